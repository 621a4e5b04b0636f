"""The twin of :mod:`memcalc.engine.blocks.adapters`: a projection with its adapter (LoRA / DoRA /
QLoRA). The norms are :mod:`.norm`'s, the feed-forward block :mod:`.mlp`'s.

Saved tensors follow PyTorch's autograd formulas (tools/autograd/derivatives.yaml) because
these are plain PyTorch ops; where a library kernel is emulated, the docstring names it.

- :class:`Linear`: ``F.linear`` (saves x and W). LoRA as in PEFT ``lora.Linear.forward``:
  ``base(x) + lora_B(lora_A(dropout(x))) * scale``. QLoRA: the frozen base is stored as
  bitsandbytes 0.50 lays it out (:class:`NF4Weight`), dequantised to the compute dtype inside
  forward and again in backward; like bitsandbytes ``MatMul4Bit`` only the packed weight is saved.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from memcalc.core.spec import LoraSpec

from ..amp import Amp
from ..devices import kernel_device
from .base import dropout

aten = torch.ops.aten

#: NF4 code book (QLoRA paper, Appendix E; bitsandbytes ``get_4bit_type('nf4')``).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


# -- QLoRA ---------------------------------------------------------------------------------
class NF4Weight:
    """Storage of one 4-bit base weight as bitsandbytes 0.50 ``functional.quantize_4bit`` leaves it
    (each its own allocation; the estimator's ``memcalc.engine.weights.quantized_bytes``): ``packed``
    uint8 (two codes per byte), ``absmax`` (fp32 per block) and ``code`` (the 16 NF4 values, fp32);
    with double quantisation ``absmax`` is uint8 per block, ``offset`` a 0-dim fp32, ``absmax2``
    fp32 per 256 blocks and ``code2`` the 256-value dynamic map (``state2``)."""

    def __init__(self, shape: tuple[int, int], block: int, double_quant: bool, device, init: bool) -> None:
        self.shape = shape
        self.block = block
        self.double_quant = double_quant
        n = shape[0] * shape[1]
        blocks = -(-n // block)
        real = init and torch.device(device).type != "meta"
        if real:
            self.packed = torch.randint(0, 256, ((n + 1) // 2,), dtype=torch.uint8, device=device)
        else:
            self.packed = torch.empty(((n + 1) // 2,), dtype=torch.uint8, device=device)
        self.code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
        self.offset: Optional[torch.Tensor] = None
        self.absmax2: Optional[torch.Tensor] = None
        self.code2: Optional[torch.Tensor] = None
        if double_quant:
            self.absmax = torch.empty((blocks,), dtype=torch.uint8, device=device)
            self.offset = torch.zeros((), dtype=torch.float32, device=device)
            self.absmax2 = torch.empty((-(-blocks // 256),), dtype=torch.float32, device=device)
            self.code2 = torch.linspace(-1.0, 1.0, 256, dtype=torch.float32, device=device)
            if real:
                self.absmax.random_(0, 256)
                self.absmax2.uniform_(0.0, 0.05)
        else:
            self.absmax = torch.empty((blocks,), dtype=torch.float32, device=device)
            if real:
                self.absmax.uniform_(0.0, 0.05)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.absmax, self.code, self.offset, self.absmax2, self.code2)
                if t is not None]


def blockwise_absmax(q: NF4Weight) -> torch.Tensor:
    """``dequantize_blockwise(absmax, state2)`` of a double-quantised weight: its uint8 absmax as
    fp32, one buffer of one element per block (the offset not yet added)."""
    am = torch.empty(q.absmax.shape, dtype=torch.float32, device=q.absmax.device)
    assert q.code2 is not None and q.absmax2 is not None
    if kernel_device(q.absmax) != "meta":
        g = torch.arange(am.numel(), device=am.device) // 256
        am.copy_(q.code2[q.absmax.long()] * q.absmax2[g])
    return am


def nested_absmax(q: NF4Weight) -> torch.Tensor:
    """The fp32 absmax as bitsandbytes ``functional.dequantize_4bit`` makes it:
    ``dequantize_blockwise(absmax, state2)``, then ``absmax += offset`` (in place)."""
    am = blockwise_absmax(q)
    assert q.offset is not None
    am += q.offset
    return am


def dequantize_nf4(q: NF4Weight, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full-size weight in ``dtype`` from the fp32 ``absmax``. Like bitsandbytes'
    ``dequantize_4bit`` kernel only the output is allocated: on ``meta`` nothing else is; on real
    devices the codes are expanded in chunks of 64K elements (a transient of about 1.5 MiB)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.packed.device)
    if kernel_device(q.packed) == "meta":
        return out
    flat = out.view(-1)
    n, blk = q.numel, q.block
    step = max(1, 65536 // blk) * blk
    for s in range(0, n, step):
        e = min(n, s + step)
        b0, b1 = s // blk, -(-e // blk)
        hi = q.packed[s // 2: (e + 1) // 2]
        codes = torch.stack(((hi >> 4), (hi & 15)), dim=-1).view(-1)[: e - s].long()
        vals = q.code[codes] * absmax[b0:b1].float().repeat_interleave(blk)[: e - s]
        flat[s:e] = vals.to(dtype)
    return out


class Linear4bit(torch.autograd.Function):
    """bitsandbytes 0.50 ``MatMul4Bit`` (autograd/_functions.py): forward is ``gemm_4bit``'s CUDA
    ``_dequant_linear_fallback`` (backends/cuda/ops.py: with double quantisation ``absmax_dq`` and
    ``absmax_dq + offset``, two fp32 buffers per block, then ``B_dq`` and ``F.linear``, all freed as it
    returns); only the packed weight is saved; backward ``functional.dequantize_4bit`` (the nested
    absmax, freed before the matmul) and ``grad @ W``. ``saves_input``: 0.41/0.42's instead
    (:func:`legacy_weight`, the input kept on the ctx)."""

    @staticmethod
    def forward(ctx, x, packed, q: NF4Weight, bias, saves_input: bool = False):
        ctx.q, ctx.legacy = q, saves_input
        if saves_input:  # bitsandbytes 0.41/0.42 (LoraSpec.bnb_saves_input): see legacy_weight
            w = legacy_weight(q, x.dtype)
            out = F.linear(x, w, bias)
            del w
            # ``ctx.tensors = (A, B)``: on the ctx, not saved; autograd's release_variables leaves it,
            # so it lives as long as the graph (memcalc.engine.retained)
            ctx.tensors = (x if ctx.needs_input_grad[0] else None, packed)
            ctx.save_for_backward(packed)
            return out
        absmax = q.absmax
        if q.double_quant:
            absmax_dq = blockwise_absmax(q)
            assert q.offset is not None
            absmax = absmax_dq + q.offset  # both alive until the fallback returns
        w = dequantize_nf4(q, absmax, x.dtype)
        out = F.linear(x, w, bias)
        del w, absmax
        if q.double_quant:
            del absmax_dq
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx = None
        if ctx.needs_input_grad[0]:
            q = ctx.q
            if ctx.legacy:
                w = legacy_weight(q, grad.dtype)
            else:
                absmax = nested_absmax(q) if q.double_quant else q.absmax
                w = dequantize_nf4(q, absmax, grad.dtype)
                del absmax
            gx = grad.matmul(w)
            del w
        return gx, None, None, None, None


def legacy_weight(q: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes 0.41/0.42 ``MatMul4Bit``: ``F.dequantize_4bit(B, quant_state).to(A.dtype)``
    (autograd/_functions.py, forward and backward alike): ``dequantize_4bit`` (functional.py)
    dequantises a nested absmax to fp32 (``absmax += offset`` in place), makes the weight in
    ``quant_state.dtype`` (fp16: ``Params4bit.cuda`` quantizes ``data.half()``, Lightning's
    ``_Linear4bit.quantize`` ``weight.to(torch.half)``) and returns it, the absmax freed; ``.to``
    then copies it into the compute dtype while it is alive."""
    absmax = nested_absmax(q) if q.double_quant else q.absmax
    w16 = dequantize_nf4(q, absmax, torch.float16)
    del absmax
    w = w16.to(dtype)
    del w16
    return w


def kbit_fp32_cast(model: nn.Module) -> None:
    """PEFT 0.21 ``prepare_model_for_kbit_training`` (peft/utils/other.py) on the replica, before its
    adapters exist there: every fp16/bf16 parameter that is not 4-bit becomes fp32
    (``param.data = param.data.to(torch.float32)``); a 4-bit linear's bias is left as it is, since
    bitsandbytes' ``Linear4bit.forward`` casts it back to the compute dtype in the first step
    (``bias.data = bias.data.to(x.dtype)``). The estimator's twin: ``memcalc.engine.weights.kbit_dtype``."""
    keep = {id(mod.bias) for mod in model.modules() if isinstance(mod, Linear) and mod.nf4 is not None}
    for name, p in model.named_parameters():
        if "lora_" in name or id(p) in keep or p.dtype not in (torch.float16, torch.bfloat16):
            continue
        p.data = p.data.to(torch.float32)


# -- projections ---------------------------------------------------------------------------
def lora_input_cast(x: torch.Tensor, lora_A: torch.Tensor, amp: Amp, input_cast: bool, quant: bool) -> bool:
    """Whether the adapter input is cast to the adapters' dtype first: PEFT ``lora.Linear.forward``
    (peft/tuners/lora/layer.py) ``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` under the
    profile's ``lora_input_cast`` (for a 4-bit base, bnb.py ``Linear4bit.forward``, only outside
    autocast: ``requires_conversion = not torch.is_autocast_enabled()``); without the rule, where a
    mixed-dtype matmul would fail (fp32 adapters over 16-bit activations outside autocast). The
    estimator's twin: ``memcalc.engine.forward`` ``proj``."""
    return (input_cast and not (quant and amp.active)) or (not amp.active and x.dtype != lora_A.dtype)


def lora_branch(x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, p: float, scale: float,
                training: bool, amp: Amp) -> torch.Tensor:
    """``lora_B(lora_A(dropout(x))) * scaling`` -- the adapter's intermediates are temporaries, gone
    before the next op (no local keeps them alive)."""
    a = F.linear(amp.lp(dropout(x, p, training)), amp.lp(lora_A))
    b = F.linear(amp.lp(a), amp.lp(lora_B))
    del a
    return b * scale


def lora_result(y: torch.Tensor, branch: torch.Tensor, cast: bool, quant: bool) -> torch.Tensor:
    """``result + branch`` (PEFT lora.Linear.forward); for a 4-bit base the branch is cast to the
    result's dtype first (bnb.py ``output.to(expected_dtype)``); after a cast input the sum is cast
    back (``result.to(torch_result_dtype)``)."""
    if quant and cast:
        branch = branch.to(y.dtype)
    out = y + branch
    del branch
    if cast and out.dtype != y.dtype:
        out = out.to(y.dtype)
    return out


class Linear(nn.Module):
    """A projection ``y = x W^T + b`` with an optional LoRA adapter and a 4-bit base (QLoRA).

    Parameter names follow :func:`memcalc.engine.params.param_inventory`: ``weight``, ``bias``,
    ``lora_A`` (r x in), ``lora_B`` (out x r). A QLoRA base is not a parameter: its storage
    lives in ``self.nf4`` (registered as buffers ``weight_packed``, ``weight_absmax``...).
    """

    def __init__(self, d_in: int, d_out: int, bias: bool, amp: Amp, *, dtype: torch.dtype, device,
                 trainable: bool = True, lora: Optional[LoraSpec] = None, target: bool = False,
                 init: bool = True, adapter_dtype: Optional[torch.dtype] = None, input_cast: bool = False) -> None:
        super().__init__()
        self.amp = amp
        self.d_in, self.d_out = d_in, d_out
        self.compute = dtype  # bnb_4bit_compute_dtype: the weight dtype QLoRA's 16-bit base would have
        self.saves_input = lora is not None and lora.bnb_saves_input
        self.nf4: Optional[NF4Weight] = None
        if lora is not None and lora.qlora:
            self.nf4 = NF4Weight((d_out, d_in), lora.quant_block, lora.double_quant, device, init)
            self.register_buffer("weight_packed", self.nf4.packed)
            for name, t in (("absmax", self.nf4.absmax), ("code", self.nf4.code), ("offset", self.nf4.offset),
                            ("absmax2", self.nf4.absmax2), ("code2", self.nf4.code2)):
                if t is not None:
                    self.register_buffer(f"weight_{name}", t)
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty((d_out, d_in), dtype=dtype, device=device), requires_grad=trainable)
            if init:
                nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros((d_out,), dtype=dtype, device=device), requires_grad=trainable)
        self.lora_dropout = 0.0
        self.scale = 0.0
        #: PEFT lora.Linear.forward's input cast (the profile's lora_input_cast)
        self.input_cast = input_cast
        if lora is not None and target:  # in the adapters' dtype (ExperimentSpec.adapter_dtype)
            adt = adapter_dtype or dtype
            self.lora_A = nn.Parameter(torch.empty((lora.rank, d_in), dtype=adt, device=device))
            self.lora_B = nn.Parameter(torch.zeros((d_out, lora.rank), dtype=adt, device=device))
            if init:
                nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.lora_dropout = lora.dropout
            self.scale = lora.alpha / lora.rank
        else:
            self.lora_A = self.lora_B = None
        self.lora_magnitude = None
        if lora is not None and target and lora.dora:  # PEFT DoraLinearLayer.weight (one per output row)
            self.lora_magnitude = nn.Parameter(torch.ones((d_out,), dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amp = self.amp
        if self.nf4 is not None:  # bitsandbytes Linear4bit.forward: x.to(compute), matmul_4bit, .to(inp_dtype)
            xc = amp.lp(x) if amp.active else x.to(self.compute)
            y = Linear4bit.apply(xc, self.weight_packed, self.nf4, amp.lp(self.bias), self.saves_input).to(x.dtype)
        else:
            y = F.linear(amp.lp(x), amp.lp(self.weight), amp.lp(self.bias))
        if self.lora_A is None:
            return y
        quant = self.input_cast and self.nf4 is not None
        if quant:  # peft/tuners/lora/bnb.py Linear4bit.forward: result = result.clone()
            y = y.clone()
        cast = lora_input_cast(x, self.lora_A, amp, self.input_cast, quant)
        xa = x.to(self.lora_A.dtype) if cast else x
        if self.lora_magnitude is not None:
            return lora_result(y, self._dora(xa, y), cast, quant)
        # PEFT lora.Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling
        return lora_result(y, lora_branch(xa, self.lora_A, self.lora_B, self.lora_dropout, self.scale,
                                          self.training, amp), cast, quant)


    def _dora(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """peft/tuners/lora/variants.py ``DoraLinearVariant.forward`` and dora.py
        ``DoraLinearLayer.forward`` line for line (engine twin: memcalc/engine/dora.py)."""
        eye = torch.eye(self.d_in, device=x.device, dtype=self.lora_A.dtype)  # get_lora_weight
        lora_weight = F.linear(F.linear(eye, self.lora_A), self.lora_B).T
        lora_weight = lora_weight.to(x.dtype)
        if self.nf4 is not None:  # dequantize_module_weight
            absmax = nested_absmax(self.nf4) if self.nf4.double_quant else self.nf4.absmax
            weight = dequantize_nf4(self.nf4, absmax, torch.bfloat16)
            del absmax
        else:
            weight = self.weight
        weight = weight.to(x.dtype)
        w2 = weight + self.scale * lora_weight.detach()  # get_weight_norm
        weight_norm = torch.linalg.norm(w2, dim=1).to(w2.dtype)
        del w2
        weight_norm = weight_norm.detach()
        mag_norm_scale = (self.lora_magnitude / weight_norm).view(1, -1)
        if self.lora_dropout and self.training:
            x = dropout(x, self.lora_dropout, self.training)
            base_result = F.linear(x, weight)
        else:
            base_result = result
        lora_result = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * self.scale
