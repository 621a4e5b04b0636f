"""Pipeline x expert parallelism x FSDP2 (``--pp`` with ``--ep`` and ``--gpus N --zero 2|3``), torchtitan
0.3.0's default layout for its MoE models, traced by :func:`.pipeline_fsdp.trace_pp_fsdp_rank`.

The mesh is torchtitan's sparse mesh (``distributed/parallel_dims.py`` ``_build_mesh``: ``("pp",
"dp_replicate", "efsdp", "ep")``, here without ``dp_replicate``): ``(pp, gpus / ep, ep)``, the traced rank at
``efsdp`` and ``ep`` coordinate 0 of pipeline rank ``r``. As ``parallelize_deepseekv3`` runs on each model
part: the experts are sharded over ``ep`` first (:func:`.ep_dispatch.shard_experts`, torchtitan's all-to-all
dispatcher), then torchtitan's own ``apply_fsdp_to_decoder`` with ``ep_degree = ep`` and ``edp_mesh`` the
``efsdp`` dimension (:func:`.pipeline_fsdp.apply_fsdp_stage`): every MoE layer one ``fully_shard`` whose
``shard_placement_fn`` puts the routed experts on the ``efsdp`` mesh (``Shard(0)``, ``Shard(1)`` when
``efsdp x ep`` exceeds the experts) and the layer's other parameters on the dense data-parallel mesh (the
flattened ``efsdp x ep``, torchtitan's ``fsdp`` of ``gpus`` ranks), and its explicit prefetching for EP.
"""

from __future__ import annotations

import types

import torch.nn as nn


def moe_aliases(dec: nn.Module) -> None:
    """Give the replica's MoE layers the names torchtitan 0.3.0's ``apply_fsdp_to_decoder`` reads:
    ``transformer_block.moe_enabled``, ``transformer_block.moe.routed_experts.inner_experts`` (the module
    holding the routed experts' weights: the replica's ``Experts``) and its ``num_experts`` (the global count:
    torchtitan's ``GroupedExperts`` keeps its config's, its weights being ``Shard(0)`` DTensors of the
    ``ep`` mesh). Plain attributes: no module is registered twice."""
    from ..blocks.moe import Experts

    for layer in dec.layers:  # type: ignore[union-attr]
        moe = getattr(layer, "moe", None)
        experts = getattr(moe, "experts", None)
        if not isinstance(experts, Experts):
            continue
        layer.__dict__["moe_enabled"] = True
        moe.__dict__["routed_experts"] = types.SimpleNamespace(inner_experts=experts)
        experts.__dict__["num_experts"] = experts.n
