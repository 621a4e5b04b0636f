"""The compiled region's forward as a graph of values, recorded from the decoder walk.

Under ``model.compile()`` the model's forward (embedding, layers, final norm, head) is one
graph that AOTAutograd traces jointly with its backward. This module records that forward
op by op from the same code the eager estimate runs (:class:`memcalc.engine.forward.Forward`,
through the simulator's ``recorder`` hook): each op's output is a value, the tensors each
op's backward formula reads (what the eager kernel saves) mark the values backward needs,
and matmul and attention inputs are read by non-fusible backward kernels. The partitioner
(:mod:`memcalc.compile.partitioner`) then chooses what to save.
"""

from __future__ import annotations

from typing import Optional

from memcalc.compile.partitioner import Graph, Value
from memcalc.core.layout import Layout, copies_hold, layout_of
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.forward import Forward
from memcalc.engine.sim import Param, Sim, T
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.weights import make_params

#: forward ops outside the recomputable allowlist that are compute-intensive (matmuls, attention)
COMPUTE = {"linear", "matmul_qk", "matmul_pv", "sdpa_flash", "sdpa_efficient"}
#: outside the allowlist but cheap (banned by the default cut, recomputable when aggressive)
OTHER = {"embedding"}
RANDOM = {"dropout"}
#: the loss after the recorded region (memcalc.engine.blocks.head.lm_loss, or compiled_loss.compiled_cross_entropy)
LOSS = {"shift_slice", "loss_split", "log_softmax", "nll_loss", "compiled_cross_entropy"}
#: op name -> kind (anything else is pointwise)
_KIND = {**{n: "compute" for n in COMPUTE}, **{n: "other" for n in OTHER}, **{n: "random" for n in RANDOM}}


class _Recorder:
    """Builds partitioner values from the ops the forward code issues."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.values: list[Value] = []
        self.of: dict[int, Value] = {}  # id(T) -> current value
        self.alive: list[T] = []  # every tensor seen, so that no id(T) is reused by a new one
        self.done = False

    def value(self, t: T, name: str, kind: str, args: list[Value], flops: int = 0, param: bool = False) -> Value:
        v = Value(name, t.nbytes, kind, args, flops=flops, param=param, layer=self.sim.layer)
        self.values.append(v)
        self.of[id(t)] = v
        self.alive.append(t)
        return v


    def get(self, t: T, name: str) -> Value:
        v = self.of.get(id(t))
        if v is None:  # a graph input (the batch) or a constant built without an op
            v = self.value(t, name, "input" if t.category == "inputs" else "pointwise", [])
        return v

    def __call__(self, name: str, saved: list[T], inputs: list[T], params: list[Param], outputs: list[T], kw: dict) -> None:
        if self.done or name in LOSS:
            self.done = True
            return
        kind = _KIND.get(name, "pointwise")
        of = self.of
        args = []
        for t in inputs:
            v = of.get(id(t))
            args.append(v if v is not None else self.get(t, "input"))
        pvals = []
        for p in params:
            pv = of.get(id(p.weight))
            if pv is None:
                pv = self.value(p.weight, p.name, "input", [], param=True)
            pvals.append(pv)
        inputs_grad = any(t.requires_grad for t in inputs)
        needs_grad = inputs_grad or any(p.trainable for p in params)
        outs = [self.value(o, name, kind, args + pvals, flops=kw.get("flops", 0) if i == 0 else 0)
                for i, o in enumerate(outputs)]
        main = outs[0] if outs else None
        if not needs_grad:
            return
        copies = set()
        for t in saved:
            v = of.get(id(t))
            if v is None:  # a tensor the op made besides its output (logsumexp, rstd, a mask)
                v = self.value(t, name + " (aux)", "pointwise", [main] if main is not None else args)
                v.extern_aux = kind in ("compute", "other")
            v.bw_read = True
            if kind == "compute":
                v.bw_materialized = True  # read by a matmul / attention backward kernel
            if v.name == "to_copy" and v.args:
                copies.add(v.args[0])
        if inputs_grad:
            for pv in pvals:
                # grad_input = g W reads the weight, or (autocast) the saved low-precision copy of it
                if pv not in copies:
                    pv.bw_read = True


class _Recording(LayerStrategy):
    """Eager layers, noting each layer's output value (what the next layer reads)."""

    def __init__(self, rec: _Recorder, outputs: dict[int, Value]) -> None:
        self.rec = rec
        self.outputs = outputs

    def run(self, fwd: Forward, x: T, lo: int, hi: int) -> T:
        y = super().run(fwd, x, lo, hi)
        self.outputs[hi - 1] = self.rec.get(y, "layer output")
        return y


#: The periods of the layout recorded for a deep stack (:func:`_built_deep`): periods 0 and 1,
#: periods 2 and 3 (the second must repeat the first exactly: the rule the deep graph is built by)
#: and the last, with the layout's prefix and suffix layers; five layers for a uniform stack.
SHALLOW_GRAPH_DEPTH = 5
#: Stacks of more layers than this are recorded at SHALLOW_GRAPH_DEPTH periods and built out
#: (and only where that records fewer layers than the stack has).
MIN_BUILT_DEPTH = 8


def record_graph(exp: ExperimentSpec) -> tuple[Graph, dict[int, Value]]:
    """The compiled region's forward as a partitioner graph, and each layer's output value.

    A deep stack is recorded with :data:`SHALLOW_GRAPH_DEPTH` periods of its layout
    (:func:`memcalc.core.layout.layout_of`: prefix, periods, suffix) and built out to its depth
    (:func:`_built_deep`: the same values, sizes and edges as the recording of every layer, at a
    sixth of the cost for 32 layers); anything the checks there do not accept is recorded whole.
    The shallow copy's own layout must be the deep one's prefix, first periods and suffix, and
    its period 3 must read period 2 exactly as period 2 reads period 1: layers that differ in a
    way the layout does not name, within the copy, fail that check."""
    m = exp.model
    lay = layout_of(m)
    depth = lay.depth_at(SHALLOW_GRAPH_DEPTH)
    if m.n_layers > MIN_BUILT_DEPTH and depth < m.n_layers and copies_hold(m, (SHALLOW_GRAPH_DEPTH,)):
        short = m.model_copy(update={"n_layers": depth})
        got = _built_deep(*_record(exp.model_copy(update={"model": short})), lay)
        if got is not None:
            return got
    return _record(exp)


def _blocks_of(values: list[Value], depth: int) -> Optional[tuple[list[Value], list[list[Value]], list[Value]]]:
    """(the values before the layers, each layer's values, the values after), or None where a layer's
    values are not contiguous in the recording."""
    layer_of = [v.layer for v in values]
    inside = [i for i, lay in enumerate(layer_of) if lay is not None]
    if not inside:
        return None
    lo, hi = inside[0], inside[-1] + 1
    blocks: list[list[Value]] = [[] for _ in range(depth)]
    expect = 0
    for v in values[lo:hi]:
        if v.layer is None or not 0 <= v.layer < depth:
            return None
        if v.layer != expect:
            if v.layer != expect + 1 or not blocks[expect]:
                return None
            expect += 1
        blocks[v.layer].append(v)
    if expect != depth - 1 or any(v.layer is not None for v in values[:lo] + values[hi:]):
        return None
    return values[:lo], blocks, values[hi:]


def _rel(block: list[Value], prev: list[Value], first: int) -> list[tuple]:
    """A period's values (its layers' laid end to end, the first being layer ``first``) relative to
    its place: each one's fields (its name with the layer number as ``{offset in the period}``) and
    its inputs as (own, index), (previous period, index) or (elsewhere, the value)."""
    own = {id(v): i for i, v in enumerate(block)}
    before = {id(v): i for i, v in enumerate(prev)}
    out = []
    for v in block:
        args = tuple(("own", own[id(a)]) if id(a) in own else ("prev", before[id(a)]) if id(a) in before
                     else ("abs", id(a)) for a in v.args)
        name = v.name.replace(f"layers.{v.layer}.", f"layers.{{{v.layer - first}}}.")  # type: ignore[operator]
        out.append((name, v.nbytes, v.kind, v.flops, v.bw_read, v.bw_materialized,
                    v.param, v.extern_aux, v.layer - first, args))  # type: ignore[operator]
    return out


def _clone(template: list[Value], t_prev: list[Value], prev: list[Value], shift: int) -> list[Value]:
    """Values ``template`` (reading ``t_prev``) moved ``shift`` layers deeper, reading ``prev`` (laid
    out as ``t_prev``): new values, inputs mapped by position; inputs outside the two (the
    embedding's output, tables made once) are shared. A value outside the layers stays so."""
    own = {id(v): i for i, v in enumerate(template)}
    before = {id(v): i for i, v in enumerate(t_prev)}
    out: list[Value] = []
    for v in template:
        args = [out[own[id(a)]] if id(a) in own else prev[before[id(a)]] if id(a) in before else a for a in v.args]
        layer, name = v.layer, v.name
        if layer is not None:
            name = name.replace(f"layers.{layer}.", f"layers.{layer + shift}.")
            layer += shift
        out.append(Value(name, v.nbytes, v.kind, args, flops=v.flops, bw_read=v.bw_read,
                         bw_materialized=v.bw_materialized, param=v.param, layer=layer, extern_aux=v.extern_aux))
    return out


def _built_deep(g: Graph, outputs: dict[int, Value], lay: Layout) -> Optional[tuple[Graph, dict[int, Value]]]:
    """The graph of the stack laid out as ``lay`` from its recording ``g`` with
    :data:`SHALLOW_GRAPH_DEPTH` periods: the prefix and periods 0-2 as recorded, periods 3 .. n-2
    copies of period 3, the last period, the suffix layers and what follows them (final norm,
    head) as recorded, each copy reading the one before it. Checked first: period 3 reads period 2
    exactly as period 2 reads period 1 (the same values, sizes, flags and inputs by position), and
    nothing after the periods reads a layer of periods 1-3. None otherwise."""
    k, p, pre_n = SHALLOW_GRAPH_DEPTH, lay.period, lay.prefix
    parts = _blocks_of(g.values, lay.depth_at(k))
    if parts is None:
        return None
    pre, blocks, post = parts
    # each period's values, layers laid end to end
    units = [[v for b in blocks[pre_n + u * p: pre_n + (u + 1) * p] for v in b] for u in range(k)]
    first = [pre_n + u * p for u in range(k)]
    if _rel(units[2], units[1], first[2]) != _rel(units[3], units[2], first[3]):
        return None
    tail_in = [v for b in blocks[pre_n + k * p:] for v in b] + post  # the suffix layers, then the head
    inner = {id(v) for u in units[1:-1] for v in u}
    if any(id(a) in inner for v in tail_in for a in v.args):
        return None
    where = {id(v): (lay_, i) for lay_, b in enumerate(blocks) for i, v in enumerate(b)}
    if any(where.get(id(outputs[i]), (None,))[0] != i for i in range(len(blocks))):
        return None
    n_units = lay.units
    deep = [v for b in blocks[:pre_n] for v in b] + [v for u in units[:3] for v in u]
    prev = units[2]
    for u in range(3, n_units - 1):
        prev = _clone(units[3], units[2], prev, (u - 3) * p)
        deep += prev
    last = _clone(units[k - 1], units[k - 2], prev, (n_units - k) * p)
    deep += last
    tail = _clone(tail_in, units[k - 1], last, (n_units - k) * p)
    deep += tail
    # each layer's output: the recorded one of the layer it was copied from, by position
    n = len(lay.layers)
    layer_values: dict[int, list[Value]] = {}
    for v in deep:
        if v.layer is not None:
            layer_values.setdefault(v.layer, []).append(v)
    outs = {}
    for i in range(n):
        src = i
        if i >= pre_n + 3 * p:
            unit, off = divmod(i - pre_n, p)
            src = (pre_n + 3 * p + off if unit < n_units - 1 else pre_n + 4 * p + off if unit < n_units
                   else i - (n_units - k) * p)
        outs[i] = layer_values[i][where[id(outputs[src])][1]]
    return Graph(pre + deep), outs


def _record(exp: ExperimentSpec) -> tuple[Graph, dict[int, Value]]:
    """The graph as the decoder walk records it, every layer."""
    eager = exp.model_copy(update={"training": exp.training.model_copy(
        update={"compile": False, "memory_budget": None, "checkpoint": "none", "fused_optimizer": False})})
    sim = Sim(exp.profile.allocator_round_bytes)
    model = make_params(sim, eager)
    rec = _Recorder(sim)
    outputs: dict[int, Value] = {}
    fwd = Forward(sim, eager, model, _Recording(rec, outputs))
    with sim.recording(rec):
        fwd.run()
    return Graph(rec.values), outputs


def checkpoint_recompute_flops(exp: ExperimentSpec) -> tuple[int, int]:
    """(forward FLOPs that activation checkpointing recomputes in backward, forward FLOPs of the
    model) for the experiment's checkpointing mode: a checkpointed layer runs its forward
    again (full, every-K, sqrt segments), selective recomputes the attention core only.
    Counted as FlopCounterMode counts: 2*m*n*k per matmul, 4*B*H*T^2*D per attention."""
    g, _ = record_graph(exp)
    tr = exp.training
    total = sum(v.flops for v in g.values)
    mode = tr.checkpoint

    def recomputed(v: Value) -> bool:
        if v.layer is None or mode == "none":
            return False
        if mode == "selective":
            return v.name.startswith(("sdpa", "matmul_"))
        if mode == "every-k":
            return v.layer % tr.checkpoint_every == 0
        return True  # full, sqrt

    return sum(v.flops for v in g.values if recomputed(v)), total
