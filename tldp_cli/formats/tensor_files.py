"""What the model-parameter formats (.npz, .safetensors) share.

Each named tensor is one record of its own (records = 1, I = the tensor's size), so a
tensor is read, perturbed and written whole: memory is bounded by the largest tensor
(a few float copies of it per block in flight), not by the file.

Model files keep every tensor's dtype. Floating-point tensors (float16, bfloat16,
float32, float64) can be perturbed: the noise is drawn and added in --dtype and the
result is rounded back to the tensor's dtype. Integer, boolean and other tensors
(step counters, index buffers, quantised codes) are copied unchanged and cannot be
selected: noise would have to be rounded into their codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.formats import ArrayJob

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
NARROW_MAX = {"float16": float(np.finfo(np.float16).max), "bfloat16": 3.3895313892515355e38}


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "float16", "bfloat16", "int64", ... (safetensors' F8 types by their NumPy-style names)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def perturbable(self) -> bool:
        return self.dtype in FLOAT_DTYPES and self.size > 0


def select(path: Path, tensors: list[Tensor], requested: list[str]) -> tuple[list[Tensor], list[str]]:
    """The tensors to perturb (in file order) and the messages that say what was chosen."""
    by_name = {t.name: t for t in tensors}
    if requested:
        wanted = set()
        for name in requested:
            tensor = by_name.get(name)
            where = f"{path}: tensor {name}"
            if tensor is None:
                floats = [t.name for t in tensors if t.perturbable]
                shown = floats or [f"{t.name} ({t.dtype})" for t in tensors]
                listing = ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")
                hint = (f"floating-point tensors: {listing}" if floats else
                        f"no floating-point tensor; tensors: {listing}" if tensors else "it holds no tensor")
                raise InputError(f"{where}: no such tensor in the file ({hint})")
            if tensor.dtype not in FLOAT_DTYPES:
                raise InputError(f"{where}: has dtype {tensor.dtype}; tldp perturbs the floating-point "
                                 "tensors of a model file (each keeps its dtype); leave it out and it "
                                 "is copied unchanged")
            if tensor.size == 0:
                raise InputError(f"{where}: is empty (shape {tensor.shape}); nothing to perturb")
            wanted.add(name)
        return [t for t in tensors if t.name in wanted], []
    chosen = [t for t in tensors if t.perturbable]
    if not chosen:
        raise InputError(f"{path}: no floating-point tensor to perturb (tensors: "
                         f"{', '.join(f'{t.name} {t.dtype}' for t in tensors[:8]) or 'none'})")
    kept = [t for t in tensors if not t.perturbable]
    message = f"perturbing {len(chosen)} floating-point tensor{'s' if len(chosen) > 1 else ''} of {path.name}"
    if kept:
        listing = ", ".join(f"{t.name} ({t.dtype})" for t in kept[:8]) + (", ..." if len(kept) > 8 else "")
        message += f"; copied unchanged: {listing}"
    return chosen, [message + " (choose with --dataset NAME)"]


def job(path: Path, format_name: str, tensor: Tensor, read) -> ArrayJob:
    """The tensor as one record; bfloat16 is read as float32 (exactly)."""
    dtype = np.dtype(np.float32) if tensor.dtype == "bfloat16" else np.dtype(tensor.dtype)
    return ArrayJob(name=tensor.name, shape=(1, *tensor.shape), dtype=dtype, read=read,
                    source={"path": str(path), "format": format_name, "dataset": tensor.name,
                            "shape": list(tensor.shape), "dtype": tensor.dtype})


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype("<u4") << 16).view("<f4")


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16), rounded to nearest even; values must be finite."""
    u = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")


def to_stored(values: np.ndarray, dtype: str, byteorder_dtype: np.dtype | None = None) -> np.ndarray:
    """Perturbed values in the tensor's own dtype: bfloat16 as its uint16 bit patterns.

    Values beyond a narrow dtype's largest finite value saturate there instead of
    becoming infinite (a noisy float16 parameter near 65504 stays finite).
    """
    if dtype in NARROW_MAX:
        limit = NARROW_MAX[dtype]
        values = np.clip(values, -limit, limit)
    if dtype == "bfloat16":
        return float32_to_bfloat16(values)
    return np.asarray(values).astype(byteorder_dtype or np.dtype(dtype))


def postprocessing(tensors: list[Tensor], noise_dtype: np.dtype) -> list[str]:
    """The steps after the noise, for the manifest."""
    steps = []
    noise_dtype = np.dtype(noise_dtype)
    for dtype in sorted({t.dtype for t in tensors}):
        size = 2 if dtype in NARROW_MAX else np.dtype(dtype).itemsize
        if noise_dtype.itemsize > size:
            saturate = (f"; values beyond +-{NARROW_MAX[dtype]:.6g} saturate there"
                        if dtype in NARROW_MAX else "")
            steps.append(f"{dtype} tensors rounded to {dtype} (nearest even) after the noise{saturate}")
        elif noise_dtype.itemsize < size:
            steps.append(f"{dtype} tensors perturbed in {noise_dtype} precision (--dtype float64 keeps "
                         "double precision)")
    return steps


def output_dtype(tensors: list[Tensor]) -> str:
    return " and ".join(sorted({t.dtype for t in tensors})) + " (each tensor keeps its dtype)"
