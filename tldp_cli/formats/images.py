"""Folders of images (PNG, JPEG, BMP, TIFF, WebP): one image is one record; a multi-page
TIFF is one record of all its pages (one specimen's stack), written as a multi-page TIFF.
Palette images (mode P, PA: segmentation class masks) are label maps, not perturbed: left
out and listed (dropped), or copied raw where --keep names them.

Images are found recursively and keyed by their relative POSIX path, which also
keys their random streams. Opening the folder reads each image's header (shape,
mode, bit depth, orientation); its pixels are decoded once, when they are
perturbed, and a damaged one stops the run then (the output is never committed).
--skip-bad decodes every image up front instead, to skip the bad ones before the
run. No image is held in memory longer than its own perturbation.

Only colour channels are perturbed; an alpha channel is left out (RGBA written as RGB,
LA as L, listed under dropped), or copied back unchanged where --keep alpha names it.
The output folder mirrors the input: lossless PNG rounded and clipped to the
input's integer range (default; written by pixels.png, encoded for noise), or float
TIFF with the values as perturbed. With --copy-other, index files
(metadata.jsonl, metadata.csv) get the output names of renamed images, and lose
the rows naming images the output does not hold (skipped as unreadable, or
symbolic links), which the manifest lists under dropped; a metadata.parquet index,
which tldp cannot rewrite, is then left out (dropped).

Symbolic links inside the folder (to images, other files or directories, dangling
or not) are never followed: they are skipped, named in a message and listed in
the manifest (skipped_symbolic_links), with or without --copy-other, so nothing
outside the folder is read or copied. The folder's own path may be a link.

With --anonymize-names the output is flat, the images numbered in a random order
(000000.png, 000001.png, ...), and the manifest names no input file or folder: its
inputs entries and lists of skipped files give the new names or counts only. The
name map, written beside the raw data, pairs the original names with the new ones
and names the skipped files; evaluate pairs the images through it.
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import hashlib
import io
import json
import math
import os
import posixpath
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tifffile
from PIL import Image

from tldp_cli import __version__
from tldp_cli.files.output import not_earlier_output, removed_during_run
from tldp_cli.errors import InputError, NotHeld, UsageError, reason_of
from tldp_cli.formats import (DATASET_FORMATS, HIDDEN_REASON, SKIP_BAD_HINT, ArrayJob, DocRow, Format, FormatOptions,
                              Reader, Writer, data_file, decode_reason, dicom_refused, folder_files, folder_output,
                              is_dicom, leftovers, listing, name_maps, plural)
from tldp_cli.formats.tensor_files import matching
from tldp_cli.formats.pixels import (PNG_ENCODING, Decoded, Header, LabelMap, Unsupported, UnsupportedMode, decode,
                                     dtype_not_applied, header, png)
from tldp_cli.files.checked_io import (Background, copy_bytes, flushed_files, json_value, open_regular,
                                      path_in_output, write_new_file, writing)

NAME = "images"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
HINTED = 100  # files of a folder without images looked at for inputs of their own (_inputs_hint)
ZARR_MARKERS = ("zarr.json", ".zarray", ".zgroup")
# Where a Zarr array keeps its chunks ("0.0", "0/0", "c/0/0"): a folder holding only such
# files and no image is most likely a store that lost its metadata.
_ZARR_CHUNK_PATH = re.compile(r"^(c/)?\d+([./]\d+)*$")
OUTPUT_SUFFIXES = {"png": (".png",), "tiff": (".tiff", ".tif")}  # the first is the one given
# Index files that name the images, as Hugging Face's imagefolder reads them: a file_name
# column (or any *_file_name one) of paths relative to the index's own folder.
INDEX_FILES = ("metadata.jsonl", "metadata.csv")
# imagefolder's third index, which tldp cannot rewrite (Parquet): not copied when it would
# name images the output does not hold.
PARQUET_INDEX = "metadata.parquet"
NAME_MAP_SCHEMA = name_maps.SCHEMA
WITHHELD = "withheld (--anonymize-names)"
LABEL_MAP_REASON = ("a palette image: class indices (a segmentation's label map), not pixel values to perturb; "
                    "not written (--keep NAME copies it raw)")
QUEUED_BYTES = 64 << 20  # encoded images waiting for the writer thread, at most (about)
ANONYMOUS_DIGITS = 6  # 000000.png: at least this many digits


def can_open(path: Path) -> bool:
    return path.is_dir() and not any((path / marker).exists() for marker in ZARR_MARKERS)


def default_output(path: Path) -> Path:
    return folder_output(path)


def default_name_map(path: Path) -> Path:
    """photos/ -> photos.name-map.json beside it: with the raw data, outside the output."""
    return name_maps.default_path(path)


def _opened(path: Path):
    """The image file, opened only if it is a regular file and not a symbolic link (one
    put in place of an image after the folder was listed, or a FIFO, which would hang)."""
    return open_regular(path, follow_links=False)


def _probe(path: Path) -> Header:
    """The image's header only: its pixels are decoded once, when they are perturbed."""
    with _opened(path) as file, Image.open(file) as im:
        return header(file, im)


def _decoded_header(path: Path) -> Header:
    """The header of an image that decodes in full (--skip-bad: bad ones are found up front)."""
    _decode(path)
    return _probe(path)


def _decode(path: Path) -> Decoded:
    with _opened(path) as file, Image.open(file) as im:
        return decode(file, im)


@dataclass
class _Image:
    rel: str  # relative POSIX path: the job name
    path: Path
    out_rel: str
    shape: tuple[int, ...]  # (1, H, W) or (1, H, W, 3)
    dtype: np.dtype
    has_alpha: bool
    has_icc: bool
    pages: int = 1  # a multi-page TIFF: shape (1, pages, H, W[, 3]), written as multi-page TIFF

    @property
    def colour(self) -> bool:
        return len(self.shape) == (5 if self.pages > 1 else 4)


def _walk(root: Path, hidden: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Relative POSIX paths of the image files, of the other files and of the symbolic
    links, sorted (formats.folder_files: links not followed, FIFOs and devices refused);
    the hidden files and folders, never read, appended to `hidden` (formats.is_hidden)."""
    files, links = folder_files(root, hidden)
    images = [rel for rel in files if Path(rel).suffix.lower() in IMAGE_SUFFIXES]
    others = [rel for rel in files if Path(rel).suffix.lower() not in IMAGE_SUFFIXES]
    return images, others, links


def output_name(rel: str, image_format: str, stack: bool = False) -> str:
    """Where the writer puts the image `rel` (a relative path) with --image-format
    `image_format`, names kept: the same path, its suffix made that format's; a multi-page
    TIFF (stack) stays TIFF."""
    suffixes = OUTPUT_SUFFIXES["tiff" if stack else image_format]
    path = Path(rel)
    return rel if path.suffix.lower() in suffixes else path.with_suffix(suffixes[0]).as_posix()


def read_output(path: Path) -> np.ndarray:
    """The perturbed colour channels of an image the writer wrote: a TIFF read with
    tifffile (its floating-point samples, without the alpha channel --keep alpha copies as
    the last channel, an extra sample), a PNG decoded as the reader decodes images."""
    if path.suffix.lower() in (".tif", ".tiff"):
        with tifffile.TiffFile(path) as tif:
            first = tif.pages[0]  # the first page is always read in full, a TiffPage
            pixels = tif.asarray()
            has_alpha = isinstance(first, tifffile.TiffPage) and bool(first.extrasamples)
        if has_alpha:
            pixels = pixels[..., :-1]
            if pixels.shape[-1] == 1:
                pixels = pixels[..., 0]
        return pixels
    return _decode(path).colour


# Images in formats tldp does not read, by their ISO-BMFF brand (HEIC, AVIF: phone photos)
# or JPEG XL signature, which Pillow alone may not recognise.
_BMFF_IMAGE_BRANDS = (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis")
UNREAD_IMAGE = "an image in a format tldp does not read"
_JPEG_XL = (b"\xff\x0a", b"\x00\x00\x00\x0cJXL \r\n\x87\n")


# Windows Explorer's hidden caches of a folder's thumbnails: small raw copies of its images.
THUMBNAIL_CACHES = ("thumbs.db", "ehthumbs.db", "ehthumbs_vista.db")


def _thumbnail_cache(rel: str) -> str | None:
    """Why --copy-other must not copy a thumbnail cache (Thumbs.db): it holds the folder's
    images themselves, raw and small; None for any other file."""
    if posixpath.basename(rel).lower() in THUMBNAIL_CACHES:
        return "a thumbnail cache (Windows' Thumbs.db), small raw copies of the folder's images"
    return None


def _unread_image(path: Path) -> str | None:
    """Why a file whose suffix is not an image's (IMAGE_SUFFIXES) is an image all the same,
    which --copy-other must not copy raw: the data of an image folder, in a format tldp does
    not perturb (GIF, PPM, TGA, ICO, a camera's raw TIFF, HEIC, AVIF, JPEG XL). None for
    any other file, and for one that cannot be read (copying it fails with the reason)."""
    kind = _unread_kind(path)
    return None if kind is None else _unread_reason(kind)


def _unread_reason(kind: str) -> str:
    """Why an image in a format tldp does not read (`kind`: GIF, HEIF/AVIF...) is not written."""
    return f"{UNREAD_IMAGE}, {kind}, a record of the folder's data: {_convert_hint(1)}"


def _convert_hint(n: int) -> str:
    it = "it" if n == 1 else "them"
    return f"convert {it} to PNG to perturb {it}"


def _unread_images(kinds: dict[str, str]) -> str:
    """"2 images in formats tldp does not read (GIF, HEIF/AVIF; convert them to PNG to perturb
    them)", of the files _unread_kind found (relative path -> format)."""
    n = len(kinds)
    what = UNREAD_IMAGE.replace("an image", "1 image") if n == 1 else f"{n} images in formats tldp does not read"
    return f"{what} ({', '.join(sorted(set(kinds.values())))}; {_convert_hint(n)})"


def _unread_kind(path: Path) -> str | None:
    """The format of an image in a format tldp does not read (_unread_image), or None."""
    try:
        with _opened(path) as file:
            head = file.read(16)
            if (head[4:8] == b"ftyp" and head[8:12] in _BMFF_IMAGE_BRANDS) or head.startswith(_JPEG_XL):
                kind = "HEIF/AVIF" if head[4:8] == b"ftyp" else "JPEG XL"
            else:
                file.seek(0)
                with Image.open(file) as im:  # the header only: Pillow names the format
                    kind = im.format or "image"
    except Exception:  # not an image Pillow knows (or not readable): not this rule's
        return None
    return kind


def _non_images(n: int) -> str:
    return "1 file that is not an image" if n == 1 else f"{n} files that are not images"


def _hidden_count(hidden: list[str]) -> str:
    """"2 hidden files and 1 hidden folder": a folder's name ends in "/" (formats.folder_files)."""
    folders = sum(rel.endswith("/") for rel in hidden)
    counts = [plural(len(hidden) - folders, "hidden file")] if len(hidden) > folders else []
    return " and ".join(counts + ([plural(folders, "hidden folder")] if folders else []))


def _check_collisions(root: Path, out_names: dict[str, str]) -> None:
    claimed: dict[str, str] = {}
    for rel, out in out_names.items():
        if out in claimed:
            raise InputError(f"{root}: {claimed[out]} and {rel} would both be written as {out}; "
                             "rename one of them")
        claimed[out] = rel


def _read(image: _Image, start: int, stop: int) -> np.ndarray:
    """The image as one record (a module-level function: jobs must pickle for Dask)."""
    try:
        colour = _decode(image.path).colour
    except InputError:  # no longer a regular file
        raise
    except Unsupported as exc:
        raise InputError(f"{image.path}: {exc}") from None
    except PermissionError as exc:
        raise InputError(f"{image.path}: cannot read ({reason_of(exc)})") from None
    except MemoryError:  # not damage: the run says memory ran out
        raise
    except Exception as exc:  # a header that reads well over pixel data that does not
        raise InputError(f"{image.path}: cannot be decoded as an image ({decode_reason(exc)})"
                         + SKIP_BAD_HINT) from None
    if (1, *colour.shape) != image.shape or colour.dtype != image.dtype:
        raise InputError(f"{image.path}: the image changed while tldp was reading the folder")
    return colour[None]


class ImageFolderReader(Reader):
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.messages: list[str] = []
        self.manifest_extra: dict = {}
        if options.datasets:
            raise UsageError(f"{path}: --dataset applies to {DATASET_FORMATS}, not image folders")
        if options.image_format not in OUTPUT_SUFFIXES:
            raise UsageError(f"--image-format must be png or tiff, not {options.image_format}")
        self.anonymized = options.anonymize_names
        self.image_format = options.image_format
        if self.anonymized and options.copy_other:
            raise UsageError(f"{path}: --copy-other copies files under their own names; it does not "
                             "go with --anonymize-names")
        self.hidden: list[str] = []  # hidden files and folders (.DS_Store, __MACOSX/): never read
        candidates, self.others, self.links = _walk(path, self.hidden)
        self.images: list[_Image] = []
        self.label_maps: list[str] = []  # palette images: class indices, not perturbed
        bad, conversions = self._probe_all(candidates, options)
        if not self.anonymized:
            _check_collisions(path, self.out_names)
        self.bad = bad
        if not self.images:
            self._no_images(bad)
        self.kept_label_maps = self._leave_out_label_maps(options)
        renamed = any(image.out_rel != image.rel for image in self.images)
        # --copy-other never copies data: what tldp reads, pickles, medical images, other images
        self.data_files = self._data_files() if options.copy_other else {}
        # Without --copy-other, the other files that are images in formats tldp does not read
        # (GIF, HEIC...), named as such: relative path -> format
        self.unread_images = {} if options.copy_other else {
            rel: kind for rel in self.others if (kind := _unread_kind(path / rel))}
        # Files that name images not written: an index row naming one is dropped.
        self.unwritten = {**{rel: "an unreadable image, skipped (--skip-bad)" for rel in bad},
                          **{rel: "a symbolic link, skipped" for rel in self.links},
                          **{rel: "a palette image (a label map), left out" for rel in self.label_maps
                             if rel not in self.kept_label_maps},
                          **{rel: "an image in a format tldp does not read, left out" for rel, reason
                             in self.data_files.items() if reason.startswith(UNREAD_IMAGE)}}
        self.index_files = [rel for rel in self.others if posixpath.basename(rel) in INDEX_FILES
                            and (renamed or self.unwritten) and options.copy_other]
        self.stale_indexes = [rel for rel in self.others if posixpath.basename(rel) == PARQUET_INDEX
                              and (renamed or self.unwritten) and options.copy_other]
        # Rewritten now, before anything is written: what the manifest says was dropped is
        # what the output's index files leave out.
        self.index_texts, self.dropped_rows = self._rewrite_indexes()
        if options.image_format == "tiff":
            self._warn_tiff_readers()
        elif options.dtype is not None:  # asked for, but PNG holds the images' own integers
            self.messages.append(dtype_not_applied(options.dtype, "the images")
                                 + " (--image-format tiff writes TIFF of the noisy values)")
        self._report_hidden()
        if self.anonymized:
            self._anonymize(options.image_format)
            conversions = {self.out_names[rel]: notes for rel, notes in conversions.items()}
            self._report_anonymized(bad, conversions)
        else:
            self._report(options, bad, conversions)
            self._warn_folder_labels()

    def _probe_all(self, candidates: list[str], options: FormatOptions) -> tuple[list[str], dict[str, list[str]]]:
        """Reads each candidate's header (decodes it with --skip-bad) into self.images, or
        self.label_maps for palette images; returns the unreadable ones skipped (--skip-bad)
        and the conversions applied, by image."""
        bad: list[str] = []
        conversions: dict[str, list[str]] = {}
        # Headers only, unless bad images are to be skipped: those are found by decoding.
        check = _decoded_header if options.skip_bad else _probe
        for rel in candidates:
            file = self.path / rel
            try:
                header = check(file)
            except InputError:  # replaced by a FIFO or a device since the folder was listed
                raise
            except LabelMap:
                self.label_maps.append(rel)
                continue
            except UnsupportedMode as exc:  # CMYK, float: the hint names the file
                reason = exc.for_file(file.name)
            except Unsupported as exc:
                reason = str(exc)
            except PermissionError as exc:
                reason = f"cannot read ({reason_of(exc)})"
            except MemoryError:  # not damage: the run says memory ran out
                raise
            except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError... on bad files
                reason = f"cannot be decoded as an image ({decode_reason(exc)})"
            else:
                out_rel = output_name(rel, options.image_format, header.pages > 1)
                self.images.append(_Image(rel, file, out_rel, (1, *header.shape), header.dtype,
                                          header.has_alpha, header.has_icc, header.pages))
                if header.notes:
                    conversions[rel] = header.notes
                continue
            if not options.skip_bad:
                raise InputError(f"{file}: {reason}{SKIP_BAD_HINT}")
            bad.append(rel)
        return bad, conversions

    def _no_images(self, bad: list[str]) -> None:
        """The error for a folder without an image to perturb, saying what it holds."""
        path = self.path
        unread = {rel: kind for rel in self.others if (kind := _unread_kind(path / rel))}
        found = [_unread_images(unread)] if unread else []
        found += [_non_images(len(self.others) - len(unread))] if len(self.others) > len(unread) else []
        found += [plural(len(self.label_maps), "palette image") + " (label maps, which tldp does not "
                  "perturb)"] if self.label_maps else []
        found += [plural(len(bad), "unreadable image")] if bad else []
        found += [plural(len(self.links), "symbolic link")] if self.links else []
        found += [_hidden_count(self.hidden) + ", not read"] if self.hidden else []
        detail = f" (found {' and '.join(found)})" if found else ""
        dicom = sum(is_dicom(path / rel) for rel in self.others)
        if dicom:  # a scan's slices: refused for what their headers hold, not as "no images"
            raise dicom_refused(path, dicom)
        if self.others and all(_ZARR_CHUNK_PATH.match(rel) for rel in self.others):
            raise InputError(f"{self.path}: no images{detail}, only what looks like the chunks of "
                             "a damaged Zarr store: no zarr.json, .zarray or .zgroup at its root "
                             "(its metadata is missing)")
        raise InputError(f"no images in {self.path}{detail}; looking for {', '.join(IMAGE_SUFFIXES)}"
                         + self._inputs_hint())

    def _inputs_hint(self) -> str:
        """Files of the folder (the first HINTED looked at) that tldp perturbs as inputs of their
        own (a folder of .safetensors checkpoints, of .npy files): say so."""
        own = [rel for rel in self.others[:HINTED]
               if "which tldp perturbs on its own" in (data_file(self.path / rel) or "")]
        if not own:
            return ""
        more = f" and {plural(len(own) - 1, 'other')}" if len(own) > 1 else ""
        return (f"; {self.path / own[0]}{more} {'hold' if more else 'holds'} data tldp perturbs on its own: "
                "give the files as inputs (tldp perturb FILE ... --out FOLDER/, or --inputs-from)")

    def _leave_out_label_maps(self, options: FormatOptions) -> list[str]:
        """The palette images (label maps) --keep names, copied raw and listed under
        unperturbed; the others are left out, listed under dropped (leftovers.py's rule)."""
        left = leftovers.Leftovers(list(options.keep))
        left.considered(image.rel for image in self.images)  # --keep never stops the noise
        kept = [rel for rel in self.label_maps if left.kept(rel)]
        self.keep_icc = left.icc_profiles(sum(image.has_icc for image in self.images))
        self.keep_alpha = left.alpha_channels(sum(image.has_alpha for image in self.images))
        try:
            left.check(self.path)
        except NotHeld as exc:  # --keep never copies a hidden file: say so, naming it
            hidden = next((rel for rel in self.hidden if matching(rel.rstrip("/"), exc.names[:1])
                           or (rel.endswith("/") and exc.names[0].startswith(rel))), None)
            if hidden is None:
                raise
            raise NotHeld(f"{self.path}: --keep {exc.names[0]} names {hidden}, which is {HIDDEN_REASON} (not even "
                          "with --keep)", exc.option, exc.names) from None
        if kept and self.anonymized:
            raise UsageError(f"{self.path}: --keep copies label maps under their own names; it does not "
                             "go with --anonymize-names")
        for rel in self.label_maps:
            if rel in kept:
                left.copied(rel, "label map", leftovers.KEPT)
            else:
                left.drop(WITHHELD if self.anonymized else rel, "label map", LABEL_MAP_REASON)
        self.manifest_extra.update(left.manifest_extra())
        left_out = [rel for rel in self.label_maps if rel not in kept]
        if left_out:
            names = "" if self.anonymized else f": {listing(left_out)}"
            self.messages.append(f"left out {plural(len(left_out), 'palette image')} (label maps: class indices, "
                                 f"not pixels to perturb; the manifest's dropped; --keep NAME copies one "
                                 f"raw){names}")
        return kept

    def _data_files(self) -> dict[str, str]:
        """The files --copy-other does not copy, by relative path, with the reason: those
        formats.data_file names, and the files of a Zarr store inside the folder."""
        found = {}
        for rel in self.others:
            parents = [posixpath.dirname(rel)]
            while parents[-1]:
                parents.append(posixpath.dirname(parents[-1]))
            store = next((p for p in parents if p and any((self.path / p / m).is_file() for m in ZARR_MARKERS)),
                         None)
            # imagefolder's indexes name the images (metadata.parquet as metadata.jsonl): not data
            index = posixpath.basename(rel) in (PARQUET_INDEX, *INDEX_FILES)
            reason = (f"part of the Zarr store {store}, data which tldp perturbs on its own" if store
                      else None if index else data_file(self.path / rel) or _thumbnail_cache(rel)
                      or _unread_image(self.path / rel))
            if reason:
                found[rel] = reason
        return found

    @property
    def copied(self) -> list[str]:
        """The files --copy-other copies: the other files but data (data_files) and the
        Parquet indexes that would name images not in the output (stale_indexes)."""
        return [rel for rel in self.others if rel not in self.data_files and rel not in self.stale_indexes]

    def _report_copies(self) -> None:
        """--copy-other: the files copied (the manifest's unperturbed) and the data files not
        copied (dropped), each with the reason."""
        self.manifest_extra["unperturbed"] = [*self.manifest_extra.get("unperturbed", []), *(
            {"name": rel, "kind": "file", "reason": "--copy-other: not an image" if rel not in self.index_files
             else "--copy-other: an index of the images, rewritten to the output's"} for rel in self.copied)]
        if self.data_files:
            self.manifest_extra["dropped"] = [*self.manifest_extra.get("dropped", []), *(
                {"name": rel, "kind": "file", "reason": f"{reason}: never copied raw"}
                for rel, reason in self.data_files.items())]
            kinds = sorted({reason.split(":")[0].split(",")[0] for reason in self.data_files.values()})
            self.messages.append(f"did not copy {plural(len(self.data_files), 'file')} holding data "
                                 f"({'; '.join(kinds)}), which --copy-other never copies raw: "
                                 f"{listing(list(self.data_files))} (the manifest's dropped)")
        if self.stale_indexes:
            self.manifest_extra["dropped"] = [*self.manifest_extra.get("dropped", []), *(
                {"name": rel, "kind": "file", "reason": "an index of the images in Parquet, which tldp cannot "
                 "rewrite: it names images the output renames or does not hold"} for rel in self.stale_indexes)]
            self.messages.append(f"did not copy {listing(self.stale_indexes)}: a Parquet index of the images, "
                                 "which tldp cannot rewrite, would name images the output renames or does "
                                 "not hold (give it as metadata.jsonl or metadata.csv, which tldp rewrites)")

    def _rewrite_indexes(self) -> tuple[dict[str, str], list[dict]]:
        """Each index file as the output holds it, and its rows dropped ({name, kind,
        reason}, as the manifest's dropped lists them)."""
        texts, dropped = {}, []
        for rel in self.index_files:
            source = self.path / rel
            try:
                with _opened(source) as f:
                    text = f.read().decode("utf-8-sig")  # a BOM would stop json.loads
            except OSError as exc:
                raise InputError(f"{source}: cannot read ({reason_of(exc)})") from None
            except UnicodeDecodeError:
                raise _unreadable_index(source, "not UTF-8 text") from None
            names = _IndexNames(rel, self.out_names, self.unwritten)
            rewrite = _rewrite_csv if rel.endswith(".csv") else _rewrite_jsonl
            texts[rel], rows = rewrite(text, names, source)
            dropped += [{"name": f"{rel} {row}", "kind": "index row",
                         "reason": f"names {value}, {self.unwritten[names.path(value)]}: not in the output"}
                        for row, value in rows]
        return texts, dropped

    def _warn_folder_labels(self) -> None:
        # malignant/x.png: the subfolder's name is the image's label, released under its own name
        folders = {posixpath.dirname(image.rel) for image in self.images} - {""}
        if folders:
            self.messages.append(
                f"warning: the images lie in {plural(len(folders), 'subfolder')}, whose names are released as "
                "each image's label, raw, outside the certificate (--anonymize-names withholds them)")

    def _warn_tiff_readers(self) -> None:
        # Pillow opens TIFF with 16/32-bit or float samples in one channel only (checked
        # with Pillow 13); torchvision's and Hugging Face's image loaders go through it.
        several = [i for i in self.images if i.colour or (i.has_alpha and self.keep_alpha)]
        if several:
            self.messages.append(
                f"warning: {plural(len(several), 'colour or alpha image')} will be TIFF with several "
                "channels of 16/32-bit integer or float samples, which Pillow cannot open (nor "
                "torchvision's and Hugging Face datasets' image loaders, which use it); tifffile "
                "reads them. For those loaders use the default --image-format png")

    @property
    def out_names(self) -> dict[str, str]:
        return {image.rel: image.out_rel for image in self.images}

    def _anonymize(self, image_format: str) -> None:
        """Flat output names numbered in a random order: the sorted order of the names
        would tell who is who to anyone who knows the names."""
        numbers = list(range(len(self.images)))
        secrets.SystemRandom().shuffle(numbers)
        digits = max(ANONYMOUS_DIGITS, len(str(len(self.images) - 1)))
        for image, number in zip(self.images, numbers):
            suffix = OUTPUT_SUFFIXES["tiff" if image.pages > 1 else image_format][0]
            image.out_rel = f"{number:0{digits}d}{suffix}"
        self.name_map_id = secrets.token_hex(16)  # ties the manifest to its name map

    def _report_skipped_others(self) -> None:
        """Without --copy-other: the files skipped, the images in formats tldp does not read
        (GIF, HEIC...; listed under dropped too, with the advice) apart from the others."""
        plain = [rel for rel in self.others if rel not in self.unread_images]
        if self.unread_images:
            self.manifest_extra["dropped"] = [*self.manifest_extra.get("dropped", []), *(
                {"name": rel, "kind": "file", "reason": _unread_reason(kind)}
                for rel, kind in self.unread_images.items())]
            self.messages.append(f"skipped {_unread_images(self.unread_images)}: {listing(list(self.unread_images))}")
        if plain:
            self.messages.append(f"skipped {_non_images(len(plain))}: {listing(plain)}")

    def _report_hidden(self) -> None:
        """The hidden files and folders (formats.is_hidden: .DS_Store, .ipynb_checkpoints/,
        __MACOSX/), never read nor copied: listed under dropped, by the name map only with
        --anonymize-names."""
        if not self.hidden:
            return
        self.manifest_extra["dropped"] = [*self.manifest_extra.get("dropped", []), *(
            {"name": WITHHELD if self.anonymized else rel, "kind": "folder" if rel.endswith("/") else "file",
             "reason": HIDDEN_REASON} for rel in self.hidden)]
        names = "named in the name map" if self.anonymized else listing(self.hidden)
        self.messages.append(f"left out {_hidden_count(self.hidden)}, never read nor copied (the manifest's "
                             f"dropped): {names}")

    def _report_anonymized(self, bad: list[str], conversions: dict[str, list[str]]) -> None:
        """Counts instead of names: the name map lists the files."""
        skipped = (("skipped_symbolic_links", self.links, "symbolic link"),
                   ("not_images", self.others, "non-image file"),
                   ("skipped_bad_images", bad, "unreadable image"))
        for key, names, word in skipped:
            if names:
                self.manifest_extra[key] = len(names)
                unread = len(self.unread_images) if key == "not_images" else 0
                what = [_unread_images(self.unread_images)] if unread else []
                what += [plural(len(names) - unread, word)] if len(names) > unread else []
                self.messages.append(f"skipped {' and '.join(what)} (named in the name map)")
        if self.others:
            self.manifest_extra["not_images_action"] = "skipped"
        if conversions:
            self.manifest_extra["image_conversions"] = conversions
        self.manifest_extra["anonymized_names"] = {
            "name_map_id": self.name_map_id,
            "rule": "images renamed to numbers in a random order in one flat folder; the input's "
                    "file and folder names and paths are withheld (lists of skipped files are "
                    "counts); the name map kept with the raw data pairs them"}

    def _report(self, options: FormatOptions, bad: list[str], conversions: dict[str, list[str]]):
        if self.links:
            self.manifest_extra["skipped_symbolic_links"] = self.links
            self.messages.append(f"skipped {plural(len(self.links), 'symbolic link')}: {listing(self.links)}")
        if self.others:
            self.manifest_extra["not_images"] = self.others
            self.manifest_extra["not_images_action"] = "copied unchanged" if options.copy_other else "skipped"
            if options.copy_other:  # the summary line names the copies (unperturbed)
                self._report_copies()
            else:
                self._report_skipped_others()
        if self.index_files:
            self.manifest_extra["not_images_action"] = (
                "copied unchanged, but for index files (index_files_rewritten): image file names "
                "follow the output's, and rows naming images not written are removed (dropped)")
            self.manifest_extra["index_files_rewritten"] = self.index_files
        if self.index_files and any(image.out_rel != image.rel for image in self.images):
            self.messages.append(f"rewrote the image file names in {listing(self.index_files)} to the "
                                 "output's (the images' suffix changed)")
        if self.dropped_rows:
            self.manifest_extra["dropped"] = [*self.manifest_extra.get("dropped", []), *self.dropped_rows]
            self.messages.append(
                f"dropped {plural(len(self.dropped_rows), 'index row')} naming images not written "
                f"(listed in the manifest's dropped): {listing([r['name'] for r in self.dropped_rows])}")
        if bad:
            self.manifest_extra["skipped_bad_images"] = bad
            self.messages.append(f"skipped {plural(len(bad), 'unreadable image')}: {listing(bad)}")
        if conversions:
            self.manifest_extra["image_conversions"] = conversions

    def arrays(self) -> list[ArrayJob]:
        return [ArrayJob(name=image.rel, shape=image.shape, dtype=image.dtype,
                         read=functools.partial(_read, image),
                         source={"path": str(image.path), "format": NAME,
                                 "shape": list(image.shape), "dtype": str(image.dtype)})
                for image in self.images]

    def output_dtype(self, dtype: np.dtype) -> str:
        """TIFF holds the engine's values; PNG each image's own bit depth (rounded and clipped)."""
        if self.image_format == "tiff":
            return str(np.dtype(dtype))
        return " and ".join(sorted({str(image.dtype) for image in self.images}))

    def manifest_name(self, name: str) -> str:
        """Anonymized: the output's name (the input's is in the name map only)."""
        return self.out_names.get(name, WITHHELD) if self.anonymized else name

    def manifest_inputs(self) -> list[dict]:
        """The manifest's inputs entries; anonymized: by output name, no input path."""
        if not self.anonymized:
            return [job.source for job in self.arrays()]
        return [{"path": WITHHELD, "image": image.out_rel, "format": NAME, "shape": list(image.shape),
                 "dtype": str(image.dtype)} for image in sorted(self.images, key=lambda i: i.out_rel)]

    def name_map(self, output_path: Path, manifest_path: Path) -> dict:
        """The name map: what the manifest withholds. It names the people in the data."""
        return {"schema": NAME_MAP_SCHEMA, "sensitive": "names the images of the raw data: keep it "
                                                        "with the raw data, never with the release",
                "tool": {"name": "tldp", "version": __version__}, "name_map_id": self.name_map_id,
                "input": str(self.path), "output": str(output_path), "manifest": str(manifest_path),
                "images": self.out_names, "skipped_bad_images": self.bad, "not_images": self.others,
                "skipped_symbolic_links": self.links, "label_maps_left_out": self.label_maps,
                "hidden_left_out": self.hidden,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}

    def close(self) -> None:
        pass


def open_reader(path: Path, options: FormatOptions) -> ImageFolderReader:
    return ImageFolderReader(path, options)


def read_name_map(path: Path, name_map_id: str) -> dict[str, str]:
    """original relative path -> output name, from the name map of the run whose manifest
    holds `name_map_id`."""
    try:
        with open_regular(Path(path)) as f:
            text = f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: name map not found; the images were renamed by perturb "
                         "--anonymize-names: give its name map with --name-map") from None
    except OSError as exc:
        raise InputError(f"{path}: not a readable name map ({reason_of(exc)})") from None
    document = json_value(text, f"{path}: not a readable name map: it")
    if not isinstance(document, dict) or document.get("schema") != NAME_MAP_SCHEMA:
        raise InputError(f"{path}: not a {NAME_MAP_SCHEMA} name map")
    if document.get("name_map_id") != name_map_id:
        raise InputError(f"{path}: is the name map of another run (its name_map_id differs from "
                         "the manifest's)")
    images = document.get("images")
    if not (isinstance(images, dict) and all(
            isinstance(k, str) and isinstance(v, str) and v and "/" not in v and v not in (".", "..")
            for k, v in images.items())):
        raise InputError(f"{path}: damaged name map: 'images' is not a map of names to file names")
    return images


def _icc_profile(path: Path) -> bytes | None:
    with _opened(path) as file, Image.open(file) as im:  # header only, no decoding
        return im.info.get("icc_profile")


def _is_name_column(key: object) -> bool:
    return isinstance(key, str) and (key == "file_name" or key.endswith("_file_name"))


class _IndexNames:
    """The names in the index file at `index_rel`: a file_name value resolved to the
    input's file it names (path), and to the output's name for it (rename). Only a renamed
    image's suffix changes, so a value keeps its own spelling ("./a.jpg" -> "./a.png");
    names of anything but a renamed image are kept. `unwritten`: the files the output does
    not hold (name -> why), whose rows are dropped."""

    def __init__(self, index_rel: str, out_names: dict[str, str], unwritten: dict[str, str]):
        self.folder = posixpath.dirname(index_rel)
        self.out_names = out_names
        self.unwritten = unwritten

    def path(self, value: str) -> str:
        return posixpath.normpath(posixpath.join(self.folder, value))

    def rename(self, value: str) -> str:
        out = self.out_names.get(self.path(value))
        suffix = posixpath.splitext(value)[1]
        return value if out is None or not suffix else value[:-len(suffix)] + posixpath.splitext(out)[1]

    def not_written(self, row: dict) -> str | None:
        """The first file_name value of the row that names a file not written, if any."""
        return next((v for k, v in row.items() if _is_name_column(k) and isinstance(v, str)
                     and self.path(v) in self.unwritten), None)


def _unreadable_index(where: Path, problem: str) -> InputError:
    return InputError(f"{where}: {problem}, so the image names in it cannot be rewritten to the "
                      "output's; fix it or leave out --copy-other")


def _rewrite_jsonl(text: str, names: _IndexNames, where: Path) -> tuple[str, list[tuple[str, str]]]:
    """The text with image names renamed and the rows naming a file not written left out;
    and those rows ("line N", the file_name value)."""
    lines: list[str | None] = list(text.split("\n"))  # as JSON Lines readers split: not at U+2028
    dropped = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json_value(line, f"line {number}")
        except InputError as exc:  # not JSON, or nested too deeply to parse
            raise _unreadable_index(where, str(exc)) from None
        if not isinstance(row, dict):
            raise _unreadable_index(where, f"line {number} is not a JSON object")
        gone = names.not_written(row)
        if gone is not None:
            lines[number - 1] = None
            dropped.append((f"line {number}", gone))
            continue
        renamed = {k: names.rename(v) if _is_name_column(k) and isinstance(v, str) else v
                   for k, v in row.items()}
        if renamed != row:
            dumped = json.dumps(renamed, ensure_ascii=False)
            try:
                dumped.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (a name that is not UTF-8): a \u escape
                dumped = json.dumps(renamed)
            lines[number - 1] = dumped + ("\r" if line.endswith("\r") else "")
    return "\n".join(line for line in lines if line is not None), dropped


def _rewrite_csv(text: str, names: _IndexNames, where: Path) -> tuple[str, list[tuple[str, str]]]:
    """As _rewrite_jsonl; rows are numbered from the first after the header ("row N")."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as exc:
        raise _unreadable_index(where, f"not readable as CSV ({reason_of(exc)})") from None
    if not rows:
        return text, []
    columns = [i for i, name in enumerate(rows[0]) if _is_name_column(name)]
    kept, dropped = [], []
    for number, row in enumerate(rows[1:], 1):
        gone = names.not_written({rows[0][i]: row[i] for i in columns if i < len(row)})
        if gone is not None:
            dropped.append((f"row {number}", gone))
        else:
            kept.append([names.rename(v) if i in columns else v for i, v in enumerate(row)])
    if kept == rows[1:]:
        return text, []
    written = io.StringIO(newline="")
    csv.writer(written, lineterminator="\r\n" if "\r\n" in text else "\n").writerows([rows[0], *kept])
    return written.getvalue(), dropped


class ImageFolderWriter(Writer):
    def __init__(self, reader: ImageFolderReader, tmp_path: Path, dtype: np.dtype,
                 options: FormatOptions):
        self.root = tmp_path
        self.image_format = options.image_format
        self.dtype = np.dtype(dtype)
        self.images = {image.rel: image for image in reader.images}
        self.keep_icc = reader.keep_icc  # --keep icc_profile (leftovers.py)
        self.keep_alpha = reader.keep_alpha  # --keep alpha
        self._digests: dict[Path, str] = {}  # filled by write; on Dask workers it stays empty
        # Every file the output must hold once complete (finish checks they all are there).
        self._expected = [image.out_rel for image in reader.images] + (reader.copied if options.copy_other
                                                                        else []) + reader.kept_label_maps
        with writing(tmp_path):
            tmp_path.mkdir()
        for rel in reader.kept_label_maps:  # --keep: byte for byte, raw (listed under unperturbed)
            self._copy(reader.path / rel, rel)
        if options.copy_other:
            for rel in reader.copied:
                if rel in reader.index_files:
                    self._write_index(reader.index_texts[rel], rel)
                else:
                    self._copy(reader.path / rel, rel)
        self.postprocessing = self._steps(any(image.has_alpha for image in reader.images) and self.keep_alpha,
                                          any(image.pages > 1 for image in reader.images))
        # What evaluate needs to read the output back, as fields (postprocessing is for people).
        self.manifest_extra = {"image_output": {"format": self.image_format,
                                                "clipped": self.image_format == "png"}}
        self.output_dtype = reader.output_dtype(self.dtype)
        # Images are encoded by the workers and written, each flushed to disk, by a thread of
        # its own, so that the workers do not wait for the disk (none in Dask workers). The
        # queue holds at most QUEUED_BYTES of encoded images (one, however large it is).
        # Started last: nothing after it can fail and leave it running.
        largest = max((math.prod(image.shape) * (self.dtype.itemsize if self.image_format == "tiff"
                                                  else image.dtype.itemsize) for image in reader.images),
                      default=1)
        self._disk: Background | None = Background(lambda item: _write_image(*item), f"tldp write {tmp_path.name}",
                                                   depth=max(1, min(8, QUEUED_BYTES // largest)))

    def _steps(self, any_alpha: bool, any_stack: bool) -> list[str]:
        if self.image_format == "tiff":
            steps = [f"write {self.dtype} TIFF (unclipped)"]
            if any_stack:
                steps.append("write each multi-page TIFF as a multi-page TIFF of its pages")
        else:
            depths = sorted({image.dtype.itemsize * 8 for image in self.images.values()})
            ranges = [f"[0, {2**d - 1}]" + (f" ({d}-bit images)" if len(depths) > 1 else "")
                      for d in depths]
            # exact (integer) noise needs no rounding; float noise does
            rounding = [] if self.dtype.kind in "iu" else ["round to nearest integer (ties to even)"]
            steps = rounding + ["clip to " + ", ".join(ranges),
                                "write " + " and ".join(f"{d}-bit" for d in depths) + " PNG " + PNG_ENCODING]
            if any_stack:
                steps.append("write each multi-page TIFF as an uncompressed multi-page TIFF of its pages, "
                             "of its own bit depth (clipped as PNG is)")
        if any_alpha:
            steps.append("copy the alpha channel unchanged from the input (it is not perturbed; --keep alpha)")
        elif any(image.has_alpha for image in self.images.values()):
            steps.append("leave out the alpha channel (RGBA written as RGB, LA as L)")
        steps.append(("keep" if self.keep_icc else "drop") + " the ICC colour profile; drop EXIF and text metadata")
        return steps

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_digests", "_disk")}

    def __setstate__(self, state):
        self.__dict__.update(state, _digests={}, _disk=None)

    def _target(self, rel: str) -> Path:
        return path_in_output(self.root, rel)

    def _copy(self, source: Path, rel: str) -> Path:
        target = self._target(rel)
        try:
            src = _opened(source)
        except OSError as exc:
            raise InputError(f"{source}: cannot read ({reason_of(exc)})") from None
        with src, writing(target), open(target, "wb") as dst:
            copy_bytes(src, source, dst, target)
        return target

    def _write_index(self, text: str, rel: str) -> None:
        """An index file as the reader rewrote it (ImageFolderReader.index_texts)."""
        target = self._target(rel)
        with writing(target), open(target, "wb") as f:
            f.write(text.encode("utf-8"))

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        image = self.images[job.name]
        values = block[0]
        alpha = _decode(image.path).alpha if image.has_alpha and self.keep_alpha else None
        icc = _icc_profile(image.path) if image.has_icc and self.keep_icc else None
        target = self._target(image.out_rel)
        encoded: bytes | memoryview
        if self.image_format == "tiff":
            pixels = values.astype(self.dtype)
            if alpha is not None:
                pixels = np.dstack([pixels, alpha.astype(self.dtype)])
            encoded = _tiff(pixels, image.colour, alpha is not None, icc)
        else:
            info = np.iinfo(image.dtype)
            rounded = values if values.dtype.kind in "iu" else np.rint(values)  # exact noise: integers
            pixels = np.clip(rounded, info.min, info.max).astype(image.dtype)
            if alpha is not None:
                pixels = np.dstack([pixels, alpha])
            # a multi-page TIFF stays one (PNG holds one page), clipped to its bit depth as PNG is
            encoded = _tiff(pixels, image.colour, False, icc) if image.pages > 1 else png(pixels, icc)
        # Encoded in memory, then written with checked writes (Pillow and tifffile write to a
        # file descriptor without checking for short writes).
        self._digests[target] = hashlib.sha256(encoded).hexdigest()  # not read back for the manifest
        if self._disk is None:
            _write_image(target, encoded)
        else:
            self._disk.put((target, bytes(encoded)))

    def digests(self) -> dict[Path, str]:
        return dict(self._digests)

    def block_writer(self):
        """write itself: it keeps no state between images, so Dask workers can run it."""
        return self.write

    def finish(self) -> None:
        """Waits for the images, then checks that every file of the output is there: one
        removed during the run (a cleanup script, say) fails it rather than go missing
        from a complete-looking output."""
        if self._disk is not None:
            self._disk.close()
        for rel in self._expected:
            if not (self.root / rel).is_file():
                raise removed_during_run(self.root / rel)

    def close(self) -> list[Path]:
        """Waits for the images (each flushed to disk as it is written), then flushes every
        other file: those copied, and images written by another process."""
        if self._disk is not None:
            self._disk.close()
        return flushed_files(self.root, self._digests)


def _tiff(pixels: np.ndarray, colour: bool, alpha: bool, icc: bytes | None) -> memoryview:
    """A TIFF of (H, W[, channels]) pixels, or of a multi-page TIFF's (pages, H, W[, 3]): one
    page each."""
    tiff = io.BytesIO()
    tifffile.imwrite(tiff, pixels, photometric="rgb" if colour else "minisblack",
                     extrasamples=("unassalpha",) if alpha else None, iccprofile=icc)
    return tiff.getbuffer()


def _write_image(target: Path, encoded: bytes | memoryview) -> None:
    with writing(target):
        write_new_file(target, encoded)


def create_writer(reader: ImageFolderReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> ImageFolderWriter:
    return ImageFolderWriter(reader, tmp_path, dtype, options)


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least the output needs on disk: PNG images 8 bits a value (noise does not
    compress), TIFF images the engine's dtype."""
    itemsize = 1 if options.image_format == "png" else np.dtype(dtype).itemsize
    return sum(job.records * job.elements for job in jobs) * itemsize


def is_earlier_output(path: Path, reader: ImageFolderReader) -> bool:
    """A folder whose manifest names it is an earlier output if it holds images and the
    files --copy-other copies from this input, nothing else; one holding other files is
    refused naming them (a .DS_Store Finder left there, notes added to the release)."""
    copied = set(reader.others)
    strays = sorted(rel for directory, _, files in os.walk(path) for name in files
                    if Path(name).suffix.lower() not in IMAGE_SUFFIXES
                    and (rel := (Path(directory) / name).relative_to(path).as_posix()) not in copied)
    if strays:
        raise not_earlier_output(path, listing(strays))
    return True


FORMAT = Format(
    name=NAME, title="folder of images", folder=True, records_are_files=True, record_noun="an image",
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    name_map_destination=name_maps.destination, write_name_map=name_maps.write,
    output_bytes=output_bytes, earlier_output=is_earlier_output, honours_keep=True,
    docs=(DocRow("folder of images (PNG, JPEG, BMP, TIFF, WebP)",
                 "any other directory (subfolders named `0` ... `9` included)",
                 "`tldp perturb sample_data/digits_png --eps 1`",
                 "`digits_png.tldp/` mirroring the relative paths, lossless PNG (a multi-page TIFF: "
                 "multi-page TIFF); palette images (label maps) left out ([below](#image-folders))"),),
)
