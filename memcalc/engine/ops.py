"""What each op allocates in forward, saves for backward, and allocates in backward.

One method per op kind. Each follows the CUDA kernel or the autograd formula named in its docstring
(``tools/autograd/derivatives.yaml`` in PyTorch unless said otherwise). Sizes come from element counts times
the dtype's width; the simulator rounds every block to the allocator granularity. Only tensors of at least one
activation's size matter for the peak; scalars and per-row statistics are kept because they are cheap to keep.
"""

from __future__ import annotations

from typing import Any, Optional

from memcalc.core.dtypes import DType
from memcalc.core.kernels import (choose_attention_kernel, efficient_lse_len, flash_head_dim_rounded, flash_seq_rounded,
                                  pow2_backward_temps)
from memcalc.engine.sim import Param, Sim, T, param_id
from memcalc.engine.retained import Retained
from memcalc.core.spec import KernelProfile

ACT = "activations"
TMP = "temporaries"
#: a tensor's dtype from its width (:meth:`Ops.dtype_of`)
_DTYPE_OF_BITS = {32: DType.fp32, 16: DType.bf16, 8: DType.uint8, 64: DType.int64}
#: ``DType.fp32`` (a class attribute of an Enum goes through EnumType.__getattr__'s slow path: the ops
#: read it per call). Widths below are ``bits // 8``: every dtype here is a whole-byte one (dtype_of).
FP32 = DType.fp32


class Ops:
    """Op library over a :class:`Sim`. ``autocast`` is the compute dtype under AMP, else None."""

    def __init__(self, sim: Sim, profile: KernelProfile, autocast: Optional[DType] = None) -> None:
        self.sim = sim
        self._alloc = sim.alloc  # (new's one call, bound once)
        self.profile = profile
        self.autocast = autocast
        self.autocast_cache: list[T] = []
        self.category = "saved activations"
        self.retained = Retained()  # what a 4-bit linear keeps on its ctx (:meth:`linear` quant_retain)

    # -- basics ---------------------------------------------------------------------
    def new(self, numel: int, dtype: DType, category: Optional[str] = None, kind: str = ACT) -> T:
        bits = dtype.bits
        return self._alloc(-(-numel * bits // 8), kind, category or self.category, False, "", numel, bits)

    def drop(self, *ts: Optional[T]) -> None:
        """A Python reference goes away."""
        unref = self.sim.unref
        for t in ts:
            if t is not None and t.refs > 1:  # another reference remains: nothing is freed (Sim.unref, inline)
                assert t.alive, f"double free of {t.name}"
                t.refs -= 1
            else:
                unref(t)

    def ref_(self, t: T) -> T:
        """A second Python reference to the same tensor (a view or an alias): ``Sim.ref``, inline."""
        assert t.alive, f"reference to a freed tensor {t.name}"
        t.refs += 1
        return t

    @staticmethod
    def dtype_of(t: T) -> DType:
        return _DTYPE_OF_BITS[t.itemsize_bits]

    def _cast_for_matmul(self, x: T) -> tuple[T, bool]:
        """Autocast's cast of an activation to the compute dtype (a copy when it differs)."""
        if self.autocast is None or x.itemsize_bits == self.autocast.bits:
            return x, False
        xc = self.new(x.numel, self.autocast)
        xc.requires_grad = x.requires_grad
        self.sim.note_op("to_copy", [x], [], [xc])
        return xc, True

    def _cast_weight(self, w: Param) -> tuple[Optional[T], bool]:
        """Autocast's cast of a weight; trainable leaves are cached until autocast exits."""
        if self.autocast is None or w.weight.itemsize_bits == self.autocast.bits:
            return None, False
        wc = self.new(w.numel, self.autocast, "autocast weight copies")
        self.sim.note_op("to_copy", [], [w], [wc])
        if w.trainable:
            self.autocast_cache.append(self.sim.ref(wc))
        return wc, True

    def exit_autocast(self) -> None:
        """Leaving the autocast region clears its weight cache."""
        for t in self.autocast_cache:
            self.sim.unref(t)
        self.autocast_cache = []

    # -- layers ---------------------------------------------------------------------
    def linear(self, x: T, rows: int, w: Param, b: Optional[Param], out_features: int,
               quant_transient_bytes: int = 0, quant_absmax_bytes: int = 0, quant_peak_bytes: int = 0,
               quant_saves_input: bool = False, quant_retain: bool = False) -> T:
        """y = x W^T + b (``addmm``/``mm``). Saves x iff W needs a gradient (grad_W = g^T x) and W
        iff x needs one (a parameter, no new bytes). A frozen linear keeps no input. Under autocast
        x and W are cast to the compute dtype; the casts are what is saved. QLoRA: the 4-bit weight
        is dequantised to a full-size copy in forward, alive with the output, and again in backward
        (alive with the input's gradient): bitsandbytes 0.50 ``MatMul4Bit`` saves only the packed
        weight (autograd/_functions.py); its forward's ``gemm_4bit`` runs the CUDA
        ``_dequant_linear_fallback`` (backends/cuda/ops.py: ``B_dq = torch.empty(shapeB)``, ``F.linear(A,
        B_dq, bias)``, with double quantisation two fp32 absmax buffers first, ``quant_absmax_bytes``
        each), its backward ``functional.dequantize_4bit`` (the nested absmax freed before the matmul);
        before 0.43.2 (``quant_saves_input``) it kept the input needing a gradient (``ctx.tensors = (A,
        B)``; ``quant_retain``: with the graph, :mod:`memcalc.engine.retained`). ``quant_peak_bytes``:
        a dequantization's peak both ways (torchao ``LinearNF4``'s, bitsandbytes 0.41/0.42's)."""
        if self.autocast is None:  # no casts (what _cast_for_matmul and _cast_weight return)
            xc, x_cast, wc = x, False, None
        else:
            xc, x_cast = self._cast_for_matmul(x)
            # a 4-bit weight is dequantised straight to the compute dtype (no autocast copy)
            wc = None if quant_transient_bytes else self._cast_weight(w)[0]
        deq = []
        if quant_transient_bytes:
            deq = [self.sim.alloc(nb, TMP, "dequantised weight") for nb in (quant_absmax_bytes, quant_absmax_bytes,
                                                                             quant_transient_bytes) if nb]
            if quant_peak_bytes > quant_transient_bytes:  # torchao: get_original_weight's locals beside its result
                self.sim.transient(quant_peak_bytes - quant_transient_bytes, TMP, "dequantisation")
        odt = self.autocast or self.dtype_of(x)
        y = self.new(rows * out_features, odt)
        for t in deq:
            self.sim.unref(t)
        saved = []
        # (a checkpointed region's first forward, grad disabled, both counts it as saved, for where the recompute
        # stops, and keeps it on the ctx; the recompute saves it: memcalc.engine.checkpoint)
        if w.trainable or (quant_saves_input and x.requires_grad and (not quant_retain or not self.sim.grad_enabled)):
            saved.append(xc)
        if not w.trainable and quant_retain and quant_saves_input and x.requires_grad:  # on the ctx
            self.retained.add(xc)
        if x.requires_grad and wc is not None:
            saved.append(wc)
        elif x.requires_grad and self.sim.offload is not None and self.sim.offload.active:
            saved.append(w.weight)  # ``weight.t()``: no GPU bytes, but offloading packs a view (engine.offload)
        params = [w] + ([b] if b is not None else [])
        temps = [quant_transient_bytes] if quant_transient_bytes and x.requires_grad else []
        if x_cast:  # grad arrives in the compute dtype, then _to_copy casts it back
            temps.append(xc.nbytes)
        in_features = w.numel // out_features
        kw: dict[str, Any] = {"on_backward": lambda s, _n: s.transient(quant_peak_bytes, TMP, "dequantisation")} if (
            quant_peak_bytes > quant_transient_bytes and x.requires_grad) else {}
        self.sim.node("linear", saved, [x], params, [y], temps=temps, flops=2 * rows * in_features * out_features, **kw)
        self.drop(xc if x_cast else None, wc)
        return y

    def embedding(self, ids: T, rows: int, w: Param, d: int) -> T:
        """embedding(ids, W): saves the ids (int64, already alive). Backward: embedding_dense_backward
        builds a full weight-sized gradient (that is the parameter gradient) plus per-segment
        partial sums in the accumulation type (fp32), at most rows x d."""
        y = self.new(rows * d, self.dtype_of(w.weight))
        self.sim.node("embedding", [ids], [], [w], [y], temps=[rows * d * 4])
        return y

    def add(self, a: T, b: T) -> T:
        """a + b: saves nothing; its gradient passes through (``passes_grad``: engine.sim_backward)."""
        dt = self.dtype_of(a) if a.itemsize_bits >= b.itemsize_bits else self.dtype_of(b)
        y = self.new(max(a.numel, b.numel), dt)
        self.sim.node("add", [], [a, b], [], [y], grad_input_bytes=[a.nbytes, b.nbytes], passes_grad=True)
        return y

    def scale(self, a: T, factor: float) -> T:
        """a * python_scalar: saves nothing."""
        if factor == 1.0:
            return self.sim.ref(a)
        y = self.new(a.numel, self.dtype_of(a))
        self.sim.node("mul_scalar", [], [a], [], [y])
        return y

    def mul(self, a: T, b: T) -> T:
        """a * b (both tensors): saves b for grad_a and a for grad_b (only what is needed)."""
        y = self.new(max(a.numel, b.numel), self.dtype_of(a))
        saved = ([b] if a.requires_grad else []) + ([a] if b.requires_grad else [])
        self.sim.node("mul", saved, [a, b], [], [y])
        return y

    def cast(self, x: T, dtype: DType) -> T:
        """``x.to(dtype)``: a copy when the dtype changes (``_to_copy``; its backward casts the
        gradient back and saves nothing), else the same tensor."""
        if x.itemsize_bits == dtype.bits:
            return self.sim.ref(x)
        y = self.new(x.numel, dtype)
        self.sim.node("to_copy", [], [x], [], [y])
        return y

    def clone(self, x: T) -> T:
        """``x.clone()``: a copy in the same dtype; its backward passes the gradient on and saves nothing."""
        y = self.new(x.numel, self.dtype_of(x))
        self.sim.node("clone", [], [x], [], [y])
        return y

    def activation(self, x: T, kind: str) -> T:
        """relu saves its result (threshold_backward(grad, result)); silu, gelu and gelu_tanh save
        their input (silu_backward/gelu_backward(grad, self)). gelu_new runs as the profile says:
        fused (``F.gelu(approximate="tanh")``, saves its input) or as Hugging Face's chain of
        pointwise ops (:meth:`gelu_new_chain`)."""
        if kind == "gelu_new" and self.profile.gelu_new == "chain":
            return self.gelu_new_chain(x)
        y = self.new(x.numel, self.dtype_of(x))
        saved = [y] if kind == "relu" else [x]
        self.sim.node(kind, saved, [x], [], [y])
        return y

    def gelu_new_chain(self, x: T) -> T:
        """transformers ``NewGELUActivation.forward`` (activations.py):
        ``0.5 * x * (1.0 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3.0))))``, op by op, with what
        autograd saves for each (tools/autograd/derivatives.yaml): ``t1 = 0.5 * x`` (a scalar
        multiply saves nothing); ``p = pow(x, 3)`` saves x (``pow_backward(grad, self, exponent)``, FunctionsManual.cpp,
        torch 2.13: ``self.pow(2)`` and ``3 * that`` beside its result, as pow2_backward_temps says of pow(x, 2));
        ``0.044715 * p``, ``x + .``, ``sqrt(2/pi) * .`` save nothing; ``th = tanh(.)`` saves its result; ``1.0 + th``
        saves nothing; ``t1 * (1 + th)`` saves both operands. So four x-sized tensors are saved (x, th, t1, 1 + th)
        where the fused kernel saves one. Under autocast ``pow`` is on CUDA's fp32 list: a 16-bit x is cast to fp32
        (the copy is what pow saves), the chain after it runs in fp32 (type promotion), ``t1`` stays in x's dtype
        and the result is fp32. Ignores the scalar tensors."""
        n = x.numel
        dt = self.dtype_of(x)
        t1 = self.new(n, dt)
        self.sim.node("mul_scalar", [], [x], [], [t1])
        xp = x
        if self.autocast is not None and dt != FP32:
            xp = self.new(n, FP32)
            xp.requires_grad = x.requires_grad
            self.sim.node("to_fp32", [], [x], [], [xp])
        ct = self.dtype_of(xp)
        p = self.new(n, ct)
        self.sim.node("pow", [xp], [xp], [], [p], temps=pow2_backward_temps(n, ct.bits // 8))
        if xp is not x:
            self.drop(xp)
        chain = p
        for op in ("mul_scalar", "add", "mul_scalar"):  # 0.044715 * p; x + .; sqrt(2/pi) * .
            nxt = self.new(n, ct)
            self.sim.node(op, [], [chain] + ([x] if op == "add" else []), [], [nxt])
            self.drop(chain)
            chain = nxt
        th = self.new(n, ct)
        self.sim.node("tanh", [th], [chain], [], [th])
        self.drop(chain)
        one = self.new(n, ct)
        self.sim.node("add_scalar", [], [th], [], [one])
        self.drop(th)
        y = self.new(n, ct if ct.bits >= dt.bits else dt)
        self.sim.node("mul", [t1, one], [t1, one], [], [y])
        self.drop(t1, one)
        return y

    def dropout(self, x: T, p: float) -> T:
        """native_dropout: output plus a mask of ``dropout_mask_bytes`` per element (CUDA: bool)."""
        if p <= 0:
            return self.sim.ref(x)
        y = self.new(x.numel, self.dtype_of(x))
        mask = self.sim.alloc(x.numel * self.profile.dropout_mask_bytes, ACT, "dropout masks")
        self.sim.node("dropout", [mask], [x], [], [y])
        self.drop(mask)
        return y

    def rmsnorm(self, x: T, rows: int, d: int, w: Param, mode: Optional[str] = None) -> T:
        """RMSNorm (``mode``: the formula, :func:`memcalc.core.rules.rmsnorm_mode`; None: the profile's).

        composite (PyTorch 2.6-2.8 on CUDA, aten/src/ATen/native/layer_norm.cpp ``rms_norm_symint``):
        ``xf = x.to(fp32)``; ``r = rsqrt(pow(xf, 2).mean(-1, keepdim).add_(eps))``;
        ``y = ((xf * r) * w).type_as(x)``. Saved: xf (fp32, a copy when x is 16-bit; pow and mul
        share it), r (rows fp32), and the fp32 ``xf * r`` (for grad_w). composite-legacy
        (2.4-2.5) casts before the weight multiply, so it saves ``(xf*r).type_as(x)`` instead.
        With ``mean_saves_input`` (PyTorch <= 2.1) the mean also keeps pow's result. Backward: mean's
        ``expand / numel``, pow's ``self.pow(1)``, ``2 * that`` (core.kernels.pow2_backward_temps), mul's g*r.
        fused (``_fused_rms_norm``, later PyTorch): saves x and rstd only."""
        dt = self.dtype_of(x)
        n = rows * d
        mode = mode or self.profile.rmsnorm
        if mode == "fused":
            rstd = self.new(rows, FP32)
            y = self.new(n, dt)
            self.sim.node("rmsnorm_fused", [x, rstd], [x], [w], [y], temps=[n * 4])
            self.drop(rstd)
            return y
        fp32 = FP32 if self.profile.norm_upcast else dt
        upcast = dt != fp32 and dt.bits != fp32.bits
        xf = self.new(n, fp32) if upcast else self.sim.ref(x)
        if upcast:
            xf.requires_grad = x.requires_grad
            self.sim.node("to_fp32", [], [x], [], [xf])
        sq = self.new(n, fp32)  # pow(xf, 2)
        self.sim.node("pow", [xf], [xf], [], [sq], temps=pow2_backward_temps(n, fp32.bits // 8))
        ms = self.new(rows, fp32)  # mean(-1, keepdim)
        self.sim.node("mean", [sq] if self.profile.mean_saves_input else [], [sq], [], [ms])
        self.drop(sq)
        r = self.new(rows, fp32)  # rsqrt(ms + eps); add_ is in place
        self.sim.node("rsqrt", [r], [ms], [], [r])
        self.drop(ms)
        xn = self.new(n, fp32)  # xf * r
        self.sim.node("mul", [xf, r], [xf, r], [], [xn], temps=[n * (fp32.bits // 8)])
        self.drop(xf, r)
        if mode == "composite-legacy":
            # PyTorch 2.4-2.5: (xf * r).type_as(x) * w -- the weight multiply runs in x's dtype
            xt = self.new(n, dt) if upcast else self.sim.ref(xn)
            if upcast:
                self.sim.node("to_dtype", [], [xn], [], [xt])
            self.drop(xn)
            y = self.new(n, dt)
            saved = ([xt] if w.trainable else []) + (param_id(self.sim) if xt.requires_grad else [])  # x, w (traced)
            self.sim.node("mul_weight", saved, [xt], [w], [y], temps=[n * (dt.bits // 8)])
            self.drop(xt)
            return y
        # PyTorch 2.6-2.8: ((xf * r) * w).type_as(x) -- the weight multiply runs in fp32 and
        # saves the fp32 normalised tensor; only the result is cast back
        y32 = self.new(n, fp32)
        # x * w saves x only for w's gradient (a frozen norm weight keeps nothing here)
        self.sim.node("mul_weight", [xn] if w.trainable else [], [xn], [w], [y32], temps=[n * (fp32.bits // 8)])
        self.drop(xn)
        if not upcast:
            return y32
        y = self.new(n, dt)
        self.sim.node("to_dtype", [], [y32], [], [y])
        self.drop(y32)
        return y

    def layernorm(self, x: T, rows: int, d: int, w: Param, b: Optional[Param]) -> T:
        """native_layer_norm: saves input, weight, bias, mean and rstd (rows fp32 each).
        Under autocast layer_norm runs in fp32 (a cast copy of a 16-bit input is what is saved)."""
        src = x
        if self.autocast is not None and x.itemsize_bits != 32:
            src = self.new(x.numel, FP32)
            src.requires_grad = x.requires_grad
            self.sim.node("to_fp32", [], [x], [], [src])
        dt = self.dtype_of(src)
        mean = self.new(rows, FP32)
        rstd = self.new(rows, FP32)
        y = self.new(n := rows * d, dt)
        params = [w] + ([b] if b is not None else [])
        p = param_id(self.sim)  # packed: a parameter, the input, a parameter, mean, rstd (traced, trl_offload)
        self.sim.node("layer_norm", [*p, src, *p * (b is not None), mean, rstd], [src], params, [y], temps=[n * 4])
        self.drop(mean, rstd)
        if src is not x:
            self.drop(src)
        return y

    def rope(self, x: T, rot_frac: float) -> T:
        """HF apply_rotary_pos_emb: ``x*cos + rotate_half(x)*sin`` (cat(-x2, x1)). Saves only the
        cos/sin tables (shared, counted once per step). Forward transients: x*cos, -x2, the cat,
        cat*sin; partial rotary (phi) slices and concatenates the pass-through part."""
        dt = self.dtype_of(x)
        n = x.numel
        nr = int(n * rot_frac)
        a = self.new(nr, dt, kind=TMP)
        neg = self.new(nr // 2, dt, kind=TMP)
        cat = self.new(nr, dt, kind=TMP)
        self.drop(neg)
        s = self.new(nr, dt, kind=TMP)
        self.drop(cat)
        if rot_frac < 1.0:
            r = self.new(nr, dt, kind=TMP)
            self.drop(a, s)
            y = self.new(n, dt)
            self.drop(r)
        else:
            y = self.new(n, dt)
            self.drop(a, s)
        self.sim.node("rope", [], [x], [], [y], temps=[nr * (dt.bits // 8), nr * (dt.bits // 8)])
        return y

    def cache_cat(self, x: T) -> T:
        """transformers' DynamicLayer.update on a first call (cache_utils.py, 5.24):
        ``torch.cat([empty, x], dim=-2)``, a copy of x; its backward saves nothing and passes the
        gradient on (``cat`` backward: narrow)."""
        y = self.new(x.numel, self.dtype_of(x))
        self.sim.node("cache_cat", [], [x], [], [y])
        return y

    def repeat_kv(self, x: T, n_rep: int) -> T:
        """HF repeat_kv (expand + reshape): a real copy n_rep times larger; backward sums it back."""
        if n_rep == 1:
            return self.sim.ref(x)
        y = self.new(x.numel * n_rep, self.dtype_of(x))
        self.sim.node("repeat_kv", [], [x], [], [y])
        return y

    # -- attention ------------------------------------------------------------------
    def autocast_sdpa(self, q: T, k: T, v: T) -> tuple[T, T, T]:
        """``scaled_dot_product_attention`` is on autocast's lower-precision list
        (aten/src/ATen/autocast_mode.cpp): under autocast fp32 q, k, v (a 4-bit linear's output cast
        back to an fp32 stream: :func:`memcalc.engine.blocks.adapters._linear_4bit`) are cast first;
        the copies are what the kernel sees and saves. New references (the inputs themselves when
        nothing is cast)."""
        ac = self.autocast
        if ac is None or q.itemsize_bits == ac.bits:
            return self.sim.ref(q), self.sim.ref(k), self.sim.ref(v)
        return self.cast(q, ac), self.cast(k, ac), self.cast(v, ac)

    def attention_kernel(self, has_mask: bool, q: T, enable_gqa: bool = False) -> str:
        """Which SDPA kernel runs: the profile's choice, or auto = flash for 16-bit inputs without
        an explicit mask, memory-efficient otherwise (fp32, or an additive mask such as ALiBi),
        except that a grouped-query call (``enable_gqa``) cannot use memory-efficient and takes
        math; a forced flash that cannot run falls back the same way
        (:func:`memcalc.core.kernels.choose_attention_kernel`, shared with the validator)."""
        return choose_attention_kernel(self.profile.attention, q.itemsize_bits == 16, has_mask, enable_gqa)

    def sdpa(self, q: T, k: T, v: T, B: int, H: int, Tq: int, D: int, bias: Optional[T], bias_bcast_bytes: int,
             dropout_p: float, kernel: str, n_rep: int = 1) -> T:
        """scaled_dot_product_attention with the kernel CUDA picks.

        flash (``_scaled_dot_product_flash_attention``, FA2): saves q, k, v, out and logsumexp
        (B,H,T fp32). Backward allocates dq, dk, dv plus FA2's ``dq_accum`` (B, T rounded to 128,
        H, D rounded to 32 (256 above 192), fp32) and ``softmax_d`` (B,H,T rounded, fp32)
        (:mod:`memcalc.core.kernels`).
        efficient (``_scaled_dot_product_efficient_attention``): saves q, k, v, out, logsumexp
        (B,H,T rounded up to 32, fp32) and the additive bias. Backward allocates dq, dk, dv,
        ``delta`` (B,H,T fp32), an fp32 dq accumulator when inputs are 16-bit, and, when the bias
        needs a gradient, a gradient of the broadcast (B,H,T,T) bias. Both make all of dq, dk, dv; those not
        needed are temps (cuda/attention_backward.cu ``_scaled_dot_product_{flash,efficient}_attention_backward_cuda``).
        math (``_scaled_dot_product_attention_math``): materialises (B,H,T,T) scores, saves the
        pre-scaled q and k copies, the softmax output, v, and the dropout mask.

        ``n_rep > 1``: a grouped-query call (``enable_gqa=True``; k and v have H / n_rep heads).
        flash takes it natively (FA2 ``mha_fwd``/``mha_bwd`` with ``num_heads_k < num_heads``): it
        saves the un-expanded k and v, and its backward allocates ``dk_expanded`` and
        ``dv_expanded`` (B, T, H, D in the input dtype) before summing them into dk, dv
        (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp ``mha_bwd``). math
        copies k and v to every query head first (attention.cpp
        ``_scaled_dot_product_attention_math`` via ``pre_process_group_query_attention_input``:
        ``repeat_interleave`` on dim -3 when ``enable_gqa``): the k copy lives until it is scaled, the v copy is saved by the
        second matmul."""
        dt = self.dtype_of(q)
        n_q = B * H * Tq * D
        if kernel in ("flash", "efficient"):
            out = self.new(n_q, dt)
            if kernel == "flash":
                lse = self.new(B * H * Tq, FP32)
                tr = flash_seq_rounded(Tq)
                dr = flash_head_dim_rounded(D)
                temps = [B * tr * H * dr * 4, B * H * tr * 4]
                if n_rep > 1:  # dk_expanded, dv_expanded
                    temps += [dt.nbytes(n_q), dt.nbytes(n_q)]
            else:
                lse = self.new(B * H * efficient_lse_len(Tq), FP32)
                temps = [B * H * Tq * 4]
                if dt != FP32:
                    temps.append(n_q * 4)
            saved = [q, k, v, out, lse] + ([bias] if bias is not None else [])
            temps += [t.nbytes for t in (q, k, v) if not t.requires_grad]  # made anyway (docstring)
            inputs = [q, k, v] + ([bias] if bias is not None else [])
            sizes = [q.nbytes, k.nbytes, v.nbytes] + ([bias_bcast_bytes] if bias is not None else [])
            # FlopCounterMode's sdpa formula: two batched matmuls, 4*B*H*Tq*Tk*D
            self.sim.node(f"sdpa_{kernel}", saved, inputs, [], [out], temps=temps, grad_input_bytes=sizes,
                          flops=4 * B * H * Tq * Tq * D)
            self.drop(lse)
            return out
        # math path
        assert kernel == "math" and (n_rep == 1 or bias is None), kernel
        nTT = B * H * Tq * Tq
        qs = self.new(n_q, dt)
        self.sim.node("mul_scalar", [], [q], [], [qs])
        if n_rep > 1:  # enable_gqa: repeat_interleave copies of k and v
            k = self.repeat_kv(k, n_rep)
            v = self.repeat_kv(v, n_rep)
        ks = self.new(k.numel, dt)
        self.sim.node("mul_scalar", [], [k], [], [ks])
        if n_rep > 1:
            self.drop(k)
        scores = self.new(nTT, dt)
        self.sim.node("matmul_qk", [qs, ks], [qs, ks], [], [scores], flops=2 * B * H * Tq * Tq * D)
        self.drop(qs, ks)
        if bias is not None:  # attn.add_(mask): in place; gradient to the bias is the broadcast grad
            self.sim.node("add_mask", [], [scores, bias], [], [scores], grad_input_bytes=[scores.nbytes, bias_bcast_bytes])
        p = self.new(nTT, dt)
        self.sim.node("softmax", [p], [scores], [], [p])
        self.drop(scores)
        if dropout_p > 0:
            pd = self.dropout(p, dropout_p)
            self.drop(p)
            p = pd
        out = self.new(n_q, dt)
        self.sim.node("matmul_pv", [p, v], [p, v], [], [out], flops=2 * B * H * Tq * Tq * D)
        self.drop(p)
        if n_rep > 1:
            self.drop(v)
        return out

    def alibi_mask(self, H: int, Tq: int, slopes: Param) -> tuple[T, int]:
        """Forgather's per-layer ALiBi mask (causal_alibi_attn.py): ``alibi_biases`` (T,T) in the
        model dtype, ``* slopes.view(-1,1,1)`` -> (H,T,T) (the mul saves the (T,T) bias for the
        slopes' gradient), ``masked_fill_`` with a (T,T) bool mask (saved) from ones/tril/
        logical_not. Returns the (H,T,T) mask; its gradient (when slopes train) flows back
        through masked_fill and the mul: two more (H,T,T) temporaries in backward."""
        dt = self.dtype_of(slopes.weight)
        tt = Tq * Tq
        base = self.new(tt, dt, "attention masks")
        m = self.sim.alloc(dt.nbytes(H * tt), ACT, "attention masks")
        m.numel, m.itemsize_bits = H * tt, dt.bits
        # base is an input of the mul (built by arange ops from nothing: under torch.compile
        # the partitioner recomputes it for free rather than saving it)
        self.sim.node("alibi_mul", [base], [base], [slopes], [m], temps=[dt.nbytes(H * tt)])
        self.drop(base)
        ones = self.sim.alloc(tt, TMP, "attention masks")
        tril = self.sim.alloc(tt, TMP, "attention masks")
        self.drop(ones)
        keep = self.sim.alloc(tt, ACT, "attention masks")
        self.drop(tril)
        if m.requires_grad:
            # masked_fill_ backward: grad.masked_fill(mask, 0) (a new (H,T,T)); saves the mask.
            self.sim.node("masked_fill", [keep], [m], [], [m])
        self.drop(keep)
        return m, dt.nbytes(H * tt)
