"""The console script. Importing the CLI takes a noticeable moment (NumPy, Typer, the
accountant); Ctrl-C during it, or anywhere outside a run, ends with one line, not a
traceback."""

import sys


def main() -> None:
    try:
        from tldp_cli.cli import main as run_cli  # imported here so that Ctrl-C while importing is caught

        run_cli()
    except KeyboardInterrupt:
        sys.stderr.write("tldp: error: interrupted; nothing was written\n")
        sys.exit(130)
