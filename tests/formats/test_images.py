"""Folders of images: the shared round trip, plus what only image folders have
(modes, alpha, 16-bit, float TIFF output, non-image and unreadable files)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image, UnidentifiedImageError

from tests.builders import SEED, RoundTrip, assert_one_line_error, siblings, tree_digest
from tldp_cli import formats
from tldp_cli.errors import InputError
from tldp_cli.formats import images, images_index, images_reader
from tldp_cli.formats.pixels import PNG_ENCODING, png

RNG = np.random.default_rng(0)


def pixels(h, w, channels=None, dtype=np.uint8):
    shape = (h, w) if channels is None else (h, w, channels)
    return RNG.integers(0, np.iinfo(dtype).max + 1, shape, dtype=dtype)


def save(path: Path, array: np.ndarray, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kwargs)
    return path


def image_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
            if p.suffix.lower() in images_reader.IMAGE_SUFFIXES}


def colour_channels(path: Path) -> np.ndarray:
    if path.suffix == ".tiff":
        array = tifffile.imread(path)
        return array[..., :-1].squeeze(-1) if array.ndim == 3 and array.shape[-1] in (2, 4) else array
    with Image.open(path) as im:
        array = np.asarray(im)
        if im.mode == "LA":
            return array[..., 0]
        return array[..., :3] if im.mode == "RGBA" else array


def alpha_channel(path: Path) -> np.ndarray:
    return tifffile.imread(path)[..., -1] if path.suffix == ".tiff" else np.asarray(Image.open(path))[..., -1]


def manifest_of(out: Path) -> dict:
    return json.loads(Path(str(out) + ".manifest.json").read_text())


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


class ImagesRoundTrip(RoundTrip):
    format = "images"

    def make_input(self, tmp_path):
        root = tmp_path / "photos"
        save(root / "rgb.png", pixels(12, 10, 3))
        save(root / "sub" / "gray.png", pixels(8, 9))
        save(root / "sub" / "deeper" / "rgba.png", pixels(7, 6, 4))
        save(root / "sub" / "deeper" / "la.png", pixels(5, 5, 2))
        save(root / "sub" / "cam.jpg", pixels(16, 16, 3), quality=90)
        save(root / "other" / "pic.bmp", pixels(6, 11, 3))
        save(root / "other" / "web.webp", pixels(9, 7, 3), lossless=True)
        save(root / "other" / "scan.tif", pixels(4, 13))
        return root

    def read_arrays(self, path):
        return {str(Path(rel).with_suffix("")): colour_channels(file)
                for rel, file in image_files(path).items()}

    def assert_same_structure(self, original, perturbed):
        sources = image_files(original)
        outputs = image_files(perturbed)
        assert set(outputs) == {str(Path(rel).with_suffix(".png")) for rel in sources}
        for rel, source in sources.items():
            output = outputs[str(Path(rel).with_suffix(".png"))]
            with Image.open(source) as a, Image.open(output) as b:
                # the alpha channel is left out (--keep alpha copies it: test_alpha_channels_are_left_out...)
                opaque = {"RGBA": "RGB", "LA": "L"}.get(a.mode, a.mode)
                assert b.format == "PNG" and (b.size, b.mode) == (a.size, opaque), rel


def test_manifest_uses_largest_image(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "small.png", pixels(4, 5))  # 20 elements
    save(src / "big" / "colour.png", pixels(6, 7, 3))  # 126 elements
    save(src / "mid.png", pixels(5, 6, 4))  # 90 elements: the alpha channel is not a record's element
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["records"] == 3
    assert manifest["elements_per_record"] == 126
    assert manifest["elements_per_record_range"] == [20, 126]
    assert manifest["value_range"] == [0, 256]
    assert [Path(i["path"]).relative_to(src).as_posix() for i in manifest["inputs"]] == \
        ["big/colour.png", "mid.png", "small.png"]
    assert manifest["inputs"][0] == {"path": str(src / "big" / "colour.png"), "format": "images",
                                     "shape": [1, 6, 7, 3], "dtype": "uint8"}
    # the default exact sampler: integer noise in int16 (saturating, never wrapping), then the PNG steps
    assert manifest["noise"] == "discrete-laplace"
    assert manifest["postprocessing"][0].startswith("saturate at the int16 limits")
    assert manifest["postprocessing"][1:3] == [  # integers: no rounding
        "clip to [0, 255]", f"write 8-bit PNG {PNG_ENCODING}"]
    assert any("alpha" in step for step in manifest["postprocessing"])
    assert sorted(Path(o["path"]).relative_to(out).as_posix() for o in manifest["outputs"]) == \
        ["big/colour.png", "mid.png", "small.png"]


def test_default_output_is_a_sibling_folder(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.png", pixels(4, 4))
    assert images.default_output(src) == tmp_path / "photos.tldp"
    result = cli("perturb", src, "--eps", "1")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "photos.tldp" / "a.png").is_file()
    assert (tmp_path / "photos.tldp.manifest.json").is_file()


def test_can_open_folders_but_not_zarr_stores(tmp_path):
    assert images.can_open(tmp_path)
    (tmp_path / "zarr.json").write_text("{}")
    assert not images.can_open(tmp_path)
    assert not images.can_open(tmp_path / "zarr.json")


def class_folders(root: Path, classes: int = 10) -> Path:
    """The MNIST-as-PNG layout: train/0 ... train/9, one folder of images per class."""
    for label in range(classes):
        save(root / str(label) / f"{label}.png", pixels(6, 5))
    return root


def test_folders_named_by_numbers_are_images_for_every_command(cli, tmp_path):
    train = class_folders(tmp_path / "train")
    assert formats.detect(train) is images.FORMAT
    files = tree_digest(train)
    result = cli("perturb", train, "--eps", "1")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "train.tldp" / "9" / "9.png").is_file()
    result = cli("weight-mask", train, "--method", "constant", "--weight", "0.5", "--out", tmp_path / "masks")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "masks" / "3" / "3.png").is_file()
    result = cli("evaluate", train, tmp_path / "train.tldp")
    assert result.exit_code == 0, result.stderr
    assert tree_digest(train) == files


def test_zarr_chunks_without_metadata_are_named_as_a_damaged_store(cli, tmp_path):
    store = tmp_path / "lost.zarr"
    for chunk in ("0.0", "1.0", "2.0"):
        store.mkdir(exist_ok=True)
        (store / chunk).write_bytes(b"\0" * 16)
    assert_one_line_error(cli("perturb", store, "--eps", "1"), 1, str(store), "damaged Zarr store")


def test_format_overrides_detection(cli, tmp_path):
    train = class_folders(tmp_path / "train", classes=2)
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", train, "--eps", "1", "--format", "zarr"), 1,
                          str(train), "damaged Zarr store")
    assert_one_line_error(cli("perturb", train / "0" / "0.png", "--eps", "1", "--format", "images"),
                          2, "0.png", "is a file", "--format images")
    assert_one_line_error(cli("plan", train, "--eps", "1", "--format", "zarr"), 1, "damaged Zarr store")
    assert cli("plan", train, "--eps", "1", "--format", "images").exit_code == 0
    assert siblings(tmp_path) == before
    result = cli("perturb", train, "--eps", "1", "--format", "images")
    assert result.exit_code == 0, result.stderr
    assert manifest_of(tmp_path / "train.tldp")["inputs"][0]["format"] == "images"
    assert_one_line_error(cli("evaluate", train, tmp_path / "train.tldp", "--format", "zarr"), 1,
                          str(train), "damaged Zarr store")
    result = cli("evaluate", train, tmp_path / "train.tldp", "--format", "images")
    assert result.exit_code == 0, result.stderr


def test_16bit_grayscale_comes_out_16bit(cli, tmp_path):
    src = tmp_path / "scans"
    original = pixels(10, 12, dtype=np.uint16)
    save(src / "deep.png", original)
    out = tmp_path / "out"
    assert cli("perturb", src, "--eps", "100000", "--seed", "1", "--allow-weak-seed", "--out", out).exit_code == 0
    with Image.open(out / "deep.png") as im:
        assert im.mode == "I;16"
        result = np.asarray(im)
    # Discrete Laplace noise of scale 65536/1e5 = 0.66 moves the values by a few units at most.
    assert np.abs(result.astype(np.int64) - original).max() <= 10
    manifest = manifest_of(out)
    assert manifest["value_range"] == [0, 65536]
    # integer noise in int32 (the default exact sampler), saturating, then the PNG steps
    assert manifest["postprocessing"][0].startswith("saturate at the int32 limits")
    assert manifest["postprocessing"][1:3] == ["clip to [0, 65535]", f"write 16-bit PNG {PNG_ENCODING}"]


def test_each_bit_depth_is_perturbed_at_its_own_range(cli, tmp_path):
    """8- and 16-bit images in one folder, without --range: each at its dtype's range (noise
    of scale 256 on the 8-bit image, 65536 on the 16-bit one), each range a calibration of its
    own, whose figures the manifest states (those of the 8-bit image perturbed alone)."""
    src = tmp_path / "mixed"
    save(src / "deep.png", np.full((64, 64), 30000, np.uint16))
    save(src / "shallow.png", np.full((64, 64), 128, np.uint8))
    out = tmp_path / "a"
    # TIFF: the noisy integers unclipped, to measure the noise's scale
    result = cli("perturb", src, "--eps", "1", "--out", out, "--image-format", "tiff", "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    for name, value, scale in (("shallow", 128, 256), ("deep", 30000, 65536)):
        noise = tifffile.imread(out / f"{name}.tiff").astype(np.int64) - value
        # median |Laplace| = b ln 2: 177 for b = 256, 45426 for b = 65536 (4096 values: within 10%)
        assert abs(np.median(np.abs(noise)) / (scale * np.log(2)) - 1) < 0.1, name
    manifest = manifest_of(out)
    assert manifest["value_ranges"] == {"deep.png": [0, 65536], "shallow.png": [0, 256]}
    groups = {tuple(g["value_range"]): g for g in manifest["range_groups"]}
    assert sorted(groups) == [(0, 256), (0, 65536)]
    assert groups[0, 256]["input_dtypes"] == ["uint8"] and groups[0, 256]["records"] == 1
    assert groups[0, 65536]["declared_by"] == ["the uint16 dtype's range (default)"]
    assert [groups[0, 256]["noise_scale"], groups[0, 65536]["noise_scale"]] == [256, 65536]
    alone = tmp_path / "alone"
    save(alone / "shallow.png", np.full((64, 64), 128, np.uint8))
    assert cli("perturb", alone, "--eps", "1", "--out", tmp_path / "b").exit_code == 0
    single = manifest_of(tmp_path / "b")["accounting"]
    assert groups[0, 256]["accounting"] == {scope: single[scope] for scope in ("per_element", "per_record")}
    # the run's figures: the worst over the groups, which the summary line says
    worst = max(g["accounting"]["per_record"]["epsilon"] for g in groups.values())
    assert manifest["accounting"]["per_record"]["epsilon"] == worst
    assert "the worst of 2 calibrations, over record sizes and 2 ranges" in result.stderr
    assert "calibrated each declared range on its own: 0:256 for uint8" in result.stderr
    planned = cli("plan", src, "--eps", "1", "--json")  # from the headers, the same groups
    assert planned.exit_code == 0 and json.loads(planned.stdout)["range_groups"] == manifest["range_groups"]


def test_anonymized_mixed_bit_depths_name_no_input_file(cli, tmp_path):
    """Regression: with --anonymize-names, a folder of 8- and 16-bit images (each depth its
    own range) wrote the input's file names as the keys of the manifest's value_ranges and
    granularities, which --anonymize-names withholds; evaluate maps them back via the name map."""
    src = tmp_path / "mixed"
    names = ("alice_smith.png", "bob_jones.png", "carol_white.png")
    save(src / names[0], pixels(8, 8, dtype=np.uint16))
    save(src / names[1], pixels(8, 8))
    save(src / names[2], pixels(8, 8, dtype=np.uint16))
    out, name_map = tmp_path / "out", tmp_path / "names.json"
    result = cli("perturb", src, "--eps", "1", "--out", out, "--anonymize-names", "--name-map", name_map)
    assert result.exit_code == 0, result.stderr
    text = (tmp_path / "out.manifest.json").read_text()
    assert not any(word in text for word in ("alice", "bob", "carol")), text
    manifest = json.loads(text)
    assert sorted(manifest["value_ranges"]) == sorted(p.name for p in out.iterdir())
    assert list(manifest["value_ranges"]) == sorted(manifest["value_ranges"])  # order tells nothing
    evaluated = cli("evaluate", src, out, "--name-map", name_map)
    assert evaluated.exit_code == 0, evaluated.stderr


def test_one_range_for_mixed_bit_depths_still_clips_each_to_its_own(cli, tmp_path):
    src = tmp_path / "mixed"
    save(src / "deep.png", pixels(4, 4, dtype=np.uint16))
    save(src / "shallow.png", pixels(4, 4))
    result = cli("perturb", src, "--eps", "1", "--range", "0:65536", "--out", tmp_path / "b", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert "range_groups" not in manifest and manifest["value_range"] == [0, 65536]
    # [0] saturate at the int32 limits, [1] round (the default exact sampler's integer noise)
    assert manifest["postprocessing"][1:3] == [
        "clip to [0, 255] (8-bit images), [0, 65535] (16-bit images)", f"write 8-bit and 16-bit PNG {PNG_ENCODING}"]
    assert Image.open(tmp_path / "b" / "shallow.png").mode == "L"
    assert Image.open(tmp_path / "b" / "deep.png").mode == "I;16"


def test_large_eps_gives_back_the_input(cli, tmp_path):
    src = tmp_path / "photos"
    original = pixels(20, 20, 3)
    save(src / "a.png", original)
    out = tmp_path / "out"
    assert cli("perturb", src, "--eps", "10000", "--out", out).exit_code == 0
    # Laplace noise of scale 256/10000 rounds away.
    np.testing.assert_array_equal(np.asarray(Image.open(out / "a.png")), original)


def test_png_output_is_clipped_not_wrapped(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.png", np.full((30, 30), 128, np.uint8))
    out = tmp_path / "out"
    assert cli("perturb", src, "--eps", "1", "--seed", "3", "--allow-weak-seed", "--out", out).exit_code == 0
    result = np.asarray(Image.open(out / "a.png"))
    # Laplace noise of scale 256 saturates about 60% of the values at 0 or 255;
    # wrapping modulo 256 would put only about 1% there.
    saturated = np.mean((result == 0) | (result == 255))
    assert 0.4 < saturated < 0.8


def test_tiff_output_is_float_and_unclipped(cli, tmp_path):
    src = tmp_path / "photos"
    colour = pixels(16, 16, 4)
    save(src / "a.jpg", pixels(16, 16, 3))
    save(src / "b.png", colour)
    out = tmp_path / "out"
    # float output needs the float sampler (the default exact one keeps 8-bit images integer)
    result = cli("perturb", src, "--eps", "0.5", "--image-format", "tiff", "--sampler", "float",
                 "--out", out, "--json", "--keep", "alpha")
    assert result.exit_code == 0, result.stderr
    assert sorted(image_files(out)) == ["a.tiff", "b.tiff"]
    perturbed = tifffile.imread(out / "b.tiff")
    assert perturbed.dtype == np.float32 and perturbed.shape == (16, 16, 4)
    np.testing.assert_array_equal(perturbed[..., 3], colour[..., 3].astype(np.float32))
    difference = perturbed[..., :3] - colour[..., :3]
    assert np.any(difference != np.round(difference)), "values were rounded"
    assert perturbed[..., :3].min() < 0 and perturbed[..., :3].max() > 255, "values were clipped"
    assert json.loads(result.stdout)["postprocessing"][0] == "write float32 TIFF (unclipped)"


def label_map(path: Path, classes: np.ndarray) -> Path:
    """A palette PNG of class indices, as segmentation datasets (Pascal VOC) store their masks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mask = Image.fromarray(classes.astype(np.uint8), mode="P")
    mask.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0, 128, 128, 0] + [0] * 756)
    mask.save(path)
    return path


def test_palette_images_are_label_maps_left_out_or_kept_raw(cli, tmp_path):
    """A palette PNG is a label map (class indices), not an image to perturb: not turned into
    RGB and perturbed, but left out and listed (dropped), or copied raw where --keep names it."""
    src = tmp_path / "voc"
    save(src / "JPEGImages" / "a.jpg", pixels(16, 16, 3), quality=90)
    classes = np.arange(256).reshape(16, 16) % 4
    label_map(src / "SegmentationClass" / "a.png", classes)
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert sorted(image_files(out)) == ["JPEGImages/a.png"]
    manifest = json.loads(result.stdout)
    assert manifest["dropped"] == [{"name": "SegmentationClass/a.png", "kind": "label map",
                                    "reason": images_reader.LABEL_MAP_REASON}]
    assert [i["path"] for i in manifest["inputs"]] == [str(src / "JPEGImages" / "a.jpg")]
    assert "left out 1 palette image (label maps" in result.stderr and "dropped 1 label map" in result.stderr

    kept = tmp_path / "kept"
    result = cli("perturb", src, "--eps", "1", "--out", kept, "--keep", "SegmentationClass/*", "--json")
    assert result.exit_code == 0, result.stderr
    copy = kept / "SegmentationClass" / "a.png"
    assert copy.read_bytes() == (src / "SegmentationClass" / "a.png").read_bytes()
    with Image.open(copy) as im:  # the indices and the palette, as they were
        assert im.mode == "P" and np.array_equal(np.asarray(im), classes)
    assert json.loads(result.stdout)["unperturbed"] == [
        {"name": "SegmentationClass/a.png", "kind": "label map", "reason": "kept by --keep"}]
    assert "copied unchanged: SegmentationClass/a.png (kept by --keep)" in result.stderr
    # --keep naming nothing is a typo; --keep with --anonymize-names would name the file
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--out", tmp_path / "x", "--keep", "nope/*"),
                          2, "--keep nope/*")
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--out", tmp_path / "y", "--keep", "*",
                              "--anonymize-names"), 2, "--anonymize-names")


def test_a_folder_of_label_maps_only_says_so(cli, tmp_path):
    label_map(tmp_path / "masks" / "a.png", np.zeros((4, 4)))
    result = cli("perturb", tmp_path / "masks", "--eps", "1")
    assert_one_line_error(result, 1, "1 palette image (label maps, which tldp does not perturb)")


@pytest.mark.parametrize("name, mode, hint", [
    ("print.jpg", "CMYK", "convert it to RGB first (Pillow: Image.open('print.jpg').convert('RGB').save('print.png'); "
                          "ImageMagick: magick print.jpg -colorspace sRGB print.png)"),
    ("depth map.tif", "F", "its samples are floating-point; perturb its values as an array (numpy.save('depth map.npy', "
                           "tifffile.imread('depth map.tif')), then tldp perturb 'depth map.npy' --range LO:HI) or "
                           "convert it to 16-bit grayscale first (ImageMagick: magick 'depth map.tif' -depth 16 "
                           "'depth map.png')")])
def test_other_modes_are_refused_with_a_conversion_hint(cli, tmp_path, name, mode, hint):
    """Regression: a CMYK JPEG or a float TIFF was refused without saying how to convert it."""
    src = tmp_path / "photos"
    save(src / "a.png", pixels(6, 6, 3))
    (src / "sub").mkdir()
    if mode == "F":
        tifffile.imwrite(src / "sub" / name, RNG.random((5, 5), dtype=np.float32))
    else:
        Image.fromarray(pixels(5, 5, 3)).convert(mode).save(src / "sub" / name)
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out2")
    assert result.exit_code == 1
    line = one_line(result)
    assert line.startswith(f"tldp: error: {src / 'sub' / name}: colour mode {mode} is not supported")
    assert hint in line


@pytest.mark.parametrize("image_format", ["png", "tiff"])
def test_a_multi_page_tiff_is_one_record_written_multi_page(cli, tmp_path, image_format):
    """A z-stack (tifffile's multi-page TIFF) is one record of all its pages (one subject's),
    and comes out a multi-page TIFF that tifffile and Pillow read page by page."""
    src = tmp_path / "stacks"
    src.mkdir()
    stack = RNG.integers(0, 256, (5, 16, 12), dtype=np.uint8)
    deep = RNG.integers(0, 65536, (4, 8, 8)).astype(np.uint16)
    colour = RNG.integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    tifffile.imwrite(src / "z.tif", stack, photometric="minisblack")
    tifffile.imwrite(src / "deep.tiff", deep, photometric="minisblack")
    tifffile.imwrite(src / "rgb.tif", colour, photometric="rgb")
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "8", "--budget", "record", "--out", out, "--json",
                 "--image-format", image_format, "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    shapes = {Path(i["path"]).name: i["shape"] for i in manifest["inputs"]}
    assert shapes == {"z.tif": [1, 5, 16, 12], "deep.tiff": [1, 4, 8, 8], "rgb.tif": [1, 3, 8, 8, 3]}
    assert manifest["records"] == 3  # one per file, not per page
    assert manifest["accounting"]["per_record"]["epsilon"] <= 8  # the whole stack gets --eps
    for name, raw in (("z.tif", stack), ("deep.tiff", deep), ("rgb.tif", colour)):
        written = tifffile.imread(out / name)
        assert written.shape == raw.shape and not np.array_equal(written, raw)
        if image_format == "tiff" and raw.ndim == 4:
            continue  # 16/32-bit colour, which Pillow cannot open (perturb warns)
        with Image.open(out / name) as im:
            assert im.n_frames == raw.shape[0]
            if image_format == "png":  # clipped to the input's bit depth, as PNG is
                assert written.dtype == raw.dtype
                pages = []
                for page in range(im.n_frames):
                    im.seek(page)
                    pages.append(np.asarray(im))
                np.testing.assert_array_equal(np.stack(pages), written)


def test_a_multi_page_tiff_of_unlike_pages_is_refused(cli, tmp_path):
    src = tmp_path / "stacks"
    src.mkdir()
    with tifffile.TiffWriter(src / "pyramid.tif") as tif:  # a page and its half-size thumbnail
        tif.write(pixels(16, 16), photometric="minisblack")
        tif.write(pixels(8, 8), photometric="minisblack")
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_error(result, 1, "pyramid.tif", "pages differ", "page 1")


def test_16bit_colour_is_refused_not_truncated(cli, tmp_path):
    src = tmp_path / "photos"
    src.mkdir()
    tifffile.imwrite(src / "deep.tif", pixels(4, 4, 3, dtype=np.uint16), photometric="rgb")
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert "deep.tif" in one_line(result) and "16-bit" in result.stderr


def test_16bit_grayscale_with_alpha_is_named_so_not_rgba(cli, tmp_path):
    """Regression: a 16-bit grayscale+alpha PNG (colour type 4, as libpng writes it for GIMP or
    ImageMagick; made here with tldp's PNG encoder, which libpng reads) was refused as having
    "16-bit RGBA samples", how Pillow opens it."""
    src = tmp_path / "photos"
    src.mkdir()
    (src / "cutout.png").write_bytes(png(pixels(4, 5, 2, dtype=np.uint16), None))
    assert (src / "cutout.png").read_bytes()[24:26] == bytes([16, 4])
    with Image.open(src / "cutout.png") as im:
        assert im.mode == "RGBA"  # what Pillow says
    line = one_line(cli("perturb", src, "--eps", "1", "--out", tmp_path / "out"))
    assert f"{src / 'cutout.png'}: has 16-bit grayscale with alpha samples, which Pillow reads as 8-bit RGBA" in line
    assert "RGBA samples" not in line and "-alpha off" in line


def test_name_collision_names_both(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.jpg", pixels(4, 4, 3))
    save(src / "a.png", pixels(4, 4, 3))
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out")
    assert result.exit_code == 1
    line = one_line(result)
    assert "a.jpg" in line and "a.png" in line


def test_non_images_are_skipped_or_copied(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.png", pixels(4, 4))
    (src / "notes.txt").write_text("private notes")
    (src / "sub").mkdir()
    (src / "sub" / "data.csv").write_text("1,2\n")

    out = tmp_path / "skipped"
    result = cli("perturb", src, "--eps", "1", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert "skipped 2 files that are not images: notes.txt, sub/data.csv" in result.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == ["a.png"]
    assert manifest_of(out)["not_images"] == ["notes.txt", "sub/data.csv"]
    assert manifest_of(out)["not_images_action"] == "skipped"

    out = tmp_path / "copied"
    result = cli("perturb", src, "--eps", "1", "--out", out, "--copy-other")
    assert result.exit_code == 0, result.stderr
    assert "copied unchanged: notes.txt, sub/data.csv (--copy-other: not an image)" in result.stderr
    assert (out / "notes.txt").read_text() == "private notes"
    assert (out / "sub" / "data.csv").read_text() == "1,2\n"
    manifest = manifest_of(out)
    assert manifest["not_images_action"] == "copied unchanged"
    assert {str(out / "notes.txt"), str(out / "sub" / "data.csv")} <= {o["path"] for o in manifest["outputs"]}


def test_copy_other_never_copies_photos_in_formats_tldp_does_not_read_nor_thumbnails(cli, tmp_path):
    """Regression: --copy-other copied a GIF, PPM or HEIC photo, or Windows' thumbnail cache
    of the folder (Thumbs.db), raw beside the perturbed ones, listed as "not an image": the
    folder's data, released unperturbed."""
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 8, 3))
    photo = Image.fromarray(pixels(8, 8, 3))
    photo.save(src / "b.gif")
    (src / "sub").mkdir()
    photo.save(src / "sub" / "c.PPM")
    (src / "phone.heic").write_bytes(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(64))
    (src / "notes.txt").write_text("P1 is the first photo")  # a PPM-like start, but text
    (src / "sub" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(56))  # Explorer's cache
    (src / "metadata.csv").write_text("file_name,caption\na.png,hi\nb.gif,there\n")
    before = tree_digest(src)
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--out", out, "--copy-other")
    assert result.exit_code == 0, result.stderr
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == ["a.png", "metadata.csv", "notes.txt"]
    reasons = {d["name"]: d["reason"] for d in manifest_of(out)["dropped"]}
    assert set(reasons) == {"b.gif", "sub/c.PPM", "phone.heic", "sub/Thumbs.db", "metadata.csv row 2"}
    assert reasons.pop("metadata.csv row 2").startswith("names b.gif, an image in a format tldp does not read")
    assert reasons.pop("sub/Thumbs.db").startswith("a thumbnail cache")
    assert all(r.startswith("an image in a format tldp does not read") for r in reasons.values())
    assert "GIF" in reasons["b.gif"] and "HEIF" in reasons["phone.heic"]
    # imagefolder finds a row for every image and an image for every row
    assert (out / "metadata.csv").read_text().splitlines() == ["file_name,caption", "a.png,hi"]
    line = next(line for line in result.stderr.splitlines() if "did not copy" in line)
    assert "4 files holding data (a thumbnail cache (Windows' Thumbs.db); an image in a format tldp does not read)" \
        in line
    assert tree_digest(src) == before


def test_photos_in_formats_tldp_does_not_read_are_not_called_files_that_are_not_images(cli, tmp_path):
    """Regression: without --copy-other, a GIF or HEIC photo was skipped as "a file that is not
    an image"; it is named as an image tldp does not read, with the advice to convert it, in
    perturb's and plan's line, in the manifest's dropped and when the folder holds no other image."""
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 8, 3))
    Image.fromarray(pixels(8, 8, 3)).save(src / "b.gif")
    (src / "phone.heic").write_bytes(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(64))
    (src / "notes.txt").write_text("shot in May")
    out = tmp_path / "out"
    for command in (("perturb", src, "--eps", "1", "--out", out), ("plan", src, "--eps", "1")):
        result = cli(*command)
        assert result.exit_code == 0, result.stderr
        assert "skipped 2 images in formats tldp does not read (GIF, HEIF/AVIF; convert them to PNG to perturb " \
               "them): b.gif, phone.heic" in result.stderr
        assert "skipped 1 file that is not an image: notes.txt" in result.stderr
    reasons = {d["name"]: d["reason"] for d in manifest_of(out)["dropped"]}
    assert set(reasons) == {"b.gif", "phone.heic"} and "convert it to PNG" in reasons["b.gif"]

    gifs = tmp_path / "gifs"
    gifs.mkdir()
    Image.fromarray(pixels(8, 8, 3)).save(gifs / "b.gif")
    assert_one_line_error(cli("perturb", gifs, "--eps", "1"), 1, "found 1 image in a format tldp does not read "
                                                                 "(GIF; convert it to PNG to perturb it)")


def test_a_stray_file_in_an_earlier_output_is_named(cli, tmp_path):
    """Regression: --overwrite refused an earlier output holding a file no run writes (a
    .DS_Store Finder left there, notes added) as "not an earlier output", naming neither."""
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 8, 3))
    out = tmp_path / "out"
    assert cli("perturb", src, "--eps", "1", "--out", out).exit_code == 0
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("release notes")
    (out / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    before = tree_digest(out)
    result = cli("perturb", src, "--eps", "1", "--out", out, "--overwrite")
    assert_one_line_error(result, 2, f"{out}: exists and is not an earlier output of this kind (it holds "
                                     ".DS_Store, sub/notes.txt, which a run on this input does not write)",
                          "remove it yourself")
    assert tree_digest(out) == before
    (out / "sub" / "notes.txt").unlink()
    (out / ".DS_Store").unlink()
    assert cli("perturb", src, "--eps", "1", "--out", out, "--overwrite").exit_code == 0


def hidden_clutter(src: Path) -> None:
    """What tools leave in a photo folder, none of it the user's data: Jupyter's checkpoints (a
    copy of an image), a macOS archive's AppleDouble resource fork, Finder's .DS_Store (file
    names), Picasa's .picasa.ini (face tags: people's names), a clone's .git."""
    save(src / ".ipynb_checkpoints" / "a-checkpoint.png", pixels(8, 8, 3))
    (src / "__MACOSX" / "sub").mkdir(parents=True)
    (src / "__MACOSX" / "._a.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(40))
    (src / "__MACOSX" / "sub" / "._c.png").write_bytes(b"\x00\x05\x16\x07" + bytes(60))
    (src / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(40))
    (src / "sub").mkdir(exist_ok=True)
    (src / "sub" / ".picasa.ini").write_text("[c.png]\nfaces=rect64(3f845bcb59418507),Alice Smith\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


HIDDEN = [".DS_Store", ".git/", ".ipynb_checkpoints/", "__MACOSX/", "sub/.picasa.ini"]


@pytest.mark.parametrize("copy_other", [False, True], ids=["skipped", "--copy-other"])
def test_hidden_files_and_folders_are_never_read_nor_copied(cli, tmp_path, copy_other):
    """Regression: .ipynb_checkpoints/ became a class of the release (its images perturbed as
    the user's), a macOS __MACOSX/._a.png stopped the run as an unreadable image, and
    --copy-other copied .DS_Store and .picasa.ini (people's names) raw into the release."""
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 8, 3))
    save(src / "sub" / "c.png", pixels(8, 8))
    (src / "notes.txt").write_text("shot in May")
    hidden_clutter(src)
    before = tree_digest(src)
    out = tmp_path / "out"
    options = ("--copy-other",) if copy_other else ()
    result = cli("perturb", src, "--eps", "1", "--out", out, *options)
    assert result.exit_code == 0, result.stderr
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == ["a.png", *(["notes.txt"] if copy_other else []), "sub/c.png"]
    manifest = manifest_of(out)
    assert {i["path"] for i in manifest["inputs"]} == {str(src / "a.png"), str(src / "sub" / "c.png")}
    dropped = {d["name"]: d for d in manifest["dropped"]}
    assert sorted(dropped) == HIDDEN
    assert dropped[".git/"]["kind"] == "folder" and dropped[".DS_Store"]["kind"] == "file"
    assert all("hidden" in d["reason"] for d in dropped.values())
    assert manifest["not_images"] == ["notes.txt"]
    assert f"left out 2 hidden files and 3 hidden folders, never read nor copied (the manifest's dropped): " \
           f"{', '.join(HIDDEN)}" in result.stderr
    assert tree_digest(src) == before

    planned = cli("plan", src, "--eps", "1", "--json", *options)
    assert planned.exit_code == 0, planned.stderr
    assert json.loads(planned.stdout)["records"] == 2 and "left out 2 hidden files" in planned.stderr


def test_keep_naming_a_hidden_file_says_it_is_never_copied(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 8, 3))
    hidden_clutter(src)
    for pattern, named in ((".picasa.ini", None), ("sub/.picasa.ini", "sub/.picasa.ini"),
                           (".ipynb_checkpoints/*.png", ".ipynb_checkpoints/")):
        result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out", "--keep", pattern)
        if named is None:
            assert_one_line_error(result, 2, f"--keep {pattern} matches no")
        else:
            assert_one_line_error(result, 2, f"--keep {pattern} names {named}, which is hidden", "never read")
    assert siblings(tmp_path) == {"photos"}


def test_hidden_files_are_withheld_with_anonymized_names(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 8, 3))
    hidden_clutter(src)
    out, name_map = tmp_path / "out", tmp_path / "names.json"
    result = cli("perturb", src, "--eps", "1", "--out", out, "--anonymize-names", "--name-map", name_map)
    assert result.exit_code == 0, result.stderr
    assert "left out 2 hidden files and 3 hidden folders, never read nor copied (the manifest's dropped): " \
           "named in the name map" in result.stderr
    manifest_text = Path(str(out) + ".manifest.json").read_text()
    assert "sub/.picasa.ini" not in manifest_text and ".ipynb_checkpoints/" not in manifest_text
    assert {d["name"] for d in manifest_of(out)["dropped"]} == {images_reader.WITHHELD}
    assert json.loads(name_map.read_text())["hidden_left_out"] == HIDDEN


def test_a_folder_of_hidden_images_only_has_no_images(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / ".ipynb_checkpoints" / "a-checkpoint.png", pixels(8, 8, 3))
    assert_one_line_error(cli("perturb", src, "--eps", "1"), 1, f"no images in {src} (found 1 hidden folder, "
                                                                "not read)")


@pytest.mark.parametrize("broken", ["truncated", "garbage"])
def test_unreadable_image_stops_the_run_or_is_skipped(cli, tmp_path, broken):
    src = tmp_path / "photos"
    save(src / "good.png", pixels(8, 8, 3))
    bad = src / "sub" / "bad.png"
    if broken == "truncated":
        data = save(bad, pixels(32, 32, 3)).read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    else:
        bad.parent.mkdir()
        bad.write_bytes(b"this is not a PNG at all")
    before = tree_digest(src)

    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert str(bad) in one_line(result)
    assert siblings(tmp_path) == {"photos"}, "something was written"

    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out", "--skip-bad")
    assert result.exit_code == 0, result.stderr
    assert "skipped 1 unreadable image: sub/bad.png" in result.stderr
    assert manifest_of(tmp_path / "out")["skipped_bad_images"] == ["sub/bad.png"]
    assert sorted(image_files(tmp_path / "out")) == ["good.png"]
    assert tree_digest(src) == before


def test_plan_skips_an_unreadable_image_as_its_error_says(cli, tmp_path):
    """`tldp plan` of a folder with a damaged image names it and says to pass --skip-bad:
    plan takes that option too, and plans what perturb --skip-bad would write."""
    src = tmp_path / "photos"
    save(src / "good.png", pixels(8, 8, 3))
    data = save(src / "bad.jpg", pixels(32, 32, 3)).read_bytes()
    (src / "bad.jpg").write_bytes(data[:40])
    before = tree_digest(src)

    result = cli("plan", src, "--eps", "1")
    assert result.exit_code == 1
    assert str(src / "bad.jpg") in one_line(result) and "--skip-bad" in one_line(result)

    planned = cli("plan", src, "--eps", "1", "--skip-bad", "--json")
    assert planned.exit_code == 0, planned.stderr
    assert "skipped 1 unreadable image: bad.jpg" in planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["records"] == 1 and plan["skipped_bad_images"] == ["bad.jpg"]
    assert tree_digest(src) == before and siblings(tmp_path) == {"photos"}


def test_folder_without_images(cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("perturb", empty, "--eps", "1")
    assert result.exit_code == 1
    assert f"no images in {empty}" in one_line(result)

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "readme.md").write_text("hello")
    result = cli("perturb", texts, "--eps", "1")
    assert result.exit_code == 1
    assert f"no images in {texts} (found 1 file that is not an image)" in one_line(result)
    assert siblings(tmp_path) == {"empty", "texts"}


def test_a_folder_of_files_tldp_reads_on_their_own_says_to_give_them_as_inputs(cli, tmp_path):
    """A folder of checkpoints (a .safetensors file beside its notes; a PEFT adapter folder was
    the case, and is now a model folder, formats/sharded_safetensors.py) and a folder of .npy
    files were refused as "no images in ... (found N files that are not images)", which did
    not say that tldp perturbs those files given as inputs."""
    from safetensors.numpy import save_file

    adapter = tmp_path / "lora"
    adapter.mkdir()
    save_file({"lora_A.weight": np.zeros((4, 8), np.float32)}, str(adapter / "step-100.safetensors"))
    (adapter / "notes.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    assert_one_line_error(cli("perturb", adapter, "--eps", "1", "--clip", "0.1"), 1, f"no images in {adapter}",
                          f"; {adapter / 'step-100.safetensors'} holds data tldp perturbs on its own: "
                          "give the files as inputs")
    arrays = tmp_path / "features"
    arrays.mkdir()
    for name in ("a.npy", "b.npy"):
        np.save(arrays / name, np.zeros((3, 4), np.uint8))
    assert_one_line_error(cli("perturb", arrays, "--eps", "1"), 1,
                          f"; {arrays / 'a.npy'} and 1 other hold data tldp perturbs on its own")
    assert siblings(tmp_path) == {"lora", "features"}


def test_png_output_decodes_alike_in_pillow_and_libpng(cli, tmp_path):
    """The PNG writer is tldp's own (noise-suited encoding): OpenCV's libpng must read what
    Pillow reads, for every mode written, with the ICC profile kept (--keep icc_profile)."""
    cv2 = pytest.importorskip("cv2")
    from PIL import ImageCms

    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    src = tmp_path / "photos"
    save(src / "gray.png", pixels(9, 7))
    save(src / "la.png", pixels(6, 8, 2))
    save(src / "rgb.png", pixels(10, 12, 3), icc_profile=icc)
    save(src / "rgba.png", pixels(5, 9, 4))
    save(src / "deep.png", pixels(7, 6, dtype=np.uint16))
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "2", "--out", out, "--range", "0:65536", "--keep", "icc_profile")
    assert result.exit_code == 0, result.stderr
    for name in ("gray", "la", "rgb", "rgba", "deep"):
        path = out / f"{name}.png"
        with Image.open(path) as im:
            ours = np.asarray(im)
            assert im.info.get("icc_profile") == (icc if name == "rgb" else None)
            assert np.asarray(im.convert("RGB")).shape == (*ours.shape[:2], 3)  # as loaders do
        theirs = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        if theirs.ndim == 3:  # libpng via OpenCV: BGR(A), gray+alpha expanded to BGRA
            theirs = cv2.cvtColor(theirs, cv2.COLOR_BGRA2RGBA if theirs.shape[2] == 4 else cv2.COLOR_BGR2RGB)
            if name == "la":
                theirs = np.dstack([theirs[..., 0], theirs[..., 3]])
        assert theirs.dtype == ours.dtype and np.array_equal(theirs, ours), name


def test_png_output_loads_in_torchvision(cli, tmp_path):
    torchvision = pytest.importorskip("torchvision")
    src = tmp_path / "photos"
    save(src / "rgb.png", pixels(10, 12, 3))
    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    tensor = torchvision.io.decode_image(str(tmp_path / "out" / "rgb.png"))
    assert tuple(tensor.shape) == (3, 10, 12)
    assert np.array_equal(tensor.permute(1, 2, 0).numpy(), np.asarray(Image.open(tmp_path / "out" / "rgb.png")))


def write_index(folder: Path, name: str, rows: list[dict]) -> None:
    if name.endswith(".jsonl"):
        text = "".join(json.dumps(row) + "\n" for row in rows)
    else:
        text = "file_name,caption\n" + "".join(f"{r['file_name']},\"{r['caption']}\"\n" for r in rows)
    (folder / name).write_text(text)


def imagefolder(data_dir: Path, cache: Path) -> list[tuple[str, tuple[int, int]]]:
    """(caption, size) of each example, as Hugging Face's imagefolder loads the folder."""
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(data_dir), cache_dir=str(cache),
                                   split="train")
    return sorted((example["caption"], example["image"].size) for example in loaded)


@pytest.mark.parametrize("index", images_index.INDEX_FILES)
def test_index_files_follow_renamed_images_for_imagefolder(cli, tmp_path, monkeypatch, index):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local folder: nothing to download
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nor anything left in the home folder
    src = tmp_path / "photos"
    save(src / "cat" / "a.jpg", pixels(16, 12, 3), quality=90)
    save(src / "dog" / "b.jpeg", pixels(8, 8, 3), quality=90)
    save(src / "dog" / "c.png", pixels(9, 7, 3))
    rows = [{"file_name": "cat/a.jpg", "caption": "a cat"}, {"file_name": "./dog/b.jpeg", "caption": "a dog"},
            {"file_name": "dog/c.png", "caption": "a dog, again"}]
    write_index(src, index, rows)
    before = tree_digest(src)
    expected = imagefolder(src, tmp_path / "cache-in")

    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--out", out, "--copy-other")
    assert result.exit_code == 0, result.stderr
    assert imagefolder(out, tmp_path / "cache-out") == expected
    assert f"rewrote the image file names in {index}" in result.stderr
    assert manifest_of(out)["index_files_rewritten"] == [index]
    written = (out / index).read_text()
    assert "cat/a.png" in written and "./dog/b.png" in written and "dog/c.png" in written
    assert ".jpg" not in written and ".jpeg" not in written
    assert tree_digest(src) == before


@pytest.mark.parametrize("index", images_index.INDEX_FILES)
def test_index_rows_of_images_not_written_are_dropped(cli, tmp_path, monkeypatch, index):
    """`perturb ds/train --copy-other --skip-bad` on a Hugging Face image folder: the rows of
    skipped images leave the index (else imagefolder finds 9 rows for 7 images and fails)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    src = tmp_path / "ds" / "train"
    rows = []
    for i in range(9):  # as the datasets docs write it: file_name, then the other features
        name = f"{i:04d}.png"
        save(src / name, pixels(6 + i, 5, 3))
        rows.append({"file_name": name, "caption": f"image {i}"})
    (src / "0002.png").write_bytes(b"not a PNG at all")
    data = (src / "0006.png").read_bytes()
    (src / "0006.png").write_bytes(data[: len(data) // 2])  # truncated
    write_index(src, index, rows)
    before = tree_digest(src)

    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--copy-other", "--skip-bad", "--out", out)
    assert result.exit_code == 0, result.stderr
    loaded = imagefolder(out, tmp_path / "cache")
    assert [caption for caption, _ in loaded] == [f"image {i}" for i in (0, 1, 3, 4, 5, 7, 8)]
    assert [size for _, size in loaded] == [(5, 6 + i) for i in (0, 1, 3, 4, 5, 7, 8)]
    row = "line" if index.endswith(".jsonl") else "row"
    manifest = manifest_of(out)
    assert manifest["dropped"] == [
        {"name": f"{index} {row} {n}", "kind": "index row",
         "reason": f"names {name}, an unreadable image, skipped (--skip-bad): not in the output"}
        for n, name in ((3, "0002.png"), (7, "0006.png"))]
    assert manifest["index_files_rewritten"] == [index]
    assert f"dropped 2 index rows naming images not written (listed in the manifest's dropped): " \
           f"{index} {row} 3, {index} {row} 7" in result.stderr
    assert "rewrote the image file names" not in result.stderr  # none was renamed
    assert tree_digest(src) == before


def test_a_parquet_index_naming_images_not_written_is_not_copied(cli, tmp_path, monkeypatch):
    """imagefolder reads metadata.parquet too; tldp cannot rewrite it, so when an image is
    skipped (or renamed) it is left out and listed, not copied naming a missing image."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    src = tmp_path / "train"
    for i in range(3):
        save(src / f"{i}.png", pixels(6, 5, 3))
    (src / "1.png").write_bytes(b"not a PNG at all")
    pq.write_table(pa.table({"file_name": [f"{i}.png" for i in range(3)], "caption": ["a", "b", "c"]}),
                   src / "metadata.parquet")
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--copy-other", "--skip-bad", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert not (out / "metadata.parquet").exists()
    dropped = {entry["name"]: entry for entry in manifest_of(out)["dropped"]}
    assert "cannot rewrite" in dropped["metadata.parquet"]["reason"]
    assert "did not copy metadata.parquet" in result.stderr
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(out), cache_dir=str(tmp_path / "cache"),
                                   split="train")
    assert len(loaded) == 2
    save(src / "1.png", pixels(6, 5, 3))  # every image written under its own name: copied as it is
    result = cli("perturb", src, "--eps", "1", "--copy-other", "--out", tmp_path / "all")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "all" / "metadata.parquet").read_bytes() == (src / "metadata.parquet").read_bytes()


def test_index_rows_naming_symbolic_links_are_dropped(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.png", pixels(6, 6, 3))
    save(tmp_path / "elsewhere.png", pixels(6, 6, 3))
    (src / "b.png").symlink_to(tmp_path / "elsewhere.png")
    (src / "sub").mkdir()
    (src / "sub" / "metadata.jsonl").write_text('{"file_name": "../a.png", "label": 0}\n'
                                               '{"file_name": "../b.png", "label": 1}\n')
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--copy-other", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert (out / "sub" / "metadata.jsonl").read_text() == '{"file_name": "../a.png", "label": 0}\n'
    assert manifest_of(out)["dropped"] == [{"name": "sub/metadata.jsonl line 2", "kind": "index row",
                                            "reason": "names ../b.png, a symbolic link, skipped: not in "
                                                      "the output"}]


def test_index_files_are_copied_as_they_are_when_no_name_changes(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.png", pixels(6, 6, 3))
    (src / "metadata.jsonl").write_text('{"file_name":  "a.png", "label": 1}\n')
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out", "--copy-other")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "metadata.jsonl").read_bytes() == (src / "metadata.jsonl").read_bytes()
    assert "index_files_rewritten" not in manifest_of(tmp_path / "out")


@pytest.mark.parametrize("index, content, problem", [
    ("metadata.jsonl", '{"file_name": "a.jpg"}\nnot json\n', "line 2"),
    ("metadata.csv", 'file_name,label\n"a.jpg,1\n', "not readable as CSV"),
    ("metadata.jsonl", b'{"file_name": "a.jpg", "caption": "\xff"}\n', "not UTF-8"),
    # issue 27, item 13: json.loads raised RecursionError ("unexpected error ... please report it")
    ("metadata.jsonl", '{"file_name": "a.jpg"}\n{"x": ' + "[" * 200_000 + "]" * 200_000 + "}\n",
     "line 2 is not valid JSON (it nests lists and objects more than 100 levels deep"),
])
def test_unreadable_index_file_stops_the_run(cli, tmp_path, index, content, problem):
    src = tmp_path / "photos"
    save(src / "a.jpg", pixels(6, 6, 3))
    (src / index).write_bytes(content if isinstance(content, bytes) else content.encode())
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--copy-other"), 1, str(src / index), problem)
    assert siblings(tmp_path) == before


def test_jsonl_index_lines_are_split_as_json_lines_readers_split_them(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "a.jpg", pixels(6, 6, 3))
    lines = ['{"file_name": "a.jpg", "caption": "one\u2028line"}', '{"file_name": "gone.jpg"}']
    (src / "metadata.jsonl").write_text("\ufeff" + "\r\n".join(lines) + "\r\n", encoding="utf-8")
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out", "--copy-other")
    assert result.exit_code == 0, result.stderr
    rows = (tmp_path / "out" / "metadata.jsonl").read_bytes().decode().split("\r\n")
    assert json.loads(rows[0]) == {"file_name": "a.png", "caption": "one\u2028line"}
    assert rows[1:] == ['{"file_name": "gone.jpg"}', ""]  # names no image here: kept as it was


def test_tiff_output_warns_when_pillow_cannot_open_it(cli, tmp_path):
    src = tmp_path / "photos"
    save(src / "gray.png", pixels(6, 6))
    save(src / "rgb.png", pixels(6, 6, 3))
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--image-format", "tiff", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert "warning: 1 colour or alpha image will be TIFF" in result.stderr
    assert "Pillow cannot open" in result.stderr
    with Image.open(out / "gray.tiff") as im:  # what the warning leaves out, Pillow reads
        im.convert("RGB")
    with pytest.raises(UnidentifiedImageError):  # what it names, Pillow does not
        Image.open(out / "rgb.tiff").convert("RGB")
    assert tifffile.imread(out / "rgb.tiff").shape == (6, 6, 3)

    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "png")
    assert "will be TIFF" not in result.stderr


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_is_applied_as_pillow_applies_it(cli, tmp_path, orientation):
    from PIL import ImageOps

    src = tmp_path / "photos"
    exif = Image.Exif()
    exif[0x0112] = orientation
    save(src / "cam.jpg", pixels(12, 20, 3), quality=95, exif=exif.tobytes())
    save(src / "tagged.png", pixels(6, 10), exif=exif.tobytes())  # eXIf before the pixel data
    out = tmp_path / "out"
    assert cli("perturb", src, "--eps", "10000", "--out", out).exit_code == 0
    for name in ("cam", "tagged"):
        with Image.open(src / f"{name}.{'jpg' if name == 'cam' else 'png'}") as im:
            upright = np.asarray(ImageOps.exif_transpose(im))
        np.testing.assert_array_equal(np.asarray(Image.open(out / f"{name}.png")), upright)
    notes = manifest_of(out).get("image_conversions", {})
    assert (notes.get("cam.jpg") == [f"EXIF orientation {orientation} applied"]) == (orientation != 1)


def test_png_output_of_smooth_images_stays_small_and_exact(cli, tmp_path):
    """A large epsilon leaves an image as it was: its PNG is filtered and deflated for
    structure, not encoded as if it were noise (which would keep about its raw size)."""
    cv2 = pytest.importorskip("cv2")
    ramp = np.add.outer(np.arange(64), np.arange(48))
    images_in = {"rgb": np.dstack([ramp, ramp * 2, 255 - ramp]).clip(0, 255).astype(np.uint8),
                 "rgba": np.dstack([ramp, ramp, ramp, np.full_like(ramp, 200)]).astype(np.uint8),
                 "deep": (ramp * 300).astype(np.uint16)}
    for name, array in images_in.items():  # one folder each: 8- and 16-bit ranges differ
        save(tmp_path / name / f"{name}.png", array)
        kept = ("--keep", "alpha") if name == "rgba" else ()  # written as it was, alpha too
        result = cli("perturb", tmp_path / name, "--eps", "1e8", "--out", tmp_path / f"{name}.out", *kept)
        assert result.exit_code == 0, result.stderr
    for name, array in images_in.items():
        path = tmp_path / f"{name}.out" / f"{name}.png"
        theirs = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        if theirs.ndim == 3:
            theirs = cv2.cvtColor(theirs, cv2.COLOR_BGRA2RGBA if theirs.shape[2] == 4 else cv2.COLOR_BGR2RGB)
        assert np.array_equal(theirs, array) and np.array_equal(np.asarray(Image.open(path)), array), name
        assert path.stat().st_size < array.nbytes / 8, name


# ----------------------------------------------------------------- FIFOs, names not UTF-8 (issue 27)

@pytest.mark.slow
@pytest.mark.parametrize("fifo, options", [("sub/f.png", ()), ("notes.txt", ("--copy-other",))],
                         ids=["named as an image", "copied by --copy-other"])
def test_a_fifo_in_the_folder_is_refused_not_waited_on(tmp_path, fifo, options):
    """Item 9: `mkfifo f/f.png` made the run wait forever for a writer (Pillow opened it);
    inside a Zarr store it is refused. An image folder refuses it too, naming it, with
    nothing written, whatever its name and with or without --copy-other."""
    src = tmp_path / "f"
    save(src / "a.png", pixels(8, 8, 3))
    save(src / "sub" / "b.png", pixels(6, 5))
    os.mkfifo(src / fifo)
    before, digest = siblings(tmp_path), tree_digest(src)
    run = subprocess.run([sys.executable, "-m", "tldp_cli", "perturb", src, "--eps", "1", *options],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert f"{src}: {fifo} " in lines[0] and "Traceback" not in run.stderr, lines[0]  # naming it
    assert siblings(tmp_path) == before and tree_digest(src) == digest


def test_a_file_pillow_does_not_recognise_is_named_not_its_file_object(cli, tmp_path):
    """Pillow's "cannot identify image file <_io.BufferedReader name=3>" named the open file
    object; the reason says what is wrong, in the image folder and in a mask folder."""
    src = tmp_path / "f"
    save(src / "a.png", pixels(8, 8))
    (src / "b.png").write_bytes(b"")
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out")
    assert_one_line_error(result, 1, f"{src / 'b.png'}: cannot be decoded as an image (not an image "
                                     "format Pillow recognises); pass --skip-bad")
    (src / "b.png").unlink()
    masks = tmp_path / "masks"
    save(masks / "a.png", np.full((8, 8), 128, np.uint8))
    (masks / "a.png").write_bytes(b"GIF89a")
    result = cli("perturb", src, "--eps", "1", "--weights", masks, "--out", tmp_path / "out")
    assert_one_line_error(result, 1, "a.png: not a readable mask image (not an image format Pillow recognises)")


def test_an_image_swapped_for_a_fifo_after_the_listing_is_an_error(tmp_path, alarm):
    """The folder is listed when it is opened and each image decoded later: an image
    replaced by a FIFO (or a mask PNG, or a file --copy-other copies) in between is opened
    non-blocking and refused, never waited on."""
    src = tmp_path / "f"
    save(src / "a.png", pixels(8, 8, 3))
    save(src / "b.png", pixels(4, 4))
    reader = images.open_reader(src, formats.FormatOptions())
    job = next(j for j in reader.arrays() if j.name == "a.png")
    (src / "a.png").unlink()
    os.mkfifo(src / "a.png")
    with pytest.raises(InputError, match=r"a\.png: not a regular file \(a FIFO\); tldp reads only regular files"):
        job.read(0, 1)


def test_a_fifo_in_a_mask_folder_is_refused_not_waited_on(cli, tmp_path, alarm):
    src, masks = tmp_path / "photos", tmp_path / "masks"
    save(src / "a.png", pixels(8, 8, 3))
    save(src / "b.png", pixels(5, 5))
    assert cli("weight-mask", src, "--method", "constant", "--weight", "0.5", "--out", masks).exit_code == 0
    (masks / "b.png").unlink()
    os.mkfifo(masks / "b.png")
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--weights", masks, "--out", tmp_path / "out"), 1,
                          f"{masks / 'b.png'}: not a regular file (a FIFO)")
    assert siblings(tmp_path) == before


@pytest.mark.skipif(sys.platform != "linux", reason="file names are bytes on Linux")
def test_file_names_that_are_not_utf8_are_perturbed_and_kept(cli, tmp_path):
    """Item 12: one file name that is not UTF-8 (b"caf\\xe9.png", Latin-1) made the whole
    folder fail with "unexpected error ... please report it". The image is perturbed and
    written under its own bytes; the manifest is valid ASCII JSON whose names give the
    bytes back through os.fsencode (docs/manifest.md); --skip-bad skips such a bad image
    and --copy-other copies such a file; evaluate pairs them."""
    src = tmp_path / "latin"
    named = lambda *parts: Path(os.fsdecode(os.fsencode(src) + b"/" + b"/".join(parts)))  # noqa: E731
    save(named(b"caf\xe9.png"), pixels(12, 10, 3))
    save(named(b"sub\xff", b"x.png"), pixels(9, 7))
    named(b"bad\xfe.png").write_bytes(b"not an image")
    named(b"note\xff.txt").write_bytes(b"kept as it is")
    digest = tree_digest(src)
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, "--copy-other", "--skip-bad")
    assert result.exit_code == 0, result.stderr
    assert tree_digest(src) == digest
    raw_out = os.fsencode(out)
    assert sorted(os.listdir(raw_out)) == [b"caf\xe9.png", b"note\xff.txt", b"sub\xff"]
    assert os.listdir(raw_out + b"/sub\xff") == [b"x.png"]
    for parts, original in [((b"caf\xe9.png",), named(b"caf\xe9.png")), ((b"sub\xff", b"x.png"), named(b"sub\xff", b"x.png"))]:
        written = colour_channels(Path(os.fsdecode(raw_out + b"/" + b"/".join(parts))))
        assert written.shape == colour_channels(original).shape
        assert not np.array_equal(written, colour_channels(original))
    assert open(raw_out + b"/note\xff.txt", "rb").read() == b"kept as it is"

    text = Path(str(out) + ".manifest.json").read_bytes()
    assert text.isascii()
    manifest = json.loads(text)
    assert {os.fsencode(o["path"]) for o in manifest["outputs"]} == {
        raw_out + b"/caf\xe9.png", raw_out + b"/sub\xff/x.png", raw_out + b"/note\xff.txt"}
    assert {os.fsencode(i["path"]) for i in manifest["inputs"]} == {
        os.fsencode(src) + b"/caf\xe9.png", os.fsencode(src) + b"/sub\xff/x.png"}
    assert [os.fsencode(n) for n in manifest["skipped_bad_images"]] == [b"bad\xfe.png"]
    assert [os.fsencode(n) for n in manifest["not_images"]] == [b"note\xff.txt"]
    checked = cli("evaluate", src, out, "--json")
    assert checked.exit_code == 0, checked.stderr
    assert all(c["passed"] for c in json.loads(checked.stdout)["checks"] if c["check"] in ("sha256", "unlisted_files"))


@pytest.mark.skipif(sys.platform != "linux", reason="file names are bytes on Linux")
def test_names_that_are_not_utf8_key_their_noise_by_their_bytes(cli, tmp_path):
    """The random streams are keyed by the name's bytes: a UTF-8 name keeps its noise (the
    same seed gives the same image), and the name that is not UTF-8 gets noise of its own."""
    runs = {}
    for name in (b"caf\xc3\xa9.png", b"caf\xe9.png", b"caf\xe8.png"):
        src = tmp_path / f"in{len(runs)}"
        save(Path(os.fsdecode(os.fsencode(src) + b"/" + name)), np.full((16, 16), 128, np.uint8))
        out = tmp_path / f"out{len(runs)}"
        result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out)
        assert result.exit_code == 0, result.stderr
        runs[name] = colour_channels(Path(os.fsdecode(os.fsencode(out) + b"/" + name)))
    utf8 = tmp_path / "utf8"
    save(utf8 / "café.png", np.full((16, 16), 128, np.uint8))
    assert cli("perturb", utf8, "--eps", "1", "--seed", SEED, "--out", tmp_path / "utf8-out").exit_code == 0
    assert np.array_equal(runs[b"caf\xc3\xa9.png"], colour_channels(tmp_path / "utf8-out" / "café.png"))
    assert not np.array_equal(runs[b"caf\xe9.png"], runs[b"caf\xe8.png"])
    assert not np.array_equal(runs[b"caf\xe9.png"], runs[b"caf\xc3\xa9.png"])


def test_alpha_channels_are_left_out_unless_keep_alpha_names_them(cli, tmp_path):
    """Regression: the alpha channel was copied raw into the output by default (only listed
    under unperturbed), though a cut-out's alpha is its subject's silhouette. It is left
    out now (RGBA written as RGB, LA as L, PNG or TIFF), listed under dropped and named by
    the summary line; --keep alpha copies it raw, listed under unperturbed; evaluate pairs
    either output with its input."""
    src = tmp_path / "cutouts"
    rgba, la = pixels(8, 8, 4), pixels(7, 5, 2)
    save(src / "a.png", rgba)
    save(src / "b.png", la)
    save(src / "c.png", pixels(8, 8, 3))
    for image_format, suffix in (("png", ".png"), ("tiff", ".tiff")):
        out = tmp_path / f"out-{image_format}"
        result = cli("perturb", src, "--eps", "1", "--image-format", image_format, "--out", out, "--json")
        assert result.exit_code == 0, result.stderr
        manifest = json.loads(result.stdout)
        (entry,) = manifest["dropped"]
        assert entry["name"] == "alpha" and entry["kind"] == "alpha channel" and "2 images" in entry["reason"]
        assert "unperturbed" not in manifest and "dropped alpha channels" in result.stderr
        if image_format == "png":
            with Image.open(out / "a.png") as a, Image.open(out / "b.png") as b:
                assert (a.mode, a.size, b.mode, b.size) == ("RGB", (8, 8), "L", (5, 7))
        else:
            assert tifffile.imread(out / "a.tiff").shape == (8, 8, 3)
            assert tifffile.imread(out / "b.tiff").shape == (7, 5)
            with tifffile.TiffFile(out / "a.tiff") as tif:
                assert not tif.pages[0].extrasamples
        evaluated = cli("evaluate", src, out, "--json", "-q")
        assert evaluated.exit_code == 0 and json.loads(evaluated.stdout)["integrity_ok"], evaluated.stderr
        kept = tmp_path / f"kept-{image_format}"
        result = cli("perturb", src, "--eps", "1", "--image-format", image_format, "--out", kept, "--json",
                     "--keep", "alpha")
        assert result.exit_code == 0, result.stderr
        (entry,) = json.loads(result.stdout)["unperturbed"]
        assert entry["name"] == "alpha" and entry["kind"] == "alpha channel" and "2 images" in entry["reason"]
        assert "copied unchanged: alpha" in result.stderr and "dropped" not in json.loads(result.stdout)
        assert np.array_equal(alpha_channel(kept / f"a{suffix}"), rgba[..., 3])
        assert np.array_equal(alpha_channel(kept / f"b{suffix}"), la[..., 1])
        if image_format == "png":
            assert Image.open(kept / "a.png").mode == "RGBA" and Image.open(kept / "b.png").mode == "LA"
        evaluated = cli("evaluate", src, kept, "--json", "-q")
        assert evaluated.exit_code == 0 and json.loads(evaluated.stdout)["integrity_ok"], evaluated.stderr
    alone = tmp_path / "opaque"
    save(alone / "b.png", pixels(8, 8, 3))
    result = cli("perturb", alone, "--eps", "1", "--out", tmp_path / "o2", "--json")
    assert "unperturbed" not in json.loads(result.stdout) and "dropped" not in json.loads(result.stdout)
    assert_one_line_error(cli("perturb", alone, "--eps", "1", "--keep", "alpha"), 2, "--keep alpha")


def test_icc_profiles_are_dropped_unless_kept(cli, tmp_path):
    """An ICC profile can hold free text (its description and copyright tags): left out and
    listed in dropped; --keep icc_profile writes it, listed under unperturbed."""
    from PIL import ImageCms

    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 9, 3), icc_profile=icc)
    save(src / "b.jpg", pixels(8, 9, 3), icc_profile=icc)
    save(src / "c.png", pixels(8, 9, 3))
    for out, keep in ((tmp_path / "out", ()), (tmp_path / "kept", ("--keep", "icc_profile"))):
        result = cli("perturb", src, "--eps", "2", "--out", out, *keep)
        assert result.exit_code == 0, result.stderr
        manifest = json.loads(Path(f"{out}.manifest.json").read_text())
        entries = manifest["unperturbed" if keep else "dropped"]
        assert [(e["name"], e["kind"]) for e in entries] == [("icc_profile", "colour profile")]
        assert "2 images" in entries[0]["reason"]
        for name in ("a", "b"):
            with Image.open(out / f"{name}.png") as im:
                assert im.info.get("icc_profile") == (icc if keep else None)


def test_the_summary_does_not_count_the_dropped_profiles_as_one(cli, tmp_path):
    """One `dropped` entry stands for the profiles of every image: the summary line said
    "dropped 1 colour profile" of two images' profiles."""
    from PIL import ImageCms

    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    src = tmp_path / "photos"
    save(src / "a.png", pixels(8, 9, 3), icc_profile=icc)
    save(src / "b.png", pixels(8, 9, 3), icc_profile=icc)
    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    assert "1 colour profile" not in result.stderr and "dropped colour profiles" in result.stderr


def test_hard_links_inside_the_folder_are_refused(cli, tmp_path):
    """Regression: two names of one image (hard links) inside a folder became two records,
    one subject's image released twice with noise of its own each time, while the manifest
    states one release per record."""
    import os

    src = tmp_path / "photos"
    save(src / "a.png", pixels(6, 5, 3))
    save(src / "c.png", pixels(6, 5, 3))
    (src / "sub").mkdir()
    os.link(src / "a.png", src / "sub" / "b.png")
    before = tree_digest(src)
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out")
    assert_one_line_error(result, 2, f"{src / 'a.png'} and {src / 'sub' / 'b.png'} are the same file")
    assert tree_digest(src) == before and siblings(tmp_path) == {"photos"}


def test_an_explicit_dtype_that_does_not_apply_to_png_output_is_said(cli, tmp_path):
    """Regression: --dtype float32 (or float64) on a folder written as PNG was accepted and
    ignored. The images are written at their own bit depth, so a --dtype given is said not to
    apply, in one line, by perturb and by plan; not when left at its default, nor with TIFF."""
    src = tmp_path / "photos"
    save(src / "a.png", pixels(6, 5, 3))
    save(src / "b.png", pixels(6, 5, dtype=np.uint16))
    note = "--dtype float32 does not apply to PNG output"
    for command in (("plan",), ("perturb", "--seed", SEED)):
        given = cli(*command, src, "--eps", "1", "--dtype", "float32")
        assert given.exit_code == 0, given.stderr
        assert sum(note in line for line in given.stderr.splitlines()) == 1, given.stderr
        default = cli(*command, src, "--eps", "1", "--overwrite") if command[0] == "perturb" else \
            cli(*command, src, "--eps", "1")
        assert default.exit_code == 0 and "--dtype" not in default.stderr, default.stderr
    with Image.open(tmp_path / "photos.tldp" / "a.png") as a, Image.open(tmp_path / "photos.tldp" / "b.png") as b:
        assert np.asarray(a).dtype == np.uint8 and b.mode.startswith("I;16")
    tiff = cli("plan", src, "--eps", "1", "--dtype", "float64", "--image-format", "tiff")
    assert tiff.exit_code == 0 and "does not apply" not in tiff.stderr, tiff.stderr


def test_subfolder_names_released_as_labels_are_warned_about(cli, tmp_path):
    """malignant/x.png: the subfolder's name is the image's label, released raw unless
    --anonymize-names; the run says so in one line (not under -q), the output unchanged."""
    src = tmp_path / "lesions"
    for rel in ("benign/a.png", "benign/b.png", "malignant/c.png"):
        save(src / rel, pixels(8, 8))
    warning = ("warning: the images lie in 2 subfolders, whose names are released as each image's label, "
               "raw, outside the certificate (--anonymize-names withholds them)")
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count(warning) == 1
    assert sorted(image_files(tmp_path / "out")) == ["benign/a.png", "benign/b.png", "malignant/c.png"]
    quiet = cli("perturb", src, "--eps", "1", "--out", tmp_path / "quiet", "-q")
    assert quiet.exit_code == 0 and "released as each image's label" not in quiet.stderr
    anonymized = cli("perturb", src, "--eps", "1", "--out", tmp_path / "anon", "--anonymize-names",
                     "--name-map", tmp_path / "names.json")
    assert anonymized.exit_code == 0, anonymized.stderr
    assert "released as each image's label" not in anonymized.stderr
    flat = tmp_path / "flat"
    save(flat / "a.png", pixels(8, 8))
    result = cli("perturb", flat, "--eps", "1", "--out", tmp_path / "flat-out")
    assert result.exit_code == 0 and "released as each image's label" not in result.stderr
