"""Deflated HDF5 chunks (netCDF-4's filters) compressed and decompressed outside HDF5.

HDF5 runs a dataset's filters inside the library, and h5py holds one global lock
around every call into it: a file compressed with deflate (netCDF-C's `zlib=True`,
h5py's `compression="gzip"`), with or without the shuffle filter before it, was
read and written one chunk at a time, the output's deflate on a single core (a
tenth of the `.npy` rate, docs/performance.md). For a dataset whose chunks hold
whole records and whose filters are exactly [shuffle,] deflate, the HDF5 format
(`hdf5_reader.py`, `hdf5_storage.py`, `hdf5_writer.py`) instead moves each chunk's
stored bytes with HDF5's direct chunk I/O (no filter runs in the lock) and the worker
threads shuffle and deflate them: zlib to read, zlib-ng to write (the same zlib stream
format, about twice as fast at the same level), the output's noise with Huffman codes
only (Deflated.huffman_only). The dataset keeps its filter and level, which later
writers use.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5t, h5z
from zlib_ng import zlib_ng

from tldp_cli.formats import decompressed, padded_chunk, whole_chunks


@dataclass(frozen=True)
class Deflated:
    """How a dataset's chunks are stored: `chunk_records` whole records each, shuffled
    (or not) then deflated at `level`. Picklable."""

    dtype: np.dtype  # as stored, byte order included
    shape: tuple[int, ...]
    chunk_records: int
    shuffle: bool
    level: int
    fill_value: Any  # what HDF5 pads a chunk cut by the dataset's end with
    # Output: deflate without string matching, Huffman codes only. Noise repeats no
    # strings, so matching costs time and bits: int16 noise took 0.664 of its size at 182
    # M values/s this way, 0.697 at 39 M/s at level 4 (docs/performance.md).
    huffman_only: bool = False

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.chunk_records, *self.shape[1:])

    def decode(self, filter_mask: int, data: bytes) -> np.ndarray:
        """A chunk from its stored bytes; a filter whose bit is set in `filter_mask` was
        skipped for this chunk (HDF5 skips optional filters that fail)."""
        deflate_bit = 2 if self.shuffle else 1
        expected = math.prod(self.chunk_shape) * self.dtype.itemsize
        if not filter_mask & deflate_bit:
            # never to more than a chunk: a few kilobytes can inflate to gigabytes
            data = decompressed(zlib.decompressobj, data, expected, streams=False)
        if len(data) != expected:
            raise ValueError(f"a chunk holds {len(data)} bytes where {expected} belong; it may be damaged")
        values = np.frombuffer(data, dtype=np.uint8)
        if self.shuffle and not filter_mask & 1:
            values = values.reshape(self.dtype.itemsize, -1).T
        return np.ascontiguousarray(values).view(self.dtype).reshape(self.chunk_shape)

    def encode(self, chunk: np.ndarray) -> bytes:
        """A chunk's stored bytes; a chunk cut by the dataset's end is padded with the fill
        value, as HDF5 does (a dataset that grows along an unlimited dimension shows it)."""
        chunk = padded_chunk(chunk, self.chunk_shape, self.fill_value, self.dtype)
        values = np.ascontiguousarray(chunk, dtype=self.dtype).view(np.uint8)
        if self.shuffle:
            values = np.ascontiguousarray(values.reshape(-1, self.dtype.itemsize).T)
        if not self.huffman_only:
            return zlib_ng.compress(values, self.level)
        deflate = zlib_ng.compressobj(self.level, zlib_ng.DEFLATED, zlib_ng.MAX_WBITS, 8, zlib_ng.Z_HUFFMAN_ONLY)
        return deflate.compress(values) + deflate.flush()

    def chunks(self, start: int, stop: int) -> range:
        return range(start // self.chunk_records, -(-stop // self.chunk_records))

    def read(self, ds: h5py.Dataset, start: int, stop: int) -> np.ndarray:
        """Records start:stop (stop past the end: up to the end, as h5py slices)."""
        stop = max(start, min(stop, self.shape[0]))
        out = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype.newbyteorder("="))
        n = self.chunk_records
        for index in self.chunks(start, stop):
            first, end = max(start, index * n), min(stop, (index + 1) * n)
            if (index + 1) * n > self.shape[0]:
                # HDF5 may store a chunk cut by the end unfiltered, saying so in the
                # dataset's chunk options, which h5py does not show: HDF5 reads it.
                out[first - start:end - start] = ds[first:end]
                continue
            mask, data = ds.id.read_direct_chunk((index * n,) + (0,) * (len(self.shape) - 1))
            try:
                chunk = self.decode(mask, data)
            except (ValueError, zlib.error) as exc:
                raise ValueError(f"its chunk of records {index * n}-{(index + 1) * n}: {exc}") from None
            out[first - start:end - start] = chunk[first - index * n:end - index * n]
        return out

    def aligned(self, start: int, records: int) -> bool:
        return whole_chunks(start, records, self.chunk_records, self.shape[0])

    def encoded(self, start: int, block: np.ndarray):
        """(chunk offset, stored bytes) of each chunk of records start:start+len(block)
        (aligned), compressed here, outside HDF5."""
        n = self.chunk_records
        for index in self.chunks(start, start + len(block)):
            part = block[index * n - start:(index + 1) * n - start]
            yield (index * n,) + (0,) * (len(self.shape) - 1), self.encode(part)


def deflated(ds: h5py.Dataset, allocated: bool = True) -> Deflated | None:
    """The dataset's Deflated layout, or None where its chunks are not whole records of
    NumPy's own number type under exactly [shuffle,] deflate at levels 0-9 (and, if
    `allocated`, all stored: direct chunk reads need every chunk)."""
    if (ds.dtype.kind not in "iuf" or ds.dtype.names or not ds.shape or ds.size == 0
            or ds.chunks is None or tuple(ds.chunks[1:]) != tuple(ds.shape[1:])
            or not plain_numbers(ds)):
        return None
    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5d.CHUNKED or plist.get_external_count():
        return None
    filters = [plist.get_filter(i) for i in range(plist.get_nfilters())]
    codes = [f[0] for f in filters]
    if codes not in ([h5z.FILTER_DEFLATE], [h5z.FILTER_SHUFFLE, h5z.FILTER_DEFLATE]):
        return None
    level = int(filters[-1][2][0]) if filters[-1][2] else 6
    if not 0 <= level <= 9:  # HDF5's deflate fails and, if optional, stores the chunk raw
        return None
    if allocated and ds.id.get_num_chunks() != math.ceil(ds.shape[0] / ds.chunks[0]):
        return None
    fill = ds.fillvalue if ds.fillvalue is not None else 0
    return Deflated(ds.dtype, tuple(ds.shape), ds.chunks[0], len(codes) == 2, level, fill)


def plain_numbers(ds: h5py.Dataset) -> bool:
    """Whether the dataset stores its numbers as NumPy lays out ds.dtype: HDF5 converts
    others when it reads them (a precision or bit offset of its own, a 16-bit float
    h5py shows as float32), which raw bytes would skip."""
    return ds.id.get_type().equal(h5t.py_create(ds.dtype))
