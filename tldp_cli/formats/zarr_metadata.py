"""A perturbed Zarr array's metadata in the output (formats/zarr_store.py): the input's
chunks, shards and codecs for the output dtype, lossy codecs (LOSSY_CODECS) left off,
compression levels lowered to FAST_LEVEL for the noise, and the fill value in JSON.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.formats import cf
from tldp_cli.formats import zarr_tree

def _json_fill(value: np.generic) -> int | float | str:
    """A fill value as Zarr writes it: an integer type's as a JSON integer (the Zarr 3
    spec allows no fraction there), a float's as a number, NaN and the infinities as
    strings."""
    if value.dtype.kind in "iub":
        return value.item()
    if np.isnan(value):
        return "NaN"
    if np.isinf(value):
        return "Infinity" if float(value) > 0 else "-Infinity"
    return float(value)


# Codecs that store other values than those written (quantize, round bits, scale to a
# fixed precision, change the stored type, lossy compression), by their numcodecs id,
# without a "numcodecs." or "imagecodecs_" prefix. Dropped from perturbed arrays, so
# the noisy values are stored exactly; the rest (compressors, shuffle, delta,
# checksums) are kept. ZFP and the image codecs are lossless only at some settings.
LOSSY_CODECS = ("quantize", "bitround", "fixedscaleoffset", "astype", "zfpy", "zfp", "sz3", "sperr",
                "lerc", "jpeg", "jpeg8", "jpeg2k", "jpegls", "jpegxl", "jpegxr", "webp", "avif", "heif")
# Of those, the ones that turn the array into bytes (Zarr 3): replaced by "bytes".
_LOSSY_SERIALIZERS = ("zfpy", "zfp", "sz3", "sperr", "lerc", "jpeg", "jpeg8", "jpeg2k", "jpegls",
                      "jpegxl", "jpegxr", "webp", "avif", "heif")


def _codec_id(codec: dict[str, Any]) -> str:
    name = str(codec.get("name") or codec.get("id") or "")
    for prefix in ("numcodecs.", "imagecodecs_"):
        name = name.removeprefix(prefix)
    return name.lower()


def _check_codec(codec: dict[str, Any], config: dict[str, Any], dtype: np.dtype, where: str) -> None:
    """Filters bound to a dtype (delta, ...) cannot be carried over to another output
    dtype; refuse rather than drop them or change what they mean."""
    for key in ("dtype", "astype"):
        if key not in config:
            continue
        try:
            same = np.dtype(config[key]) == dtype
        except TypeError:
            same = False
        if not same:
            name = codec.get("name") or codec.get("id")
            raise InputError(f"{where} uses the {name} filter for {config[key]} data, which "
                             f"cannot apply to the {dtype} output; re-encode the array without it")


def _retype(codec: dict[str, Any], config: dict[str, Any], dtype: np.dtype, where: str) -> None:
    """Sets a delta filter (in `config`, in place) to the output dtype: the differences of
    the output's values, integers (which wrap and sum back) or values on the noise's grid
    (differences of multiples of a power of two), are stored exactly, as the input's were.
    A delta that narrows its differences (astype) and other codecs bound to a dtype are
    checked as they are (_check_codec)."""
    if _codec_id(codec) == "delta" and "dtype" in config:
        try:
            plain = np.dtype(config.get("astype", config["dtype"])) == np.dtype(config["dtype"])
        except TypeError:
            plain = False
        if plain and dtype.kind in "iuf":
            config["dtype"] = dtype.str
            if "astype" in config:
                config["astype"] = dtype.str
    _check_codec(codec, config, dtype, where)


# Compressors whose level only trades CPU for size, by numcodecs id, and the key of the
# level in their configuration. Noise compresses no better at a high level than at 1
# (int16 noise of scale 256: 0.774 of its size with zstd at levels 1 and 3 alike; float
# noise hardly at all), so perturbed arrays are written at level 1 at most.
_LEVELS = {"zstd": "level", "blosc": "clevel", "gzip": "level", "zlib": "level"}
FAST_LEVEL = 1
_ZSTD_DEFAULT = 3  # zstd's level 0 means its default level


def _fast_level(codec: dict[str, Any], config: dict[str, Any], levels: list[dict[str, Any]]) -> None:
    """Lowers a compressor's level in `config` (in place) to FAST_LEVEL, noted in `levels`;
    levels at or below it (and zstd's fast negative levels) stay."""
    key = _LEVELS.get(_codec_id(codec))
    if key is None:
        return
    level = config.get(key)
    if not isinstance(level, int) or isinstance(level, bool):
        return
    effective = _ZSTD_DEFAULT if _codec_id(codec) == "zstd" and level == 0 else level
    if effective > FAST_LEVEL:
        config[key] = FAST_LEVEL
        levels.append({"codec": _codec_id(codec), "input_level": level, "output_level": FAST_LEVEL})


def _output_codecs(codecs: list, dtype: np.dtype, where: str, dropped: list[str],
                   levels: list[dict[str, Any]]) -> list:
    """Zarr 3 codecs for the output: lossy ones dropped (named in `dropped`), compression
    levels lowered (noted in `levels`), the rest checked against the output dtype."""
    result = []
    for entry in codecs:
        codec: dict[str, Any] = {"name": entry} if isinstance(entry, str) else copy.deepcopy(entry)
        config = codec.get("configuration") or {}
        if _codec_id(codec) in LOSSY_CODECS:
            dropped.append(codec["name"])  # Zarr 3 codecs have one (zarr-python opened the array)
            if _codec_id(codec) in _LOSSY_SERIALIZERS:
                result.append({"name": "bytes", "configuration": {"endian": "little"}})
            continue
        _retype(codec, config, dtype, where)
        if codec.get("name") == "bytes" and "endian" not in config:
            codec["configuration"] = {**config, "endian": "little"}  # required for multi-byte types
        if codec.get("name") == "blosc" and "typesize" in config:
            config["typesize"] = dtype.itemsize  # the shuffle's element size, as zarr-python sets it
        if codec.get("name") == "sharding_indexed":
            config["codecs"] = _output_codecs(config.get("codecs", []), dtype, where, dropped, levels)
        _fast_level(codec, config, levels)
        result.append(codec)
    return result


def output_metadata(node: zarr_tree.Node, fill_value: Any, zarr_format: zarr_tree.ZarrFormat, dtype: np.dtype,
                    where: str) -> tuple[dict[str, Any], list[str], list[dict[str, Any]]]:
    """A perturbed array's metadata for the output dtype, the lossy codecs dropped and the
    compression levels lowered."""
    meta = copy.deepcopy(node.meta)
    dropped: list[str] = []
    levels: list[dict[str, Any]] = []
    # The fill value in the output dtype as the missing-data markers are (cf.output_marker):
    # where the dtype cannot hold it, the least value (or NaN), never a wrapped one
    # (uint32 4294967295 as int16 would be -1, which noisy values take).
    fill = None if fill_value is None else _json_fill(cf.output_marker(fill_value, dtype))
    if zarr_format == 3:
        meta["data_type"] = dtype.name
        meta["fill_value"] = fill
        meta["codecs"] = _output_codecs(meta.get("codecs", []), dtype, where, dropped, levels)
    else:
        meta["dtype"] = dtype.str
        meta["fill_value"] = fill
        filters = []
        for codec in meta.get("filters") or []:
            if _codec_id(codec) in LOSSY_CODECS:
                dropped.append(codec.get("id"))
            else:
                _retype(codec, codec, dtype, where)
                filters.append(codec)
        meta["filters"] = filters or None
        compressor = meta.get("compressor")
        if compressor and _codec_id(compressor) in LOSSY_CODECS:
            dropped.append(compressor.get("id"))
            meta["compressor"] = None
        elif compressor:
            _check_codec(compressor, compressor, dtype, where)
            _fast_level(compressor, compressor, levels)
    return meta, dropped, levels
