"""Model presets and model resolution: a preset name, a Hugging Face config.json, or a spec file.

Presets are ``data/models/<name>.yaml`` (read through :mod:`memcalc.inputs.data_files`, so
they work from any install); each holds :class:`~memcalc.core.spec.ModelSpec` fields and
a comment citing the published ``config.json`` it was written from. Their exact
parameter totals are pinned in ``tests/unit/test_params.py``. A top-level ``hf_id`` key
(metadata, not a ModelSpec field: stripped before the spec is built) names the Hugging
Face checkpoint a preset describes, so ``--model ORG/NAME`` finds the preset.

"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from memcalc.inputs.data_files import check_name, list_names, load_named, parse_text, path_kind, read_user_file, shorten
from memcalc.core.errors import UserError
from memcalc.engine.params import count_params
from memcalc.core.spec import ModelSpec
from memcalc.inputs.pydantic_errors import pydantic_error_line

_FOLDER = "models"
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")
#: the preset key naming its Hugging Face checkpoint (metadata, not a ModelSpec field)
HF_ID_KEY = "hf_id"


@dataclass(frozen=True)
class ModelSource:
    """Where ``--model``'s model came from, for the inputs table and ``--json``.

    ``kind``: ``preset`` (by name), ``preset-by-id`` (a preset whose ``hf_id`` is the id given),
    ``hf-cache`` (config.json in the local Hugging Face cache), ``hub`` (config.json fetched
    from the Hub), ``file`` (a path given).
    """

    kind: str
    value: str
    preset: Optional[str] = None
    hf_id: Optional[str] = None
    path: Optional[str] = None
    url: Optional[str] = None
    note: Optional[str] = None

    def describe(self) -> str:
        """One line for the inputs table."""
        if self.kind == "preset-by-id":
            return f"preset {self.preset} (Hugging Face id {self.hf_id})"
        if self.kind == "hf-cache":
            return f"{self.hf_id}: config.json in the Hugging Face cache, {self.path}"
        if self.kind == "hub":
            saved = f", saved to {self.path}" if self.path else f" (not saved: {self.note})"
            return f"{self.hf_id}: config.json fetched from {self.url}{saved}"
        if self.kind == "file":
            return f"file {self.path}"
        return f"preset {self.preset}"

    def as_json(self) -> dict[str, Any]:
        """The ``inputs.model_source`` object of ``--json``: the set fields."""
        return {k: v for k, v in (("kind", self.kind), ("value", self.value), ("preset", self.preset),
                                  ("hf_id", self.hf_id), ("path", self.path), ("url", self.url),
                                  ("note", self.note)) if v is not None}


# --------------------------------------------------------------------------- presets


def list_presets() -> list[str]:
    """Names of the shipped model presets (``data/models/*.yaml``), sorted."""
    return list_names(_FOLDER)


def _unknown_preset(name: str) -> UserError:
    valid = list_presets()
    import difflib  # (here: only a misspelt name needs it, not an estimate's start-up)

    close = difflib.get_close_matches(name.lower(), valid, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UserError(
        f"unknown model preset {shorten(name)}{hint}; valid: {', '.join(valid)} "
        "(or a Hugging Face id ORG/NAME, or a path to a Hugging Face config.json or a model spec .yaml/.json)"
    )


def load_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (exact, or differing only in case).

    Raises :class:`UserError` listing the valid names, with a close-match suggestion.
    """
    key = _preset_key(name)
    raw = load_named(_FOLDER, key)
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if k not in _META_KEYS}
        if "hf_config" in raw:
            return _preset_from_hf_config(raw, key)
    return model_from_dict(raw, f"{_FOLDER}/{key}.yaml", default_name=key)


def _preset_key(name: str) -> str:
    valid = list_presets()
    key = name if name in valid else name.strip().lower()
    if key not in valid:
        raise _unknown_preset(name)
    return key


def _hf_id_of(raw: Any) -> Optional[str]:
    hid = raw.get(HF_ID_KEY) if isinstance(raw, dict) else None
    return hid.strip() if isinstance(hid, str) and hid.strip() else None


def preset_hf_id(name: str) -> Optional[str]:
    """The Hugging Face id (``ORG/NAME``) of the checkpoint preset ``name`` describes, or None."""
    return _hf_id_of(load_named(_FOLDER, _preset_key(name)))


def preset_hf_ids() -> dict[str, str]:
    """Every preset that has an ``hf_id``: preset name -> id (all files scanned, so new presets count)."""
    out = {}
    for name in list_presets():
        hid = _hf_id_of(load_named(_FOLDER, name))
        if hid is not None:
            out[name] = hid
    return out


def preset_for_hf_id(repo_id: str) -> Optional[str]:
    """The preset whose ``hf_id`` is ``repo_id`` ignoring case (Hub ids are case-insensitive), or None."""
    want = repo_id.strip().lower()
    return next((name for name, hid in preset_hf_ids().items() if hid.lower() == want), None)


#: preset keys that describe the preset, not the model (stripped before the spec is built)
_META_KEYS = (HF_ID_KEY,)
_HF_FOLDER = "hf_configs"


def _preset_from_hf_config(raw: dict[str, Any], key: str) -> ModelSpec:
    """A preset that names a shipped Hugging Face config (``hf_config: ORG--NAME.json`` in
    ``data/hf_configs``): the spec is that config read by :mod:`memcalc.inputs.hf_config`, so the
    preset and the published file cannot drift apart."""
    from memcalc.inputs.hf_config import from_hf_config

    where = f"{_FOLDER}/{key}.yaml"
    extra = sorted(set(raw) - {"hf_config", "name"})
    if extra:
        raise UserError(f"{where}: a preset with hf_config takes only hf_config, name and {', '.join(_META_KEYS)}; "
                        f"got {', '.join(extra)}")
    stem = str(raw["hf_config"]).removesuffix(".json")
    try:
        cfg = load_named(_HF_FOLDER, stem)
    except FileNotFoundError:
        raise UserError(f"{where}: hf_config {raw['hf_config']!r} is not in data/{_HF_FOLDER}") from None
    return from_hf_config(cfg, str(raw.get("name", key)), where=f"{_HF_FOLDER}/{stem}.json", strict=True)


def preset_hf_config(name: str) -> Optional[dict[str, Any]]:
    """The shipped Hugging Face config.json (a fresh dict) that preset ``name`` is read from
    (``hf_config: ORG--NAME.json``), or None for a preset written as ModelSpec fields."""
    raw = load_named(_FOLDER, _preset_key(name))
    if not (isinstance(raw, dict) and "hf_config" in raw):
        return None
    cfg = load_named(_HF_FOLDER, str(raw["hf_config"]).removesuffix(".json"))
    return json.loads(json.dumps(cfg))


def preset_summary(name: str) -> dict[str, Any]:
    """One row of the ``memcalc models`` table: name, Hugging Face id, exact parameter count and shapes."""
    m = load_preset(name)
    return {
        "name": name,
        "hf_id": preset_hf_id(name),
        "params": count_params(m).total,
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "n_kv_heads": m.kv_heads,
        "d_ff": m.d_ff,
        "vocab_size": m.vocab_size,
        "max_seq_len": m.max_seq_len,
    }


# --------------------------------------------------------------------------- resolution


def model_from_dict(raw: Any, where: str, default_name: Optional[str] = None) -> ModelSpec:
    """Build a ModelSpec from parsed ModelSpec fields; every problem is a one-line UserError.

    ``default_name`` is used when the mapping has no ``name``.
    """
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping of model fields, not {type(raw).__name__}")
    raw = dict(raw)
    hid = raw.pop(HF_ID_KEY, None)  # metadata: the checkpoint a preset (or a copy of one) describes
    if hid is not None and not (isinstance(hid, str) and _hf_hub().is_repo_id(hid.strip())):
        raise UserError(f"{HF_ID_KEY} in {where} must be a Hugging Face id ORG/NAME, got {shorten(str(hid))}")
    if default_name is not None and "name" not in raw:
        raw["name"] = default_name
    try:
        return ModelSpec(**raw)
    except ValidationError as e:
        raise UserError(pydantic_error_line(e, where)) from None
    except TypeError as e:  # a non-string key, e.g. `1: 2` in YAML
        raise UserError(f"invalid model spec {where}: {e}") from None


def _hf_hub():
    """:mod:`memcalc.inputs.hf_hub`, imported when a Hugging Face id is in play (it loads the
    HTTP client: a preset or ``--params`` estimate never needs it)."""
    from memcalc.inputs import hf_hub

    return hf_hub


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or value.lower().endswith(_SPEC_SUFFIXES)


def _hf_name(raw: dict[str, Any], path: Path) -> str:
    """A report name for a Hugging Face config: its ``_name_or_path``, else its folder or file stem."""
    given = raw.get("_name_or_path")
    if isinstance(given, str) and given.strip():
        return given.strip().rstrip("/").rsplit("/", 1)[-1]
    if path.stem == "config" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


def resolve_model(value: str) -> ModelSpec:
    """A model from ``--model VALUE`` (see :func:`resolve_model_source`)."""
    return resolve_model_source(value)[0]


def is_hf_id(value: str) -> bool:
    """``--model VALUE`` names a Hugging Face id rather than a path: exactly one ``/``, no
    spec-file suffix (.json/.yaml/.yml), no existing file or folder of that name, and the
    form of a Hub id (huggingface_hub's rules)."""
    return (value.count("/") == 1 and not value.lower().endswith(_SPEC_SUFFIXES)
            and path_kind(Path(value).expanduser()) == "none" and _hf_hub().is_repo_id(value))


def resolve_model_source(value: str) -> tuple[ModelSpec, ModelSource]:
    """A model from ``--model VALUE``, and where it came from.

    In order: a preset name (``memcalc models``); a path to a Hugging Face
    ``config.json`` (any JSON/YAML mapping with ``model_type``, read offline by
    :func:`memcalc.inputs.hf_config.from_hf_config`); a path to a YAML/JSON file of
    ModelSpec fields (``name`` defaults to the file stem); a Hugging Face id ``ORG/NAME``
    (:func:`is_hf_id`, resolved by :func:`resolve_hf_id`).
    """
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"empty --model value {value!r}; give a preset name or a file path (see `memcalc models`)")
    value = value.strip()
    check_name(value, "--model")
    presets = list_presets()
    if value in presets or (value.lower() in presets and path_kind(Path(value)) != "file"):
        key = value if value in presets else value.lower()
        return load_preset(value), ModelSource("preset", value, preset=key)
    path = Path(value).expanduser()
    kind = path_kind(path)
    if kind in ("file", "other"):  # (a FIFO or a device: refused unread, its kind named)
        return _model_file(value, path), ModelSource("file", value, path=str(path))
    if kind == "dir":
        cfg = path / "config.json"
        if cfg.is_file():
            return _model_file(str(cfg), cfg), ModelSource("file", value, path=str(cfg))
        raise UserError(f"model directory {value} has no config.json")
    if is_hf_id(value):
        return resolve_hf_id(value)
    if _looks_like_path(value):
        raise UserError(f"model file not found: {value if len(value) <= 200 else shorten(value, 200)}")
    raise _unknown_preset(value)


def _model_file(value: str, path: Path) -> ModelSpec:
    """A Hugging Face config.json or a file of ModelSpec fields."""
    if not path.name.lower().endswith(_SPEC_SUFFIXES):
        raise UserError(f"model file {value} must be .json, .yaml or .yml")
    text = read_user_file(path, "model file")
    where = str(value)
    raw = parse_text(text, where)
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping (model fields or a Hugging Face config.json), "
                        f"not {type(raw).__name__}")
    if "model_type" in raw:
        from memcalc.inputs.hf_config import from_hf_config

        return from_hf_config(raw, _hf_name(raw, path), where=where)
    return model_from_dict(raw, where, default_name=path.stem)


def resolve_hf_id(repo_id: str) -> tuple[ModelSpec, ModelSource]:
    """The model a Hugging Face id names: (1) the preset whose ``hf_id`` it is (ignoring case);
    (2) its ``config.json`` in the local Hugging Face cache (offline); (3) its ``config.json``
    fetched from the Hub and saved into the cache (unless ``HF_HUB_OFFLINE=1``; see
    :mod:`memcalc.inputs.hf_hub`); otherwise one line saying how to pass the file."""
    from memcalc.inputs import hf_hub
    from memcalc.inputs.hf_config import from_hf_config

    preset = preset_for_hf_id(repo_id)
    if preset is not None:
        return load_preset(preset), ModelSource("preset-by-id", repo_id, preset=preset, hf_id=preset_hf_id(preset))
    name = repo_id.split("/", 1)[1]
    cached = hf_hub.cached_config(repo_id)
    if cached is not None:
        repo_id = hf_hub.repo_id_of(cached) or repo_id  # the cache's spelling, when it differs in case
        name = repo_id.split("/", 1)[1]
        where = str(cached)
        raw = parse_text(read_user_file(cached, "cached config"), where)  # at most 1 MiB, as any file named
        src = ModelSource("hf-cache", repo_id, hf_id=repo_id, path=where)
    else:
        got = hf_hub.fetch_config(repo_id)
        where = str(got.stored) if got.stored is not None else got.url
        try:
            text = got.data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"malformed config.json from {got.url}: {e}") from None
        raw = parse_text(text, f"config.json from {got.url}")  # the same bounds as a file
        src = ModelSource("hub", repo_id, hf_id=repo_id, path=str(got.stored) if got.stored else None, url=got.url,
                          note=got.not_stored)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UserError(f"{where} is not a Hugging Face model config (a JSON object with model_type)")
    return from_hf_config(raw, name, where=where), src
