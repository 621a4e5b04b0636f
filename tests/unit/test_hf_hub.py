"""``--model ORG/NAME``: a preset by its ``hf_id``, the local Hugging Face cache, the Hub (a fake opener: no network)."""

from __future__ import annotations

import email.message
import io
import json
import os
import shutil
import socket
import urllib.error
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.errors import UserError
from memcalc.engine.params import count_params
from memcalc.inputs import hf_hub
from memcalc.inputs.data_files import load_named
from memcalc.inputs.presets import (is_hf_id, list_presets, load_preset, model_from_dict, preset_for_hf_id,
                                    preset_hf_ids, resolve_model, resolve_model_source)

#: models--org--name/snapshots/abc/config.json, refs/main = abc
CACHE = Path(__file__).parent.parent / "fixtures" / "hf_cache"
TINY = json.loads((CACHE / "models--org--name" / "snapshots" / "abc" / "config.json").read_text())
# source: LlamaForCausalLM of the fixture: embed 256*64 + 2 * (attn q,o 2*64*64 + k,v 2*64*32 + mlp 3*64*128
#         + 2 norms 2*64) + final norm 64 + lm_head 256*64
TINY_PARAMS = 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64 + 256 * 64
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run(args):
    return CliRunner().invoke(app, args)


# ---------------------------------------------------------------- what counts as an id

# (value, is an id) -- source: huggingface_hub utils/_validators.py validate_repo_id, and the
# rule of issue 12: exactly one "/", no .json/.yaml/.yml suffix, not an existing path
ID_FORMS = [
    ("meta-llama/Llama-3.1-8B", True),
    ("org/name", True),
    ("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", True),
    ("microsoft/phi-1_5", True),
    ("gpt2", False),                 # a preset name (or a Hub id without org: not handled)
    ("a/b/c", False),                # two slashes: a path
    ("org/config.json", False),      # a spec-file suffix: a path
    ("org/model.YAML", False),
    ("./model", False),              # not an id's form
    ("~/model", False),
    ("/model", False),
    ("org--x/name", False),          # "--" is not allowed in ids
    ("org/na..me", False),           # nor ".."
    ("org/na me", False),
    ("o/" + "n" * 95, False),        # over 96 characters
]


@pytest.mark.parametrize("value,expected", ID_FORMS)
def test_what_is_an_id(value, expected):
    assert is_hf_id(value) is expected


def test_an_existing_path_is_not_an_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").write_text("{}")
    assert not is_hf_id("org/name")
    with pytest.raises(UserError, match="model file org/name must be .json, .yaml or .yml"):
        resolve_model("org/name")  # the path behaviour, as before


# ---------------------------------------------------------------- presets by id

# (id as typed, preset) -- source: each preset's header comment cites the config.json of this checkpoint
PRESET_IDS = [
    ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/llama-3.1-8b", "llama-3.1-8b"),  # ids are case-insensitive on the Hub
    ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
    ("mistralai/Mistral-7B-v0.1", "mistral-7b"),  # vocab 32000 and sliding_window 4096: v0.1 (v0.3: vocab 32768)
    ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),
    ("openai-community/gpt2", "gpt2"),
    ("microsoft/phi-1_5", "phi-1.5"),
    ("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "tinyllama-1.1b"),
]


@pytest.mark.parametrize("repo_id,preset", PRESET_IDS)
def test_preset_by_id(repo_id, preset):
    m, src = resolve_model_source(repo_id)
    assert m == load_preset(preset)
    assert (src.kind, src.preset) == ("preset-by-id", preset)


def test_preset_ids_are_valid_and_unique():
    ids = preset_hf_ids()
    assert all(hf_hub.is_repo_id(i) for i in ids.values()), ids
    lowered = [i.lower() for i in ids.values()]
    assert len(lowered) == len(set(lowered)), ids
    assert "deep-one-1.6b" not in ids  # no published checkpoint


@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
def test_hf_id_is_metadata_not_a_spec_field():
    for name in list_presets():
        raw = load_named("models", name)
        assert "hf_id" not in load_preset(name).model_dump()
        if "hf_id" in raw:
            assert preset_for_hf_id(raw["hf_id"]) == name
    with pytest.raises(UserError, match="hf_id in x.yaml must be a Hugging Face id ORG/NAME, got '3'"):
        model_from_dict({**load_named("models", "gpt2"), "hf_id": 3}, "x.yaml")


# ---------------------------------------------------------------- the local cache


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(CACHE))
    return CACHE


def test_cache_fixture(cache):
    m, src = resolve_model_source("org/name")
    assert count_params(m).total == TINY_PARAMS
    assert m.name == "name" and (m.n_layers, m.d_model, m.kv_heads) == (2, 64, 2)
    assert src.kind == "hf-cache" and src.path == str(cache / "models--org--name" / "snapshots" / "abc" / "config.json")


def test_cache_case_insensitive(cache):
    _, src = resolve_model_source("ORG/Name")
    assert src.kind == "hf-cache" and src.hf_id == "org/name"  # the cache's spelling


@pytest.mark.parametrize("text,message", [
    # source: issue 32 (files in the Hugging Face cache skipped the 1 MiB / depth bounds)
    ('{"model_type": "llama", "pad": "' + "x" * 2**21 + '"}', "is larger than 1 MiB"),
    ('{"model_type": "llama", "a": ' + "[" * 70 + "]" * 70 + "}", "nests deeper than 64 levels"),
])
def test_a_cached_config_is_read_within_bounds(tmp_path, monkeypatch, text, message):
    shutil.copytree(CACHE, tmp_path / "hub")
    (tmp_path / "hub" / "models--org--name" / "snapshots" / "abc" / "config.json").write_text(text)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError, match=message):
        resolve_model_source("org/name")


@pytest.mark.slow  # about 0.5 s: the quick lane stays under 30 s
def test_cache_under_hf_home(tmp_path, monkeypatch):
    shutil.copytree(CACHE, tmp_path / "hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hf_hub.hub_cache() == tmp_path / "hub"
    assert resolve_model_source("org/name")[1].path == str(tmp_path / "hub" / "models--org--name" / "snapshots"
                                                          / "abc" / "config.json")


# (variables set, the cache folder relative to tmp) -- source: huggingface_hub constants.py HF_HUB_CACHE
CACHE_VARS = [
    ({"HF_HUB_CACHE": "a", "HUGGINGFACE_HUB_CACHE": "b", "HF_HOME": "c"}, "a"),
    ({"HUGGINGFACE_HUB_CACHE": "b", "HF_HOME": "c"}, "b"),
    ({"HF_HOME": "c", "XDG_CACHE_HOME": "d"}, "c/hub"),
    ({"XDG_CACHE_HOME": "d"}, "d/huggingface/hub"),
    ({}, "home/.cache/huggingface/hub"),
]


@pytest.mark.parametrize("env,expected", CACHE_VARS)
def test_cache_folder_precedence(tmp_path, monkeypatch, env, expected):
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for k, v in env.items():
        monkeypatch.setenv(k, str(tmp_path / v))
    assert hf_hub.hub_cache() == tmp_path / expected


def _snapshot(repo: Path, rev: str, layers: int, mtime: float) -> None:
    cfg = repo / "snapshots" / rev / "config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps({**TINY, "num_hidden_layers": layers}))
    os.utime(cfg, (mtime, mtime))


def test_refs_main_picks_the_revision_else_the_newest(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--two"
    _snapshot(repo, "old", 3, 1_000_000)
    _snapshot(repo, "new", 5, 2_000_000)
    assert resolve_model("org/two").n_layers == 5  # no refs/main: the newest snapshot
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("old\n")
    assert resolve_model("org/two").n_layers == 3  # refs/main names the revision


# ---------------------------------------------------------------- the Hub (a fake opener)


class _Resp(io.BytesIO):
    def __init__(self, body: bytes, headers: dict[str, str]):
        super().__init__(body)
        self.headers = headers


def _http_error(code: int, error_code: str | None = None) -> urllib.error.HTTPError:
    h = email.message.Message()
    if error_code:
        h["X-Error-Code"] = error_code
    return urllib.error.HTTPError("https://huggingface.co/x", code, "Unauthorized" if code == 401 else "Error", h, None)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Online, an empty cache in tmp, and an opener that records each request and answers ``hub.answer``."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE")

    class Hub:
        answer: object = _Resp(json.dumps(TINY).encode(), {"X-Repo-Commit": COMMIT, "ETag": '"abc123"'})
        requests: list = []

        def __call__(self, req, timeout):
            self.requests.append((req, timeout))
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

    h = Hub()
    monkeypatch.setattr(hf_hub, "urlopen", h)
    return h


def test_fetch_then_offline(hub, tmp_path):
    m, src = resolve_model_source("org/fetched")
    (req, timeout), = hub.requests
    assert req.full_url == "https://huggingface.co/org/fetched/resolve/main/config.json"
    assert timeout == hf_hub.FETCH_TIMEOUT_S and req.get_header("Authorization") is None
    assert count_params(m).total == TINY_PARAMS and m.name == "fetched"
    repo = tmp_path / "cache" / "models--org--fetched"
    cfg = repo / "snapshots" / COMMIT / "config.json"
    assert src.kind == "hub" and src.path == str(cfg) and src.url == req.full_url
    assert (repo / "refs" / "main").read_text() == COMMIT
    assert json.loads(cfg.read_text()) == TINY  # a link into blobs/ (huggingface_hub's layout)
    assert cfg.is_symlink() and cfg.resolve().parent == (repo / "blobs").resolve()
    # the next run finds it in the cache and does not ask the Hub
    hub.answer = AssertionError("the Hub was asked again")
    assert resolve_model_source("org/fetched")[1].kind == "hf-cache"


def test_fetch_sends_token_and_uses_endpoint(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example/")
    resolve_model("org/gated")
    (req, _), = hub.requests
    assert req.full_url == "https://mirror.example/org/gated/resolve/main/config.json"
    assert req.get_header("Authorization") == "Bearer hf_secret"


def test_token_from_login_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "token"))
    (tmp_path / "token").write_text("hf_fromfile\n")
    assert hf_hub.token() == "hf_fromfile"


def test_read_only_cache_still_works(hub, tmp_path):
    (tmp_path / "cache").write_text("a file, not a folder")  # mkdir under it fails
    m, src = resolve_model_source("org/fetched")
    assert count_params(m).total == TINY_PARAMS and src.kind == "hub" and src.path is None
    assert "(not saved: the cache " in src.describe() and "is not writable" in src.note


def test_no_commit_header_is_not_saved(hub, tmp_path):
    hub.answer = _Resp(json.dumps(TINY).encode(), {})
    src = resolve_model_source("org/fetched")[1]
    assert src.path is None and src.note == "the answer had no X-Repo-Commit header"
    assert not (tmp_path / "cache").exists()


# (what the Hub does, message) -- source: huggingface_hub utils/_http.py hf_raise_for_status (X-Error-Code)
HUB_FAILURES = [
    (_http_error(404), "and the Hub has no model org/x (HTTP 404)"),
    (_http_error(401, "RepoNotFound"), "and the Hub has no model org/x (HTTP 401) (or it is private"),
    (_http_error(401), "org/x is gated or private on the Hugging Face Hub (HTTP 401): accept its license"),
    (_http_error(403, "GatedRepo"), "is gated or private on the Hugging Face Hub (HTTP 403)"),
    (_http_error(404, "EntryNotFound"), "the Hugging Face repo has no config.json (HTTP 404)"),
    (_http_error(503), "and the Hub answered HTTP 503"),
    (urllib.error.URLError(socket.timeout("timed out")), "could not be reached at https://huggingface.co "
                                                         "(no answer within 10 s)"),
    (TimeoutError("timed out"), "(no answer within 10 s)"),
    (urllib.error.URLError(OSError("Name or service not known")), "(Name or service not known)"),
    (_Resp(b"<html>", {"X-Repo-Commit": COMMIT}), "malformed config.json from https://huggingface.co/org/x"),
    (_Resp(b'{"hidden_size": 8}', {}), "is not a Hugging Face model config"),
    (_Resp(b"x" * (hf_hub.MAX_CONFIG_BYTES + 1), {}), "the Hub's config.json is over 4 MiB"),
]


@pytest.mark.parametrize("answer,message", HUB_FAILURES)
def test_hub_failures_are_one_line(hub, answer, message):
    hub.answer = answer
    with pytest.raises(UserError) as e:
        resolve_model("org/x")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gated_with_a_token_says_no_access(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub.answer = _http_error(403, "GatedRepo")
    with pytest.raises(UserError, match="your token has no access to it"):
        resolve_model("org/x")


@pytest.mark.parametrize("value,offline", [("1", True), ("ON", True), ("yes", True), ("true", True),
                                           ("0", False), ("", False)])  # source: huggingface_hub constants._is_true
def test_offline_never_asks(hub, monkeypatch, value, offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    hub.answer = _http_error(404)
    with pytest.raises(UserError) as e:
        resolve_model("org/x")
    assert ("HF_HUB_OFFLINE is set, so the Hub was not asked" in str(e.value)) is offline
    assert len(hub.requests) == (0 if offline else 1)


# ---------------------------------------------------------------- the command line

HOW = "pass --model path/to/config.json"

# (args, extra environment, exit code, text in the output) -- the session runs offline with an empty cache
CLI = [
    (["estimate", "--model", "openai-community/GPT2", "--seq", "256"], {}, 0, "preset gpt2 (Hugging Face id openai-community/gpt2)"),
    (["estimate", "--model", "org/name", "--seq", "128"], {"HF_HUB_CACHE": str(CACHE)}, 0,
     "config.json in the Hugging Face cache"),
    (["estimate", "--model", "org/missing"], {"HF_HUB_CACHE": str(CACHE)}, 2, "HF_HUB_OFFLINE is set"),
    (["estimate", "--model", "org/missing"], {}, 2, HOW),
    (["plan", "--model", "org/missing", "--gpu", "rtx-4090"], {}, 2, "--model org/missing: no preset has this Hugging Face id"),
    (["estimate", "--model", "nowhere/model.yaml"], {}, 2, "model file not found: nowhere/model.yaml"),  # a path, as before
    (["estimate", "--model", "a/b/c"], {}, 2, "model file not found: a/b/c"),
]


@pytest.mark.parametrize("args,env,code,message", CLI)
def test_cli(monkeypatch, args, env, code, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = run(args)
    assert r.exit_code == code, r.output
    if code == 0:
        assert message in " ".join(r.stdout.replace("│", " ").split()), r.stdout
    else:
        assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.output, r.stderr


def test_cli_json_says_where_from(cache):
    doc = json.loads(run(["estimate", "--model", "org/name", "--seq", "128", "--json"]).stdout)
    assert doc["inputs"]["model_source"] == {"kind": "hf-cache", "value": "org/name", "hf_id": "org/name",
                                             "path": str(cache / "models--org--name" / "snapshots" / "abc" / "config.json")}
    doc = json.loads(run(["estimate", "--model", "gpt2", "--seq", "128", "--json"]).stdout)
    assert "model_source" not in doc["inputs"]  # a preset by name: the document as before


def test_plan_notes_the_source(cache):
    from memcalc.plan.options import plan_model  # what `memcalc plan --model` calls (the plan itself is slow)

    assert plan_model("openai-community/gpt2", None)[1] == ["model from preset gpt2 (Hugging Face id openai-community/gpt2)"]
    assert plan_model("org/name", None)[1][0].startswith("model from org/name: config.json in the Hugging Face cache")
    assert plan_model("gpt2", None)[1] == []  # a preset by name: no note, as before


@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
def test_cli_models_lists_ids():
    rows = json.loads(run(["models", "--json"]).stdout)
    ids = {r["name"]: r["hf_id"] for r in rows}
    assert ids["llama-3.1-8b"] == "meta-llama/Llama-3.1-8B" and ids["deep-one-1.6b"] is None
    out = CliRunner().invoke(app, ["models"], env={"COLUMNS": "200"}).stdout
    assert "Hugging Face id" in out and "meta-llama/Llama-2-7b-hf" in out


@pytest.mark.slow  # about 0.5 s: the quick lane stays under 30 s
def test_real_urllib_against_a_local_hub(tmp_path, monkeypatch):
    """The real opener, against a Hub stand-in on 127.0.0.1 (HF_ENDPOINT): headers, 401 GatedRepo, 404."""
    import http.server
    import threading

    body = json.dumps(TINY).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/org/served/resolve/main/config.json":
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + "b" * 40 + '"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path.startswith("/org/gated/"):
                self.send_response(401)
                self.send_header("X-Error-Code", "GatedRepo")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
        monkeypatch.delenv("HF_HUB_OFFLINE")
        for name in ("no_proxy", "NO_PROXY"):  # a proxy in the environment must not see 127.0.0.1
            monkeypatch.setenv(name, "127.0.0.1,localhost")
        m, src = resolve_model_source("org/served")
        assert count_params(m).total == TINY_PARAMS and src.kind == "hub"
        assert (tmp_path / "models--org--served" / "blobs" / ("b" * 40)).read_bytes() == body
        with pytest.raises(UserError, match=r"org/gated is gated or private on the Hugging Face Hub \(HTTP 401\)"):
            resolve_model("org/gated")
        with pytest.raises(UserError, match=r"the Hub has no model org/nothing \(HTTP 404\)"):
            resolve_model("org/nothing")
    finally:
        server.shutdown()
        server.server_close()
