"""The partial output of a resumable run (--resume) and its journal of finished blocks.

A format that can reopen an output it began (a module with `reopen_writer`, today
Zarr) is written into a deterministic sibling of the destination,

    .NAME.tldp-partial/
        store/          the output being written
        journal.jsonl   line 1: the run's options, the tldp version and the random-stream
                        layout; then one line per finished block, with the
                        writer's note of it (Writer.block_note: a count the
                        manifest states anyway, e.g. moved_off_markers)

A block is journaled only after its write returned, so every journaled block is on
disk; a block that was being written when the run died is simply written again.
The directory is locked (flock) while a run uses it, so two runs never share one.

The journal records the options that decide the output, never the seed nor anything
derived from it (a hash would confirm guesses of a weak seed), and no hash
or statistic of the input. With the same seed a resumed run equals an uninterrupted
one; without it the remaining blocks get fresh, independent noise. Another tldp
version or stream layout (rng.STREAM_LAYOUT, STREAM_UNIT_ELEMENTS) may draw other
noise for the same seed, or lay blocks out differently: such a run is not resumed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tldp_cli import __version__
from tldp_cli.files.output import PARTIAL_MARK
from tldp_cli.sampling import rng
from tldp_cli.errors import OutputError, UsageError

JOURNAL_VERSION = 1
# What else a resumed run must share with the interrupted one, as the journal names it.
_PROVENANCE = {"tldp": "tldp version", "stream_layout": "random-stream layout",
               "stream_unit_elements": "stream unit elements"}


def partial_path(output: Path) -> Path:
    return output.with_name(f".{output.name}{PARTIAL_MARK}")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "given" if value else "not given"
    return json.dumps(value)


class Partial:
    """An exclusive hold on the partial output of `output`.

    `resuming` says whether blocks of an earlier run are kept; `completed` maps their
    (array name, start, stop) to the writer's note of each (Writer.block_note);
    `messages` what the user should be told.
    """

    def __init__(self, output: Path, options: dict[str, Any], resume: bool):
        self.output = output
        self.root = partial_path(output)
        self.store = self.root / "store"
        self.journal = self.root / "journal.jsonl"
        self.options = json.loads(json.dumps(options, default=str))  # as the journal holds them
        self.provenance = {"tldp": __version__, "stream_layout": rng.STREAM_LAYOUT,
                           "stream_unit_elements": rng.STREAM_UNIT_ELEMENTS}
        self.resuming = False
        self.completed: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.messages: list[str] = []
        self._lock: int | None = None
        self._fd: int | None = None
        if self.root.exists():
            self._acquire()
            try:
                self._take_over(resume)
            except BaseException:
                self.release()
                raise
        elif resume:
            self.messages.append(f"no interrupted run of {output} to resume; starting from the beginning")
        if not self.resuming:
            self._start()

    def _acquire(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{self.output}: another tldp run is writing it (its partial output "
                              f"{self.root} is in use)") from None
        self._lock = fd

    def _take_over(self, resume: bool) -> None:
        if not resume:  # a run that starts over needs no leftover to be cleaned by hand
            self.messages.append(f"removed {self.root}, the partial output of an interrupted run "
                                 "(pass --resume to continue one instead)")
            self._discard()
            return
        header, completed = self._read_journal()
        if header is None:  # died before its first block: nothing worth keeping
            self.messages.append(f"the interrupted run of {self.output} had written nothing; "
                                 "starting from the beginning")
            self._discard()
            return
        other = [f"{label} {_show(header[key]) if key in header else 'unknown'} "
                 f"(now {_show(self.provenance[key])})"
                 for key, label in _PROVENANCE.items() if header.get(key) != self.provenance[key]]
        if other:
            raise UsageError(f"--resume: the interrupted run of {self.output} was written by another "
                             f"tldp: {', '.join(other)}; its blocks cannot be mixed with this one's. "
                             "Resume it with that tldp, or rerun without --resume "
                             "to start over")
        recorded = header["options"]
        differ = [key for key in sorted(set(recorded) | set(self.options))
                  if recorded.get(key) != self.options.get(key)]
        if differ:
            listing = ", ".join(f"{key} {_show(recorded.get(key))} (now {_show(self.options.get(key))})"
                                for key in differ)
            raise UsageError(f"--resume: the interrupted run of {self.output} used other options: "
                             f"{listing}; rerun with the same options (and the same --seed), or "
                             "without --resume to start over")
        self.resuming = True
        self.completed = completed
        self._fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)

    def _read_journal(self) -> tuple[dict[str, Any] | None, dict[tuple[str, int, int], dict[str, Any]]]:
        """The journal's first line (options, version, layout) and the finished blocks with
        their notes."""
        try:
            lines = self.journal.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            return None, {}
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except ValueError:  # the last line of a run killed while writing it
                break
        if not entries or not isinstance(entries[0], dict) or entries[0].get("journal") != JOURNAL_VERSION:
            return None, {}
        if not isinstance(entries[0].get("options"), dict) or not self.store.is_dir():
            return None, {}
        try:
            return entries[0], {(e["array"], e["start"], e["stop"]): e.get("note") or {} for e in entries[1:]}
        except (KeyError, TypeError, AttributeError):
            return None, {}

    def _discard(self) -> None:
        shutil.rmtree(self.root)
        self.release()

    def _start(self) -> None:
        self.root.mkdir()
        self._acquire()

    def begin(self) -> None:
        """Record the options, once the output's skeleton is complete under `store`."""
        if self.resuming:
            return
        self._fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self._append({"journal": JOURNAL_VERSION, **self.provenance, "options": self.options})

    def done(self, array: str, start: int, stop: int, note: dict[str, Any]) -> None:
        self._append({"array": array, "start": start, "stop": stop, **({"note": note} if note else {})})

    def _append(self, entry: dict[str, Any]) -> None:
        assert self._fd is not None  # open from begin() (or the resumed journal's) until release()
        os.write(self._fd, (json.dumps(entry) + "\n").encode())  # one write: whole lines

    def release(self) -> None:
        for fd in (self._fd, self._lock):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock = None

    def remove(self) -> None:
        """Throw the partial output away (the run failed for a reason a rerun will not fix)."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.release()
