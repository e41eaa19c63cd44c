"""`tldp weight-mask` and `perturb --weights` end to end (issue 4).

Masks are made with the CLI on real data the tests write (the shipped MNIST digits,
PNG folders made with Pillow, HDF5 and Zarr files) and then used by perturb.
"""

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from PIL import Image

from tests.builders import assert_one_line_error, siblings, tree_digest
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.run.manifest import sha256_file
from tldp_cli.weight_mask import feather

RNG = np.random.default_rng(4)


def ok(result):
    assert result.exit_code == 0, result.stderr
    return result


def save_png(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


def png(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im)


def manifest_of(out: Path) -> dict:
    return json.loads(Path(str(out) + ".manifest.json").read_text())


@pytest.fixture
def digits_file(tmp_path, digits):
    path = tmp_path / "digits.npy"
    np.save(path, digits[:50])
    return path


@pytest.fixture
def photos(tmp_path):
    """A folder of PNG and JPEG photos of different sizes, gray and colour, in subfolders."""
    root = tmp_path / "photos"
    save_png(root / "a.png", RNG.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    save_png(root / "sub" / "b.png", RNG.integers(0, 256, (16, 12), dtype=np.uint8))
    root.joinpath("sub", "deeper").mkdir()
    Image.fromarray(RNG.integers(0, 256, (10, 14, 3), dtype=np.uint8)).save(
        root / "sub" / "deeper" / "c.jpg", quality=95)
    return root


# --- statistics through the full pipeline -------------------------------------------

def retained(original: np.ndarray, perturbed: np.ndarray) -> np.ndarray:
    """Which values came through raw (noise is continuous: a noised value never equals it)."""
    return perturbed == original.astype(np.float32)


# Counting raw values by equality, against p in closed form, needs continuous noise: the float
# sampler (the default exact one snaps float data to a grid, so no output equals its input).
FLOAT = ("--sampler", "float")


def binomial_ok(kept: int, n: int, p: float) -> bool:
    return abs(kept - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1


# The tests below need a visible p (weights scale the retain probability) on small float records
# in 0:1, which keep raw values with probability above dp_delta: a raw release, which needs
# consent (tests/privacy/test_raw_release.py).
CONSENT = "--allow-raw-release"


@pytest.mark.parametrize("weight", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_constant_mask_scales_the_retain_probability(cli, tmp_path, weight):
    """Scalar records (I = 1, p = 0.83 at eps 10): the kept fraction is (1 - w) p."""
    n = 20000
    data = RNG.random(n)
    src = tmp_path / "x.npy"
    np.save(src, data)
    mask = tmp_path / "w.npy"
    ok(cli("weight-mask", src, "--method", "constant", "--weight", weight, "--out", mask))
    out = tmp_path / "out.npy"
    m = json.loads(ok(cli("perturb", src, "--eps", "10", "--range", "0:1", "--weights", mask,
                          "--seed", 11, "--allow-weak-seed", "--out", out, "--json", "-q", CONSENT,
                          *FLOAT)).stdout)
    p = calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=10, range_width=1,
                  elements=1).p
    assert p > 0.8
    kept = int(retained(data, np.load(out)).sum())
    if weight == 1.0:
        assert kept == 0
    assert binomial_ok(kept, n, (1 - weight) * p), (kept, n * (1 - weight) * p)
    assert m["retain_probability"] == pytest.approx((1 - weight) * p)
    assert m["weights"]["method"] == "constant" and m["weights"]["data_derived"] is False
    assert m["weights"]["min"] == m["weights"]["max"] == weight


def write_hdf5(path: Path, data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(1000, *data.shape[1:]))
    return path


def write_zarr(path: Path, data: np.ndarray) -> Path:
    zarr.create_array(store=str(path), data=data, chunks=(1000, *data.shape[1:]))
    return path


def read_any(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        return np.load(path)
    if path.suffix == ".h5":
        with h5py.File(path, "r") as f:
            return f["x"][:]
    return zarr.open_array(str(path), mode="r")[:]


@pytest.mark.parametrize("fmt", ["npy", "h5", "zarr"])
def test_box_mask_weights_each_position(cli, tmp_path, fmt):
    """2x2 records (p = 0.057 at eps 0.3): each position keeps (1 - w) p of its values,
    weight 1 none; the same through every array format."""
    n = 40000
    data = RNG.random((n, 2, 2)).astype(np.float32)
    src = tmp_path / f"x.{fmt}"
    {"npy": lambda: np.save(src, data), "h5": lambda: write_hdf5(src, data),
     "zarr": lambda: write_zarr(src, data)}[fmt]()
    boxes = tmp_path / "boxes.csv"
    # pixel (row 0, col 0) w = 0.25, (0, 1) w = 0.5, (1, 0) w = 1, (1, 1) no box: w = 0
    boxes.write_text("x0,y0,x1,y1,weight\n0,0,1,1,0.25\n1,0,2,1,0.5\n0,1,1,2,1\n")
    mask = tmp_path / "mask.npy"
    ok(cli("weight-mask", src, "--method", "box", "--boxes", boxes, "--out", mask))
    np.testing.assert_array_equal(np.load(mask), [[0.25, 0.5], [1.0, 0.0]])
    out = tmp_path / f"out.{fmt}"
    m = json.loads(ok(cli("perturb", src, "--eps", "0.3", "--range", "0:1", "--weights", mask,
                          "--seed", 5, "--allow-weak-seed", "--out", out, "--json", "-q", CONSENT,
                          *FLOAT)).stdout)
    p = calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=0.3, range_width=1,
                  elements=4).p
    assert p > 0.05
    kept = retained(data, read_any(out)).sum(axis=0)
    assert kept[1, 0] == 0, "weight 1 kept a raw value"
    for (row, col), w in {(0, 0): 0.25, (0, 1): 0.5, (1, 1): 0.0}.items():
        assert binomial_ok(int(kept[row, col]), n, (1 - w) * p), (row, col, kept[row, col], n * (1 - w) * p)
    assert m["weights"]["method"] == "box" and m["weights"]["sha256"] == sha256_file(mask)
    assert m["weights"]["min"] == 0.0 and m["weights"]["max"] == 1.0
    assert m["accounting"] == json.loads(ok(cli(
        "perturb", src, "--eps", "0.3", "--range", "0:1", "--out", tmp_path / f"plain.{fmt}",
        "--json", "-q", CONSENT, *FLOAT)).stdout)["accounting"], "weights changed the certified accounting"


def test_per_record_mask_through_the_pipeline(cli, tmp_path):
    """An intensity mask (one per record) weights each record by its own values."""
    n = 20000
    data = np.where(np.arange(n) % 2 == 0, 0.0, 1.0)[:, None].repeat(2, axis=1)  # records 0 or 1
    src = tmp_path / "x.npy"
    np.save(src, data)
    mask = tmp_path / "w.npy"
    ok(cli("weight-mask", src, "--method", "intensity", "--range", "0:1", "--out", mask))
    assert np.load(mask).shape == (n, 2)
    out = tmp_path / "out.npy"
    ok(cli("perturb", src, "--eps", "0.5", "--range", "0:1", "--weights", mask, "--seed", 2, "--allow-weak-seed",
           "--out", out, "-q", CONSENT, *FLOAT))
    kept = retained(data, np.load(out))
    p = calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=0.5, range_width=1,
                  elements=2).p
    assert kept[1::2].sum() == 0, "records of value 1 (w = 1) kept raw values"
    assert binomial_ok(int(kept[0::2].sum()), n, p)


# --- each method on real data ------------------------------------------------------

def test_intensity_on_digits(cli, digits_file, digits, tmp_path):
    mask = tmp_path / "int.npy"
    result = ok(cli("weight-mask", digits_file, "--method", "intensity", "--gamma", 2, "--out", mask,
                    "--preview", tmp_path / "check.png"))
    assert "depends on the data" in result.stderr
    values = np.load(mask)
    assert values.shape == (50, 28, 28)
    np.testing.assert_allclose(values, (digits[:50] / 256.0) ** 2, rtol=1e-6)
    sidecar = json.loads((tmp_path / "int.npy.json").read_text())
    assert sidecar["method"] == "intensity" and sidecar["data_derived"] is True
    assert sidecar["shape"] == [50, 28, 28]
    # No statistic of the data in the sidecar: only what the user declared.
    assert set(sidecar) == {"schema", "tool", "method", "data_derived", "shape", "per_record",
                            "parameters", "created"}
    assert sidecar["parameters"] == {"feather": 0, "value_range": [0.0, 256.0], "gamma": 2.0}
    with Image.open(tmp_path / "check.png") as im:
        assert (im.format, im.mode, im.size) == ("PNG", "RGB", (28, 28))

    out = tmp_path / "noisy.npy"
    result = ok(cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--out", out))
    assert "computed from the private values" in result.stderr
    w = manifest_of(out)["weights"]
    assert w["method"] == "intensity" and w["data_derived"] is True
    # The mask is a function of the private data: its hash and extremes stay out.
    assert w["sha256"] is None and w["min"] is None and w["max"] is None
    assert w["shape"] == [50, 28, 28]
    assert manifest_of(out)["retain_probability_log10"] == pytest.approx(
        calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=1, range_width=256,
                  elements=784).p_log10)


def test_box_on_digits_from_json_with_feather_and_preview(cli, digits_file, tmp_path):
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps([{"x0": 10, "y0": 5, "x1": 18, "y1": 15, "weight": 0.8},
                                 {"x0": 12.5, "y0": 12, "x1": 14.2, "y1": 20}]))  # weight 1
    mask = tmp_path / "box.npy"
    preview = tmp_path / "check.png"
    ok(cli("weight-mask", digits_file, "--method", "box", "--boxes", boxes, "--feather", 3,
           "--out", mask, "--preview", preview))
    values = np.load(mask)
    assert values.shape == (28, 28)
    assert values[5:15, 10:18].min() == 0.8 and values[12:20, 12:15].min() == 1.0
    assert values[7, 9] == pytest.approx(0.8 * 3 / 4)  # one pixel out: a quarter down
    assert values[7, 6] == 0.0 and values[0, 0] == 0.0  # four pixels out: nothing
    with Image.open(preview) as im:
        assert (im.format, im.size) == ("PNG", (28, 28))
        rgb = np.asarray(im.convert("RGB")).astype(int)
    assert (rgb[:, :, 0] >= rgb[:, :, 1]).all()
    assert (rgb[14, 13, 0] - rgb[14, 13, 1]) > 100, "the weight-1 box is not tinted red"
    assert (rgb[0, 0] == rgb[0, 0, 0]).all(), "the unmasked background is not gray"

    out = tmp_path / "noisy.npy"
    ok(cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--out", out, "-q"))
    w = manifest_of(out)["weights"]
    assert w == {"path": str(mask), "sha256": sha256_file(mask), "shape": [28, 28], "min": 0.0,
                 "max": 1.0, "method": "box", "data_derived": False}


def test_image_method_on_digits(cli, digits_file, tmp_path):
    picture = np.zeros((28, 28), np.uint8)
    picture[:, 14:] = 255
    picture[:, 10:14] = 51  # 0.2
    save_png(tmp_path / "region.png", picture)
    mask = tmp_path / "m.npy"
    ok(cli("weight-mask", digits_file, "--method", "image", "--mask-image", tmp_path / "region.png",
           "--out", mask))
    np.testing.assert_allclose(np.load(mask), picture / 255.0)
    # A larger picture is refused without --resize and resized with it.
    save_png(tmp_path / "big.png", np.kron(picture, np.ones((4, 4), np.uint8)))
    refused = cli("weight-mask", digits_file, "--method", "image", "--mask-image",
                  tmp_path / "big.png", "--out", tmp_path / "r.npy")
    assert_one_line_error(refused, 1, "big.png", "112x112", "28x28", "--resize")
    assert not (tmp_path / "r.npy").exists() and not (tmp_path / "r.npy.json").exists()
    ok(cli("weight-mask", digits_file, "--method", "image", "--mask-image", tmp_path / "big.png",
           "--resize", "--out", tmp_path / "r.npy"))
    resized = np.load(tmp_path / "r.npy")
    assert resized.shape == (28, 28)
    assert resized[:, :9].max() == 0 and resized[:, 15:].min() == pytest.approx(1)


def test_constant_on_a_colour_array_covers_every_channel(cli, tmp_path):
    src = tmp_path / "rgb.npy"
    np.save(src, RNG.integers(0, 256, (5, 6, 7, 3), dtype=np.uint8))
    mask = tmp_path / "w.npy"
    ok(cli("weight-mask", src, "--method", "constant", "--weight", 0.25, "--out", mask))
    assert np.load(mask).shape == (6, 7, 3)
    ok(cli("weight-mask", src, "--method", "box", "--boxes", _csv(tmp_path, "1,1,3,3,1\n"),
           "--out", tmp_path / "b.npy", "--preview", tmp_path / "p.png"))
    assert np.load(tmp_path / "b.npy").shape == (6, 7)  # spatial: broadcast over channels
    assert Image.open(tmp_path / "p.png").size == (7, 6)
    for m in ("w.npy", "b.npy"):
        ok(cli("perturb", src, "--eps", "1", "--weights", tmp_path / m, "--out", tmp_path / f"o{m}", "-q"))


def _csv(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "boxes.csv"
    path.write_text(text)
    return path


def test_folder_of_photos_two_commands(cli, photos, tmp_path):
    """The issue's goal: a mask for a folder of photos, a look at it, the perturbed folder."""
    boxes = _csv(tmp_path, "file,x0,y0,x1,y1,weight\na.png,5,2,15,10,1\nc.jpg,0,0,7,5,0.6\n"
                           ",0,0,2,2,0.5\n")  # the last row (no file) applies to every image
    masks, preview = tmp_path / "masks", tmp_path / "check.png"
    before = tree_digest(photos)
    result = ok(cli("weight-mask", photos, "--method", "box", "--boxes", boxes, "--out", masks,
                    "--preview", preview))
    assert "3 mask PNGs" in result.stderr
    assert sorted(p.relative_to(masks).as_posix() for p in masks.rglob("*.png")) == [
        "a.png", "sub/b.png", "sub/deeper/c.png"]
    a, b, c = png(masks / "a.png"), png(masks / "sub" / "b.png"), png(masks / "sub/deeper/c.png")
    assert a.shape == (20, 30) and b.shape == (16, 12) and c.shape == (10, 14)
    assert Image.open(masks / "a.png").mode == "L"
    assert (a[2:10, 5:15] == 255).all() and a[15, 20] == 0 and a[0, 0] == 128  # 0.5 rounds up
    assert (c[0:5, 0:7] == 153).all() and b[0, 0] == 128 and b[5, 5] == 0
    with Image.open(preview) as im:
        assert (im.format, im.size) == ("PNG", (30, 20))  # the first image, a.png
    assert tree_digest(photos) == before

    out = tmp_path / "private"
    ok(cli("perturb", photos, "--eps", "1", "--weights", masks, "--out", out, "-q"))
    w = manifest_of(out)["weights"]
    assert w["method"] == "box" and w["data_derived"] is False and w["files"] == 3
    assert w["shape"] is None and w["min"] == 0.0 and w["max"] == 1.0 and len(w["sha256"]) == 64
    assert sorted(p.name for p in out.rglob("*.png")) == ["a.png", "b.png", "c.png"]


def test_a_folder_with_an_unreadable_photo_skips_it_as_its_error_says(cli, photos, tmp_path):
    """Regression: weight-mask on a folder with a damaged image said "pass --skip-bad to
    skip it", and then refused --skip-bad (No such option)."""
    (photos / "sub" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n damaged before its header ends")
    masks, before = tmp_path / "masks", tree_digest(photos)
    args = ("weight-mask", photos, "--method", "constant", "--weight", "0.5", "--out", masks)
    assert_one_line_error(cli(*args), 1, f"{photos / 'sub' / 'bad.png'}: cannot be decoded")
    assert "--skip-bad" in cli(*args).stderr and not masks.exists()

    result = ok(cli(*args, "--skip-bad"))
    assert "skipped 1 unreadable image (no mask made): sub/bad.png" in result.stderr
    assert sorted(p.relative_to(masks).as_posix() for p in masks.rglob("*.png")) == [
        "a.png", "sub/b.png", "sub/deeper/c.png"]
    out = tmp_path / "private"
    ok(cli("perturb", photos, "--eps", "1", "--weights", masks, "--skip-bad", "--out", out, "-q"))
    assert manifest_of(out)["weights"]["files"] == 3
    assert tree_digest(photos) == before


def test_intensity_constant_and_image_on_photos(cli, photos, tmp_path):
    ok(cli("weight-mask", photos, "--method", "intensity", "--out", tmp_path / "i"))
    rgb = np.asarray(Image.open(photos / "a.png"))
    # Colour: the brightest channel decides; levels rounded up.
    expected = np.ceil(rgb.max(axis=-1) / 256.0 * 255 - 1e-6)
    np.testing.assert_array_equal(png(tmp_path / "i" / "a.png"), expected)
    assert json.loads((tmp_path / "i.json").read_text())["data_derived"] is True

    ok(cli("weight-mask", photos, "--method", "constant", "--weight", 0.3, "--out", tmp_path / "c"))
    assert (png(tmp_path / "c" / "sub" / "b.png") == 77).all()  # ceil(0.3 * 255)

    save_png(tmp_path / "region.png", np.full((4, 4), 255, np.uint8))
    refused = cli("weight-mask", photos, "--method", "image", "--mask-image", tmp_path / "region.png",
                  "--out", tmp_path / "m")
    assert_one_line_error(refused, 1, "region.png", "--resize")
    assert not (tmp_path / "m").exists()
    ok(cli("weight-mask", photos, "--method", "image", "--mask-image", tmp_path / "region.png",
           "--resize", "--out", tmp_path / "m"))
    assert (png(tmp_path / "m" / "sub" / "deeper" / "c.png") == 255).all()

    out = tmp_path / "o"
    result = ok(cli("perturb", photos, "--eps", "1", "--weights", tmp_path / "i", "--out", out))
    assert "computed from the private values" in result.stderr
    w = manifest_of(out)["weights"]
    assert w["data_derived"] is True and w["sha256"] is None and w["min"] is None


def test_mask_made_elsewhere_has_unknown_method(cli, digits_file, tmp_path):
    mask = tmp_path / "mine.npy"
    np.save(mask, np.full((28, 28), 0.1))
    out = tmp_path / "o.npy"
    ok(cli("perturb", digits_file, "--eps", "1", "--weights", mask, "--out", out, "-q"))
    w = manifest_of(out)["weights"]
    # No sidecar: of unknown origin, so treated as data-derived (tests/run/test_sensitive_outputs.py)
    assert w["method"] is None and w["data_derived"] is True and w["min"] is None
    assert w["origin"] == "unknown (no sidecar): treated as data-derived"


def test_data_derived_can_be_declared_for_boxes(cli, digits_file, tmp_path):
    ok(cli("weight-mask", digits_file, "--method", "box", "--boxes", _csv(tmp_path, "0,0,5,5\n"),
           "--data-derived", "--out", tmp_path / "b.npy"))
    assert json.loads((tmp_path / "b.npy.json").read_text())["data_derived"] is True


def test_feather_never_lowers_a_weight():
    mask = np.zeros((9, 9))
    mask[4, 4] = 1.0
    mask[0, 0] = 0.5
    soft = feather(mask, 2)
    assert soft[4, 4] == 1.0 and soft[0, 0] == 0.5
    assert soft[4, 6] == pytest.approx(1 / 3) and soft[6, 6] == pytest.approx(1 / 3)
    assert soft[4, 7] == 0.0 and (soft >= mask).all()


# --- bad input ---------------------------------------------------------------------

def check_nothing_written(cli, tmp_path, code, *args, fragments=()):
    before = siblings(tmp_path)
    result = cli("weight-mask", *args)
    assert_one_line_error(result, code, *fragments)
    assert siblings(tmp_path) == before, "output left behind"


def test_unknown_method_is_a_usage_error(cli, digits_file, tmp_path):
    check_nothing_written(cli, tmp_path, 2, digits_file, "--method", "blur", "--out", tmp_path / "m.npy")


def test_constant_needs_a_weight(cli, digits_file, tmp_path):
    check_nothing_written(cli, tmp_path, 2, digits_file, "--method", "constant", "--out",
                          tmp_path / "m.npy", fragments=("--weight",))


@pytest.mark.parametrize("args,fragment", [
    (("--method", "box"), "--boxes"),
    (("--method", "image"), "--mask-image"),
    (("--method", "constant", "--weight", "1.5"), "[0, 1]"),
    (("--method", "box", "--gamma", "2", "--boxes", "x.csv"), "--gamma"),
    (("--method", "intensity", "--gamma", "-1"), "--gamma"),
    (("--method", "intensity", "--feather", "-2"), "--feather"),
    (("--method", "intensity", "--range", "3:1"), "--range"),
])
def test_option_misuse_is_a_usage_error(cli, digits_file, tmp_path, args, fragment):
    check_nothing_written(cli, tmp_path, 2, digits_file, *args, "--out", tmp_path / "m.npy",
                          fragments=(fragment,))


@pytest.mark.parametrize("name,text,fragment", [
    ("b.csv", "x0,y0,x1,y1,weight\n1,2,3\n", "line 2"),
    ("b.csv", "x0,y0,x1,y1\n1,2,three,4\n", "x1 must be a number"),
    ("b.csv", "5,5,2,8,1\n", "inverted"),
    ("b.csv", "0,0,4,4,2\n", "weight must lie in [0, 1]"),
    ("b.csv", "x0,y0,x1,y1,colour\n0,0,1,1,red\n", "unknown column"),
    ("b.csv", "# nothing\n", "no boxes"),
    ("b.json", "[{\"x0\": 0, \"y0\": 0, \"x1\": 3}]", "y1 is missing"),
    ("b.json", "[{\"x0\": 0, ", "not valid JSON"),
    ("b.json", "[" * 200_000 + "]" * 200_000, "not valid JSON (it nests lists and objects more than 100"),
    ("b.json", "{\"x0\": 0}", "list of objects"),
    ("b.csv", "100,100,120,120,1\n", "outside"),
    ("b.csv", "file,x0,y0,x1,y1,weight\na.png,0,0,3,3,1\n", "not a folder of images"),
])
def test_malformed_box_file(cli, digits_file, tmp_path, name, text, fragment):
    boxes = tmp_path / name
    boxes.write_text(text)
    check_nothing_written(cli, tmp_path, 1, digits_file, "--method", "box", "--boxes", boxes,
                          "--out", tmp_path / "m.npy", fragments=(name, fragment))


def test_box_for_an_unknown_photo(cli, photos, tmp_path):
    boxes = _csv(tmp_path, "file,x0,y0,x1,y1\nmissing.png,0,0,3,3\n")
    check_nothing_written(cli, tmp_path, 1, photos, "--method", "box", "--boxes", boxes,
                          "--out", tmp_path / "m", fragments=("missing.png", "matches no image"))


def test_colour_mask_image_is_refused(cli, digits_file, tmp_path):
    save_png(tmp_path / "colour.png", RNG.integers(0, 256, (28, 28, 3), dtype=np.uint8))
    check_nothing_written(cli, tmp_path, 1, digits_file, "--method", "image", "--mask-image",
                          tmp_path / "colour.png", "--out", tmp_path / "m.npy",
                          fragments=("colour.png", "grayscale"))


def test_refuses_to_overwrite(cli, digits_file, tmp_path):
    mask = tmp_path / "m.npy"
    args = (digits_file, "--method", "constant", "--weight", 0.5, "--out", mask)
    ok(cli("weight-mask", *args))
    written = tree_digest(mask)
    check_nothing_written(cli, tmp_path, 1, *args[:-3], "0.7", "--out", mask, fragments=("--overwrite",))
    assert tree_digest(mask) == written
    ok(cli("weight-mask", *args[:-3], "0.7", "--out", mask, "--overwrite"))
    assert np.load(mask).max() == 0.7


def test_folder_output_is_not_a_npy_file(cli, photos, tmp_path):
    check_nothing_written(cli, tmp_path, 2, photos, "--method", "constant", "--weight", 1,
                          "--out", tmp_path / "m.npy", fragments=("folder",))


def test_intensity_on_float_data_needs_a_range(cli, tmp_path):
    src = tmp_path / "f.npy"
    np.save(src, np.zeros((3, 4)))
    check_nothing_written(cli, tmp_path, 2, src, "--method", "intensity", "--out", tmp_path / "m.npy",
                          fragments=("--range",))


def test_help_has_examples(cli):
    result = cli("weight-mask", "--help")
    assert result.exit_code == 0 and "Examples:" in result.stdout
    assert "tldp weight-mask" in result.stdout and "--weights" in result.stdout


# --- bad masks given to perturb ----------------------------------------------------

def perturb_fails(cli, tmp_path, src, weights, *fragments):
    before = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1", "--weights", weights, "--out", tmp_path / "out")
    assert_one_line_error(result, 1, *fragments)
    assert siblings(tmp_path) == before, "output left behind"


def test_mask_folder_missing_a_file(cli, photos, tmp_path):
    masks = tmp_path / "masks"
    ok(cli("weight-mask", photos, "--method", "constant", "--weight", 0.5, "--out", masks))
    (masks / "sub" / "b.png").unlink()
    perturb_fails(cli, tmp_path, photos, masks, "masks", "sub/b.png")


def test_mask_png_of_the_wrong_size_or_mode(cli, photos, tmp_path):
    masks = tmp_path / "masks"
    ok(cli("weight-mask", photos, "--method", "constant", "--weight", 0.5, "--out", masks))
    save_png(masks / "a.png", np.zeros((5, 5), np.uint8))
    perturb_fails(cli, tmp_path, photos, masks, "a.png", "5x5")
    save_png(masks / "a.png", np.zeros((20, 30, 3), np.uint8))
    perturb_fails(cli, tmp_path, photos, masks, "a.png", "mode RGB")


def test_mask_folder_for_an_array(cli, digits_file, photos, tmp_path):
    masks = tmp_path / "masks"
    ok(cli("weight-mask", photos, "--method", "constant", "--weight", 0.5, "--out", masks))
    perturb_fails(cli, tmp_path, digits_file, masks, "folder of images")


def test_stale_sidecar_is_refused(cli, digits_file, tmp_path):
    mask = tmp_path / "m.npy"
    ok(cli("weight-mask", digits_file, "--method", "constant", "--weight", 0.5, "--out", mask))
    np.save(mask, np.zeros((50, 28, 28)))  # replaced behind the sidecar's back
    perturb_fails(cli, tmp_path, digits_file, mask, "m.npy.json", "make the mask again")


@pytest.mark.parametrize("bad,fragment", [(np.nan, "NaN"), (1.5, "[0, 1]"), (-0.1, "[0, 1]")])
def test_bad_per_record_mask_values(cli, digits_file, tmp_path, bad, fragment):
    mask = np.zeros((50, 28, 28))
    mask[49, 3, 3] = bad
    np.save(tmp_path / "m.npy", mask)
    perturb_fails(cli, tmp_path, digits_file, tmp_path / "m.npy", "m.npy", fragment)


def test_box_on_a_folder_of_mixed_bit_depths_needs_no_range(cli, tmp_path):
    src = tmp_path / "scans"
    save_png(src / "deep.png", RNG.integers(0, 65536, (6, 6), dtype=np.uint16))
    save_png(src / "shallow.png", RNG.integers(0, 256, (6, 6), dtype=np.uint8))
    ok(cli("weight-mask", src, "--method", "box", "--boxes", _csv(tmp_path, "0,0,3,3,1\n"),
           "--out", tmp_path / "m", "--preview", tmp_path / "p.png"))
    assert png(tmp_path / "m" / "deep.png")[:3, :3].min() == 255


# --- faces (OpenCV's bundled Haar cascade) -----------------------------------------

def sample_photos(root: Path) -> Path:
    """scikit-learn's two bundled photographs (no faces) and matplotlib's Grace Hopper."""
    datasets = pytest.importorskip("sklearn.datasets")
    cbook = pytest.importorskip("matplotlib.cbook")
    root.mkdir()
    bunch = datasets.load_sample_images()
    for name, image in zip(bunch.filenames, bunch.images):
        Image.fromarray(image).save(root / Path(name).name)
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        (root / "grace_hopper.jpg").write_bytes(f.read())
    return root


def test_faces_on_sample_photographs(cli, tmp_path):
    pytest.importorskip("cv2")
    photos = sample_photos(tmp_path / "photos")
    masks, preview = tmp_path / "masks", tmp_path / "check.png"
    result = ok(cli("weight-mask", photos, "--method", "faces", "--margin", 0.1, "--out", masks,
                    "--preview", preview))
    assert "found 1 face(s) in 1 of 3 image(s)" in result.stderr
    assert "depends on the data" in result.stderr
    assert png(masks / "china.png").max() == 0 and png(masks / "flower.png").max() == 0
    face = png(masks / "grace_hopper.png")
    assert face.shape == (600, 512)
    assert face[220, 260] == 255  # between the eyes
    assert face[20, 20] == 0 and face[580, 260] == 0  # the flag, the uniform
    assert 0.05 < (face > 0).mean() < 0.5
    with Image.open(preview) as im:
        assert im.format == "PNG" and im.size == (640, 427)  # china.jpg comes first
    sidecar = json.loads((tmp_path / "masks.json").read_text())
    assert sidecar["method"] == "faces" and sidecar["data_derived"] is True

    out = tmp_path / "private"
    ok(cli("perturb", photos, "--eps", "1", "--weights", masks, "--out", out, "-q"))
    assert manifest_of(out)["weights"]["method"] == "faces"
    assert manifest_of(out)["weights"]["data_derived"] is True


def test_faces_on_an_array_are_per_record(cli, tmp_path):
    pytest.importorskip("cv2")
    cbook = pytest.importorskip("matplotlib.cbook")
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        face = np.asarray(Image.open(f).convert("RGB"))
    src = tmp_path / "people.npy"
    np.save(src, np.stack([face, np.zeros_like(face)]))
    mask = tmp_path / "faces.npy"
    ok(cli("weight-mask", src, "--method", "faces", "--weight", 0.9, "--out", mask))
    values = np.load(mask)
    assert values.shape == (2, 600, 512)
    assert values[0, 220, 260] == pytest.approx(0.9) and values[1].max() == 0
    ok(cli("perturb", src, "--eps", "1", "--weights", mask, "--out", tmp_path / "o.npy", "-q"))


def test_faces_without_opencv(cli, digits_file, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 now raises ImportError
    check_nothing_written(cli, tmp_path, 1, digits_file, "--method", "faces", "--out",
                          tmp_path / "m.npy", fragments=("OpenCV", "tldp-tensors[faces]"))


@pytest.mark.parametrize("case", ["box file as mask", "box file as sidecar", "mask image as preview"])
def test_the_mask_never_replaces_a_file_it_reads(cli, tmp_path, case):
    """--out or --preview naming the --boxes file or the --mask-image, --overwrite given,
    replaced it with the mask (a .npy under the box file's name) or the preview."""
    src = tmp_path / "d.npy"
    np.save(src, np.zeros((4, 8, 8), np.uint8))
    boxes = tmp_path / ("m.npy.json" if case == "box file as sidecar" else "boxes.csv")
    boxes.write_text("x0,y0,x1,y1,weight\n1,1,4,4,1\n")
    region = save_png(tmp_path / "region.png", np.full((8, 8), 200, np.uint8))
    args = {"box file as mask": ["--method", "box", "--boxes", boxes, "--out", boxes],
            "box file as sidecar": ["--method", "box", "--boxes", boxes, "--out", tmp_path / "m.npy"],
            "mask image as preview": ["--method", "image", "--mask-image", region, "--out", tmp_path / "m.npy",
                                      "--preview", region]}[case]
    before = tree_digest(tmp_path)
    result = cli("weight-mask", src, *args, "--overwrite")
    assert_one_line_error(result, 2, "name the same file")
    assert tree_digest(tmp_path) == before
