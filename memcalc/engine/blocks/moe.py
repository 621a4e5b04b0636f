"""The mixture-of-experts block: what its router and experts allocate, save and free, op by op.

Follows transformers 5.23 as it runs by default: the experts of every MoE family carry
``@use_experts_implementation`` and ``PreTrainedModel.get_correct_experts_implementation`` picks
``grouped_mm`` (transformers/integrations/moe.py ``grouped_mm_experts_forward``). The routers and
sparse blocks follow models/{qwen2_moe,qwen3_moe,mixtral,deepseek_v3}/modeling_*.py. The
validator's replica (``validate/moe.py``) runs the same ops in PyTorch.

With ``N = batch x seq`` tokens, ``k = top_k``, ``S = N x k`` routed rows, ``E`` experts,
``f = d_ff_expert``, ``d = d_model``, one MoE block holds for backward:

- router: the linear's input (when the router trains), the (N, E) fp32 softmax output (or the
  sigmoid scores), the top-k indices and the renormalisation's (N, k) copies;
- the gathered rows ``hidden[perm // k]`` (S, d) when the experts train (the grouped matmul's
  input), the (S,) int64 gather index, ``perm`` and ``inv_perm`` (S,) int64;
- the gate/up grouped matmul output (S, 2f) (both chunks are saved views: silu's input and the
  product's ``up``), the activation (S, f), the product (S, f) (the down matmul's input when the
  experts train), the down output (S, d) (the routing-weight product's saved operand), the
  sorted routing weights (S,).

The routing weights' dtype sets the dtype of the weighted output (S, d) and its reordered copy:
the model dtype for Qwen (``router_top_value.to(router_logits.dtype)``), fp32 for Mixtral and
DeepSeek-V3 (their routers never cast back), so that (S, d) pair is twice as large there.

LoRA on the experts (``experts`` targets, or gate/up/down on the families where PEFT converts them,
``MoESpec.lora_mlp_to_experts``): PEFT's ParamWrapper materialises ``W + B A * scale`` for each
adapted expert tensor (one ``baddbmm``, the size of the whole expert stack, in the weight dtype)
and the grouped matmul saves it, with its input: one extra copy of the adapted expert weights per
MoE layer lives until backward.

Routing: ``MoESpec.routing = "balanced"`` (each expert gets S / E rows). The grouped kernel sizes
every tensor by S alone, so this assumption moves no byte here; it would matter for the eager
per-expert loop (``experts_implementation="eager"``: the busiest expert's temporaries) and for
expert parallelism, neither modelled. Real routing is imbalanced; with the grouped kernel the
activation bytes are the same, the kernel's time is not.

LitGPT's ``LLaMAMoE`` (an eager per-expert loop, ``MoESpec.implementation`` litgpt) is :mod:`.litgpt_moe`.

Ignored: ``output_router_logits`` (False in every family's config: no load-balancing loss, so no
layer's logits outlive its block); the eager loop, expert parallelism, QLoRA's dequantisation
(transformers keeps the 3-D experts in the weight dtype) and gpt-oss's clamped SwiGLU with expert biases (the
default ``act(gate) * up`` is used); DeepSeek's group-limited routing temporaries are counted
with n_group 8, topk_group 4 (V3's config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.core.rules import deepseek_groups, expert_lora_ranks
from memcalc.engine.blocks.base import Linear, ParamTensor
from memcalc.engine.blocks.litgpt_moe import litgpt_moe_block, litgpt_moe_params
from memcalc.engine.blocks.mlp import mlp_params
from memcalc.engine.sim import Param, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

I64 = DType.int64
F32 = DType.fp32
ACT = "activations"
TMP = "temporaries"

def router_kind(m: ModelSpec) -> str:
    """``softmax`` (Qwen2/3-MoE: fp32 softmax, weights cast back to the model dtype),
    ``softmax-fp32`` (Mixtral: weights stay fp32), ``sigmoid`` (DeepSeek-V3: fp32 router linear,
    sigmoid scores, fp32 weights)."""
    assert m.moe is not None
    return m.moe.router


def moe_params(m: ModelSpec, i: int, linear: Linear, out: list[ParamTensor], full: bool,
               lora: Optional[LoraSpec], ep: int = 1) -> None:
    """One MoE block: router (E x d, a bias on gpt-oss), routed experts stored as 3-D parameters
    (transformers 5 MixtralExperts / Qwen3MoeExperts / DeepseekV3NaiveMoe / GptOssExperts:
    gate_up_proj E x 2f x d, down_proj E x d x f, biases E x 2f and E x d on gpt-oss), shared
    experts as one dense MLP of width ``shared_width`` (DeepseekV3MoE.shared_experts,
    Qwen2MoeSparseMoeBlock.shared_expert) and Qwen2-MoE's shared_expert_gate Linear(d, 1).

    LoRA: ``target_modules`` reach only nn.Linear modules (shared experts, dense layers), never
    the 3-D expert parameters; target ``experts`` is PEFT's ``target_parameters`` on
    experts.gate_up_proj and experts.down_proj, whose ParamWrapper holds lora_A: (r * E) x in and
    lora_B: out x (r * E) (peft 0.21 tuners/lora/layer.py ParamWrapper.update_layer).
    QLoRA: the expert tensors and the router stay in the weight dtype: transformers 5.23 bitsandbytes
    replaces only ``nn.Linear`` / ``Conv1D`` modules with 4-bit ones (integrations/bitsandbytes.py
    ``replace_with_bnb_linear``; quantizer_bnb_4bit ``param_needs_quantization``: a Linear4bit's
    weight), and the experts are 3-D ``nn.Parameter``s. Shared experts and dense layers (nn.Linear)
    are quantized.
    Expert parallelism (``ep`` > 1, :mod:`memcalc.engine.expert_parallel`): the routed experts'
    tensors hold this rank's ``n_experts / ep`` experts (torchtitan's ``Shard(0)``); the router
    and the shared experts are whole.
    """
    moe = m.moe
    assert moe is not None
    if moe.implementation == "litgpt":  # LitGPT's LLaMAMoE: one module per expert (blocks/litgpt_moe.py)
        return litgpt_moe_params(m, i, lora, out)
    d, e, f = m.d_model, moe.n_experts, moe.d_ff_expert
    out.append(ParamTensor(f"layers.{i}.moe.router.weight", (e, d), i, full, "router"))
    if moe.router_bias:
        out.append(ParamTensor(f"layers.{i}.moe.router.bias", (e,), i, full, "bias"))
    up_width = 2 * f if m.mlp == "gated" else f
    ranks = expert_lora_ranks(m, lora)
    for name, d_in, d_out in (("gate_up_proj", d, up_width), ("down_proj", f, d)):
        out.append(ParamTensor(f"layers.{i}.moe.experts.{name}", (e // ep, d_out, d_in), i, full, "experts"))
        if moe.expert_bias:
            out.append(ParamTensor(f"layers.{i}.moe.experts.{name}_bias", (e, d_out), i, full, "bias"))
        r = ranks[name]
        if r:
            out.append(ParamTensor(f"layers.{i}.moe.experts.{name}.lora_A", (r * e, d_in), i, True, "lora"))
            out.append(ParamTensor(f"layers.{i}.moe.experts.{name}.lora_B", (d_out, r * e), i, True, "lora"))
    if moe.n_shared_experts:
        mlp_params(m, "moe.shared_experts", moe.shared_width, False, linear)
    if moe.shared_expert_gate:
        linear("shared_expert_gate", "moe.shared_expert_gate", d, 1, False)


class _Block:
    """One MoE block on the forward walk ``fwd`` (:class:`memcalc.engine.context.ForwardContext`)."""

    def __init__(self, fwd: ForwardContext, i: int) -> None:
        self.fwd, self.i = fwd, i
        self.o, self.sim = fwd.ops, fwd.sim
        self.m = fwd.m
        assert fwd.m.moe is not None
        self.moe = fwd.m.moe
        self.N = fwd.rows

    # -- helpers ------------------------------------------------------------------------
    def p(self, name: str) -> Param:
        return self.fwd.p(f"layers.{self.i}.moe.{name}")

    def new(self, numel: int, dt: DType, kind: str = ACT) -> T:
        return self.o.new(numel, dt, kind=kind)

    def raw(self, nbytes: int) -> T:
        """An integer tensor (int32 offsets and histograms: no DType of their own here)."""
        return self.sim.alloc(nbytes, ACT, self.o.category)

    def node(self, name: str, saved: list[T], grads: list[tuple[T, int]], params: list[Param], outputs: list[T],
             temps: Optional[list[int]] = None) -> None:
        """An autograd node; ``grads`` pairs each input with the bytes of the gradient it receives."""
        live = [(t, b) for t, b in grads if t.requires_grad]
        self.sim.node(name, saved, [t for t, _ in live], params, outputs, temps=temps or [],
                      grad_input_bytes=[b for _, b in live])

    def drop(self, *ts: Optional[T]) -> None:
        self.o.drop(*ts)

    # -- the router ---------------------------------------------------------------------
    def router(self, x: T, dt: DType) -> tuple[T, T, T]:
        """(logits, routing weights (N, k), indices (N, k) int64), as the router returns them."""
        if router_kind(self.m) == "sigmoid":
            return self._router_sigmoid(x, dt)
        N, E = self.N, self.moe.n_experts
        o = self.o
        w = self.p("router.weight")
        logits = o.linear(x, N, w, self.fwd.maybe(f"layers.{self.i}.moe.router.bias"), E)
        ldt = o.dtype_of(logits)
        if ldt != F32:  # softmax(logits, dtype=float) / softmax(logits.float()): a cast copy
            lf = self.new(N * E, F32)
            self.node("to_fp32", [], [(logits, logits.nbytes)], [], [lf])
        else:
            lf = o.ref_(logits)
        probs = self.new(N * E, F32)
        self.node("softmax", [probs], [(lf, lf.nbytes)], [], [probs])
        self.drop(lf)
        return (logits,) + self._topk_renorm(probs, F32, N * E, cast_to=ldt if router_kind(self.m) == "softmax" else None)

    def _topk_renorm(self, probs: T, pdt: DType, n_in: int, cast_to: Optional[DType]) -> tuple[T, T]:
        """``topk`` then ``v /= v.sum(-1, keepdim=True)`` (autograd saves a clone of v and the sum)."""
        N, k = self.N, self.moe.top_k
        vals = self.new(N * k, pdt)
        idx = self.new(N * k, I64)
        # topk backward: new_zeros (N, E) then scatter (N, E): the gradient plus one temporary
        self.node("topk", [idx], [(probs, pdt.nbytes(n_in))], [], [vals], temps=[pdt.nbytes(n_in)])
        self.drop(probs)
        s = self.new(N, pdt)
        self.node("sum", [], [(vals, vals.nbytes)], [], [s])
        orig = self.new(N * k, pdt)  # div_'s saved original self
        self.node("div_", [orig, s], [(vals, vals.nbytes), (s, s.nbytes)], [], [vals],
                  temps=[vals.nbytes] * 3)
        self.drop(orig, s)
        if cast_to is not None and cast_to != pdt:
            wts = self.new(N * k, cast_to)
            self.node("to_dtype", [], [(vals, vals.nbytes)], [], [wts])
            self.drop(vals)
            vals = wts
        return vals, idx

    def _router_sigmoid(self, x: T, dt: DType) -> tuple[T, T, T]:
        """DeepseekV3TopkRouter.forward: ``linear(x.type(fp32), W.type(fp32))``, sigmoid, the
        group-limited choice (no gradient), ``scores.gather``, renormalised, times the scale. Under
        autocast the linear runs in the autocast dtype, and so do the scores and weights."""
        o = self.o
        N, E, k = self.N, self.moe.n_experts, self.moe.top_k
        G, TG = deepseek_groups(E)
        w = self.p("router.weight")
        if o.autocast is not None:  # .type(fp32) is a no-op on fp32 tensors; autocast's linear casts both
            logits = o.linear(x, N, w, None, E)
        else:
            xf = o.ref_(x) if dt == F32 else self.new(N * self.m.d_model, F32)
            if xf is not x:
                self.node("to_fp32", [], [(x, x.nbytes)], [], [xf])
            wf_bytes = F32.nbytes(w.numel)
            wf = self.new(w.numel, F32) if w.weight.itemsize_bits != 32 else None
            logits = self.new(N * E, F32)
            saved = ([xf] if w.trainable else []) + ([wf] if wf is not None and xf.requires_grad else [])
            self.node("router_linear", saved, [(xf, xf.nbytes)], [w], [logits],
                      temps=[wf_bytes] if wf is not None and w.trainable else [])
            self.drop(xf, wf)
        sdt = o.dtype_of(logits)  # fp32, or the autocast dtype
        scores = self.new(N * E, sdt)
        self.node("sigmoid", [scores], [(logits, logits.nbytes)], [], [scores])
        # the choice path: no gradient reaches it (topk indices), so transients with their lifetimes;
        # the fp32 correction bias promotes it to fp32
        choice = self.new(N * E, F32)
        top2v, top2i = self.new(N * G * min(2, E // G), F32), self.new(N * G * min(2, E // G), I64)
        self.drop(top2i)
        group_scores = self.new(N * G, F32)
        self.drop(top2v)
        tgv, group_idx = self.new(N * TG, F32), self.new(N * TG, I64)
        self.drop(tgv)
        group_mask = self.new(N * G, F32)
        score_mask = self.new(N * E, F32)
        b1 = self.sim.alloc(N * E, ACT, o.category)  # .bool()
        b2 = self.sim.alloc(N * E, ACT, o.category)  # ~
        self.drop(b1)
        choice2 = self.new(N * E, F32)  # masked_fill
        self.drop(b2, choice)
        tkv, idx = self.new(N * k, F32), self.new(N * k, I64)
        self.drop(tkv)
        wts = self.new(N * k, sdt)
        self.node("gather", [idx], [(scores, scores.nbytes)], [], [wts], temps=[scores.nbytes])
        s = self.new(N, sdt)
        self.node("sum", [], [(wts, wts.nbytes)], [], [s])
        den = self.new(N, sdt)  # + 1e-20
        self.node("add_scalar", [], [(s, s.nbytes)], [], [den])
        self.drop(s)
        orig = self.new(N * k, sdt)
        self.node("div_", [orig, den], [(wts, wts.nbytes), (den, den.nbytes)], [], [wts], temps=[wts.nbytes] * 3)
        self.drop(orig)
        out = self.new(N * k, sdt)  # * routed_scaling_factor
        self.node("mul_scalar", [], [(wts, wts.nbytes)], [], [out])
        # the router's locals die at its return
        self.drop(wts, den, choice2, score_mask, group_mask, group_idx, group_scores, scores)
        return logits, out, idx

    # -- the experts --------------------------------------------------------------------
    def adapted(self, name: str) -> Optional[T]:
        """PEFT's ParamWrapper on a 3-D expert tensor (``target_parameters``; peft 0.21
        tuners/lora/layer.py ``_LoraFactorsProxy``): while the experts run, the parameter is the
        parametrization ``baddbmm(W, B', A', alpha=scale)``, a new tensor the size of the whole
        expert stack (cached for the call), which the grouped matmul saves. None without an adapter."""
        pre = f"layers.{self.i}.moe.experts.{name}"
        a_p = self.fwd.maybe(pre + ".lora_A")
        if a_p is None:
            return None
        w = self.p(f"experts.{name}")
        wp = self.new(w.numel, self.o.dtype_of(w.weight))
        # baddbmm backward: the factors' gradients (two small bmm); saves the factors (parameters)
        self.node("baddbmm", [], [], [a_p, self.fwd.p(pre + ".lora_B")], [wp])
        return wp

    def experts(self, x: T, wts: T, idx: T, dt: DType) -> T:
        """``grouped_mm_experts_forward`` (see the module docstring); returns the (N, d) output."""
        if self.fwd.exp.training.ep > 1:  # torchtitan's all-to-all dispatch around them
            from memcalc.engine.expert_parallel import ep_experts

            return ep_experts(self, x, wts, idx, dt)
        o = self.o
        N, E, k, d, f = self.N, self.moe.n_experts, self.moe.top_k, self.m.d_model, self.moe.d_ff_expert
        S = N * k
        gated = self.m.mlp == "gated"
        up_w = 2 * f if gated else f
        wdt = o.dtype_of(wts)
        gu, dn = self.p("experts.gate_up_proj"), self.p("experts.down_proj")
        ids_g, perm = self.new(S, I64), self.new(S, I64)  # torch.sort
        gidx = self.new(S, I64)  # perm // top_k
        sel = self.new(S * d, dt)  # hidden[perm // top_k]
        # index backward: new_zeros (N, d) + index_put (N, d)
        self.node("index", [gidx], [(x, dt.nbytes(N * d))], [], [sel], temps=[dt.nbytes(N * d)])
        self.drop(gidx)
        wts_g = self.new(S, wdt)  # sample_weights[perm]
        self.node("index", [perm], [(wts, wts.nbytes)], [], [wts_g], temps=[wdt.nbytes(S)])
        hist_in = self.raw(4 * S)  # expert_ids_g.int()
        per_expert = self.raw(4 * E)  # histc
        offsets = self.raw(4 * E)  # cumsum (int32)
        wgu = self.adapted("gate_up_proj")
        bgu = self.bias("gate_up_proj", S, up_w, dt)
        proj = self.new(S * up_w, dt)
        self.grouped_mm(sel, gu, wgu, offsets, proj)
        self.add_bias(proj, bgu)
        if gated:
            # chunk(2): two views; act(gate) saves gate, the product saves act(gate) and up: the
            # whole (S, 2f) projection stays alive through its views
            gv = self.sim.alloc(0, ACT, o.category)
            uv = self.sim.alloc(0, ACT, o.category)
            self.node("chunk", [], [(proj, proj.nbytes)], [], [gv, uv])
            a = self.new(S * f, dt)
            self.node(self.m.activation, [a] if self.m.activation == "relu" else [proj], [(gv, dt.nbytes(S * f))],
                      [], [a])
            h = self.new(S * f, dt)
            self.node("mul", [a, proj], [(a, a.nbytes), (uv, dt.nbytes(S * f))], [], [h])
            self.drop(a, gv, uv)
        else:
            h = self.new(S * f, dt)
            self.node(self.m.activation, [h] if self.m.activation == "relu" else [proj], [(proj, proj.nbytes)], [], [h])
        self.drop(proj)
        wdn = self.adapted("down_proj")
        bdn = self.bias("down_proj", S, d, dt)
        y = self.new(S * d, dt)
        self.grouped_mm(h, dn, wdn, offsets, y)
        self.add_bias(y, bdn)
        self.drop(h)
        pdt = F32 if F32 in (dt, wdt) else dt  # type promotion of proj_out * weights
        wy = self.new(S * d, pdt)
        # mul backward (autograd's MulBackward0, then the engine's validate_outputs): grad * y and
        # grad * w are both made in the promoted dtype before the engine sums the first to (S, 1) and
        # casts the second back to y's dtype (the meta trace shows both (S, d) products alive)
        temps = [pdt.nbytes(S * d)] + ([pdt.nbytes(S * d)] if pdt != dt else [])
        self.node("mul", ([wts_g] if y.requires_grad else []) + ([y] if wts_g.requires_grad else []),
                  [(y, y.nbytes), (wts_g, wts_g.nbytes)], [], [wy], temps=temps)
        inv = self.new(S, I64)  # empty_like(perm)
        ar = self.new(S, I64)  # arange, written into inv_perm by index_put_
        self.drop(ar)
        wy2 = self.new(S * d, pdt)  # weighted_out[inv_perm]
        self.node("index", [inv], [(wy, wy.nbytes)], [], [wy2], temps=[wy.nbytes])
        self.drop(wy)
        out = self.new(N * d, pdt)  # view(N, k, d).sum(1); its backward expands, and the view copies
        self.node("sum", [], [(wy2, wy2.nbytes)], [], [out])
        if pdt != dt:
            res = self.new(N * d, dt)
            self.node("to_dtype", [], [(out, out.nbytes)], [], [res])
        else:
            res = o.ref_(out)
        # locals die at the function's return
        self.drop(ids_g, perm, sel, wts_g, hist_in, per_expert, offsets, y, inv, wy2, out, wgu, wdn, bgu, bdn)
        return res

    def bias(self, name: str, S: int, width: int, dt: DType) -> Optional[T]:
        """gpt-oss's expert biases: ``<name>_bias[expert_ids_g]`` gathers one bias row per routed row
        (S, width); its backward scatters into the (E, width) bias gradient. None without biases."""
        b = self.fwd.maybe(f"layers.{self.i}.moe.experts.{name}_bias")
        if b is None:
            return None
        rows = self.new(S * width, dt)
        self.node("index", [], [], [b], [rows], temps=[dt.nbytes(S * width)])
        return rows

    def add_bias(self, y: T, b: Optional[T]) -> None:
        """``out.add_(bias)`` in place: no new tensor; its backward hands the same gradient to both
        (modelled as a new gradient of y's size, and an empty one for the gathered biases)."""
        if b is not None:
            self.node("add_", [], [(y, y.nbytes), (b, 0)], [], [y])

    def grouped_mm(self, x: T, w: Param, wp: Optional[T], offsets: T, y: T) -> None:
        """``_grouped_mm(x, W^T, offs)``: saves x when the weight needs a gradient, the weight (a
        parameter, or the adapted copy ``wp``) when x does, and the offsets; backward makes x's
        gradient and the weight's (E, in, out)."""
        if wp is None:
            self.node("grouped_mm", ([x] if w.trainable else []) + [offsets], [(x, x.nbytes)], [w], [y])
        else:
            self.node("grouped_mm", [x, wp, offsets], [(x, x.nbytes), (wp, wp.nbytes)], [], [y])

    # -- the block ----------------------------------------------------------------------
    def run(self, h: T) -> T:
        o, moe = self.o, self.moe
        dt = o.dtype_of(h)
        shared = None
        if moe.shared_expert_gate:  # Qwen2MoeSparseMoeBlock: the shared expert first
            shared = self.shared(h)
        logits, wts, idx = self.router(h, dt)
        y = self.experts(h, wts, idx, dt)
        if shared is not None:  # (moe.shared_expert_gate)
            g = self.fwd.proj(h, self.i, "moe.shared_expert_gate", "shared_expert_gate", 1)
            sg = self.new(self.N, o.dtype_of(g))
            self.node("sigmoid", [sg], [(g, g.nbytes)], [], [sg])
            o.drop(g)
            gs = o.mul(sg, shared)
            o.drop(sg, shared)
            z = o.add(y, gs)
            o.drop(y, gs)
            y = z
        elif moe.n_shared_experts and self.fwd.tp:  # torchtitan MoE.forward under tp (no --ep): below
            y = self.tp_shared(h, y)
        elif moe.n_shared_experts:  # DeepseekV3MoE: experts(...) + shared_experts(residuals)
            s = self.shared(h)
            z = o.add(y, s)
            o.drop(y, s)
            y = z
        o.drop(logits, wts, idx)
        return y

    def tp_shared(self, h: T, y: T) -> T:
        """torchtitan 0.3.0 ``MoE.forward`` (routed, then shared, then the sum) under
        ``set_moe_sharding_config(enable_ep=False)`` (models/common/moe_sharding.py): the shared experts'
        w1/w3 take the block's ``Replicate`` input as a DTensor (``_shared_expert_colwise_config``: no
        per-linear reduction of its gradient, which stays ``Partial`` to the MoE boundary). With sequence
        parallelism the routed output and the shared w2's are each reduce-scattered to ``Shard(1)``
        (``desired_experts_output_layout``, ``_shared_expert_rowwise_config``) and summed on the shard;
        without, the two ``Partial`` outputs are summed whole and all-reduced once at the boundary
        (:func:`moe_block`)."""
        fwd, o = self.fwd, self.o
        tp = fwd.tp
        assert tp is not None
        if tp.sp:
            y = tp.reduce(fwd, y)
        fwd.tp = None  # the shared linears' colwise inputs: no TensorParallel.colwise reduction
        try:
            s = self.shared(h)
        finally:
            fwd.tp = tp
        if tp.sp:
            s = tp.reduce(fwd, s)
        z = o.add(y, s)
        o.drop(y, s)
        return z

    def shared(self, h: T) -> T:
        """The shared experts: one dense MLP of ``shared_width`` (gate, up, down as the layer's MLP)."""
        fwd, o, m, i = self.fwd, self.o, self.m, self.i
        width = self.moe.shared_width
        pre = "moe.shared_experts"
        if m.mlp == "gated":
            g = fwd.proj(h, i, f"{pre}.gate_proj", "gate", width)
            a = o.activation(g, m.activation)
            o.drop(g)
            u = fwd.proj(h, i, f"{pre}.up_proj", "up", width)
            x = o.mul(a, u)
            o.drop(a, u)
            y = fwd.proj(x, i, f"{pre}.down_proj", "down", m.d_model)
        else:
            f1 = fwd.proj(h, i, f"{pre}.fc1", "up", width)
            x = o.activation(f1, m.activation)
            o.drop(f1)
            y = fwd.proj(x, i, f"{pre}.fc2", "down", m.d_model)
        o.drop(x)
        return y


def moe_block(fwd: ForwardContext, h: T, i: int) -> T:
    """The MoE feed-forward block of layer ``i`` on the walk ``fwd``; returns a new reference."""
    assert fwd.m.moe is not None
    if fwd.m.moe.implementation == "litgpt":  # LitGPT 0.5.13's LLaMAMoE loop (blocks/litgpt_moe.py)
        return litgpt_moe_block(fwd, h, i)
    # tensor parallelism (no --ep): torchtitan 0.3.0 models/common/moe_sharding.py _moe_sharding_config with
    # enable_ep=False: the input redistributed to Replicate (gathered under SP; its Partial gradient reduced), the
    # experts run on d_ff_expert / tp (local_model), the Partial output all-reduced / reduce-scattered
    if fwd.tp:
        x = fwd.tp.gather(fwd, h)
        y = _Block(fwd, i).run(x)
        fwd.ops.drop(x)
        if fwd.tp.sp and fwd.m.moe.n_shared_experts:  # already reduce-scattered (_Block.tp_shared)
            return y
        return fwd.tp.reduce(fwd, y)
    return _Block(fwd, i).run(h)
