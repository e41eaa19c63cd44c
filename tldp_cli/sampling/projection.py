"""The public bases of --mechanism privunit: a record's k coefficients, and a record made
back from k coefficients. No randomness: projection and write-back are matrix products.

`DctBasis` (the default): a low-pass block of the orthonormal DCT-II over the record's
two spatial axes, computed separably (Y = C_H X C_W^T, then the k coefficients picked
from the block), so its cost and memory are those of two small matrix products per
block of records, whatever the record's size. The spatial axes are the last two; a 1-D
record is one row (a 1-D DCT); a record of shape (H, W, C) with C in 1, 3, 4 is an image
with its channels last (image folders deliver them so); every other leading axis counts
as channels. Each channel gets the same frequencies (no colour transform): the
coefficients are ordered by spatial frequency (i/H)^2 + (j/W)^2 (ties: the lower i + j,
then the lower i), each frequency for every channel in turn, and the first k are kept.

`MatrixBasis`: a user's k x I matrix with orthonormal rows (--basis FILE.npy), which the
user declares public; one matrix product each way.

A basis derived from the data being released is not public: its rows would carry the
data into the output. Both kinds here depend on the record's shape (and the user's file)
only.
"""

from __future__ import annotations

import functools
import math

import numpy as np

IMAGE_CHANNELS = (1, 3, 4)
# A user's basis: rows orthonormal to within this (the largest |B B^T - I| entry).
ORTHONORMAL_TOLERANCE = 1e-4


def dct_matrix(n: int, rows: int) -> np.ndarray:
    """The first `rows` rows of the orthonormal DCT-II matrix of size n:
    C[f, x] = sqrt((1 if f == 0 else 2) / n) cos(pi (2x + 1) f / (2n))."""
    f = np.arange(rows, dtype=np.float64)[:, None]
    x = np.arange(n, dtype=np.float64)[None, :]
    matrix = np.cos(np.pi * (2 * x + 1) * f / (2 * n)) * math.sqrt(2.0 / n)
    matrix[0] = math.sqrt(1.0 / n)
    return matrix


def layout(record_shape: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """(channels, H, W, channels_last) of a record: its spatial axes and its channels."""
    shape = tuple(record_shape)
    if len(shape) == 0:
        return 1, 1, 1, False
    if len(shape) == 1:
        return 1, 1, shape[0], False
    if len(shape) == 3 and shape[2] in IMAGE_CHANNELS:
        return shape[2], shape[0], shape[1], True
    return math.prod(shape[:-2]), shape[-2], shape[-1], False


def describe_layout(record_shape: tuple[int, ...]) -> str:
    channels, h, w, last = layout(record_shape)
    if h == 1:
        return f"1-D DCT-II over the record's {w} values"
    where = "the first two axes (channels last)" if last else "the last two axes"
    per = f", per channel ({channels} channels)" if channels > 1 else ""
    return f"2-D DCT-II over {where}, {h} x {w}{per}"


class DctBasis:
    """The first k coefficients of the orthonormal DCT-II of a record (module docstring)."""

    kind = "dct"

    def __init__(self, record_shape: tuple[int, ...], k: int):
        self.record_shape = tuple(int(n) for n in record_shape)
        self.k = int(k)
        self.channels, self.height, self.width, self.channels_last = layout(self.record_shape)
        total = self.channels * self.height * self.width
        if not 1 <= self.k <= total:
            raise ValueError(f"k = {k} coefficients for records of {total} elements")
        frequencies = -(-self.k // self.channels)
        rows, cols = min(self.height, frequencies), min(self.width, frequencies)
        grid_i, grid_j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        i, j = grid_i.ravel(), grid_j.ravel()
        order = np.lexsort((i, i + j, (i / self.height) ** 2 + (j / self.width) ** 2))[:frequencies]
        i, j = i[order], j[order]
        channel = np.tile(np.arange(self.channels), frequencies)
        self.index = (channel[:self.k], np.repeat(i, self.channels)[:self.k],
                      np.repeat(j, self.channels)[:self.k])
        self.rows_h = dct_matrix(self.height, int(self.index[1].max()) + 1)
        self.rows_w = dct_matrix(self.width, int(self.index[2].max()) + 1)

    def _canonical(self, records: np.ndarray) -> np.ndarray:
        n = records.shape[0]
        if self.channels_last:
            return np.moveaxis(records.reshape(n, self.height, self.width, self.channels), 3, 1)
        return records.reshape(n, self.channels, self.height, self.width)

    def project(self, records: np.ndarray) -> np.ndarray:
        """(n, *record_shape) -> the (n, k) coefficients, in float64."""
        x = self._canonical(np.asarray(records, dtype=np.float64))
        block = self.rows_h @ (x @ self.rows_w.T)  # (n, channels, a, b)
        return block[(slice(None), *self.index)]

    def synthesize(self, coefficients: np.ndarray) -> np.ndarray:
        """(n, k) coefficients -> (n, *record_shape) records, in float64 (B^T times them)."""
        n = coefficients.shape[0]
        block = np.zeros((n, self.channels, self.rows_h.shape[0], self.rows_w.shape[0]))
        block[(slice(None), *self.index)] = coefficients
        x = self.rows_h.T @ block @ self.rows_w  # (n, channels, H, W)
        if self.channels_last:
            x = np.moveaxis(x, 1, 3)
        return np.ascontiguousarray(x).reshape(n, *self.record_shape)

    def describe(self) -> str:
        return f"the {self.k} lowest frequencies of the {describe_layout(self.record_shape)}"

    def frequencies(self) -> np.ndarray:
        """Each coefficient's spatial frequency in cycles per record, sqrt(i^2 + j^2) / 2 for
        DCT-II row i and column j (row f of the DCT has f/2 cycles over the axis)."""
        return np.hypot(self.index[1], self.index[2]) / 2.0


@functools.lru_cache(maxsize=32)
def dct_basis(record_shape: tuple[int, ...], k: int) -> DctBasis:
    return DctBasis(record_shape, k)


class MatrixBasis:
    """A user's basis: a k x I matrix with orthonormal rows (check_orthonormal)."""

    kind = "file"

    def __init__(self, matrix: np.ndarray, record_shape: tuple[int, ...], sha256: str):
        self.matrix = np.ascontiguousarray(matrix, dtype=np.float64)
        self.record_shape = tuple(int(n) for n in record_shape)
        self.k = self.matrix.shape[0]
        self.sha256 = sha256

    def project(self, records: np.ndarray) -> np.ndarray:
        n = records.shape[0]
        return np.asarray(records, dtype=np.float64).reshape(n, -1) @ self.matrix.T

    def synthesize(self, coefficients: np.ndarray) -> np.ndarray:
        return (coefficients @ self.matrix).reshape(coefficients.shape[0], *self.record_shape)

    def describe(self) -> str:
        return f"a user's basis of {self.k} orthonormal rows (sha256 {self.sha256})"


def orthonormality_error(matrix: np.ndarray) -> float:
    """The largest entry of |B B^T - I|, computed in float64."""
    b = np.asarray(matrix, dtype=np.float64)
    return float(np.abs(b @ b.T - np.eye(b.shape[0])).max())
