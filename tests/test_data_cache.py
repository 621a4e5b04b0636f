"""``data/_parsed.json``: the shipped YAML files stored parsed, so that an estimate imports no YAML
parser (issue 15). It must hold exactly what the YAML files parse to; a shipped file whose text
differs from the stored text is parsed instead (same answer, slower)."""

from __future__ import annotations

import json
from functools import lru_cache

import pytest

from memcalc.inputs import data_files
from memcalc.inputs.data_files import PARSED_FILE, data_root, load_file, load_named, parse_text
from memcalc.inputs.data_files import parsed_document as _parsed_document

REGENERATE = "python -m memcalc.inputs.data_files"
parsed_document = lru_cache(maxsize=1)(_parsed_document)  # every shipped YAML file parsed: once per session


def test_the_parsed_file_is_what_the_yaml_files_parse_to():
    # a shipped YAML file edited (or added) without regenerating fails here
    stored = json.loads((data_root() / PARSED_FILE).read_text(encoding="utf-8"))
    want = parsed_document()
    # json text: also tells true from 1 and 1.0 from 1, which == does not
    assert sorted(stored["files"]) == sorted(want["files"]), f"data/{PARSED_FILE} is stale: run `{REGENERATE}`"
    for path, entry in want["files"].items():
        assert json.dumps(stored["files"][path], sort_keys=True) == json.dumps(entry, sort_keys=True), \
            f"data/{PARSED_FILE} is stale for {path}: run `{REGENERATE}`"


def test_every_shipped_yaml_file_is_stored():
    # source: the shipped files are plain mappings, lists, strings and numbers: all of them fit JSON
    assert len(parsed_document()["files"]) == len(data_files.shipped_yaml()) > 40


@pytest.mark.parametrize("load,args,where", [
    (load_file, ("gpus.yaml",), "gpus.yaml"),
    (load_named, ("models", "llama-3.1-8b"), "models/llama-3.1-8b.yaml"),
    (load_named, ("configs", "control"), "configs/control.yaml"),
])
def test_a_stored_file_reads_as_its_parse_and_a_changed_one_is_parsed(monkeypatch, load, args, where):
    text = data_root().joinpath(*where.split("/")).read_text(encoding="utf-8")
    parsed = parse_text(text, where)
    got = load(*args)
    assert got == parsed
    got.clear()  # each read is a fresh copy: a caller's change does not reach the next one
    assert load(*args) == parsed
    # the stored entry no longer matches the file's text: the file is parsed, the stored data unused
    monkeypatch.setattr(data_files, "_parsed", lambda: {where: (text + "# edited\n", {"stale": True})})
    assert load(*args) == parsed
    monkeypatch.setattr(data_files, "_parsed", lambda: {where: (text, {"stored": True})})
    assert load(*args) == {"stored": True}  # (the check above can fail: a matching entry is used)


def test_data_root_is_what_importlib_resources_gives():
    # data_root() skips importlib.resources for a package loaded from a folder; it must name the
    # same root (the same type and path), listing the same files
    from importlib import resources

    want = resources.files("memcalc.data")
    got = data_root()
    assert type(got) is type(want) and str(got) == str(want)
    assert sorted(e.name for e in got.iterdir()) == sorted(e.name for e in want.iterdir())
