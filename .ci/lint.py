"""ruff and mypy over the repository, against baselines that only shrink.

    python .ci/lint.py                   # fail on a finding above its baseline, or below it
    python .ci/lint.py --update          # write the baselines; a count that grew stays (and fails)
    python .ci/lint.py --update --allow-growth   # ... accepting growth (say why in the commit)
    python .ci/lint.py --only ruff       # one tool

A finding is keyed by (file, rule code, message with line numbers and E501's length taken out) and counted, so
moving code inside a file changes nothing, and fixing one finding makes its count go down: the
check then fails too, asking for `--update` so that the baseline follows the fix and the fixed
finding cannot come back. The settings (rules, line length, pydantic plugin) are pyproject.toml's.

mypy cannot map `validate/` and `data/` to `memcalc.validate` / `memcalc.data` the way
pyproject's package-dir does, so it runs on a tree of symbolic links under .mypy_cache/tree
(memcalc/'s entries, plus validate -> memcalc/validate, data -> memcalc/data); its findings are
mapped back to the real paths.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
BASELINES = {"ruff": ROOT / ".ci" / "ruff-baseline.json", "mypy": ROOT / ".ci" / "mypy-baseline.json"}
CACHE = ROOT / ".mypy_cache"
#: folders installed under memcalc by pyproject's package-dir: (folder, its path under the tree)
MAPPED = (("validate", "memcalc/validate/"), ("data", "memcalc/data/"))
LINE_NUMBER = re.compile(r"\b(line|lines) \d+(-\d+)?")
LINE_LENGTH = re.compile(r"^Line too long \(\d+ > ")  # E501: a long line edited stays the same finding

Key = tuple[str, str, str]  # (file, code, message)
Finding = tuple[Key, int]  # and its line


def _key(file: str, code: str, message: str) -> Key:
    return file, code, LINE_LENGTH.sub("Line too long (N > ", LINE_NUMBER.sub(r"\1 N", message))


def ruff() -> list[Finding]:
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "json", "--no-fix", "--exit-zero", "."],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    found = []
    for item in json.loads(run.stdout):
        file = Path(item["filename"]).resolve().relative_to(ROOT).as_posix()
        found.append((_key(file, item["code"] or "syntax", item["message"]), item["location"]["row"]))
    return found


def _mypy_tree() -> Path:
    tree = CACHE / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "memcalc").mkdir(parents=True)
    for entry in (ROOT / "memcalc").iterdir():
        if entry.name != "__pycache__":
            (tree / "memcalc" / entry.name).symlink_to(entry)
    for folder, under in MAPPED:
        (tree / under.rstrip("/")).symlink_to(ROOT / folder)
    return tree


def mypy() -> list[Finding]:
    tree = _mypy_tree()
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(CACHE), "--output", "json", "memcalc"],
        cwd=tree, capture_output=True, text=True,
    )
    if run.returncode not in (0, 1):
        sys.exit(f"mypy failed to run:\n{run.stdout}{run.stderr}")
    found = []
    for line in run.stdout.splitlines():
        item = json.loads(line)
        if item["severity"] != "error":
            continue
        file = item["file"]
        for folder, under in MAPPED:
            if file.startswith(under):
                file = folder + "/" + file[len(under):]
        found.append((_key(file, item["code"] or "misc", item["message"]), item["line"]))
    return found


def load(path: Path) -> Counter[Key]:
    if not path.exists():
        return Counter()
    stored = json.loads(path.read_text())
    return Counter({
        (file, *entry.split(": ", 1)): count  # type: ignore[misc]
        for file, entries in stored.items() for entry, count in entries.items()
    })


def save(path: Path, counts: Counter[Key]) -> None:
    nested: dict[str, dict[str, int]] = {}
    for (file, code, message), count in sorted(counts.items()):
        nested.setdefault(file, {})[f"{code}: {message}"] = count
    path.write_text(json.dumps(nested, indent=1, sort_keys=True) + "\n")


def _show(key: Key, count: int, lines: Optional[list[int]] = None) -> str:
    file, code, message = key
    where = f":{','.join(map(str, sorted(lines)))}" if lines else ""
    return f"  {file}{where}: {code}: {message}" + (f"  (x{count})" if count != 1 else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--update", action="store_true", help="write the baselines (never raising a count)")
    parser.add_argument("--allow-growth", action="store_true", help="with --update: accept counts that grew")
    parser.add_argument("--only", choices=sorted(BASELINES), help="run one tool")
    args = parser.parse_args(argv)
    tools = {"ruff": ruff, "mypy": mypy}
    failed = False
    for name in [args.only] if args.only else list(tools):
        findings, base = tools[name](), load(BASELINES[name])
        now = Counter(key for key, _ in findings)
        lines: dict[Key, list[int]] = {}
        for key, line in findings:
            lines.setdefault(key, []).append(line)
        grew = {key: now[key] - base[key] for key in now if now[key] > base[key]}
        shrank = {key: base[key] - now[key] for key in base if now[key] < base[key]}
        print(f"{name}: {sum(now.values())} findings, baseline {sum(base.values())}")
        if grew:
            print(f"{name}: new findings (above .ci/{BASELINES[name].name}):")
            print("\n".join(_show(key, n, lines[key]) for key, n in sorted(grew.items())))
        if args.update:
            if grew and not args.allow_growth:
                print(f"{name}: counts that grew are kept at their baseline (fix them, or --allow-growth)")
                now = Counter({key: min(count, now[key]) for key, count in base.items() if now[key]})
                failed = True
            if now != base:
                save(BASELINES[name], now)
                print(f"{name}: wrote .ci/{BASELINES[name].name}")
            continue
        if shrank:
            print(f"{name}: fixed, so the baseline must shrink: run `python .ci/lint.py --update`:")
            print("\n".join(_show(key, n) for key, n in sorted(shrank.items())))
        failed |= bool(grew or shrank)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
