"""Zarr directory stores, Zarr format 2 and 3: a single array or a group tree.

The output starts as a file-for-file copy of the input without the perturbed
arrays' chunks and what is left out (below). Their metadata is rewritten for the float output dtype (same
chunks, shards, codecs, fill value, attributes, dimension names) and the noisy
records are written as chunk files (zarr_chunks.py) or, for sharded and other
layouts, through zarr-python. Consolidated metadata is rebuilt at the end.

Nothing outside the store is read or copied. A symbolic link anywhere inside it
(to a file or a directory, dangling or not), or any other entry that is neither a
regular file nor a directory, is refused before anything is written; only the
store's own path may be a link. Every directory below a group must be a node (hold
zarr.json, or .zarray/.zgroup): one without is refused as a damaged store, since it
may be an array that lost its metadata. Node names starting with "." are nodes like
any other.

What is not perturbed (arrays, free-text attributes, files that are neither
metadata nor chunks of an array, such as .DS_Store or a README) is left out unless
it is structural metadata, a numeric coordinate or named by --keep, and listed in
the manifest (formats.leftovers).

This module is the format's declaration (detection, the default output, FORMAT); the
format's own modules beside it, each over the next:
- zarr_writer.py: the output store (ZarrWriter, and --store coefficients'
  ZarrCoefficientWriter) and the blocks written from any process (_Blocks);
- zarr_reader.py: the reader (ZarrReader): which arrays are perturbed, kept or left out;
  zarr_metadata.py: the perturbed arrays' metadata in the output (codecs, fill value);
- zarr_ome.py: OME-Zarr (NGFF) multiscale images: the pyramids, their regenerated lower
  levels, the metadata's free-text names; zarr_cf.py: the CF conventions as xarray
  writes them into Zarr (dimension names, missing values, packing, coordinates);
- zarr_tree.py: the store's nodes and files, opening its arrays and reading records;
- zarr_chunks.py: plain chunk files, read and written with numcodecs; zarr_names.py: the
  names of the metadata files, which detection checks without importing zarr-python.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tldp_cli.formats import ArrayJob, DocRow, Format, FormatOptions, tldp_name
from tldp_cli.formats.zarr_names import METADATA_FILES

if TYPE_CHECKING:  # imported where used: detecting another format imports no zarr
    from tldp_cli.formats import zarr_reader, zarr_writer

NAME = "zarr"


def can_open(path: Path) -> bool:
    """A folder with Zarr metadata at its root (even a corrupt one). Chunk-like names alone
    decide nothing: folders named 0..9 are the usual layout of a folder of images by class,
    and a store that lost its root metadata cannot be read as Zarr anyway (perturb
    --format zarr says what is missing)."""
    return path.is_dir() and any((path / name).is_file() for name in METADATA_FILES)


def default_output(path: Path) -> Path:
    if path.name in ("", ".."):
        path = path.resolve()
    return tldp_name(path, ".zarr", FORMAT.compound_suffixes)


def open_reader(path: Path, options: FormatOptions) -> zarr_reader.ZarrReader:
    from tldp_cli.formats import zarr_reader

    return zarr_reader.ZarrReader(path, options, NAME)


def create_writer(reader: zarr_reader.ZarrReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> zarr_writer.ZarrWriter:
    from tldp_cli.formats import zarr_writer

    return zarr_writer.ZarrWriter(reader, tmp_path, dtype, bounds=options.value_bounds)


def reopen_writer(reader: zarr_reader.ZarrReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> zarr_writer.ZarrWriter:
    """The writer of an output an interrupted run began: its blocks are kept (--resume)."""
    from tldp_cli.formats import zarr_writer

    return zarr_writer.ZarrWriter(reader, tmp_path, dtype, reopen=True, bounds=options.value_bounds)


def create_coefficient_writer(reader: zarr_reader.ZarrReader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype,
                              options: FormatOptions) -> zarr_writer.ZarrCoefficientWriter:
    from tldp_cli.formats import zarr_writer

    return zarr_writer.ZarrCoefficientWriter(reader, jobs, tmp_path, dtype)


def is_earlier_output(path: Path, reader: zarr_reader.ZarrReader) -> bool:
    """A folder whose manifest names it is an earlier output if it is a Zarr store."""
    return any((path / name).is_file() for name in METADATA_FILES)


FORMAT = Format(
    name=NAME, title="Zarr store", suffixes=(".zarr",), compound_suffixes=(".ome.zarr",), folder=True,
    selects_arrays=True, honours_keep=True, cf_markers=True, shares_rows=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    reopen_writer=reopen_writer, earlier_output=is_earlier_output, create_coefficient_writer=create_coefficient_writer,
    docs=(DocRow("Zarr store (format 2 or 3)",
                 "`zarr.json`, `.zarray`, `.zgroup`, `.zattrs` or `.zmetadata` at its root",
                 "`tldp perturb sample_data/digits.zarr --eps 1`",
                 "`digits.tldp.zarr`: same format version, groups, structural attributes, chunks, shards, codecs"),
          DocRow("OME-Zarr image (NGFF 0.4, 0.5)", "a Zarr group with `multiscales`",
                 "`tldp perturb cells.ome.zarr --eps 1`",
                 "`cells.tldp.ome.zarr`: the full resolution perturbed, lower levels regenerated from it "
                 "([below](#ome-zarr-multiscale-images))")),
)
