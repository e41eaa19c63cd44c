"""The `tldp` command: one module per command over plain library functions.

`app` is the Typer application, `main` the console script.
"""

# Importing a command's module registers it; --help lists the commands in this order.
from tldp_cli.cli import perturb, weight_mask, evaluate, sweep, plan, ledger, audit, seed  # noqa: F401, I001
from tldp_cli.cli.app import app, main

__all__ = ["app", "main"]
