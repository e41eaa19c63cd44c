"""`tldp perturb` through the CLI: the success path and every bad input of issue 2."""

import builtins
import errno
import io
import json
import math
import os

import numpy as np
import pytest

from tests.builders import SEED, assert_one_line_error, siblings, tree_digest
from tldp_cli.cli.summary import guarantee_line
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.run.manifest import sha256_file


@pytest.fixture
def digits_file(tmp_path, digits):
    path = tmp_path / "digits.npy"
    np.save(path, digits[:60])
    return path


def test_success_writes_output_manifest_and_summary(cli, digits_file, tmp_path):
    result = cli("perturb", digits_file, "--eps", "1", "--noise", "gaussian", "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "digits.tldp.npy"
    manifest_path = tmp_path / "digits.tldp.npy.manifest.json"
    # the exact sampler (the default) keeps uint8 data integer: discrete Gaussian noise, int16
    assert np.load(out).shape == (60, 28, 28) and np.load(out).dtype == np.int16
    manifest = json.loads(manifest_path.read_text())
    assert manifest["noise"] == "discrete-gaussian" and manifest["sampler"] == "exact"
    assert "each element (eps=" in result.stderr and "each record (eps=953.9" in result.stderr
    assert result.stdout == ""
    assert manifest["outputs"] == [{"path": str(out), "sha256": sha256_file(out)}]
    text = manifest_path.read_text()
    assert str(SEED) not in text and manifest["seeded"] is True
    assert all(str(SEED) not in name for name in siblings(tmp_path))


MANIFEST_FIELDS = {"schema", "tool", "mechanism", "noise", "budget", "epsilon", "value_range",
                   "range_width", "elements_per_record", "records", "noise_scale",
                   "retain_probability", "retain_probability_log10", "weights", "rng", "seeded",
                   "weak_seed", "accounting", "inputs", "outputs", "postprocessing", "created"}


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("mechanism", ["tldp", "baseline"])
@pytest.mark.parametrize("budget", ["element", "record"])
def test_manifest_figures_reproduce_from_design(cli, digits_file, tmp_path, noise, mechanism, budget):
    """An independent calculation from docs/guarantee.md's formulas reproduces every stated figure
    (of the continuous mechanisms: --sampler float; tests/sampling/test_discrete.py has the exact ones)."""
    # TLDP under the record budget keeps raw values with probability ~ eps e^-eps / (2 Delta)
    # per record, above dp_delta: a release that needs consent (tests/privacy/test_raw_release.py).
    consent = ["--allow-raw-release"] if (mechanism, budget) == ("tldp", "record") else []
    result = cli("perturb", digits_file, "--eps", "2", "--noise", noise, "--mechanism", mechanism,
                 "--budget", budget, "--sampler", "float", "--json", "--quiet", *consent)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    m = json.loads(result.stdout)
    assert m["noise"] == noise and m["sampler"] == "float"
    assert MANIFEST_FIELDS <= set(m)
    assert m["schema"] == "tldp-manifest/1" and m["seeded"] is False and m["rng"] == "secure"
    assert m["value_range"] == [0.0, 256.0] and m["range_width"] == 256.0
    assert m["elements_per_record"] == 784 and m["records"] == 60
    I, D, eps = 784, 256.0, 2.0
    rec, el = m["accounting"]["per_record"], m["accounting"]["per_element"]
    if noise == "laplace":
        b = {"tldp": {"element": D / eps, "record": I * D / eps},
             "baseline": {"element": I * D / eps, "record": I * D / eps}}[mechanism][budget]
        assert m["noise_scale"] == pytest.approx(b)
        assert el["epsilon"] == pytest.approx(D / b) and rec["epsilon"] == pytest.approx(I * D / b)
        assert rec["rho"] is None
    else:
        sigma = m["noise_scale"]
        if budget == "element":
            expected = D / math.sqrt(2 * eps) if mechanism == "tldp" else D * math.sqrt(I / (2 * eps))
            assert sigma == pytest.approx(expected)
        else:
            assert rec["approx"]["epsilon"] == pytest.approx(eps, rel=1e-6)
        assert el["rho"] == pytest.approx(D**2 / (2 * sigma**2))
        assert rec["rho"] == pytest.approx(I * D**2 / (2 * sigma**2))
    if mechanism == "tldp":
        eps_e = m["calibration_epsilon"]
        if noise == "laplace":
            a = eps_e - I * D / b
            log_p = a - math.log(2 * b + math.exp(a))
        else:
            a = eps_e - I * D**2 / (2 * sigma**2)
            log_p = a - math.log(sigma * math.sqrt(2 * math.pi) + math.exp(a))
        assert m["retain_probability_log10"] == pytest.approx(log_p / math.log(10), rel=1e-9)
        p = math.exp(log_p)
        delta_log10 = (math.log10(1 - (1 - p) ** I) if p > 1e-12
                       else (log_p + math.log(I)) / math.log(10))  # I p to first order
        assert rec["point_mass_delta_log10"] == pytest.approx(delta_log10, rel=1e-6)
    else:
        assert m["retain_probability"] == 0.0 and rec["point_mass_delta"] == 0.0


@pytest.mark.parametrize("sampler,noise", [([], "discrete-laplace"), (["--sampler", "float"], "laplace")])
def test_summary_line_states_the_manifests_figures(cli, digits_file, sampler, noise):
    result = cli("perturb", digits_file, "--eps", "1", "--json", *sampler)
    m = json.loads(result.stdout)
    assert m["noise"] == noise
    assert guarantee_line(m["accounting"], noise) in result.stderr
    # only the float sampler's figures are limited to the real-valued mechanism
    assert ("real-valued mechanism only" in result.stderr) == (noise == "laplace")


def test_quiet_prints_nothing(cli, digits_file):
    result = cli("perturb", digits_file, "--eps", "1", "--quiet")
    assert result.exit_code == 0 and result.stdout == "" and result.stderr == ""


def test_one_dimensional_array_is_scalar_records(cli, tmp_path):
    src = tmp_path / "x.npy"
    np.save(src, np.linspace(0, 1, 1000))
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--json", "-q", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["elements_per_record"] == 1 and m["records"] == 1000
    # the default exact sampler: discrete Laplace on the automatic grid of the float data
    assert m["noise"] == "discrete-laplace" and m["range_width"] == 1
    assert m["retain_probability"] == pytest.approx(calibrate(
        mechanism="tldp", noise="discrete-laplace", budget="element", epsilon=1, range_width=1,
        elements=1, granularity=m["granularity"]).p)


def test_weights_mask_is_recorded(cli, digits_file, tmp_path):
    mask = tmp_path / "mask.npy"  # made by weight-mask: its sidecar says it is not data-derived
    made = cli("weight-mask", digits_file, "--method", "constant", "--weight", "0.5", "--out", mask, "-q")
    assert made.exit_code == 0, made.stderr
    result = cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    w = json.loads(result.stdout)["weights"]
    assert w["sha256"] == sha256_file(mask) and w["shape"] == [28, 28] and w["min"] == 0.5


def test_clip_input_is_recorded(cli, tmp_path):
    src = tmp_path / "f.npy"
    np.save(src, np.array([[0.5, 1.5], [-0.2, 0.1]]))
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--clip-input", "--json", "-q",
                 "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["preprocessing"] == ["clip_input"]


def run_and_check_nothing_written(cli, tmp_path, src, *args, code=1, fragments=()):
    before_dir = siblings(tmp_path)
    before = tree_digest(src) if src.exists() else None
    result = cli("perturb", src, *args)
    assert_one_line_error(result, code, *fragments)
    assert siblings(tmp_path) == before_dir, "output left behind"
    if before is not None:
        assert tree_digest(src) == before
    return result


def test_missing_file(cli, tmp_path):
    run_and_check_nothing_written(cli, tmp_path, tmp_path / "nope.npy", "--eps", "1",
                                  fragments=("nope.npy", "no such file"))


@pytest.mark.parametrize("command", ["perturb", "plan", "sweep"])
def test_unreadable_input_is_one_line_and_exit_1(cli, tmp_path, monkeypatch, command):
    """Click's own check (os.access, then exit 2 with 'Invalid value for INPUT: ... is not
    readable') used to answer before tldp, which names the file and exits 1 as for any
    input it cannot read. Simulated (tests may run as root, who reads any file): os.access
    and every open of the input refuse, as they do for a user without read permission."""
    src = tmp_path / "locked.npy"
    np.save(src, np.zeros((4, 4), np.uint8))
    real_access, real_open, real_os_open = os.access, builtins.open, os.open

    def refused(path):
        return os.fspath(path) == str(src) if isinstance(path, (str, os.PathLike)) else False

    def access(path, mode, *args, **kwargs):
        return False if refused(path) and mode & os.R_OK else real_access(path, mode, *args, **kwargs)

    def open_(path, *args, **kwargs):
        if refused(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real_open(path, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if refused(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    args = {"perturb": ["--eps", "1"], "plan": ["--eps", "1"],
            "sweep": ["--eps", "1,2", "--out", tmp_path / "sweep"]}[command]
    result = cli(command, src, *args)
    assert_one_line_error(result, 1, f"{src}: Permission denied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked.npy"]


def test_manifest_path_ending_in_a_slash_is_refused(cli, digits_file, tmp_path):
    """A trailing '/' used to be dropped, and the manifest written as a file of that name."""
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", "1", "--out", tmp_path / "o.npy",
                                  "--manifest", f"{tmp_path}/mdir/", code=2,
                                  fragments=("--manifest", "mdir/", "give its path"))


def test_not_an_array(cli, tmp_path):
    src = tmp_path / "text.npy"
    src.write_text("hello")
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", fragments=("text.npy",))


def test_truncated_npy(cli, tmp_path):
    src = tmp_path / "t.npy"
    np.save(src, np.zeros((100, 10), np.uint8))
    src.write_bytes(src.read_bytes()[:500])
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", fragments=("t.npy", "truncated"))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_say_where(cli, tmp_path, bad):
    src = tmp_path / "f.npy"
    data = np.zeros((10, 4))
    data[7, 2] = bad
    np.save(src, data)
    # Small float records at --range 0:1 keep raw values with probability above dp_delta, which
    # needs consent (tests/privacy/test_raw_release.py); the point here is the error naming the value.
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", "--range", "0:1", "--allow-raw-release",
                                  fragments=("f.npy", "record 7", "element 2"))


@pytest.mark.parametrize("eps", ["0", "-1", "inf", "nan"])
def test_bad_eps_is_a_usage_error(cli, digits_file, tmp_path, eps):
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", eps, code=2, fragments=("--eps",))


@pytest.mark.parametrize("args", [["--eps", "1e160"], ["--eps", "1e160", "--budget", "record"],
                                  ["--eps", "1e160", "--mechanism", "baseline"]])
def test_a_huge_eps_is_certified_not_an_unexpected_error(cli, digits_file, tmp_path, args):
    """A per-element eps whose square leaves float64 (the zCDP bound of the discrete Laplace)
    once failed with OverflowError; the pure bound holds."""
    result = cli("perturb", digits_file, *args, "--json", "--quiet", "--out", tmp_path / "o.npy")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)["accounting"]["per_record"]
    assert math.isfinite(record["epsilon"]) and record["epsilon"] >= 1e157


@pytest.mark.parametrize("command", ["perturb", "plan"])
@pytest.mark.parametrize("args", [["--eps", "1.7e308"], ["--eps", "1e305"], ["--eps", "1e305", "--noise", "gaussian"],
                                  ["--eps", "1.7e308", "--mechanism", "baseline"]])
def test_an_eps_whose_figures_leave_float64_is_a_usage_error(cli, digits_file, tmp_path, command, args):
    """Per record (784 elements) or per file (60 records), the figure is infinite: refused at once,
    never a manifest that cannot be written."""
    result = cli(command, digits_file, *args, "--json", *(["--out", tmp_path / "o.npy"] if command == "perturb" else []))
    assert_one_line_error(result, 2, "digits.npy", "--eps", "infinite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.npy"]


@pytest.mark.parametrize("command", ["perturb", "plan"])
@pytest.mark.parametrize("value_range, eps", [("0:1", "1e306"), ("0:1", "1.7e308"), ("-1e308:1e308", "1")])
def test_float_data_without_a_grid_step_is_a_usage_error(cli, tmp_path, command, value_range, eps):
    """The exact sampler's automatic grid step, (HI - LO) / (1024 eps), leaves float64 (0 or inf):
    once an unexpected error (math domain error, OverflowError)."""
    src = tmp_path / "f.npy"
    np.save(src, np.full((10, 4), 0.5))
    extra = ["--out", tmp_path / "o.npy"] if command == "perturb" else []
    result = cli(command, src, "--eps", eps, f"--range={value_range}", *extra)
    assert_one_line_error(result, 2, "f.npy", "beyond float64 arithmetic")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.npy"]


@pytest.mark.parametrize("command", ["perturb", "plan"])
@pytest.mark.parametrize("floats, args, refusal", [
    (False, ["--eps", "1", "--budget", "record"], "--budget record: TLDP with discrete-laplace noise certifies"),
    (True, ["--eps", "0.0001", "--range", "0:1"], "--dtype float32 cannot hold the grid values exactly"),
], ids=["record-budget-out-of-reach", "grid-beyond-float32"])
def test_a_calibration_refusal_names_the_input(cli, digits_file, tmp_path, command, floats, args, refusal):
    """TLDP-L certifies at least 7.6 per record of 784 elements, and float32 holds 2^24 grid
    steps: refused because of what the input holds (its record size, float data), so the one
    line names the input, as with several inputs (it once began with the option, as an error
    about the options alone would)."""
    src = digits_file
    if floats:
        src = tmp_path / "f.npy"
        np.save(src, np.load(digits_file).astype(np.float32) / 255)
    before = sorted(p.name for p in tmp_path.iterdir())
    extra = ["--out", tmp_path / "o.npy"] if command == "perturb" else []
    result = cli(command, src, *args, *extra)
    assert_one_line_error(result, 2, refusal)
    assert result.stderr.startswith(f"tldp: error: {src}: {refusal}")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if command == "plan" and not floats:  # described records have no file to name
        described = cli("plan", "--elements", "28x28", "--range", "0:256", *args)
        assert_one_line_error(described, 2, "784 elements")
        assert described.stderr.startswith(f"tldp: error: {refusal}")


def test_audit_without_a_grid_step_is_a_usage_error(cli):
    result = cli("audit", "--eps", "1.7e308", "--elements", "4", "--range", "0:1", "--samples", "1000")
    assert_one_line_error(result, 2, "beyond float64 arithmetic")


def test_float_data_needs_a_range(cli, tmp_path):
    src = tmp_path / "f.npy"
    np.save(src, np.zeros((3, 3)))
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", code=2, fragments=("--range",))


@pytest.mark.parametrize("bad", ["1:1", "2:1", "a:b", "0", "0:inf"])
def test_empty_inverted_or_malformed_range(cli, digits_file, tmp_path, bad):
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", "1", f"--range={bad}", code=2,
                                  fragments=("--range",))


def test_values_outside_the_range_are_counted(cli, tmp_path):
    src = tmp_path / "f.npy"
    data = np.full((2000, 10), 0.5)
    data[100:103, 0] = 2.0
    data[1999, 9] = -1.0
    np.save(src, data)
    # --allow-raw-release: the consent check (tests/privacy/test_raw_release.py) runs before the data is
    # read and would otherwise stop the run before the values are counted.
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", "--range", "0:1", "--allow-raw-release",
                                  fragments=("4 values", "--clip-input"))


@pytest.mark.parametrize("mask,fragment", [(np.zeros((5, 5)), "shape"), (np.full((28, 28), 1.5), "[0, 1]"),
                                           (np.full((28, 28), np.nan), "NaN")])
def test_bad_weight_masks(cli, digits_file, tmp_path, mask, fragment):
    path = tmp_path / "mask.npy"
    np.save(path, mask)
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", "1", "--weights", path,
                                  fragments=("mask.npy", fragment))


def test_object_dtype_is_never_unpickled(cli, tmp_path):
    src = tmp_path / "obj.npy"
    np.save(src, np.array([[1, "a"], [2, None]], dtype=object), allow_pickle=True)
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", fragments=("obj.npy", "object"))


def test_complex_dtype(cli, tmp_path):
    src = tmp_path / "c.npy"
    np.save(src, np.zeros((3, 3), np.complex64))
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", "--range", "0:1",
                                  fragments=("c.npy", "complex"))


def test_output_directory_must_exist(cli, digits_file, tmp_path):
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", "1", "--out",
                                  tmp_path / "missing" / "o.npy", fragments=("does not exist",))


def test_a_usage_error_comes_before_an_existing_output(cli, tmp_path):
    """Exit 2 for the options before exit 1 for the destination, whatever their order."""
    src = tmp_path / "f.npy"
    np.save(src, np.zeros((4, 3), np.float32))
    (tmp_path / "f.tldp.npy").write_bytes(b"earlier")
    run_and_check_nothing_written(cli, tmp_path, src, "--eps", "1", code=2, fragments=("needs --range",))


@pytest.mark.parametrize("flag", ["--out", "--manifest"])
def test_an_empty_path_is_a_usage_error(cli, digits_file, tmp_path, flag):
    """`--out "$OUT"` with OUT unset wrote into the current folder (--out) or the default
    manifest (--manifest) without a word."""
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", "1", flag, "", code=2,
                                  fragments=(f"{flag} is empty",))


def test_output_under_a_file_says_it_is_not_a_folder(cli, digits_file, tmp_path):
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", "1", "--out",
                                  digits_file / "o.npy", fragments=("digits.npy is not a folder",))


def test_unknown_option_is_a_one_line_usage_error(cli, digits_file, tmp_path):
    run_and_check_nothing_written(cli, tmp_path, digits_file, "--eps", "1", "--noise", "uniform", code=2)


def test_help_has_examples(cli):
    result = cli("perturb", "--help")
    assert result.exit_code == 0 and "Examples:" in result.stdout and "--eps" in result.stdout


def test_help_names_every_kind_of_input_it_detects(cli):
    """Regression: INPUT's help left out tables (Parquet, Arrow, dataset folders) and --format's
    said every folder without Zarr, model or dataset metadata is read as images (shards too)."""
    import re

    text = re.sub(r"\s+", " ", cli("perturb", "--help").stdout)
    assert ".parquet" in text and ".arrow" in text and "Hugging Face dataset folder;" in text
    assert "one with .tar files and no image WebDataset shards" in text
    text = re.sub(r"\s+", " ", cli("weight-mask", "--help").stdout)  # it reads tables and shards too
    assert "a table (.parquet, .arrow, a dataset folder), WebDataset shards" in text


def test_seed_warns_that_it_fixes_the_noise(cli, digits_file, tmp_path):
    """The noise depends on the seed and positions only: two inputs of one shape under one
    seed get the same noise (documented, and warned about)."""
    other = tmp_path / "other.npy"
    np.save(other, np.load(digits_file)[::-1])
    outs = []
    for src in (digits_file, other):
        out = tmp_path / f"{src.stem}.out.npy"
        result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out)
        assert result.exit_code == 0, result.stderr
        assert "same seed on another input" in result.stderr and str(SEED) not in result.stderr
        outs.append(np.load(out).astype(np.float64) - np.load(src))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-3)  # float32 rounding of x + z
    result = cli("perturb", digits_file, "--eps", "1", "--out", tmp_path / "x.npy")
    assert "same seed" not in result.stderr


@pytest.mark.parametrize("command", [[], ["perturb"], ["weight-mask"], ["evaluate"], ["sweep"], ["audit"]])
def test_no_arguments_prints_the_help_as_is(cli, command):
    result = cli(*command)
    assert result.exit_code == 2
    assert result.stderr.startswith("Usage: ") and len(result.stderr.splitlines()) > 5
    assert "error" not in result.stderr.splitlines()[0]


@pytest.mark.parametrize("mechanism, noise, shape, value_range, message", [
    # noise below float32's resolution
    ("baseline", "gaussian", (4, 3), "0:1e-37", "beyond what float32 output can hold"),
    # Algorithm 1's p rounds to 1: every value kept
    ("tldp", "gaussian", (4, 3), "0:1e-25", "retain probability 1"),
    ("tldp", "laplace", (1000,), "0:1e-19", "retain probability 1"),  # one-element records
    ("tldp", "gaussian", (4, 3), "0:1e-200", "beyond float64 arithmetic"),
    ("baseline", "laplace", (4, 3), "0:1e300", "beyond what float32 output can hold"),
])
def test_ranges_that_leave_no_privacy_or_no_float32_noise_are_refused(cli, tmp_path, mechanism, noise, shape,
                                                                      value_range, message):
    src = tmp_path / "small.npy"
    np.save(src, np.zeros(shape, np.float32))
    # continuous noise (--sampler float): its scale must be a float32 and leave p below 1;
    # the exact sampler's noise lives on a grid scaled to the range
    result = cli("perturb", src, "--eps", "1", "--noise", noise, "--range", value_range,
                 "--mechanism", mechanism, "--sampler", "float", "--out", tmp_path / "out.npy")
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.npy"]


def test_audit_refuses_noise_float32_cannot_hold(cli):
    # continuous noise (the exact sampler's is on a grid scaled to the range)
    result = cli("audit", "--eps", "1", "--noise", "gaussian", "--mechanism", "baseline", "--elements", "4",
                 "--range", "0:1e-39", "--dtype", "float32", "--sampler", "float")
    assert result.exit_code == 2 and "beyond what float32 output can hold" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_discrete_noise_keeping_every_value_is_refused(cli, tmp_path):
    src = tmp_path / "u8.npy"
    np.save(src, np.zeros(100, np.uint8))
    result = cli("perturb", src, "--eps", "1e18", "--noise", "discrete-laplace", "--out", tmp_path / "o.npy")
    assert result.exit_code == 2 and "retain probability 1" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u8.npy"]


def test_preview_strip_shows_raw_records_over_the_written_ones(cli, digits_file, tmp_path):
    """--preview: a PNG with the first 8 raw records (top) over their perturbed copies as
    written (bottom), each 28 x 28 digit enlarged twice, values mapped from the range."""
    from PIL import Image

    from tldp_cli import evaluate

    preview = tmp_path / "before-after.png"
    result = cli("perturb", digits_file, "--eps", "10", "--mechanism", "privunit", "--seed", SEED,
                 "--preview", preview)
    assert result.exit_code == 0, result.stderr
    assert "keep it with the raw data" in result.stderr
    with Image.open(preview) as im:
        strip = np.asarray(im.convert("RGB"))
    zoom, gap = 2, 4  # 64 // 28; 4 white pixels around each tile
    assert strip.shape == (2 * 28 * zoom + 3 * gap, 8 * (28 * zoom + gap) + gap, 3)
    raw = np.load(digits_file)[:8]
    written = np.load(tmp_path / "digits.tldp.npy")[:8]
    for row, records in enumerate((raw, written)):
        for col, record in enumerate(records):
            y, x = gap + row * (28 * zoom + gap), gap + col * (28 * zoom + gap)
            tile = strip[y:y + 28 * zoom:zoom, x:x + 28 * zoom:zoom, 0]
            expected = np.clip(record.astype(np.float64) / 256 * 255, 0, 255).astype(np.uint8)
            assert np.array_equal(tile, expected)
    # the same strip from the library, and the manifest does not list the preview
    assert evaluate.preview(digits_file, tmp_path / "digits.tldp.npy") == preview.read_bytes()
    manifest = json.loads((tmp_path / "digits.tldp.npy.manifest.json").read_text())
    assert str(preview) not in json.dumps(manifest)


def test_preview_refusals_before_the_run(cli, digits_file, tmp_path):
    for args, words in ((["--preview", tmp_path / "p.jpg"], ".png"),
                        (["--preview", tmp_path / "missing" / "p.png"], "does not exist"),
                        (["--out", tmp_path / "o", "--preview", tmp_path / "o" / "p.png"], "inside the output")):
        (tmp_path / "o").mkdir(exist_ok=True)
        before = tree_digest(tmp_path)
        result = cli("perturb", digits_file, "--eps", "1", *args)
        assert_one_line_error(result, 2, words)
        assert tree_digest(tmp_path) == before
    (tmp_path / "p.png").write_bytes(b"x")
    result = cli("perturb", digits_file, "--eps", "1", "--preview", tmp_path / "p.png")
    assert result.exit_code == 2 and "--overwrite" in result.stderr
    assert (tmp_path / "p.png").read_bytes() == b"x" and not (tmp_path / "digits.tldp.npy").exists()


def test_preview_never_replaces_an_input_or_a_file_the_run_reads(cli, tmp_path):
    """--overwrite --preview photos/a.png replaced the raw photo a.png of the folder it
    released with the strip (exit 0); a preview named like the ledger or the manifest replaced it."""
    from PIL import Image

    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(3)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(photos / f"{name}.png")
    cases = ((photos / "a.png", "the preview would be written inside the input"),
             (photos / "new.png", "the preview would be written inside the input"),
             (tmp_path / "l.png", "the ledger and the preview name the same file"),
             (tmp_path / "m.png", "the manifest and the preview name the same file"))
    for preview, words in cases:
        before = tree_digest(tmp_path)
        result = cli("perturb", photos, "--mechanism", "privunit", "--eps", "4", "--out", tmp_path / "out",
                     "--overwrite", "--ledger", tmp_path / "l.png", "--manifest", tmp_path / "m.png",
                     "--preview", preview)
        assert_one_line_error(result, 2, words)
        assert tree_digest(tmp_path) == before
