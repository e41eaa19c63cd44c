"""Making weight masks: `tldp weight-mask`.

`constant`, `box`, `image`, `intensity` and `faces` masks, with optional feathering
and a preview PNG, and the JSON sidecar that records how a mask was made (run/masks.py
reads it back when a run uses the mask).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import numpy as np
from PIL import Image

from tldp_cli import __version__, formats
from tldp_cli.files import output
from tldp_cli.files.checked_io import json_value
from tldp_cli.errors import InputError, MissingExtra, UsageError, reason_of
from tldp_cli.formats import ArrayJob, FormatOptions, listing, plural
from tldp_cli.run.masks import SIDECAR_SCHEMA, sidecar_path
from tldp_cli.run.calibration import DEFAULT_RANGE_BITS, resolve_range
from tldp_cli.run.pipeline import block_bounds, check_finite
from tldp_cli.formats.npy import NpyWriter

DATA_DERIVED_METHODS = ("intensity", "faces")  # computed by tldp from the private values
METHODS = ("intensity", "box", "image", "constant", "faces")
PER_RECORD_METHODS = DATA_DERIVED_METHODS  # for arrays: one mask per record
FACE_CASCADE = "haarcascade_frontalface_default.xml"  # ships with opencv-python-headless 4
LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R 601 gray, as Pillow's convert("L")
FACE_DETECTOR = (f"OpenCV Haar cascade {FACE_CASCADE} on the histogram-equalised gray image "
                 "(scale factor 1.1, 5 neighbours, faces of 24 pixels or more)")
PREVIEW_TINT = 0.6  # opacity of the red overlay where w = 1
BLOCK_ELEMENTS = 1 << 22  # elements read at a time when a mask is made from the data


@dataclass
class MaskOptions:
    input: Path
    method: str
    out: Path
    weight: float | None = None  # constant: the weight; box: for rows without one (default 1)
    boxes: Path | None = None  # box: JSON or CSV rectangles
    mask_image: Path | None = None  # image: a grayscale picture of the weights
    resize: bool = False  # image: resize it to the records' spatial shape
    value_range: tuple[float, float] | None = None  # intensity (and the preview)
    gamma: float | None = None  # intensity: w = ((x - lo) / (hi - lo)) ** gamma; default 1
    margin: float | None = None  # faces: grow each face box by this fraction of its size; 0.2
    feather: int = 0  # pixels of outward ramp at the mask's edges
    preview: Path | None = None  # PNG overlay of the mask on the first record or image
    dataset: str | None = None  # HDF5/Zarr: the array the mask is for
    data_derived: bool = False  # box/image: the regions were found in the private data
    overwrite: bool = False
    input_format: str | None = None  # --format: the input's format NAME, None: detected
    skip_bad: bool = False  # image folders: skip unreadable images (no mask for them), as perturb --skip-bad


@dataclass
class MaskResult:
    output: Path
    sidecar: Path
    preview: Path | None
    description: str  # e.g. "one 28x28 mask" or "12 mask PNGs"
    messages: list[str] = field(default_factory=list)


@dataclass
class Box:
    x0: float
    y0: float
    x1: float
    y1: float
    weight: float
    file: str | None
    where: str  # "line 3" or "box 2", for messages


def check_options(o: MaskOptions) -> None:
    """Usage errors, before the input is opened."""
    if o.method not in METHODS:
        raise UsageError(f"--method must be one of {', '.join(METHODS)}, not {o.method}")
    needs = {"constant": ("--weight", o.weight), "box": ("--boxes", o.boxes),
             "image": ("--mask-image", o.mask_image)}
    if o.method in needs and needs[o.method][1] is None:
        raise UsageError(f"--method {o.method} needs {needs[o.method][0]}")
    only = [("--weight", o.weight is not None, ("constant", "box", "faces")),
            ("--boxes", o.boxes is not None, ("box",)),
            ("--mask-image", o.mask_image is not None, ("image",)),
            ("--resize", o.resize, ("image",)),
            ("--gamma", o.gamma is not None, ("intensity",)),
            ("--margin", o.margin is not None, ("faces",)),
            ("--data-derived", o.data_derived, ("box", "image"))]
    for option, given, methods in only:
        if given and o.method not in methods:
            raise UsageError(f"{option} applies to --method {' or '.join(methods)}, not {o.method}")
    if o.weight is not None and not 0 <= o.weight <= 1:
        raise UsageError(f"--weight must lie in [0, 1], not {o.weight:g}")
    if o.gamma is not None and not (math.isfinite(o.gamma) and o.gamma > 0):
        raise UsageError(f"--gamma must be a positive number, not {o.gamma:g}")
    if o.margin is not None and not (math.isfinite(o.margin) and o.margin >= 0):
        raise UsageError(f"--margin must be a fraction >= 0, not {o.margin:g}")
    if o.feather < 0:
        raise UsageError(f"--feather must be a number of pixels >= 0, not {o.feather}")
    for option, path in (("--boxes", o.boxes), ("--mask-image", o.mask_image)):
        if path is not None and not path.is_file():
            raise InputError(f"{path}: {option} " + ("is not a regular file" if path.exists() else "file not found"))


def feather(mask: np.ndarray, pixels: int, axes: tuple[int, int] = (0, 1)) -> np.ndarray:
    """Soften a mask's edges outward over `pixels` pixels along `axes`.

    w'(q) = max over positions r of w(r) (1 - d(q, r) / (pixels + 1)), d the chessboard
    distance: a linear ramp from each weight down to 0 just past `pixels`. Weights never
    go down, so a region marked sensitive stays as protected as it was.
    """
    if pixels <= 0:
        return mask
    out = mask.astype(np.float64, copy=True)
    grown = out
    for k in range(1, pixels + 1):
        grown = _dilate(grown, axes)
        np.maximum(out, grown * (1 - k / (pixels + 1)), out=out)
    return out


def _dilate(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Maximum over each position and its neighbours along `axes` (a 3x3 max filter)."""
    for axis in axes:
        b = a.copy()
        head = [slice(None)] * a.ndim
        tail = [slice(None)] * a.ndim
        head[axis], tail[axis] = slice(None, -1), slice(1, None)
        np.maximum(b[tuple(tail)], a[tuple(head)], out=b[tuple(tail)])
        np.maximum(b[tuple(head)], a[tuple(tail)], out=b[tuple(head)])
        a = b
    return a


def read_boxes(path: Path, default_weight: float) -> list[Box]:
    """Rectangles from JSON or CSV: x0, y0, x1, y1 in pixels (x the column, y the row;
    x1 and y1 exclusive), an optional weight (default `default_weight`) and an optional
    file (the image the box belongs to; boxes without one apply to every record)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(f"{path}: box file is not UTF-8 text") from None
    stripped = text.lstrip()
    rows = _json_boxes(path, stripped) if stripped[:1] in ("[", "{") else _csv_boxes(path, text)
    boxes = [_box(path, where, row, default_weight) for where, row in rows]
    if not boxes:
        raise InputError(f"{path}: no boxes in the file")
    return boxes


def _json_boxes(path: Path, text: str) -> list[tuple[str, dict]]:
    data = json_value(text, f"{path}: box file")
    if isinstance(data, dict) and set(data) == {"boxes"}:
        data = data["boxes"]
    if not isinstance(data, list) or not all(isinstance(b, dict) for b in data):
        raise InputError(f"{path}: a JSON box file holds a list of objects "
                         '{"x0": .., "y0": .., "x1": .., "y1": .., "weight": .., "file": ..}')
    return [(f"box {i + 1}", b) for i, b in enumerate(data)]


CSV_COLUMNS = ("x0", "y0", "x1", "y1", "weight", "file")


def _csv_boxes(path: Path, text: str) -> list[tuple[str, dict]]:
    lines = [(n, row) for n, row in enumerate(csv.reader(text.splitlines()), 1)
             if row and any(c.strip() for c in row) and not row[0].lstrip().startswith("#")]
    if not lines:
        return []
    first = [c.strip().lower() for c in lines[0][1]]
    header: list[str] | None = None  # the column names, when the first line names them
    if set(first) & set(CSV_COLUMNS):
        unknown = [c for c in first if c not in CSV_COLUMNS]
        if unknown:
            raise InputError(f"{path}: line {lines[0][0]}: unknown column {unknown[0]!r} "
                             f"(columns: {', '.join(CSV_COLUMNS)})")
        header = first
        lines = lines[1:]
    rows = []
    for n, row in lines:
        cells = [c.strip() for c in row]
        names = header or {4: CSV_COLUMNS[:4], 5: CSV_COLUMNS[:5],
                           6: ("file", *CSV_COLUMNS[:5])}.get(len(cells))
        if names is None or len(cells) != len(names):
            want = len(header) if header else "x0,y0,x1,y1,weight (optionally file first)"
            raise InputError(f"{path}: line {n}: expected {want} values, found {len(cells)}")
        rows.append((f"line {n}", dict(zip(names, cells))))
    return rows


def _box(path: Path, where: str, row: dict, default_weight: float) -> Box:
    unknown = set(row) - set(CSV_COLUMNS)
    if unknown:
        raise InputError(f"{path}: {where}: unknown key {sorted(unknown)[0]!r} "
                         f"(keys: {', '.join(CSV_COLUMNS)})")
    values = {}
    for key in ("x0", "y0", "x1", "y1", "weight"):
        raw = row.get(key)
        if raw is None or raw == "":
            if key == "weight":
                values[key] = default_weight
                continue
            raise InputError(f"{path}: {where}: {key} is missing")
        try:
            if isinstance(raw, bool):
                raise ValueError
            values[key] = float(raw)
        except (TypeError, ValueError):
            raise InputError(f"{path}: {where}: {key} must be a number, not {raw!r}") from None
        if not math.isfinite(values[key]):
            raise InputError(f"{path}: {where}: {key} must be finite, not {raw!r}")
    if values["x1"] <= values["x0"] or values["y1"] <= values["y0"]:
        raise InputError(f"{path}: {where}: the box is empty or inverted (need x0 < x1 and y0 < y1)")
    if not 0 <= values["weight"] <= 1:
        raise InputError(f"{path}: {where}: weight must lie in [0, 1], not {values['weight']:g}")
    file = row.get("file")
    if file is not None and not isinstance(file, str):
        raise InputError(f"{path}: {where}: file must be a string")
    return Box(file=file or None, where=where, **values)


def draw_boxes(shape: tuple[int, int], boxes: list[Box], path: Path, what: str) -> np.ndarray:
    """A mask of `shape` (H, W): each box's weight inside it (the largest where boxes
    overlap), 0 elsewhere. Fractional edges grow outward; boxes are clipped to the image."""
    height, width = shape
    mask = np.zeros(shape)
    for box in boxes:
        x0, y0 = max(0, math.floor(box.x0)), max(0, math.floor(box.y0))
        x1, y1 = min(width, math.ceil(box.x1)), min(height, math.ceil(box.y1))
        if x0 >= x1 or y0 >= y1:
            raise InputError(f"{path}: {box.where}: the box lies outside {what} ({width}x{height}, WxH)")
        np.maximum(mask[y0:y1, x0:x1], box.weight, out=mask[y0:y1, x0:x1])
    return mask


def read_mask_image(path: Path) -> np.ndarray:
    """A grayscale picture of the weights: 0 -> 0, 255 (65535 for 16-bit) -> 1."""
    try:
        with Image.open(path) as im:
            im.load()
            if im.mode == "1":
                return np.asarray(im, dtype=np.float64)
            if im.mode in ("I;16", "I;16L", "I;16B", "I;16N"):
                return np.asarray(im).astype(np.float64) / 65535.0
            if im.mode in ("L", "LA"):
                return np.asarray(im.getchannel(0)).astype(np.float64) / 255.0
            rgb = np.asarray(im.convert("RGB"))
    except Exception as exc:
        raise InputError(f"{path}: not a readable image ({reason_of(exc)})") from None
    if not (np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 0], rgb[..., 2])):
        raise InputError(f"{path}: is a colour image; a mask image must be grayscale "
                         "(black = weight 0, white = weight 1)")
    return rgb[..., 0].astype(np.float64) / 255.0


def fit_mask_image(picture: np.ndarray, shape: tuple[int, int], resize: bool, path: Path,
                   what: str) -> np.ndarray:
    if picture.shape == shape:
        return picture
    if not resize:
        raise InputError(f"{path}: the mask image is {picture.shape[1]}x{picture.shape[0]} (WxH) but "
                         f"{what} is {shape[1]}x{shape[0]}; pass --resize to resize it")
    image = Image.fromarray(picture.astype(np.float32))  # mode F
    resized = image.resize((shape[1], shape[0]), Image.Resampling.BILINEAR)
    return np.clip(np.asarray(resized, dtype=np.float64), 0.0, 1.0)


def intensity(values: np.ndarray, lo: float, hi: float, gamma: float) -> np.ndarray:
    """The paper's MNIST rule: weight grows with the value, w = ((x - lo) / (hi - lo)) ** gamma."""
    w = np.clip((values.astype(np.float64) - lo) / (hi - lo), 0.0, 1.0)
    return w if gamma == 1 else w ** gamma


class FaceDetector:
    """Frontal faces by the Haar cascade that opencv-python-headless ships (nothing is
    downloaded). Returns boxes (x, y, width, height) in pixels."""

    def __init__(self):
        try:
            import cv2
        except ImportError:
            raise MissingExtra("--method faces", "OpenCV (opencv-python-headless 4)", "faces") from None
        path = Path(getattr(getattr(cv2, "data", None), "haarcascades", "")) / FACE_CASCADE
        self.cv2 = cv2
        self.cascade = cv2.CascadeClassifier(str(path)) if path.is_file() else None
        if self.cascade is None or self.cascade.empty():
            raise InputError(f"OpenCV {cv2.__version__} does not ship the face model {FACE_CASCADE}; "
                             "install opencv-python-headless 4 (pip install 'tldp-tensors[faces]')")

    def __call__(self, gray: np.ndarray) -> list[tuple[int, int, int, int]]:
        equalised = self.cv2.equalizeHist(np.ascontiguousarray(gray, dtype=np.uint8))
        found = self.cascade.detectMultiScale(equalised, scaleFactor=1.1, minNeighbors=5,
                                              minSize=(24, 24))
        return [(int(x), int(y), int(w), int(h)) for x, y, w, h in found]


def face_mask(pixels: np.ndarray, lo: float, hi: float, detector: FaceDetector, weight: float,
              margin: float) -> tuple[np.ndarray, int]:
    """Weight `weight` on every face found in one image (grown by `margin` of its size on
    each side), 0 elsewhere; and the number of faces."""
    gray = pixels[..., :3] @ LUMA if pixels.ndim == 3 and pixels.shape[-1] >= 3 else \
        (pixels[..., 0] if pixels.ndim == 3 else pixels)
    faces = detector(np.rint(intensity(gray, lo, hi, 1.0) * 255))
    boxes = [Box(x - margin * w, y - margin * h, x + w + margin * w, y + h + margin * h, weight,
                 None, "face") for x, y, w, h in faces]
    return draw_boxes(gray.shape, boxes, Path("faces"), "the image"), len(faces)


def to_png_levels(mask: np.ndarray) -> np.ndarray:
    """Weights as 8-bit levels, rounded up: a stored weight is never below the one asked for."""
    return np.clip(np.ceil(mask * 255.0 - 1e-6), 0, 255).astype(np.uint8)


def _spatial(record_shape: tuple[int, ...], where: Path, method: str) -> tuple[int, int]:
    if len(record_shape) in (2, 3):
        return record_shape[0], record_shape[1]
    raise InputError(f"{where}: records of shape {record_shape} are not images; --method {method} "
                     "needs records of 2 axes (H, W) or 3 (H, W, channels)")


def _display(record: np.ndarray, lo: float | None, hi: float | None) -> np.ndarray:
    """One record as 8-bit RGB for the preview, scaled by the range: the declared one, else
    the dtype's for 8- and 16-bit integers (as calibration.resolve_range), else the record's own
    extremes (the preview stays private)."""
    values = record.astype(np.float64)
    if values.ndim == 3:
        values = values[..., :3] if values.shape[-1] >= 3 else values[..., 0]
    if lo is None or hi is None:
        if record.dtype.kind in "iu" and record.dtype.itemsize * 8 <= DEFAULT_RANGE_BITS:
            lo, hi = float(np.iinfo(record.dtype).min), float(np.iinfo(record.dtype).max) + 1
        else:
            lo, hi = float(values.min()), float(values.max())
    scaled = np.clip((values - lo) / ((hi - lo) or 1.0), 0, 1) * 255
    return scaled[..., None].repeat(3, -1) if scaled.ndim == 2 else scaled


def preview_image(record: np.ndarray, mask: np.ndarray, lo: float | None, hi: float | None) -> Image.Image:
    """The record in gray or colour with the mask tinted red (opacity PREVIEW_TINT at w = 1)."""
    base = _display(record, lo, hi)
    if mask.ndim == 3:
        mask = mask.max(axis=-1)
    alpha = PREVIEW_TINT * np.broadcast_to(mask, base.shape[:2])[..., None]
    red = np.array([255.0, 0.0, 0.0])
    return Image.fromarray(np.rint(base * (1 - alpha) + red * alpha).astype(np.uint8), "RGB")


class _Maker:
    """Makes the mask(s) of one input under temporary names; make_mask moves them into place."""

    def __init__(self, o: MaskOptions, module, reader, jobs: list[ArrayJob]):
        self.o, self.reader, self.jobs = o, reader, jobs
        self.folder = module.records_are_files  # one mask PNG per record file
        self.weight = o.weight if o.weight is not None else 1.0
        self.gamma = o.gamma if o.gamma is not None else 1.0
        self.margin = o.margin if o.margin is not None else 0.2
        # (check_options requires --boxes for box, --mask-image for image)
        self.boxes = read_boxes(o.boxes, self.weight) if o.method == "box" and o.boxes is not None else []
        self.picture = read_mask_image(o.mask_image) if o.method == "image" and o.mask_image is not None else None
        self.detector = FaceDetector() if o.method == "faces" else None
        self.faces = [0, 0]  # faces found, images with at least one (shown, never stored)
        self.range = self._range()
        self.preview: Image.Image | None = None
        # Weights computed from the private values (intensity is an exact function of each
        # value; faces and detector boxes say where the people are): readable by their owner only.
        self.data_derived = o.method in DATA_DERIVED_METHODS or o.data_derived
        if o.method == "box":
            self._match_box_files()

    @property
    def data_range(self) -> tuple[float, float]:
        """The range of the methods computed from the values (intensity, faces)."""
        assert self.range is not None  # _range resolved it for them
        return self.range

    def _range(self) -> tuple[float, float] | None:
        if self.o.method in DATA_DERIVED_METHODS:
            return resolve_range(self.o.value_range, self.jobs, self.o.input)
        return self.o.value_range  # only the preview uses it

    def _match_box_files(self) -> None:
        """Box file names -> image relative paths (exact, or a unique base name)."""
        named = [box for box in self.boxes if box.file]
        if named and not self.folder:
            raise InputError(f"{self.o.boxes}: {named[0].where} names a file ({named[0].file}), but "
                             f"{self.o.input} is not a folder of images")
        names = [job.name for job in self.jobs]
        for box in named:
            if box.file in names:
                continue
            matches = [n for n in names if PurePosixPath(n).name == box.file]
            if len(matches) != 1:
                why = "matches no image" if not matches else f"matches {len(matches)} images"
                raise InputError(f"{self.o.boxes}: {box.where}: file {box.file} {why} in {self.o.input}"
                                 + (" (give its relative path)" if matches else ""))
            box.file = matches[0]

    # --- the mask of one record (or of every record) -----------------------------------
    def _static(self, shape: tuple[int, ...], name: str | None, what: str) -> np.ndarray:
        """Methods constant, box and image: the same for any values."""
        if self.o.method == "constant":
            return np.full(shape, self.weight)
        spatial = shape[0], shape[1]  # box and image: _spatial's (H, W)
        if self.o.method == "box":
            assert self.o.boxes is not None  # check_options requires --boxes
            boxes = [box for box in self.boxes if box.file in (None, name)]
            return draw_boxes(spatial, boxes, self.o.boxes, what)
        assert self.picture is not None and self.o.mask_image is not None  # --method image: --mask-image
        return fit_mask_image(self.picture, spatial, self.o.resize, self.o.mask_image, what)

    def _from_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Methods intensity and faces on one image: a spatial (H, W) mask."""
        lo, hi = self.data_range
        if self.o.method == "faces":
            assert self.detector is not None  # made for --method faces
            mask, found = face_mask(pixels, lo, hi, self.detector, self.weight, self.margin)
            self.faces[0] += found
            self.faces[1] += found > 0
            return mask
        # Colour: the brightest channel decides, so a pixel bright in any channel is
        # weighted at least as much as under the mean of the channels.
        return intensity(pixels.max(axis=-1) if pixels.ndim == 3 else pixels, lo, hi, self.gamma)

    def _finish(self, mask: np.ndarray, axes=(0, 1)) -> np.ndarray:
        return feather(mask, self.o.feather, axes) if self.o.feather else mask

    def _check_shapes(self) -> None:
        o = self.o
        for job in self.jobs:
            if o.method in ("box", "image", "faces") or (self.folder and o.method == "constant"):
                _spatial(job.record_shape, o.input, o.method)
            if (o.feather or o.preview) and len(job.record_shape) not in (2, 3):
                option = "--feather" if o.feather else "--preview"
                raise UsageError(f"{o.input}: {option} needs image-like records of 2 axes (H, W) or 3 "
                                 f"(H, W, channels), not {job.record_shape}")

    # --- writing ------------------------------------------------------------------------
    def write(self, tmp: Path) -> tuple[str, list[int] | None]:
        """Write the mask(s) to `tmp`; return (description, the .npy's shape or None)."""
        self._check_shapes()
        if self.folder:
            return self._write_folder(tmp), None
        if self.o.method in PER_RECORD_METHODS:
            return self._write_per_record(tmp)
        return self._write_one(tmp)

    def _write_one(self, tmp: Path) -> tuple[str, list[int]]:
        jobs = self.jobs
        if self.o.method == "constant":
            shapes = {job.record_shape for job in jobs}
        else:
            shapes = {_spatial(job.record_shape, self.o.input, self.o.method) for job in jobs}
        if len(shapes) > 1:
            raise UsageError(f"{self.o.input}: the arrays have records of different shapes "
                             f"({', '.join(map(str, sorted(shapes)))}); choose one with --dataset")
        shape = shapes.pop()
        mask = self._finish(self._static(shape, None, "the records"))
        with self._create(tmp) as f:
            np.save(f, mask)
        if self.o.preview:
            job = jobs[0]
            self.preview = preview_image(job.read(0, 1)[0], mask, *(self.range or (None, None)))
        return f"one {'x'.join(map(str, shape)) or 'scalar'} mask", list(shape)

    def _write_per_record(self, tmp: Path) -> tuple[str, list[int]]:
        """One mask per record, streamed: intensity per element, faces per pixel."""
        if len(self.jobs) > 1:
            names = ", ".join(job.name for job in self.jobs)
            raise UsageError(f"{self.o.input}: holds several arrays ({names}); a {self.o.method} "
                             "mask is made for one: choose it with --dataset")
        job = self.jobs[0]
        lo, hi = self.data_range
        shape = job.shape if self.o.method == "intensity" else (job.records, *job.record_shape[:2])
        target = dataclasses.replace(job, shape=shape)
        self._create(tmp).close()  # NpyWriter opens it again: it keeps its mode
        writer = NpyWriter(target, tmp, np.dtype(np.float32))
        try:
            for start, stop in block_bounds(job, BLOCK_ELEMENTS):
                block = job.read(start, stop)
                check_finite(block, job, start, self.o.input)
                if self.o.method == "intensity":
                    mask = self._finish(intensity(block, lo, hi, self.gamma), axes=(1, 2))
                else:
                    mask = np.stack([self._finish(self._from_pixels(record)) for record in block])
                writer.write(target, start, mask)
                if self.o.preview and start == 0:
                    self.preview = preview_image(block[0], mask[0], lo, hi)
        finally:
            writer.close()
        return f"{job.records} masks of {'x'.join(map(str, shape[1:])) or 'scalar'}", list(shape)

    def _create(self, path: Path) -> BinaryIO:
        """A new mask file: its owner's only when the weights are data-derived."""
        return output.create_private(path) if self.data_derived else open(path, "wb")

    def _write_folder(self, tmp: Path) -> str:
        tmp.mkdir(mode=0o700 if self.data_derived else 0o777)
        lo, hi = self.range or (None, None)
        from_pixels = self.o.method in DATA_DERIVED_METHODS
        for job in self.jobs:
            shape = _spatial(job.record_shape, self.o.input, self.o.method)
            pixels = job.read(0, 1)[0] if from_pixels or (self.o.preview and self.preview is None) \
                else None
            mask = self._from_pixels(pixels) if from_pixels and pixels is not None else \
                self._static(shape, job.name, f"image {job.name}")
            levels = to_png_levels(self._finish(mask))
            target = tmp / PurePosixPath(job.name).with_suffix(".png")
            target.parent.mkdir(parents=True, exist_ok=True)
            with self._create(target) as f:
                Image.fromarray(levels, "L").save(f, format="PNG")
            if self.o.preview and self.preview is None and pixels is not None:  # (read for it above)
                self.preview = preview_image(pixels, levels / 255.0, lo, hi)
        count = len(self.jobs)
        return f"{count} mask PNG{'s' if count != 1 else ''}"


def make_mask(o: MaskOptions) -> MaskResult:
    """Make a weight mask for INPUT and write it (and its sidecar, and the preview) atomically."""
    check_options(o)
    module = formats.detect(o.input, o.input_format)
    if module.records_are_files and o.out.suffix.lower() == ".npy":
        raise UsageError(f"{o.out}: for a folder of images the mask is a folder of PNGs; "
                         "give --out a folder name")
    reader = module.open_reader(o.input, FormatOptions(datasets=[o.dataset] if o.dataset else [],
                                                       skip_bad=o.skip_bad))
    skipped = list(getattr(reader, "bad", []))  # unreadable images --skip-bad left out
    try:
        jobs = reader.arrays()
        maker = _Maker(o, module, reader, jobs)
        sidecar = sidecar_path(o.out)
        targets = [(o.out, "mask"), (sidecar, "mask sidecar")]
        targets += [(o.preview, "preview")] if o.preview else []
        for path, what in targets:
            output.check_destination(path, o.input, o.overwrite, what,
                                     folder=path == o.out and module.records_are_files)
        reads = {what: path for what, path in (("box file", o.boxes), ("mask image", o.mask_image)) if path}
        output.check_distinct({**{what: path for path, what in targets}, **reads})

        with output.staged(o.overwrite) as staging:
            temps = {path: staging.temporary(path) for path, _ in targets}
            description, shape = maker.write(temps[o.out])
            data_derived = maker.data_derived
            meta = {"schema": SIDECAR_SCHEMA, "tool": {"name": "tldp", "version": __version__},
                    "method": o.method, "data_derived": data_derived, "shape": shape,
                    "per_record": o.method in PER_RECORD_METHODS and not maker.folder,
                    "parameters": _parameters(o, maker),
                    "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
            temps[sidecar].write_text(json.dumps(meta, indent=2) + "\n")
            if o.preview:
                assert maker.preview is not None  # the maker makes one when asked
                with output.create_private(temps[o.preview]) as f:  # it shows the data: its owner's only
                    maker.preview.save(f, format="PNG")
    finally:
        reader.close()
    messages = [f"skipped {plural(len(skipped), 'unreadable image')} (no mask made): {listing(skipped)}"
                ] if skipped else []
    if o.method == "faces":
        messages.append(f"found {maker.faces[0]} face(s) in {maker.faces[1]} of "
                        f"{sum(job.records for job in jobs)} image(s)"
                        + ("; check them in the preview" if o.preview else ""))
    if o.method in DATA_DERIVED_METHODS:
        messages.append("warning: these weights are computed from the private values themselves, "
                        "so the chance that a value is kept depends on the data; the manifest of a "
                        "run that uses this mask says so (data_derived: true)")
    return MaskResult(o.out, sidecar, o.preview, description, messages)


def _parameters(o: MaskOptions, maker: _Maker) -> dict[str, Any]:
    """How the mask was made: only what the user declared, never a statistic of the data."""
    p: dict[str, Any] = {"feather": o.feather}
    if o.method in ("constant", "box", "faces"):
        p["weight"] = maker.weight
    if o.method == "box":
        p["boxes"] = str(o.boxes)
    if o.method == "image":
        p.update(mask_image=str(o.mask_image), resize=o.resize)
    if o.method == "intensity":
        p.update(value_range=list(maker.data_range), gamma=maker.gamma)
        if maker.folder:
            p["colour"] = "max over channels"
    if o.method == "faces":
        p.update(value_range=list(maker.data_range), margin=maker.margin, detector=FACE_DETECTOR)
    if o.dataset:
        p["dataset"] = o.dataset
    return p
