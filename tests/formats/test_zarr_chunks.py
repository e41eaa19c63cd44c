"""Plain Zarr chunk files read and written beside zarr-python (formats/zarr_chunks.py):
every layout is made by zarr-python, and what is read or written here is checked against
zarr-python reading the same store and writing the same values."""

import hashlib
import json
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, TransposeCodec, ZstdCodec

from tldp_cli.formats import zarr_chunks
from tldp_cli.run.pipeline import PerturbOptions, perturb

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHAPE, CHUNKS = (45, 6, 5), (8, 4, 5)  # edge chunks on axes 0 and 1

# name -> create_array keyword arguments (beside shape, chunks and dtype)
PLAIN = {
    "v3 zstd": dict(zarr_format=3, compressors=ZstdCodec(level=3)),
    "v3 zstd checksum": dict(zarr_format=3, compressors=ZstdCodec(level=1, checksum=True)),
    "v3 gzip": dict(zarr_format=3, compressors=GzipCodec(level=5)),
    "v3 blosc shuffle": dict(zarr_format=3, compressors=BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")),
    "v3 blosc bitshuffle": dict(zarr_format=3, compressors=BloscCodec(cname="zstd", shuffle="bitshuffle")),
    "v3 uncompressed": dict(zarr_format=3, compressors=None),
    "v3 big-endian": dict(zarr_format=3, compressors=ZstdCodec(), serializer=BytesCodec(endian="big")),
    "v3 dot keys": dict(zarr_format=3, chunk_key_encoding={"name": "default", "separator": "."}),
    "v3 v2 keys": dict(zarr_format=3, chunk_key_encoding={"name": "v2", "separator": "."}),
    "v2 blosc": dict(zarr_format=2, compressors=numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE)),
    "v2 zstd slash keys": dict(zarr_format=2, compressors=numcodecs.Zstd(level=2), chunk_key_encoding={"name": "v2", "separator": "/"}),
    "v2 zlib": dict(zarr_format=2, compressors=numcodecs.Zlib(level=1)),
    "v2 uncompressed": dict(zarr_format=2, compressors=None),
}
NOT_PLAIN = {
    "v3 sharded": dict(zarr_format=3, shards=(16, 8, 5)),
    "v3 crc32c": dict(zarr_format=3, compressors=[ZstdCodec(), Crc32cCodec()]),
    "v3 transpose": dict(zarr_format=3, filters=[TransposeCodec(order=(2, 1, 0))]),
    "v2 delta filter": dict(zarr_format=2, filters=[numcodecs.Delta(dtype="<i4")]),
    "v2 order F": dict(zarr_format=2, order="F"),
}
VALUES = np.random.default_rng(5).integers(-3000, 3000, SHAPE).astype(np.int32)


def create(path: Path, kwargs: dict, dtype=np.int32, fill_value=-1, chunks=CHUNKS):
    kwargs = dict(kwargs)
    if kwargs.pop("serializer", None) is not None:  # big-endian: the bytes codec says so
        kwargs["serializer"] = BytesCodec(endian="big")
    return zarr.create_array(str(path), shape=SHAPE, chunks=chunks, dtype=dtype, fill_value=fill_value,
                             **kwargs)


def layout_of(array) -> zarr_chunks.Layout | None:
    return zarr_chunks.of_array(array)


def chunk_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): without_gzip_time(p.read_bytes()) for p in sorted(path.rglob("*"))
            if p.is_file() and p.name not in ("zarr.json", ".zarray", ".zattrs")}


def without_gzip_time(data: bytes) -> bytes:
    """A gzip member's header holds the time it was written (bytes 4-7): two writers a
    second apart differ there and nowhere else."""
    return data[:4] + bytes(4) + data[8:] if data[:3] == b"\x1f\x8b\x08" else data


@pytest.mark.parametrize("chunks", [CHUNKS, (8, 6, 5)], ids=["split records", "whole records"])
@pytest.mark.parametrize("name", PLAIN)
def test_reads_what_zarr_python_wrote(tmp_path, name, chunks):
    array = create(tmp_path / "a.zarr", PLAIN[name], chunks=chunks)
    array[:32] = VALUES[:32]  # records 32-44 are never written: their chunks have no file
    layout = layout_of(array)
    assert layout is not None
    expected = array[:]
    assert (expected[32:] == -1).all()
    for start, stop in [(0, 45), (0, 8), (3, 11), (30, 45), (44, 45), (8, 16)]:
        got = layout.read(tmp_path / "a.zarr", start, stop)
        assert got.dtype == np.dtype(np.int32) and got.dtype.isnative
        np.testing.assert_array_equal(got, expected[start:stop], err_msg=f"{name} {start}:{stop}")


@pytest.mark.parametrize("name", PLAIN)
def test_writes_the_files_zarr_python_writes(tmp_path, name):
    by_zarr = create(tmp_path / "zarr.zarr", PLAIN[name])
    by_zarr[:] = VALUES
    here = create(tmp_path / "here.zarr", PLAIN[name])
    layout = layout_of(here)
    written = []
    for start in range(0, SHAPE[0], 16):  # blocks of two chunks, the last cut by the edge
        assert layout.aligned(start, len(VALUES[start:start + 16]))
        files = layout.encoded(tmp_path / "here.zarr", start, VALUES[start:start + 16])
        zarr_chunks.write_files(tmp_path / "here.zarr", files)
        written += files
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "here.zarr"), mode="r")[:], VALUES)
    assert chunk_files(tmp_path / "here.zarr") == chunk_files(tmp_path / "zarr.zarr")
    assert all(path.read_bytes() == data for path, data in written)
    assert len({path for path, _ in written}) == len(chunk_files(tmp_path / "here.zarr"))


def test_only_whole_chunks_are_aligned(tmp_path):
    layout = layout_of(create(tmp_path / "a.zarr", PLAIN["v3 zstd"]))
    assert layout.aligned(0, 8) and layout.aligned(40, 5) and layout.aligned(8, 37)
    assert not layout.aligned(4, 4) and not layout.aligned(0, 5) and not layout.aligned(40, 4)


@pytest.mark.parametrize("name", NOT_PLAIN)
def test_other_layouts_are_left_to_zarr_python(tmp_path, name):
    assert layout_of(create(tmp_path / "a.zarr", NOT_PLAIN[name])) is None


def test_a_damaged_chunk_raises(tmp_path):
    array = create(tmp_path / "a.zarr", PLAIN["v3 zstd"])
    array[:] = VALUES
    (tmp_path / "a.zarr" / "c" / "1" / "0" / "0").write_bytes(b"not zstd")
    with pytest.raises(Exception):
        layout_of(array).read(tmp_path / "a.zarr", 0, 16)


@pytest.mark.parametrize("name", ["v3 zstd", "v2 blosc", "v3 sharded"])
def test_perturb_output_reads_back_and_its_manifest_hashes_hold(tmp_path, name):
    source = create(tmp_path / "in.zarr", (PLAIN | NOT_PLAIN)[name], dtype=np.uint8, fill_value=0)
    source[:] = (VALUES % 256).astype(np.uint8)
    out = tmp_path / "out.zarr"
    perturb(PerturbOptions(input=tmp_path / "in.zarr", eps=1.0, out=out, seed="ab13c892a8c04073b2e03853143751e3"))
    result = zarr.open_array(str(out), mode="r")
    assert result.shape == SHAPE and result.dtype == np.int16
    noise = result[:].astype(np.int64) - (VALUES % 256)
    assert noise.std() > 50  # every record was perturbed (ε = 1 over 150 uint8 values: large noise)
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    files = manifest["outputs"]
    assert len(files) > 3  # chunks (or shards) and metadata
    for entry in files:
        assert hashlib.sha256(Path(entry["path"]).read_bytes()).hexdigest() == entry["sha256"], entry
