"""Pipeline parallelism: the step of each rank of a ``pp``-stage pipeline, as torch.distributed.pipelining runs it.

A rank holds its stage (:func:`memcalc.core.pipeline.stage_layers`: torchtitan's split; the
embedding on the first stage, the final norm, head and loss on the last) and runs the schedule's actions in the order
torch's schedule runs them on that rank (:func:`actions`; torch 2.13 torch/distributed/pipelining/
schedules.py ``ScheduleGPipe._step_microbatches``, ``Schedule1F1B._step_microbatches``): a forward of
micro-batch ``i`` (``F``), a backward of it (``B``). Each forward runs the decoder walk
(:class:`memcalc.engine.forward.Forward`) over the stage's layers on ``batch / M`` rows and keeps its
autograd graph until that micro-batch's backward, so the schedule's micro-batches in flight hold their
saved activations at once (GPipe: all ``M`` before the first backward; 1F1B: ``min(M, pp - rank)``).
With several stages per rank (``interleaved-1f1b``, ``zero-bubble``, ``zbv-zero-bubble``: :class:`LocalStage`) the
actions name their stage, in the order :mod:`memcalc.core.pp_schedules` ports from torch, and
``_PipelineScheduleRuntime`` runs them (no ``output`` kept past its action, each input gradient sent right after its
backward; at a V's turn, where the next stage is the rank's own, the output and the input gradient become that
stage's receive buffers instead: :func:`memcalc.engine.pipeline_zb.pass_back`); zero bubble's ``I`` and ``W``:
:mod:`memcalc.engine.pipeline_zb`.

What the schedule itself holds, from its source (torch 2.13):

- **receive buffers** (stage.py ``_setup_forward_recv_info`` / ``_create_grad_recv_info``): a stage
  that is not the first has one ``(b, T, d)`` activation buffer per micro-batch, one that is not the
  last one ``(b, T, d)`` gradient buffer per micro-batch, made once and kept across steps; the
  received activation is the buffer itself, a leaf requiring grad;
- **the stage's output** (``fwd_cache[i] = (output_tuple, input_values)``) until micro-batch ``i``'s
  backward pops it, and the schedule's local ``output`` (the latest forward's) until the next forward
  returns: on the last stage these are the logits (the loss is ``loss_fn(output, target)`` outside the
  module, ``_maybe_compute_loss``); every micro-batch's loss stays in ``_internal_losses`` to the end;
- **the input gradient** sent back (non-first stages): ``stage_backward`` reads it from the buffer's
  ``.grad`` and clears it (_backward.py), ``bwd_cache`` -> ``get_bwd_send_ops`` -> a ``P2POp`` held by the
  schedule's ``ops`` (GPipe: until the next backward's receive ops replace it) or ``bwd_sends`` (1F1B:
  until the next backward's send ops replace it, after that backward);
- gradients accumulate over the micro-batches into ``.grad`` (``perform_reduce_grad`` scales them in
  place), then the optimizer steps and ``zero_grad(set_to_none=True)``.

Frees follow those Python references; on GPUs NCCL keeps a sent tensor's block until its transfer
completes (``recordStream`` on P2P ops, ProcessGroupNCCL.cpp ``pointToPoint``; pytorch/pytorch#132292),
a matter of timing the fake process group cannot show, not modelled.

With ``--tp`` each rank runs its stage of the tensor-parallel local model (torchtitan's ``apply_tp`` on each
model part over the ``tp`` mesh dimension; :mod:`memcalc.engine.tensor_parallel`); with sequence parallelism
the stages exchange the rank's ``seq / tp`` rows (a row-parallel linear's local output), and the last stage's
loss runs under loss parallel.

With ``--ep`` each stage's MoE layers hold the rank's ``n_experts / ep`` routed experts and dispatch every
micro-batch's ``batch / M x seq x top_k`` rows through torchtitan's all-to-all
(:mod:`memcalc.engine.expert_parallel`: :class:`StageForward` is the decoder walk that runs it, on the micro-batch);
with FSDP2 too, the experts are their own FSDP2 groups over ``efsdp`` (:mod:`memcalc.engine.pipeline_ep_fsdp`).

With ``--cp`` (ring attention) each stage's decoder walk runs the rank's ``seq / cp`` tokens and the ring of
:mod:`memcalc.engine.context_parallel` (:class:`StageForward` is a :class:`memcalc.engine.forward.Forward`): torchtitan
0.3.0 (trainer.py ``pp_forward_backward_step``) cp-shards every micro-batch (``post_dataloading_process`` ->
``prepare_context_parallel_input`` -> ``cp_shard``, torch's ``_context_parallel_shard``) before the schedule runs, so
the stages exchange ``(b, seq / cp, d)`` hidden states and each rank holds the sharded ids and labels (new tensors,
``distribute_tensor(...).to_local()`` of the load-balanced ``gather``) beside the whole batch.

Every rank also holds the whole batch's ids and labels (torchtitan's ``forward_backward_step`` moves
both to the GPU before branching on the stage); each micro-batch's are views of them
(``torch.tensor_split``, microbatch.py ``_split_tensor``). A non-last stage's backward starts from its gradient
receive buffer (``stage_backward``'s ``output_grads``), which the stage keeps: autograd sums a residual's gradient
into it out of place (:meth:`memcalc.engine.sim_backward.SimBackward._run_node`, ``InputBuffer::accumulate``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Optional

from memcalc.core.pipeline import (MULTI_STAGE, TORCH_SCHEDULES, check_pp, micro_batch, rank_stages,
                                   simulated_ranks, stages_per_rank)
from memcalc.core.pipeline import split as split_layers
from memcalc.core.pp_lowering import lowered
from memcalc.core.pp_schedules import rank_actions, single_stage
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.blocks import attention_variants as av
from memcalc.engine.context_parallel import shard_group
from memcalc.engine.blocks import embedding, head
from memcalc.engine.forward import Forward
from memcalc.engine.fsdp import optimizer_training
from memcalc.engine.observers import AllocEvents, AllocTrace, PeakAbove, Timeline
from memcalc.engine.optimizers import OptimizerSim
from memcalc.engine.params import param_inventory
from memcalc.engine.pipeline_zb import InputBackward, pass_back
from memcalc.engine.pipeline_ep_fsdp import stage_fsdp2
from memcalc.engine.pipeline_fsdp import PipelineFSDP2
from memcalc.engine.result import SimResult
from memcalc.engine.sim import Node, Sim, T
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.timeline import step_and_zero_grad
from memcalc.engine.weights import Model, make_params


def actions(schedule: str, pp: int, M: int, rank: int) -> list[tuple[str, int]]:
    """The rank's ``(F | B, micro-batch)`` actions in the order a single-stage schedule (GPipe, 1F1B) runs them
    (:func:`memcalc.core.pp_schedules.single_stage`; several stages per rank: ``rank_actions``)."""
    return [(k, i) for k, _, i in single_stage(schedule, pp, M, rank)]


@dataclass
class StagePeak:
    """One rank's simulated step: its stage and its peak."""

    rank: int
    layers: tuple[int, int]
    peak_bytes: int
    peak_phase: str
    peak_label: str
    #: with several stages per rank: each one's (global stage index, [lo, hi)); ``layers`` is the first's
    virtual: Optional[list[tuple[int, tuple[int, int]]]] = None

    def to_dict(self) -> dict:
        d = {"rank": self.rank, "layers": list(self.layers), "embedding": self.rank == 0,
             "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "peak_label": self.peak_label}
        if self.virtual is not None:
            d["stages"] = [{"stage": s, "layers": list(lh)} for s, lh in self.virtual]
        return d


@dataclass
class LocalStage:
    """One of a rank's stages: its global index, its layers, and the receive buffers torch made for it."""

    index: int
    lo: int
    hi: int
    first: bool
    last: bool
    recv: list[T]
    grad_recv: list[T]


class StageForward(Forward):
    """The decoder walk over one stage: the embedding if first, layers ``[lo, hi)`` (their global
    indices, so every parameter and per-layer rule is the layer's own), the final norm and the head if
    last. :meth:`run_stage` returns the stage's output (hidden states, or the logits)."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, model: Model, strategy: LayerStrategy,
                 lo: int, hi: int, first: bool, last: bool, fsdp: Optional[PipelineFSDP2] = None) -> None:
        super().__init__(sim, exp, model, strategy, fsdp)
        self.lo, self.hi, self.first, self.last = lo, hi, first, last
        self.fsdp = fsdp

    def layers(self, x: T) -> T:
        for lo, hi in self.strategy.regions(self.hi - self.lo):
            self.sim.mark(f"fwd layer {lo + self.lo}")
            y = self.strategy.run(self, x, lo + self.lo, hi + self.lo)
            self.ops.drop(x)
            x = y
        self.strategy.after_layers(self)
        return x

    def run_stage(self, x_in: T) -> T:
        """The stage's module forward on ``x_in`` (the ids view, or the received buffer; not taken)."""
        sim, o, m = self.sim, self.ops, self.m
        sim.where(None, "embedding")
        self.ids_labels = ()
        if self.first and self.fsdp is not None:  # FSDP2: the embedding's unit (engine.pipeline_fsdp)
            self.fsdp.unit_forward(self.fsdp.embed)
        x = embedding.embed_dropout(self, embedding.embed(self, x_in)) if self.first else sim.ref(x_in)
        if m.positions == "rope":  # the stage's RoPE tables (a local of its forward; saved by RoPE's nodes)
            from memcalc.core.rules import rope_tables_bytes, rope_width

            self.rope_tables = sim.alloc(rope_tables_bytes(self.exp.profile.framework, self.B, self.T, rope_width(m),
                                                           o.dtype_of(x).nbytes(1)), "activations", "rope tables")
        self.masks = av.build_masks(self)
        x = self.layers(x)
        if self.last:
            sim.mark("final norm & head")
            sim.set_role("head")
            if self.fsdp is not None:
                self.fsdp.unit_forward(self.fsdp.head)
            x = head.final_norm(self, x)
        self.release_masks()
        if self.last:
            x = head.logits(self, x)
            self.strategy.logits(self, x)
        o.exit_autocast()
        if self.lo == self.hi and self.rope_tables is not None:  # a stage of no layer (an uneven
            sim.unref(self.rope_tables)  # split's end stage): nothing saves them, they go as the forward returns
            self.rope_tables = None
        # the tables stay to the end of the stage's backward (:meth:`RankStep.backward`): the forward's local goes as
        # it returns, but the first layer's RoPE multiplications save them (eager), or its checkpointed region saves
        # them as inputs (torch/utils/checkpoint.py, use_reentrant=False) until its backward
        return x


class RankStep:
    """One rank's step (see the module docstring); :meth:`run` returns its :class:`SimResult`."""

    def __init__(self, exp: ExperimentSpec, rank: int, strategy, first_step: bool,
                 observers: Sequence[object] = ()) -> None:
        exp = shard_group(exp)  # context parallelism: FSDP2 over the stage's dp x cp ranks (torchtitan's dp_shard_cp)
        tr = exp.training
        self.M, b = micro_batch(tr)
        self.exp = exp
        self.mexp = exp.model_copy(update={"training": tr.model_copy(update={"batch": b})})  # what one F runs
        self.rank, self.pp = rank, tr.pp
        self.V = stages_per_rank(tr)
        n_stages = tr.pp * self.V
        split = split_layers(tr, exp.model.n_layers)
        self.stage_ids = rank_stages(tr, rank)
        self.lo, self.hi = split[self.stage_ids[0]]
        self.first = self.stage_ids[0] == 0  # holds the embedding
        self.last = self.stage_ids[-1] == n_stages - 1  # holds the final norm, the head and the loss
        self.runtime = tr.pp_schedule in MULTI_STAGE  # _PipelineScheduleRuntime._step_microbatches runs it
        self.stages = {s: LocalStage(s, *split[s], s == 0, s == n_stages - 1, [], []) for s in self.stage_ids}
        self.strategy, self.first_step = strategy, first_step
        self.sim = Sim(exp.profile.allocator_round_bytes)
        self.log: Optional[AllocEvents] = next((ob for ob in observers if isinstance(ob, AllocEvents)), None)
        for ob in observers:
            self.sim.watch(ob)

    def keep(self, name: str, layer: Optional[int]) -> bool:
        """Whether parameter ``name`` (of decoder layer ``layer``, None outside the layers) is this rank's."""
        if layer is not None:
            return any(st.lo <= layer < st.hi for st in self.stages.values())
        return self.first if name.startswith("embed_") else self.last

    def setup(self) -> None:
        sim, exp = self.sim, self.exp
        sim.mark("weights", "setup")
        self.model = make_params(sim, exp, only=self.keep)
        self.gather = stage_fsdp2(sim, exp, self.model)
        rows_of = {p.name: (p.shape[0] if len(p.shape) == 2 else 0) for p in param_inventory(exp.model, None)}
        self.opt = OptimizerSim(sim, optimizer_training(exp.training), self.model.order, rows_of)
        if not self.first_step:
            self.opt.create_all()
        tr, d = exp.training, exp.model.d_model
        b, seq = tr.batch // self.M, tr.seq // tr.cp  # (context parallelism: the rank's seq / cp tokens)
        if tr.tp > 1 and tr.sequence_parallel:  # the stage's output: the rank's local seq / tp rows (a plain tensor:
            seq //= tr.tp  # the rowwise linears' use_local_output; torch/distributed/tensor/parallel/style.py)
        dt = tr.weight_dtype  # the residual stream between stages
        n = b * seq * d

        def buffers() -> list[T]:
            return [sim.alloc(dt.nbytes(n), "activations", "pipeline receive buffers", numel=n, itemsize_bits=dt.bits)
                    for _ in range(self.M)]

        for st in self.stages.values():  # each stage's own (its _prepare_forward_infra / _prepare_backward_infra)
            st.recv = buffers() if not st.first else []
            st.grad_recv = buffers() if not st.last else []
        self.ids = sim.alloc(tr.batch * tr.seq * 8, "activations", "inputs")
        self.labels = sim.alloc(tr.batch * tr.seq * 8, "activations", "inputs")
        if tr.cp > 1:  # and their context-parallel shards (cp_shard's copies; the module docstring)
            self.ids_labels_cp = [sim.alloc(tr.batch * (tr.seq // tr.cp) * 8, "activations", "inputs")
                                  for _ in range(2)]
        sim.mark("step start", "setup")
        self.step_start = len(self.log.events) if self.log is not None else 0
        self.state_moves = None
        if self.log is not None and not self.first_step:  # where a first step would create the state
            self.opt.created_at, self.opt.events = [], self.log.events  # (as timeline._Step.setup records it)
            self.state_moves = (frozenset(t.uid for ts in self.opt.state.values() for t in ts if t.uid),
                                self.opt.created_at)

    def run(self) -> SimResult:
        self.graphs: dict[tuple[int, int], tuple] = {}
        try:
            self.step()
        except PeakAbove:  # cut short: its graphs let go as a whole step's are (Sim.abandon_graph)
            self.sim.abandon_graph([*(g[0] for g in self.graphs.values()),
                                    *(s[1] for s in getattr(self, "split", {}).values())])
            raise
        return self.result()

    def step(self) -> None:
        self.setup()
        sim, tr = self.sim, self.exp.training
        self.output: Optional[T] = None  # the schedule's local ``output``
        self.losses: list[T] = []
        self.sending: Optional[T] = None  # the input gradient the schedule's send ops hold
        self.held: list[T] = []  # (zero bubble) input gradients left as the receive buffers' .grad
        self.split: dict[tuple[int, int], tuple] = {}  # (zero bubble) micro-batches between their I and W
        acts = rank_actions(tr.pp_schedule, self.pp, self.V, self.M, self.rank)
        runtime = self.gather if self.runtime else None
        if runtime is not None:  # the runtime's UNSHARD / RESHARD / REDUCE_GRAD (engine.pipeline_fsdp)
            runtime.assign_stages({s: (st.lo, st.hi, st.first, st.last) for s, st in self.stages.items()})
            acts = lowered(acts, self.M)
        for kind, s, i in acts:
            if runtime is not None and runtime.runtime_action(kind, s):
                continue
            st = self.stages[s]
            if kind == "F":
                self.forward(st, i)
            elif kind == "B" or (st.first and kind == "W"):  # stage 0's W is its full backward
                self.backward(st, i)
            elif not st.first:  # zero bubble's split backward (stage 0's I does nothing)
                split_backward(self, st, i, kind)
        if self.gather is not None and runtime is None:  # perform_reduce_grad
            self.gather.reduce_all()
        for t in [self.output, self.sending, *self.losses]:
            sim.unref(t)
        step_and_zero_grad(sim, self.opt, self.model)
        for g in self.held:  # zero bubble's input gradients: the next step's clear_runtime_states frees them
            sim.unref(g)
        sim.mark("step end", "optimizer step")

    def forward(self, st: LocalStage, i: int) -> None:
        sim = self.sim
        sim.mark(f"mb {i} forward" + (f" stage {st.index}" if self.V > 1 else ""), "forward")
        sim.new_graph()
        layers = self.strategy()
        fwd = StageForward(sim, self.mexp, self.model, layers, st.lo, st.hi, st.first, st.last, self.gather)
        x_in = self.ids if st.first else st.recv[i]
        if not st.first:
            x_in.requires_grad = True  # the received activation: a leaf requiring grad
        out = fwd.run_stage(x_in)
        if self.gather is not None:  # the root's post-forward
            self.gather.after_forward()
        if not self.runtime:  # ``output = forward_one_chunk(...)`` rebinds before the loss is computed (the
            if self.output is not None:  # runtime's ``output`` is a local of its action, gone when it returns)
                sim.unref(self.output)
            self.output = sim.ref(out)
        loss = None
        if st.last:  # _maybe_compute_loss: loss_fn(output, target) on the kept logits
            sim.mark(f"mb {i} loss")
            loss = head.loss(fwd, sim.ref(out))
            self.losses.append(loss)
        uses = {p.name: p.uses for p in self.model.order if p.uses}
        for p in self.model.order:  # each graph's uses are its own (restored at its backward)
            p.uses = 0
        self.graphs[st.index, i] = (sim.nodes, fwd, layers, out, loss, uses)
        sim.new_graph()
        nxt = self.stages.get(st.index + 1)
        if nxt is not None:  # the next stage is this rank's (a V's turn): set_local_fwd_input, no send / receive
            old, nxt.recv[i] = nxt.recv[i], sim.ref(out)  # (stage.py: ``info.buffer = output.detach()``, the buffer
            sim.unref(old)  # replaced to the next step's; schedules.py _PipelineScheduleRuntime, FORWARD)

    def backward(self, st: LocalStage, i: int) -> None:
        sim = self.sim
        nodes, fwd, layers, out, loss, uses = self.graphs.pop((st.index, i))
        sim.mark(f"mb {i} backward" + (f" stage {st.index}" if self.V > 1 else ""), "backward")
        if self.pp_schedule == "gpipe" and self.sending is not None:  # ``ops`` replaced by the receive ops
            sim.unref(self.sending)
            self.sending = None
        for p in self.model.order:
            p.uses = uses.get(p.name, 0)
        sim.use_graph(nodes)
        if self.gather is not None:
            self.gather.stage_backward_start(st.index)
        if loss is not None:
            sim.backward(loss, 4, _label_of)
        else:
            out.grad_buffer = sim.ref(st.grad_recv[i])
            sim.run_nodes(nodes, _label_of)
        layers.end_backward(fwd)
        if self.gather is not None:
            self.gather.stage_backward_end()
        sim.unref(fwd.rope_tables)  # (held by the first layer's saved tensors until now: StageForward.run_stage)
        fwd.rope_tables = None
        sim.new_graph()
        sim.unref(out)  # fwd_cache's reference
        if not st.first:
            buf = st.recv[i]
            g, buf.grad_buffer = buf.grad_buffer, None  # stage_backward: val.grad read, then set to None
            if self.runtime:  # bwd_cache, popped by the SEND_B right after (_add_send_recv) into its P2POps
                if g is not None:
                    pass_back(sim, self.stages, st.index, i, g)
                sim.unref(g)
                return
            if self.sending is not None:  # 1F1B: ``bwd_sends`` replaced after this backward
                sim.unref(self.sending)
            self.sending = g

    def restore_uses(self, uses: dict) -> None:
        """Each parameter's uses in one micro-batch's graph (restored before its backward runs)."""
        for p in self.model.order:
            p.uses = uses.get(p.name, 0)

    @property
    def pp_schedule(self) -> str:
        return self.exp.training.pp_schedule

    def result(self) -> SimResult:
        sim = self.sim
        moves = None
        if self.state_moves is not None:
            setup_state, created_at = self.state_moves
            moves = (setup_state, [(i, [(t.uid, t.nbytes) for t in ts if t.uid]) for i, ts in created_at])
        return SimResult(state_moves=moves,
            peak_bytes=sim.peak, peak_phase=sim.peak_phase, peak_label=sim.peak_label,
            peak_categories=sim.peak_categories(), peak_kinds=sim.peak_kinds_alive(),
            peak_by_kind=sim.peak_by_kind(),
            phases={k: v for k, v in sim.phase_peaks.items() if k != "setup"},
            timeline=[], max_activation_bytes=sim.max_activations)


def split_backward(step: RankStep, st: LocalStage, i: int, kind: str) -> None:
    """Zero bubble's ``I`` or ``W`` of micro-batch ``i`` on stage ``st`` (not the first: :mod:`.pipeline_zb`)."""
    sim = step.sim
    sim.mark(f"mb {i} backward stage {st.index}" + (" weights" if kind == "W" else ""), "backward")
    if kind == "I":
        nodes, fwd, layers, out, loss, uses = step.graphs.pop((st.index, i))
        sim.use_graph(nodes)  # (no weight gradient: the uses wait for W)
        if loss is not None:  # torch.ones_like(loss)
            loss.grad_buffer = sim.alloc(4, "temporaries", "activation gradients")
        else:
            out.grad_buffer = sim.ref(st.grad_recv[i])
        run = InputBackward(sim, nodes)
        if step.gather is not None:  # FSDP2: the units' post-backward hooks fire in I (engine.pipeline_fsdp)
            step.gather.stage_backward_start(st.index)
        run.run(_label_of)
        if step.gather is not None:
            step.gather.stage_backward_end()
        sim.new_graph()
        if loss is not None:  # the logits: fwd_cache's reference gone, detach_()-ed; backward_state keeps the loss
            sim.unref(out)
            out = None
        buf = st.recv[i]
        g, buf.grad_buffer = buf.grad_buffer, None  # ``inp.grad = dinput``: kept to the next step's clear
        if g is not None:
            step.held.append(g)
            pass_back(sim, step.stages, st.index, i, g)
        step.split[st.index, i] = (run, nodes, fwd, layers, out, uses)
        return
    run, nodes, fwd, layers, out, uses = step.split.pop((st.index, i))
    step.restore_uses(uses)
    sim.use_graph(nodes)
    run.weights({p.name: k for k, p in enumerate(step.model.order)}, f"mb {i} weights")
    layers.end_backward(fwd)
    sim.unref(fwd.rope_tables)
    fwd.rope_tables = None
    sim.new_graph()
    sim.unref(out)  # backward_state's stage output (a non-last stage)


def _label_of(node: Node) -> str:
    lab = node.fwd_label or ""
    return lab.replace("fwd ", "bwd ") if lab.startswith("fwd ") else (lab or "backward")


def simulate_pp(exp: ExperimentSpec, strategy, first_step: bool = False, record_timeline: bool = True,
                trace_allocs: bool = False, events: bool = False,
                observers: Sequence[object] = (), ranks: Optional[Sequence[int]] = None) -> SimResult:
    """Each rank's step (:class:`RankStep`) of ``ranks`` (default :func:`memcalc.core.pipeline.simulated_ranks`:
    every rank of a short pipeline); the result is the worst rank's (the highest peak, the first such rank),
    with each simulated rank's :class:`StagePeak` in ``stages``.
    Python's cyclic garbage collector is paused meanwhile, as for one step (:func:`memcalc.engine.timeline.simulate`:
    the ranks' objects live until each rank's step ends; collected, they are traversed again and again, about a
    fifth of the time)."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _simulate_ranks(exp, strategy, first_step, record_timeline, trace_allocs, events, observers, ranks)
    finally:
        if paused:
            gc.enable()


def _simulate_ranks(exp: ExperimentSpec, strategy, first_step: bool, record_timeline: bool, trace_allocs: bool,
                    events: bool, observers: Sequence[object], ranks: Optional[Sequence[int]]) -> SimResult:
    check_pp(exp)
    peaks: list[StagePeak] = []
    results: list[tuple[SimResult, Optional[Timeline], Optional[AllocTrace], Optional[AllocEvents]]] = []
    V = stages_per_rank(exp.training)
    tr = exp.training
    less = (tr.pp_first_stage_less_layers, tr.pp_last_stage_less_layers)
    for r in (simulated_ranks(tr.pp, exp.model, V, tr.pp_schedule, less) if ranks is None else ranks):
        tracer = AllocTrace() if trace_allocs else None
        log = AllocEvents() if events else None
        step = RankStep(exp, r, strategy, first_step, [*observers, *(ob for ob in (tracer, log) if ob is not None)])
        tl = Timeline(step.sim) if record_timeline else None
        if tl is not None:
            step.sim.watch(tl)
        res = step.run()
        res.step_start = step.step_start
        step.sim.release_graph()
        results.append((res, tl, tracer, log))
        virtual = [(s, (st.lo, st.hi)) for s, st in step.stages.items()] if V > 1 else None
        peaks.append(StagePeak(r, (step.lo, step.hi), res.peak_bytes, res.peak_phase, res.peak_label, virtual))
    at = max(range(len(peaks)), key=lambda i: (peaks[i].peak_bytes, -peaks[i].rank))
    worst = peaks[at].rank
    res, tl, tracer, log = results[at]
    res.timeline = tl.points if tl is not None else []
    res.alloc_trace = tracer.rows if tracer is not None else None
    if log is not None:
        res.events, res.event_phases = log.events, log.phases
    res.peak_label = f"rank {worst} {res.peak_label}".strip()
    res.stages = [p.to_dict() for p in peaks]
    return res


def pipeline_extra(exp: ExperimentSpec, stages: list[dict]) -> dict:
    """``--json``'s ``pipeline``: the schedule (its torch class), the micro-batches, each simulated rank's stage
    and steady-state peak (:func:`memcalc.core.pipeline.simulated_ranks`), and the worst rank (the estimate's
    peak is its)."""
    tr = exp.training
    M, b = micro_batch(tr)
    worst = max(stages, key=lambda s: (s["peak_bytes"], -s["rank"]))
    out = {"pp": tr.pp, "schedule": tr.pp_schedule, "torch_schedule": TORCH_SCHEDULES[tr.pp_schedule],
           "microbatches": M, "microbatch_size": b, "worst_rank": worst["rank"], "stages": stages}
    if stages_per_rank(tr) > 1:
        out["stages_per_rank"] = stages_per_rank(tr)
    return out
