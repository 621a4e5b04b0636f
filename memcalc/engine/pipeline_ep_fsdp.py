"""Pipeline x expert parallelism x FSDP2 (``--pp`` with ``--ep`` and ``--gpus N --zero 2|3``): torchtitan 0.3.0's
default layout for its MoE models, one pipeline rank's FSDP2 runtime (validate/sharded/pipeline_ep_fsdp.py traces
the same with torchtitan's own ``apply_fsdp_to_decoder``).

It is :class:`memcalc.engine.pipeline_fsdp.PipelineFSDP2` (no reshard after forward, no-sync backwards that
accumulate the unsharded gradients, one ``perform_reduce_grad`` at the end) over the units of
:class:`memcalc.engine.expert_fsdp.EPFSDP2`:

- **Two parameter groups per MoE layer** (torchtitan 0.3.0 ``distributed/fsdp.py`` ``apply_fsdp_to_decoder``,
  ``ep_degree > 1``: ``shard_placement_fn`` gives the routed experts ``edp_mesh``'s mesh info, the rest
  ``dp_mesh``'s; torch 2.13 ``_fsdp_init.py`` makes one ``FSDPParamGroup`` per mesh): the layer's other
  parameters over the ``gpus`` data-parallel ranks, its experts over ``efsdp = gpus / ep``
  (:func:`memcalc.engine.expert_fsdp.fsdp_shard_numel`: ``Shard(0)``, or ``Shard(1)`` when ``efsdp x ep``
  exceeds the experts). Each group is all-gathered, kept unsharded, accumulates its gradients and is
  reduce-scattered over its own mesh; ``perform_reduce_grad`` (torch 2.13 pipelining/stage.py) runs
  ``post_backward`` on every state's ``_fsdp_param_groups`` in turn (dense first, then experts).
- **Explicit prefetching for EP** (``apply_fsdp_to_decoder``'s tail, "D2H syncs in EP could interfere with
  implicit prefetching"): the embedding prefetches the stage's first layer, each layer the next, the stage's
  last layer the final norm and head unit (``set_modules_to_forward_prefetch``); backward prefetches the other
  way (``lm_head`` the last layer, each layer the one before, layer 0 the embedding). Under pipelining every unit
  stays unsharded from its first all-gather (micro-batch 0's forward) to the end, so only that forward's
  all-gather buffers move; the backward prefetches find every unit unsharded and do nothing.
"""

from __future__ import annotations

from typing import Optional

from memcalc.engine.expert_fsdp import EPFSDP2, fsdp_shard_numel, shard1_cat
from memcalc.engine.fsdp import Unit
from memcalc.core.spec import ExperimentSpec
from memcalc.engine import pipeline_fsdp
from memcalc.engine.pipeline_fsdp import PipelineFSDP2
from memcalc.engine.sim import Sim


class PipelineEPFSDP2(PipelineFSDP2, EPFSDP2):
    """One pipeline rank's FSDP2 runtime with expert parallelism (module docstring). The MRO runs
    :class:`PipelineFSDP2`'s no-sync / reduce-at-the-end rules over :class:`EPFSDP2`'s per-layer groups and
    their meshes."""

    def units(self, stage: Optional[int] = None) -> list[Unit]:
        """``_state_ctx.all_states``' order, each state's ``_fsdp_param_groups`` in turn: the embedding, each
        layer's groups (dense, experts), the head (of ``stage`` only, if given: :meth:`PipelineFSDP2.units`)."""
        if stage is not None and self.by_stage:
            return self.by_stage[stage]
        groups = [u for i in self._layer_ids() for u in self.groups[i]]
        return [u for u in (self.embed, *groups, self.head) if u is not None]

    def unit_forward(self, u: Optional[Unit]) -> None:
        """The embedding's or the head unit's pre-forward; the embedding then prefetches the stage's first
        layer (``tok_embeddings.set_modules_to_forward_prefetch([transformer_blocks[0]])``)."""
        super().unit_forward(u)
        if u is not None and u is self.embed and self.groups:
            for g in self.groups[self._layer_ids()[0]]:
                self.unshard(g)

    def layer_enter(self, i: int) -> None:
        super().layer_enter(i)
        if not self.in_backward and i == self._layer_ids()[-1] and self.head is not None:
            self.unshard(self.head)  # the last block prefetches [norm, lm_head]

    def stage_backward_start(self, stage: Optional[int] = None) -> None:
        super().stage_backward_start(stage)
        self.current_groups = None

    def stage_backward_end(self) -> None:
        """The last layer's groups' post-backward (no sync), then the root's final callback."""
        self.finish_current_groups()
        super().stage_backward_end()

    def _layer_ids(self) -> list[int]:
        """The stage's decoder layers, in order."""
        return sorted(i for i in self.groups if i is not None)


class PipelineShard1FSDP2(PipelineFSDP2):
    """Without expert parallelism, FSDP2 over more data-parallel ranks than an MoE layer's routed experts: torchtitan
    0.3.0's ``apply_fsdp_to_decoder`` (``ep_degree == 1``, ``efsdp_ep_size = fsdp mesh size > num_experts``) gives the
    layer's one ``fully_shard`` a ``shard_placement_fn`` putting the experts on dim 1 (``Shard(1)``, "to avoid
    padding"), on the same mesh: one parameter group per layer as for a dense one, the experts' shards
    ``n_experts x ceil(d / gpus) x ...`` (:func:`memcalc.engine.expert_fsdp.fsdp_shard_numel`), and each all-gather's
    copy-out making an ``empty_like`` temporary of every ``Shard(1)`` parameter before its dim-1 chunk-cat
    (torch 2.13 ``_fsdp_collectives.py`` ``foreach_all_gather_copy_out``)."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, params: list, shapes: dict) -> None:
        assert exp.model.moe is not None
        self.n_experts = exp.model.moe.n_experts
        super().__init__(sim, exp, params, shapes)

    def _unit(self, layer, ps, shapes) -> Unit:
        u = super()._unit(layer, ps, shapes)
        u.shard_numels = [fsdp_shard_numel(shapes[p.name], "experts", self.n, 1, self.n_experts, True)
                          if ".moe.experts." in p.name else s for p, s in zip(ps, u.shard_numels, strict=True)]
        return u

    def wait_for_unshard(self, u: Unit, forward: bool) -> None:
        temps = [self.sim.alloc(self.n * self._param_dtype_bytes(p, s), "temporaries", "all-gather buffers (FSDP2)")
                 for p, s in zip(u.params, u.shard_numels, strict=True) if ".moe.experts." in p.name] \
            if u.ag_out is not None else []
        super().wait_for_unshard(u, forward)
        for t in temps:
            self.sim.unref(t)

    def _reduce_loop(self, with_grad: list):
        """The reduce's ``Shard(1)`` copies of the experts' gradients
        (:func:`memcalc.engine.expert_fsdp.shard1_cat`)."""
        return shard1_cat(self.sim, with_grad, lambda p: ".moe.experts." in p.name)


def stage_fsdp2(sim: Sim, exp: ExperimentSpec, model) -> Optional[PipelineFSDP2]:
    """The rank's FSDP2 runtime: :class:`PipelineEPFSDP2` with ``--ep``, :class:`PipelineShard1FSDP2` for experts
    on dim 1 without it, else :func:`memcalc.engine.pipeline_fsdp.stage_fsdp2`'s (None without FSDP2)."""
    tr, moe = exp.training, exp.model.moe
    if model.fsdp2 and tr.ep == 1 and moe is not None and tr.gpus > moe.n_experts:
        shard1 = PipelineShard1FSDP2(sim, exp, model.order, model.shapes)
        sim.set_on_layer(lambda s, i: shard1.backward_enter(i))
        return shard1
    if not model.fsdp2 or tr.ep == 1:
        return pipeline_fsdp.stage_fsdp2(sim, exp, model)
    gather = PipelineEPFSDP2(sim, exp, model.order, model.shapes)
    sim.set_on_layer(lambda s, i: gather.backward_enter(i))
    return gather
