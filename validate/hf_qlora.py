"""QLoRA on the real Hugging Face step: a bitsandbytes 4-bit base built as ``from_pretrained(...,
quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` builds it, PEFT's
``prepare_model_for_kbit_training`` and LoRA on top, and bitsandbytes' CUDA kernels' allocations on
``meta``. Library code runs unmodified (transformers 5.24, PEFT 0.21, bitsandbytes 0.50); only the
kernel behind one custom op is replaced.

Loading (:func:`load_4bit`), as transformers' bitsandbytes quantizer does it
(quantizers/quantizer_bnb_4bit.py ``Bnb4BitHfQuantizer``):

- ``_process_model_before_weight_loading``: ``replace_with_bnb_linear`` (integrations/bitsandbytes.py)
  swaps every ``nn.Linear`` but ``get_modules_to_not_convert``'s (the output head, tied or not) for a
  ``bnb.nn.Linear4bit(compute_dtype=bnb_4bit_compute_dtype, compress_statistics=
  bnb_4bit_use_double_quant, quant_type="nf4", quant_storage=uint8)``;
- each of its weights is then the checkpoint's 16-bit tensor through ``Bnb4bitQuantize.convert``:
  ``Params4bit(value, requires_grad=False, **old.__dict__).to(value.device)``, whose ``.to(cuda)`` is
  ``Params4bit._quantize`` (bitsandbytes/nn/modules.py): ``functional.quantize_4bit`` leaves the
  packed weight (uint8, ``numel/2``), the absmax (fp32 per block of 64; with double quantisation
  uint8 per block, plus ``offset`` (a 0-dim fp32), ``state2.absmax`` (fp32 per 256 blocks) and
  ``state2.code`` (256 fp32)) and the NF4 ``code`` (16 fp32), each its own CUDA allocation. On meta
  ``.to("meta")`` does not quantize, so the same ``_quantize`` is called with the meta device;
  ``quantize_4bit``'s and ``quantize_blockwise``'s ops run their registered fake kernels, which
  allocate exactly the CUDA kernels' outputs.
- ``_process_model_after_weight_loading``: ``model.is_loaded_in_4bit = True``.

Then, with the profile's ``qlora_fp32_cast`` (PEFT's documented QLoRA recipe),
``prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)`` (peft/utils/other.py):
every 16-bit parameter that is not a ``Params4bit`` (embedding, norms, the output head, the 4-bit
layers' biases) becomes fp32 (``param.data = param.data.to(torch.float32)``); checkpointing is the
harness's, as Trainer enables it.

The step (:func:`gemm_4bit`): ``Linear4bit.forward`` runs ``bnb.matmul_4bit``, whose autograd
``MatMul4Bit.forward`` (bitsandbytes/autograd/_functions.py) calls the custom op
``bitsandbytes::gemm_4bit``. Its fake kernel allocates only the output; its CUDA kernel
(backends/cuda/ops.py) runs the fused ``cgemm_4bit`` only for ``M = rows <= 1536`` where an
arch-dependent heuristic favours it (for a non-small weight never above ``M = 512``), and otherwise
``_dequant_linear_fallback``: with double quantisation ``absmax_dq = empty_like(absmax_8bit, fp32)``
and ``absmax = absmax_dq + absmax_offset`` (two fp32 per block), ``B_dq = empty(shapeB, A.dtype)``
(the whole weight in the compute dtype), ``F.linear(A, B_dq, bias)``; all freed as it returns.
:func:`gemm_4bit` makes those allocations on meta for every ``M`` (memcalc's rule,
:data:`memcalc.core.kernels.BNB_GEMM_4BIT_FUSED_MAX_ROWS`: a training step's rows are above the
fused kernel's range). Backward (``MatMul4Bit.backward``) calls ``functional.dequantize_4bit``,
whose ops (``dequantize_blockwise`` for the nested absmax, ``dequantize_4bit``) allocate on meta
what their CUDA kernels allocate (their outputs): nothing is replaced there.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from memcalc.core.spec import LoraSpec


def load_4bit(model, lora: LoraSpec, compute_dtype: torch.dtype, quant_storage: torch.dtype = torch.uint8) -> None:
    """Quantize ``model`` (built on meta in its 16-bit dtype) as ``from_pretrained`` with a
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=
    compute_dtype, bnb_4bit_use_double_quant=lora.double_quant, bnb_4bit_quant_storage=quant_storage)`` does
    (see the module docstring; the storage dtype only reinterprets the packed bytes: ``quantize_4bit``
    ``.view(quant_storage)``, bitsandbytes/functional.py)."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                            bnb_4bit_use_double_quant=lora.double_quant, bnb_4bit_quant_storage=quant_storage)
    quantizer = Bnb4BitHfQuantizer(qc)
    # the checkpoint's 16-bit tensors, by parameter name (the meta model's own weights here)
    values: dict[str, Any] = {f"{n}.weight": m.weight for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    quantizer._process_model_before_weight_loading(model, device_map=None)
    convert = Bnb4bitQuantize(quantizer)
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, bnb.nn.Linear4bit):
            continue
        key = f"{name}.weight"
        weight: Any = mod.weight
        weight.blocksize = lora.quant_block  # bitsandbytes' Params4bit default is 64
        new: Any = convert.convert({key: values[key]}, full_layer_name=key, model=model)[key]
        if not new.bnb_quantized:  # .to("meta") skipped it, and its copy lost ``module``: what .to("cuda") runs,
            # on the Params4bit convert made (Params4bit.to -> self._quantize, which sets module.quant_state)
            new = bnb.nn.Params4bit(values[key], requires_grad=False, **weight.__dict__)._quantize(values[key].device)
        mod.weight = new
    quantizer._process_model_after_weight_loading(model)


def prepare_kbit(model) -> None:
    """PEFT's ``prepare_model_for_kbit_training`` without its checkpointing (the harness's)."""
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quant_state_tensors(model) -> list[torch.Tensor]:
    """Every tensor of the 4-bit weights' quantisation states (not parameters, yet allocated on the
    GPU by ``quantize_4bit``): absmax, code, and with double quantisation offset and state2's. Read from
    the module (``Linear4bit.quant_state``, which ``Params4bit._quantize`` sets), as FSDP1 replaces the
    weight by a view of its flat parameter."""
    import bitsandbytes as bnb

    out: list[torch.Tensor] = []
    for mod in model.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            qs = getattr(mod, "quant_state", None)
            if qs is None:
                qs = getattr(mod.weight, "quant_state", None)
            if qs is None:
                continue
            out += [qs.absmax, qs.code]
            if qs.nested:
                out += [qs.offset, qs.state2.absmax, qs.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def is_gemm_4bit(func) -> bool:
    """Whether ``func`` is the ``bitsandbytes::gemm_4bit`` op (bitsandbytes need not be imported)."""
    return str(func) == "bitsandbytes.gemm_4bit.default"


def gemm_4bit(A: torch.Tensor, B: torch.Tensor, shapeB, absmax: torch.Tensor, blocksize: int, quant_type: str,
              bias: Optional[torch.Tensor] = None, absmax_8bit: Optional[torch.Tensor] = None,
              absmax_code: Optional[torch.Tensor] = None, absmax_offset: Any = None) -> torch.Tensor:
    """``bitsandbytes::gemm_4bit`` on meta with the allocations of bitsandbytes 0.50's CUDA
    ``_dequant_linear_fallback`` (backends/cuda/ops.py), the path a training step's row count takes;
    the dequantisation kernels write in place, so only their buffers are made."""
    if absmax_8bit is not None:
        absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)  # _dequantize_blockwise_impl(out=)
        absmax = absmax_dq + absmax_offset
    B_dq = torch.empty(tuple(shapeB), dtype=A.dtype, device=A.device)  # _dequantize_4bit_impl(out=B_dq)
    out = torch.nn.functional.linear(A, B_dq, bias)
    del B_dq, absmax
    return out
