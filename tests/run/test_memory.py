"""Peak memory does not grow with the input: measured (peak RSS), never timed."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from tests.builders import MEASURED_ENV
from tldp_cli.run.pipeline import PerturbOptions, perturb

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tldp_cli.run.pipeline import PerturbOptions, perturb
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    perturb(PerturbOptions(input=src, eps=1.0, out=out, rng="fast", seed=1, allow_weak_seed=True, workers=2,
                           block_elements=1 << 18))
    # VmHWM belongs to this process image; ru_maxrss would include the forking parent's.
    status = Path("/proc/self/status").read_text().splitlines()
    print(next(line.split()[1] for line in status if line.startswith("VmHWM:")))  # KiB
""")
SLAB = 10_000  # records written at a time while making the input


def make_input(tmp_path, fmt, records):
    shape = (records, 1000)
    if fmt in ("npy", "npy-fortran"):
        path = tmp_path / f"in{records}.npy"
        data = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape,
                                         fortran_order=fmt == "npy-fortran")
    elif fmt == "hdf5":
        path = tmp_path / f"in{records}.h5"
        handle = h5py.File(path, "w")
        data = handle.create_dataset("x", shape=shape, dtype=np.uint8, chunks=(1000, 1000))
    else:
        path = tmp_path / f"in{records}.zarr"
        data = zarr.create_array(store=str(path), shape=shape, dtype=np.uint8, chunks=(1000, 1000))
    for start in range(0, records, SLAB):
        data[start:start + SLAB] = start % 251
    if fmt == "hdf5":
        handle.close()
    del data
    return path


def peak_rss_kib(tmp_path, fmt, records):
    src = make_input(tmp_path, fmt, records)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / f"out-{src.name}")],
                            capture_output=True, text=True, check=True, env={**os.environ, **MEASURED_ENV})
    return int(result.stdout.strip())


@pytest.mark.parametrize("fmt", ["npy", "npy-fortran", "hdf5", "zarr"])
def test_peak_memory_is_flat_in_input_size(tmp_path, fmt):
    # 10 MB and 60 MB of uint8 input (40 MB and 240 MB of float32 output), blocks of 0.25 M
    # elements. Holding either array whole would add over 47 MiB (a reader keeping the blocks
    # it read: 48 to 50 MiB); with MEASURED_ENV the peaks of the two runs are within 2 MiB.
    # npy-fortran: a Fortran-order array's blocks were read through a memory map, of which each
    # block of records touches every page: the whole file was resident (about 50 MiB more).
    small = peak_rss_kib(tmp_path, fmt, 10_000)
    large = peak_rss_kib(tmp_path, fmt, 60_000)
    grown_mib = (large - small) / 1024
    assert grown_mib < 25, f"peak RSS grew by {grown_mib:.0f} MiB for 6x the input"


def test_block_size_does_not_change_the_output(tmp_path):
    src = tmp_path / "x.npy"
    np.save(src, np.random.default_rng(0).integers(0, 256, (3000, 50), dtype=np.uint8))
    outs = []
    for i, block in enumerate([1 << 12, 1 << 16, 1 << 22]):
        out = tmp_path / f"o{i}.npy"
        perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=11, allow_weak_seed=True,
                               block_elements=block))
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def deflated_zeros_npz(path, shape, fortran_order=False):
    """An .npz whose one float32 tensor is zeros of `shape`, deflated as np.savez_compressed
    stores it (about 1000:1), written in pieces so that making it takes no memory."""
    import zipfile

    elements = int(np.prod(shape))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("w.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": fortran_order,
                                                          "shape": tuple(shape)})
            piece = bytes(1 << 23)
            for start in range(0, elements * 4, len(piece)):
                member.write(piece[:min(len(piece), elements * 4 - start)])
    return path


MEMORY_LIMIT = int(1.4 * (1 << 30))  # bytes of address space


def limited_run(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`tldp *args` in a process limited to MEMORY_LIMIT bytes of address space."""
    import resource

    return subprocess.run([sys.executable, "-m", "tldp_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT)))


def test_a_tensor_that_cannot_fit_in_memory_is_refused_before_it_is_read(tmp_path):
    """A 0.4 MB .npz holding a 400 MB tensor stored in Fortran order, which is read whole,
    for a process limited to 1.4 GiB: perturbing it needs at least its values, their noise
    and the output side by side (1.6 GB). It ran into memory errors (an ImportError, a
    MemoryError) once the tensor was inflated; it is refused from the header, one line,
    nothing written."""
    src = deflated_zeros_npz(tmp_path / "zeros.npz", (10_000, 10_000), fortran_order=True)
    assert src.stat().st_size < 1_000_000
    run = limited_run("perturb", src, "--eps", "1", "--clip", "1")
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith(f"tldp: error: {src}: tensor w: a record of 100,000,000 elements"), run.stderr
    assert "needs at least 1.6 GB of memory" in run.stderr and len(run.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zeros.npz"]


def test_a_tensor_larger_than_memory_allows_is_perturbed_in_parts(tmp_path):
    """The same 400 MB tensor in C order, under the same limit: read (inflated), perturbed and
    written (deflated) part by part, in flat memory, where it was refused (or ran out of
    memory) before. The output is the tensor numpy reads: its shape, dtype and noise."""
    import zipfile

    src = deflated_zeros_npz(tmp_path / "zeros.npz", (8192, 4096))
    run = limited_run("perturb", src, "--eps", "1", "--clip", "1", "--out", tmp_path / "out.npz")
    assert run.returncode == 0, run.stderr
    with zipfile.ZipFile(tmp_path / "out.npz") as archive, archive.open("w.npy") as member:
        version = np.lib.format.read_magic(member)
        assert np.lib.format.read_array_header_1_0(member) == ((8192, 4096), False, np.dtype("<f4"))
        assert version == (1, 0)
        head = np.frombuffer(member.read(4 << 20), "<f4")
        assert np.isfinite(head).all() and np.count_nonzero(head) > 0.99 * head.size
        member.seek(-(4 << 20), 2)
        tail = np.frombuffer(member.read(), "<f4")
        assert np.isfinite(tail).all() and np.count_nonzero(tail) > 0.99 * tail.size


TENSOR = (8192, 4096)  # 32 M float32 values: 128 MiB
SMALL_TENSOR = (1024, 4096)  # 16 MiB


def _model(folder, fmt, shape):
    """A model file of one float32 tensor of `shape` (and a small one), written by its library."""
    from safetensors.numpy import save_file

    from tests.builders import write_sharded_model

    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors = {"embed.weight": rng.standard_normal(shape, dtype=np.float32) * 0.02,
               "norm.weight": np.ones(4096, np.float32)}
    if fmt == "safetensors":
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder / "model.safetensors"
    if fmt == "sharded":
        return write_sharded_model(folder / "model", tensors, max_shard_size=1 << 20)
    np.savez(folder / "model.npz", **tensors)
    return folder / "model.npz"


def _read_back(path, fmt) -> dict:
    """The output's tensors, as their consumers read them (safe_open, the hub's index, np.load)."""
    from safetensors.numpy import load_file

    from tests.builders import read_sharded_model

    if fmt == "safetensors":
        return load_file(str(path))
    if fmt == "sharded":
        return read_sharded_model(path)
    with np.load(path) as archive:
        return dict(archive)


def _perturbed(tmp_path, fmt, shape) -> tuple[int, Path, Path]:
    """Perturbs a model whose largest tensor has `shape`, in a process of its own: (how far its
    resident memory rose while the blocks ran, the model, the output)."""
    from tests.builders import run_measured_phase

    src = _model(tmp_path / f"in{shape[0]}", fmt, shape)
    out = tmp_path / f"out{shape[0]}-{src.name}"
    code, stderr, _, rise = run_measured_phase(tmp_path, "perturbing", "perturb", src, "--eps", "1", "--clip",
                                               "0.1", "--out", out, "--block-elements", 1 << 18)
    assert code == 0, stderr
    return rise, src, out


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "npz"])
def test_a_model_s_largest_tensor_is_perturbed_in_flat_memory(tmp_path, fmt):
    """A model's tensor is one record, but it is read, perturbed and written part by part:
    8 times the tensor (16 MiB, then 128 MiB) and the resident memory the blocks add grows
    by far less than the tensor (by about 770 MiB when a tensor was perturbed whole). The
    output loads with the format's own reader, its values noised."""
    small, _, _ = _perturbed(tmp_path, fmt, SMALL_TENSOR)
    large, src, out = _perturbed(tmp_path, fmt, TENSOR)
    grown = large - small
    assert grown < 16 << 20, f"the memory the blocks add grew by {grown / 2**20:.0f} MiB for 8x the tensor"
    raw, noisy = _read_back(src, fmt), _read_back(out, fmt)
    assert noisy["embed.weight"].shape == TENSOR and noisy["embed.weight"].dtype == np.float32
    noise = noisy["embed.weight"] - np.clip(raw["embed.weight"], -0.1, 0.1)
    assert np.count_nonzero(noise) > 0.999 * noise.size  # the exact noise is 0 now and then
    assert 0.5 < np.abs(noise).mean() / np.abs(noisy["norm.weight"] - 0.1).mean() < 2  # one noise law
