"""Zarr chunk files go to disk from a writer thread, their whole pages with direct I/O
(O_DIRECT) and the rest through the page cache: the files must be the same byte for
byte whichever path each part took, where the filesystem refuses direct I/O too, a
failure on the writer's thread is one line that leaves nothing, and --resume journals
a block only once its files are written."""

import errno
import hashlib
import json
import os
import threading
import time

import numpy as np
import pytest
import zarr

from tests.builders import disk_full_after, refuse_direct_open, refuse_direct_writes
from tldp_cli.errors import OutputError
from tldp_cli.files import checked_io
from tldp_cli.formats import zarr_chunks, zarr_writer
from tldp_cli.run import resume
from tldp_cli.run.pipeline import PerturbOptions, perturb
from tldp_cli.sampling.engine import PAGE

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this OS")

SHAPE = (600, 28, 28)  # 1024-byte uint8 records, chunks of 50 records: 12 chunk files


def make_store(path, compressors="auto"):
    data = np.random.default_rng(0).integers(0, 256, SHAPE, dtype=np.uint8)
    zarr.create_array(store=str(path), shape=SHAPE, dtype="uint8", chunks=(50, 28, 28),
                      compressors=compressors)[:] = data
    return path


def chunk_bytes(store):
    return {p.relative_to(store).as_posix(): p.read_bytes() for p in sorted((store / "c").rglob("*"))
            if p.is_file()}


def run(tmp_path, name, **options):
    src = tmp_path / "in.zarr"
    if not src.exists():
        make_store(src)
    out = tmp_path / f"{name}.zarr"
    result = perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=5, allow_weak_seed=True,
                                    block_elements=100 * 784, **options))
    return out, json.loads(result.manifest_path.read_text())


def test_direct_equals_page_cache_writes(tmp_path, monkeypatch, direct_opens):
    direct, manifest = run(tmp_path, "direct", workers=2)
    assert any(str(p).startswith(str(tmp_path / ".direct.zarr")) for p in direct_opens)
    monkeypatch.setattr(checked_io, "_O_DIRECT", 0)
    cached, _ = run(tmp_path, "cached", workers=2)
    assert chunk_bytes(direct) == chunk_bytes(cached) and len(chunk_bytes(direct)) == 12
    np.testing.assert_array_equal(zarr.open_array(str(direct), mode="r")[:],
                                  zarr.open_array(str(cached), mode="r")[:])
    for entry in manifest["outputs"]:
        assert entry["sha256"] == hashlib.sha256(open(entry["path"], "rb").read()).hexdigest()


def test_filesystem_without_direct_io(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (EINVAL at open, or at the write) gets ordinary
    writes and the same files."""
    expected, _ = run(tmp_path, "expected")
    with monkeypatch.context() as patch:
        refuse_direct_open(patch)
        out, _ = run(tmp_path, "refused-open")
    assert chunk_bytes(out) == chunk_bytes(expected)
    with monkeypatch.context() as patch:
        refused = refuse_direct_writes(patch)
        out, _ = run(tmp_path, "refused-write")
    assert refused
    assert chunk_bytes(out) == chunk_bytes(expected)


@pytest.mark.parametrize("size", [0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5, (1 << 20) + 3])
def test_write_new_file_replaces_the_whole_file(tmp_path, size):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (size + 2 * PAGE + 7))  # longer: must be cut, not overwritten in place
    data = np.random.default_rng(size).bytes(size)
    checked_io.write_new_file(path, data)
    assert path.read_bytes() == data


@pytest.mark.parametrize("workers", [1, 2])
def test_a_write_failure_in_the_writer_thread_is_one_line_and_leaves_nothing(cli, tmp_path, monkeypatch,
                                                                              workers):
    """ENOSPC on the writer's thread: exit 1, one line naming the chunk file, no output, no
    partial store, and no writer thread left behind."""
    src = make_store(tmp_path / "in.zarr")
    disk_full_after(monkeypatch, 4)
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out.zarr", "--workers", workers,
                 "--block-elements", 100 * 784)
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert "No space left on device" in line and "out.zarr/c/" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr"]
    assert not [t for t in threading.enumerate() if t.name.startswith("tldp ")]


def test_resume_journals_a_block_only_once_its_files_are_written(tmp_path, monkeypatch):
    """The writer thread is slowed down: when the journal records a block, every chunk file
    of it holds its final bytes already."""
    real_write_files = zarr_chunks.write_files

    def slow_write_files(directory, files):
        time.sleep(0.05)
        real_write_files(directory, files)

    journaled = []
    real_done = resume.Partial.done

    def done(self, array, start, stop, note):
        store = self.root / "store" / "c"
        # chunks of 50 records: the files of records start:stop, and what each holds now
        journaled.append({index: (store / str(index) / "0" / "0").exists()
                          for index in range(start // 50, -(-stop // 50))})
        real_done(self, array, start, stop, note)

    monkeypatch.setattr(zarr_chunks, "write_files", slow_write_files)
    monkeypatch.setattr(resume.Partial, "done", done)
    out, _ = run(tmp_path, "slow", workers=2)
    assert len(journaled) == 6 and all(all(block.values()) for block in journaled), journaled
    assert len(chunk_bytes(out)) == 12


def test_background_futures():
    seen = []
    background = checked_io.Background(seen.append, "tldp test")
    futures = [background.put(item) for item in range(3)]
    assert [f.result(timeout=5) for f in futures] == [None] * 3 and seen == [0, 1, 2]
    background.close()

    def fail_on_one(item):
        if item == 1:
            raise OSError(errno.EIO, "I/O error")
        time.sleep(0.01)

    background = checked_io.Background(fail_on_one, "tldp test", depth=4)
    futures = [background.put(item) for item in range(3)]
    assert futures[0].result(timeout=5) is None
    for future in futures[1:]:  # the failing item, and the one dropped after it
        with pytest.raises(OSError, match="I/O error"):
            future.result(timeout=5)
    with pytest.raises(OSError, match="I/O error"):
        background.close()


def test_a_put_after_close_is_refused_not_blocked():
    """A worker that ends its block after a second Ctrl-C cut close() short finds the
    writer closed: put() refuses at once instead of waiting forever for a thread that is
    gone (the process would then hang at exit)."""
    background = checked_io.Background(lambda item: None, "tldp test", depth=2)
    background.close()
    refused = []

    def late_worker():
        for item in range(5):  # more than depth
            try:
                background.put(item)
            except RuntimeError:
                refused.append(item)

    worker = threading.Thread(target=late_worker, daemon=True)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "put() blocked after close()"
    assert refused == list(range(5))


def after_the_second_block(monkeypatch, action) -> None:
    """action(blocks, job) runs once the writer has taken its second block."""
    real_call = zarr_writer._Blocks.__call__
    calls = []

    def write_then_act(self, job, start, block):
        moved = real_call(self, job, start, block)
        calls.append(start)
        if len(calls) == 2:
            action(self, job)
        return moved

    monkeypatch.setattr(zarr_writer._Blocks, "__call__", write_then_act)


@pytest.mark.parametrize("sharded", [False, True])
def test_an_output_removed_during_the_run_fails(tmp_path, monkeypatch, sharded):
    """The partial output removed after two blocks (a cleanup script, say): the run fails
    with one line, rather than commit chunks without their metadata (plain chunk files
    went through mkdir(parents=True), sharded ones through zarr-python, which both made
    the removed folders again)."""
    src = tmp_path / "in.zarr"
    data = np.random.default_rng(0).integers(0, 256, SHAPE, dtype=np.uint8)
    zarr.create_array(store=str(src), shape=SHAPE, dtype="uint8", chunks=(50, 28, 28),
                      shards=(100, 28, 28) if sharded else None)[:] = data
    after_the_second_block(monkeypatch, lambda blocks, job: os.rename(blocks.root.parent, tmp_path / "gone"))
    out = tmp_path / "out.zarr"  # its .out.zarr.tldp-partial went at once
    with pytest.raises(OutputError, match=r"out\.zarr"):
        perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=5, allow_weak_seed=True,
                               block_elements=100 * 784, workers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "in.zarr"]


@pytest.mark.parametrize("sharded", [False, True])
def test_every_output_file_is_flushed_to_disk(tmp_path, monkeypatch, sharded):
    """Chunk files are flushed as the writer thread writes them, the rest (metadata,
    chunks written through zarr-python) when the writer closes: none is left to the
    kernel's writeback when the manifest says the output is complete."""
    src = tmp_path / "in.zarr"
    data = np.random.default_rng(0).integers(0, 256, SHAPE, dtype=np.uint8)
    zarr.create_array(store=str(src), shape=SHAPE, dtype="uint8", chunks=(50, 28, 28),
                      shards=(100, 28, 28) if sharded else None)[:] = data
    flushed = set()
    real_fsync = os.fsync

    def fsync(fd):
        flushed.add(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) + f":{os.fstat(fd).st_ino}")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out.zarr"
    perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=5, allow_weak_seed=True,
                           block_elements=100 * 784, workers=2))
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) >= 7  # zarr.json and 6 shards, or 12 chunk files
    assert {f"{p.name}:{p.stat().st_ino}" for p in files} <= flushed


def test_a_chunk_file_removed_during_the_run_fails_it(tmp_path, monkeypatch):
    """A chunk file deleted after it was written: the store would read the fill value
    there, under a manifest that does not list it."""
    src = make_store(tmp_path / "in.zarr")

    def remove_the_first_chunk(blocks, job):
        blocks.wait(job.name, 0)
        next(iter(blocks.digests)).unlink()

    after_the_second_block(monkeypatch, remove_the_first_chunk)
    with pytest.raises(OutputError, match=r"out\.zarr/c/0/0/0: removed while tldp wrote the output"):
        perturb(PerturbOptions(input=src, eps=1.0, out=tmp_path / "out.zarr", seed=5,
                               allow_weak_seed=True, block_elements=100 * 784, workers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr"]
