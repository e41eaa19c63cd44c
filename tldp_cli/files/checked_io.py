"""Writes that check their result, reads of input files that cannot hang or recurse
without end, and errors that name the file the user will see.

One pwrite may write less than asked, and pwrite, truncate and fsync errors name no
file: every output writer goes through these. Opening a FIFO found in a folder waits
for a writer forever, and json.loads on 200,000 `[` raises RecursionError: files found
by listing a folder are opened with open_regular, and JSON read from input files is
parsed with json_value.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import stat
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np

from tldp_cli.errors import InputError, WriteError, reason_of
from tldp_cli.files.output import removed_during_run, shown
from tldp_cli.sampling.engine import PAGE, page_aligned_empty

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the OS has none (macOS, Windows)
_thread_buffers = threading.local()
# JSON read from input files nests no deeper than this: real metadata (OME-Zarr's, Zarr's
# consolidated metadata, a safetensors header) nests about ten levels, and code that walks
# a value recursively (zarr-python, copy.deepcopy, json.dumps) must stay far from Python's
# recursion limit.
MAX_JSON_DEPTH = 100


def not_regular(path: Path, mode: int) -> InputError:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
             (stat.S_ISBLK, "a device"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"))
    kind = next((name for test, name in kinds if test(mode)), "of an unknown kind")
    return InputError(f"{path}: not a regular file ({kind}); tldp reads only regular files")


def open_regular(path: Path, follow_links: bool = True) -> BinaryIO:
    """`path` opened to read in binary, refused (InputError) unless it is a regular file.
    It is checked before it is opened (opening a FIFO waits for a writer, a device's open
    may act), and once more on the open file (it may have been replaced meanwhile), which
    is opened non-blocking for that. `follow_links`=False refuses a symbolic link too (one
    put in place after the check: ELOOP, an OSError like the others of os.open)."""
    mode = (os.stat if follow_links else os.lstat)(path).st_mode
    if not stat.S_ISREG(mode):
        raise not_regular(path, mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags if follow_links else flags | getattr(os, "O_NOFOLLOW", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _json_depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0), walked without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:
            pending.extend((child, depth + 1) for child in children)
    return deepest


def json_value(text: str | bytes, where: str) -> Any:
    """The JSON value `text` read from an input file, or InputError "{where} is not valid
    JSON (...)": text that is not JSON, or that nests lists and objects more than
    MAX_JSON_DEPTH deep (json.loads would raise RecursionError on 200,000 `[`, and code
    walking the value recursively could later). `where` names the file, as the error's
    start: "data.zarr: damaged Zarr store: zarr.json"."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InputError(f"{where} is not valid JSON ({reason_of(exc)})") from None
    else:
        if _json_depth(value) <= MAX_JSON_DEPTH:
            return value
    raise InputError(f"{where} is not valid JSON (it nests lists and objects more than "
                     f"{MAX_JSON_DEPTH} levels deep; tldp reads none deeper)")


def write_error(path: Path, cause: OSError) -> WriteError:
    if cause.errno == errno.ENOENT:  # the file, or a folder it was in, is gone
        error = WriteError(str(removed_during_run(path)))
    else:
        error = WriteError(f"{shown(path)}: cannot write ({reason_of(cause)})")
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
            raise InputError(f"{source}: cannot read ({reason_of(exc)}); "
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


def _aligned_copy(data: np.ndarray) -> np.ndarray:
    """`data` (bytes) in this thread's reused page-aligned buffer."""
    buffer = getattr(_thread_buffers, "buffer", None)
    if buffer is None or buffer.size < data.size:
        buffer = _thread_buffers.buffer = page_aligned_empty(data.size, np.uint8)
    buffer[:data.size] = data
    return buffer[:data.size]


def write_direct(path: Path, data: np.ndarray, position: int) -> bool:
    """Writes whole pages (`position` and len(data) multiples of PAGE) with O_DIRECT; False,
    having written nothing, where the filesystem does not support it."""
    if not _O_DIRECT:
        return False
    if data.ctypes.data % PAGE:
        data = _aligned_copy(data)
    try:
        fd = os.open(path, os.O_WRONLY | _O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    try:
        pwrite_all(fd, data, position)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False  # refused before writing: alignment the device does not take
        raise
    finally:
        os.close(fd)
    return True


def write_new_file(path: Path, data: bytes | memoryview) -> None:
    """Writes `data` as the whole of file `path` (created, or emptied first) and flushes
    it to disk (fsync): its whole pages with direct I/O where the filesystem takes it
    (write_direct), the last partial page through the page cache. Copying many megabytes
    into the page cache costs more CPU than the direct write, most of all in memory the
    machine has not touched for a while. Raises OSError (call it inside `writing`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        whole = len(data) // PAGE * PAGE
        if whole and not write_direct(path, np.frombuffer(data, np.uint8, whole), 0):
            whole = 0
        pwrite_all(fd, memoryview(data)[whole:], whole)
        os.fsync(fd)  # little left to flush: the file's metadata and its last page
    finally:
        os.close(fd)


def path_in_output(root: Path, rel: str) -> Path:
    """`rel`'s path in the output folder `root`, making the folders it goes in below
    `root`, never `root` itself: an output removed during the run fails, rather than come
    back without the files written before."""
    target = root / rel
    if not root.is_dir():
        raise removed_during_run(root)
    with writing(target.parent):
        target.parent.mkdir(parents=True, exist_ok=True)
    return target


# zarr-python's LocalStore writes each chunk as NAME.<uuid>.partial, then renames it: a run
# stopped early (Ctrl-C on Dask) can list one a worker renames a moment later.
ATOMIC_WRITE_SUFFIX = ".partial"


def flushed_files(root: Path, flushed_already) -> list[Path]:
    """The files under `root`, sorted, each flushed to disk (fsync_file) unless it is in
    `flushed_already` (written and flushed one by one, as a writer thread does)."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        if path not in flushed_already:
            if path.name.endswith(ATOMIC_WRITE_SUFFIX) and not path.exists():
                continue  # a store's write in flight when the run stopped early, since renamed
            fsync_file(path)
    return [path for path in files if not path.name.endswith(ATOMIC_WRITE_SUFFIX) or path.exists()]


class Background:
    """Runs work(item) on a thread of its own for each item put, in order; put() waits while
    `depth` items are queued and returns a Future that is done once the item's work is. The
    first failure is raised by the next put(), by close() and by the Futures of its item
    and of those after it, which are dropped (the output is lost anyway)."""

    def __init__(self, work: Callable[[Any], None], name: str, depth: int = 2):
        self._work = work
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._failure: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (queued := self._queue.get()) is not None:
            item, done = queued
            if self._failure is None:
                try:
                    self._work(item)
                except BaseException as exc:
                    self._failure = exc
            if self._failure is None:
                done.set_result(None)
            else:
                done.set_exception(self._failure)

    def put(self, item: Any) -> Future:
        """Raises the first failure, or RuntimeError once close() has begun: a worker that
        ends after a second Ctrl-C cut close() short must not wait for a thread that is gone."""
        done: Future = Future()
        while True:
            if self._failure is not None:
                raise self._failure
            if self._closing:
                raise RuntimeError(f"{self._thread.name}: closed")
            try:
                self._queue.put((item, done), timeout=0.1)
                return done
            except queue.Full:
                continue

    def close(self) -> None:
        """Waits for the queued items; raises the failure, if any."""
        self._closing = True
        try:
            if self._thread.is_alive():
                self._queue.put(None)
                self._thread.join()
        except BaseException as exc:  # Ctrl-C while waiting: drop the rest, let the thread end
            self._failure = self._failure or exc
            while True:
                try:
                    queued = self._queue.get_nowait()
                except queue.Empty:
                    break
                if queued is not None:
                    queued[1].set_exception(self._failure)
            self._queue.put_nowait(None)
            raise
        if self._failure is not None:
            raise self._failure
