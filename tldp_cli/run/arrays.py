"""Perturbing an array in memory: the library's entry point for data that is not in a file.

The same calibration, engine and accounting as `tldp perturb`, on one array whose axis 0
indexes records. Safe to call in a loop: without a seed every call draws fresh
noise (rng.Streams), so two calls on the same batch, or on two batches at the same
position, never share noise. With a seed the same call repeats exactly, and so does the
noise on any array of the same shape unless each batch passes its own `key`
(rng.keyed_name, as model_params.perturb_tensors' key).

NumPy arrays in, NumPy out. A torch tensor (CPU, any float dtype, bfloat16 included)
comes back as a torch tensor of its dtype and device (float16 and bfloat16 saturating
at their largest finite value, as the model-file writers do); torch is never imported
unless the caller passes one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from tldp_cli.sampling import engine
from tldp_cli.errors import DataError, UsageError
from tldp_cli.formats import ArrayJob, plural
from tldp_cli.formats.tensor_files import saturated
from tldp_cli.privacy.mechanisms import GAUSSIAN_ONLY, PRIVUNIT, Calibration
from tldp_cli.run import manifest, privacy_warnings
from tldp_cli.run.calibration import Calibrated, calibrate_run
from tldp_cli.run.library import python_words, speaks_python
from tldp_cli.run.options import COEFFICIENTS, PerturbOptions, checked_options, dtype_name
from tldp_cli.run.pipeline import SEED_WARNING, validate_block
from tldp_cli.run.run_manifest import privunit_of_run
from tldp_cli.sampling.rng import Streams, keyed_name

__all__ = ["Perturbed", "perturb_array"]

ARRAY_NAME = "array"  # the array's name in messages and in its random streams
# What a seeded call warns of: the command's words (pipeline.SEED_WARNING), with the library's
# way out of a seeded loop over batches in place of "use it for one release only"; with a key,
# that key is the one to use once.
SEED_IN_A_LOOP = (SEED_WARNING.removeprefix("warning: ").partition(", so ")[0] + ", so pass each batch "
                  "its own key (key=i in a loop): one seed under distinct keys draws distinct noise")
SEED_AND_KEY = ("a seed makes the noise reproducible; the same seed and key on another array of the same "
                "shape give the same noise, so use each key for one batch only")


@dataclass(frozen=True)
class Perturbed:
    """The perturbed array and the guarantee it carries."""

    array: Any  # the input's type: a NumPy array, or a torch tensor
    accounting: dict[str, Any]  # per_element, per_record, per_file: as a manifest's accounting
    calibration: Calibration  # noise scale, retain probability, element epsilon
    noise: str  # the distribution drawn (discrete-laplace, ..., or laplace/gaussian: float sampler)
    sampler: str
    value_range: tuple[float, float]
    dtype: np.dtype  # of the perturbed values before any conversion back to torch
    # --mechanism privunit: the manifest's `privunit` object (basis, k, reference, output scale;
    # with store="coefficients" its `stored`, so rebuild_records(result, result.array) works);
    # None for the other mechanisms
    privunit: dict[str, Any] | None = None


@speaks_python()
def perturb_array(array: Any, *, eps: float, value_range: tuple[float, float] | str | None = None,
                  noise: str | None = None, mechanism: str = "tldp", budget: str | None = None,
                  sampler: str = "exact", weights: Any = None, seed: str | int | None = None,
                  key: str | bytes | int | None = None,
                  allow_weak_seed: bool = False, allow_raw_release: bool = False,
                  dp_delta: float = 1e-5, granularity: float | None = None, rng: str = "secure",
                  dtype: DTypeLike = "float32", clip: float | None = None,
                  clip_input: bool = False, basis: str | None = None,
                  reference: str | float | None = None, store: str = "records") -> Perturbed:
    """Perturb every record (axis 0) of `array` with TLDP and return it with its figures.

    The options mean what `tldp perturb`'s do (`noise` None: the mechanism's default,
    laplace for tldp; `budget` None: element, record for privunit; `basis`: privunit's
    --basis; `reference`: its --reference, auto (None), zero, low, mid or a number; `store`: its
    --store, "coefficients" returns each record's k released coefficients, (n, k)). `value_range`, (lo, hi) or "lo:hi", is required for
    float data; `weights` (values in [0, 1]; not with privunit, mvg or idn, as for perturb)
    has the record's shape or one mask per record. `dtype` (float32 or float64, by name or
    NumPy's dtype) is what float output comes back in; integer data comes back widened. A torch
    tensor comes back as a torch tensor of its own dtype, on its device. The input is only
    read. Without a seed every call draws fresh noise; one seed gives every call on an
    array of the same shape the same noise unless `key` (a str, bytes or int naming the
    batch: key=i in a loop) differs: the noise is a function of the seed, the key and each
    value's position (docs/library.md#a-seed-in-a-loop). Neither is kept in the result.
    Raises UsageError for options that cannot work (a TldpError; also for a masked array
    with masked values, and a torch meta tensor), DataError for values
    that are not finite or lie outside the range (unless clip_input); their messages name
    these parameters (run/library.py).
    """
    values, torch_dtype, torch_device = _numpy_values(array)
    if values.ndim == 0 or values.shape[0] == 0:
        raise UsageError(f"perturb_array needs records along axis 0, not an array of shape {values.shape}")
    if values.dtype.kind not in "iuf":
        raise UsageError(f"perturb_array perturbs integer and floating-point data, not {values.dtype}")
    options = checked_options(PerturbOptions(
        input=Path(ARRAY_NAME), eps=eps, noise=noise,
        mechanism=mechanism, budget=budget, sampler=sampler,
        value_range=value_range,
        seed=seed, allow_weak_seed=allow_weak_seed, rng=rng, dtype=dtype_name(dtype), dp_delta=dp_delta,
        granularity=granularity, clip=clip, clip_input=clip_input, allow_raw_release=allow_raw_release,
        basis=basis, reference=None if reference is None else str(reference), store=store))
    assert options.noise is not None  # checked_options resolved it
    if weights is not None and options.mechanism in (PRIVUNIT, *GAUSSIAN_ONLY):  # as perturb refuses --weights
        raise UsageError(f"--weights lower TLDP's retain probability; --mechanism {options.mechanism} keeps "
                         "no raw value, so it takes no weights")
    job = ArrayJob(name=ARRAY_NAME, shape=tuple(values.shape), dtype=values.dtype,
                   read=lambda start, stop: values[start:stop],
                   source={"format": "array", "shape": list(values.shape), "dtype": str(values.dtype)})
    stream_name = keyed_name(ARRAY_NAME, key)  # refuses a key that is no str, bytes or int
    calibrated = calibrate_run(options, [job])
    streams = Streams(rng, seed, allow_weak_seed)  # checks the seed before any work
    outside = validate_block(values, job, 0, calibrated.lo, calibrated.top, options.input)  # NaN, Inf: DataError
    if options.clip is not None or clip_input:
        values = np.clip(values, calibrated.lo, calibrated.top)
    elif outside:
        raise DataError(f"{ARRAY_NAME}: {plural(outside, 'value')} outside the declared range "
                        f"[{calibrated.lo:g}, {calibrated.top:g}]; fix value_range or pass clip_input=True")
    calib = calibrated.calib_of[ARRAY_NAME]
    noisy = engine.perturb_records(values, 0, stream_name, calib, streams,
                                   _weights(weights, values.shape), calibrated.out_dtype, calibrated.grid,
                                   len(values), calibrated.bases.get(ARRAY_NAME), options.store == COEFFICIENTS)
    result = noisy if torch_dtype is None else _numpy_to_torch(noisy, torch_dtype, torch_device)
    _warn_of_a_large_epsilon(options, job, calibrated)
    if seed is not None:  # as the command warns of every seeded run (docs/library.md#a-seed-in-a-loop)
        warnings.warn(SEED_IN_A_LOOP if stream_name == ARRAY_NAME else SEED_AND_KEY, UserWarning, stacklevel=3)
    return Perturbed(result, manifest.accounting_entry(calibrated.certified), calib, options.noise, sampler,
                     (calibrated.lo, calibrated.hi), noisy.dtype, privunit_of_run(options, calibrated))


def _warn_of_a_large_epsilon(options: PerturbOptions, job: ArrayJob, calibrated: Calibrated) -> None:
    """The warning `tldp perturb` prints and its manifest lists when a record's certified
    epsilon protects nothing (privacy_warnings.large_epsilon), as a UserWarning in the
    library's words; Python's warning filters show it once per calling line by default."""
    record = privacy_warnings.record_name(None, [job], [], False)
    warning = privacy_warnings.large_epsilon(calibrated.certified, record, options.budget or "element")
    if warning:
        message = python_words(warning["message"].removeprefix("warning: "))
        warnings.warn(message, UserWarning, stacklevel=4)  # past this, perturb_array and speaks_python


def _weights(weights: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """The engine's weights: one mask of I values, or one per record (n, I)."""
    if weights is None:
        return None
    w = np.asarray(weights, dtype=np.float64)
    records, record_shape = shape[0], shape[1:]
    elements = int(np.prod(record_shape, dtype=np.int64))
    if w.shape == record_shape or w.size == elements and w.ndim <= 1:
        w = w.reshape(elements)
    elif w.shape == (records, *record_shape):
        w = w.reshape(records, elements)
    else:
        raise UsageError(f"weights of shape {w.shape} fit neither a record {record_shape} nor every "
                         f"record {shape}")
    if not np.all((w >= 0) & (w <= 1)):
        raise UsageError("weights must lie in [0, 1]")
    return w


def _numpy_values(array: Any) -> tuple[np.ndarray, Any, Any]:
    """The values to perturb as a NumPy array, and a torch tensor's dtype and device to
    give the result back in (None, None: NumPy). Refuses what np.asarray would misread: a
    masked array's masked values (it drops the mask and passes them on as data) and a torch
    meta tensor (a shape without values; torch's own error is a NotImplementedError)."""
    if type(array).__module__.split(".")[0] == "torch":
        if getattr(array, "is_meta", False):
            raise UsageError("array is a torch meta tensor: it has a shape but no values (a model built "
                             "on device='meta', or not loaded yet); load its values first")
        return _torch_to_numpy(array), array.dtype, array.device
    if isinstance(array, np.ma.MaskedArray) and np.ma.is_masked(array):
        raise UsageError(f"array is a masked array with {plural(int(np.ma.count_masked(array)), 'masked value')}, "
                         "which perturb_array would take as data without their mask: fill them "
                         "(array.filled(value)) or compress them out (drop the records that hold them) first")
    return np.asarray(array), None, None


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()  # NumPy has no bfloat16; float32 holds its values exactly
    return tensor.numpy()


def _numpy_to_torch(values: np.ndarray, dtype: Any, device: Any) -> Any:
    import torch

    if dtype.is_floating_point:  # float16/bfloat16 saturate as the file writers' to_stored does
        values = saturated(values, str(dtype).removeprefix("torch."))
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if dtype.is_floating_point:
        tensor = tensor.to(dtype)
    return tensor.to(device)
