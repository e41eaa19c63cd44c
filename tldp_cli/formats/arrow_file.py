"""Arrow IPC files (`.arrow`, `.feather` version 2): the file format (`ARROW1`) and the
stream format that `datasets` writes (its cache and save_to_disk shards). Row i is one
record across the columns perturbed, as in a Parquet file (formats/tables.py has the rules).

The output is in the input's IPC format (file or stream) with its record batches (their
sizes), column order and types and the Hugging Face features of the columns it holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.files.checked_io import open_regular
from tldp_cli.formats import ArrayJob, DocRow, Format, FormatOptions, Reader, Writer, tldp_name

# formats/tables.py imports pyarrow (0.3 s), imported when a table is read: not while
# another format's input is being detected.

NAME = "arrow"


def can_open(path: Path) -> bool:
    """The IPC file format's magic, or a stream that starts with a schema message (pyarrow
    reads it only then)."""
    try:
        with open_regular(path) as f:
            head = f.read(6)
    except (OSError, InputError):
        return False
    if head != b"ARROW1" and head[:4] != b"\xff\xff\xff\xff":
        return False
    from tldp_cli.formats import tables

    return tables.layout_of(path) in (tables.IPC_FILE, tables.IPC_STREAM)


def default_output(path: Path) -> Path:
    return tldp_name(path, ".arrow")


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    from tldp_cli.formats import tables

    return tables.output_bytes(jobs, dtype, options)


def open_reader(path: Path, options: FormatOptions) -> Reader:
    from tldp_cli.formats import tables, tables_reader

    part, schema, _ = tables.open_part(path)
    return tables_reader.TableReader(path, tables.Table((part,)), schema, options, NAME)


def create_writer(reader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> Writer:
    from tldp_cli.formats import tables_writer

    return tables_writer.TableWriter(reader, [tmp_path], dtype)


FORMAT = Format(
    name=NAME, title="Arrow file", suffixes=(".arrow",), member_noun="column",
    selects_arrays=True, honours_keep=True, shares_rows=True, writes_rows=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    output_bytes=output_bytes,
    docs=(DocRow("Arrow IPC file or stream (`datasets` cache files, pyarrow)",
                 "`ARROW1`, or an IPC stream's schema message, at its start",
                 "`tldp perturb data.arrow --eps 1`",
                 "`data.tldp.arrow`: same IPC format, record batches, column types and features; "
                 "columns as in Parquet"),),
)
