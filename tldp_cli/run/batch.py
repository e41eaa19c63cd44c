"""Several inputs in one call (`tldp perturb a.npy b.npy dir/ --eps 1`, `--inputs-from FILE`).

Each input is its own run, exactly as if it were given alone: its own output under its
default name (inside --out, which then names a folder) and its own manifest, complete or
absent, and with --ledger its own release. They share the process: the start-up, and the
accountant's work for every calibration they have in common (calibration.certified_figures).
A failed input does not stop the others; what each gave is yielded in input order.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from typing import Any
from dataclasses import dataclass
from pathlib import Path

from tldp_cli import formats
from tldp_cli.errors import NotHeld, OutputError, TldpError, UsageError
from tldp_cli.files import local
from tldp_cli.run.calibration import arrays_named
from tldp_cli.run.context import Phase, Progress
from tldp_cli.run.options import PerturbOptions, checked_options
from tldp_cli.run.pipeline import PerturbResult, checked_format_options, once_each, output_of, perturb, without_unheld


@dataclass
class Outcome:
    """One input's run: its result, or the exception that stopped it (nothing of it written)."""

    input: Path
    result: PerturbResult | None = None
    error: Exception | None = None


def input_list(text: str, where: str) -> list[Path]:
    """The inputs listed in `text` (--inputs-from), one path per line; blank lines skipped.
    A stream (`-`) or a URL is refused, naming the line, and so is a list holding a NUL
    byte (find -print0), which no path can hold."""
    if "\0" in text:
        raise UsageError(f"{where}: holds a NUL byte; list one path per line (find -print, not -print0)")
    paths = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        problem = local.problem(line, stream=local.STDIN)
        if problem:
            raise UsageError(f"{where}, line {number}: {problem}")
        paths.append(Path(line))
    if not paths:
        raise UsageError(f"{where}: lists no input (one path per line)")
    return paths


def prepare(options: PerturbOptions, inputs: list[Path]) -> list[PerturbOptions]:
    """The options of each input's run, refusing before any of them what cannot work for
    several: one --manifest, --preview or --name-map for all, a seed (the same noise on
    inputs of the same shape), an input given twice, two outputs in one place, an output
    that is another input, an --out that is not an existing folder, and a --keep or
    --range NAME=LO:HI that matches nothing in any input."""
    options = checked_options(options)
    for flag, value in (("--manifest", options.manifest), ("--name-map", options.name_map)):
        if value is not None:
            raise UsageError(f"{flag} names one file; with several inputs each goes beside its output")
    if options.seed is not None:
        raise UsageError("a seed is for one release: with several inputs, inputs of the same shape would "
                         "get the same noise; run them without a seed, or one by one with a seed each")
    if options.out is not None:
        folder = str(options.out)
        if not Path(folder).is_dir():
            raise OutputError(f"{folder}: with several inputs --out names the folder their outputs go in, "
                              "and it does not exist")
        options = dataclasses.replace(options, out=folder.rstrip("/" + os.sep) + os.sep)
    each = [dataclasses.replace(options, input=path) for path in inputs]
    if options.resume:  # continues the inputs that can be continued; the others run as usual
        each = [_resume_if_resumable(o) for o in each]
    _check_distinct(each)
    check_names(each)
    return each


def check_names(each: list[PerturbOptions]) -> None:
    """Refuses a --keep or --exclude pattern or a --range NAME=LO:HI that matches nothing in
    any input (a typo would drop what the user meant to keep, perturb what was meant to be
    left out, or perturb an array at another range); one that some input holds is fine for
    the others, which take what they hold of them (pipeline.without_unheld). Opens the
    inputs' readers in turn until every name has matched; an input that cannot be opened
    matches nothing here (its own run says why)."""
    pending = {"keep": list(each[0].keep), "exclude": list(each[0].exclude)} if each else {}
    ranges = list(each[0].ranges) if each and each[0].clip is None else []
    for options in each:
        if not any(pending.values()) and not ranges:
            return
        try:
            module = formats.detect(options.input, options.input_format)
            reader, unheld = _reader_without_unheld(
                dataclasses.replace(options, keep=pending["keep"], exclude=pending["exclude"]), module)
            try:
                jobs = reader.arrays()
            finally:
                reader.close()
            pending = unheld
            ranges = [name for name in ranges if not arrays_named(name, jobs)]
        except Exception:  # noqa: BLE001 (any failure is that input's own run's to report)
            continue
    if pending.get("keep"):
        raise UsageError(f"--keep {pending['keep'][0]} matches no dataset, attribute, column or file of any "
                         "input (give a path, PATH@ATTRIBUTE, or a glob of them)")
    if pending.get("exclude"):
        raise UsageError(f"--exclude {pending['exclude'][0]} matches no dataset or tensor of any input")
    if ranges:
        raise UsageError(f"--range {ranges[0]}=... names no array of any input")


def _reader_without_unheld(options: PerturbOptions, module) -> tuple[Any, dict[str, list[str]]]:
    """The input's reader, opened without the --keep and --exclude patterns it does not hold
    (errors.NotHeld), and those patterns by option."""
    unheld: dict[str, list[str]] = {"keep": [], "exclude": []}
    for _ in range(len(unheld)):
        try:
            return module.open_reader(options.input, checked_format_options(options, module)), unheld
        except NotHeld as exc:
            if exc.option not in unheld:
                raise
            unheld[exc.option] += exc.names
            patterns = [p for p in getattr(options, exc.option) if p not in exc.names]
            options = (dataclasses.replace(options, keep=patterns) if exc.option == "keep"
                       else dataclasses.replace(options, exclude=patterns))
    return module.open_reader(options.input, checked_format_options(options, module)), unheld


def _resume_if_resumable(options: PerturbOptions) -> PerturbOptions:
    """--resume for an input whose format keeps an interrupted run's blocks (Zarr); none for
    the others, whose interrupted runs left nothing to continue."""
    try:
        module = formats.detect(options.input, options.input_format)
    except Exception:  # noqa: BLE001 (its own run says what is wrong with it)
        return options
    return options if module.resumable else dataclasses.replace(options, resume=False)


def _check_distinct(each: list[PerturbOptions]) -> None:
    seen: dict[str, tuple[int, Path]] = {}  # by absolute path: the input (its index) that names it
    real: dict[str, tuple[int, Path]] = {}  # by the path with its links resolved: one file by two names
    for i, options in enumerate(each):
        for path in _named_paths(options):
            key, resolved = os.path.abspath(path), os.path.realpath(path)
            twice = seen.get(key) or real.get(resolved)
            if twice is not None and twice[0] != i:
                also = f", which names {path}" if path != options.input else ""
                raise UsageError(f"{options.input}: given twice (as {twice[1]} and {options.input}{also})")
            seen[key] = real[resolved] = (i, options.input)
    _check_not_inside({resolved: path for resolved, (_, path) in real.items()})
    _check_no_hard_links(each)
    written: dict[str, Path] = {}
    for options in each:
        destination = _destination(options)
        if destination is None:
            continue  # its run reports what is wrong with it
        key = os.path.abspath(destination)
        if key in written:
            raise UsageError(f"{written[key]} and {options.input} would both write {destination}; "
                             "run them separately, or with --out in different folders")
        if key in seen:
            raise UsageError(f"{options.input} would write {destination}, which is another input; "
                             "run them separately")
        written[key] = options.input


def _check_not_inside(real: dict[str, Path]) -> None:
    """Refuses an input inside another (a shard and its folder of shards): its data would be
    released twice, with noise of its own each time, and each manifest state one release."""
    for resolved, path in real.items():
        for parent in Path(resolved).parents:
            outer = real.get(str(parent))
            if outer is not None:
                raise UsageError(f"{path}: inside another input, {outer}, which releases it too; "
                                 "give one of them")


def _named_paths(options: PerturbOptions) -> list[Path]:
    """The paths an input names: itself, or the files a pattern names (the shards of a brace
    pattern), so that a shard given beside its pattern is caught as given twice."""
    if os.path.lexists(options.input):
        return [options.input]
    try:
        return formats.detect(options.input, options.input_format).pattern_files(options.input) or [options.input]
    except Exception:  # noqa: BLE001 (its own run says what is wrong with it)
        return [options.input]


def _check_no_hard_links(each: list[PerturbOptions]) -> None:
    """Refuses two names of one file by (st_dev, st_ino): hard links given as two inputs, an
    input and a file inside a folder input, or two files inside one folder input, which
    paths alone do not show."""
    owner: dict[tuple[int, int], tuple[int, Path]] = {}  # file -> (its input's index, its path)
    for i, options in enumerate(each):
        for identity, path in (found for named in _named_paths(options) for found in _files_of(named)):
            first = owner.setdefault(identity, (i, path))
            if first[0] != i:
                raise UsageError(f"{options.input}: given twice ({first[1]} and {path} are the same file, "
                                 "hard links to it); give one of them")
            if first[1] != path:  # inside one folder input (formats.folder_files refuses it alone too)
                raise UsageError(f"{options.input}: {first[1]} and {path} are the same file (hard links to "
                                 "it), which would be released twice, as two records; give one of them")


def _files_of(path: Path) -> Iterator[tuple[tuple[int, int], Path]]:
    """(st_dev, st_ino) and path of the files an input is: a file, or the regular files in a
    folder that other names may share (hard links: more than one link). Symbolic links are
    not followed (folder formats never read through them)."""
    try:
        info = os.stat(path)
    except OSError:
        return  # its own run says what is wrong with it
    if not os.path.isdir(path):
        yield (info.st_dev, info.st_ino), path
        return
    for directory, _, names in os.walk(path):
        for name in names:
            inner = os.path.join(directory, name)
            try:
                info = os.lstat(inner)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                yield (info.st_dev, info.st_ino), Path(inner)


def _destination(options: PerturbOptions) -> Path | None:
    try:
        return output_of(options, formats.detect(options.input, options.input_format))
    except (TldpError, OSError):
        return None


def perturb_each(each: list[PerturbOptions], progress: Progress | None = None, phase: Phase | None = None,
                 start=None) -> Iterator[Outcome]:
    """Run `prepare`'s options one after the other (`progress` and `phase` as perturb takes
    them); `start(i, options)` is told before each. An input's failure (any Exception) is
    its Outcome; Ctrl-C stops the whole call."""
    for i, options in enumerate(each):
        if start is not None:
            start(i, options)
        try:
            told = once_each(phase)
            yield Outcome(options.input, result=without_unheld(
                lambda o: perturb(o, progress=progress, phase=told), options))
        except Exception as exc:  # reported as that input's, and the next one runs
            yield Outcome(options.input, error=exc)
