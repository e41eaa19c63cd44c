"""tldp evaluate: integrity against the manifest, noise statistics, task utility, sweep."""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import tifffile
from PIL import Image

from tests.builders import REPO
from tldp_cli import evaluate as ev

SAMPLE = REPO / "sample_data"
LABELS = SAMPLE / "digits_labels.npy"
TEST_X = SAMPLE / "digits_test.npy"
TEST_Y = SAMPLE / "digits_test_labels.npy"
TASK = ["--labels", LABELS, "--test", TEST_X, "--test-labels", TEST_Y]

REPORT_KEYS = {"schema", "tool", "original", "perturbed", "manifest", "format", "mechanism", "noise",
               "budget", "epsilon", "value_range", "records", "elements_per_record", "accounting",
               "ok", "integrity_ok", "statistics_ok", "alpha", "checks", "error", "per_record",
               "utility"}
ERROR_KEYS = {"mse", "mae", "relative_l2", "l2", "psnr", "ssim", "image_metrics", "clipped_output"}
CHECKS = {"parameters", "sha256", "shapes", "noise_norm", "retained_fraction", "noise_distribution"}
UTILITY_KEYS = {"model", "metric", "f1_perturbed", "f1_clean", "f1_majority_class", "train_records",
                "test_records", "classes", "seconds"}


def perturb(cli, src, out, *args):
    result = cli("perturb", src, "--out", out, "--seed", 7, "--allow-weak-seed", "--quiet", *args)
    assert result.exit_code == 0, result.output
    return out


def checks(report):
    return {c["check"]: c for c in report["checks"]}


@pytest.fixture(scope="module")
def small(tmp_path_factory, digits):
    """60 digits perturbed with TLDP-L at eps 1."""
    from typer.testing import CliRunner

    from tldp_cli.cli import app

    d = tmp_path_factory.mktemp("small")
    np.save(d / "x.npy", digits[:60])
    r = CliRunner().invoke(app, ["perturb", str(d / "x.npy"), "--eps", "1", "--out", str(d / "y.npy"),
                                 "--seed", "3", "--allow-weak-seed", "--quiet"])
    assert r.exit_code == 0, r.output
    return d


def test_clean_run_passes_and_json_has_every_key(cli, small, tmp_path):
    report_path = tmp_path / "report.json"
    r = cli("evaluate", small / "x.npy", small / "y.npy", "--report", report_path, "--per-record")
    assert r.exit_code == 0, r.output
    assert "every check passed" in r.output and "noise_distribution" in r.output
    report = json.loads(report_path.read_text())
    assert REPORT_KEYS <= set(report)
    assert ERROR_KEYS <= set(report["error"])
    assert CHECKS <= set(checks(report))
    assert all(checks(report)[c]["passed"] for c in CHECKS)
    assert report["ok"] and report["records"] == 60
    assert len(report["per_record"]["mse"]) == 60
    norm = checks(report)["noise_norm"]
    assert norm["expected_l2"] == pytest.approx(256 * np.sqrt(2 * 784))
    assert 0.9 < norm["ratio"] < 1.1


def test_tampered_output_fails_integrity(cli, small, tmp_path):
    y = tmp_path / "y.npy"
    y.write_bytes((small / "y.npy").read_bytes())
    (tmp_path / "y.npy.manifest.json").write_text((small / "y.npy.manifest.json").read_text())
    data = np.load(y)
    data[5, 3, 3] += 1.0
    np.save(y, data)
    r = cli("evaluate", small / "x.npy", y)
    assert r.exit_code == 1
    assert "sha256" in r.output.splitlines()[-1] and "(see the table)" in r.output.splitlines()[-1]
    quiet = cli("evaluate", small / "x.npy", y, "-q")  # no table printed: none to point at
    assert quiet.exit_code == 1 and quiet.stderr.strip().splitlines() == [
        f"tldp: error: {y}: failed sha256 (run without -q for the table)"]


@pytest.mark.parametrize("edit", [
    lambda a: a["per_file"].update(epsilon=1.0), lambda a: a["per_file"].update(delta=0.3),
    lambda a: a["per_file"].update(records=3), lambda a: a.pop("per_file")],
    ids=["epsilon", "delta", "records", "deleted"])
def test_an_edited_whole_file_figure_fails_parameters(cli, small, tmp_path, edit):
    """accounting.per_file, the guarantee of everything the run released, was not checked."""
    m = json.loads((small / "y.npy.manifest.json").read_text())
    edit(m["accounting"])
    (tmp_path / "m.json").write_text(json.dumps(m))
    r = cli("evaluate", small / "x.npy", small / "y.npy", "--manifest", tmp_path / "m.json", "--json")
    assert r.exit_code == 1
    failed = [c for c in json.loads(r.stdout)["checks"] if c["check"] == "parameters"][0]
    assert not failed["passed"] and any(x["field"].startswith("accounting.per_file.")
                                        for x in failed["mismatches"])


def test_edited_scale_fails_parameters(cli, small, tmp_path):
    m = json.loads((small / "y.npy.manifest.json").read_text())
    m["noise_scale"] *= 0.5
    (tmp_path / "m.json").write_text(json.dumps(m))
    report = tmp_path / "r.json"
    r = cli("evaluate", small / "x.npy", small / "y.npy", "--manifest", tmp_path / "m.json",
            "--report", report)
    assert r.exit_code == 1
    assert "parameters" in r.output.splitlines()[-1]
    mismatch = checks(json.loads(report.read_text()))["parameters"]["mismatches"]
    assert [x["field"] for x in mismatch] == ["noise_scale"]


def test_consistent_manifest_for_other_noise_fails_statistics(cli, small, tmp_path):
    """A manifest that is self-consistent and hash-correct but describes other noise."""
    perturb(cli, small / "x.npy", tmp_path / "y2.npy", "--eps", "2")
    m = json.loads((tmp_path / "y2.npy.manifest.json").read_text())
    original = json.loads((small / "y.npy.manifest.json").read_text())
    original["outputs"] = m["outputs"]  # eps=1 manifest, eps=2 data, right hash
    (tmp_path / "y2.npy.manifest.json").write_text(json.dumps(original))
    report = tmp_path / "r.json"
    r = cli("evaluate", small / "x.npy", tmp_path / "y2.npy", "--report", report)
    assert r.exit_code == 1
    rep = json.loads(report.read_text())
    assert rep["integrity_ok"] and not rep["statistics_ok"]
    assert checks(rep)["noise_distribution"]["passed"] is False
    assert checks(rep)["noise_norm"]["passed"] is False


def test_huge_eps_scalar_records_keep_values(cli, tmp_path):
    """I = 1 and eps = 1e5: p is nearly 1, and the values that are not kept move by ~1e-5."""
    x = np.random.default_rng(0).random(4000)
    np.save(tmp_path / "x.npy", x)
    # Keeping nearly every raw value is this test's point: a raw release, which needs consent
    # (tests/privacy/test_raw_release.py). Continuous Laplace (--sampler float): p = 1 / (1 + 2 Delta / eps).
    perturb(cli, tmp_path / "x.npy", tmp_path / "y.npy", "--eps", "1e5", "--range", "0:1",
            "--dtype", "float64", "--allow-raw-release", "--sampler", "float")
    report = tmp_path / "r.json"
    r = cli("evaluate", tmp_path / "x.npy", tmp_path / "y.npy", "--report", report)
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    kept = checks(rep)["retained_fraction"]
    assert kept["passed"] and kept["fraction"] > 0.99
    assert kept["retain_probability"] == pytest.approx(1 / (1 + 2e-5))
    assert rep["error"]["mae"]["max"] < 1e-3


def test_huge_eps_f1_matches_clean_and_small_eps_baseline_is_chance(cli, tmp_path):
    hi = perturb(cli, SAMPLE / "digits.npy", tmp_path / "hi.npy", "--eps", "1e5")
    lo = perturb(cli, SAMPLE / "digits.npy", tmp_path / "lo.npy", "--eps", "0.1",
                 "--mechanism", "baseline")
    for out, name in ((hi, "hi"), (lo, "lo")):
        r = cli("evaluate", SAMPLE / "digits.npy", out, "--report", tmp_path / f"{name}.json", *TASK)
        assert r.exit_code == 0, r.output
    u_hi = json.loads((tmp_path / "hi.json").read_text())["utility"]
    rep_lo = json.loads((tmp_path / "lo.json").read_text())
    assert UTILITY_KEYS <= set(u_hi)
    assert u_hi["f1_clean"] > 0.9
    assert abs(u_hi["f1_perturbed"] - u_hi["f1_clean"]) < 0.03
    assert json.loads((tmp_path / "hi.json").read_text())["error"]["ssim"]["mean"] > 0.99
    assert rep_lo["utility"]["f1_perturbed"] < 0.45  # four balanced classes: chance ~0.25
    assert rep_lo["error"]["ssim"]["mean"] < 0.05


def test_mlp_model(tmp_path, digits):
    y = np.load(LABELS)
    f1 = ev.weighted_f1(digits[:200], y[:200], np.load(TEST_X), np.load(TEST_Y), "mlp", (0, 256))
    assert f1 > 0.85


def _png_folder(root: Path, n=6, size=16):
    rng = np.random.default_rng(1)
    for i in range(n):
        sub = root / f"c{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8)).save(sub / f"{i}.png")
    return root


def test_image_folders_png_skips_tests_tiff_tests_noise(cli, tmp_path):
    src = _png_folder(tmp_path / "imgs")
    for fmt in ("png", "tiff"):
        out = perturb(cli, src, tmp_path / f"out_{fmt}", "--eps", "1", "--image-format", fmt)
        report = tmp_path / f"{fmt}.json"
        r = cli("evaluate", src, out, "--report", report)
        assert r.exit_code == 0, r.output
        rep = json.loads(report.read_text())
        assert rep["records"] == 6 and rep["format"] == "images"
        gof = checks(rep)["noise_distribution"]
        if fmt == "png":
            assert gof["status"] == "skipped" and "clipped" in gof["detail"]
            assert rep["error"]["clipped_output"]
        else:  # every value the noise changed (exact noise is 0 for about 1 value in 500)
            changed = sum(int((tifffile.imread(o).astype(int) != np.asarray(Image.open(
                src / o.parent.name / f"{o.stem}.png"))).sum()) for o in out.rglob("*.tif*"))
            assert gof["passed"] and gof["samples"] == changed > 6 * 256 * 0.95
    # a tampered image in the folder is caught
    png = next((tmp_path / "out_png").rglob("*.png"))
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(png)
    r = cli("evaluate", src, tmp_path / "out_png")
    assert r.exit_code == 1 and "sha256" in r.output.splitlines()[-1]


def test_multi_page_tiff_and_mixed_bit_depths_are_paired_and_checked(cli, tmp_path):
    """A multi-page TIFF (one record, written multi-page under its own name) and 8- and
    16-bit images at their own ranges: evaluate pairs them and recomputes every figure."""
    src = tmp_path / "imgs"
    src.mkdir()
    rng = np.random.default_rng(1)
    tifffile.imwrite(src / "z.tif", rng.integers(0, 256, (4, 16, 16), dtype=np.uint8), photometric="minisblack")
    Image.fromarray(rng.integers(0, 65536, (16, 16)).astype(np.uint16)).save(src / "deep.png")
    for fmt in ("png", "tiff"):
        out = perturb(cli, src, tmp_path / f"out_{fmt}", "--eps", "1", "--image-format", fmt)
        r = cli("evaluate", src, out, "--json")
        assert r.exit_code == 0, r.output
        rep = json.loads(r.stdout)
        assert rep["records"] == 2 and checks(rep)["parameters"]["passed"] and checks(rep)["shapes"]["passed"]


def test_hdf5_pairs_datasets(cli, tmp_path, digits):
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["images"] = digits[:20]
    out = perturb(cli, tmp_path / "d.h5", tmp_path / "o.h5", "--eps", "1", "--noise", "gaussian")
    r = cli("evaluate", tmp_path / "d.h5", out, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["format"] == "hdf5" and checks(rep)["noise_distribution"]["passed"]


def test_arrays_sharing_rows_say_what_a_certified_record_is(cli, tmp_path, digits):
    """Regression: two datasets of 20 rows were measured as "40 records x 784 elements", then
    "certified per record eps=1562": the figure of a row of both (1568 elements), read as one
    of the 784-element records just named. The header says what the figure's record is."""
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["a"] = digits[:20]
        f["b"] = digits[20:40]
    out = perturb(cli, tmp_path / "d.h5", tmp_path / "o.h5", "--eps", "1")
    r = cli("evaluate", tmp_path / "d.h5", out)
    assert r.exit_code == 0, r.output
    header = r.stderr.splitlines()[0]
    assert "40 records x 784 elements" in header
    assert header.endswith("a record being one row of each array that shares it: 20 of up to 1568 elements)")
    rep = json.loads(cli("evaluate", tmp_path / "d.h5", out, "--json").stdout)
    assert rep["row_records"]["records"] == 20 and rep["row_records"]["elements_per_record"] == 1568
    alone = perturb(cli, tmp_path / "d.h5", tmp_path / "a.h5", "--eps", "1", "--dataset", "a")
    assert json.loads(cli("evaluate", tmp_path / "d.h5", alone, "--json").stdout)["row_records"] is None


def test_ssim_identity_and_noise():
    x = np.random.default_rng(0).integers(0, 256, (3, 20, 20)).astype(float)
    assert np.allclose(ev.ssim(x, x, 255), 1.0)
    noisy = x + np.random.default_rng(1).normal(0, 50, x.shape)
    assert (ev.ssim(x, noisy, 255) < 0.9).all()
    rgb = np.repeat(x[..., None], 3, axis=-1)
    assert np.allclose(ev.ssim(rgb, rgb, 255), 1.0)


def test_sweep_writes_table_and_valid_pngs(cli, tmp_path, digits):
    np.save(tmp_path / "x.npy", digits[:100])
    np.save(tmp_path / "y.npy", np.load(LABELS)[:100])
    mask = np.zeros((28, 28))
    mask[:4] = 1.0
    np.save(tmp_path / "w.npy", mask)
    out = tmp_path / "sweep"
    r = cli("sweep", tmp_path / "x.npy", "--eps", "1,10", "--seed", 0, "--allow-weak-seed",
            "--weights", tmp_path / "w.npy", "--labels", tmp_path / "y.npy", "--test", TEST_X, "--test-labels",
            TEST_Y, "--out", out)
    assert r.exit_code == 0, r.output
    for name in ev.SWEEP_FILES:
        assert (out / name).is_file()
    for png in ("sweep_nominal_eps.png", "sweep_record_eps.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(out / png) as im:
            im.verify()
    result = json.loads((out / "sweep.json").read_text())
    assert result["methods"] == ["TLDP-L", "TLDP-G", "Laplace", "Gaussian", "MVG", "IDN",
                                 "TLDP-L-w", "TLDP-G-w"]
    rows = {(row["method"], row["epsilon"]): row for row in result["rows"]}
    assert len(rows) == 16
    assert rows["TLDP-L", 1.0]["record_epsilon"] == pytest.approx(784)
    assert rows["Laplace", 1.0]["record_epsilon"] == pytest.approx(1)
    assert set(ev.SWEEP_COLUMNS) <= set(rows["TLDP-L", 1.0])
    assert rows["TLDP-L", 10.0]["f1"] > rows["Laplace", 1.0]["f1"]
    header = (out / "sweep.csv").read_text().splitlines()[0].split(",")
    assert header == list(ev.SWEEP_COLUMNS)
    # the same files again without --overwrite is refused
    r = cli("sweep", tmp_path / "x.npy", "--eps", "1", "--out", out)
    assert r.exit_code == 1 and "--overwrite" in r.output


def test_evaluate_sweep_is_a_deprecated_alias_of_tldp_sweep(cli, tmp_path):
    """`tldp evaluate --sweep` runs `tldp sweep` (the flag anywhere among the options),
    after one line on stderr pointing to it; the tables are the same."""
    args = ("--eps", "1", "--methods", "Gaussian,TLDP-L", "--seed", 0, "--allow-weak-seed", "-q")
    new = cli("sweep", SAMPLE / "digits.npy", *args, "--out", tmp_path / "new")
    old = cli("evaluate", SAMPLE / "digits.npy", *args, "--sweep", "--out", tmp_path / "old")
    assert new.exit_code == 0 and old.exit_code == 0, old.stderr
    assert new.stderr == ""
    assert old.stderr.splitlines() == [
        "tldp: warning: 'tldp evaluate --sweep' is deprecated and will be removed; use 'tldp sweep', "
        "which takes the same options"]
    assert (tmp_path / "old" / "sweep.csv").read_text() == (tmp_path / "new" / "sweep.csv").read_text()
    refused = cli("evaluate", SAMPLE / "digits.npy", "--sweep", "--eps", "1", "--out", tmp_path / "s",
                  "--manifest", tmp_path / "m.json")  # evaluate's options are not the sweep's
    assert refused.exit_code == 2 and "No such option: --manifest" in refused.stderr


def test_sweep_reproducible_with_seed():
    a = ev.sweep(SAMPLE / "digits.npy", [1.0], seed=5, allow_weak_seed=True)
    b = ev.sweep(SAMPLE / "digits.npy", [1.0], seed=5, allow_weak_seed=True)
    assert [r["mean_l2_error"] for r in a["rows"]] == [r["mean_l2_error"] for r in b["rows"]]


def test_sweep_repeats_draw_fresh_noise_and_the_first_draw_is_the_single_run():
    one = ev.sweep(SAMPLE / "digits.npy", [1.0], seed=5, allow_weak_seed=True)
    two = ev.sweep(SAMPLE / "digits.npy", [1.0], seed=5, allow_weak_seed=True, repeats=2)
    assert two["repeats"] == 2 and all(r["repeats"] == 2 for r in two["rows"])
    for a, b in zip(one["rows"], two["rows"]):
        assert a["mean_l2_error"] != b["mean_l2_error"]  # the mean of two draws, the first shared
        assert a["f1"] is None and b["f1_std"] is None  # no labels, no F1
    with pytest.raises(ev.UsageError):
        ev.sweep(SAMPLE / "digits.npy", [1.0], repeats=0)


def test_sweep_takes_privunit_under_budget_record_only():
    """privunit's --eps is per record: a --budget record sweep has its row (pure, certified
    at most --eps, with its output scale), an element sweep names it as skipped."""
    x = SAMPLE / "digits.npy"
    record = ev.sweep(x, [10.0], budget="record", seed=5, allow_weak_seed=True)
    assert record["methods"][-1] == "privunit"
    row = next(r for r in record["rows"] if r["method"] == "privunit")
    assert row["mechanism"] == "privunit" and row["budget"] == "record"
    assert row["record_epsilon"] <= 10.0 and row["record_delta"] == 0.0
    assert row["retain_probability_log10"] is None and row["expected_l2_error"] is None
    from tldp_cli.privacy import privunit

    assert row["noise_scale"] == pytest.approx(privunit.output_scale(0, 256, 784))  # the output scale c
    json.dumps(record, allow_nan=False)  # the table has no NaN or Inf
    element = ev.sweep(x, [1.0], seed=5, allow_weak_seed=True)
    assert "privunit" not in element["methods"]
    assert {"method": "privunit", "reason": "its --eps is per record: run the sweep with --budget record"} \
        in element["skipped_methods"]


def test_sweep_methods_runs_the_named_ones_and_says_why_a_named_one_is_skipped(cli, tmp_path):
    out = tmp_path / "s"
    r = cli("sweep", SAMPLE / "digits.npy", "--eps", "1", "--methods", "Gaussian,privunit,TLDP-L-w",
            "--seed", 0, "--allow-weak-seed", "--out", out)
    assert r.exit_code == 0, r.output
    result = json.loads((out / "sweep.json").read_text())
    assert result["methods"] == ["Gaussian"] and [row["method"] for row in result["rows"]] == ["Gaussian"]
    assert [entry["method"] for entry in result["skipped_methods"]] == ["privunit", "TLDP-L-w"]
    r = cli("sweep", SAMPLE / "digits.npy", "--eps", "1", "--methods", "Gauss", "--out", out)
    assert r.exit_code == 2 and "--methods" in r.output
    r = cli("evaluate", SAMPLE / "digits.npy", SAMPLE / "digits.npy", "--methods", "Gaussian")
    assert r.exit_code == 2 and "No such option: --methods" in r.output  # an option of tldp sweep


def test_sweep_refuses_a_reference_it_cannot_use(cli, tmp_path):
    """`tldp sweep --reference zz` (a bad value) and --reference on a sweep that runs no
    privunit ran the sweep and ignored it, exit 0; perturb and plan refuse both, exit 2."""
    from tests.builders import assert_one_line_error

    out = tmp_path / "s"
    r = cli("sweep", SAMPLE / "digits.npy", "--eps", "4", "--budget", "record", "--reference", "zz", "--out", out)
    assert_one_line_error(r, 2, "--reference zz")
    r = cli("sweep", SAMPLE / "digits.npy", "--eps", "4", "--reference", "mid", "--out", out)
    assert_one_line_error(r, 2, "--reference applies to privunit", "--budget record")
    assert not out.exists()


def test_sweep_methods_that_all_skip_is_a_usage_error(cli, tmp_path):
    """`--methods privunit` without --budget record (privunit implies it for perturb, not
    for a sweep) skipped the one method named and wrote an empty table, exit 0."""
    from tests.builders import assert_one_line_error

    out = tmp_path / "s"
    r = cli("sweep", SAMPLE / "digits.npy", "--eps", "4", "--methods", "privunit,TLDP-L-w", "--out", out)
    assert_one_line_error(r, 2, "--methods", "privunit: its --eps is per record: run the sweep with --budget record",
                          "TLDP-L-w: weighted TLDP needs --weights")
    assert not out.exists()
    r = cli("sweep", SAMPLE / "digits.npy", "--eps", "4", "--methods", "privunit", "--budget", "record",
            "--seed", 0, "--allow-weak-seed", "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    assert [row["method"] for row in json.loads(r.stdout)["rows"]] == ["privunit"]


def test_help_and_usage_errors(cli, small):
    r = cli("evaluate", "--help")
    assert r.exit_code == 0 and "Examples:" in r.output and "tldp sweep" in r.output
    r = cli("sweep", "--help")
    assert r.exit_code == 0 and "Examples:" in r.output and "--methods" in r.output
    r = cli("evaluate", small / "x.npy")
    assert r.exit_code == 2 and "PERTURBED" in r.output
    r = cli("sweep", small / "x.npy", "--eps", "1")
    assert r.exit_code == 2 and "--out" in r.output
    r = cli("sweep", small / "x.npy", "--eps", "1,x", "--out", small / "s")
    assert r.exit_code == 2
    r = cli("evaluate", small / "x.npy", small / "y.npy", "--labels", LABELS)
    assert r.exit_code == 2 and "--test" in r.output
    r = cli("evaluate", small / "x.npy", small / "missing.npy")
    assert r.exit_code == 1 and "missing.npy" in r.output


def test_zarr_with_labels_inside_the_stores(cli, tmp_path):
    """Labels from an array of the same Zarr store, for training and for test. A huge eps
    gives F1 near the clean reference only if every label sits with its record."""
    import zarr

    test_store = zarr.open_group(tmp_path / "test.zarr", mode="w")
    test_store.create_array("images", data=np.load(TEST_X))
    test_store.create_array("labels", data=np.load(TEST_Y))
    out = perturb(cli, SAMPLE / "digits.zarr", tmp_path / "o.zarr", "--eps", "1e5",
                  "--dataset", "images")
    r = cli("evaluate", SAMPLE / "digits.zarr", out, "--json", "--labels", "dataset=labels",
            "--test", tmp_path / "test.zarr", "--test-labels", "dataset=labels")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["format"] == "zarr" and rep["ok"] and rep["records"] == 400
    assert rep["utility"]["f1_clean"] > 0.9
    assert abs(rep["utility"]["f1_perturbed"] - rep["utility"]["f1_clean"]) < 0.03


def test_hdf5_labels_dataset_in_sweep(tmp_path):
    """Labels from a dataset of the same HDF5 file: at a huge eps the TLDP rows score the
    clean F1 only if every label sits with its record. The two TLDP methods only: the
    other methods' rows (a model fitted for each) were not checked."""
    result = ev.sweep(SAMPLE / "digits.h5", [1e4], labels="dataset=labels", test=TEST_X,
                      test_labels=TEST_Y, dataset="images", seed=0, allow_weak_seed=True,
                      named=["TLDP-L", "TLDP-G"])
    assert result["reference"]["f1_clean"] > 0.9
    assert [row["method"] for row in result["rows"]] == ["TLDP-L", "TLDP-G"]
    assert all(abs(row["f1"] - result["reference"]["f1_clean"]) < 0.05 for row in result["rows"])


def test_image_folder_labels_from_subfolders(cli, tmp_path):
    test_dir = tmp_path / "test_png"
    for i, (image, label) in enumerate(zip(np.load(TEST_X)[:80], np.load(TEST_Y)[:80])):
        (test_dir / f"digit_{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(test_dir / f"digit_{label}" / f"{i:03}.png")
    out = perturb(cli, SAMPLE / "digits_png", tmp_path / "out", "--eps", "1e5")
    r = cli("evaluate", SAMPLE / "digits_png", out, "--json", "--labels", "subfolders",
            "--test", test_dir, "--test-labels", "subfolders")
    assert r.exit_code == 0, r.output
    utility = json.loads(r.stdout)["utility"]
    assert utility["classes"] == ["digit_0", "digit_1", "digit_6", "digit_9"]
    assert utility["f1_clean"] > 0.85
    assert abs(utility["f1_perturbed"] - utility["f1_clean"]) < 0.05
    np.testing.assert_array_equal(
        np.unique(ev.load_labels("subfolders", SAMPLE / "digits_png")),
        ["digit_0", "digit_1", "digit_6", "digit_9"])


def test_labels_of_a_folder_of_photos_of_several_sizes(cli, tmp_path):
    """Regression: `evaluate photos/ out/ --labels subfolders --test ...` on a folder of
    photos of several sizes stopped on an unexpected error (NumPy's concatenate) instead
    of saying that task utility needs records of one shape."""
    src, test_dir = tmp_path / "photos", tmp_path / "test"
    for folder, sizes in ((src, ((8, 8), (8, 8), (6, 10), (6, 10))), (test_dir, ((8, 8),) * 4)):
        for i, size in enumerate(sizes):
            (folder / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((*size, 3), 40 * i, np.uint8)).save(folder / f"c{i % 2}" / f"{i}.png")
    out = perturb(cli, src, tmp_path / "out", "--eps", "1")
    r = cli("evaluate", src, out, "--labels", "subfolders", "--test", test_dir, "--test-labels", "subfolders")
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2, r.output
    assert lines[-1] == f"tldp: error: {src}: task utility needs records of one shape"
    assert "unexpected" not in r.stderr


def test_an_unreadable_test_photo_is_named_without_an_option_evaluate_lacks(cli, tmp_path):
    """Regression: evaluate and sweep on a folder with a damaged image said "pass --skip-bad
    to skip it", an option neither takes (No such option)."""
    src, test_dir = tmp_path / "photos", tmp_path / "test"
    for folder in (src, test_dir):
        for i in range(4):
            (folder / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8), 40 * i, np.uint8)).save(folder / f"c{i % 2}" / f"{i}.png")
    out = perturb(cli, src, tmp_path / "out", "--eps", "1")
    bad = test_dir / "c0" / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n damaged before its header ends")
    for args in (("evaluate", src, out, "--labels", "subfolders", "--test", test_dir, "--test-labels", "subfolders"),
                 ("sweep", test_dir, "--eps", "1", "--out", tmp_path / "sweep")):
        r = cli(*args)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 1 and lines[-1].startswith(f"tldp: error: {bad}: cannot be decoded"), r.output
        assert "--skip-bad" not in r.stderr and "move it out of the folder" in lines[-1]
    assert not (tmp_path / "sweep").exists()


def test_label_source_errors(cli, small, tmp_path):
    base = ("evaluate", small / "x.npy", small / "y.npy", "--test", TEST_X, "--test-labels", TEST_Y)
    r = cli(*base, "--labels", "subfolders")
    assert r.exit_code == 2 and "not a folder of images" in r.output
    r = cli(*base, "--labels", "dataset=labels")
    assert r.exit_code == 2 and "not an HDF5 file or Zarr store" in r.output
    with pytest.raises(ev.TldpError, match="nope"):
        ev.load_labels("dataset=nope", SAMPLE / "digits.h5")
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(flat / "a.png")
    with pytest.raises(ev.InputError, match="not inside a subfolder"):
        ev.load_labels("subfolders", flat)


def test_sweep_of_several_arrays_without_dataset_says_what_works(cli, tmp_path):
    """Regression: sweeping WebDataset shards said "name one with --dataset", and --dataset was
    then refused ("applies to HDF5, Zarr and model files")."""
    import io
    import tarfile

    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for key in ("a", "b"):
            data = io.BytesIO()
            Image.fromarray(np.zeros((4, 4), np.uint8)).save(data, format="PNG")
            info = tarfile.TarInfo(f"{key}.png")
            info.size = len(data.getvalue())
            tar.addfile(info, io.BytesIO(data.getvalue()))
    r = cli("sweep", shard, "--eps", "1", "--out", tmp_path / "out")
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert "name one with --dataset" not in r.stderr and "does not apply to WebDataset shards" in r.stderr
    assert not (tmp_path / "out").exists()


def test_psnr_and_ssim_of_images_at_their_own_ranges(cli, tmp_path):
    """8- and 16-bit images in one folder are released at their own ranges: each record's
    PSNR and SSIM are measured against its own (255 or 65535), not the first range's (a
    16-bit image's PSNR came out about 48 dB too low, below 0)."""
    src = tmp_path / "imgs"
    src.mkdir()
    rng = np.random.default_rng(2)
    gray = rng.integers(0, 256, (24, 24)).astype(np.uint8)
    Image.fromarray(gray).save(src / "a8.png")
    Image.fromarray(gray.astype(np.uint16) * 257).save(src / "b16.png")
    out = perturb(cli, src, tmp_path / "out", "--eps", "4", "--mechanism", "privunit")
    r = cli("evaluate", src, out, "--json", "--per-record")
    assert r.exit_code == 0, r.output
    per_record = json.loads(r.stdout)["per_record"]
    (mse8, mse16), (psnr8, psnr16) = per_record["mse"], per_record["psnr"]
    assert psnr8 == pytest.approx(10 * np.log10(255**2 / mse8))
    assert psnr16 == pytest.approx(10 * np.log10(65535**2 / mse16))
    # the same pixels released at the same eps and display scale: comparable figures
    assert abs(psnr8 - psnr16) < 10 and abs(per_record["ssim"][0] - per_record["ssim"][1]) < 0.3


@pytest.mark.parametrize("store", ["records", "coefficients"])
def test_a_user_basis_is_found_beside_the_manifest_or_given_with_basis(cli, tmp_path, monkeypatch, store):
    """perturb --basis FILE.npy records the path as it was given (relative to where perturb
    ran); evaluate run from elsewhere finds it beside the manifest, takes --basis FILE.npy
    (checked against privunit.basis.sha256), and, when neither finds it, says to pass --basis."""
    from tests.builders import assert_one_line_error, make_npy

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    src, _ = make_npy(run_dir)
    q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(64, 10)))
    np.save(run_dir / "basis.npy", q.T)
    monkeypatch.chdir(run_dir)
    perturb(cli, "d.npy", "o.npy", "--eps", "4", "--mechanism", "privunit", "--basis", "basis.npy",
            "--store", store)
    monkeypatch.chdir(elsewhere)
    r = cli("evaluate", src, run_dir / "o.npy", "--json", "-q")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["integrity_ok"]

    (run_dir / "basis.npy").rename(elsewhere / "moved.npy")
    assert_one_line_error(cli("evaluate", src, run_dir / "o.npy", "-q"), 1,
                          "basis.npy: the run's basis (privunit.basis.path) is not found", "pass it with --basis")
    r = cli("evaluate", src, run_dir / "o.npy", "--json", "-q", "--basis", "moved.npy")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["integrity_ok"]
    np.save(elsewhere / "other.npy", q.T[::-1])  # orthonormal too, another sha256
    assert_one_line_error(cli("evaluate", src, run_dir / "o.npy", "-q", "--basis", "other.npy"), 1,
                          "other.npy: not the run's basis", "differs from the manifest's privunit.basis.sha256")
    np.save(elsewhere / "basis.npy", q.T[::-1])  # another file at the recorded path, here
    assert_one_line_error(cli("evaluate", src, run_dir / "o.npy", "-q"), 1,
                          "basis.npy: not the run's basis", "pass the run's basis with --basis FILE.npy")


def test_basis_applies_to_a_user_basis_run_only(cli, tmp_path):
    from tests.builders import assert_one_line_error, make_npy

    src, _ = make_npy(tmp_path)
    q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(64, 10)))
    np.save(tmp_path / "basis.npy", q.T)
    out = perturb(cli, src, tmp_path / "o.npy", "--eps", "4", "--mechanism", "privunit")
    assert_one_line_error(cli("evaluate", src, out, "-q", "--basis", tmp_path / "basis.npy"), 2,
                          "--basis applies to a run of --mechanism privunit --basis FILE.npy")


def _with_missing_values(tmp_path: Path, store: str) -> Path:
    """40 records of 8 x 10 temperatures, two of them missing (NaN), as xarray writes them: a
    netCDF variable packed in int16 (the marker -32767, unpacked to -47.67 and written as
    -32767.0), or a float variable of a Zarr format 2 store (NaN)."""
    import xarray as xr

    data = 280 + 20 * np.random.default_rng(5).random((40, 8, 10))
    data[0, 0, 0] = data[7, 3, 4] = np.nan
    ds = xr.Dataset({"t": (("time", "y", "x"), data, {"units": "K"})})
    if store == "zarr":
        ds.to_zarr(tmp_path / "in.zarr", zarr_format=2)
        return tmp_path / "in.zarr"
    ds.to_netcdf(tmp_path / "in.nc", encoding={"t": {"dtype": "int16", "scale_factor": 0.01,
                                                    "add_offset": 280.0, "_FillValue": -32767}})
    return tmp_path / "in.nc"


@pytest.mark.parametrize("store", ["netcdf", "zarr"])
def test_missing_values_are_left_out_of_the_noise_statistics(cli, tmp_path, store):
    """Missing values are copied, not perturbed: the output holds its marker there, which is
    not noise. Counted as noise, the packed netCDF variable's -32767.0 against the -47.67
    it unpacks to failed noise_norm (z = +600) on a correct run, and the Zarr store's NaN made
    the report NaN (an unexpected error, exit 1)."""
    src = _with_missing_values(tmp_path, store)
    out = perturb(cli, src, tmp_path / f"out{src.suffix}", "--eps", "1", "--range", "250:320")
    r = cli("evaluate", src, out, "--json", "-q")
    assert r.exit_code == 0, r.stderr
    c = checks(json.loads(r.stdout))
    assert c["noise_norm"]["passed"] and 0.9 < c["noise_norm"]["ratio"] < 1.1
    assert c["retained_fraction"]["passed"] and c["retained_fraction"]["elements"] == 40 * 80 - 2
    assert c["noise_distribution"]["passed"] and c["noise_distribution"]["samples"] > 0

    unit = perturb(cli, src, tmp_path / f"unit{src.suffix}", "--eps", "4", "--mechanism", "privunit",
                   "--range", "250:320")
    r = cli("evaluate", src, unit, "--json", "-q")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    mse = report["error"]["mse"]
    assert mse["max"] < 3 * mse["median"]  # the record with a missing value is like the others
    assert checks(report)["privunit_alignment"]["mean_cosine"] > 0


def test_sweep_refuses_missing_values_in_one_line(cli, tmp_path):
    """sweep reads the records as they are stored: an xarray Zarr store's missing values are
    NaN, which made every figure NaN and the report an unexpected error."""
    from tests.builders import assert_one_line_error

    src = _with_missing_values(tmp_path, "zarr")
    assert_one_line_error(cli("sweep", src, "--eps", "1", "--range", "250:320", "--out", tmp_path / "s"), 1,
                          "NaN or Inf at record 0, element 0")
    assert not (tmp_path / "s").exists()
