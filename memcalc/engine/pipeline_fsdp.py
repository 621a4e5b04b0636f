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
"""

from __future__ import annotations

from typing import Optional

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

    def units(self) -> list[Unit]:
        """``_state_ctx.all_states``' order: the embedding, the layers, the head."""
        return [u for u in (self.embed, *self.layers.values(), self.head) if u is not None]

    # -- forward ------------------------------------------------------------------------
    def unit_forward(self, u: Optional[Unit]) -> None:
        """The embedding's or the head unit's pre-forward (a layer's is :meth:`layer_enter`)."""
        if u is not None:
            self.unshard(u)
            self.wait_for_unshard(u, forward=True)

    # -- backward -----------------------------------------------------------------------
    def stage_backward_start(self) -> None:
        """A micro-batch's backward starts (the root, with no parameters, has nothing to unshard; the units
        are unsharded already)."""
        self.in_backward, self.current, self.sync = True, None, False
        self.posted = set()

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
        for u in self.units():
            if id(u) not in self.posted:
                self.post_backward(u)
        self.in_backward = False

    def reduce_all(self) -> None:
        """``perform_reduce_grad``: every unit's post-backward with sync (module docstring)."""
        self.sync = True
        for u in self.units():
            for p in u.params:
                if p.name in self.acc:
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
