"""The library speaks Python: one name per parameter (eps), ranges as (lo, hi) or "lo:hi",
and messages that name the parameters of perturb_array, PerturbOptions and calibrate, never
a flag of the command; the command's messages keep naming its flags."""

import ast
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import tldp_cli
from tldp_cli.run import library

SEED = "98ab6f93e8be360eae780f2ba450c708"
FLOATS = np.random.default_rng(0).random((10, 4)).astype(np.float32)
FLAG = re.compile(r"(?<![\w-])--[a-z]")

# perturb_array's keywords for a bad call (FLOATS unless "array" is given), and the words
# its message must hold.
BAD_ARRAY_CALLS = {
    "float data without a range": (dict(), ["value_range=(lo, hi)"]),
    "int64 data without a range": (dict(array=FLOATS.astype(np.int64)), ["value_range=(lo, hi)"]),
    "eps 0": (dict(eps=0, value_range=(0, 1)), ["eps must be"]),
    "eps nan": (dict(eps=float("nan"), value_range=(0, 1)), ["eps must be"]),
    "weak seed": (dict(value_range=(0, 1), seed=5), ["allow_weak_seed=True"]),
    "unknown noise": (dict(value_range=(0, 1), noise="cauchy"), ["noise must be one of"]),
    "unknown mechanism": (dict(value_range=(0, 1), mechanism="foo"), ["mechanism must be one of"]),
    "unknown budget": (dict(value_range=(0, 1), budget="x"), ["budget must be one of"]),
    "unknown sampler": (dict(value_range=(0, 1), sampler="x"), ["sampler must be one of"]),
    "noise with privunit": (dict(value_range=(0, 1), mechanism="privunit", noise="laplace"),
                            ["mechanism='privunit'", "leave out noise"]),
    "laplace for mvg": (dict(value_range=(0, 1), mechanism="mvg", noise="laplace"),
                        ["mechanism='mvg'", "noise='gaussian'"]),
    "exact noise, float sampler": (dict(value_range=(0, 1), sampler="float", noise="discrete-laplace"),
                                   ["noise='discrete-laplace'", "sampler='float'"]),
    "bad basis": (dict(value_range=(0, 1), mechanism="privunit", basis="dct:1"), ["basis='dct:1'"]),
    "basis without privunit": (dict(value_range=(0, 1), basis="dct"), ["basis applies to mechanism='privunit'"]),
    "dp_delta": (dict(value_range=(0, 1), dp_delta=2), ["dp_delta must lie"]),
    # were TypeErrors naming no parameter: "must be real number, not str", "'<' not supported ..."
    "eps a str": (dict(eps="1", value_range=(0, 1)), ["eps must be a finite number > 0, not '1'"]),
    "eps None": (dict(eps=None, value_range=(0, 1)), ["eps must be a finite number > 0, not None"]),
    "dp_delta a str": (dict(value_range=(0, 1), dp_delta="1e-5"), ["dp_delta must lie in (0, 1), not '1e-5'"]),
    "clip a str": (dict(clip="1"), ["clip must be a finite number > 0, not '1'"]),
    "dtype": (dict(value_range=(0, 1), dtype="int8"), ["dtype must be"]),
    "clip and range": (dict(value_range=(0, 1), clip=1.0), ["clip=C", "clip or value_range"]),
    "clip negative": (dict(clip=-1.0), ["clip must be"]),
    "granularity on integers": (dict(array=np.zeros((4, 3), np.uint8), granularity=0.1), ["granularity applies"]),
    "granularity with privunit": (dict(value_range=(0, 1), mechanism="privunit", granularity=0.1),
                                  ["granularity applies", "mechanism='privunit'"]),
    "raw release": (dict(value_range=(0, 1), sampler="float", noise="gaussian"),
                    ["dp_delta=1e-05", "value_range", "allow_raw_release=True"]),
    "range string": (dict(value_range="0-1"), ["value_range must be two numbers"]),
    "range inverted": (dict(value_range=(1, 0)), ["value_range (1, 0) is empty or inverted"]),
    "range infinite": (dict(value_range="0:inf"), ["value_range must be finite"]),
    "out-of-range data": (dict(array=FLOATS * 3, value_range=(0, 1)), ["value_range", "clip_input=True"]),
}


@pytest.mark.parametrize("case", BAD_ARRAY_CALLS)
def test_perturb_array_messages_name_its_parameters(case):
    """Was: "needs --range LO:HI", "pass --allow-weak-seed", "--eps must be ..."."""
    given, words = BAD_ARRAY_CALLS[case]
    given = {"eps": 1, **given}
    array = given.pop("array", FLOATS)
    with pytest.raises(tldp_cli.TldpError) as caught:
        tldp_cli.perturb_array(array, **given)
    message = str(caught.value)
    assert not FLAG.search(message), message
    for word in words:
        assert word in message, message


@pytest.fixture
def floats_file(tmp_path):
    np.save(tmp_path / "x.npy", FLOATS)
    return tmp_path / "x.npy"


# PerturbOptions' fields for a bad run of x.npy (float data), the words its message must
# hold, and the same input's command-line arguments, whose message names the flag instead.
BAD_FILE_RUNS = {
    "no range": (dict(), ["value_range=(lo, hi)"], [], "--range LO:HI"),
    "eps out of range": (dict(eps=-1, value_range=(0, 1)), ["eps must be"], ["--range", "0:1"], "--eps must be"),
    "weak seed": (dict(value_range=(0, 1), seed=5), ["allow_weak_seed=True"], ["--range", "0:1", "--seed", "5"],
                  "--allow-weak-seed"),
    "clip and range": (dict(value_range=(0, 1), clip=1.0), ["clip or value_range"],
                       ["--range", "0:1", "--clip", "1"], "give --clip or --range"),
    "range of no array": (dict(ranges={"t": "0:1"}), ["ranges={'t': (0, 1)} names no array"],
                          ["--range", "t=0:1"], "--range t=0:1 names no array"),
    "bad own range": (dict(ranges={"t": "1:0"}), ["ranges['t']", "empty or inverted"], None, None),
    "existing output": (dict(value_range=(0, 1), out="y.npy"), ["overwrite=True"], ["--range", "0:1", "--out", "y.npy"],
                        "--overwrite"),
    "resume of npy": (dict(value_range=(0, 1), resume=True), ["resume=True applies to Zarr"],
                      ["--range", "0:1", "--resume"], "--resume applies to Zarr"),
}


@pytest.mark.parametrize("case", BAD_FILE_RUNS)
def test_perturb_options_messages_name_fields_and_the_command_keeps_its_flags(case, floats_file, cli):
    fields, words, args, flag_words = BAD_FILE_RUNS[case]
    if "out" in fields:
        fields = {**fields, "out": floats_file.parent / fields["out"]}
        fields["out"].write_bytes(b"an earlier output")
    with pytest.raises(tldp_cli.TldpError) as caught:
        tldp_cli.perturb(tldp_cli.PerturbOptions(input=floats_file, eps=fields.pop("eps", 1), **fields))
    message = str(caught.value)
    assert not FLAG.search(message), message
    for word in words:
        assert word in message, message
    if args is not None:
        args = [str(floats_file.parent / a) if a.endswith(".npy") else a for a in args]
        result = cli("perturb", floats_file, "--eps", "-1" if case == "eps out of range" else "1", *args)
        assert result.exit_code in (1, 2) and flag_words in result.stderr, result.stderr


def test_calibrate_names_its_own_epsilon():
    with pytest.raises(tldp_cli.UsageError, match=r"^epsilon must be a finite number > 0"):
        tldp_cli.calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=-1,
                           range_width=1, elements=3)
    with pytest.raises(tldp_cli.UsageError, match=r"^epsilon must be a finite number > 0, not '4'"):
        tldp_cli.calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon="4",
                           range_width=1, elements=3)
    with pytest.raises(tldp_cli.UsageError, match=r"granularity applies"):
        tldp_cli.calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=1,
                           range_width=1, elements=3, granularity=0.5)


def test_the_library_keeps_the_message_type_and_the_lower_level_keeps_flags():
    from tldp_cli.privacy import mechanisms

    with pytest.raises(tldp_cli.UsageError, match="^--eps must be"):
        mechanisms.calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=0,
                             range_width=1, elements=3)
    with pytest.raises(tldp_cli.DataError):
        tldp_cli.perturb_array(FLOATS * 3, eps=1, value_range=(0, 1))


def test_ranges_take_strings_and_tuples(tmp_path):
    """Was: value_range="0:1" failed with "could not convert string to float: ':'"."""
    by_string = tldp_cli.perturb_array(FLOATS, eps=1, value_range="0:1", seed=SEED)
    by_tuple = tldp_cli.perturb_array(FLOATS, eps=1, value_range=(0, 1), seed=SEED)
    assert by_string.value_range == (0.0, 1.0)
    assert np.array_equal(by_string.array, by_tuple.array)
    np.savez(tmp_path / "m.npz", a=FLOATS, b=FLOATS * 4)
    outputs = []
    for ranges in ({"a": "0:1", "b": "0:4"}, {"a": (0, 1), "b": (0.0, 4.0)}):
        out = tmp_path / f"out{len(outputs)}.npz"
        result = tldp_cli.perturb(tldp_cli.PerturbOptions(input=tmp_path / "m.npz", eps=1, ranges=ranges,
                                                         out=out, seed=SEED))
        assert result.manifest["value_ranges"] == {"a": [0.0, 1.0], "b": [0.0, 4.0]}
        outputs.append(dict(np.load(out)))
    assert all(np.array_equal(outputs[0][k], outputs[1][k]) for k in ("a", "b"))


def test_epsilon_is_a_deprecated_name_of_eps():
    with pytest.warns(DeprecationWarning, match="epsilon= is deprecated; use eps="):
        old = tldp_cli.PerturbOptions(input="x.npy", epsilon=2.0)
    assert old == tldp_cli.PerturbOptions(input="x.npy", eps=2.0)
    with pytest.warns(DeprecationWarning, match="use eps"):
        assert old.epsilon == 2.0
    with pytest.raises(TypeError, match="not both"):
        tldp_cli.PerturbOptions(input="x.npy", eps=1.0, epsilon=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tldp_cli.PerturbOptions("x.npy", 1.0)  # positional, as before: no warning


def test_perturb_array_and_perturb_options_share_every_name():
    import inspect

    # `key` is perturb_array's alone: it keeps one seed's calls on batches apart, and the
    # command has no counterpart (a seed with several inputs is refused, docs/perturb.md:
    # run them one by one with a seed each), so neither has PerturbOptions.
    params = set(inspect.signature(tldp_cli.perturb_array).parameters) - {"array", "key"}
    fields = set(inspect.signature(tldp_cli.PerturbOptions).parameters)
    assert params <= fields, params - fields
    assert "key" not in fields


def test_every_flag_a_library_message_can_hold_has_a_parameter():
    """A flag in a raise of the modules the library runs (all but the command's and `tldp
    plan`'s) translates to a PerturbOptions field, through pipeline.OPTION_FLAGS."""
    root = Path(tldp_cli.__file__).parent
    unknown = set()
    for path in root.rglob("*.py"):
        if path.parts[-2] == "cli" or path.name in ("plan.py", "audit.py", "weight_mask.py") \
                or "evaluate" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for const in ast.walk(node.exc):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        unknown |= {(flag, path.name) for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", const.value)
                                    if FLAG.search(library.python_words(flag))
                                    or flag not in library._PARAMETERS and flag not in library._COMMAND_ONLY}
    assert not unknown, sorted(unknown)


def test_dtype_takes_numpy_s_names_of_it(tmp_path):
    """Was: dtype=np.float64 refused as "dtype must be float32 or float64, not <class
    'numpy.float64'>"; NumPy's dtype objects name the same dtypes as the strings."""
    for dtype in (np.float64, np.dtype("float64"), float):
        assert tldp_cli.perturb_array(FLOATS, eps=1, value_range=(0, 1), dtype=dtype).array.dtype == np.float64
    assert tldp_cli.perturb_array(FLOATS, eps=1, value_range=(0, 1), dtype=np.float32).array.dtype == np.float32
    np.save(tmp_path / "x.npy", FLOATS)
    tldp_cli.perturb(tldp_cli.PerturbOptions(input=tmp_path / "x.npy", eps=1, value_range=(0, 1),
                                             dtype=np.float64, out=tmp_path / "y.npy"))
    assert np.load(tmp_path / "y.npy").dtype == np.float64
    with pytest.raises(tldp_cli.UsageError, match=r"^dtype must be float32 or float64, not float16$"):
        tldp_cli.perturb_array(FLOATS, eps=1, value_range=(0, 1), dtype=np.float16)
