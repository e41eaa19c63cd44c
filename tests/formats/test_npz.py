"""NumPy .npz archives: what the header of a member promises is checked before its data is
read (the members are read whole, one tensor at a time)."""

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
