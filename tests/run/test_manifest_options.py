"""A manifest read back into options (run_manifest.options_of_manifest, the inverse of
build_manifest beside it): the calibration they make is the one the run made, which is what
tldp evaluate recomputes and checks."""

from pathlib import Path

import numpy as np
import pytest

from tldp_cli.formats import ArrayJob
from tldp_cli.run.bases import parse_basis
from tldp_cli.run.calibration import calibrate_run
from tldp_cli.run.context import RunContext
from tldp_cli.run.options import PerturbOptions, checked_options
from tldp_cli.run.run_manifest import build_manifest, options_of_manifest


def job(name, shape, dtype):
    return ArrayJob(name, shape, np.dtype(dtype), lambda a, b: np.zeros((b - a, *shape[1:]), dtype),
                    {"path": "x", "format": "test", "dataset": name, "shape": list(shape), "dtype": dtype})


IMAGES = [job("images", (40, 8, 8), "uint8")]
FLOATS = [job("x", (30, 6, 5), "float32")]
TWO = [job("a", (20, 12), "float32"), job("b", (20, 3), "float64")]

CASES = {  # options (besides input and eps), the arrays
    "tldp laplace exact, range from the dtype": (dict(), IMAGES),
    "tldp gaussian float sampler": (dict(noise="gaussian", sampler="float", value_range=(-1, 1)), FLOATS),
    "discrete grid given": (dict(noise="discrete-laplace", value_range=(-1, 1), granularity=2**-6), FLOATS),
    "float64 output, dp delta": (dict(noise="gaussian", value_range=(0, 4), dtype="float64", dp_delta=1e-7), FLOATS),
    "a range per array": (dict(ranges={"a": (0.0, 1.0), "b": (-5.0, 5.0)}), TWO),
    "record budget": (dict(budget="record", value_range=(-1, 1), eps=50.0), TWO),
    "clip": (dict(clip=0.5), FLOATS),
    "mvg": (dict(mechanism="mvg", sampler="float", value_range=(-1, 1)), FLOATS),
    "idn": (dict(mechanism="idn", sampler="float", value_range=(0, 255)), IMAGES),
    "baseline": (dict(mechanism="baseline", noise="gaussian", value_range=(0, 255)), IMAGES),
    "privunit default k": (dict(mechanism="privunit", value_range=(0, 255)), IMAGES),
    "privunit dct:K": (dict(mechanism="privunit", basis="dct:5", value_range=(-1, 1)), FLOATS),
    "raw release allowed": (dict(value_range=(0, 1e6), allow_raw_release=True, eps=8.0), IMAGES),
}


@pytest.mark.parametrize("case", CASES)
def test_a_manifest_read_back_calibrates_as_the_run_did(case):
    given, jobs = CASES[case]
    options = checked_options(PerturbOptions(**{"input": Path("x"), "eps": 1.0, **given}))
    calibrated = calibrate_run(options, jobs)
    manifest = build_manifest(RunContext(options, jobs, calibrated))
    again = options_of_manifest(manifest, Path("x"))
    rerun = calibrate_run(again, jobs)
    assert rerun.calib_of == calibrated.calib_of
    assert (rerun.lo, rerun.hi, rerun.grid, rerun.out_dtype) == (calibrated.lo, calibrated.hi, calibrated.grid,
                                                                 calibrated.out_dtype)
    assert rerun.certified == calibrated.certified
    assert rerun.bounds == calibrated.bounds
    assert build_manifest(RunContext(again, jobs, rerun))["accounting"] == \
        manifest["accounting"]
    for field in ("eps", "mechanism", "noise", "budget", "dp_delta", "granularity", "ranges"):
        assert getattr(again, field) == getattr(options, field), field
    if options.mechanism == "privunit":  # no --basis is dct
        assert parse_basis(again.basis) == parse_basis(options.basis)
    else:
        assert again.basis is None
    assert again.allow_raw_release == bool(calibrated.raw_release)


def test_a_basis_file_is_read_back_as_the_file(tmp_path):
    rows = np.linalg.qr(np.random.default_rng(0).normal(size=(30, 4)))[0].T
    np.save(tmp_path / "basis.npy", rows)
    options = checked_options(PerturbOptions(input=Path("x"), eps=2.0, mechanism="privunit",
                                             basis=str(tmp_path / "basis.npy"), value_range=(-1, 1)))
    calibrated = calibrate_run(options, FLOATS)
    again = options_of_manifest(build_manifest(RunContext(options, FLOATS, calibrated)),
                                Path("x"))
    assert again.basis == str(tmp_path / "basis.npy")
    assert calibrate_run(again, FLOATS).calib_of == calibrated.calib_of
