"""The adapter contract: one :class:`Family` per Hugging Face ``model_type``, one module each in this
package (``<model_type>.py`` defining ``FAMILY``), found by :mod:`.registry`. Torch-free: the
estimator reads a ``config.json`` through it (:mod:`memcalc.inputs.hf_config`), the validator builds
the real transformers + PEFT model from it (:mod:`memcalc.validate.hf_model`), and the tests take
their PEFT target names from it.

A family says:

- which ``config.json`` it reads (``model_type``, ``aliases``);
- how it reads one (``read``: keys through a :class:`~.reader.Reader` into ModelSpec fields, the
  layout its ``modeling_*.py`` builds; ``defaults``: its transformers configuration class's defaults
  of the keys it reads without an inline default), and which keys it deliberately ignores, each
  with the reason (``ignored``, on top of :data:`.ignored.COMMON`); every other key is reported;
- its PEFT names (``lora``: memcalc LoRA target -> ``target_modules`` names; ``lora_params``:
  targets reached through ``target_parameters``, MoE experts; ``lora_kwargs``: further
  ``LoraConfig`` arguments);
- what the validator builds (``auto_class``, the transformers auto class given the config; and,
  optional, ``inverse``: ModelSpec -> configuration keywords for models that are no shipped
  config.json's, with what of a ModelSpec the family cannot express).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Optional
from collections.abc import Callable, Mapping

if TYPE_CHECKING:
    from memcalc.core.spec import ModelSpec
    from memcalc.inputs.hf_families.reader import Reader

#: ModelSpec keyword arguments, as a family's ``read`` returns them
Fields = dict[str, Any]


def frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


#: memcalc LoRA target -> PEFT module names of the Llama-style modeling files (q_proj, ..., down_proj)
LLAMA_LORA: Mapping[str, tuple[str, ...]] = frozen({
    "q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",), "gate": ("gate_proj",),
    "up": ("up_proj",), "down": ("down_proj",)})
#: the routed experts: no module, PEFT's target_parameters on the 3-D expert tensors (transformers 5)
EXPERT_PARAMS: Mapping[str, tuple[str, ...]] = frozen({"experts": ("experts.gate_up_proj", "experts.down_proj")})
#: LLAMA_LORA plus the experts (reached through EXPERT_PARAMS)
MOE_LORA: Mapping[str, tuple[str, ...]] = frozen({**LLAMA_LORA, "experts": ()})


@dataclass(frozen=True)
class Inverse:
    """ModelSpec -> the family's configuration keywords (``AutoConfig.for_model``), for a model that
    is no shipped config.json's (``memcalc validate --framework hf`` on a hand-written ModelSpec)."""

    #: the configuration class's keyword arguments for ``m``
    config: Callable[[ModelSpec], dict[str, Any]]
    #: what of ``m`` the family's modeling code cannot express (empty: it can)
    mismatches: Callable[[ModelSpec], list[str]]
    #: a one-line description for error messages
    shape: str = ""
    #: the family's q, k, v projection is one module (GPT-2 c_attn): ModelSpec.fused_qkv must say so
    fused_qkv: bool = False
    #: the validator tries the families whose model_type the model's name does not contain in this order
    order: int = 100


@dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Family:
    """One Hugging Face ``model_type`` (see the module docstring)."""

    model_type: str
    #: config keys -> ModelSpec fields (without ``name``); raises UserError for what it refuses
    read: Callable[[Reader], Fields]
    #: config key -> the transformers configuration class's default, for keys read without one inline
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: config keys deliberately not read -> why they change no memory memcalc models
    ignored: Mapping[str, str] = field(default_factory=dict)
    #: memcalc LoRA target -> PEFT ``target_modules`` names (one fused module may serve several targets)
    lora: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_LORA)
    #: memcalc LoRA target -> PEFT ``target_parameters`` (MoE experts)
    lora_params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: further ``LoraConfig`` arguments (GPT-2's Conv1D stores weights (in, out): fan_in_fan_out)
    lora_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: other ``model_type`` names read the same way
    aliases: tuple[str, ...] = ()
    #: not empty: the model_type is recognised and refused; the error says ``{where}: model_type {t} {refused}``
    refused: str = ""
    #: the transformers auto class the validator builds the model with (``from_config``)
    auto_class: str = "AutoModelForCausalLM"
    #: ModelSpec -> configuration keywords, for hand-written ModelSpecs (optional)
    inverse: Optional[Inverse] = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type, *self.aliases)
