"""Weight masks given as .npy files (run/masks.py): what is not a mask file is refused in
one line that says what it is."""

import os

import numpy as np

from tests.builders import assert_one_line_error, siblings


def test_a_npy_weight_mask_that_is_a_fifo_says_so(cli, tmp_path):
    """A FIFO given to --weights was reported as "weight mask not found"."""
    np.save(tmp_path / "x.npy", np.zeros((4, 3, 3), np.uint8))
    os.mkfifo(tmp_path / "w.npy")
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", tmp_path / "x.npy", "--eps", "1", "--weights", tmp_path / "w.npy"),
                          1, f"{tmp_path / 'w.npy'}: not a regular file (a FIFO)")
    assert siblings(tmp_path) == before
    assert_one_line_error(cli("perturb", tmp_path / "x.npy", "--eps", "1", "--weights", tmp_path / "none.npy"),
                          1, "none.npy: weight mask not found")
