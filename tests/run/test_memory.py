"""Peak memory does not grow with the input: measured (peak RSS), never timed."""

import os
import subprocess
import sys
import textwrap

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


def deflated_zeros_npz(path, elements):
    """An .npz whose one float32 tensor is `elements` zeros, deflated as np.savez_compressed
    stores it (about 1000:1), written in pieces so that making it takes no memory."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("w.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False,
                                                          "shape": (elements,)})
            piece = bytes(1 << 23)
            for start in range(0, elements * 4, len(piece)):
                member.write(piece[:min(len(piece), elements * 4 - start)])
    return path


def test_a_tensor_that_cannot_fit_in_memory_is_refused_before_it_is_read(tmp_path):
    """A 0.4 MB .npz holding a 400 MB tensor, for a process limited to 1.4 GiB: perturbing
    it needs at least its values, their noise and the output side by side (1.6 GB). It ran
    into memory errors (an ImportError, a MemoryError) once the tensor was inflated; it is
    refused from the header, one line, nothing written."""
    import resource

    src = deflated_zeros_npz(tmp_path / "zeros.npz", 100_000_000)
    assert src.stat().st_size < 1_000_000
    limit = int(1.4 * (1 << 30))
    run = subprocess.run([sys.executable, "-m", "tldp_cli", "perturb", str(src), "--eps", "1", "--clip", "1"],
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith(f"tldp: error: {src}: tensor w: a record of 100,000,000 elements"), run.stderr
    assert "needs at least 1.6 GB of memory" in run.stderr and len(run.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zeros.npz"]
