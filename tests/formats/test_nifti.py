"""NIfTI volumes (.nii, .nii.gz), made and read back with nibabel; DICOM refused."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tests.builders import (SEED, RoundTrip, assert_one_line_error, run_measured_phase, siblings, tree_digest,
                            validate_manifest)
from tldp_cli.formats import FormatOptions, nifti

AFFINE = np.array([[-2.0, 0.0, 0.0, 90.0], [0.0, 2.5, 0.0, -126.0], [0.0, 0.0, 3.0, -72.0], [0.0, 0.0, 0.0, 1.0]])
SECRET = b"Alice Smith 1970-01-01"


def volume(path: Path, data: np.ndarray, *, slope=None, inter=None, text: bool = False,
           endianness: str = "<") -> Path:
    """A NIfTI-1 file as nibabel writes it: a scanner's affine (qform and sform), mm and
    seconds, a repetition time; `text`: free-text fields, a display window and a comment
    extension naming the subject."""
    header = nib.Nifti1Header(endianness=endianness)
    img = nib.Nifti1Image(data, AFFINE, header)
    img.set_data_dtype(data.dtype)  # a header given: nibabel would write its default, float32
    img.header.set_xyzt_units("mm", "sec")
    img.header.set_qform(AFFINE, code="scanner")
    img.header.set_sform(AFFINE, code="aligned")
    if data.ndim == 4:
        img.header["pixdim"][4] = 2.0
    if slope is not None:
        img.header.set_slope_inter(slope, inter)
    if text:
        img.header["descrip"] = SECRET
        img.header["aux_file"] = b"alice.txt"
        img.header["intent_name"] = b"subject 7"
        img.header["db_name"] = b"hospital"
        img.header["cal_min"], img.header["cal_max"] = float(data.min()), float(data.max())
        img.header.extensions.append(nib.nifti1.Nifti1Extension("comment", SECRET))
    nib.save(img, path)
    return path


def stored(path: Path) -> np.ndarray:
    """The values as stored (no scaling)."""
    return np.asanyarray(nib.load(path).dataobj.get_unscaled())


def values(path: Path) -> np.ndarray:
    return np.asarray(nib.load(path).dataobj)


def raw_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def run(cli, src: Path, out: Path, *more) -> dict:
    result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, *more)
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    validate_manifest(manifest)
    return manifest


def noise_std(manifest: dict) -> float:
    """The standard deviation of out - in: discrete Laplace noise of the manifest's scale (in
    grid steps), where a value is not kept."""
    a = math.exp(-1.0 / manifest["noise_scale"])
    step = manifest.get("granularity") or 1.0
    return step * math.sqrt((1 - manifest["retain_probability"]) * 2 * a / (1 - a) ** 2)


class NiftiRoundTrip(RoundTrip):
    format = "nifti"
    out_suffix = ".nii.gz"

    def make_input(self, tmp_path):
        data = np.random.default_rng(0).integers(0, 4000, (6, 5, 4, 3)).astype(np.int16)
        return volume(tmp_path / "bold.nii.gz", data, text=True)

    def read_arrays(self, path):
        return {"volume": values(path)}

    def assert_same_structure(self, original, perturbed):
        a, b = nib.load(original), nib.load(perturbed)
        assert b.shape == a.shape and np.array_equal(b.affine, a.affine)
        assert b.header.get_zooms() == a.header.get_zooms()
        assert b.header.get_xyzt_units() == ("mm", "sec")
        assert b.header.get_qform(coded=True)[1] == 1 and b.header.get_sform(coded=True)[1] == 2
        assert np.array_equal(b.header.get_qform(), a.header.get_qform())
        assert b.get_data_dtype().kind == "i" and not b.header.extensions
        assert b.header["descrip"] == b"" and SECRET not in raw_bytes(perturbed)


@pytest.mark.parametrize("dtype", ["int16", "float32"])
@pytest.mark.parametrize("frames", [None, 5])
@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
def test_nibabel_reads_the_output_with_the_same_affine_and_shape(cli, tmp_path, dtype, frames, suffix):
    rng = np.random.default_rng(1)
    shape = (10, 9, 8) + ((frames,) if frames else ())
    data = (rng.integers(0, 256, shape) if dtype == "int16" else rng.uniform(0, 256, shape)).astype(dtype)
    src = volume(tmp_path / f"scan{suffix}", data, endianness=">" if frames else "<")
    out = tmp_path / f"out{suffix}"
    before = tree_digest(src)
    manifest = run(cli, src, out, "--range", "0:256", "--eps", "20")
    assert tree_digest(src) == before
    img = nib.load(out)
    assert img.shape == data.shape and np.array_equal(img.affine, nib.load(src).affine)
    assert img.header.get_zooms() == nib.load(src).header.get_zooms()
    assert (out.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".nii.gz")
    if suffix == ".nii.gz":  # no file name (the work folder's) nor time in the gzip header
        assert out.read_bytes()[3] == 0 and out.read_bytes()[4:8] == bytes(4)
    assert img.header.endianness == nib.load(src).header.endianness
    # Perturbed, not copied: out - in is the calibrated noise, voxel by voxel (a frame or
    # axis out of place would add the data's own spread, about 74, to it)
    residual = values(out).astype(np.float64) - data
    assert np.mean(residual == 0) < 0.05
    assert abs(residual.mean()) < 0.1 * noise_std(manifest)
    assert residual.std() == pytest.approx(noise_std(manifest), rel=0.1)
    if frames:  # each frame has its own noise
        first, second = residual[..., 0].ravel(), residual[..., 1].ravel()
        assert abs(np.corrcoef(first, second)[0, 1]) < 0.15
        assert manifest["row_datasets"] == [[f"frame {i}" for i in range(frames)]]
    assert manifest["outputs"][0]["path"] == str(out)


def test_a_series_is_one_record_whose_figure_composes_its_frames(cli, tmp_path):
    data = np.random.default_rng(2).integers(0, 256, (6, 5, 4, 8)).astype(np.uint8)
    src = volume(tmp_path / "bold.nii.gz", data)
    element = run(cli, src, tmp_path / "e.nii.gz")
    whole = 6 * 5 * 4 * 8
    assert element["row_records"] == {**element["row_records"], "records": 1, "elements_per_record": whole}
    acc = element["accounting"]
    assert acc["per_record"]["epsilon"] == pytest.approx(whole * acc["per_element"]["epsilon"])
    assert acc["per_record"]["epsilon"] == pytest.approx(acc["per_file"]["epsilon"])
    assert "whole series" in element["warnings"][0]["record"]
    # --budget record: --eps is the whole series', spread over its frames
    record = run(cli, src, tmp_path / "r.nii.gz", "--budget", "record", "--eps", "400")
    assert record["accounting"]["per_record"]["epsilon"] == pytest.approx(400, rel=1e-6)
    assert record["noise_scale"] > 2 * element["noise_scale"]


def test_scaled_values_are_perturbed_in_their_scaled_units(cli, tmp_path):
    raw = np.random.default_rng(3).integers(0, 200, (8, 8, 6, 2)).astype(np.int16)
    src = volume(tmp_path / "ct.nii.gz", raw, slope=0.5, inter=10.0)
    assert np.array_equal(values(src), raw * 0.5 + 10)
    refused = cli("perturb", src, "--eps", "1")
    assert_one_line_error(refused, 2, "float64 data needs --range")
    # Raw codes reach 199: only the scaled values (10 to 109.5) lie in 10:110
    out = tmp_path / "out.nii.gz"
    manifest = run(cli, src, out, "--range", "10:110", "--eps", "20")
    img = nib.load(out)
    assert img.get_data_dtype() == np.float32 and img.dataobj.slope == 1.0 and img.dataobj.inter == 0.0
    assert math.isnan(img.header["scl_slope"])
    residual = values(out).astype(np.float64) - (raw * 0.5 + 10)
    assert residual.std() == pytest.approx(noise_std(manifest), rel=0.1)
    assert manifest["unpacked"] == {"ct.nii.gz": {"stored_dtype": "int16", "unsigned": False}}
    assert any("scl_slope" in step for step in manifest["postprocessing"])


def test_the_scaling_nibabel_derives_from_the_volume_is_not_stated(cli, tmp_path):
    """nibabel stores float data as int16 with a scl_slope and scl_inter fitted to the
    volume's own minimum and maximum, which they give back exactly: neither the manifest
    nor the messages state them (docs/guarantee.md, "What the figures do not cover")."""
    scan = np.random.default_rng(9).normal(300, 40, (12, 10, 6)).astype(np.float32)
    img = nib.Nifti1Image(scan, AFFINE)
    img.set_data_dtype(np.int16)  # nibabel scales to fit the values
    src = tmp_path / "scan.nii"
    nib.save(img, src)
    slope, inter = float(nib.load(src).dataobj.slope), float(nib.load(src).dataobj.inter)
    codes = stored(src)
    assert codes.min() * slope + inter == pytest.approx(scan.min(), abs=slope)  # the raw range, given away
    assert codes.max() * slope + inter == pytest.approx(scan.max(), abs=slope)
    out = tmp_path / "out.nii"
    result = cli("perturb", src, "--eps", "1", "--range", "0:1000", "--out", out)
    assert result.exit_code == 0, result.stderr
    text = Path(f"{out}.manifest.json").read_text()
    manifest = json.loads(text)
    assert manifest["unpacked"] == {"scan.nii": {"stored_dtype": "int16", "unsigned": False}}
    for value in (slope, inter):
        assert repr(value)[:8] not in text and f"{value:g}" not in result.stderr


def test_text_fields_and_extensions_are_dropped_and_listed(cli, tmp_path):
    data = np.random.default_rng(4).integers(0, 256, (6, 6, 6)).astype(np.int16)
    src = volume(tmp_path / "t1.nii", data, text=True)
    out = tmp_path / "out.nii"
    manifest = run(cli, src, out)
    dropped = {d["name"]: d["kind"] for d in manifest["dropped"]}
    assert dropped == {"@descrip": "header field", "@aux_file": "header field", "@intent_name": "header field",
                       "@db_name": "header field", "@cal_min": "header field", "@cal_max": "header field",
                       "@extension.1": "extension"}
    header = nib.load(out).header
    assert [header[key].item() for key in ("descrip", "aux_file", "intent_name", "db_name")] == [b""] * 4
    assert header["cal_min"] == 0 and header["cal_max"] == 0 and not header.extensions
    assert SECRET not in out.read_bytes() and b"hospital" not in out.read_bytes()
    assert "unperturbed" not in manifest


def test_keep_copies_the_named_fields_and_extensions(cli, tmp_path):
    data = np.random.default_rng(5).integers(0, 256, (6, 6, 6, 2)).astype(np.int16)
    src = volume(tmp_path / "t1.nii.gz", data, text=True)
    out = tmp_path / "out.nii.gz"
    manifest = run(cli, src, out, "--keep", "@descrip", "--keep", "@extension.*")
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {
        "@descrip": "kept by --keep", "@extension.1": "kept by --keep"}
    assert "@descrip" not in {d["name"] for d in manifest["dropped"]}
    img = nib.load(out)
    assert img.header["descrip"] == SECRET and img.header["aux_file"] == b""
    assert [(e.get_code(), e.get_content()) for e in img.header.extensions] == [(6, SECRET)]
    assert img.shape == data.shape and np.array_equal(img.affine, nib.load(src).affine)
    typo = cli("perturb", src, "--eps", "1", "--out", tmp_path / "typo.nii.gz", "--keep", "@descript")
    assert_one_line_error(typo, 2, "--keep @descript matches no")
    plain = volume(tmp_path / "plain.nii.gz", data)  # a blank field: nothing to keep, nothing to refuse
    assert "unperturbed" not in run(cli, plain, tmp_path / "plain.tldp.nii.gz", "--keep", "@descrip")


NIBABEL_DATA = Path(nib.__file__).parent / "tests" / "data"


@pytest.mark.parametrize("keep", [False, True])
def test_a_cifti_file_comes_out_as_nifti_2_that_nibabel_loads(cli, tmp_path, keep):
    """nibabel's own CIFTI-2 test file (a dense connectome): its CIFTI extension is left out,
    so its CIFTI intent is too (written as none, listed), or nibabel.load, which takes a
    CIFTI intent for a CIFTI-2 image, fails on the output ("NIfTI2 header does not contain
    a CIFTI-2 extension"). Kept with --keep, the extension keeps its intent: CIFTI-2 again."""
    src = NIBABEL_DATA / "row_major.dconn.nii"
    before = nib.load(src)
    out = tmp_path / "out.nii"
    manifest = run(cli, src, out, "--range", "-1:1", *(["--keep", "@extension.*"] if keep else []))
    img = nib.load(out)
    assert np.asanyarray(img.dataobj).squeeze().shape == before.shape == (10, 10)
    dropped = {d["name"]: d["reason"] for d in manifest["dropped"]}
    if keep:
        assert isinstance(img, nib.Cifti2Image) and img.nifti_header.get_intent()[0] == "ConnDense"
        assert "@intent_code" not in dropped
    else:
        assert type(img) is nib.Nifti2Image and img.header.get_intent()[0] == "none"
        assert "CIFTI" in dropped["@intent_code"] and "@extension.1" in dropped


def test_plan_reads_the_header_alone(cli, tmp_path):
    data = np.random.default_rng(6).integers(0, 256, (8, 8, 8, 4)).astype(np.int16)
    src = volume(tmp_path / "bold.nii.gz", data, text=True)
    full = src.read_bytes()
    src.write_bytes(full[:len(full) // 2])  # the voxels cut in half: a plan never reads them
    result = cli("plan", src, "--eps", "1", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["row_records"]["elements_per_record"] == 8 * 8 * 8 * 4
    assert "@descrip" in {d["name"] for d in plan["dropped"]}
    refused = cli("perturb", src, "--eps", "1")
    assert_one_line_error(refused, 1, str(src), "it may be truncated")


@pytest.mark.parametrize("suffix", [".nii.gz", ".nii"])
def test_a_truncated_volume_is_refused_in_one_line(cli, tmp_path, suffix):
    data = np.random.default_rng(7).integers(0, 256, (16, 16, 8, 6)).astype(np.int16)
    src = volume(tmp_path / f"bold{suffix}", data)
    full = src.read_bytes()
    src.write_bytes(full[:len(full) * 2 // 3])
    before = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_error(result, 1, str(src), "it may be truncated")
    assert siblings(tmp_path) == before  # no output, manifest or work folder left


@pytest.mark.parametrize("suffix", [".nii.gz", ".nii"])
def test_memory_running_out_while_a_frame_is_read_is_not_called_damage(cli, tmp_path, monkeypatch, suffix):
    """A MemoryError while nibabel reads a frame was reported as 'cannot read its voxels
    (); it may be truncated or corrupt': the run says memory ran out, as for every format."""
    from nibabel.arrayproxy import ArrayProxy

    def out_of_memory(self, key):
        raise MemoryError()

    src = volume(tmp_path / f"bold{suffix}", np.zeros((4, 4, 3, 2), np.int16))
    monkeypatch.setattr(ArrayProxy, "__getitem__", out_of_memory)
    before = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_error(result, 1, f"{src}: ran out of memory (MemoryError)")
    assert "truncated" not in result.stderr
    assert siblings(tmp_path) == before


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
@pytest.mark.parametrize("slope", [None, 0.25])
def test_reader_streams_one_frame_per_array_as_nibabel_reads_it(tmp_path, suffix, slope):
    data = np.random.default_rng(8).integers(-500, 500, (5, 4, 3, 6)).astype(np.int16)
    src = volume(tmp_path / f"bold{suffix}", data, endianness=">", slope=slope, inter=slope and -3.0)
    reader = nifti.open_reader(src, FormatOptions())
    jobs = reader.arrays()
    assert [job.shape for job in jobs] == [(1, 5, 4, 3)] * 6
    proxy = nib.load(src).dataobj
    # in order, out of order (blocks on threads), and a second pass (the ledger's, then the run's)
    for i in [*range(6), 3, 5, 4, 0, 2, 1]:
        frame = jobs[i].read(0, 1)
        assert frame.dtype == (np.float64 if slope else np.int16) and frame.dtype.isnative
        np.testing.assert_array_equal(frame[0], proxy[..., i])
    assert reader.rows(jobs) == [[job.name for job in jobs]]
    reader.close()


@pytest.mark.slow
def test_peak_memory_is_flat_in_the_number_of_frames(tmp_path):
    """Measured as the rise above the memory held as the perturbing phase starts: the
    planning before it holds 26 MiB more for the 10 frames than for the 150 here, which hid
    a growth that size in the peak of the whole run (frames kept as read: 37 MiB)."""
    peaks, rises = [], []
    for frames in (10, 150):  # 2.6 and 39 MB of int16; 157 MB as float64 if held whole
        data = np.random.default_rng(9).integers(0, 4000, (64, 64, 32, frames)).astype(np.int16)
        src = volume(tmp_path / f"bold{frames}.nii.gz", data)
        del data
        code, stderr, peak, rise = run_measured_phase(tmp_path, "perturbing", "perturb", src, "--eps", "1",
                                                      "--workers", "2", "-q")
        assert code == 0, stderr
        peaks.append(peak)
        rises.append(rise)
    grown_mib = (rises[1] - rises[0]) / (1 << 20)  # within 2 MiB here
    assert grown_mib < 16, f"perturbing took {grown_mib:.0f} MiB more for 15 times the frames"
    grown_mib = (peaks[1] - peaks[0]) / (1 << 20)
    assert grown_mib < 50, f"peak RSS grew by {grown_mib:.0f} MiB for 15 times the frames"


def test_output_names_nibabel_cannot_open_are_refused(cli, tmp_path):
    src = volume(tmp_path / "t1.nii.gz", np.zeros((4, 4, 4), np.uint8))
    for name in ("out", "out.npy"):
        result = cli("perturb", src, "--eps", "1", "--out", tmp_path / name)
        assert_one_line_error(result, 2, name)
    assert not (tmp_path / "out").exists()
    assert run(cli, src, tmp_path / "t1.tldp.nii")["outputs"]  # compression follows the name
    assert (tmp_path / "t1.tldp.nii").read_bytes()[344:347] == b"n+1"


def test_default_output_sits_beside_the_input(cli, tmp_path):
    src = volume(tmp_path / "t1.nii.gz", np.zeros((4, 4, 4), np.uint8))
    result = cli("perturb", src, "--eps", "1")
    assert result.exit_code == 0, result.stderr
    assert nib.load(tmp_path / "t1.tldp.nii.gz").shape == (4, 4, 4)


# --- DICOM ------------------------------------------------------------------------------

def dicom(path: Path) -> Path:
    """The DICOM preamble and magic, then a patient's name (what pydicom writes first)."""
    path.write_bytes(b"\0" * 128 + b"DICM" + b"\x10\x00\x10\x00PN\x0c\x00Alice^Smith ")
    return path


@pytest.mark.parametrize("name", ["IM0001.dcm", "IM0001"])
def test_a_dicom_file_is_refused_with_the_reason(cli, tmp_path, name):
    src = dicom(tmp_path / name)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_error(result, 1, str(src), "DICOM", "patient names", "NIfTI")
    assert siblings(tmp_path) == {name}


def test_a_folder_of_dicom_files_is_refused_with_the_reason(cli, tmp_path):
    series = tmp_path / "series"
    series.mkdir()
    for i in range(3):
        dicom(series / f"IM{i:04d}")
    (series / "DICOMDIR").write_bytes(b"\0" * 200)
    result = cli("perturb", series, "--eps", "1")
    assert_one_line_error(result, 1, str(series), "3 DICOM files", "patient names", "NIfTI")
    assert siblings(tmp_path) == {"series"}



@pytest.mark.slow
def test_a_damaged_header_is_one_line_without_nibabel_s_log(tmp_path):
    """nibabel logged its attempted fixes ("sizeof_hdr should be 348; set sizeof_hdr to 348",
    "data code ... not recognized; not attempting fix") to stderr above tldp's line. A process
    of its own: pytest's log capture would swallow the lines."""
    import subprocess
    import sys

    src = tmp_path / "scan.nii"
    src.write_bytes(b"\x93NUMPY" + bytes(range(256)) * 2)
    result = subprocess.run([sys.executable, "-m", "tldp_cli", "perturb", str(src), "--eps", "1", "--format",
                             "nifti", "--out", str(tmp_path / "o.nii")], capture_output=True, text=True)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tldp: error: {src}: not a readable NIfTI header"), lines
