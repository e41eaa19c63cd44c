"""Tables of named columns (Apache Arrow): what the Parquet file, Arrow file and Hugging Face
dataset folder formats share (formats/parquet_file.py, arrow_file.py, dataset_folder.py).

A table is one or more files (parts: a Parquet file, an Arrow IPC file or stream; a
folder's shards in order), each read batch by batch (Parquet row groups, Arrow record
batches). Row i of the table is one record: one subject's, across every column perturbed
(Reader.rows joins them, as HDF5 arrays that share their first axis).

Columns, by their Arrow type and their Hugging Face feature (the `huggingface` schema
metadata that `datasets` writes):
- image columns (the `Image` feature: a struct of `bytes` and `path`): each row's image
  decoded (formats/pixels.py), perturbed in its integer range, re-encoded; a column whose
  images share one size and bit depth is one array of records, a column of several sizes
  is perturbed alone, each image a record (an array) of its own, as in an image folder;
- tensor columns: (nested) lists of numbers whose rows have one shape (fixed-size lists,
  `datasets` Sequence(length=...) and Array2D-5D, pyarrow's fixed_shape_tensor, or lists
  whose every row has the same lengths);
- numeric columns (one number a row).
Image and tensor columns are perturbed unless --dataset names the columns to perturb; a
numeric column only when --dataset names it (a lone number per row is often a label or
an identifier). Every other column (labels, ClassLabel, text, numbers not chosen), the
images' `path` field (file names, which may name a person) and the schema's other
metadata are left out and listed in the manifest's `dropped`, unless --keep names them
(formats.leftovers): a column by its name, an image column's paths as COLUMN.path (a
kept column's too), a schema metadata key as @KEY. The alpha channels of the images
perturbed are left out too (RGBA written as RGB, LA as L; dropped), or copied unchanged
where --keep COLUMN.alpha names them (listed in `unperturbed`).

The output has the input's parts, batches (row group sizes), column order and types, and
the Hugging Face features of the columns it holds, so `datasets` loads it with the same
features: perturbed numbers are rounded and clipped back into their integer type, or
stored in their float type; images are written in 8 or 16 bits as their input, PNG as
lossless PNG and JPEG as JPEG, any other as PNG (the `Image` feature decodes either).

Blocks are read per column, whole batches at a time (ArrayJob.chunk_records), and the
pipeline hands them over in row order (Format.writes_rows): the writer keeps the blocks of
the batch it is assembling and writes each batch as soon as every perturbed column has
reached its end, so memory holds a few blocks, not the table.
"""

from __future__ import annotations

import functools
import io
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.formats import ArrayJob, FormatOptions, Reader, Writer, decode_reason, leftovers, listing, plural
from tldp_cli.formats.pixels import LabelMap, Unsupported, decode, header, png
from tldp_cli.formats.tensor_files import to_stored
from tldp_cli.files.checked_io import writing

PARQUET_MAGIC = b"PAR1"
IPC_FILE_MAGIC = b"ARROW1"
IPC_CONTINUATION = b"\xff\xff\xff\xff"
PYARROW_FOOTER_KEYS = (b"ARROW:schema", b"content_defined_chunking")  # how pyarrow wrote it
HF_KEY = b"huggingface"  # the schema metadata key of `datasets`' features
EXTENSION_KEYS = (b"ARROW:extension:name", b"ARROW:extension:metadata")  # structural: the column's type
# Layouts of a part (how its batches are read and written)
PARQUET, IPC_FILE, IPC_STREAM = "Parquet file", "Arrow IPC file", "Arrow IPC stream"
IMAGE, TENSOR, NUMBER, OTHER = "image", "tensor", "number", "other"
JPEG_QUALITY = 95
LABEL_MAP_REASON = "label maps (palette images: a segmentation's class indices, not pixel values)"
PATH_FIELD = "path"  # an image column's field of file names


# --- parts: the files of a table ---------------------------------------------------------

def layout_of(path: Path) -> str | None:
    """PARQUET, IPC_FILE or IPC_STREAM by the file's content; None for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if head[:4] == PARQUET_MAGIC:
        return PARQUET
    if head[:6] == IPC_FILE_MAGIC:
        return IPC_FILE
    if head[:4] == IPC_CONTINUATION and len(head) == 8:
        try:
            with pa.memory_map(str(path)) as source:
                pa.ipc.open_stream(source).schema
        except (pa.ArrowException, OSError, ValueError):
            return None
        return IPC_STREAM
    return None


@dataclass(frozen=True)
class Part:
    """One file of a table: its layout and the rows of each batch. Picklable: opens its
    file inside each call."""

    path: Path
    layout: str
    batches: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.batches)

    def read(self, batch: int, columns: list[str]) -> pa.Table:
        """Batch `batch` of the columns named; InputError names the file when it cannot be
        read (a damaged page, a file cut short since it was opened)."""
        try:
            return self._read(batch, columns)
        except MemoryError:
            raise
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read {'row group' if self.layout == PARQUET else 'record batch'} "
                             f"{batch} ({reason_of(exc)}); the file may be damaged") from None

    def _read(self, batch: int, columns: list[str]) -> pa.Table:
        if self.layout == PARQUET:
            return pq.ParquetFile(self.path).read_row_group(batch, columns=columns)
        with pa.memory_map(str(self.path)) as source:
            if self.layout == IPC_FILE:
                found = pa.ipc.open_file(source).get_batch(batch)
            else:
                reader = pa.ipc.open_stream(source)
                for _ in range(batch + 1):
                    found = reader.read_next_batch()
            return pa.Table.from_batches([found]).select(columns)


def open_part(path: Path, layout: str | None = None) -> tuple[Part, pa.Schema, dict[str, Any]]:
    """The part, its schema and, for Parquet, how it is written (version, compression by
    column); refuses what is not a readable table."""
    layout = layout or layout_of(path)
    try:
        if layout == PARQUET:
            meta = pq.ParquetFile(path).metadata
            schema = pq.ParquetFile(path).schema_arrow
            # The footer's key-value metadata outside the Arrow schema (written by Spark, DuckDB,
            # add_key_value_metadata) follows the schema metadata's rule: dropped and listed;
            # pyarrow's own (the schema; the content-defined chunking datasets turns on) is not.
            extra = {k: v for k, v in (meta.metadata or {}).items()
                     if k not in PYARROW_FOOTER_KEYS and k not in (schema.metadata or {})}
            if extra:
                schema = schema.with_metadata({**extra, **(schema.metadata or {})})
            batches = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
            return Part(path, layout, batches), schema, _parquet_settings(meta, schema)
        with pa.memory_map(str(path)) as source:
            if layout == IPC_FILE:
                reader = pa.ipc.open_file(source)
                batches = tuple(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            elif layout == IPC_STREAM:
                reader = pa.ipc.open_stream(source)
                batches = tuple(batch.num_rows for batch in reader)
            else:
                raise InputError(f"{path}: not a Parquet or Arrow file")
            return Part(path, layout, batches), reader.schema, {}
    except InputError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # ArrowInvalid, OSError on a truncated footer, ...
        raise InputError(f"{path}: not a readable {layout or 'table'} ({reason_of(exc)}); it may be "
                         "truncated or corrupt") from None


def _leaves(type_: pa.DataType) -> int:
    """How many Parquet leaf columns an Arrow type is stored in."""
    type_ = _storage(type_)
    if pa.types.is_struct(type_):
        return sum(_leaves(type_.field(i).type) for i in range(type_.num_fields))
    if pa.types.is_map(type_):
        return _leaves(type_.key_type) + _leaves(type_.item_type)
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        return _leaves(type_.value_type)
    return 1


def _parquet_settings(meta, schema: pa.Schema) -> dict[str, Any]:
    """The writer settings that keep the file's layout: format version, and the compression
    of each column's leaves (by the first row group)."""
    compression: dict[str, list[str]] = {}
    if meta.num_row_groups:
        group, leaf = meta.row_group(0), 0
        for field_ in schema:
            count = _leaves(field_.type)
            compression[field_.name] = [group.column(i).compression for i in range(leaf, leaf + count)]
            leaf += count
    return {"version": meta.format_version if meta.format_version in ("1.0", "2.4", "2.6") else "2.6",
            "compression": compression}


def parquet_compression(schema: pa.Schema, by_column: dict[str, list[str]] | None) -> dict[str, str] | str:
    """The ParquetWriter compression of the output's leaf columns (by their paths, which
    its writer names): each as the input's column's."""
    if not by_column:
        return "snappy"
    probe = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), probe)
    written = pq.ParquetFile(pa.BufferReader(probe.getvalue())).schema
    paths = [written.column(i).path for i in range(len(written))]
    codecs = [codec for field_ in schema for codec in by_column.get(field_.name, ["SNAPPY"] * _leaves(field_.type))]
    if len(codecs) != len(paths):
        return "snappy"
    return {path: "NONE" if codec == "UNCOMPRESSED" else codec for path, codec in zip(paths, codecs)}


@dataclass(frozen=True)
class Table:
    """Parts in row order."""

    parts: tuple[Part, ...]

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    def batches(self):
        """(part index, batch index, first row, rows) of every batch, in row order."""
        first = 0
        for p, part in enumerate(self.parts):
            for b, rows in enumerate(part.batches):
                yield p, b, first, rows
                first += rows

    def read(self, columns: list[str], start: int, stop: int) -> pa.Table:
        """Rows [start, stop) of the columns named."""
        pieces = []
        for p, b, first, rows in self.batches():
            if first + rows <= start or first >= stop or not rows:
                continue
            batch = self.parts[p].read(b, columns)
            lo, hi = max(start, first) - first, min(stop, first + rows) - first
            pieces.append(batch.slice(lo, hi - lo))
        return pa.concat_tables(pieces) if len(pieces) != 1 else pieces[0]


# --- columns ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # IMAGE, TENSOR, NUMBER, OTHER
    type: pa.DataType  # as stored (an extension type's storage)
    dtype: np.dtype | None = None  # of the numbers (tensors, numbers)
    shape: tuple[int, ...] = ()  # a record's (tensors: from the type or the first row; images: after the scan)
    levels: tuple[int, ...] = ()  # tensors: the lengths of its nested lists (0: variable; () as shape)
    why: str = ""  # OTHER: what it holds, for `dropped`

    @property
    def values_dtype(self) -> np.dtype:
        """The dtype of a column perturbed as numbers (a tensor or number column)."""
        assert self.dtype is not None
        return self.dtype


def _hf_info(schema: pa.Schema) -> dict[str, Any]:
    """The `info` of the Hugging Face schema metadata ({} for none)."""
    text = (schema.metadata or {}).get(HF_KEY)
    try:
        info = json.loads(text).get("info", {}) if text else {}
    except (ValueError, AttributeError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def features_of(schema: pa.Schema) -> dict[str, Any]:
    """The Hugging Face features in the schema metadata, by column ({} for none)."""
    features = _hf_info(schema).get("features", {})
    return features if isinstance(features, dict) else {}


def _storage(type_: pa.DataType) -> pa.DataType:
    return type_.storage_type if isinstance(type_, pa.BaseExtensionType) else type_


def _tensor_shape(type_: pa.DataType) -> tuple[int, ...] | None:
    """pyarrow's fixed_shape_tensor (row-major): its shape; None for any other type."""
    if isinstance(type_, pa.FixedShapeTensorType) and not (type_.permutation and
                                                            list(type_.permutation) != sorted(type_.permutation)):
        return tuple(type_.shape)
    return None


def _list_shape(type_: pa.DataType) -> tuple[list[int | None], pa.DataType]:
    """The lengths of nested list levels (None: variable) and the leaf type."""
    lengths = []
    type_ = _storage(type_)
    while pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        lengths.append(type_.list_size if pa.types.is_fixed_size_list(type_) else None)
        type_ = _storage(type_.value_type)
    return lengths, type_


def _numeric(type_: pa.DataType) -> bool:
    return pa.types.is_integer(type_) or pa.types.is_floating(type_)


def classify(field_: pa.Field, feature: Any) -> Column:
    """What a column is, from its Arrow type and its Hugging Face feature."""
    type_ = _storage(field_.type)
    kind_of = feature.get("_type") if isinstance(feature, dict) else None
    if kind_of == "ClassLabel":
        return Column(field_.name, OTHER, type_, why="a label column (ClassLabel)")
    if _holds_file_names(type_) and kind_of in (None, "Image"):
        return Column(field_.name, IMAGE, type_)
    if _numeric(type_):
        return Column(field_.name, NUMBER, type_, np.dtype(type_.to_pandas_dtype()))
    lengths, leaf = _list_shape(type_)
    if lengths and _numeric(leaf):
        levels = tuple(n or 0 for n in lengths)
        return Column(field_.name, TENSOR, type_, np.dtype(leaf.to_pandas_dtype()),
                      _tensor_shape(field_.type) or levels, levels)
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        why = "text"
    elif lengths:
        why = f"lists of {leaf}"
    else:
        why = f"{type_} values"
    return Column(field_.name, OTHER, type_, why=why)


def numbers(array: pa.Array | pa.ChunkedArray, column: Column, rows: int, where: str) -> np.ndarray:
    """A tensor or numeric column's rows as one array (rows, *shape); refuses nulls and
    rows of another shape than the column's."""
    if isinstance(array, pa.ChunkedArray):
        array = pa.concat_arrays(array.chunks) if array.num_chunks != 1 else array.chunk(0)
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    values = array
    for level, length in enumerate(column.levels):
        if values.null_count:
            raise InputError(f"{where}: column {column.name} holds missing values (nulls); tldp perturbs "
                             "columns without them: fill or drop them first")
        if not pa.types.is_fixed_size_list(values.type):
            lengths = values.value_lengths().to_numpy(zero_copy_only=False)
            if lengths.size and (lengths.min() != length or lengths.max() != length):
                raise InputError(f"{where}: column {column.name} holds rows of different lengths (level "
                                 f"{level + 1}: {length} and {int(lengths.min() if lengths.min() != length else lengths.max())}); "
                                 "tldp perturbs list columns whose rows share one shape")
        values = values.flatten()
        if isinstance(values, pa.ExtensionArray):
            values = values.storage
    if values.null_count:
        raise InputError(f"{where}: column {column.name} holds missing values (nulls); tldp perturbs "
                         "columns without them: fill or drop them first")
    return values.to_numpy(zero_copy_only=False).reshape(rows, *column.shape)


def to_arrow(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """Rows of numbers (rows, *shape) as an array of `type_` (its nested lists rebuilt)."""
    if isinstance(type_, pa.BaseExtensionType):
        if _tensor_shape(type_):
            values = values.reshape(values.shape[0], -1)
        return pa.ExtensionArray.from_storage(type_, to_arrow(values, type_.storage_type))
    if not (pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_)):
        return pa.array(values.reshape(-1), type=type_)
    rows, length = values.shape[0], values.shape[1]
    inner = to_arrow(values.reshape(rows * length, *values.shape[2:]), type_.value_type)
    if pa.types.is_fixed_size_list(type_):
        return pa.FixedSizeListArray.from_arrays(inner, type=type_)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int64) * length,
                       type=pa.int64() if pa.types.is_large_list(type_) else pa.int32())
    return (pa.LargeListArray if pa.types.is_large_list(type_) else pa.ListArray).from_arrays(
        offsets, inner, type=type_)


def stored(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Perturbed values in the column's own number type: integers rounded and clipped to
    its range, floats rounded to it (float16 saturating at its largest finite value)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        rounded = values if values.dtype.kind in "iu" else np.rint(values)
        return np.clip(rounded, info.min, info.max).astype(dtype)
    return to_stored(values, dtype.name)


# --- images ----------------------------------------------------------------------------

def _image_bytes(struct: pa.Array | pa.ChunkedArray) -> pa.Array:
    return _image_struct(struct).field("bytes")


def image_values(data: bytes, where: str):
    """An image's decoded pixels (pixels.Decoded) and its Pillow format; InputError names
    the row for what cannot be perturbed."""
    try:
        file = io.BytesIO(data)
        with Image.open(file) as im:
            return decode(file, im), im.format, im.info.get("icc_profile")
    except (Unsupported, LabelMap) as exc:
        raise InputError(f"{where}: {exc if isinstance(exc, Unsupported) else 'a palette image'}") from None
    except MemoryError:
        raise
    except Exception as exc:
        raise InputError(f"{where}: cannot be decoded as an image ({decode_reason(exc)})") from None


def image_header(data: bytes | None, where: str):
    """The header of a row's image (pixels.Header) and its format, without decoding it; None
    for a palette image (a label map: class indices, not pixel values)."""
    if data is None:
        raise InputError(f"{where}: holds no image bytes (an image stored by its path only, or a null); "
                         "tldp perturbs images held in the table: embed them first (datasets "
                         "embeds them in to_parquet and push_to_hub)")
    try:
        file = io.BytesIO(data)
        with Image.open(file) as im:
            found = header(file, im)
            if found.pages > 1:
                raise Unsupported(f"a multi-page TIFF ({found.pages} pages); tldp perturbs one image a row")
            return found, im.format
    except LabelMap:
        return None, "palette"
    except Unsupported as exc:
        raise InputError(f"{where}: {exc}") from None
    except Exception as exc:
        raise InputError(f"{where}: cannot be decoded as an image ({decode_reason(exc)})") from None


def encode_image(values: np.ndarray, source: bytes, keep_icc: bool, keep_alpha: bool = False) -> bytes:
    """A perturbed image (colour channels) in `source`'s format: its alpha channel put back
    where `keep_alpha` (--keep COLUMN.alpha; else written without it), and its ICC profile
    where `keep_icc` (--keep COLUMN.icc_profile), rounded and clipped to its bit depth; JPEG
    as JPEG, else PNG."""
    file = io.BytesIO(source)
    with Image.open(file) as im:  # the header only, unless the alpha channel is wanted
        found, kind = header(file, im), im.format
        icc = im.info.get("icc_profile") if keep_icc else None
        alpha = decode(file, im).alpha if found.has_alpha and keep_alpha else None
    dtype = found.dtype
    info = np.iinfo(dtype)
    rounded = values if values.dtype.kind in "iu" else np.rint(values)
    out = np.clip(rounded, info.min, info.max).astype(dtype)
    if alpha is not None:
        out = np.dstack([out, alpha])
    if kind == "JPEG" and alpha is None and dtype == np.uint8:
        buffer = io.BytesIO()
        Image.fromarray(out).save(buffer, "JPEG", quality=JPEG_QUALITY, icc_profile=icc)
        return buffer.getvalue()
    return png(out, icc)


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
            data = _row_of_batch(self.table, self.column.name, start)
        else:
            data = self.table.read([self.column.name], start, stop).column(0)
        if self.column.kind != IMAGE:
            return numbers(data, self.column, stop - start, where).astype(self.dtype, copy=False)
        out = np.empty((stop - start, *self.shape), self.dtype)
        for i, value in enumerate(_image_bytes(data).to_pylist()):
            row = f"{self.source}: row {start + i} of column {self.column.name}"
            if value is None:
                image_header(value, row)
            colour = image_values(value, row)[0].colour
            if colour.shape != self.shape or colour.dtype != self.dtype:
                raise InputError(f"{row}: the image changed while tldp was reading the file")
            out[i] = colour
        return out


def _row_of_batch(table: Table, column: str, row: int) -> pa.Array:
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


# --- the reader ------------------------------------------------------------------------

def image_job_name(column: str, row: int) -> str:
    """The array of one image of a column of several sizes (its random streams' key)."""
    return f"{column}[{row}]"


class TableReader(Reader):
    """The columns of a table to perturb, one ArrayJob each (named by the column), and what
    is left out (formats.leftovers)."""

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
                if _holds_file_names(column.type):  # its paths follow the rule of a perturbed column's
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
        self.hf_info = {key: value for key, value in _hf_info(self.schema).items() if key == "features"
                        or self.left.attribute(HF_KEY.decode(), key, (), "huggingface info field")}
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
            features = {name: value for name, value in self.features.items() if name in self.written}
            metadata[HF_KEY] = json.dumps({"info": {**self.hf_info, "features": features}}).encode()
        return pa.schema(fields, metadata=metadata or None)


# --- the writer ------------------------------------------------------------------------


class FolderTableReader(TableReader):
    """The shards of a dataset folder read as one table (dataset_folder.py), with what its
    writer needs besides: the shards (relative paths, in row order), save_to_disk's
    state.json and dataset_info.json (None for a folder of Parquet files), and the folder's
    other files that are copied."""

    shards: list[str]
    state: dict[str, Any] | None = None
    info: dict[str, Any] | None = None
    others: list[str]


class _Sink:
    """One output part being written, batch by batch, in its input's layout."""

    def __init__(self, path: Path, layout: str, schema: pa.Schema, settings: dict[str, Any]):
        self.path = path
        with writing(path):
            self.file = open(path, "xb")
            try:
                if layout == PARQUET:
                    self.out = pq.ParquetWriter(self.file, schema, version=settings.get("version", "2.6"),
                                                compression=parquet_compression(schema, settings.get("compression")))
                elif layout == IPC_FILE:
                    self.out = pa.ipc.new_file(self.file, schema)
                else:
                    self.out = pa.ipc.new_stream(self.file, schema)
            except BaseException:
                self.file.close()
                raise
        self.layout = layout

    def write(self, table: pa.Table) -> None:
        with writing(self.path):
            if self.layout == PARQUET:
                if table.num_rows:
                    self.out.write_table(table, row_group_size=table.num_rows)
            else:
                for batch in table.combine_chunks().to_batches() or [pa.RecordBatch.from_pylist([], table.schema)]:
                    self.out.write_batch(batch)

    def close(self, complete: bool) -> None:
        try:
            with writing(self.path):
                if complete:
                    self.out.close()
                    self.file.flush()
                    os.fsync(self.file.fileno())
        finally:
            self.file.close()


class TableWriter(Writer):
    """Writes the table batch by batch in row order, each as soon as every perturbed column
    has reached its end (the pipeline hands blocks over in row order)."""

    def __init__(self, reader: TableReader, targets: list[Path], dtype: np.dtype):
        self.reader, self.targets = reader, targets
        self.table = reader.table
        self.schema = reader.output_schema()
        self.columns = {c.name: c for c in reader.chosen}
        self.job_rows = reader.job_rows()  # array name -> (column, the table's row of its record 0)
        self.batches = list(self.table.batches())
        self.next = 0  # the next batch to write
        self.pending: dict[str, list[tuple[int, int, Any]]] = {name: [] for name in self.columns}
        self.lock = threading.Lock()
        self.sink: _Sink | None = None
        self.sink_part = -1
        self.written: list[Path] = []
        self.failed = False
        self.postprocessing = self._steps(np.dtype(dtype))
        # What `evaluate` must know to read the noise back: the columns rounded and clipped to
        # their type (images and integers), whose noise is not the mechanism's where it was cut.
        clipped = [c.name for c in reader.chosen if c.kind == IMAGE or c.values_dtype.kind in "iu"]
        self.manifest_extra = {"table_output": {"clipped": clipped}} if clipped else {}
        self.output_dtype = ", ".join(f"{c.name}: {self._stored_type(c)}" for c in reader.chosen) + \
            " (each column keeps its type)"

    def _stored_type(self, column: Column) -> str:
        if column.kind == IMAGE:
            each = self.reader.each_image.get(column.name, [(column.dtype, column.shape)])
            depths = " and ".join(f"{d}-bit" for d in sorted({np.dtype(dtype).itemsize * 8 for dtype, _ in each}))
            return f"{depths} {' and '.join(self.reader.image_formats[column.name])} images"
        return str(column.dtype)

    def _steps(self, dtype: np.dtype) -> list[str]:
        steps = []
        ints = [c.name for c in self.columns.values() if c.kind != IMAGE and c.values_dtype.kind in "iu"]
        floats = [c.name for c in self.columns.values() if c.kind != IMAGE and c.values_dtype.kind == "f"]
        images = [c for c in self.columns.values() if c.kind == IMAGE]
        if ints:
            steps.append(f"integer columns ({', '.join(ints)}): "
                         + ("" if dtype.kind in "iu" else "round to nearest integer (ties to even), ")
                         + "clip to the column's integer type and store in it")
        if floats:
            steps.append(f"float columns ({', '.join(floats)}): store in the column's float type "
                         "(float16 saturating at its largest finite value)")
        if images:
            alpha = ("copy the alpha channel unchanged (--keep COLUMN.alpha), " if any(self.reader.keep_alpha.values())
                     else "leave out the alpha channel (RGBA written as RGB, LA as L), "
                     if any(self.reader.alpha.values()) else "")
            steps.append(f"image columns ({', '.join(c.name for c in images)}): "
                         + ("" if dtype.kind in "iu" else "round to nearest integer (ties to even), ")
                         + "clip to the image's bit depth, " + alpha
                         + ("keep" if any(self.reader.keep_icc.values()) else "drop") + " the ICC "
                         f"profile (EXIF and text dropped); PNG written as PNG, JPEG as JPEG (quality "
                         f"{JPEG_QUALITY}, lossy, after the noise), any other format as PNG")
        steps.append("write the input's row groups (record batches) and column types; the columns not "
                     "written are listed in dropped")
        return steps

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        name, first = self.job_rows[job.name]
        column = self.columns[name]
        start += first
        stop = start + len(block)
        if column.kind == IMAGE:
            sources = (_row_of_batch(self.table, name, start) if first else
                       self.table.read([name], start, stop).column(0))
            keep_icc = self.reader.keep_icc.get(name, False)
            keep_alpha = self.reader.keep_alpha.get(name, False)
            payload: Any = [encode_image(values, source, keep_icc, keep_alpha)
                            for values, source in zip(block, _image_bytes(sources).to_pylist())]
        else:
            payload = stored(block, column.values_dtype)
        with self.lock:
            self.pending[name].append((start, stop, payload))
            try:
                self._flush()
            except BaseException:
                self.failed = True
                raise

    def _take(self, name: str, lo: int, hi: int) -> Any | None:
        """Rows [lo, hi) of a perturbed column, if every block they are in has come."""
        if hi <= lo:
            return None
        pieces = sorted(self.pending[name], key=lambda piece: piece[0])
        parts, at = [], lo
        for start, stop, payload in pieces:
            if stop <= at or start >= hi:
                continue
            if start > at:
                return None
            parts.append(payload[at - start:min(hi, stop) - start])
            at = min(hi, stop)
        if at < hi:
            return None
        if isinstance(parts[0], list):
            return [item for part in parts for item in part]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _flush(self) -> None:
        while self.next < len(self.batches) and not self.failed:
            p, b, first, rows = self.batches[self.next]
            values = {name: self._take(name, first, first + rows) for name in self.columns}
            if rows and any(value is None for value in values.values()):
                return
            self._write_batch(p, b, rows, values)
            self.next += 1
            end = first + rows
            for name in self.pending:  # the blocks wholly written
                self.pending[name] = [piece for piece in self.pending[name] if piece[1] > end]

    def _write_batch(self, p: int, b: int, rows: int, values: dict[str, Any]) -> None:
        if p != self.sink_part:
            if self.sink is not None:
                self.sink.close(True)
                self.written.append(self.sink.path)
            self.sink = _Sink(self.targets[p], self.table.parts[p].layout, self.schema, self.reader.settings)
            self.sink_part = p
        raw = [name for name in self.reader.written
               if name not in self.columns or self.reader.keep_paths.get(name)]
        source = self.table.parts[p].read(b, raw) if raw and rows else None
        arrays = []
        for field_ in self.schema:
            column = self.columns.get(field_.name)
            if column is None:  # copied raw (an empty batch has no rows to copy)
                kept = source.column(field_.name) if source is not None else pa.array([], type=field_.type)
                arrays.append(kept if self.reader.keep_paths.get(field_.name, True) else _without_paths(kept))
            elif column.kind == IMAGE:
                arrays.append(self._images(field_, values[field_.name] or [], source, rows))
            else:
                arrays.append(to_arrow(values[field_.name], field_.type) if rows
                              else pa.array([], type=field_.type))
        assert self.sink is not None  # part p's, opened above
        self.sink.write(pa.Table.from_arrays(arrays, schema=self.schema))

    def _images(self, field_: pa.Field, encoded: list[bytes], source: pa.Table | None, rows: int) -> pa.Array:
        type_ = _storage(field_.type)
        names = (_image_struct(source.column(field_.name)).field(PATH_FIELD)
                 if self.reader.keep_paths.get(field_.name) and source is not None
                 else pa.nulls(rows, type_.field(PATH_FIELD).type))
        data = pa.array(encoded, type=type_.field("bytes").type)
        return pa.StructArray.from_arrays([data if type_.field(i).name == "bytes" else names
                                           for i in range(type_.num_fields)],
                                          fields=[type_.field(i) for i in range(type_.num_fields)])

    def finish(self) -> None:
        with self.lock:
            self._flush()
            if self.next < len(self.batches):
                raise RuntimeError(f"tables: {len(self.batches) - self.next} batches were not written")
            if self.sink is not None:
                self.sink.close(True)
                self.written.append(self.sink.path)
                self.sink = None

    def close(self) -> list[Path]:
        if self.sink is not None:  # a failed run: the output is discarded
            self.sink.close(False)
            self.sink = None
        return list(self.written)


def _holds_file_names(type_: pa.DataType) -> bool:
    """A struct of `bytes` and `path` (datasets' Image and Audio features): its paths are
    file names."""
    return pa.types.is_struct(type_) and {type_.field(i).name for i in range(type_.num_fields)} == {"bytes", PATH_FIELD}


def _names_files(table: Table, name: str) -> bool:
    """Whether any row of a column of `bytes` and `path` structs names a file."""
    for p, b, _, _ in table.batches():
        part = table.parts[p]
        nested = part.layout == PARQUET and "." not in name  # Parquet reads the one field
        paths = _image_struct(part.read(b, [f"{name}.{PATH_FIELD}" if nested else name]).column(0)).field(PATH_FIELD)
        if paths.null_count < len(paths):
            return True
    return False


def _without_paths(array: pa.Array | pa.ChunkedArray) -> pa.StructArray:
    """A column of `bytes` and `path` structs with its paths written as null."""
    struct = _image_struct(array)
    fields = [struct.type.field(i) for i in range(struct.type.num_fields)]
    children = [pa.nulls(len(struct), f.type) if f.name == PATH_FIELD else struct.field(i)
                for i, f in enumerate(fields)]
    return pa.StructArray.from_arrays(children, fields=fields, mask=struct.is_null() if struct.null_count else None)


def _image_struct(array: pa.Array | pa.ChunkedArray) -> pa.StructArray:
    if isinstance(array, pa.ChunkedArray):
        array = pa.concat_arrays(array.chunks) if array.num_chunks != 1 else array.chunk(0)
    return array


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least a table needs: the perturbed values in their columns' types (noise does not
    compress), images 8 or 16 bits a value."""
    return sum(job.records * job.elements * job.dtype.itemsize for job in jobs)
