"""HDF5 input: round trip, dataset selection, detection, layout independence, bad files.

Every test works on real HDF5 files written with h5py in tmp_path.
"""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.builders import RoundTrip, siblings, tree_digest
from tldp_cli.formats import FormatOptions, hdf5, hdf5_storage

IMAGES = np.random.default_rng(1).integers(0, 256, (40, 8, 8), dtype=np.uint8)
# What perturb writes for uint8 data: the default exact sampler keeps integers integer (widened).
PERTURBED = np.int16


def write_sample(path: Path, **image_layout) -> Path:
    """The round-trip input: a group tree with attributes, one perturbable dataset and
    data that must come through untouched."""
    layout = image_layout or {"chunks": (10, 8, 8), "compression": "gzip", "compression_opts": 4,
                              "shuffle": True, "fillvalue": 255}
    with h5py.File(path, "w") as f:
        f.attrs["title"] = "sample"
        f.attrs["version"] = np.int16(3)
        train = f.create_group("train", track_order=True)
        train.attrs["split"] = np.bytes_(b"train")
        train.attrs["scale"] = np.array([0.5, 2.0])
        train.create_dataset("labels", data=np.arange(40, dtype=np.int64) % 10)  # created first
        images = train.create_dataset("images", data=IMAGES, **layout)
        images.attrs["units"] = "intensity"
        images.attrs["empty"] = h5py.Empty("f4")
        f.create_dataset("names", data=[f"item {i}" for i in range(40)], dtype=h5py.string_dtype())
        meta = f.create_group("meta")
        meta.create_dataset("count", data=np.int32(40))
        meta.attrs["source"] = "synthetic"
        f["latest"] = h5py.SoftLink("/train/images")
    return path


def objects(path: Path) -> dict[str, str]:
    """Every name in the file (links not followed) and what it is."""
    found = {}
    with h5py.File(path, "r") as f:
        def visit(name):
            found[name] = type(f.get(name, getlink=True)).__name__
        f.visit_links(visit)
    return found


def assert_same_attrs(a, b):
    assert list(a.attrs) == list(b.attrs), a.name
    for key in a.attrs:
        assert a.attrs.get_id(key).get_type() == b.attrs.get_id(key).get_type(), (a.name, key)
        x, y = a.attrs[key], b.attrs[key]
        if isinstance(x, h5py.Empty):
            assert isinstance(y, h5py.Empty) and x.dtype == y.dtype
        else:
            np.testing.assert_array_equal(x, y)


def run(cli, src, *more):
    # Records of a few uint8 elements keep raw values with probability ~1e-5 at --eps 1, which
    # needs consent (tests/privacy/test_raw_release.py); these tests are about the HDF5 files.
    return cli("perturb", src, "--eps", "1", "--seed", "7", "--allow-weak-seed", "--allow-raw-release", *more)


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


class Hdf5RoundTrip(RoundTrip):
    format = "hdf5"
    # Everything is kept (--keep '*'), so the copy of what is not perturbed is checked whole;
    # what is left out by default: tests/formats/test_leftovers.py.
    extra_args = ("--keep", "*")

    def make_input(self, tmp_path):
        return write_sample(tmp_path / "data.h5")

    def read_arrays(self, path):
        with h5py.File(path, "r") as f:
            return {"/train/images": f["/train/images"][()]}

    def assert_same_structure(self, original, perturbed):
        assert objects(original) == objects(perturbed)
        with h5py.File(original, "r") as a, h5py.File(perturbed, "r") as b:
            assert list(a["train"]) == list(b["train"]) == ["labels", "images"]  # creation order kept
            for name in ["/", "/train", "/meta", "/train/labels", "/train/images", "/names", "/meta/count"]:
                assert_same_attrs(a[name], b[name])
            for name in ["/train/labels", "/names", "/meta/count"]:
                assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
                assert a[name].id.get_type() == b[name].id.get_type(), name
                x, y = a[name][()], b[name][()]
                assert (x.tolist() == y.tolist()) if x.dtype.kind == "O" else x.tobytes() == y.tobytes(), name
            src, out = a["/train/images"], b["/train/images"]
            assert out.dtype == PERTURBED and out.shape == src.shape
            assert out.chunks == src.chunks == (10, 8, 8)
            assert (out.compression, out.compression_opts) == ("gzip", 4)
            assert out.shuffle and not out.fletcher32 and out.scaleoffset is None
            assert out.fillvalue == PERTURBED(255)
            assert b["latest"].name == "/latest" and b.get("latest", getlink=True).path == "/train/images"


def test_source_entry_and_chunking(tmp_path):
    path = write_sample(tmp_path / "data.h5")
    reader = hdf5.open_reader(path, FormatOptions())
    try:
        (job,) = reader.arrays()
        assert job.name == "/train/images" and job.chunk_records == 10
        assert job.source == {"path": str(path), "format": "hdf5", "dataset": "/train/images",
                              "shape": [40, 8, 8], "dtype": "uint8"}
        np.testing.assert_array_equal(job.read(5, 12), IMAGES[5:12])
        assert "/train/images" in reader.messages[0]
    finally:
        reader.close()


def test_blocks_in_any_order(tmp_path):
    """Blocks that straddle chunks, written back to front, land where they belong."""
    path = write_sample(tmp_path / "data.h5")
    reader = hdf5.open_reader(path, FormatOptions())
    out = tmp_path / "out.h5"
    try:
        (job,) = reader.arrays()
        writer = hdf5.create_writer(reader, out, np.dtype("float32"), FormatOptions())
        for start in reversed(range(0, 40, 7)):
            writer.write(job, start, job.read(start, min(start + 7, 40)).astype(np.float32) + 0.5)
        assert writer.close() == [out]
    finally:
        reader.close()
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["/train/images"][()], IMAGES + np.float32(0.5))


def test_default_output_keeps_the_suffix():
    assert hdf5.default_output(Path("d/data.h5")) == Path("d/data.tldp.h5")
    assert hdf5.default_output(Path("scan.hdf5")) == Path("scan.tldp.hdf5")
    assert hdf5.default_output(Path("raw.dat")) == Path("raw.tldp.dat")


def two_candidates(path: Path, features_records: int = 30) -> Path:
    rng = np.random.default_rng(2)
    with h5py.File(path, "w") as f:
        f["images"] = rng.integers(0, 256, (30, 4, 4), dtype=np.uint8)
        f["features"] = rng.integers(0, 256, (features_records, 5), dtype=np.uint8)
        f["labels"] = np.arange(30)
    return path


def test_candidates_with_one_record_count_are_all_perturbed(cli, tmp_path):
    src = two_candidates(tmp_path / "data.h5")
    result = run(cli, src)
    assert result.exit_code == 0, result.stderr
    assert any("/images" in line and "/features" in line and "--dataset" in line
               for line in result.stderr.splitlines()), result.stderr
    with h5py.File(tmp_path / "data.tldp.h5", "r") as b:
        assert b["images"].dtype == b["features"].dtype == PERTURBED
        assert "labels" not in b  # not perturbed: left out (--keep copies it raw)


def test_different_record_counts_ask_for_dataset(cli, tmp_path):
    src = two_candidates(tmp_path / "data.h5", features_records=20)
    result = run(cli, src)
    assert result.exit_code == 2
    line = one_line(result)
    assert "--dataset" in line and "/images" in line and "/features" in line
    assert siblings(tmp_path) == {"data.h5"}


def test_dataset_option_chooses(cli, tmp_path):
    src = two_candidates(tmp_path / "data.h5", features_records=20)
    result = run(cli, src, "--dataset", "features", "--json")  # no leading slash
    assert result.exit_code == 0, result.stderr
    assert '"dataset": "/features"' in result.stdout
    with h5py.File(tmp_path / "data.tldp.h5", "r") as b:
        assert b["features"].dtype == PERTURBED
        assert "images" not in b  # not chosen: left out
    reasons = {d["name"]: d["reason"] for d in json.loads(result.stdout)["dropped"]}
    assert "not chosen" in reasons["/images"]


@pytest.mark.parametrize("dataset", ["/nope", "/train", "/names", "/meta/count", "latest"])
def test_bad_dataset_option(cli, tmp_path, dataset):
    src = write_sample(tmp_path / "data.h5")
    before = siblings(tmp_path)
    result = run(cli, src, "--dataset", dataset)
    assert result.exit_code == 1
    line = one_line(result)
    assert str(src) in line and dataset.lstrip("/") in line
    assert siblings(tmp_path) == before


def test_detected_by_content(cli, tmp_path):
    src = write_sample(tmp_path / "data.dat")
    result = run(cli, src)
    assert result.exit_code == 0, result.stderr
    with h5py.File(tmp_path / "data.tldp.dat", "r") as f:
        assert f["/train/images"].dtype == PERTURBED


def test_user_block_is_detected_and_kept_by_keep(cli, tmp_path):
    src = tmp_path / "ub.h5"
    with h5py.File(src, "w", userblock_size=1024) as f:
        f["x"] = IMAGES
    with open(src, "r+b") as f:
        f.write(b"a user block")
    assert hdf5.can_open(src)
    result = run(cli, src, "--keep", "userblock")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "ub.tldp.h5"
    assert out.read_bytes()[:1024] == src.read_bytes()[:1024]
    with h5py.File(out, "r") as f:
        assert f.userblock_size == 1024 and f["x"].dtype == PERTURBED


@pytest.mark.parametrize("chunks", [(7, 8, 8), None], ids=["rechunked", "contiguous"])
def test_layout_does_not_change_the_noise(cli, tmp_path, chunks):
    write_sample(tmp_path / "a.h5")
    write_sample(tmp_path / "b.h5", chunks=chunks)
    for name in ("a", "b"):
        assert run(cli, tmp_path / f"{name}.h5").exit_code == 0
    with h5py.File(tmp_path / "a.tldp.h5", "r") as a, h5py.File(tmp_path / "b.tldp.h5", "r") as b:
        assert a["/train/images"].chunks != b["/train/images"].chunks
        assert a["/train/images"][()].tobytes() == b["/train/images"][()].tobytes()


def object_times(path: Path) -> dict[str, int]:
    """The modification time HDF5 stores in each object's header (0: none stored)."""
    with h5py.File(path, "r") as f:
        times = {"/": h5py.h5g.get_objinfo(f.id, b"/").mtime}

        def visit(name):
            times[name] = h5py.h5g.get_objinfo(f.id, name.encode()).mtime
        f.visit(visit)
    return times


def test_seeded_runs_write_the_same_bytes_with_no_object_times(cli, tmp_path):
    """A seeded run is bit-identical (docs/perturb.md), so the output stores no object times:
    HDF5 stamps each group's and dataset's header with the time it is created unless told
    not to, and the output's groups and root once carried the run's clock (a second later,
    other bytes and another sha256 in the manifest), whatever the input held. Its object copy
    kept an input dataset's own times too (as HDF5's C library, MATLAB and others write them:
    when the data was recorded), which a copied dataset no longer carries, its values,
    chunks and filters as they were."""
    import time

    src = write_sample(tmp_path / "data.h5")
    stamped = {"chunked": {"chunks": (10,), "compression": "gzip", "shuffle": True}, "contiguous": {}}
    with h5py.File(src, "a") as f:  # datasets the input stamps itself, copied raw (--keep)
        for name, layout in stamped.items():
            f.create_dataset(f"stamped/{name}", data=np.arange(40.0) * 1.5, track_times=True, **layout)
    assert object_times(src)["stamped/chunked"] > 0 and object_times(src)["train"] == 0
    digests = []
    for name in ("a.h5", "b.h5"):
        assert run(cli, src, "--out", tmp_path / name, "--keep", "*").exit_code == 0
        digests.append(json.loads((tmp_path / f"{name}.manifest.json").read_text())["outputs"][0]["sha256"])
        assert set(object_times(tmp_path / name).values()) == {0}, object_times(tmp_path / name)
        time.sleep(1.1)  # HDF5 stores times in whole seconds
    assert digests[0] == digests[1]
    assert (tmp_path / "a.h5").read_bytes() == (tmp_path / "b.h5").read_bytes()
    with h5py.File(src, "r") as a, h5py.File(tmp_path / "a.h5", "r") as b:
        for name, layout in stamped.items():
            x, y = a[f"stamped/{name}"], b[f"stamped/{name}"]
            assert y[()].tobytes() == x[()].tobytes() and (y.chunks, y.compression, y.shuffle) == (
                x.chunks, x.compression, x.shuffle)
            if x.chunks:
                assert y.id.read_direct_chunk((10,)) == x.id.read_direct_chunk((10,))  # copied compressed


@pytest.mark.parametrize("layout", [
    {"chunks": (7, 8, 8)}, {"chunks": None}, {"chunks": (7, 8, 8), "dtype": ">f4"}, {"shape": (40 * 64,)},
    {"chunks": (7, 8, 8), "userblock_size": 1024},
], ids=["chunked", "contiguous", "big-endian", "one-dimensional", "user-block"])
def test_plain_storage_is_read_beside_hdf5_as_hdf5_reads_it(tmp_path, layout):
    """Unfiltered datasets are read with plain file reads at the places HDF5 lists;
    every range (inside one chunk, across chunks, the partial last chunk) as h5py gives it."""
    data = IMAGES.astype(layout.get("dtype", IMAGES.dtype)).reshape(layout.get("shape", IMAGES.shape))
    with h5py.File(tmp_path / "x.h5", "w", userblock_size=layout.get("userblock_size")) as f:
        f.create_dataset("x", data=data, chunks=layout.get("chunks"))
    reader = hdf5.open_reader(tmp_path / "x.h5", FormatOptions(datasets=["x"]))
    job = reader.arrays()[0]
    assert job.read.placement is not None
    for start, stop in [(0, 40), (3, 5), (5, 16), (35, 40), (0, 1)]:
        scale = data.shape[0] // 40
        block = job.read(start * scale, stop * scale)
        assert block.dtype == data.dtype
        np.testing.assert_array_equal(block, data[start * scale:stop * scale])
    reader.close()


@pytest.mark.parametrize("layout", [
    {"chunks": (10, 8, 8), "compression": "gzip"}, {"chunks": (10, 4, 8)}, {"chunks": (10, 8, 8), "data": None},
], ids=["filtered", "partial-records", "unwritten"])
def test_other_storage_is_read_through_hdf5(tmp_path, layout):
    with h5py.File(tmp_path / "x.h5", "w") as f:
        data = layout.pop("data", IMAGES)
        f.create_dataset("x", shape=IMAGES.shape, dtype=IMAGES.dtype, data=data, **layout)
        assert hdf5_storage.placement_of(f["x"]) is None


def test_plain_output_is_written_beside_hdf5_as_hdf5_writes_it(cli, tmp_path, monkeypatch):
    """The same run written through HDF5 (no dataset placed) and beside it: the same values
    where h5py finds them, in both layouts."""
    write_sample(tmp_path / "c.h5", chunks=(7, 8, 8))
    write_sample(tmp_path / "d.h5", chunks=None)
    for name in ("c", "d"):
        assert run(cli, tmp_path / f"{name}.h5").exit_code == 0
    monkeypatch.setattr(hdf5_storage, "MAX_PLACED_CHUNKS", 0)  # every dataset through HDF5
    for name in ("c", "d"):
        assert run(cli, tmp_path / f"{name}.h5", "--out", tmp_path / f"{name}-hdf5.h5").exit_code == 0
    monkeypatch.undo()
    for name in ("c", "d"):
        with h5py.File(tmp_path / f"{name}.tldp.h5", "r") as a, h5py.File(tmp_path / f"{name}-hdf5.h5", "r") as b:
            placed, through = a["/train/images"], b["/train/images"]
            assert placed.chunks == through.chunks and placed.dtype == through.dtype == PERTURBED
            assert hdf5_storage.placement_of(placed) is not None
            assert placed[()].tobytes() == through[()].tobytes()
            assert np.abs(placed[()].astype(int) - IMAGES).max() > 0


def test_hard_link_alias_gets_the_perturbed_data(cli, tmp_path):
    src = write_sample(tmp_path / "data.h5")
    with h5py.File(src, "a") as f:
        f["alias"] = f["/train/images"]
    result = run(cli, src, "--dataset", "/train/images", "--dataset", "alias", "--json")
    assert result.exit_code == 0, result.stderr
    assert len(json.loads(result.stdout)["inputs"]) == 1  # perturbed once
    with h5py.File(tmp_path / "data.tldp.h5", "r") as f:
        assert f["alias"] == f["/train/images"]  # one object, two names
        assert f["alias"].dtype == PERTURBED


def test_external_links_are_dropped_unless_kept(cli, tmp_path):
    """Regression: a link into another file was copied into the output as a link, so its target's
    file name and path (raw metadata: whose record it is) left with the release, outside the
    certificate. It is now left out and listed under `dropped`, and copied as a link (as before)
    only when --keep names it."""
    patients = tmp_path / "data" / "patients"
    patients.mkdir(parents=True)
    with h5py.File(patients / "john_smith.h5", "w") as f:
        f["scans/2019-03-04"] = np.arange(10.0)
    src = write_sample(tmp_path / "data.h5")
    with h5py.File(src, "a") as f:
        f["meta/previous"] = h5py.ExternalLink(str(patients / "john_smith.h5"), "/scans/2019-03-04")
        assert f["meta/previous"].shape == (10,)  # the link resolves
    result = run(cli, src, "--dataset", "/train/images", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    out = tmp_path / "data.tldp.h5"
    with h5py.File(out, "r") as f:
        assert "previous" not in f["meta"]
        assert isinstance(f.get("latest", getlink=True), h5py.SoftLink)  # links inside the file stay
    assert b"john_smith" not in out.read_bytes() and "john_smith" not in result.stdout
    dropped = {d["name"]: d for d in manifest["dropped"]}
    assert dropped["/meta/previous"]["kind"] == "external link"
    assert "another file" in dropped["/meta/previous"]["reason"]
    assert "external_links" not in manifest

    result = run(cli, src, "--dataset", "/train/images", "--keep", "/meta/previous", "--json", "--overwrite")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    with h5py.File(out, "r") as f:
        link = f["meta"].get("previous", getlink=True)
        assert isinstance(link, h5py.ExternalLink)
        assert (link.filename, link.path) == (str(patients / "john_smith.h5"), "/scans/2019-03-04")
        np.testing.assert_array_equal(f["meta/previous"][()], np.arange(10.0))  # h5py follows it
    assert {"name": "/meta/previous", "kind": "external link", "reason": "kept by --keep"} in manifest["unperturbed"]
    assert manifest["external_links"] == [f"/meta/previous -> {patients / 'john_smith.h5'}:/scans/2019-03-04"]
    assert "/meta/previous" not in {d["name"] for d in manifest["dropped"]}


def test_a_soft_link_to_a_dataset_left_out_is_left_out_too(cli, tmp_path):
    """Regression: a soft link to a dataset the run leaves out (/train/labels) was copied, so the
    output held a link to nothing, unlisted (h5py's get gives None, h5dump an error). It is left
    out with its target and listed; --keep naming the target keeps both."""
    src = write_sample(tmp_path / "data.h5")
    with h5py.File(src, "a") as f:
        f["meta/labels"] = h5py.SoftLink("/train/labels")
    for kept in (False, True):
        out = tmp_path / f"out-{kept}.h5"
        result = run(cli, src, "--out", out, "--json", *(["--keep", "/train/labels"] if kept else []))
        assert result.exit_code == 0, result.stderr
        dropped = {(d["name"], d["kind"]) for d in json.loads(result.stdout)["dropped"]}
        with h5py.File(out, "r") as f:
            assert f.get("latest", getlink=True).path == "/train/images" and f["latest"] == f["/train/images"]
            if kept:
                assert f["meta/labels"] == f["/train/labels"]
                assert ("/meta/labels", "soft link") not in dropped
            else:
                assert "labels" not in f["meta"] and "labels" not in f["train"]
                assert {("/train/labels", "dataset"), ("/meta/labels", "soft link")} <= dropped


def test_integer_scaleoffset_is_dropped_with_a_note(cli, tmp_path):
    src = tmp_path / "so.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", data=IMAGES.astype(np.int16), chunks=(10, 8, 8), scaleoffset=0)
    result = run(cli, src)
    assert result.exit_code == 0, result.stderr
    assert "scale-offset" in result.stderr
    with h5py.File(tmp_path / "so.tldp.h5", "r") as f:
        assert f["x"].scaleoffset is None and f["x"].chunks == (10, 8, 8)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_file(cli, tmp_path, damage):
    whole = write_sample(tmp_path / "whole.h5").read_bytes()
    src = tmp_path / "bad.h5"
    if damage == "truncated":
        src.write_bytes(whole[:2000])
    else:
        src.write_bytes(hdf5.SIGNATURE + bytes(range(256)) * 16)
    (tmp_path / "whole.h5").unlink()
    before = tree_digest(src)
    result = run(cli, src)
    assert result.exit_code == 1
    assert str(src) in one_line(result) and "Traceback" not in result.output
    assert siblings(tmp_path) == {"bad.h5"}
    assert tree_digest(src) == before


@pytest.mark.slow
def test_a_file_another_program_writes_says_so(cli, tmp_path):
    """HDF5 refuses the read lock while another process has the file open for writing: that
    was reported as "it may be truncated or corrupt"."""
    import subprocess
    import sys

    src = write_sample(tmp_path / "busy.h5")
    writer = subprocess.Popen([sys.executable, "-c", "import sys, h5py; f = h5py.File(sys.argv[1], 'a'); "
                               "print('open', flush=True); sys.stdin.read()", str(src)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        result = run(cli, src)
    finally:
        writer.communicate("")
    assert result.exit_code == 1
    line = one_line(result)
    assert str(src) in line and "another program has the HDF5 file open for writing" in line
    assert "corrupt" not in line


def test_float_dataset_needs_a_range(cli, tmp_path):
    src = tmp_path / "f.h5"
    with h5py.File(src, "w") as f:
        f["features"] = np.random.default_rng(3).random((20, 6))
    result = run(cli, src)
    assert result.exit_code == 2 and "--range" in one_line(result)
    assert siblings(tmp_path) == {"f.h5"}
    result = run(cli, src, "--range", "0:1")
    assert result.exit_code == 0, result.stderr
    with h5py.File(tmp_path / "f.tldp.h5", "r") as f:
        assert f["features"].dtype == np.float32 and f["features"].shape == (20, 6)


def test_references_point_into_the_output(cli, tmp_path):
    """Dimension scales and other references name objects by address; the output's
    must lead to the output's objects."""
    src = write_sample(tmp_path / "data.h5")
    with h5py.File(src, "a") as f:
        f["/train/index"] = np.arange(40)
        f["/train/index"].make_scale("index")
        f["/train/images"].dims[0].attach_scale(f["/train/index"])
        f.attrs["meta"] = f["meta"].ref
        f.attrs["corner"] = f["/train/images"].regionref[:2, :3, 0]
        f.create_dataset("pointers", data=[f["/train/labels"].ref, f["names"].ref], dtype=h5py.ref_dtype)
    assert run(cli, src, "--keep", "*").exit_code == 0
    with h5py.File(tmp_path / "data.tldp.h5", "r") as f:
        images = f["/train/images"]
        assert images.dtype == PERTURBED and images.dims[0].keys() == ["index"]
        assert f[images.dims[0][0].attrs["REFERENCE_LIST"][0]["dataset"]] == images
        assert f[f.attrs["meta"]].name == "/meta"
        assert f[f.attrs["corner"]] == images
        np.testing.assert_array_equal(images[f.attrs["corner"]], images[:2, :3, :1])
        assert [f[r].name for r in f["pointers"][()]] == ["/train/labels", "/names"]


def write_globbed(path: Path) -> Path:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["grp/a"] = rng.uniform(0, 1, (10, 4)).astype(np.float32)
        f["grp/b"] = rng.uniform(0, 1, (10, 3)).astype(np.float32)
        f["grp/name"] = np.array([b"x"] * 10)
        f["labels"] = np.arange(10)
    return path


def test_dataset_takes_globs_as_exclude_does(cli, tmp_path):
    """Was: --dataset 'grp/*' was read as a dataset's path and refused (no such dataset)."""
    src = write_globbed(tmp_path / "d.h5")
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--dataset", "grp/*", "--exclude", "*/b",
                 "--json")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert [i["dataset"] for i in m["inputs"]] == ["/grp/a"]  # /grp/name is not numeric, /grp/b excluded
    with h5py.File(src) as before, h5py.File(tmp_path / "d.tldp.h5") as after:
        assert not np.array_equal(after["grp/a"][()], before["grp/a"][()])
        np.testing.assert_array_equal(after["grp/b"][()], before["grp/b"][()])
        assert "labels" not in after


@pytest.mark.parametrize("pattern,fragment", [
    ("x*", "dataset /x*: no such dataset in the file"),
    ("grp/n*", "--dataset /grp/n* matches no numeric dataset to perturb")])
def test_a_dataset_glob_that_matches_nothing_is_refused(cli, tmp_path, pattern, fragment):
    from tests.builders import assert_one_line_error

    src = write_globbed(tmp_path / "d.h5")
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--range", "0:1", "--dataset", pattern), 1,
                          str(src), fragment)
    assert siblings(tmp_path) == before
