"""The volume table of docs/choosing-eps.md ("Volumes: the 3-D basis"): privunit's default basis
on real volumes, the per-slice 2-D DCT it had before (old) against the 3-D DCT (new), with and
without the image pre-emphasis and Wiener write-back weights.

The volumes are real scans that ship inside nibabel's wheel (its tests/data, nothing is
downloaded): `anatomical.nii` (a T1 brain scan, 33 x 41 x 25 voxels of 2 mm, int16),
`example4d.nii.gz` (an EPI series: its 2 frames of 128 x 96 x 24 voxels, int16) and
`small.mnc` (a MINC brain scan, 18 x 28 x 29, float). Each is one record, released with the
package's own mechanism (sampling/engine.perturb_records with privacy/mechanisms'
calibration, the default k = 128) with --reference auto (here zero: 0) and mid at per-record
eps 2, 4, 8 and 16, seeds 0 to 39 (published weak seeds: right for a table in the docs, never for a release).
The declared range is one a user could give from what such scans hold: from 0 (or, for
anatomical.nii, whose values reach -610, from -1024) to the next power of two at or above the
scan's maximum (for the int16 scans narrower than int16's default range: the range scales the
written deviation and sets where it is clipped). The variants:

- old: the basis before the 3-D DCT, the 2-D DCT over the last two axes with every leading
  axis a channel (projection.DctBasis), with the weights it had then (pre-emphasis a = 0.5;
  the Wiener filter below E<V, u> = 0.1);
- new-unweighted: the 3-D DCT (projection.VolumeDctBasis) without pre-emphasis or weights;
- new: the 3-D DCT with the same weights rule as old, on the 3-D frequencies (what the
  package does).

Measured per release against its record: `corr`, the Pearson correlation of the voxels;
`slices`, the Pearson correlation of the profile of per-slice means along each of the three
axes (mean over the axes); `flat`, the share of slices (of all three axes' slices) along which
the release is constant. Each is the mean over the volumes' records and the 40 seeds (and
`corr_se` the standard error of `corr`). `mean_corr` and `mean_slices` are the same
correlations for the mean of the 40 releases of a record: what many records that share a
structure (a cohort's anatomy) give together, which one release at these eps does not.
`ceiling` is what the basis can carry at all, with no noise: the correlation of the record
with its own projection, r + B^T B (x - r) (the release's expected direction, before
clipping). (The per-slice means of a release are at the display scale, so their relative
error says more about the scale than about the basis; their correlation with the record's
does not depend on it.)

    python docs/choosing-eps/volumes.py --out docs/choosing-eps/volumes.json

It takes about a minute on one core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

EPSILONS = (2.0, 4.0, 8.0, 16.0)
SEEDS = tuple(range(40))
VARIANTS = ("old", "new-unweighted", "new")
REFERENCES = ("auto", "mid")


def volumes() -> dict[str, np.ndarray]:
    """name -> (records, *shape) float64, from nibabel's bundled test data."""
    import nibabel
    import nibabel.tests

    data = Path(os.path.dirname(nibabel.tests.__file__)) / "data"
    out = {}
    for name in ("anatomical.nii", "example4d.nii.gz", "small.mnc"):
        array = np.asarray(nibabel.load(data / name).dataobj, dtype=np.float64)
        out[name] = np.moveaxis(array, 3, 0) if array.ndim == 4 else array[None]
    return out


def calibration(variant: str, epsilon: float, shape: tuple[int, ...], value_range: tuple[float, float],
                reference: str):
    from tldp_cli.privacy import mechanisms, privunit

    calib = mechanisms.calibrate_privunit(epsilon=epsilon, record_shape=shape, value_range=value_range,
                                          reference=reference)
    if variant == "new-unweighted":
        return replace(calib, privunit=replace(calib.privunit, emphasis_exponent=None, prior_exponent=None))
    return calib  # old and new: the same weights rule (pre-emphasis; Wiener below E<V, u> = 0.1)


def release(variant: str, records: np.ndarray, epsilon: float, seed: int,
            value_range: tuple[float, float], reference: str) -> np.ndarray:
    from tldp_cli.sampling import engine, projection
    from tldp_cli.sampling.rng import Streams

    shape = records.shape[1:]
    calib = calibration(variant, epsilon, shape, value_range, reference)
    saved = projection.dct_basis
    if variant == "old":  # the per-slice 2-D DCT of before, for this run only
        projection.dct_basis = lambda s, k: projection.DctBasis(s, k)
    try:
        return engine.perturb_records(records, 0, "volume", calib, Streams("secure", seed, allow_weak_seed=True),
                                      dtype=np.float64)
    finally:
        projection.dct_basis = saved


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    norm = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / norm) if norm > 0 else 0.0


def ceiling(variant: str, records: np.ndarray, epsilon: float, value_range: tuple[float, float],
            reference: str) -> float:
    """The mean correlation of each record with r + B^T B (x - r), its projection on the basis."""
    from tldp_cli.sampling import projection

    params = calibration(variant, epsilon, records.shape[1:], value_range, reference).privunit
    basis = (projection.DctBasis if variant == "old" else projection.dct_basis)(records.shape[1:], params.k)
    x = records - params.reference
    return float(np.mean([pearson(a, b) for a, b in zip(basis.synthesize(basis.project(x)), x)]))


def scores(out: np.ndarray, record: np.ndarray) -> dict[str, float]:
    profiles, flat, slices = [], 0, 0
    for axis in range(3):
        other = tuple(a for a in range(3) if a != axis)
        profiles.append(pearson(out.mean(axis=other), record.mean(axis=other)))
        spread = out.max(axis=other) - out.min(axis=other)
        flat += int((spread == 0).sum())
        slices += spread.size
    return {"corr": pearson(out, record), "slices": float(np.mean(profiles)), "flat": flat / slices}


def declared_range(records: np.ndarray) -> tuple[float, float]:
    """0, or minus the next power of two below a negative minimum, to the next power of two."""
    low = 0.0 if records.min() >= 0 else -(2.0 ** math.ceil(math.log2(-records.min())))
    return low, 2.0 ** math.ceil(math.log2(records.max()))


def row(name: str, records: np.ndarray, epsilon: float, variant: str, reference: str) -> dict:
    value_range = declared_range(records)
    outs = np.stack([release(variant, records, epsilon, seed, value_range, reference) for seed in SEEDS])
    cells = [scores(out, record) for per_seed in outs for out, record in zip(per_seed, records)]
    means = [scores(mean, record) for mean, record in zip(outs.mean(axis=0), records)]
    return {"volume": name, "shape": list(records.shape[1:]), "records": len(records), "range": list(value_range),
            "epsilon": epsilon, "variant": variant, "reference": reference,
            **{key: float(np.mean([c[key] for c in cells])) for key in cells[0]},
            "corr_se": float(np.std([c["corr"] for c in cells]) / math.sqrt(len(cells))),
            "mean_corr": float(np.mean([c["corr"] for c in means])),
            "mean_slices": float(np.mean([c["slices"] for c in means])),
            "ceiling": ceiling(variant, records, epsilon, value_range, reference)}


def measure() -> list[dict]:
    rows = []
    for name, records in volumes().items():
        for reference in REFERENCES:
            for epsilon in EPSILONS:
                for variant in VARIANTS:
                    rows.append(r := row(name, records, epsilon, variant, reference))
                    print(f"{name:17} {reference:4} eps {epsilon:4g} {variant:11} corr {r['corr']:.3f} ± "
                          f"{r['corr_se']:.3f} slices {r['slices']:.3f} flat {r['flat']:.3f} | mean of "
                          f"{len(SEEDS)}: corr {r['mean_corr']:.3f} slices {r['mean_slices']:.3f} | ceiling "
                          f"{r['ceiling']:.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps({"seeds": list(SEEDS), "rows": measure()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
