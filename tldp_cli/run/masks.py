"""Weight masks for weighted TLDP (paper, Algorithm 2): loading them (`perturb --weights`).

A weight w in [0, 1] per element lowers that element's retain probability to
(1 - w) p; the noise scale and the certified figures do not change.

Loading (`perturb --weights`). A mask is
- a .npy array of the record's shape, of its spatial shape (all axes but the last,
  broadcast over channels: the paper's A x B mask for an A x B x 3 image), or one
  such mask per record (records first);
- or, for a folder of images, a folder of 8-bit grayscale mask PNGs (0..255 <-> 0..1)
  mirroring the image folder: the mask of `sub/cat.jpg` is `sub/cat.png`.

Masks are made by `tldp weight-mask` (tldp_cli/weight_mask.py). A small JSON sidecar beside the mask
(`MASK.npy.json`, `MASKS.json` for a folder) records how it was made, so that the
manifest of a run that uses it can say whether the weights depend on the data.
The sidecar holds no statistic of the data. A mask without a readable sidecar is of
unknown origin and is treated as data-derived (its hash and extremes stay out of the
manifest).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from tldp_cli.errors import InputError, reason_of
from tldp_cli.files.checked_io import json_value, not_regular, open_regular
from tldp_cli import formats
from tldp_cli.formats import ArrayJob
from tldp_cli.run.manifest import sha256_file

SIDECAR_SCHEMA = "tldp-weight-mask/1"
BLOCK_ELEMENTS = 1 << 22  # elements of a per-record mask checked at a time


def sidecar_path(mask: Path) -> Path:
    """mask.npy -> mask.npy.json; a folder masks/ -> masks.json."""
    if mask.name in ("", ".", ".."):
        mask = mask.resolve()
    return mask.with_name(mask.name + ".json")


def _folder_digest(root: Path, files: list[str]) -> str:
    """sha256 of the `sha256sum`-style listing of the files (sorted relative paths)."""
    lines = "".join(f"{sha256_file(root / rel)}  {rel}\n" for rel in sorted(files))
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()  # names not UTF-8: their bytes


# --------------------------------------------------------------------------------------
# Loading: perturb --weights
# --------------------------------------------------------------------------------------

@dataclass
class Mask:
    """The weights of one array (ArrayJob): for_block gives what the engine takes."""

    record_shape: tuple[int, ...]
    channels: bool  # the stored mask lacks the record's last axis: broadcast over it
    values: np.ndarray | None = None  # one mask for every record, flattened to (I,)
    per_record: Path | None = None  # a .npy of one mask per record, read block by block
    png: Path | None = None  # an image's mask PNG, read when its record is perturbed
    info: dict[str, Any] = field(default_factory=dict)  # the manifest's weights entry

    def _flatten(self, mask: np.ndarray, n: int | None) -> np.ndarray:
        shape = self.record_shape if n is None else (n, *self.record_shape)
        if self.channels:
            mask = np.broadcast_to(mask[..., None], shape)
        return np.ascontiguousarray(mask.reshape(-1 if n is None else (n, -1)), dtype=np.float64)

    def for_block(self, start: int, stop: int) -> np.ndarray:
        """(I,) for one mask for every record, (stop - start, I) for one mask per record."""
        if self.values is not None:
            return self.values
        if self.png is not None:
            mask = _read_png_mask(self.png)
            if mask.shape != (self.record_shape[:-1] if self.channels else self.record_shape):
                raise InputError(f"{self.png}: the mask changed while tldp was reading it")
            return self._flatten(mask, None)
        assert self.per_record is not None  # the mask is one of values, png and per_record
        mm = np.load(self.per_record, mmap_mode="r", allow_pickle=False)  # a fresh map per block
        try:
            return self._flatten(np.asarray(mm[start:stop], dtype=np.float64), stop - start)
        finally:
            del mm


def _fit(shape: tuple[int, ...], record_shape: tuple[int, ...], records: int) -> tuple[bool, bool] | None:
    """How a mask of `shape` fits records: (one per record?, broadcast over channels?)."""
    spatial = record_shape[:-1]
    if shape == record_shape:
        return False, False
    if len(record_shape) >= 2 and shape == spatial:
        return False, True
    if shape == (records, *record_shape):
        return True, False
    if len(record_shape) >= 2 and shape == (records, *spatial):
        return True, True
    return None


def _shape_error(path: Path, shape: tuple[int, ...], record_shape: tuple[int, ...]) -> InputError:
    spatial = f", {record_shape[:-1]}" if len(record_shape) >= 2 else ""
    return InputError(f"{path}: weight mask shape {shape} does not fit records of shape {record_shape} "
                      f"(want {record_shape}{spatial} or one per record)")


def _check_values(path: Path, mask: np.ndarray) -> tuple[float, float]:
    """(min, max) of a mask; refuses NaN, Inf and values outside [0, 1]."""
    if not np.all(np.isfinite(mask)):
        raise InputError(f"{path}: weight mask contains NaN or Inf")
    if mask.size == 0:
        return 0.0, 0.0
    lo, hi = float(mask.min()), float(mask.max())
    if lo < 0 or hi > 1:
        raise InputError(f"{path}: weights must lie in [0, 1], found [{lo:g}, {hi:g}]")
    return lo, hi


def load_mask(path: Path, record_shape: tuple[int, ...], records: int) -> Mask:
    """A .npy mask for one array of `records` records of `record_shape`."""
    if not path.is_file():
        if path.exists():  # a FIFO, a device, a folder: never opened (a FIFO would wait)
            raise not_regular(path, path.stat().st_mode)
        raise InputError(f"{path}: weight mask not found")
    try:
        mm = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:
        raise InputError(f"{path}: not a readable .npy weight mask ({reason_of(exc)})") from None
    try:
        if not isinstance(mm, np.ndarray) or mm.dtype.kind not in "iuf":
            raise InputError(f"{path}: a weight mask must be a numeric .npy array")
        shape = tuple(mm.shape)
        fit = _fit(shape, record_shape, records)
        if fit is None:
            raise _shape_error(path, shape, record_shape)
        per_record, channels = fit
        if per_record:  # as large as the data: checked and later read block by block
            step = max(1, BLOCK_ELEMENTS // max(1, int(np.prod(shape[1:], dtype=np.int64))))
            bounds = [_check_values(path, np.asarray(mm[s:s + step], dtype=np.float64))
                      for s in range(0, shape[0], step)]
            lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
            mask = Mask(record_shape, channels, per_record=path)
        else:
            values = np.asarray(mm, dtype=np.float64)
            lo, hi = _check_values(path, values)
            mask = Mask(record_shape, channels)
            mask.values = mask._flatten(values, None)
    finally:
        del mm
    mask.info = {"path": str(path), "sha256": sha256_file(path), "shape": list(shape),
                 "min": lo, "max": hi}
    return mask


def _read_png_mask(path: Path) -> np.ndarray:
    """An 8-bit grayscale mask PNG as weights in [0, 1]."""
    from PIL import Image  # here: only mask folders need Pillow

    try:
        with open_regular(path) as file, Image.open(file) as im:  # never a FIFO: it would hang
            im.load()
            mode, pixels = im.mode, np.asarray(im)
    except InputError:
        raise
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError... on bad files
        raise InputError(f"{path}: not a readable mask image ({formats.decode_reason(exc)})") from None
    if mode != "L":
        raise InputError(f"{path}: mask PNGs must be 8-bit grayscale (mode L), not mode {mode}")
    return pixels.astype(np.float64) / 255.0


def _records_are_files(job: ArrayJob) -> bool:
    """Whether the array is a record that is a file of its own (an image in a folder)."""
    fmt = formats.of_source(job.source)
    return fmt is not None and fmt.records_are_files


def _load_mask_folder(folder: Path, jobs: list[ArrayJob]) -> tuple[dict[str, Mask], dict[str, Any]]:
    """One mask PNG per image, matched by relative path (suffix .png); all checked now."""
    if not all(_records_are_files(job) for job in jobs):
        raise InputError(f"{folder}: a folder of mask PNGs fits a folder of images only; "
                         "give a .npy weight mask for this input")
    masks, files, missing = {}, [], []
    lo, hi = math.inf, -math.inf
    for job in jobs:
        rel = PurePosixPath(job.name).with_suffix(".png").as_posix()
        file = folder / rel
        if not file.exists():  # a FIFO or a device is refused by _read_png_mask
            missing.append(rel)
            continue
        values = _read_png_mask(file)
        fit = _fit(values.shape, job.record_shape, job.records)
        if fit is None or fit[0]:
            raise InputError(f"{file}: mask is {values.shape[1]}x{values.shape[0]} (WxH) but image "
                             f"{job.name} is {job.record_shape[1]}x{job.record_shape[0]}")
        lo, hi = min(lo, float(values.min())), max(hi, float(values.max()))
        masks[job.name] = Mask(job.record_shape, fit[1], png=file)
        files.append(rel)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InputError(f"{folder}: no mask for {len(missing)} image(s): {missing[0]}{more} "
                         f"(expected {folder / missing[0]})")
    info = {"path": str(folder), "sha256": _folder_digest(folder, files), "shape": None,
            "files": len(files), "min": lo, "max": hi}
    return masks, info


def read_sidecar(mask: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The weight-mask sidecar beside `mask` if tldp wrote one, else (None, why not)."""
    path = sidecar_path(mask)
    if not path.is_file():
        return None, "no sidecar"
    try:
        with open_regular(path) as f:
            meta = json_value(f.read(), str(path))
    except (OSError, InputError):
        return None, "unreadable sidecar"
    if not isinstance(meta, dict) or meta.get("schema") != SIDECAR_SCHEMA:
        return None, "sidecar not written by tldp weight-mask"  # some other file of that name
    return meta, None


def load_masks(path: Path, jobs: list[ArrayJob]) -> tuple[dict[str, Mask], dict[str, Any]]:
    """The mask of every array to perturb, and the manifest's weights entry.

    Everything is read and checked here, before any output exists.
    """
    if path.is_dir():
        masks, info = _load_mask_folder(path, jobs)
    else:
        masks = {job.name: load_mask(path, job.record_shape, job.records) for job in jobs}
        info = dict(next(iter(masks.values())).info)
    meta, missing = read_sidecar(path)
    if meta is not None and path.is_file() and meta.get("shape") not in (None, info["shape"]):
        raise InputError(f"{sidecar_path(path)}: describes a mask of shape {meta['shape']}, but "
                         f"{path} has shape {info['shape']}; make the mask again")
    info["method"] = meta.get("method") if meta else None
    # Only a sidecar that says so clears a mask: one of unknown origin may be a function
    # of the private values (an intensity mask's max is the brightest pixel / 255).
    info["data_derived"] = meta is None or meta.get("data_derived") is not False
    if missing:
        info["origin"] = f"unknown ({missing}): treated as data-derived"
    if info["data_derived"]:
        # The mask may be a function of the private values: its hash and extremes would
        # confirm guesses about them, so they stay out of the manifest.
        made = ("nothing says how the weights were made, so they may have been computed from the "
                "private values" if missing else "the weights were computed from the private values "
                "themselves")
        info.update(sha256=None, min=None, max=None,
                    note=f"{made}, so the chance that a value is kept may depend on the data; the "
                         "certified figures assume w = 0 and do not use the weights; sha256, min "
                         "and max are withheld")
    return masks, info


def weights_warning(path: Path | None, info: dict[str, Any] | None) -> str | None:
    """The line perturb shows about a data-derived (or unknown) mask, if any (none without
    --weights: `path` None, and no `info`)."""
    if path is None or not info or not info["data_derived"]:
        return None
    if "origin" in info:
        return (f"warning: {path} has no readable sidecar {sidecar_path(path).name} from tldp "
                "weight-mask, so its weights are treated as data-derived: the manifest withholds "
                "their sha256, min and max, and the certified figures assume w = 0")
    return (f"warning: the weights in {path} were computed from the private values (method "
            f"{info['method']}); the manifest says so")
