"""tldp: local differential privacy (TLDP) for tensor datasets on disk.

The public API, imported on first use (so that `import tldp_cli` and the command stay
quick):

    perturb_array(array, *, eps, value_range, ...) -> Perturbed   arrays in memory
    perturb(PerturbOptions(input, eps, ...)) -> PerturbResult     files, as `tldp perturb`
    plan(PerturbOptions(input, eps, ...)) -> dict                 its plan, as `tldp plan --json`
    calibrate(...), certify(calibration) -> Certificate, compose([(calibration, records)]) -> Guarantee
    rebuild_records(manifest or Perturbed, rows) -> records      from --store coefficients' rows
    TldpError, UsageError, InputError, DataError, OutputError     the errors raised

The parameters are the command's options without their dashes (eps, dp_delta,
allow_weak_seed=True; --range is value_range, (lo, hi) or "lo:hi", and ranges for single
arrays), and the errors of perturb_array, perturb, plan and calibrate name them, not the flags.
"""

from importlib import import_module

__version__ = "0.1.0"

__all__ = [
    "DataError", "InputError", "OutputError", "PerturbOptions", "PerturbResult", "Perturbed",
    "TldpError", "UsageError", "calibrate", "certify", "compose", "perturb", "perturb_array", "plan",
    "rebuild_records",
]

_WHERE = {
    "perturb_array": "tldp_cli.run.arrays", "Perturbed": "tldp_cli.run.arrays",
    "perturb": "tldp_cli.run.library", "PerturbOptions": "tldp_cli.run.pipeline", "plan": "tldp_cli.run.plan",
    "PerturbResult": "tldp_cli.run.pipeline",
    "calibrate": "tldp_cli.run.library", "certify": "tldp_cli.privacy.accounting", "compose": "tldp_cli.privacy.accounting",
    "TldpError": "tldp_cli.errors", "UsageError": "tldp_cli.errors", "InputError": "tldp_cli.errors",
    "DataError": "tldp_cli.errors", "OutputError": "tldp_cli.errors", "rebuild_records": "tldp_cli.run.manifest",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'tldp_cli' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
