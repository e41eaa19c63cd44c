"""NumPy .npz archives: what the header of a member promises is checked before its data is
read (the members are read whole, one tensor at a time)."""

import json
import zipfile

import numpy as np

from tests.builders import assert_one_line_error, siblings


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
