"""Options that several commands share, defined once: their choices, their help and
where a seed comes from."""

from __future__ import annotations

import os
import stat
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tldp_cli.cli.app import SEED_ENV
from tldp_cli.errors import UsageError


class Noise(str, Enum):
    laplace = "laplace"
    gaussian = "gaussian"
    discrete_laplace = "discrete-laplace"
    discrete_gaussian = "discrete-gaussian"


class Sampler(str, Enum):
    exact = "exact"
    float = "float"


class Mechanism(str, Enum):
    tldp = "tldp"
    baseline = "baseline"
    mvg = "mvg"
    idn = "idn"


class Budget(str, Enum):
    element = "element"
    record = "record"


class RngKind(str, Enum):
    secure = "secure"
    fast = "fast"


class ImageFormat(str, Enum):
    png = "png"
    tiff = "tiff"


class Scheduler(str, Enum):
    threads = "threads"
    dask = "dask"


class OutDtype(str, Enum):
    float32 = "float32"
    float64 = "float64"


# --seed-file and --allow-weak-seed, the same for every command that takes a seed.
SeedFile = Annotated[Optional[Path], typer.Option(
    metavar="PATH", help=f"Read the seed from PATH (whitespace around it stripped) instead of "
                         f"--seed or ${SEED_ENV}, which keeps it out of the command line; warns "
                         f"when other users may read or write PATH.", show_default=False)]
AllowWeakSeed = Annotated[bool, typer.Option(
    help="Accept a seed shorter than 32 hex digits (128 bits), for tests and demos: it can be "
         "guessed. Recorded as weak_seed.")]
_SEED_FILE_LIMIT = 4096  # bytes; a seed is a few dozen, more is the wrong file


def resolve_seed(seed: Optional[str], seed_file: Optional[Path], quiet: bool) -> Optional[str]:
    """The seed from whichever of --seed, --seed-file and $TLDP_SEED is given (None: none;
    an empty TLDP_SEED counts as unset). Two at once is a usage error, not a precedence
    rule: a forgotten exported TLDP_SEED must not silently win or lose."""
    from_env = os.environ.get(SEED_ENV) or None
    given = [name for name, value in (("--seed", seed), ("--seed-file", seed_file), (f"${SEED_ENV}", from_env))
             if value is not None]
    if len(given) > 1:
        raise UsageError(f"a seed is given by both {given[0]} and {given[1]}; give it one way "
                         f"(--seed-file or ${SEED_ENV} keep it out of the command line)")
    if seed_file is None:
        return seed if seed is not None else from_env
    with open(seed_file, "rb") as f:  # an OSError names the file (see _run)
        mode = os.fstat(f.fileno()).st_mode
        content = f.read(_SEED_FILE_LIMIT + 1)
    try:
        text = content.decode("ascii")
    except UnicodeDecodeError:
        text = None
    if text is None or len(content) > _SEED_FILE_LIMIT or not text.strip():
        raise UsageError(f"{seed_file}: not a seed file (a seed is one line of hex digits, e.g. "
                         f"from `tldp seed`)")
    # Only warned about: the mode alone does not prove exposure (a private folder, a
    # container's secret mount), and a refusal would push the seed back into argv.
    if stat.S_ISREG(mode) and mode & 0o077 and not quiet:
        typer.echo(f"tldp: warning: other users may read or write the seed file {seed_file} "
                   f"(mode {stat.S_IMODE(mode):04o}); it holds a secret key: chmod 600 {seed_file}",
                   err=True)
    return text


