"""The decoder's forward pass, op by op, as the model code runs it.

Mirrors the module code of the families we model: Hugging Face Llama/Mistral/
Qwen2 (pre-norm, SwiGLU, RoPE, ``repeat_kv`` for GQA), GPT-2 (learned
positions, LayerNorm, GELU), phi (parallel block, partial rotary) and
Forgather's Deep One (DeepNet post-norm, per-layer ALiBi mask, ReLU-gated FFN,
shifted-copy loss). Python references are dropped where the Python variable
dies, so the simulator frees what real code frees.

This module walks the decoder only. How layers run (eagerly, checkpointed, inside a
compiled graph) is the strategy's (:mod:`memcalc.engine.strategy`); ZeRO-3's all-gathers
are :class:`memcalc.engine.sharding.LayerGather`'s. Every op records the layer it belongs to
and its role (``Sim.layer``, ``Sim.role``).
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.rules import is_attention_variant, is_variant_layer, rope_width
from memcalc.core.spec import ExperimentSpec
from memcalc.engine import attention_variants as av
from memcalc.engine import block_variants as bv
from memcalc.engine.dora import dora_branch
from memcalc.engine.loss import lm_loss
from memcalc.engine.mla import mla_attention
from memcalc.engine.moe import moe_block
from memcalc.engine.ops import Ops
from memcalc.engine.sharding import GatherHooks
from memcalc.engine.sim import Param, Sim, T
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.tensor_parallel import TensorParallel, local_experiment
from memcalc.engine.weights import Model


class Forward:
    """Runs one forward pass on the simulator; returns the loss tensor. The block variants
    (attention, MLP, layer; engine/attention_variants.py and the like) see it through
    :class:`memcalc.engine.context.ForwardContext`."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, model: Model, strategy: LayerStrategy,
                 gather: Optional[GatherHooks] = None) -> None:
        exp = local_experiment(exp)  # tensor parallelism: the decoder one rank runs (engine.tensor_parallel)
        self.sim = sim
        self.strategy = strategy
        self.gather = gather
        self.exp = exp
        self.m = exp.model
        self.tr = exp.training
        self.model = model
        self.ops = Ops(sim, exp.profile, tr_autocast(exp))
        self.B = self.tr.batch
        self.T = self.tr.seq
        self.rows = self.B * self.T
        self.tp = TensorParallel.of(exp, self.rows)  # its collectives (None without tensor parallelism)
        self.seq_rows = self.tp.seq_rows if self.tp else self.rows  # rows of the residual stream on this rank
        self.lora = self.tr.lora
        self.rope_tables: Optional[T] = None
        self.masks: dict[str, T] = {}
        self.held_masks: list[T] = []  # masks a checkpointed region holds until its backward
        self.masks_released = False
        self._projs: dict[tuple, tuple] = {}  # proj's parameters by (layer, name, base, weight)
        # what the layer walk asks of the (frozen) model spec for every layer, read once
        m = self.m
        self._variant_layer = is_variant_layer(m)
        self._variant_attention = m.mla is not None or is_attention_variant(m)
        self._q_dim, self._kv_dim, self._dim_head, self._kv_heads = m.q_dim, m.kv_dim, m.dim_head, m.kv_heads

    # -- helpers ----------------------------------------------------------------------
    def p(self, name: str) -> Param:
        return self.model.params[name]

    def maybe(self, name: str) -> Optional[Param]:
        return self.model.params.get(name)

    def proj(self, x: T, layer: Optional[int], name: str, short: str, d_out: int, base: Optional[str] = None,
             weight: Optional[str] = None) -> T:
        """A projection, with its LoRA adapter when targeted: y = base(x) + B(A(drop(x))) * s.

        With the profile's ``lora_input_cast`` (PEFT ``lora.Linear.forward``, peft/tuners/lora/layer.py):
        ``x = x.to(lora_A.weight.dtype)`` (``_cast_input_dtype``: a copy when the adapters are fp32 over
        16-bit activations, made per target, so q, k and v each cast the same input), then
        ``result = result + lora_B(lora_A(dropout(x))) * scaling`` (16-bit + fp32 promotes to an
        fp32 sum) and ``result.to(torch_result_dtype)`` (a copy back). lora_A saves its input: the
        cast copy, or with dropout the dropout output (the copy then dies; dropout keeps its mask).
        Without it (plain, torchtune, litgpt) the branch runs on x as is. A 4-bit base under PEFT
        runs ``bnb.Linear4bit.forward`` instead (see below)."""
        o = self.ops
        key = (layer, name, base, weight)
        got = self._projs.get(key)
        if got is None:  # the projection's parameters, looked up once per step (a layer is walked 1-3 times)
            base = base or f"layers.{layer}.{name}"  # the output head: "lm_head" (its weight may be the embedding's)
            got = self._projs[key] = (base, self.p(weight or base + ".weight"), self.maybe(base + ".bias"),
                                      self.maybe(base + ".lora_A"))
        base, w, bias, a_p = got
        qt = 0
        if self.lora is not None and self.lora.qlora and w.weight.itemsize_bits == 4:
            qt = self.model.compute.nbytes(w.numel)
        y = o.linear(x, self.rows, w, bias, d_out, quant_transient_bytes=qt)
        if self.tp and short not in ("o", "down"):
            self.tp.colwise(self, y, x)
        if a_p is None:
            return y
        peft = self.exp.profile.lora_input_cast
        # PEFT's bnb Linear4bit.forward (peft/tuners/lora/bnb.py) differs for a 4-bit base: the
        # base output is cloned (``result.clone()``), and the casts happen only outside autocast
        # (``requires_conversion = not torch.is_autocast_enabled()``), the branch's output being
        # cast back to the result's dtype before the add
        quant = peft and qt > 0
        if quant:
            y2 = o.clone(y)
            o.drop(y)
            y = y2
        # without the cast rule, fp32 adapters over 16-bit activations still need one (outside
        # autocast a mixed-dtype matmul is an error)
        cast = (peft and not (quant and o.autocast is not None)) or (
            o.autocast is None and x.itemsize_bits != a_p.weight.itemsize_bits)
        xa = o.cast(x, o.dtype_of(a_p.weight)) if cast else o.ref_(x)
        if self.lora.dora:  # PEFT DoraLinearVariant (engine/dora.py)
            bs = dora_branch(self, xa, y, w, a_p, self.p(base + ".lora_B"), self.p(base + ".lora_magnitude"), d_out, qt)
            o.drop(xa)
            return self._lora_out(y, bs, cast, quant)
        xd = o.dropout(xa, self.lora.dropout)
        o.drop(xa)
        a = o.linear(xd, self.rows, a_p, None, self.lora.rank)
        o.drop(xd)
        b = o.linear(a, self.rows, self.p(base + ".lora_B"), None, d_out)
        o.drop(a)
        bs = o.scale(b, self.lora.alpha / self.lora.rank + 1e-12)
        o.drop(b)
        return self._lora_out(y, bs, cast, quant)

    def _lora_out(self, y: T, bs: T, cast: bool, quant: bool) -> T:
        """``result + branch`` and the cast back to the result's dtype (lora.Linear.forward)."""
        o = self.ops
        if quant and cast:  # output.to(expected_dtype) before result + output
            b2 = o.cast(bs, o.dtype_of(y))
            o.drop(bs)
            bs = b2
        out = o.add(y, bs)
        o.drop(bs)
        if cast and out.itemsize_bits != y.itemsize_bits:  # lora.Linear: result.to(torch_result_dtype)
            back = o.cast(out, o.dtype_of(y))
            o.drop(out)
            out = back
        o.drop(y)
        return out

    def norm(self, x: T, name: str) -> T:
        o = self.ops
        if self.m.norm == "rmsnorm":
            return o.rmsnorm(x, self.seq_rows, self.m.d_model, self.p(name + ".weight"))
        return o.layernorm(x, self.seq_rows, self.m.d_model, self.p(name + ".weight"), self.maybe(name + ".bias"))

    # -- blocks -----------------------------------------------------------------------
    def attention(self, h: T, i: int) -> T:
        role, self.sim.role = self.sim.role, "attention"
        y = self._attention(h, i)
        self.sim.role = role
        return y

    def _attention(self, h: T, i: int) -> T:
        o, m = self.ops, self.m
        if self._variant_attention:
            if m.mla is not None:  # DeepSeek multi-head latent attention (engine/mla.py)
                return mla_attention(self, h, i)
            # fused qkv, q/k norms, eager attention, sliding masks (engine/attention_variants.py)
            return av.attention(self, h, i)
        h = self.tp.gather(self, h) if self.tp else o.ref_(h)
        q = self.proj(h, i, "attn.q_proj", "q", self._q_dim)
        k = self.proj(h, i, "attn.k_proj", "k", self._kv_dim)
        v = self.proj(h, i, "attn.v_proj", "v", self._kv_dim)
        o.drop(h)
        out = self.strategy.core_attention(self, q, k, v, i, lambda: self.core_attention(q, k, v, i))
        o.drop(q, k, v)
        y = self.proj(out, i, "attn.o_proj", "o", m.d_model)
        o.drop(out)
        return self.tp.reduce(self, y) if self.tp else y

    def core_attention(self, q: T, k: T, v: T, i: int) -> T:
        o, m = self.ops, self.m
        H, D = m.n_heads, self._dim_head
        bias, bias_bytes = None, 0
        if m.positions == "alibi":
            slopes = self.maybe(f"layers.{i}.attn.alibi_slopes")
            if slopes is not None:
                bias, bias_bytes = o.alibi_mask(H, self.T, slopes)
                bias_bytes = bias_bytes * self.B
        n_rep = m.n_heads // self._kv_heads
        # transformers passes grouped K/V un-expanded (enable_gqa) when use_gqa_in_sdpa holds:
        # no explicit mask, head dim <= 256 (integrations/sdpa_attention.py)
        gqa = n_rep > 1 and self.exp.profile.sdpa_gqa and bias is None and D <= 256
        kernel = o.attention_kernel(bias is not None, q, enable_gqa=gqa)
        if m.positions == "rope":
            q2, k2 = o.rope(q, m.rotary_pct), o.rope(k, m.rotary_pct)
        else:
            q2, k2 = o.ref_(q), o.ref_(k)
        if gqa or self._kv_heads == 1:
            # one kv head (MQA, or a tensor-parallel rank's share): repeat_kv's reshape of the
            # (B, 1, n_rep, T, D) expand is a view (stride 0 over the heads), no copy
            k3, v3 = o.ref_(k2), o.ref_(v)
        else:
            k3, v3 = o.repeat_kv(k2, n_rep), o.repeat_kv(v, n_rep)
        o.drop(k2)
        out = o.sdpa(q2, k3, v3, self.B, H, self.T, D, bias, bias_bytes, m.attn_dropout, kernel,
                     n_rep=n_rep if gqa else 1)
        o.drop(q2, k3, v3, bias)
        return out

    def mlp(self, h: T, i: int) -> T:
        role, self.sim.role = self.sim.role, "mlp"
        y = self.strategy.mlp(self, h, i, lambda: self._mlp(h, i))
        self.sim.role = role
        return y

    def _mlp(self, h: T, i: int) -> T:
        o, m = self.ops, self.m
        if m.moe is not None and m.moe.is_moe_layer(i):  # the sparse block (engine/moe.py)
            return moe_block(self, h, i)
        if m.fused_gate_up:  # Phi-3 / GLM-4 gate_up_proj (engine/block_variants.py)
            return bv.fused_gate_up_mlp(self, h, i)
        h = self.tp.gather(self, h) if self.tp else o.ref_(h)
        if m.mlp == "gated":
            g = self.proj(h, i, "mlp.gate_proj", "gate", m.d_ff)
            u = self.proj(h, i, "mlp.up_proj", "up", m.d_ff)
            a = o.activation(g, m.activation)
            o.drop(g)
            x = o.mul(a, u)
            o.drop(a, u)
            y = self.proj(x, i, "mlp.down_proj", "down", m.d_model)
        else:
            f = self.proj(h, i, "mlp.fc1", "up", m.d_ff)
            a = o.activation(f, m.activation)
            o.drop(f)
            x = a
            y = self.proj(x, i, "mlp.fc2", "down", m.d_model)
        o.drop(x, h)
        return self.tp.reduce(self, y) if self.tp else y

    def resid_drop(self, x: T) -> T:
        if self.m.resid_dropout <= 0:  # dropout(x, 0) is x: a new reference, then x's dropped (nothing changes)
            assert x.alive, f"reference to a freed tensor {x.name}"
            return x
        y = self.ops.dropout(x, self.m.resid_dropout)
        self.ops.drop(x)
        return y

    def layer(self, x: T, i: int) -> T:
        """One decoder layer; takes a reference to x and returns a new output reference."""
        where = self.sim.layer, self.sim.role
        self.sim.layer, self.sim.role = i, "layer"
        gather = self.gather
        if gather is not None:  # FSDP2's per-layer pre- and post-forward (engine.fsdp)
            sim = self.sim
            c = sim.alloc_count
            gather.layer_enter(i)
            sim.hook_allocs += sim.alloc_count - c  # (a checkpointed region's recompute skips them)
        y = self._layer(x, i)
        if gather is not None:
            c = sim.alloc_count
            gather.layer_exit(i)
            sim.hook_allocs += sim.alloc_count - c
        self.sim.layer, self.sim.role = where
        return y

    def _layer(self, x: T, i: int) -> T:
        o, m = self.ops, self.m
        if self._variant_layer:  # sandwich / output norms, two parallel norms, residual multiplier
            return bv.layer(self, x, i)
        if m.block == "parallel":
            h = self.norm(x, f"layers.{i}.norm1")
            a = self.resid_drop(self.attention(h, i))
            f = self.resid_drop(self.mlp(h, i))
            o.drop(h)
            s = o.add(a, f)
            o.drop(a, f)
            y = o.add(s, x)
            o.drop(s)
            return y
        if m.norm_placement == "pre":
            h = self.norm(x, f"layers.{i}.norm1")
            a = self.resid_drop(self.attention(h, i))
            o.drop(h)
            x1 = o.add(x, a)
            o.drop(a)
            h2 = self.norm(x1, f"layers.{i}.norm2")
            f = self.resid_drop(self.mlp(h2, i))
            o.drop(h2)
            y = o.add(x1, f)
            o.drop(x1, f)
            return y
        # post-norm (DeepNet): x = norm(x * alpha + f(x))
        a = self.resid_drop(self.attention(x, i))
        r = o.scale(x, m.residual_scale)
        z = o.add(r, a)
        o.drop(r, a)
        x1 = self.norm(z, f"layers.{i}.norm1")
        o.drop(z)
        f = self.resid_drop(self.mlp(x1, i))
        r2 = o.scale(x1, m.residual_scale)
        z2 = o.add(r2, f)
        o.drop(r2, f, x1)
        y = self.norm(z2, f"layers.{i}.norm2")
        o.drop(z2)
        return y

    # -- the layers -------------------------------------------------------------------
    def layers(self, x: T) -> T:
        """All decoder layers, region by region as the strategy runs them."""
        n = self.m.n_layers
        for lo, hi in self.strategy.regions(n):
            self.sim.mark(f"fwd layer {lo}")
            if self.gather is not None:
                self.gather.forward_enter(lo)
            y = self.strategy.run(self, x, lo, hi)
            self.ops.drop(x)
            x = y
        if self.gather is not None:
            self.gather.release()
        self.strategy.after_layers(self)
        return x

    def run(self) -> T:
        """The whole forward: inputs, embedding, layers, final norm, head, loss."""
        sim, o, m = self.sim, self.ops, self.m
        sim.mark("inputs", "forward")
        sim.layer, sim.role = None, "embedding"
        if sim.offload is not None:  # torchtune wraps the model's forward in OffloadActivations
            sim.offload.active = True
        ids = sim.alloc(self.rows * 8, "activations", "inputs")
        labels = sim.alloc(self.rows * 8, "activations", "inputs")
        self.ids_labels = (ids, labels)
        x = o.embedding(ids, self.rows, self.p("embed_tokens.weight"), m.d_model)
        if self.tp:  # vocabulary-parallel embedding: its Partial output reduced
            x = self.tp.reduce(self, x)
        x = bv.scale_embeddings(self, x)
        pos = self.maybe("embed_positions.weight")
        if pos is not None:
            pe = o.embedding(ids, self.T, pos, m.d_model)
            x2 = o.add(x, pe)
            o.drop(x, pe)
            x = x2
        if m.positions == "rope":
            self.rope_tables = sim.alloc(2 * DType.fp32.nbytes(self.rows * rope_width(m)), "activations", "rope tables")
        x = self.resid_drop_embd(x)
        self.masks = av.build_masks(self)
        x = self.layers(x)
        sim.mark("final norm & head")
        sim.role = "head"
        if m.final_norm:
            h = self.norm(x, "final_norm")
            o.drop(x)
            x = h
        self.release_masks()
        if sim.offload is not None:  # ... with a NoOpManager around the output head; the loss is outside
            sim.offload.active = False
        weight = "lm_head.weight" if self.maybe("lm_head.weight") is not None else "embed_tokens.weight"
        if self.tp:  # the head is column-parallel on the vocabulary
            h = self.tp.gather(self, x)
            o.drop(x)
            x = h
        # the head as a projection: with LoRA target head, its adapter branch is a vocab-wide B output
        logits = self.proj(x, None, "lm_head", "head", m.vocab_size, base="lm_head", weight=weight)
        o.drop(x)
        logits = bv.post_logits(self, logits)
        self.strategy.logits(self, logits)
        sim.role = "loss"
        o.category = "logits & loss"
        loss = lm_loss(o, logits, self.B, self.T, m.vocab_size, self.tp is not None)
        o.category = "saved activations"
        o.drop(logits)
        o.exit_autocast()
        sim.mark("loss")
        return loss

    def resid_drop_embd(self, x: T) -> T:
        y = self.ops.dropout(x, self.m.embd_dropout)
        self.ops.drop(x)
        return y

    def release_masks(self) -> None:
        """The attention masks go when the model's forward returns (before the head); with
        checkpointing, a checkpointed region's recompute holds its masks until its backward
        (:func:`memcalc.engine.attention_variants.hold_masks`)."""
        if self.masks_released:
            return
        if self.tr.checkpoint != "none":
            av.hold_masks(self)
        for t in self.masks.values():
            self.sim.unref(t)
        self.masks_released = True  # the mapping stays for the recomputed layers to look up

    def release_inputs(self) -> None:
        """The batch and the RoPE tables go away with the step (and any mask still held)."""
        self.release_masks()
        self.masks = {}
        for t in self.held_masks:
            self.sim.unref(t)
        self.held_masks = []
        for t in (*self.ids_labels, self.rope_tables):
            self.sim.unref(t)


def tr_autocast(exp: ExperimentSpec) -> Optional[DType]:
    tr = exp.training
    return tr.compute_dtype if tr.is_amp else None
