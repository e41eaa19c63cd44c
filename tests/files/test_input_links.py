"""Nothing outside the input is read or copied, and nothing is copied raw in silence:
symbolic links, hidden Zarr nodes and stray files in Zarr stores and image folders."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr
from PIL import Image

from tests.builders import one_line_error, siblings, tree_digest

# zarr warns that consolidated metadata is not part of the format 3 spec.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SECRET = b"TOP-SECRET-4f1c9e do not publish"
VALUES = np.random.default_rng(0).integers(0, 256, (20, 4, 4), dtype=np.uint8)
# What perturb writes for uint8 data: the default exact sampler keeps integers integer (widened).
PERTURBED = np.int16


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret.txt"
    path.write_bytes(SECRET)
    return path


def make_store(path: Path, zarr_format: int, hidden: bool = False) -> Path:
    """A group holding images (20, 4, 4) and labels (20,); with hidden, also .h (20, 4, 4)."""
    group = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    group.create_array("images", shape=VALUES.shape, dtype="uint8", chunks=(5, 4, 4))[:] = VALUES
    group.create_array("labels", shape=(20,), dtype="int64", chunks=(10,))[:] = np.arange(20)
    if hidden:
        group.create_array(".h", shape=VALUES.shape, dtype="uint8", chunks=(5, 4, 4))[:] = VALUES
    return path


def output_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def manifest_of(out: Path) -> dict:
    return json.loads(Path(f"{out}.manifest.json").read_text())


def perturb_ok(cli, *args):
    result = cli("perturb", *args, "--eps", "1", "--seed", "7", "--allow-weak-seed")
    assert result.exit_code == 0, result.stderr
    return result


# --- Zarr stores -----------------------------------------------------------------------

def _link_to_secret_at_root(store, secret):
    os.symlink(secret, store / "notes.txt")
    return "notes.txt"


def _link_named_like_a_chunk(store, secret):
    # Inside an array that is not perturbed, so copied as one of its chunks before.
    chunk = next(p for p in sorted((store / "labels").rglob("*")) if p.is_file() and p.name[0].isdigit())
    chunk.unlink()
    os.symlink(secret, chunk)
    return chunk.relative_to(store).as_posix()


def _link_to_a_directory(store, secret):
    os.symlink(secret.parent, store / "everything")
    return "everything"


def _dangling_link(store, secret):
    os.symlink(store.parent / "gone", store / "labels" / "gone")
    return "labels/gone"


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("plant", [_link_to_secret_at_root, _link_named_like_a_chunk,
                                   _link_to_a_directory, _dangling_link])
def test_link_inside_a_store_is_refused_before_anything_is_written(cli, tmp_path, zarr_format, plant):
    secret = secret_file(tmp_path)
    store = make_store(tmp_path / "store.zarr", zarr_format)
    link = plant(store, secret)
    before, files = siblings(tmp_path), tree_digest(secret)
    result = cli("perturb", store, "--eps", "1", "--out", tmp_path / "out.zarr")
    line = one_line_error(result, 1)
    assert str(store) in line and f"{link} is a symbolic link" in line
    assert not (tmp_path / "out.zarr").exists()
    assert siblings(tmp_path) == before, "something was written next to the output"
    assert tree_digest(secret) == files


def test_the_store_itself_may_be_a_link(cli, tmp_path):
    store = make_store(tmp_path / "store.zarr", 3)
    (tmp_path / "link.zarr").symlink_to(store, target_is_directory=True)
    perturb_ok(cli, tmp_path / "link.zarr", "--dataset", "images", "--out", tmp_path / "out.zarr")
    assert zarr.open_array(tmp_path / "out.zarr", path="images", mode="r").dtype == PERTURBED


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_hidden_array_is_perturbed_like_any_other(cli, tmp_path, zarr_format):
    store = make_store(tmp_path / "store.zarr", zarr_format, hidden=True)
    out = tmp_path / "out.zarr"
    result = perturb_ok(cli, store, "--out", out)
    assert "perturbing arrays .h, images of store.zarr" in result.stderr
    group = zarr.open_group(out, mode="r", use_consolidated=False)
    assert set(dict(group.members())) == {".h", "images"}  # labels: not perturbed, left out
    for name in (".h", "images"):
        perturbed = zarr.open_array(out, path=name, mode="r")
        assert perturbed.dtype == PERTURBED
        assert not np.array_equal(perturbed[:], VALUES), f"{name} was copied raw"
    assert {i["dataset"] for i in manifest_of(out)["inputs"]} == {".h", "images"}

    out = tmp_path / "chosen.zarr"
    perturb_ok(cli, store, "--dataset", ".h", "--keep", "images", "--out", out)
    assert not np.array_equal(zarr.open_array(out, path=".h", mode="r")[:], VALUES)
    np.testing.assert_array_equal(zarr.open_array(out, path="images", mode="r")[:], VALUES)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_hidden_directory_without_metadata_is_a_damaged_store(cli, tmp_path, zarr_format):
    store = make_store(tmp_path / "store.zarr", zarr_format)
    (store / ".h").mkdir()
    (store / ".h" / "0.0.0").write_bytes(VALUES.tobytes())  # an array that lost its metadata
    before = siblings(tmp_path)
    line = one_line_error(cli("perturb", store, "--eps", "1", "--out", tmp_path / "out.zarr"), 1)
    assert str(store) in line and "damaged Zarr store" in line and ".h/" in line
    assert siblings(tmp_path) == before


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_stray_files_are_dropped_or_kept_and_reported(cli, tmp_path, zarr_format):
    store = make_store(tmp_path / "store.zarr", zarr_format)
    (store / ".DS_Store").write_bytes(b"finder")
    (store / "labels" / "README.txt").write_text("labels 0-19")
    (store / "images" / "notes.txt").write_text("raw notes")  # goes with the perturbed chunks
    out = tmp_path / "out.zarr"
    result = perturb_ok(cli, store, "--dataset", "images", "--keep", "labels", "--out", out)
    assert "dropped 3 files (not perturbed, not written: listed in the manifest)" in result.stderr
    assert {d["name"]: d["kind"] for d in manifest_of(out)["dropped"]} == {
        ".DS_Store": "file", "images/notes.txt": "file", "labels/README.txt": "file"}
    assert not (out / ".DS_Store").exists() and not (out / "labels" / "README.txt").exists()
    assert not (out / "images" / "notes.txt").exists()
    assert zarr.open_array(out, path="images", mode="r").dtype == PERTURBED

    out = tmp_path / "kept.zarr"  # --keep copies them, listed as unperturbed
    result = perturb_ok(cli, store, "--dataset", "images", "--keep", "labels", "--keep", ".DS_Store",
                        "--keep", "labels/README.txt", "--out", out)
    assert "copied unchanged: labels, .DS_Store, labels/README.txt (kept by --keep)" in result.stderr
    assert {u["name"]: u["kind"] for u in manifest_of(out)["unperturbed"]} == {
        "labels": "array", ".DS_Store": "file", "labels/README.txt": "file"}
    assert (out / ".DS_Store").read_bytes() == b"finder"
    assert (out / "labels" / "README.txt").read_text() == "labels 0-19"
    assert not (out / "images" / "notes.txt").exists()


def test_store_without_strays_reports_nothing(cli, tmp_path):
    out = tmp_path / "out.zarr"
    result = perturb_ok(cli, make_store(tmp_path / "store.zarr", 3), "--dataset", "images", "--keep", "labels",
                        "--out", out)
    assert "dropped" not in result.stderr and "dropped" not in manifest_of(out)


# --- image folders ---------------------------------------------------------------------

def save_png(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.parametrize("copy_other", [False, True])
def test_links_in_an_image_folder_are_skipped_and_reported(cli, tmp_path, copy_other):
    secret = secret_file(tmp_path)
    outside_png = save_png(tmp_path / "private" / "face.png", seed=1)
    secret_dir = tmp_path / "private"
    src = tmp_path / "photos"
    save_png(src / "a.png", seed=2)
    (src / "notes.txt").write_text("kept")
    os.symlink(outside_png, src / "b.png")
    os.symlink(secret, src / "secret.txt")
    os.symlink(secret_dir, src / "more")
    out = tmp_path / "out"
    result = perturb_ok(cli, src, "--out", out, *(["--copy-other"] if copy_other else []))

    links = ["b.png", "more", "secret.txt"]
    assert f"skipped 3 symbolic links: {', '.join(links)}" in result.stderr
    manifest = manifest_of(out)
    assert manifest["skipped_symbolic_links"] == links
    assert manifest["not_images"] == ["notes.txt"]
    assert [i["path"] for i in manifest["inputs"]] == [str(src / "a.png")]
    written = output_files(out)
    assert set(written) == ({"a.png", "notes.txt"} if copy_other else {"a.png"})
    outside_bytes = [SECRET, outside_png.read_bytes()]
    for name, data in written.items():
        assert not any(secret_bytes in data for secret_bytes in outside_bytes), name
    assert not any(p.is_symlink() for p in out.rglob("*"))


def test_dangling_link_is_skipped_not_an_unreadable_image(cli, tmp_path):
    src = tmp_path / "photos"
    save_png(src / "sub" / "a.png", seed=2)
    os.symlink(tmp_path / "gone.png", src / "sub" / "gone.png")
    result = perturb_ok(cli, src, "--out", tmp_path / "out")
    assert "skipped 1 symbolic link: sub/gone.png" in result.stderr
    assert manifest_of(tmp_path / "out")["skipped_symbolic_links"] == ["sub/gone.png"]


def test_folder_of_links_only_has_no_images(cli, tmp_path):
    src = tmp_path / "photos"
    src.mkdir()
    os.symlink(save_png(tmp_path / "private" / "face.png", seed=1), src / "face.png")
    line = one_line_error(cli("perturb", src, "--eps", "1", "--out", tmp_path / "out"), 1)
    assert f"no images in {src} (found 1 symbolic link)" in line
    assert not (tmp_path / "out").exists()


def test_the_image_folder_itself_may_be_a_link(cli, tmp_path):
    save_png(tmp_path / "photos" / "a.png", seed=2)
    (tmp_path / "link").symlink_to(tmp_path / "photos", target_is_directory=True)
    result = perturb_ok(cli, tmp_path / "link", "--out", tmp_path / "out")
    assert "symbolic link" not in result.stderr
    assert set(output_files(tmp_path / "out")) == {"a.png"}


def test_hdf5_data_kept_in_other_files_is_never_copied_raw(cli, tmp_path):
    import h5py

    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["secret"] = np.arange(10.0) + 0.123456789
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = np.zeros((10, 4, 4), np.uint8)
        f["lnk"] = h5py.ExternalLink("other.h5", "/secret")
        layout = h5py.VirtualLayout(shape=(10,), dtype="f8")
        layout[:] = h5py.VirtualSource("other.h5", "secret", shape=(10,))
        f.create_virtual_dataset("v", layout)
    refused = cli("perturb", tmp_path / "in.h5", "--eps", "1", "--dataset", "x", "--keep", "/v",
                  "--out", tmp_path / "o.h5")  # copied, it would be copied raw
    assert refused.exit_code == 1 and "/v keeps its values in other files" in refused.stderr
    assert not (tmp_path / "o.h5").exists()
    result = cli("perturb", tmp_path / "in.h5", "--eps", "1", "--dataset", "x", "--out", tmp_path / "o.h5",
                 "--json")  # not perturbed: left out
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert "/v" in {d["name"] for d in manifest["dropped"]}
    assert "/lnk" in {d["name"] for d in manifest["dropped"]}  # a link into another file: left out
    secret = (np.arange(10.0) + 0.123456789).tobytes()
    assert secret not in (tmp_path / "o.h5").read_bytes()
    result = cli("perturb", tmp_path / "in.h5", "--eps", "1", "--dataset", "x", "--out", tmp_path / "o.h5",
                 "--keep", "/lnk", "--overwrite", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["external_links"] == ["/lnk -> other.h5:/secret"]
    assert secret not in (tmp_path / "o.h5").read_bytes()  # the link is copied, its target is not
