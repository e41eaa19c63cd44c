""".npy arrays of dtypes NumPy does not name: ml_dtypes's bfloat16 (what JAX and flax users
get from np.save) is read as bfloat16 and written back as ml_dtypes writes it; NumPy's own
void dtypes and structured records are refused as what they are."""

import json

import numpy as np
import pytest

from tests.builders import REPO, SEED, assert_one_line_error, siblings, tree_digest
from tldp_cli.formats import npy

# Made with ml_dtypes 0.6.0 and NumPy 2.4.6 (pip install ml_dtypes), as JAX and flax users
# save bfloat16 arrays:
#   rng = np.random.default_rng(2026)
#   x = rng.normal(0, 0.05, (12, 4, 3)).astype(ml_dtypes.bfloat16)
#   np.save("bfloat16_weights.npy", x)
#   np.save("bfloat16_weights_big_endian_fortran.npy",
#           np.asfortranarray(x.astype(np.dtype(ml_dtypes.bfloat16).newbyteorder(">"))))
#   np.save("float8_e4m3fn.npy", np.linspace(-1, 1, 8).astype(ml_dtypes.float8_e4m3fn))
# np.save writes bfloat16's descr as '<V2' (or '>V2'), with the byte order no NumPy void
# dtype has ('|V2'); np.load reads it back as '|V2', and .view(ml_dtypes.bfloat16) (or
# jax.numpy.load) gives the values. ml_dtypes's 1-byte types are '<V1'.
FIXTURES = REPO / "tests" / "fixtures"
BFLOAT16_NPY = FIXTURES / "bfloat16_weights.npy"
BFLOAT16_BIG_ENDIAN_FORTRAN = FIXTURES / "bfloat16_weights_big_endian_fortran.npy"
FLOAT8_NPY = FIXTURES / "float8_e4m3fn.npy"


def bfloat16_values(bits):
    """bfloat16 bit patterns (as uint16) as float32 values: the upper half of a float32."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def nearest_even_bfloat16(values):
    """float32 values rounded to bfloat16 (nearest even), as bit patterns (uint16)."""
    u = np.asarray(values, "<f4").view("<u4")
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")


def header(path):
    """A .npy file's header dict as stored (np.load drops a void dtype's byte order)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        length = int.from_bytes(f.read(2 if version == (1, 0) else 4), "little")
        return f.read(length).decode("latin1").strip()


def test_bfloat16_saved_by_ml_dtypes_is_perturbed_and_written_back_as_bfloat16(cli, tmp_path):
    """Regression: a bfloat16 array saved with np.save (ml_dtypes: JAX, flax) was refused as
    an array of "structured dtype |V2". It is read as bfloat16, perturbed, and written back
    under the same '<V2' header; its values are those the same run gives the same values
    stored as float32, rounded to bfloat16, and the manifest says bfloat16."""
    out = tmp_path / "w.tldp.npy"
    result = cli("perturb", BFLOAT16_NPY, "--eps", "1", "--clip", "0.1", "--seed", SEED, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["inputs"][0]["dtype"] == "bfloat16" and manifest["inputs"][0]["shape"] == [12, 4, 3]
    assert manifest["output_dtype"] == "bfloat16"
    assert any(step.startswith("bfloat16 tensors rounded to bfloat16 (nearest even)")
               for step in manifest["postprocessing"])
    assert "'descr': '<V2'" in header(out) and "'shape': (12, 4, 3)" in header(out)
    written = np.load(out)
    assert written.dtype == np.dtype("V2") and written.shape == (12, 4, 3)
    bits = written.view("<u2")
    # The same values as float32 (bfloat16 widens exactly), perturbed by the same run.
    as_float = bfloat16_values(np.load(BFLOAT16_NPY).view("<u2"))
    np.save(tmp_path / "f.npy", as_float)
    result = cli("perturb", tmp_path / "f.npy", "--eps", "1", "--clip", "0.1", "--seed", SEED,
                 "--out", tmp_path / "f.tldp.npy")
    assert result.exit_code == 0, result.stderr
    reference = np.load(tmp_path / "f.tldp.npy")
    assert reference.dtype == np.float32
    assert np.array_equal(bits, nearest_even_bfloat16(reference))
    assert not np.array_equal(bfloat16_values(bits), as_float)  # perturbed


@pytest.mark.parametrize("fortran_reads", [npy.FORTRAN_READS, 1])  # 1: records read through a memory map
def test_big_endian_fortran_order_bfloat16_keeps_its_byte_order(cli, tmp_path, monkeypatch, fortran_reads):
    """The same values in big-endian Fortran order: the same perturbed values, written in
    C order under a '>V2' header (the byte order the input's values have)."""
    monkeypatch.setattr(npy, "FORTRAN_READS", fortran_reads)
    outputs = {}
    for src in (BFLOAT16_NPY, BFLOAT16_BIG_ENDIAN_FORTRAN):
        out = tmp_path / src.name
        result = cli("perturb", src, "--eps", "1", "--clip", "0.1", "--seed", SEED, "--out", out)
        assert result.exit_code == 0, result.stderr
        outputs[src] = out
    assert "'descr': '>V2', 'fortran_order': False" in header(outputs[BFLOAT16_BIG_ENDIAN_FORTRAN])
    big = np.load(outputs[BFLOAT16_BIG_ENDIAN_FORTRAN]).view(">u2")
    assert np.array_equal(big, np.load(outputs[BFLOAT16_NPY]).view("<u2"))


def test_plan_and_evaluate_know_bfloat16(cli, tmp_path):
    """plan says the values are written as bfloat16; evaluate reads both files as bfloat16,
    checks the output's sha256 and recomputes the manifest's figures."""
    result = cli("plan", BFLOAT16_NPY, "--eps", "1", "--clip", "0.1", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["output_dtype"] == "bfloat16" and plan["inputs"][0]["dtype"] == "bfloat16"
    out = tmp_path / "w.tldp.npy"
    assert cli("perturb", BFLOAT16_NPY, "--eps", "1", "--clip", "0.1", "--seed", SEED, "--out", out).exit_code == 0
    result = cli("evaluate", BFLOAT16_NPY, out, "--json")
    report = json.loads(result.stdout)
    assert report["integrity_ok"] is True, report["checks"]
    assert {c["check"]: c["passed"] for c in report["checks"]
            if c["check"] in ("parameters", "sha256", "shapes")} == {"parameters": True, "sha256": True, "shapes": True}
    assert report["records"] == 12 and report["elements_per_record"] == 12


@pytest.mark.parametrize("make, fragments", [
    (lambda path: np.save(path, np.zeros(8, "<u2").view("V2")),
     ("the array holds raw 2-byte values (|V2: a void dtype, not numbers; ml_dtypes's bfloat16, stored as <V2",)),
    (lambda path: path.write_bytes(FLOAT8_NPY.read_bytes()),
     ("the array holds raw 1-byte values (|V1: a void dtype, not numbers;", "its 1-byte types are not")),
    (lambda path: np.save(path, np.zeros(4, [("x", "<f4"), ("y", "<i2")])),
     ("array has structured dtype [('x', '<f4'), ('y', '<i2')]; tldp perturbs integer and floating-point",)),
])
def test_void_and_structured_arrays_are_refused_saying_what_they_hold(cli, tmp_path, make, fragments):
    """NumPy's own raw bytes ('|V2'), ml_dtypes's 1-byte types and records with fields are
    not numbers tldp reads: one line naming the file, exit 1, nothing written."""
    src = tmp_path / "a.npy"
    make(src)
    before = tree_digest(src)
    for command in ("plan", "perturb"):
        result = cli(command, src, "--eps", "1", "--clip", "0.1")
        assert_one_line_error(result, 1, f"{src}: ", *fragments)
    assert siblings(tmp_path) == {"a.npy"} and tree_digest(src) == before


@pytest.mark.dask
def test_bfloat16_blocks_written_on_dask_workers(cli, tmp_path):
    """Blocks written from Dask worker processes (the writer's block_writer) are rounded to
    bfloat16 as the threads' are: the same bytes."""
    outputs = []
    for name, more in (("threads", ()), ("dask", ("--scheduler", "dask", "--workers", "1"))):
        out = tmp_path / f"{name}.npy"
        result = cli("perturb", BFLOAT16_NPY, "--eps", "1", "--clip", "0.1", "--seed", SEED, "--out", out, *more)
        assert result.exit_code == 0, result.stderr
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
