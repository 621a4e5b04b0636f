"""pytest imports test files by basename (rootdir mode, no packages): two test files with one name
in tests/unit and tests/trace stop collection in a clean checkout ("import file mismatch")."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_unique():
    names: dict[str, list[str]] = {}
    for f in TESTS.rglob("test_*.py"):
        names.setdefault(f.name, []).append(str(f.relative_to(TESTS)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
