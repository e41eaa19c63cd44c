"""Chunk files of plain Zarr arrays, read and written beside zarr-python.

zarr-python moves every chunk through one asyncio event loop shared by all the
threads that call it, and writes each through a temporary file: in a run that path
cost as much CPU as the codec, and two workers reading through it were no faster
than one (docs/performance.md). An array whose chunks are plain files (a regular
grid, no sharding, C order, the bytes codec and at most one compressor: zstd, gzip
or blosc in Zarr 3, any numcodecs compressor without filters in Zarr 2) is read and
written here instead, with the numcodecs codec that zarr-python itself calls, so
each chunk file holds what zarr-python would write. Any other array goes through
zarr-python (`layout` returns None).

Reading is stricter than zarr-python's in three ways: a Blosc chunk whose header states
another length than the file's is refused (numcodecs decodes a truncated one from
beyond its end), a chunk path that is not a file is an error, not the fill value, and
no chunk is decompressed to more than the array's chunk size: a Blosc, LZ4 or Zstandard
chunk whose header states another size is refused before it is decoded, and zlib, gzip,
bz2 and LZMA chunks are decompressed a bounded amount at a time (_decompressed); a
chunk of a hundred kilobytes can otherwise expand to gigabytes in every worker.
"""

from __future__ import annotations

import bz2
import functools
import itertools
import json
import lzma
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numcodecs
import numpy as np
import zarr
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec
from zarr.registry import register_codec

from tldp_cli.errors import InputError, reason_of
from tldp_cli.files.checked_io import write_new_file, writing
from tldp_cli.formats import decompressed, padded_chunk, whole_chunks, wrong_chunk_size

_V3_COMPRESSORS = ("zstd", "gzip", "blosc")
_BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


# numcodecs takes Blosc's typesize from 0.16 on; zarr-python leaves it out before.
_BLOSC_TYPESIZE = tuple(int(part) for part in numcodecs.__version__.split(".")[:2]) >= (0, 16)


@functools.lru_cache(maxsize=None)
def _codec(config_json: str):
    """One numcodecs codec per configuration, shared by threads (its encode and decode
    keep no state between calls)."""
    config = json.loads(config_json)
    if config["id"] == "blosc" and not _BLOSC_TYPESIZE:
        config.pop("typesize", None)
    return numcodecs.get_codec(config)


def _check_blosc_length(data: bytes) -> None:
    """A Blosc frame states its own length (bytes 12-16 of its header)."""
    if len(data) < 16 or int.from_bytes(data[12:16], "little") != len(data):
        raise ValueError(f"a Blosc chunk of {len(data)} bytes whose header says otherwise (truncated?)")


_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE = 0x184D2A50  # the magic of skippable frames, less its last 4 bits


def _zstd_content_size(data: bytes) -> int | None:
    """The bytes the Zstandard frames of `data` state they hold (their Frame_Content_Size
    fields, RFC 8878), None if a frame does not say; ValueError if `data` is not a
    sequence of whole frames. Walks the frame and block headers, decoding nothing."""
    total, known, pos, end = 0, True, 0, len(data)

    def field(at: int, size: int) -> int:
        if at + size > end:
            raise ValueError("the Zstandard data stop inside a frame")
        return int.from_bytes(data[at:at + size], "little")

    while pos < end:
        magic = field(pos, 4)
        if magic & 0xFFFFFFF0 == _ZSTD_SKIPPABLE:
            pos += 8 + field(pos + 4, 4)
            continue
        if magic != _ZSTD_MAGIC:
            raise ValueError("not Zstandard data (no frame magic number)")
        descriptor = field(pos + 4, 1)
        single_segment = descriptor >> 5 & 1
        pos += 5 + (not single_segment) + (0, 1, 2, 4)[descriptor & 3]  # window, dictionary ID
        size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
        if size_bytes:
            total += field(pos, size_bytes) + (256 if size_bytes == 2 else 0)
        known = known and size_bytes > 0
        pos += size_bytes
        last = 0
        while not last:  # blocks: 3-byte headers; an RLE block stores 1 byte
            header = field(pos, 3)
            last, kind = header & 1, header >> 1 & 3
            if kind == 3:
                raise ValueError("a Zstandard block of the reserved type (damaged?)")
            pos += 3 + (1 if kind == 1 else header >> 3)
        pos += 4 * (descriptor >> 2 & 1)  # content checksum
    if pos != end:
        raise ValueError("the Zstandard data stop inside a frame")
    return total if known else None


def _decompressed(codec, data: bytes, size: int):
    """`data` decoded by the numcodecs `codec`, never to more than the chunk's `size`
    bytes (+1): numcodecs decodes a Blosc, LZ4 or Zstandard chunk to the size its header
    states, and zlib, gzip, bz2 and LZMA to the end of the stream, whatever the chunk's
    size. Other codecs are decoded, then their size compared."""
    name = codec.codec_id
    if name in ("blosc", "lz4"):
        if name == "blosc":
            _check_blosc_length(data)
        declared = int.from_bytes(data[4:8] if name == "blosc" else data[:4], "little")
        if declared != size:
            raise wrong_chunk_size(declared, size, "Blosc" if name == "blosc" else "LZ4")
    elif name == "zstd":
        stated = _zstd_content_size(data)
        if stated is not None and stated != size:
            raise wrong_chunk_size(stated, size, "Zstandard")
        # Without a stated size numcodecs decodes a stream: into `out`, it stops at its size.
        return codec.decode(data, out=np.empty(size, np.uint8))
    elif name in ("zlib", "gzip"):
        wbits = zlib.MAX_WBITS + (16 if name == "gzip" else 0)
        return decompressed(lambda: zlib.decompressobj(wbits), data, size, streams=name == "gzip")
    elif name == "bz2":
        return decompressed(bz2.BZ2Decompressor, data, size)
    elif name == "lzma":
        return decompressed(lambda: lzma.LZMADecompressor(codec.format, filters=codec.filters), data, size)
    return codec.decode(data)


@dataclass(frozen=True)
class Layout:
    """Where an array's chunks are and how each is encoded. Picklable (Dask workers)."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype  # as stored, byte order included
    fill_value: Any
    compressor: str | None  # its numcodecs configuration, as JSON
    typed: bool  # the compressor gets the typed array (Zarr 2), not its bytes (Zarr 3)
    prefix: str  # before the chunk's indices: "c/", "c." or ""
    separator: str

    def key(self, index: tuple[int, ...]) -> str:
        return self.prefix + self.separator.join(map(str, index))

    def _grid(self, first: int, stop: int) -> Iterator[tuple[int, ...]]:
        """The indices of the chunks that hold records first:stop, in order."""
        ranges = [range(first // self.chunks[0], -(-stop // self.chunks[0]))]
        ranges += [range(-(-n // c)) for n, c in zip(self.shape[1:], self.chunks[1:])]
        return itertools.product(*ranges)

    def _region(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, self.chunks, self.shape))

    @property
    def codec(self):
        """The numcodecs compressor, or None."""
        return None if self.compressor is None else _codec(self.compressor)

    def decode(self, data: bytes) -> np.ndarray:
        size = math.prod(self.chunks) * self.dtype.itemsize
        if self.compressor is not None:
            data = _decompressed(self.codec, data, size)
        if memoryview(data).nbytes != size:
            raise ValueError(f"it holds {memoryview(data).nbytes} bytes where a chunk holds {size}")
        return np.frombuffer(data, dtype=self.dtype).reshape(self.chunks)

    def encode(self, chunk: np.ndarray) -> bytes:
        chunk = np.ascontiguousarray(chunk, dtype=self.dtype)
        if self.compressor is None:
            return chunk.tobytes()
        return bytes(self.codec.encode(chunk if self.typed else chunk.view(np.uint8).ravel()))

    def read(self, directory: Path, start: int, stop: int) -> np.ndarray:
        """Records start:stop of the array whose chunks are in `directory`; a chunk with no
        file holds the fill value. Raises InputError naming the chunk file it cannot read
        or decode."""
        out = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype.newbyteorder("="))
        for index in self._grid(start, stop):
            region = self._region(index)
            rows = slice(max(region[0].start, start), min(region[0].stop, stop))
            target = (slice(rows.start - start, rows.stop - start), *region[1:])
            path = directory / self.key(index)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                out[target] = self.fill_value
                continue
            except OSError as exc:
                raise InputError(f"{path}: cannot read ({reason_of(exc)})") from None
            try:
                chunk = self.decode(data)
            except MemoryError:  # not damage: the run says memory ran out
                raise
            except Exception as exc:  # ValueError or the codec's own errors
                raise InputError(f"{path}: cannot decode the chunk of records {region[0].start}-"
                                 f"{region[0].stop} ({reason_of(exc)}); it may be damaged") from None
            offset = index[0] * self.chunks[0]
            out[target] = chunk[(slice(rows.start - offset, rows.stop - offset),
                                 *(slice(0, r.stop - r.start) for r in region[1:]))]
        return out

    def aligned(self, start: int, records: int) -> bool:
        return whole_chunks(start, records, self.chunks[0], self.shape[0])

    def encoded(self, directory: Path, start: int, block: np.ndarray) -> list[tuple[Path, bytes]]:
        """The chunk files of records start:start+len(block) (aligned) in `directory`: each
        path and its bytes. A chunk cut by the array's edge is padded with the fill value,
        as zarr-python does. Raises the codec's error for values it cannot encode."""
        files = []
        for index in self._grid(start, start + len(block)):
            region = self._region(index)
            rows = slice(region[0].start - start, region[0].stop - start)
            part = padded_chunk(block[(rows, *region[1:])], self.chunks, self.fill_value, self.dtype)
            files.append((directory / self.key(index), self.encode(part)))
        return files


def write_files(directory: Path, files: list[tuple[Path, bytes]]) -> None:
    """Writes the chunk files (Layout.encoded) of the array in `directory`, making the
    folders they go in below it, never `directory` itself: an output removed during the
    run fails, rather than come back as chunks without metadata. Raises WriteError
    naming the file."""
    for path, data in files:
        with writing(path):
            try:
                write_new_file(path, data)
            except FileNotFoundError:  # the first chunk of its folder
                if not directory.is_dir():
                    raise
                path.parent.mkdir(parents=True, exist_ok=True)
                write_new_file(path, data)


def _v3_compressor(codecs: list[dict[str, Any]], dtype: np.dtype) -> tuple[dict | None, np.dtype] | None:
    """The numcodecs configuration of a Zarr 3 codec chain of bytes and at most one
    compressor, and the stored dtype; None for any other chain."""
    if not codecs or codecs[0].get("name") != "bytes" or len(codecs) > 2:
        return None
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    stored = dtype.newbyteorder("<" if endian == "little" else ">")
    if len(codecs) == 1:
        return None, stored
    name, config = codecs[1].get("name"), dict(codecs[1].get("configuration") or {})
    if name not in _V3_COMPRESSORS:
        return None
    if name == "blosc":
        shuffle = config.get("shuffle")  # a name, or Blosc's number
        config["shuffle"] = _BLOSC_SHUFFLE.get(shuffle, shuffle) if isinstance(shuffle, str) else shuffle
        if not isinstance(config["shuffle"], int):
            return None
    return {"id": name, **config}, stored


def of_array(array) -> Layout | None:
    """The chunk layout of an open zarr array (see layout)."""
    return layout(array.metadata.to_dict(), array.fill_value)


def layout(metadata: dict[str, Any], fill_value: Any) -> Layout | None:
    """The chunk layout of an array from its metadata as JSON (zarr.json, or .zarray), or
    None where its chunks are not plain files this module reads and writes."""
    shape = tuple(metadata.get("shape") or ())
    if not shape:
        return None
    if metadata.get("zarr_format") == 2 or "chunks" in metadata:
        if metadata.get("filters") or metadata.get("order", "C") != "C":
            return None
        dtype, compressor, typed = np.dtype(metadata["dtype"]), metadata.get("compressor"), True
        chunks = tuple(metadata["chunks"])
        prefix, separator = "", metadata.get("dimension_separator") or "."
    else:
        grid, keys = metadata.get("chunk_grid") or {}, metadata.get("chunk_key_encoding") or {}
        if (grid.get("name") != "regular" or metadata.get("storage_transformers")
                or not isinstance(metadata.get("data_type"), str)
                or keys.get("name") not in ("default", "v2")):
            return None
        codecs = _v3_compressor(list(metadata.get("codecs") or []), np.dtype(metadata["data_type"]))
        if codecs is None:
            return None
        compressor, dtype = codecs
        typed, chunks = False, tuple(grid["configuration"]["chunk_shape"])
        default = "/" if keys["name"] == "default" else "."
        separator = (keys.get("configuration") or {}).get("separator", default)
        prefix = "c" + separator if keys["name"] == "default" else ""
    if dtype.kind not in "iuf" or len(chunks) != len(shape) or math.prod(chunks) == 0:
        return None
    return Layout(shape, chunks, dtype, 0 if fill_value is None else fill_value,
                  None if compressor is None else json.dumps(compressor, sort_keys=True), typed,
                  prefix, separator)


# Chunks zarr-python decodes itself (sharded arrays, F order, codecs beside the compressor):
# its Zstandard, Blosc and gzip codecs decode a chunk to the size its header states, or to
# the end of its stream, before anything compares it with the chunk. These subclasses,
# which zarr_tree selects in zarr's codec configuration, refuse a chunk that states more
# than the chunk's bytes (with room for checksums beside it) before decoding it. A
# Zstandard frame that states no size is decoded as before.
CODEC_SLACK = 1 << 16


def _chunk_limit(chunk_spec) -> int:
    itemsize = np.dtype(chunk_spec.dtype.to_native_dtype()).itemsize
    return math.prod(chunk_spec.shape) * itemsize + CODEC_SLACK


class _EqualByConfiguration:
    """zarr's codecs are values: a checked codec equals zarr's own of the same configuration
    (code that compares an array's compressors with ZstdCodec(level=1) still works)."""

    def __eq__(self, other):
        return hasattr(other, "to_dict") and self.to_dict() == other.to_dict()

    def __hash__(self):
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))


class CheckedZstdCodec(_EqualByConfiguration, ZstdCodec):
    def _decode_sync(self, chunk_bytes, chunk_spec):
        declared = _zstd_content_size(chunk_bytes.to_bytes())
        if declared is not None and declared > _chunk_limit(chunk_spec):
            raise wrong_chunk_size(declared, _chunk_limit(chunk_spec) - CODEC_SLACK, "Zstandard")
        return super()._decode_sync(chunk_bytes, chunk_spec)


class CheckedBloscCodec(_EqualByConfiguration, BloscCodec):
    def _decode_sync(self, chunk_bytes, chunk_spec):
        data = chunk_bytes.to_bytes()
        _check_blosc_length(data)
        declared = int.from_bytes(data[4:8], "little")
        if declared > _chunk_limit(chunk_spec):
            raise wrong_chunk_size(declared, _chunk_limit(chunk_spec) - CODEC_SLACK, "Blosc")
        return super()._decode_sync(chunk_bytes, chunk_spec)


class CheckedGzipCodec(_EqualByConfiguration, GzipCodec):
    def _decode_sync(self, chunk_bytes, chunk_spec):
        data = decompressed(lambda: zlib.decompressobj(zlib.MAX_WBITS + 16), chunk_bytes.to_bytes(),
                            _chunk_limit(chunk_spec))
        return chunk_spec.prototype.buffer.from_bytes(data)


CHECKED_CODECS = {"zstd": CheckedZstdCodec, "blosc": CheckedBloscCodec, "gzip": CheckedGzipCodec}


@functools.cache
def use_checked_codecs() -> None:
    """Selects the size-checking codecs above in zarr's configuration, once per process."""
    for key, cls in CHECKED_CODECS.items():
        register_codec(key, cls)
        zarr.config.set({f"codecs.{key}": f"{__name__}.{cls.__name__}"})
