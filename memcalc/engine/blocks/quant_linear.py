"""A GPTQ / AWQ 4-bit base linear under LoRA (``LoraSpec.quant``), read from source: its kernels need CUDA.

transformers 5.24 loads both through gptqmodel (``integrations/awq.py`` ``replace_with_awq_linear``,
``quantizers/quantizer_gptq.py``; ``hf_select_quant_linear_v2``); PEFT 0.21 wraps them in
``GPTQLoraLinear`` / ``AwqLoraLinear`` (peft/tuners/lora/gptq.py, awq.py): ``result =
quant_linear(x)`` then ``result + lora_B(lora_A(dropout(x))) * scaling``, the branch as for any
PEFT target. In training gptqmodel runs the kernels that support it (``SUPPORTS_TRAINING``; the
inference kernels, Marlin / IPEX, switch to the torch kernel when ``train()``,
``SUPPORTS_TRAINING_USE_TORCH_KERNEL``): ``TorchQuantLinear._forward`` (nn_modules/qlinear/torch.py)
``weights = self.dequantize_weight(...).to(x.dtype)``; ``torch.matmul(x, weights)`` and
``AwqTorchLinear.forward`` (torch_awq.py) ``weight = dequantize_gemm(...)``; ``torch.matmul(x_flat,
weight)``. The dequantized weight (in_features x out_features, the compute dtype) is a plain tensor the
matmul saves for the input's gradient (``mm`` keeps ``mat2`` when ``self`` needs a gradient): every
quantized linear keeps a full 16-bit copy of its weight from forward until its backward, unless
checkpointing recomputes the layer.

Dequantization's transients: GPTQ's ``dequantize_weight`` is compiled (``TorchQuantLinear.optimize``:
``torch_compile(self.dequantize_weight)``, Inductor fuses the unpacking into the kernel that writes
the result: no other full-size buffer counted); AWQ's ``dequantize_gemm``
(quantization/awq/utils/packing_utils.py) runs eagerly: :func:`awq_dequant_peak_bytes`.
"""

from __future__ import annotations

from memcalc.core.dtypes import DType
from memcalc.core.rules import awq_dequant_peak_bytes
from memcalc.engine.context import ForwardContext
from memcalc.engine.sim import Param, T

TMP = "temporaries"


def quant_linear(fwd: ForwardContext, x: T, w: Param, bias: Param | None, d_out: int, method: str) -> T:
    """The base projection of a GPTQ / AWQ target (see the module docstring): the dequantized weight in the
    compute dtype (GPTQ: the input's, ``.to(x.dtype)``; AWQ: the input's when 16-bit, else fp16, the input
    cast to it and the output cast back), saved by the matmul when the input needs a gradient."""
    o = fwd.ops
    k = w.numel // d_out
    xdt = o.dtype_of(x)
    cdt = xdt if method == "gptq" or xdt in (DType.bf16, DType.fp16) else DType.fp16
    xc = o.cast(x, cdt) if cdt != xdt else x
    deq = o.new(k * d_out, cdt)
    if method == "awq":  # dequantize_gemm's int8 / int32 unpacking and the repeated scales, beside its result
        o.sim.transient(awq_dequant_peak_bytes(k, d_out, cdt.bits // 8) - cdt.nbytes(k * d_out), TMP,
                        "dequantisation")
    y = o.new(fwd.rows * d_out, cdt)
    saved = [deq] if xc.requires_grad else []
    params = [w] + ([bias] if bias is not None else [])
    o.sim.node("linear", saved, [xc], params, [y], flops=2 * fwd.rows * k * d_out)
    o.drop(deq)
    if xc is not x:
        o.drop(xc)
    if cdt == xdt:
        return y
    back = o.cast(y, xdt)
    o.drop(y)
    return back
