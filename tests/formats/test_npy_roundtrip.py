"""The .npy round-trip case, run with every format's by tests/formats/test_round_trip.py."""

import numpy as np

from tests.builders import RoundTrip


class NpyRoundTrip(RoundTrip):
    format = "npy"

    def make_input(self, tmp_path):
        path = tmp_path / "data.npy"
        np.save(path, np.random.default_rng(0).integers(0, 256, (50, 6, 5), dtype=np.uint8))
        return path

    def read_arrays(self, path):
        return {"array": np.load(path)}

    def assert_same_structure(self, original, perturbed):
        a, b = np.load(original), np.load(perturbed)
        # uint8 data under the default exact sampler: integer noise, widened to int16
        assert a.shape == b.shape and b.dtype == np.int16
