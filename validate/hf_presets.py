"""The transformers model of a preset read from a shipped Hugging Face config.json
(``data/models/<name>.yaml`` with ``hf_config``; :func:`memcalc.inputs.presets.preset_hf_config`).

When the ModelSpec being validated is such a preset's model (equal to what
:func:`memcalc.inputs.hf_config.from_hf_config` reads from the config, except possibly ``n_layers``
and ``name``: ``--scale-layers``), the model is built from the published config itself
(``AutoConfig.for_model(model_type, **config)``), not from an inverse mapping: every family
transformers knows (Qwen3, Gemma-2/3, OLMo-2, SmolLM3, Granite, Phi-3/4, Mixtral, Qwen3-MoE,
DeepSeek-V3, gpt-oss, ...) is then the real one.

The depth is the ModelSpec's ``n_layers``; what else in a config counts layers is cut to match:
per-layer lists (``layer_types``: Gemma-3, gpt-oss; ``no_rope_layers``: SmolLM3) keep their first
``n_layers`` entries; index lists (``mlp_only_layers``: Qwen2/3-MoE) keep the indices below
``n_layers``; a count (``first_k_dense_replace``: DeepSeek) needs no change (more dense layers
than layers = every layer dense, as memcalc's ``MoeSpec.first_dense_layers`` reads it).
The stored quantization format (``quantization_config``: gpt-oss MXFP4, DeepSeek FP8) and the
remote-code map (``auto_map``) are dropped: training builds the plain transformers modules.

LoRA: memcalc's targets as the module names of each family's ``modeling_*.py`` are its adapter's
(:mod:`memcalc.inputs.hf_families`, ``Family.lora`` and ``lora_params``).
"""

from __future__ import annotations

import json

from functools import lru_cache
from typing import Any, Optional

from memcalc.core.spec import ModelSpec
from memcalc.inputs import hf_families

#: config keys holding one entry per layer (cut to n_layers)
_PER_LAYER = ("layer_types", "no_rope_layers")
#: config keys holding layer indices (keep those below n_layers)
_LAYER_INDICES = ("mlp_only_layers",)
#: config keys the training model does not use
_DROPPED = ("model_type", "quantization_config", "auto_map")


def config_kwargs(raw: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """``raw`` (a config.json) as keyword arguments of its configuration class with ``n_layers`` layers
    (see the module docstring for what is cut)."""
    key = "num_hidden_layers" if "num_hidden_layers" in raw else "n_layer"  # GPT2Config: n_layer
    full = raw[key]
    out = {k: v for k, v in raw.items() if k not in _DROPPED}
    out[key] = n_layers
    for k in _PER_LAYER:
        if isinstance(out.get(k), list):
            assert len(out[k]) == full, (k, len(out[k]), full)
            out[k] = out[k][:n_layers]
    for k in _LAYER_INDICES:
        if isinstance(out.get(k), list):
            out[k] = [i for i in out[k] if i < n_layers]
    return out


#: the model types of hf_model.FAMILIES: the adapters with a ModelSpec inverse (hf_model imports this module)
_HAND_WRITTEN = tuple(t for t, a in hf_families.families().items() if a.inverse is not None)


@lru_cache(maxsize=1)
def _hf_config_presets() -> tuple[tuple[str, ModelSpec, dict[str, Any]], ...]:
    from memcalc.inputs.presets import list_presets, load_preset, preset_hf_config

    from memcalc.inputs.data_files import list_names, load_named
    from memcalc.inputs.hf_config import from_hf_config

    out = []
    for name in list_presets():
        raw = preset_hf_config(name)
        if raw is not None:
            out.append((name, load_preset(name), raw))
    # then every shipped config.json (data/hf_configs) of a model type that has no hand-written family
    # in hf_model.FAMILIES (those build every model of their type): the model of one no preset names
    for stem in list_names("hf_configs"):
        raw = json.loads(json.dumps(load_named("hf_configs", stem)))
        if raw.get("model_type") in _HAND_WRITTEN:
            continue
        try:
            spec = from_hf_config(raw, stem)
        except Exception:  # noqa: BLE001 - a fixture the reader refuses names no model to match
            continue
        out.append((stem, spec, raw))
    return tuple(out)


def find_preset(m: ModelSpec) -> Optional[tuple[str, dict[str, Any]]]:
    """(preset name, its config.json) when ``m`` is that preset's model up to ``n_layers`` and ``name``,
    else (a shipped config's stem, the config) when ``m`` is the model of a config.json in
    ``data/hf_configs`` that no preset names; else None."""
    for name, spec, raw in _hf_config_presets():
        if m.model_copy(update={"n_layers": spec.n_layers, "name": spec.name}) == spec:
            return name, raw
    return None


def patch_peft_old_torchao() -> None:
    """PEFT 0.21's LoRA dispatch asks ``is_torchao_available()`` for every target module
    (peft/tuners/lora/torchao.py ``dispatch_torchao``), which *raises* ImportError when the installed
    torchao is older than 0.16 (peft/import_utils.py) -- and torchtune 0.6.1 needs torchao 0.14.1
    (the ``torchtune`` extra). The validator never builds a torchao-quantized base, so an old torchao
    is treated as absent there (what PEFT does without torchao): dispatch falls through to the plain
    ``lora.Linear``. Installed once, idempotent; nothing changes with torchao >= 0.16."""
    try:
        from peft.tuners.lora import torchao as peft_torchao
    except ImportError:  # pragma: no cover - another PEFT layout
        return
    check = peft_torchao.is_torchao_available
    if getattr(check, "_memcalc_old_torchao", False):
        return

    def available() -> bool:
        try:
            return check()
        except ImportError:  # torchao < 0.16: unusable by PEFT, as if not installed
            return False

    available._memcalc_old_torchao = True  # type: ignore[attr-defined]
    peft_torchao.is_torchao_available = available  # type: ignore[assignment]


def patch_peft_meta_autocast() -> None:
    """PEFT 0.21 folds an expert adapter into its 3-D parameter under
    ``torch.autocast(device_type=W.device.type, enabled=False)``
    (peft/tuners/lora/layer.py ``_LoraFactorsProxy.forward``); ``torch.autocast("meta")`` raises
    (no autocast dtype for meta). On meta the fold runs with torch-function modes off instead, so
    the validator's autocast emulation (:class:`~.hf_kernels.HFKernels`) leaves it in W's dtype as
    ``enabled=False`` does on CUDA (the dispatch-level tracer still sees it); on every other device
    PEFT's own forward runs. Installed once, idempotent."""
    import torch
    from peft.tuners.lora import layer

    proxy = getattr(layer, "_LoraFactorsProxy", None)
    if proxy is None or getattr(proxy.forward, "_memcalc_meta", False):
        return
    original = proxy.forward

    def forward(self, W):
        if W.device.type == "meta":
            with torch._C.DisableTorchFunction():
                return torch.baddbmm(W, self.lhs, self.rhs, alpha=self.scaling)
        return original(self, W)

    forward._memcalc_meta = True  # type: ignore[attr-defined]
    proxy.forward = forward
