"""Review of formats/zarr_chunks.py: the codec is the one zarr-python builds, a damaged
Blosc chunk is an error, and an encoding error is a one-line InputError that leaves no
partial output (as on the zarr-python path)."""

import json

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from tldp_cli.errors import InputError
from tldp_cli.formats import zarr_chunks
from tldp_cli.run.pipeline import PerturbOptions, perturb

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHAPE, CHUNKS = (64, 10), (8, 5)
VALUES = np.random.default_rng(0).integers(1, 200, SHAPE).astype(np.uint8)


def layout_of(array) -> zarr_chunks.Layout:
    layout = zarr_chunks.of_array(array)
    assert layout is not None
    return layout


@pytest.mark.parametrize("codec", [ZstdCodec(level=3, checksum=True), GzipCodec(level=5),
                                   BloscCodec(cname="lz4", shuffle="shuffle"),
                                   BloscCodec(cname="zstd", shuffle="bitshuffle")],
                         ids=["zstd", "gzip", "blosc shuffle", "blosc bitshuffle"])
def test_the_codec_is_the_one_zarr_python_builds(tmp_path, codec):
    """zarr-python passes Blosc's typesize to numcodecs only from numcodecs 0.16 on (its
    Blosc takes no typesize before): with numcodecs 0.14 or 0.15, which zarr 3 accepts, a
    configuration with typesize fails on every chunk."""
    array = zarr.create_array(str(tmp_path / "a.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="u1",
                              compressors=codec)
    ours = zarr_chunks._codec(layout_of(array).compressor)  # raises TypeError with numcodecs < 0.16
    compressor = array.metadata.codecs[1]
    theirs = next(getattr(compressor, name) for name in ("_blosc_codec", "_zstd_codec", "_gzip_codec")
                  if hasattr(compressor, name))
    assert type(ours) is type(theirs)
    if isinstance(theirs, numcodecs.GZip):  # its header holds the time: compare what it decodes
        assert bytes(ours.decode(ours.encode(VALUES.ravel()))) == VALUES.tobytes()
    else:
        assert bytes(ours.encode(VALUES.ravel())) == bytes(theirs.encode(VALUES.ravel()))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_truncated_blosc_chunk_raises(tmp_path, zarr_format):
    """numcodecs' Blosc decodes a truncated buffer without an error (it reads past its end):
    the chunk must be refused like a truncated zstd or gzip chunk, not read as garbage."""
    codec = BloscCodec(cname="lz4", shuffle="shuffle") if zarr_format == 3 else numcodecs.Blosc()
    array = zarr.create_array(str(tmp_path / "a.zarr"), shape=SHAPE, chunks=CHUNKS, dtype="u1",
                              zarr_format=zarr_format, compressors=codec)
    array[:] = VALUES
    chunk = tmp_path / "a.zarr" / ("c/4/1" if zarr_format == 3 else "4.1")
    chunk.write_bytes(chunk.read_bytes()[:28])
    with pytest.raises(InputError, match=r"a\.zarr/(c/4/1|4\.1): cannot decode the chunk of records 32-40"):
        layout_of(array).read(tmp_path / "a.zarr", 32, 40)


def test_an_encoding_error_is_an_input_error_and_leaves_nothing(tmp_path):
    """A compressor that cannot encode (here a zlib level out of range, which decoding
    ignores): the zarr-python path says "cannot encode array ... with its codecs" and
    removes the partial output; the chunk-file path must do the same, not end in
    "unexpected error" with .out.zarr.tldp-partial left behind."""
    source = tmp_path / "in.zarr"
    array = zarr.create_array(str(source), shape=SHAPE, chunks=CHUNKS, dtype="u1", zarr_format=2,
                              compressors=numcodecs.Zlib(level=1))
    array[:] = VALUES
    meta = json.loads((source / ".zarray").read_text())
    meta["compressor"]["level"] = -5
    (source / ".zarray").write_text(json.dumps(meta))
    out = tmp_path / "out.zarr"
    with pytest.raises(InputError, match="cannot encode"):
        perturb(PerturbOptions(input=source, epsilon=1.0, out=out, seed="ab13c892a8c04073b2e03853143751e3", workers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr"]


def test_a_damaged_or_unreadable_chunk_is_named_with_its_records(cli, tmp_path, monkeypatch):
    """The error named the whole block (records 0-64) and called a chunk it could not
    open 'damaged': it names the chunk file, its records, and the cause."""
    source = tmp_path / "in.zarr"
    zarr.create_array(str(source), shape=SHAPE, chunks=CHUNKS, dtype="u1")[:] = VALUES
    damaged = source / "c" / "3" / "0"
    damaged.write_bytes(damaged.read_bytes()[:10])
    result = cli("perturb", source, "--eps", "1", "--out", tmp_path / "out.zarr")
    assert result.exit_code == 1 and result.stderr.strip().splitlines() == [
        f"tldp: error: {damaged}: cannot decode the chunk of records 24-32 (Zstd decompression error: "
        "invalid input data); it may be damaged"]
    damaged.unlink()
    locked = source / "c" / "5" / "1"
    real_read_bytes = zarr_chunks.Path.read_bytes

    def read_bytes(path):
        if path == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_bytes(path)

    monkeypatch.setattr(zarr_chunks.Path, "read_bytes", read_bytes)
    result = cli("perturb", source, "--eps", "1", "--out", tmp_path / "out.zarr")
    assert result.exit_code == 1 and result.stderr.strip().splitlines() == [
        f"tldp: error: {locked}: cannot read (Permission denied)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr"]
