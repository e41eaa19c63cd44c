"""The public bases of --mechanism privunit: a record's k coefficients, and a record made
back from k coefficients. No randomness: projection and write-back are matrix products.

`dct_basis` (the default) picks, by a public rule of the record's shape alone, one of two
low-pass blocks of the orthonormal DCT-II, each computed separably (one small matrix
product per spatial axis per block of records, then the k coefficients picked from the
block; never a dense k x I matrix), so its cost and memory are those of a few small matrix
products per block of records, whatever the record's size:

- `VolumeDctBasis`, a 3-D DCT-II over three spatial axes (D, H, W), for a *volume*
  (`is_volume`): a record of three axes that is neither a channels-last image (H, W, C)
  with C in 1, 3, 4 nor a channels-first image (C, H, W) with C in 1, 3, 4 (the torch
  layout of image datasets), so its spatial axes are all three; or a record of four or more
  axes, whose last three are the spatial axes and whose leading axes count as channels
  (torch's (C, D, H, W)), but a stack of colour images stored channels last, (D, H, W, C)
  with C in 3, 4 and D, H, W at least 2 (a multi-page RGB TIFF: `is_colour_stack`), whose
  first three are. Its coefficients are ordered by normalised frequency
  (i/D)^2 + (j/H)^2 + (l/W)^2 (ties: the lower i + j + l, then the lower i, then the
  lower j; compared exactly, in integers, for records of up to 1.7e9 elements), each
  frequency for every channel in turn, and the first k are kept.
- `DctBasis`, a 2-D DCT-II over two spatial axes, for every other record. The spatial axes
  are the last two; a 1-D record is one row (a 1-D DCT); a record of shape (H, W, C) with
  C in 1, 3, 4 is an image with its channels last (image folders deliver them so); the
  leading axis of a (C, H, W) record with C in 1, 3, 4 counts as channels. Each channel
  gets the same frequencies (no colour transform): the coefficients are ordered by spatial
  frequency (i/H)^2 + (j/W)^2 (ties: the lower i + j, then the lower i), each frequency
  for every channel in turn, and the first k are kept.

A volume stored channels last, (D, H, W, C), with C other than 3 or 4 has four axes and so
is read as (D) channels of (H, W, C) volumes: move its channels first, or give a basis
(--basis FILE.npy).

`MatrixBasis`: a user's k x I matrix with orthonormal rows (--basis FILE.npy), which the
user declares public; one matrix product each way.

A basis derived from the data being released is not public: its rows would carry the
data into the output. Every kind here depends on the record's shape (and the user's file)
only.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from tldp_cli.privacy.privunit import IMAGE_CHANNELS, is_colour_stack, spatial_axes
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


def is_volume(record_shape: tuple[int, ...]) -> bool:
    """A record the default basis takes as a volume (module docstring): three axes, neither
    (H, W, C) nor (C, H, W) with C in 1, 3, 4; or four axes or more. Its shape only."""
    return len(spatial_axes(record_shape)) == 3


def volume_layout(record_shape: tuple[int, ...]) -> tuple[int, int, int, int, bool]:
    """(channels, D, H, W, channels_last) of a volume (is_volume): its last three axes and its
    leading channels, or a stack of colour images' first three and its last (channels last)."""
    shape = tuple(record_shape)
    if is_colour_stack(shape):
        return shape[3], shape[0], shape[1], shape[2], True
    return math.prod(shape[:-3]), shape[-3], shape[-2], shape[-1], False


def describe_layout(record_shape: tuple[int, ...]) -> str:
    if is_volume(record_shape):
        channels, d, h, w, last = volume_layout(record_shape)
        per = f", per channel ({channels} channels)" if channels > 1 else ""
        if last:
            return f"3-D DCT-II over the first three axes (a stack of colour images, channels last), {d} x {h} x {w}{per}"
        return f"3-D DCT-II over the last three axes (a volume), {d} x {h} x {w}{per}"
    channels, h, w, last = layout(record_shape)
    if h == 1:
        return f"1-D DCT-II over the record's {w} values"
    where = "the first two axes (channels last)" if last else "the last two axes"
    per = f", per channel ({channels} channels)" if channels > 1 else ""
    return f"2-D DCT-II over {where}, {h} x {w}{per}"


class DctBasis:
    """The first k coefficients of the orthonormal 2-D (or 1-D) DCT-II of a record that is
    not a volume (module docstring; dct_basis picks the basis of a record's shape)."""

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


def lowest_frequencies(shape: tuple[int, int, int], count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The `count` lowest 3-D frequencies (i, j, l) of a (D, H, W) DCT-II, ordered by
    (i/D)^2 + (j/H)^2 + (l/W)^2, ties by the lower i + j + l, then i, then j (compared in
    integers: the key times (D H W)^2). Only the (i, j, l) with (i + 1)(j + 1)(l + 1) <= count
    are candidates: each of the others comes after the (i + 1)(j + 1)(l + 1) - 1 frequencies
    below it on every axis (a lower or equal key and a lower sum), so it is never among the
    first `count`."""
    d, h, w = shape
    parts = []
    for depth_row in range(min(d, count)):
        rest = count // (depth_row + 1)
        grid_j, grid_l = np.meshgrid(np.arange(min(h, rest)), np.arange(min(w, rest)), indexing="ij")
        keep = (grid_j + 1) * (grid_l + 1) <= rest
        parts.append((np.full(int(keep.sum()), depth_row), grid_j[keep], grid_l[keep]))
    i, j, l = (np.concatenate(axis).astype(np.int64) for axis in zip(*parts))
    # (i/D)^2 + (j/H)^2 + (l/W)^2 times (D H W)^2, exact in int64 below 2^63 (records of up
    # to about 1.7e9 elements), in float64 above.
    exact = 3 * (d * h * w) ** 2 < 2**63
    dtype = np.int64 if exact else np.float64
    key = ((i * (h * w)).astype(dtype) ** 2 + (j * (d * w)).astype(dtype) ** 2
           + (l * (d * h)).astype(dtype) ** 2)
    order = np.lexsort((j, i, i + j + l, key))[:count]
    return i[order], j[order], l[order]


class VolumeDctBasis:
    """The first k coefficients of the orthonormal 3-D DCT-II of a volume, per channel
    (module docstring), computed separably, axis by axis."""

    kind = "dct"

    def __init__(self, record_shape: tuple[int, ...], k: int):
        self.record_shape = tuple(int(n) for n in record_shape)
        self.k = int(k)
        self.channels, self.depth, self.height, self.width, self.channels_last = volume_layout(self.record_shape)
        total = self.channels * self.depth * self.height * self.width
        if not 1 <= self.k <= total:
            raise ValueError(f"k = {k} coefficients for records of {total} elements")
        frequencies = -(-self.k // self.channels)
        i, j, l = lowest_frequencies((self.depth, self.height, self.width), frequencies)
        channel = np.tile(np.arange(self.channels), frequencies)
        self.index = (channel[:self.k], np.repeat(i, self.channels)[:self.k],
                      np.repeat(j, self.channels)[:self.k], np.repeat(l, self.channels)[:self.k])
        self.rows_d = dct_matrix(self.depth, int(self.index[1].max()) + 1)
        self.rows_h = dct_matrix(self.height, int(self.index[2].max()) + 1)
        self.rows_w = dct_matrix(self.width, int(self.index[3].max()) + 1)

    def project(self, records: np.ndarray) -> np.ndarray:
        """(n, *record_shape) -> the (n, k) coefficients, in float64."""
        n = records.shape[0]
        x = np.asarray(records, dtype=np.float64)
        if self.channels_last:  # (n, D, H, W, C) -> (n, C, D, H, W)
            x = np.moveaxis(x.reshape(n, self.depth, self.height, self.width, self.channels), 4, 1)
        x = x.reshape(n, self.channels, self.depth, self.height, self.width)
        a, b, c = self.rows_d.shape[0], self.rows_h.shape[0], self.rows_w.shape[0]
        y = self.rows_h @ (x @ self.rows_w.T)  # (n, channels, D, b, c)
        block = (self.rows_d @ y.reshape(n, self.channels, self.depth, b * c)).reshape(n, self.channels, a, b, c)
        return block[(slice(None), *self.index)]

    def synthesize(self, coefficients: np.ndarray) -> np.ndarray:
        """(n, k) coefficients -> (n, *record_shape) records, in float64 (B^T times them)."""
        n = coefficients.shape[0]
        a, b, c = self.rows_d.shape[0], self.rows_h.shape[0], self.rows_w.shape[0]
        block = np.zeros((n, self.channels, a, b, c))
        block[(slice(None), *self.index)] = coefficients
        y = (self.rows_d.T @ block.reshape(n, self.channels, a, b * c)).reshape(n, self.channels, self.depth, b, c)
        x = (self.rows_h.T @ y) @ self.rows_w  # (n, channels, D, H, W)
        if self.channels_last:
            x = np.moveaxis(x, 1, 4)
        return np.ascontiguousarray(x).reshape(n, *self.record_shape)

    def describe(self) -> str:
        return f"the {self.k} lowest frequencies of the {describe_layout(self.record_shape)}"

    def frequencies(self) -> np.ndarray:
        """Each coefficient's spatial frequency in cycles per record, sqrt(i^2 + j^2 + l^2) / 2
        for DCT-II rows i, j, l of the three axes (as DctBasis.frequencies)."""
        _, i, j, l = self.index
        return np.sqrt(i * i + j * j + l * l) / 2.0


@functools.lru_cache(maxsize=32)
def dct_basis(record_shape: tuple[int, ...], k: int) -> DctBasis | VolumeDctBasis:
    """The default basis of records of `record_shape`: a volume's 3-D DCT (is_volume), else
    the 2-D (or 1-D) DCT."""
    if is_volume(record_shape):
        return VolumeDctBasis(record_shape, k)
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
