"""formats/zarr_chunks.py's codecs and errors: the codec is the one zarr-python builds, a damaged
Blosc chunk is an error, and an encoding error is a one-line InputError that leaves no
partial output (as on the zarr-python path). A chunk that expands beyond its size is
refused before it is (issue 27, item 11)."""

import json
import tracemalloc
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from tests.builders import run_measured
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
        perturb(PerturbOptions(input=source, eps=1.0, out=out, seed="ab13c892a8c04073b2e03853143751e3", workers=1))
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
        f"tldp: error: {damaged}: cannot decode the chunk of records 24-32 (the Zstandard data stop "
        "inside a frame); it may be damaged"]
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


def test_a_codec_error_without_a_message_still_gives_a_reason(cli, tmp_path, monkeypatch):
    """Some decoders raise an exception that carries no text: the line said "cannot decode
    ... (); it may be damaged". It names the exception's type instead."""
    source = tmp_path / "in.zarr"
    zarr.create_array(str(source), shape=SHAPE, chunks=CHUNKS, dtype="u1")[:] = VALUES

    def decode(self, data):
        raise ValueError()

    monkeypatch.setattr(zarr_chunks.Layout, "decode", decode)
    result = cli("perturb", source, "--eps", "1", "--out", tmp_path / "out.zarr")
    assert result.exit_code == 1 and result.stderr.strip().splitlines() == [
        f"tldp: error: {source / 'c' / '0' / '0'}: cannot decode the chunk of records 0-8 (ValueError); "
        "it may be damaged"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr"]


def test_reason_of_is_never_empty():
    from tldp_cli.errors import reason_of

    assert reason_of(ValueError()) == "ValueError"
    assert reason_of(MemoryError()) == "MemoryError"
    assert reason_of(OSError(2, "No such file or directory", "/x")) == "No such file or directory"
    assert reason_of(RuntimeError("two\nlines ")) == "two lines"
    assert reason_of(KeyError("shape")) == "'shape'"


# ------------------------------------------------------------ chunks that expand (issue 27)

BOMB = 16 << 20  # what each crafted chunk below expands to, for a chunk of 40 bytes
EXPANDING = {
    "zarr 2 blosc": (2, numcodecs.Blosc(cname="zstd")), "zarr 2 zstd": (2, numcodecs.Zstd()),
    "zarr 2 lz4": (2, numcodecs.LZ4()), "zarr 2 zlib": (2, numcodecs.Zlib()),
    "zarr 2 gzip": (2, numcodecs.GZip()), "zarr 2 bz2": (2, numcodecs.BZ2()),
    "zarr 2 lzma": (2, numcodecs.LZMA(preset=1)),  # a 1 MB window: the decoder's own memory
    "zarr 3 zstd": (3, ZstdCodec()),
    "zarr 3 gzip": (3, GzipCodec()), "zarr 3 blosc": (3, BloscCodec()),
}


def expanding_store(path, zarr_format: int, codec, expands_to: int):
    """A store zarr-python wrote, whose chunk of records 8-16 is replaced by one its own
    codec (numcodecs) encoded from `expands_to` zero bytes."""
    array = zarr.create_array(str(path), shape=SHAPE, chunks=CHUNKS, dtype="u1", zarr_format=zarr_format,
                              compressors=codec)
    array[:] = VALUES
    layout = layout_of(array)
    chunk = path / layout.key((1, 0))
    chunk.write_bytes(bytes(zarr_chunks._codec(layout.compressor).encode(np.zeros(expands_to, np.uint8))))
    return layout, chunk


@pytest.mark.parametrize("name", EXPANDING)
def test_a_chunk_that_expands_beyond_its_chunk_is_refused_before_it_is(tmp_path, name):
    """A Blosc/Zstandard chunk was decoded to the size its header states, and a zlib or gzip
    one to its end, before anything compared it with the 40 bytes of the array's chunk:
    a chunk of kilobytes took gigabytes in every worker. Refused naming the chunk file,
    with no more than a chunk allocated."""
    layout, chunk = expanding_store(tmp_path / "a.zarr", *EXPANDING[name], BOMB)
    tracemalloc.start()
    try:
        with pytest.raises(InputError) as refused:
            layout.read(tmp_path / "a.zarr", 8, 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert message.startswith(f"{chunk}: cannot decode the chunk of records 8-16 (") and "\n" not in message
    header = "header says it expands to 16777216 bytes, where a chunk holds 40"
    assert header in message or "it expands to more than the 40 bytes a chunk holds" in message, message
    assert peak < BOMB // 8, f"{peak} bytes allocated to refuse it"


def test_zstandard_frames_are_measured_as_numcodecs_writes_them(tmp_path):
    """The sizes the frames state are added up over every frame (numcodecs decodes several),
    and a frame that states none is decoded into the chunk's size, never beyond it."""
    data = VALUES[8:16, :5].tobytes()
    one = bytes(numcodecs.Zstd(level=5, checksum=True).encode(np.frombuffer(data, np.uint8)))
    half = bytes(numcodecs.Zstd().encode(np.frombuffer(data[:20], np.uint8)))
    other = bytes(numcodecs.Zstd().encode(np.frombuffer(data[20:], np.uint8)))
    assert zarr_chunks._zstd_content_size(one) == 40 and zarr_chunks._zstd_content_size(half + other) == 40
    assert bytes(zarr_chunks._decompressed(numcodecs.Zstd(), half + other, 40)) == data
    with pytest.raises(ValueError, match="header says it expands to 60 bytes, where a chunk holds 40"):
        zarr_chunks._decompressed(numcodecs.Zstd(), one + half, 40)
    # Single_Segment_flag off and Frame_Content_Size_flag 0: a frame that does not state its
    # size (as streaming writers make), of 8 raw blocks of 128 kB of zeros (a 1 MB window).
    blocks = [((128 << 10) << 3 | (i == 7)).to_bytes(3, "little") + bytes(128 << 10) for i in range(8)]
    unsized = (0xFD2FB528).to_bytes(4, "little") + bytes([0, (20 - 10) << 3]) + b"".join(blocks)
    assert zarr_chunks._zstd_content_size(unsized) is None
    assert len(bytes(numcodecs.Zstd().decode(unsized))) == 1 << 20  # numcodecs reads it
    with pytest.raises(RuntimeError, match="Destination buffer is too small"):
        zarr_chunks._decompressed(numcodecs.Zstd(), unsized, 40)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak memory from /proc")
@pytest.mark.parametrize("name", ["zarr 2 blosc", "zarr 3 zstd"])
def test_a_run_over_an_expanding_chunk_stays_small(tmp_path, name):
    """The review's case end to end: a chunk expanding to 512 MB took that much in the
    worker before the size check; refused with one line, nothing written, the process's
    peak resident memory far below it."""
    source = tmp_path / "in.zarr"
    _, chunk = expanding_store(source, *EXPANDING[name], 512 << 20)
    code, stderr, peak = run_measured(tmp_path, "perturb", source, "--eps", "1", "--out",
                                      tmp_path / "out.zarr", "--workers", "1")
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"tldp: error: {chunk}: cannot decode"), stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr"]
    assert peak < 300 << 20, f"peak RSS {peak >> 20} MB"  # 146 MB here; 660 MB before
    assert "header says it expands to 536870912 bytes, where a chunk holds 40" in lines[0]


def sharded_bomb(path: Path, codec, bomb: bytes) -> None:
    """A sharded array (zarr-python decodes it, not tldp's chunk files) whose first inner
    chunk is replaced by `bomb`, with the shard's index rewritten to match."""
    array = zarr.create_array(str(path), shape=(100, 100), chunks=(10, 100), shards=(50, 100), dtype="u1",
                              compressors=codec)
    array[:] = 1
    shard = path / "c" / "0" / "0"
    data = shard.read_bytes()
    index = np.frombuffer(data[-84:-4], "<u8").reshape(5, 2)
    inner = [data[offset:offset + length] for offset, length in index]
    inner[0] = bomb
    offsets, body = [], b""
    for part in inner:
        offsets.append((len(body), len(part)))
        body += part
    table = np.array(offsets, "<u8").tobytes()
    shard.write_bytes(body + bytes(numcodecs.CRC32C().encode(np.frombuffer(table, np.uint8))))


@pytest.mark.parametrize("name", ["zstd", "blosc", "gzip"])
def test_a_sharded_chunk_that_expands_beyond_its_chunk_is_refused_before_it_is(tmp_path, name):
    """The second review: chunks that zarr-python decodes (sharded arrays) were decompressed
    in full before any size check (a 256 MB frame in a 10x100 chunk took 260 MB more); tldp refuses it first."""
    zeros = np.zeros(64 << 20, np.uint8)
    codec, bomb = {"zstd": (ZstdCodec(), numcodecs.Zstd(level=19).encode(zeros)),
                   "blosc": (BloscCodec(), numcodecs.Blosc(cname="zstd").encode(zeros)),
                   "gzip": (GzipCodec(), numcodecs.GZip(level=9).encode(zeros))}[name]
    sharded_bomb(tmp_path / "in.zarr", codec, bytes(bomb))
    tracemalloc.start()
    try:
        with pytest.raises(InputError) as refused:
            perturb(PerturbOptions(input=tmp_path / "in.zarr", eps=1.0, out=str(tmp_path / "out.zarr"),
                                   workers=1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert "\n" not in message and ("expands to 67108864 bytes" in message or "expands to more than" in message)
    assert peak < (64 << 20) // 2, f"{peak} bytes allocated to refuse it"
    assert not (tmp_path / "out.zarr").exists()


def test_sharded_arrays_read_as_zarr_python_reads_them(tmp_path):
    """The size-checking codecs decode what zarr-python's own do."""
    values = np.random.default_rng(2).integers(0, 200, (100, 100)).astype(np.uint16)
    for name, codec in {"zstd": ZstdCodec(), "blosc": BloscCodec(), "gzip": GzipCodec()}.items():
        array = zarr.create_array(str(tmp_path / f"{name}.zarr"), shape=values.shape, chunks=(10, 100),
                                  shards=(50, 100), dtype=values.dtype, compressors=codec)
        array[:] = values
        assert type(zarr.open_array(str(tmp_path / f"{name}.zarr"), mode="r").metadata.codecs[0]
                    .codec_pipeline.bytes_bytes_codecs[0]) in zarr_chunks.CHECKED_CODECS.values()
        np.testing.assert_array_equal(zarr.open_array(str(tmp_path / f"{name}.zarr"), mode="r")[:], values)
