"""tldp evaluate on discrete noise off the grid's ends and at several scales, its header
wording, and the model-file and --dataset error messages."""

import json
import shutil
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image

from tests.builders import REPO, one_line_error, siblings
from tldp_cli import evaluate as ev
from tldp_cli.privacy import privunit

DIGITS = np.load(REPO / "sample_data" / "digits.npy")


def perturb(cli, src, out, *args):
    # Small records in 0:1 keep raw values with probability above dp_delta, which needs consent
    # (tests/privacy/test_raw_release.py); these tests are about evaluate, so every run gives it.
    result = cli("perturb", src, "--out", out, "--seed", 11, "--allow-weak-seed", "--allow-raw-release",
                 "--quiet", *args)
    assert result.exit_code == 0, result.output
    return out


def evaluate(cli, original, perturbed, tmp_path, *args):
    report = tmp_path / f"report{len(list(tmp_path.glob('report*')))}.json"
    result = cli("evaluate", original, perturbed, "--report", report, *args)
    return result, json.loads(report.read_text())


def checks(report):
    return {c["check"]: c for c in report["checks"]}


# --------------------------------------------------------------------------- 1. grid width

def test_readme_model_recipe_with_discrete_noise_passes(cli, tmp_path):
    """--clip 0.1: the automatic grid 2^-13 Z holds -819..819, width 0.19995, not 0.2."""
    src = tmp_path / "model.npz"
    shutil.copy(REPO / "docs" / "type3" / "model.npz", src)
    out = perturb(cli, src, tmp_path / "model.tldp.npz", "--eps", "1", "--clip", "0.1",
                  "--noise", "discrete-laplace")
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 0, result.output
    assert checks(report)["parameters"]["passed"]
    m = json.loads((tmp_path / "model.tldp.npz.manifest.json").read_text())
    assert m["range_width"] == 1638 * 2.0**-13 != 0.2


def test_explicit_granularity_off_the_range_end(cli, tmp_path):
    """--range 0:1 --granularity 0.3: the grid 0, 0.3, 0.6, 0.9 is 0.9 wide; a manifest that
    says 1.0 (hi - lo) is refused."""
    src = tmp_path / "x.npy"
    np.save(src, np.random.default_rng(0).random((300, 8)).astype(np.float32))
    out = perturb(cli, src, tmp_path / "y.npy", "--eps", "1", "--range", "0:1", "--granularity", "0.3",
                  "--noise", "discrete-gaussian")
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 0, result.output
    m_path = tmp_path / "y.npy.manifest.json"
    m = json.loads(m_path.read_text())
    assert m["range_width"] == pytest.approx(0.9)
    m["range_width"] = 1.0
    m_path.write_text(json.dumps(m))
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 1
    assert [x["field"] for x in checks(report)["parameters"]["mismatches"]] == ["range_width"]


def test_check_parameters_from_the_manifest_alone(cli, tmp_path):
    """Without the original's dtypes the grid comes from the manifest's inputs; a granularity
    that is not the automatic one is caught."""
    src = tmp_path / "x.npy"
    np.save(src, np.random.default_rng(1).random((50, 6)).astype(np.float32) * 3 - 1)
    perturb(cli, src, tmp_path / "y.npy", "--eps", "2", "--range", "-1:2", "--noise", "discrete-laplace")
    m = json.loads((tmp_path / "y.npy.manifest.json").read_text())
    assert ev.check_parameters(m)["passed"]
    m["granularity"] *= 2
    assert "granularity" in [x["field"] for x in ev.check_parameters(m)["mismatches"]]


# --------------------------------------------------------------------------- 2. several scales

def _sized_pngs(root: Path) -> Path:
    rng = np.random.default_rng(2)
    root.mkdir()
    for i, (h, w) in enumerate([(8, 8), (16, 16), (32, 24), (12, 40)]):
        Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8)).save(root / f"im{i}.png")
    return root


@pytest.mark.parametrize("noise", ["discrete-laplace", "discrete-gaussian"])
@pytest.mark.parametrize("options,eps", [(("--mechanism", "baseline"), 1), (("--budget", "record"), 100)])
def test_discrete_noise_at_several_scales(cli, tmp_path, noise, options, eps):
    """Records of 64, 256, 768 and 480 pixels: four noise scales, each tested against its own."""
    src = _sized_pngs(tmp_path / "imgs")
    args = ("--noise", noise, "--image-format", "tiff", *options)
    out = perturb(cli, src, tmp_path / "out", "--eps", eps, *args)
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 0, result.output
    gof = checks(report)["noise_distribution"]
    assert gof["passed"] and gof["test"] == "chi-square"
    assert len(gof["groups"]) == 4 and all("pvalue" in g for g in gof["groups"])
    kept = checks(report)["retained_fraction"]["retained"]
    assert sum(g["samples"] for g in gof["groups"]) == gof["samples"] == 64 + 256 + 768 + 480 - kept

    # noise of 4 eps behind the eps manifest (hashes updated): every scale is too small
    wrong = perturb(cli, src, tmp_path / "wrong", "--eps", 4 * eps, *args)
    m = json.loads((tmp_path / "out.manifest.json").read_text())
    m["outputs"] = json.loads((tmp_path / "wrong.manifest.json").read_text())["outputs"]
    (tmp_path / "wrong.manifest.json").write_text(json.dumps(m))
    result, report = evaluate(cli, src, wrong, tmp_path)
    assert result.exit_code == 1 and report["integrity_ok"]
    assert checks(report)["noise_distribution"]["passed"] is False


# --------------------------------------------------------------------------- 3. header

# --sampler float where the default exact sampler cannot run: MVG and IDN have none, and exact
# TLDP-L certifies at least 3.9 per record of 16 elements (refused at --budget record --eps 1).
@pytest.mark.parametrize("mechanism,budget,words,sampler", [
    ("tldp", "element", "eps=1 per element", "exact"),
    ("tldp", "record", "eps=1 per record (--budget record)", "float"),
    ("baseline", "element", "eps=1 per record (the paper's calibration of the baseline)", "exact"),
    ("mvg", "element", "eps=1, delta=1e-05 per record by the mechanism's own design", "float"),
    ("idn", "record", "eps=1 per record (--budget record)", "float")])
def test_header_says_what_eps_covers(cli, tmp_path, mechanism, budget, words, sampler):
    src = tmp_path / "x.npy"
    np.save(src, np.random.default_rng(3).random((40, 4, 4)).astype(np.float32))
    out = perturb(cli, src, tmp_path / "y.npy", "--eps", "1", "--range", "0:1",
                  "--mechanism", mechanism, "--budget", budget, "--sampler", sampler)
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 0, result.output
    assert report["epsilon_scope"] == words
    header = result.stderr.splitlines()[0]
    assert f"{mechanism} " in header and words + ";" in header
    if mechanism != "tldp" or budget == "record":
        assert "per element" not in header


# --------------------------------------------------------------------------- 4. model files say tensor

@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_model_file_errors_name_the_tensor(cli, tmp_path, suffix):
    from safetensors.numpy import save_file

    w = np.ones((3, 4), np.float32)
    w[1, 2] = np.nan
    tensors = {"w": w, "b": np.ones(4, np.float32)}
    src = tmp_path / f"m{suffix}"
    np.savez(src, **tensors) if suffix == ".npz" else save_file(tensors, str(src))
    # Tensors of 12 and 4 values keep raw values with probability above dp_delta: consent
    # (tests/privacy/test_raw_release.py), so the run reaches the data and its NaN.
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1", "--allow-raw-release"), 1)
    assert f"{src}: tensor w, NaN or Inf" in line and "dataset" not in line
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1", "--mechanism", "mvg",
                              "--sampler", "float"), 2)  # MVG needs the float sampler
    assert f"{src}: tensor b: --mechanism mvg" in line
    assert siblings(tmp_path) == {src.name}


def test_hdf5_errors_still_name_the_dataset(cli, tmp_path):
    src = tmp_path / "d.h5"
    with h5py.File(src, "w") as f:
        f["x"] = np.array([[0.0, np.inf]])
    # A record of 2 values in 0:1 needs consent to keep raw values (tests/privacy/test_raw_release.py),
    # so the run reaches the data and its Inf.
    line = one_line_error(cli("perturb", src, "--eps", "1", "--range", "0:1", "--allow-raw-release"), 1)
    assert f"{src}: dataset /x, NaN or Inf" in line


# --------------------------------------------------------------------------- 5. --dataset

def test_dataset_on_npy_or_images_is_a_usage_error(cli, tmp_path):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((4, 3), np.uint8))
    line = one_line_error(cli("perturb", npy, "--eps", "1", "--dataset", "images"), 2)
    assert str(npy) in line and "--dataset applies to" in line
    folder = _sized_pngs(tmp_path / "imgs")
    line = one_line_error(cli("perturb", folder, "--eps", "1", "--dataset", "images"), 2)
    assert str(folder) in line and "--dataset applies to" in line
    assert siblings(tmp_path) == {"x.npy", "imgs"}


def test_missing_dataset_names_the_file_and_lists_what_it_holds(cli, tmp_path):
    h5 = tmp_path / "d.h5"
    with h5py.File(h5, "w") as f:
        f["x"] = np.zeros((3, 4))
        f["g/y"] = np.zeros((3, 2), np.uint8)
    strings = tmp_path / "s.h5"
    with h5py.File(strings, "w") as f:
        f["names"] = np.array([b"a", b"b"])
    ints = tmp_path / "i.npz"
    np.savez(ints, step=np.arange(3))
    for src, listing in ((h5, "(numeric datasets: /g/y, /x)"),
                         (strings, "(no numeric dataset; datasets: /names)"),
                         (ints, "(no floating-point tensor; tensors: step (int64))")):
        line = one_line_error(cli("perturb", src, "--eps", "1", "--range", "0:1", "--dataset", "nope"), 1)
        assert line.startswith(f"tldp: error: {src}: ") and "nope" in line and listing in line


# --------------------------------------------------------------------------- 6. kept zeros

def test_retained_check_catches_a_kept_zero(cli, tmp_path):
    """At x = 0 the float-rounding allowance is ~1e-45: with p = 0 (eps 1, I = 784) a single
    output value equal to its input is an unaccounted point mass and fails the check.
    Continuous noise (--sampler float): exact noise lands on the integer 0 by itself."""
    src = tmp_path / "zeros.npy"
    np.save(src, np.zeros((300, 28, 28), np.uint8))
    for noise in ("laplace", "gaussian"):
        out = perturb(cli, src, tmp_path / f"{noise}.npy", "--eps", "1", "--noise", noise,
                      "--sampler", "float")
        result, report = evaluate(cli, src, out, tmp_path)
        assert result.exit_code == 0, result.output
        kept = checks(report)["retained_fraction"]
        assert kept["passed"] and kept["retained"] == 0 and kept["float_rounding_allowance"] < 1e-40
        y = np.load(out)
        y[7, 3, 5] = 0.0
        np.save(out, y)
        result, report = evaluate(cli, src, out, tmp_path)
        assert checks(report)["retained_fraction"]["passed"] is False


# --------------------------------------------------------------------------- deep JSON (issue 27)

@pytest.mark.damaged_manifests
@pytest.mark.parametrize("damaged", ["manifest", "name map"])
def test_a_deeply_nested_manifest_or_name_map_is_one_line(cli, tmp_path, damaged):
    """200,000 nested lists in the manifest or name map evaluate reads raised RecursionError
    ("unexpected error ... please report it"): one line naming the file, exit 1."""
    src = tmp_path / "photos"
    src.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(np.full((6, 6), 100, np.uint8)).save(src / name)
    out = perturb(cli, src, tmp_path / "out", "--eps", "1", "--anonymize-names")
    file = tmp_path / ("out.manifest.json" if damaged == "manifest" else "photos.name-map.json")
    file.write_text(file.read_text().rstrip().removesuffix("}") + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    line = one_line_error(cli("evaluate", src, out), 1)
    assert line.startswith(f"tldp: error: {file}: not a readable ") and "it is not valid JSON (it nests lists " \
        "and objects more than 100 levels deep" in line, line


@pytest.mark.damaged_manifests
@pytest.mark.parametrize("field, value, message", [
    (("accounting", "per_record"), "x", "'accounting.per_record' is missing or not an object"),
    (("accounting", "per_file", "approx"), 1, "'accounting.per_file.approx' is not an object"),
    (("accounting", "dp_delta"), None, "'accounting.dp_delta' is missing or not a number"),
    (("grid",), "x", "'grid' is not an object"),
    (("weights",), 3, "'weights' is not an object"),
    (("privunit",), "x", "'privunit' is not an object"),
    (("privunit", "basis"), -1, "'privunit.basis' is not an object"),
    (("accounting", "privunit"), "x", "'accounting.privunit' is not an object"),
    (("preprocessing",), 1, "'preprocessing' is not a list"),
    (("inputs", 0, "shape"), None, "an 'inputs' entry's shape is not a list of integers"),
    (("inputs", 0, "format"), [], "an 'inputs' entry's format is not a string"),
])
def test_a_manifest_damaged_inside_is_one_line_naming_it(cli, tmp_path, field, value, message):
    """A field inside the manifest of the wrong JSON type failed as "unexpected error
    (AttributeError ...); please report it": one line naming the file and the field, exit 1."""
    src = tmp_path / "d.npy"
    np.save(src, DIGITS[:20])
    mechanism = ["--mechanism", "privunit"] if "privunit" in field else []
    out = perturb(cli, src, tmp_path / "out.npy", "--eps", "1", *mechanism)
    path = tmp_path / "out.npy.manifest.json"
    m = json.loads(path.read_text())
    parent = m
    for key in field[:-1]:
        parent = parent[key]
    parent[field[-1]] = value
    path.write_text(json.dumps(m))
    assert one_line_error(cli("evaluate", src, out), 1) == f"tldp: error: {path}: damaged manifest: {message}"


@pytest.mark.damaged_manifests
@pytest.mark.parametrize("field", [("accounting", "per_record", "epsilon"), ("accounting", "per_file", "records"),
                                   ("retain_probability",), ("expected_l2_error_per_record",)])
def test_a_stated_figure_that_is_no_number_fails_the_parameters_check(cli, tmp_path, field):
    """It failed as "unexpected error (ValueError: could not convert string to float)": the
    figure disagrees with the one recomputed, as any other wrong figure does."""
    src = tmp_path / "d.npy"
    np.save(src, DIGITS[:20])
    out = perturb(cli, src, tmp_path / "out.npy", "--eps", "1")
    path = tmp_path / "out.npy.manifest.json"
    m = json.loads(path.read_text())
    parent = m
    for key in field[:-1]:
        parent = parent[key]
    parent[field[-1]] = "x"
    path.write_text(json.dumps(m))
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 1 and "unexpected error" not in result.stderr
    parameters = checks(report)["parameters"]
    assert parameters["passed"] is False
    assert {"field": ".".join(field), "manifest": "x"}.items() <= next(
        mm for mm in parameters["mismatches"] if mm["field"] == ".".join(field)).items()


def test_evaluate_weighs_the_alignment_of_records_of_several_k(cli, tmp_path):
    """Two record sizes of two k: each record's cosine is set beside its own calibration's
    E<V, u>, and the expected mean is theirs weighted by the records, not the largest k's."""
    src = tmp_path / "two.h5"
    with h5py.File(src, "w") as f:
        f["big"] = DIGITS[:40]
        f["small"] = DIGITS[40:100, :4, :4]
    perturb(cli, src, tmp_path / "out.h5", "--mechanism", "privunit", "--eps", "4", "--dataset", "big",
            "--dataset", "small")
    m = json.loads((tmp_path / "out.h5.manifest.json").read_text())
    sizes = {entry["records"]: entry["privunit"] for entry in m["calibrations"]}
    assert sorted(sizes) == [40, 60] and sizes[40]["k"] != sizes[60]["k"]
    own = {n: privunit.expected_alignment(c["k"], c["gamma"], c["p"]) for n, c in sizes.items()}
    result, report = evaluate(cli, src, tmp_path / "out.h5", tmp_path)
    assert result.exit_code == 0, result.stderr
    check = checks(report)["privunit_alignment"]
    assert check["records"] == 100
    assert check["expected_alignment"] == pytest.approx((40 * own[40] + 60 * own[60]) / 100)
    assert {(c["k"], c["records"]) for c in check["calibrations"]} == {(sizes[n]["k"], n) for n in sizes}
    for c in check["calibrations"]:
        assert c["expected_alignment"] == pytest.approx(own[c["records"]])
    weighted = sum(c["mean_cosine"] * c["records"] for c in check["calibrations"]) / 100
    assert check["mean_cosine"] == pytest.approx(weighted)


@pytest.mark.parametrize("task, refusal", [
    (dict(labels="y.npy"), "task utility needs all of --labels, --test and --test-labels"),
    (dict(test=Path("t.npy"), test_labels="ty.npy"), "task utility needs all of"),
    (dict(model="svm"), "--model must be one of logistic, mlp, not 'svm'"),
])
def test_evaluate_and_sweep_refuse_a_partial_task_or_an_unknown_model_before_reading(tmp_path, task, refusal):
    """The library's evaluate and sweep (the CLI's choices stop an unknown --model earlier):
    refused before any file is opened (the inputs here do not exist)."""
    with pytest.raises(ev.UsageError, match=refusal):
        ev.evaluate(tmp_path / "none.npy", tmp_path / "none.tldp.npy", **task)
    with pytest.raises(ev.UsageError, match=refusal):
        ev.sweep(tmp_path / "none.npy", [1.0], **task)


# --------------------------------------------------------------------------- reports over what is read

@pytest.mark.parametrize("target", ["d.npy", "out.npy", "out.npy.manifest.json"])
def test_evaluate_report_never_replaces_what_it_reads(cli, tmp_path, target):
    """--report naming the original, the perturbed copy or the manifest replaced it with
    the report, --overwrite given: the raw data, the release or its certificate lost."""
    src = tmp_path / "d.npy"
    np.save(src, DIGITS[:20])
    out = perturb(cli, src, tmp_path / "out.npy", "--eps", "1")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    line = one_line_error(cli("evaluate", src, out, "--report", tmp_path / target, "--overwrite"), 2)
    assert f"the report would replace {tmp_path / target}, which this command reads" in line
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("inside", ["photos", "photos.tldp"])
def test_evaluate_report_is_never_written_inside_a_folder_it_reads(cli, tmp_path, inside):
    """A report (computed from the raw data) landed inside the release folder, or inside the
    raw image folder."""
    src = tmp_path / "photos"
    src.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(np.full((6, 6), 100, np.uint8)).save(src / name)
    out = perturb(cli, src, tmp_path / "photos.tldp", "--eps", "1")
    line = one_line_error(cli("evaluate", src, out, "--report", tmp_path / inside / "report.json"), 2)
    assert "the report would be written inside" in line and inside in line
    assert siblings(src) == {"a.png", "b.png"} and siblings(out) == {"a.png", "b.png"}


def test_sweep_never_writes_over_or_into_what_it_reads(cli, tmp_path):
    """sweep --report ORIGINAL --overwrite replaced the raw data with the JSON table, and
    --out inside an image folder wrote the tables among its images."""
    src = tmp_path / "d.npy"
    np.save(src, DIGITS[:20])
    raw = src.read_bytes()
    line = one_line_error(cli("sweep", src, "--eps", "1", "--out", tmp_path / "sw", "--report", src, "--overwrite",
                        "--methods", "TLDP-L"), 2)
    assert f"the report would replace {src}, which this command reads" in line
    assert src.read_bytes() == raw and siblings(tmp_path) == {"d.npy"}
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(np.full((6, 6), 100, np.uint8)).save(photos / "a.png")
    line = one_line_error(cli("sweep", photos, "--eps", "1", "--out", photos, "--methods", "TLDP-L"), 2)
    assert "the sweep table would be written inside" in line
    assert siblings(photos) == {"a.png"}


@pytest.mark.parametrize("report", ["exists.json", "missing/report.json"])
def test_sweep_refuses_its_report_before_writing_its_tables(cli, tmp_path, report):
    """An existing --report (no --overwrite) or one in a missing folder failed only after the
    whole sweep, its tables already written: exit 1 with half the outputs."""
    src = tmp_path / "d.npy"
    np.save(src, DIGITS[:20])
    (tmp_path / "exists.json").write_text("{}")
    line = one_line_error(cli("sweep", src, "--eps", "1", "--out", tmp_path / "sw", "--report", tmp_path / report,
                        "--methods", "TLDP-L"), 1)
    assert str(tmp_path / report) in line
    assert siblings(tmp_path) == {"d.npy", "exists.json"} and (tmp_path / "exists.json").read_text() == "{}"


# --------------------------------------------------------------------------- retained values


def test_retained_fraction_states_the_unchanged_values_it_expects(cli, tmp_path):
    """Discrete noise leaves a value unchanged whenever it draws 0: at --eps 1 on the digits
    about 690 of 313,600 values, with a retain probability of 0. The detail read "660 of 313600
    values kept unchanged; p = 0" and passed, as if raw values had been kept against p; it
    now states what it expects and why."""
    src = tmp_path / "d.npy"
    np.save(src, DIGITS)
    out = perturb(cli, src, tmp_path / "o.npy", "--eps", "1", "--noise", "gaussian")
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 0, result.output
    check = checks(report)["retained_fraction"]
    assert check["passed"] and check["retain_probability"] == 0 and check["retained"] > 100
    expected = check["elements"] * check["expected_fraction"]
    assert 500 < expected < 900  # P(noise = 0) of a discrete Gaussian of scale 181: 0.0022
    detail = check["detail"]
    assert f"{check['retained']} of {check['elements']} values unchanged, {expected:.4g} expected" in detail
    assert "kept with p = 0" in detail and "noise of 0" in detail


def bfloat16_file(path, bits):
    """`bits` (uint16 bfloat16 bit patterns) as ml_dtypes and np.save write a bfloat16 array:
    a '<V2' header (np.lib.format's, which np.save calls) over the bits; in an .npz as np.savez
    writes it (tests/formats/test_npy.py and test_npz.py read the files ml_dtypes wrote)."""
    target = path.with_suffix(".npy") if path.suffix == ".npz" else path
    with open(target, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<V2", "fortran_order": False, "shape": bits.shape})
        f.write(bits.astype("<u2").tobytes())
    if path.suffix == ".npz":
        with zipfile.ZipFile(path, "w") as archive:
            archive.write(target, "w.npy")
    return path


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_retained_fraction_counts_the_noise_bfloat16_rounds_away(cli, tmp_path, suffix):
    """Regression: values written back as bfloat16 (ml_dtypes's, in an .npz or .npy) keep 8
    significant bits, coarser than the grid near 1 at --eps 4 (16 grid steps): noise of up to
    8 steps rounds back to the value. evaluate expected only the noise's zeros unchanged (10 of
    20,000, where about 70 are), so a correct output failed retained_fraction; it now expects
    those too."""
    magnitudes = np.random.default_rng(7).uniform(0.5, 1, 20_000).astype(np.float32)
    values = magnitudes * np.where(np.arange(magnitudes.size) % 2, 1, -1).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16).reshape(100, 200)  # truncated to bfloat16
    src = bfloat16_file(tmp_path / f"w{suffix}", bits)
    out = perturb(cli, src, tmp_path / f"o{suffix}", "--eps", "4", "--clip", "1")
    result, report = evaluate(cli, src, out, tmp_path)
    check = checks(report)["retained_fraction"]
    assert check["passed"], check
    assert check["retained"] > 40 and check["elements"] * check["expected_fraction"] > 40  # P(noise = 0): 10


def to_bfloat16_bits(values):
    """float64 values rounded to bfloat16 (nearest even, through float32 as perturb writes them)."""
    u = np.asarray(values, np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def bfloat16_values(path):
    """A bfloat16 .npy (bfloat16_file's) as float32, exactly."""
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        shape, _, _ = np.lib.format.read_array_header_1_0(f)
        bits = np.frombuffer(f.read(), "<u2").reshape(shape)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def coarse_bfloat16(tmp_path):
    """100,000 values uniform in -32:32 as bfloat16: steps up to 1/8, coarser than the grid
    (1/128 at --eps 8 on -32:32) and the noise's tails cross into steps of 1/4 to 1."""
    values = np.random.default_rng(7).uniform(-32, 32, 100_000).astype(np.float32)
    return bfloat16_file(tmp_path / "w.npy", to_bfloat16_bits(values).reshape(1000, 100))


@pytest.mark.parametrize("noise", ["discrete-gaussian", "discrete-laplace"])
def test_noise_distribution_of_bfloat16_output_is_the_law_rounded(cli, tmp_path, noise):
    """Regression: a correct bfloat16 output of values up to +-32 (8 significant bits: steps up
    to 1/8 where the grid is 1/128) failed noise_distribution (p = 2e-10 for the discrete
    Gaussian, 1e-88 for the discrete Laplace): the stored noise is the law rounded to
    bfloat16's steps, and the test compared it with the unrounded law. It now tests each noisy
    value's randomized PIT under the rounded law (continuous noise: the wrong-scale test's
    control below)."""
    src = coarse_bfloat16(tmp_path)
    out = perturb(cli, src, tmp_path / "o.npy", "--range", "-32:32", "--eps", "8", "--noise", noise)
    result, report = evaluate(cli, src, out, tmp_path)
    check = checks(report)["noise_distribution"]
    assert check["passed"] and check["pvalue"] > 1e-3, check
    assert check["test"] == "Kolmogorov-Smirnov (randomized PIT)" and check["samples"] > 99_000
    assert "rounded as stored" in check["detail"] and result.exit_code == 0, result.output


@pytest.mark.parametrize("factor", [0.9, 1.0, 1.1])
@pytest.mark.parametrize("noise", ["discrete-gaussian", "gaussian"])
def test_noise_distribution_of_bfloat16_output_fails_a_wrong_scale(cli, tmp_path, noise, factor):
    """The rounded law's test still fails noise of the wrong scale: the output is rewritten
    with Gaussian noise of `factor` times the manifest's scale (discrete: a normal rounded to
    the grid, as close to the discrete Gaussian of scale ~1000 steps as the test can see),
    rounded to bfloat16 as perturb rounds it. The right scale passes; 10 % off fails."""
    src = coarse_bfloat16(tmp_path)
    sampler = ("--sampler", "float") if noise == "gaussian" else ()
    out = perturb(cli, src, tmp_path / "o.npy", "--range", "-32:32", "--eps", "8", "--noise", noise, *sampler)
    manifest = json.loads((tmp_path / "o.npy.manifest.json").read_text())
    x = bfloat16_values(src).astype(np.float64)
    draws = np.random.default_rng(3).normal(0.0, factor * manifest["noise_scale"], x.shape)
    if noise == "discrete-gaussian":
        g = manifest["granularity"]
        y = (np.rint(x / g) + np.rint(draws)) * g
    else:
        y = x + draws
    bfloat16_file(out, to_bfloat16_bits(y))
    _, report = evaluate(cli, src, out, tmp_path)
    check = checks(report)["noise_distribution"]
    assert check["test"] == "Kolmogorov-Smirnov (randomized PIT)", check
    if factor == 1.0:
        assert check["passed"] and check["pvalue"] > 1e-3, check
    else:
        assert not check["passed"] and check["pvalue"] < 1e-12, check


def test_noise_distribution_of_float16_tensors_beside_float32_ones(cli, tmp_path):
    """Regression: a safetensors file (safetensors's own writer) of a float16 tensor of values up
    to +-32 (11 significant bits: steps of 1/64 where the grid at --eps 32 is 1/512) beside a
    float32 one failed noise_distribution on a correct output (chi-square p ~ 1e-20): the
    float16 tensor's noise is the law rounded to its steps. Its values are now tested under the
    rounded law, pooled with the float32 tensor's noise (their PIT from their samples)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    src = tmp_path / "w.safetensors"
    save_file({"a": rng.uniform(-32, 32, (1000, 100)).astype(np.float16),
               "b": rng.uniform(-1, 1, (200, 100)).astype(np.float32)}, str(src))
    out = perturb(cli, src, tmp_path / "o.safetensors", "--range", "-32:32", "--eps", "32",
                  "--noise", "discrete-laplace")
    result, report = evaluate(cli, src, out, tmp_path)
    check = checks(report)["noise_distribution"]
    assert check["passed"] and check["pvalue"] > 1e-3, check
    assert check["test"] == "Kolmogorov-Smirnov (randomized PIT)" and result.exit_code == 0, result.output
    assert f"of {check['samples']} values in 16-bit floats" in check["detail"] and check["samples"] > 110_000


def test_a_model_whose_tensors_were_perturbed_in_parts_passes_every_check(cli, tmp_path):
    """Tensors larger than a block are read, perturbed and written part by part, each stream
    segment drawn apart (rng.segments): evaluate recomputes the manifest's figures and finds
    the noise's law and the retained fraction in the bytes written."""
    from tests.builders import write_safetensors
    from tldp_cli.sampling.rng import STREAM_UNIT_ELEMENTS

    rng = np.random.default_rng(8)
    tensors = {"embed.weight": rng.uniform(-0.1, 0.1, (2 * STREAM_UNIT_ELEMENTS + 999, 1)).astype(np.float32),
               "norm.weight": np.ones(64, np.float32)}
    src = write_safetensors(tmp_path / "model.safetensors", tensors)
    out = perturb(cli, src, tmp_path / "model.tldp.safetensors", "--eps", "1", "--clip", "0.1",
                  "--block-elements", str(STREAM_UNIT_ELEMENTS), "--workers", "2")
    result, report = evaluate(cli, src, out, tmp_path)
    assert result.exit_code == 0, result.output
    found = checks(report)
    for name in ("parameters", "sha256", "shapes", "noise_norm", "retained_fraction", "noise_distribution"):
        assert found[name]["passed"] is True, (name, found[name])
