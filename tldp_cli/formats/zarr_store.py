"""Zarr directory stores, Zarr format 2 and 3: a single array or a group tree.

The output starts as a file-for-file copy of the input without the perturbed
arrays' chunks. Their metadata is rewritten for the float output dtype (same
chunks, shards, codecs, fill value, attributes, dimension names) and the noisy
records are written through zarr. Consolidated metadata is rebuilt at the end.

Nothing outside the store is read or copied. A symbolic link anywhere inside it
(to a file or a directory, dangling or not), or any other entry that is neither a
regular file nor a directory, is refused before anything is written; only the
store's own path may be a link. Every directory below a group must be a node (hold
zarr.json, or .zarray/.zgroup): one without is refused as a damaged store, since it
may be an array that lost its metadata. Node names starting with "." are nodes like
any other. Files that are neither metadata nor chunks of an array (.DS_Store, a
README) are copied unchanged, named in a message and listed in the manifest
(not_zarr_files); those inside the directory of an array being perturbed are
left out with its chunks.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from tldp_cli.errors import InputError, OutputError
from tldp_cli.formats import (
    ArrayJob,
    FormatOptions,
    Reader,
    Writer,
    check_numeric_dtype,
    default_selection,
    dropped_filters,
    listing,
    plural,
    tldp_name,
)

NAME = "zarr"
METADATA_FILES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")
_CHUNK_NAME = re.compile(r"^\d+(\.\d+)*$")
# A chunk (or shard) key within its array's directory: "0.0", "0/0", "c/0/0", "c.0.0", "c".
_CHUNK_KEY = re.compile(r"^(c|\d+)([./]\d+)*$")


def can_open(path: Path) -> bool:
    if not path.is_dir():
        return False
    if any((path / name).is_file() for name in METADATA_FILES):  # even a corrupt one
        return True
    # An array that lost its metadata still has its chunks ("0.0.0", "0/0", "c/0/0").
    # (A group that lost its root metadata is not claimed: its members look just like a
    # folder holding several stores.)
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    return bool(entries) and all(_CHUNK_NAME.match(p.name) or (p.name == "c" and p.is_dir())
                                 for p in entries)


def default_output(path: Path) -> Path:
    if path.name in ("", ".."):
        path = path.resolve()
    return tldp_name(path, ".zarr")


@dataclass
class _Node:
    path: str  # within the store, "" for the root
    kind: str  # "array" or "group"
    meta: dict[str, Any]  # the parsed zarr.json (format 3) or .zarray/.zgroup (format 2)
    consolidated: bool = False


def _display(name: str) -> str:
    return name or "/"


def _read_json(store: Path, file: Path) -> dict[str, Any]:
    where = file.relative_to(store).as_posix()
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{store}: damaged Zarr store: {where} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{store}: damaged Zarr store: {where} is not a JSON object")
    return meta


def _zarr_format(store: Path) -> int:
    if (store / "zarr.json").is_file():
        return 3
    if (store / ".zarray").is_file() or (store / ".zgroup").is_file():
        return 2
    raise InputError(f"{store}: damaged Zarr store: no zarr.json, .zarray or .zgroup at its root "
                     "(its metadata is missing)")


def _node_at(store: Path, directory: Path, zarr_format: int) -> _Node | None:
    rel = directory.relative_to(store).as_posix()
    rel = "" if rel == "." else rel
    if zarr_format == 3:
        if not (directory / "zarr.json").is_file():
            return None
        meta = _read_json(store, directory / "zarr.json")
        kind = meta.get("node_type")
        if kind not in ("array", "group") or meta.get("zarr_format") != 3:
            raise InputError(f"{store}: damaged Zarr store: {_display(rel)} has no valid "
                             "node_type/zarr_format in its zarr.json")
        return _Node(rel, kind, meta, meta.get("consolidated_metadata") is not None)
    if (directory / ".zarray").is_file():
        return _Node(rel, "array", _read_json(store, directory / ".zarray"))
    if (directory / ".zgroup").is_file():
        return _Node(rel, "group", _read_json(store, directory / ".zgroup"),
                     (directory / ".zmetadata").is_file())
    return None


def _files(store: Path) -> list[str]:
    """Relative POSIX paths of the files in the store, found without following links.
    A link is refused rather than skipped: zarr would follow it when reading, and the
    copy of the unperturbed files would publish whatever it points to."""
    def unreadable(exc: OSError):
        raise InputError(f"{store}: cannot list {exc.filename} ({exc.strerror})")

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


def _walk(store: Path, zarr_format: int) -> list[_Node]:
    """Every node of the store, read from its own metadata file (never from consolidated
    metadata, which may be stale)."""
    nodes = [_node_at(store, store, zarr_format)]
    pending = [nodes[0]]
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


def _not_zarr(files: list[str], nodes: list[_Node]) -> dict[str, str | None]:
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


def _open(store: LocalStore, where: Path, node: str, kind: str, zarr_format: int, mode: str = "r"):
    try:
        if kind == "group":
            return zarr.open_group(store=store, path=node, mode=mode, zarr_format=zarr_format,
                                   use_consolidated=False)
        return zarr.open_array(store=store, path=node, mode=mode, zarr_format=zarr_format)
    except Exception as exc:  # zarr raises many kinds on bad metadata
        detail = f"no {exc} field" if isinstance(exc, KeyError) else str(exc)
        raise InputError(f"{where}: damaged Zarr store: {kind} {_display(node)} has invalid "
                         f"metadata ({detail})") from None


@dataclass(frozen=True)
class _Records:
    """Reads records of one array. Picklable: opens the store inside each call, so it can
    run in Dask worker processes."""

    store: Path
    name: str  # the array's path in the store, "" for a single-array store
    zarr_format: int

    def __call__(self, start: int, stop: int) -> np.ndarray:
        array = _open(LocalStore(self.store, read_only=True), self.store, self.name, "array",
                      self.zarr_format)
        try:
            return np.asarray(array[start:stop])
        except Exception as exc:
            raise InputError(f"{self.store}: cannot read records {start}-{stop} of array "
                             f"{_display(self.name)} ({exc}); a chunk may be damaged") from None


class ZarrReader(Reader):
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.messages: list[str] = []
        self.manifest_extra: dict = {}
        files = _files(path)  # first: it refuses links before any file is read
        self.zarr_format = _zarr_format(path)
        self.nodes = _walk(path, self.zarr_format)
        self.store = LocalStore(path, read_only=True)
        opened = {n.path: _open(self.store, path, n.path, n.kind, self.zarr_format) for n in self.nodes}
        self.handles = {n.path: opened[n.path] for n in self.nodes if n.kind == "array"}
        selected = self._select(options.datasets)
        self.jobs = [self._job(name) for name in selected]
        # The writer leaves out everything in a perturbed array's directory but its metadata.
        copied = [rel for rel, owner in _not_zarr(files, self.nodes).items() if owner not in selected]
        if copied:
            self.manifest_extra["not_zarr_files"] = copied
            self.manifest_extra["not_zarr_files_action"] = "copied unchanged"
            self.messages.append(f"copied {plural(len(copied), 'file')} unchanged (not perturbed), "
                                 f"neither Zarr metadata nor chunks: {listing(copied)}")

    def _select(self, requested: list[str]) -> list[str]:
        arrays = self.handles
        listing = ", ".join(_display(n) for n in arrays) or "none"
        if requested:
            names: list[str] = []
            groups = {n.path for n in self.nodes if n.kind == "group"}
            for item in requested:
                name = item.strip("/")
                if name not in arrays:
                    what = "is a group, not an array" if name in groups else "does not exist"
                    raise InputError(f"{self.path}: Zarr array {item} {what} (arrays: {listing})")
                self._check(name)
                if name not in names:
                    names.append(name)
            return names
        if "" in arrays:  # a single-array store
            self._check("")
            return [""]
        numeric = {n: tuple(a.shape) for n, a in arrays.items() if a.dtype.kind in "iuf"}
        names, message = default_selection(self.path, numeric, "array")
        for name in names:
            self._check(name)
        self.messages.append(message)
        return names

    def _check(self, name: str) -> None:
        array = self.handles[name]
        check_numeric_dtype(self.path, array.dtype, f"array {_display(name)}")
        if array.ndim == 0 or array.shape[0] == 0:
            raise InputError(f"{self.path}: array {_display(name)} has no records "
                             f"(shape {tuple(array.shape)}; axis 0 indexes records)")

    def _job(self, name: str) -> ArrayJob:
        array = self.handles[name]
        shape = tuple(array.shape)
        return ArrayJob(
            name=_display(name), shape=shape, dtype=array.dtype,
            read=_Records(self.path, name, self.zarr_format),
            source={"path": str(self.path), "format": NAME, "dataset": _display(name),
                    "shape": list(shape), "dtype": str(array.dtype)},
            chunk_records=(array.shards or array.chunks)[0],
        )

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def close(self) -> None:
        self.store.close()


def open_reader(path: Path, options: FormatOptions) -> ZarrReader:
    return ZarrReader(path, options)


def _json_float(value: float) -> float | str:
    """A float fill value as Zarr writes it: NaN and the infinities as strings."""
    if np.isnan(value):
        return "NaN"
    if np.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


# Codecs that store other values than those written (quantize, round bits, scale to a
# fixed precision, change the stored type, lossy compression), by their numcodecs id,
# without a "numcodecs." or "imagecodecs_" prefix. Dropped from perturbed arrays, so
# the noisy values are stored exactly; the rest (compressors, shuffle, delta,
# checksums) are kept. ZFP and the image codecs are lossless only at some settings.
LOSSY_CODECS = ("quantize", "bitround", "fixedscaleoffset", "astype", "zfpy", "zfp", "sz3", "sperr",
                "lerc", "jpeg", "jpeg8", "jpeg2k", "jpegls", "jpegxl", "jpegxr", "webp", "avif", "heif")
# Of those, the ones that turn the array into bytes (Zarr 3): replaced by "bytes".
_LOSSY_SERIALIZERS = ("zfpy", "zfp", "sz3", "sperr", "lerc", "jpeg", "jpeg8", "jpeg2k", "jpegls",
                      "jpegxl", "jpegxr", "webp", "avif", "heif")


def _codec_id(codec: dict[str, Any]) -> str:
    name = str(codec.get("name") or codec.get("id") or "")
    for prefix in ("numcodecs.", "imagecodecs_"):
        name = name.removeprefix(prefix)
    return name.lower()


def _check_codec(codec: dict[str, Any], config: dict[str, Any], dtype: np.dtype, where: str) -> None:
    """Filters bound to a dtype (delta, ...) cannot be carried over to another output
    dtype; refuse rather than drop them or change what they mean."""
    for key in ("dtype", "astype"):
        if key not in config:
            continue
        try:
            same = np.dtype(config[key]) == dtype
        except TypeError:
            same = False
        if not same:
            name = codec.get("name") or codec.get("id")
            raise InputError(f"{where} uses the {name} filter for {config[key]} data, which "
                             f"cannot apply to the {dtype} output; re-encode the array without it")


# Compressors whose level only trades CPU for size, by numcodecs id, and the key of the
# level in their configuration. Noise compresses no better at a high level than at 1
# (int16 noise of scale 256: 0.774 of its size with zstd at levels 1 and 3 alike; float
# noise hardly at all), so perturbed arrays are written at level 1 at most.
_LEVELS = {"zstd": "level", "blosc": "clevel", "gzip": "level", "zlib": "level"}
FAST_LEVEL = 1
_ZSTD_DEFAULT = 3  # zstd's level 0 means its default level


def _fast_level(codec: dict[str, Any], config: dict[str, Any], levels: list[dict[str, Any]]) -> None:
    """Lowers a compressor's level in `config` (in place) to FAST_LEVEL, noted in `levels`;
    levels at or below it (and zstd's fast negative levels) stay."""
    key = _LEVELS.get(_codec_id(codec))
    level = config.get(key) if key else None
    if not isinstance(level, int) or isinstance(level, bool):
        return
    effective = _ZSTD_DEFAULT if _codec_id(codec) == "zstd" and level == 0 else level
    if effective > FAST_LEVEL:
        config[key] = FAST_LEVEL
        levels.append({"codec": _codec_id(codec), "input_level": level, "output_level": FAST_LEVEL})


def _output_codecs(codecs: list, dtype: np.dtype, where: str, dropped: list[str],
                   levels: list[dict[str, Any]]) -> list:
    """Zarr 3 codecs for the output: lossy ones dropped (named in `dropped`), compression
    levels lowered (noted in `levels`), the rest checked against the output dtype."""
    result = []
    for codec in codecs:
        codec = {"name": codec} if isinstance(codec, str) else copy.deepcopy(codec)
        config = codec.get("configuration") or {}
        if _codec_id(codec) in LOSSY_CODECS:
            dropped.append(codec.get("name"))
            if _codec_id(codec) in _LOSSY_SERIALIZERS:
                result.append({"name": "bytes", "configuration": {"endian": "little"}})
            continue
        _check_codec(codec, config, dtype, where)
        if codec.get("name") == "bytes" and "endian" not in config:
            codec["configuration"] = {**config, "endian": "little"}  # required for multi-byte types
        if codec.get("name") == "sharding_indexed":
            config["codecs"] = _output_codecs(config.get("codecs", []), dtype, where, dropped, levels)
        _fast_level(codec, config, levels)
        result.append(codec)
    return result


def _output_metadata(node: _Node, fill_value: Any, zarr_format: int, dtype: np.dtype,
                     where: str) -> tuple[dict[str, Any], list[str], list[dict[str, Any]]]:
    """A perturbed array's metadata for the output dtype, the lossy codecs dropped and the
    compression levels lowered."""
    meta = copy.deepcopy(node.meta)
    dropped: list[str] = []
    levels: list[dict[str, Any]] = []
    with np.errstate(over="ignore"):
        fill = None if fill_value is None else _json_float(dtype.type(fill_value))
    if zarr_format == 3:
        meta["data_type"] = dtype.name
        meta["fill_value"] = fill
        meta["codecs"] = _output_codecs(meta.get("codecs", []), dtype, where, dropped, levels)
    else:
        meta["dtype"] = dtype.str
        meta["fill_value"] = fill
        filters = []
        for codec in meta.get("filters") or []:
            if _codec_id(codec) in LOSSY_CODECS:
                dropped.append(codec.get("id"))
            else:
                _check_codec(codec, codec, dtype, where)
                filters.append(codec)
        meta["filters"] = filters or None
        compressor = meta.get("compressor")
        if compressor and _codec_id(compressor) in LOSSY_CODECS:
            dropped.append(compressor.get("id"))
            meta["compressor"] = None
        elif compressor:
            _check_codec(compressor, compressor, dtype, where)
            _fast_level(compressor, compressor, levels)
    return meta, dropped, levels


@dataclass
class _Blocks:
    """Writes blocks of records through zarr. Picklable (the open arrays are not pickled:
    each process opens its own), so Dask workers can write their blocks themselves.
    Blocks must cover whole shards (pipeline.block_bounds): two writers filling
    different chunks of one shard would lose one of them."""

    root: Path
    source: Path  # the input, named in messages
    paths: dict[str, str]  # job name -> the array's path in the store
    zarr_format: int
    dtype: np.dtype

    def __post_init__(self):
        self._arrays: dict[str, Any] = {}

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_arrays"}

    def __setstate__(self, state):
        self.__dict__.update(state, _arrays={})

    def array(self, job_name: str):
        if job_name not in self._arrays:
            self._arrays[job_name] = _open(LocalStore(self.root), self.source, self.paths[job_name],
                                           "array", self.zarr_format, mode="r+")
        return self._arrays[job_name]

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        array = self.array(job.name)
        try:
            array[start:start + len(block)] = np.asarray(block, dtype=self.dtype)
        except OSError:
            raise
        except Exception as exc:
            raise InputError(f"{self.source}: cannot encode array {job.name} as {self.dtype} with "
                             f"its codecs ({exc})") from None


# Zarr's LocalStore writes through temporary files named like this; a killed run leaves them.
_STORE_TEMP = re.compile(r"\.[0-9a-f]{32}\.partial$")


class ZarrWriter(Writer):
    def __init__(self, reader: ZarrReader, tmp_path: Path, dtype: np.dtype, reopen: bool = False):
        self.root = tmp_path
        self.dtype = np.dtype(dtype)
        if tmp_path.resolve().is_relative_to(reader.path.resolve()):
            raise OutputError(f"{tmp_path.parent}: the output cannot go inside the input store "
                              f"{reader.path}")
        nodes = {n.path: n for n in reader.nodes}
        names = {job.name: job.name.strip("/") for job in reader.jobs}
        # Rewritten before anything is copied, so an impossible filter fails fast.
        metadata, dropped, lowered = {}, {}, {}
        for job_name, path in names.items():
            metadata[path], lossy, levels = _output_metadata(
                nodes[path], reader.handles[path].fill_value, reader.zarr_format, self.dtype,
                f"{reader.path}: array {_display(path)}")
            if lossy:
                dropped[job_name] = lossy
            if levels:
                lowered[job_name] = levels
        self.postprocessing, self.manifest_extra = dropped_filters(dropped)
        if lowered:  # the values are the same at any level: only the CPU spent differs
            self.manifest_extra["codec_levels"] = lowered
        reader.messages += [f"array {name}: written without the input's lossy "
                            f"filter{'s' if len(lossy) > 1 else ''} {', '.join(lossy)}, so the noisy "
                            "values are stored exactly" for name, lossy in dropped.items()]
        meta_file = "zarr.json" if reader.zarr_format == 3 else ".zarray"
        if reopen:
            for path, meta in metadata.items():
                try:
                    same = json.loads((tmp_path / path / meta_file).read_text(encoding="utf-8")) == meta
                except (OSError, UnicodeDecodeError, ValueError):
                    same = False
                if not same:
                    raise OutputError(f"{tmp_path}: the partial output does not match this input "
                                      f"(array {_display(path)}); remove it to start over")
            for leftover in [p for p in tmp_path.rglob("*") if _STORE_TEMP.search(p.name)]:
                leftover.unlink()
        else:
            def skip_chunks(directory: str, entries: list[str]) -> list[str]:
                rel = Path(directory).relative_to(reader.path).as_posix()
                if (rel if rel != "." else "") in metadata:
                    return [e for e in entries if e not in METADATA_FILES]
                return []

            # The reader refused links; one made since is copied as a link, not followed.
            shutil.copytree(reader.path, tmp_path, ignore=skip_chunks, symlinks=True)
            for path, meta in metadata.items():
                (tmp_path / path / meta_file).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        self.write = _Blocks(tmp_path, reader.path, names, reader.zarr_format, self.dtype)
        for job in names:  # open now: a bad codec fails before any block runs
            self.write.array(job)
        self.consolidate = [n.path for n in reader.nodes if n.consolidated]
        self.zarr_format = reader.zarr_format

    def block_writer(self) -> _Blocks:
        return self.write

    def finish(self) -> None:
        """Rebuild consolidated metadata; only a complete output is worth it."""
        if self.consolidate:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "consolidated metadata is not in the v3 spec"
                # Nested groups first, the root last.
                for path in sorted(self.consolidate, key=lambda p: (p == "", -p.count("/"))):
                    zarr.consolidate_metadata(LocalStore(self.root), path=path,
                                              zarr_format=self.zarr_format)

    def close(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*") if p.is_file())


def create_writer(reader: ZarrReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> ZarrWriter:
    return ZarrWriter(reader, tmp_path, dtype)


def reopen_writer(reader: ZarrReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> ZarrWriter:
    """The writer of an output an interrupted run began: its blocks are kept (--resume)."""
    return ZarrWriter(reader, tmp_path, dtype, reopen=True)
