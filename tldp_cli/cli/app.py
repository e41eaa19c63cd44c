"""The `tldp` application: one line per failure, exit codes, and what every command
runs with (the library call in `run`, JSON output, signals, the progress bar).

Human-readable text goes to stderr; stdout carries only machine output (--json).
"""

import contextlib
import json
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from tldp_cli import __version__
from tldp_cli.errors import TldpError, UsageError, reason_of
from tldp_cli.formats import listing, plural
from tldp_cli.files import output

DEBUG_ENV = "TLDP_DEBUG"
SEED_ENV = "TLDP_SEED"


class _OneLineErrors(TyperGroup):
    """Every failure is one line on stderr: exit 2 for usage errors, 1 otherwise."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        prog_name = prog_name or "tldp"
        words = list(sys.argv[1:] if args is None else args)
        if not os.environ.get(f"_{prog_name.upper()}_COMPLETE") and self._bare(words):
            self._help(prog_name, words)  # a bare `tldp` or `tldp perturb`: the help, as is
        try:
            code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        except typer.TyperException as exc:  # Typer's usage errors carry exit code 2
            ctx = getattr(exc, "ctx", None)
            hint = f" (see 'tldp {ctx.info_name} --help')" if ctx is not None and ctx.parent else ""
            fail(f"{exc.format_message()}{hint}", exc.exit_code)
        except typer.Abort:
            fail("interrupted; nothing was written", 130)
        sys.exit(code if isinstance(code, int) else 0)

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
      tldp audit --eps 1 --elements 4 --range 0:1
      tldp plan --elements 28x28 --range 0:256 --eps 8 --budget record
    """


def run(debug: bool, action):
    """Run a library call; a TldpError becomes one line and exit 1 (2 for usage), and so
    does any other exception (a bug: the traceback with --debug). Warnings from the
    libraries underneath (NumPy, dp-accounting, zarr) are the tool's internals: shown with
    --debug only; what the user needs to know the library says in its own messages."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return action()
            finally:
                if debug:
                    for warning in caught:
                        typer.echo(f"tldp: debug: {warning.category.__name__}: {warning.message} "
                                   f"({warning.filename}:{warning.lineno})", err=True)
    except UsageError as exc:
        if debug:
            traceback.print_exc()
        fail(str(exc), 2)
    except TldpError as exc:
        if debug:
            traceback.print_exc()
        fail(str(exc), 1)
    except KeyboardInterrupt as exc:  # an errors.Interrupted says what it kept
        fail(str(exc) or "interrupted; nothing was written", 130)
    except OSError as exc:
        if debug:
            traceback.print_exc()
        where = exc.filename or "I/O"
        fail(f"{where}: {reason_of(exc)}", 1)
    except MemoryError as exc:
        if debug:
            traceback.print_exc()
        fail(f"ran out of memory ({reason_of(exc)}); free memory, or work on less data at once", 1)
    except Exception as exc:  # a bug, not the user's doing: still one line without --debug
        if debug:
            traceback.print_exc()
        detail = f": {exc}" if str(exc).strip() else ""
        fail(f"unexpected error ({type(exc).__name__}{detail}); please report it, and rerun with "
              "--debug for the traceback", 1)



def emit_json(data: dict, to_stdout: bool, path: Path | None, overwrite: bool) -> None:
    """--json prints the report to stdout; --report PATH writes it (complete or not at all)."""
    text = json.dumps(data, indent=2, allow_nan=False)
    if path is not None:
        output.write_files({Path(path): (text + "\n").encode()}, overwrite)
    if to_stdout:
        typer.echo(text)


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


def progress_bar(quiet: bool, unit: str):
    """A tqdm callback on a terminal, None otherwise (pipes and CI logs stay clean)."""
    if quiet or not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm

    bar = None

    def advance(done: int, total: int):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
        bar.update(done)

    return advance, lambda: bar is not None and bar.close()



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


def privunit_phrase(manifest: dict) -> str:
    """--mechanism privunit, as plan's summary line says it: the basis, k and the split."""
    unit = manifest["privunit"]
    figures = manifest["accounting"].get("privunit") or {}
    basis = "DCT-II" if unit["basis"]["kind"] == "dct" else "user"
    return (f"privunit on {unit['k']} {basis} coefficients (eps0 {unit['epsilon0']:.4g}, cap share "
            f"{figures.get('q', float('nan')):.3g}, expected alignment "
            f"{figures.get('expected_alignment', float('nan')):.3g}), output scale "
            f"{unit['output_scale']['c']:.4g}")


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
        kinds[entry.get("kind") or "item"] = kinds.get(entry.get("kind") or "item", 0) + 1
    if kinds:
        counts = [plural(n, kind) for kind, n in kinds.items()]
        counted = ", ".join(counts[:-1]) + " and " + counts[-1] if len(counts) > 1 else counts[0]
        note += f"; dropped {counted} (not perturbed, not written: listed in the manifest)"
    return note


def main():
    app()
