"""Draw docs/architecture.md's layer diagrams from the code: one per layers contract.

    python docs/make_architecture_graph.py           # redraw them in docs/architecture.md
    python docs/make_architecture_graph.py --check   # exit 1 if the drawings are stale

Each layers contract of import-linter in pyproject.toml is one Mermaid flowchart: its
layers from the top, and an arrow from one layer to another wherever a module of the
first imports a module of the second (imports inside functions too), labelled with the
number of importing modules. The contracts say which arrows may exist (only down, none
between the independent modules of one layer); the drawing shows which do, and
tests/test_docs.py checks it is current. An arrow that ran up would be drawn as it is
(import-linter fails the tests on it).
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

from page_writer import between_markers, check_or_write  # beside this script

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "architecture.md"
PACKAGE = "tldp_cli"
BEGIN = "<!-- layers: drawn by docs/make_architecture_graph.py from the code; do not edit by hand -->"
END = "<!-- end of the drawn layers -->"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    found = {}
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b`: the module a.b when there is one, else a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def contracts() -> list[tuple[str, list[list[str]]]]:
    """(name, layers from the top, each a list of module names) of every layers contract."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return [(c["name"], [[m.strip() for m in layer.split("|")] for layer in c["layers"]])
            for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]


def _member(module: str, layers: list[list[str]]) -> str | None:
    """The contract's module that `module` is (or is inside), if any."""
    for layer in layers:
        for member in layer:
            if module == member or module.startswith(member + "."):
                return member
    return None


def flowchart(layers: list[list[str]], edges: dict[str, set[str]]) -> list[str]:
    """A contract's Mermaid flowchart: a node per layer, an arrow per pair of layers with
    imports between them."""
    members = [m for layer in layers for m in layer]
    common = members[0].rpartition(".")[0] if all(m.count(".") >= 2 for m in members) else PACKAGE
    short = {m: m.removeprefix(common + ".") for m in members}
    layer_of = {m: i for i, layer in enumerate(layers) for m in layer}
    counts: dict[tuple[int, int], set[str]] = defaultdict(set)
    for importer, targets in edges.items():
        source = _member(importer, layers)
        for target in targets:
            goal = _member(target, layers)
            if source and goal and source != goal:
                counts[(layer_of[source], layer_of[goal])].add(importer)
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    L{i}["{" | ".join(short[m] for m in layer)}"]' for i, layer in enumerate(layers)]
    lines += [f"    L{a} -->|{len(who)}| L{b}" for (a, b), who in sorted(counts.items())]
    return lines + ["```"]


def drawings() -> list[str]:
    known = modules()
    edges = {name: imports(name, path, known) for name, path in known.items()}
    lines: list[str] = []
    for name, layers in contracts():
        lines += ["", f"**{name}**", "", *flowchart(layers, edges)]
    return lines


def generate(page: str | None) -> str:
    """`page` with the text between its markers replaced by the drawings."""
    return between_markers(page, BEGIN, END, [*drawings(), ""], PAGE.relative_to(REPO))


def main(argv: list[str] | None = None) -> int:
    return check_or_write(argv, __doc__.splitlines()[0], PAGE, REPO, "docs/make_architecture_graph.py", generate)


if __name__ == "__main__":
    import sys

    sys.exit(main())
