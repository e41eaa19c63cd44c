"""Weight masks for weighted TLDP (paper, Algorithm 2): loading and checking.

A weight w in [0, 1] per element lowers that element's retain probability to
(1 - w) p. A mask may have the record's shape, the record's spatial shape (all
axes but the last, broadcast over channels, the paper's A x B mask for an
A x B x 3 image), or one such mask per record.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tldp_cli.errors import InputError


@dataclass
class Mask:
    values: np.ndarray  # (I,) for one mask, (records, I) for one mask per record
    info: dict[str, Any]  # manifest entry

    def for_block(self, start: int, stop: int) -> np.ndarray:
        return self.values if self.values.ndim == 1 else self.values[start:stop]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_mask(path: Path, record_shape: tuple[int, ...], records: int) -> Mask:
    if not path.is_file():
        raise InputError(f"{path}: weight mask not found")
    try:
        mask = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise InputError(f"{path}: not a readable .npy weight mask ({exc})") from None
    if not isinstance(mask, np.ndarray) or mask.dtype.kind not in "iuf":
        raise InputError(f"{path}: a weight mask must be a numeric .npy array")
    mask = mask.astype(np.float64)
    if not np.all(np.isfinite(mask)):
        raise InputError(f"{path}: weight mask contains NaN or Inf")
    if mask.size and (mask.min() < 0 or mask.max() > 1):
        raise InputError(f"{path}: weights must lie in [0, 1], found [{mask.min():g}, {mask.max():g}]")
    elements = int(np.prod(record_shape, dtype=np.int64)) if record_shape else 1
    shape = tuple(mask.shape)
    spatial = record_shape[:-1]
    if shape == record_shape:
        values = mask.reshape(elements)
    elif len(record_shape) >= 2 and shape == spatial:
        values = np.broadcast_to(mask[..., None], record_shape).reshape(elements)
    elif shape == (records, *record_shape):
        values = mask.reshape(records, elements)
    elif len(record_shape) >= 2 and shape == (records, *spatial):
        values = np.broadcast_to(mask[..., None], (records, *record_shape)).reshape(records, elements)
    else:
        raise InputError(f"{path}: weight mask shape {shape} does not fit records of shape "
                         f"{record_shape} (want {record_shape}, {spatial} or one per record)")
    info = {"path": str(path), "sha256": sha256_file(path), "shape": list(shape),
            "min": float(mask.min()), "max": float(mask.max())}
    return Mask(np.ascontiguousarray(values), info)
