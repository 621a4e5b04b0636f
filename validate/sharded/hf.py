"""The Hugging Face model (transformers + PEFT) as the sharded trace's model (``framework="hf"``).

Built as ``validate/hf_runner.py`` builds it (:func:`~..hf_model.build_hf_model`:
``AutoModelForCausalLM.from_config`` under ``FakeTensorMode`` on ``meta``; checkpointing through
``activation_checkpointing_enable`` as HF Trainer calls it), then FSDP2 ``fully_shard`` on every
decoder layer (the model's ``ModuleList`` of ``n_layers`` modules) and the root, as for the replica
(``fsdp2.py``). The step is HF's: ``model(input_ids=ids, labels=labels).loss`` inside the emulated
autocast region, with :class:`~..hf_kernels.HFKernels` and :func:`~..hf_kernels.hf_patches` active
(kernel dispatch only). FSDP1 is not built for HF models here.
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

    if sharding != "fsdp2":
        raise UserError("--framework hf with --sharding fsdp1: the sharded trace wraps the Hugging Face model with "
                        "FSDP2 only; use --framework plain for FSDP1")
    why = hf_unsupported(exp.model_copy(update={"training": exp.training.model_copy(update={"gpus": 1, "zero": 0})}),
                         "meta")
    if why:
        raise UserError(why)
    tr = plan.build
    from torch.distributed.fsdp import fully_shard

    with fake, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model, _family = build_hf_model(m, tr.lora, torch_dtype(tr.weight_dtype.value), "meta")
    if tr.checkpoint in ("full", "every-k"):
        every = tr.checkpoint_every if tr.checkpoint == "every-k" else 1
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=every)
    params = param_counts(model)[0]
    layers = list(_decoder_layers(model, m.n_layers))
    if len(layers) != m.n_layers:
        raise UserError(f"--framework hf: could not find the {m.n_layers} decoder layers of {m.name} to shard")
    policy = plan.policy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=RESHARD_AFTER_FORWARD[zero], mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    with fake:
        model.to_empty(device="cpu")
    return model, layers, params


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
    stack.enter_context(hf_patches(model, kernels))
    stack.enter_context(kernels)
    return forward, stack, hooks


__all__ = ["build_hf_sharded", "hf_step_parts"]
