"""Cut Cross-Entropy (``--kernels cce``, axolotl's ``cut_cross_entropy: true``): which models its transformers
patch applies to and which training setups memcalc models it with. The estimator
(:mod:`memcalc.engine.blocks.cce`) and the validator (``validate/hf_cce.py``) both read these.

Source: apple/ml-cross-entropy. The installed cut-cross-entropy 25.1.1 wheel ships the kernels
(``cut_cross_entropy/cce.py`` ``LinearCrossEntropyFunction`` and its Triton launchers) but not the
``cut_cross_entropy.transformers`` package; its patch is read from the repository at 1f3ebdb (24.12.1, the
commit whose cce.py the 25.1.1 wheel matches up to whitespace and docstrings):
``transformers/patch.py`` ``cce_patch(model_type_or_model, impl="cce", reduction="mean")`` dispatches on
``model_type`` (``match model_type: case "llama" | "phi3" | "gemma2" | "mistral"``, else ``RuntimeError(f"Unknown
model type {model_type}")``) and each ``patch_<family>`` sets the CausalLM's ``forward`` to its ``cce_forward``:
the decoder's hidden states go straight to ``linear_cross_entropy(hidden_states, self.lm_head.weight,
labels.to(hidden_states.device), shift=True, impl=..., reduction=...)``; no logits tensor exists.
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import ModelSpec, TrainingSpec

#: ``cce_patch``'s families (transformers/patch.py ``match model_type``)
CCE_PATCH_FAMILIES = ("llama", "phi3", "gemma2", "mistral")
#: the ones memcalc models: gemma2's ``cce_forward`` passes ``softcap=self.config.final_logit_softcapping``, whose
#: ``softcapping`` (utils.py, a torch.compile'd tanh on the gathered logits) is not modelled
CCE_FAMILIES = ("llama", "phi3", "mistral")


def check_cce_model_type(model_type: str) -> None:
    """The validator's refusal of a family ``cce_patch`` does not patch (or memcalc does not model)."""
    if model_type not in CCE_FAMILIES:
        why = ("cut_cross_entropy's cce_patch has no patch for it (transformers/patch.py: "
               f"{', '.join(CCE_PATCH_FAMILIES)})" if model_type not in CCE_PATCH_FAMILIES
               else "its final-logit softcapping is not modelled")
        raise UserError(f"--kernels cce: model_type {model_type} is not modelled ({why}); modelled: "
                        f"{', '.join(CCE_FAMILIES)}")


def check_cce(m: ModelSpec, tr: Optional[TrainingSpec] = None) -> None:
    """A one-line UserError for a model or training setup CCE is not modelled with (both sides call this)."""
    if m.logit_softcap is not None or m.logit_scale != 1.0 or m.moe is not None or m.mla is not None:
        raise UserError(f"--kernels cce: {m.name} is none of the families whose Cut Cross-Entropy patch memcalc "
                        f"models ({', '.join(CCE_FAMILIES)}: a dense model, no final-logit softcap or scale)")
    if tr is None:
        return
    if tr.lora is not None and tr.lora.qlora:
        raise UserError("--kernels cce with QLoRA is not modelled yet (PEFT's prepare_model_for_kbit_training makes "
                        "the head fp32); use LoRA")
    if tr.tp > 1 or tr.zero == 3 or tr.compile:
        raise UserError("--kernels cce with tensor parallelism, ZeRO-3 or torch.compile is not modelled (the loss "
                        "reads the whole lm_head weight, outside the model's gathers and graphs)")
    if tr.is_amp or tr.compute_dtype.value == "fp32":
        raise UserError("--kernels cce needs 16-bit hidden states without autocast: cut_cross_entropy's backward "
                        "asserts bf16/fp16 embeddings (cce_backward.py cce_backward_kernel); use --precision bf16 "
                        "or fp16")
    if tr.lora is not None and "head" in tr.lora.targets:
        raise UserError("--kernels cce: the loss reads lm_head.weight directly (cce_forward), so a LoRA adapter on "
                        "the head is bypassed; drop the head from the LoRA targets")
