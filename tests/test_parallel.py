"""Serial and threaded runs give bit-identical output on every format, over many blocks."""

import h5py
import numpy as np
import pytest
import zarr
from PIL import Image

from tests.conftest import SEED
from tldp_cli.pipeline import PerturbOptions, perturb

DATA = np.random.default_rng(5).integers(0, 256, (200, 8, 8), dtype=np.uint8)


def make_npy(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, DATA)
    return path, lambda out: np.load(out)


def make_hdf5(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=DATA, chunks=(10, 8, 8), compression="gzip")
    return path, lambda out: h5py.File(out, "r")["x"][...]


def make_zarr(tmp_path):
    path = tmp_path / "d.zarr"
    z = zarr.create_array(store=str(path), shape=DATA.shape, dtype=DATA.dtype, chunks=(10, 8, 8),
                          shards=(20, 8, 8), zarr_format=3)
    z[:] = DATA
    return path, lambda out: zarr.open_array(str(out), mode="r")[...]


def make_images(tmp_path):
    path = tmp_path / "imgs"
    path.mkdir()
    for i in range(30):
        Image.fromarray(DATA[i]).save(path / f"{i:02d}.png")
    return path, lambda out: np.stack([np.asarray(Image.open(out / f"{i:02d}.png")) for i in range(30)])


@pytest.mark.parametrize("make", [make_npy, make_hdf5, make_zarr, make_images])
def test_threads_equal_serial(tmp_path, make):
    src, read = make(tmp_path)
    results = []
    for workers in (1, 3):
        out = tmp_path / f"out{workers}{src.suffix}"
        perturb(PerturbOptions(input=src, epsilon=1.0, out=out, seed=SEED, workers=workers,
                               block_elements=640))  # 10 records a block: many blocks
        results.append(read(out))
    np.testing.assert_array_equal(results[0], results[1])
    assert not np.array_equal(results[0], DATA)
