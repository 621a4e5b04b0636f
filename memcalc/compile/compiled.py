"""What ``torch.compile`` saves for backward, and what its memory budget recomputes.

Under ``model.compile()`` the model's forward (embedding, layers, final norm, head)
is one graph; AOTAutograd traces it jointly with its backward and its partitioner
(:mod:`memcalc.compile.partitioner`) chooses the saved set. The partition graph ends at the logits;
the loss is the graph's own fused cross-entropy with ``compile_scope model`` (a forward that computes
its loss, as Forgather's and the validator's do: memcalc.engine.blocks.compiled_loss.graph_loss) and
runs eagerly after the graph with ``compile_scope logits``.

The forward graph comes from :mod:`memcalc.compile.graph`. This module reduces the
partitioner's answer to what the compiled timeline (:mod:`memcalc.compile.backward`) needs: bytes saved per layer, the bytes the backward recomputes
at one step and keeps for a later one (``chain_hold``), and the forward FLOPs the
backward graph spends recomputing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from memcalc.compile.graph import record_graph
from memcalc.compile.partitioner import Graph, Partition, Value, choose_saved_values_set
from memcalc.core.spec import ExperimentSpec

@dataclass
class CompiledPlan:
    """The partitioner's choice for one experiment, in bytes and FLOPs."""

    budget: float
    how: str
    saved_bytes: int  # activations the compiled backward receives (graph inputs excluded)
    saved_by_layer: dict[Optional[int], int] = field(default_factory=dict)  # None: outside layers
    # layer -> saved bytes of the layer besides its output (which the next layer, or the
    # eager final norm, holds as its input): what the timeline keeps per compiled layer
    extra_by_layer: dict[int, int] = field(default_factory=dict)
    # (computed at step, last read at step) -> bytes the compiled backward recomputes at one
    # backward step and keeps for a later one (see chain_hold; step n_layers is the head's)
    held: dict[tuple[int, int], int] = field(default_factory=dict)
    recompute_flops: int = 0  # forward FLOPs recomputed in backward
    forward_flops: int = 0  # forward FLOPs of the compiled region
    default_saved_bytes: int = 0  # what budget 1.0 would save
    # layer -> bytes of the MLP's buffers in that layer's compiled backward (see mlp_pool),
    # which inductor keeps for the next layer to reuse
    mlp_pool_by_layer: dict[int, int] = field(default_factory=dict)
    # compile_scope layer: each layer graph's saved tensors as save_for_backward receives them,
    # (bytes, a parameter?) each, its input left out (memcalc.compile.layer_scope.saved_order)
    saved_order_by_layer: dict[int, tuple[tuple[int, bool], ...]] = field(default_factory=dict)
    # compile_scope layer: whether each layer graph saves its input (None: always, the whole graph's rule)
    input_saved_by_layer: Optional[dict[int, bool]] = None

    @property
    def recompute_pct(self) -> float:
        return 100.0 * self.recompute_flops / self.forward_flops if self.forward_flops else 0.0


@lru_cache(maxsize=64)
def _plan_cached(exp_json: str) -> CompiledPlan:
    exp = ExperimentSpec.model_validate_json(exp_json)
    return _plan(exp)


def compiled_plan(exp: ExperimentSpec) -> CompiledPlan:
    """The saved set under ``torch.compile`` at the experiment's memory budget (1.0 if unset).

    Python's cyclic garbage collector is paused meanwhile, as during a simulated step
    (``memcalc.engine.timeline.simulate``): recording the graph and partitioning it make tens of
    thousands of objects that live on in the caches, which full collections would traverse
    again and again (in ``plan --compile``, a sixth of the time)."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _plan_cached(exp.model_dump_json())
    finally:
        if paused:
            gc.enable()


#: TrainingSpec fields the recorded forward graph cannot depend on: the optimizer runs after it,
#: checkpointing and the budget are what the partition decides, accumulation repeats it. Every
#: other field of the experiment (a later one too) is part of the graph's key.
_NOT_IN_GRAPH = ("optimizer", "optimizer_impl", "offload_optimizer", "fused_optimizer", "grad_accum", "compile",
                 "memory_budget", "checkpoint", "checkpoint_every")


def graph_key(exp: ExperimentSpec) -> ExperimentSpec:
    """``exp`` with the fields that cannot change its forward graph at their defaults (names and
    published figures too): experiments with the same key record the same graph, so
    ``plan --compile``'s budgets and optimizers share one graph and its default partition."""
    tf = type(exp.training).model_fields
    tr = exp.training.model_copy(update={k: tf[k].get_default(call_default_factory=True) for k in _NOT_IN_GRAPH})
    ef = type(exp).model_fields
    top = {k: f.get_default(call_default_factory=True) for k, f in ef.items() if k not in ("model", "training", "profile")}
    return exp.model_copy(update={**top, "training": tr})


@lru_cache(maxsize=32)
def _graph(key: ExperimentSpec) -> tuple[Graph, dict[int, Value]]:
    return record_graph(key)


@lru_cache(maxsize=128)
def _partition(key: ExperimentSpec, budget: float) -> Partition:
    """The partition of ``key``'s graph at ``budget`` (the partitioner leaves the graph as it is)."""
    return choose_saved_values_set(_graph(key)[0], budget)


def _plan(exp: ExperimentSpec) -> CompiledPlan:
    key = graph_key(exp)
    g, outputs = _graph(key)
    budget = exp.training.memory_budget if exp.training.memory_budget is not None else 1.0
    if exp.training.compile_scope == "layer":
        return _layer_plan(g, outputs, budget)
    part: Partition = _partition(key, budget)
    default = part if budget == 1.0 else _partition(key, 1.0)
    by_layer: dict[Optional[int], int] = {}
    for v in part.saved:
        if v.kind != "input":
            by_layer[v.layer] = by_layer.get(v.layer, 0) + v.nbytes
    saved = set(part.saved)
    extra = {i: by_layer.get(i, 0) - (out.nbytes if out in saved else 0) for i, out in outputs.items()}
    realized = _realized_values(key)
    steps = _backward_steps(g, part, len(outputs), realized)
    held = chain_hold(steps, set(outputs.values()))
    pool = mlp_pool(g, part, steps, realized)
    return CompiledPlan(
        budget=budget,
        how=part.how,
        saved_bytes=part.saved_bytes,
        saved_by_layer=by_layer,
        extra_by_layer=extra,
        held=held,
        recompute_flops=part.recompute_flops,
        forward_flops=sum(v.flops for v in g.values),
        default_saved_bytes=default.saved_bytes,
        mlp_pool_by_layer=pool,
    )


def _layer_plan(g: Graph, outputs: dict[int, Value], budget: float) -> CompiledPlan:
    """``compile_scope layer`` (:mod:`memcalc.compile.layer_scope`): one partition per layer graph;
    nothing held across layers, no buffer pool shared between graphs."""
    from memcalc.compile.layer_scope import layer_saved_bytes, partition_layers, saved_order

    parts = partition_layers(g, outputs, budget)
    defaults = partition_layers(g, outputs, 1.0) if budget != 1.0 else parts
    in_layers = [v for v in g.values if v.layer is not None]
    by_layer: dict[Optional[int], int] = {i: p.saved_bytes for i, (p, _, _) in parts.items()}
    return CompiledPlan(
        budget=budget,
        how=",".join(sorted({p.how for p, _, _ in parts.values()})),
        saved_bytes=sum(by_layer.values()),  # type: ignore[arg-type]
        saved_by_layer=by_layer,
        extra_by_layer={i: layer_saved_bytes(p, out) for i, (p, out, _) in parts.items()},
        recompute_flops=sum(p.recompute_flops for p, _, _ in parts.values()),
        forward_flops=sum(v.flops for v in in_layers),
        default_saved_bytes=sum(p.saved_bytes for p, _, _ in defaults.values()),
        saved_order_by_layer={i: saved_order(p) for i, (p, _, _) in parts.items()},
        input_saved_by_layer={i: x for i, (_, _, x) in parts.items()},
    )


def _attention_mask_only(v: Value, u: Value) -> bool:
    """Does ``u`` read ``v`` only as an attention kernel's additive mask (its args are
    q, k, v, mask)?"""
    return u.name.startswith("sdpa") and u.kind == "compute" and v in u.args[3:] and v not in u.args[:3]


def _realized(v: Value) -> bool:
    """Does inductor give this value a buffer of its own, shared by its readers? Outputs of
    extern kernels (matmul, attention, embedding) and their second outputs, and anything a
    matmul or attention kernel reads (``ExternKernel.realize_input`` realizes the value in
    place). Other pointwise values are inlined into the kernels that use them and
    recomputed there. So is an attention mask: the SDPA lowering's stride constraint
    (``sdpa_constraint`` in torch/_inductor/lowering.py: the bias needs a dense, aligned last
    dimension; an expanded batch keeps stride 0) copies an unrealized mask into a fresh
    buffer for each kernel that reads it, computed from its cheap inputs (ALiBi slopes,
    positions), so the compiled backward never keeps a mask from one layer to the next."""
    if v.kind in ("compute", "other", "random") or v.extern_aux:
        return True
    readers = [u for u in v.users if u.kind in ("compute", "other")]
    return any(not _attention_mask_only(v, u) for u in readers)


@lru_cache(maxsize=32)
def _realized_values(key: ExperimentSpec) -> frozenset:
    """The values of ``key``'s graph that ``_realized`` holds for (it depends on the graph only)."""
    return frozenset(v for v in _graph(key)[0].values if _realized(v))


def _backward_steps(g: Graph, part: Partition, n_layers: int,
                    realized: Optional[frozenset] = None) -> dict[Value, tuple[int, int]]:
    """For each value the compiled backward materialises: (the step that computes it, the last
    step that reads it); see chain_hold. ``realized``: ``_realized_values`` (worked out here if
    not given)."""
    if realized is None:
        realized = frozenset(v for v in g.values if _realized(v))
    saved = set(part.saved)
    head = n_layers
    last = max((v.order for v in g.values if v.layer is not None), default=-1)

    def step_of(v: Value) -> int:
        return v.layer if v.layer is not None else (head if v.order > last else -1)

    reads: dict[int, list[Value]] = {}
    for u in g.values:
        if u.bw_read and u not in saved and u.kind != "input":
            reads.setdefault(step_of(u), []).append(u)
    computed_at: dict[Value, int] = {}
    last_use: dict[Value, int] = {}

    def ensure(v: Value, s: int, inline: set) -> None:
        stack = [(v, False)]
        while stack:
            x, expanded = stack.pop()
            if x in saved or x.kind == "input":
                continue
            if x in computed_at:  # materialised earlier: read here
                last_use[x] = s
                continue
            if not expanded:
                if x in inline:
                    continue
                inline.add(x)
                stack.append((x, True))
                stack.extend((a, False) for a in x.args)
            elif x in realized:
                computed_at[x] = s
                last_use[x] = s

    for s in [head] + list(range(n_layers - 1, -2, -1)):
        inline: set = set()  # values recomputed inline at this step (each once)
        for u in reads.get(s, []):
            ensure(u, s, inline)
    return {v: (c, last_use[v]) for v, c in computed_at.items()}


def chain_hold(steps: dict[Value, tuple[int, int]], layer_outputs: set) -> dict[tuple[int, int], int]:
    """Bytes the compiled backward computes at one step and keeps for a later one.

    The backward graph is reordered to mimic the autograd engine
    (``reordering_to_mimic_autograd_engine`` in partitioners.py): each backward op pulls in,
    in forward order, the recomputation it needs. Steps run head first, then layers from
    the last to the first. At each step the values its backward formulas read are made
    available: saved values and graph inputs are; a value inductor materialises (see
    ``_realized``) is computed once and kept until its last reader; any other value is
    recomputed inline wherever it is read, from its own inputs. The head's backward needs
    the last layer's output, so when the residual stream is not saved the whole forward
    chain is computed at the first step and what later steps read of it stays alive.

    Returns ``{(computed at step, last read at step): bytes}`` for values kept across steps
    (``n_layers`` is the head's step); values used only at the step that computes them are
    left to the timeline's per-layer recomputation, and so are the layer outputs (the
    timeline keeps the residual stream from the forward). ``steps``: ``_backward_steps``.
    """
    held: dict[tuple[int, int], int] = {}
    for v, (c, last) in steps.items():
        if v in layer_outputs or last == c:
            continue
        held[(c, last)] = held.get((c, last), 0) + v.nbytes
    return held


def mlp_pool(g: Graph, part: Partition, steps: dict[Value, tuple[int, int]],
             realized: Optional[frozenset] = None) -> dict[int, int]:
    """Per layer i >= 1, the bytes of MLP-width buffers that stay allocated, dead, through the
    layer's attention backward because layer i-1's MLP backward will reuse them.

    Inductor's wrapper plans memory statically: a dead buffer that a later allocation of the
    same size can take is kept for it rather than freed (``FreeIfNotReusedLine`` and the reuse
    pool in torch/_inductor/codegen/wrapper.py). Layers are identical, so what layer i's
    MLP backward leaves can serve layer i-1's. Counted in MLP-width buffers (the up/gate/fc1
    outputs and the down projection's input, which inductor materialises, each with one
    gradient), per layer, as traced in a real inductor step (CPU, memory-efficient attention
    emulated; benchmarks/compile_cpu_probe.py):

    - distinct buffers its MLP backward uses: its gradients only when the MLP values are
      saved (3 for a gated MLP); values and gradients (6) when it recomputes them there; the
      values and one more (4) when the values come from the forward chain the backward
      rebuilt at an earlier step (the gradients then reuse them in place);
    - new allocations it makes: those, less the chain values already allocated;
    - kept through layer i's attention backward: the smaller of layer i's distinct buffers
      and layer i-1's new allocations. Layer 0 has no successor: nothing is kept.

    Budget 0.05 on 32 layers: one buffer at layers 31-28 (their successors' values come from
    the chain), four at 27, six below; budget 1.0: three everywhere. ``steps``:
    ``_backward_steps``; ``realized``: ``_realized_values`` (worked out here if not given)."""
    saved = set(part.saved)
    width: dict[int, int] = {}
    distinct: dict[int, int] = {}
    new: dict[int, int] = {}
    for i, down in _down_projections(g):
        real = [v for v in _mlp_inner(down) if (v in realized if realized is not None else _realized(v))]
        if not real:
            continue
        from_chain = [v for v in real if v not in saved and v in steps and steps[v][0] != i]
        here = [v for v in real if v not in saved and v not in from_chain]
        grads = len(real) if not from_chain else 1
        width[i] = max(v.nbytes for v in real)
        distinct[i] = len(here) + len(from_chain) + grads
        new[i] = distinct[i] - len(from_chain)
    return {i: min(distinct[i], new[i - 1]) * width[i] for i in distinct if i - 1 in new}


def _down_projections(g: Graph) -> Iterator[tuple[int, Value]]:
    """Each layer's MLP down projection (``down_proj`` / ``fc2``), with its layer, in graph order."""
    for v in g.values:
        if (v.kind == "compute" and v.layer is not None
                and any(a.param and a.name.endswith(("down_proj.weight", "fc2.weight")) for a in v.args)):
            yield v.layer, v


def _mlp_inner(down: Value) -> set:
    """The MLP's inner values: the down projection's input and its pointwise ancestors back to
    (and including) the projections that produce them."""
    inner, stack = set(), [a for a in down.args if not a.param and a.kind != "input"]
    while stack:
        v = stack.pop()
        if v in inner or v.kind == "input":
            continue
        inner.add(v)
        if v.kind == "pointwise":
            stack.extend(a for a in v.args if not a.param)
    return inner
