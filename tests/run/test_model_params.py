"""Model-parameter files (.npz, .safetensors), --clip, and the per-tensor and whole-file
figures (issue 8, Type III).

Every file is real, written with NumPy or the safetensors library in tmp_path.
"""

import json
import math
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from scipy import stats

from tests.builders import (
    RoundTrip,
    analytic_gaussian_delta,
    one_line_error,
    read_safetensors,
    siblings,
    tree_digest,
    write_safetensors,
)
from tldp_cli.errors import InputError
from tldp_cli.formats import FormatOptions, detect, npz, safetensors_file, tensor_files
from tldp_cli.privacy import accounting
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.run import model_params
from tldp_cli.sampling.rng import Streams

RNG = np.random.default_rng(11)
WEIGHT = RNG.normal(0, 0.3, (16, 8)).astype(np.float32)  # some beyond the clip bound 0.5
BIAS = RNG.normal(0, 0.1, 16).astype(np.float16)
BF16 = np.round(RNG.uniform(-1, 1, (8, 16)) * 64).astype(np.float32) / 64  # exact in bfloat16
HEAD = RNG.normal(0, 0.2, (3, 2, 2))  # float64
STEP = np.array([1234], np.int64)
MASK = np.array([True, False, True, True])
METADATA = {"format": "pt", "source": "tldp tests"}


def write_model_safetensors(path: Path) -> Path:
    return write_safetensors(path, {"encoder.weight": WEIGHT, "encoder.bias": BIAS, "head": HEAD,
                                    "step": STEP, "mask": MASK}, bf16={"decoder.weight": BF16},
                             metadata=METADATA)


def write_model_npz(path: Path, compressed: bool = False) -> Path:
    save = np.savez_compressed if compressed else np.savez
    save(path, **{"encoder.weight": WEIGHT, "encoder.bias": BIAS, "decoder.weight": BF16.astype(">f4"),
                  "head": HEAD, "step": STEP, "mask": MASK})
    return path


FLOATS = ["encoder.weight", "encoder.bias", "decoder.weight", "head"]
# The model file's tensors are small (16 to 128 values): TLDP keeps raw values with a probability
# whose share of the file costs more than dp_delta, which needs consent (tests/privacy/test_raw_release.py).
# The round trips are about the formats, so they give it.
ROUND_TRIP_ARGS = ("--clip", "0.5", "--allow-raw-release")


class SafetensorsRoundTrip(RoundTrip):
    format = "safetensors"
    # __metadata__'s free text kept (by default left out: tests/formats/test_leftovers.py)
    extra_args = (*ROUND_TRIP_ARGS, "--keep", "@source")

    def make_input(self, tmp_path):
        return write_model_safetensors(tmp_path / "model.safetensors")

    def read_arrays(self, path):
        return {name: read_safetensors(path)[2][name] for name in FLOATS}

    def assert_same_structure(self, original, perturbed):
        header_a, meta_a, a = read_safetensors(original)
        header_b, meta_b, b = read_safetensors(perturbed)
        # Names, dtypes, shapes, order, offsets and metadata: the header is the same bytes.
        assert header_b == header_a and meta_b == METADATA
        np.testing.assert_array_equal(b["step"], STEP)
        np.testing.assert_array_equal(b["mask"], MASK)
        with safe_open(str(perturbed), framework="np") as f:  # the library reads it back
            assert f.metadata() == METADATA
            assert f.get_tensor("encoder.bias").dtype == np.float16
            assert f.get_tensor("head").dtype == np.float64


class NpzStructure:
    format = "npz"
    extra_args = ROUND_TRIP_ARGS

    def read_arrays(self, path):
        with np.load(path) as f:
            return {name: f[name] for name in FLOATS}

    def assert_same_structure(self, original, perturbed):
        with zipfile.ZipFile(original) as a, zipfile.ZipFile(perturbed) as b:
            assert [(i.filename, i.compress_type, i.date_time) for i in a.infolist()] == \
                   [(i.filename, i.compress_type, i.date_time) for i in b.infolist()]
        with np.load(original) as a, np.load(perturbed) as b:
            for name in a.files:
                assert (b[name].dtype, b[name].shape) == (a[name].dtype, a[name].shape), name
            assert b["decoder.weight"].dtype == np.dtype(">f4")  # byte order kept
            np.testing.assert_array_equal(b["step"], STEP)
            np.testing.assert_array_equal(b["mask"], MASK)


class NpzRoundTrip(NpzStructure, RoundTrip):
    def make_input(self, tmp_path):
        return write_model_npz(tmp_path / "model.npz")


class CompressedNpzRoundTrip(NpzStructure, RoundTrip):
    def make_input(self, tmp_path):
        return write_model_npz(tmp_path / "model.npz", compressed=True)


def test_detection_is_by_content(tmp_path):
    st = write_model_safetensors(tmp_path / "weights.bin")
    nz = write_model_npz(tmp_path / "weights.npz")
    nz = nz.rename(tmp_path / "weights.data")
    assert detect(st) is safetensors_file.FORMAT and detect(nz) is npz.FORMAT
    (tmp_path / "notes.txt").write_text("{not a model}")
    with pytest.raises(InputError, match="not a dataset tldp can read"):
        detect(tmp_path / "notes.txt")


def test_summary_names_tensors_and_the_whole_file(cli, tmp_path):
    src = write_model_safetensors(tmp_path / "m.safetensors")
    result = cli("perturb", src, "--eps", "1", "--clip", "0.5", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    only = "only float16, bfloat16, float32, float64 tensors are perturbed"
    assert (f"4 tensors, the largest of 128 elements; copied unchanged: step (int64: {only}); "
            f"mask (bool: {only})") in result.stderr
    manifest = json.loads((tmp_path / "m.tldp.safetensors.manifest.json").read_text())
    assert [(u["name"], u["dtype"], u["shape"]) for u in manifest["unperturbed"]] == [
        ("step", "int64", [1]), ("mask", "bool", [4])]
    assert "4 tensors, the largest of 128 elements" in result.stderr
    # 128 + 16 + 128 + 12 elements of eps 0.999 each (the exact sampler's discrete Laplace)
    assert "whole file, 4 tensors (eps=283.7," in result.stderr


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_noise_on_a_large_tensor_has_the_declared_distribution(cli, tmp_path, noise):
    x = np.random.default_rng(5).uniform(-3, 3, (200, 250)).astype(np.float32)  # most beyond C
    src = write_safetensors(tmp_path / "big.safetensors", {"w": x})
    # the continuous distributions: --sampler float
    result = cli("perturb", src, "--eps", "1", "--clip", "0.5", "--noise", noise, "--seed", "3",
                 "--allow-weak-seed", "--sampler", "float", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["noise"] == noise
    scale = m["accounting"]["per_tensor"][0]["noise_scale"]
    # Range width 2C = 1 at eps 1: Laplace b = 1/eps, Gaussian sigma = 1/sqrt(2 eps).
    assert scale == pytest.approx(1.0 if noise == "laplace" else 1 / math.sqrt(2))
    y = read_safetensors(tmp_path / "big.tldp.safetensors")[2]["w"].astype(np.float64)
    z = (y - np.clip(x, -0.5, 0.5)).ravel()
    dist = stats.laplace if noise == "laplace" else stats.norm
    assert stats.kstest(z, dist(scale=scale).cdf).pvalue > 1e-3
    assert stats.kstest(z, dist(scale=1.1 * scale).cdf).pvalue < 1e-6  # the test can fail
    assert stats.kstest((y - x).ravel(), dist(scale=scale).cdf).pvalue < 1e-6  # as if not clipped


# The continuous mechanisms (--sampler float) keep raw values visibly (p = 1/2 for one element);
# the default exact sampler's element budget is evaluated too.
@pytest.mark.parametrize("args", [("--sampler", "float"), ("--sampler", "float", "--budget", "record"),
                                  ("--sampler", "float", "--mechanism", "baseline"), ()])
def test_evaluate_accepts_a_clipped_model_file(cli, tmp_path, args):
    """Half the values are clipped; the tensors differ in size, so in retain probability
    (with continuous noise the 1-element one keeps its value with p = 1/2) and, but for the
    element budget, in noise scale."""
    x = np.random.default_rng(6).uniform(-1, 1, (100, 100)).astype(np.float32)
    src = write_safetensors(tmp_path / "m.safetensors", {"w": x, "b": x[0].copy(), "s": x[1, :1].copy()})
    # The 1- and 100-element tensors' visible p is the point: a raw release, which needs consent
    # (tests/privacy/test_raw_release.py).
    assert cli("perturb", src, "--eps", "2", "--clip", "0.5", "--seed", "1", "--allow-weak-seed", "-q",
               "--allow-raw-release", *args).exit_code == 0
    result = cli("evaluate", src, tmp_path / "m.tldp.safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    checks = {c["check"]: c["passed"] for c in json.loads(result.stdout)["checks"]}
    assert checks["noise_distribution"] and checks["retained_fraction"] is not False
    assert checks["parameters"] and checks["sha256"]


@pytest.mark.parametrize("writer", ["safetensors", "npz"])
def test_dataset_selects_tensors_and_copies_the_rest(cli, tmp_path, writer):
    src = (write_model_safetensors(tmp_path / "m.safetensors") if writer == "safetensors"
           else write_model_npz(tmp_path / "m.npz"))
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--clip", "0.5", "--dataset", "encoder.bias",
                 "--out", out, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert [i["dataset"] for i in m["inputs"]] == ["encoder.bias"]
    assert [t["name"] for t in m["accounting"]["per_tensor"]] == ["encoder.bias"]
    if writer == "safetensors":
        before, after = read_safetensors(src)[2], read_safetensors(out)[2]
    else:
        before, after = dict(np.load(src)), dict(np.load(out))
    assert not np.array_equal(after["encoder.bias"], before["encoder.bias"])
    for name in ("encoder.weight", "decoder.weight", "head", "step", "mask"):
        np.testing.assert_array_equal(after[name], before[name])


@pytest.mark.parametrize("name,fragment", [
    ("step", "has dtype int64"), ("mask", "has dtype bool"), ("nope", "no such tensor")])
def test_dataset_refuses_what_cannot_be_perturbed(cli, tmp_path, name, fragment):
    src = write_model_safetensors(tmp_path / "m.safetensors")
    before = siblings(tmp_path)
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1", "--dataset", name), 1)
    assert str(src) in line and fragment in line and f"tensor {name}" in line
    assert siblings(tmp_path) == before


def test_file_without_float_tensors(cli, tmp_path):
    src = tmp_path / "ints.npz"
    np.savez(src, a=np.arange(4), b=np.zeros(3, bool))
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1"), 1)
    assert str(src) in line and "no floating-point tensor" in line


def corrupt(tmp_path: Path, kind: str) -> Path:
    if kind == "truncated safetensors":
        src = write_model_safetensors(tmp_path / "m.safetensors")
        src.write_bytes(src.read_bytes()[:-10])
    elif kind == "safetensors truncated in its header":  # was "not a dataset tldp can read"
        src = write_model_safetensors(tmp_path / "m.safetensors")
        src.write_bytes(src.read_bytes()[:300])
    elif kind == "bad safetensors header":
        src = tmp_path / "m.safetensors"
        src.write_bytes(struct.pack("<Q", 12) + b'{"w": [1, 2' + b" " * 40)
    elif kind == "deeply nested safetensors header":  # issue 27: json.loads raised RecursionError
        src = write_model_safetensors(tmp_path / "m.safetensors")
        raw = src.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header = raw[8:8 + length].rstrip().removesuffix(b"}") + b', "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        src.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length:])
    elif kind == "truncated npz":
        src = write_model_npz(tmp_path / "m.npz")
        src.write_bytes(src.read_bytes()[:300])
    else:  # a flipped byte inside a stored member: its CRC fails when the tensor is read
        src = tmp_path / "m.npz"
        np.savez(src, small=np.zeros(3, np.float32), big=np.zeros(20000, np.float32))
        raw = bytearray(src.read_bytes())
        with zipfile.ZipFile(src) as zf:
            info = zf.getinfo("big.npy")
        raw[info.header_offset + 30 + len(info.filename) + 20 + info.file_size // 2] ^= 0xFF
        src.write_bytes(bytes(raw))
    return src


@pytest.mark.parametrize("kind,fragment", [
    ("truncated safetensors", "not a valid safetensors file"),
    ("safetensors truncated in its header", "not a valid safetensors file (its header of"),
    ("bad safetensors header", "its header is not valid JSON"),
    ("deeply nested safetensors header", "its header is not valid JSON (it nests lists and objects more than 100"),
    ("truncated npz", "not a valid .npz file"),
    ("bad CRC", "cannot read tensor big (Bad CRC-32")])
def test_corrupt_files_are_refused_with_nothing_written(cli, tmp_path, kind, fragment):
    src = corrupt(tmp_path, kind)
    before, digest = siblings(tmp_path), tree_digest(src)
    # --allow-raw-release: the bad-CRC file's 3-value tensor keeps raw values with probability
    # above dp_delta, and the consent check (tests/privacy/test_raw_release.py) runs before any read.
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1", "--workers", "2",
                              "--allow-raw-release"), 1)
    assert str(src) in line and fragment in line
    assert siblings(tmp_path) == before and tree_digest(src) == digest


def test_a_file_shorter_than_its_header_length_is_refused(cli, tmp_path):
    """--format safetensors on a 3-byte file: was "unexpected error (unpack requires a buffer of 8 bytes)"."""
    src = tmp_path / "m.safetensors"
    src.write_bytes(b"abc")
    line = one_line_error(cli("perturb", src, "--format", "safetensors", "--eps", "1", "--clip", "1"), 1)
    assert f"{src}: not a valid safetensors file (it is shorter than the 8 bytes" in line
    assert siblings(tmp_path) == {"m.safetensors"}


def test_nan_in_a_tensor_names_it(cli, tmp_path):
    w = np.zeros((4, 4), np.float32)
    w[2, 1] = np.nan
    src = write_safetensors(tmp_path / "m.safetensors", {"ok": np.zeros(3, np.float32), "w": w})
    # Tensors of 3 and 16 values need consent to keep raw values (tests/privacy/test_raw_release.py),
    # so the run reaches the data and its NaN.
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1", "--allow-raw-release"), 1)
    assert "tensor w" in line and "NaN or Inf" in line and "element 9" in line


@pytest.mark.parametrize("args,fragment", [
    (("--clip", "1", "--range", "-1:1"), "not both"),
    (("--clip", "0"), "--clip must be a finite number > 0"),
    (("--clip", "-2"), "--clip must be a finite number > 0"),
    (("--clip", "nan"), "--clip must be a finite number > 0"),
    ((), "needs --range")])
def test_clip_usage_errors(cli, tmp_path, args, fragment):
    src = write_model_safetensors(tmp_path / "m.safetensors")
    before = siblings(tmp_path)
    assert fragment in one_line_error(cli("perturb", src, "--eps", "1", *args), 2)
    assert siblings(tmp_path) == before


def test_a_clip_below_1_on_integer_data_is_refused_naming_the_clip(cli, tmp_path):
    """--clip 0.1 on int8 data (a model's clip given to several inputs) was refused as "the
    range 0:1 holds a single grid value", a range nobody typed."""
    src = tmp_path / "codes.npy"
    np.save(src, np.arange(-64, 64, dtype=np.int8).reshape(8, 16))
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "0.1"), 2)
    assert line.startswith(f"tldp: error: {src}: --clip 0.1 on integer data (int8) keeps one integer")
    assert siblings(tmp_path) == {"codes.npy"}


def test_clip_works_for_every_format_npy(cli, tmp_path):
    src = tmp_path / "x.npy"
    x = np.array([[-100.0, -0.25, 0.25, 100.0]] * 50)
    np.save(src, x)
    result = cli("perturb", src, "--eps", "1000", "--clip", "1", "--seed", "2", "--allow-weak-seed", "--json",
                 "-q")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["value_range"] == [-1.0, 1.0] and m["range_width"] == 2.0
    assert m["preprocessing"] == ["clip"] and m["clip"] == {"norm": "linf", "bound": 1.0}
    # the default exact sampler: discrete Laplace on the automatic grid over the clipped range,
    # b = W / eps in grid steps (W grid values)
    assert m["noise"] == "discrete-laplace"
    assert m["granularity"] * m["grid"]["sensitivity_steps"] == 2.0
    assert m["noise_scale"] == pytest.approx(m["grid"]["values"] / 1000)
    y = np.load(tmp_path / "x.tldp.npy")
    np.testing.assert_allclose(y, np.clip(x, -1, 1), atol=0.2)


def test_clip_on_integer_images(cli, tmp_path):
    """uint8 data: --clip replaces the dtype's default range 0:256."""
    src = tmp_path / "u8.npy"
    np.save(src, np.full((20, 3, 3), 200, np.uint8))
    result = cli("perturb", src, "--eps", "1000", "--clip", "2", "--seed", "1", "--allow-weak-seed", "--json",
                 "-q")
    assert result.exit_code == 0, result.stderr
    # integer data under the exact default: the 5 values -2..2 ([-2, 3) holds them), W = 5
    assert json.loads(result.stdout)["range_width"] == 5.0
    assert json.loads(result.stdout)["value_range"] == [-2, 3]
    np.testing.assert_allclose(np.load(tmp_path / "u8.tldp.npy"), 2.0, atol=0.5)


# --------------------------------------------------------------------------- accounting

def laplace_p(eps: float, width: float, elements: int) -> float:
    """The paper's retain probability (docs/guarantee.md): p = e^{eps - I Delta/b} / (2b + e^{eps - I Delta/b}), b = Delta/eps."""
    b = width / eps
    a = math.exp(eps - elements * width / b)
    return a / (2 * b + a)


def test_manifest_composes_the_tensors_of_the_file(cli, tmp_path):
    """Tensors of 1, 2 and 3 elements at eps 5, C = 1: p is far from 0, so the point
    masses are visible, and every figure has a closed form."""
    src = write_safetensors(tmp_path / "tiny.safetensors", {
        "a": np.zeros(1, np.float32), "b": np.zeros(2, np.float32), "c": np.zeros(3, np.float32)})
    # the closed forms are those of continuous Laplace noise: --sampler float
    result = cli("perturb", src, "--eps", "5", "--clip", "1", "--sampler", "float", "--json", "-q",
                 "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["noise"] == "laplace"
    acc = m["accounting"]
    ps = {n: laplace_p(5.0, 2.0, i) for n, i in (("a", 1), ("b", 2), ("c", 3))}
    for entry, (name, size) in zip(acc["per_tensor"], (("a", 1), ("b", 2), ("c", 3))):
        assert entry["name"] == name and entry["elements"] == size
        assert entry["noise_scale"] == pytest.approx(2.0 / 5.0)
        assert entry["retain_probability"] == pytest.approx(ps[name])
        assert entry["epsilon"] == pytest.approx(5.0 * size)
        assert entry["point_mass_delta"] == pytest.approx(1 - (1 - ps[name]) ** size)
    f = acc["per_file"]
    assert f["records"] == 3 and f["elements"] == 6
    assert f["epsilon"] == pytest.approx(30.0)
    closed = 1 - (1 - ps["a"]) * (1 - ps["b"]) ** 2 * (1 - ps["c"]) ** 3
    assert f["point_mass_delta"] == pytest.approx(closed) and f["delta"] == pytest.approx(closed)
    assert f["approx"]["delta"] == pytest.approx(1e-5 + closed)
    # Each element and each record: the worst case over the tensors. The largest tensor has
    # the largest pure eps (15), the 1-element tensor keeps its raw value with p_a = 0.556.
    assert acc["per_record"]["epsilon"] == pytest.approx(15.0)
    assert acc["per_record"]["delta"] == pytest.approx(ps["a"]) and ps["a"] > 0.5
    assert acc["per_element"]["epsilon"] == pytest.approx(5.0)
    assert acc["per_element"]["delta"] == acc["per_element"]["point_mass_delta"] == pytest.approx(ps["a"])
    assert acc["per_element"]["approx"]["delta"] == pytest.approx(1e-5 + ps["a"])
    assert acc["worst_case_of"] == 3
    assert m["retain_probability"] == pytest.approx(ps["a"])
    assert m["retain_probability_log10"] == pytest.approx(math.log10(ps["a"]))
    assert [c["elements_per_record"] for c in m["calibrations"]] == [1, 2, 3]
    assert [c["retain_probability"] for c in m["calibrations"]] == pytest.approx([ps["a"], ps["b"], ps["c"]])
    assert m["elements_per_record"] == 3 and m["noise_scale"] == pytest.approx(0.4)


# Exact TLDP-L certifies at least 5.9 per record of 128 elements: --eps 8 for the default
# sampler, --eps 2 for the continuous one.
@pytest.mark.parametrize("eps,sampler", [(8.0, "exact"), (2.0, "float")])
def test_record_budget_gives_each_tensor_eps_and_the_file_the_sum(cli, tmp_path, eps, sampler):
    src = write_model_safetensors(tmp_path / "m.safetensors")
    result = cli("perturb", src, "--eps", eps, "--clip", "0.5", "--budget", "record", "--sampler", sampler,
                 "--json", "-q", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    acc = json.loads(result.stdout)["accounting"]
    assert [t["epsilon"] for t in acc["per_tensor"]] == pytest.approx([eps] * 4)
    assert acc["per_file"]["epsilon"] == pytest.approx(4 * eps)


def test_compose_one_record_is_the_per_record_figure():
    for noise in ("laplace", "gaussian"):
        c = calibrate(mechanism="tldp", noise=noise, budget="element", epsilon=1.0, range_width=2.0,
                      elements=300)
        one, rec = accounting.compose([(c, 1)]), accounting.certify(c).per_record
        for key in ("epsilon", "delta", "point_mass_delta") + (("rho",) if noise == "gaussian" else ()):
            assert getattr(one, key) == pytest.approx(getattr(rec, key), rel=1e-9), (noise, key)
        assert one.rho is rec.rho is None or noise == "gaussian"
        assert one.approx_epsilon == pytest.approx(rec.approx_epsilon, rel=1e-9)


def test_composed_laplace_against_dp_accounting():
    """Per-record budget: tensors of 4 and 16 elements get different scales; the composed
    (eps, delta) is checked against dp-accounting's PLD at a finer grid."""
    from dp_accounting import ComposedDpEvent, LaplaceDpEvent, SelfComposedDpEvent
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    cs = [calibrate(mechanism="tldp", noise="laplace", budget="record", epsilon=1.0, range_width=2.0,
                    elements=i) for i in (4, 16)]
    f = accounting.compose([(cs[0], 3), (cs[1], 2)])  # 3 tensors of 4 elements, 2 of 16
    assert f.epsilon == pytest.approx(5.0)  # pure: 5 records of eps 1
    pld = PLDAccountant(value_discretization_interval=1e-5)
    pld.compose(ComposedDpEvent([SelfComposedDpEvent(LaplaceDpEvent(c.scale / 2.0), n * c.elements)
                                 for c, n in zip(cs, (3, 2))]))
    assert f.approx_epsilon == pytest.approx(pld.get_epsilon(1e-5), rel=1e-2)
    assert f.approx_epsilon < 5.0


def test_composed_gaussian_is_one_gaussian_of_the_summed_rho():
    from dp_accounting import ComposedDpEvent, GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    cs = [calibrate(mechanism="tldp", noise="gaussian", budget=b, epsilon=e, range_width=1.0, elements=i)
          for b, e, i in (("element", 0.5, 10), ("record", 3.0, 40))]
    f = accounting.compose([(cs[0], 2), (cs[1], 1)])
    rho = 2 * 10 * 0.5 + 40 / (2 * cs[1].scale**2)
    assert f.rho == pytest.approx(rho)
    # Closed form: the composition is a Gaussian of sensitivity/sigma = sqrt(2 rho).
    assert analytic_gaussian_delta(f.approx_epsilon, 1.0, math.sqrt(2 * rho)) == pytest.approx(1e-5, rel=1e-3)
    assert f.epsilon <= rho + 2 * math.sqrt(rho * math.log(1e5))
    pld = PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(ComposedDpEvent([SelfComposedDpEvent(GaussianDpEvent(c.scale / 1.0), n * c.elements)
                                 for c, n in zip(cs, (2, 1))]))
    assert f.epsilon == pytest.approx(pld.get_epsilon(1e-5), rel=1e-2)


def test_training_rounds_compose():
    calibs = model_params.calibrate_tensors({"w": (8, 4), "b": (4,)}, epsilon=1.0, clip=0.1)
    one, ten = model_params.certify_tensors(calibs), model_params.certify_tensors(calibs, releases=10)
    assert one["per_file"]["epsilon"] == pytest.approx(36.0)
    assert ten["per_file"]["epsilon"] == pytest.approx(360.0)
    assert ten["per_tensor"] == one["per_tensor"]  # per release


def test_library_perturbs_in_memory_like_the_file_path():
    params = {"w": np.full((30, 40), 3.0, np.float32), "b": np.zeros(4, np.float16)}
    calibs = model_params.calibrate_tensors({n: t.shape for n, t in params.items()}, epsilon=1000.0, clip=0.5)
    streams = Streams("fast", seed=1, allow_weak_seed=True)
    a = model_params.perturb_tensors(params, calibs, streams=streams, key="round 0")
    b = model_params.perturb_tensors(params, calibs, streams=streams, key="round 1")
    assert a["w"].dtype == np.float32 and a["b"].dtype == np.float16
    np.testing.assert_allclose(a["w"], 0.5, atol=0.05)  # clipped to C, little noise
    assert not np.array_equal(a["w"], b["w"]), "two releases must not share their noise"


# --------------------------------------------------------------------------- details

def test_narrow_dtypes_round_to_nearest_and_saturate():
    big = np.array([1e6, -1e6, 1.0], np.float32)
    assert tensor_files.to_stored(big, "float16").tolist() == [65504.0, -65504.0, 1.0]
    # 1 + 2^-8 is halfway between two bfloat16 values: ties go to the even one (1.0).
    bits = tensor_files.to_stored(np.array([1 + 2**-8, 1 + 3 * 2**-8, 1e39], np.float64), "bfloat16")
    back = tensor_files.bfloat16_to_float32(bits)
    assert back[0] == 1.0 and back[1] == 1 + 2**-6 and np.isfinite(back[2])


def test_readers_and_writers_pickle(tmp_path):
    """Blocks may run in other processes (--scheduler dask)."""
    for src, module in ((write_model_safetensors(tmp_path / "m.safetensors"), safetensors_file),
                        (write_model_npz(tmp_path / "m.npz"), npz)):
        reader = module.open_reader(src, FormatOptions())
        job = reader.arrays()[0]
        np.testing.assert_array_equal(pickle.loads(pickle.dumps(job.read))(0, 1), job.read(0, 1))
        reader.close()


def test_other_noises_compose_by_their_per_record_figures(cli, tmp_path):
    """Discrete noise: the pure bound already covers the kept values (delta 0), so the
    file's figure is the sum of the tensors' (basic composition)."""
    src = write_model_safetensors(tmp_path / "m.safetensors")
    result = cli("perturb", src, "--eps", "1", "--clip", "0.5", "--noise", "discrete-laplace", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    acc = json.loads(result.stdout)["accounting"]
    assert acc["per_file"]["epsilon"] == pytest.approx(sum(t["epsilon"] for t in acc["per_tensor"]))
    assert acc["per_file"]["delta"] == 0.0 and acc["per_file"]["point_mass_delta"] == 0.0


def fp8_model(path: Path) -> Path:
    """A float32 weight and an FP8 (E4M3) one, written by the format's specification."""
    weight = np.linspace(-0.05, 0.05, 16, dtype=np.float32).reshape(4, 4).tobytes()
    fp8 = bytes([0x38, 0xB8, 0x30, 0x00])  # 1.0, -1.0, 0.5, 0.0 in E4M3
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
              "f8": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [64, 68]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + weight + fp8)
    return path


def test_fp8_weights_are_never_copied_raw_unasked(cli, tmp_path):
    """FP8 tensors were copied unperturbed, as "float8_e4m3fn: only floating-point tensors
    are perturbed": raw weights in a release nobody asked for."""
    src = fp8_model(tmp_path / "m.safetensors")
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "0.1"), 1)
    assert "tensor f8 is float8_e4m3fn, which tldp cannot perturb" in line and "--exclude f8" in line
    assert siblings(tmp_path) == {"m.safetensors"}
    result = cli("perturb", src, "--eps", "1", "--clip", "0.1", "--exclude", "f8", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    out = (tmp_path / "m.tldp.safetensors").read_bytes()
    assert out.endswith(bytes([0x38, 0xB8, 0x30, 0x00]))  # the last tensor of the file, as it was


@pytest.mark.parametrize("code, dtype, size", [("F4", "float4_e2m1fn", 4), ("F6_E2M3", "float6_e2m3fn", 6),
                                               ("F6_E3M2", "float6_e3m2fn", 6), ("F8_E8M0", "float8_e8m0fnu", 4)])
def test_fp4_fp6_weights_and_e8m0_scales_are_never_copied_raw_unasked(cli, tmp_path, code, dtype, size):
    """The microscaling formats safetensors stores (MXFP4, NVFP4: FP4 or FP6 weights, E8M0
    block scales) were copied raw unasked, as "f4: only float16, bfloat16, float32, float64
    tensors are perturbed", where FP8 is refused."""
    weight = np.linspace(-0.05, 0.05, 16, dtype=np.float32).tobytes()
    codes = bytes(range(17, 17 + size))  # 8 values packed: 4 bytes of F4, 6 of F6; 4 of E8M0 (2 x 2)
    shape = [2, 2] if code == "F8_E8M0" else [8]
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
              "q": {"dtype": code, "shape": shape, "data_offsets": [64, 64 + size]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    src = tmp_path / "m.safetensors"
    src.write_bytes(struct.pack("<Q", len(raw)) + raw + weight + codes)
    with safe_open(str(src), framework="np") as f:  # the library takes the file as it is
        assert sorted(f.keys()) == ["q", "w"]
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "0.1"), 1)
    assert f"{src}: tensor q is {dtype}, which tldp cannot perturb" in line and "--exclude q" in line
    assert siblings(tmp_path) == {"m.safetensors"}
    result = cli("perturb", src, "--eps", "1", "--clip", "0.1", "--exclude", "q", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "m.tldp.safetensors").read_bytes().endswith(codes)


def test_a_clip_too_small_for_the_tensor_dtype_is_refused(cli, tmp_path):
    """--clip 1e-300 made grid steps float32 cannot hold: every weight came out 0."""
    src = write_model_safetensors(tmp_path / "m.safetensors")
    line = one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1e-300"), 2)
    assert "cannot hold grid steps of" in line and line.startswith(f"tldp: error: {src}: ")
    assert siblings(tmp_path) == {"m.safetensors"}


def test_a_grid_float32_cannot_hold_is_refused_naming_the_file(cli, tmp_path):
    """The warning's advice, --budget record, on a model of 1024-value tensors was refused with
    "--dtype float32 cannot hold the grid values exactly ..." naming no file (with several
    inputs, no way to tell which one); --dtype float64, which the line advises, then works.
    Without --dtype the run now computes in float64 itself (test_model_checkpoints.py); the
    refusal stays for --dtype float32 given."""
    src = write_safetensors(tmp_path / "m.safetensors",
                            {"w": RNG.normal(0, 0.02, (32, 32)).astype(np.float32)})
    args = ("perturb", src, "--eps", "8", "--budget", "record", "--clip", "0.1")
    line = one_line_error(cli(*args, "--dtype", "float32"), 2)
    assert line.startswith(f"tldp: error: {src}: --dtype float32 cannot hold the grid values exactly")
    assert siblings(tmp_path) == {"m.safetensors"}
    result = cli(*args, "--dtype", "float64")
    assert result.exit_code == 0, result.stderr
    assert read_safetensors(tmp_path / "m.tldp.safetensors")[2]["w"].dtype == np.float32
