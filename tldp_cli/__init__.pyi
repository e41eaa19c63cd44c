# What type checkers see of tldp_cli (the package ships py.typed): the public names, which
# __init__.py imports on first use through its module __getattr__. A stub rather than imports
# under `if TYPE_CHECKING:` in __init__.py: the import contracts (pyproject.toml) count those,
# and modules of every layer import __version__ from here. Without it a type checker saw only
# __getattr__ and typed every name, a misspelt one too, as Any. Kept equal to _WHERE by
# tests/run/test_library.py.
from tldp_cli.errors import DataError, InputError, OutputError, TldpError, UsageError
from tldp_cli.privacy.accounting import certify, compose
from tldp_cli.run.arrays import Perturbed, perturb_array
from tldp_cli.run.library import calibrate, perturb
from tldp_cli.run.manifest import rebuild_records
from tldp_cli.run.plan import plan
from tldp_cli.run.pipeline import PerturbOptions, PerturbResult

__version__: str

__all__ = [
    "DataError", "InputError", "OutputError", "PerturbOptions", "PerturbResult", "Perturbed",
    "TldpError", "UsageError", "calibrate", "certify", "compose", "perturb", "perturb_array", "plan",
    "rebuild_records",
]

def __dir__() -> list[str]: ...
