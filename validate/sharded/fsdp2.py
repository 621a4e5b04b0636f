"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied as torchtitan applies it.

``fully_shard`` on every decoder layer, then on the root module (embedding, final norm, head and
anything left), on a 1-D mesh (torchtitan ``parallelize_llama`` ``apply_fsdp``, and the FSDP2
tutorial). The unit of each all-gather and reduce-scatter is one layer's parameters; the root
unit holds the rest.

- ``zero`` 3: the layers get ``reshard_after_forward=True``: each layer frees its unsharded
  parameters after its forward and all-gathers them again in backward; ``zero`` 2: ``False``: they
  stay from forward to the end of that layer's backward
  (``torch/distributed/fsdp/_fully_shard/_fully_shard.py`` ``fully_shard`` docstring).
- The root gets FSDP2's default (``reshard_after_forward=None``), as torchtitan's
  ``fully_shard(model, **fsdp_config)`` does: a root so left is never resharded after forward
  (``_fsdp_state.py`` ``FSDPState._lazy_init``: "For the root, do not reshard after forward since
  for training, the parameters would be freed and all-gathered immediately"), so its unsharded
  parameters (embedding, final norm, head) live from the first forward to the end of backward.
- Precision (``precision_plan``): ``fp32`` everything fp32; pure ``bf16``: the model built in bf16,
  no policy; ``bf16`` with ``master_weights``: fp32 shards of the trainable parameters, gradient shards
  and optimizer state,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (torchtitan's default
  ``mixed_precision_param="bfloat16"``, ``mixed_precision_reduce="float32"``): parameters are
  all-gathered in bf16 (``_fsdp_param.py`` ``FSDPParam.init_all_gather_outputs`` with
  ``param_dtype``), the unsharded bf16 gradients are cast to fp32 before the reduce-scatter
  (``_fsdp_collectives.py`` ``foreach_reduce``). Autocast precisions (``amp-*``) keep fp32 weights
  and no policy (the model casts itself, ``amp.py``).
- With LoRA and ``master_weights`` the model is built in the 16-bit dtype and only the trainable
  parameters are cast up to fp32 before ``fully_shard`` (:func:`upcast_trainable`), as accelerate 1.15
  ``utils/fsdp_utils.py`` ``fsdp2_prepare_model`` does ("FSDP2 requires uniform orig_dtype among
  trainable params in each group. Upcast to fp32 master weights": ``param.requires_grad and
  param.dtype != torch.float32``): the frozen base keeps 16-bit shards. FSDP2 allows it: torch 2.13
  ``_fsdp_param_group.py`` ``_init_mp_dtypes`` asks one original dtype of the trainable parameters
  only, and ``_fsdp_param.py`` ``init_dtype_attrs`` clears ``param_dtype`` where it equals the
  original dtype (the frozen base is all-gathered as it is, without the cast copy-in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from memcalc.core.spec import TrainingSpec

#: what ``--zero`` means under FSDP2
RESHARD_AFTER_FORWARD = {3: True, 2: False}


@dataclass(frozen=True)
class PrecisionPlan:
    """How the model is built and wrapped for a TrainingSpec's precision."""

    build: TrainingSpec  # the spec the model is built from (its weight dtype is the shards')
    param_dtype: Optional[torch.dtype]  # MixedPrecisionPolicy.param_dtype (None: no policy)
    reduce_dtype: Optional[torch.dtype]
    name: str  # what the record says ran

    def policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


def precision_plan(tr: TrainingSpec, sharding: str = "fsdp2") -> PrecisionPlan:
    """The precision mapping of the module docstring (``sharding`` fsdp1: every parameter fp32 under
    ``master_weights``, LoRA or not: FSDP1's flat parameters are one dtype each)."""
    p = tr.precision
    if tr.master_weights and p in ("bf16", "fp16"):
        low = torch.bfloat16 if p == "bf16" else torch.float16
        if tr.lora is not None and sharding == "fsdp2":  # the frozen base 16-bit, the adapters cast up
            return PrecisionPlan(tr.model_copy(update={"master_weights": False}), low, torch.float32,
                                 f"MixedPrecisionPolicy(param_dtype={p}, reduce_dtype=fp32) over fp32 shards of "
                                 f"the trainable parameters, {p} shards of the frozen base")
        build = tr.model_copy(update={"precision": "fp32", "master_weights": False})
        return PrecisionPlan(build, low, torch.float32,
                             f"MixedPrecisionPolicy(param_dtype={p}, reduce_dtype=fp32) over fp32 shards")
    if p.startswith("amp-"):
        return PrecisionPlan(tr, None, None, f"autocast {p[4:]} (emulated) over fp32 shards, no policy")
    return PrecisionPlan(tr, None, None, f"pure {p}: {p} shards, no policy")


def upcast_trainable(model: nn.Module, plan: PrecisionPlan) -> None:
    """Under a mixed-precision policy, every trainable parameter not fp32 cast to fp32 in place
    (accelerate 1.15 ``fsdp2_prepare_model``: ``param.data = param.data.to(torch.float32)``); the
    frozen ones keep their dtype. Nothing to do without a policy or on an fp32 build."""
    if plan.param_dtype is None:
        return
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


def apply_fsdp2(model: nn.Module, mesh, zero: int, plan: PrecisionPlan) -> None:
    """``fully_shard`` each of ``model.layers`` and the root (see the module docstring), the trainable
    parameters cast up first (:func:`upcast_trainable`)."""
    from torch.distributed.fsdp import fully_shard

    upcast_trainable(model, plan)
    reshard = RESHARD_AFTER_FORWARD[zero]
    policy = plan.policy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: FSDP2's default, kept unsharded (docstring)
