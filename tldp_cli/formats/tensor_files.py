"""What the model-parameter formats (.npz, .safetensors) share.

Each named tensor is one record of its own (records = 1, I = the tensor's size). A
tensor larger than a block is read, perturbed and written part by part where the
format can (ArrayJob.read_parts, Writer.part_writer: safetensors files and shards,
.npz members in C order), so memory stays flat whatever the tensor's size; otherwise it
is read, perturbed and written whole (a few float copies of it in flight).

Model files keep every tensor's dtype. Floating-point tensors (float16, bfloat16,
float32, float64) can be perturbed: the noise is drawn and added in --dtype and the
result is rounded back to the tensor's dtype. Integer, boolean and other tensors
(step counters, index buffers, quantised codes) are copied unchanged and cannot be
selected: noise would have to be rounded into their codes.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError, NotHeld, UsageError
from tldp_cli.formats import ArrayJob

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# FP8, FP6 and FP4 weights (and E8M0 block scales): refused unless --exclude names them
NARROW_FLOATS = ("float8", "float6_", "float4_")  # prefixes: not float64
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


# Normalisation statistics (PyTorch BatchNorm buffers, Keras moving averages) by the last
# part of their name: perturbed, a variance can go negative and the model outputs NaN.
NORM_STATS = ("running_mean", "running_var", "num_batches_tracked", "moving_mean", "moving_variance")
VARIANCES = ("running_var", "moving_variance")
NORM_REASON = "normalisation statistics: perturbing can make the variance negative"


def leaf(name: str) -> str:
    """The last part of a tensor's name: bn1.running_var -> running_var."""
    return re.split(r"[./]", name)[-1]


def matching(name: str, patterns: list[str]) -> str | None:
    """The first --exclude glob that matches the name (with or without a leading "/")."""
    return next((p for p in patterns
                 if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.lstrip("/"), p.lstrip("/"))),
                None)


def select(path: Path, tensors: list[Tensor], requested: list[str], exclude: Sequence[str] = (),
           norm_stats: set[str] | None = None) -> tuple[list[Tensor], list[str], list[dict]]:
    """The tensors to perturb (in file order), the messages that say what was chosen, and
    the tensors copied unchanged, each with the reason (the manifest's `unperturbed`).

    Default: every floating-point tensor but the normalisation statistics (`norm_stats`,
    by default found by name) and those an --exclude glob matches. Named with --dataset,
    a floating-point tensor is perturbed whatever it is."""
    if norm_stats is None:
        norm_stats = {t.name for t in tensors if leaf(t.name) in NORM_STATS}
    unmatched = [p for p in exclude if not any(matching(t.name, [p]) for t in tensors)]
    if unmatched:
        raise NotHeld(f"{path}: --exclude {unmatched[0]} matches no tensor in the file", "exclude", unmatched)
    if requested:
        names = [name for name in requested if not _is_glob(tensors, name)]
        wanted = {_requested(path, tensors, name).name for name in names}
        both = [(n, matching(n, list(exclude))) for n in wanted if matching(n, list(exclude))]
        if both:
            raise UsageError(f"{path}: tensor {both[0][0]} is named by --dataset and matched by "
                             f"--exclude {both[0][1]}; give one")
        reasons: dict[str, str] = {}
        for pattern in (name for name in requested if name not in names):
            wanted |= _globbed(path, tensors, pattern, list(exclude), reasons)
        chosen = [t for t in tensors if t.name in wanted]
        for t in tensors:
            if t.name not in wanted and t.name not in reasons:
                reasons[t.name] = "not named by --dataset"
        return chosen, [], _unperturbed(tensors, reasons)
    reasons = {}
    for t in tensors:
        excluded_by = matching(t.name, list(exclude))
        if t.name in norm_stats:
            reasons[t.name] = NORM_REASON
        elif excluded_by is not None:
            reasons[t.name] = f"--exclude {excluded_by}"
        elif t.dtype.startswith(NARROW_FLOATS):  # weights all the same: never copied raw unasked
            raise InputError(f"{path}: tensor {t.name} is {t.dtype}, which tldp cannot perturb (noise "
                             "does not fit floats of 8 bits or fewer); convert the file to bfloat16 or "
                             f"float16, or pass --exclude {t.name} to copy it unperturbed")
        elif not t.perturbable:
            reasons[t.name] = _unperturbable(t)
    chosen = [t for t in tensors if t.name not in reasons]
    if not chosen:
        listing = ", ".join(f"{t.name} ({t.dtype})" for t in tensors[:8]) or "none"
        raise InputError(f"{path}: no floating-point tensor to perturb (tensors: {listing}"
                         + ("; see --exclude and the normalisation statistics" if reasons and any(
                             t.perturbable for t in tensors) else "") + ")")
    message = (f"perturbing {len(chosen)} floating-point tensor{'s' if len(chosen) > 1 else ''} "
               f"of {path.name} (choose with --dataset NAME, leave out with --exclude PATTERN)")
    return chosen, [message], _unperturbed(tensors, reasons)


def _unperturbable(tensor: Tensor) -> str:
    """Why a tensor that is not perturbable is left as it is: empty, or not floating-point."""
    return ("empty" if tensor.dtype in FLOAT_DTYPES else
            f"{tensor.dtype}: only {', '.join(FLOAT_DTYPES)} tensors are perturbed")


def _is_glob(tensors: list[Tensor], name: str) -> bool:
    """A --dataset that is a glob (as --exclude's): not a tensor's own name, and with * ? or [."""
    return any(c in name for c in "*?[") and not any(t.name == name for t in tensors)


def _globbed(path: Path, tensors: list[Tensor], pattern: str, exclude: list[str],
             reasons: dict[str, str]) -> set[str]:
    """The tensors a --dataset glob chooses: the non-empty floating-point ones it matches
    (normalisation statistics included, as when named) but those --exclude leaves out
    (their reasons added to `reasons`, with those of the matched tensors of other dtypes).
    A glob that matches nothing is refused as a missing name is; FP8/FP6/FP4 as when named."""
    matched = [t for t in tensors if matching(t.name, [pattern])]
    if not matched:
        _requested(path, tensors, pattern)  # raises: no such tensor, with the listing
    chosen = set()
    for t in matched:
        if t.dtype.startswith(NARROW_FLOATS):
            _requested(path, tensors, t.name)  # raises: tldp perturbs the floating-point tensors
        elif (left_out := matching(t.name, exclude)) is not None:
            reasons.setdefault(t.name, f"--exclude {left_out}")
        elif not t.perturbable:
            reasons.setdefault(t.name, _unperturbable(t))
        else:
            chosen.add(t.name)
    if not chosen:
        raise InputError(f"{path}: --dataset {pattern} matches no floating-point tensor to perturb "
                         f"({', '.join(f'{t.name} ({reasons[t.name]})' for t in matched[:8])})")
    return chosen


def _requested(path: Path, tensors: list[Tensor], name: str) -> Tensor:
    """The tensor --dataset names, refused unless it can be perturbed."""
    tensor = next((t for t in tensors if t.name == name), None)
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
    return tensor


def _unperturbed(tensors: list[Tensor], reasons: dict[str, str]) -> list[dict]:
    return [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "reason": reasons[t.name]}
            for t in tensors if t.name in reasons]


def manifest_extra(unperturbed: list[dict]) -> dict:
    return {"unperturbed": unperturbed} if unperturbed else {}


def job(path: Path, format_name: str, tensor: Tensor, read, read_parts=None) -> ArrayJob:
    """The tensor as one record; bfloat16 is read as float32 (exactly). `read_parts`: the
    tensor read in parts (ArrayJob.read_parts), where the format can."""
    dtype = np.dtype(np.float32) if tensor.dtype == "bfloat16" else np.dtype(tensor.dtype)
    return ArrayJob(name=tensor.name, shape=(1, *tensor.shape), dtype=dtype, read=read,
                    source={"path": str(path), "format": format_name, "dataset": tensor.name,
                            "shape": list(tensor.shape), "dtype": tensor.dtype}, read_parts=read_parts)


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype("<u4") << 16).view("<f4")


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16), rounded to nearest even; values must be finite."""
    u = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")


def bfloat16_order(dtype: np.dtype, header: bytes) -> str | None:
    """The byte order ("<" or ">") of a .npy array that holds bfloat16 values, from its
    header as stored (`dtype`: NumPy's reading of it); None for any other array.
    ml_dtypes's bfloat16 is written as a 2-byte void with a byte order ('<V2'), which no
    NumPy void dtype has ('|V2'), and which NumPy reads back as '|V2'."""
    if dtype.kind != "V" or dtype.itemsize != 2 or dtype.names is not None or dtype.subdtype is not None:
        return None
    found = re.search(rb"""['"]descr['"]\s*:\s*['"]([<>])V2['"]""", header)
    return found.group(1).decode() if found else None


def void_values(dtype: np.dtype) -> str:
    """What a .npy array of a plain void dtype (not bfloat16_order's) holds, in words, with
    what tldp reads as numbers of those that look like it."""
    return (f"raw {dtype.itemsize}-byte values ({dtype.str}: a void dtype, not numbers; ml_dtypes's "
            "bfloat16, stored as <V2, is perturbed, its 1-byte types are not)")


def smallest_positive(dtype: str) -> float:
    """The smallest positive normal value of a float dtype (bfloat16 shares float32's)."""
    return float(np.finfo(np.float32 if dtype == "bfloat16" else np.dtype(dtype)).tiny)


def saturated(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` clipped to a narrow float dtype's finite range (float16: +-65504, bfloat16),
    so rounding to it saturates instead of overflowing to inf; other dtypes: as they are."""
    if dtype in NARROW_MAX:
        limit = NARROW_MAX[dtype]
        return np.clip(values, -limit, limit)
    return values


def to_stored(values: np.ndarray, dtype: str, byteorder_dtype: np.dtype | None = None,
              positive: bool = False) -> np.ndarray:
    """Perturbed values in the tensor's own dtype: bfloat16 as its uint16 bit patterns.

    Values beyond a narrow dtype's largest finite value saturate there instead of
    becoming infinite (a noisy float16 parameter near 65504 stays finite). `positive`
    (a perturbed variance): values <= 0 are raised to the dtype's smallest positive
    normal value, so the variance stays in its domain.
    """
    if positive:
        values = np.maximum(values, smallest_positive(dtype))
    values = saturated(values, dtype)
    if dtype == "bfloat16":
        return float32_to_bfloat16(values)
    return np.asarray(values).astype(byteorder_dtype or np.dtype(dtype))


def postprocessing(tensors: list[Tensor], noise_dtype: np.dtype, variances: Collection[str] = frozenset()
                   ) -> list[str]:
    """The steps after the noise, for the manifest; `variances`: the perturbed variances."""
    steps = []
    if variances:
        steps.append(f"variances ({', '.join(sorted(variances))}): values <= 0 raised to the smallest "
                     "positive normal value of their dtype, so each stays > 0")
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


def variances(tensors: list[Tensor]) -> set[str]:
    """The variances among these tensors, by name (running_var, moving_variance)."""
    return {t.name for t in tensors if leaf(t.name) in VARIANCES}


def output_dtype(tensors: list[Tensor]) -> str:
    return " and ".join(sorted({t.dtype for t in tensors})) + " (each tensor keeps its dtype)"
