"""What travels with a release holds nothing derived from the raw values or names
(issue "Certified means the bytes on disk", items 5 and 6): masks of unknown origin,
evaluate reports, image names, and wide integer types without a declared range.

Real files throughout: the shipped MNIST digits, PNG and JPEG folders made with Pillow.
"""

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.builders import SEED, assert_one_line_error, siblings, tree_digest
from tldp_cli.run.manifest import sha256_file

RNG = np.random.default_rng(6)
SENSITIVE = "computed from the raw data: keep it with the raw data, never with the release"


def ok(result):
    assert result.exit_code == 0, result.stderr
    return result


def manifest_of(out: Path) -> dict:
    return json.loads(Path(str(out) + ".manifest.json").read_text())


def numbers(value) -> list[float]:
    """Every number in a JSON document."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def lists(value) -> list[list]:
    """Every list in a JSON document."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in lists(v)]
    if isinstance(value, list):
        return [value] + [x for v in value for x in lists(v)]
    return []


@pytest.fixture
def digits_file(tmp_path, digits):
    path = tmp_path / "digits.npy"
    np.save(path, digits[:50])
    return path


def save(path: Path, pixels: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)  # by its suffix: PNG, JPEG, TIFF, BMP
    return path


# ------------------------------------------------------------------ 1. masks of unknown origin

def test_mask_without_sidecar_is_treated_as_data_derived(cli, digits_file, digits, tmp_path):
    # An intensity mask made outside tldp: its max is the brightest pixel over 300.
    mask = tmp_path / "bright.npy"
    np.save(mask, digits[:50] / 300.0)
    brightest = float(digits[:50].max()) / 300.0
    out = tmp_path / "o.npy"
    result = ok(cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--out", out))
    assert "no readable sidecar bright.npy.json" in result.stderr and "data-derived" in result.stderr
    m = manifest_of(out)
    w = m["weights"]
    assert w["data_derived"] is True and w["method"] is None
    assert w["sha256"] is None and w["min"] is None and w["max"] is None
    assert w["origin"] == "unknown (no sidecar): treated as data-derived"
    assert "withheld" in w["note"]
    text = Path(str(out) + ".manifest.json").read_text()
    assert sha256_file(mask) not in text and brightest not in numbers(m)
    # The certified figures assume w = 0, and evaluate accepts the withheld minimum.
    report = tmp_path / "r.json"
    ok(cli("evaluate", digits_file, out, "--report", report, "-q"))
    checks = {c["check"]: c for c in json.loads(report.read_text())["checks"]}
    assert checks["parameters"]["passed"] is True


@pytest.mark.parametrize("sidecar, origin", [
    ("{not json", "unknown (unreadable sidecar): treated as data-derived"),
    # issue 27: 200,000 nested lists raised RecursionError ("unexpected error")
    ('{"schema": ' + "[" * 200_000 + "]" * 200_000 + "}", "unknown (unreadable sidecar): treated as data-derived"),
    ('{"schema": "someone-else/1", "data_derived": false}',
     "unknown (sidecar not written by tldp weight-mask): treated as data-derived"),
])
def test_mask_with_an_unusable_sidecar_is_treated_as_data_derived(cli, digits_file, tmp_path, sidecar, origin):
    mask = tmp_path / "m.npy"
    np.save(mask, np.full((28, 28), 0.25))
    (tmp_path / "m.npy.json").write_text(sidecar)
    out = tmp_path / "o.npy"
    ok(cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--out", out, "-q"))
    w = manifest_of(out)["weights"]
    assert w["origin"] == origin and w["data_derived"] is True
    assert w["sha256"] is None and w["min"] is None and w["max"] is None


def test_tldp_sidecar_without_data_derived_false_is_not_trusted(cli, digits_file, tmp_path):
    mask = tmp_path / "m.npy"
    ok(cli("weight-mask", digits_file, "--method", "constant", "--weight", "0.25", "--out", mask))
    sidecar = json.loads((tmp_path / "m.npy.json").read_text())
    del sidecar["data_derived"]
    (tmp_path / "m.npy.json").write_text(json.dumps(sidecar))
    out = tmp_path / "o.npy"
    ok(cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--out", out, "-q"))
    w = manifest_of(out)["weights"]
    assert w["data_derived"] is True and w["sha256"] is None and "origin" not in w


def test_mask_whose_sidecar_says_not_data_derived_is_recorded(cli, digits_file, tmp_path):
    mask = tmp_path / "m.npy"
    ok(cli("weight-mask", digits_file, "--method", "constant", "--weight", "0.25", "--out", mask))
    out = tmp_path / "o.npy"
    result = ok(cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--out", out))
    assert "data-derived" not in result.stderr
    w = manifest_of(out)["weights"]
    assert w["data_derived"] is False and w["method"] == "constant" and "origin" not in w
    assert w["sha256"] == sha256_file(mask) and w["min"] == w["max"] == 0.25


def test_mask_folder_without_sidecar_withholds_its_digest(cli, tmp_path):
    photos = tmp_path / "photos"
    masks = tmp_path / "masks"
    for name in ("a", "b"):
        save(photos / f"{name}.png", RNG.integers(0, 256, (12, 12), dtype=np.uint8))
        save(masks / f"{name}.png", np.full((12, 12), 200, np.uint8))
    out = tmp_path / "out"
    ok(cli("perturb", photos, "--eps", "1", "--weights", masks, "--out", out, "-q"))
    w = manifest_of(out)["weights"]
    assert w["origin"] == "unknown (no sidecar): treated as data-derived"
    assert w["sha256"] is None and w["min"] is None and w["max"] is None and w["files"] == 2


# ------------------------------------------------------------------ 2. evaluate reports

@pytest.fixture
def perturbed(cli, digits_file, tmp_path):
    out = tmp_path / "y.npy"
    ok(cli("perturb", digits_file, "--eps", "1", "--out", out, "--seed", SEED, "-q"))
    return out


def test_report_is_marked_sensitive_and_holds_no_per_record_lists(cli, digits_file, perturbed, tmp_path):
    report_path = tmp_path / "report.json"
    result = ok(cli("evaluate", digits_file, perturbed, "--report", report_path))
    assert f"this report is {SENSITIVE}" in result.stderr
    report = json.loads(report_path.read_text())
    assert list(report)[:2] == ["schema", "sensitive"] and report["sensitive"] == SENSITIVE
    assert report["per_record"] is None
    assert set(report["error"]["mse"]) == {"mean", "median", "min", "max"}  # summaries stay
    # Nothing in it is a list as long as the records (a per-record figure).
    assert all(len(x) < 50 for x in lists(report))


def test_per_record_lists_when_asked(cli, digits_file, perturbed, tmp_path, digits):
    result = ok(cli("evaluate", digits_file, perturbed, "--json", "--per-record", "-q"))
    report = json.loads(result.stdout)
    assert report["sensitive"] == SENSITIVE
    rows = report["per_record"]
    assert set(rows) == {"mse", "mae", "relative_l2", "l2", "psnr", "ssim"}
    assert all(len(v) == 50 for v in rows.values())
    # Why they are sensitive: ||Z|| / relative L2 is the record's exact norm.
    norms = np.array(rows["l2"]) / np.array(rows["relative_l2"])
    expected = np.sqrt((digits[:50].reshape(50, -1).astype(np.float64) ** 2).sum(axis=1))
    np.testing.assert_allclose(norms, expected, rtol=1e-9)


def test_per_record_needs_json_and_is_not_for_sweeps(cli, digits_file, perturbed, tmp_path):
    assert_one_line_error(cli("evaluate", digits_file, perturbed, "--per-record"), 2, "--per-record", "--json")
    assert_one_line_error(cli("sweep", digits_file, "--eps", "1", "--out", tmp_path / "s",
                              "--per-record"), 2, "--per-record", "tldp sweep")
    assert not (tmp_path / "s").exists()


def test_sweep_json_is_marked_sensitive(cli, tmp_path, digits):
    np.save(tmp_path / "x.npy", digits[:30])
    out = tmp_path / "sweep"
    result = ok(cli("sweep", tmp_path / "x.npy", "--eps", "1", "--seed", SEED,
                    "--out", out))
    assert "these files are computed from the raw data: keep them" in result.stderr
    assert json.loads((out / "sweep.json").read_text())["sensitive"] == SENSITIVE


# ------------------------------------------------------------------ 3. --anonymize-names

NAMES = ["alice.png", "bob.jpg", "Carol Smith.png", "dave/dave_at_home.png", "dave/dave_2019.png",
         "eve/portrait.tif", "frank.bmp", "grace/hopper.png"]
# Pieces of the names above, of the skipped files' and of the folder's.
PRIVATE = ["alice", "bob", "carol", "dave", "eve/", "portrait", "frank", "grace", "hopper",
           "notes about", "broken", "link to"]


@pytest.fixture
def family(tmp_path):
    """A folder of portraits named after people, with a note, a broken image and a link."""
    root = tmp_path / "family_photos"
    for i, name in enumerate(NAMES):
        shape = (20, 16, 3) if i % 2 else (20, 16)
        save(root / name, RNG.integers(0, 256, shape, dtype=np.uint8))
    (root / "notes about grace.txt").write_text("private")
    (root / "eve" / "broken.png").write_bytes(b"not an image")
    os.symlink(root / "alice.png", root / "link to alice.png")
    return root


def perturb_anonymized(cli, family, tmp_path, *args):
    release = tmp_path / "release"
    release.mkdir(exist_ok=True)
    out = release / "images"
    result = ok(cli("perturb", family, "--eps", "1", "--anonymize-names", "--skip-bad", "--out", out,
                    "--seed", SEED, *args))
    return out, result


def test_anonymized_output_and_manifest_name_nobody(cli, family, tmp_path):
    before = tree_digest(family)
    out, result = perturb_anonymized(cli, family, tmp_path)
    assert tree_digest(family) == before
    files = sorted(p.name for p in out.iterdir())
    assert files == [f"{i:06d}.png" for i in range(len(NAMES))]  # flat, numbered
    manifest_text = Path(str(out) + ".manifest.json").read_text()
    for word in PRIVATE + ["family_photos"]:
        assert word not in manifest_text.lower(), word
    m = json.loads(manifest_text)
    assert m["anonymized_names"]["name_map_id"]
    assert [i["image"] for i in m["inputs"]] == files
    assert all(i["path"] == "withheld (--anonymize-names)" for i in m["inputs"])
    assert m["not_images"] == 1 and m["skipped_bad_images"] == 1 and m["skipped_symbolic_links"] == 1
    assert [Path(o["path"]).name for o in m["outputs"]] == files
    # The messages count the skipped files and point at the name map.
    assert "skipped 1 unreadable image (named in the name map)" in result.stderr
    for line in result.stderr.lower().splitlines():
        if "wrote" not in line:  # the lines that name the output and the name map
            assert not any(word in line for word in PRIVATE), line


def test_name_map_pairs_every_image_and_stays_with_the_raw_data(cli, family, tmp_path):
    out, result = perturb_anonymized(cli, family, tmp_path)
    name_map = tmp_path / "family_photos.name-map.json"  # beside the input, not in the release
    assert f"wrote the name map {name_map}" in result.stderr
    assert stat.S_IMODE(name_map.stat().st_mode) == 0o600
    assert siblings(tmp_path / "release") == {"images", "images.manifest.json"}
    document = json.loads(name_map.read_text())
    assert document["name_map_id"] == manifest_of(out)["anonymized_names"]["name_map_id"]
    assert "never with the release" in document["sensitive"]
    mapping = document["images"]
    assert sorted(mapping) == sorted(NAMES)
    assert sorted(mapping.values()) == sorted(p.name for p in out.iterdir())
    assert list(mapping.values()) != sorted(mapping.values())  # a random order (1 in 8! it is sorted)
    assert document["skipped_bad_images"] == ["eve/broken.png"]
    assert document["not_images"] == ["notes about grace.txt"]
    assert document["skipped_symbolic_links"] == ["link to alice.png"]
    # The pixels went where the map says: each output is the noisy version of its image.
    for original, new in mapping.items():
        with Image.open(family / original) as a, Image.open(out / new) as b:
            assert a.size == b.size and len(a.getbands()) == len(b.getbands())


def test_evaluate_pairs_through_the_name_map(cli, family, tmp_path):
    out, _ = perturb_anonymized(cli, family, tmp_path)
    result = ok(cli("evaluate", family, out))
    assert "every check passed" in result.stderr
    moved = tmp_path / "elsewhere.json"
    (tmp_path / "family_photos.name-map.json").rename(moved)
    assert_one_line_error(cli("evaluate", family, out), 1, "family_photos.name-map.json", "--name-map")
    report = json.loads(ok(cli("evaluate", family, out, "--name-map", moved, "--json", "-q")).stdout)
    assert report["ok"] and report["records"] == len(NAMES)


def test_evaluate_refuses_the_name_map_of_another_run(cli, family, tmp_path):
    out, _ = perturb_anonymized(cli, family, tmp_path)
    first = tmp_path / "first.json"
    (tmp_path / "family_photos.name-map.json").rename(first)
    second = tmp_path / "second"
    second.mkdir()
    ok(cli("perturb", family, "--eps", "1", "--anonymize-names", "--skip-bad", "--out", second / "images",
           "--name-map", second / "map.json", "-q"))
    assert_one_line_error(cli("evaluate", family, out, "--name-map", second / "map.json"), 1,
                          "map.json", "another run")
    assert_one_line_error(cli("evaluate", family, second / "images", "--name-map", first), 1, "another run")


def test_name_map_option_needs_an_anonymized_output(cli, family, tmp_path):
    out = tmp_path / "plain"
    ok(cli("perturb", family, "--eps", "1", "--skip-bad", "--out", out, "-q"))
    (tmp_path / "map.json").write_text("{}")
    assert_one_line_error(cli("evaluate", family, out, "--name-map", tmp_path / "map.json"), 2, "--anonymize-names")


def test_name_map_inside_the_output_or_input_is_refused(cli, family, tmp_path):
    out = tmp_path / "release"
    run = ["perturb", family, "--eps", "1", "--anonymize-names", "--skip-bad", "--out", out]
    assert cli(*run, "--name-map", tmp_path / "first.map.json").exit_code == 0  # an earlier output
    before = tree_digest(tmp_path)
    run.append("--overwrite")  # which --overwrite may replace
    assert_one_line_error(cli(*run, "--name-map", out / "map.json"), 2, "name map", "inside the output")
    assert_one_line_error(cli(*run, "--name-map", family / "map.json"), 2, "name map", "inside the input")
    assert_one_line_error(cli(*run, "--name-map", tmp_path / "release.manifest.json"), 2, "name the same file")
    assert tree_digest(tmp_path) == before
    assert siblings(tmp_path) == {"family_photos", "release", "release.manifest.json", "first.map.json"}


@pytest.mark.parametrize("destination", ["--manifest", "--name-map"])
def test_the_weights_sidecar_is_never_replaced(cli, tmp_path, destination):
    """The sidecar of --weights (MASK.json, which says whether the mask is data-derived) is a
    file the run reads; --manifest or --name-map naming it, --overwrite given, replaced it."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(np.full((6, 6), 100, np.uint8)).save(photos / name)
    masks = tmp_path / "masks"
    ok(cli("weight-mask", photos, "--method", "constant", "--weight", "0.5", "--out", masks, "-q"))
    sidecar = tmp_path / "masks.json"
    before = tree_digest(tmp_path)
    assert_one_line_error(cli("perturb", photos, "--eps", "1", "--anonymize-names", "--weights", masks,
                              "--out", tmp_path / "release", destination, sidecar, "--overwrite"),
                          2, "the weights sidecar and the", "name the same file")
    assert tree_digest(tmp_path) == before


def test_existing_name_map_is_not_replaced_without_overwrite(cli, family, tmp_path):
    (tmp_path / "family_photos.name-map.json").write_text("mine")
    assert_one_line_error(cli("perturb", family, "--eps", "1", "--anonymize-names", "--skip-bad", "--out",
                              tmp_path / "o"), 1, "name map exists", "--overwrite")
    assert (tmp_path / "family_photos.name-map.json").read_text() == "mine"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--copy-other"], "--copy-other"),
    (["--name-map", "x.json"], None),
])
def test_usage_errors(cli, family, tmp_path, args, fragment):
    if fragment is None:  # --name-map alone
        assert_one_line_error(cli("perturb", family, "--eps", "1", "--skip-bad", *args), 2,
                              "--name-map applies to --anonymize-names")
    else:
        assert_one_line_error(cli("perturb", family, "--eps", "1", "--skip-bad", "--anonymize-names", *args), 2,
                              fragment, "--anonymize-names")
    assert siblings(tmp_path) == {"family_photos"}


def test_anonymize_names_is_for_image_folders(cli, digits_file, tmp_path):
    assert_one_line_error(cli("perturb", digits_file, "--eps", "1", "--anonymize-names"), 2,
                          "digits.npy", "folders of images")
    assert siblings(tmp_path) == {"digits.npy"}


def test_anonymized_tiff_output(cli, family, tmp_path):
    out, _ = perturb_anonymized(cli, family, tmp_path, "--image-format", "tiff")
    assert sorted(p.name for p in out.iterdir()) == [f"{i:06d}.tiff" for i in range(len(NAMES))]
    ok(cli("evaluate", family, out, "-q"))


# ------------------------------------------------------------------ 4. wide integers need --range

@pytest.mark.parametrize("dtype", ["int32", "uint32", "int64", "uint64"])
def test_wide_integers_without_range_are_refused(cli, tmp_path, dtype):
    counts = tmp_path / "counts.npy"
    np.save(counts, RNG.integers(0, 100, (40, 6)).astype(dtype))
    assert_one_line_error(cli("perturb", counts, "--eps", "1"), 2, "counts.npy", dtype, "--range LO:HI")
    assert siblings(tmp_path) == {"counts.npy"}
    ok(cli("perturb", counts, "--eps", "1", "--range", "0:100", "-q", "--allow-raw-release"))
    assert np.abs(np.load(tmp_path / "counts.tldp.npy")).max() < 1e6  # noise of the declared range


@pytest.mark.parametrize("dtype, lo_hi", [("uint8", [0, 256]), ("int8", [-128, 128]),
                                          ("uint16", [0, 65536]), ("int16", [-32768, 32768])])
def test_narrow_integers_default_to_their_dtype_range(cli, tmp_path, dtype, lo_hi):
    src = tmp_path / "x.npy"
    np.save(src, RNG.integers(0, 100, (40, 6)).astype(dtype))
    ok(cli("perturb", src, "--eps", "1", "-q", "--allow-raw-release"))
    assert manifest_of(tmp_path / "x.tldp.npy")["value_range"] == lo_hi


def test_weight_mask_and_sweep_refuse_wide_integers_alike(cli, tmp_path):
    counts = tmp_path / "counts.npy"
    np.save(counts, RNG.integers(0, 100, (40, 8, 8)).astype(np.int64))
    assert_one_line_error(cli("weight-mask", counts, "--method", "intensity", "--out", tmp_path / "m.npy"), 2,
                          "counts.npy", "int64", "--range LO:HI")
    assert_one_line_error(cli("sweep", counts, "--eps", "1", "--out", tmp_path / "s"), 2,
                          "counts.npy", "int64", "--range LO:HI")
    assert siblings(tmp_path) == {"counts.npy"}
    # A mask that needs no range is made, and its preview is scaled without the dtype's.
    ok(cli("weight-mask", counts, "--method", "constant", "--weight", "0.5", "--out", tmp_path / "m.npy",
           "--preview", tmp_path / "p.png"))
    with Image.open(tmp_path / "p.png") as preview:
        assert np.asarray(preview).std() > 0


def test_wide_integer_hdf5_and_zarr_are_refused(cli, tmp_path):
    import h5py
    import zarr

    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("counts", data=RNG.integers(0, 9, (20, 4)).astype(np.int32))
    zarr.create_array(tmp_path / "c.zarr", shape=(20, 4), dtype="uint32", chunks=(10, 4))[:] = 1
    assert_one_line_error(cli("perturb", tmp_path / "c.h5", "--eps", "1"), 2, "c.h5", "int32", "--range")
    assert_one_line_error(cli("perturb", tmp_path / "c.zarr", "--eps", "1"), 2, "c.zarr", "uint32", "--range")
    assert siblings(tmp_path) == {"c.h5", "c.zarr"}


@pytest.fixture
def shared_umask():
    """A umask that lets other users read new files (the common 022), whatever the test runner's."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_that_show_or_can_test_the_raw_data_are_their_owners_only(cli, digits_file, tmp_path, shared_umask):
    """Regression: the --preview strip of perturb and weight-mask (raw records) and the ledger (its
    key tests whether a guessed record is in the data) were created readable by every user
    (0644 under umask 022), where the name map, which names the people, is 0600. The docs say to
    keep them as private as the raw data: they are now created 0600, like the name map."""
    preview, mask_preview, ledger = tmp_path / "strip.png", tmp_path / "check.png", tmp_path / "ledger.db"
    ok(cli("perturb", digits_file, "--eps", "10", "--budget", "record", "--mechanism", "privunit", "-q",
           "--out", tmp_path / "out.npy", "--preview", preview, "--ledger", ledger))
    ok(cli("weight-mask", digits_file, "--method", "constant", "--weight", "0.5", "--out", tmp_path / "m.npy",
           "--preview", mask_preview))
    for path in (preview, mask_preview, ledger, *tmp_path.glob("ledger.db-*")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((tmp_path / "out.npy").stat().st_mode) == 0o644  # the release: as the umask says
    with Image.open(preview) as im:
        assert im.format == "PNG"
    ok(cli("perturb", digits_file, "--eps", "10", "--budget", "record", "--mechanism", "privunit", "-q",
           "--out", tmp_path / "out.npy", "--preview", preview, "--ledger", ledger, "--overwrite"))
    assert stat.S_IMODE(preview.stat().st_mode) == 0o600  # replaced, still private


def test_reports_sweeps_and_data_derived_masks_are_their_owners_only(cli, digits_file, perturbed, tmp_path,
                                                                     shared_umask):
    """Regression: `evaluate --report`, `sweep`'s tables, plots and `--report` (marked "sensitive":
    computed from the raw data) and masks whose weights come from the private values (intensity is
    an exact function of each value; boxes declared `--data-derived` say where the people are) were
    created readable by every user (0644 under umask 022). They are now created 0600; the
    release, a mask of declared weights and every mask's sidecar (no statistic of the data) follow
    the umask."""
    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    ok(cli("evaluate", digits_file, perturbed, "--report", tmp_path / "report.json", "-q"))
    ok(cli("sweep", digits_file, "--eps", "1", "--seed", SEED, "--allow-weak-seed", "-q",
           "--out", tmp_path / "sweep", "--report", tmp_path / "sweep-report.json"))
    private = [tmp_path / "report.json", tmp_path / "sweep-report.json", *(tmp_path / "sweep").iterdir()]
    assert len(private) == 6
    ok(cli("weight-mask", digits_file, "--method", "intensity", "--out", tmp_path / "intensity.npy"))
    ok(cli("weight-mask", digits_file, "--method", "constant", "--weight", "0.5", "--out", tmp_path / "c.npy"))
    photos = tmp_path / "photos"
    save(photos / "a.png", RNG.integers(0, 256, (20, 16), dtype=np.uint8))
    save(photos / "sub" / "b.png", RNG.integers(0, 256, (20, 16, 3), dtype=np.uint8))
    (tmp_path / "faces.csv").write_text("x0,y0,x1,y1\n2,3,10,12\n")
    ok(cli("weight-mask", photos, "--method", "box", "--boxes", tmp_path / "faces.csv", "--data-derived",
           "--out", tmp_path / "found"))
    ok(cli("weight-mask", photos, "--method", "box", "--boxes", tmp_path / "faces.csv", "--out",
           tmp_path / "drawn"))
    private += [tmp_path / "intensity.npy", tmp_path / "found" / "a.png", tmp_path / "found" / "sub" / "b.png"]
    for path in private:
        assert mode(path) == 0o600, path
    assert mode(tmp_path / "found") == 0o700
    public = [tmp_path / "c.npy", tmp_path / "drawn" / "a.png", tmp_path / "drawn" / "sub" / "b.png",
              tmp_path / "intensity.npy.json", tmp_path / "found.json"]
    for path in public:
        assert mode(path) == 0o644, path
    # Why: the intensity mask gives back every raw value (its range's width is 256 for uint8).
    np.testing.assert_array_equal(np.load(tmp_path / "intensity.npy") * 256, np.load(digits_file))
    with Image.open(tmp_path / "found" / "sub" / "b.png") as im:
        assert im.format == "PNG" and np.asarray(im)[5, 5] == 255 and np.asarray(im)[0, 0] == 0
