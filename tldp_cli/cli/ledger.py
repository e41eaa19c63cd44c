"""`tldp ledger`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from tldp_cli.cli.options import Quiet, Debug
from tldp_cli.cli.app import DEBUG_ENV, app, run


@app.command("ledger", no_args_is_help=True)
def ledger_command(
    path: Annotated[Path, typer.Argument(readable=False, metavar="LEDGER", help="A ledger written by perturb --ledger.",
                                         show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the ledger as JSON to stdout.")] = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """List the datasets of a release ledger, their releases and what they spend together.

    A dataset is identified by a keyed fingerprint of its content (the key lives in the
    ledger): a copy at another path is the same data. Pending releases are runs that were
    killed after recording their release; they count as spent.

    \b
    Examples:
      tldp ledger ledger.db
      tldp ledger ledger.db --json > releases.json
    """
    from tldp_cli.run import ledger as ledger_mod

    debug = debug or bool(os.environ.get(DEBUG_ENV))
    report = run(debug, lambda: ledger_mod.listing(path))
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False))
        return
    if quiet:
        return
    for dataset in report["datasets"]:
        total = dataset["cumulative_per_record"]
        typer.echo(f"data {dataset['fingerprint'][:16]}: {total['releases']} release(s)"
                   + (f", {total['pending']} pending" if total["pending"] else "")
                   + f"; together, each record (eps={total['epsilon']:.4g}, delta={total['delta']:.3g})")
        for r in dataset["releases"]:
            record = r["per_record"]
            typer.echo(f"  #{r['id']} {r['created']} {r['status']:8} {r['input']} -> {r['output']}: "
                       f"each record (eps={record['epsilon']:.4g}, delta={record['delta']:.3g})")
    if not report["datasets"]:
        typer.echo("no releases recorded", err=True)


