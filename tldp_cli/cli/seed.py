"""`tldp seed`."""

import json
from typing import Annotated

import typer

from tldp_cli.cli.app import app
from tldp_cli.cli.options import Debug, Quiet


@app.command("seed")
def seed_command(
    json_out: Annotated[bool, typer.Option("--json", help='Print {"seed": ...} as JSON.')] = False,
    quiet: Quiet = False,  # the seed is the only output, on stdout: accepted like every command's
    debug: Debug = False,
):
    """Print a fresh random seed: 32 hex digits (128 bits) from the OS's secure source.

    A seed is a secret key: whoever has it can regenerate the noise and subtract
    it. Keep it off command lines (other users see them in ps; shells keep them
    in their history): pass it with --seed-file or the TLDP_SEED variable. Use a
    seed for one release only.

    \b
    Examples:
      (umask 077; tldp seed > release-1.seed)
      tldp perturb data.npy --eps 1 --range 0:1 --seed-file release-1.seed
      TLDP_SEED=$(cat release-1.seed) tldp perturb data.npy --eps 1 --range 0:1
      python -c "import secrets; print(secrets.token_hex(16))"    # the same, without tldp
    """
    from tldp_cli.sampling.rng import new_seed

    seed = new_seed()
    typer.echo(json.dumps({"seed": seed}) if json_out else seed)


