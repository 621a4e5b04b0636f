"""Reading a PyTorch memory snapshot the user names, safely: a pickle that can hold data only.

``torch.cuda.memory._dump_snapshot`` writes ``pickle.dump(torch.cuda.memory._snapshot(), f)``
(torch 2.13 ``torch/cuda/memory.py``): a dict of lists, dicts, strings, ints, floats, bools,
None (and tuples: ``segment_pool_id``). A plain ``pickle.load`` of a file from elsewhere runs any
callable the file names (``GLOBAL`` / ``STACK_GLOBAL`` / ``REDUCE``), so the file is read with
:class:`DataOnlyUnpickler`, whose ``find_class`` refuses every global: without a class or a
function no ``REDUCE`` / ``BUILD`` / ``NEWOBJ`` / ``INST`` / ``OBJ`` opcode can call anything, and the
extension registry (``EXT1/2/4``) goes through ``find_class`` too (CPython ``Lib/pickle.py``
``get_extension``; ``Modules/_pickle.c`` calls the method likewise). Persistent ids and
out-of-band buffers raise on their own (no ``persistent_load``, ``buffers=None``). Anything else
wrong is one :class:`~memcalc.core.errors.UserError` line.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from memcalc.core.errors import UserError
from memcalc.core.files import read_bounded

#: the largest snapshot file read (bytes). PyTorch's own note: "Snapshot file sizes scale with
#: max_entries and stack trace depth per entry, with several KB per entry" (``_dump_snapshot``'s
#: docstring), so the default 100,000-entry history with Python + C++ stacks is a few hundred MiB.
MAX_SNAPSHOT_BYTES = 2**30
#: the most trace entries read per device (``_record_memory_history``'s ``max_entries`` default is
#: sys.maxsize; 10M entries is far beyond what a file under MAX_SNAPSHOT_BYTES holds with frames)
MAX_ENTRIES = 10_000_000


class DataOnlyUnpickler(pickle.Unpickler):
    """An unpickler that builds only the built-in containers and scalars pickle encodes without a
    global: every ``find_class`` (a class, a function, ``copyreg`` extension) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module[:60]}.{name[:60]}")


def unpickle_data(data: bytes) -> Any:
    """``data`` unpickled with :class:`DataOnlyUnpickler` (errors as pickle raises them)."""
    return DataOnlyUnpickler(io.BytesIO(data)).load()


def read_snapshot(path: str | Path) -> dict[str, Any]:
    """The snapshot dict in ``path`` (``_dump_snapshot``'s pickle), read with
    :func:`unpickle_data` and checked for ``segments`` and ``device_traces`` lists; a missing,
    oversized (:func:`memcalc.core.files.read_bounded`: a FIFO or device is refused unread), refused or
    malformed file is one :class:`UserError` line."""
    shown = str(path)[:200]
    data = read_bounded(path, "snapshot", MAX_SNAPSHOT_BYTES, "record fewer entries "
                        "(torch.cuda.memory._record_memory_history(max_entries=...))")
    try:
        snap = unpickle_data(data)
    except pickle.UnpicklingError as e:
        why = str(e).splitlines()[0][:150] if str(e) else "malformed pickle"
        raise UserError(f"snapshot {shown!r} is not a PyTorch memory snapshot pickle ({why}); memcalc reads "
                        "only dicts, lists, strings and numbers from it, never code") from None
    except Exception as e:  # EOFError, ValueError, MemoryError, RecursionError...: a damaged file
        raise UserError(f"snapshot {shown!r} is not a PyTorch memory snapshot pickle ({type(e).__name__})") from None
    return check_snapshot(snap, shown)


def check_snapshot(snap: Any, shown: str) -> dict[str, Any]:
    """``snap`` if it has the shape ``torch.cuda.memory._snapshot()`` documents (``segments``: a
    list of dicts; ``device_traces``: a list of lists of dicts), else one UserError line."""
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list) \
            or not isinstance(snap.get("device_traces"), list):
        raise UserError(f"snapshot {shown!r} is not a PyTorch memory snapshot (no 'segments' and 'device_traces' "
                        "lists; write one with torch.cuda.memory._dump_snapshot)")
    if not all(isinstance(s, dict) for s in snap["segments"]):
        raise UserError(f"snapshot {shown!r}: a segment is not a dict")
    for i, trace in enumerate(snap["device_traces"]):
        if not isinstance(trace, list) or not all(isinstance(e, dict) for e in trace):
            raise UserError(f"snapshot {shown!r}: device_traces[{i}] is not a list of entries")
        if len(trace) > MAX_ENTRIES:
            raise UserError(f"snapshot {shown!r}: device {i} has more than {MAX_ENTRIES:,} trace entries")
    return snap


__all__ = ["MAX_ENTRIES", "MAX_SNAPSHOT_BYTES", "DataOnlyUnpickler", "check_snapshot", "read_snapshot",
           "unpickle_data"]
