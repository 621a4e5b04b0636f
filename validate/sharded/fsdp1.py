"""FSDP1 (``FullyShardedDataParallel``) with one unit per decoder layer and the root.

``ModuleWrapPolicy({DecoderLayer})`` wraps every layer; the outer ``FullyShardedDataParallel``
is the root unit (embedding, final norm, head). ``zero`` 3: ``ShardingStrategy.FULL_SHARD``
(parameters resharded after forward and all-gathered again in backward); ``zero`` 2:
``SHARD_GRAD_OP`` (kept unsharded from forward to backward), as
``torch/distributed/fsdp/api.py`` ``ShardingStrategy`` defines them. Each unit flattens its
parameters into one ``FlatParameter`` (``_flat_param.py``); the unsharded flat parameter is
allocated and freed by ``UntypedStorage.resize_`` (``_alloc_storage`` / ``_free_storage``), which
the rank tracer follows. ``use_orig_params=False`` (FSDP1's default): the optimizer steps the
flat shards, and ``zero_grad(set_to_none=True)`` frees the flat gradient shard. (With
``use_orig_params=True`` FSDP1 keeps the flat gradient shard until the next forward's
``_reset_flat_param_grad_info_if_needed``, and ``SHARD_GRAD_OP`` fails its
``_writeback_orig_params`` assertion in torch 2.13, on real CPU tensors too.)

Precision: the same plan as FSDP2 (``fsdp2.precision_plan``); bf16 with master weights is
``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 shards. FSDP1 calls
``record_stream`` on CUDA only, so on a GPU some frees can come later than this trace shows
(FSDP2 frees by reference).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .fsdp2 import PrecisionPlan

#: what ``--zero`` means under FSDP1
STRATEGIES = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP"}


def apply_fsdp1(model: nn.Module, mesh, zero: int, plan: PrecisionPlan) -> nn.Module:
    """The FSDP1-wrapped model (a new root module; call inside the fake mode the model was built in)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ..model import DecoderLayer

    mp = None
    if plan.param_dtype is not None:
        mp = MixedPrecision(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    return FSDP(model, process_group=mesh.get_group(), sharding_strategy=getattr(ShardingStrategy, STRATEGIES[zero]),
                auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}), mixed_precision=mp, use_orig_params=False,
                limit_all_gathers=True, device_id=torch.device("cpu"))
