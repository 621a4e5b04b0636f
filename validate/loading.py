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


def trace_torchtune_load(exp: ExperimentSpec) -> StorageTracer:
    """torchtune's ``_setup_model`` build and ``load_state_dict`` of ``exp`` on meta, traced."""
    from .trainers.torchtune_model import build

    dtype = _dtype(exp)
    tracer = LoadTracer("meta")
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


__all__ = ["LoadTracer", "trace_torchtune_load"]
