"""HDF5 files: the chosen numeric datasets are perturbed; the group tree, links and the
user block are copied unchanged, and of the attributes and other datasets what
formats.leftovers keeps (structural metadata, numeric coordinates, what --keep or
--exclude names); the rest is left out and listed in the manifest. A
perturbed dataset keeps its chunks and lossless filters; filters that may be lossy
(hdf5_writer.LOSSY_FILTERS) are left off and listed in the manifest (dropped_filters). Records
are read and written outside HDF5 where their bytes allow it: at their places in the
file (hdf5_storage.Placement) or, for deflated chunks, compressed by the workers (hdf5_chunks.py).

This module is the format's declaration (detection, the default output, FORMAT); the
format's own modules beside it, each over the next:
- hdf5_writer.py: the output, built object by object from the input (Hdf5Writer), and
  --store coefficients' (Hdf5CoefficientWriter);
- hdf5_output.py: the output file as HDF5 sees it, which never lets HDF5 see an I/O
  error, and Ctrl-C held while HDF5 works on it;
- hdf5_reader.py: the reader: which datasets are perturbed, kept or left out (Keras
  weights, netCDF dimensions and coordinates, CF encodings), and what the reader and the
  writer both ask of an HDF5 object (its attributes, dimensions, references);
- hdf5_storage.py: where a dataset's records are in the file, reading and writing them,
  and the checks of the input's storage;
- hdf5_chunks.py: netCDF-4-style deflated chunks, compressed and decompressed outside HDF5.

netCDF-4 files are HDF5 files, and the copy keeps what netCDF readers rely on:
- attributes are copied byte for byte in their stored type and shape (converting
  netCDF-C's fixed-length null-terminated strings drops their last character);
- the root group keeps its creation-order tracking, which the file creation list
  the input reports leaves out: netCDF-C opens a file for writing only with it, and
  lists variables and attributes in that order.
Of a perturbed dataset, the CF attributes about its values are honoured (cf.Encoding):
values equal to its _FillValue or missing_value are missing data, copied rather than
perturbed (the writer puts them back, so which values are missing is released as
is), unless the marker lies inside the declared range: then it is data (see cf.py)
and the output leaves it off; packed integers (scale_factor, add_offset, _Unsigned) are unpacked, perturbed in
physical units and written unpacked; valid_range, valid_min, valid_max and
actual_range are dropped, since noisy values pass them and readers would mask them.
Coordinate variables (dimension scales, and the variables named in a coordinates,
bounds, climatology or cell_measures attribute) are not perturbed unless named; one
that holds text is left out, its dimension written as netCDF-C writes a dimension
without a variable, so the file stays valid netCDF.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tldp_cli.formats import ArrayJob, DocRow, Format, FormatOptions, tldp_name

if TYPE_CHECKING:  # imported where used: detecting another format imports no h5py
    from tldp_cli.formats import hdf5_reader, hdf5_writer

NAME = "hdf5"
SIGNATURE = b"\x89HDF\r\n\x1a\n"


def can_open(path: Path) -> bool:
    """The signature sits at offset 0, or after a user block at 512, 1024, 2048, ..."""
    if not path.is_file():
        return False
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            offset = 0
            while offset + len(SIGNATURE) <= size:
                f.seek(offset)
                if f.read(len(SIGNATURE)) == SIGNATURE:
                    return True
                offset = offset * 2 if offset else 512
    except OSError:
        return False
    return False


def default_output(path: Path) -> Path:
    return tldp_name(path, path.suffix, FORMAT.compound_suffixes)


def open_reader(path: Path, options: FormatOptions) -> hdf5_reader.Hdf5Reader:
    from tldp_cli.formats import hdf5_reader

    return hdf5_reader.Hdf5Reader(path, options, NAME)


def create_writer(reader: hdf5_reader.Hdf5Reader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> hdf5_writer.Hdf5Writer:
    from tldp_cli.formats import hdf5_writer

    return hdf5_writer.Hdf5Writer(reader, tmp_path, dtype, options.value_bounds)


def create_coefficient_writer(reader: hdf5_reader.Hdf5Reader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype,
                              options: FormatOptions) -> hdf5_writer.Hdf5CoefficientWriter:
    from tldp_cli.formats import hdf5_writer

    return hdf5_writer.Hdf5CoefficientWriter(reader, jobs, tmp_path, dtype)


FORMAT = Format(
    name=NAME, title="HDF5 file", suffixes=(".h5", ".hdf5", ".hdf", ".he5", ".nc", ".nc4", ".cdf"),
    compound_suffixes=(".weights.h5",),
    selects_arrays=True, honours_exclude=True, honours_keep=True, cf_markers=True, shares_rows=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    create_coefficient_writer=create_coefficient_writer,
    docs=(DocRow("HDF5 file", "the HDF5 signature (any suffix)",
                 "`tldp perturb sample_data/digits.h5 --eps 1 --dataset images`",
                 "`digits.tldp.h5`: same groups, structural attributes, chunks, filters; labels and other "
                 "datasets not perturbed left out ([below](#what-is-not-perturbed))"),
          DocRow("Keras 3 `.weights.h5`", "an HDF5 file with the Keras weights layout",
                 "`tldp perturb model.weights.h5 --eps 1 --clip 0.1`",
                 "`model.tldp.weights.h5`: the same groups, attributes, dtypes and shapes")),
)
