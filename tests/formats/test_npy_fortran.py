"""A Fortran-order .npy array is read block by block with one positional read per element
of the record (formats/npy.py): each block must hold the records a C-order copy holds."""

import numpy as np
import pytest

from tldp_cli.run.pipeline import PerturbOptions, perturb


# Records of 4096 elements: blocks of 64 records (a stream unit), 3 to 5 blocks, the last one
# short, each read a run per element; of 4500 (more than FORTRAN_READS, in runs under a page):
# through a memory map.
@pytest.mark.parametrize("shape, dtype", [((200, 16, 256), ">f4"), ((150, 4096), "<i2"), ((300, 4, 32, 32), "u1"),
                                          ((150, 5, 30, 30), "u1")])
def test_a_fortran_order_array_gives_what_its_c_order_copy_gives(tmp_path, shape, dtype):
    data = np.random.default_rng(3).integers(0, 100, shape).astype(dtype)
    outputs = []
    for order in ("C", "F"):
        src = tmp_path / f"{order}.npy"
        np.save(src, np.asfortranarray(data) if order == "F" else np.ascontiguousarray(data))
        assert np.load(src).flags.f_contiguous == (order == "F")
        out = tmp_path / f"{order}-out.npy"
        perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=5, allow_weak_seed=True, allow_raw_release=True,
                               value_range=(0, 100) if dtype.endswith("f4") else None,
                               block_elements=64 * 4096, workers=2))
        outputs.append(np.load(out))
    assert outputs[0].shape == shape and np.array_equal(outputs[0], outputs[1])
