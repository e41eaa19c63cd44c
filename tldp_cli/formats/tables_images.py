"""The values of a table's image columns (formats/tables.py): a row's image decoded
(formats/pixels.py), or only its header read, and a perturbed image encoded in its input's
format (JPEG at JPEG_QUALITY, any other as PNG).
"""

from __future__ import annotations

import io
import pyarrow as pa
from PIL import Image

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.formats import decode_reason
from tldp_cli.formats.pixels import LabelMap, Unsupported, decode, header, png
from tldp_cli.formats.tables import image_struct

JPEG_QUALITY = 95


def image_bytes(struct: pa.Array | pa.ChunkedArray) -> pa.Array:
    return image_struct(struct).field("bytes")


def image_values(data: bytes, where: str):
    """An image's decoded pixels (pixels.Decoded) and its Pillow format; InputError names
    the row for what cannot be perturbed."""
    try:
        file = io.BytesIO(data)
        with Image.open(file) as im:
            return decode(file, im), im.format, im.info.get("icc_profile")
    except (Unsupported, LabelMap) as exc:
        raise InputError(f"{where}: {exc if isinstance(exc, Unsupported) else 'a palette image'}") from None
    except MemoryError:
        raise
    except Exception as exc:
        raise InputError(f"{where}: cannot be decoded as an image ({decode_reason(exc)})") from None


def image_header(data: bytes | None, where: str):
    """The header of a row's image (pixels.Header) and its format, without decoding it; None
    for a palette image (a label map: class indices, not pixel values)."""
    if data is None:
        raise InputError(f"{where}: holds no image bytes (an image stored by its path only, or a null); "
                         "tldp perturbs images held in the table: embed them first (datasets "
                         "embeds them in to_parquet and push_to_hub)")
    try:
        file = io.BytesIO(data)
        with Image.open(file) as im:
            found = header(file, im)
            if found.pages > 1:
                raise Unsupported(f"a multi-page TIFF ({found.pages} pages); tldp perturbs one image a row")
            return found, im.format
    except LabelMap:
        return None, "palette"
    except Unsupported as exc:
        raise InputError(f"{where}: {exc}") from None
    except Exception as exc:
        raise InputError(f"{where}: cannot be decoded as an image ({decode_reason(exc)})") from None


def encode_image(values: np.ndarray, source: bytes, keep_icc: bool, keep_alpha: bool = False) -> bytes:
    """A perturbed image (colour channels) in `source`'s format: its alpha channel put back
    where `keep_alpha` (--keep COLUMN.alpha; else written without it), and its ICC profile
    where `keep_icc` (--keep COLUMN.icc_profile), rounded and clipped to its bit depth; JPEG
    as JPEG, else PNG."""
    file = io.BytesIO(source)
    with Image.open(file) as im:  # the header only, unless the alpha channel is wanted
        found, kind = header(file, im), im.format
        icc = im.info.get("icc_profile") if keep_icc else None
        alpha = decode(file, im).alpha if found.has_alpha and keep_alpha else None
    dtype = found.dtype
    info = np.iinfo(dtype)
    rounded = values if values.dtype.kind in "iu" else np.rint(values)
    out = np.clip(rounded, info.min, info.max).astype(dtype)
    if alpha is not None:
        out = np.dstack([out, alpha])
    if kind == "JPEG" and alpha is None and dtype == np.uint8:
        buffer = io.BytesIO()
        Image.fromarray(out).save(buffer, "JPEG", quality=JPEG_QUALITY, icc_profile=icc)
        return buffer.getvalue()
    return png(out, icc)
