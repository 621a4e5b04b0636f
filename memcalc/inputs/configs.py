"""Experiment configs: a shipped reference config by name, or a YAML/JSON file of one's own.

A config is an :class:`~memcalc.core.spec.ExperimentSpec` whose ``model`` may be a
preset name or a path (Hugging Face config.json or a model spec file) and whose
``profile`` may be a profile name; both are resolved here. Nothing downstream
reads files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memcalc.inputs.data_files import check_name, list_names, load_named, parse_text, path_kind, read_user_file, shorten
from memcalc.core.errors import UserError, unknown_name
from memcalc.inputs.profiles import get_profile
from memcalc.core.spec import ExperimentSpec


def list_configs() -> list[str]:
    """Names of the shipped reference configs."""
    return list_names("configs")


def _raw(name_or_path: str) -> tuple[Any, str]:
    check_name(name_or_path, "--config")
    if not name_or_path.strip():
        raise UserError(f"--config {name_or_path!r}: an empty name; give a config name or a file path")
    p = Path(name_or_path)
    kind = path_kind(p)
    if p.suffix.lower() in (".yaml", ".yml", ".json") or kind != "none":
        if kind in ("dir", "none"):  # (a FIFO or a device: refused unread, its kind named)
            shown = name_or_path if len(name_or_path) <= 200 else shorten(name_or_path, 200)
            raise UserError(f"config file {shown} is a directory; give a file path" if kind == "dir" else
                            f"config file not found: {shown}")
        return parse_text(read_user_file(p, "config file"), str(p)), str(p)
    if name_or_path not in list_configs():
        raise unknown_name("config", shorten(name_or_path)[1:-1], list_configs())
    return load_named("configs", name_or_path), f"configs/{name_or_path}"


def experiment_from_dict(raw: Any, where: str) -> ExperimentSpec:
    """Build an ExperimentSpec from parsed YAML/JSON, resolving model and profile names."""
    from memcalc.inputs.presets import resolve_model
    from memcalc.inputs.pydantic_errors import pydantic_error_line

    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping of experiment fields, not {type(raw).__name__}")
    raw = dict(raw)
    if "model" not in raw:
        raise UserError(f"{where} has no 'model' (a preset name, a path, or a mapping of model fields)")
    if isinstance(raw["model"], str):
        raw["model"] = resolve_model(raw["model"])
    prof = raw.get("profile")
    if isinstance(prof, str):
        raw["profile"] = get_profile(prof)
    elif isinstance(prof, dict) and "base" in prof:
        base = get_profile(prof.pop("base"))
        raw["profile"] = {**base.model_dump(), **prof}  # validated below, as the experiment's profile
    try:
        return ExperimentSpec(**raw)
    except ValidationError as e:
        raise UserError(pydantic_error_line(e, where)) from None


def load_config(name_or_path: str) -> ExperimentSpec:
    """A reference config by name (``memcalc configs`` lists them) or a config file path."""
    raw, where = _raw(name_or_path)
    return experiment_from_dict(raw, where)


def lora_precision_note(config: str, precision: str, named: bool) -> str:
    """``--config FILE`` with a LoRA flag: the precision the file names is kept; one it does not name
    is LoRA's default bf16 base, as with ``--model`` (memcalc.inputs.resolve ``_setup_defaults``)."""
    if named:
        return (f"--config {config} names precision {precision}: kept under LoRA (a config naming none gets LoRA's "
                f"default, a bf16 base; --bf16 for one)")
    return f"--config {config} names no precision: LoRA's default, a bf16 base, as with --model"
