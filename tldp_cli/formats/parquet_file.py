"""Parquet files (`.parquet`): Hugging Face Hub datasets, pandas and pyarrow tables. Row i
is one record, across the columns perturbed: image columns (the `Image` feature), tensor
and list columns, and numeric columns --dataset names; labels, text and the images' file
names are left out unless --keep names them (formats/tables.py has the rules).

The output has the input's row groups (their sizes), column order and types, format
version, compression of each column, and the Hugging Face features of the columns it holds:
`datasets.load_dataset("parquet", data_files=...)` gives the same features.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.files.checked_io import open_regular
from tldp_cli.formats import ArrayJob, DocRow, Format, FormatOptions, Reader, Writer, tldp_name

# formats/tables.py imports pyarrow (0.3 s), imported when a table is read: not while
# another format's input is being detected.

NAME = "parquet"


MAGIC = b"PAR1"  # at the start and the end of every Parquet file


def can_open(path: Path) -> bool:
    try:
        with open_regular(path) as f:
            return f.read(4) == MAGIC
    except (OSError, InputError):
        return False


def default_output(path: Path) -> Path:
    return tldp_name(path, ".parquet")


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    from tldp_cli.formats import tables

    return tables.output_bytes(jobs, dtype, options)


def open_reader(path: Path, options: FormatOptions) -> Reader:
    from tldp_cli.formats import tables, tables_reader

    part, schema, settings = tables.open_part(path, tables.PARQUET)
    return tables_reader.TableReader(path, tables.Table((part,)), schema, options, NAME, settings)


def create_writer(reader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> Writer:
    from tldp_cli.formats import tables_writer

    return tables_writer.TableWriter(reader, [tmp_path], dtype)


FORMAT = Format(
    name=NAME, title="Parquet file", suffixes=(".parquet",), member_noun="column",
    selects_arrays=True, honours_keep=True, shares_rows=True, writes_rows=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    output_bytes=output_bytes,
    docs=(DocRow("Parquet file (Hugging Face Hub datasets, pandas, pyarrow)", "`PAR1` at its start",
                 "`tldp perturb train.parquet --eps 1`",
                 "`train.tldp.parquet`: same row groups, column types and Hugging Face features; image, "
                 "tensor and named numeric columns perturbed, the other columns and the images' paths "
                 "dropped unless --keep"),),
)
