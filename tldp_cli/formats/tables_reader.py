"""The reader of a table (formats/tables.py) the Parquet file, Arrow file and dataset folder
formats share: the columns perturbed, one ArrayJob each (ColumnRead reads their records,
whole batches at a time), and what is left out (formats.leftovers).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import pyarrow as pa

import numpy as np

from tldp_cli.errors import InputError, UsageError
from tldp_cli.formats import ArrayJob, FormatOptions, Reader, leftovers, listing, plural
from tldp_cli.formats.tables import (EXTENSION_KEYS, HF_KEY, IMAGE, NUMBER, OTHER, PARQUET, PATH_FIELD, TENSOR, Column,
                                     Part, Table, classify, features_of, hf_info, holds_file_names, image_struct,
                                     numbers)
from tldp_cli.formats.tables_images import image_bytes, image_header, image_values

LABEL_MAP_REASON = "label maps (palette images: a segmentation's class indices, not pixel values)"
FEATURE_ID_REASON = "free text (a feature's optional id, which datasets writes as given), not perturbed"


@dataclass(frozen=True)
class ColumnRead:
    """Reads rows [start, stop) of one column as an array of records (ArrayJob.read).
    Picklable: opens the files inside each call."""

    table: Table
    column: Column
    dtype: np.dtype
    shape: tuple[int, ...]  # a record's
    source: Path
    first: int = 0  # the table's row of record 0 (an image of a column of several sizes: its row)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        start, stop = start + self.first, stop + self.first
        where = f"{self.source}: rows {start} to {stop - 1}"
        if self.first and stop - start == 1:  # one image of a column of several sizes
            data = row_of_batch(self.table, self.column.name, start)
        else:
            data = self.table.read([self.column.name], start, stop).column(0)
        if self.column.kind != IMAGE:
            return numbers(data, self.column, stop - start, where).astype(self.dtype, copy=False)
        out = np.empty((stop - start, *self.shape), self.dtype)
        for i, value in enumerate(image_bytes(data).to_pylist()):
            row = f"{self.source}: row {start + i} of column {self.column.name}"
            if value is None:
                image_header(value, row)
            colour = image_values(value, row)[0].colour
            if colour.shape != self.shape or colour.dtype != self.dtype:
                raise InputError(f"{row}: the image changed while tldp was reading the file")
            out[i] = colour
        return out


def row_of_batch(table: Table, column: str, row: int) -> pa.Array:
    """Row `row` of a column, from its batch kept in memory while the rows after it are
    read (the images of a column of several sizes are each a record: one read a batch)."""
    for p, b, first, rows in table.batches():
        if first <= row < first + rows:
            part = table.parts[p]
            stat = part.path.stat()
            batch = _cached_batch(part, b, column, (stat.st_ino, stat.st_size, stat.st_mtime_ns))
            return batch.slice(row - first, 1)
    raise IndexError(row)


@functools.lru_cache(maxsize=2)
def _cached_batch(part: Part, batch: int, column: str, version: tuple[int, int, int]) -> pa.Array:
    data = part.read(batch, [column]).column(0)
    return pa.concat_arrays(data.chunks) if data.num_chunks != 1 else data.chunk(0)


def image_job_name(column: str, row: int) -> str:
    """The array of one image of a column of several sizes (its random streams' key)."""
    return f"{column}[{row}]"


class TableReader(Reader):
    """The columns of a table to perturb, one ArrayJob each (named by the column), and what
    is left out (formats.leftovers)."""

    keeps_dtypes = True  # each column written back in its own type (tables.stored)

    def __init__(self, path: Path, table: Table, schema: pa.Schema, options: FormatOptions, name: str,
                 settings: dict[str, Any] | None = None, considered: bool = False):
        """`considered`: the format decides more leftovers (a folder's files), then calls
        finish_leftovers; else it is called here."""
        self.path, self.table, self.schema, self.format = path, table, schema, name
        self.settings = settings or {}
        if options.exclude:
            raise UsageError(f"{path}: --exclude does not apply to tables: name the columns to perturb "
                             "with --dataset")
        if not table.rows:
            raise InputError(f"{path}: the table has no rows; nothing to perturb")
        twice = sorted({name for name in schema.names if schema.names.count(name) > 1})
        if twice:
            raise InputError(f"{path}: holds more than one column named {', '.join(twice)}")
        self.features = features_of(schema)
        self.columns = [classify(f, self.features.get(f.name)) for f in schema]
        self.requested = list(options.datasets)
        self.label_maps: list[str] = []  # image columns of palette images (label maps), not perturbed
        self.chosen = self._choose(options.datasets)
        self.images: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}  # by column: pixels' dtype, shape
        # by column of images of several sizes: each row's (dtype, shape); each image a record
        self.each_image: dict[str, list[tuple[np.dtype, tuple[int, ...]]]] = {}
        self.image_formats: dict[str, list[str]] = {}  # by column: the Pillow formats found
        self.list_shapes: dict[str, tuple[int, ...]] = {}  # by variable-length list column: its rows' shape
        self.alpha: dict[str, int] = {}  # by image column: how many of its images have an alpha channel
        self.icc: dict[str, int] = {}  # by image column: how many of its images carry an ICC profile
        paths = self._scan()
        self.left = leftovers.Leftovers(list(options.keep))
        self.left.considered(c.name for c in self.chosen)
        self.written = self._leftovers(paths)  # the columns of the output, in order
        if not considered:
            self.finish_leftovers()
        shown = ", ".join(c.name for c in self.chosen)
        self.messages = [f"perturbing column{'s' if len(self.chosen) > 1 else ''} {shown} of {path.name}, "
                         f"{plural(table.rows, 'row')} (one record a row; choose with --dataset)"]

    def finish_leftovers(self) -> None:
        """Refuses a --keep that matches nothing; the manifest's unperturbed and dropped."""
        self.left.check(self.path)
        self.manifest_extra = self.left.manifest_extra()

    def _choose(self, requested: list[str]) -> list[Column]:
        by_name = {c.name: c for c in self.columns}
        if requested:
            for name in requested:
                column = by_name.get(name)
                if column is None:
                    raise InputError(f"{self.path}: no column {name} (columns: {listing(list(by_name))})")
                if column.kind == OTHER:
                    raise InputError(f"{self.path}: column {name} is {column.why}, which tldp does not perturb "
                                     "(it perturbs images, numbers and lists of numbers)")
            return [c for c in self.columns if c.name in requested]
        chosen = [c for c in self.columns if c.kind in (IMAGE, TENSOR)]
        if not chosen:
            numeric = [c.name for c in self.columns if c.kind == NUMBER]
            hint = (f"; its numeric columns ({listing(numeric)}) are perturbed when --dataset names them"
                    if numeric else "")
            others = [f"{c.name} ({c.why})" for c in self.columns if c.kind == OTHER]
            hint += f"; not perturbed: {listing(others)}" if others else ""
            raise InputError(f"{self.path}: no image or tensor column to perturb{hint}")
        return chosen

    def _scan(self) -> dict[str, bool]:
        """Reads the chosen image and list columns once: each image's header (one size and bit
        depth a column), each list's lengths (one shape a column), no nulls. Returns, by image
        column, whether any row names a file (path)."""
        paths = {}
        scanned = [c for c in self.chosen if c.kind == IMAGE or (c.kind == TENSOR and 0 in c.levels)]
        for column in scanned:
            if column.kind == TENSOR:
                self._list_shape(column)
                continue
            each, formats, named, maps, alpha, icc = [], set(), False, [], 0, 0
            for p, b, first, rows in self.table.batches():
                data = self.table.parts[p].read(b, [column.name]).column(0)
                struct = pa.concat_arrays(data.chunks) if data.num_chunks != 1 else data.chunk(0)
                named = named or struct.field(PATH_FIELD).null_count < len(struct)
                for i, value in enumerate(struct.field("bytes").to_pylist()):
                    head, kind = image_header(value, f"{self.path}: row {first + i} of column {column.name}")
                    if head is None:
                        maps.append(first + i)
                        continue
                    each.append((head.dtype.str, head.shape))
                    formats.add(kind)
                    alpha += head.has_alpha
                    icc += head.has_icc
            if maps:
                self._label_maps(column, maps)
                continue
            found = set(each)
            if len(found) > 1:
                self._several_sizes(column, found, each)
            dtype, shape = each[0]
            self.images[column.name] = (np.dtype(dtype), shape)
            self.image_formats[column.name] = sorted(formats)
            self.alpha[column.name] = alpha
            self.icc[column.name] = icc
            paths[column.name] = named
        self.chosen = [self._shaped(c) for c in self.chosen if c.name not in self.label_maps]
        if not self.chosen:
            raise InputError(f"{self.path}: no image or tensor column to perturb (the image columns "
                             f"{listing(self.label_maps)} are label maps: palette images)")
        self.columns = [Column(c.name, OTHER, c.type, why=LABEL_MAP_REASON) if c.name in self.label_maps else c
                        for c in self.columns]
        return paths

    def _label_maps(self, column: Column, maps: list[int]) -> None:
        """A column of palette images: label maps (a segmentation's class indices), not
        perturbed but left out or kept, as in an image folder; refused where --dataset names
        it, or where only some of its images are."""
        if len(maps) < self.table.rows:
            raise InputError(f"{self.path}: row {maps[0]} of column {column.name} is a palette image (a label "
                             "map: class indices), among images of pixel values; tldp perturbs a column of "
                             "one kind")
        if column.name in self.requested:
            raise InputError(f"{self.path}: column {column.name} holds palette images ({LABEL_MAP_REASON}); "
                             "leave it out of --dataset (--keep copies it raw)")
        self.label_maps.append(column.name)

    def _several_sizes(self, column: Column, found: set, each: list) -> None:
        """An image column of several sizes or bit depths: each image is a record of its own
        (an array of one record, as in an image folder); refused beside other columns, whose
        row i could not join image i in one record."""
        if len(self.chosen) > 1:
            sizes = sorted(f"{'x'.join(map(str, shape))} {np.dtype(dtype)}" for dtype, shape in found)
            raise InputError(f"{self.path}: column {column.name} holds images of {len(found)} sizes or bit "
                             f"depths ({listing(sizes)}), so each image is a record of its own, which "
                             "cannot join the other columns' rows: perturb it alone (--dataset "
                             f"{column.name}), or the other columns")
        self.each_image[column.name] = [(np.dtype(dtype), shape) for dtype, shape in each]
        self.record_description = f"one image of column {column.name} (its images differ in size)"

    def _list_shape(self, column: Column) -> None:
        """The shape of a variable-length list column, from its first row; every row is
        checked against it as it is read."""
        first = self.table.read([column.name], 0, 1).column(0)
        shape, values = [], first.combine_chunks() if isinstance(first, pa.ChunkedArray) else first
        for _ in column.levels:
            values = values.storage if isinstance(values, pa.ExtensionArray) else values
            shape.append(len(values[0]) if len(values) and values[0].is_valid else 0)
            values = values.flatten()
        if 0 in shape:
            raise InputError(f"{self.path}: column {column.name} starts with an empty list or a null; tldp "
                             "perturbs list columns whose rows share one shape")
        self.list_shapes[column.name] = tuple(shape)
        for p, b, first_row, rows in self.table.batches():  # every row: the same lengths
            numbers(self.table.parts[p].read(b, [column.name]).column(0),
                    Column(column.name, TENSOR, column.type, column.dtype, tuple(shape), tuple(shape)), rows,
                    f"{self.path}: rows from {first_row}")

    def _shaped(self, column: Column) -> Column:
        shapes = self.list_shapes
        if column.name in self.images:
            dtype, shape = self.images[column.name]
            return Column(column.name, IMAGE, column.type, dtype, tuple(shape))
        if column.name in shapes:
            return Column(column.name, TENSOR, column.type, column.dtype, shapes[column.name], shapes[column.name])
        return column

    def _leftovers(self, paths: dict[str, bool]) -> list[str]:
        """The columns the output holds (the perturbed and those --keep names); the others,
        the images' paths and the schema's metadata listed as dropped unless kept."""
        chosen = {c.name for c in self.chosen}
        written = []
        for column in self.columns:
            if column.name in chosen:
                written.append(column.name)
            elif self.left.kept(column.name):
                self.left.copied(column.name, "column", leftovers.KEPT)
                written.append(column.name)
                if holds_file_names(column.type):  # its paths follow the rule of a perturbed column's
                    paths[column.name] = _names_files(self.table, column.name)
            else:
                why = (f"{column.why}, not perturbed" if column.why else
                       "numbers, perturbed only when --dataset names the column" if column.kind == NUMBER else
                       f"{'an' if column.kind == IMAGE else 'a'} {column.kind} column --dataset does not "
                       "name, not perturbed")
                self.left.drop(column.name, "column", why)
        self.keep_paths = {}
        for name, named in paths.items():
            if named:
                kept = self.left.kept(f"{name}.{PATH_FIELD}")
                self.keep_paths[name] = kept
                if kept:
                    self.left.copied(f"{name}.{PATH_FIELD}", "image path field", leftovers.KEPT)
                else:
                    self.left.drop(f"{name}.{PATH_FIELD}", "image path field",
                                   "the images' file names, which can name a person; written as null")
        # By image column: whether --keep COLUMN.alpha copies its images' alpha channels.
        self.keep_alpha = {name: self.left.alpha_channels(count, "image", f"{name}.{leftovers.ALPHA}",
                                                          f" of column {name}")
                           for name, count in self.alpha.items()}
        # By image column: whether --keep COLUMN.icc_profile keeps its images' ICC profiles.
        self.keep_icc = {name: self.left.icc_profiles(count, name=f"{name}.{leftovers.ICC_PROFILE}")
                         for name, count in self.icc.items()}
        self.hf_info = {key: value for key, value in hf_info(self.schema).items() if key == "features"
                        or self.left.attribute(HF_KEY.decode(), key, (), "huggingface info field")}
        # The features of the columns written, each feature's id (free text) left out unless kept.
        self.out_features = without_ids({name: value for name, value in self.features.items() if name in written},
                                        HF_KEY.decode(), "features", self.left) \
            if HF_KEY in (self.schema.metadata or {}) else {}
        self.metadata = {key: value for key, value in (self.schema.metadata or {}).items()
                         if key == HF_KEY or self.left.attribute("", key.decode("utf-8", "replace"), (),
                                                                  "schema metadata key")}
        self.field_metadata = {f.name: {k: v for k, v in (f.metadata or {}).items()
                                        if k in EXTENSION_KEYS or self.left.attribute(
                                            f.name, k.decode("utf-8", "replace"), (), "column metadata key")}
                               for f in self.schema if f.name in written}
        return written

    def arrays(self) -> list[ArrayJob]:
        step = max(self.table.parts[0].batches, default=0) or None
        jobs = []
        for column in self.chosen:
            if column.name in self.each_image:
                jobs += self._image_jobs(column)
                continue
            dtype = column.values_dtype
            jobs.append(ArrayJob(
                name=column.name, shape=(self.table.rows, *column.shape), dtype=dtype,
                read=ColumnRead(self.table, column, dtype, column.shape, self.path), chunk_records=step,
                source={"path": str(self.path), "format": self.format, "dataset": column.name,
                        "shape": [self.table.rows, *column.shape], "dtype": str(dtype)}))
        return jobs

    def _image_jobs(self, column: Column) -> list[ArrayJob]:
        """One array of one record a row: the images of a column of several sizes."""
        jobs = []
        for row, (dtype, shape) in enumerate(self.each_image[column.name]):
            jobs.append(ArrayJob(
                name=image_job_name(column.name, row), shape=(1, *shape), dtype=dtype,
                read=ColumnRead(self.table, column, dtype, shape, self.path, row),
                source={"path": str(self.path), "format": self.format, "dataset": column.name, "row": row,
                        "shape": [1, *shape], "dtype": str(dtype)}))
        return jobs

    def job_rows(self) -> dict[str, tuple[str, int]]:
        """By array name, its column and the table's row of its record 0."""
        found = {}
        for column in self.chosen:
            if column.name in self.each_image:
                found.update({image_job_name(column.name, row): (column.name, row)
                              for row in range(len(self.each_image[column.name]))})
            else:
                found[column.name] = (column.name, 0)
        return found

    def rows(self, jobs: list[ArrayJob]) -> list[list[str]] | None:
        """Row i of every perturbed column is one record; each image of a column of several
        sizes is a record of its own (such a column is perturbed alone)."""
        if self.each_image:
            return []
        return [[job.name for job in jobs]] if len(jobs) > 1 else []

    def output_schema(self) -> pa.Schema:
        """The output's schema: the columns written, their types and structural metadata, and
        the Hugging Face features of those columns."""
        fields = [self.schema.field(name).with_metadata(self.field_metadata[name] or None)
                  for name in self.written]
        metadata = dict(self.metadata)
        if HF_KEY in metadata:
            metadata[HF_KEY] = json.dumps({"info": {**self.hf_info, "features": self.out_features}}).encode()
        return pa.schema(fields, metadata=metadata or None)


class FolderTableReader(TableReader):
    """The shards of a dataset folder read as one table (dataset_folder.py), with what its
    writer needs besides: the shards (relative paths, in row order), save_to_disk's
    state.json and dataset_info.json as they are written, by the folder holding them
    ("" for the input itself, a DatasetDict's split folders; none for a folder of Parquet
    files), a DatasetDict's dataset_dict.json as written (None for any other folder), and
    the folder's other files that are copied."""

    shards: list[str]
    saved: dict[str, tuple[dict[str, Any], dict[str, Any]]]
    dataset_dict: dict[str, Any] | None = None
    others: list[str]


def without_ids(value: Any, owner: str, path: str, left: leftovers.Leftovers) -> Any:
    """Hugging Face features (JSON, as `Features.to_dict` writes them) without the `id` of
    each feature (a dict with `_type`; every feature type has an optional id, free text that
    datasets copies as given), at any depth; each left out is listed as OWNER@PATH.id
    (`dataset_info.json@features.label.id`) unless --keep names it. A struct's fields (a dict
    without `_type`) are column names: a field named id is kept."""
    if isinstance(value, list):
        return [without_ids(item, owner, f"{path}.{i}", left) for i, item in enumerate(value)]
    if not isinstance(value, dict):
        return value
    feature = "_type" in value
    out = {}
    for key, item in value.items():
        if feature and key == "id" and item is not None and \
                not left.attribute(owner, f"{path}.id", (), "feature id", FEATURE_ID_REASON):
            continue
        out[key] = without_ids(item, owner, f"{path}.{key}", left)
    return out


def _names_files(table: Table, name: str) -> bool:
    """Whether any row of a column of `bytes` and `path` structs names a file."""
    for p, b, _, _ in table.batches():
        part = table.parts[p]
        nested = part.layout == PARQUET and "." not in name  # Parquet reads the one field
        paths = image_struct(part.read(b, [f"{name}.{PATH_FIELD}" if nested else name]).column(0)).field(PATH_FIELD)
        if paths.null_count < len(paths):
            return True
    return False
