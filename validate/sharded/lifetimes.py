"""Lifetimes read from a trace's timeline: which storage lived from when to when.

``lifetimes(trace, min_bytes=0)`` takes :func:`~.runner.trace_rank`'s dict (made with
``timeline=True``, or a ``/work/fsdp-traces`` file's ``trace``) and returns one row per storage
seen in the measured step: ``id``, ``op`` (what made it: an aten op, or ``UntypedStorage.resize_``
for FSDP's unsharded parameters, which live in storages made in step 1 and regrown each step),
``bytes`` (its largest size), ``born`` / ``died`` (the timeline labels, ``phase layer [fsdp scope]``;
``died`` is None for what outlives the step: shards, optimizer state) and ``born_at`` / ``died_at``
(event indices), sorted by birth. A resized storage gives one row per grow-to-shrink span.
"""

from __future__ import annotations

from typing import Optional


def lifetimes(trace: dict, min_bytes: int = 0) -> list[dict]:
    """One row per storage span of the measured step (see the module docstring)."""
    events, ids, ops = trace["timeline"], trace["timeline_ids"], trace["timeline_ops"]
    open_: dict[int, dict] = {}
    rows: list[dict] = []

    def close(sid: int, k: int, label: str) -> None:
        row = open_.pop(sid)
        row["died"], row["died_at"] = label, k
        rows.append(row)

    for k, ((kind, label, nbytes, _live), sid, op) in enumerate(zip(events, ids, ops)):
        if kind == "alloc":
            open_[sid] = {"id": sid, "op": op, "bytes": nbytes, "born": label, "born_at": k}
        elif kind == "resize":
            row: Optional[dict] = open_.get(sid)
            if nbytes > 0:
                if row is None:
                    open_[sid] = {"id": sid, "op": op, "bytes": nbytes, "born": label, "born_at": k}
                else:
                    row["bytes"] += nbytes
            elif row is not None:
                if row["bytes"] + nbytes <= 0:
                    close(sid, k, label)
                else:
                    row["bytes"] += nbytes
        elif kind == "free" and sid in open_:
            close(sid, k, label)
    for row in open_.values():
        row["died"], row["died_at"] = None, None
        rows.append(row)
    rows = [r for r in rows if r["bytes"] >= min_bytes]
    rows.sort(key=lambda r: r["born_at"])
    return rows
