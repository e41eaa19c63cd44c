"""The structure docs/architecture.md describes: layers that only look down, no import
cycle (imports inside functions count), format modules that declare their interface,
and no long function without a stated reason."""

import ast
import importlib
import importlib.util
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from tldp_cli import formats

ROOT = Path(__file__).resolve().parents[1]

# Functions whose body is over LONG_FUNCTION lines, with the reason they stay whole.
LONG_FUNCTION = 80
ALLOWED_LONG: dict[str, str] = {}


def test_import_contracts_hold():
    """The import-linter contracts in pyproject.toml (layers, independent formats and commands)."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "import-linter is in the dev extra"
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_import_cycle():
    graph = grimp.build_graph("tldp_cli")
    cycles = []
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            if importer.startswith(imported + "."):  # a module and its own package's __init__
                continue
            if graph.chain_exists(importer=imported, imported=importer):
                cycles.append(" -> ".join(graph.find_shortest_chain(importer=imported, imported=importer))
                              + f" -> {imported}")
    assert not cycles, "\n".join(cycles)


def test_no_import_cycle_detector_finds_one(tmp_path, monkeypatch):
    """The check above would see a cycle made by an import inside a function."""
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\n")
    (package / "b.py").write_text("def f():\n    from cyclic import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclic", cache_dir=None)
    assert graph.chain_exists(importer="cyclic.b", imported="cyclic.a")


@pytest.mark.parametrize("name", formats.names())
def test_format_modules_declare_their_interface(name):
    """Each registered module declares its Format (tests/formats/test_format_interface.py
    checks what it declares) and is one of the independent format modules."""
    module = importlib.import_module(f"tldp_cli.formats.{formats.FORMAT_MODULES[name]}")
    assert isinstance(getattr(module, "FORMAT", None), formats.Format), f"{module.__name__} declares no FORMAT"
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    independent = next(c["modules"] for c in contracts if c["type"] == "independence"
                       and c["name"].startswith("formats:"))
    assert module.__name__ in independent, f"add {module.__name__} to the formats' independence contract"


def _long_functions() -> dict[str, int]:
    found = {}
    for path in sorted((ROOT / "tldp_cli").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]  # the docstring does not count
                lines = node.end_lineno - body[0].lineno + 1
                if lines > LONG_FUNCTION:
                    found[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = lines
    return found


def test_no_long_function_without_a_reason():
    unexplained = {name: lines for name, lines in _long_functions().items() if name not in ALLOWED_LONG}
    assert not unexplained, f"functions over {LONG_FUNCTION} lines: {unexplained}"


# A run's steps share a run.context.RunContext rather than long lists of parameters:
# at most this many before the keyword-only ones (an API's options named at each call).
MANY_PARAMETERS = 6


def _positional_parameters(folder: Path) -> dict[str, int]:
    found = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                found[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = len(names)
    return found


def test_no_long_parameter_list_in_run():
    long = {name: n for name, n in _positional_parameters(ROOT / "tldp_cli" / "run").items()
            if n > MANY_PARAMETERS}
    assert not long, f"more than {MANY_PARAMETERS} positional parameters (pass a RunContext): {long}"


# Where PerturbOptions are made, one function per source: the command's values
# (cli/options.py's perturb_options), a manifest (run/run_manifest.py's options_of_manifest) and
# perturb_array's keywords (run/arrays.py); a library caller makes its own.
OPTIONS_MADE_IN = {"tldp_cli/cli/options.py:perturb_options", "tldp_cli/run/run_manifest.py:options_of_manifest",
                   "tldp_cli/run/arrays.py:perturb_array"}


def _options_made() -> set[str]:
    found = set()
    for path in sorted((ROOT / "tldp_cli").rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, ast.Call) and "PerturbOptions" in (
                            getattr(node.func, "id", None), getattr(node.func, "attr", None)):
                        found.add(f"{path.relative_to(ROOT).as_posix()}:{function.name}")
    return found


def test_perturb_options_are_made_once_per_source():
    assert _options_made() == OPTIONS_MADE_IN


# The accounting returns typed results (privacy/certificates.py): the manifest's keys are
# spelled where the manifest is built (run/manifest.py), the guarantee line in cli/summary.py.
ACCOUNTING = ("tldp_cli/privacy/accounting.py", "tldp_cli/privacy/certificates.py")


def _manifest_shapes(path: Path) -> list[str]:
    """What in `path` has the shape of a manifest's object: a function annotated to return a
    dict, a dict display with a string key, dict(key=...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None
                and "dict" in ast.unparse(node.returns)):
            found.append(f"{node.lineno}: {node.name} returns {ast.unparse(node.returns)}")
        elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                for k in node.keys):
            found.append(f"{node.lineno}: a dict with the keys {[ast.unparse(k) for k in node.keys if k]}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
              and node.keywords):
            found.append(f"{node.lineno}: dict({', '.join(k.arg or '**' for k in node.keywords)})")
    return found


@pytest.mark.parametrize("module", ACCOUNTING)
def test_the_accounting_returns_typed_results_not_manifest_objects(module):
    found = _manifest_shapes(ROOT / module)
    assert not found, f"{module}: render figures in run/manifest.py, not here:\n" + "\n".join(found)


def test_the_manifest_shape_scan_finds_one(tmp_path):
    (tmp_path / "leaky.py").write_text('def certify(c) -> dict[str, float]:\n    return {"epsilon": c}\n'
                                       "def scope(c):\n    return dict(epsilon=c)\n")
    assert len(_manifest_shapes(tmp_path / "leaky.py")) == 3


def _private_names_crossing(root: Path) -> list[str]:
    """Every use of another tldp_cli module's private name (one _underscore, not a dunder):
    `from tldp_cli.x import _name`, or `module._name` where `module` names an imported
    tldp_cli module (imports inside functions count)."""
    package = root.name

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(root.parent).as_posix()
        modules = set()  # local names bound to tldp_cli modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {alias.asname for alias in node.names
                            if alias.asname and alias.name.startswith(package + ".")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
                for alias in node.names:
                    if private(alias.name):
                        found.append(f"{rel}:{node.lineno}: from {node.module} import {alias.name}")
                    elif _is_module(f"{node.module}.{alias.name}"):
                        modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and private(node.attr)):
                found.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def _is_module(name: str) -> bool:
    """Whether `name` (a.b.c) is a module of the installed package (not a name inside one)."""
    parent, _, _ = name.rpartition(".")
    spec = importlib.util.find_spec(parent)
    return spec.submodule_search_locations is not None and importlib.util.find_spec(name) is not None


def test_no_private_name_crosses_modules():
    """A name with a leading underscore is its module's own: another module that needs it
    needs a public function (formats/images_reader.py's output_name and images_writer.py's
    read_output, which evaluate pairs images with)."""
    found = _private_names_crossing(ROOT / "tldp_cli")
    assert not found, "\n".join(found)


def test_the_private_name_scan_finds_one(tmp_path):
    package = tmp_path / "tldp_cli"
    package.mkdir()
    (package / "leaky.py").write_text("from tldp_cli.formats import images\n"
                                      "from tldp_cli.run.pipeline import _row_records\n\n\n"
                                      "def f(p):\n    return images._decode(p)\n")
    assert sorted(_private_names_crossing(package)) == [
        "tldp_cli/leaky.py:2: from tldp_cli.run.pipeline import _row_records",
        "tldp_cli/leaky.py:6: images._decode"]
