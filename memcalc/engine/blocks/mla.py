"""DeepSeek-V2/V3 multi-head latent attention: what each op allocates, saves and frees.

Follows transformers 5.23 models/deepseek_v3/modeling_deepseek_v3.py
``DeepseekV3Attention.forward`` / ``expand_kv`` and integrations/sdpa_attention.py, op by op (the
validator's replica, ``validate/mla.py``, runs the same ops). With ``N = batch x seq`` rows,
``H`` heads, head dims ``nope``, ``rope``, ``v`` and ranks ``rq``, ``rkv``:

- q: ``q_a_proj`` (N, rq) -> ``q_a_layernorm`` -> ``q_b_proj`` (N, H (nope + rope)) (or one
  ``q_proj``); split into views;
- kv: ``kv_a_proj_with_mqa`` (N, rkv + rope); ``kv_a_layernorm`` on the latent view; the rope
  part a view (one head);
- RoPE (``apply_rotary_pos_emb_interleave``, V3's default): a new (N, H rope) for q and (N, rope)
  for k, with half-size products as transients; saves only the cos/sin tables;
- ``cat((q_pass, q_rot))``: the query (N, H (nope + rope)), a copy;
- ``kv_b_proj`` (N, H (nope + v)); the value is a strided view of it, so the attention kernel
  keeps the whole kv_b output; the key is ``new_empty`` (N, H (nope + rope)) filled by two
  ``copy_`` (whose backward, ``CopySlices``, clones the key's gradient once each);
- SDPA: flash needs equal q/k/v head dims (sdp_utils.cpp ``check_head_dim_size_flash``), so with
  ``v != nope + rope`` CUDA runs the memory-efficient kernel (saves q, k, v, out (N, H v), a
  (B, H, T rounded to 32) fp32 logsumexp; backward: dq, dk, dv, ``delta`` and an fp32 dq
  accumulator for 16-bit inputs);
- the output transposed to (B, T, H v) with ``.contiguous()`` (no copy: the fused kernels
  return a transposed view of a (B, T, H, v) buffer), then ``o_proj``.

Python locals live until the method returns: the q_b output (``q_states``), the compressed kv,
the rotated parts and the key's expanded rope view die only then.

Ignored: DeepSeek-V2's complex-number RoPE (its transients differ slightly, nothing it saves);
YaRN's softmax scale (a value); selective checkpointing of the attention core (MLA runs its core
eagerly: ``checkpoint="selective"`` keeps its attention activations, in the replica too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.core.kernels import efficient_lse_len, mla_attention_kernel
from memcalc.core.spec import ModelSpec
from memcalc.engine.blocks.base import Linear, Norm
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

F32 = DType.fp32
TMP = "temporaries"


def mla_params(m: ModelSpec, linear: Linear, norm: Norm) -> None:
    """DeepseekV3Attention's projections and norms: q_a/kv_a/o biases are attention_bias; q_b, kv_b none."""
    d = m.d_model
    a, h = m.mla, m.n_heads
    assert a is not None
    if a.q_lora_rank is None:
        linear("q", "attn.q_proj", d, h * a.qk_head_dim, False)
    else:
        linear("q_a", "attn.q_a_proj", d, a.q_lora_rank, m.qkv_bias)
        norm("attn.q_a_layernorm", (a.q_lora_rank,), m.has_norm_bias)
        linear("q_b", "attn.q_b_proj", a.q_lora_rank, h * a.qk_head_dim, False)
    linear("kv_a", "attn.kv_a_proj_with_mqa", d, a.kv_lora_rank + a.qk_rope_head_dim, m.qkv_bias)
    norm("attn.kv_a_layernorm", (a.kv_lora_rank,), m.has_norm_bias)
    linear("kv_b", "attn.kv_b_proj", a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), False)
    linear("o", "attn.o_proj", h * a.v_head_dim, d, m.o_bias)


class _MLA:
    def __init__(self, fwd: ForwardContext, i: int) -> None:
        self.fwd, self.i, self.o, self.sim, self.m = fwd, i, fwd.ops, fwd.sim, fwd.m
        assert fwd.m.mla is not None
        self.a = fwd.m.mla

    def node(self, name: str, saved: list[T], grads: list[tuple[T, int]], params: list, outputs: list[T],
             temps: Optional[list[int]] = None) -> None:
        live = [(t, b) for t, b in grads if t.requires_grad]
        self.sim.node(name, saved, [t for t, _ in live], params, outputs, temps=temps or [],
                      grad_input_bytes=[b for _, b in live])

    def view(self) -> T:
        """A view: no bytes of its own (its gradient is what matters)."""
        return self.sim.alloc(0, "activations", self.o.category)

    def norm(self, x: T, width: int, name: str) -> T:
        return self.o.rmsnorm(x, self.fwd.rows, width, self.fwd.p(f"layers.{self.i}.{name}.weight"))

    def rope(self, x: T, n: int, dt: DType) -> T:
        """``cat([x1 cos - x2 sin, x2 cos + x1 sin])`` on even/odd slices of an ``n``-element view
        (whose storage is ``x``): four half products, a sub, an add, the cat."""
        o, h = self.o, n // 2
        a1, a2 = o.new(h, dt, kind=TMP), o.new(h, dt, kind=TMP)
        s1 = o.new(h, dt, kind=TMP)
        o.drop(a1, a2)
        b1, b2 = o.new(h, dt, kind=TMP), o.new(h, dt, kind=TMP)
        s2 = o.new(h, dt, kind=TMP)
        o.drop(b1, b2)
        y = o.new(n, dt)
        o.drop(s1, s2)
        self.node("rope_interleave", [], [(x, dt.nbytes(n))], [], [y], temps=[dt.nbytes(h)] * 2)
        return y

    def run(self, h: T) -> T:
        fwd, o, m, a, i = self.fwd, self.o, self.m, self.a, self.i
        N, B, Tq, H = fwd.rows, fwd.B, fwd.T, m.n_heads
        nope, rope, dv = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        qk = nope + rope
        if a.q_lora_rank is None:
            q = fwd.proj(h, i, "attn.q_proj", "q", H * qk)
        else:
            qa = fwd.proj(h, i, "attn.q_a_proj", "q_a", a.q_lora_rank)
            qn = self.norm(qa, a.q_lora_rank, "attn.q_a_layernorm")
            o.drop(qa)
            q = fwd.proj(qn, i, "attn.q_b_proj", "q_b", H * qk)
            o.drop(qn)
        dt = o.dtype_of(q)
        # view + transpose + split: two views; the split's backward cats their gradients and the
        # view's backward copies the transposed result back (reshape)
        q_pass, q_view = self.view(), self.view()
        self.node("split", [], [(q, q.nbytes)], [], [q_pass, q_view], temps=[q.nbytes])
        ckv = fwd.proj(h, i, "attn.kv_a_proj_with_mqa", "kv_a", a.kv_lora_rank + rope)
        # the latent and the rope part are views of ckv (small: their gradients go to ckv whole)
        kvn = self.norm(ckv, a.kv_lora_rank, "attn.kv_a_layernorm")
        q_rot = self.rope(q_view, N * H * rope, dt)
        k_rot = self.rope(ckv, N * rope, dt)
        query = o.new(N * H * qk, dt)  # cat((q_pass, q_rot))
        self.node("cat", [], [(q_pass, dt.nbytes(N * H * nope)), (q_rot, q_rot.nbytes)], [], [query])
        # expand_kv: kv_b output viewed (B, H, T, nope + v) and split: k_nope and the value are views
        kvb = fwd.proj(kvn, i, "attn.kv_b_proj", "kv_b", H * (nope + dv))
        o.drop(kvn)
        k_nope, value = self.view(), self.view()
        self.node("split", [], [(kvb, kvb.nbytes)], [], [k_nope, value], temps=[kvb.nbytes])
        key = o.new(N * H * qk, dt)  # new_empty, then copy_ of k_nope and of k_rot expanded
        kb = dt.nbytes(N * H * qk)
        self.node("copy_slices", [], [(k_nope, dt.nbytes(N * H * nope))], [], [key], temps=[kb])
        self.node("copy_slices", [], [(k_rot, k_rot.nbytes)], [], [key], temps=[kb])
        out = self.sdpa(query, key, kvb, value, B, H, Tq, qk, dv)
        o.drop(query, key)
        # transpose(1, 2).contiguous() copies nothing: the fused kernels return a transposed view of a
        # (B, T, H, v) buffer, so the transposed-back output is already contiguous
        y = fwd.proj(out, i, "attn.o_proj", "o", m.d_model)
        o.drop(out)
        # the method's locals die at its return
        o.drop(q, ckv, q_rot, k_rot, kvb, q_pass, q_view, k_nope, value)
        return y

    def sdpa(self, q: T, k: T, kv: T, v: T, B: int, H: int, Tq: int, qk: int, dv: int) -> T:
        """SDPA with q/k head dim ``qk`` and value head dim ``dv`` (the value ``v`` a view of ``kv``:
        the kernel saves the view, which keeps ``kv`` whole)."""
        o, m = self.o, self.m
        dt = o.dtype_of(q)
        kernel = mla_attention_kernel(o.attention_kernel(False, q), qk, dv)
        n_v = B * H * Tq * dv
        if kernel in ("flash", "efficient"):
            out = o.new(n_v, dt)
            if kernel == "flash":  # equal head dims only: the common formula
                from memcalc.core.kernels import flash_head_dim_rounded, flash_seq_rounded
                lse = o.new(B * H * Tq, F32)
                tr = flash_seq_rounded(Tq)
                temps = [B * tr * H * flash_head_dim_rounded(qk) * 4, B * H * tr * 4]
            else:
                lse = o.new(B * H * efficient_lse_len(Tq), F32)
                temps = [B * H * Tq * 4] + ([B * Tq * H * qk * 4] if dt != F32 else [])
            self.node(f"sdpa_{kernel}", [q, k, kv, out, lse], [(q, q.nbytes), (k, k.nbytes), (v, dt.nbytes(n_v))],
                      [], [out], temps=temps)
            o.drop(lse)
            return out
        # math: scores (B,H,T,T), softmax saved, the pre-scaled q and k copies, v
        return o.sdpa(q, k, kv, B, H, Tq, qk, None, 0, m.attn_dropout, kernel)


def mla_attention(fwd: ForwardContext, h: T, i: int) -> T:
    """The MLA attention block of layer ``i`` on the walk ``fwd``; returns a new reference."""
    return _MLA(fwd, i).run(h)
