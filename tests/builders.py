"""Builders shared by the test modules (and benchmarks): inputs in every format, closed
forms the tests compare against, and assertions on one-line errors."""

import json
import math
import struct
from pathlib import Path

import h5py
import numpy as np
import zarr
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import save_file
from scipy.stats import norm

def mixture_loss_atoms(d: int, b: float, p: float) -> dict[float, float]:
    """Privacy loss of one element of the discrete Laplace TLDP mixture for the inputs 0 and
    d, outcome by outcome on -T..d+T (no lumping): {loss: mass under input 0}, equal losses
    merged and rounded up by 1e-9; the mass beyond T (< 1e-18) as an infinite loss."""
    from collections import defaultdict

    a = math.exp(-1 / b)
    T = math.ceil(45 * b) + 1
    y = np.arange(-T, d + T + 1)
    c = (1 - p) * (1 - a) / (1 + a)
    upper, lower = c * a ** np.abs(y).astype(float), c * a ** np.abs(y - d).astype(float)
    upper[y == 0] += p
    lower[y == d] += p
    atoms = defaultdict(float)
    for loss, mass in zip(np.log(upper) - np.log(lower), upper):
        atoms[round(float(loss), 9) + 1e-9] += float(mass)
    atoms[math.inf] += max(0.0, 1 - float(upper.sum()))
    return atoms


def composed_losses(atoms_list) -> dict[float, float]:
    """The loss distribution of independent elements: every combination of their atoms."""
    from collections import defaultdict

    dist = {0.0: 1.0}
    for atoms in atoms_list:
        combined = defaultdict(float)
        for l0, p0 in dist.items():
            for l1, p1 in atoms.items():
                combined[round(l0 + l1, 9)] += p0 * p1
        dist = combined
    return dist


def exact_delta(dist: dict[float, float], eps: float) -> float:
    """Hockey-stick divergence E[(1 - e^(eps - L))+] of a loss distribution."""
    return sum(m * (1.0 if loss == math.inf else -math.expm1(eps - loss)) for loss, m in dist.items()
               if loss > eps)


def exact_epsilon(dist: dict[float, float], delta: float) -> float:
    lo, hi = 0.0, max(loss for loss in dist if loss != math.inf) + 1
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exact_delta(dist, mid) > delta else (lo, mid)
    return hi


def bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = values.astype("<f4").view("<u4")
    assert not (bits & 0xFFFF).any(), "not exactly representable in bfloat16"
    return (bits >> 16).astype("<u2")


def write_safetensors(path: Path, tensors: dict, bf16: dict | None = None, metadata=None) -> Path:
    """With the safetensors library; bfloat16 tensors (given as float32, which NumPy's API
    cannot hold) by the format's specification, then checked by the library."""
    if not bf16:
        save_file(tensors, str(path), metadata=metadata)
        return path
    codes = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "bool": "BOOL"}
    parts = [(n, codes[v.dtype.name], v.shape, np.ascontiguousarray(v, v.dtype.newbyteorder("<")).tobytes())
             for n, v in tensors.items()]
    parts += [(n, "BF16", v.shape, bf16_bits(v).tobytes()) for n, v in bf16.items()]
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, code, shape, data in parts:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(p[3] for p in parts))
    with safe_open(str(path), framework="np") as f:
        assert sorted(f.keys()) == sorted(header.keys() - {"__metadata__"})
    return path


def read_safetensors(path: Path) -> tuple[bytes, dict, dict[str, np.ndarray]]:
    """The header bytes, __metadata__ and every tensor (bfloat16 as float32), parsed here
    without tldp's reader."""
    raw = Path(path).read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    codes = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "BOOL": "?", "BF16": "<u2"}
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        array = np.frombuffer(data[begin:end], codes[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            array = (array.astype("<u4") << 16).view("<f4")
        tensors[name] = array
    return raw[:8 + length], header.get("__metadata__", {}), tensors


def assert_one_line_error(result, code, *fragments):
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def analytic_gaussian_delta(eps, sigma, sensitivity):
    """Balle and Wang (2018), Theorem 8: the exact delta of a Gaussian mechanism at eps."""
    a = sensitivity / (2 * sigma)
    b = eps * sigma / sensitivity
    return norm.cdf(a - b) - math.exp(eps + norm.logcdf(-a - b))


DATA = np.random.default_rng(5).integers(0, 256, (200, 8, 8), dtype=np.uint8)


def make_npy(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, DATA)
    return path, lambda out: np.load(out)


def make_hdf5(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=DATA, chunks=(10, 8, 8), compression="gzip")
    return path, lambda out: h5py.File(out, "r")["x"][...]


def make_zarr(tmp_path):
    path = tmp_path / "d.zarr"
    z = zarr.create_array(store=str(path), shape=DATA.shape, dtype=DATA.dtype, chunks=(10, 8, 8),
                          shards=(20, 8, 8), zarr_format=3)
    z[:] = DATA
    return path, lambda out: zarr.open_array(str(out), mode="r")[...]


def make_images(tmp_path):
    path = tmp_path / "imgs"
    path.mkdir()
    for i in range(30):
        Image.fromarray(DATA[i]).save(path / f"{i:02d}.png")
    return path, lambda out: np.stack([np.asarray(Image.open(out / f"{i:02d}.png")) for i in range(30)])
