"""Full disks, short writes and inputs that shrink during a run: one line naming the file
and exit 1, never a traceback, a crash, a silently wrong output or a temporary file left.

The full-disk tests write into a real 2 MB tmpfs (mounting one needs root; they are
skipped otherwise). The run's check of the free space passes; then, as another process
filling the disk would, a filler file takes all but LEAVE bytes, so that the writer meets
ENOSPC in mid-run. tldp runs in a subprocess, where a crash shows as an exit code (HDF5
output on a full disk used to end in a segmentation fault).
"""

import errno
import os
import posix
import shutil
import signal
import struct
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from tests.builders import REPO, SEED, tree_digest
from tldp_cli.errors import InputError
from tldp_cli.files import checked_io
from tldp_cli.formats import FormatOptions, hdf5_output, hdf5_storage, hdf5_writer, safetensors_file

pytestmark = pytest.mark.slow

LEAVE = 64 << 10  # bytes the filler leaves free: enough to start the output, not to finish it

# Runs `tldp ARGS...` with the format's create_writer (its declaration's) first filling the
# disk: the moment after the pipeline checked the free space and before the writer starts.
FILLING_RUN = """
import dataclasses, importlib, os, shutil, sys
module = importlib.import_module(sys.argv[1])
filler, leave = sys.argv[2], int(sys.argv[3])
create_writer = module.FORMAT.create_writer

def create_writer_on_a_filled_disk(*args, **kwargs):
    free = shutil.disk_usage(os.path.dirname(filler)).free
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(1, free - leave))
    return create_writer(*args, **kwargs)

module.FORMAT = dataclasses.replace(module.FORMAT, create_writer=create_writer_on_a_filled_disk)
sys.argv = ["tldp", *sys.argv[4:]]
from tldp_cli.entry import main
main()
"""

# Runs `tldp ARGS...` with every pwrite failing with ENOSPC once `limit` bytes are written.
ENOSPC_RUN = """
import errno, os, sys
limit = int(sys.argv[1])
real_pwrite, written = os.pwrite, [0]

def pwrite(fd, data, position):
    if written[0] + len(data) > limit:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    written[0] += len(data)
    return real_pwrite(fd, data, position)

os.pwrite = pwrite
sys.argv = ["tldp", *sys.argv[2:]]
from tldp_cli.entry import main
main()
"""


def tldp(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def assert_one_line(done: subprocess.CompletedProcess, named: str, *fragments: str) -> str:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"tldp: error: {named}"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def tmpfs(tmp_path):
    """A real 2 MB tmpfs with an empty folder `out` for the outputs (the filler goes beside it)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small tmpfs to fill")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 2 MB tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        (mount / "out").mkdir()
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def values(records: int = 256, elements: int = 1024) -> np.ndarray:
    """1 MB of float32 in [0, 1): half the tmpfs, so the free-space check passes."""
    return np.random.default_rng(7).random((records, elements), dtype=np.float32)


def write_h5(path, **layout):
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=values(), **layout)
        f.create_dataset("labels", data=np.arange(256))
        f.attrs["title"] = "sample"
    return path


def write_images(folder, count: int, size: int, other_bytes: int = 0):
    rng = np.random.default_rng(8)
    (folder / "sub").mkdir(parents=True)
    for i in range(count):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / ("sub" if i % 2 else ".") / f"im{i}.png")
    if other_bytes:
        (folder / "notes.bin").write_bytes(rng.bytes(other_bytes))
    return folder


def write_npy(folder):
    np.save(folder / "in.npy", values())
    return folder / "in.npy"


def write_safetensors(folder):
    save_file({"w": values(), "step": np.arange(4)}, folder / "in.safetensors")
    return folder / "in.safetensors"


def write_npz(folder):
    np.savez(folder / "in.npz", w=values(), step=np.arange(4))
    return folder / "in.npz"


def write_zarr(folder):
    """Plain chunk files, written by the writer thread (formats/zarr_chunks.py)."""
    import zarr

    zarr.create_array(store=str(folder / "in.zarr"), shape=(256, 1024), dtype="float32",
                      chunks=(16, 1024))[:] = values()
    return folder / "in.zarr"


INPUTS = {  # kind: (write the input into a folder, format module, output name)
    "npy": (write_npy, "npy", "out.npy"),
    "hdf5-contiguous": (lambda folder: write_h5(folder / "in.h5"), "hdf5", "out.h5"),
    # Chunks wait in HDF5's chunk cache: the disk is found full only when the file is closed.
    "hdf5-chunked": (lambda folder: write_h5(folder / "in.h5", chunks=(16, 1024)), "hdf5", "out.h5"),
    "hdf5-gzip": (lambda folder: write_h5(folder / "in.h5", chunks=(16, 1024), compression="gzip"),
                  "hdf5", "out.h5"),
    "safetensors": (write_safetensors, "safetensors_file", "out.safetensors"),
    "npz": (write_npz, "npz", "out.npz"),
    "png": (lambda folder: write_images(folder / "in", 8, 256), "images", "outdir"),
    "zarr": (write_zarr, "zarr_store", "out.zarr"),
}


@pytest.mark.parametrize("kind", INPUTS)
def test_a_disk_that_fills_during_the_run(tmp_path, tmpfs, kind):
    make, module, name = INPUTS[kind]
    src = make(tmp_path)
    before = tree_digest(src)
    out = tmpfs / "out" / name
    value_range = [] if module == "images" else ["--range", "0:1"]  # 8-bit images: 0:256
    done = tldp(FILLING_RUN, f"tldp_cli.formats.{module}", tmpfs / "filler", LEAVE,
                "perturb", src, "--eps", "1", *value_range, "--out", out)
    assert_one_line(done, str(out), "cannot write (No space left on device)")
    assert os.listdir(tmpfs / "out") == []
    assert tree_digest(src) == before


def test_a_disk_that_fills_writing_float_tiff(tmp_path, tmpfs):
    src = write_images(tmp_path / "in", 4, 128)  # 786 kB of float32
    out = tmpfs / "out" / "outdir"
    done = tldp(FILLING_RUN, "tldp_cli.formats.images", tmpfs / "filler", LEAVE,
                "perturb", src, "--eps", "1", "--image-format", "tiff", "--out", out)
    assert_one_line(done, f"{out}/im", ".tiff: cannot write (No space left on device)")
    assert os.listdir(tmpfs / "out") == []


def test_a_disk_that_fills_copying_other_files(tmp_path, tmpfs):
    src = write_images(tmp_path / "in", 2, 16, other_bytes=600_000)
    before = tree_digest(src)
    out = tmpfs / "out" / "outdir"
    done = tldp(FILLING_RUN, "tldp_cli.formats.images", tmpfs / "filler", LEAVE,
                "perturb", src, "--eps", "1", "--copy-other", "--out", out)
    assert_one_line(done, f"{out}/notes.bin: cannot write (No space left on device)")
    assert os.listdir(tmpfs / "out") == []
    assert tree_digest(src) == before


@pytest.mark.parametrize("layout", [{}, {"chunks": (16, 1024)}])
def test_hdf5_write_errors_without_a_tmpfs(tmp_path, layout):
    """The same failure by fault injection, where no tmpfs can be mounted: ENOSPC once the
    output holds 64 kB, during the writes (contiguous) or when the file is closed (chunked)."""
    src = write_h5(tmp_path / "in.h5", **layout)
    out = tmp_path / "out" / "out.h5"
    out.parent.mkdir()
    done = tldp(ENOSPC_RUN, LEAVE, "perturb", src, "--eps", "1", "--range", "0:1", "--out", out)
    assert_one_line(done, str(out), "cannot write (No space left on device)")
    assert os.listdir(out.parent) == []


# --- Short writes --------------------------------------------------------------------------

@pytest.fixture
def short_pwrites(monkeypatch):
    """os.pwrite writes at most 12 kB + 1 byte a call, as one write of more than 0x7ffff000
    bytes does on Linux; returns the lengths asked for."""
    real_pwrite, asked = os.pwrite, []

    def pwrite(fd, data, position):
        data = memoryview(data).cast("B")
        asked.append(len(data))
        return real_pwrite(fd, data[:12289], position)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return asked


def test_short_writes_are_completed(tmp_path, short_pwrites):
    tensors = {"w": values(64, 1000), "b16": values(8, 100).astype(np.float16), "step": np.arange(5)}
    src = tmp_path / "in.safetensors"
    save_file(tensors, src)
    reader = safetensors_file.open_reader(src, FormatOptions())
    out = tmp_path / "out.safetensors"
    writer = safetensors_file.create_writer(reader, out, np.dtype(np.float32), FormatOptions())
    noisy = {"w": tensors["w"] + 1, "b16": tensors["b16"].astype(np.float32) - 1}
    for job in reader.arrays():
        writer.block_writer()(job, 0, noisy[job.name][None])
    writer.close()
    assert max(short_pwrites) > 12289  # the writes were cut short, and completed
    written = load_file(out)
    np.testing.assert_array_equal(written["w"], noisy["w"])
    np.testing.assert_array_equal(written["b16"], noisy["b16"].astype(np.float16))
    np.testing.assert_array_equal(written["step"], tensors["step"])


def test_short_writes_through_the_cli(cli, tmp_path, short_pwrites, monkeypatch):
    src = tmp_path / "in.safetensors"
    save_file({"w": values(64, 1000), "step": np.arange(5)}, src)
    run = ("perturb", src, "--eps", "1", "--range", "0:1", "--seed", SEED, "--out")
    result = cli(*run, tmp_path / "out.safetensors")
    assert result.exit_code == 0, result.stderr
    assert max(short_pwrites) > 12289  # the writes were cut short, and completed
    # The same seeded run with whole writes: a lost tail would read as zeros, which exact noise
    # on the grid can also give, so the reference is the output itself.
    monkeypatch.setattr(os, "pwrite", posix.pwrite)
    assert cli(*run, tmp_path / "reference.safetensors").exit_code == 0
    written, reference = load_file(tmp_path / "out.safetensors"), load_file(tmp_path / "reference.safetensors")
    np.testing.assert_array_equal(written["w"], reference["w"])
    assert not np.array_equal(written["w"], values(64, 1000))  # perturbed
    np.testing.assert_array_equal(written["step"], np.arange(5))


def test_a_write_of_nothing_is_an_error(cli, tmp_path, monkeypatch):
    src = tmp_path / "in.safetensors"
    save_file({"w": values(64, 1000)}, src)
    monkeypatch.setattr(os, "pwrite", lambda fd, data, position: 0)
    out = tmp_path / "out.safetensors"
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--out", out)
    assert result.exit_code == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == f"tldp: error: {out}: cannot write (the filesystem wrote nothing)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_write_errors_stay_oserrors_with_their_errno(tmp_path):
    with pytest.raises(OSError) as caught, checked_io.writing(tmp_path / "out.npy"):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert caught.value.errno == errno.EDQUOT
    assert str(caught.value) == f"{tmp_path / 'out.npy'}: cannot write ({os.strerror(errno.EDQUOT)})"


# --- HDF5 input that shrinks, or declares more than it holds ------------------------------

@pytest.mark.parametrize("placed", [True, False], ids=["read-beside-hdf5", "read-through-h5py"])
def test_hdf5_input_truncated_during_a_read(cli, tmp_path, monkeypatch, placed):
    """HDF5 reads the part of a file cut off after it was opened as zeros; plain reads of
    the records (formats/hdf5_storage.py's Placement) come back short."""
    src = write_h5(tmp_path / "in.h5")
    size = src.stat().st_size
    real_getitem, real_read = h5py.Dataset.__getitem__, hdf5_storage.Placement.read

    def truncating_getitem(self, key):
        os.truncate(src, size // 2)
        return real_getitem(self, key)

    def truncating_read(self, path, start, stop):
        os.truncate(src, size // 2)
        return real_read(self, path, start, stop)

    if not placed:
        monkeypatch.setattr(hdf5_storage, "MAX_PLACED_CHUNKS", 0)  # chunked: read through h5py
        src = write_h5(tmp_path / "in.h5", chunks=(16, 1024))
        size = src.stat().st_size
    monkeypatch.setattr(h5py.Dataset, "__getitem__", truncating_getitem)
    monkeypatch.setattr(hdf5_storage.Placement, "read", truncating_read)
    result = cli("perturb", src, "--dataset", "x", "--eps", "1", "--range", "0:1",
                 "--out", tmp_path / "out.h5")
    assert result.exit_code == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == f"tldp: error: {src}: the file shrank from {size} to {size // 2} bytes while tldp was reading it"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


def test_hdf5_input_truncated_while_it_is_copied(cli, tmp_path, monkeypatch):
    """The datasets copied unchanged come from the handle opened at the start."""
    src = write_h5(tmp_path / "in.h5")
    size = src.stat().st_size
    copy_group = hdf5_writer.Hdf5Writer._copy_group

    def truncating_copy_group(self, source, target):
        os.truncate(src, size - 1024)
        copy_group(self, source, target)

    monkeypatch.setattr(hdf5_writer.Hdf5Writer, "_copy_group", truncating_copy_group)
    result = cli("perturb", src, "--dataset", "x", "--eps", "1", "--range", "0:1",
                 "--out", tmp_path / "out.h5")
    assert result.exit_code == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"{src}: the file shrank from {size} to {size - 1024} bytes" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


def test_hdf5_dataset_beyond_the_end_of_the_file(cli, tmp_path):
    """A file cut short whose superblock was made to agree: HDF5 opens it, the dataset does
    not fit in it."""
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:  # the earliest format: a version 0 superblock
        data = f.create_dataset("x", data=values(100, 1000))
        end = data.id.get_offset() + data.nbytes // 2
    with open(src, "r+b") as f:
        f.seek(40)  # version 0 superblock: the end-of-file address
        f.write(struct.pack("<Q", end))
        f.truncate(end)
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--out", tmp_path / "out.h5")
    assert result.exit_code == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tldp: error: {src}: ") and "truncated or corrupt" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


def test_hdf5_contiguous_extent_is_checked_against_the_size_at_open(tmp_path):
    src = write_h5(tmp_path / "in.h5")
    with h5py.File(src, "r") as f:
        hdf5_storage.check_storage(src, src.stat().st_size, "/x", f["x"], perturbed=True)
        with pytest.raises(InputError, match="beyond the end of the file"):
            hdf5_storage.check_storage(src, 4096, "/x", f["x"], perturbed=False)


def test_hdf5_declaring_far_more_than_it_holds_is_refused_at_open(cli, tmp_path):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", shape=(10**12, 1000), dtype="f4", chunks=(1000, 1000))
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--out", tmp_path / "out.h5")
    assert result.exit_code == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tldp: error: {src}: dataset /x declares 4000000000000000 bytes")
    assert "never written" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


def test_hdf5_sparse_and_highly_compressed_datasets_are_read(cli, tmp_path):
    """Legal files: chunks never written read as the fill value; zeros compress a thousandfold."""
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        sparse = f.create_dataset("sparse", shape=(1000, 100), dtype="f4", chunks=(10, 100), fillvalue=0.5)
        sparse[:100] = 0.25
        f.create_dataset("zeros", data=np.zeros((1000, 100), np.float32), chunks=(100, 100),
                         compression="gzip")
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--out", tmp_path / "out.h5")
    assert result.exit_code == 0, result.stderr
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["sparse"].shape == (1000, 100) and f["zeros"].shape == (1000, 100)


def test_signals_wait_while_hdf5_works_on_the_output():
    """A KeyboardInterrupt inside an HDF5 driver callback would be taken for a failed write."""
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with hdf5_output.signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            reached = True
    assert reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
