"""A Zarr store's tree (formats/zarr_store.py): its format (2 or 3), nodes and files, the
checks of its metadata and entries (no links, no directory that is not a node), opening
its arrays with zarr-python, and reading an array's records (Records).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from zarr.storage import LocalStore

from tldp_cli.errors import InputError, reason_of
from tldp_cli.files.checked_io import json_value, open_regular
from tldp_cli.formats import cf, zarr_chunks
from tldp_cli.formats.zarr_names import METADATA_FILES

zarr_chunks.use_checked_codecs()  # chunks zarr-python decodes: sizes checked before decoding

# A chunk (or shard) key within its array's directory: "0.0", "0/0", "c/0/0", "c.0.0", "c".
_CHUNK_KEY = re.compile(r"^(c|\d+)([./]\d+)*$")


@dataclass
class Node:
    path: str  # within the store, "" for the root
    kind: str  # "array" or "group"
    meta: dict[str, Any]  # the parsed zarr.json (format 3) or .zarray/.zgroup (format 2)
    consolidated: bool = False


def display(name: str) -> str:
    return name or "/"


def _read_json(store: Path, file: Path) -> dict[str, Any]:
    where = file.relative_to(store).as_posix()
    try:
        with open_regular(file, follow_links=False) as f:  # listed as a regular file: still one
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{store}: damaged Zarr store: {where} is not valid JSON ({reason_of(exc)})") from None
    meta = json_value(text, f"{store}: damaged Zarr store: {where}")
    if not isinstance(meta, dict):
        raise InputError(f"{store}: damaged Zarr store: {where} is not a JSON object")
    return meta


# The Zarr format versions zarr-python reads and writes.
ZarrFormat = Literal[2, 3]


def store_format(store: Path) -> ZarrFormat:
    if (store / "zarr.json").is_file():
        return 3
    if (store / ".zarray").is_file() or (store / ".zgroup").is_file():
        return 2
    raise InputError(f"{store}: damaged Zarr store: no zarr.json, .zarray or .zgroup at its root "
                     "(its metadata is missing)")


def _node_at(store: Path, directory: Path, zarr_format: ZarrFormat) -> Node | None:
    rel = directory.relative_to(store).as_posix()
    rel = "" if rel == "." else rel
    if zarr_format == 3:
        if not (directory / "zarr.json").is_file():
            return None
        meta = _read_json(store, directory / "zarr.json")
        kind = meta.get("node_type")
        if kind not in ("array", "group") or meta.get("zarr_format") != 3:
            raise InputError(f"{store}: damaged Zarr store: {display(rel)} has no valid "
                             "node_type/zarr_format in its zarr.json")
        return Node(rel, kind, meta, meta.get("consolidated_metadata") is not None)
    if (directory / ".zarray").is_file():
        return Node(rel, "array", _read_json(store, directory / ".zarray"))
    if (directory / ".zgroup").is_file():
        return Node(rel, "group", _read_json(store, directory / ".zgroup"),
                    (directory / ".zmetadata").is_file())
    return None


def store_files(store: Path) -> list[str]:
    """Relative POSIX paths of the files in the store, found without following links.
    A link is refused rather than skipped: zarr would follow it when reading, and the
    copy of the unperturbed files would publish whatever it points to."""
    def unreadable(exc: OSError):
        raise InputError(f"{store}: cannot list {exc.filename} ({reason_of(exc)})")

    files = []
    for directory, dirs, names in os.walk(store, onerror=unreadable):
        dirs.sort()
        for name in sorted(dirs + names):
            entry = Path(directory, name)
            rel = entry.relative_to(store).as_posix()
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise InputError(f"{store}: {rel} is a symbolic link; tldp does not follow links "
                                 "inside a Zarr store (replace it with a copy of what it points to)")
            if stat.S_ISREG(mode):
                files.append(rel)
            elif not stat.S_ISDIR(mode):
                raise InputError(f"{store}: {rel} is neither a regular file nor a directory")
    return sorted(files)


def walk(store: Path, zarr_format: ZarrFormat) -> list[Node]:
    """Every node of the store, read from its own metadata file (never from consolidated
    metadata, which may be stale)."""
    root = _node_at(store, store, zarr_format)
    assert root is not None  # store_format found its metadata
    nodes = [root]
    pending = [root]
    while pending:
        group = pending.pop()
        if group.kind != "group":
            continue
        directory = store / group.path
        for child in sorted(p for p in directory.iterdir() if p.is_dir()):
            node = _node_at(store, child, zarr_format)
            if node is None:
                # Most likely an array that lost its metadata: copying it as is could
                # publish raw data in the perturbed output.
                expected = "zarr.json" if zarr_format == 3 else ".zarray or .zgroup"
                raise InputError(f"{store}: damaged Zarr store: {child.relative_to(store).as_posix()}/ "
                                 f"has no {expected}")
            nodes.append(node)
            pending.append(node)
    return sorted(nodes, key=lambda n: n.path)


def check_attributes(store: Path, files: list[str], nodes: list[Node]) -> None:
    """Reads the nodes' Zarr 2 attributes (.zattrs, which zarr-python parses itself) with
    _read_json first: one that is not JSON, or nests too deeply, is refused naming it,
    before zarr-python reaches it. (.zmetadata is never read: the output's is rebuilt.)"""
    node_paths = {n.path for n in nodes}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        if name == ".zattrs" and parent in node_paths:
            _read_json(store, store / rel)


def not_zarr(files: list[str], nodes: list[Node]) -> dict[str, str | None]:
    """The files that are neither a node's metadata nor chunks of an array, each with
    the array whose directory holds it (None if it lies in a group's)."""
    node_paths = {n.path for n in nodes}
    arrays = [n.path for n in nodes if n.kind == "array"]
    others: dict[str, str | None] = {}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        if parent in node_paths and name in METADATA_FILES:
            continue
        # Arrays have no children, so at most one holds the file.
        owner = next((a for a in arrays if a == "" or rel.startswith(a + "/")), None)
        if owner is not None and _CHUNK_KEY.match(rel[len(owner) + 1:] if owner else rel):
            continue
        others[rel] = owner
    return others


def open_node(store: LocalStore, where: Path, node: str, kind: str, zarr_format: ZarrFormat,
              mode: Literal["r", "r+"] = "r"):
    try:
        if kind == "group":
            return zarr.open_group(store=store, path=node, mode=mode, zarr_format=zarr_format,
                                   use_consolidated=False)
        return zarr.open_array(store=store, path=node, mode=mode, zarr_format=zarr_format)
    except Exception as exc:  # zarr raises many kinds on bad metadata
        detail = f"no {exc} field" if isinstance(exc, KeyError) else reason_of(exc)
        raise InputError(f"{where}: damaged Zarr store: {kind} {display(node)} has invalid "
                         f"metadata ({detail})") from None


@dataclass(frozen=True)
class Records(cf.EncodedRecords):
    """Reads records of one array. Picklable: opens the store inside each call, so it can
    run in Dask worker processes."""

    store: Path
    name: str  # the array's path in the store, "" for a single-array store
    zarr_format: ZarrFormat
    encoding: cf.Encoding | None = None  # CF: missing values and packing (xarray's stores)
    chunk_files: zarr_chunks.Layout | None = None  # plain chunk files are read without zarr-python

    def stored(self, start: int, stop: int) -> np.ndarray:
        """Records start:stop as stored."""
        try:
            if self.chunk_files is not None:
                return self.chunk_files.read(self.store / self.name, start, stop)
            array = open_node(LocalStore(self.store, read_only=True), self.store, self.name, "array",
                              self.zarr_format)
            return np.asarray(array[start:stop])
        except InputError:
            raise
        except MemoryError:  # not damage: the run says memory ran out
            raise
        except Exception as exc:
            raise InputError(f"{self.store}: cannot read records {start}-{stop} of array "
                             f"{display(self.name)} ({reason_of(exc)}); a chunk may be damaged") from None
