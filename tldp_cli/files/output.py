"""Where a run's files go, and how they get there without touching anything else.

The rules (docs/output.md says the same for users):

- `--out PATH` names the output itself. When PATH ends in `/` (or is `.` or `..`),
  or is an existing folder and the output is a single file, the output goes inside
  that folder under its default name, as `cp` does.
- The output keeps the input's format: a suffix that names another format is refused.
- A run never writes into its input, into the store the input lies in, or over a
  folder that holds the input; it never replaces a folder with a file or a file
  with a folder; an existing folder is replaced (`--overwrite`) only when it is an
  earlier output of the same kind.
- Everything is written into a hidden work folder beside each destination,
  `.NAME.tldp-tmp-XXXXXXXX/`, that the run holds an exclusive lock on (flock on
  the `lock` file inside). At the end every file is moved into place in one step
  each, without replacing anything that appeared meanwhile (renameat2
  RENAME_NOREPLACE, or link/mkdir where the filesystem lacks it); with
  `--overwrite`, swapped with what was there (RENAME_EXCHANGE) so that a failure
  puts the old files back. Of several runs racing for one destination without
  `--overwrite`, exactly one wins.
- A killed run's work folder is unlocked: the next run into the same destination
  removes it and says so. A live run's is locked and left alone. On a filesystem
  whose locks do not reach other machines (NFS mounted with `nolock`), a run on
  another machine writing to the same destination at the same moment can lose its
  work folder; it then fails, it never leaves a wrong output.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil
import signal
import stat
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Protocol

from tldp_cli.errors import InputError, OutOfMemory, OutputError, UsageError, reason_of

WORK_MARK = ".tldp-tmp-"
PARTIAL_MARK = ".tldp-partial"  # .NAME.tldp-partial: a resumable run's output (run/resume.py)
_NEW_MARK = ".tldp-new-"  # a work folder before its lock is taken
_NEW_GRACE_SECONDS = 60  # an unlocked new folder younger than this may be a run starting up
LOCK_FILE = "lock"
# Files that show or name the raw data (the --preview strip, the name map, the ledger) are
# created readable and writable by their owner only, as the raw data should be.
PRIVATE_MODE = 0o600


# Names of one archive file: a folder output under such a name (`--out shard.tar` on one
# WebDataset shard) would be a folder no tar reader opens.
ARCHIVE_SUFFIXES = (".tar", ".tgz", ".zip")


class OutputKind(Protocol):
    """What the output is, as the rules above need it (the formats layer declares it:
    formats.Format)."""

    title: str  # how messages name it: "HDF5 file"
    folder: bool  # a folder, not a file
    suffixes: tuple[str, ...]  # the suffixes that name it
    # Where its readers know it by the name's suffix alone (nibabel.load): the output's
    # name must end with one of these; () where any name will do.
    required_suffixes: tuple[str, ...]


# Pseudo-filesystems whose paths name no data: an input there is refused and no output
# is ever derived from one (`perturb /dev/stdin` must not write into /dev).
_SPECIAL_ROOTS = (Path("/dev"), Path("/proc"), Path("/sys"))


def _resolve(path: Path, what: str) -> Path:
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise OutputError(f"{path}: {what} path cannot be resolved ({reason_of(exc)})") from None


def _special_root(path: Path) -> str | None:
    """"dev", "proc" or "sys" for a path under one of them; None otherwise."""
    absolute = Path(os.path.abspath(path))
    if any(absolute == root or root in absolute.parents for root in _SPECIAL_ROOTS):
        return absolute.parts[1]
    return None


def check_input(path: Path) -> None:
    """Refuses inputs that are not a regular file or folder (FIFOs, devices, /dev/stdin)."""
    special = _special_root(path)
    if special:
        raise InputError(f"{path}: tldp reads regular files and folders, not /{special}/ "
                         "entries; save the data to a file first")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or directory") from None
    except (RuntimeError, OSError) as exc:
        raise InputError(f"{path}: cannot be opened ({reason_of(exc)})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise InputError(f"{path}: not a regular file or folder (a pipe or device); tldp reads "
                         "files and folders: save the data to a file first")


def _names_folder(text: str) -> bool:
    """`dir/`, `.`, `..`: a folder to write into, whatever exists."""
    return text.endswith((os.sep, "/")) or Path(text).name in ("", "..")


def destination(out: Path | None, out_text: str | None, default: Path, kind: OutputKind,
                named_by: Callable[[str], str | None]) -> Path:
    """The output path: `default` without --out, else --out by the rules above.

    `out_text` is --out as typed (a trailing slash survives there, not in a Path).
    `named_by(suffix)`: how messages name the other format a suffix names, if one does, so
    that `--out x.h5` on a .npy input is refused, not written as a .npy file with the wrong
    name."""
    if out is None:
        return default
    text = out_text if out_text is not None else str(out)
    if text == "-":
        raise UsageError("--out -: tldp writes files, not standard output; give a file or folder path")
    if _names_folder(text) or (not kind.folder and out.is_dir()):
        if not out.is_dir():
            raise OutputError(f"{text}: --out names a folder that does not exist (tldp makes no folders: "
                              "create it first)")
        return _resolve(out, "output") / default.name
    suffix = out.suffix.lower()
    if kind.folder and suffix in ARCHIVE_SUFFIXES:
        raise UsageError(f"{out}: the output of {kind.title} is a folder (each shard or file in it under "
                         f"its own name), not one {suffix} file; name a folder, such as {default.name}")
    other = None if suffix in kind.suffixes else named_by(suffix)
    if other is not None:
        raise UsageError(f"{out}: the name says {other}, but the input is a {kind.title} and tldp "
                         "writes the input's format; name the output accordingly")
    required = kind.required_suffixes
    if required and not out.name.lower().endswith(required):
        raise UsageError(f"{out}: {kind.title} readers know the format by the name's suffix; "
                         f"end it with {' or '.join(required)}")
    return out


def store_root(path: Path) -> Path | None:
    """The outermost Zarr store that `path` lies inside (not `path` itself), if any."""
    root = None
    for parent in _resolve(path, "input").parents:
        if any((parent / name).is_file() for name in ("zarr.json", ".zgroup", ".zarray")):
            root = parent
    return root


def store_member(path: Path) -> tuple[Path, str] | None:
    """(the store, the member's path in it: "t2m", "group/t2m") of an array or group inside
    a Zarr store (`era.zarr/t2m`), if `path` is one."""
    root = store_root(path)
    if root is None:
        return None
    return root, _resolve(path, "input").relative_to(root).as_posix()


def default_beside_store(path: Path, default: Path) -> Path:
    """An array inside a store (`era.zarr/t2m`): its default output goes beside the store
    (`era.t2m.tldp.zarr`), never into it."""
    member = store_member(path)
    if member is None:
        return default
    root, name = member
    stem = root.name[:-5] if root.name.endswith(".zarr") else root.name
    return root.with_name(f"{stem}.{name.replace('/', '.')}.tldp.zarr")


def check_destination(path: Path, source: Path, overwrite: bool, what: str, folder: bool,
                      earlier_output=None) -> None:
    """Refuses a destination that would touch anything but this run's own output.

    `folder`: the output is a folder. `earlier_output(path) -> bool`: whether an existing
    folder is an earlier output of this kind, which --overwrite may replace."""
    parent = path.parent
    if not parent.is_dir():
        if os.path.lexists(parent):
            raise OutputError(f"{path}: {parent} is not a folder")
        raise OutputError(f"{path}: {what} folder {parent} does not exist")
    final = _resolve(path, what)
    source_real = _resolve(source, "input")
    if final == source_real:
        raise UsageError(f"{path}: the {what} would replace the input")
    if final in source_real.parents:
        raise UsageError(f"{path}: the {what} would replace the folder {path} that holds the input")
    if source_real.is_dir() and source_real in final.parents:
        raise UsageError(f"{path}: the {what} would be written inside the input {source}")
    store = store_root(source)
    if store is not None and store in final.parents:
        raise UsageError(f"{path}: the {what} would be written inside the Zarr store {store} that "
                         "holds the input")
    if store is not None and final == store:
        raise UsageError(f"{path}: the {what} would replace the Zarr store that holds the input")
    special = _special_root(path)
    if special:
        raise UsageError(f"{path}: tldp writes regular files and folders, not /{special}/ entries")
    if not os.path.lexists(path):
        return
    mode = path.lstat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        raise UsageError(f"{path}: exists and is not a regular file or folder (a device, pipe or "
                         f"socket); tldp never replaces one")
    is_folder = path.is_dir() and not path.is_symlink()
    if folder and not is_folder:
        raise UsageError(f"{path}: exists and is not a folder; the {what} is a folder and tldp does "
                         "not replace a file with a folder")
    if not folder and is_folder:
        raise UsageError(f"{path}: is a folder; the {what} is a file and tldp does not replace a "
                         "folder with a file")
    if not overwrite:
        raise OutputError(f"{path}: {what} exists; pass --overwrite to replace it")
    if is_folder and earlier_output is not None and not earlier_output(path):
        raise not_earlier_output(path)


def not_earlier_output(path: Path, strays: str | None = None) -> UsageError:
    """The refusal to replace the folder `path`; `strays`: the files in it that no run on
    this input writes (their relative paths, listed), which a format's earlier_output names
    by raising this itself."""
    held = f" (it holds {strays}, which a run on this input does not write)" if strays else ""
    return UsageError(f"{path}: exists and is not an earlier output of this kind{held}; tldp replaces "
                      "only its own outputs, so remove it yourself or choose another --out")


def check_outside_inputs(path: Path, reads: list[Path], what: str) -> None:
    """Refuses `path` (which need not exist yet) when it is one of the files a command reads
    or lies inside one of their folders or Zarr stores: evaluate's and sweep's --report and
    sweep's files are written beside the raw data and the release, never over or into them."""
    final = _resolve(path, what)
    for source in reads:
        if not os.path.lexists(source):
            continue
        real = _resolve(source, "input")
        store = store_root(source)
        if final == real:
            raise UsageError(f"{path}: the {what} would replace {source}, which this command reads")
        if (real.is_dir() and real in final.parents) or (store is not None and store in final.parents):
            raise UsageError(f"{path}: the {what} would be written inside {store or source}, which this "
                             "command reads")


def check_distinct(paths: dict[str, Path]) -> None:
    """Refuses two destinations that are the same file, or one inside another."""
    resolved = {what: _resolve(p, what) for what, p in paths.items()}
    names = list(resolved)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if resolved[a] == resolved[b]:
                raise UsageError(f"{paths[b]}: the {b} and the {a} name the same file")
            for inner, outer in ((a, b), (b, a)):
                if resolved[outer] in resolved[inner].parents:
                    raise UsageError(f"{paths[inner]}: the {inner} would be written inside the {outer}")


def check_free_space(folder: Path, needed: int, what: Path) -> None:
    """Refuses an output that cannot fit: before any memory or disk is committed."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if needed > free:
        raise OutputError(f"{what}: needs about {_size(needed)} but {folder} has {_size(free)} free")


def available_memory() -> int | None:
    """About how many bytes this process can still allocate and use: the least of the
    memory the system has available (with free swap), what its cgroup's limit leaves, and
    what its address-space limit (ulimit -v) leaves; None where none can be read."""
    limits: list[int | None] = []
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        info = {line.split(":")[0]: int(line.split()[1]) * 1024
                for line in Path("/proc/meminfo").read_text().splitlines()}
        limits.append(info["MemAvailable"] + info.get("SwapFree", 0))
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        limits.append(_cgroup_room())
    with contextlib.suppress(OSError, ValueError, StopIteration):
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            status = Path("/proc/self/status").read_text().splitlines()
            used = int(next(line for line in status if line.startswith("VmSize:")).split()[1]) * 1024
            limits.append(soft - used)
    known = [limit for limit in limits if limit is not None]
    return max(0, min(known)) if known else None


def _cgroup_room() -> int | None:
    """What the memory limit of this process's cgroup (v2, or v1) leaves beside the memory
    its processes hold (the page cache can be reclaimed); None without a limit."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        v2 = controllers == ""
        if not (v2 or "memory" in controllers.split(",")):
            continue
        root = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")
        for folder in (root / where.lstrip("/"), root):  # a container sees its own cgroup as the root
            limit_file = folder / ("memory.max" if v2 else "memory.limit_in_bytes")
            if limit_file.is_file():
                limit = limit_file.read_text().strip()
                if limit == "max" or int(limit) >= 1 << 60:
                    return None
                stat = dict(entry.split() for entry in (folder / "memory.stat").read_text().splitlines())
                return int(limit) - int(stat["anon" if v2 else "total_rss"])
    return None


def check_free_memory(needed: int, what: str) -> None:
    """Refuses, before anything is allocated, work that cannot fit in memory: `needed` is
    the least it must hold at once; `what` says what needs it."""
    available = available_memory()
    if available is not None and needed > available:
        raise OutOfMemory(f"{what} needs at least {_size(needed)} of memory, but this process has about "
                          f"{_size(available)} available; nothing was written")


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} EB"


def removed_during_run(path: Path) -> OutputError:
    """The error for a file or folder of a run's output that another program removed."""
    return OutputError(f"{shown(path)}: removed while tldp wrote the output (another program?); "
                       "nothing was written")


def shown(path: Path) -> Path:
    """`path` by the name the user will find it under: a file in a run's work folder
    (.NAME.tldp-tmp-XXXXXXXX/NAME/...) or in the partial output of a resumable run
    (.NAME.tldp-partial/store/..., see run/resume.py) by its destination (NAME/...)."""
    parts = path.parts
    for i in range(len(parts) - 1):
        if parts[i].startswith(f".{parts[i + 1]}{WORK_MARK}"):
            return Path(*parts[:i], *parts[i + 1:])
        if parts[i].startswith(".") and parts[i].endswith(PARTIAL_MARK) and parts[i + 1] == "store":
            return Path(*parts[:i], parts[i][1:-len(PARTIAL_MARK)], *parts[i + 2:])
    return path


# --- Work folders and their locks --------------------------------------------------------

# What flock raises on a filesystem without locks: such a lock is taken as held, since
# nothing better can be known.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


def _lock(fd: int, wait: bool) -> None:
    """Takes an exclusive lock on `fd` (BlockingIOError if someone holds it and not `wait`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if isinstance(exc, BlockingIOError) or exc.errno not in _NO_LOCKS:
            raise


def _take_dead(folder: Path, new: bool) -> int | None:
    """The lock of a work folder that belongs to no live run, held (an open fd), or None
    while a run holds it."""
    if new:
        try:
            if time.time() - folder.lstat().st_mtime < _NEW_GRACE_SECONDS:
                return None
        except OSError:
            return None
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        # a tmp folder always has its lock file; a new one may not yet: lock the folder
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY) if new else None
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # held (or locks do not work here: never guess that a run is dead)
    return fd


def remove_dead_work(final: Path) -> list[str]:
    """Removes the work folders that killed runs left beside `final`, first finishing a
    move into place that a run was killed in the middle of; returns notes."""
    notes: list[str] = []
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return notes
    prefix = f".{final.name}"
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        new = rest.startswith(_NEW_MARK)
        if not (new or rest.startswith(WORK_MARK)) or not entry.is_dir() or entry.is_symlink():
            continue
        lock = _take_dead(entry, new)
        if lock is None:
            continue
        try:
            notes += _finish_commit(entry / COMMIT_JOURNAL)
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                notes.append(f"removed {entry}, left by a tldp run that was killed")
        finally:
            os.close(lock)
    return notes


COMMIT_JOURNAL = "commit.json"  # what a run is moving into place: written before the first move


def _finish_commit(journal: Path) -> list[str]:
    """A run killed while moving its files into place left output and manifest out of
    step (one new, one old): complete its moves, since all its files were complete."""
    try:
        moves = json.loads(journal.read_text())
    except (OSError, ValueError):
        return []
    finished = []
    with _parents_locked([Path(m["final"]) for m in moves]):
        for move in moves:
            tmp, final = Path(move["tmp"]), Path(move["final"])
            try:
                pending = tmp.lstat().st_ino == move["inode"]
            except OSError:
                pending = False
            if not pending:
                continue  # moved already (or gone)
            if os.path.lexists(final):
                swap(tmp, final)
                remove(tmp)
            else:
                place_new(tmp, final)
            finished.append(str(final))
    return [f"finished moving {', '.join(finished)} into place for a tldp run killed while doing "
            "it"] if finished else []


@contextlib.contextmanager
def _parents_locked(finals: list[Path]):
    """Holds an exclusive lock on the folders of `finals` (in one order: no deadlock), so
    that two runs move their output and manifest into place one after the other, never
    interleaved (an output under another run's manifest)."""
    fds = []
    try:
        for folder in sorted({_resolve(final.parent, "output") for final in finals}):
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                raise removed_during_run(folder) from None
            fds.append(fd)
            _lock(fd, wait=True)
        yield
    finally:
        for fd in fds:
            os.close(fd)


class WorkFolder:
    """A locked, hidden folder beside a destination that holds the files being written."""

    def __init__(self, final: Path):
        token = secrets.token_hex(4)
        new = final.with_name(f".{final.name}{_NEW_MARK}{token}")
        try:
            new.mkdir(mode=0o700)
        except OSError as exc:
            raise OutputError(f"{final.parent}: cannot create a temporary folder there "
                              f"({reason_of(exc)})") from None
        self._lock_fd: int | None = None
        try:
            self._lock_fd = os.open(new / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            _lock(self._lock_fd, wait=False)  # a new file: nobody else holds it
            self.path = final.with_name(f".{final.name}{WORK_MARK}{token}")
            os.rename(new, self.path)
        except BaseException:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            shutil.rmtree(new, ignore_errors=True)
            raise

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# --- Moving into place -------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_renameat2: Callable[..., int] | None
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError):
    _renameat2 = None
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)


def _rename2(src: Path, dst: Path, flags: int) -> None:
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(dst))


def _renamed(src: Path, dst: Path, flags: int) -> bool:
    """renameat2 with `flags`; False where the system or filesystem lacks it."""
    try:
        _rename2(src, dst, flags)
        return True
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
        return False


def place_new(src: Path, dst: Path) -> None:
    """Renames src to dst; fails with FileExistsError if dst exists, atomically."""
    if _renamed(src, dst, _RENAME_NOREPLACE):
        return
    if src.is_dir() and not src.is_symlink():
        os.mkdir(dst)  # the claim: fails if anything is there
        try:
            os.rename(src, dst)  # replaces the empty folder just made
        except BaseException:
            os.rmdir(dst)
            raise
    else:
        os.link(src, dst, follow_symlinks=False)
        os.unlink(src)


def swap(src: Path, dst: Path) -> None:
    """Exchanges src and dst (both exist): afterwards src holds the old dst."""
    if _renamed(src, dst, _RENAME_EXCHANGE):
        return
    aside = src.with_name(src.name + ".old")
    os.rename(dst, aside)
    try:
        os.rename(src, dst)
    except BaseException:
        os.rename(aside, dst)
        raise
    os.rename(aside, src)


class Staging:
    """The files of one run, written under work folders and moved into place together:
    all of them or none (a failure puts back whatever was replaced)."""

    def __init__(self) -> None:
        self._folders: dict[Path, WorkFolder] = {}  # by destination folder
        self._targets: list[tuple[Path, Path]] = []  # (temporary, final)
        self._inodes: dict[Path, int] = {}  # final -> the inode moved there
        self.notes: list[str] = []

    def temporary(self, final: Path) -> Path:
        """Where to write the file or folder that becomes `final`."""
        self.notes += remove_dead_work(final)
        parent = _resolve(final.parent, "output")
        if parent not in self._folders:
            self._folders[parent] = WorkFolder(final)
        tmp = self._folders[parent].path / final.name
        self._targets.append((tmp, final))
        return tmp

    def adopt(self, tmp: Path, final: Path) -> None:
        """A temporary kept elsewhere (a resumable run's partial store)."""
        self._targets.append((tmp, final))

    def commit(self, overwrite: bool) -> None:
        """Moves every output into place, all or none (see uninterruptible for signals)."""
        with _parents_locked([final for _, final in self._targets]):
            self._journal()
            self._move(overwrite)
            for folder in {final.parent for _, final in self._targets}:
                _flush_folder(folder)

    def _journal(self) -> None:
        """Writes down the moves before the first, so that the next run can finish them if
        this one is killed in between (see _finish_commit)."""
        for tmp, final in self._targets:
            try:
                self._inodes[final] = tmp.lstat().st_ino
            except FileNotFoundError:
                raise removed_during_run(tmp) from None
        if not self._folders:
            return
        moves = [{"tmp": os.path.abspath(tmp), "final": os.path.abspath(final), "inode": self._inodes[final]}
                 for tmp, final in self._targets]
        journal = next(iter(self._folders.values())).path / COMMIT_JOURNAL
        with open(journal, "x", encoding="utf-8") as f:
            f.write(json.dumps(moves))
            f.flush()
            os.fsync(f.fileno())

    def _move(self, overwrite: bool) -> None:
        done: list[tuple[str, Path, Path]] = []
        try:
            for tmp, final in self._targets:
                if os.path.lexists(final):
                    if not overwrite:
                        raise OutputError(f"{final}: appeared while tldp was writing (another run?); "
                                          "nothing was replaced")
                    swap(tmp, final)
                    done.append(("swapped", tmp, final))
                else:
                    try:
                        place_new(tmp, final)
                    except FileExistsError:
                        raise OutputError(f"{final}: appeared while tldp was writing (another run?); "
                                          "nothing was replaced") from None
                    done.append(("placed", tmp, final))
        except BaseException as exc:
            for how, tmp, final in reversed(done):
                try:
                    swap(tmp, final) if how == "swapped" else os.rename(final, tmp)
                except OSError:
                    pass
            if isinstance(exc, FileNotFoundError):  # a temporary, or the destination's folder
                raise removed_during_run(final) from None
            raise
        for _, tmp, _ in done:  # the replaced outputs, now in the work folders
            if os.path.lexists(tmp):
                remove(tmp)

    def check_in_place(self) -> None:
        """After commit: raises OutputError if an output is no longer what was moved into
        place (another program removed it meanwhile), after removing this run's other
        outputs, so that a run never reports a file that is not there and never leaves a
        manifest without its output."""
        gone = [final for final, inode in self._inodes.items() if _inode(final) != inode]
        if not gone:
            return
        for final, inode in self._inodes.items():
            if final not in gone and _inode(final) == inode:
                remove(final)
        raise OutputError(f"{gone[0]}: removed by another program as soon as tldp had moved it into "
                          "place; the run's other files were removed too")

    def discard(self) -> None:
        for folder in self._folders.values():
            folder.remove()
        self._folders.clear()

    def close(self) -> None:
        """After commit: the emptied work folders go."""
        self.discard()


@contextlib.contextmanager
def staged(overwrite: bool) -> Iterator[Staging]:
    """A Staging for the files written inside the block, moved into place together once it
    ends (Staging.commit), or removed, nothing replaced, if it fails."""
    staging = Staging()
    try:
        yield staging
        staging.commit(overwrite)
    except BaseException:
        staging.discard()
        raise
    staging.close()


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None


def _flush_folder(folder: Path) -> None:
    """Flushes a folder's entries to disk (fsync), so that the outputs just moved into it
    are still there after a power loss. Best effort: the outputs are in place by now, and
    some filesystems refuse fsync on a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_private(path: Path) -> BinaryIO:
    """A new file (never an existing one), open for writing, readable by its owner only
    (PRIVATE_MODE) from the moment it exists: for files that show or name the raw data."""
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE), "wb")


def check_file_target(path: Path, overwrite: bool, folder_made: bool = False) -> None:
    """What write_files refuses for `path`, so that a command can refuse it before its work:
    a missing folder (unless the caller makes it, `folder_made`), a folder at the path, an
    existing file without `overwrite`."""
    if not folder_made and not path.parent.is_dir():
        raise OutputError(f"{path}: folder {path.parent} does not exist")
    if path.is_dir() or (os.path.lexists(path) and not overwrite):
        raise OutputError(f"{path}: exists; pass --overwrite to replace it")


def write_files(contents: dict[Path, bytes], overwrite: bool, private: bool = False) -> None:
    """Writes small files (reports, sweep tables) as a run writes its output: complete or
    not at all, together, never replacing anything without `overwrite`; `private`: readable
    by their owner only (create_private)."""
    for path in contents:
        check_file_target(path, overwrite)
    with staged(overwrite) as staging:
        for path, data in contents.items():
            tmp = staging.temporary(path)
            try:
                with (create_private(tmp) if private else open(tmp, "xb")) as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise OutputError(f"{path}: cannot write ({reason_of(exc)})") from None


def remove(path: Path) -> None:
    """Removes a file, a link or a folder tree (never what a link points at)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def interrupt(signum, frame):
    """Ctrl-C and SIGTERM in a process that ends with its run (the `tldp` command): they
    stop the run (KeyboardInterrupt) until its outputs are moved into place. From then on
    they stay ignored (see uninterruptible), so that nothing after the commit (the summary,
    threads ending, the interpreter's exit) turns an output in place into an error or a
    death by signal: the process exits 0."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def uninterruptible():
    """Ctrl-C and SIGTERM are ignored inside: once a run starts moving its outputs into
    place it finishes, so that it never reports "nothing was written" with the output in
    place. Yields `keep`, to call once the outputs are in place: the signals then stay
    ignored until the process exits if their handler was `interrupt`; otherwise (a
    library caller's handlers, or a failed commit) the previous handlers come back. Only
    the main thread sets signal handlers; elsewhere this does nothing."""
    committed = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    previous = {}
    try:
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, signal.SIG_IGN)
        yield lambda: committed.append(True)
    finally:
        for number, handler in previous.items():
            if not (committed and handler is interrupt):
                signal.signal(number, signal.SIG_DFL if handler is None else handler)
