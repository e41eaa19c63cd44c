"""The committed reproduction tables are what the documented commands write.

The commands are read from the pages themselves: every fenced code block that follows a
`<!-- reproduce: quick -->` or `<!-- reproduce: full -->` comment is run line by line
(`tldp ...` as `python -m tldp_cli ...`, `python docs/...` with this interpreter) from the
repository, with every path under docs/ (except the scripts) moved into tmp_path. Then each
CSV and JSON file of every `--out` folder must equal the committed one: same rows, same
values (parsed, compared exactly), apart from timings, the tool version and file paths.

The quick blocks run always (about a minute in all on 2 cores); the full ones take minutes
each and run only with TLDP_FULL_REPRODUCTION=1.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = ("reproduction.md", "type2.md", "type3.md")
IGNORED_KEYS = {"seconds", "tool", "original", "path"}  # timings, the version, where files were


def documented_blocks() -> list[tuple[str, str, list[str]]]:
    """(page, quick|full, commands) for every marked code block of PAGES."""
    blocks = []
    for page in PAGES:
        text = (REPO / "docs" / page).read_text(encoding="utf-8")
        for match in re.finditer(r"<!-- reproduce: (quick|full) -->\s*\n```sh\n(.*?)\n```", text, re.S):
            joined = match.group(2).replace("\\\n", " ")
            commands = [line.strip() for line in joined.splitlines()
                        if line.strip() and not line.strip().startswith("#")]
            blocks.append((page, match.group(1), commands))
    return blocks


BLOCKS = documented_blocks()


def _argv(command: str, tmp_path: Path) -> tuple[list[str], list[Path]]:
    """The command's argv with docs/ paths moved to tmp_path, and its --out folders."""
    words = shlex.split(command, comments=True)
    moved = []
    for word in words:
        if word.startswith("docs/") and not word.endswith(".py"):
            (tmp_path / word).parent.mkdir(parents=True, exist_ok=True)
            word = str(tmp_path / word)
        moved.append(word)
    outs = [Path(words[i + 1]) for i, w in enumerate(words[:-1]) if w == "--out"]
    if words[0] == "tldp":
        return [sys.executable, "-m", "tldp_cli", *moved[1:]], outs
    assert words[0] == "python" and words[1].startswith("docs/"), command
    return [sys.executable, *moved[1:]], outs


def _parsed(text: str) -> object:
    try:
        return float(text)
    except ValueError:
        return text


def _csv(path: Path) -> list[list[object]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [[_parsed(cell) for cell in row] for row in csv.reader(f)]


def _stripped(value: object) -> object:
    if isinstance(value, dict):
        return {k: _stripped(v) for k, v in value.items() if k not in IGNORED_KEYS}
    if isinstance(value, list):
        return [_stripped(v) for v in value]
    return value


def _tables(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".csv", ".json") and ".mask." not in p.name)


def test_every_reproduction_page_has_a_checked_quick_block():
    assert {page for page, kind, _ in BLOCKS if kind == "quick"} == set(PAGES)


@pytest.mark.slow
@pytest.mark.parametrize("page, kind, commands", BLOCKS,
                         ids=[f"{page}-{kind}-{i}" for i, (page, kind, _) in enumerate(BLOCKS)])
def test_documented_commands_reproduce_the_committed_tables(page, kind, commands, tmp_path):
    if kind == "full" and not os.environ.get("TLDP_FULL_REPRODUCTION"):
        pytest.skip("the full runs take minutes: set TLDP_FULL_REPRODUCTION=1")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TLDP_SEED", None)
    checked = 0
    for command in commands:
        argv, outs = _argv(command, tmp_path)
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        for out in outs:
            if out.suffix:  # a file made for a later command (a weight mask), not a table folder
                continue
            committed = REPO / out
            assert committed.is_dir(), f"{page}: {out} is not committed"
            tables = _tables(committed)
            assert tables, f"{committed}: no CSV or JSON table"
            for table in tables:
                rerun = tmp_path / out / table.name
                assert rerun.is_file(), f"{command} did not write {table.name}"
                if table.suffix == ".csv":
                    assert _csv(rerun) == _csv(table), f"{out / table.name} differs from a rerun"
                else:
                    assert _stripped(json.loads(rerun.read_text())) == \
                        _stripped(json.loads(table.read_text())), f"{out / table.name} differs from a rerun"
                checked += 1
    assert checked, f"{page}: the block writes no table that is checked"
