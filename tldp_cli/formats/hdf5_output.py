"""The HDF5 format's output file as HDF5 sees it (formats/hdf5.py, hdf5_writer.py).

HDF5 does not survive a failed write: when a write fails while it flushes its
caches (chunks are cached, so a full disk often shows only when the file is
closed), closing the file fails halfway, and the next attempt, at the latest when
the process exits, reads freed memory and crashes. So the output goes through
h5py's file-object driver to Output, which never lets HDF5 see an I/O error: the
first is kept, the writes after it are dropped (the output is discarded anyway),
and the writer raises it once HDF5 has returned. Ctrl-C and SIGTERM wait while
HDF5 works on the output (signals_held), so that their KeyboardInterrupt never surfaces
inside a driver call either.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import h5py
from h5py import h5f, h5fd, h5p

from tldp_cli.files.checked_io import pwrite_all, write_error
from tldp_cli.sampling.engine import PAGE

class Output:
    """The output file as h5py's file-object driver sees it: keeps the first error instead
    of raising it into HDF5, and drops the writes after it (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        self.position = 0
        self.failure: BaseException | None = None

    def open_fd(self) -> int:
        """The file's descriptor (ValueError once closed, as a closed Python file)."""
        if self.fd is None:
            raise ValueError("I/O operation on closed file")
        return self.fd

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self.position
        elif whence == os.SEEK_END:
            try:
                offset += os.fstat(self.open_fd()).st_size
            except BaseException as exc:
                self.failure = self.failure or exc
        self.position = offset
        return offset

    def tell(self) -> int:
        return self.position

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if self.failure is None:
            try:
                pwrite_all(self.open_fd(), data, self.position)
            except BaseException as exc:
                self.failure = exc
        self.position += size
        return size

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        try:
            while done < len(view):
                count = os.preadv(self.open_fd(), [view[done:]], self.position + done)
                if count == 0:
                    break
                done += count
        except BaseException as exc:
            self.failure = self.failure or exc
        view[done:] = bytes(len(view) - done)  # beyond the end: zeros, as HDF5's own driver reads
        self.position += len(view)
        return len(view)

    def truncate(self, size: int) -> int:
        if self.failure is None:
            try:
                os.ftruncate(self.open_fd(), size)
            except BaseException as exc:
                self.failure = exc
        return size

    def flush(self) -> None:
        pass  # every write is in the file already; the writer syncs it when done

    def error(self) -> BaseException:
        """The error to raise for the failure kept (asked only once there is one)."""
        failure = self.failure
        assert failure is not None
        return write_error(self.path, failure) if isinstance(failure, OSError) else failure

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def create_output(output: Output, fcpl: h5p.PropFCID) -> h5py.File:
    """A new HDF5 file written through `output`. The file-access list holding `output` is
    released on return: one still open when Python exits is freed after it, and its
    driver's callback into Python crashes the process."""
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fileobj_driver(h5fd.fileobj_driver, output)
    if fcpl.get_userblock() == 0:  # (HDF5 wants a user block larger than the alignment)
        fapl.set_alignment(PAGE, PAGE)  # objects of a page or more start on a page: direct writes
    return h5py.File(h5f.create(os.fsencode(output.path), h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


@contextmanager
def signals_held() -> Iterator[None]:
    """Holds SIGINT and SIGTERM (Python handlers, which raise KeyboardInterrupt) until the
    block ends: inside a driver callback, HDF5 would take the exception for a failed write."""
    if threading.current_thread() is not threading.main_thread():
        yield  # the handlers run on the main thread, never inside this thread's callbacks
        return
    held: list[int] = []
    previous = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(number)):
            previous[number] = signal.signal(number, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if held:
            signal.raise_signal(held[0])
