"""FSDP2 inside a pipeline stage (``--pp`` with ``--gpus N --zero 2|3``): one rank's FSDP2 runtime as
torchtitan 0.3.0 and torch 2.13's pipelining run it (validate/sharded/pipeline_fsdp.py traces the same).

- **Units** (torchtitan 0.3.0 ``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder`` on a model part):
  the embedding its own unit (first stage), the final norm and the head one unit (last stage), each decoder
  layer one unit, and the stage module the root, which owns no parameter of its own.
- **No reshard after forward**: ``get_fsdp_reshard_after_forward_policy("default", pp_enabled=True)`` is
  ``not pp_enabled`` ("For PP, by default do not reshard after forward to avoid per-microbatch
  all-gathers"), for ``--zero 2`` and ``--zero 3`` alike.
- **No sync, no reshard after backward until the end** (torch 2.13 ``torch/distributed/pipelining/stage.py``
  ``backward_maybe_with_nosync``: ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)`` before every micro-batch's backward): each unit is all-gathered once,
  in the first micro-batch's forward (the all-gather buffers as :class:`memcalc.engine.fsdp.FSDP2` models
  them), and stays unsharded. A unit's post-backward without sync (``_fsdp_param_group.py``
  ``FSDPParamGroup.post_backward``) only accumulates: ``FSDPParam.accumulate_unsharded_grad_if_needed``
  adds a new ``param_dtype`` gradient into the ``reduce_dtype`` accumulator and frees it,
  ``to_accumulated_grad_if_needed`` turns the first one into that accumulator (``grad.to(reduce_dtype)``, the
  gradient freed) when the dtypes differ; otherwise autograd accumulates into ``.grad`` in place. The
  embedding's post-backward runs in the root's final callback (its input, the token ids, needs no gradient:
  ``_root_post_backward_final_callback``), the head unit's as backward leaves the final norm.
- **The end** (``perform_reduce_grad`` after the last backward): the three flags set back, then every unit's
  ``post_backward`` in the states' order (embedding, layers, head): reshard, reduce-scatter
  (:meth:`memcalc.engine.fsdp.FSDP2.post_backward`), the final callback releasing the kept reduce-scatter
  input; ``scale_grads`` divides the gradient shards in place.

With several stages per rank (``interleaved-1f1b``, ``zero-bubble``) each stage is its own FSDP root (torchtitan
parallelizes each model part) and ``_PipelineScheduleRuntime`` runs the FSDP actions its lowering adds
(:mod:`memcalc.core.pp_lowering`; :meth:`PipelineFSDP2.runtime_action`):

- **UNSHARD** (``_perform_action``: ``submodule.unshard(async_op=True)`` for every FSDP module of
  ``stage.submod.modules()``, embedding, layers, head): each unit's all-gather (``FSDPParamGroup.unshard`` ->
  ``foreach_all_gather``: the copy-in, the flat output kept in ``_all_gather_result``). With ``V <= 3`` every
  stage of the rank is UNSHARDed before the first action, so a later stage's all-gather outputs wait, unsharded
  sized, until its first compute.
- **The wait** (``_assert_unsharded`` before each compute action of a stage with pending handles): each unit's
  ``wait_for_unshard``: the unsharded parameters copied out, the all-gather output freed at once (the group is
  not in ``TrainingState.FORWARD`` then: no implicit-prefetch state kept). The stage's forwards and backwards
  then find every unit unsharded: their hooks all-gather nothing.
- **REDUCE_GRAD** right after the stage's last ``B`` / ``W``: ``perform_reduce_grad`` on that stage's units
  (the end above), so a stage's gradients are reduce-scattered and its parameters resharded while the rank's
  other stages still run backward.
- **RESHARD** (``reshard()``): after REDUCE_GRAD a no-op; with ``V >= 4`` the runtime evicts a stage mid-step
  (its unsharded parameters freed; its accumulated unsharded gradients stay) and UNSHARDs it again later.
- **Zero bubble**: a unit's post-backward hook (``RegisterPostBackwardFunction`` on its inputs) fires in the
  micro-batch's ``I`` (the input gradient passes it), before ``W`` makes the weights' gradients
  (``stage_backward_weight``: ``weight.grad = dw`` or ``+=``): the previous micro-batch's gradients are folded
  into the ``reduce_dtype`` accumulator then, and the last ``W``'s by REDUCE_GRAD's
  ``accumulate_unsharded_grad_if_needed``.
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.pp_lowering import REDUCE_GRAD, RESHARD, UNSHARD
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.fsdp import FSDP2, Unit
from memcalc.engine.sim import Param, Sim, T


class PipelineFSDP2(FSDP2):
    """One pipeline rank's FSDP2 runtime (module docstring); :class:`memcalc.engine.pipeline.RankStep` calls
    :meth:`unit_forward`, :meth:`stage_backward_start`, :meth:`stage_backward_end` and :meth:`reduce_all`."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, params: list[Param], shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(sim, exp, params, shapes)
        root = self.root
        pick = list(zip(root.params, root.shard_numels, strict=True))
        emb = [(p, s) for p, s in pick if p.name.startswith("embed_")]
        head = [(p, s) for p, s in pick if not p.name.startswith("embed_")]
        self.embed = Unit(None, [p for p, _ in emb], [s for _, s in emb]) if emb else None
        self.head = Unit(None, [p for p, _ in head], [s for _, s in head]) if head else None
        self.root = Unit(None, [], [])
        self.acc: dict[str, T] = {}  # FSDPParam.unsharded_accumulated_grad
        self.posted: set[int] = set()  # units whose post-backward ran in this micro-batch's backward
        self.sync = False
        self.by_stage: dict[int, list[Unit]] = {}  # several stages per rank: each stage's units (assign_stages)
        self.stage: Optional[int] = None  # the stage a backward runs on
        self.pending: set[int] = set()  # stages UNSHARDed and not yet waited on (the runtime's unshard_ops)

    def units(self, stage: Optional[int] = None) -> list[Unit]:
        """``_state_ctx.all_states``' order: the embedding, the layers, the head (of ``stage`` only, if given)."""
        if stage is not None and self.by_stage:
            return self.by_stage[stage]
        return [u for u in (self.embed, *self.layers.values(), self.head) if u is not None]

    def assign_stages(self, stages: dict[int, tuple[int, int, bool, bool]]) -> None:
        """Each of the rank's stages (global index -> ``(lo, hi, first, last)``) is its own FSDP root."""
        self.by_stage = {s: [u for u in self.units() if (u is self.embed and first) or (u is self.head and last)
                             or (u.layer is not None and lo <= u.layer < hi)]
                         for s, (lo, hi, first, last) in stages.items()}

    # -- the runtime's FSDP actions (several stages per rank; module docstring) ----------------
    def runtime_action(self, kind: str, stage: int) -> bool:
        """UNSHARD, RESHARD or REDUCE_GRAD of ``stage`` (True), or, before a compute action on it, the wait on its
        pending unshard (``_assert_unsharded``; False: the action still runs)."""
        if kind == UNSHARD:
            for u in self.units(stage):
                self.unshard(u)
            self.pending.add(stage)
        elif kind == RESHARD:
            for u in self.units(stage):
                if not u.resharded:
                    self.reshard(u)
        elif kind == REDUCE_GRAD:
            self.reduce_all(stage)
        else:
            if stage in self.pending:
                self.pending.discard(stage)
                for u in self.units(stage):
                    self.wait_for_unshard(u, forward=False)
            return False
        return True

    # -- forward ------------------------------------------------------------------------
    def unit_forward(self, u: Optional[Unit]) -> None:
        """The embedding's or the head unit's pre-forward (a layer's is :meth:`layer_enter`)."""
        if u is not None:
            self.unshard(u)
            self.wait_for_unshard(u, forward=True)

    # -- backward -----------------------------------------------------------------------
    def stage_backward_start(self, stage: Optional[int] = None) -> None:
        """A micro-batch's backward (or zero bubble's ``I``) starts on ``stage`` (the root, with no parameters,
        has nothing to unshard; the units are unsharded already)."""
        self.in_backward, self.current, self.sync = True, None, False
        self.posted = set()
        self.stage = stage

    def backward_enter(self, layer: Optional[int]) -> None:
        if layer is not None and self.head is not None and id(self.head) not in self.posted:
            self.post_backward(self.head)  # backward left the final norm (its input's post-backward hook)
        super().backward_enter(layer)

    def post_backward(self, u: Unit) -> None:
        if self.sync:
            return super().post_backward(u)
        self.posted.add(id(u))
        sim, pol = self.sim, self.pol
        for p in u.params:
            g = p.unsharded_grad
            if g is None:
                continue
            if p.name in self.acc:  # accumulate_unsharded_grad_if_needed
                sim.unref(g)
                p.unsharded_grad = None
            elif pol.reduce != pol.param:  # to_accumulated_grad_if_needed
                self.acc[p.name] = sim.alloc(pol.reduce.nbytes(p.grad_bytes * 8 // pol.param.bits), "gradients",
                                             "unsharded gradients (FSDP2, accumulated)")
                sim.unref(g)
                p.unsharded_grad = None

    def stage_backward_end(self) -> None:
        """The micro-batch's backward is over: the last layer's post-backward, then the root's final callback
        (every unit not yet post-backwarded: the embedding's input needs no gradient)."""
        if self.current is not None:
            self.post_backward(self.current)
            self.current = None
        for u in self.units(self.stage):  # (the root's own units: its _state_ctx.all_states)
            if id(u) not in self.posted:
                self.post_backward(u)
        self.in_backward = False

    def reduce_all(self, stage: Optional[int] = None) -> None:
        """``perform_reduce_grad`` (of ``stage``): every unit's post-backward with sync (module docstring),
        which first adds a gradient made since the last post-backward (zero bubble's last ``W``) into the
        accumulator (``accumulate_unsharded_grad_if_needed``)."""
        self.sync = True
        for u in self.units(stage):
            for p in u.params:
                if p.name in self.acc:
                    if p.unsharded_grad is not None:
                        self.sim.unref(p.unsharded_grad)
                    p.unsharded_grad = self.acc.pop(p.name)
            self.post_backward(u)
        if self.rs_state is not None:
            self.sim.unref(self.rs_state)
            self.rs_state = None
        self.sync = False


def stage_fsdp2(sim: Sim, exp: ExperimentSpec, model) -> Optional[PipelineFSDP2]:
    """The rank's FSDP2 runtime (its backward hook registered), or None without FSDP2."""
    if not model.fsdp2:
        return None
    gather = PipelineFSDP2(sim, exp, model.order, model.shapes)
    sim.set_on_layer(lambda s, i: gather.backward_enter(i))
    return gather
