"""The .npy writer sends whole pages to the disk with direct I/O (O_DIRECT) and the rest
through the page cache; the file must be the same byte for byte whichever path each
part took, and where the filesystem refuses direct I/O."""

import errno
import hashlib
import json
import os
import threading

import numpy as np
import pytest

from tests.builders import disk_full_after, refuse_direct_open, refuse_direct_writes
from tldp_cli.files import checked_io
from tldp_cli.run.pipeline import PerturbOptions, perturb
from tldp_cli.sampling.engine import PAGE, page_aligned_empty

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this OS")


def run(tmp_path, name, data, **options):
    src = tmp_path / f"{name}-in.npy"
    np.save(src, data)
    out = tmp_path / f"{name}-out.npy"
    # Records of a few uint8 values keep raw values with probability above dp_delta, which needs
    # consent (tests/privacy/test_raw_release.py); these tests are about the writer.
    result = perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=5, allow_weak_seed=True,
                                    allow_raw_release=True, **options))
    return out, json.loads(result.manifest_path.read_text())


def test_header_is_a_page_and_numpy_reads_it(tmp_path, direct_opens):
    data = np.random.default_rng(0).integers(0, 256, (3000, 28, 28), dtype=np.uint8)
    out, manifest = run(tmp_path, "a", data, block_elements=1 << 18)
    raw = out.read_bytes()
    assert int.from_bytes(raw[8:12], "little") + 12 == PAGE  # version 2.0 header length
    # uint8 data under the default exact sampler comes out int16 (integer noise, widened)
    assert len(raw) == PAGE + data.size * 2
    loaded = np.load(out)
    assert loaded.shape == data.shape and loaded.dtype == np.int16
    np.testing.assert_array_equal(np.load(out, mmap_mode="r")[:, 0, 0], loaded[:, 0, 0])
    assert manifest["outputs"][0]["sha256"] == hashlib.sha256(raw).hexdigest()
    assert direct_opens  # the whole-page blocks did go direct


@pytest.mark.parametrize("records, elements, block_elements, workers, goes_direct", [
    (2100, (28, 28), 1 << 18, 2, True),  # blocks of whole pages
    (2100, (1025,), 5000, 3, True),      # 2050-byte int16 records: blocks start and end inside pages
    (300, (3,), 700, 1, False),          # less than a page of output: nothing goes direct
])
def test_direct_equals_page_cache_writes(tmp_path, monkeypatch, direct_opens, records, elements, block_elements,
                                         workers, goes_direct):
    data = np.random.default_rng(1).integers(0, 256, (records, *elements), dtype=np.uint8)
    direct, manifest = run(tmp_path, "direct", data, block_elements=block_elements, workers=workers)
    used_direct = bool(direct_opens)
    monkeypatch.setattr(checked_io, "_O_DIRECT", 0)
    cached, _ = run(tmp_path, "cached", data, block_elements=block_elements, workers=workers)
    assert direct.read_bytes() == cached.read_bytes()
    assert manifest["outputs"][0]["sha256"] == hashlib.sha256(direct.read_bytes()).hexdigest()
    assert used_direct == goes_direct


def test_filesystem_without_direct_io(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (EINVAL at open, or at the write) gets ordinary
    writes and the same file."""
    data = np.random.default_rng(2).integers(0, 256, (2000, 28, 28), dtype=np.uint8)
    expected, _ = run(tmp_path, "expected", data)
    with monkeypatch.context() as patch:
        refuse_direct_open(patch)
        out, _ = run(tmp_path, "refused-open", data)
    assert out.read_bytes() == expected.read_bytes()
    with monkeypatch.context() as patch:
        refused = refuse_direct_writes(patch)
        out, _ = run(tmp_path, "refused-write", data)
    assert refused
    assert out.read_bytes() == expected.read_bytes()


def test_other_write_errors_are_not_swallowed(tmp_path, monkeypatch):
    data = np.random.default_rng(3).integers(0, 256, (2000, 28, 28), dtype=np.uint8)
    refuse_direct_open(monkeypatch, errno.ENOSPC)
    with pytest.raises(OSError, match="No space"):
        run(tmp_path, "full", data)
    assert not list(tmp_path.glob("full-out*")) and not list(tmp_path.glob(".full-out*"))


def test_page_aligned_empty():
    for shape, dtype in [((3, 5), np.float32), ((0,), np.float64), ((4097,), np.uint8)]:
        a = page_aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype
        assert a.size == 0 or a.ctypes.data % PAGE == 0
        assert a.flags.c_contiguous and a.flags.writeable


@pytest.mark.parametrize("workers", [1, 2])
def test_a_write_failure_in_the_writer_thread_is_one_line_and_leaves_nothing(cli, tmp_path, monkeypatch, workers):
    """ENOSPC from a write on the writer's own thread: exit 1, one line naming the file, no
    output, no temporary file, and no writer or hasher thread left behind."""
    src = tmp_path / "in.npy"
    np.save(src, np.random.default_rng(4).integers(0, 256, (3000, 28, 28), dtype=np.uint8))
    disk_full_after(monkeypatch, 2)
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out.npy", "--workers", workers,
                 "--block-elements", 1 << 18)
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert "No space left on device" in line and "out.npy" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npy"]
    assert not [t for t in threading.enumerate() if t.name.startswith("tldp ")]


def test_ctrl_c_while_closing_leaves_no_thread():
    """A second Ctrl-C while close() waits for queued blocks: the rest are dropped and the
    thread still ends."""
    import _thread
    import time

    background = checked_io.Background(lambda item: time.sleep(0.2), "tldp test")
    for item in range(3):
        background.put(item)
    threading.Timer(0.05, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        background.close()
    background._thread.join(timeout=5)
    assert not background._thread.is_alive()
