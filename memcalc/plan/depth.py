"""The step of a deep model from three shallow copies of it: exact peaks at a fraction of the cost.

A direct simulation walks every decoder layer, so it costs time in proportion to the depth
(llama-3.1-8b: 32 layers, 70b: 80, 405b: 126), and the plan asks for hundreds of them. But a
stack repeats: its layout (:func:`memcalc.core.layout.layout_of`) is a prefix of layers outside
the pattern (DeepSeek's dense first layers), whole *periods* of one or more layers (1 for a
uniform stack, 2 for Gemma-2's sliding/full alternation, 6 for Gemma-3), and a suffix (a period
cut short). Period ``u``'s allocations in forward (and in backward) request the same bytes for
every interior ``u``, on top of a running total that moves by the same amount from one period to
the next (one more period's saved activations, or gradients). So once each allocation is named
by where it sits -- its phase, its label with the layer number replaced by the layer's place (a
layer of the prefix or the suffix; else its period's place in the stack -- first, second,
second-to-last, last -- and its offset in the period), and its position inside that block --
the bytes alive before it and the bytes it requests are *affine* functions of the number of
periods ``n``. :func:`deep_trace` simulates the step with 3, 4 and 5 periods
(:data:`SHALLOW_DEPTHS`, :func:`shallow`: prefix + 3, 4, 5 periods + suffix layers; 3, 4 and 5
layers for a uniform stack; ``observers.AllocTrace``), names the allocations this way, extrapolates
both numbers to ``n`` periods in integers (``x(n) = x(3) + (n - 3) * (x(4) - x(3))``) and rounds
the request as the allocator does at depth ``n`` (a step temporary the size of all parameters, as
the foreach optimizer step makes, rounds differently at every depth). Its running total is the sum.

- The periods strictly between the second and the second-to-last are left out: their totals lie
  between those two periods' (affine in the period's index), so they never set a maximum.
- A block whose number of allocations grows with the depth (a per-parameter optimizer step) is
  split the same way into a prefix, one chunk per period and a suffix: one run of chunks, so the
  engine traces a second run apart (``SimHooks.traced_as``: the foreach step's temporaries).
- Setup (weights and optimizer state, allocated one by one, never freed) is left out: its
  highest total is its last, which the step's next allocation exceeds. What the step allocates
  at its start, before the forward (FSDP2's root unit all-gathered, with its all-gather buffer
  freed after the copy-out: not monotone), is a named block like the others.

Exactness is checked, not assumed: the three shallow steps must have the same named blocks,
each with the same number of allocations, both numbers of every allocation exactly affine over
the three depths (integers, no tolerance), and with 5 periods the three interior periods must
request the same bytes with totals exactly affine in the period's index. Anything else falls
back to the direct simulation (:func:`applies` rules out up front: sqrt and every-K
checkpointing, whose segments depend on the depth; torch.compile, whose partition is of the
whole graph; models of at most as many layers as the three copies together, :data:`MIN_DEPTH`
for a uniform stack; a model whose shallow copies' layouts are not the deep layout's prefix,
first periods and suffix, :func:`memcalc.core.layout.repeating`).

Why the layout's period is safe, and what no check can see: :mod:`memcalc.core.layout`.

Under ZeRO over N GPUs with one flat partition (DeepSpeed, the generic ZeRO model) a request that
grows with the depth is a rank's share ``ceil(S / N)`` of a sum (the foreach step's temporary),
not affine in the depth: the sum ``S`` is read from the same step's shallow traces on one GPU and
divided at depth ``n``. FSDP2 and FSDP1 shard parameter by parameter, so such a sum is affine
in the depth and extrapolates like any other request. ``tests/unit/test_depth.py`` compares
the extrapolated peaks with direct simulations.

Cost: 3 + 4 + 5 = 12 periods (and three times the prefix and suffix) simulated instead of the
model's layers; 3 + 4 = 7 for a setup whose structure (:func:`structure_key`: the same setup at
another batch, sequence or GPU count) has passed the three-depth check (:func:`deep_trace`).
``tests/unit/test_depth.py`` compares the two as well.
"""

from __future__ import annotations

import re
from itertools import repeat
from typing import Callable, Optional

import numpy as np

from memcalc.core.layout import layout_of, place, repeating
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.sharding import Share, uses_deepspeed

#: The depths simulated for one deep step (three points: two define the line, the third checks it).
SHALLOW_DEPTHS = (3, 4, 5)
#: A uniform stack of at most this many layers (as many as its copies together) is simulated directly.
MIN_DEPTH = sum(SHALLOW_DEPTHS)

#: The label of the allocations a step makes at its start, before the forward (timeline.py).
STEP_START = "step start"

_LAYER = re.compile(r"\blayer (\d+)\b")
_LAYER_RANGE = re.compile(r"\blayers \d")


def applies(exp: ExperimentSpec) -> bool:
    """Whether :func:`deep_trace` may extrapolate ``exp``'s step: eager or per-layer checkpointing
    (none, full, selective) without torch.compile, and a model whose layout repeats deep enough to
    gain (:func:`memcalc.core.layout.repeating` at :data:`SHALLOW_DEPTHS`: more layers than the
    copies together, :data:`MIN_DEPTH` for a uniform stack, and each copy's layout the deep one's
    prefix, first periods and suffix). Not with expert parallelism: its one-GPU reference (``gpus``
    1) is no setup of it (``ep`` divides ``gpus``), and its shards are of two sizes (engine.expert_fsdp)."""
    tr = exp.training
    if tr.compile or tr.ep > 1 or tr.checkpoint not in ("none", "full", "selective"):
        return False
    return repeating(exp.model, SHALLOW_DEPTHS) is not None


def shallow(exp: ExperimentSpec, units: int) -> ExperimentSpec:
    """``exp`` with a copy of its model of ``units`` whole periods (its prefix and suffix as they
    are; ``units`` layers for a uniform stack), every other field as given."""
    depth = layout_of(exp.model).depth_at(units)
    return exp.model_copy(update={"model": exp.model.model_copy(update={"n_layers": depth})})


#: (bytes alive before the allocation, bytes requested, the whole it is a share of, the number of
#: shares): a request that is a ZeRO rank's share ``ceil(whole / shares)`` (an
#: :class:`memcalc.engine.sharding.Share`, e.g. a foreach optimizer step over sharded state) is
#: extrapolated through its whole, which is affine in the depth; any other has whole = request,
#: shares = 1.
Event = tuple[int, int, int, int]


def _blocks(trace: list[tuple[int, str, str, int]], depth: int, round_bytes: int,
            cut: tuple[int, int] = (0, 1)) -> Optional[tuple[dict, dict, np.ndarray]]:
    """Group a shallow step's allocations by named block (see the module docstring). ``depth``
    counts the periods of the copy, ``cut`` is its layout's (prefix, period) (``layout.place``).

    Returns (blocks, interior, setup): blocks maps (phase, label template, place) to the
    allocations in order, an int64 array (allocations, 4) of :data:`Event` rows (place: "first",
    "second", "penultimate", "last", or "" outside the layers; depth 3's middle period is both
    "second" and "penultimate"; a layer of the prefix or the suffix is a place of its own);
    interior maps (phase, template, offset in the period) to {period: allocations} for the
    periods strictly inside the stack; setup holds the setup phase's running totals. None:
    labels this method does not understand (a checkpointed segment of several layers).

    Each (phase, label) pair is one block (a label names one layer, or none), so the events are
    grouped by that pair with one stable sort; only the distinct labels are parsed."""
    empty = np.empty((0, 4), dtype=np.int64)
    if not trace:
        return {}, {}, empty[:, 0]
    tot, phs, labs, reqs = zip(*trace)
    pair_id: dict[tuple[str, str], int] = {}
    gid = np.fromiter([pair_id.setdefault(k, len(pair_id)) for k in zip(phs, labs)], dtype=np.int64, count=len(trace))
    req = np.fromiter(reqs, dtype=np.int64, count=len(trace))
    whole, parts = req, np.ones_like(req)
    shared = np.flatnonzero(np.fromiter(map(isinstance, reqs, repeat(Share)), dtype=bool, count=len(trace)))
    if len(shared):
        whole, parts = req.copy(), parts.copy()
        whole[shared] = [reqs[i].whole for i in shared]
        parts[shared] = [reqs[i].parts for i in shared]
    total = np.fromiter(tot, dtype=np.int64, count=len(trace))
    before = total - -(-req // round_bytes) * round_bytes  # the request rounded as Sim.alloc does
    ev = np.stack([before, req, whole, parts], axis=1)
    setup_mask = np.zeros(len(pair_id), dtype=bool)
    order = np.argsort(gid, kind="stable")
    cuts = np.searchsorted(gid[order], np.arange(1, len(pair_id)))
    rows = np.split(ev[order], cuts)
    blocks: dict[tuple[str, str, str], np.ndarray] = {}
    interior: dict[tuple[str, str, str], dict[int, np.ndarray]] = {}
    for (phase, label), g in pair_id.items():
        if phase == "setup" and label != STEP_START:
            setup_mask[g] = True
            continue
        got = _parse(label)
        if got is None:
            return None
        layer, tmpl = got
        if layer is None:
            blocks[(phase, label, "")] = rows[g]
            continue
        unit, offset = place(layer, depth, cut)
        if unit is None:
            blocks[(phase, tmpl, offset)] = rows[g]
        elif unit == 0:
            blocks[(phase, tmpl, "first" + offset)] = rows[g]
        elif unit == depth - 1:
            blocks[(phase, tmpl, "last" + offset)] = rows[g]
        else:
            interior.setdefault((phase, tmpl, offset), {})[unit] = rows[g]
            if unit == 1:
                blocks[(phase, tmpl, "second" + offset)] = rows[g]
            if unit == depth - 2:
                blocks[(phase, tmpl, "penultimate" + offset)] = rows[g]
    return blocks, interior, total[setup_mask[gid]]


#: Parsed labels, shared by every trace (labels repeat across steps and setups).
_PARSED: dict[str, Optional[tuple[Optional[int], str]]] = {}


def _parse(label: str) -> Optional[tuple[Optional[int], str]]:
    """:func:`_parse_label`, cached."""
    got = _PARSED.get(label, _UNSEEN)
    if got is _UNSEEN:
        if len(_PARSED) > 100_000:
            _PARSED.clear()
        got = _PARSED[label] = _parse_label(label)
    return got


_UNSEEN = object()
_NO_EVENTS = np.empty((0, 4), dtype=np.int64)


def _parse_label(label: str) -> Optional[tuple[Optional[int], str]]:
    """An allocation label as :func:`_blocks` names it: (None, label) outside the layers, (layer,
    the label with the layer number replaced by ``{}``) inside one, or None for a label it does not
    understand (a segment of several layers)."""
    if _LAYER_RANGE.search(label):
        return None
    found = _LAYER.findall(label)
    if not found:
        return None, label
    if len(found) > 1:
        return None
    mt = _LAYER.search(label)
    assert mt is not None
    return int(found[0]), label[:mt.start(1)] + "{}" + label[mt.end(1):]


def _uniform(chunks: list[list[Event]]) -> bool:
    """Interior chunks (layers 1 .. depth-2): the same requested sizes, and what is alive before
    each allocation exactly affine in the chunk index (checked where there are three)."""
    if not chunks:
        return True
    if len({len(c) for c in chunks}) != 1:
        return False
    a = np.array(chunks, dtype=np.int64)  # (chunks, events, 4)
    if np.any(a[:, :, 1] != a[0, :, 1]):
        return False
    return not (len(a) >= 3 and np.any(np.diff(a[:, :, 0], n=2, axis=0) != 0))


def _places(chunks: list[list[Event]], depth: int) -> dict[str, list[Event]]:
    """The chunks of a stack by place: first, second, penultimate, last."""
    return {"first": chunks[0], "second": chunks[1], "penultimate": chunks[depth - 2], "last": chunks[depth - 1]}


def _split_grown(rows: list[list[Event]], depths: tuple[int, ...]) -> Optional[list[list[list[Event]]]]:
    """A block whose length grows with the depth (one chunk of events per layer: the per-parameter
    steps of an optimizer): split it into prefix, first/second/penultimate/last chunk and suffix at
    every depth, or None. Returns, per part, the events at each depth."""
    lens = [len(r) for r in rows]
    k = lens[1] - lens[0]
    if k <= 0 or any(lens[i + 1] - lens[i] != k * (depths[i + 1] - depths[i]) for i in range(len(lens) - 1)):
        return None
    c = lens[0] - k * depths[0]
    if c < 0:
        return None
    for c1 in range(c + 1):
        parts: list[list[list[Event]]] = [[] for _ in range(6)]
        ok = True
        for r, d in zip(rows, depths):
            chunks = [r[c1 + j * k: c1 + (j + 1) * k] for j in range(d)]
            if not _uniform(chunks[1:d - 1]):
                ok = False
                break
            pl = _places(chunks, d)
            for i, part in enumerate([r[:c1], pl["first"], pl["second"], pl["penultimate"], pl["last"], r[c1 + d * k:]]):
                parts[i].append(part)
        if ok and all(_affine(p) is not None for p in parts):
            return parts
    return None


def _parts(rows: list[list[Event]], depths: tuple[int, ...]) -> Optional[list[list[list[Event]]]]:
    """A named block's events at each depth as its parts: the block itself where it has as many
    events at every depth, else :func:`_split_grown`'s parts (None if it cannot split it)."""
    return [rows] if len({len(r) for r in rows}) == 1 else _split_grown(rows, depths)


def _affine(rows: list[list[Event]], requests: bool = True) -> Optional[np.ndarray]:
    """Events of one named block at consecutive depths (equal lengths) as an array (depths, events,
    4) of :data:`Event` rows, when the bytes alive before each, its share count and (for a share)
    its whole are exactly affine in the depth, and so is the request itself unless ``requests`` is
    false (then the caller checks it): :func:`_not_affine`."""
    if len({len(r) for r in rows}) != 1:
        return None
    a = np.array(rows, dtype=np.int64).reshape(len(rows), -1, 4)
    return None if _not_affine(a, requests) else a


def _not_affine(a: np.ndarray, requests: bool) -> bool:
    """Whether any event of ``a`` (depths, events, 4) breaks :func:`_affine`'s rules: the bytes
    alive before it, its share count and (for a share, or with ``requests``) its whole exactly
    affine in the depth. Elementwise, so one call checks many blocks laid end to end. (The request
    itself need not be affine: a share's whole is, or, without ``requests``, the caller checks it.)"""
    bad = np.diff(a, axis=0)
    bad = bad != bad[:1]  # (depths - 1, events, 4): not affine
    check_whole = (a[0, :, 3] > 1) | requests
    return bool(np.any(bad[..., 0]) or np.any(bad[..., 3]) or np.any(bad[..., 2] & check_whole))


def _interior_alike(interior: dict[tuple[str, str, str], dict[int, np.ndarray]], depth: int) -> bool:
    """:func:`_uniform` for every interior template of a ``depth``-layer step at once (their layers
    laid end to end, the checks being elementwise): each has the
    layers 1 .. depth-2 with as many allocations, requesting the same bytes, with the bytes alive
    before each exactly affine in the layer index (where there are three)."""
    layers = list(range(1, depth - 1))
    for by_layer in interior.values():
        if sorted(by_layer) != layers or len({len(by_layer[i]) for i in layers}) != 1:
            return False
    if len(layers) < 2 or not interior:  # (one interior layer is alike with itself)
        return True
    return _uniform([np.concatenate([by_layer[i] for by_layer in interior.values()]) for i in layers])


def extrapolate(traces: list[list[tuple[int, str, str, int]]], depths: tuple[int, ...], n: int,
                round_bytes: int, shards: int = 1,
                unsharded: Optional[Callable[[], Optional[list[list[tuple[int, str, str, int]]]]]] = None,
                cut: tuple[int, int] = (0, 1)) -> Optional[tuple[np.ndarray, tuple[str, ...]]]:
    """The named running totals of the ``n``-period step from the shallow steps' traces (one per
    depth in ``depths``, consecutive), or None where the checks fail. Depths count whole periods of
    the model's layout, cut as ``cut`` = (prefix, period) (layers, for a uniform stack: (0, 1)).
    Returns the totals (int64, in a fixed order of the named blocks) and the phase of each. Each allocation's bytes alive
    before it and bytes requested are extrapolated; the request is rounded at depth ``n``
    (a step temporary the size of all parameters rounds differently at every depth). Under ZeRO
    over ``shards`` GPUs a request that changes with the depth is this rank's share of a sum,
    ``ceil(S / shards)``, which is not affine in the depth: ``unsharded()`` gives the same step's
    traces on one GPU, whose request is ``S`` itself (checked against the shares at every
    shallow depth); without it such a step is refused (None).

    The named blocks are laid end to end (a block whose length grows with the depth split into
    its parts first), so the checks and the extrapolation are a few array operations over every
    allocation at once; only blocks with a request that varies under ZeRO are looked at one by one."""
    blocks = _checked_blocks(traces, depths, round_bytes, cut)
    laid = None if blocks is None else _end_to_end(blocks, depths)
    if laid is None:
        return None
    segs, a, phases = laid
    # under ZeRO a request may be a rank's share ceil(S / N) of a sum S affine in the depth: not
    # affine itself, so only the bytes alive before are required affine here
    if _not_affine(a, requests=shards == 1):
        return None
    at_n = a[0] + (n - depths[0]) * (a[1] - a[0])  # (events, 4)
    shares = a[0, :, 3]
    req = np.where(shares > 1, -(-at_n[:, 2] // np.maximum(shares, 1)), at_n[:, 1])
    vary = (a[1, :, 1] != a[0, :, 1]) & (shares == 1)
    if shards > 1 and vary.any() and not _shared_requests(a, segs, vary, req, n, depths, shards, round_bytes,
                                                          unsharded, cut):
        return None
    return at_n[:, 0] + -(-req // round_bytes) * round_bytes, tuple(phases)


def _checked_blocks(traces: list[list[tuple[int, str, str, int]]], depths: tuple[int, ...],
                    round_bytes: int, cut: tuple[int, int] = (0, 1)) -> Optional[list[dict]]:
    """The named blocks of each shallow step (consecutive depths), or None where a check fails: a
    trace that does not parse, a setup that frees, interior periods that are not alike, or steps
    with different blocks."""
    if any(depths[i + 1] - depths[i] != 1 for i in range(len(depths) - 1)):
        return None
    parsed = [_blocks(tr, d, round_bytes, cut) for tr, d in zip(traces, depths)]
    if any(p is None for p in parsed):
        return None
    for (_, interior, setup), d in zip(parsed, depths):  # type: ignore[misc]
        # setup only allocates (weights, state): its highest total is its last, which the
        # step's first allocation exceeds, so it never sets a maximum
        if np.any(np.diff(setup) < 0) or not _interior_alike(interior, d):
            return None
    blocks = [p[0] for p in parsed]  # type: ignore[index]
    keys = set(blocks[-1])
    return None if any(set(b) != keys for b in blocks) else blocks


#: a block's part laid end to end: (key, part, parts of the key, start, end)
_Segment = tuple[tuple[str, str, str], int, int, int, int]


def _end_to_end(blocks: list[dict], depths: tuple[int, ...]
                ) -> Optional[tuple[list[_Segment], np.ndarray, list[str]]]:
    """The blocks as segments end to end (a block whose length grows with the depth split into its
    parts), their rows at every depth as one (depths, events, 4) array, and each row's phase; None
    where a block does not split or there is nothing."""
    segs: list[_Segment] = []
    rows_at: list[list[np.ndarray]] = [[] for _ in depths]
    phases: list[str] = []
    at = 0
    for k in blocks[-1]:
        parts = _parts([b[k] for b in blocks], depths)
        if parts is None:
            return None
        for i, part in enumerate(parts):
            m = len(part[0])
            if m:
                segs.append((k, i, len(parts), at, at + m))
                for j, r in enumerate(part):
                    rows_at[j].append(np.asarray(r, dtype=np.int64).reshape(-1, 4))
                phases.extend(repeat(k[0], m))
                at += m
    if not segs:
        return None
    return segs, np.stack([np.concatenate(r) for r in rows_at]), phases


def _shared_requests(a: np.ndarray, segs: list[_Segment], vary: np.ndarray, req: np.ndarray, n: int,
                     depths: tuple[int, ...], shards: int, round_bytes: int,
                     unsharded: Optional[Callable[[], Optional[list[list[tuple[int, str, str, int]]]]]],
                     cut: tuple[int, int] = (0, 1)) -> bool:
    """Under ZeRO over ``shards`` GPUs, each request that varies with the depth (``vary``) is either
    ceil(S / N) of the one-GPU step's request S (a flat partition's share, a foreach step over the
    shards: S is extrapolated, then divided at depth n, into ``req``) or, failing that, exactly
    affine itself (per-parameter shards summed: FSDP's padded rows). False where one is neither
    (the step is refused)."""
    affine_req = np.all(np.diff(a[:, :, 1], n=2, axis=0) == 0, axis=0) if len(a) >= 3 else np.ones_like(vary)
    share = np.zeros_like(vary)
    one_gpu: list = []  # the unsharded traces' blocks, parsed once when first needed
    for k, i, parts_n, lo, hi in segs:
        if unsharded is None or not vary[lo:hi].any():
            continue
        u = _one_gpu_requests(one_gpu, unsharded, depths, round_bytes, k, i, parts_n, (len(a), hi - lo, 4), cut)
        if u is None:
            continue
        share[lo:hi] = np.all(-(-u[:, :, 1] // shards) == a[:, lo:hi, 1], axis=0)
        total = u[0, :, 1] + (n - depths[0]) * (u[1, :, 1] - u[0, :, 1])
        req[lo:hi] = np.where(vary[lo:hi] & share[lo:hi], -(-total // shards), req[lo:hi])
    return not np.any(vary & ~share & ~affine_req)


def _one_gpu_requests(cache: list, unsharded: Callable[[], Optional[list[list[tuple[int, str, str, int]]]]],
                      depths: tuple[int, ...], round_bytes: int, k: tuple[str, str, str], i: int, parts_n: int,
                      shape: tuple[int, ...], cut: tuple[int, int] = (0, 1)) -> Optional[np.ndarray]:
    """Block ``k``'s part ``i`` (of ``parts_n``) in the one-GPU step's traces (``unsharded()``,
    parsed once into ``cache``): the same shape, every number exactly affine, or None."""
    if not cache:
        ts = unsharded()
        got = None if ts is None else [_blocks(t, d, round_bytes, cut) for t, d in zip(ts, depths)]
        cache.append(None if got is None or any(g is None for g in got) else [g[0] for g in got])
    if cache[0] is None:
        return None
    parts = _parts([b.get(k, _NO_EVENTS) for b in cache[0]], depths)
    if parts is None or len(parts) != parts_n:
        return None
    u = _affine(parts[i])
    return u if u is not None and u.shape == shape else None


def structure_key(exp: ExperimentSpec, first_step: bool) -> tuple:
    """What a step's named blocks depend on: the setup with its batch, sequence and GPU count left
    out (one GPU apart from several: a single GPU gathers nothing). Every layer of a uniform stack
    allocates the same blocks whatever the sizes and the degree; only their bytes change."""
    tr = exp.training
    return (exp.model, tr.model_copy(update={"batch": 1, "seq": 1, "gpus": min(tr.gpus, 2)}), exp.profile, first_step)


#: Structures (:func:`structure_key`) whose step has passed the three-depth check: their other
#: sizes and GPU counts take the two-depth extrapolation (:data:`CHECKED_DEPTHS`). A plan's worker
#: processes send what they add back to the parent (``memcalc.plan.parallel``).
CHECKED: dict[tuple, bool] = {}
#: The depths simulated for a step whose structure has been checked at :data:`SHALLOW_DEPTHS`.
CHECKED_DEPTHS = SHALLOW_DEPTHS[:2]


def deep_trace(exp: ExperimentSpec, first_step: bool,
               depths: Optional[tuple[int, ...]] = None) -> Optional[tuple[np.ndarray, tuple[str, ...]]]:
    """The running totals (named, see the module docstring) of ``exp``'s steady-state step (or
    its first step) from copies of :data:`SHALLOW_DEPTHS` periods, or None where :func:`applies` says no
    or the checks fail (then simulate directly). Their maximum is the direct simulation's peak.

    A step whose structure (:func:`structure_key`: the same setup at another batch, sequence or
    GPU count) has passed the three-depth check takes two depths, :data:`CHECKED_DEPTHS`: the line
    through them is the one the third point confirmed for its structure, and the checks that two
    depths allow still run (the same named blocks, the interior layers alike). Not under DeepSpeed,
    whose buckets are cut by bytes (a bucket boundary may fall elsewhere at another size): always
    three depths there. ``depths`` forces the depths (``tests/unit/test_depth.py`` compares the two)."""
    if not applies(exp):
        return None
    from memcalc.plan.steps import traced_step

    key = None if uses_deepspeed(exp) else structure_key(exp, first_step)
    if depths is None:
        depths = CHECKED_DEPTHS if key in CHECKED else SHALLOW_DEPTHS
    traces = [traced_step(shallow(exp, d), first_step).alloc_trace or [] for d in depths]
    tr = exp.training
    # a request that grows with the depth under ZeRO is a rank's share ceil(S / N) of a sum (a flat
    # partition, the foreach step's temporary), not affine in the depth: it takes the one-GPU
    # traces' S; FSDP's per-parameter shards summed are affine and extrapolate as they are
    shards = tr.gpus if tr.zero >= 1 else 1
    lay = layout_of(exp.model)
    got = extrapolate(traces, depths, lay.units, exp.profile.allocator_round_bytes, shards,
                      unsharded=lambda: _one_gpu_traces(exp.model_copy(update={"training": tr.model_copy(
                          update={"gpus": 1})}), first_step, depths), cut=(lay.prefix, lay.period))
    if got is not None and key is not None and len(depths) == len(SHALLOW_DEPTHS):
        if len(CHECKED) > 100_000:
            CHECKED.clear()
        CHECKED[key] = True
    return got


#: The one-GPU shallow traces by (setup on one GPU, first step, depths) (:func:`_one_gpu_traces`),
#: shared by every ZeRO degree of the setup; a plan's workers send theirs back to the parent
#: (``memcalc.plan.parallel``), so that the next stage's workers start with them.
ONE_GPU_TRACES: dict[tuple[ExperimentSpec, bool, tuple[int, ...]], Optional[list]] = {}
ONE_GPU_TRACES_SIZE = 64  #: at most this many are kept


def _one_gpu_traces(exp: ExperimentSpec, first_step: bool,
                    depths: tuple[int, ...] = SHALLOW_DEPTHS) -> Optional[list[list[tuple[int, str, str, int]]]]:
    """The shallow traces of ``exp`` (on one GPU), shared by every ZeRO degree of the same setup
    (cached in :data:`ONE_GPU_TRACES`)."""
    key = (exp, first_step, depths)
    if key in ONE_GPU_TRACES:
        return ONE_GPU_TRACES[key]
    full = ONE_GPU_TRACES.get((exp, first_step, SHALLOW_DEPTHS), ())
    if full != () and depths == SHALLOW_DEPTHS[:len(depths)]:  # the first of the three depths
        return None if full is None else full[:len(depths)]
    got = None
    if applies(exp):
        from memcalc.plan.steps import traced_step

        got = [traced_step(shallow(exp, d), first_step).alloc_trace or [] for d in depths]
    if len(ONE_GPU_TRACES) >= ONE_GPU_TRACES_SIZE:
        ONE_GPU_TRACES.clear()
    ONE_GPU_TRACES[key] = got
    return got
