"""The writer of folders of images (formats/images.py): the output folder mirrors the
input's (or, with --anonymize-names, is flat: images_reader.py names each image), each
image encoded by the workers, lossless PNG rounded and clipped to the image's bit depth
(pixels.png) or TIFF of the values as perturbed (a multi-page TIFF stays one), and
written by a thread of its own; the files --copy-other copies and the label maps --keep
names are copied raw, the index files written as the reader rewrote them. read_output
reads an image it wrote back (evaluate).
"""

from __future__ import annotations

import hashlib
import io
import math
from pathlib import Path

import numpy as np
import tifffile
from PIL import Image

from tldp_cli.errors import InputError, reason_of
from tldp_cli.files.output import removed_during_run
from tldp_cli.formats import ArrayJob, FormatOptions, Writer
from tldp_cli.formats.images_reader import ImageFolderReader, decoded, opened
from tldp_cli.formats.pixels import PNG_ENCODING, png
from tldp_cli.files.checked_io import (Background, copy_bytes, flushed_files, path_in_output, write_new_file,
                                      writing)

QUEUED_BYTES = 64 << 20  # encoded images waiting for the writer thread, at most (about)


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
            src = opened(source)
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
        alpha = decoded(image.path).alpha if image.has_alpha and self.keep_alpha else None
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


def _icc_profile(path: Path) -> bytes | None:
    with opened(path) as file, Image.open(file) as im:  # header only, no decoding
        return im.info.get("icc_profile")


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
    return decoded(path).colour
