"""`preview(...)`: a PNG strip of raw records over their perturbed copies (perturb
--preview)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.evaluate.integrity import (input_named, name_map_of, open_original, pair_up, read_manifest,
                                         user_basis_of)

PREVIEW_RECORDS = 8
PREVIEW_MIN_SIDE = 64  # small records (a 28 x 28 digit) are enlarged to about this many pixels


def preview(original: Path, perturbed: Path, manifest_path: Path | None = None, *,
            records: int = PREVIEW_RECORDS, name_map: Path | None = None,
            input_format: str | None = None) -> bytes:
    """A PNG strip: the first `records` raw records of ORIGINAL (top row) over their
    copies in PERTURBED as written (bottom row), each value mapped from its array's
    declared range to 0..255 (values outside it shown clipped). It shows raw records: a
    file to keep with the raw data, never with the release."""
    m, manifest_path = read_manifest(Path(perturbed), manifest_path)
    renamed = name_map_of(m, Path(original), name_map, manifest_path)
    m = input_named(m, renamed)
    ranges = {name: tuple(float(v) for v in r) for name, r in (m.get("value_ranges") or {}).items()}
    default = tuple(float(v) for v in m["value_range"])
    module, reader = open_original(Path(original), m, input_format)
    raw: list[np.ndarray] = []
    released: list[np.ndarray] = []
    try:
        jobs = reader.arrays()
        pairs = pair_up(module, reader, Path(perturbed), m, {job.name: None for job in jobs}, [],
                       renamed, input_format, user_basis_of(m, manifest_path, None))
        for pair in pairs:
            take = min(records - len(raw), pair.job.records, pair.perturbed_shape[0])
            if take <= 0:
                break
            lo, hi = ranges.get(pair.name, default)
            raw += [_preview_tile(r, lo, hi) for r in pair.job.read(0, take)]
            released += [_preview_tile(r, lo, hi) for r in pair.read_perturbed(0, take)]
    finally:
        reader.close()
    if not raw:
        raise InputError(f"{original}: no records to preview")
    return _preview_png(raw, released)


def _preview_tile(record: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """One record as an (H, W, 3) uint8 picture: an image as it is (alpha dropped), a
    1-D record as a bar, other records the middle 2-D slice of their last two axes."""
    values = np.asarray(record, np.float64)
    if values.ndim == 3 and values.shape[-1] in (1, 3, 4):
        values = values[..., :3] if values.shape[-1] != 1 else values[..., 0]
    elif values.ndim <= 1:
        values = np.repeat(values.reshape(1, -1), 8, axis=0)
    while values.ndim > 2 and not (values.ndim == 3 and values.shape[-1] == 3):
        values = values[values.shape[0] // 2]
    scaled = np.clip((values - lo) / (hi - lo) * 255.0, 0, 255)
    scaled = np.nan_to_num(scaled, nan=0.0)
    grey = scaled.ndim == 2
    return np.repeat(scaled[..., None], 3, axis=2).astype(np.uint8) if grey else scaled.astype(np.uint8)


def _preview_png(top: list[np.ndarray], bottom: list[np.ndarray]) -> bytes:
    """Two rows of tiles on a white ground, 4 pixels apart, small tiles enlarged."""
    from PIL import Image

    h = max(t.shape[0] for t in top + bottom)
    w = max(t.shape[1] for t in top + bottom)
    zoom = max(1, PREVIEW_MIN_SIDE // max(h, w))
    gap = 4
    canvas = np.full((2 * h * zoom + 3 * gap, len(top) * (w * zoom + gap) + gap, 3), 255, np.uint8)
    for row, tiles in enumerate((top, bottom)):
        for col, tile in enumerate(tiles):
            big = tile.repeat(zoom, axis=0).repeat(zoom, axis=1)
            y, x = gap + row * (h * zoom + gap), gap + col * (w * zoom + gap)
            canvas[y:y + big.shape[0], x:x + big.shape[1]] = big
    buf = io.BytesIO()
    Image.fromarray(canvas).save(buf, format="PNG")
    return buf.getvalue()

