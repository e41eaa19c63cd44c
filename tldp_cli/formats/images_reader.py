"""The reader of folders of images (formats/images.py): which files are images, read
header first and decoded when perturbed (an image is one record; a multi-page TIFF one
record of all its pages), which are palette images (label maps) left out or kept, what
--copy-other copies and what it never copies (data: pickles, medical images, images in
formats tldp does not read, a Zarr store inside the folder), the hidden files and the
symbolic links skipped, the index files rewritten (images_index.py), the output's names
(output_name; --anonymize-names: numbers in a random order, and the name map), and what
the manifest and the command say of all this.
"""

from __future__ import annotations

import datetime as _dt
import functools
import posixpath
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from tldp_cli import __version__
from tldp_cli.errors import InputError, NotHeld, UsageError, reason_of
from tldp_cli.formats import (DATASET_FORMATS, HIDDEN_REASON, SKIP_BAD_HINT, ArrayJob, FormatOptions, Reader,
                              data_file, decode_reason, dicom_refused, folder_files, images_index, is_dicom,
                              leftovers, listing, name_maps, plural)
from tldp_cli.formats.tensor_files import matching
from tldp_cli.formats.pixels import (Decoded, Header, LabelMap, Unsupported, UnsupportedMode, decode,
                                     dtype_not_applied, header)
from tldp_cli.files.checked_io import json_value, open_regular

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
HINTED = 100  # files of a folder without images looked at for inputs of their own (_inputs_hint)
ZARR_MARKERS = ("zarr.json", ".zarray", ".zgroup")
# Where a Zarr array keeps its chunks ("0.0", "0/0", "c/0/0"): a folder holding only such
# files and no image is most likely a store that lost its metadata.
_ZARR_CHUNK_PATH = re.compile(r"^(c/)?\d+([./]\d+)*$")
OUTPUT_SUFFIXES = {"png": (".png",), "tiff": (".tiff", ".tif")}  # the first is the one given
NAME_MAP_SCHEMA = name_maps.SCHEMA
WITHHELD = "withheld (--anonymize-names)"
LABEL_MAP_REASON = ("a palette image: class indices (a segmentation's label map), not pixel values to perturb; "
                    "not written (--keep NAME copies it raw)")
ANONYMOUS_DIGITS = 6  # 000000.png: at least this many digits


def opened(path: Path):
    """The image file, opened only if it is a regular file and not a symbolic link (one
    put in place of an image after the folder was listed, or a FIFO, which would hang)."""
    return open_regular(path, follow_links=False)


def _probe(path: Path) -> Header:
    """The image's header only: its pixels are decoded once, when they are perturbed."""
    with opened(path) as file, Image.open(file) as im:
        return header(file, im)


def _decoded_header(path: Path) -> Header:
    """The header of an image that decodes in full (--skip-bad: bad ones are found up front)."""
    decoded(path)
    return _probe(path)


def decoded(path: Path) -> Decoded:
    """The image's pixels, decoded (pixels.decode)."""
    with opened(path) as file, Image.open(file) as im:
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


def unread_image_magic(head: bytes) -> str | None:
    """The format of an image tldp does not read that its first bytes name by a signature
    (HEIF/AVIF, JPEG XL, GIF), or None (Pillow may still know it: _unread_kind)."""
    if head[4:8] == b"ftyp" and head[8:12] in _BMFF_IMAGE_BRANDS:
        return "HEIF/AVIF"
    if head.startswith(_JPEG_XL):
        return "JPEG XL"
    return "GIF" if head[:6] in (b"GIF87a", b"GIF89a") else None


def _unread_kind(path: Path) -> str | None:
    """The format of an image in a format tldp does not read (_unread_image), or None."""
    try:
        with opened(path) as file:
            head = file.read(16)
            kind = unread_image_magic(head)
            if kind is None:
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
        colour = decoded(image.path).colour
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
    def __init__(self, path: Path, options: FormatOptions, name: str):
        self.path = path
        self.format = name  # the format's name (formats/images.py's NAME), in each image's source
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
        self.index_files = [rel for rel in self.others if posixpath.basename(rel) in images_index.INDEX_FILES
                            and (renamed or self.unwritten) and options.copy_other]
        self.stale_indexes = [rel for rel in self.others if posixpath.basename(rel) == images_index.PARQUET_INDEX
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
            index = posixpath.basename(rel) in (images_index.PARQUET_INDEX, *images_index.INDEX_FILES)
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
                with opened(source) as f:
                    text = f.read().decode("utf-8-sig")  # a BOM would stop json.loads
            except OSError as exc:
                raise InputError(f"{source}: cannot read ({reason_of(exc)})") from None
            except UnicodeDecodeError:
                raise images_index.unreadable(source, "not UTF-8 text") from None
            texts[rel], rows = images_index.rewritten(rel, text, self.out_names, self.unwritten, source)
            dropped += rows
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
                         source={"path": str(image.path), "format": self.format,
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
        return [{"path": WITHHELD, "image": image.out_rel, "format": self.format, "shape": list(image.shape),
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
