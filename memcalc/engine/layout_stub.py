"""A first, approximate forward for the layouts of issue 12 (fused projections, q/k norms,
sinks, 4-norm and output-norm layers, two parallel norms, MoE, MLA).

Every parameter of :mod:`memcalc.engine.params` is used by one node, so each gets its gradient
(full fine-tuning) and every adapter its activations; the activations themselves are a first
approximation until the dedicated rules replace this module (issue 12: famdense for the dense
features, moemla for MoE and MLA):

* a fused projection's output is split by a copy (``split``): the pieces are new tensors;
* MoE routes ``rows x top_k`` token copies, spread evenly (``MoESpec.routing`` balanced): one
  gather, then the expert projections over all routed rows at once, then the router-weighted
  sum; the router logits are one ``rows x n_experts`` linear;
* MLA runs its projections and norms at their shapes and attends with head_dim
  ``qk_nope_head_dim + qk_rope_head_dim``;
* q/k norms, sinks, softcaps, multipliers and the sliding window add no activations here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.spec import ModelSpec
from memcalc.engine.sim import Param, T

if TYPE_CHECKING:
    from memcalc.engine.forward import Forward


def needs_stub_attention(m: ModelSpec) -> bool:
    return m.fused_qkv or m.mla is not None or m.qk_norm != "none" or m.attn_sinks


def needs_stub_mlp(m: ModelSpec) -> bool:
    return m.fused_gate_up or m.moe is not None


def needs_stub_layer(m: ModelSpec) -> bool:
    return m.norm_placement in ("sandwich", "output") or m.parallel_norms == 2


def split(f: "Forward", x: T, sizes: list[int]) -> list[T]:
    """Pieces of ``x`` (per row widths ``sizes``) as new tensors; the grad goes back to x whole."""
    o = f.ops
    dt = o.dtype_of(x)
    rows = x.numel // sum(sizes)
    outs = [o.new(rows * s, dt) for s in sizes]
    f.sim.node("split", [], [x], [], outs, grad_input_bytes=[x.nbytes])
    return outs


def norm_d(f: "Forward", x: T, rows: int, d: int, name: str) -> T:
    """A norm of width ``d`` over ``rows`` rows with the model's norm kind."""
    o = f.ops
    if f.m.norm == "rmsnorm":
        return o.rmsnorm(x, rows, d, f.p(name + ".weight"))
    return o.layernorm(x, rows, d, f.p(name + ".weight"), f.maybe(name + ".bias"))


def touch(f: "Forward", x: T, params: list[Optional[Param]]) -> None:
    """Parameters that enter the graph without a tensor of their own size (sinks): one node
    that sends them their gradient."""
    ps = [p for p in params if p is not None]
    if ps:
        y = f.ops.new(1, f.ops.dtype_of(x), kind="temporaries")
        f.sim.node("param_use", [], [x], ps, [y], grad_input_bytes=[0])
        f.ops.drop(y)


def attention(f: "Forward", h: T, i: int) -> T:
    o, m = f.ops, f.m
    pre = f"layers.{i}.attn"
    if m.mla is not None:
        return _mla(f, h, i)
    if m.fused_qkv:
        qkv = f.proj(h, i, "attn.qkv_proj", "qkv", m.q_dim + 2 * m.kv_dim)
        q, k, v = split(f, qkv, [m.q_dim, m.kv_dim, m.kv_dim])
        o.drop(qkv)
    else:
        q = f.proj(h, i, "attn.q_proj", "q", m.q_dim)
        k = f.proj(h, i, "attn.k_proj", "k", m.kv_dim)
        v = f.proj(h, i, "attn.v_proj", "v", m.kv_dim)
    if m.qk_norm != "none":
        hd = m.dim_head
        if m.qk_norm == "full":
            qn, kn = norm_d(f, q, f.rows, m.q_dim, pre + ".q_norm"), norm_d(f, k, f.rows, m.kv_dim, pre + ".k_norm")
        else:
            qn = norm_d(f, q, f.rows * m.n_heads, hd, pre + ".q_norm")
            kn = norm_d(f, k, f.rows * m.kv_heads, hd, pre + ".k_norm")
        o.drop(q, k)
        q, k = qn, kn
    touch(f, q, [f.maybe(pre + ".sinks")])
    out = f.strategy.core_attention(f, q, k, v, i, lambda: f.core_attention(q, k, v, i))
    o.drop(q, k, v)
    y = f.proj(out, i, "attn.o_proj", "o", m.d_model)
    o.drop(out)
    return y


def _mla(f: "Forward", h: T, i: int) -> T:
    o, m = f.ops, f.m
    a = m.mla
    assert a is not None
    H, rows = m.n_heads, f.rows
    pre = f"layers.{i}.attn"
    if a.q_lora_rank is None:
        q = f.proj(h, i, "attn.q_proj", "q", H * a.qk_head_dim)
    else:
        qa = f.proj(h, i, "attn.q_a_proj", "q_a", a.q_lora_rank)
        qn = norm_d(f, qa, rows, a.q_lora_rank, pre + ".q_a_layernorm")
        o.drop(qa)
        q = f.proj(qn, i, "attn.q_b_proj", "q_b", H * a.qk_head_dim)
        o.drop(qn)
    kva = f.proj(h, i, "attn.kv_a_proj_with_mqa", "kv_a", a.kv_lora_rank + a.qk_rope_head_dim)
    lat, k_rope = split(f, kva, [a.kv_lora_rank, a.qk_rope_head_dim])
    o.drop(kva)
    latn = norm_d(f, lat, rows, a.kv_lora_rank, pre + ".kv_a_layernorm")
    o.drop(lat)
    kv = f.proj(latn, i, "attn.kv_b_proj", "kv_b", H * (a.qk_nope_head_dim + a.v_head_dim))
    o.drop(latn)
    k_nope, v = split(f, kv, [H * a.qk_nope_head_dim, H * a.v_head_dim])
    o.drop(kv)
    k = o.new(rows * H * a.qk_head_dim, o.dtype_of(k_nope))  # cat(k_nope, k_rope expanded over heads)
    f.sim.node("cat", [], [k_nope, k_rope], [], [k], grad_input_bytes=[k_nope.nbytes, k_rope.nbytes])
    o.drop(k_nope, k_rope)
    kernel = o.attention_kernel(False, q)
    out = o.sdpa(q, k, v, f.B, H, f.T, a.qk_head_dim, None, 0, m.attn_dropout, kernel)
    o.drop(q, k, v)
    y = f.proj(out, i, "attn.o_proj", "o", m.d_model)
    o.drop(out)
    return y


def dense_mlp(f: "Forward", h: T, i: int, prefix: str, width: int) -> T:
    """A dense MLP of hidden width ``width`` under ``prefix`` (gated, fused gate_up, or plain)."""
    o, m = f.ops, f.m
    if m.mlp != "gated":
        u = f.proj(h, i, f"{prefix}.fc1", "up", width)
        a = o.activation(u, m.activation)
        o.drop(u)
        y = f.proj(a, i, f"{prefix}.fc2", "down", m.d_model)
        o.drop(a)
        return y
    if m.fused_gate_up:
        gu = f.proj(h, i, f"{prefix}.gate_up_proj", "gate_up", 2 * width)
        g, u = split(f, gu, [width, width])
        o.drop(gu)
    else:
        g = f.proj(h, i, f"{prefix}.gate_proj", "gate", width)
        u = f.proj(h, i, f"{prefix}.up_proj", "up", width)
    a = o.activation(g, m.activation)
    o.drop(g)
    x = o.mul(a, u)
    o.drop(a, u)
    y = f.proj(x, i, f"{prefix}.down_proj", "down", m.d_model)
    o.drop(x)
    return y


def _experts_linear(f: "Forward", x: T, rows: int, i: int, name: str, d_out: int) -> T:
    o = f.ops
    base = f"layers.{i}.moe.experts.{name}"
    y = o.linear(x, rows, f.p(base), f.maybe(base + "_bias"), d_out)
    a_p = f.maybe(base + ".lora_A")
    if a_p is None:
        return y
    lr = f.lora
    a = o.linear(x, rows, a_p, None, lr.rank)
    b = o.linear(a, rows, f.p(base + ".lora_B"), None, d_out)
    o.drop(a)
    out = o.add(y, b)
    o.drop(y, b)
    return out


def mlp(f: "Forward", h: T, i: int) -> T:
    o, m = f.ops, f.m
    moe = m.moe
    if moe is None or not moe.is_moe_layer(i):
        return dense_mlp(f, h, i, "mlp", m.d_ff)
    d, fe = m.d_model, moe.d_ff_expert
    logits = o.linear(h, f.rows, f.p(f"layers.{i}.moe.router.weight"), f.maybe(f"layers.{i}.moe.router.bias"),
                      moe.n_experts)
    routed = f.rows * moe.top_k
    xe = o.new(routed * d, o.dtype_of(h))  # index_select of each token once per chosen expert
    f.sim.node("index_select", [], [h], [], [xe], grad_input_bytes=[h.nbytes])
    if m.mlp == "gated":
        gu = _experts_linear(f, xe, routed, i, "gate_up_proj", 2 * fe)
        g, u = split(f, gu, [fe, fe])
        o.drop(gu)
        a = o.activation(g, m.activation)
        o.drop(g)
        x = o.mul(a, u)
        o.drop(a, u)
    else:
        up = _experts_linear(f, xe, routed, i, "gate_up_proj", fe)
        x = o.activation(up, m.activation)
        o.drop(up)
    o.drop(xe)
    ye = _experts_linear(f, x, routed, i, "down_proj", d)
    o.drop(x)
    w = o.new(routed, o.dtype_of(logits))  # routing weights (softmax, top-k)
    f.sim.node("topk_softmax", [w], [logits], [], [w])
    o.drop(logits)
    yw = o.mul(ye, w)
    o.drop(ye, w)
    y = o.new(f.rows * d, o.dtype_of(yw))  # index_add back to the tokens
    f.sim.node("index_add", [], [yw], [], [y], grad_input_bytes=[yw.nbytes])
    o.drop(yw)
    if moe.n_shared_experts:
        s = dense_mlp(f, h, i, "moe.shared_experts", moe.shared_width)
        if moe.shared_expert_gate:
            g = f.proj(h, i, "moe.shared_expert_gate", "shared_expert_gate", 1)
            s2 = o.mul(s, g)
            o.drop(s, g)
            s = s2
        y2 = o.add(y, s)
        o.drop(y, s)
        y = y2
    return y


def layer(f: "Forward", x: T, i: int) -> T:
    """Sandwich (4 norms), output-norm (OLMo-2) and two-norm parallel layers."""
    o, m = f.ops, f.m
    n = f"layers.{i}.norm"
    if m.block == "parallel":  # GPT-NeoX / Falcon new_decoder_architecture: ln_attn, ln_mlp
        h1 = f.norm(x, n + "1")
        a = f.resid_drop(f.attention(h1, i))
        o.drop(h1)
        h2 = f.norm(x, n + "2")
        g = f.resid_drop(f.mlp(h2, i))
        o.drop(h2)
        s = o.add(a, g)
        o.drop(a, g)
        y = o.add(s, x)
        o.drop(s)
        return y
    sandwich = m.norm_placement == "sandwich"
    h = f.norm(x, n + "1") if sandwich else o.ref_(x)
    a = f.attention(h, i)
    o.drop(h)
    an = f.norm(a, n + ("2" if sandwich else "1"))
    o.drop(a)
    ra = f.resid_drop(an)
    x1 = o.add(x, ra)
    o.drop(ra)
    h2 = f.norm(x1, n + "3") if sandwich else o.ref_(x1)
    g = f.mlp(h2, i)
    o.drop(h2)
    gn = f.norm(g, n + ("4" if sandwich else "2"))
    o.drop(g)
    rg = f.resid_drop(gn)
    y = o.add(x1, rg)
    o.drop(x1, rg)
    return y
