"""torchtune 0.6.1's own model for a :class:`~memcalc.core.spec.ModelSpec`: its component builders,
its adapters, its kernel dispatch as CUDA picks it. Used by :mod:`.torchtune`.

- The builders (torchtune/models/llama3_2/_component_builders.py ``llama3_2`` / ``lora_llama3_2``
  for tied embeddings, torchtune/models/llama3_1/_component_builders.py ``llama3_1`` /
  ``lora_llama3_1`` otherwise) with the spec's sizes, under ``training.set_default_dtype(dtype)``
  and ``torch.device`` as the recipes' ``_setup_model`` builds them. ``lora_attn_modules`` /
  ``apply_lora_to_mlp`` / ``apply_lora_to_output`` / ``use_dora`` / ``quantize_base`` come from
  the LoRA spec (``quantize_base``: every linear of every layer is an NF4 ``to_nf4`` weight, the
  LoRA ones in ``LoRALinear``/``DoRALinear``, the others ``FrozenNF4Linear``; the output head is
  not quantized: "quantize_base is not applied to final output_proj currently").
- The RoPE cache: on ``meta`` ``Llama3ScaledRoPE.rope_init`` returns early (``freqs.is_meta``), as
  the sharded recipes build it later; here it is built by the module's own ``rope_init`` on the
  host and its buffers moved to the traced device, so the cache ((max_seq_len, head_dim/2, 2)
  fp32) is there as on a GPU.
- LoRA: ``get_adapter_params`` + ``set_trainable_params`` (lora_finetune_single_device.py
  ``_setup_model``); DoRA: ``initialize_dora_magnitude`` on every module that has it (same place;
  it sets values only, and refuses meta weights, so not on meta).
- :class:`TorchtuneKernels`: :class:`~memcalc.validate.hf_kernels.HFKernels`' SDPA and dropout
  routing, plus ``F.rms_norm`` as CUDA dispatches it (aten/src/ATen/native/layer_norm.cpp
  ``rms_norm_symint``: ``_fused_rms_norm`` on CUDA from PyTorch 2.9 when input and weight have one
  dtype; the composite otherwise, as on meta). torchtune's ``RMSNorm`` calls
  ``F.rms_norm(x.float(), ..., weight=self.scale).to(x.dtype)``, so a 16-bit weight always takes
  the composite.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from memcalc.core.errors import UserError
from memcalc.core.kernels import rmsnorm_for_torch
from memcalc.core.spec import ExperimentSpec, KernelProfile, LoraSpec, ModelSpec

from ..blocks.norm import _FusedRMSNorm
from ..devices import kernel_device
from ..hf_kernels import HFKernels, _in_mode

#: memcalc LoRA target -> torchtune's lora_attn_modules name
ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "output_proj"}
MLP = ("gate", "up", "down")


def model_refusal(m: ModelSpec) -> Optional[str]:
    """Why torchtune's Llama 3 builders cannot build ``m`` (None when they can)."""
    hd = m.head_dim or m.d_model // m.n_heads
    checks = (
        (m.moe is None and m.mla is None, "mixture-of-experts and MLA layers"),
        (m.norm == "rmsnorm" and m.norm_placement == "pre" and m.block == "sequential",
         "a norm other than pre-norm RMSNorm, or parallel blocks"),
        (m.mlp == "gated" and m.activation == "silu", "an MLP other than SwiGLU"),
        (m.positions == "rope" and m.rotary_pct == 1.0, "positions other than full RoPE"),
        (not (m.qkv_bias or m.o_bias or m.mlp_bias or m.lm_head_bias or m.has_norm_bias), "biases"),
        (m.qk_norm == "none" and m.attn_softcap is None and m.logit_softcap is None and not m.attn_sinks,
         "q/k norms, softcaps or attention sinks"),
        (m.sliding_window is None, "sliding-window attention"),
        (not (m.fused_qkv or m.fused_gate_up), "fused qkv or gate_up projections"),
        (m.embedding_scale == 1.0 and m.residual_multiplier == 1.0 and m.logit_scale == 1.0
         and m.residual_scale == 1.0, "embedding, residual or logit scaling"),
        (m.final_norm, "no final norm"),
        (m.resid_dropout == 0 and m.embd_dropout == 0, "residual or embedding dropout"),
        (hd * m.n_heads == m.d_model, f"head_dim {hd} x {m.n_heads} heads != d_model {m.d_model} (the builders "
                                      "take head_dim = embed_dim // num_heads)"),
        (m.n_heads % (m.n_kv_heads or m.n_heads) == 0, "query heads not a multiple of the K/V heads"),
    )
    for ok, what in checks:
        if not ok:
            return (f"--framework torchtune builds Llama 3 decoders (torchtune.models.llama3_2 / llama3_1 component "
                    f"builders): {m.name} has {what}")
    return None


def lora_refusal(lora: LoraSpec, m: ModelSpec) -> Optional[str]:
    """Why torchtune's LoRA builders cannot express ``lora`` (None when they can)."""
    mlp = [t for t in MLP if t in lora.targets]
    if mlp and len(mlp) != len(MLP):
        return (f"--framework torchtune: LoRA targets {','.join(mlp)} without the rest of gate,up,down: torchtune "
                "adapts the MLP whole (apply_lora_to_mlp)")
    if "head" in lora.targets and m.tie_embeddings:
        return ("--framework torchtune: LoRA on the output head of a tied-embedding model: lora_llama3_2 raises "
                "(apply_lora_to_output is not supported when the projection is tied to the embeddings)")
    return None


def _lora_kwargs(lora: LoraSpec) -> dict:
    return dict(lora_attn_modules=[ATTN[t] for t in ("q", "k", "v", "o") if t in lora.targets],
                apply_lora_to_mlp="gate" in lora.targets, apply_lora_to_output="head" in lora.targets,
                lora_rank=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_dora=lora.dora,
                quantize_base=lora.qlora)


def build(m: ModelSpec, lora: Optional[LoraSpec], dtype: torch.dtype, device: str) -> torch.nn.Module:
    """torchtune's TransformerDecoder for ``m`` (see the module docstring), trainable parameters set."""
    from torchtune import training
    from torchtune.models.llama3_1._component_builders import llama3_1, lora_llama3_1
    from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2

    kw = dict(vocab_size=m.vocab_size, num_layers=m.n_layers, num_heads=m.n_heads,
              num_kv_heads=m.n_kv_heads or m.n_heads, embed_dim=m.d_model, max_seq_len=m.max_seq_len,
              intermediate_dim=m.d_ff, attn_dropout=m.attn_dropout, norm_eps=m.norm_eps)
    tied = m.tie_embeddings
    if lora is None:
        builder = llama3_2 if tied else llama3_1
    else:
        builder = lora_llama3_2 if tied else lora_llama3_1
        kw.update(_lora_kwargs(lora))
    if tied:
        kw["tie_word_embeddings"] = True
    with training.set_default_dtype(dtype), torch.device(device):
        model = builder(**kw)
    _build_rope_caches(model, device)
    if lora is not None:
        from torchtune.modules.peft import get_adapter_params, set_trainable_params

        adapters = get_adapter_params(model)
        set_trainable_params(model, adapters)
        # lora_finetune_single_device._setup_model; its values only (the magnitude parameter exists
        # already), and it refuses meta weights: skipped there
        if any("magnitude" in k for k in adapters) and device != "meta":
            for mod in model.modules():
                if hasattr(mod, "initialize_dora_magnitude"):
                    mod.initialize_dora_magnitude()
    return model


def _build_rope_caches(model: torch.nn.Module, device: str) -> None:
    """Each RoPE module's own ``rope_init`` run on the host, its buffers moved to ``device``."""
    for mod in model.modules():
        if hasattr(mod, "rope_init") and not getattr(mod, "is_cache_built", True):
            with torch.device("cpu"):
                mod.rope_init()  # type: ignore[operator]
            for name, buf in list(mod.named_buffers(recurse=False)):
                mod.register_buffer(name, buf.to(device), persistent=False)


def check_spec(exp: ExperimentSpec) -> None:
    """The model and LoRA refusals as one-line UserErrors."""
    why = model_refusal(exp.model)
    if why is None and exp.training.lora is not None:
        why = lora_refusal(exp.training.lora, exp.model)
    if why:
        raise UserError(why)


class TorchtuneKernels(HFKernels):
    """:class:`HFKernels` plus ``F.rms_norm`` as CUDA dispatches it (see the module docstring)."""

    def __init__(self, profile: KernelProfile) -> None:
        super().__init__(profile)
        self.fused_rms = rmsnorm_for_torch(profile.torch_version) == "fused"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.rms_norm:
            return self.rms_norm(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    def rms_norm(self, input, normalized_shape, weight=None, eps=None):
        same = weight is None or weight.dtype == input.dtype
        if self.fused_rms and same and kernel_device(input) == "meta" and len(normalized_shape) == 1:
            return _FusedRMSNorm.apply(input, weight, eps if eps is not None else torch.finfo(input.dtype).eps)
        return F.rms_norm(input, normalized_shape, weight, eps)


def recompute_in_mode(model: torch.nn.Module, mode: TorchtuneKernels) -> None:
    """Each ``CheckpointWrapper``'s recomputation run with the kernel routing on: backward is called
    inside the mode's handler, where the mode is off (as :func:`~..hf_kernels.hf_patches` does for
    transformers' checkpointed layers)."""
    for mod in model.modules():
        fn = mod.__dict__.get("checkpoint_fn")
        if fn is not None:
            mod.__dict__["checkpoint_fn"] = _routed(fn, mode)


def _routed(fn, mode: TorchtuneKernels):
    def checkpoint_fn(function, *a, **kw):
        return fn(_in_mode(function, mode), *a, **kw)
    return checkpoint_fn
