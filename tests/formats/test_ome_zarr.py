"""OME-Zarr multiscale images (NGFF 0.4 on Zarr 2, 0.5 on Zarr 3), written by ome-zarr-py:
only the full resolution is perturbed, the lower levels are regenerated from it, and the
output opens with ome-zarr-py's reader."""

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zarr
from ome_zarr.format import FormatV04, FormatV05
from ome_zarr_models.v04.hcs import HCS as HCS04
from ome_zarr_models.v04.image import Image as Image04
from ome_zarr.io import parse_url
from ome_zarr.reader import Label, Multiscales, Plate, Reader
from ome_zarr.writer import (write_image, write_labels, write_multiscale, write_plate_metadata,
                              write_well_metadata)
from skimage.transform import downscale_local_mean

from tests.builders import SEED, assert_one_line_error, tree_digest
from tldp_cli.errors import Interrupted
from tldp_cli.formats import zarr_ome
from tldp_cli.run.pipeline import PerturbOptions
from tldp_cli.run.pipeline import perturb as run_perturb
from tldp_cli.run.resume import partial_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

FORMATS = [pytest.param(FormatV04(), id="ngff-0.4"), pytest.param(FormatV05(), id="ngff-0.5")]
# Two channels of 64 x 48: every level of the default pyramid (factors 2, 4, 8, 16) divides it.
IMAGE = np.random.default_rng(3).integers(0, 256, (2, 64, 48), dtype=np.uint8)
CELLS = (np.arange(64 * 48).reshape(64, 48) // 97 % 5).astype(np.uint8)


def make_ome(path: Path, fmt, labels: bool = True, **options) -> Path:
    """An OME-Zarr image as ome-zarr-py writes it (its default downsampling, resize,
    unless options say otherwise), with a label image."""
    group = zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format)
    write_image(IMAGE, group, axes="cyx", fmt=fmt, **options)
    if labels:
        write_labels(CELLS, group, name="cells", axes="yx", fmt=fmt)
    return path


def ome_levels(path: Path) -> dict[type, list[np.ndarray]]:
    """Every level of the image and of its label, read with ome-zarr-py's reader."""
    nodes = list(Reader(parse_url(path))())
    found = {}
    for node in nodes:
        kinds = {type(spec) for spec in node.specs}
        if kinds & {Multiscales, Label}:  # a label image has both specs
            found[Label if Label in kinds else Multiscales] = [np.asarray(level) for level in node.data]
    return found


def perturb(cli, src: Path, *args):
    return cli("perturb", src, "--eps", "1", "--range", "0:256", "--seed", "7", "--allow-weak-seed", *args)


def mean_2x2(level: np.ndarray) -> np.ndarray:
    """The block mean the output's lower levels are documented to hold, rounded for integers."""
    return np.rint(downscale_local_mean(level.astype(np.float64), (1, 2, 2))).astype(level.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_levels_are_regenerated_from_the_perturbed_full_resolution(tmp_path, cli, fmt):
    src = make_ome(tmp_path / "a.ome.zarr", fmt)
    before = tree_digest(src)
    result = perturb(cli, src)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "a.tldp.ome.zarr"
    assert tree_digest(src) == before
    raw, noisy = ome_levels(src), ome_levels(out)
    for kind in (Multiscales, Label):
        assert [level.shape for level in noisy[kind]] == [level.shape for level in raw[kind]]
        assert all(level.dtype == np.int16 for level in noisy[kind])
        # no level is raw: each differs from the input's
        assert all(not np.array_equal(n, r) for n, r in zip(noisy[kind], raw[kind]))
    image, cells = noisy[Multiscales], noisy[Label]
    assert len(image) == 5 and len(cells) == 5
    for above, level in zip(image, image[1:]):
        np.testing.assert_array_equal(level, mean_2x2(above))
    for k, level in enumerate(cells):  # labels: nearest, the first element of each block
        np.testing.assert_array_equal(level, cells[0][::2 ** k, ::2 ** k])
    assert "regenerated from the perturbed s0" in result.stderr


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_manifest_counts_one_release_of_the_full_resolution(tmp_path, cli, fmt):
    src = make_ome(tmp_path / "a.ome.zarr", fmt)
    assert perturb(cli, src).exit_code == 0
    manifest = json.loads((tmp_path / "a.tldp.ome.zarr.manifest.json").read_text())
    assert sorted(i["dataset"] for i in manifest["inputs"]) == ["labels/cells/s0", "s0"]
    # 2 channels of the image and 64 rows of the label: the lower levels add no record
    assert manifest["records"] == manifest["accounting"]["per_file"]["records"] == 2 + 64
    image, cells = manifest["multiscale_images"]
    assert image == {"image": "/", "perturbed": "s0", "regenerated": ["s1", "s2", "s3", "s4"],
                     "downsampling": "mean", "factors": [[1, 2, 2]] * 4, "declared_downsampling": None}
    assert cells["downsampling"] == "nearest" and cells["regenerated"][0] == "labels/cells/s1"
    assert any("multiscale image labels/cells" in step for step in manifest["postprocessing"])
    # the same noise on the plain full-resolution array gives the same figures
    alone = zarr.open_group(tmp_path / "alone.zarr", mode="w")
    alone.create_array("s0", data=IMAGE, chunks=(1, 64, 48))
    alone.create_array("cells", data=CELLS, chunks=(64, 48))
    assert perturb(cli, tmp_path / "alone.zarr", "--dataset", "s0", "--dataset", "cells").exit_code == 0
    plain = json.loads((tmp_path / "alone.tldp.zarr.manifest.json").read_text())
    assert manifest["accounting"] == plain["accounting"]


def test_metadata_says_how_the_levels_were_made(tmp_path, cli):
    src = make_ome(tmp_path / "a.ome.zarr", FormatV05(), labels=False)
    assert perturb(cli, src).exit_code == 0
    entry = zarr.open_group(tmp_path / "a.tldp.ome.zarr", mode="r").attrs["ome"]["multiscales"][0]
    assert entry["type"] == "mean" and "regenerated from the perturbed s0" in entry["metadata"]["description"]
    original = zarr.open_group(src, mode="r").attrs["ome"]["multiscales"][0]
    assert entry["datasets"] == original["datasets"] and entry["axes"] == original["axes"]


def test_a_declared_nearest_downsampling_is_followed(tmp_path, cli):
    """write_multiscale stores the method the caller declares (write_image declares none)."""
    group = zarr.open_group(tmp_path / "a.ome.zarr", mode="w", zarr_format=2)
    write_multiscale([IMAGE[:, ::2 ** k, ::2 ** k] for k in range(3)], group, axes="cyx", fmt=FormatV04(),
                     metadata={"method": "skimage.transform.resize", "kwargs": {"order": 0}})
    result = perturb(cli, tmp_path / "a.ome.zarr")
    assert result.exit_code == 0, result.stderr
    image = ome_levels(tmp_path / "a.tldp.ome.zarr")[Multiscales]
    assert len(image) == 3
    for k, level in enumerate(image):
        np.testing.assert_array_equal(level, image[0][:, ::2 ** k, ::2 ** k])
    manifest = json.loads((tmp_path / "a.tldp.ome.zarr.manifest.json").read_text())
    assert manifest["multiscale_images"][0]["declared_downsampling"] == "skimage.transform.resize"
    assert manifest["multiscale_images"][0]["downsampling"] == "nearest"


def test_odd_sizes_keep_the_input_shapes(tmp_path, cli):
    """ome-zarr-py rounds odd sizes down (45 -> 22 -> 11): the blocks past the last whole one are
    left out, as the declared factor 2 says."""
    group = zarr.open_group(tmp_path / "odd.ome.zarr", mode="w", zarr_format=2)
    write_image(IMAGE[:, :45, :45], group, axes="cyx", fmt=FormatV04(), scale_factors=(2, 4))
    assert perturb(cli, tmp_path / "odd.ome.zarr").exit_code == 0
    image = ome_levels(tmp_path / "odd.tldp.ome.zarr")[Multiscales]
    assert [level.shape for level in image] == [(2, 45, 45), (2, 22, 22), (2, 11, 11)]
    np.testing.assert_array_equal(image[1], mean_2x2(image[0][:, :44, :44]))


def test_an_edge_block_averages_the_elements_it_has():
    level = np.arange(25, dtype=np.float32).reshape(5, 5)
    down = zarr_ome._downsample(level, (2, 2), (3, 3), zarr_ome.MEAN, np.dtype(np.float32))
    assert down[0, 0] == level[:2, :2].mean() and down[2, 2] == 24 and down[0, 2] == (4 + 9) / 2
    assert down[2, 0] == (20 + 21) / 2


def test_a_lower_level_stands_for_the_full_resolution(tmp_path, cli):
    src = make_ome(tmp_path / "a.ome.zarr", FormatV05())
    result = perturb(cli, src, "--dataset", "s2", "--dataset", "labels/cells")
    assert result.exit_code == 0, result.stderr
    assert "s2 is a lower level of multiscale image /: perturbing its full resolution s0" in result.stderr
    manifest = json.loads((tmp_path / "a.tldp.ome.zarr.manifest.json").read_text())
    assert sorted(i["dataset"] for i in manifest["inputs"]) == ["labels/cells/s0", "s0"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_range_naming_the_label_group_is_its_full_resolution(tmp_path, cli, fmt):
    """--range labels/cells=LO:HI names the label image's full resolution, as --dataset does;
    uint32 labels (as segmentation tools write them) need it, the uint8 image does not."""
    group = zarr.open_group(tmp_path / "a.ome.zarr", mode="w", zarr_format=fmt.zarr_format)
    write_image(IMAGE, group, axes="cyx", fmt=fmt)
    write_labels(CELLS.astype(np.uint32), group, name="cells", axes="yx", fmt=fmt)
    base = ("perturb", tmp_path / "a.ome.zarr", "--eps", "1", "--seed", SEED)
    result = cli(*base, "--range", "labels/cells=0:8")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "a.tldp.ome.zarr.manifest.json").read_text())
    assert manifest["value_ranges"] == {"s0": [0, 256], "labels/cells/s0": [0, 8]}
    groups = {tuple(g["value_range"]): g for g in manifest["range_groups"]}
    assert groups[0, 8]["input_dtypes"] == ["uint32"] and groups[0, 8]["declared_by"] == ["--range NAME=LO:HI"]
    assert groups[0, 256]["declared_by"] == ["the uint8 dtype's range (default)"]
    # a lower level stands for it too; naming the image twice is refused
    assert cli(*base, "--range", "labels/cells/s1=0:8", "--out", tmp_path / "b.ome.zarr").exit_code == 0
    result = cli(*base, "--range", "labels/cells=0:8", "--range", "labels/cells/s0=0:8",
                 "--out", tmp_path / "c.ome.zarr")
    assert_one_line_error(result, 2, "labels/cells/s0", "has a range already")


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_image_and_labels_of_other_integer_dtypes_need_no_range(tmp_path, cli, fmt):
    """A uint16 image with uint8 labels: each at its dtype's range, without --range."""
    group = zarr.open_group(tmp_path / "a.ome.zarr", mode="w", zarr_format=fmt.zarr_format)
    write_image(IMAGE.astype(np.uint16) * 200, group, axes="cyx", fmt=fmt)
    write_labels(CELLS, group, name="cells", axes="yx", fmt=fmt)
    result = cli("perturb", tmp_path / "a.ome.zarr", "--eps", "1", "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "a.tldp.ome.zarr"
    manifest = json.loads((tmp_path / "a.tldp.ome.zarr.manifest.json").read_text())
    assert manifest["value_ranges"] == {"s0": [0, 65536], "labels/cells/s0": [0, 256]}
    assert [g["noise_scale"] for g in manifest["range_groups"]] == [256, 65536]
    noisy = ome_levels(out)
    # the labels' noise is of scale 256 (median |noise| = 256 ln 2 = 177), not 65536
    noise = noisy[Label][0].astype(np.int64) - CELLS
    assert abs(np.median(np.abs(noise)) / (256 * np.log(2)) - 1) < 0.1
    assert len(noisy[Multiscales]) == 5 and len(noisy[Label]) == 5


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_image_left_unperturbed_is_refused(tmp_path, cli, fmt):
    src = make_ome(tmp_path / "a.ome.zarr", fmt)
    result = perturb(cli, src, "--dataset", "s0")
    assert_one_line_error(result, 2, "a.ome.zarr", "multiscale image labels/cells unperturbed",
                          "--dataset labels/cells")
    assert not (tmp_path / "a.tldp.ome.zarr").exists()


def test_a_level_that_is_no_whole_downsampling_is_refused(tmp_path, cli):
    src = make_ome(tmp_path / "a.ome.zarr", FormatV04(), labels=False)
    group = zarr.open_group(src, mode="r+")
    attrs = group.attrs.asdict()
    attrs["multiscales"][0]["datasets"][1]["coordinateTransformations"][0]["scale"] = [1.0, 1.5, 1.5]
    group.attrs.put(attrs)
    result = perturb(cli, src)
    assert_one_line_error(result, 1, "a.ome.zarr", "level s1", "not a downsampling", "ratio 1.5")


def test_downsampling_memory_is_one_tile(tmp_path):
    """A 2048 x 2048 level in 256 x 256 chunks: regenerating its levels holds a few chunks,
    never the level (32 MiB as float64)."""
    root = zarr.open_group(tmp_path / "big.zarr", mode="w", zarr_format=3)
    for k in range(3):
        size = 2048 >> k
        level = root.create_array(f"s{k}", shape=(size, size), dtype="float32", chunks=(256, 256))
        if k == 0:
            for row in range(0, size, 256):
                level[row:row + 256] = np.random.default_rng(row).random((256, size), dtype=np.float32)
    pyramid = zarr_ome.Pyramid("", 0, True, ("s0", "s1", "s2"), ((2, 2), (2, 2)), zarr_ome.MEAN, None)
    tracemalloc.start()
    zarr_ome.regenerate(tmp_path / "big.zarr", tmp_path / "big.zarr", pyramid, 3, np.dtype(np.float32))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, peak
    s0 = zarr.open_array(tmp_path / "big.zarr", path="s0")[:512, :512]
    np.testing.assert_allclose(zarr.open_array(tmp_path / "big.zarr", path="s2")[:128, :128],
                               s0.reshape(128, 4, 128, 4).mean(axis=(1, 3)), rtol=1e-6)


def test_resume_regenerates_the_levels(tmp_path):
    """An interrupted run resumed (its partial holding a stale chunk in a lower level)
    equals an uninterrupted one with the same seed."""
    group = zarr.open_group(tmp_path / "a.ome.zarr", mode="w", zarr_format=3)
    write_image(IMAGE, group, axes="cyx", fmt=FormatV05(), scale_factors=(2, 4),
                storage_options={"chunks": (1, 64, 48)})

    def run(out, progress=None, **more):
        return run_perturb(PerturbOptions(input=tmp_path / "a.ome.zarr", out=out, eps=1.0, seed=SEED,
                                          block_elements=64 * 48, **more), progress=progress)

    def stop_after_one_block(done, total):
        raise KeyboardInterrupt

    run(tmp_path / "reference.ome.zarr")
    out = tmp_path / "out.ome.zarr"
    with pytest.raises(Interrupted):
        run(out, progress=stop_after_one_block)
    stale = partial_path(out) / "store" / "s1" / "c" / "5" / "0" / "0"  # no such chunk in the output
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes((partial_path(out) / "store" / "s0" / "c" / "0" / "0" / "0").read_bytes()[:64])
    run(out, resume=True)
    reference = tmp_path / "reference.ome.zarr"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == \
        sorted(p.relative_to(reference) for p in reference.rglob("*"))
    for level in ("s0", "s1", "s2"):
        np.testing.assert_array_equal(zarr.open_array(out, path=level, mode="r")[:],
                                      zarr.open_array(reference, path=level, mode="r")[:])


@pytest.mark.parametrize("fmt", FORMATS)
def test_metadata_computed_from_the_raw_values_is_not_copied(tmp_path, cli, fmt):
    """omero channel windows (the raw min and max) and label properties are statistics of
    the raw image: the output replaces the windows with the declared range (NGFF 0.4
    validators require a window), drops the properties, and the manifest says so."""
    src = tmp_path / "w.ome.zarr"
    group = zarr.open_group(src, mode="w", zarr_format=fmt.zarr_format)
    window = {"min": int(IMAGE.min()), "max": int(IMAGE.max()), "start": 3, "end": 250}
    write_image(IMAGE, group, axes="cyx", fmt=fmt,
                omero={"channels": [{"label": "DNA", "window": window, "color": "0000FF"},
                                    {"label": "actin", "window": window, "color": "FF0000"}]})
    write_labels(CELLS, group, name="cells", axes="yx", fmt=fmt,
                 label_metadata={"properties": [{"label-value": int(v), "area": int((CELLS == v).sum())}
                                                for v in np.unique(CELLS)]})

    def ngff(path: Path, sub: str = "") -> dict:
        attrs = zarr.open_group(path / sub if sub else path, mode="r").attrs.asdict()
        return attrs.get("ome", attrs)

    assert "window" in ngff(src)["omero"]["channels"][0]
    assert "properties" in ngff(src, "labels/cells")["image-label"]
    result = perturb(cli, src)
    assert result.exit_code == 0, result.stderr
    # 2 channels of 64 x 48 and 64 label rows of 48: not "66 records x 3072 elements"
    assert "(66 records of up to 3072 elements;" in result.stderr
    out = tmp_path / "w.tldp.ome.zarr"
    channels = ngff(out)["omero"]["channels"]
    assert [c["label"] for c in channels] == ["DNA", "actin"]
    declared = {"min": 0, "max": 255, "start": 0, "end": 255}  # --range 0:256 of integer data
    assert all(c["window"] == declared for c in channels)
    assert "properties" not in ngff(out, "labels/cells")["image-label"]
    steps = json.loads(Path(str(out) + ".manifest.json").read_text())["postprocessing"]
    assert any("replace the omero channel windows" in s and "[0, 255]" in s for s in steps)
    assert any("image-label properties" in s for s in steps)
    assert set(ome_levels(out)) == {Multiscales, Label}  # ome-zarr-py still reads both
    # ome-zarr-models (pydantic models of the NGFF spec) validates the output as it did the
    # input. Not at 0.5: ome-zarr-py writes labels groups without the version it requires.
    if fmt.version == "0.4":
        Image04.from_zarr(zarr.open_group(src, mode="r"))
        Image04.from_zarr(zarr.open_group(out, mode="r"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_image_names_are_not_copied_unless_kept(tmp_path, cli, fmt):
    """Regression: the free-text names inside the NGFF metadata, multiscales[].name and
    omero.name (bioformats2raw writes the source image's name there, often its file name, which
    can name the patient), were copied raw with the structure they sit in. They are not structure
    readers need: left out and listed under `dropped` (GROUP@multiscales.name, GROUP@omero.name),
    unless --keep names them; the channel labels (DNA), which say what a channel is, stay."""
    src = tmp_path / "n.ome.zarr"
    group = zarr.open_group(src, mode="w", zarr_format=fmt.zarr_format)
    write_image(IMAGE, group, axes="cyx", fmt=fmt, name="alice_smith_biopsy",
                omero={"name": "alice_smith_biopsy.svs [0]",
                       "channels": [{"label": label, "color": color, "window": {"min": 0, "max": 255, "start": 0,
                                                                                "end": 255}}
                                    for label, color in (("DNA", "0000FF"), ("actin", "FF0000"))]})
    write_labels(CELLS, group, name="cells", axes="yx", fmt=fmt)
    result = perturb(cli, src, "--out", tmp_path / "out.ome.zarr")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out.ome.zarr"
    text = "".join(p.read_text() for p in out.rglob("*.json")) + "".join(p.read_text() for p in out.rglob(".z*"))
    manifest = json.loads((tmp_path / "out.ome.zarr.manifest.json").read_text())
    assert "alice" not in text and "alice" not in json.dumps(manifest)
    assert {"/@multiscales.name", "/@omero.name"} <= {e["name"] for e in manifest["dropped"]}
    attrs = zarr.open_group(out, mode="r").attrs.asdict()
    ngff = attrs.get("ome", attrs)
    assert [c["label"] for c in ngff["omero"]["channels"]] == ["DNA", "actin"]
    assert set(ome_levels(out)) == {Multiscales, Label}  # ome-zarr-py still reads both
    if fmt.version == "0.4":
        Image04.from_zarr(zarr.open_group(out, mode="r"))
    kept = perturb(cli, src, "--out", tmp_path / "kept.ome.zarr", "--keep", "@omero.name")
    assert kept.exit_code == 0, kept.stderr
    attrs = zarr.open_group(tmp_path / "kept.ome.zarr", mode="r").attrs.asdict()
    assert attrs.get("ome", attrs)["omero"]["name"] == "alice_smith_biopsy.svs [0]"
    assert "name" not in attrs.get("ome", attrs)["multiscales"][0]


def make_plate(path: Path, fmt) -> Path:
    """A one-row plate of two wells of one field each, as ome-zarr-py writes it, named after the
    patient in its name, its acquisition's name and description, with the acquisition's time and
    each image's OMERO id."""
    root = zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format)
    write_plate_metadata(root, ["A"], ["1", "2"], ["A/1", "A/2"], fmt=fmt, name="alice_smith plate 7",
                         acquisitions=[{"id": 1, "name": "alice_smith 2019-03-04", "description": "Alice Smith, biopsy",
                                        "starttime": 1551657600000}], field_count=1)
    for well in ("A/1", "A/2"):
        group = root.require_group(well)
        write_well_metadata(group, [{"path": "0", "acquisition": 1}], fmt=fmt)
        write_image(IMAGE, group.require_group("0"), axes="cyx", fmt=fmt,
                    omero={"id": 4711, "channels": [{"label": "DNA", "color": "0000FF",
                                                     "window": {"min": 0, "max": 255, "start": 0, "end": 255}}]})
    return path


@pytest.mark.parametrize("fmt", FORMATS)
def test_plate_names_acquisitions_and_omero_ids_are_not_copied_unless_kept(tmp_path, cli, fmt):
    """Regression: a plate's name, its acquisitions' names, descriptions and start times and each
    image's omero.id (its record in the OMERO server it came from) were copied raw with the plate
    and image structure, where multiscales[].name and omero.name were already left out. They are
    left out alike and listed under `dropped` (GROUP@plate.name, GROUP@plate.acquisitions.name,
    ..., GROUP@omero.id), unless --keep names them; the rows, columns, wells and acquisition ids
    readers need stay."""
    src = make_plate(tmp_path / "p.ome.zarr", fmt)
    before = json.dumps(zarr.open_group(src, mode="r").attrs.asdict())
    assert "alice_smith" in before and "1551657600000" in before
    result = perturb(cli, src, "--out", tmp_path / "out.ome.zarr")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out.ome.zarr"
    text = "".join(p.read_text() for p in out.rglob("*.json")) + "".join(p.read_text() for p in out.rglob(".z*"))
    manifest = json.loads((tmp_path / "out.ome.zarr.manifest.json").read_text())
    for secret in ("alice", "Alice", "1551657600000", "4711"):
        assert secret not in text and secret not in json.dumps(manifest), secret
    dropped = {e["name"] for e in manifest["dropped"]}
    assert {"/@plate.name", "/@plate.acquisitions.name", "/@plate.acquisitions.description",
            "/@plate.acquisitions.starttime", "A/1/0@omero.id", "A/2/0@omero.id"} <= dropped
    attrs = zarr.open_group(out, mode="r").attrs.asdict()
    plate = attrs.get("ome", attrs)["plate"]
    assert [w["path"] for w in plate["wells"]] == ["A/1", "A/2"] and plate["acquisitions"] == [{"id": 1}]
    assert [r["name"] for r in plate["rows"]] == ["A"] and [c["name"] for c in plate["columns"]] == ["1", "2"]
    # ome-zarr-py still reads the plate: its two wells' images side by side
    [node] = list(Reader(parse_url(out))())
    assert [type(spec) for spec in node.specs] == [Plate]
    image = zarr.open_group(out / "A" / "1" / "0", mode="r").attrs.asdict()
    level = image.get("ome", image)["multiscales"][0]["datasets"][0]["path"]
    wells = [zarr.open_array(out / well / "0" / level, mode="r")[:] for well in ("A/1", "A/2")]
    np.testing.assert_array_equal(np.asarray(node.data[0]), np.concatenate(wells, axis=-1))
    if fmt.version == "0.4":
        HCS04.from_zarr(zarr.open_group(out, mode="r"))
    kept = perturb(cli, src, "--out", tmp_path / "kept.ome.zarr", "--keep", "@plate.name",
                   "--keep", "A/1/0@omero.id")
    assert kept.exit_code == 0, kept.stderr
    attrs = zarr.open_group(tmp_path / "kept.ome.zarr", mode="r").attrs.asdict()
    assert attrs.get("ome", attrs)["plate"]["name"] == "alice_smith plate 7"
    assert "name" not in attrs.get("ome", attrs)["plate"]["acquisitions"][0]
    image = zarr.open_group(tmp_path / "kept.ome.zarr" / "A" / "1" / "0", mode="r").attrs.asdict()
    assert image.get("ome", image)["omero"]["id"] == 4711


@pytest.mark.parametrize("fmt", FORMATS)
def test_label_colors_listing_the_raw_label_values_are_not_copied(tmp_path, cli, fmt):
    """A label image's `colors` give an entry per label value, which tools write for the
    values the raw labels hold (how many cells, lesions, ...): like its `properties`, a
    statistic of the raw data, and meaningless once noise has scrambled the ids. The output
    leaves them out and the manifest says so."""
    src = tmp_path / "c.ome.zarr"
    group = zarr.open_group(src, mode="w", zarr_format=fmt.zarr_format)
    write_image(IMAGE, group, axes="cyx", fmt=fmt)
    present = [int(v) for v in np.unique(CELLS) if v]
    write_labels(CELLS, group, name="cells", axes="yx", fmt=fmt,
                 label_metadata={"colors": [{"label-value": v, "rgba": [255, 0, 0, 255]} for v in present]})

    def image_label(path: Path) -> dict:
        attrs = zarr.open_group(path / "labels/cells", mode="r").attrs.asdict()
        return attrs.get("ome", attrs)["image-label"]

    assert [c["label-value"] for c in image_label(src)["colors"]] == present
    result = perturb(cli, src)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "c.tldp.ome.zarr"
    assert "colors" not in image_label(out)
    steps = json.loads(Path(str(out) + ".manifest.json").read_text())["postprocessing"]
    assert any("image-label colors" in s for s in steps)
    assert set(ome_levels(out)) == {Multiscales, Label}  # ome-zarr-py still reads both


@pytest.mark.parametrize("fmt", FORMATS)
def test_label_images_stay_integers_under_privunit(tmp_path, cli, fmt):
    """privunit's values are floats; NGFF requires integer label images: the label image is
    written in its own dtype (rounded, clipped: post-processing), which ome-zarr-py's reader
    reads as a label image, and the manifest says so."""
    src = make_ome(tmp_path / "a.ome.zarr", fmt)
    before = tree_digest(src)
    result = cli("perturb", src, "--eps", "8", "--mechanism", "privunit", "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    assert tree_digest(src) == before
    out = tmp_path / "a.tldp.ome.zarr"
    noisy = ome_levels(out)
    assert len(noisy[Label]) == 5 and all(level.dtype == np.uint8 for level in noisy[Label])
    assert all(level.dtype == np.float32 for level in noisy[Multiscales])
    for k, level in enumerate(noisy[Label]):  # still the nearest element of the full resolution
        np.testing.assert_array_equal(level, noisy[Label][0][::2 ** k, ::2 ** k])
    assert not np.array_equal(noisy[Label][0], CELLS)
    manifest = json.loads((tmp_path / "a.tldp.ome.zarr.manifest.json").read_text())
    assert manifest["output_dtype"] == "float32 (label images keep their integer dtype: labels/cells uint8)"
    assert any(step.startswith("round the released values of label image labels/cells") and "[0, 255]" in step
               for step in manifest["postprocessing"])
    plan = cli("plan", src, "--eps", "8", "--mechanism", "privunit", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert json.loads(plan.stdout)["output_dtype"] == manifest["output_dtype"]
    # other mechanisms' float values stay unrounded (tldp evaluate checks their noise)
    plan = cli("plan", src, "--eps", "8", "--sampler", "float", "--json")
    assert plan.exit_code == 0, plan.stderr
    report = json.loads(plan.stdout)
    assert report["calibration"]["values_dtype"] == "float32" and "output_dtype" not in report
