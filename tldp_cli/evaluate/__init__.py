"""`tldp evaluate` and `tldp sweep`: what survived the noise, checked against the manifest,
and the paper's privacy-utility comparison (Type I: train on perturbed records, test on
clean ones, weighted F1).

Plain functions returning dicts; the CLI only parses options and prints. One module per
job:

- `integrity`: ORIGINAL paired with PERTURBED the way `perturb` wrote them, the sha256 of
  every output, shapes and record counts.
- `recompute`: the manifest's parameters recomputed from the options it states
  (run_manifest.options_of_manifest, mechanisms.calibrate, accounting.certify_all).
- `noise`: per-record MSE, MAE, relative L2, PSNR and SSIM for image-shaped records, the
  empirical norm of the noise against Table 5, the retained fraction against p, a
  Kolmogorov-Smirnov test against the manifest's noise distribution.
- `utility`: the task utility, with labels (classifiers, weighted F1).
- `report`: `evaluate(...)`, the report from the four above; `previews`: `preview(...)`.
- `sweeps`: `sweep(...)` perturbs in memory over a grid of epsilons for TLDP-L, TLDP-G
  and the paper's Laplace, Gaussian, MVG and IDN baselines (and weighted TLDP), and, with
  --budget record, privunit (its default basis and k rule), and `write_sweep(...)` writes
  a CSV, a JSON table and PNG plots.

Statistical checks fail only at ALPHA = 1e-6, so a correct run essentially never fails
one while a wrong scale or distribution fails at once.

Reports and sweeps are computed from the raw data and say so (`sensitive`); the
per-record lists, which give each record's exact norm, are left out unless asked for.
"""

from tldp_cli.errors import InputError, OutputError, TldpError, UsageError
from tldp_cli.evaluate.common import SENSITIVE, Progress
from tldp_cli.evaluate.noise import ALPHA, is_image_shaped, ssim
from tldp_cli.evaluate.previews import preview
from tldp_cli.evaluate.recompute import check_parameters
from tldp_cli.evaluate.report import REPORT_SCHEMA, epsilon_scope, evaluate
from tldp_cli.evaluate.sweeps import (SWEEP_COLUMNS, SWEEP_FILES, SWEEP_METHODS, SWEEP_SCHEMA, parse_eps_list,
                                      parse_methods, sweep, write_sweep)
from tldp_cli.evaluate.utility import (MODELS, folder_labels, load_labels, load_records, task_utility,
                                       weighted_f1)

__all__ = [
    "ALPHA", "InputError", "MODELS", "OutputError", "Progress", "REPORT_SCHEMA", "SENSITIVE", "SWEEP_COLUMNS",
    "SWEEP_FILES", "SWEEP_METHODS", "SWEEP_SCHEMA", "TldpError", "UsageError", "check_parameters",
    "epsilon_scope", "evaluate", "folder_labels", "is_image_shaped", "load_labels", "load_records",
    "parse_eps_list", "parse_methods", "preview", "ssim", "sweep", "task_utility", "weighted_f1", "write_sweep",
]
