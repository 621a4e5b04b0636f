"""The twin of :mod:`memcalc.engine.blocks.head`: the output head (:class:`LMHead`) and the causal LM
loss of the replica (``validate/model.py``), the twin of :mod:`memcalc.engine.blocks.head`'s ``lm_loss``:
full or chunked cross-entropy, Forgather's shifted copy or Hugging Face's padded labels."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from memcalc.core.rules import chunk_rows
from memcalc.core.spec import KernelProfile, ModelSpec

from ..amp import Amp

if TYPE_CHECKING:
    from .build import BuildConfig


def cross_entropy(x: torch.Tensor, labels: torch.Tensor, amp: Amp, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` on (N,V); under autocast ``cross_entropy_loss`` keeps log_softmax in the
    logits' dtype (it passes ``self.scalar_type()``) and ``nll_loss`` (an fp32 op) upcasts its
    input, which it then saves."""
    if amp.active and x.dtype != torch.float32:
        lsm = F.log_softmax(x, -1, dtype=x.dtype)
        up = amp.fp32(lsm)
        assert up is not None
        return F.nll_loss(up, labels, ignore_index=-100, reduction=reduction)
    return F.cross_entropy(x, labels, ignore_index=-100, reduction=reduction)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, profile: KernelProfile, amp: Amp) -> torch.Tensor:
    """The causal LM loss per the profile.

    ``shift_copy`` (Forgather CausalLoss): ``logits[..., :-1, :].contiguous()``, labels
    shifted the same way, mean cross-entropy, ``.nan_to_num()``. Otherwise Hugging Face
    ``ForCausalLMLoss``: labels padded with -100 and shifted, logits used whole.
    ``logits_fp32``: ``logits.float()`` first (HF). ``cross_entropy="chunked"``: the rows in
    ``profile.loss_chunks`` chunks (``split`` into :func:`memcalc.core.rules.chunk_rows` sizes),
    each ``.float()``-ed and reduced with ``reduction="sum"``, the sum divided by the count of
    non-ignored labels (torchtune ``CEWithChunkedOutputLoss``; see :mod:`memcalc.engine.loss`).
    """
    V = logits.shape[-1]
    if profile.logits_fp32:
        logits = logits.float()
    if profile.shift_copy:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
    else:
        shift_logits = logits
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    del logits
    x = shift_logits.view(-1, V)
    y = shift_labels.view(-1)
    del shift_logits
    if profile.cross_entropy == "chunked":
        total = None
        sizes = chunk_rows(x.shape[0], profile.loss_chunks)
        for xc, yc in zip(x.split(sizes), y.split(sizes), strict=True):
            part = cross_entropy(xc.float(), yc, amp, reduction="sum")
            total = part if total is None else total + part
        assert total is not None  # at least one chunk
        loss = total / (y != -100).sum().clamp(min=1)
    else:
        loss = cross_entropy(x, y, amp)
    del x
    return loss.nan_to_num() if profile.shift_copy else loss


class LMHead(nn.Module):
    """The output projection; tied heads borrow the embedding weight (only a bias of their own)."""

    def __init__(self, m: ModelSpec, cfg: BuildConfig) -> None:
        super().__init__()
        if not m.tie_embeddings:
            self.weight = nn.Parameter(torch.empty((m.vocab_size, m.d_model), dtype=cfg.dtype, device=cfg.device),
                                       requires_grad=cfg.full)
            if cfg.init:
                nn.init.normal_(self.weight, std=0.02)
        self.bias = (nn.Parameter(torch.zeros((m.vocab_size,), dtype=cfg.dtype, device=cfg.device),
                                  requires_grad=cfg.full) if m.lm_head_bias else None)
        lora = cfg.lora
        self.lora_A = self.lora_B = None
        self.lora_dropout, self.scale = 0.0, 0.0
        if lora is not None and "head" in lora.targets:  # LoRA target head (PEFT lm_head): A r x d, B vocab x r
            adt = cfg.adapter_dtype
            self.lora_A = nn.Parameter(torch.empty((lora.rank, m.d_model), dtype=adt, device=cfg.device))
            self.lora_B = nn.Parameter(torch.zeros((m.vocab_size, lora.rank), dtype=adt, device=cfg.device))
            if cfg.init:
                nn.init.normal_(self.lora_A, std=0.02)
            self.lora_dropout, self.scale = lora.dropout, lora.alpha / lora.rank
        if lora is not None and "head" in lora.targets and lora.dora:
            self.lora_magnitude = nn.Parameter(torch.ones((m.vocab_size,), dtype=cfg.dtype, device=cfg.device))
        self.amp = cfg.amp
        #: the decoder calls this module (True) or F.linear on its weight (False, the replica's way
        #: since before tensor parallelism: DeepSpeed ZeRO-3 then keeps the head gathered for the
        #: whole step, which engine/deepspeed.py models). validate/sharded/tp.py sets it: DTensor's
        #: ColwiseParallel acts through the module's forward hooks.
        self.call_module = False

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits; ``weight``: the tied embedding's (else this head's own)."""
        amp = self.amp
        w = self.weight if weight is None else weight
        return F.linear(amp.lp(x), amp.lp(w), amp.lp(self.bias))
