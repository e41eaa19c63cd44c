"""Two open defaults of privunit for volumes (docs/choosing-eps.md, "Volumes: the default
reference and k"): which --reference `auto` should pick for a volume (zero, as today, or mid),
and whether the default k = min(I, 128) suits volumes (k = 64, 128, 256, 512).

The protocol below was written, and committed, before any of its figures was computed.

THE VOLUMES. Every array in nibabel's tests/data (shipped inside its wheel: nothing is
downloaded) that nibabel reads, that the default basis takes as a volume (projection.is_volume:
a record of three axes not shaped like an image), with at least 4000 voxels per record (so that
k = 512 leaves 8 voxels per coefficient), and that is not a copy, a resampling or a
reorientation of another array in the set. Each 3-D frame of a series is one record; a file's
records are released together.

- development (measured before by docs/choosing-eps/volumes.py, whose figures were seen):
  `anatomical.nii` (T1, 33 x 41 x 25, int16), `example4d.nii.gz` (EPI, 2 frames of
  128 x 96 x 24), `small.mnc` (MINC, 18 x 28 x 29);
- held out (never measured by the project before this script): `scaled+tlrc.HEAD` (AFNI, a
  brain in Talairach space, 47 x 54 x 43, float), `example4d+orig.HEAD` (AFNI, 3 frames of
  33 x 41 x 25, int16), `phantom_EPI_asc_CLEAR_2_1.PAR` (Philips PAR/REC, an EPI of a phantom,
  3 frames of 64 x 64 x 9), `example_nifti2.nii.gz` (NIfTI-2, 2 frames of 32 x 20 x 12, int16),
  `tiny.mnc` (MINC, 10 x 20 x 20).
- left out, with the reason: `functional.nii` (frames of 17 x 21 x 3: the default basis reads
  them as colour images), `minc1_4d.mnc`, `minc2_4d.mnc`, `minc1_1_scale.mnc`,
  `minc2_1_scale.mnc` (copies of tiny.mnc), `reoriented_anat_moved.nii`,
  `resampled_anat_moved.nii` (made from anatomical.nii), `standard.nii.gz`, `test.mgz` (fewer
  than 4000 voxels), the PAR files without data, the DICOM slices (2-D).
  scikit-image's volumes (cells3d, brain, kidney) are fetched from the network on first use:
  not used.

THE RELEASES. The package's own mechanism (sampling/engine.perturb_records with
privacy/mechanisms.calibrate_privunit: the 3-D DCT basis, the pre-emphasis and the write-back's
weights, the display scale, clipping to the range), float64 output, seeds 0 to 39 (published
weak seeds: right for a table in the docs, never for a release). The declared range is the one
docs/choosing-eps/volumes.py gives (declared_range: 0, or minus the next power of two below a
negative minimum, to the next power of two at or above the maximum): what a user could declare
from what such scans hold.

THE MEASURES, per release against its record (volumes.scores), chosen before the runs:
  M1 `corr`         the Pearson correlation of the voxels of one release (mean over records and seeds);
  M2 `mean_corr`    the same for the mean of the 40 releases of a record (what a cohort's many
                    records give together; one release at these eps is mostly noise by design);
  M3 `mean_slices`  the correlation of the profile of per-slice means along each axis (mean over
                    the three axes) of the mean of the 40 releases;
  M4 `slices`       the same profile correlation for one release (reported, not deciding: noisy).
Reported, not deciding: `psnr` (dB, of one release against its record over the declared range:
20 log10((hi - lo) / RMSE)), `clipped` (the share of voxels written at an end of the range) and
`level` (the mean written value over the record's mean). The written values are at a display
scale, not in the scanner's units (c = (hi - lo) sqrt(I) / 8), so their level says how the
release looks, not what it carries; a scan viewer windows the values anyway.

THE DECISIONS, fixed before the runs. A cell is one (file, eps); a win is a strictly higher mean.
1. Reference (part "reference": zero and mid at per-record eps 2, 4, 8, 16, k by the default
   rule). `auto` becomes mid for volumes if mid wins at least 15 of the 20 held-out cells on
   each of M1, M2 and M3, and at least 2/3 of all 32 cells on each. It stays zero if zero wins
   so. Otherwise the evidence is mixed: the rule stays (zero) and the docs give the numbers.
2. k (part "k": k = 64, 128, 256, 512 at per-record eps 2, 4, 8, under both references). A k
   other than 128 is "clearly better" at an eps if it beats k = 128 on each of M1, M2 and M3 in
   at least 7 of the 8 files under the reference auto picks for volumes after decision 1, and in
   at least 6 of 8 under the other reference. The rule for volumes changes only if at every eps
   some k is clearly better and those k are one value (a new constant) or grow with eps (a
   rule of eps, stepping at the geometric middles of the eps measured); otherwise k stays
   min(I, 128). A rule may use eps and the record's shape only, and must leave the bytes of
   every image and 1-D record as they are.

    python docs/choosing-eps/volume_defaults.py reference --out docs/choosing-eps/volume_reference.json
    python docs/choosing-eps/volume_defaults.py k --out docs/choosing-eps/volume_k.json
    python docs/choosing-eps/volume_defaults.py weights --out docs/choosing-eps/volume_weights.json
    python docs/choosing-eps/volume_defaults.py decide docs/choosing-eps/volume_reference.json \
        docs/choosing-eps/volume_k.json

`decide` applies the two decisions above to the JSON files and prints the counts, then the
tables of docs/choosing-eps.md.

AFTER THE RUNS (not part of the protocol above; added once k = 256 had won at eps 4 only): part
"weights" separates k from the write-back's Wiener weights at eps 4, where k = 256's alignment
(0.095) is below the 0.1 that turns them on and k = 128's (0.134) above: k = 128 and 256, each
with the weights off and on, under both references.

The first and third take about a minute on one core, the second two.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import volumes  # noqa: E402  (the research script beside this one: pearson, scores, declared_range)

SEEDS = tuple(range(40))
DEVELOPMENT = ("anatomical.nii", "example4d.nii.gz", "small.mnc")
HELD_OUT = ("scaled+tlrc.HEAD", "example4d+orig.HEAD", "phantom_EPI_asc_CLEAR_2_1.PAR",
            "example_nifti2.nii.gz", "tiny.mnc")
REFERENCE_EPSILONS = (2.0, 4.0, 8.0, 16.0)
K_EPSILONS = (2.0, 4.0, 8.0)
KS = (64, 128, 256, 512)
REFERENCES = ("zero", "mid")
DECIDING = ("corr", "mean_corr", "mean_slices")


def load(name: str) -> np.ndarray:
    """(records, D, H, W) float64: a file of nibabel's test data, one record per 3-D frame."""
    import nibabel
    import nibabel.tests

    array = np.asarray(nibabel.load(Path(os.path.dirname(nibabel.tests.__file__)) / "data" / name).dataobj,
                       dtype=np.float64)
    return np.moveaxis(array, 3, 0) if array.ndim == 4 else array[None]


def calibration(records: np.ndarray, epsilon: float, value_range: tuple[float, float], reference: str,
                k: int | None, weights: str = "rule"):
    """The package's calibration; `weights` "on" or "off" overrides the write-back's Wiener weights
    (part "weights" only; "rule": the package's rule, E<V, u> below 0.1)."""
    from dataclasses import replace

    from tldp_cli.privacy import privunit
    from tldp_cli.privacy.mechanisms import calibrate_privunit

    calib = calibrate_privunit(epsilon=epsilon, record_shape=records.shape[1:], value_range=value_range,
                               reference=reference, k=k)
    if weights == "rule":
        return calib
    exponent = privunit.SPECTRAL_PRIOR_EXPONENT if weights == "on" else None
    return replace(calib, privunit=replace(calib.privunit, prior_exponent=exponent))


def release(records: np.ndarray, epsilon: float, seed: int, value_range: tuple[float, float],
            reference: str, k: int | None, weights: str = "rule") -> np.ndarray:
    from tldp_cli.sampling import engine
    from tldp_cli.sampling.rng import Streams

    calib = calibration(records, epsilon, value_range, reference, k, weights)
    return engine.perturb_records(records, 0, "volume", calib, Streams("secure", seed, allow_weak_seed=True),
                                  dtype=np.float64)


def extra_scores(out: np.ndarray, record: np.ndarray, value_range: tuple[float, float]) -> dict[str, float]:
    lo, hi = value_range
    rmse = math.sqrt(float(np.mean((out - record) ** 2)))
    return {"psnr": 20 * math.log10((hi - lo) / rmse) if rmse > 0 else math.inf,
            "clipped": float(np.mean((out <= lo) | (out >= hi))),
            "level": float(out.mean() / record.mean()) if record.mean() else math.nan}


def row(name: str, records: np.ndarray, epsilon: float, reference: str, k: int | None,
        weights: str = "rule") -> dict:
    value_range = volumes.declared_range(records)
    outs = np.stack([release(records, epsilon, seed, value_range, reference, k, weights) for seed in SEEDS])
    cells = [{**volumes.scores(out, record), **extra_scores(out, record, value_range)}
             for per_seed in outs for out, record in zip(per_seed, records)]
    means = [volumes.scores(mean, record) for mean, record in zip(outs.mean(axis=0), records)]
    params = calibration(records, epsilon, value_range, reference, k, weights).privunit
    return {"volume": name, "set": "development" if name in DEVELOPMENT else "held out",
            "shape": list(records.shape[1:]), "records": len(records), "range": list(value_range),
            "epsilon": epsilon, "reference": reference, "reference_value": params.reference, "k": params.k,
            "alignment": params.alignment, "weighted": params.prior_exponent is not None,
            **{key: float(np.mean([c[key] for c in cells])) for key in cells[0]},
            "corr_se": float(np.std([c["corr"] for c in cells]) / math.sqrt(len(cells))),
            "mean_corr": float(np.mean([c["corr"] for c in means])),
            "mean_slices": float(np.mean([c["slices"] for c in means]))}


def measure(part: str) -> list[dict]:
    rows = []
    for name in DEVELOPMENT + HELD_OUT:
        records = load(name)
        grid = {"reference": [(eps, ref, None, "rule") for ref in REFERENCES for eps in REFERENCE_EPSILONS],
                "k": [(eps, ref, k, "rule") for ref in REFERENCES for eps in K_EPSILONS for k in KS],
                "weights": [(4.0, ref, k, w) for ref in REFERENCES for k in (128, 256) for w in ("off", "on")]}[part]
        for epsilon, reference, k, weights in grid:
            rows.append(r := row(name, records, epsilon, reference, k, weights))
            print(f"{name:30} {reference:4} eps {epsilon:4g} k {r['k']:4} {'w' if r['weighted'] else ' '} "
                  f"corr {r['corr']:.3f} ± {r['corr_se']:.3f} "
                  f"slices {r['slices']:.3f} psnr {r['psnr']:.1f} clipped {r['clipped']:.3f} | mean of "
                  f"{len(SEEDS)}: corr {r['mean_corr']:.3f} slices {r['mean_slices']:.3f}", flush=True)
    return rows


def wins(rows: list[dict], better: dict, worse: dict, measure: str) -> tuple[int, int]:
    """(cells where the `better` selection beats the `worse` one on `measure`, cells)."""
    def pick(selection: dict) -> dict:
        return {(r["volume"], r["epsilon"]): r[measure] for r in rows
                if all(r[key] == value for key, value in selection.items())}
    a, b = pick(better), pick(worse)
    return sum(a[cell] > b[cell] for cell in a), len(a)


def decide_reference(rows: list[dict]) -> str:
    held = [r for r in rows if r["set"] == "held out"]
    verdicts = []
    for name, winner, loser in (("mid", "mid", "zero"), ("zero", "zero", "mid")):
        ok = True
        for measure in DECIDING + ("slices", "psnr"):
            h, hn = wins(held, {"reference": winner}, {"reference": loser}, measure)
            a, an = wins(rows, {"reference": winner}, {"reference": loser}, measure)
            print(f"  {winner} beats {loser} on {measure:11}: held out {h:2}/{hn}, all {a:2}/{an}")
            if measure in DECIDING:
                ok = ok and 4 * h >= 3 * hn and 3 * a >= 2 * an
        verdicts.append(name if ok else None)
    chosen = [v for v in verdicts if v]
    return chosen[0] if chosen else "mixed: the rule stays (zero)"


def decide_k(rows: list[dict], auto: str) -> dict:
    other = "mid" if auto == "zero" else "zero"
    clearly = {}
    for eps in K_EPSILONS:
        clearly[eps] = []
        for k in KS:
            if k == 128:
                continue
            ok = True
            for reference, need in ((auto, 7), (other, 6)):
                sub = [r for r in rows if r["epsilon"] == eps and r["reference"] == reference]
                counts = [wins(sub, {"k": k}, {"k": 128}, m) for m in DECIDING + ("slices",)]
                print(f"  eps {eps:g} {reference:4}: k {k:3} beats 128 on " +
                      ", ".join(f"{m} {w}/{n}" for m, (w, n) in zip(DECIDING + ("slices",), counts)))
                ok = ok and all(w >= need for w, _ in counts[:len(DECIDING)])
            if ok:
                clearly[eps].append(k)
    return clearly


SHORT = {"example4d.nii.gz": "example4d (2 frames)", "example4d+orig.HEAD": "example4d+orig (3 frames)",
         "phantom_EPI_asc_CLEAR_2_1.PAR": "phantom EPI (3 frames)",
         "example_nifti2.nii.gz": "example_nifti2 (2 frames)", "scaled+tlrc.HEAD": "scaled+tlrc"}


def reference_table(rows: list[dict]) -> list[str]:
    """The markdown table of the reference part: zero / mid per (file, eps)."""
    lines = ["| volume | set | ε | one release | mean of 40 | per-slice means of the mean of 40 | PSNR (dB) "
             "| voxels clipped |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    cells = {(r["volume"], r["epsilon"], r["reference"]): r for r in rows}
    for name in DEVELOPMENT + HELD_OUT:
        for eps in REFERENCE_EPSILONS:
            zero, mid = cells[name, eps, "zero"], cells[name, eps, "mid"]
            pair = " | ".join(f"{zero[m]:.3f} / {mid[m]:.3f}".replace("-", "−") for m in DECIDING)
            lines.append(f"| {SHORT.get(name, name)} | {zero['set']} | {eps:g} | {pair} | "
                         f"{zero['psnr']:.1f} / {mid['psnr']:.1f} | {zero['clipped']:.0%} / {mid['clipped']:.1%} |")
    return lines


def k_table(rows: list[dict], reference: str) -> list[str]:
    """The markdown table of the k part under one reference: each measure at each k, per (file, eps)."""
    lines = [f"| volume | ε | " + " | ".join(f"{label}, k = {' / '.join(map(str, KS))}" for label in
                                               ("one release", "mean of 40", "per-slice means of the mean"))
             + " |", "|---|---:|---:|---:|---:|"]
    cells = {(r["volume"], r["epsilon"], r["k"]): r for r in rows if r["reference"] == reference}
    for name in DEVELOPMENT + HELD_OUT:
        for eps in K_EPSILONS:
            parts = [" / ".join(f"{cells[name, eps, k][m]:.2f}".replace("-", "−") for k in KS) for m in DECIDING]
            lines.append(f"| {SHORT.get(name, name)} | {eps:g} | " + " | ".join(parts) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("reference", "k", "weights", "decide"))
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.part == "decide":
        reference_rows, k_rows = (json.loads(f.read_text())["rows"] for f in args.files)
        auto = decide_reference(reference_rows)
        print(f"decision 1 (--reference auto for volumes): {auto}")
        clearly = decide_k(k_rows, "mid" if auto == "mid" else "zero")
        print(f"decision 2 (k clearly better than 128, per eps): {clearly}")
        print("\n".join(["", *reference_table(reference_rows), ""]))
        for reference in REFERENCES:
            print("\n".join([f"k under --reference {reference}:", "", *k_table(k_rows, reference), ""]))
        return
    if args.out is None:
        parser.error("--out is required")
    rows = measure(args.part)
    args.out.write_text(json.dumps({"seeds": list(SEEDS), "part": args.part, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
