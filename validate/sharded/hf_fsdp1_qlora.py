"""QLoRA under FSDP1 as PEFT's FSDP + QLoRA recipe runs it (issue 28), for :mod:`.hf`'s sharded trace.

What the libraries require, and what the harness does (transformers 5.24, PEFT 0.21, bitsandbytes 0.50,
torch 2.13 ``torch/distributed/fsdp/_flat_param.py``):

- **Quant storage in the model's dtype.** ``FlatParamHandle._validate_tensors_to_flatten`` refuses
  integer tensors ("Cannot flatten integer dtype tensors") and a flat parameter of mixed dtypes ("Must
  flatten tensors with uniform dtype"), so PEFT's recipe (docs/source/accelerate/fsdp.md, "Use PEFT QLoRA
  and FSDP") loads with ``BitsAndBytesConfig(bnb_4bit_quant_storage=torch_dtype)``: the packed 4-bit
  weight is the same bytes viewed as bf16 (``functional.quantize_4bit`` ``.view(quant_storage)``), flattened
  with the layer's bf16 norms. The harness builds the base that way (:func:`..hf_qlora.load_4bit`).
- **No k-bit fp32 cast.** PEFT's ``prepare_model_for_kbit_training`` makes the norms fp32 beside the bf16
  packed weights of the same decoder layer, which FSDP1 refuses (the uniform-dtype check above); TRL's
  ``prepare_peft_model`` skips it for sharded QLoRA (trl 1.16 trl/experimental/utils.py ``is_sharded_qlora``;
  huggingface/trl 58c0888). A profile with ``qlora_fp32_cast`` is refused in one line (:func:`check`).
- **Params4bit cannot wrap a fake tensor** (``torch.Tensor._make_subclass`` on a ``FakeTensor``), so the
  model is quantized and wrapped by PEFT on real ``meta`` tensors, then every parameter, buffer and
  quantisation-state tensor is replaced by a fake ``cpu`` tensor of its shape and dtype
  (:func:`to_fake_cpu`), which FSDP1 flattens.
- **The weight's quant_state in forward.** FSDP1 (``use_orig_params=False``) sets each weight to a plain
  view of the unsharded flat parameter, without the ``Params4bit`` and its ``quant_state``;
  ``Linear4bit.forward`` calls ``fix_4bit_weight_quant_state_from_module`` (bitsandbytes/nn/modules.py),
  which wraps the view in a new ``Params4bit`` (``_make_subclass``: the view's own storage, no copy) and
  gives it the module's ``quant_state``. A fake view cannot be re-wrapped, so :func:`fake_views_keep_state`
  sets ``quant_state`` on the view itself: the same storage and no allocation, as on CUDA. This is the one
  library function the harness replaces; it allocates nothing either way.
- **The quantisation states** (absmax, code; nested: offset, state2) are no FSDP parameters: every rank
  holds its own whole copy, counted as existing before the step (:func:`..hf_qlora.quant_state_tensors`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec

#: the refusal when the profile casts with PEFT's prepare_model_for_kbit_training
KBIT_CAST_REFUSED = (
    "--sharding fsdp1 with QLoRA and PEFT's prepare_model_for_kbit_training (profile qlora_fp32_cast): its fp32 "
    "norms beside the bf16-storage 4-bit weights of one decoder layer make a flat parameter FSDP1 refuses "
    "('Must flatten tensors with uniform dtype', torch/distributed/fsdp/_flat_param.py); TRL skips the cast "
    "for sharded QLoRA: --framework trl, or a profile with qlora_fp32_cast false")


def check(exp: ExperimentSpec) -> None:
    """One line for the FSDP1 + QLoRA setup FSDP1 itself refuses (see the module docstring)."""
    if exp.profile.qlora_fp32_cast:
        raise UserError(KBIT_CAST_REFUSED)


def to_fake_cpu(model) -> list[torch.Tensor]:
    """Call inside the fake mode: every parameter and buffer of the real-``meta`` ``model`` becomes a fake
    ``cpu`` tensor of its shape, dtype and ``requires_grad`` (tied ones stay tied; a ``Params4bit`` becomes
    a plain parameter, as FSDP1's flattening makes it anyway), and so does every 4-bit weight's quantisation
    state. Returns the quantisation-state tensors (what the rank holds beside its parameters)."""
    import bitsandbytes as bnb
    import torch.nn as nn

    done: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            done[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return done[id(t)]

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                               requires_grad=p.requires_grad)
                mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = fake(b)
    states: list[torch.Tensor] = []
    seen: set[int] = set()
    for mod in model.modules():
        qs = getattr(mod, "quant_state", None) if isinstance(mod, bnb.nn.Linear4bit) else None
        if qs is None or id(qs) in seen:
            continue
        seen.add(id(qs))
        qs.absmax, qs.code = fake(qs.absmax), fake(qs.code)
        states += [qs.absmax, qs.code]
        if qs.nested:
            qs.offset, qs.state2.absmax, qs.state2.code = fake(qs.offset), fake(qs.state2.absmax), fake(qs.state2.code)
            states += [qs.offset, qs.state2.absmax, qs.state2.code]
    return states


@contextlib.contextmanager
def fake_views_keep_state() -> Iterator[None]:
    """``fix_4bit_weight_quant_state_from_module`` for a fake view of FSDP1's flat parameter: the module's
    ``quant_state`` set on the view (bitsandbytes wraps the view in a ``Params4bit`` sharing its storage;
    see the module docstring). Any other weight goes through bitsandbytes' own function."""
    import bitsandbytes.nn.modules as bnb_modules
    from torch._subclasses.fake_tensor import FakeTensor

    original = bnb_modules.fix_4bit_weight_quant_state_from_module

    def fix(module) -> None:
        w: Any = module.weight
        if getattr(w, "quant_state", None) is None and isinstance(w, FakeTensor) \
                and not isinstance(w, bnb_modules.Params4bit):
            setattr(w, "quant_state", module.quant_state)  # noqa: B010 - an attribute of the fake view
            return
        original(module)

    bnb_modules.fix_4bit_weight_quant_state_from_module = fix
    try:
        yield
    finally:
        bnb_modules.fix_4bit_weight_quant_state_from_module = original


__all__ = ["KBIT_CAST_REFUSED", "check", "fake_views_keep_state", "to_fake_cpu"]
