"""Writes that check their result, and errors that name the file the user will see.

One pwrite may write less than asked, and pwrite, truncate and fsync errors name no
file: every output writer goes through these.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from tldp_cli.errors import InputError, WriteError
from tldp_cli.files.output import shown


def write_error(path: Path, cause: OSError) -> WriteError:
    error = WriteError(f"{shown(path)}: cannot write ({cause.strerror or cause})")
    error.errno = cause.errno
    return error


@contextlib.contextmanager
def writing(path: Path):
    """Turns an OSError while writing `path` (a full disk, a quota, an I/O error) into a
    WriteError naming it: pwrite, truncate and fsync errors name no file, and the user
    would read only "I/O"."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, WriteError):
            raise
        raise write_error(path, exc) from None


def fsync_file(path: Path) -> None:
    """Flushes a written file to disk, whoever wrote it (other processes too); a failure
    names the file."""
    with writing(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pwrite_all(fd: int, data, position: int) -> None:
    """Writes all of `data` at `position`: one pwrite may write less than asked (Linux
    stops at 0x7ffff000 bytes, a filling disk at its last free block)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, position)
        if written == 0:
            raise OSError(errno.EIO, "the filesystem wrote nothing")
        view, position = view[written:], position + written


def copy_bytes(src, source, dst, target: Path, count: int | None = None) -> None:
    """Copies `count` bytes (None: up to its end) from file object `src`, which reads
    `source`, to `dst`, which writes `target`: a failure to read is an InputError naming
    `source`, one to write a WriteError naming `target`."""
    while count is None or count > 0:
        try:
            chunk = src.read(1 << 20 if count is None else min(count, 1 << 20))
        except Exception as exc:  # OSError; zipfile or zlib errors from a damaged archive member
            raise InputError(f"{source}: cannot read ({getattr(exc, 'strerror', None) or exc}); "
                             "it may be damaged") from None
        if not chunk:
            if count is None:
                return
            raise InputError(f"{source}: ends {count} bytes early; it may have been truncated "
                             "during the run")
        with writing(target):
            dst.write(chunk)
        if count is not None:
            count -= len(chunk)


