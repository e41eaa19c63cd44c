"""What a run is asked to do (PerturbOptions) and the checks of the request that need no
data (checked_options, checked_input): the usage errors in option values, an input that is
missing or is no dataset. This module and what it imports load without NumPy, SciPy or a
format library, so the command line refuses those before importing the pipeline
(tests/cli/test_startup.py); the pipeline runs the same checks, in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tldp_cli import formats
from tldp_cli.errors import UsageError
from tldp_cli.privacy.mechanisms import (GAUSSIAN_ONLY, PRIVUNIT, check_parameters, default_noise, parse_reference,
                                         is_number, resolve_budget, sampled_noise, shown)

if TYPE_CHECKING:
    from tldp_cli.formats import Format

# Records per block are chosen so a block holds about this many elements: 8 MB of
# float32 output, small enough that the blocks in flight and Zarr's encoding copies of
# them stay well inside a few hundred MB, large enough that per-block costs vanish.
BLOCK_ELEMENTS = 1 << 21
DESCRIBED = "records"  # the name of a described (not read) array: `tldp plan --elements` (run/plan.py)
# --store: what a --mechanism privunit run writes for each record. records: the record written
# back in the input's shape; coefficients: the k released coefficients (V, the released unit
# vector), one row of k values per record, in formats whose Format.create_coefficient_writer is set.
RECORDS, COEFFICIENTS = "records", "coefficients"
STORE_CHOICES = (RECORDS, COEFFICIENTS)


@dataclass
class PerturbOptions:
    """The options of `tldp perturb`, for tldp_cli.perturb: each the command's option without its
    dashes (eps, dp_delta, allow_weak_seed=True), except --range (value_range, and ranges for
    single arrays), --dataset (datasets) and --format (input_format); paths as Path or str
    (docs/library.md)."""

    input: Path
    eps: float  # --eps (epsilon=, its old name, is deprecated: see _renamed_keywords)
    noise: str | None = None  # None: the mechanism's (default_noise: laplace; gaussian for mvg, idn)
    mechanism: str = "tldp"
    budget: str | None = None  # None: the mechanism's own (element; record for privunit)
    value_range: tuple[float, float] | str | None = None  # --range LO:HI: every array without its own
    ranges: Mapping[str, tuple[float, float] | str] = field(default_factory=dict)  # --range NAME=LO:HI
    weights: Path | None = None
    out: Path | str | None = None  # a str keeps a trailing "/" ("write inside this folder")
    manifest: Path | str | None = None  # a str keeps a trailing "/", which is refused
    seed: str | int | None = None  # a secret key: hex digits (see rng.py)
    allow_weak_seed: bool = False  # accept a seed of fewer than rng.MIN_SEED_BITS bits (tests, demos)
    rng: str = "secure"
    dtype: str | None = None  # --dtype: float32 or float64; None: not asked for, float32 (float_dtype)
    dp_delta: float = 1e-5
    granularity: float | None = None  # discrete noises on float data: the grid step (None: automatic)
    overwrite: bool = False
    clip_input: bool = False
    clip: float | None = None  # --clip C: clip to [-C, C] (L-infinity) and take (-C, C) as the range
    datasets: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)  # globs of arrays left out (model files, HDF5)
    keep: list[str] = field(default_factory=list)  # what is copied raw rather than dropped (formats.leftovers)
    input_format: str | None = None  # --format: the format's NAME, None: detected
    image_format: str = "png"
    copy_other: bool = False
    skip_bad: bool = False
    workers: int = 1
    block_elements: int = BLOCK_ELEMENTS
    scheduler: str = "threads"  # or "dask"
    dask_address: str | None = None  # an existing cluster; None: a local one of `workers` processes
    dask_logs: bool = False  # show dask.distributed's own log output (the CLI's --debug)
    resume: bool = False  # continue an interrupted run's resumable (Zarr) output
    allow_raw_release: bool = False  # consent to kept raw values costing more than dp_delta
    ledger: Path | None = None  # the release ledger (ledger.py) that counts releases of this data
    seed_file: Path | None = None  # where the seed came from (--seed-file): never to be overwritten
    max_record_eps: float | None = None  # caps on what the data's releases spend together, per record
    max_record_delta: float | None = None
    sampler: str = "exact"  # exact: laplace/gaussian drawn as their discrete counterparts; float
    anonymize_names: bool = False  # image folders, WebDataset: neutral output names, names kept in the name map
    name_map: Path | None = None  # --anonymize-names: where the name map goes (None: beside the input)
    # CF missing-data markers inside the declared range: values equal to one are missing data,
    # copied (the missingness pattern declared public), instead of data, perturbed
    public_missing: bool = False
    basis: str | None = None  # --mechanism privunit: dct (default), dct:K or FILE.npy (run/bases.py)
    reference: str | None = None  # --mechanism privunit: auto (None), zero, low, mid or a number
    store: str = RECORDS  # --mechanism privunit: records (written back) or coefficients (V itself)

    def __post_init__(self):  # the library takes str paths too (out and manifest stay str: see above)
        for name in ("input", "weights", "ledger", "seed_file", "name_map"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, Path(getattr(self, name)))
        for name in ("datasets", "exclude", "keep"):  # one name: datasets="images" is ["images"], not 6 letters
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])

    @property
    def epsilon(self) -> float:
        """Deprecated: `eps`, as perturb_array and the command have it."""
        warnings.warn("PerturbOptions.epsilon is deprecated; use eps", DeprecationWarning, stacklevel=2)
        return self.eps


def _renamed_keywords(init, **old_names: str):
    """`init` also taking each parameter's old keyword, with a DeprecationWarning (for one
    release: PerturbOptions(epsilon=...) is PerturbOptions(eps=...))."""
    @functools.wraps(init)
    def taking_old_names(self, *args, **kwargs):
        for old, new in old_names.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"give {new}= (the new name of {old}=), not both")
                warnings.warn(f"{old}= is deprecated; use {new}=", DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)
    return taking_old_names


PerturbOptions.__init__ = _renamed_keywords(PerturbOptions.__init__, epsilon="eps")  # type: ignore[method-assign]



def parse_range(text: str) -> tuple[float, float]:
    """'LO:HI' -> (lo, hi); refuses empty, inverted and non-finite ranges."""
    parts = text.split(":")
    if len(parts) != 2:
        raise UsageError(f"--range must be LO:HI (for example 0:256), not {text!r}")
    try:
        lo, hi = float(parts[0]), float(parts[1])
    except ValueError:
        raise UsageError(f"--range must be two numbers LO:HI, not {text!r}") from None
    return _checked_bounds(lo, hi, "--range", text, command_line=True)


def as_range(value: tuple[float, float] | str, flag: str = "--range") -> tuple[float, float]:
    """The library's ranges: a pair (lo, hi) or a string 'lo:hi', refused as parse_range
    refuses --range (`flag`: the option the message names)."""
    try:
        lo, hi = (float(bound) for bound in (value.split(":") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        raise UsageError(f"{flag} must be two numbers, (lo, hi) or 'lo:hi', not {value!r}") from None
    return _checked_bounds(lo, hi, flag, value, command_line=False)


def _checked_bounds(lo: float, hi: float, flag: str, value: object, command_line: bool) -> tuple[float, float]:
    """(lo, hi), refused when not finite, empty or inverted, in the words of the command line
    (`value`: --range's text; its ends LO and HI) or of the library (`value` as given; lo, hi)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise UsageError(f"{flag} must be finite, not {value!r}")
    shown, low, high = (value, "LO", "HI") if command_line else (repr(value), "lo", "hi")
    if hi <= lo:
        raise UsageError(f"{flag} {shown} is empty or inverted: {high} must be greater than {low}")
    return lo, hi


def parse_ranges(texts: list[str]) -> tuple[tuple[float, float] | None, dict[str, tuple[float, float]]]:
    """--range values: at most one LO:HI (the default), and NAME=LO:HI for single arrays."""
    default, own = None, {}
    for text in texts:
        name, sep, bounds = text.rpartition("=")
        if not sep:
            if default is not None:
                raise UsageError(f"--range {text}: a second LO:HI; give one default range, and "
                                 "NAME=LO:HI for single datasets or tensors")
            default = parse_range(text)
        elif not name:
            raise UsageError(f"--range {text}: NAME=LO:HI needs the dataset's or tensor's name")
        elif name in own:
            raise UsageError(f"--range {name}=...: given twice")
        else:
            own[name] = parse_range(bounds)
    return default, own


def float_dtype(options: PerturbOptions) -> str:
    """The float dtype the noise is drawn in and float output is written in: --dtype, or
    float32 where none was given."""
    return options.dtype or "float32"


def checked_noise(options: PerturbOptions) -> str:
    """The noise of options checked_options returned (it resolves the mechanism's default)."""
    assert options.noise is not None
    return options.noise


def checked_budget(options: PerturbOptions) -> str:
    """The budget of options checked_options returned (it resolves the mechanism's own)."""
    assert options.budget is not None
    return options.budget


def dtype_name(dtype: object) -> str | None:
    """--dtype by its name: the library's np.float64, np.dtype("float64") or float are "float64"
    (the refusal read "not <class 'numpy.float64'>"); a str or None as given, and what NumPy
    cannot read as a dtype (torch.float64) as it prints, for the refusal."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    import numpy as np  # only for a caller's dtype object: the command gives a str

    try:
        return np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError:
        return str(dtype)


def checked_options(options: PerturbOptions) -> PerturbOptions:
    """Refuses option values that cannot work (usage errors), before any file is read;
    returns the options with the noise as drawn (sampled_noise) and the budget resolved
    (resolve_budget)."""
    noise = default_noise(options.mechanism) if options.noise is None else options.noise
    budget = resolve_budget(options.mechanism, options.budget)
    options = dataclasses.replace(options, budget=budget, noise=noise,
                                  value_range=None if options.value_range is None else as_range(options.value_range),
                                  ranges={name: as_range(bounds, f"--range {name}=...")
                                          for name, bounds in options.ranges.items()})
    check_parameters(mechanism=options.mechanism, noise=noise, budget=budget,
                     epsilon=options.eps, dp_delta=options.dp_delta)
    if options.mechanism == PRIVUNIT:
        from tldp_cli.run import bases as bases_mod

        bases_mod.parse_basis(options.basis)
        parse_reference(options.reference)
        if options.weights is not None:
            raise UsageError("--weights lower TLDP's retain probability; --mechanism privunit keeps no "
                             "raw value, so it takes no weights")
        if options.granularity is not None:
            raise UsageError("--granularity applies to the discrete noises; --mechanism privunit adds no noise")
    elif options.basis is not None:
        raise UsageError("--basis applies to --mechanism privunit")
    elif options.reference is not None:
        raise UsageError("--reference applies to --mechanism privunit")
    if options.store not in STORE_CHOICES:
        raise UsageError(f"--store must be {' or '.join(STORE_CHOICES)}, not {options.store}")
    if options.store == COEFFICIENTS and options.mechanism != PRIVUNIT:
        raise UsageError("--store coefficients applies to --mechanism privunit (the k released coefficients "
                         f"of each record); --mechanism {options.mechanism} writes records")
    options = dataclasses.replace(options, noise=sampled_noise(noise, options.sampler, options.mechanism))
    if options.seed is not None:
        from tldp_cli.sampling.rng import check_seed

        check_seed(options.seed, options.allow_weak_seed)
    options = dataclasses.replace(options, dtype=dtype_name(options.dtype))
    if options.dtype not in (None, "float32", "float64"):
        raise UsageError(f"--dtype must be float32 or float64, not {options.dtype}")
    if options.clip is not None:
        if not (is_number(options.clip) and math.isfinite(options.clip) and options.clip > 0):
            raise UsageError(f"--clip must be a finite number > 0, not {shown(options.clip)}")
        if options.value_range is not None or options.ranges:
            raise UsageError("--clip C sets the range to (-C, C); give --clip or --range, not both")
    if options.weights is not None and options.mechanism in GAUSSIAN_ONLY:
        raise UsageError(f"--weights lower TLDP's retain probability; --mechanism {options.mechanism} "
                         "keeps no raw value, so it takes no weights")
    if options.scheduler not in ("threads", "dask"):
        raise UsageError(f"--scheduler must be threads or dask, not {options.scheduler}")
    if options.dask_address is not None and options.scheduler != "dask":
        raise UsageError("--dask-address applies to --scheduler dask")
    if options.scheduler == "dask":
        from tldp_cli.run import dask_runner

        dask_runner.require()
        if options.dask_address is not None:
            dask_runner.check_address(dask_runner.parse_address(options.dask_address))
    for flag, cap, top in (("--max-record-eps", options.max_record_eps, math.inf),
                           ("--max-record-delta", options.max_record_delta, 1.0)):
        if cap is not None and not 0 <= cap <= top:  # NaN too: it would turn the cap off
            raise UsageError(f"{flag} must be a number in [0, {top:g}], not {cap:g}")
    if options.ledger is None and (options.max_record_eps is not None or options.max_record_delta is not None):
        raise UsageError("--max-record-eps and --max-record-delta cap what a ledger counts: give --ledger PATH")
    # Python floats from here on: a NumPy scalar (eps=np.float32(4)) reached the manifest, which json refused
    return dataclasses.replace(options, eps=float(options.eps), dp_delta=float(options.dp_delta),
                               clip=None if options.clip is None else float(options.clip))


def checked_input(options: PerturbOptions) -> tuple[PerturbOptions, Format]:
    """checked_options, then the input's format (formats.detect): what a run refuses first,
    in this order, before it reads anything but the input's name and first bytes."""
    checked = checked_options(options)
    module = formats.detect(options.input, checked.input_format)
    if checked.store == COEFFICIENTS and module.create_coefficient_writer is None:
        held = ", ".join(f"{fmt.name} ({fmt.title})" for fmt in formats.registered() if fmt.create_coefficient_writer)
        raise UsageError(f"{options.input}: --store coefficients does not apply to {module.name} ({module.title}), "
                         f"whose output keeps its input's shapes; it applies to {held}")
    return checked, module
