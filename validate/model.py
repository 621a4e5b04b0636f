"""A decoder-only transformer built from a :class:`~memcalc.core.spec.ModelSpec`, for measuring.

Every preset can be built; Forgather's "Deep One" (post-norm, ALiBi) runs exactly the code
path of modelsrc/transformer/{causal_alibi_attn,deepnet,glu_feedforward,
checkpoint_layer_stack,causal_loss,input_encoder}.py at commit a0ce9176: the ALiBi mask
is rebuilt in every layer (in the model dtype, times the trainable slopes, ``masked_fill_``
-inf above the diagonal) and passed to the memory-efficient kernel; ``x = norm(x * alpha +
f(x))``; ``down(up(x) * relu(gate(x)))``; final RMSNorm; untied head; the loss shifts with
``.contiguous()``, takes the mean cross-entropy and ``nan_to_num``. Pre-norm models follow
Hugging Face Llama/Mistral/Qwen2 (RoPE, ``repeat_kv``), GPT-2 (learned positions,
LayerNorm) and phi (parallel block, partial rotary).

Parameter names follow :func:`memcalc.engine.params.param_inventory`; the parameter count equals
:func:`memcalc.engine.params.count_params` (a QLoRA base counts its logical elements).

Activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) follows
``TrainingSpec.checkpoint``: full (each layer), every-k (layer ``i`` when ``i % K == 0``, as
Forgather's LayerStack), sqrt (segments of :func:`memcalc.core.spec.sqrt_segments` layers, one
checkpoint each), selective (only the attention core: positions, mask, kernel).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memcalc.core.rules import rope_width
from memcalc.core.spec import KernelProfile, ModelSpec, TrainingSpec, sqrt_segments

from .amp import Amp
from .blocks.adapters import Linear, kbit_fp32_cast, lora_branch, lora_input_cast, lora_result
from .blocks.attention import Attention
from .blocks.base import dropout
from .blocks.build import DTYPES, BuildConfig, torch_dtype
from .blocks.head import LMHead, lm_loss
from .blocks.layer import DecoderLayer
from .blocks.sdpa import rope_tables
from .blocks import attention_variants as variants
from .offload import OffloadActivations

__all__ = ["DTYPES", "Attention", "BuildConfig", "Decoder", "DecoderLayer", "LMHead", "build_model", "param_count",
           "torch_dtype", "unbuilt_features"]



def op_sac_context():
    """torchtitan's op-level selective activation checkpointing (``--checkpoint selective-op``):
    ``_save_list`` = {mm, flash and memory-efficient SDPA} and ``_custom_policy`` (MUST_SAVE a
    listed op's output except every second mm, counted per forward / recompute; PREFER_RECOMPUTE
    the rest) through ``create_selective_checkpoint_contexts``
    (torchtitan/distributed/activation_checkpoint.py before its name-based rewrite). The
    estimator's twin is ``memcalc.engine.checkpoint.OpSaver``."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    mm = torch.ops.aten.mm.default
    save = {mm, torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default, torch.ops.aten.max.default}
    meta: dict = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == mm:
            meta[key] += 1
        to_save = func in save and not (func == mm and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Decoder(nn.Module):
    """The whole model: ``forward(input_ids, labels) -> loss`` (logits are not returned, as in
    Forgather's trainer, which keeps only ``outputs[0]``)."""

    def __init__(self, exp_model: ModelSpec, tr: TrainingSpec, profile: KernelProfile, device="meta",
                 amp: Optional[Amp] = None, init: Optional[bool] = None) -> None:
        super().__init__()
        m = exp_model
        self.m, self.tr, self.profile = m, tr, profile
        self.amp = amp if amp is not None else Amp(torch_dtype(tr.compute_dtype.value) if tr.is_amp else None)
        init = torch.device(device).type != "meta" if init is None else init
        cfg = BuildConfig(m, tr, profile, device, self.amp, init)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(m.vocab_size, m.d_model, dtype=cfg.dtype, device=device)
        self.embed_tokens.weight.requires_grad_(cfg.full)
        if m.positions == "learned":
            self.embed_positions = nn.Embedding(m.max_seq_len, m.d_model, dtype=cfg.dtype, device=device)
            self.embed_positions.weight.requires_grad_(cfg.full)
        if m.positions == "rope":
            rot = rope_width(m)
            inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.int64, device=device).float() / rot))
            self.register_buffer("inv_freq", inv, persistent=False)
        self.layers = nn.ModuleList([DecoderLayer(m, cfg, i) for i in range(m.n_layers)])
        if m.final_norm:
            self.final_norm = cfg.norm()
        self.lm_head = LMHead(m, cfg)
        #: called with a label ("layer 3", "head & loss") as forward and backward reach it
        self.on_label: Optional[Callable[[str], None]] = None
        #: torchtune's OffloadActivations around the forward up to the head (offload.py)
        self.offload: Optional[OffloadActivations] = OffloadActivations() if tr.activation_offload else None
        if tr.lora is not None and tr.lora.qlora and profile.qlora_fp32_cast:
            kbit_fp32_cast(self)

    # -- helpers ----------------------------------------------------------------------
    def _label(self, text: str) -> None:
        if self.on_label is not None:
            self.on_label(text)

    def _mark_backward(self, t: torch.Tensor, text: str) -> None:
        if self.on_label is not None and t.requires_grad:
            cb = self.on_label
            t.register_hook(lambda g: cb(text))

    def _ckpt(self, fn, *args, context_fn=None):
        kw = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(self.amp.wrap(fn), *args, use_reentrant=False, preserve_rng_state=self.cfg.preserve_rng,
                          **kw)

    def run_layers(self, x: torch.Tensor, cos, sin, masks: Optional[dict] = None) -> torch.Tensor:
        tr, n, m = self.tr, self.m.n_layers, self.m
        masks = masks or {}
        mode = tr.checkpoint
        i = 0
        while i < n:
            self._label(f"layer {i}")
            if mode == "full" or (mode == "every-k" and i % tr.checkpoint_every == 0):
                x = self._ckpt(self.layers[i], x, cos, sin, variants.layer_mask(m, masks, i))
                step = 1
            elif mode == "selective-op":
                x = self._ckpt(self.layers[i], x, cos, sin, variants.layer_mask(m, masks, i),
                               context_fn=op_sac_context)
                step = 1
            elif mode == "sqrt":
                hi = min(n, i + sqrt_segments(n))

                def segment(h, c, s, lo=i, hi=hi):
                    for j in range(lo, hi):
                        h = self.layers[j](h, c, s, variants.layer_mask(m, masks, j))
                    return h

                x = self._ckpt(segment, x, cos, sin)
                step = hi - i
            else:
                x = self.layers[i](x, cos, sin, variants.layer_mask(m, masks, i))
                step = 1
            self._mark_backward(x, f"layer {i + step - 1}")
            i += step
        return x

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding, layers, final norm and head. ``model.compile()`` compiles :meth:`forward`, so on a
        GPU the loss is in the graph too (memcalc.engine.blocks.compiled_loss ``loss_in_model_graph``);
        the meta partition (validate/compiled.py) traces this part alone, without the loss. Call inside
        ``self.amp.region()``."""
        B, T = input_ids.shape
        x = self.embed(input_ids)
        cos, sin = self.rope(T, x.dtype)
        masks = variants.build_masks(self.m, B, T, x.dtype, x.device)
        x = self.final(self.run_layers(x, cos, sin, masks))
        del masks  # the model's forward returns (checkpoint closures may still hold them)
        box = [x]
        del x  # handed over: the head frees it after its matmul
        return self.head(box)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding (positions, scale, dropout): the first pipeline stage's start too
        (validate/sharded/pipeline.py)."""
        m = self.m
        T = input_ids.shape[1]
        self._label("embedding")
        if self.offload is not None:
            self.offload.__enter__()
        x = self.embed_tokens(input_ids)
        if m.embedding_scale != 1.0:  # Gemma normalizer, Granite embedding_multiplier
            x = x * m.embedding_scale
        if m.positions == "learned":
            pos = torch.arange(T, device=input_ids.device)[None, :]
            x = x + self.embed_positions(pos)
        return dropout(x, m.embd_dropout if self.training else 0.0)

    def rope(self, T: int, dtype: torch.dtype) -> tuple:
        """The RoPE tables of a forward ((None, None) without RoPE)."""
        if self.m.positions == "rope":
            return rope_tables(self.inv_freq, T, dtype)
        return None, None

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm (the last pipeline stage's end starts here)."""
        self._label("head & loss")
        return self.final_norm(x) if self.m.final_norm else x

    def head(self, box: list) -> torch.Tensor:
        """The head on the final norm's output, handed over in a one-element list ``box`` (no caller's
        reference keeps it alive: it goes after the head's matmul): the logits."""
        m, amp = self.m, self.amp
        x = box.pop()
        if self.offload is not None:  # torchtune: a NoOpManager around the output head
            self.offload.__exit__(None, None, None)
        tied = self.embed_tokens.weight if m.tie_embeddings else None
        if self.lm_head.call_module:  # tensor parallelism: the module's hooks (validate/sharded/tp.py)
            logits = self.lm_head(x, weight=tied)
        else:
            w = self.lm_head.weight if tied is None else tied
            logits = F.linear(amp.lp(x), amp.lp(w), amp.lp(self.lm_head.bias))
        head = self.lm_head
        if head.lora_A is not None and head.lora_B is not None:  # as layers.Linear.forward (lora_result)
            cast = lora_input_cast(x, head.lora_A, amp, self.profile.lora_input_cast, False)
            xa = x.to(head.lora_A.dtype) if cast else x
            logits = lora_result(logits, lora_branch(xa, head.lora_A, head.lora_B, head.lora_dropout, head.scale,
                                                     self.training, amp), cast, False)
            del xa
        del x
        if m.logit_scale != 1.0:  # Cohere logit_scale, Granite 1 / logits_scaling
            logits = logits * m.logit_scale
        if m.logit_softcap is not None:  # Gemma2ForCausalLM final_logit_softcapping
            logits = logits / m.logit_softcap
            logits = torch.tanh(logits)
            logits = logits * m.logit_softcap
        return logits

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.amp.region():
            logits = self.logits(input_ids)
            self._mark_backward(logits, "head & loss")
            loss = lm_loss(logits, labels, self.profile, self.amp)
            del logits
        return loss


def param_count(model: Decoder) -> tuple[int, int]:
    """(total, trainable) elements: parameters plus the logical elements of 4-bit bases."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.nf4 is not None:
            total += mod.nf4.numel
    return total, trainable


def unbuilt_features(m: ModelSpec) -> list[str]:
    """ModelSpec features of issue 12 that ``Decoder`` does not build yet (it would trace another model).
    The dense ones (fused projections, q/k norms, sinks and softcaps, norm placements, sliding
    windows, multipliers) are built (:mod:`.variants`), MoE and MLA too (:mod:`.moe`, :mod:`.mla`);
    gpt-oss's experts (biases, clamped gate) are not."""
    checks = [(m.moe is not None and (m.moe.expert_bias or m.moe.router_bias), "gpt-oss experts (biases, clamped gate)"),
              (m.moe is not None and m.moe.implementation == "litgpt",
               "LitGPT's LLaMAMoE (validate --framework litgpt traces LitGPT's own)")]
    return [name for cond, name in checks if cond]


def build_model(m: ModelSpec, tr: TrainingSpec, profile: KernelProfile, device="meta",
                amp: Optional[Amp] = None) -> Decoder:
    """The model on ``device`` in the precision policy's weight dtype (built there directly:
    nothing is moved, so it works on ``meta`` and never needs two copies on a GPU)."""
    missing = unbuilt_features(m)
    if missing:
        from memcalc.core.errors import UserError

        raise UserError(f"the validator's replica does not build {', '.join(missing)} of {m.name} yet (issue 12); "
                        "its parameter counts are checked against transformers instead")
    model = Decoder(m, tr, profile, device=device, amp=amp)
    model.train()
    return model
