"""The writer of a table (formats/tables.py): the output's parts in their input's layouts,
written batch by batch: the writer keeps the blocks of the batch it is assembling and
writes each batch as soon as every perturbed column has reached its end.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any
import pyarrow as pa
import pyarrow.parquet as pq

import numpy as np

from tldp_cli.formats import ArrayJob, Writer
from tldp_cli.files.checked_io import writing
from tldp_cli.formats.tables import (IMAGE, IPC_FILE, PARQUET, PATH_FIELD, Column, image_struct, parquet_compression,
                                     storage, stored, to_arrow)
from tldp_cli.formats.tables_images import JPEG_QUALITY, encode_image, image_bytes
from tldp_cli.formats.tables_reader import TableReader, row_of_batch

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
            sources = (row_of_batch(self.table, name, start) if first else
                       self.table.read([name], start, stop).column(0))
            keep_icc = self.reader.keep_icc.get(name, False)
            keep_alpha = self.reader.keep_alpha.get(name, False)
            payload: Any = [encode_image(values, source, keep_icc, keep_alpha)
                            for values, source in zip(block, image_bytes(sources).to_pylist())]
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
        type_ = storage(field_.type)
        names = (image_struct(source.column(field_.name)).field(PATH_FIELD)
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


def _without_paths(array: pa.Array | pa.ChunkedArray) -> pa.StructArray:
    """A column of `bytes` and `path` structs with its paths written as null."""
    struct = image_struct(array)
    fields = [struct.type.field(i) for i in range(struct.type.num_fields)]
    children = [pa.nulls(len(struct), f.type) if f.name == PATH_FIELD else struct.field(i)
                for i, f in enumerate(fields)]
    return pa.StructArray.from_arrays(children, fields=fields, mask=struct.is_null() if struct.null_count else None)
