"""`tldp ledger`."""

import json
from pathlib import Path
from typing import Annotated

import typer

from tldp_cli.cli.options import Quiet, Debug, file_path
from tldp_cli.cli.app import app, debugging, run


@app.command("ledger", no_args_is_help=True)
def ledger_command(
    path: Annotated[Path, typer.Argument(parser=file_path, metavar="LEDGER", help="A ledger written by perturb --ledger.",
                                         show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the ledger as JSON to stdout.")] = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """List a release ledger's releases and what they spend together on each subject.

    A subject is a record (a row; row i of every array sharing axis 0 is subject i's),
    known by a keyed fingerprint of its content (the key lives in the ledger): the same
    records in a copy, another format or another record shape (28x28 or 784) are the same
    subjects; changed values are other records. Subjects are listed grouped by the releases
    charged to them, most-spent first. Pending releases are runs in progress or killed after
    recording their release; they count as spent.

    \b
    Examples:
      tldp ledger ledger.db
      tldp ledger ledger.db --json > releases.json
    """
    from tldp_cli.run import ledger as ledger_mod

    debug = debugging(debug)
    report = run(debug, lambda: ledger_mod.listing(path))
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False))
        return
    if not report["releases"]:
        if not quiet:
            typer.echo("no releases recorded", err=True)
        return
    # the listing is the command's result, on stdout: -q leaves it (docs/output.md#what-a-command-prints)
    typer.echo("releases:")
    for r in report["releases"]:
        record = r[r["charged"]]  # a model file's whole file, else each record
        scope = "whole file" if r["charged"] == "per_file" else "each record"
        whom = ("charged to every subject (recorded by a ledger of schema 1)" if r["charged_to_every_subject"]
                else f"{r['subjects']} subject{'s' if r['subjects'] != 1 else ''}")
        typer.echo(f"  #{r['id']} {r['created']} {r['status']:8} {r['input']} -> {r['output']}: "
                   f"{scope} (eps={record['epsilon']:.4g}, delta={record['delta']:.3g}); {whom}")
    typer.echo("subjects, by the releases charged to them (most-spent first):")
    for group in report["subjects"]:
        total = group["per_record"]
        count = group["subjects"]
        who = f"{count} subject{'s' if count != 1 else ''}" if count else "every subject (none recorded yet)"
        typer.echo(f"  {who}: release{'s' if len(group['releases']) != 1 else ''} "
                   + ", ".join(f"#{i}" for i in group["releases"])
                   + (f" ({total['pending']} pending)" if total["pending"] else "")
                   + f": each record (eps={total['epsilon']:.4g}, delta={total['delta']:.3g})")
