"""Named kernel profiles: what a PyTorch version's kernels and a framework's layers save.

The reference configs pin ``torch-2.8-cuda``, the build the published table was
measured with. Choose another with ``--profile``; every field can also be set in
a config file's ``profile:`` mapping. The plain-PyTorch profiles take their RMSNorm from
:data:`memcalc.core.kernels.RMSNORM_BY_TORCH` (the table the validator follows too).
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.errors import UserError, unknown_name
from memcalc.core.kernels import rmsnorm_for_torch
from memcalc.core.spec import LOSSES, KernelProfile

PROFILES: dict[str, KernelProfile] = {
    p.name: p
    for p in (
        # PyTorch 2.8 on CUDA with plain PyTorch layers (nn.RMSNorm composite with the weight
        # multiply in fp32; loss on model-dtype logits with a shifted contiguous copy). The
        # reference experiment's build (Forgather's layers).
        KernelProfile(name="torch-2.8-cuda", torch_version="2.8", rmsnorm=rmsnorm_for_torch("2.8")),
        # PyTorch 2.9+: nn.RMSNorm dispatches to the fused _fused_rms_norm kernel on CUDA.
        KernelProfile(name="torch-2.9-cuda", torch_version="2.9", rmsnorm=rmsnorm_for_torch("2.9")),
        # PyTorch 2.4-2.5: composite RMSNorm casts back before the weight multiply.
        KernelProfile(name="torch-2.4-cuda", torch_version="2.4", rmsnorm=rmsnorm_for_torch("2.4")),
        # PyTorch 2.1: mean(x*x) backward keeps its input.
        KernelProfile(name="torch-2.1-cuda", torch_version="2.1", rmsnorm=rmsnorm_for_torch("2.1"), mean_saves_input=True),
        # Hugging Face transformers (LlamaRMSNorm casts back before the weight; the loss upcasts
        # logits to fp32 and shifts the labels, not the logits) on PyTorch 2.8.
        KernelProfile(
            name="hf-torch-2.8-cuda", torch_version="2.8", rmsnorm="composite-legacy",
            logits_fp32=True, shift_copy=False,
        ),
    )
}

DEFAULT_PROFILE = "torch-2.8-cuda"


def get_profile(name: str) -> KernelProfile:
    """A named profile; unknown names list the valid ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise unknown_name("profile", name, list(PROFILES)) from None


def with_loss(profile: KernelProfile, loss: Optional[str] = None, loss_chunks: Optional[int] = None) -> KernelProfile:
    """``profile`` with ``--loss`` (its ``cross_entropy``) and ``--loss-chunks`` (its ``loss_chunks``)
    overridden where given; bad values are one-line errors."""
    upd: dict = {}
    if loss is not None:
        if loss not in LOSSES:
            raise UserError(f"unknown --loss {loss!r}; valid: {', '.join(LOSSES)}")
        upd["cross_entropy"] = loss
    if loss_chunks is not None:
        if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int):
            raise UserError(f"--loss-chunks must be a whole number, got {loss_chunks!r}")
        if loss_chunks <= 0:
            raise UserError(f"--loss-chunks must be positive, got {loss_chunks}")
        upd["loss_chunks"] = loss_chunks
    if not upd:
        return profile
    return KernelProfile.model_validate({**profile.model_dump(), **upd})
