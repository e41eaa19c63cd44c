"""--basis: which public basis --mechanism privunit projects records on.

`dct` (the default) and `dct:K` are the DCT-II low-pass bases of sampling/projection.py,
K coefficients or the public default rule's (privacy/privunit.default_k). `FILE.npy` is
a user's basis: a k x I array of k orthonormal rows (I, the record's elements), which the
user declares public; the manifest records its sha256 and path. A basis learned from the
data being released is not public, and `tldp` cannot tell: the declaration is the user's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.files.checked_io import open_regular
from tldp_cli.sampling import projection

DCT = "dct"
FILE = "file"


@dataclass(frozen=True)
class BasisChoice:
    """--basis, parsed: the kind, k (None: the default rule) and a user basis's file."""

    kind: str
    k: int | None = None
    path: Path | None = None

    def describe(self) -> str:
        if self.kind == FILE:
            return str(self.path)
        return DCT if self.k is None else f"{DCT}:{self.k}"


def parse_basis(text: str | None) -> BasisChoice:
    """'dct', 'dct:K' or a path to a .npy file (None: dct)."""
    if text is None or text == DCT:
        return BasisChoice(DCT)
    if text.startswith(DCT + ":"):
        count = text[len(DCT) + 1:]
        if not count.isdigit() or int(count) < 2:
            raise UsageError(f"--basis {text}: dct:K needs a whole number K >= 2 of coefficients")
        return BasisChoice(DCT, int(count))
    path = Path(text)
    if path.suffix.lower() != ".npy":
        raise UsageError(f"--basis {text}: give dct, dct:K, or a .npy file holding a k x I matrix of "
                         "orthonormal rows")
    return BasisChoice(FILE, path=path)


@dataclass(frozen=True)
class UserBasis:
    """A user's basis file, loaded and checked once: its rows and its sha256."""

    matrix: np.ndarray
    sha256: str
    path: Path

    @property
    def k(self) -> int:
        return int(self.matrix.shape[0])

    def for_records(self, record_shape: tuple[int, ...], where: object) -> projection.MatrixBasis:
        elements = int(np.prod(record_shape, dtype=np.int64))
        if self.matrix.shape[1] != elements:
            raise UsageError(f"{where}: --basis {self.path} has rows of {self.matrix.shape[1]} values, "
                             f"but the records have {elements} elements (shape {tuple(record_shape)})")
        return projection.MatrixBasis(self.matrix, record_shape, self.sha256)


def load_basis(path: Path) -> UserBasis:
    """Reads and checks a user's basis: a regular file holding a finite 2-D float or integer
    array without pickles, of k <= I rows that are orthonormal to within
    projection.ORTHONORMAL_TOLERANCE."""
    try:
        with open_regular(Path(path)) as f:  # never a FIFO (it would wait) or a device (/dev/zero)
            data = f.read()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the basis ({reason_of(exc)})") from None
    import io

    try:
        matrix = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise InputError(f"{path}: not a .npy array ({reason_of(exc)})") from None
    if matrix.ndim != 2 or matrix.dtype.kind not in "iuf" or min(matrix.shape) < 1:
        raise InputError(f"{path}: a basis is a 2-D numeric k x I array, not {matrix.dtype} of shape "
                         f"{matrix.shape}")
    matrix = matrix.astype(np.float64)
    if not np.isfinite(matrix).all():
        raise InputError(f"{path}: the basis holds NaN or Inf")
    k, elements = matrix.shape
    if k > elements:
        raise InputError(f"{path}: {k} rows of {elements} values cannot be orthonormal (k x I, k <= I)")
    error = projection.orthonormality_error(matrix)
    if error > projection.ORTHONORMAL_TOLERANCE:
        raise InputError(f"{path}: the basis's rows are not orthonormal (|B B^T - I| reaches {error:.3g}, "
                         f"more than {projection.ORTHONORMAL_TOLERANCE:g})")
    return UserBasis(matrix, hashlib.sha256(data).hexdigest(), Path(path))
