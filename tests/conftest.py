"""Shared helpers: small model specs that estimate in milliseconds."""

from __future__ import annotations

import pytest

from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec

_WHOLE_FILE_SLOW = "\npytestmark = pytest.mark.slow"


def _build_each_app_once() -> None:
    """typer's ``CliRunner.invoke(app, ...)`` rebuilds the click command tree from the Typer app on every
    call (typer/testing.py ``invoke`` -> typer.main.get_command: every command's signature and type hints
    evaluated again, 0.1-0.3 s a call, more than most commands' own run). The tree depends only on the
    app's registered commands and their module-level ``Annotated`` options, fixed at import, so each app's
    tree is built once per test process and reused; each invocation still makes its own click context
    (click's ``Command.main``). ``memcalc`` itself builds it once per process (memcalc/cli/__init__.py main)."""
    import typer.testing

    real = typer.testing._get_command
    built: dict[int, tuple[object, object]] = {}  # id(app) -> (app, its command); the app kept alive

    def get_command(app):
        hit = built.get(id(app))
        if hit is None or hit[0] is not app:
            hit = built[id(app)] = (app, real(app))
        return hit[1]

    typer.testing._get_command = get_command  # type: ignore[attr-defined]


_build_each_app_once()


def pytest_ignore_collect(collection_path, config):
    """The quick lane (``-m "not slow"``) does not even import a test file marked slow as a whole
    (``pytestmark = pytest.mark.slow``): those are the validator's files, and importing them
    imports torch (several seconds) for tests that would be deselected anyway."""
    if (config.getoption("markexpr") or "").replace(" ", "") != "notslow" or collection_path.suffix != ".py":
        return None
    try:
        text = collection_path.read_text()
    except OSError:
        return None
    return True if _WHOLE_FILE_SLOW in text else None


def tiny_llama(**kw) -> ModelSpec:
    base = dict(name="tiny-llama", n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=688,
                vocab_size=1000, max_seq_len=4096)
    base.update(kw)
    return ModelSpec(**base)


def experiment(model: ModelSpec | None = None, **training) -> ExperimentSpec:
    return ExperimentSpec(name="test", model=model or tiny_llama(), training=TrainingSpec(**training))


@pytest.fixture
def tiny():
    return tiny_llama()


def small_config(name: str, layers: int, **training) -> ExperimentSpec:
    """A shipped reference config with fewer layers (and training overrides)."""
    from memcalc.inputs.configs import load_config

    exp = load_config(name)
    return exp.model_copy(update={"model": exp.model.model_copy(update={"n_layers": layers}),
                                  "training": exp.training.model_copy(update=training)})


def preset_exp(model: str, layers: int, budget: float, **kw) -> ExperimentSpec:
    """A preset under torch.compile at ``budget``, batch 2 x seq 256, with fewer layers."""
    from memcalc.inputs.resolve import Options, resolve

    exp = resolve(Options(model=model, batch=2, seq=256, memory_budget=budget, **{"framework": "plain", **kw})).exp
    return exp.model_copy(update={"model": exp.model.model_copy(update={"n_layers": layers})})


def cli_run(args: list[str]):
    """``memcalc ARGS`` in-process (typer's runner), stderr apart."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    return CliRunner().invoke(app, args, prog_name="memcalc")


def one_line_error(r, code: int, message: str) -> None:
    """A bad input's answer: exit ``code``, one line on stderr naming ``message``, no traceback."""
    assert r.exit_code == code, r.output
    err = r.stderr
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("memcalc: error: "), err
    assert "Traceback" not in r.output


class _Stop(Exception):
    """Raised by :func:`resolved`'s spy to stop the command once its inputs are resolved."""


def resolved_run(args: list[str], monkeypatch):
    """``memcalc ARGS`` stopped once the estimate's inputs are resolved (the CLI's own parsing, without
    running the estimate): (the CliRunner result, the Resolved, or None when it stopped before)."""
    from typer.testing import CliRunner

    import memcalc.inputs.resolve as mod
    from memcalc.cli import app

    got: list = []
    real = mod.resolve

    def spy(o):
        got.append(real(o))
        raise _Stop

    monkeypatch.setattr(mod, "resolve", spy)
    r = CliRunner().invoke(app, args)
    monkeypatch.setattr(mod, "resolve", real)
    return r, (got[0] if got else None)


def resolved(args: list[str], monkeypatch):
    """What `memcalc estimate ARGS` resolves (the CLI's own parsing), without running the estimate."""
    r, res = resolved_run(["estimate", *args], monkeypatch)
    assert res is not None, r.output
    return res


@pytest.fixture(scope="session", autouse=True)
def _no_hugging_face_hub(tmp_path_factory):
    """No test reaches the Hugging Face Hub or reads the developer's cache: ``--model ORG/NAME``
    sees an empty cache and offline mode (tests of the cache and the fetch set their own)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf_hub_cache")))
        mp.setenv("HF_TOKEN_PATH", str(tmp_path_factory.mktemp("hf_home") / "token"))  # no such file: no token
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_ENDPOINT"):
            mp.delenv(name, raising=False)
        yield
