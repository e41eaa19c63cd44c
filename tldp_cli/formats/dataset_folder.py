"""Hugging Face dataset folders, as `Dataset.save_to_disk` writes them: `state.json` (which
names the Arrow shards, in row order), `dataset_info.json` (the features and a description
of the dataset) and `data-00000-of-0000N.arrow` shards (Arrow IPC streams). The shards
are one table: row i of it is one record across the columns perturbed, as in a Parquet
file (formats/tables.py has the rules for columns).

The output folder has the same shards, each with its record batches, and a state.json
naming them, whose `_fingerprint` (a hash `datasets` computes from the data) is replaced
by a hash of the shards written; `dataset_info.json` keeps the features of the columns written
(without each feature's id, free text: tables_reader.without_ids), the builder's and
configuration's names and the version (STRUCTURAL_INFO; the version's description left out);
its other fields (description, citation, dataset_name, sizes, checksums of the downloaded
files, ...) and the folder's other files
(cache files of `map`, ...) are left out and listed unless --keep names them
(dataset_info.json@FIELD, a file's name); a --keep naming a file that holds data (a cache
or indices file of map, select or shuffle: the rows raw; formats.data_file) is refused.
`datasets.load_from_disk` loads it with the same features.

A DatasetDict folder, as `DatasetDict.save_to_disk` writes it (`dataset_dict.json`, whose
`splits` name the splits in order, and a save_to_disk folder per split), is one table too:
the splits' shards in that order, every row of every split one record of one release (as
the splits of a Hub folder of Parquet files are); they must share their columns. A
person with rows in several splits has a record in each, which tldp cannot tell (the
ledger knows records by their content). The output has the same splits, each written as
a save_to_disk folder is, and dataset_dict.json's `splits`; `datasets.load_from_disk`
loads it as a DatasetDict with the same splits, features and rows. --dataset names
columns, in every split; a split is released alone by giving its folder (dd/train). The
manifest lists the splits and their rows (`splits`).

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
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tldp_cli.errors import InputError, UsageError
from tldp_cli.files.checked_io import copy_bytes, flushed_files, json_value, open_regular, writing
from tldp_cli.formats import (HIDDEN_REASON, ArrayJob, DocRow, Format, FormatOptions, Writer, data_file, folder_output,
                              is_hidden, leftovers, plural)

if TYPE_CHECKING:  # imported where used: pyarrow is not loaded to detect the format
    import pyarrow as pa

    from tldp_cli.formats import tables_reader

NAME = "hf-dataset"
STATE, INFO = "state.json", "dataset_info.json"
DICT = "dataset_dict.json"  # DatasetDict.save_to_disk: one save_to_disk folder per split
SPLIT_NAME = re.compile(r"\w+(\.\w+)*")  # datasets' split names (naming._split_re)
# dataset_name is not among them: load_dataset names a local folder's dataset by the folder's name.
STRUCTURAL_INFO = ("features", "builder_name", "config_name", "version")
# What Dataset.save_to_disk writes in state.json (and load_from_disk reads): any other key is
# not datasets', and follows the rule of dataset_info.json's other fields (STATE@KEY).
STATE_KEYS = ("_data_files", "_fingerprint", "_format_columns", "_format_kwargs", "_format_type",
              "_output_all_columns", "_split")


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


def _splits(path: Path) -> tuple[list[str], dict[str, Any]]:
    """The splits dataset_dict.json names, in its order, each a save_to_disk folder of the
    folder; and the document."""
    document = _json(path / DICT)
    splits = document.get("splits")
    if not isinstance(splits, list) or not splits or not all(isinstance(s, str) for s in splits):
        raise InputError(f"{path / DICT}: names no splits (a list of split names); the DatasetDict folder is damaged")
    for split in splits:
        if not SPLIT_NAME.fullmatch(split):  # datasets' own rule, which keeps it a folder of the folder
            raise InputError(f"{path / DICT}: names split {split!r}, which is not a split name (word characters "
                             "joined by dots)")
        if splits.count(split) > 1:
            raise InputError(f"{path / DICT}: names split {split} twice")
        if is_hidden(split):  # its files would be listed as never read, and written
            raise InputError(f"{path / DICT}: names split {split}, a folder tldp never reads ({HIDDEN_REASON})")
        if not _saved(path / split):
            raise InputError(f"{path / DICT}: names split {split}, but {path / split} is not a dataset folder "
                             f"({STATE} and {INFO})")
    _once_each(path, splits, "split folder")
    return splits, document


def _once_each(path: Path, names: list[str], what: str) -> None:
    """Refuses two of `names` (files or folders of `path`) that are one (a link to the other,
    a hard link): its rows would be released twice, each copy a record of its own, and a
    person in them charged twice the per-record figure the manifest states."""
    seen: dict[tuple[int, int], str] = {}
    for name in names:
        try:
            found = os.stat(path / name)
        except OSError as exc:
            raise InputError(f"{path / name}: cannot read ({exc.strerror or exc})") from None
        other = seen.setdefault((found.st_dev, found.st_ino), name)
        if other != name:
            raise InputError(f"{path / name}: the same {what} as {path / other} (a link); its rows would be "
                             f"released twice, each a record: give each {what} once")


def _rel(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


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
        if names.count(name) > 1:
            raise InputError(f"{path / STATE}: names {name} twice; the dataset folder is damaged")
        if "/" in name or "\\" in name or name in (".", "..") or not (path / name).is_file():
            raise InputError(f"{path / STATE}: names {name}, which is not a file of the folder")
    if state.get("_indices_data_files"):
        raise InputError(f"{path}: the dataset has an indices mapping (_indices_data_files); save it "
                         "with flatten_indices() first")
    return names


def _a(layout: str) -> str:
    return "an" if layout.startswith("Arrow") else "a"


def _table(path: Path, names: list[str], options: FormatOptions, layout: str,
           apart: str = "configuration") -> tables_reader.FolderTableReader:
    """The shards as one table's reader; they must share their columns (else each `apart`,
    a configuration or a split, is perturbed on its own)."""
    from tldp_cli.formats import tables, tables_reader

    parts: list[tables.Part] = []
    schema: pa.Schema | None = None
    settings: dict[str, Any] = {}
    other: list[tuple[str, str | None, str]] = []  # (shard, column, key): its metadata apart from the first's
    _once_each(path, names, "file")
    for name in names:
        found = tables.layout_of(path / name)
        if found != layout:  # a shard of one file only, too: the folder's kind says what it should be
            raise InputError(f"{path / name}: " + (
                f"not a readable {layout}, as the folder's data files are; it may be truncated or corrupt"
                if found is None else f"{_a(found)} {found}, where the folder's data files are {layout}s"))
        part, found, found_settings = tables.open_part(path / name, layout)
        if schema is not None and not found.remove_metadata().equals(schema.remove_metadata()):
            raise InputError(f"{path / name}: has other columns or types than {names[0]}; perturb each "
                             f"{apart}'s folder on its own")
        other += [] if schema is None else [(name, *entry) for entry in _metadata_apart(schema, found)]
        schema, settings = schema or found, settings or found_settings
        parts.append(part)
    reader = tables_reader.FolderTableReader(path, tables.Table(tuple(parts)), schema, options, NAME, settings,
                                             considered=True)
    for name, column, key in other:  # a column left out is listed already
        if column is None or column in reader.written:
            reader.left.drop(f"{name}@{key if column is None else f'{column}.{key}'}", "schema metadata key",
                             f"this file's own, where the output's files all carry {names[0]}'s schema metadata "
                             "(its features, the keys --keep names)")
    reader.shards, reader.saved = names, {}
    return reader


def _metadata_apart(first: pa.Schema, found: pa.Schema) -> list[tuple[str | None, str]]:
    """The schema metadata keys (column None) and column metadata keys of a shard's schema
    `found` that the first shard's lacks or holds otherwise: the output's shards are written
    with the first's, so they are left out of this shard's and listed."""
    def decoded(metadata: dict | None) -> dict[str, bytes]:
        return {key.decode("utf-8", "replace"): value for key, value in (metadata or {}).items()}

    apart: list[tuple[str | None, str]] = []
    for column, ours, theirs in [(None, first.metadata, found.metadata),
                                 *((f.name, first.field(f.name).metadata, f.metadata) for f in found)]:
        ours = decoded(ours)
        apart += [(column, key) for key, value in decoded(theirs).items() if ours.get(key) != value]
    return apart


def open_reader(path: Path, options: FormatOptions) -> tables_reader.FolderTableReader:
    from tldp_cli.formats import tables

    if not _saved(path) and not (path / DICT).is_file():
        names = _parquet_files(path)
        if names is None:
            raise InputError(f"{path}: no Parquet files, nor a state.json and dataset_info.json (a dataset "
                             "folder of save_to_disk)")
        reader = _table(path, names, options, tables.PARQUET)
        reader.others = _others(path, reader.left, set(names))
        reader.finish_leftovers()
        return reader
    splits, document = _splits(path) if not _saved(path) else ([""], None)
    saved = {folder: (_json(path / folder / STATE), _json(path / folder / INFO)) for folder in splits}
    by_folder = {folder: [_rel(folder, name) for name in _shards(path / folder, saved[folder][0])]
                 for folder in splits}
    names = [name for folder in splits for name in by_folder[folder]]
    try:
        reader = _table(path, names, options, tables.IPC_STREAM, "configuration" if document is None else "split")
    except InputError as exc:
        split = next((name for name in options.datasets if document is not None and name in splits), None)
        if split is None or "no column" not in str(exc):
            raise
        raise InputError(f"{exc}; {split} is a split: perturb its folder, {path / split}, to release it alone "
                         "(--dataset names columns)") from None
    reader.saved = {folder: (_written_state(reader, _rel(folder, STATE), state),
                             _written_info(reader, _rel(folder, INFO), info))
                    for folder, (state, info) in saved.items()}
    known = {_rel(folder, name) for folder in splits for name in (STATE, INFO)} | set(names)
    reader.others = _others(path, reader.left, known if document is None else known | {DICT})
    if document is not None:
        reader.dataset_dict = {key: value for key, value in document.items()
                               if key == "splits" or reader.left.attribute(DICT, key, (), "dataset_dict.json key")}
    reader.finish_leftovers()
    if document is not None:
        _split_rows(reader, path, splits, by_folder)
    return reader


def _written_state(reader: tables_reader.FolderTableReader, owner: str, state: dict[str, Any]) -> dict[str, Any]:
    """state.json as written (its _fingerprint replaced by the writer): the keys datasets
    writes, each data file by its name only; the keys --keep names (OWNER@KEY); the others
    listed as dropped."""
    written = {key: value for key, value in state.items()
               if key in STATE_KEYS or reader.left.attribute(owner, key, (), "state.json key")}
    written["_data_files"] = [{"filename": entry["filename"]} for entry in state["_data_files"]]
    return written


def _written_info(reader: tables_reader.FolderTableReader, owner: str, info: dict[str, Any]) -> dict[str, Any]:
    """dataset_info.json as written: its structural fields, the features of the columns
    written, the fields --keep names (OWNER@FIELD); the others listed as dropped."""
    written = {key: value for key, value in info.items()
               if key in STRUCTURAL_INFO or reader.left.attribute(owner, key, (), "dataset_info field")}
    from tldp_cli.formats.tables_reader import without_ids

    written["features"] = without_ids({k: v for k, v in info["features"].items() if k in reader.written}, owner,
                                      "features", reader.left) \
        if isinstance(info.get("features"), dict) else info.get("features")
    version = written.get("version")
    if isinstance(version, dict) and version.get("description") is not None and \
            not reader.left.attribute(owner, "version.description", (), "dataset_info field"):
        written["version"] = {key: value for key, value in version.items() if key != "description"}
    return written


def _split_rows(reader: tables_reader.FolderTableReader, path: Path, splits: list[str],
                by_folder: dict[str, list[str]]) -> None:
    """A DatasetDict's splits in the manifest (`splits`) and in a message: one table, every
    row of every split one record."""
    rows, parts = [], iter(reader.table.parts)
    for split in splits:
        rows.append(sum(next(parts).rows for _ in by_folder[split]))
    reader.manifest_extra = {**reader.manifest_extra,
                             "splits": [{"name": split, "rows": n} for split, n in zip(splits, rows)]}
    shown = ", ".join(f"{split}: {plural(n, 'row')}" for split, n in zip(splits, rows))
    reader.messages = [*reader.messages, f"{path.name}: a DatasetDict of {plural(len(splits), 'split')} "
                       f"({shown}), one release: every row of every split is one record (perturb a split's "
                       f"folder, {path / splits[0]}, to release it alone)"]


def _others(path: Path, left: leftovers.Leftovers, known: set[str]) -> list[str]:
    """The folder's other files: copied when --keep names them, else listed as dropped. A file
    holding data (formats.data_file: an Arrow cache or indices file of map, select or
    shuffle, a Parquet file, a pickle, ...) holds raw rows: a --keep naming it is refused, as
    in model folders."""
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
                data = data_file(path / rel)
                if data is not None:
                    raise UsageError(f"{path / rel}: holds {data}; tldp never copies it raw")
                left.copied(rel, "file", leftovers.KEPT)
                copied.append(rel)
            else:
                left.drop(rel, "file", "not a shard the dataset's state.json names (a cache file of map, ...), "
                          "not perturbed")
    return copied


class DatasetFolderWriter(Writer):
    """The shards (tables_writer.TableWriter), then state.json and dataset_info.json (each
    split's, and dataset_dict.json, for a DatasetDict) and the files --keep names."""

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
        if reader.saved:
            self.postprocessing.append("state.json: _fingerprint (a hash datasets computes from the raw data) "
                                       "replaced by a hash of the shards written"
                                       + (" (each split's, of its shards)" if reader.dataset_dict is not None else ""))
        self.output_dtype = self.table.output_dtype
        self.manifest_extra = self.table.manifest_extra

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        self.table.write(job, start, block)

    def finish(self) -> None:
        self.table.finish()
        written: list[tuple[str, Any]] = []
        for folder, (saved, info) in self.reader.saved.items():
            state = dict(saved, _fingerprint=self._fingerprint(folder))
            if isinstance(state.get("_format_columns"), list):  # set_format's columns written
                state["_format_columns"] = [c for c in state["_format_columns"] if c in self.reader.written]
            written += [(_rel(folder, STATE), state), (_rel(folder, INFO), info)]
        if self.reader.dataset_dict is not None:
            written.append((DICT, self.reader.dataset_dict))
        for name, value in written:
            target = self.root / name
            with writing(target), open(target, "x") as f:
                json.dump(value, f, indent=2)
        for rel in self.reader.others:
            target = self.root / rel
            with writing(target):
                target.parent.mkdir(parents=True, exist_ok=True)
            with open_regular(self.reader.path / rel, follow_links=False) as src, writing(target), open(target, "xb") as dst:
                copy_bytes(src, self.reader.path / rel, dst, target)

    def _fingerprint(self, folder: str) -> str:
        """The output's own fingerprint: a hash of the shards written in `folder` (of the
        release, never of the raw data), as datasets' are 16 hex digits."""
        digest = hashlib.sha256()
        for name in self.reader.shards:
            if os.path.dirname(name) != folder:
                continue
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
    """A dataset folder that holds the shards, state.json and dataset_info.json (each split's,
    and dataset_dict.json, for a DatasetDict) and the files --keep copies, nothing else."""
    saved = {_rel(folder, name) for folder in reader.saved for name in (STATE, INFO)}
    saved |= {DICT} if reader.dataset_dict is not None else set()
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
          DocRow("Hugging Face `DatasetDict` folder (`DatasetDict.save_to_disk`)",
                 "a directory with `dataset_dict.json` (and a dataset folder per split)",
                 "`tldp perturb mnist_dd --eps 1`",
                 "`mnist_dd.tldp/`: every split perturbed, one release (a record a row of any split); "
                 "`datasets.load_from_disk` loads the same splits, features and rows"),
          DocRow("folder of Parquet files (a Hugging Face Hub dataset: `data/train-00000-of-00002.parquet`, ...)",
                 "a directory of `.parquet` files and no image (nor an imagefolder's `metadata.parquet`)",
                 "`tldp perturb mnist --eps 1`",
                 "`mnist.tldp/`: the same files under the same paths, each with its row groups; the dataset "
                 "card (README.md) and other files dropped unless --keep")),
)
