"""CF conventions (netCDF, xarray's Zarr) about a variable's values, shared by the
formats that honour them (hdf5, zarr_store); no I/O here.

Missing data: values equal to a variable's _FillValue or missing_value are missing,
copied rather than perturbed, and the writer puts its markers back. A noisy value
may land on a marker too (a fill value of -1 sits on the grid just below a range
starting at 0): every reader would take it for missing data, so the writer moves it
to the nearest value that is not a marker (move_off_markers), a deterministic
post-processing of the output that costs no privacy.
"""

from __future__ import annotations

import numpy as np

MOVE_PASSES = 8  # a moved value lands on another marker at most once per marker


def move_off_markers(block: np.ndarray, missing: np.ndarray | None, markers: list,
                     bounds: tuple[float, float, float | None]) -> int:
    """Moves, in place, every value of `block` outside `missing` that equals one of
    `markers` (output values meaning "missing") one step toward the declared range
    (lo, hi): a grid step where the noise is on a grid (step), else one ulp of the
    block's dtype. Returns how many values moved."""
    targets = [m for m in markers if not np.isnan(m)]  # NaN equals no value
    if not targets:
        return 0
    lo, hi, step = bounds
    moved = 0
    for _ in range(MOVE_PASSES):
        hit = np.isin(block, np.asarray(targets, dtype=block.dtype))
        if missing is not None:
            hit &= ~missing
        count = int(np.count_nonzero(hit))
        if not count:
            break
        moved = moved or count  # later passes move values the first one moved
        values = block[hit]
        up = values.astype(np.float64) < (lo + hi) / 2
        block[hit] = _step(values, up, step)
    return moved


def _step(values: np.ndarray, up: np.ndarray, step: float | None) -> np.ndarray:
    """Each value one step up (where `up`) or down: `step` where it changes the value in
    the values' dtype, else the next representable value."""
    dtype = values.dtype
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # At the dtype's limit the only way is back (values saturate there).
        up = np.where(values == info.max, False, np.where(values == info.min, True, up))
        return np.where(up, values + dtype.type(1), values - dtype.type(1)).astype(dtype)
    toward = np.where(up, np.inf, -np.inf).astype(dtype)
    nearest = np.nextafter(values, toward)
    if step is None:
        return nearest
    with np.errstate(over="ignore"):
        stepped = np.where(up, values + step, values - step).astype(dtype)
    return np.where(stepped == values, nearest, stepped)
