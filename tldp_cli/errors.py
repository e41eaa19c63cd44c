"""Typed errors. The CLI turns a TldpError (a MissingExtra among them) into one line on
stderr and exit 1, a UsageError into one line and exit 2. Nothing below cli.py prints or exits."""


class TldpError(Exception):
    """A failure the user can act on; the message names the file and the problem."""


class UsageError(TldpError):
    """An option value that cannot work (exit code 2)."""


class NotHeld(UsageError):
    """An option names what the input does not hold: `names`, given to the PerturbOptions
    field `option` (keep, exclude: --keep, --exclude patterns; ranges: --range NAME=LO:HI). Raised before
    anything is written; with several inputs a name another input holds is dropped for
    this one (run/batch.py)."""

    def __init__(self, message: str, option: str, names: list[str]):
        super().__init__(message)
        self.option, self.names = option, names


class OutOfReach(UsageError):
    """A per-record --eps below the least figure a mechanism certifies for some record size:
    `least` is that figure, so that a run of several sizes can name the largest (the --eps
    every size needs)."""

    def __init__(self, message: str, least: float):
        super().__init__(message)
        self.least = least


class MissingExtra(TldpError):
    """What was asked for needs a library of an optional extra that is not installed: exit 1,
    as for any failure that is not a usage error (the command line is right, the installation
    lacks something), one line naming the pip command that installs it."""

    def __init__(self, what: str, library: str, extra: str):
        super().__init__(f"{what} needs {library}, an optional extra: pip install 'tldp-tensors[{extra}]'")
        self.extra = extra


class InputError(TldpError):
    """The input cannot be read or is not what it must be."""


class DataError(InputError):
    """The input's values break the contract (NaN, Inf, out of the declared range)."""


class OutputError(TldpError):
    """The output cannot be written where asked."""


class WriteError(OutputError, OSError):
    """Writing the output failed: one line naming the file for the user (an OutputError),
    and still an OSError, with its errno, for code that handles those."""


class OutOfMemory(TldpError):
    """A run needs (or needed) more memory than the machine, or the process's limits, give it."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run; the message says what was kept (a KeyboardInterrupt
    still, so callers that stop on one keep doing so)."""


def reason_of(exc: BaseException) -> str:
    """What went wrong, for the brackets of a one-line message: the system's words for an
    OSError (its strerror), else the exception's text, else, for an exception that carries
    none (a codec's bare error, MemoryError), the name of its type; never empty."""
    text = getattr(exc, "strerror", None) or str(exc)
    return " ".join(text.split()) or type(exc).__name__
