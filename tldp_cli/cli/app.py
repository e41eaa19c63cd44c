"""The `tldp` application: one line per failure, exit codes, and what every command
runs with (the library call in `run`, JSON output, signals, the progress bar).

stdout carries a command's result only (--json, the seed, the ledger's listing), which -q
never silences; everything else goes to stderr: errors and the warnings that ask for a
change nothing records, always; the rest (progress, notes, summaries, a run's warnings,
which its manifest keeps) unless -q (docs/output.md#what-a-command-prints).
"""

import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from tldp_cli import __version__
from tldp_cli.cli import coercion
from tldp_cli.errors import TldpError, UsageError, reason_of
from tldp_cli.formats import listing, of_source, plural
from tldp_cli.files import output

DEBUG_ENV = "TLDP_DEBUG"
SEED_ENV = "TLDP_SEED"


class _OneLineErrors(TyperGroup):
    """Every failure is one line on stderr: exit 2 for usage errors, 1 otherwise."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        prog_name = prog_name or "tldp"
        coercion.install(self)  # options coerced without pydantic (a tenth of a second) where plain
        words = list(sys.argv[1:] if args is None else args)
        if not os.environ.get(f"_{prog_name.upper()}_COMPLETE"):
            args = words = self._aliased(words)
            if self._bare(words):
                self._help(prog_name, words)  # a bare `tldp` or `tldp perturb`: the help, as is
        try:
            code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        except typer.TyperException as exc:  # Typer's usage errors carry exit code 2
            message = exc.format_message()
            message = message[:-1] if message.endswith(".") and not message.endswith("..") else message
            fail(f"{message} (see '{self._help_command(exc, words)}')", exc.exit_code)
        except typer.Abort:
            fail("interrupted; nothing was written", 130)
        except _StdoutFailed as exc:
            _quiet_stdout()
            fail(str(exc), 1)
        sys.exit(code if isinstance(code, int) else 0)

    # Typer turns a closed stdout (EPIPE) into a silent exit 1, a full one (ENOSPC: `--json >
    # m.json` on a full disk) into a traceback, and Ctrl-C or SIGTERM outside a run (a command
    # importing what it needs) into a silent exit 130; these make each one line, as every
    # other failure: the root's --help and --version run in make_context, the rest in invoke.
    def make_context(self, *args, **kwargs):
        with _one_line_failures():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_failures():
            return super().invoke(ctx)

    def _help_command(self, exc: Exception, words: list[str]) -> str:
        """Where a usage error's help is: the command's (`tldp perturb --help`), or the root's
        for an unknown command or a root option; Click's parser gives some errors no context
        (an option's value where it takes none): the command the words name, then."""
        ctx = getattr(exc, "ctx", None)
        if ctx is not None:
            command = ctx.info_name if ctx.parent is not None else None
        else:
            command = words[0] if words and words[0] in self.commands else None
        return f"tldp {command} --help" if command else "tldp --help"

    def _aliased(self, words: list[str]) -> list[str]:
        """A deprecated flag that stood for a command of its own (`evaluate --sweep`) runs
        that command, the flag taken out, after one line on stderr naming it."""
        options = words[1:words.index("--")] if "--" in words else words[1:]
        for flag in options if words else ():
            target = DEPRECATED_FLAGS.get((words[0], flag))
            if target is not None:
                # a warning that asks for a change no manifest records: printed with -q too
                typer.echo(f"tldp: warning: 'tldp {words[0]} {flag}' is deprecated and will be removed; "
                           f"use 'tldp {target}', which takes the same options", err=True)
                rest = list(words[1:])
                rest.remove(flag)
                return [target, *rest]
        return words

    def get_params(self, ctx):
        """The root's bare flags (--help, --install-completion, --show-completion) default to
        False rather than None: Typer skips coercing a flag's bool, and its first coercion
        imports pydantic (a tenth of a second), which `tldp perturb --help`, completion and a
        bad flag then never pay (tests/cli/test_startup.py)."""
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.default is None:
                param.default = False
        return params

    def _bare(self, words: list[str]) -> bool:
        """No words, or only a command that needs arguments (no_args_is_help)."""
        if not words:
            return True
        command = self.commands.get(words[0]) if len(words) == 1 else None
        return bool(command is not None and getattr(command, "no_args_is_help", False))

    def _help(self, prog_name: str, words: list[str]) -> None:
        with self.make_context(prog_name, [], resilient_parsing=True) as ctx:
            if words:
                command = self.commands[words[0]]
                # a context for the help text alone: parsing the command's options would
                # coerce each one, and Typer's coercion imports pydantic
                with command.context_class(command, info_name=words[0], parent=ctx) as sub:
                    typer.echo(command.get_help(sub), err=True)
            else:
                typer.echo(self.get_help(ctx), err=True)
        sys.exit(2)


STDOUT_CLOSED = ("standard output: closed before all of it was printed (broken pipe: the program "
                 "reading it, `head` say, stopped)")


class _StdoutFailed(Exception):
    """Writing to stdout failed (not an OSError, which Typer would swallow or show as a
    traceback); its text is the one line."""


@contextlib.contextmanager
def _one_line_failures():
    try:
        yield
    except KeyboardInterrupt as exc:  # not one a run reported (those exit inside it)
        raise typer.Abort from exc
    except RuntimeError as exc:
        if wrapped_interrupt(exc):
            raise typer.Abort from exc
        raise
    except OSError as exc:
        # every file a command reads or writes is handled inside its run (`run`, `failure`):
        # an OSError out here, with no file name, is the printing of --json, --help or a listing
        if exc.filename is not None:
            raise
        raise _StdoutFailed(_stdout_failure(exc)) from exc


def wrapped_interrupt(exc: BaseException) -> bool:
    """A Ctrl-C or SIGTERM that landed in a class's __set_name__ while a module was imported:
    Python 3.11 raises it as a RuntimeError whose cause is the KeyboardInterrupt."""
    return isinstance(exc, RuntimeError) and isinstance(exc.__cause__, KeyboardInterrupt)


def _stdout_failure(exc: OSError) -> str:
    if exc.errno == errno.EPIPE:
        return STDOUT_CLOSED
    return f"standard output: cannot write ({reason_of(exc)})"


def _quiet_stdout() -> None:
    """stdout to /dev/null, so the interpreter's last flush of what is left does not fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# (command, flag) -> the command it stands for: `tldp evaluate --sweep ...` runs `tldp sweep ...`.
DEPRECATED_FLAGS: dict[tuple[str, str], str] = {}


def deprecated_flag(command: str, flag: str, target: str) -> None:
    """Make `tldp COMMAND FLAG ...` a deprecated alias of `tldp TARGET ...` (the flag dropped)."""
    DEPRECATED_FLAGS[(command, flag)] = target


def fail(message: str, code: int):
    message = " ".join(message.split())  # one line, even when an embedded message has several
    typer.echo(f"tldp: error: {message}", err=True)
    sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors, rich_markup_mode=None, add_completion=True, no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        typer.echo(f"tldp {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
):
    """Local differential privacy (TLDP) for tensor datasets on disk.

    \b
    Examples:
      tldp perturb sample_data/digits.npy --eps 1 --noise gaussian
      tldp perturb data.npy --eps 1 --range 0:1 --out noisy.npy --json
      tldp weight-mask photos/ --method box --boxes faces.csv --out masks --preview check.png
      tldp evaluate sample_data/digits.npy sample_data/digits.tldp.npy
      tldp sweep sample_data/digits.npy --eps 0.1,1,10 --out sweep/
      tldp audit --eps 1 --elements 4 --range 0:1
      tldp plan --elements 28x28 --range 0:256 --eps 8 --budget record
    """


def debugging(flag: bool) -> bool:
    """--debug, or TLDP_DEBUG set to anything but empty, 0, false, no or off (a pipeline's
    `TLDP_DEBUG=0` turns it off, as it does Click's boolean variables)."""
    value = os.environ.get(DEBUG_ENV, "").strip().lower()
    return flag or value not in ("", "0", "false", "no", "off", "n", "f")


def run(debug: bool, action):
    """Run a library call; a TldpError becomes one line and exit 1 (2 for usage), and so
    does any other exception (a bug: the traceback with --debug), as `failure` says it."""
    try:
        with library_warnings(debug):
            return action()
    except KeyboardInterrupt as exc:  # an errors.Interrupted says what it kept
        fail(str(exc) or "interrupted; nothing was written", 130)
    except Exception as exc:
        if wrapped_interrupt(exc):  # during an import the run makes (the pipeline's)
            fail("interrupted; nothing was written", 130)
        fail(*failure(exc, debug))


@contextlib.contextmanager
def library_warnings(debug: bool):
    """Warnings from the libraries underneath (NumPy, dp-accounting, zarr) are the tool's
    internals: shown with --debug only; what the user needs to know the library says in
    its own messages."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            if debug:
                for warning in caught:
                    typer.echo(f"tldp: debug: {warning.category.__name__}: {warning.message} "
                               f"({warning.filename}:{warning.lineno})", err=True)


def failure(exc: Exception, debug: bool) -> tuple[str, int]:
    """The one line and the exit code for an exception a library call raised: 2 for a
    UsageError, 1 for the rest; with --debug the traceback first."""
    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, UsageError):
        return str(exc), 2
    if isinstance(exc, TldpError):
        return str(exc), 1
    if isinstance(exc, _StdoutFailed):  # --json printed inside a run (emit_json)
        _quiet_stdout()
        return str(exc), 1
    if isinstance(exc, OSError):
        return f"{exc.filename or 'I/O'}: {reason_of(exc)}", 1
    if isinstance(exc, MemoryError):
        return f"ran out of memory ({reason_of(exc)}); free memory, or work on less data at once", 1
    # a bug, not the user's doing: still one line without --debug
    detail = f": {exc}" if str(exc).strip() else ""
    return (f"unexpected error ({type(exc).__name__}{detail}); please report it, and rerun with "
            "--debug for the traceback"), 1


def shown(value, spec: str = ".4g") -> str:
    """A figure in a printed table: formatted with `spec`, or "-" for None."""
    return "-" if value is None else format(value, spec)


def emit_json(data: dict, to_stdout: bool, path: Path | None, overwrite: bool) -> None:
    """--json prints the report to stdout; --report PATH writes it (complete or not at all),
    readable by its owner only: evaluate's and sweep's reports are computed from the raw data."""
    text = json.dumps(data, indent=2, allow_nan=False)
    if path is not None:
        output.write_files({Path(path): (text + "\n").encode()}, overwrite, private=True)
    if to_stdout:
        try:
            typer.echo(text)
        except OSError as exc:
            raise _StdoutFailed(_stdout_failure(exc)) from exc


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM stops a run as Ctrl-C does, so its temporary output is cleaned up (or, when
    resumable, kept for --resume) instead of the process just vanishing. The console script
    has done so already (entry.py), for good: once the output starts moving into place,
    both stay ignored until the process exits."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) is output.interrupt:
        yield
        return
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def kept_signals():
    """Yields `restore`, which puts back the Ctrl-C and SIGTERM handlers in place on entry.
    Once a run's output is in place the run ignores both until the process exits
    (files.output.uninterruptible); with several inputs the next input is a run of its own,
    which they stop again."""
    numbers = (signal.SIGINT, signal.SIGTERM)
    saved = {n: signal.getsignal(n) for n in numbers}

    def restore():
        if threading.current_thread() is threading.main_thread():
            for number, handler in saved.items():
                signal.signal(number, signal.SIG_DFL if handler is None else handler)

    yield restore


def bar_size() -> dict:
    """tqdm's size options for stderr's terminal. A terminal that reports 0 rows (or 0
    columns: `script`, `docker exec -t`, a CI job's pseudo-terminal) makes tqdm show nothing
    at all; there the bar gets a fixed size, 80 columns and 20 rows where it says 0."""
    try:
        columns, rows = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # not a real file (a test's stand-in)
        return {"dynamic_ncols": True}
    return {"dynamic_ncols": True} if columns and rows else {"ncols": columns or 80, "nrows": rows or 20}


def progress_bar(quiet: bool, label: str, unit: str):
    """A tqdm callback on a terminal, None otherwise (pipes and CI logs stay clean); its bar
    labelled as perturb's is ("tldp: evaluating: 45%|... | 180/400 [..., 150.00 records/s]")."""
    if quiet or not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm

    bar = None

    def advance(done: int, total: int):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=f"tldp: {label}", unit=f" {unit}", file=sys.stderr, leave=False,
                       **bar_size())
        bar.update(done)

    return advance, lambda: bar is not None and bar.close()


class Display:
    """perturb's and plan's progress on stderr. With -v, one line as each phase starts,
    saying what it does. On a terminal (never with -q): the current phase's label once it
    has lasted a second ("tldp: planning (0:03)"), then, as the records are perturbed, the
    labelled records bar. `phase` and `advance` are a run's Phase and Progress."""

    DELAY = 1.0  # seconds a phase runs before its label is shown

    def __init__(self, quiet: bool, verbose: bool):
        self.live = not quiet and sys.stderr.isatty()
        self.verbose = verbose and not quiet
        self.prefix = ""  # several inputs: "[2/5] "
        self.name = ""  # several inputs: "a.npy: ", on the terminal's label and bar
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._label: str | None = None
        self._since = 0.0
        self._shown = None  # the tqdm showing the label or the bar

    def phase(self, label: str, what: str) -> None:
        with self._lock:
            self._close_shown()
            self._label, self._since = label, time.monotonic()
            if self.verbose:
                typer.echo(f"tldp: {self.prefix}{label}: {what}", err=True)
        if self.live and self._thread is None:
            self._thread = threading.Thread(target=self._tick, name="tldp-progress", daemon=True)
            self._thread.start()

    def advance(self, done: int, total: int) -> None:
        if not self.live:
            return
        from tqdm import tqdm

        with self._lock:
            if self._label is not None:  # the records bar replaces the phase's label
                self._close_shown()
                self._label = None
                self._shown = tqdm(total=total, desc=f"tldp: {self.prefix}{self.name}perturbing", unit=" records",
                                   file=sys.stderr, leave=False, **bar_size())
            if self._shown is not None:
                self._shown.update(done)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._close_shown()
            self._label = None
        self._stop.clear()

    def _close_shown(self) -> None:
        if self._shown is not None:
            self._shown.close()
            self._shown = None

    def _tick(self) -> None:
        from tqdm import tqdm

        while not self._stop.wait(0.25):
            with self._lock:
                if self._label is None:
                    continue
                lasted = time.monotonic() - self._since
                if self._shown is None and lasted < self.DELAY:
                    continue
                text = f"tldp: {self.prefix}{self.name}{self._label} ({tqdm.format_interval(lasted)})"
                if self._shown is None:
                    self._shown = tqdm(total=None, desc=text, bar_format="{desc}", file=sys.stderr, leave=False,
                                       **bar_size())
                else:
                    self._shown.set_description_str(text)  # and shows it


def records_phrase(manifest: dict) -> str:
    """What a run perturbs, as perturb's and plan's summary lines say it: tensors of a
    model file, subjects' records spanning several arrays, or records of one or more sizes."""
    rows = manifest.get("row_records")
    sizes = {c["elements_per_record"] for c in manifest.get("calibrations") or []}
    if "per_tensor" in manifest["accounting"]:
        return f"{plural(manifest['records'], 'tensor')}, the largest of {manifest['elements_per_record']} elements"
    if rows:
        return (f"{plural(rows['records'], 'record')} of up to {rows['elements_per_record']} elements, a "
                "record being one row of each array that shares it")
    if len(sizes) > 1:
        return f"{plural(manifest['records'], 'record')} of up to {manifest['elements_per_record']} elements"
    return f"{plural(manifest['records'], 'record')} x {manifest['elements_per_record']} elements"


def _auto_reference_groups(manifest: dict) -> list[dict]:
    """The privunit calibration of each group of records (the run's one where it has a single
    group) of a run under --reference auto; [] for any other run."""
    unit = manifest.get("privunit")
    if not unit or unit.get("reference_option") != "auto":
        return []
    return [c["privunit"] for c in manifest.get("calibrations") or [] if "privunit" in c] or [unit]


def reference_hint(manifest: dict) -> str:
    """A clause for privunit's summary line where --reference auto measures records that are
    not colour images from an end of a declared range that does not hold 0 (200 K for
    200:330): their releases lean to that end; "" otherwise (the rule itself is unchanged)."""
    from tldp_cli.privacy.privunit import is_colour_image

    groups = _auto_reference_groups(manifest)
    if not any(float(g["reference"]) != 0 and not is_colour_image(tuple(g["record_shape"])) for g in groups):
        return ""
    return "; the range does not hold 0, so auto measures records from its end: --reference mid centres the releases"


# privunit's output scale c, one run's or each group's: 5 significant digits, so that a 16-bit
# range's (65536) is written out, not 6.554e+04.
SCALE = ".5g"


def privunit_phrase(manifest: dict) -> str:
    """--mechanism privunit, as plan's summary line says it: the basis, k, the split and the
    write-back's scale and reference point; each group's where the records' sizes or ranges
    give them several calibrations that differ in these."""
    unit = manifest["privunit"]
    figures = manifest["accounting"].get("privunit") or {}
    basis = "DCT-II" if unit["basis"]["kind"] == "dct" else "user"
    shown = ("record_shape", "k", "epsilon0", "output_scale", "reference")
    groups = [(c["records"], c["privunit"]) for c in manifest.get("calibrations") or [] if "privunit" in c]
    if len({tuple(str(group[key]) for key in shown) for _, group in groups}) > 1:
        each = "; ".join(f"{plural(n, 'record')} of {' x '.join(map(str, g['record_shape']))} on {g['k']} {basis} "
                         f"coefficients (eps0 {g['epsilon0']:.4g}), output scale {g['output_scale']:{SCALE}} around "
                         f"{g['reference']:g}" for n, g in groups)
        return (f"privunit, each group of records its own calibration (the manifest's calibrations): {each}; "
                f"cap share {figures.get('q', float('nan')):.3g}, expected alignment "
                f"{figures.get('expected_alignment', float('nan')):.3g} at k {figures.get('k')} (the guarantee's "
                f"group, accounting.privunit) (--reference {unit.get('reference_option', 'zero')}"
                f"{reference_hint(manifest)})")
    layout = f"{unit['basis']['layout']}; " if unit["basis"].get("layout") else ""  # 1-, 2- or 3-D, over which axes
    return (f"privunit on {unit['k']} {basis} coefficients ({layout}eps0 {unit['epsilon0']:.4g}, cap share "
            f"{figures.get('q', float('nan')):.3g}, expected alignment "
            f"{figures.get('expected_alignment', float('nan')):.3g}), output scale "
            f"{unit['output_scale']['c']:{SCALE}} around {unit['reference']:g} (--reference "
            f"{unit.get('reference_option', 'zero')}{reference_hint(manifest)})")


def reference_note(manifest: dict) -> str | None:
    """A hint for grayscale photos: under --mechanism privunit --reference auto, the single-channel
    images of an image folder (alone or beside colour ones) are written around 0 (auto's rule
    goes by the record's shape alone, and is right for digits on black), which darkens photos.
    None for any other run (arrays such as the .npy digits, colour images, another --reference)."""
    groups = _auto_reference_groups(manifest) if manifest.get("inputs") else []
    gray = [group["reference"] for group in groups if len(group["record_shape"]) == 2]  # (H, W): one channel
    if not gray or not all((fmt := of_source(entry)) is not None and fmt.records_are_files  # an image folder's
                           for entry in manifest["inputs"]):
        return None
    return (f"note: the grayscale images are written around {gray[0]:g} (--reference auto goes by the "
            "record's shape: right for digits on black); grayscale photos come out dark that way, pass "
            "--reference mid for them (docs/choosing-eps.md#photos-the-reference-point)")


def unperturbed_note(manifest: dict) -> str:
    """What a run writes raw beside the perturbed values (the manifest's `unperturbed`: tensors,
    coordinates, what --keep names), by reason, and how much it leaves out (`dropped`), by kind."""
    by_reason: dict[str, list[str]] = {}
    for entry in manifest.get("unperturbed", []):
        by_reason.setdefault(entry["reason"], []).append(entry["name"])
    note = ""
    if by_reason:
        note = "; copied unchanged: " + "; ".join(f"{listing(names)} ({reason})"
                                                  for reason, names in by_reason.items())
    kinds: dict[str, int] = {}
    for entry in manifest.get("dropped", []):
        kind = entry.get("kind") or "item"  # an entry may stand for several (WebDataset members)
        kinds[kind] = kinds.get(kind, 0) + entry.get("members", 1)
    if kinds:  # one colour-profile (alpha-channel) entry stands for every image's: its number is in its reason
        counts = [kind + "s" if kind in ("colour profile", "alpha channel") else plural(n, kind)
                  for kind, n in kinds.items()]
        counted = ", ".join(counts[:-1]) + " and " + counts[-1] if len(counts) > 1 else counts[0]
        note += f"; dropped {counted} (not perturbed, not written: listed in the manifest)"
    return note


def main():
    app()
