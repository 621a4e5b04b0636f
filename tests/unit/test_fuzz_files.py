"""Hostile values in every key of the files users hand memcalc (issue 32: 58 tracebacks from 16 code sites
in the recipe, DeepSpeed and Hugging Face config readers).

Each example takes one shipped fixture (a published recipe, a DeepSpeed config, a config.json), puts one
hostile value (a list, a dict, ``"²"``, a 4,000-digit integer, a 300-digit float, ...) into one of its
keys, and runs ``memcalc estimate`` on it up to the estimate itself (the readers and the resolver are
what is fuzzed; the engine is fed only validated specs). The answer is a resolved setup or one error
line with exit code 2; never a traceback. The quick lane draws a few examples; the slow lane many.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import _Stop, cli_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIX = Path(__file__).parent.parent / "fixtures"
# (fixture, how it is passed)
FILES = ([(f, "--recipe") for f in sorted((FIX / "recipes").glob("*.y*ml"))]
         + [(f, "--deepspeed") for f in sorted((FIX / "deepspeed").glob("*.json"))]
         + [(f, "--model") for f in sorted((FIX / "hf").glob("*.json"))])
# source: issue 32's sweep (the values that raised), plus the plain wrong types
HOSTILE = [[1], {"a": 1}, "²", int("9" * 4000), float("1" + "0" * 300), "1e400", -1, 0, None, True, "", "nan", 1.5,
           "x" * 300, [], {}, "-1", 2**63, "٣"]


def _leaves(doc, prefix=()):
    """Paths of the leaves (dict keys; the items of lists of dicts)."""
    if isinstance(doc, dict) and doc:
        for k, v in doc.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(doc, list) and doc and all(isinstance(x, dict) for x in doc):
        for i, v in enumerate(doc):
            yield from _leaves(v, (*prefix, i))
    elif prefix:
        yield prefix


@functools.cache
def _load(path: Path):
    """A fixture's document, parsed once (callers copy it before changing it: ``_with``)."""
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


CASES = [(f, flag, leaf) for f, flag in FILES for leaf in _leaves(_load(f))]


def _with(doc, leaf, value):
    doc = copy.deepcopy(doc)
    cur = doc
    for k in leaf[:-1]:
        cur = cur[k]
    cur[leaf[-1]] = value
    return doc


def _write(tmp: Path, source: Path, flag: str, doc) -> Path:
    text = json.dumps(doc) if source.suffix == ".json" else yaml.safe_dump(doc)
    out = (tmp / "m" / "config.json") if flag == "--model" else tmp / source.name
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    return out


def _check(tmp: Path, case, value) -> None:
    source, flag, leaf = case
    path = _write(tmp, source, flag, _with(_load(source), leaf, value))
    args = ["estimate", flag, str(path), *(["--model", "gpt2", "--gpus", "2"] if flag == "--deepspeed" else [])]
    with mock.patch("memcalc.estimate.peak.estimate", side_effect=_Stop):  # the readers, not the engine
        r = cli_run(args)
    where = f"{source.name}:{'.'.join(map(str, leaf))} = {str(value)[:30]!r}"
    if isinstance(r.exception, _Stop):
        return  # resolved: a setup the engine accepts
    assert r.exception is None or isinstance(r.exception, SystemExit), (where, r.exception)
    assert r.exit_code == 2, (where, r.output)
    assert r.stderr.startswith("memcalc: error: ") and r.stderr.count("\n") == 1, (where, r.stderr)
    assert len(r.stderr) < 1000, where  # a 4,000-digit value is not echoed whole


CASE = st.sampled_from(CASES)
VALUE = st.sampled_from(HOSTILE)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=CASE, value=VALUE)
def test_a_hostile_value_in_any_key_is_an_answer_or_one_line(tmp_path_factory, case, value):
    _check(tmp_path_factory.mktemp("f"), case, value)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=CASE, value=VALUE)
def test_many_hostile_values_are_answers_or_one_line(tmp_path_factory, case, value):
    _check(tmp_path_factory.mktemp("f"), case, value)
