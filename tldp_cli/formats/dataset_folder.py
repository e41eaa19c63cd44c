"""Hugging Face dataset folders, as `Dataset.save_to_disk` writes them: `state.json` (which
names the Arrow shards, in row order), `dataset_info.json` (the features and a description
of the dataset) and `data-00000-of-0000N.arrow` shards (Arrow IPC streams). The shards
are one table: row i of it is one record across the columns perturbed, as in a Parquet
file (formats/tables.py has the rules for columns).

The output folder has the same shards, each with its record batches, and a state.json
naming them, whose `_fingerprint` (a hash `datasets` computes from the data) is replaced
by a hash of the shards written; `dataset_info.json` keeps the features of the columns written and the
dataset's names and version (STRUCTURAL_INFO); its other fields (description,
citation, sizes, checksums of the downloaded files, ...) and the folder's other files
(cache files of `map`, ...) are left out and listed unless --keep names them
(dataset_info.json@FIELD, a file's name). `datasets.load_from_disk` loads it with the
same features.

A folder of Parquet files as the Hugging Face Hub lays a dataset out (`data/train-00000-of-
00002.parquet`, `data/test-00000-of-00001.parquet`, a README.md dataset card) is read the
same way: its Parquet files, in the order of their paths, are one table (every row of every
split is one record); they must share their columns. The output holds them under the same
paths, each with its row groups; the dataset card and any other file are left out and
listed unless --keep names them, hidden folders (a clone's .git) and a macOS archive's __MACOSX are not read
(formats.is_hidden), nor is a hidden file read as a Parquet file. `datasets.load_dataset("parquet", data_files=...)` and
`load_dataset(folder)` load it with the same features.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.files.checked_io import copy_bytes, flushed_files, json_value, open_regular, writing
from tldp_cli.formats import (HIDDEN_REASON, ArrayJob, DocRow, Format, FormatOptions, Writer, folder_output, is_hidden,
                              leftovers)

if TYPE_CHECKING:  # imported where used: pyarrow is not loaded to detect the format
    import pyarrow as pa

    from tldp_cli.formats import tables_reader

NAME = "hf-dataset"
STATE, INFO = "state.json", "dataset_info.json"
DICT = "dataset_dict.json"  # DatasetDict.save_to_disk: one save_to_disk folder per split
STRUCTURAL_INFO = ("features", "builder_name", "config_name", "dataset_name", "version")


PARQUET_SUFFIX = ".parquet"
# A folder holding any of these is an image folder (an imagefolder's metadata.parquet index too).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
INDEX = "metadata.parquet"


def default_output(path: Path) -> Path:
    return folder_output(path)


def _saved(path: Path) -> bool:
    return (path / STATE).is_file() and (path / INFO).is_file()


def _parquet_files(path: Path) -> list[str] | None:
    """The relative paths of the Parquet files of a folder of them, sorted; None when the
    folder holds an image (an image folder) or no Parquet file."""
    found = []
    for directory, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not is_hidden(d))
        for name in files:
            lower = name.lower()
            if is_hidden(name):  # ._train.parquet: a macOS resource fork, not Parquet
                continue
            if lower.endswith(IMAGE_SUFFIXES) or lower == INDEX:
                return None
            if lower.endswith(PARQUET_SUFFIX):
                found.append((Path(directory) / name).relative_to(path).as_posix())
    return sorted(found) or None


def can_open(path: Path) -> bool:
    """A save_to_disk folder (state.json and dataset_info.json), or a folder of Parquet
    files and no image."""
    return path.is_dir() and (_saved(path) or (path / DICT).is_file() or _parquet_files(path) is not None)


def _refuse_dataset_dict(path: Path) -> None:
    """A DatasetDict's folder holds a folder per split, each a dataset folder of its own:
    say so, naming them, rather than take it for an image folder."""
    if _saved(path) or not (path / DICT).is_file():
        return
    try:
        with open_regular(path / DICT) as f:
            splits = json.loads(f.read()).get("splits")
    except (OSError, InputError, ValueError, AttributeError):
        splits = None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        splits = sorted(d.name for d in path.iterdir() if _saved(d))
    folders = ", ".join(str(path / s) for s in splits) or f"{path}/SPLIT"
    raise InputError(f"{path}: a DatasetDict folder ({DICT}), one dataset folder per split; perturb "
                     f"the splits' folders instead ({folders}), each a release of its own")


def _json(path: Path) -> dict:
    try:
        with open_regular(path) as f:
            text = f.read()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    value = json_value(text, str(path))
    if not isinstance(value, dict):
        raise InputError(f"{path}: not a JSON object; the dataset folder is damaged")
    return value


def _shards(path: Path, state: dict) -> list[str]:
    files = state.get("_data_files")
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise InputError(f"{path / STATE}: names no data files (_data_files); the dataset folder is damaged")
    names = [f["filename"] for f in files]
    for name in names:
        if "/" in name or "\\" in name or name in (".", "..") or not (path / name).is_file():
            raise InputError(f"{path / STATE}: names {name}, which is not a file of the folder")
    if state.get("_indices_data_files"):
        raise InputError(f"{path}: the dataset has an indices mapping (_indices_data_files); save it "
                         "with flatten_indices() first")
    return names


def _a(layout: str) -> str:
    return "an" if layout.startswith("Arrow") else "a"


def _table(path: Path, names: list[str], options: FormatOptions, layout: str) -> tables_reader.FolderTableReader:
    """The shards as one table's reader; they must share their columns."""
    from tldp_cli.formats import tables, tables_reader

    parts: list[tables.Part] = []
    schema: pa.Schema | None = None
    settings: dict[str, Any] = {}
    for name in names:
        found = tables.layout_of(path / name)
        if found != layout:  # a shard of one file only, too: the folder's kind says what it should be
            raise InputError(f"{path / name}: " + (
                f"not a readable {layout}, as the folder's data files are; it may be truncated or corrupt"
                if found is None else f"{_a(found)} {found}, where the folder's data files are {layout}s"))
        part, found, found_settings = tables.open_part(path / name, layout)
        if schema is not None and not found.remove_metadata().equals(schema.remove_metadata()):
            raise InputError(f"{path / name}: has other columns or types than {names[0]}; perturb each "
                             "configuration's folder on its own")
        schema, settings = schema or found, settings or found_settings
        parts.append(part)
    reader = tables_reader.FolderTableReader(path, tables.Table(tuple(parts)), schema, options, NAME, settings,
                                             considered=True)
    reader.shards = names
    return reader


def open_reader(path: Path, options: FormatOptions) -> tables_reader.FolderTableReader:
    from tldp_cli.formats import tables

    _refuse_dataset_dict(path)
    if not _saved(path):
        names = _parquet_files(path)
        if names is None:
            raise InputError(f"{path}: no Parquet files, nor a state.json and dataset_info.json (a dataset "
                             "folder of save_to_disk)")
        reader = _table(path, names, options, tables.PARQUET)
        reader.others = _others(path, reader.left, set(names))
        reader.finish_leftovers()
        return reader
    state, info = _json(path / STATE), _json(path / INFO)
    names = _shards(path, state)
    reader = _table(path, names, options, tables.IPC_STREAM)
    reader.state = state
    written_info = {key: value for key, value in info.items()
                    if key in STRUCTURAL_INFO or reader.left.attribute(INFO, key, (), "dataset_info field")}
    written_info["features"] = {k: v for k, v in info.get("features", {}).items() if k in reader.written} \
        if isinstance(info.get("features"), dict) else info.get("features")
    reader.info = written_info
    reader.others = _others(path, reader.left, {STATE, INFO, *names})
    reader.finish_leftovers()
    return reader


def _others(path: Path, left: leftovers.Leftovers, known: set[str]) -> list[str]:
    """The folder's other files: copied when --keep names them, else listed as dropped."""
    copied = []
    for directory, dirs, files in os.walk(path):
        for hidden in sorted(d for d in dirs if is_hidden(d)):  # .git, .cache, __MACOSX: never read
            rel = (Path(directory) / hidden).relative_to(path).as_posix()
            left.drop(rel + "/", "folder", HIDDEN_REASON)
        dirs[:] = sorted(d for d in dirs if not is_hidden(d))
        for name in sorted(files):
            rel = (Path(directory) / name).relative_to(path).as_posix()
            if rel in known:
                continue
            if left.kept(rel):
                left.copied(rel, "file", leftovers.KEPT)
                copied.append(rel)
            else:
                left.drop(rel, "file", "not a shard the dataset's state.json names (a cache file of map, ...), "
                          "not perturbed")
    return copied


class DatasetFolderWriter(Writer):
    """The shards (tables_writer.TableWriter), then state.json, dataset_info.json and the files
    --keep names."""

    def __init__(self, reader: tables_reader.FolderTableReader, tmp_path: Path, dtype: np.dtype):
        from tldp_cli.formats import tables_writer

        self.reader, self.root = reader, tmp_path
        with writing(tmp_path):
            tmp_path.mkdir()
        for name in reader.shards:
            with writing(tmp_path / name):
                (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        self.table = tables_writer.TableWriter(reader, [tmp_path / name for name in reader.shards], dtype)
        self.postprocessing = list(self.table.postprocessing)
        if reader.state is not None:
            self.postprocessing.append("state.json: _fingerprint (a hash datasets computes from the raw data) "
                                       "replaced by a hash of the shards written")
        self.output_dtype = self.table.output_dtype
        self.manifest_extra = self.table.manifest_extra

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        self.table.write(job, start, block)

    def finish(self) -> None:
        self.table.finish()
        saved = self.reader.state
        state = None if saved is None else dict(saved, _fingerprint=self._fingerprint())
        if state is not None and isinstance(state.get("_format_columns"), list):  # set_format's columns written
            state["_format_columns"] = [c for c in state["_format_columns"] if c in self.reader.written]
        for name, value in ((STATE, state), (INFO, self.reader.info)) if state is not None else ():
            target = self.root / name
            with writing(target), open(target, "x") as f:
                json.dump(value, f, indent=2)
        for rel in self.reader.others:
            target = self.root / rel
            with writing(target):
                target.parent.mkdir(parents=True, exist_ok=True)
            with open_regular(self.reader.path / rel, follow_links=False) as src, writing(target), open(target, "xb") as dst:
                copy_bytes(src, self.reader.path / rel, dst, target)

    def _fingerprint(self) -> str:
        """The output's own fingerprint: a hash of the shards written (of the release, never
        of the raw data), as datasets' are 16 hex digits."""
        digest = hashlib.sha256()
        for name in self.reader.shards:
            with open(self.root / name, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
        return digest.hexdigest()[:16]

    def close(self) -> list[Path]:
        written = self.table.close()
        return flushed_files(self.root, set(written)) if self.root.is_dir() else written


def create_writer(reader: tables_reader.FolderTableReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> Writer:
    return DatasetFolderWriter(reader, tmp_path, dtype)


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    from tldp_cli.formats import tables

    return tables.output_bytes(jobs, dtype, options)


def is_earlier_output(path: Path, reader: tables_reader.FolderTableReader) -> bool:
    """A dataset folder that holds the shards, state.json and dataset_info.json and the
    files --keep copies, nothing else."""
    saved = {STATE, INFO} if reader.state is not None else set()
    expected = {*saved, *reader.shards, *reader.others}
    found = {(Path(d) / name).relative_to(path).as_posix() for d, _, files in os.walk(path) for name in files}
    return found <= expected and saved <= found and bool(found)


FORMAT = Format(
    name=NAME, title="Hugging Face dataset folder", folder=True, member_noun="column",
    selects_arrays=True, honours_keep=True, shares_rows=True, writes_rows=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    output_bytes=output_bytes, earlier_output=is_earlier_output,
    docs=(DocRow("Hugging Face dataset folder (`Dataset.save_to_disk`)",
                 "a directory with `state.json` and `dataset_info.json`",
                 "`tldp perturb mnist_train --eps 1`",
                 "`mnist_train.tldp/`: same Arrow shards and record batches, features; `datasets.load_from_disk` "
                 "loads it; columns as in Parquet"),
          DocRow("folder of Parquet files (a Hugging Face Hub dataset: `data/train-00000-of-00002.parquet`, ...)",
                 "a directory of `.parquet` files and no image (nor an imagefolder's `metadata.parquet`)",
                 "`tldp perturb mnist --eps 1`",
                 "`mnist.tldp/`: the same files under the same paths, each with its row groups; the dataset "
                 "card (README.md) and other files dropped unless --keep")),
)
