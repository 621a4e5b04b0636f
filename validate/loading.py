"""The load phase traced: each framework's own loader on ``meta``, beside
:mod:`memcalc.engine.loading`'s arithmetic of it.

- torchtune 0.6.1 (:func:`trace_torchtune_load`): the recipe's ``_setup_model`` as it runs it
  (recipes/lora_finetune_single_device.py l.431-452): the component builders under
  ``training.set_default_dtype(dtype)`` and the device (here ``meta``), quantizing each linear with
  torchao's ``to_nf4`` as it is built, then ``model.load_state_dict(base_model_state_dict,
  strict=False)`` from a state dict on the CPU, as the checkpointer gives it (every base parameter
  in the model dtype; uninitialised ``torch.empty``: the loaders read only shapes on meta). torch's
  ``Module._load_from_state_dict`` skips copies into meta parameters, so the harness makes the
  ``param.copy_(input_param)`` it makes on CUDA, parameter by parameter in state-dict order; torchao's
  NF4 ``copy_`` then copies each tensor to the device and quantizes it again, unmodified.
- transformers 5.24 + bitsandbytes 0.50 (:func:`trace_hf_load`): ``convert_and_load_state_dict_in_model``'s
  loop as it runs under on-the-fly quantization (no loader threads; core_model_loading.py
  l.1863-1990): the checkpoint's tensors in ``dot_natural_key`` order, each ``_materialize_copy``-ed to
  the device in the model dtype; a 4-bit linear's through ``Bnb4bitQuantize.convert`` (and
  ``Params4bit._quantize``, what ``.to("cuda")`` runs; ``.to("meta")`` skips it, as
  :func:`memcalc.validate.hf_qlora.load_4bit` says), set on the module, the 16-bit copy dropped;
  then PEFT's ``prepare_model_for_kbit_training`` (profile ``qlora_fp32_cast``) and ``get_peft_model``.

Each returns the tracer's peak (``max_memory_allocated`` over the load, 512-byte blocks).
"""

from __future__ import annotations


from typing import Any

import torch

from memcalc.core.spec import ExperimentSpec

from .tracer import StorageTracer


class LoadTracer(StorageTracer):
    """:class:`~.tracer.StorageTracer` that counts a tensor subclass by its inner tensors.

    torchao's ``NF4Tensor`` is a wrapper subclass (``_make_wrapper_subclass``): on CUDA the wrapper
    holds no memory, its inner tensors (``__tensor_flatten__``: the packed data, the scalers) do. On
    meta the wrapper reports a storage of the full 16-bit size, which an op returning it (the
    ``detach`` of ``nn.Parameter(nf4)``) would otherwise add; the step's harness counts parameters
    the same way (:func:`memcalc.validate.trainers.torchtune._leaves`)."""

    def _add(self, t: torch.Tensor) -> None:
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
            super()._add(t)
            return
        names, _ctx = flatten(t)
        for n in names:
            self._add(getattr(t, n))


def _dtype(exp: ExperimentSpec) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[exp.training.weight_dtype.value]


def trace_torchtune_load(exp: ExperimentSpec, allocator: Any = None) -> StorageTracer:
    """torchtune's ``_setup_model`` build and ``load_state_dict`` of ``exp`` on meta, traced
    (``allocator``: a :class:`memcalc.core.allocator.CachingAllocatorSim` the storages go through)."""
    from .trainers.torchtune_model import build

    dtype = _dtype(exp)
    tracer = LoadTracer("meta", allocator=allocator)
    with tracer:
        tracer.set_phase("load", "build")
        model = build(exp.model, exp.training.lora, dtype, "meta")
    adapters = ("lora_a", "lora_b", "magnitude")
    state = {n: torch.empty(tuple(p.shape), dtype=dtype) for n, p in model.named_parameters()
             if not any(a in n for a in adapters)}
    from torchao.dtypes.nf4tensor import NF4_OPS_TABLE, NF4Tensor

    copy_nf4 = NF4_OPS_TABLE[torch.ops.aten.copy_.default]
    params = dict(model.named_parameters())
    with tracer, torch.no_grad():
        tracer.set_phase("load", "load_state_dict")
        # Module._load_from_state_dict (torch 2.13 nn/modules/module.py) skips a copy into a meta
        # parameter ("a no-op"); on CUDA it runs param.copy_(input_param), in state-dict order. An
        # NF4 parameter's copy_ is torchao's registered implementation, called as NF4Tensor's
        # __torch_dispatch__ calls it (nf4tensor.py l.938-939): inside a dispatch mode's handler the
        # mode is off, so through the dispatcher its ops would not be seen
        for name, value in state.items():
            p = params[name]
            if isinstance(p, NF4Tensor):
                copy_nf4(torch.ops.aten.copy_.default, (p, value), {})
            else:
                p.copy_(value)
    return tracer


def trace_hf_load(exp: ExperimentSpec) -> StorageTracer:
    """``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))``'s load of
    ``exp`` on meta, traced (see the module docstring), then PEFT's kbit preparation and LoRA."""
    import bitsandbytes as bnb
    import transformers
    from transformers import BitsAndBytesConfig
    from transformers.core_model_loading import _materialize_copy, dot_natural_key
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from .hf_model import choose_family, hf_config, peft_targets
    from .hf_presets import patch_peft_meta_autocast, patch_peft_old_torchao
    from .hf_qlora import prepare_kbit

    lora = exp.training.lora
    assert lora is not None and lora.qlora
    dtype = _dtype(exp)
    family = choose_family(exp.model)
    with torch.device("meta"):  # from_pretrained builds the model empty, then loads into it
        model = getattr(transformers, family.auto_class).from_config(hf_config(exp.model, family), dtype=dtype)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied head once, as the checkpoint
    quantizer = Bnb4BitHfQuantizer(BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=lora.double_quant))
    quantizer._process_model_before_weight_loading(model, device_map=None)
    convert = Bnb4bitQuantize(quantizer)
    tracer = LoadTracer("meta")
    with tracer:
        tracer.set_phase("load", "convert_and_load_state_dict_in_model")
        for key in sorted(shapes, key=dot_natural_key):  # l.1893: the checkpoint's names in this order
            value: Any = _materialize_copy(torch.empty(shapes[key], dtype=dtype), "meta", dtype)
            path, _, name = key.rpartition(".")
            mod = model.get_submodule(path)
            if isinstance(mod, bnb.nn.Linear4bit) and name == "weight":
                weight: Any = mod.weight
                weight.blocksize = lora.quant_block
                new: Any = convert.convert({key: value}, full_layer_name=key, model=model)[key]
                if not new.bnb_quantized:  # .to("meta") skipped it: what .to("cuda") runs
                    new = new._quantize(value.device)
                mod.weight = new
                del new, weight
            else:  # set_param_for_module (l.1568-1610): the value as the module's parameter
                setattr(mod, name, torch.nn.Parameter(value, requires_grad=value.is_floating_point()))
            del value  # del realized_value (l.1990)
        model.tie_weights()  # from_pretrained ties a tied head to the loaded embedding after loading
        if exp.profile.qlora_fp32_cast:
            tracer.set_phase("load", "prepare_model_for_kbit_training")
            prepare_kbit(model)
        from peft import LoraConfig, get_peft_model

        patch_peft_meta_autocast()
        patch_peft_old_torchao()
        tracer.set_phase("load", "get_peft_model")
        with torch.device("meta"):
            model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]
                                                     lora_dropout=lora.dropout,
                                                     target_modules=peft_targets(family, lora)))
    return tracer


__all__ = ["LoadTracer", "trace_hf_load", "trace_torchtune_load"]
