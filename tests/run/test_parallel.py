"""Serial and threaded runs give bit-identical output on every format, over many blocks."""

import numpy as np
import pytest

from tests.builders import DATA, SEED, make_hdf5, make_images, make_npy, make_zarr
from tldp_cli.run.pipeline import PerturbOptions, perturb


@pytest.mark.parametrize("make", [make_npy, make_hdf5, make_zarr, make_images])
def test_threads_equal_serial(tmp_path, make):
    src, read = make(tmp_path)
    results = []
    for workers in (1, 3):
        out = tmp_path / f"out{workers}{src.suffix}"
        perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=SEED, workers=workers,
                               block_elements=640))  # 10 records a block: many blocks
        results.append(read(out))
    np.testing.assert_array_equal(results[0], results[1])
    assert not np.array_equal(results[0], DATA)
