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

This module is the table's model (its parts, batches and columns, what each column holds);
beside it, each over the next:
- tables_writer.py: the output's parts, batch by batch (TableWriter);
- tables_reader.py: the reader (TableReader, FolderTableReader): the columns perturbed,
  one ArrayJob each (ColumnRead), and what is left out;
- tables_images.py: an image column's values: decoded, or only their header read, and
  encoded again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import pyarrow as pa
import pyarrow.parquet as pq

import numpy as np

from tldp_cli.errors import InputError, reason_of
from tldp_cli.formats import ArrayJob, FormatOptions
from tldp_cli.formats.tensor_files import to_stored

PARQUET_MAGIC = b"PAR1"
IPC_FILE_MAGIC = b"ARROW1"
IPC_CONTINUATION = b"\xff\xff\xff\xff"
PYARROW_FOOTER_KEYS = (b"ARROW:schema", b"content_defined_chunking")  # how pyarrow wrote it
HF_KEY = b"huggingface"  # the schema metadata key of `datasets`' features
EXTENSION_KEYS = (b"ARROW:extension:name", b"ARROW:extension:metadata")  # structural: the column's type
# Layouts of a part (how its batches are read and written)
PARQUET, IPC_FILE, IPC_STREAM = "Parquet file", "Arrow IPC file", "Arrow IPC stream"
IMAGE, TENSOR, NUMBER, OTHER = "image", "tensor", "number", "other"
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
    type_ = storage(type_)
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


def hf_info(schema: pa.Schema) -> dict[str, Any]:
    """The `info` of the Hugging Face schema metadata ({} for none)."""
    text = (schema.metadata or {}).get(HF_KEY)
    try:
        info = json.loads(text).get("info", {}) if text else {}
    except (ValueError, AttributeError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def features_of(schema: pa.Schema) -> dict[str, Any]:
    """The Hugging Face features in the schema metadata, by column ({} for none)."""
    features = hf_info(schema).get("features", {})
    return features if isinstance(features, dict) else {}


def storage(type_: pa.DataType) -> pa.DataType:
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
    type_ = storage(type_)
    while pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        lengths.append(type_.list_size if pa.types.is_fixed_size_list(type_) else None)
        type_ = storage(type_.value_type)
    return lengths, type_


def _numeric(type_: pa.DataType) -> bool:
    return pa.types.is_integer(type_) or pa.types.is_floating(type_)


def classify(field_: pa.Field, feature: Any) -> Column:
    """What a column is, from its Arrow type and its Hugging Face feature."""
    type_ = storage(field_.type)
    kind_of = feature.get("_type") if isinstance(feature, dict) else None
    if kind_of == "ClassLabel":
        return Column(field_.name, OTHER, type_, why="a label column (ClassLabel)")
    if holds_file_names(type_) and kind_of in (None, "Image"):
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


def holds_file_names(type_: pa.DataType) -> bool:
    """A struct of `bytes` and `path` (datasets' Image and Audio features): its paths are
    file names."""
    return pa.types.is_struct(type_) and {type_.field(i).name for i in range(type_.num_fields)} == {"bytes", PATH_FIELD}


def image_struct(array: pa.Array | pa.ChunkedArray) -> pa.StructArray:
    if isinstance(array, pa.ChunkedArray):
        array = pa.concat_arrays(array.chunks) if array.num_chunks != 1 else array.chunk(0)
    return array


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least a table needs: the perturbed values in their columns' types (noise does not
    compress), images 8 or 16 bits a value."""
    return sum(job.records * job.elements * job.dtype.itemsize for job in jobs)
