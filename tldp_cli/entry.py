"""The console script. Importing takes a noticeable moment (Typer for the CLI, then NumPy
and the accountant inside a command that needs them); Ctrl-C or SIGTERM during it, or
anywhere outside a run, ends with one line, not a traceback."""

import signal
import sys


def _take_signals() -> None:
    """Ctrl-C and SIGTERM stop the command (KeyboardInterrupt: one line, exit 130) until a
    run starts moving its output into place; from then on they are ignored until the
    process exits, which it does with 0 (output.interrupt). A signal the process was
    started with ignored (Ctrl-C in a shell's background job) stays ignored."""
    from tldp_cli.files import output

    for number, unchanged in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(number) is unchanged:
            signal.signal(number, output.interrupt)


def main() -> None:
    try:
        _take_signals()
        from tldp_cli.cli import main as run_cli  # imported here so that Ctrl-C while importing is caught

        run_cli()
    except KeyboardInterrupt:
        sys.stderr.write("tldp: error: interrupted; nothing was written\n")
        sys.exit(130)
