"""Decoding and encoding images, shared by the formats that hold them: image folders
(formats/images.py), the image members of WebDataset shards (formats/webdataset.py) and the
image columns of Parquet and Arrow tables (formats/tables_images.py).

`header` learns what an opened image (Pillow) decodes to from its header alone, `decode`
gives its colour channels and alpha apart (EXIF orientation applied, bilevel images
converted, a multi-page TIFF's pages stacked), and `png` encodes perturbed pixels as PNG,
fast for noise. Images tldp cannot perturb faithfully raise Unsupported; palette images
(label maps) raise its subclass LabelMap.
"""

from __future__ import annotations

import io
import os
import posixpath
import shlex
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, TiffImagePlugin
from zlib_ng import zlib_ng

SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
SUPPORTED_MODES = ("L", "LA", "RGB", "RGBA", *SIXTEEN_BIT_MODES)
PNG_ENCODING = ("(noisy images: no row filter, Huffman-only deflate, since noise does not "
                "compress; smooth ones: Sub filter, deflate level 6)")  # see deflated_rows
SMOOTH_STEP = 12  # mean |difference| of neighbouring 8-bit samples below which filters pay


def dtype_not_applied(dtype: str, images: str) -> str:
    """The note that an explicit --dtype is not what PNG output holds (image folders, WebDataset
    shards of images): `images` (what is written as PNG) keep their own bit depth."""
    return (f"--dtype {dtype} does not apply to PNG output: {images} are written at their own bit depth "
            "(uint8, uint16), rounded and clipped to the range")


class Unsupported(Exception):
    """An image Pillow can decode but tldp cannot perturb faithfully."""


class UnsupportedMode(Unsupported):
    """An image of a mode tldp does not perturb (CMYK, YCbCr, LAB; 32-bit integer or float
    samples: I, F): the message says how to convert it."""

    def __init__(self, mode: str):
        self.mode = mode
        super().__init__(self.for_file("image.jpg" if not mode.startswith(("F", "I")) else "image.tif"))

    def for_file(self, name: str) -> str:
        """The message, its conversion hint naming the file `name` (its base name)."""
        return (f"colour mode {self.mode} is not supported (supported: L, LA, RGB, RGBA, 16-bit grayscale; "
                f"palette images are label maps, not perturbed): {conversion_hint(self.mode, name)}")


def conversion_hint(mode: str, name: str) -> str:
    """How to turn the image `name` (a file name), of a mode tldp does not perturb, into one it
    perturbs: a Pillow or ImageMagick command."""
    stem, shell = posixpath.splitext(name)[0], shlex.quote
    if mode.startswith(("F", "I")):  # a float or 32-bit TIFF: measurements, not 8/16-bit pixels
        kind = "floating-point" if mode.startswith("F") else "32-bit integer"
        return (f"its samples are {kind}; perturb its values as an array (numpy.save({stem + '.npy'!r}, "
                f"tifffile.imread({name!r})), then tldp perturb {shell(stem + '.npy')} --range LO:HI) or convert "
                f"it to 16-bit grayscale first (ImageMagick: magick {shell(name)} -depth 16 {shell(stem + '.png')})")
    return (f"convert it to RGB first (Pillow: Image.open({name!r}).convert('RGB').save({stem + '.png'!r}); "
            f"ImageMagick: magick {shell(name)} -colorspace sRGB {shell(stem + '.png')})")


class LabelMap(Unsupported):
    """A palette image (mode P or PA): class indices, as segmentation datasets store their
    masks, not pixel values. It is not perturbed: an image folder leaves it out and lists
    it, or copies it raw where --keep names it (leftovers.py)."""

    def __init__(self, mode: str):
        super().__init__(f"a palette ({mode}) image: class indices (a label map), not pixel values "
                         "to perturb; convert it to RGB first if it is a picture")
        self.mode = mode


@dataclass
class Header:
    """What an image will decode to, learnt from its header without decoding it."""
    shape: tuple[int, ...]  # of the colour channels: (H, W) or (H, W, 3)
    dtype: np.dtype
    has_alpha: bool
    notes: list[str]  # conversions applied, e.g. "palette (P) -> RGB"
    orientation: int  # EXIF orientation, 1 = as stored
    convert_to: str | None  # the mode it is converted to after decoding, if any
    has_icc: bool  # carries an ICC colour profile (kept in the output)
    pages: int = 1  # a multi-page TIFF's pages, one record: shape is then (pages, H, W[, 3])


@dataclass
class Decoded:
    colour: np.ndarray  # (H, W) or (H, W, 3); a multi-page TIFF's: (pages, H, W[, 3])
    alpha: np.ndarray | None  # (H, W) or None
    notes: list[str]


# EXIF orientation -> the transposition that shows the pixels the way viewers do
TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
              6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}


def _png_ihdr(file) -> bytes:
    """A PNG's bit depth and colour type: signature, IHDR length and type, width, height, then
    these two bytes (read without moving Pillow's position in the file)."""
    if isinstance(file, io.BytesIO):
        return bytes(file.getbuffer()[24:26])
    return os.pread(file.fileno(), 26, 0)[24:26]


# PNG colour types as people name them: Pillow reads 16-bit grayscale with alpha as RGBA
PNG_COLOURS = {0: "grayscale", 2: "RGB", 3: "palette", 4: "grayscale with alpha", 6: "RGBA"}
MODE_COLOURS = {"LA": "grayscale with alpha", "L": "grayscale"}


def stored_colour(file, im: Image.Image, mode: str) -> str:
    """The image's colours as stored ("grayscale with alpha", "RGB"), which Pillow's mode
    does not always say (a 16-bit grayscale-with-alpha PNG opens as RGBA)."""
    if im.format == "PNG":
        return PNG_COLOURS.get(_png_ihdr(file)[1], mode)
    return MODE_COLOURS.get(mode, mode)


def source_bit_depth(file, im: Image.Image) -> int:
    """Bits per sample as stored; Pillow reads 16-bit colour PNG and TIFF as 8-bit."""
    if im.format == "PNG":
        return _png_ihdr(file)[0]
    if im.format == "TIFF" and isinstance(im, TiffImagePlugin.TiffImageFile):
        bits = im.tag_v2.get(258, (8,))
        return max(bits) if isinstance(bits, tuple) else int(bits)
    return 8


def exif_orientation(im: Image.Image) -> int:
    # Pillow's PNG getexif decodes the whole image to look for an eXIf chunk after the
    # pixel data; only the header's (before IDAT, where writers put it) is read here.
    if im.format == "PNG" and "exif" not in im.info:
        return 1
    return im.getexif().get(ExifTags.Base.Orientation, 1)


def header(file, im: Image.Image) -> Header:
    """The shape, dtype and conversions of an opened, not yet decoded image. A multi-page
    TIFF (a z-stack, a time series: one subject's) is one record of all its pages, which
    must be alike."""
    frames = getattr(im, "n_frames", 1)
    if frames > 1 and im.format != "TIFF":
        raise Unsupported(f"has {frames} frames; tldp perturbs single-frame images (and multi-page TIFF)")
    first = page_header(file, im)
    return stack_header(file, im, first, frames) if frames > 1 else first


def stack_header(file, im: Image.Image, first: Header, frames: int) -> Header:
    """A multi-page TIFF's header: its first page's, for every page (each one checked)."""
    if first.has_alpha:
        raise Unsupported(f"a multi-page TIFF ({frames} pages) with an alpha channel; tldp perturbs "
                          "multi-page TIFF of L, RGB or 16-bit grayscale pages")
    for page in range(1, frames):
        im.seek(page)
        try:
            header = page_header(file, im)
        except LabelMap:
            header = None
        if header is None or (header.shape, header.dtype, header.convert_to, header.orientation) != (
                first.shape, first.dtype, first.convert_to, first.orientation):
            found = "a palette page" if header is None else f"{header.shape} {header.dtype}"
            raise Unsupported(f"a multi-page TIFF whose pages differ (page {page}: {found}; page 0: "
                              f"{first.shape} {first.dtype}); tldp perturbs a multi-page TIFF as one "
                              "record of pages of one shape and mode")
    im.seek(0)
    return Header((frames, *first.shape), first.dtype, False, first.notes, first.orientation,
                  first.convert_to, first.has_icc, frames)


def page_header(file, im: Image.Image) -> Header:
    """header() of the current page (frame)."""
    notes, convert_to = [], None
    orientation = exif_orientation(im)
    if orientation in TRANSPOSE:  # output carries no EXIF: store the pixels as viewers show them
        notes.append(f"EXIF orientation {orientation} applied")
    if im.mode == "1":
        convert_to = "L"
        notes.append("bilevel (1) -> L")
    elif im.mode in ("P", "PA"):
        raise LabelMap(im.mode)
    mode = convert_to or im.mode
    if mode not in SUPPORTED_MODES:
        raise UnsupportedMode(mode)
    depth = source_bit_depth(file, im)
    if depth > 8 and mode not in SIXTEEN_BIT_MODES:
        colours = stored_colour(file, im, mode)
        if colours == "grayscale with alpha":
            raise Unsupported(f"has {depth}-bit grayscale with alpha samples, which Pillow reads as 8-bit RGBA; "
                              "only grayscale without alpha may be 16-bit: take the alpha channel off first "
                              "(ImageMagick: magick IN.png -alpha off OUT.png) or convert it to 8-bit")
        raise Unsupported(f"has {depth}-bit {colours} samples, which Pillow reads as 8-bit; "
                          "only grayscale may be 16-bit")
    width, height = im.size
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    shape = (height, width, 3) if mode in ("RGB", "RGBA") else (height, width)
    dtype = np.dtype(np.uint16 if mode in SIXTEEN_BIT_MODES else np.uint8)
    return Header(shape, dtype, mode in ("LA", "RGBA"), notes, orientation, convert_to,
                  bool(im.info.get("icc_profile")))


def decode(file, im: Image.Image) -> Decoded:
    """The pixels of an opened image (`file` its source, as header takes it): colour and
    alpha apart, EXIF orientation and conversions applied; a multi-page TIFF's pages
    stacked."""
    found = header(file, im)
    decoded = [page_pixels(im, found, page) for page in range(found.pages)]
    mode = decoded[0][0]
    values = decoded[0][1] if found.pages == 1 else np.stack([page for _, page in decoded])
    if mode in SIXTEEN_BIT_MODES:
        return Decoded(values.astype(np.uint16), None, found.notes)  # native byte order
    if mode in ("LA", "RGBA"):
        colour = values[..., 0] if mode == "LA" else values[..., :3]
        return Decoded(np.ascontiguousarray(colour), np.ascontiguousarray(values[..., -1]), found.notes)
    return Decoded(values, None, found.notes)


def page_pixels(im: Image.Image, header: Header, page: int) -> tuple[str, np.ndarray]:
    """The mode and pixels of one page (of a multi-page TIFF; page 0 of any image), oriented
    and converted as its header says."""
    if header.pages > 1:
        im.seek(page)
    im.load()
    shown = im.transpose(TRANSPOSE[header.orientation]) if header.orientation in TRANSPOSE else im
    if header.convert_to:
        shown = shown.convert(header.convert_to)
    return shown.mode, np.asarray(shown)


PNG_COLOUR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> grayscale, gray+alpha, RGB, RGBA


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def is_smooth(pixels: np.ndarray) -> bool:
    """Whether neighbouring samples differ little (a large epsilon leaves most of an image
    as it was), judged on every 8th row and scaled to 8 bits."""
    if pixels.shape[1] < 2:
        return False
    step = np.abs(np.diff(pixels[::8].astype(np.int32), axis=1)).mean()
    return step / 256 ** (pixels.dtype.itemsize - 1) < SMOOTH_STEP


def deflated_rows(pixels: np.ndarray) -> bytes:
    """The PNG image data. Noise leaves filters and LZ77 nothing to find: no row filter and
    Huffman-only deflate take 1 ms on a noisy 224x224 RGB image where Pillow's default
    (adaptive filters, level 6) takes 10, and come out no larger. A smooth image gets the
    Sub filter and level 6, close to Pillow's size (a clean photo: 8 kB against 6, where
    Huffman-only would take 125); zlib-ng deflates twice as fast as zlib."""
    height = pixels.shape[0]
    samples = pixels.astype(">u2" if pixels.dtype.itemsize == 2 else np.uint8, copy=False)
    raw = samples.reshape(height, -1).view(np.uint8)
    rows = np.empty((height, 1 + raw.shape[1]), np.uint8)
    if not is_smooth(pixels):
        rows[:, 0], rows[:, 1:] = 0, raw
        deflate = zlib_ng.compressobj(1, zlib_ng.DEFLATED, 15, 9, zlib_ng.Z_HUFFMAN_ONLY)
        return deflate.compress(rows) + deflate.flush()
    pixel_bytes = raw.shape[1] // pixels.shape[1]  # Sub: each byte less the one a pixel before
    rows[:, 0], rows[:, 1:1 + pixel_bytes] = 1, raw[:, :pixel_bytes]
    np.subtract(raw[:, pixel_bytes:], raw[:, :-pixel_bytes], out=rows[:, 1 + pixel_bytes:])
    return zlib_ng.compress(rows, 6)


def png(pixels: np.ndarray, icc: bytes | None) -> bytes:
    """A PNG of 8- or 16-bit (H, W) or (H, W, channels) pixels, encoded for noise."""
    height, width = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    header = struct.pack(">IIBBBBB", width, height, pixels.dtype.itemsize * 8,
                         PNG_COLOUR_TYPES[channels], 0, 0, 0)
    profile = [png_chunk(b"iCCP", b"ICC Profile\0\0" + zlib.compress(icc))] if icc else []
    return b"".join([b"\x89PNG\r\n\x1a\n", png_chunk(b"IHDR", header), *profile,
                     png_chunk(b"IDAT", deflated_rows(pixels)), png_chunk(b"IEND", b"")])
