"""cli/options.py: the command's values, as Typer parsed them, become the library's
PerturbOptions in one place (perturb_options), for `tldp perturb` and `tldp plan` alike."""

import os
from pathlib import Path

import pytest

from tldp_cli.cli.options import Budget, InputFormat, Mechanism, OutDtype, Sampler, perturb_options
from tldp_cli.errors import UsageError
from tldp_cli.run.pipeline import PerturbOptions


def test_the_command_values_become_perturb_options():
    options = perturb_options(Path("x.h5"), ["0:256", "t2m=200:330"], eps=1.0, mechanism=Mechanism.privunit,
                              noise=None, budget=Budget.record, sampler=Sampler.float, dtype=OutDtype.float64,
                              datasets=None, exclude=["*.bias"], keep=None, input_format=InputFormat("hdf5"))
    assert options == PerturbOptions(
        input=Path("x.h5"), eps=1.0, mechanism="privunit", noise=None, budget="record", sampler="float",
        dtype="float64", value_range=(0.0, 256.0), ranges={"t2m": (200.0, 330.0)}, datasets=[],
        exclude=["*.bias"], keep=[], input_format="hdf5")
    for name in ("mechanism", "budget", "sampler", "dtype", "input_format"):  # the values, not the Enums
        assert type(getattr(options, name)) is str, name


def test_no_range_given_is_none_and_a_bad_one_the_usage_error_of_range():
    assert perturb_options(Path("x.npy"), None, eps=1.0).value_range is None
    with pytest.raises(UsageError, match="--range 2:1 is empty or inverted"):
        perturb_options(Path("x.npy"), ["2:1"], eps=1.0)


def test_inputs_from_stdin_takes_paths_that_are_not_utf8_in_a_strict_locale(monkeypatch):
    """`find raw -name '*.npy' | tldp perturb --inputs-from -` with a Latin-1 file name, where
    stdin's text layer is strict (en_US.UTF-8): an "unexpected error (UnicodeDecodeError)".
    The name comes through as the same bytes, as from a list file."""
    import io
    import sys
    from pathlib import Path

    from tldp_cli.cli.options import input_paths

    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9.npy\nplain.npy\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", stdin)
    paths = input_paths(None, Path("-"))
    assert [os.fsencode(p) for p in paths] == [b"caf\xe9.npy", b"plain.npy"]
