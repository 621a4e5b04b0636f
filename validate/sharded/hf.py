"""The Hugging Face model (transformers + PEFT) as the sharded trace's model (``framework="hf"``).

Built as ``validate/hf_runner.py`` builds it (:func:`~..hf_model.build_hf_model`:
``AutoModelForCausalLM.from_config`` under ``FakeTensorMode`` on ``meta``; checkpointing through
``activation_checkpointing_enable`` as HF Trainer calls it), then FSDP2 ``fully_shard`` on every
decoder layer (the model's ``ModuleList`` of ``n_layers`` modules) and the root, as for the replica
(``fsdp2.py``). The step is HF's: ``model(input_ids=ids, labels=labels).loss`` inside the emulated
autocast region, with :class:`~..hf_kernels.HFKernels` and :func:`~..hf_kernels.hf_patches` active
(kernel dispatch only). FSDP1 (``sharding="fsdp1"``): the model built on ``meta`` as for FSDP2, its
parameters made fake ``cpu`` tensors (:func:`_to_empty_cpu`), then ``FullyShardedDataParallel`` with PEFT's
``fsdp_auto_wrap_policy`` (:func:`apply_fsdp1_hf`); QLoRA under FSDP1 as PEFT's FSDP + QLoRA recipe builds
it (bf16 quant storage, no k-bit fp32 cast; :mod:`.hf_fsdp1_qlora`). QLoRA under FSDP2 is built the same way
(real ``meta``: ``Params4bit`` cannot wrap a fake tensor; bf16 quant storage, as PEFT's FSDP + QLoRA recipe
loads it; the views keep their ``quant_state``), then ``fully_shard``-ed; with the profile's ``qlora_fp32_cast``
PEFT's ``prepare_model_for_kbit_training`` runs first (``fully_shard`` shards each parameter in its own dtype, so
FSDP2, unlike FSDP1, takes the fp32 norms, embedding and head beside the bf16 storage).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec

from ..amp import Amp
from ..model import torch_dtype


def build_hf_sharded(exp: ExperimentSpec, m, plan, fake, mesh, zero: int, sharding: str):
    """(model, decoder layers, params count): the HF model on fake ``meta``, wrapped by FSDP2, moved to cpu."""
    from ..hf_model import build_hf_model, param_counts
    from ..hf_runner import _decoder_layers, hf_unsupported
    from .fsdp2 import RESHARD_AFTER_FORWARD

    fsdp1_qlora = sharding == "fsdp1" and exp.training.lora is not None and exp.training.lora.qlora
    if fsdp1_qlora:
        from .hf_fsdp1_qlora import check

        check(exp)
    why = hf_unsupported(exp.model_copy(update={"training": exp.training.model_copy(update={"gpus": 1, "zero": 0})}),
                         "meta")
    if why:
        raise UserError(why)
    tr = plan.build
    from torch.distributed.fsdp import fully_shard

    dtype = torch_dtype(tr.weight_dtype.value)
    # a 4-bit base under FSDP1: quantized on real meta (Params4bit cannot wrap a fake tensor), storage in the
    # model's dtype (FSDP1 flattens floating tensors of one dtype), then made fake cpu tensors below
    qlora = exp.training.lora is not None and exp.training.lora.qlora
    with (contextlib.nullcontext() if qlora else fake), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model, _family = build_hf_model(m, tr.lora, dtype, "meta", compute_dtype=torch_dtype(tr.compute_dtype.value),
                                        quant_storage=dtype if qlora else None,
                                        kbit_prepare=qlora and not fsdp1_qlora and exp.profile.qlora_fp32_cast)
    if tr.checkpoint in ("full", "every-k"):
        every = tr.checkpoint_every if tr.checkpoint == "every-k" else 1
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=every)
    params = param_counts(model)[0]
    layers = list(_decoder_layers(model, m.n_layers))
    if len(layers) != m.n_layers:
        raise UserError(f"--framework hf: could not find the {m.n_layers} decoder layers of {m.name} to shard")
    if sharding == "fsdp1":
        with fake:
            if fsdp1_qlora:
                from .hf_fsdp1_qlora import to_fake_cpu

                to_fake_cpu(model)
            else:
                _to_empty_cpu(model)
            return apply_fsdp1_hf(model, mesh, zero, plan, layers), layers, params
    from .fsdp2 import upcast_trainable

    if qlora:  # built on real meta (Params4bit cannot wrap a fake tensor): fake cpu tensors, as under FSDP1
        from .hf_fsdp1_qlora import to_fake_cpu

        with fake:
            to_fake_cpu(model)
    upcast_trainable(model, plan)  # (PEFT's adapters are fp32 already: autocast_adapter_dtype)
    policy = plan.policy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=RESHARD_AFTER_FORWARD[zero], mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if not qlora:
        with fake:
            model.to_empty(device="cpu")
    return model, layers, params


def _to_empty_cpu(model) -> None:
    """``model.to_empty(device="cpu")`` for a fake model on ``meta``, parameter by parameter: ``_apply``
    always swaps a fake parameter and fails ("Couldn't swap"), so each parameter and buffer is replaced
    by an uninitialised ``cpu`` one of its shape, dtype and ``requires_grad`` (tied weights stay tied).
    FSDP1 then flattens plain (fake) cpu tensors, as the replica's (runner.py)."""
    import torch.nn as nn

    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = done.setdefault(id(b), torch.empty_like(b, device="cpu"))


def apply_fsdp1_hf(model, mesh, zero: int, plan, layers):
    """FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=False``) over the HF model as accelerate wraps
    it: with PEFT, ``peft.utils.other.fsdp_auto_wrap_policy(model)`` (every leaf module whose weight requires
    grad, i.e. each LoRA ``lora_A`` / ``lora_B``, its own unit, and the model's ``_no_split_modules``
    decoder layers); without, the decoder layers (``ModuleWrapPolicy``); the root holds the rest."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from .fsdp1 import STRATEGIES

    if any(not p.requires_grad for p in model.parameters()):
        from peft.utils.other import fsdp_auto_wrap_policy

        wrap = fsdp_auto_wrap_policy(model)
    else:
        wrap = ModuleWrapPolicy({type(layers[0])})
    mp = None
    if plan.param_dtype is not None:
        mp = MixedPrecision(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    return FSDP(model, process_group=mesh.get_group(), sharding_strategy=getattr(ShardingStrategy, STRATEGIES[zero]),
                auto_wrap_policy=wrap, mixed_precision=mp, use_orig_params=False, limit_all_gathers=True,
                device_id=torch.device("cpu"))


def hf_step_parts(exp: ExperimentSpec, model, layers, set_label: Callable[[str], None]):
    """(forward: ids, labels -> loss, a context for the steps, hooks to remove)."""
    from ..hf_kernels import HFKernels, hf_patches

    tr = exp.training
    amp = Amp(torch_dtype(tr.compute_dtype.value) if tr.is_amp else None)
    hooks = [layer.register_forward_pre_hook(lambda *_a, i=i: set_label(f"layer {i}")) for i, layer in enumerate(layers)]
    head = model.get_output_embeddings()
    if head is not None:
        hooks.append(head.register_forward_pre_hook(lambda *_a: set_label("head & loss")))
    kernels = HFKernels(exp.profile, amp)

    def forward(ids, labels):
        with amp.region():
            return model(input_ids=ids, labels=labels).loss

    stack = contextlib.ExitStack()
    if tr.lora is not None and tr.lora.qlora:
        from .hf_fsdp1_qlora import fake_views_keep_state

        stack.enter_context(fake_views_keep_state())
    stack.enter_context(hf_patches(model, kernels))
    stack.enter_context(kernels)
    return forward, stack, hooks


__all__ = ["build_hf_sharded", "hf_step_parts"]
