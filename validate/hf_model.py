"""memcalc's :class:`~memcalc.core.spec.ModelSpec` as a Hugging Face ``transformers`` config, and the
real model built from it (``memcalc validate --framework hf``).

Every family is its adapter (:mod:`memcalc.inputs.hf_families`, one module per ``model_type``,
torch-free): its PEFT names (``lora``, ``lora_params``, ``lora_kwargs``), the transformers auto class
that builds it, and, for the families that build a hand-written ModelSpec, its ``inverse``. The
validator's :class:`Family` record is made from the adapter (:func:`from_adapter`) and holds:

- ``mismatches(m)``: what of the ModelSpec the family's modeling code cannot express (empty =
  it can), read from its ``modeling_*.py`` (transformers 5.23);
- ``config(m)``: the keyword arguments of its configuration class (``AutoConfig.for_model``);
- ``lora_modules``: memcalc's LoRA target names (:data:`memcalc.core.spec.LORA_TARGETS`) as the
  module names PEFT matches (``target_modules``); several memcalc targets that name one fused
  module (GPT-2's ``c_attn`` = q, k, v) must be asked together.

A preset read from a shipped config.json (``data/models/*.yaml`` with ``hf_config``) needs no
inverse: when the ModelSpec is that preset's model, :func:`choose_family` returns its adapter's
family with the published file, cut to the traced depth, as config (:mod:`.hf_presets`).

:data:`FAMILIES` are the adapters with an ``inverse`` (the tests round-trip each: ModelSpec ->
config -> ``from_config`` parameter count == :func:`memcalc.engine.params.count_params`). Choices
the ModelSpec does not carry are the adapters' (Mistral's ``sliding_window`` None; ModelSpec's
``gelu_new`` is transformers' ``gelu_new``, ``gelu_tanh`` its ``gelu_pytorch_tanh``, in every family:
:data:`memcalc.inputs.hf_families.common.HF_ACTIVATIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.inputs import hf_families


@dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type`` as the validator builds it (see the module docstring), made
    from its adapter (:func:`from_adapter`)."""

    model_type: str
    mismatches: Callable[[ModelSpec], list[str]]
    config: Callable[[ModelSpec], dict[str, Any]]
    lora_modules: dict[str, tuple[str, ...]]
    #: memcalc targets that share one module (must be asked together)
    fused: tuple[tuple[str, ...], ...] = field(default=())
    #: a one-line description for error messages
    shape: str = ""
    #: further LoraConfig arguments the family needs (GPT-2's Conv1D stores weights (in, out))
    lora_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the family's q, k, v projection is one module (GPT-2 c_attn): ModelSpec.fused_qkv must say so
    fused_qkv: bool = False
    #: memcalc targets reached through PEFT's ``target_parameters`` (MoE experts), not modules
    lora_params: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: the transformers auto class that builds the model from its configuration
    auto_class: str = "AutoModelForCausalLM"


def from_adapter(a: hf_families.Family, mismatches: Optional[Callable[[ModelSpec], list[str]]] = None,
                 config: Optional[Callable[[ModelSpec], dict[str, Any]]] = None, shape: str = "",
                 fused_qkv: bool = False) -> Family:
    """The validator's record of adapter ``a``: its PEFT names and auto class; ``mismatches``,
    ``config``, ``shape`` and ``fused_qkv`` from its ``inverse`` unless given."""
    inv = a.inverse
    return Family(a.model_type, mismatches or (inv.mismatches if inv else (lambda _m: [])),
                  config or (inv.config if inv else _no_inverse(a.model_type)), dict(a.lora),
                  shape=shape or (inv.shape if inv else ""), lora_kwargs=dict(a.lora_kwargs),
                  fused_qkv=fused_qkv or (inv.fused_qkv if inv else False), lora_params=dict(a.lora_params),
                  auto_class=a.auto_class)


def _no_inverse(model_type: str) -> Callable[[ModelSpec], dict[str, Any]]:
    def config(m: ModelSpec) -> dict[str, Any]:
        raise UserError(f"--framework hf: {model_type} builds only from a config.json (no ModelSpec inverse)")
    return config


#: ModelSpec fields of the newer families (issue 12) and their defaults: a family registered here
#: builds none of them, so a model that sets one is not that family (it would trace another model)
_NEWER_FEATURES = (("norm_impl", "framework"),
                   ("fused_gate_up", False), ("qk_norm", "none"), ("attn_softcap", None), ("logit_softcap", None),
                   ("attn_sinks", False), ("sliding_window", None), ("embedding_scale", 1.0),
                   ("residual_multiplier", 1.0), ("logit_scale", 1.0), ("parallel_norms", 1), ("moe", None),
                   ("mla", None))


def _feature_mismatches(f: Family, m: ModelSpec) -> list[str]:
    """What ``m`` sets that family ``f`` does not build (the fields of :data:`_NEWER_FEATURES`, and a
    fused or separate q, k, v projection)."""
    out = [f"{k}={getattr(m, k)!r}" for k, default in _NEWER_FEATURES if getattr(m, k) != default]
    if m.fused_qkv != f.fused_qkv:
        out.append(f"fused_qkv={m.fused_qkv}")
    return out


def hand_written() -> dict[str, Family]:
    """The families with a ModelSpec inverse (their adapters' ``inverse``), in their ``order``."""
    order = {t: a.inverse.order for t, a in hf_families.families().items() if a.inverse is not None}
    return {t: from_adapter(hf_families.families()[t]) for t in sorted(order, key=lambda t: (order[t], t))}


FAMILIES: dict[str, Family] = hand_written()


def preset_family(m: ModelSpec) -> Optional[Family]:
    """The family of a preset read from a shipped config.json when ``m`` is that preset's model
    (:mod:`.hf_presets`): its config is the published file, cut to ``m.n_layers``."""
    from . import hf_presets

    hit = hf_presets.find_preset(m)
    if hit is None:
        return None
    name, raw = hit
    adapter = hf_families.get(raw["model_type"])
    assert adapter is not None, raw["model_type"]  # find_preset matched a model read through it
    return from_adapter(adapter, lambda _m: [], lambda mm: hf_presets.config_kwargs(raw, mm.n_layers),
                        shape=f"preset {name}, data/hf_configs", fused_qkv=m.fused_qkv)


def source_family(m: ModelSpec) -> Optional[Family]:
    """The family of the config.json ``m`` was read from (``--model PATH``, an id's cached or fetched
    file, a preset's shipped file: :attr:`ModelSpec.hf_source`), while ``m`` is still that file's model
    at any depth: its config is that exact file, cut to ``m.n_layers`` (:func:`.hf_presets.config_kwargs`),
    every key it sets (``use_cache``, ...) as given."""
    from . import hf_presets

    src = m.hf_source
    if src is None:
        return None
    adapter = hf_families.get(src.config.get("model_type"))
    if adapter is None or adapter.refused:
        return None
    raw = src.config
    return from_adapter(adapter, lambda _m: [], lambda mm: hf_presets.config_kwargs(raw, mm.n_layers),
                        shape=f"config.json {src.where}", fused_qkv=m.fused_qkv)


def choose_family(m: ModelSpec) -> Family:
    """The family that expresses ``m``: the config.json it was read from (:func:`source_family`), else
    a preset's own config.json when ``m`` is such a preset's model (:func:`preset_family`), else one
    whose ``model_type`` is in the model's name first (``mistral-7b`` -> mistral), else the first in
    :data:`FAMILIES` order; a one-line :class:`UserError` naming the closest family's differences when
    none can."""
    pf = source_family(m) or preset_family(m)
    if pf is not None:
        return pf
    name = m.name.lower().replace("-", "").replace("_", "")
    order = sorted(FAMILIES.values(), key=lambda f: f.model_type not in name)
    misses = {f.model_type: f.mismatches(m) + _feature_mismatches(f, m) for f in order}
    for f in order:
        if not misses[f.model_type]:
            return f
    near = min(order, key=lambda f: len(misses[f.model_type]))
    supported = "; ".join(f"{f.model_type} ({f.shape})" for f in FAMILIES.values())
    raise UserError(f"--framework hf: model {m.name!r} is none of the Hugging Face families memcalc builds "
                    f"(closest, {near.model_type}, differs in {', '.join(misses[near.model_type])}); "
                    f"supported: {supported}")


def peft_targets(family: Family, lora: LoraSpec) -> list[str]:
    """PEFT ``target_modules`` for memcalc's LoRA targets, in order, each module once."""
    asked = set(lora.targets)
    if "head" in asked:  # every CausalLM's output projection is the module lm_head
        rest = lora.model_copy(update={"targets": tuple(t for t in lora.targets if t != "head")}) if len(asked) > 1 else None
        return (peft_targets(family, rest) if rest is not None else []) + ["lm_head"]
    for group in family.fused:
        got = asked & set(group)
        if got and got != set(group):
            raise UserError(f"--framework hf: {family.model_type} fuses {', '.join(group)} in one module "
                            f"({family.lora_modules[group[0]][0]}); LoRA targets them all or none, "
                            f"not {', '.join(t for t in group if t in got)}")
    missing = [t for t in lora.targets if t not in family.lora_modules]
    if missing:
        raise UserError(f"--framework hf: {family.model_type} has no LoRA target {', '.join(missing)}; "
                        f"its targets: {', '.join(family.lora_modules)}")
    out: list[str] = []
    for t in lora.targets:
        for name in family.lora_modules[t]:
            if name not in out:
                out.append(name)
    return out


def hf_config(m: ModelSpec, family: Optional[Family] = None):
    """The ``transformers`` configuration of ``m`` (``AutoConfig.for_model``)."""
    from transformers import AutoConfig

    family = family or choose_family(m)
    kw = family.config(m)
    kw.setdefault("use_cache", m.use_cache)  # a hand-written spec's (a config.json's own stays as given)
    return AutoConfig.for_model(family.model_type, **kw)


def build_hf_model(m: ModelSpec, lora: Optional[LoraSpec], dtype, device: str = "meta", family: Optional[Family] = None,
                   compute_dtype=None, kbit_prepare: bool = False, quant_storage=None):
    """The real model: ``AutoModelForCausalLM.from_config(cfg, dtype=dtype)`` built directly on
    ``device`` (on ``meta``: no weights), in train mode; with ``lora``, PEFT's
    ``get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout))`` with PEFT's
    defaults (``autocast_adapter_dtype=True``: fp32 adapters over a 16-bit base). A QLoRA base is
    first loaded in 4-bit with ``compute_dtype`` and, with ``kbit_prepare``, passed through PEFT's
    ``prepare_model_for_kbit_training`` (:mod:`.hf_qlora`; ``quant_storage``: ``bnb_4bit_quant_storage``,
    uint8 when None). Returns ``(model, family)``."""
    import torch
    import transformers

    family = family or choose_family(m)
    cfg = hf_config(m, family)
    with torch.device(device):
        model = getattr(transformers, family.auto_class).from_config(cfg, dtype=dtype)
    if lora is not None and lora.qlora:
        from .hf_qlora import load_4bit, prepare_kbit

        load_4bit(model, lora, compute_dtype or dtype, quant_storage or torch.uint8)
        if kbit_prepare:
            prepare_kbit(model)
    if lora is not None:
        import warnings

        from peft import LoraConfig, get_peft_model

        from .hf_presets import patch_peft_meta_autocast, patch_peft_old_torchao

        patch_peft_meta_autocast()
        patch_peft_old_torchao()
        targets = peft_targets(family, lora)
        params = [p for t in lora.targets for p in family.lora_params.get(t, ())]
        extra = dict(family.lora_kwargs, **({"target_parameters": params} if params else {}))
        if lora.modules_to_save:
            extra["modules_to_save"] = modules_to_save_names(model, lora.modules_to_save)
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=lora.dropout,
                         use_dora=lora.dora, **extra)
        with torch.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # PEFT calls transformers 5's deprecated aliases
            # PEFT's v4 -> v5 MoE conversion adds rank/alpha patterns for the fused expert parameter,
            # which no *module* matches (it is reached through target_parameters)
            warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
            model = get_peft_model(model, cfg)
    model.train()
    return model, family


def modules_to_save_names(model, save: tuple[str, ...]) -> list[str]:
    """PEFT ``modules_to_save`` for memcalc's names: the module names of the model's input embedding
    (``embed_tokens``) and output head (``lm_head``), as the family calls them (GPT-2 ``wte``)."""
    mods = {"embed_tokens": model.get_input_embeddings(), "lm_head": model.get_output_embeddings()}
    names = {id(mod): name.rsplit(".", 1)[-1] for name, mod in model.named_modules()}
    return [names[id(mods[s])] for s in save]


def param_counts(model) -> tuple[int, int]:
    """(total, trainable) parameter elements of a built model (tied weights counted once)."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return total, trainable
