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
from memcalc.core.spec import KernelProfile, LoraSpec, ModelSpec, TrainingSpec, sqrt_segments

from .amp import Amp
from .blocks.attention import alibi_mask, alibi_slopes_init, apply_rope, choose_kernel, repeat_kv, rope_tables, sdpa
from .blocks.adapters import Linear, lora_branch, lora_input_cast, lora_result
from .blocks.base import dropout
from .blocks.mlp import MLP
from .blocks.norm import LayerNorm, RMSNorm
from .blocks.head import lm_loss
from .blocks import attention_variants as variants
from .blocks.mla import MLAttention
from .blocks.moe import MoEBlock
from .offload import OffloadActivations

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


class Attention(nn.Module):
    """q/k/v/o projections, positions (RoPE or ALiBi), GQA expansion and the SDPA kernel."""

    def __init__(self, m: ModelSpec, cfg: "BuildConfig") -> None:
        super().__init__()
        self.m, self.cfg = m, cfg
        mk = cfg.linear
        if m.fused_qkv:  # Phi3Attention.qkv_proj, GPT-2 c_attn, GPT-NeoX query_key_value
            self.qkv_proj = mk("qkv", m.d_model, m.q_dim + 2 * m.kv_dim, m.qkv_bias)
        else:
            self.q_proj = mk("q", m.d_model, m.q_dim, m.qkv_bias)
            self.k_proj = mk("k", m.d_model, m.kv_dim, m.qkv_bias)
            self.v_proj = mk("v", m.d_model, m.kv_dim, m.qkv_bias)
        self.o_proj = mk("o", m.q_dim, m.d_model, m.o_bias)
        if m.qk_norm != "none":
            self.q_norm, self.k_norm = cfg.qk_norm(m.n_heads), cfg.qk_norm(m.kv_heads)
        if m.attn_sinks:  # GptOssAttention.sinks
            self.sinks = nn.Parameter(torch.zeros((m.n_heads,), dtype=cfg.dtype, device=cfg.device),
                                      requires_grad=cfg.full)
        if m.positions == "alibi":
            slopes = alibi_slopes_init(m.n_heads, cfg.device).to(cfg.dtype)
            if m.alibi_trainable:
                self.alibi_slopes = nn.Parameter(slopes, requires_grad=cfg.full)
            else:
                self.register_buffer("alibi_slopes", slopes, persistent=False)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             layer_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Positions, mask and kernel on (B,H,T,D) q and (B,kvH,T,D) k, v; ``layer_mask``: the
        layer's shared mask (eager float mask, or SDPA's boolean sliding mask)."""
        m, amp = self.m, self.cfg.amp
        T = q.shape[2]
        mask = None
        if variants.eager(m):  # Gemma-2 softcap, gpt-oss sinks: transformers' eager attention
            if m.positions == "rope":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q, k, v = amp.lp(q), amp.lp(k), amp.lp(v)
            p = m.attn_dropout if self.training else 0.0
            out = variants.eager_attention(q, k, v, layer_mask, m.n_heads // m.kv_heads, m.dim_head ** -0.5,
                                           m.attn_softcap, getattr(self, "sinks", None), p)
            return out.transpose(1, 2)
        if layer_mask is not None:  # a sliding layer: the boolean mask through SDPA
            if m.positions == "rope":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q, k, v = amp.lp(q), amp.lp(k), amp.lp(v)
            n_rep = m.n_heads // m.kv_heads
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            mask = variants.convert_bool_mask(layer_mask, q.dtype)
            kernel = choose_kernel(self.cfg.profile.attention, q.dtype, True)
            p = m.attn_dropout if self.training else 0.0
            return sdpa(q, k, v, mask, kernel, p, is_causal=True)
        if m.positions == "alibi":
            mask = alibi_mask(self.alibi_slopes, T, q.dtype)
        elif m.positions == "rope":
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v, mask = amp.lp(q), amp.lp(k), amp.lp(v), amp.lp(mask)  # autocast: sdpa is lower-precision
        n_rep = m.n_heads // m.kv_heads
        # the profile's sdpa_gqa: K/V un-expanded with enable_gqa where transformers' use_gqa_in_sdpa holds
        # (integrations/sdpa_attention.py: no explicit mask, head dim <= 256; memcalc.engine.forward's rule)
        gqa = n_rep > 1 and self.cfg.profile.sdpa_gqa and mask is None and m.dim_head <= 256
        kernel = choose_kernel(self.cfg.profile.attention, q.dtype, mask is not None, gqa)
        if not gqa:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        p = m.attn_dropout if self.training else 0.0
        return sdpa(q, k, v, mask, kernel, p, is_causal=True)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B,H,T,D) q and (B,kvH,T,D) k, v: projections (a fused one is split into views), q/k norms
        (Qwen3: per head on the (B,T,H,D) view; OLMo-2: on the whole projection), transposes."""
        B, T, _ = x.shape
        m = self.m
        if m.fused_qkv:
            query, key, value = self.qkv_proj(x).split([m.q_dim, m.kv_dim, m.kv_dim], dim=-1)
        else:
            query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if m.qk_norm == "full":
            query, key = self.q_norm(query), self.k_norm(key)
        # -1 heads: a tensor-parallel rank holds n_heads / tp of them (as torchtitan's Attention views)
        query = query.view(B, T, -1, m.dim_head)
        key = key.view(B, T, -1, m.dim_head)
        if m.qk_norm in ("head", "head_unshared"):
            query, key = self.q_norm(query), self.k_norm(key)
        value = value.view(B, T, -1, m.dim_head)
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos=None, sin=None, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        m = self.m
        query, key, value = self.qkv(x)
        if self.cfg.checkpoint_attention:
            out = checkpoint(self.cfg.amp.wrap(self.core), query, key, value, cos, sin, mask,
                             use_reentrant=False, preserve_rng_state=self.cfg.preserve_rng)
        else:
            out = self.core(query, key, value, cos, sin, mask)
        del query, key, value
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """One layer: pre-norm (HF), post-norm DeepNet (Forgather) or parallel (phi)."""

    def __init__(self, m: ModelSpec, cfg: "BuildConfig", i: int) -> None:
        super().__init__()
        self.m, self.cfg, self.i = m, cfg, i
        self.attn = MLAttention(m, cfg) if m.mla is not None else Attention(m, cfg)
        if m.moe is not None and m.moe.is_moe_layer(i):
            self.moe = MoEBlock(m, cfg, i)  # parameters layers.{i}.moe.* (engine.params)
            object.__setattr__(self, "mlp", self.moe)  # forward calls self.mlp; registered once, as moe
        else:
            self.mlp = MLP(m.mlp, cfg.activation, cfg.linear, m.d_model, m.d_ff, m.mlp_bias,
                           forgather_order=m.norm_placement == "post", fused=m.fused_gate_up)
        for j in range(m.norms_per_layer):
            setattr(self, f"norm{j + 1}", cfg.norm())

    def forward(self, x: torch.Tensor, cos=None, sin=None, mask=None) -> torch.Tensor:
        m, p = self.m, (self.m.resid_dropout if self.training else 0.0)
        if m.norm_placement in ("sandwich", "output") or m.parallel_norms == 2 or m.residual_multiplier != 1.0:
            return variants.variant_layer(self, x, cos, sin, mask)
        if m.block == "parallel":  # phi: x + attn(n) + mlp(n), one norm
            h = self.norm1(x)
            a = dropout(self.attn(h, cos, sin, mask), p)
            f = dropout(self.mlp(h), p)
            del h
            return a + f + x
        if m.norm_placement == "pre":  # Hugging Face Llama
            residual = x
            h = self.norm1(x)
            h = dropout(self.attn(h, cos, sin, mask), p)
            x = residual + h
            del h
            residual = x
            h = self.norm2(x)
            h = dropout(self.mlp(h), p)
            return residual + h
        # Forgather DeepnetLayer.forward (residual_dropout = identity)
        alpha = m.residual_scale
        residual = x
        x = self.attn(x, cos, sin, mask)
        x = dropout(x, p)
        x = self.norm1((residual * alpha if alpha != 1.0 else residual) + x)
        residual = x
        x = self.mlp(x)
        x = dropout(x, p)
        x = self.norm2((residual * alpha if alpha != 1.0 else residual) + x)
        return x


class BuildConfig:
    """What the modules need besides the ModelSpec: dtype, device, amp, profile, LoRA."""

    def __init__(self, m: ModelSpec, tr: TrainingSpec, profile: KernelProfile, device, amp: Amp,
                 init: bool) -> None:
        self.m, self.tr, self.profile, self.device, self.amp, self.init = m, tr, profile, device, amp, init
        self.dtype = torch_dtype(tr.weight_dtype.value)
        #: the adapters' dtype (ExperimentSpec.adapter_dtype: LoraSpec.dtype, else the profile's lora_dtype)
        adt = None if tr.lora is None else (tr.lora.dtype or profile.lora_dtype)
        self.adapter_dtype = torch.float32 if adt == "fp32" else self.dtype
        #: the activation as the profile runs it (gelu_new: fused, or transformers' chain of pointwise ops)
        chain = m.activation == "gelu_new" and profile.gelu_new == "chain"
        self.activation = "gelu_new_chain" if chain else m.activation
        self.lora: Optional[LoraSpec] = tr.lora
        self.full = tr.lora is None
        self.checkpoint_attention = tr.checkpoint == "selective"
        self.preserve_rng = torch.device(device).type != "meta"

    def linear(self, short: str, d_in: int, d_out: int, bias: bool) -> Linear:
        lora = self.lora
        # PEFT moves gate/up/down targets of some MoE types onto the routed experts (engine.params)
        to_experts = self.m.moe is not None and self.m.moe.lora_mlp_to_experts and short in ("gate", "up", "down")
        return Linear(d_in, d_out, bias, self.amp, dtype=self.dtype, device=self.device, trainable=self.full,
                      lora=lora, target=lora is not None and short in lora.targets and not to_experts, init=self.init,
                      adapter_dtype=self.adapter_dtype, input_cast=self.profile.lora_input_cast)

    def plain_linear(self, d_in: int, d_out: int, bias: bool) -> Linear:
        return Linear(d_in, d_out, bias, self.amp, dtype=self.dtype, device=self.device, trainable=self.full,
                      init=self.init)

    def norm(self) -> nn.Module:
        m = self.m
        if m.norm == "rmsnorm":
            return RMSNorm(m.d_model, m.norm_eps, self.amp, mode=self.profile.rmsnorm,
                           mean_saves_input=self.profile.mean_saves_input, bias=m.has_norm_bias,
                           dtype=self.dtype, device=self.device, trainable=self.full, upcast=self.profile.norm_upcast)
        return LayerNorm(m.d_model, m.norm_eps, self.amp, bias=m.has_norm_bias, dtype=self.dtype,
                         device=self.device, trainable=self.full)

    def qk_norm(self, heads: int) -> nn.Module:
        """The q or k norm (no bias): over each head (one weight of head_dim, or one per head) or
        over the whole projection (heads * head_dim)."""
        m = self.m
        d = m.dim_head if m.qk_norm in ("head", "head_unshared") else heads * m.dim_head
        shape = (heads, m.dim_head) if m.qk_norm == "head_unshared" else (d,)
        if m.norm == "rmsnorm":
            return RMSNorm(d, m.norm_eps, self.amp, mode=self.profile.rmsnorm, mean_saves_input=self.profile.mean_saves_input,
                           bias=False, dtype=self.dtype, device=self.device, trainable=self.full, shape=shape,
                           upcast=self.profile.norm_upcast)
        if m.qk_norm == "head_unshared":
            return variants.PerHeadLayerNorm(heads, d, m.norm_eps, self.amp, dtype=self.dtype, device=self.device,
                                             trainable=self.full)
        return LayerNorm(d, m.norm_eps, self.amp, bias=False, dtype=self.dtype, device=self.device, trainable=self.full)


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
        """Embedding, layers, final norm and head: what ``model.compile()`` compiles (the loss
        stays eager in Forgather's trainer). Call inside ``self.amp.region()``."""
        m, amp = self.m, self.amp
        B, T = input_ids.shape
        self._label("embedding")
        if self.offload is not None:
            self.offload.__enter__()
        x = self.embed_tokens(input_ids)
        if m.embedding_scale != 1.0:  # Gemma normalizer, Granite embedding_multiplier
            x = x * m.embedding_scale
        if m.positions == "learned":
            pos = torch.arange(T, device=input_ids.device)[None, :]
            x = x + self.embed_positions(pos)
        x = dropout(x, m.embd_dropout if self.training else 0.0)
        cos = sin = None
        if m.positions == "rope":
            cos, sin = rope_tables(self.inv_freq, T, x.dtype)
        masks = variants.build_masks(m, B, T, x.dtype, x.device)
        x = self.run_layers(x, cos, sin, masks)
        self._label("head & loss")
        if m.final_norm:
            x = self.final_norm(x)
        del masks  # the model's forward returns (checkpoint closures may still hold them)
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
    checks = [(m.moe is not None and (m.moe.expert_bias or m.moe.router_bias), "gpt-oss experts (biases, clamped gate)")]
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
