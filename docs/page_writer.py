"""The command line the generated pages share: `python docs/make_*.py` writes the page
from the code, `--check` exits 1 if the page on disk differs (tests/test_docs.py checks
each page is current)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def check_or_write(argv: list[str] | None, description: str, page: Path, repo: Path, script: str,
                   render: Callable[[str | None], str]) -> int:
    """Write render(the page's current text, None if absent) to `page`, or with --check
    compare it and exit 1 when it differs; `script` is what to run to regenerate it."""
    name = page.relative_to(repo)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true",
                        help=f"do not write; exit 1 if {name} differs from what would be written")
    args = parser.parse_args(argv)
    current = page.read_text(encoding="utf-8") if page.exists() else None
    text = render(current)
    if args.check:
        if current != text:
            print(f"{name} is stale: run python {script}", file=sys.stderr)
            return 1
        print(f"{name} is current", file=sys.stderr)
        return 0
    page.write_text(text, encoding="utf-8")
    print(f"wrote {name}", file=sys.stderr)
    return 0


def between_markers(page: str | None, begin: str, end: str, lines: list[str], name: object) -> str:
    """`page` (the text of the page `name`) with what stands between its two marker comments
    replaced by `lines`."""
    if page is None:
        raise SystemExit(f"{name} is missing")
    if page.count(begin) != 1 or page.count(end) != 1:
        raise SystemExit(f"{name}: needs the marker comments, once each:\n{begin}\n{end}")
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    return "\n".join([head + begin, *lines, end]) + tail
