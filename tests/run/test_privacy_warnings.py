"""Privacy settings that do less than they seem: a certified per-record eps above the
documented threshold, and a weight mask that cannot change the output. Each is one
line on stderr (unless -q) and an entry of the manifest's `warnings` (so of --json)."""

import json

import h5py
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file

from tests.builders import REPO, SEED
from tldp_cli.privacy import accounting

DIGITS = np.load(REPO / "sample_data" / "digits.npy")[:40]
GUIDE = "see docs/choosing-eps.md for choosing eps"


@pytest.fixture
def digits(tmp_path):
    np.save(tmp_path / "x.npy", DIGITS)
    return tmp_path / "x.npy"


def warning_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("tldp: warning:")]


def run_json(cli, *args):
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return result, json.loads(result.stdout)


def large(manifest):
    return [w for w in manifest.get("warnings", []) if w["kind"] == "large_record_epsilon"]


def test_a_huge_per_record_eps_is_named_with_its_record(cli, digits, tmp_path):
    result, manifest = run_json(cli, "perturb", digits, "--eps", "1", "--out", tmp_path / "o.npy")
    figure = manifest["accounting"]["per_record"]["epsilon"]  # 780.9: the accounting's, not a new one
    assert figure > accounting.RECORD_EPSILON_WARNING
    [line] = [line for line in warning_lines(result) if "certified eps" in line]
    assert line == (f"tldp: warning: the certified eps per record is {figure:.4g}, above 100 (a record is "
                    "one of the 40 entries along the first axis, of 784 elements): a bound of e^eps on "
                    f"what the release tells about it protects nothing; {GUIDE} (--budget record sets "
                    "eps per record)")
    [entry] = large(manifest)
    assert entry["epsilon"] == figure and entry["threshold"] == 100 and entry["scope"] == "per_record"
    assert entry["guide"] == "docs/choosing-eps.md" and entry["message"] == line[len("tldp: "):]
    assert json.loads((tmp_path / "o.npy.manifest.json").read_text())["warnings"] == manifest["warnings"]


@pytest.mark.parametrize("eps, warned", [("8", False), ("100", False), ("101", True)])
def test_the_threshold_is_the_certified_figure_against_100(cli, digits, tmp_path, eps, warned):
    result, manifest = run_json(cli, "perturb", digits, "--eps", eps, "--budget", "record",
                                "--out", tmp_path / "o.npy")
    assert bool(large(manifest)) == warned
    assert any("certified eps" in line for line in warning_lines(result)) == warned
    if warned:
        assert "(lower --eps)" in large(manifest)[0]["message"]


def test_quiet_silences_the_line_but_not_the_manifest(cli, digits, tmp_path):
    result = cli("perturb", digits, "--eps", "1", "--out", tmp_path / "o.npy", "-q", "--json")
    assert result.exit_code == 0 and result.stderr == ""
    assert large(json.loads(result.stdout))
    assert large(json.loads((tmp_path / "o.npy.manifest.json").read_text()))


def test_plan_warns_as_perturb_does(cli, digits):
    result, plan = run_json(cli, "plan", digits, "--eps", "1")
    [entry] = large(plan)
    assert entry["epsilon"] == plan["accounting"]["per_record"]["epsilon"]
    assert entry["message"] in plan["messages"]
    assert f"tldp: {entry['message']}" in warning_lines(result)
    described, plan = run_json(cli, "plan", "--elements", "640x480x3", "--records", "10", "--range", "0:256",
                               "--eps", "1")
    assert "a record is one of the 10 entries along the first axis, of 921600 elements" in described.stderr
    assert large(plan)[0]["epsilon"] > 8e5  # a photo at --eps 1
    assert not large(run_json(cli, "plan", digits, "--eps", "8", "--budget", "record")[1])


def test_a_single_record_is_the_only_entry(cli):
    """docs/choosing-eps.md's photo plan (--records 1) warned "a record is one of the 1
    entries along the first axis"."""
    described, _ = run_json(cli, "plan", "--elements", "480x640x3", "--records", "1", "--range", "0:256",
                            "--eps", "1")
    assert "a record is the only entry along the first axis, of 921600 elements" in described.stderr


def test_the_record_is_named_for_images_rows_and_model_files(cli, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(photos / "a.png")
    _, manifest = run_json(cli, "perturb", photos, "--eps", "1", "--out", tmp_path / "po")
    assert large(manifest)[0]["record"] == "an image"

    with h5py.File(tmp_path / "rows.h5", "w") as f:
        f["a"] = DIGITS[:10, :8, :8]
        f["b"] = DIGITS[:10, 0, :4]
    result, manifest = run_json(cli, "perturb", tmp_path / "rows.h5", "--eps", "2", "--range", "0:256",
                                "--out", tmp_path / "r.h5")
    [entry] = large(manifest)
    assert entry["record"] == "row i of /a, /b"
    assert entry["epsilon"] == manifest["accounting"]["per_record"]["epsilon"]  # the row composed

    save_file({"w": np.zeros((32, 16), np.float32), "b": np.zeros(16, np.float32)}, str(tmp_path / "m.safetensors"))
    result, manifest = run_json(cli, "perturb", tmp_path / "m.safetensors", "--eps", "60", "--budget", "record",
                                "--clip", "0.1", "--dtype", "float64", "--out", tmp_path / "o.safetensors")
    # Each tensor gets eps 60; the file, one party's, composes them: that is the subject's figure.
    [entry] = large(manifest)
    assert entry["scope"] == "per_file" and entry["record"] == "one party's 2 tensors, composed"
    assert entry["epsilon"] == manifest["accounting"]["per_file"]["epsilon"] > 100
    assert manifest["accounting"]["per_record"]["epsilon"] <= 60
    assert "the certified eps per file is" in result.stderr


@pytest.mark.parametrize("mechanism", [[], ["--mechanism", "privunit"]])
def test_a_file_already_at_record_budget_is_told_to_lower_eps(cli, tmp_path, mechanism):
    """--budget record (or privunit, which implies it) already sets eps per tensor: the
    advice for a file whose composed figure passes 100 is a lower --eps, not that option."""
    tensors = {f"t{i}": np.zeros((4, 4), np.float32) for i in range(30)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    budget = [] if mechanism else ["--budget", "record"]
    _, manifest = run_json(cli, "perturb", tmp_path / "m.safetensors", "--eps", "4", *budget, *mechanism,
                           "--clip", "0.1", "--out", tmp_path / "o.safetensors")
    [entry] = large(manifest)
    assert entry["scope"] == "per_file" and entry["epsilon"] == manifest["accounting"]["per_file"]["epsilon"]
    assert entry["message"].endswith(f"{GUIDE} (lower --eps: each tensor gets it, the file composes them)")
    assert "--budget record" not in entry["message"]


def test_a_mask_that_cannot_change_the_output_says_so(cli, digits, tmp_path):
    mask = tmp_path / "w.npy"
    np.save(mask, np.full((28, 28), 0.9))
    masked, manifest = run_json(cli, "perturb", digits, "--eps", "1", "--weights", mask, "--seed", SEED,
                                "--out", tmp_path / "masked.npy")
    plain = cli("perturb", digits, "--eps", "1", "--seed", SEED, "--out", tmp_path / "plain.npy")
    assert plain.exit_code == 0
    # What the warning claims: the bytes are those of the run without the mask.
    assert (tmp_path / "masked.npy").read_bytes() == (tmp_path / "plain.npy").read_bytes()
    assert manifest["retain_probability"] == 0.0 and manifest["retain_probability_log10"] < -324
    [entry] = [w for w in manifest["warnings"] if w["kind"] == "weights_without_effect"]
    assert entry["records"] == entry["of"] == 40
    line = f"tldp: {entry['message']}"
    assert line in warning_lines(masked)
    assert line.startswith(f"tldp: warning: the weight mask {mask} cannot change the output: TLDP's retain "
                           "probability is already 0 at --eps 1 (element budget) for records of 784 elements "
                           f"(log10 p = {manifest['retain_probability_log10']:.5g} underflows)")
    quiet = cli("perturb", digits, "--eps", "1", "--weights", mask, "--out", tmp_path / "q.npy", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert any(w["kind"] == "weights_without_effect"
               for w in json.loads((tmp_path / "q.npy.manifest.json").read_text())["warnings"])

    baseline, manifest = run_json(cli, "perturb", digits, "--eps", "1", "--mechanism", "baseline",
                                  "--weights", mask, "--out", tmp_path / "b.npy")
    assert "cannot change the output: the mechanism keeps no raw value" in baseline.stderr


def test_a_mask_that_can_change_the_output_is_not_warned_about(cli, tmp_path):
    values = np.random.default_rng(1).integers(0, 4, (200, 4), dtype=np.uint8)
    np.save(tmp_path / "small.npy", values)
    np.save(tmp_path / "w.npy", np.full(4, 0.5))
    result, manifest = run_json(cli, "perturb", tmp_path / "small.npy", "--eps", "1", "--range", "0:4",
                                "--weights", tmp_path / "w.npy", "--out", tmp_path / "o.npy")
    assert manifest["retain_probability"] > 1e-3
    assert "warnings" not in manifest and not warning_lines(result)[1:]  # only the sidecar's line


def test_a_mask_idle_on_some_records_counts_them(cli, tmp_path):
    """The retain probability falls with the record's size: a 2x2 image keeps raw values
    at eps 1, a 64x64 one does not."""
    photos, masks = tmp_path / "photos", tmp_path / "masks"
    photos.mkdir()
    masks.mkdir()
    rng = np.random.default_rng(2)
    for name, shape in (("small", (2, 2)), ("large", (64, 64))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(photos / f"{name}.png")
        Image.fromarray(np.full(shape, 128, np.uint8)).save(masks / f"{name}.png")
    result, manifest = run_json(cli, "perturb", photos, "--eps", "1", "--weights", masks, "--out", tmp_path / "out")
    assert [c["retain_probability"] > 0 for c in manifest["calibrations"]] == [True, False]
    [entry] = [w for w in manifest["warnings"] if w["kind"] == "weights_without_effect"]
    assert (entry["records"], entry["of"]) == (1, 2)
    assert "cannot change the output for 1 of the 2 records it covers" in entry["message"]
    assert "records of 4096 elements" in entry["message"]


def clip_warnings(manifest):
    return [w for w in manifest.get("warnings", []) if w["kind"] == "clip_on_integers"]


def test_clip_on_unsigned_integers_says_what_it_clips_and_that_the_range_doubles(cli, digits, tmp_path):
    """--clip C on uint8 digits sets their values above C to C, silently until this warning,
    and declares (-C, C): half of it values uint8 cannot hold, which the noise is scaled to."""
    result, manifest = run_json(cli, "perturb", digits, "--eps", "1", "--clip", "100", "--out", tmp_path / "o.npy")
    [entry] = clip_warnings(manifest)
    assert entry["message"] == (
        "warning: --clip 100 on integer data: uint8 (values 0..255): its values above 100 become 100 before "
        "the noise, and the range it declares, -100:101, is 1.99 times as wide as the values that reach the "
        "noise (0..100), which the noise is scaled to; --range 0:101 --clip-input scales it to them")
    assert f"tldp: {entry['message']}" in warning_lines(result)
    assert manifest["value_range"] == [-100, 101] and manifest["preprocessing"] == ["clip"]
    # What it suggests clips the same values at half the noise, and is not warned about.
    _, suggested = run_json(cli, "perturb", digits, "--eps", "1", "--range", "0:101", "--clip-input",
                            "--out", tmp_path / "s.npy")
    assert suggested["value_range"] == [0, 101] and not clip_warnings(suggested)
    assert suggested["noise_scale"] == pytest.approx(manifest["noise_scale"] * 101 / 201)
    written = np.load(tmp_path / "o.npy")
    assert written.dtype == np.int16 and written.shape == DIGITS.shape


def test_clip_beyond_the_dtype_clips_nothing_and_says_so(cli, digits, tmp_path):
    result, plan = run_json(cli, "plan", digits, "--eps", "1", "--clip", "1000")
    [entry] = clip_warnings(plan)
    assert entry["message"] == (
        "warning: --clip 1000 on integer data: uint8 (values 0..255): it clips none of its values, and the "
        "range it declares, -1000:1001, is 7.82 times as wide as the values that reach the noise (0..255), "
        "which the noise is scaled to; --range 0:256 scales it to them")
    assert f"tldp: {entry['message']}" in warning_lines(result) and entry["message"] in plan["messages"]


def test_clip_on_signed_integers_names_both_ends_and_float_data_is_not_warned(cli, tmp_path):
    np.save(tmp_path / "s.npy", np.arange(-512, 512, dtype=np.int16).reshape(64, 16))
    _, plan = run_json(cli, "plan", tmp_path / "s.npy", "--eps", "1", "--clip", "100", "--sampler", "float")
    [entry] = clip_warnings(plan)
    assert entry["message"] == ("warning: --clip 100 on integer data: int16 (values -32768..32767): its values "
                                "below -100 become -100 and those above 100 become 100 before the noise")
    np.save(tmp_path / "f.npy", np.linspace(-2, 2, 64, dtype=np.float32).reshape(4, 16))
    result, plan = run_json(cli, "plan", tmp_path / "f.npy", "--eps", "1", "--clip", "1")
    assert not clip_warnings(plan) and "--clip" not in result.stderr


def kept_warnings(manifest):
    return [w for w in manifest.get("warnings", []) if w["kind"] == "kept_per_record"]


def test_keeping_a_dataset_of_a_value_per_record_warns_and_names_it(cli, tmp_path):
    """--keep /raw copied 20 records' values raw, outside the certified figure, and only the
    summary line's "copied unchanged" said so; a coordinate (4 values, no record axis) is no
    such array, a kept 1-D labels dataset is (usual for labels, but raw)."""
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "scans.h5", "w") as f:
        f["images"] = rng.random((20, 4, 4))
        f["raw"] = rng.random((20, 8))
        f["labels"] = np.arange(20)
        f["lat"] = np.arange(4.0)
    result, manifest = run_json(cli, "perturb", tmp_path / "scans.h5", "--eps", "1", "--dataset", "images",
                                "--range", "0:1", "--keep", "/raw", "--keep", "/lat", "--keep", "/labels",
                                "--out", tmp_path / "o.h5")
    [entry] = kept_warnings(manifest)
    assert sorted(entry["names"]) == ["/labels", "/raw"]
    assert entry["message"].startswith(f"warning: --keep copies {', '.join(entry['names'])} raw: they hold a "
                                       "value per record")
    assert "outside the certified eps" in entry["message"] and "usual for labels" in entry["message"]
    assert f"tldp: {entry['message']}" in warning_lines(result)
    with h5py.File(tmp_path / "o.h5") as out:  # what it warns about is what was written raw
        np.testing.assert_array_equal(out["raw"][()], h5py.File(tmp_path / "scans.h5")["raw"][()])
    _, coordinate = run_json(cli, "plan", tmp_path / "scans.h5", "--eps", "1", "--dataset", "images",
                             "--range", "0:1", "--keep", "/lat")
    assert not kept_warnings(coordinate)


def test_keeping_a_table_column_warns_and_names_it(cli, tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(1)
    pq.write_table(pa.table({"x": rng.random(10), "income": rng.random(10)}), tmp_path / "t.parquet")
    result, manifest = run_json(cli, "perturb", tmp_path / "t.parquet", "--eps", "1", "--dataset", "x",
                                "--range", "0:1", "--keep", "income", "--out", tmp_path / "o.parquet")
    [entry] = kept_warnings(manifest)
    assert entry["names"] == ["income"]
    assert entry["message"].startswith("warning: --keep copies income raw: it holds a value per record")
    assert f"tldp: {entry['message']}" in warning_lines(result)
    assert pq.read_table(tmp_path / "o.parquet").column("income").to_pylist() == \
        pq.read_table(tmp_path / "t.parquet").column("income").to_pylist()
    _, plain = run_json(cli, "perturb", tmp_path / "t.parquet", "--eps", "1", "--dataset", "x", "--range", "0:1",
                        "--out", tmp_path / "p.parquet")
    assert not kept_warnings(plain)


def test_keeping_a_zarr_array_of_a_value_per_record_warns_but_not_a_small_one(cli, tmp_path):
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(2)
    group = zarr.open_group(tmp_path / "s.zarr", mode="w")
    group.create_array("images", data=rng.random((20, 4, 4)))
    group.create_array("scores", data=rng.random((20, 3)))
    group.create_array("meta", data=np.arange(5.0))
    result, manifest = run_json(cli, "perturb", tmp_path / "s.zarr", "--eps", "1", "--dataset", "images",
                                "--range", "0:1", "--keep", "scores", "--keep", "meta", "--out", tmp_path / "o.zarr")
    [entry] = kept_warnings(manifest)
    assert entry["names"] == ["scores"] and f"tldp: {entry['message']}" in warning_lines(result)
    assert {u["name"] for u in manifest["unperturbed"]} >= {"scores", "meta"}


def _webdataset_shard(path, samples: int = 4):
    """One shard laid out as webdataset's TarWriter writes it: each sample's members
    KEY.EXTENSION, consecutive (an image, a class label, a JSON record)."""
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            png = io.BytesIO()
            Image.fromarray(np.random.default_rng(i).integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(png, "PNG")
            for ext, data in (("png", png.getvalue()), ("cls", str(i % 2).encode()),
                              ("json", json.dumps({"age": 40 + i}).encode())):
                info = tarfile.TarInfo(f"sample{i:04d}.{ext}")
                info.size, info.mtime = len(data), 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return path


def test_keeping_webdataset_label_members_warns_and_names_them(cli, tmp_path):
    """Regression: --keep cls copied each sample's label raw (one value per sample, a
    per-record value, as a table's column) without the kept_per_record warning."""
    src = tmp_path / "shards"
    src.mkdir()
    _webdataset_shard(src / "a.tar")
    result, manifest = run_json(cli, "perturb", src, "--eps", "1", "--keep", "cls", "--out", tmp_path / "out")
    [entry] = kept_warnings(manifest)
    assert entry["names"] == ["cls"]
    assert entry["message"].startswith("warning: --keep copies cls raw: it holds a value per record")
    assert "a member of each sample" in entry["message"] and "usual for labels" in entry["message"]
    assert f"tldp: {entry['message']}" in warning_lines(result)
    _, anonymized = run_json(cli, "perturb", src, "--eps", "1", "--keep", "cls", "--keep", "json",
                             "--anonymize-names", "--out", tmp_path / "anon")
    [counted] = kept_warnings(anonymized)
    assert "names" not in counted and counted["message"].startswith(
        "warning: --keep copies 2 arrays, columns or members raw: they hold a value per record")
    _, plain = run_json(cli, "perturb", src, "--eps", "1", "--out", tmp_path / "plain")
    assert not kept_warnings(plain)
