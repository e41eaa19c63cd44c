"""NumPy .npz archives: what the header of a member promises is checked before its data is
read (the members are read whole, one tensor at a time)."""

import json
import zipfile

import numpy as np

from tests.builders import REPO, SEED, assert_one_line_error, siblings


def npz_with_a_short_member(path, declared, held):
    """An .npz (as np.savez writes them) whose member w.npy declares `declared` float32 values
    but holds only `held`, beside an honest member b.npy."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("w.npy", "w") as member:
            np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False,
                                                          "shape": (declared,)})
            member.write(np.zeros(held, "<f4").tobytes())
        with archive.open("b.npy", "w") as member:
            np.lib.format.write_array(member, np.linspace(-0.1, 0.1, 8, dtype=np.float32))
    return path


def test_a_member_that_holds_less_than_it_declares_is_refused_from_its_header(cli, tmp_path):
    """A 40 MB tensor declared in a member of 1 kB: refused when the archive is opened (by
    plan too, which reads headers only), naming the member, before any tensor is read and
    its declared size allocated."""
    src = npz_with_a_short_member(tmp_path / "m.npz", 10_000_000, 256)
    for command in (("plan", src, "--eps", "1", "--clip", "0.1"),
                    ("perturb", src, "--eps", "1", "--clip", "0.1")):
        result = cli(*command)
        assert_one_line_error(result, 1, f"{src}: member w.npy declares a 10000000 float32 array",
                              "but holds 1,152 bytes; the file is damaged")
    assert siblings(tmp_path) == {"m.npz"}


def test_an_honest_archive_still_passes(cli, tmp_path):
    src = tmp_path / "ok.npz"
    np.savez_compressed(src, w=np.zeros(1000, np.float32), b=np.linspace(-0.1, 0.1, 8, dtype=np.float32))
    result = cli("perturb", src, "--eps", "1", "--clip", "0.1")
    assert result.exit_code == 0, result.stderr
    with np.load(tmp_path / "ok.tldp.npz") as out:
        assert out["w"].shape == (1000,) and out["w"].dtype == np.float32


def test_arrays_of_strings_are_left_out_and_listed_unless_kept(cli, tmp_path):
    """Regression: an .npz member of strings (class names, file names, a patient's ID) was
    copied raw unasked, listed under `unperturbed` as if it were an integer tensor; text is
    left out unless --keep names it, as in an HDF5 file."""
    src = tmp_path / "m.npz"
    np.savez(src, w=np.linspace(-0.1, 0.1, 8, dtype=np.float32), step=np.array([7]),
             subjects=np.array(["alice_smith", "bob_jones"]), ids=np.array([b"id-0042"]))
    result = cli("perturb", src, "--eps", "1", "--clip", "0.1", "--out", tmp_path / "o.npz", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    with np.load(tmp_path / "o.npz") as out:
        assert sorted(out.files) == ["step", "w"] and out["step"].tolist() == [7]
    assert b"alice" not in (tmp_path / "o.npz").read_bytes()
    assert {e["name"]: e["kind"] for e in manifest["dropped"]} == {"subjects": "array", "ids": "array"}
    assert [e["name"] for e in manifest["unperturbed"]] == ["step"]
    result = cli("perturb", src, "--eps", "1", "--clip", "0.1", "--out", tmp_path / "k.npz", "--json",
                 "--keep", "subjects")
    assert result.exit_code == 0, result.stderr
    with np.load(tmp_path / "k.npz") as out:
        assert out["subjects"].tolist() == ["alice_smith", "bob_jones"] and "ids" not in out.files
    assert {e["name"] for e in json.loads(result.stdout)["unperturbed"]} == {"step", "subjects"}


def test_member_dates_are_not_copied(cli, tmp_path):
    """Regression: each output member carried its input member's zip date (numpy 1.x's np.savez
    and the zip tool write the time of saving), input metadata outside the figures that can date
    when the model was trained or a recording made. Every member is now dated 1980-01-01 00:00,
    zip's first date, as numpy 2 writes them."""
    src = tmp_path / "m.npz"
    with zipfile.ZipFile(src, "w") as archive:
        for name, values in (("w", np.linspace(-0.1, 0.1, 8, dtype=np.float32)), ("step", np.array([7]))):
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=(2021, 5, 17, 9, 30, 12)), "w") as member:
                np.lib.format.write_array(member, values)
    result = cli("perturb", src, "--eps", "1", "--clip", "0.1", "--out", tmp_path / "o.npz")
    assert result.exit_code == 0, result.stderr
    with zipfile.ZipFile(tmp_path / "o.npz") as out:
        assert [(i.filename, i.date_time) for i in out.infolist()] == [("w.npy", (1980, 1, 1, 0, 0, 0)),
                                                                       ("step.npy", (1980, 1, 1, 0, 0, 0))]
    with np.load(tmp_path / "o.npz") as out:
        assert out["step"].tolist() == [7] and out["w"].shape == (8,)


# Made with ml_dtypes 0.6.0 and NumPy 2.4.6 as JAX and flax users save bfloat16 parameters:
#   rng = np.random.default_rng(2026)
#   np.savez(path, **{"dense/kernel": rng.normal(0, 0.05, (16, 8)).astype(ml_dtypes.bfloat16),
#                     "dense/bias": rng.normal(0, 0.01, 8).astype(ml_dtypes.bfloat16),
#                     "scale": np.ones(8, np.float32), "step": np.array(1000, np.int64)})
# A bfloat16 member's header says '<V2'; np.load reads it back as '|V2'.
BFLOAT16_NPZ = REPO / "tests" / "fixtures" / "bfloat16_params.npz"


def bfloat16_values(bits):
    """bfloat16 bit patterns (as uint16) as float32 values: the upper half of a float32."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def member_header(path, member):
    with zipfile.ZipFile(path) as archive:
        raw = archive.read(member)
    return raw[:raw.index(b"\n") + 1]


def test_bfloat16_members_saved_by_ml_dtypes_are_perturbed_as_bfloat16(cli, tmp_path):
    """Regression: a bfloat16 array saved with np.savez (ml_dtypes, so JAX and flax) is a
    2-byte void member, and was left out of the output as if it were text. It is perturbed
    as bfloat16, as a .safetensors file's BF16 tensors are, and written back as ml_dtypes
    writes it; the values are those the same run gives the same values stored as float32,
    rounded to bfloat16."""
    out = tmp_path / "o.npz"
    result = cli("perturb", BFLOAT16_NPZ, "--eps", "1", "--clip", "0.1", "--seed", SEED, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert "dropped" not in manifest
    assert {i["dataset"]: i["dtype"] for i in manifest["inputs"]} == {
        "dense/kernel": "bfloat16", "dense/bias": "bfloat16", "scale": "float32"}
    with zipfile.ZipFile(BFLOAT16_NPZ) as a, zipfile.ZipFile(out) as b:
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
    for member in ("dense/kernel.npy", "dense/bias.npy"):
        assert member_header(out, member) == member_header(BFLOAT16_NPZ, member)  # '<V2', as ml_dtypes writes
    # The same parameters as float32, perturbed by the same run: rounded to bfloat16, the same bits.
    with np.load(BFLOAT16_NPZ) as raw, np.load(out) as written:
        as_float = {name: bfloat16_values(raw[name].view("<u2")) for name in ("dense/kernel", "dense/bias")}
        np.savez(tmp_path / "f.npz", **as_float, scale=raw["scale"], step=raw["step"])
        assert written["dense/kernel"].dtype == np.dtype("V2") and written["step"] == 1000
        bits = {name: written[name].view("<u2") for name in as_float}
    result = cli("perturb", tmp_path / "f.npz", "--eps", "1", "--clip", "0.1", "--seed", SEED,
                 "--out", tmp_path / "f.tldp.npz")
    assert result.exit_code == 0, result.stderr
    with np.load(tmp_path / "f.tldp.npz") as reference:
        for name, values in as_float.items():
            u = reference[name].astype("<f4").view("<u4")
            nearest_even = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")
            assert (bits[name] == nearest_even).all()
            assert not np.array_equal(bfloat16_values(bits[name]), values)  # perturbed


def test_other_void_members_are_left_out_saying_what_they_hold(cli, tmp_path):
    """A 2-byte void member without a byte order (NumPy's own raw bytes, not ml_dtypes's
    bfloat16) is not read as numbers: left out, and the manifest says why."""
    src = tmp_path / "m.npz"
    np.savez(src, w=np.linspace(-0.1, 0.1, 8, dtype=np.float32), raw=np.zeros(8, "<u2").view("V2"))
    result = cli("perturb", src, "--eps", "1", "--clip", "0.1", "--out", tmp_path / "o.npz", "--json")
    assert result.exit_code == 0, result.stderr
    [entry] = json.loads(result.stdout)["dropped"]
    assert entry["name"] == "raw" and entry["reason"].startswith("holds raw 2-byte values (|V2: a void dtype")
    with np.load(tmp_path / "o.npz") as out:
        assert out.files == ["w"]
