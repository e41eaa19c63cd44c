"""tldp plan: the manifest's figures before the data, from headers alone, writing nothing."""

import io
import json
import shutil
import time

import h5py
import numpy as np
import pytest
import tifffile
import webdataset as wds
import zarr
from PIL import Image
from safetensors.numpy import save_file

from tests.builders import REPO, assert_one_line_error, siblings

DIGITS = np.load(REPO / "sample_data" / "digits.npy")[:30]


def make_input(kind, tmp_path):
    if kind == "npy":
        np.save(tmp_path / "x.npy", DIGITS)
        return tmp_path / "x.npy"
    if kind == "hdf5":
        with h5py.File(tmp_path / "x.h5", "w") as f:
            f["images"] = DIGITS
            f["masks"] = DIGITS[:, :4, :4]
        return tmp_path / "x.h5"
    if kind == "zarr":
        zarr.create_array(tmp_path / "x.zarr", shape=DIGITS.shape, dtype="uint8", chunks=(10, 28, 28),
                          zarr_format=3)[:] = DIGITS
        return tmp_path / "x.zarr"
    if kind == "images":
        shutil.copytree(REPO / "sample_data" / "digits_png", tmp_path / "png")
        return tmp_path / "png"
    weights = np.random.default_rng(0).normal(0, 0.05, (32, 16)).astype(np.float32)
    save_file({"w": weights, "b": np.zeros(16, np.float32)}, str(tmp_path / "m.safetensors"))
    return tmp_path / "m.safetensors"


def json_of(result):
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("kind", ["npy", "hdf5", "zarr", "images", "safetensors"])
@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_plan_states_what_the_run_certifies(cli, tmp_path, kind, noise):
    src = make_input(kind, tmp_path)
    extra = ["--clip", "0.2"] if kind == "safetensors" else []
    before = siblings(tmp_path)
    planned = json_of(cli("plan", src, "--eps", "2", "--noise", noise, "--json", "-q", *extra))
    assert siblings(tmp_path) == before  # a plan writes nothing
    ran = json_of(cli("perturb", src, "--eps", "2", "--noise", noise, "--json", "-q", *extra,
                      "--out", tmp_path / "out" if kind in ("zarr", "images") else tmp_path / f"o{src.suffix}"))
    assert planned["accounting"] == ran["accounting"]
    for field in ("noise", "noise_scale", "retain_probability", "sampler", "records",
                  "elements_per_record", "inputs", "value_range", "preprocessing"):
        assert planned[field] == ran[field], field
    assert planned.get("row_datasets") == ran.get("row_datasets")


def test_a_described_record_needs_no_file(cli):
    planned = json_of(cli("plan", "--elements", "28x28", "--records", "60000", "--range", "0:256",
                          "--eps", "8", "--budget", "record", "--noise", "discrete-laplace", "--json"))
    assert planned["accounting"]["per_record"]["epsilon"] <= 8
    assert planned["calibration"]["records"] == 60000
    assert planned["calibration"]["calibration_epsilon"] < 8 / 784 * 1.1


def test_the_least_reachable_target_is_stated(cli):
    result = cli("plan", "--elements", "784", "--range", "0:256", "--eps", "1", "--budget", "record",
                 "--noise", "discrete-laplace")
    assert result.exit_code == 2 and "at least 7.646" in result.stderr


def test_plan_states_what_copy_other_copies_and_leaves_out(cli, tmp_path):
    """Regression: plan took no --copy-other, so the plan of a perturb --copy-other run said
    the files beside the photos were skipped, where perturb copies them (unperturbed) or,
    for data such as a GIF photo, leaves them out (dropped)."""
    src = tmp_path / "photos"
    src.mkdir()
    Image.fromarray(DIGITS[0]).save(src / "a.png")
    Image.fromarray(DIGITS[1]).save(src / "b.gif")
    (src / "notes.txt").write_text("captions")
    planned = json_of(cli("plan", src, "--eps", "1", "--copy-other", "--json", "-q"))
    ran = cli("perturb", src, "--eps", "1", "--copy-other", "--out", tmp_path / "out", "-q")
    assert ran.exit_code == 0, ran.output
    manifest = json.loads((tmp_path / "out.manifest.json").read_text())
    for field in ("unperturbed", "dropped", "not_images", "not_images_action"):
        assert planned[field] == manifest[field], field
    assert planned["unperturbed"] == [{"name": "notes.txt", "kind": "file", "reason": "--copy-other: not an image"}]
    assert [d["name"] for d in planned["dropped"]] == ["b.gif"]


def least_reachable(result) -> float:
    assert result.exit_code == 2, result.output
    return float(result.stderr.split("certifies at least ")[1].split()[0])


def test_photos_of_several_sizes_are_refused_with_the_eps_every_size_needs(cli, tmp_path):
    """Regression: under --budget record, a folder of photos of several sizes (8- and 16-bit)
    was refused with the least figure of the first size found; the --eps it named was then
    refused again, at the next size."""
    images = {"a.png": np.full((8, 8, 3), 90, np.uint8), "b.png": np.full((48, 40, 3), 90, np.uint8),
              "c.png": np.full((12, 12), 9000, np.uint16), "d.png": np.full((30, 20), 90, np.uint8)}
    alone = {}
    (tmp_path / "all").mkdir()
    for name, pixels in images.items():
        (tmp_path / name).mkdir()
        for folder in (tmp_path / name, tmp_path / "all"):
            Image.fromarray(pixels).save(folder / name)
        alone[name] = least_reachable(cli("plan", tmp_path / name, "--eps", "1", "--budget", "record"))
    assert len(set(alone.values())) == len(alone)  # each size needs its own least figure
    least = least_reachable(cli("plan", tmp_path / "all", "--eps", "1", "--budget", "record"))
    assert least == max(alone.values())
    planned = cli("plan", tmp_path / "all", "--eps", str(least * 1.001), "--budget", "record", "--json", "-q")
    assert planned.exit_code == 0, planned.output


def test_a_sparse_50_gb_input_is_planned_in_seconds(cli, tmp_path):
    records = 50 * 10**9 // 784
    path = tmp_path / "big.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(
            f, {"descr": "|u1", "fortran_order": False, "shape": (records, 28, 28)})
        f.truncate(f.tell() + records * 784)  # sparse: no block of it is on disk
    started = time.monotonic()
    planned = json_of(cli("plan", path, "--eps", "1", "--json", "-q"))
    assert time.monotonic() - started < 30  # it reads the header only (about a second)
    assert planned["calibration"]["elements"] == records * 784
    assert path.stat().st_blocks * 512 < 10**6  # still sparse: nothing was read into it


def test_plan_refuses_what_perturb_refuses(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((100, 1), np.float32))
    planned = cli("plan", tmp_path / "x.npy", "--eps", "1", "--range", "0:1", "--sampler", "float")
    ran = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--range", "0:1", "--sampler", "float")
    assert planned.exit_code == ran.exit_code == 2
    assert planned.stderr == ran.stderr


def test_plan_describes_rows_and_the_worst_retain_probability_as_perturb_does(cli, tmp_path):
    """Two arrays whose rows are one subject's: plan said "100 records, the largest of 64
    elements" with the largest record size's retain probability; perturb says 50 records
    of up to 80 elements, and the manifest the worst record size's p."""
    src = tmp_path / "two.h5"
    rng = np.random.default_rng(0)
    with h5py.File(src, "w") as f:
        f["a"] = rng.integers(0, 256, (50, 8, 8), dtype=np.uint8)
        f["b"] = rng.integers(0, 256, (50, 4, 4), dtype=np.uint8)
    args = ["--eps", "1", "--dataset", "a", "--dataset", "b", "--noise", "gaussian"]
    planned = cli("plan", src, *args, "--json")
    ran = cli("perturb", src, *args, "--out", tmp_path / "out.h5")
    assert planned.exit_code == 0 and ran.exit_code == 0, planned.stderr + ran.stderr
    phrase = "50 records of up to 80 elements, a record being one row of each array that shares it"
    assert f"tldp: plan: {phrase};" in planned.stderr and f"({phrase})" in ran.stderr
    manifest = json.loads((tmp_path / "out.h5.manifest.json").read_text())
    plan = json.loads(planned.stdout)
    assert plan["calibration"]["retain_probability"] == manifest["retain_probability"] == plan["retain_probability"]
    assert f"retain probability {manifest['retain_probability']:.3g}" in planned.stderr


def test_a_unit_range_without_a_dtype_points_to_input_dtype(cli):
    """--range 0.0:1.0 has integer ends, so it described integer data holding one value:
    the refusal did not say that --input-dtype makes it float data."""
    result = cli("plan", "--elements", "784", "--range", "0.0:1.0", "--eps", "1")
    assert result.exit_code == 2 and "--input-dtype float32" in result.stderr
    assert cli("plan", "--elements", "784", "--range", "0:1", "--eps", "1", "--input-dtype", "float32").exit_code == 0


def test_a_narrow_integer_range_says_the_records_are_planned_as_integers(cli, tmp_path):
    """--range -1:1 (tanh features) described integer data {-1, 0} without a word: the plan
    certified half what perturb certifies for the float file (8 per record against 16)."""
    described = cli("plan", "--elements", "16", "--records", "10", "--range", "-1:1", "--eps", "1", "--json")
    assert described.exit_code == 0, described.stderr
    note = ("note: --range -1:1 has integer ends, so the records are planned as integers -1 to 0; "
            "for float data in that range give --input-dtype float32 (or float64)")
    assert f"tldp: {note}" in described.stderr.splitlines() and note in json.loads(described.stdout)["messages"]
    np.save(tmp_path / "f.npy", np.tanh(np.random.default_rng(0).normal(size=(10, 16))).astype(np.float32))
    as_floats = [json.loads(cli(*args, "--range", "-1:1", "--eps", "1", "--json").stdout)["accounting"]["per_record"]
                 for args in (("plan", tmp_path / "f.npy"),
                              ("plan", "--elements", "16", "--records", "10", "--input-dtype", "float32"))]
    assert as_floats[0] == as_floats[1]  # what the note points to is the file's plan
    assert json.loads(described.stdout)["accounting"]["per_record"]["epsilon"] < as_floats[0]["epsilon"] / 1.9
    for quiet in (("--range", "0:256"), ("--range", "-1:1", "--input-dtype", "int8"), ("--range", "-1.5:1")):
        result = cli("plan", "--elements", "16", *quiet, "--eps", "1")  # a byte's range, or the dtype given
        assert result.exit_code == 0 and "note:" not in result.stderr, result.stderr


def test_described_records_without_a_range_say_what_to_give(cli):
    """--elements without --range said "records: float64 data needs --range", naming a file
    'records' the user never gave; the line names --elements and the ways out (--range,
    --clip, an 8- or 16-bit --input-dtype)."""
    result = cli("plan", "--elements", "28x28", "--records", "10", "--eps", "4", "--mechanism", "privunit")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("tldp: error: --elements describes records") and "records:" not in result.stderr
    assert "--range LO:HI" in result.stderr and "--input-dtype uint8" in result.stderr and "--clip C" in result.stderr
    assert cli("plan", "--elements", "28x28", "--eps", "4", "--input-dtype", "uint8",
               "--mechanism", "privunit").exit_code == 0
    floats = cli("plan", "--elements", "28x28", "--eps", "4", "--input-dtype", "float32")
    assert floats.exit_code == 2 and floats.stderr.startswith("tldp: error: --elements describes records")
    assert "float32 data needs --range LO:HI" in floats.stderr


@pytest.mark.parametrize("image_format", ["png", "tiff"])
def test_plan_names_the_dtype_perturb_writes_for_images(cli, tmp_path, image_format):
    """Images are written as PNG of their own bit depth (uint8), not as the engine's values
    (int16): the plan's summary line and output_dtype say what the run's files hold."""
    src = make_input("images", tmp_path)
    planned = cli("plan", src, "--eps", "2", "--image-format", image_format)
    assert planned.exit_code == 0, planned.stderr
    plan_json = json_of(cli("plan", src, "--eps", "2", "--image-format", image_format, "--json", "-q"))
    ran = json_of(cli("perturb", src, "--eps", "2", "--json", "-q", "--image-format", image_format,
                      "--out", tmp_path / "out"))
    first = next(p for p in sorted((tmp_path / "out").rglob("*")) if p.is_file())
    if image_format == "png":
        with Image.open(first) as im:
            written = np.asarray(im).dtype
    else:
        written = tifffile.imread(first).dtype
    assert plan_json["output_dtype"] == ran["output_dtype"] == str(written)
    assert f", values {written}" in planned.stderr
    assert (written == np.uint8) == (image_format == "png")


def test_plan_names_the_dtype_perturb_writes_for_webdataset(cli, tmp_path):
    src = tmp_path / "shards"
    src.mkdir()
    with wds.TarWriter(str(src / "a.tar")) as sink:
        sink.write({"__key__": "s0", "png": DIGITS[0], "npy": DIGITS[1]})
    planned = cli("plan", src, "--eps", "2")
    ran = json_of(cli("perturb", src, "--eps", "2", "--json", "-q", "--out", tmp_path / "out"))
    sample = next(iter(wds.WebDataset(str(tmp_path / "out" / "a.tar"), shardshuffle=False)))
    with Image.open(io.BytesIO(sample["png"])) as im:
        written = [np.asarray(im).dtype, np.load(io.BytesIO(sample["npy"])).dtype]
    assert ran["output_dtype"] == f"{written[0]} PNG, {written[1]} .npy"
    assert f", values {ran['output_dtype']}" in planned.stderr


@pytest.mark.parametrize("command", ["plan", "audit"])
@pytest.mark.parametrize("elements", ["99999999999999999999", "4294967296x4294967296", "3037000500x3037000500"])
def test_more_elements_than_int64_counts_is_a_usage_error(cli, command, elements):
    """A count past int64 failed as "unexpected error (OverflowError)", and a shape whose
    product wraps around int64 as "a record must have at least one element"."""
    result = cli(command, "--elements", elements, "--range", "0:256", "--eps", "1")
    assert_one_line_error(result, 2, f"--elements {elements}: more elements per record than an array can hold")
