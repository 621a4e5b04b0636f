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

from memcalc.compile.partitioner import Graph, Value
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
#: the eager loss after the compiled region (memcalc.engine.loss.lm_loss)
LOSS = {"shift_slice", "loss_split", "log_softmax", "nll_loss"}
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


def record_graph(exp: ExperimentSpec) -> tuple[Graph, dict[int, Value]]:
    """The compiled region's forward as a partitioner graph, and each layer's output value."""
    eager = exp.model_copy(update={"training": exp.training.model_copy(
        update={"compile": False, "memory_budget": None, "checkpoint": "none", "fused_optimizer": False})})
    sim = Sim(exp.profile.allocator_round_bytes)
    sim.record_timeline = False
    model = make_params(sim, eager)
    rec = _Recorder(sim)
    outputs: dict[int, Value] = {}
    fwd = Forward(sim, eager, model, _Recording(rec, outputs))
    sim.recorder = rec
    fwd.run()
    sim.recorder = None
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
