"""The format interface (formats/__init__.py): every format is a plug-in that declares
what it is and can do, the registry is the one list of them, and nothing else spells a
format's name."""

import ast
import importlib
import sys
import types
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr

from tldp_cli import formats
from tldp_cli.cli.options import InputFormat
from tldp_cli.errors import UsageError
from tldp_cli.files import output
from tldp_cli.formats import Format, FormatOptions, npy

from tests.builders import REPO, make_images, make_npy

PACKAGE = REPO / "tldp_cli"
REGISTRY = PACKAGE / "formats" / "__init__.py"

# Where a format's name may appear as a string constant besides its own module and the
# registry's FORMAT_MODULES: file -> names, with the reason.
ALLOWED: dict[str, tuple[str, ...]] = {
    # The name map's "images" key (original name -> output name), which the reader of the
    # images format writes and reads: a key of a JSON document, not a format's name.
    "tldp_cli/formats/images_reader.py": ("images",),
}


def _own_module(name: str) -> Path:
    return PACKAGE / "formats" / f"{formats.FORMAT_MODULES[name]}.py"


def _registry_constants() -> set[int]:
    """ids of the nodes inside the FORMAT_MODULES assignment of the registry."""
    tree = ast.parse(REGISTRY.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FORMAT_MODULES" for t in node.targets):
            return {id(n) for n in ast.walk(node)}, tree
    raise AssertionError("formats/__init__.py has no FORMAT_MODULES")


def format_name_literals(root: Path = PACKAGE) -> list[str]:
    """Every string constant equal to a registered format's name outside that format's own
    module and the registry's FORMAT_MODULES."""
    names = set(formats.names())
    registry_nodes, registry_tree = _registry_constants()
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = registry_tree if path == REGISTRY else ast.parse(path.read_text())
        rel = path.relative_to(root.parent).as_posix()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names):
                continue
            name = node.value
            if path == _own_module(name) or (path == REGISTRY and id(node) in registry_nodes):
                continue
            if name in ALLOWED.get(rel, ()):
                continue
            found.append(f"{rel}:{node.lineno}: {name!r}")
    return found


def test_no_format_name_is_spelled_outside_its_module_and_the_registry():
    found = format_name_literals()
    assert not found, ("these ask for a format by name; ask its declaration (formats.Format) "
                       "instead:\n" + "\n".join(found))


def test_the_scan_finds_a_format_name(tmp_path):
    """The check above sees a name in a comparison, a tuple and a dict key."""
    package = tmp_path / "tldp_cli"
    (package / "run").mkdir(parents=True)
    (package / "run" / "bad.py").write_text(
        'def f(m):\n    return m.name == "zarr" or m.name in ("hdf5", "npz") or {"images": 1}\n')
    found = format_name_literals(package)
    assert sorted(line.split(": ")[1] for line in found) == ["'hdf5'", "'images'", "'npz'", "'zarr'"]


@pytest.mark.parametrize("name", formats.names())
def test_every_registered_module_declares_its_format(name):
    module = importlib.import_module(f"tldp_cli.formats.{formats.FORMAT_MODULES[name]}")
    fmt = module.FORMAT
    assert isinstance(fmt, Format) and fmt.name == name and formats.get(name) is fmt
    for function in (fmt.can_open, fmt.default_output, fmt.open_reader, fmt.create_writer):
        assert callable(function) and function.__module__ == module.__name__
    assert fmt.docs and all(len(row) == 4 and all(row) for row in fmt.docs)
    assert all(s.startswith(".") and s == s.lower() for s in (*fmt.suffixes, *fmt.compound_suffixes))
    # A folder format says how it knows its own earlier output, or --overwrite replaces none.
    assert fmt.folder == (fmt.earlier_output is not formats.never_earlier_output)
    assert fmt.name_map == (fmt.name_map_destination is not None)
    assert fmt.resumable == (getattr(module, "reopen_writer", None) is not None)


def test_no_two_formats_claim_a_suffix():
    claimed = [s for fmt in formats.registered() for s in fmt.suffixes]
    assert len(claimed) == len(set(claimed))


def test_the_cli_offers_the_registered_formats():
    assert [choice.value for choice in InputFormat] == formats.names()


def _toy(monkeypatch) -> Format:
    """A format registered by its declaration alone (it reads .npy content)."""
    toy = Format(name="toy", title="toy file", suffixes=(".toy",), single_array=True,
                 can_open=lambda path: path.suffix == ".toy" and npy.can_open(path),
                 default_output=lambda path: formats.tldp_name(path, ".toy"),
                 open_reader=npy.open_reader, create_writer=npy.create_writer,
                 docs=(formats.DocRow("toy file", "its suffix", "-", "-"),))
    module = types.ModuleType("tldp_cli.formats.toy")
    module.FORMAT = toy
    monkeypatch.setitem(sys.modules, "tldp_cli.formats.toy", module)
    monkeypatch.setattr(formats, "FORMAT_MODULES", {"toy": "toy", **formats.FORMAT_MODULES})
    return toy


def test_a_new_format_registers_by_its_declaration(monkeypatch, tmp_path):
    toy = _toy(monkeypatch)
    path = tmp_path / "a.toy"
    np.save(tmp_path / "a.npy", np.zeros((2, 3)))
    (tmp_path / "a.npy").rename(path)
    assert formats.detect(path) is toy and formats.detect(path, "toy") is toy
    assert formats.data_file(path).startswith("toy data")
    assert formats.named_by(".toy") is toy and formats.named_by(".toy", skip=toy) is None
    with pytest.raises(UsageError, match="the name says toy file, but the input is a .npy array"):
        output.destination(tmp_path / "x.toy", None, tmp_path / "d", npy.FORMAT,
                           lambda suffix: formats.named_by(suffix, npy.FORMAT).title)


def test_a_writer_s_messages_are_its_own(tmp_path):
    """A writer says what it did in its own messages, which the CLI shows after the
    reader's: it does not append to the reader's list."""
    store = tmp_path / "q.zarr"
    zarr.create_array(store=str(store), shape=(8, 4), dtype="f4", chunks=(4, 4), zarr_format=2,
                      filters=[numcodecs.Quantize(digits=2, dtype="f4")])[:] = np.ones((8, 4))
    fmt = formats.detect(store)
    reader = fmt.open_reader(store, FormatOptions())
    try:
        read = list(reader.messages)
        writer = fmt.create_writer(reader, tmp_path / "out.zarr", np.dtype("f4"), FormatOptions())
        assert list(reader.messages) == read
        assert any("written without the input's lossy filter quantize" in m for m in writer.messages)
        writer.close()
    finally:
        reader.close()


@pytest.mark.parametrize("make", [make_npy, make_images])
def test_a_reader_refusing_dataset_names_every_format_that_takes_it(tmp_path, make):
    """--dataset given to a format that does not take it: the refusal names each format
    whose declaration says it does (Format.selects_arrays), by its title."""
    path, _ = make(tmp_path)
    fmt = formats.detect(path)
    assert not fmt.selects_arrays
    with pytest.raises(UsageError, match="--dataset applies to") as refused:
        fmt.open_reader(path, FormatOptions(datasets=["x"]))
    takers = [taker for taker in formats.registered() if taker.selects_arrays]
    assert len(takers) > 4
    for taker in takers:
        assert taker.title.removesuffix(" file").removesuffix(" store") in str(refused.value), taker.title
