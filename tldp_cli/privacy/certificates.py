"""What the accounting certifies (accounting.py), as typed results.

Plain frozen records of figures: the accounting computes them and nothing else does;
the manifest (run/manifest.py) renders them as its `accounting` object and the command
line (cli/summary.py) as its guarantee line. None of them knows a manifest key.
"""

from __future__ import annotations

from dataclasses import dataclass

from tldp_cli.privacy.mvg_idn import MvgParameters
from tldp_cli.privacy.types import Calibration


@dataclass(frozen=True)
class Guarantee:
    """What one scope (an element, a record, the releases of a file) is certified.

    `epsilon`/`delta` is the headline: pure epsilon with the point-mass delta for Laplace
    noise, (epsilon, delta) at dp_delta for Gaussian noise; `approx_*` an (epsilon, delta)
    pair at dp_delta for every noise; `rho` the zCDP of the Gaussian noise (None
    otherwise); `point_mass_*` what kept raw values cost. A `*_log10` stays finite where
    its delta underflows float64 (None: the delta is 0)."""

    epsilon: float
    delta: float
    delta_log10: float | None
    rho: float | None
    approx_delta: float
    approx_epsilon: float
    point_mass_delta: float
    point_mass_delta_log10: float | None


@dataclass(frozen=True)
class Designed:
    """MVG, IDN: the (epsilon, delta) per record that the mechanism's own design condition
    gives its sigma (looser than the tight per-record figure), with the condition's
    parameters: MVG's precision budget and Theorem 3's constants, IDN's s2 and zeta."""

    mechanism: str  # "mvg" or "idn"
    epsilon: float
    delta: float
    condition: str
    precision_budget: float | None = None  # MVG
    mvg: MvgParameters | None = None  # MVG
    s2: float | None = None  # IDN
    zeta: float | None = None  # IDN


@dataclass(frozen=True)
class PrivUnitFigures:
    """PrivUnit's split and its figures: the cap's exact share q, its bounds for the sampler
    as implemented, the nominal epsilon of the real-valued mechanism, the certified one and
    the margin between them, and the expected alignment E<V, u>."""

    k: int
    gamma: float
    p: float
    p_numerator: int
    epsilon0: float
    q: float
    q_lower: float
    q_upper: float
    inner_product_error: float
    excluded_probability: float
    nominal_epsilon: float
    epsilon: float
    margin: float
    expected_alignment: float


@dataclass(frozen=True)
class FileGuarantee(Guarantee):
    """Everything a run released, composed: its Guarantee, and how many records and
    elements it covers."""

    records: int
    elements: int


@dataclass(frozen=True)
class TensorFigures:
    """One tensor of a model file (a record of its own): its calibration and the figures
    of its record."""

    name: str
    calibration: Calibration
    per_record: Guarantee


@dataclass(frozen=True)
class FileCertificate:
    """certify_file: `per_file` composes every record released; `per_tensor` (model files)
    lists each tensor's figures, None otherwise."""

    per_file: FileGuarantee
    per_tensor: tuple[TensorFigures, ...] | None = None


@dataclass(frozen=True)
class Certificate:
    """The certified figures of a run's calibrations (certify, certify_all; certify_run adds
    the file's).

    `per_element` and `per_record`: the worst case over every calibration, field by field
    (`worst_case_of` calibrations, None for one); `notes`: how the figures were derived;
    `designed` (MVG, IDN) and `privunit` (its split) where they apply, for several
    calibrations the one of the largest epsilon; `per_file` and `per_tensor` as
    certify_file gives them, where the run's releases were certified."""

    per_element: Guarantee
    per_record: Guarantee
    dp_delta: float
    accountant: str
    notes: tuple[str, ...]
    worst_case_of: int | None = None
    designed: Designed | None = None
    privunit: PrivUnitFigures | None = None
    per_file: FileGuarantee | None = None
    per_tensor: tuple[TensorFigures, ...] | None = None
