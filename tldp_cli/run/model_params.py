"""Model parameters in memory (the paper's Type III: parameters shared in federated
training). The same clipping, calibration, engine and accounting as
`tldp perturb --clip C` on a model file: every named tensor is one record of its
own, clipped to [-C, C] (range width 2C) and perturbed by TLDP or a baseline.

    calibs = calibrate_tensors({n: t.shape for n, t in params.items()}, epsilon=1, clip=0.1)
    noisy = perturb_tensors(params, calibs, streams=Streams())       # every round, every client
    figures = certify_tensors(calibs, releases=rounds)               # the whole training

Randomness: `streams` keyed by a seed give the same noise for the same tensor
names, so a seeded Streams used for several releases needs a distinct `key` for
each (e.g. f"round {r}/client {c}"); an unseeded Streams() is fresh every time.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from tldp_cli.privacy import accounting
from tldp_cli.run import manifest
from tldp_cli.sampling import engine
from tldp_cli.errors import UsageError
from tldp_cli.privacy.mechanisms import PRIVUNIT, Calibration, calibrate_arrays, calibrate_privunit, matrix_rows
from tldp_cli.sampling.rng import Streams, keyed_name


def calibrate_tensors(shapes: Mapping[str, tuple[int, ...]], *, epsilon: float, clip: float,
                      noise: str = "laplace", mechanism: str = "tldp", budget: str = "element",
                      dp_delta: float = 1e-5) -> dict[str, Calibration]:
    """One calibration per tensor (I = its size, range width 2C), in the given order.
    MVG unfolds a tensor along its first axis, as `tldp perturb` does. privunit: each
    tensor is one record of its own shape on the default DCT basis (noise and budget
    are its own)."""
    if not (math.isfinite(clip) and clip > 0):
        raise UsageError(f"clip must be a finite number > 0, not {clip}")
    if mechanism == PRIVUNIT:
        return {name: calibrate_privunit(epsilon=epsilon, record_shape=tuple(shape), value_range=(-clip, clip),
                                         dp_delta=dp_delta) for name, shape in shapes.items()}
    arrays = {name: (int(np.prod(shape, dtype=np.int64)), matrix_rows(mechanism, tuple(shape), f"tensor {name}"))
              for name, shape in shapes.items()}
    return calibrate_arrays(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                            range_width=2 * clip, dp_delta=dp_delta, granularity=None, arrays=arrays)


def perturb_tensors(tensors: Mapping[str, np.ndarray], calibrations: Mapping[str, Calibration], *,
                    streams: Streams, key: str | bytes | int = "", dtype: np.dtype | type = np.float32
                    ) -> dict[str, np.ndarray]:
    """Each tensor clipped to [-C, C] (C from its calibration) and perturbed as one record.

    The result keeps every tensor's shape; floating-point tensors keep their dtype,
    others come back in `dtype`. `key` keeps the noise of different releases apart
    under one seeded `streams` (rng.keyed_name: a str, bytes or int; perturb_array's `key`).
    """
    out = {}
    for name, tensor in tensors.items():
        calib = calibrations[name]
        tensor = np.asarray(tensor)
        if tensor.size != calib.elements:
            raise UsageError(f"tensor {name} has {tensor.size} elements, its calibration {calib.elements}")
        if not np.isfinite(tensor).all():
            raise UsageError(f"tensor {name} holds NaN or Inf")
        bound = calib.range_width / 2
        clipped = np.clip(tensor.astype(dtype, copy=False), -bound, bound)
        noisy = engine.perturb_records(clipped.reshape(1, -1), 0, keyed_name(name, key),
                                       calib, streams, dtype=dtype)
        out[name] = noisy.reshape(tensor.shape).astype(tensor.dtype if tensor.dtype.kind == "f" else dtype)
    return out


def certify_tensors(calibrations: Mapping[str, Calibration], releases: int = 1) -> dict[str, Any]:
    """Certified figures, as a manifest's accounting states them: per element and per
    record (the worst case over the tensors), per tensor, and per_file = all tensors
    released `releases` times (e.g. every round of a training run)."""
    if releases < 1:
        raise UsageError(f"releases must be at least 1, not {releases}")
    return manifest.accounting_entry(accounting.certify_run(
        list(calibrations.values()), None, [(name, calib, releases) for name, calib in calibrations.items()],
        per_tensor=True))
