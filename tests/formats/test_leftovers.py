"""What a run writes besides the perturbed arrays (formats/leftovers.py): datasets, arrays,
attributes, metadata and files that are not perturbed are left out and listed in the
manifest's `dropped` unless they are structural metadata, numeric coordinates, or named by
--keep (then copied raw and listed in `unperturbed`); --copy-other never copies data.

Every input is written by the library people use (h5py, xarray/netCDF4, zarr-python,
safetensors, Pillow) and every output read back with it.
"""

import gzip
import json
import struct
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from PIL import Image

from tests.builders import assert_one_line_error, siblings, validate_manifest

xr = pytest.importorskip("xarray")
netCDF4 = pytest.importorskip("netCDF4")
pytest.importorskip("h5netcdf")

IMAGES = np.random.default_rng(4).integers(0, 256, (12, 6, 6), dtype=np.uint8)
NAMES = ["alice smith", "bob jones", "carol white"]


def perturb(cli, src: Path, out: Path, *more) -> tuple[dict, str]:
    result = cli("perturb", src, "--eps", "1", "--out", out, "--allow-raw-release", *more)
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    validate_manifest(manifest)
    return manifest, result.stderr


def by_name(entries: list[dict]) -> dict[str, dict]:
    return {entry["name"]: entry for entry in entries}


def file_bytes(path: Path) -> bytes:
    return path.read_bytes() if path.is_file() else b"".join(p.read_bytes() for p in path.rglob("*")
                                                              if p.is_file())


# --- HDF5 -----------------------------------------------------------------------------

def hdf5_study(path: Path) -> Path:
    """An image dataset beside a table of names and ages, a string dataset of names and
    attributes computed from the images."""
    with h5py.File(path, "w") as f:
        f.attrs["Conventions"] = "CF-1.8"
        f.attrs["title"] = "scans of three patients"
        images = f.create_dataset("images", data=IMAGES, chunks=(4, 6, 6))
        images.attrs["units"] = "counts"
        images.attrs["mean_intensity"] = np.float64(IMAGES.mean())
        images.attrs["max_value"] = np.uint8(IMAGES.max())
        table = np.zeros(3, dtype=[("name", "S16"), ("age", "i4")])
        table["name"], table["age"] = [n.encode() for n in NAMES], [31, 45, 52]
        f.create_dataset("people", data=table)
        f.create_dataset("names", data=NAMES, dtype=h5py.string_dtype())
    return path


def test_hdf5_tables_strings_and_statistics_are_left_out(cli, tmp_path):
    src = hdf5_study(tmp_path / "study.h5")
    out = tmp_path / "out.h5"
    manifest, stderr = perturb(cli, src, out)
    with h5py.File(out, "r") as f:
        assert list(f) == ["images"]
        assert dict(f.attrs) == {"Conventions": "CF-1.8"}
        assert dict(f["images"].attrs) == {"units": "counts"}
    assert not any(name.encode() in out.read_bytes() for name in NAMES)
    dropped = by_name(manifest["dropped"])
    assert set(dropped) == {"/people", "/names", "/@title", "/images@mean_intensity", "/images@max_value"}
    assert dropped["/people"]["kind"] == "dataset" and "compound" in dropped["/people"]["reason"]
    assert "strings" in dropped["/names"]["reason"]
    assert dropped["/images@max_value"]["kind"] == "attribute"
    assert "unperturbed" not in manifest
    assert "dropped 2 datasets and 3 attributes (not perturbed, not written" in stderr


def test_hdf5_keep_copies_one_raw_and_lists_it(cli, tmp_path):
    src = hdf5_study(tmp_path / "study.h5")
    out = tmp_path / "out.h5"
    manifest, stderr = perturb(cli, src, out, "--keep", "/names", "--keep", "images@mean_intensity")
    with h5py.File(src, "r") as a, h5py.File(out, "r") as b:
        assert sorted(b) == ["images", "names"]
        assert b["names"].asstr()[()].tolist() == NAMES
        assert b["images"].attrs["mean_intensity"] == a["images"].attrs["mean_intensity"]
        assert "max_value" not in b["images"].attrs
    unperturbed = by_name(manifest["unperturbed"])
    assert set(unperturbed) == {"/names", "/images@mean_intensity"}
    assert {u["reason"] for u in unperturbed.values()} == {"kept by --keep"}
    assert unperturbed["/names"]["shape"] == [3] and unperturbed["/names"]["kind"] == "dataset"
    assert set(by_name(manifest["dropped"])) == {"/people", "/@title", "/images@max_value"}
    assert "copied unchanged: /names, /images@mean_intensity (kept by --keep)" in stderr


def test_hdf5_attributes_left_out_of_a_copied_object_leave_no_bytes(cli, tmp_path):
    """A dataset kept raw and a named datatype are copied whole; the attributes the manifest
    lists as dropped ("not written") must not be in the output file's bytes either."""
    src = tmp_path / "kept.h5"
    with h5py.File(src, "w") as f:
        f["images"] = IMAGES
        f["labels"] = np.arange(len(IMAGES))
        f["labels"].attrs["who"] = "ZQX labels of alice smith"
        f["labels"].attrs["units"] = "1"
        f["record_t"] = np.dtype([("name", "S16"), ("age", "i4")])
        f["record_t"].attrs["note"] = "ZQX type of bob jones"
    out = tmp_path / "out.h5"
    manifest, _ = perturb(cli, src, out, "--keep", "/labels")
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["labels"][()], np.arange(len(IMAGES)))
        assert dict(f["labels"].attrs) == {"units": "1"} and dict(f["record_t"].attrs) == {}
    assert {"/labels@who", "/record_t@note"} <= set(by_name(manifest["dropped"]))
    assert b"ZQX" not in out.read_bytes()


def test_hdf5_user_block_is_zeroed_and_listed_unless_kept(cli, tmp_path):
    """HDF5 leaves the bytes before its data to other programs: free content, copied only
    when --keep names it; the output keeps its size (and stays HDF5) with zeros in it."""
    src = tmp_path / "ub.h5"
    with h5py.File(src, "w", userblock_size=512) as f:
        f["images"] = IMAGES
    with open(src, "r+b") as f:
        f.write(b"ZQX scans of alice smith")
    out = tmp_path / "out.h5"
    manifest, stderr = perturb(cli, src, out)
    with h5py.File(out, "r") as f:
        assert f.userblock_size == 512 and f["images"].shape == IMAGES.shape
    assert out.read_bytes()[:512] == bytes(512)
    assert by_name(manifest["dropped"])["userblock"]["kind"] == "user block"
    assert "dropped 1 user block" in stderr
    kept, _ = perturb(cli, src, tmp_path / "kept.h5", "--keep", "userblock")
    assert (tmp_path / "kept.h5").read_bytes()[:512] == src.read_bytes()[:512]
    assert by_name(kept["unperturbed"])["userblock"]["reason"] == "kept by --keep"


def test_hdf5_soft_links_to_nothing_are_left_out_and_links_to_data_kept(cli, tmp_path):
    src = hdf5_study(tmp_path / "study.h5")
    with h5py.File(src, "a") as f:
        del f["names"], f["people"]
        f["latest"] = h5py.SoftLink("/images")
        f["patient"] = h5py.SoftLink("/scans/Alice Smith 1972-03-04")  # holds nothing: free text
    out = tmp_path / "out.h5"
    manifest, _ = perturb(cli, src, out)
    with h5py.File(out, "r") as f:
        assert sorted(f) == ["images", "latest"] and f.get("latest", getlink=True).path == "/images"
    assert b"Alice" not in out.read_bytes()
    dropped = by_name(manifest["dropped"])
    assert dropped["/patient"]["kind"] == "soft link" and "holds nothing" in dropped["/patient"]["reason"]
    kept, _ = perturb(cli, src, tmp_path / "kept.h5", "--keep", "/patient")
    with h5py.File(tmp_path / "kept.h5", "r") as f:
        assert f.get("patient", getlink=True).path == "/scans/Alice Smith 1972-03-04"
    assert by_name(kept["unperturbed"])["/patient"]["kind"] == "soft link"


def test_a_dimension_scale_of_names_keeps_its_dimension(cli, tmp_path):
    src = tmp_path / "scaled.h5"
    with h5py.File(src, "w") as f:
        data = f.create_dataset("data", data=IMAGES[:3, 0, :4])
        who = f.create_dataset("who", data=NAMES, dtype=h5py.string_dtype())
        who.make_scale("who")
        data.dims[0].attach_scale(who)
        x = f.create_dataset("x", data=np.arange(4.0))
        x.make_scale("x")
        data.dims[1].attach_scale(x)
    out = tmp_path / "out.h5"
    manifest, _ = perturb(cli, src, out)
    with h5py.File(out, "r") as f:
        assert f["data"].dims[0].keys() == ["who"] and f["data"].dims[1].keys() == ["x"]
        assert f["who"].dtype == np.dtype(">f4") and np.isnan(f["who"][()]).all()  # no names left
        np.testing.assert_array_equal(f["x"][()], np.arange(4.0))
    assert not any(name.encode() in out.read_bytes() for name in NAMES)
    assert "dimension stays" in by_name(manifest["dropped"])["/who"]["reason"]
    assert by_name(manifest["unperturbed"])["/x"]["reason"] == "coordinate"


def test_a_keep_that_matches_nothing_is_refused(cli, tmp_path):
    src = hdf5_study(tmp_path / "study.h5")
    before = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1", "--keep", "/nmes")
    assert_one_line_error(result, 2, str(src), "--keep /nmes matches no")
    assert siblings(tmp_path) == before
    np.save(tmp_path / "x.npy", IMAGES)
    assert_one_line_error(cli("perturb", tmp_path / "x.npy", "--eps", "1", "--keep", "x"), 2, "--keep")


def test_plan_lists_what_perturb_drops_and_keeps(cli, tmp_path):
    src = hdf5_study(tmp_path / "study.h5")
    manifest, _ = perturb(cli, src, tmp_path / "out.h5", "--keep", "/names")
    result = cli("plan", src, "--eps", "1", "--keep", "/names", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["dropped"] == manifest["dropped"] and plan["unperturbed"] == manifest["unperturbed"]
    assert "copied unchanged: /names (kept by --keep); dropped 1 dataset and 3 attributes" in result.stderr
    assert not (tmp_path / "study.tldp.h5").exists()


# --- netCDF ---------------------------------------------------------------------------

def climate_dataset():
    rng = np.random.default_rng(6)
    return xr.Dataset(
        {"t2m": (("person", "lat"), rng.uniform(250, 300, (6, 4)).astype(np.float32),
                 {"units": "K", "long_name": "temperature at 2 m", "comment": "measured at alice's house",
                  "grid_mapping": "crs"}),
         "score": (("person",), np.arange(6, dtype=np.int16), {"comment": "ages of the people"}),
         "crs": ((), np.int32(0), {"grid_mapping_name": "latitude_longitude", "semi_major_axis": 6378137.0})},
        coords={"lat": ("lat", [10.0, 20.0, 30.0, 40.0], {"units": "degrees_north"}),
                "person": ("person", [f"patient {n}" for n in "ABCDEF"])},
        attrs={"Conventions": "CF-1.8", "history": "written by bob on his laptop",
               "comment": "do not share", "source": "hospital records"})


@pytest.mark.parametrize("engine", ["netcdf4", "h5netcdf"])
def test_netcdf_free_text_is_left_out_and_the_output_stays_netcdf(cli, tmp_path, engine):
    src = tmp_path / "in.nc"
    climate_dataset().to_netcdf(src, engine=engine)
    out = tmp_path / "out.nc"
    manifest, stderr = perturb(cli, src, out, "--range", "250:300", "--dataset", "t2m")
    for read in ("netcdf4", "h5netcdf"):
        with xr.open_dataset(out, engine=read) as ds:
            assert ds.attrs == {"Conventions": "CF-1.8"}
            assert ds["t2m"].attrs == {"units": "K", "long_name": "temperature at 2 m", "grid_mapping": "crs"}
            assert set(ds.variables) == {"t2m", "lat", "crs"} and ds.sizes == {"person": 6, "lat": 4}
            assert ds["crs"].attrs == {"grid_mapping_name": "latitude_longitude", "semi_major_axis": 6378137.0}
            np.testing.assert_array_equal(ds["lat"].values, [10.0, 20.0, 30.0, 40.0])
            assert ds["lat"].attrs == {"units": "degrees_north"}
    with netCDF4.Dataset(out) as ds:  # the names' coordinate variable is gone, its dimension stays
        assert ds.dimensions["person"].size == 6 and "person" not in ds.variables
    data = out.read_bytes()
    for secret in (b"alice", b"bob", b"patient", b"hospital", b"do not share", b"ages of"):
        assert secret not in data, secret
    # (the attributes of a dataset left out go with it, unlisted)
    assert set(by_name(manifest["dropped"])) == {"/person", "/score", "/@history", "/@comment", "/@source",
                                                 "/t2m@comment"}
    assert by_name(manifest["unperturbed"]) == {
        "/lat": {"name": "/lat", "kind": "dataset", "shape": [4], "dtype": "float64", "reason": "coordinate"},
        "/crs": {"name": "/crs", "kind": "dataset", "shape": [], "dtype": "int32", "reason": "grid mapping"}}
    assert "/crs (grid mapping); /lat (coordinate); dropped 2 datasets and 4 attributes" in stderr


@pytest.mark.parametrize("engine", ["netcdf4", "h5netcdf"])
def test_netcdf_keep_brings_back_history_and_the_names(cli, tmp_path, engine):
    src = tmp_path / "in.nc"
    climate_dataset().to_netcdf(src, engine=engine)
    out = tmp_path / "out.nc"
    manifest, _ = perturb(cli, src, out, "--range", "250:300", "--dataset", "t2m",
                          "--keep", "@history", "--keep", "/person")
    with xr.open_dataset(out, engine=engine) as ds:
        assert ds.attrs == {"Conventions": "CF-1.8", "history": "written by bob on his laptop"}
        assert ds["person"].values.tolist() == [f"patient {n}" for n in "ABCDEF"]
    with netCDF4.Dataset(out) as ds:
        assert ds["person"][:].tolist() == [f"patient {n}" for n in "ABCDEF"]
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {
        "/lat": "coordinate", "/crs": "grid mapping", "/person": "kept by --keep", "/@history": "kept by --keep"}


# --- Zarr -----------------------------------------------------------------------------

@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zarr_free_text_arrays_and_files_are_left_out(cli, tmp_path, zarr_format):
    src = tmp_path / "in.zarr"
    ds = climate_dataset().drop_vars("person")
    ds["names"] = ("person", NAMES * 2)
    ds.to_zarr(src, zarr_format=zarr_format, consolidated=True)
    (src / "README.txt").write_text("patients: alice smith, bob jones")
    out = tmp_path / "out.zarr"
    manifest, stderr = perturb(cli, src, out, "--range", "250:300", "--dataset", "t2m")
    after = xr.open_zarr(out)  # through the consolidated metadata
    assert after.attrs == {"Conventions": "CF-1.8"}
    assert set(after.variables) == {"t2m", "lat", "crs"}
    assert after["t2m"].attrs == {"units": "K", "long_name": "temperature at 2 m", "grid_mapping": "crs"}
    assert dict(zarr.open_group(out, mode="r", use_consolidated=False).attrs) == {"Conventions": "CF-1.8"}
    assert not (out / "README.txt").exists() and not (out / "names").exists()
    data = file_bytes(out)
    for secret in (b"alice", b"bob", b"hospital", b"do not share"):
        assert secret not in data, secret
    dropped = by_name(manifest["dropped"])
    assert set(dropped) == {"names", "score", "README.txt", "/@history", "/@comment", "/@source",
                            "t2m@comment"}
    assert dropped["names"]["kind"] == "array" and "strings" in dropped["names"]["reason"]
    assert dropped["README.txt"]["kind"] == "file"
    assert "copied unchanged: crs (grid mapping); lat (coordinate); dropped 2 arrays, 1 file and 4 attributes" \
        in stderr

    out = tmp_path / "kept.zarr"
    manifest, _ = perturb(cli, src, out, "--range", "250:300", "--dataset", "t2m", "--keep", "names",
                          "--keep", "t2m@comment")
    after = xr.open_zarr(out)
    assert after["names"].values.tolist() == NAMES * 2
    assert after["t2m"].attrs["comment"] == "measured at alice's house"
    assert {u["name"] for u in manifest["unperturbed"]} == {"lat", "crs", "names", "t2m@comment"}


def test_zarr_keep_never_copies_a_data_file_in_the_store(cli, tmp_path):
    """Regression: --keep copied an .npy or a pickle left in a Zarr store raw (the records
    themselves, or code); model and image folders never copy a data file."""
    import pickle

    src = tmp_path / "in.zarr"
    climate_dataset().to_zarr(src, zarr_format=3, consolidated=False)
    np.save(src / "raw_t2m.npy", climate_dataset()["t2m"].values)
    with open(src / "people.pkl", "wb") as f:
        pickle.dump({"names": NAMES}, f)
    out = tmp_path / "out.zarr"
    for name, what in [("raw_t2m.npy", "holds npy data"), ("people.pkl", "holds a Python pickle")]:
        result = cli("perturb", src, "--eps", "1", "--out", out, "--range", "250:300", "--dataset", "t2m",
                     "--keep", name)
        assert_one_line_error(result, 2, f"{src / name}: {what}", "never copies it raw")
        assert siblings(tmp_path) == {"in.zarr"}
    manifest, _ = perturb(cli, src, out, "--range", "250:300", "--dataset", "t2m")
    assert {"raw_t2m.npy", "people.pkl"} <= set(by_name(manifest["dropped"]))
    assert xr.open_zarr(out, consolidated=False)["t2m"].shape == (6, 4)


def test_npz_keep_never_copies_an_array_of_python_objects_or_a_pickle(cli, tmp_path):
    """Regression: --keep copied a member np.savez pickled (an array of Python objects), or a
    pickle member, raw, where pickles are never copied anywhere else."""
    import pickle

    src = tmp_path / "m.npz"
    np.savez(src, w=np.random.default_rng(9).normal(0, 0.1, (8, 8)).astype(np.float32),
             people=np.array([{"name": name} for name in NAMES], dtype=object))
    result = cli("perturb", src, "--eps", "1", "--clip", "0.5", "--out", tmp_path / "out.npz", "--keep", "people")
    assert_one_line_error(result, 2, f"{src}: member people.npy holds Python objects", "never copies it raw")
    assert siblings(tmp_path) == {"m.npz"}
    with zipfile.ZipFile(src, "a") as z:  # a pickle beside the arrays
        z.writestr("people.pkl", pickle.dumps({"names": NAMES}))
    result = cli("perturb", src, "--eps", "1", "--clip", "0.5", "--out", tmp_path / "out.npz", "--keep", "*.pkl")
    assert_one_line_error(result, 2, f"{src}: member people.pkl holds a Python pickle", "never copies it raw")
    assert siblings(tmp_path) == {"m.npz"}
    manifest, _ = perturb(cli, src, tmp_path / "out.npz", "--clip", "0.5")
    assert {"people", "people.pkl"} <= set(by_name(manifest["dropped"]))
    assert list(np.load(tmp_path / "out.npz")) == ["w"]


# --- model files ----------------------------------------------------------------------

def test_safetensors_metadata_keeps_only_its_format(cli, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(8)
    tensors = {"w": rng.normal(0, 0.1, (16, 8)).astype(np.float32), "step": np.array([7], np.int64)}
    src = tmp_path / "m.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt", "author": "Alice Smith",
                                           "dataset": "patient-records-2024"})
    out = tmp_path / "out.safetensors"
    manifest, stderr = perturb(cli, src, out, "--clip", "0.5")
    with safe_open(str(out), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
    loaded = load_file(str(out))
    np.testing.assert_array_equal(loaded["step"], tensors["step"])  # copied at its new offset
    assert loaded["w"].shape == (16, 8) and not np.array_equal(loaded["w"], tensors["w"])
    assert b"Alice" not in out.read_bytes() and b"patient" not in out.read_bytes()
    assert {d["name"]: d["kind"] for d in manifest["dropped"]} == {"@author": "metadata key",
                                                                    "@dataset": "metadata key"}
    assert "dropped 2 metadata keys" in stderr

    out = tmp_path / "kept.safetensors"
    manifest, _ = perturb(cli, src, out, "--clip", "0.5", "--keep", "@author")
    with safe_open(str(out), framework="np") as f:
        assert f.metadata() == {"format": "pt", "author": "Alice Smith"}
    np.testing.assert_array_equal(load_file(str(out))["step"], tensors["step"])
    assert by_name(manifest["unperturbed"])["@author"]["reason"] == "kept by --keep"


def test_npz_members_that_are_not_arrays_and_comments_are_left_out(cli, tmp_path):
    src = tmp_path / "m.npz"
    np.savez(src, w=np.random.default_rng(9).normal(0, 0.1, (8, 8)).astype(np.float32))
    with zipfile.ZipFile(src, "a") as z:
        z.writestr("notes.txt", "trained on alice's records")
        z.comment = b"made by bob"
    out = tmp_path / "out.npz"
    manifest, _ = perturb(cli, src, out, "--clip", "0.5")
    with zipfile.ZipFile(out) as z:
        assert z.namelist() == ["w.npy"] and z.comment == b""
    assert np.load(out)["w"].shape == (8, 8)
    assert {d["name"]: d["kind"] for d in manifest["dropped"]} == {"notes.txt": "file", "@comment": "comment"}


# --- image folders --------------------------------------------------------------------

def dicom_like(path: Path) -> Path:
    """The DICOM preamble and magic, then a patient's name (what pydicom writes first)."""
    path.write_bytes(b"\0" * 128 + b"DICM" + b"\x10\x00\x10\x00PN\x0c\x00Alice^Smith ")
    return path


def nifti_gz(path: Path) -> Path:
    """A gzipped NIfTI-1 header (sizeof_hdr 348, magic n+1) and a few voxels."""
    header = bytearray(348)
    header[0:4] = struct.pack("<i", 348)
    header[344:348] = b"n+1\0"
    path.write_bytes(gzip.compress(bytes(header) + bytes(range(64))))
    return path


def test_copy_other_never_copies_medical_images_or_data(cli, tmp_path):
    src = tmp_path / "photos"
    (src / "sub").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(IMAGES[i]).save(src / f"{i}.png")
    (src / "notes.txt").write_text("captions")
    dicom_like(src / "scan")  # no suffix: found by its magic
    dicom_like(src / "sub" / "other.dcm")
    nifti_gz(src / "sub" / "brain.nii.gz")
    nifti_gz(src / "sub" / "brain2.gz")  # gzipped NIfTI under another name: found by what it holds
    np.save(src / "features.npy", IMAGES)
    out = tmp_path / "out"
    manifest, stderr = perturb(cli, src, out, "--copy-other")
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == ["0.png", "1.png", "2.png", "notes.txt"]
    assert b"Alice" not in file_bytes(out)
    reasons = {d["name"]: d["reason"] for d in manifest["dropped"]}
    assert set(reasons) == {"scan", "sub/other.dcm", "sub/brain.nii.gz", "sub/brain2.gz", "features.npy"}
    assert reasons["scan"].startswith("DICOM") and reasons["sub/brain.nii.gz"].startswith("NIfTI")
    assert reasons["sub/brain2.gz"].startswith("NIfTI")
    assert reasons["features.npy"].startswith("npy data")
    assert {d["kind"] for d in manifest["dropped"]} == {"file"}
    assert manifest["unperturbed"] == [{"name": "notes.txt", "kind": "file", "reason": "--copy-other: not an image"}]
    lines = [line for line in stderr.splitlines() if "did not copy" in line]
    assert len(lines) == 1 and "5 files holding data" in lines[0] and "DICOM" in lines[0]
    assert "dropped 5 files" in stderr
