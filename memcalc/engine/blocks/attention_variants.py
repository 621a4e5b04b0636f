"""Attention of the model families beyond Llama: fused q,k,v, q/k norms, eager attention
(softcapped scores, attention sinks) and sliding-window masks, op by op as transformers 5 runs
them (the validator's replica, ``validate/model.py`` and ``validate/variants.py``, runs the same ops).

- **Fused q,k,v** (GPT-2 ``c_attn`` + ``split``, Phi-3 ``qkv_proj`` + slices, GPT-NeoX
  ``query_key_value`` + ``chunk``): one projection output; q, k and v are views of it (no
  bytes). A kernel that saves a view keeps the whole projection output alive (flash saves v when
  K/V are not expanded, so q and k's part of the storage stays too). Backward: the views'
  gradients meet in the split's backward, one full-size gradient (``split_backward`` = ``cat``).
  Not modelled: Falcon's ``_split_heads`` (advanced indexing and ``broadcast_to`` + ``flatten``:
  K/V copies at full head count).
- **q/k norms** (``qk_norm``): Qwen3/Gemma-3 ``q_norm(q_proj(x).view(B, T, H, D))`` (a norm over each
  head: rows B*T*H, width D, one weight of D), Cohere/StableLM per-head weights (H, D)
  (``head_unshared``), OLMo-2 over the whole projection (``q_norm(q_proj(x))``: rows B*T, width
  q_dim). Each is the model's norm (RMSNorm as the profile's ``rmsnorm`` mode, or LayerNorm), so
  it saves what the layer norms save. ``head_unshared`` with LayerNorm is a weightless
  ``layer_norm`` over D times the (H, D) weight (the weight multiply saves the normalised input).
- **Eager attention** (``attn_softcap``: Gemma-2; ``attn_sinks``: gpt-oss): ``Gemma2PreTrainedModel``
  and ``GptOssPreTrainedModel`` set ``_supports_sdpa = False`` ("sdpa does not support
  softcapping"), so transformers' default ``attn_implementation`` is ``eager`` (flash needs the
  flash-attn package): :func:`eager_attention` follows ``eager_attention_forward`` of
  modeling_gemma2.py / modeling_gpt_oss.py. It materialises the (B, H, T, T) scores.
- **Masks**: eager attention adds a float mask ``masking_utils.eager_mask`` ((B, 1, T, T) in the
  embeddings' dtype, 0 / finfo.min), one per layer type, built once per forward in the model's
  ``forward`` and shared by the layers. With SDPA, a sliding layer at T >= window gets the boolean
  ``sdpa_mask`` ((1, 1, T, T) expanded to B: T*T bytes, shared), because
  ``_ignore_causal_mask_sdpa`` refuses to skip it when ``kv_length >= local_attention_size``;
  SDPA then converts it in every layer (``convert_boolean_attn_mask``: a (B, 1, T, T) tensor in
  the query dtype, which the memory-efficient kernel saves as its bias), an explicit mask rules
  flash out, and ``use_gqa_in_sdpa`` is false (K/V expanded by ``repeat_kv``). This is the rule
  for every framework: PyTorch's SDPA has no window argument (a flash-attn ``window_size`` call
  would keep the memory of plain causal flash); see :func:`sliding_mask_materialised`.

Ignores: tensors of a few elements (0-dim mask constants, the sinks' expand, the aranges of mask
construction: T int64 each, gone before the layers); a padding ``attention_mask`` (none is passed:
unpadded batches, so masks are (1, 1, T, T) expanded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.core.rules import eager, kv_cache, layer_slides, mask_types, rmsnorm_mode, sliding_mask_materialised
from memcalc.engine.blocks.norm import layernorm_ops
from memcalc.engine.ops import ACT, TMP, Ops
from memcalc.engine.records import Node, NodeHook
from memcalc.engine.sim import Param, Sim, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

MASKS = "attention masks"


# -- layer types and masks -------------------------------------------------------------------
def _bool_mask(ops: Ops, Tq: int, sliding: bool) -> T:
    """``sdpa_mask`` without padding: ``kv <= q`` (and ``kv > q - window``, ``and_masks``), a
    (1, 1, T, T) bool built by broadcasting aranges (T*T bytes; intermediates of the same size)."""
    sim = ops.sim
    causal = sim.alloc(Tq * Tq, ACT, MASKS)
    if not sliding:
        return causal
    both = sim.alloc(Tq * Tq, TMP, MASKS)  # ones(()) & causal
    ops.drop(causal)
    win = sim.alloc(Tq * Tq, TMP, MASKS)  # kv > q - window
    out = sim.alloc(Tq * Tq, ACT, MASKS)  # & the two
    ops.drop(both, win)
    return out


def build_masks(fwd: ForwardContext) -> dict[str, T]:
    """The masks the model's ``forward`` builds before its layers (``causal_mask_mapping``), alive
    until the layers are done. Eager families: a float (B, 1, T, T) mask per layer type
    (``eager_mask``: ``torch.where(bool_mask, 0, finfo.min)`` in the embeddings' dtype). SDPA
    families: the boolean sliding mask when :func:`sliding_mask_materialised` (the full layers'
    causal mask is skipped: ``is_causal``)."""
    m, ops, B, Tq = fwd.m, fwd.ops, fwd.B, fwd.T
    out: dict[str, T] = {}
    if eager(m):
        dt = fwd.tr.weight_dtype  # inputs_embeds.dtype
        for kind in mask_types(m):
            b = _bool_mask(ops, Tq, kind == "sliding")
            out[kind] = ops.new(B * Tq * Tq, dt, MASKS)
            ops.drop(b)
    elif any(layer_slides(m, i) for i in range(m.n_layers)) and sliding_mask_materialised(m, Tq):
        out["sliding"] = _bool_mask(ops, Tq, True)
    return out


def hold_masks(fwd: ForwardContext) -> None:
    """Under checkpointing a region's recompute closure keeps the masks it was given: each
    checkpointed layer (or attention core) its own layer type's mask, a ``sqrt`` segment all of
    them (the closure holds the whole mapping). A mask lives on until the backward of the
    lowest such region (its last user); the step's end releases any whose region never ran
    backward. Adds a reference per held mask (the caller drops its own)."""
    sim, m = fwd.sim, fwd.m
    regions = [n for n in sim.nodes if n.role == "checkpoint" and n.layer is not None]
    every = fwd.tr.checkpoint == "sqrt"
    for kind, t in fwd.masks.items():
        users = [n for n in regions if every or ("sliding" if layer_slides(m, n.layer) else "full") == kind]
        if not users:
            continue
        last = min(users, key=lambda n: n.layer)
        held = sim.ref(t)
        fwd.held_masks.append(held)

        def free(s: Sim, _node, held: T = held) -> None:
            if any(h is held for h in fwd.held_masks):
                fwd.held_masks.remove(held)
                s.unref(held)

        first = last.after_backward
        if first is None:
            last.after_backward = free
        else:
            def both(s: Sim, nd: Node, f: NodeHook = first, g: NodeHook = free) -> None:
                f(s, nd)
                g(s, nd)

            last.after_backward = both


def layer_mask(fwd: ForwardContext, i: int) -> Optional[T]:
    """The mask layer ``i`` receives (None: causal without a mask)."""
    masks = getattr(fwd, "masks", None) or {}
    return masks.get("sliding" if layer_slides(fwd.m, i) else "full")


# -- views -----------------------------------------------------------------------------------
def split_views(ops: Ops, base: T, sizes: list[int], name: str = "split") -> list[T]:
    """Views of ``base`` (``split``/``chunk``/slices of a projection output): no bytes; the split's
    backward gathers their gradients into one gradient of ``base``'s size (``split_backward``)."""
    sim = ops.sim
    views = []
    for n in sizes:
        v = sim.alloc(0, ACT, ops.category)
        v.numel, v.itemsize_bits, v.requires_grad = n, base.itemsize_bits, base.requires_grad
        views.append(v)
    sim.node(name, [], [base], [], views, grad_input_bytes=[base.nbytes])
    return views


def pin_views(sim: Sim, first_node: int, views: dict[int, tuple[T, T]]) -> None:
    """After ops on views: a node that saved a view keeps its base's storage alive too, and a
    gradient sent to a view has the view's logical size. ``views``: id(view) -> (view, base)."""
    for node in sim.nodes[first_node:]:
        bases = {id(views[id(t)][1]): views[id(t)][1] for t in node.saved if id(t) in views}
        for key, base in bases.items():  # the view (no bytes) stays saved; its base joins it
            if not any(t is base for t in node.saved):
                node.saved.append(sim.ref(base))
        if any(id(t) in views for t in node.inputs):
            sizes = node.grad_input_bytes or [t.nbytes for t in node.inputs]
            node.grad_input_bytes = [
                _logical_bytes(t) if id(t) in views else s for t, s in zip(node.inputs, sizes)]


def _logical_bytes(v: T) -> int:
    return -(-v.numel * v.itemsize_bits // 8)


def view_map(base: T, views: list[T]) -> dict[int, tuple[T, T]]:
    return {id(v): (v, base) for v in views}


# -- projections and q/k norms ---------------------------------------------------------------
def fused_qkv(fwd: ForwardContext, h: T, i: int) -> tuple[T, T, T, T]:
    """One q,k,v projection and its three views; returns (q, k, v, base)."""
    m = fwd.m
    base = fwd.proj(h, i, "attn.qkv_proj", "qkv", m.q_dim + 2 * m.kv_dim)
    q, k, v = split_views(fwd.ops, base, [fwd.rows * m.q_dim, fwd.rows * m.kv_dim, fwd.rows * m.kv_dim])
    return q, k, v, base


def qk_norm(fwd: ForwardContext, x: T, i: int, which: str, heads: int) -> T:
    """The q or k norm of layer ``i`` on x (B*T rows of heads*D): per head or over the projection."""
    m, o = fwd.m, fwd.ops
    name = f"layers.{i}.attn.{which}_norm"
    w = fwd.p(name + ".weight")
    D = m.dim_head
    rows, d = (fwd.rows * heads, D) if m.qk_norm in ("head", "head_unshared") else (fwd.rows, heads * D)
    if m.norm == "rmsnorm":
        return o.rmsnorm(x, rows, d, w, rmsnorm_mode(m, o.profile.rmsnorm))
    if m.norm_impl == "layernorm-ops":  # CohereLayerNorm((H, D)) on q and k: over each head, a weight per head
        return layernorm_ops(o, x, rows, d, w)
    if m.qk_norm != "head_unshared":
        return o.layernorm(x, rows, d, w, None)
    return _layernorm_per_head_weight(o, x, rows, d, w)


def _layernorm_per_head_weight(o: Ops, x: T, rows: int, d: int, w: Param) -> T:
    """``layer_norm(x, (D,))`` without affine, then ``* weight`` of shape (H, D) (Cohere's per-head
    norm weight): native_layer_norm saves input, mean, rstd; the multiply saves the normalised
    tensor for the weight's gradient."""
    sim = o.sim
    src = x
    if o.autocast is not None and x.itemsize_bits != 32:
        src = o.new(rows * d, DType.fp32)
        src.requires_grad = x.requires_grad
        sim.node("to_fp32", [], [x], [], [src])
    dt = o.dtype_of(src)
    mean, rstd = o.new(rows, DType.fp32), o.new(rows, DType.fp32)
    xn = o.new(rows * d, dt)
    sim.node("layer_norm", [src, mean, rstd], [src], [], [xn], temps=[rows * d * 4])
    o.drop(mean, rstd)
    if src is not x:
        o.drop(src)
    y = o.new(rows * d, dt)
    sim.node("mul_weight", [xn] if w.trainable else [], [xn], [w], [y], temps=[rows * d * dt.itemsize])
    o.drop(xn)
    return y


# -- the attention core ----------------------------------------------------------------------
def output_copy(fwd: ForwardContext, out: T, kernel: str) -> T:
    """``attn_output.transpose(1, 2).contiguous()`` (integrations/sdpa_attention.py
    ``sdpa_attention_forward``; the replica's ``reshape``) after SDPA: no copy when the kernel's
    output is a transposed view of a (B, T, H, D) buffer, a copy otherwise. Flash allocates its
    output like q (flash_api.cpp ``mha_fwd``: ``empty_like`` of q transposed; the meta kernel
    ``torch.empty_like(query)``): partial rotary builds q by ``torch.cat([q_embed, q_pass], -1)``
    (modeling_gpt_neox.py / modeling_phi.py / modeling_stablelm.py ``apply_rotary_pos_emb``), a
    contiguous (B, H, T, D) tensor, so the output is (B, H, T, D) and the transpose copies (the
    o projection then saves the copy for its weight's gradient). The memory-efficient kernel
    always returns a (B, T, H, D) buffer. LitGPT builds q by ``torch.cat((q_roped, q[..., rope_n_elem:]),
    dim=-1)`` whatever the rotary share (litgpt/model.py ``CausalSelfAttention.forward``, 0.4 to 0.5.13),
    so its flash output is always (B, H, T, D) and ``y.transpose(1, 2)`` then ``y.reshape(B, T, C)``
    copies. Returns ``out`` or its copy (``out`` dropped)."""
    m = fwd.m
    always_cat = fwd.exp.profile.framework == "litgpt"
    if kernel != "flash" or m.positions != "rope" or (m.rotary_pct >= 1 and not always_cat):
        return out
    o = fwd.ops
    y = o.new(out.numel, o.dtype_of(out))
    o.sim.node("contiguous", [], [out], [], [y])
    o.drop(out)
    return y


def cache_update(fwd: ForwardContext, k: T, v: T) -> tuple[T, T]:
    """``key_states, value_states = cache.update(key_states, value_states, layer_idx)`` when the
    forward fills a KV cache (:func:`memcalc.core.rules.kv_cache`): K (after RoPE) and V are copied
    (``ops.cache_cat``); attention then runs on the copies, and the cache holds them until the model's
    output is dropped (``Forward.release_cache``, after the loss). Takes over ``k``'s reference; the
    caller drops the returned V copy as well as its own ``v``."""
    o = fwd.ops
    kc, vc = o.cache_cat(k), o.cache_cat(v)
    o.drop(k)
    fwd.kv_cache.extend((o.ref_(kc), o.ref_(vc)))
    return kc, vc


def core_attention(fwd: ForwardContext, q: T, k: T, v: T, i: int, views: Optional[dict[int, tuple[T, T]]] = None) -> T:
    """RoPE, GQA expansion and the kernel for the families' variants: eager attention (softcap,
    sinks), an explicit sliding mask for SDPA, views of a fused projection. The plain path is
    :meth:`memcalc.engine.forward.Forward.core_attention`."""
    o, m, sim = fwd.ops, fwd.m, fwd.sim
    n0 = len(sim.nodes)
    H, D = m.n_heads, m.dim_head
    if m.positions == "rope":
        q2, k2 = o.rope(q, m.rotary_pct), o.rope(k, m.rotary_pct)
    else:
        q2, k2 = o.ref_(q), o.ref_(k)
    vc = None
    if kv_cache(m, fwd.tr.checkpoint, fwd.exp.profile.kv_cache):
        k2, vc = cache_update(fwd, k2, v)
        v = vc
    n_rep = m.n_heads // m.kv_heads
    mask = layer_mask(fwd, i)
    if eager(m):
        sinks = fwd.maybe(f"layers.{i}.attn.sinks") if m.attn_sinks else None
        out = eager_attention(o, q2, k2, v, fwd.B, H, fwd.T, D, n_rep, mask, m.attn_softcap, sinks,
                              m.attn_dropout, fwd.tr.compute_dtype)
        o.drop(q2, k2)
    else:
        bias, bias_bytes = None, 0
        if fwd.kv_heads == 1 and fwd.exp.profile.framework != "litgpt":
            # one kv head (Gemma-3 1B's MQA): repeat_kv's reshape of the (B, 1, n_rep, T, D) expand is a view
            # (transformers integrations/sdpa_attention.py repeat_kv; stride 0 over the heads), no copy, as on
            # the plain path (memcalc.engine.blocks.attention.core_attention)
            k3, v3 = o.ref_(k2), o.ref_(v)
        else:
            k3, v3 = o.repeat_kv(k2, n_rep), o.repeat_kv(v, n_rep)
        o.drop(k2)
        if mask is not None:
            bias, bias_bytes = sdpa_bool_mask(o, mask, fwd.B, fwd.T, q2)
        qa, ka, va = o.autocast_sdpa(q2, k3, v3)
        kernel = o.attention_kernel(bias is not None, qa)
        out = o.sdpa(qa, ka, va, fwd.B, H, fwd.T, D, bias, bias_bytes, m.attn_dropout, kernel)
        out = output_copy(fwd, out, kernel)
        o.drop(qa, ka, va, q2, k3, v3, bias)
    o.drop(vc)
    if views:
        pin_views(sim, n0, views)
    return out


def sdpa_bool_mask(o: Ops, mask: T, B: int, Tq: int, q: T) -> tuple[T, int]:
    """What ``scaled_dot_product_attention`` does with a boolean mask (aten attention.cpp
    ``convert_boolean_attn_mask``): ``zeros_like(mask, q.dtype)`` of the (B, 1, T, T) expanded
    mask (a full tensor: an expanded input is not dense), ``masked_fill_(mask.logical_not(), -inf)``
    (a transient (B, 1, T, T) bool); then ``preprocess_mask`` pads the last dim to a multiple of 8
    (``pad_bias``, a copy) when T is not one, and expands to (B, H, T, T) (a view). Returns the
    bias the memory-efficient kernel saves, and the bytes of its broadcast gradient (none: the
    mask needs no gradient)."""
    dt = o.dtype_of(q)
    conv = o.new(B * Tq * Tq, dt, MASKS)
    o.sim.transient(B * Tq * Tq, TMP, MASKS)  # logical_not
    if Tq % 8:
        padded = o.new(B * Tq * (Tq + 8 - Tq % 8), dt, MASKS)
        o.drop(conv)
        conv = padded
    return conv, 0


def eager_attention(o: Ops, q: T, k: T, v: T, B: int, H: int, Tq: int, D: int, n_rep: int,
                    mask: Optional[T], softcap: Optional[float], sinks: Optional[Param],
                    dropout_p: float, compute: DType) -> T:
    """transformers ``eager_attention_forward`` (modeling_gemma2.py; modeling_gpt_oss.py with sinks)
    on q (B, H, T, D) after RoPE (laid out (B, T, H, D)), k and v (B, kvH, T, D). Op by op, what
    autograd saves (``tools/autograd/derivatives.yaml``):

    1. ``repeat_kv`` of k and v (copies when n_rep > 1);
    2. ``matmul(q, k.transpose(2, 3))``: ``at::matmul`` folds to ``bmm`` through ``reshape``
       (B*H, T, D), a copy for q (its heads are not the outer stride) and for k when it was not
       expanded; ``bmm`` saves both reshaped operands; out (B, H, T, T);
    3. ``* scaling``: a new (B, H, T, T), saves nothing;
    4. softcap (Gemma-2): ``/ cap`` (new), ``tanh`` (new, saves its result), ``* cap`` (new);
    5. ``+ attention_mask``: new (B, H, T, T) (the wider of the two dtypes), saves nothing;
    6. sinks (gpt-oss): ``cat([scores, sinks expanded])`` (B, H, T, T + 1); ``max(-1, keepdim)``
       saves its int64 indices; ``-`` max: new; ``softmax(dtype=the same)`` saves its output; the
       ``[..., :-1]`` slice is a view (``bmm`` takes it without a copy), cast to v's dtype (a copy
       only when they differ: under autocast the fp32 mask made the scores fp32);
       otherwise ``softmax(dtype=float32)``: a bf16 input is first cast to an fp32 copy (fp16 on
       CUDA goes straight to ``_softmax(half_to_float=True)``); the fp32 output is saved; then
       ``.to(query.dtype)``: a new 16-bit copy;
    7. dropout (``native_dropout``: output and a bool mask) when p > 0;
    8. ``matmul(probs, v)``: saves the probabilities and v (reshaped: a copy when v was not
       expanded); out (B, H, T, D);
    9. ``transpose(1, 2).contiguous()``: a copy.

    Returns the (B, T, H*D) output. Ignores scalar tensors (the 0-dim sink expand, the mask
    constants)."""
    sim = o.sim
    dt = o.dtype_of(q)
    n_q = B * H * Tq * D
    nTT = B * H * Tq * Tq
    k3, v3 = o.repeat_kv(k, n_rep), o.repeat_kv(v, n_rep)
    qc = o.new(n_q, dt)  # reshape copy of q, not a node of its own (clone passes the gradient)
    kc = o.new(k3.numel, dt) if n_rep == 1 else o.ref_(k3)
    scores = o.new(nTT, dt)
    sim.node("matmul_qk", [qc, kc], [q, k3], [], [scores], flops=2 * B * H * Tq * Tq * D)
    o.drop(qc, kc, k3)
    s = o.new(nTT, dt)
    sim.node("mul_scalar", [], [scores], [], [s])
    o.drop(scores)
    if softcap is not None:
        d = o.new(nTT, dt)
        sim.node("div_scalar", [], [s], [], [d])
        o.drop(s)
        t = o.new(nTT, dt)
        sim.node("tanh", [t], [d], [], [t])
        o.drop(d)
        s = o.new(nTT, dt)
        sim.node("mul_scalar", [], [t], [], [s])
        o.drop(t)
    if mask is not None:  # the mask needs no gradient: the add's backward passes s's through
        wide = dt if dt.bits >= mask.itemsize_bits else o.dtype_of(mask)
        a = o.new(nTT, wide)
        sim.node("add", [], [s, mask], [], [a], grad_input_bytes=[s.nbytes], passes_grad=True)  # AddBackward0
        o.drop(s)
        s = a
    sdt = o.dtype_of(s)  # the scores' dtype after the mask (an fp32 mask under autocast promotes)
    if sinks is not None:
        nS = B * H * Tq * (Tq + 1)
        c = o.new(nS, sdt)
        sim.node("cat", [], [s], [sinks], [c], grad_input_bytes=[s.nbytes])
        o.drop(s)
        mx = o.new(B * H * Tq, sdt)
        idx = o.new(B * H * Tq, DType.int64)
        sim.node("max", [idx], [c], [], [mx])
        o.drop(idx)
        z = o.new(nS, sdt)
        sim.node("sub", [], [c, mx], [], [z])
        o.drop(c, mx)
        p = o.new(nS, sdt)
        sim.node("softmax", [p], [z], [], [p])
        o.drop(z)
        probs = p  # [..., :-1]: a view, bmm reads it in place
        if sdt.bits != v3.itemsize_bits:  # .to(value_states.dtype): under autocast an fp32 mask made
            probs = o.new(nTT, o.dtype_of(v3))  # the scores fp32 and v is 16-bit: a (B, H, T, T) copy
            sim.node("to_dtype", [], [p], [], [probs])
            o.drop(p)
    else:
        src = s
        if sdt != DType.fp32 and compute != DType.fp16:
            src = o.new(nTT, DType.fp32)
            sim.node("to_fp32", [], [s], [], [src])
            o.drop(s)
        p32 = o.new(nTT, DType.fp32)
        sim.node("softmax", [p32], [src], [], [p32])
        o.drop(src)
        if dt != DType.fp32:
            probs = o.new(nTT, dt)
            sim.node("to_dtype", [], [p32], [], [probs])
            o.drop(p32)
        else:
            probs = p32
    if dropout_p > 0:
        pd = o.dropout(probs, dropout_p)
        o.drop(probs)
        probs = pd
    vc = o.new(v3.numel, o.dtype_of(v3)) if n_rep == 1 else o.ref_(v3)
    out = o.new(n_q, o.dtype_of(probs))
    sim.node("matmul_pv", [probs, vc], [probs, v3], [], [out], flops=2 * B * H * Tq * Tq * D)
    o.drop(probs, vc, v3)
    y = o.new(n_q, o.dtype_of(out))
    sim.node("contiguous", [], [out], [], [y])
    o.drop(out)
    return y


# -- the attention block ---------------------------------------------------------------------
def attention(fwd: ForwardContext, h: T, i: int) -> T:
    """The attention block of layer ``i``: projections (fused or not), q/k norms, the core (through
    the strategy's hook, so selective checkpointing recomputes it), the output projection."""
    o, m, sim = fwd.ops, fwd.m, fwd.sim
    n0 = len(sim.nodes)
    H, kvH = m.n_heads, m.kv_heads
    base: Optional[T] = None
    views: dict[int, tuple[T, T]] = {}
    if m.fused_qkv:
        q, k, v, base = fused_qkv(fwd, h, i)
        views = view_map(base, [q, k, v])
    else:
        q = fwd.proj(h, i, "attn.q_proj", "q", m.q_dim)
        k = fwd.proj(h, i, "attn.k_proj", "k", m.kv_dim)
        v = fwd.proj(h, i, "attn.v_proj", "v", m.kv_dim)
    if m.qk_norm != "none":
        qn, kn = qk_norm(fwd, q, i, "q", H), qk_norm(fwd, k, i, "k", kvH)
        o.drop(q, k)
        q, k = qn, kn
    if eager(m) or layer_mask(fwd, i) is not None:
        def core() -> T:
            return core_attention(fwd, q, k, v, i, views)
    else:
        def core() -> T:
            c0 = len(sim.nodes)
            out = fwd.core_attention(q, k, v, i)
            if views:
                pin_views(sim, c0, views)
            return out
    out = fwd.strategy.core_attention(fwd, q, k, v, i, core)
    if views:
        pin_views(sim, n0, views)
    o.drop(q, k, v, base)
    y = fwd.proj(out, i, "attn.o_proj", "o", m.d_model)
    o.drop(out)
    return y
