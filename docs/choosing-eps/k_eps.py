"""Research: where privunit's utility on MNIST stops, and an eps-dependent k rule (issue 28).

It measures, WITHOUT any MNIST test digit, the F1 of `tldp evaluate`'s classifier
(tldp_cli.evaluate.weighted_f1: logistic regression on x / 256, weighted F1) trained on
privunit releases, on:

- "mnist2000": 5-fold cross-validation of the 2000 MNIST *training* digits of
  sample_data/mnist-subset.npz (x_train, y_train only; k_rule.py's split, seed 20261126):
  1600 released training records and 400 clean held-out training digits per fold;
- "digits8": scikit-learn's 8x8 digits (k_rule.py's split: 1200 training, 597 test records);
- "mnist400": 5-fold cross-validation of the 400 shipped MNIST training digits.

What is released is the PACKAGE's pipeline, not a re-implementation: the calibration
(tldp_cli.privacy.mechanisms.calibrate_privunit: the certified split, the cap's floor, the
alignment m, the reference, the display scale, the write-back's rule and the pre-emphasis), the
DCT basis (sampling/projection.py), the directions (sampling/engine.record_directions) and the
write-back (sampling/engine.write_back: reference + c B^T (w * V), clipped, float32). Only the
draw of V is replaced by k_rule.py's inverse-CDF PrivUnit2 with the package's (gamma, p):
the same law up to the floating-point margin (the package's rejection sampler costs 1/q
candidates of k Gaussians per record, too slow for a grid at large eps). `check` compares
the two samplers (mean <V, u> and F1) on the same records.

A variant is a comma-free string of options joined by "+":
  kK      k = K coefficients (default: the package's rule)
  DX      the display divisor X of c = (hi - lo) sqrt(I) / X (default: the package's)
  capX    the cap's floor 2^-X (default: the package's MIN_CAP_PROBABILITY)
  aX      the pre-emphasis exponent X (a0: none)
  exact   no noise: V = u (the pipeline's ceiling: projection, emphasis, normalisation,
          write-back at the display scale, clipping)
  noclip  the write-back without the clip to the range
  diagonal, square  the k coefficients kept are the lowest by i/H + j/W ("diagonal", zig-zag-like)
          or max(i/H, j/W) ("square") instead of the package's (i/H)^2 + (j/W)^2 (ties as the
          package's: the lower i + j, then the lower i)
  unit    c such that the written deviation has the norm of the mean training record (a
          public constant of this research only, to see what the fixed display scale costs)

    python docs/choosing-eps/k_eps.py grid --data mnist2000 --folds 5 --releases 1 \
        --eps 8 --variants exact+k64,exact+k128,exact+k256,exact+k784 --name ceiling-mnist2000

The tables of docs/choosing-eps.md ("Issue 28's gap: k with eps, the display scale and the
cap's floor, re-examined") come from the commands listed there; each JSON under
docs/choosing-eps/k_rule/ also stores the command that wrote it.

Every variant of one (eps, release) draws V from the same stream (paired differences).
Prints one line per (eps, variant) and writes JSON under docs/choosing-eps/k_rule/.
RESEARCH CODE, NOT THE PRODUCT: NumPy's PCG64 with a fixed seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import k_rule  # noqa: E402  (the research script beside this one)

OUT = HERE / "k_rule"


def parse(variant: str) -> dict:
    opts = {"k": None, "D": None, "cap": None, "a": None, "exact": False, "noclip": False, "unit": False,
            "order": "radial"}
    for part in filter(None, variant.split("+")):
        if part in ("exact", "noclip", "unit"):
            opts[part] = True
        elif part in ("diagonal", "square"):
            opts["order"] = part
        elif part.startswith("cap"):
            opts["cap"] = float(part[3:])
        elif part[0] in "kDa":
            opts[part[0]] = int(part[1:]) if part[0] == "k" else float(part[1:])
        else:
            raise SystemExit(f"unknown option {part!r} in {variant!r}")
    return opts


def calibration(eps: float, shape: tuple[int, ...], value_range: tuple[float, float], opts: dict):
    """The package's calibration for these options (k, floor), then the display divisor and the
    pre-emphasis replaced where the variant says."""
    from tldp_cli.privacy import mechanisms, privunit

    kwargs = {} if opts["cap"] is None else {"min_cap": 2.0 ** -opts["cap"]}
    calib = mechanisms.calibrate_privunit(epsilon=eps, record_shape=shape, value_range=value_range,
                                          k=opts["k"], **kwargs)
    params = calib.privunit
    if opts["D"] is not None:
        lo, hi = value_range
        params = dataclasses.replace(params, output_scale=(hi - lo) * math.sqrt(math.prod(shape)) / opts["D"])
    if opts["a"] is not None:
        params = dataclasses.replace(params, emphasis_exponent=None if opts["a"] == 0 else opts["a"])
    return dataclasses.replace(calib, privunit=params)


def ordered_basis(record_shape: tuple[int, ...], k: int, order: str):
    """The package's DCT basis (sampling/projection.DctBasis) with its k coefficients picked by
    another ordering of the frequencies (one channel: the records measured here)."""
    from tldp_cli.sampling import projection

    basis = projection.DctBasis(record_shape, k)
    if order == "radial":
        return basis
    h, w = basis.height, basis.width
    grid_i, grid_j = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    i, j = grid_i.ravel(), grid_j.ravel()
    key = i / h + j / w if order == "diagonal" else np.maximum(i / h, j / w)
    pick = np.lexsort((i, i + j, np.round(key, 12)))[:k]
    basis.index = (np.zeros(k, dtype=int), i[pick], j[pick])
    basis.rows_h = projection.dct_matrix(h, int(i[pick].max()) + 1)
    basis.rows_w = projection.dct_matrix(w, int(j[pick].max()) + 1)
    return basis


def draw(u: np.ndarray, params, rng: np.random.Generator) -> np.ndarray:
    """V for unit rows u: k_rule.privunit (inverse CDF) with the package's (gamma, p) of `params`."""
    from tldp_cli.privacy.privunit import cap_probability

    cal = {"p": params.p, "q": cap_probability(params.gamma, params.k), "gamma": params.gamma}
    return k_rule.privunit(u, cal, rng)


def release(x: np.ndarray, eps: float, value_range, opts: dict, rng: np.random.Generator,
            unit_norm: float | None = None, reference=None, written_from=None,
            zeroed: tuple[int, ...] = ()) -> tuple[np.ndarray, float]:
    """(the records written, the mean <V, u>) through the package's pipeline (module docstring).

    For centering.py: `reference` (a value, an image of the record's shape, or one image per
    record) replaces the package's reference point in u, `written_from` (default: `reference`)
    in the write-back, and the coefficients `zeroed` of V are set to 0 before the write-back."""
    from tldp_cli.sampling import engine

    shape = x.shape[1:]
    calib = calibration(eps, shape, value_range, opts)
    params = calib.privunit
    if opts["unit"]:
        calib = dataclasses.replace(calib, privunit=dataclasses.replace(params, output_scale=unit_norm))
        params = calib.privunit
    basis = engine.privunit_basis(calib, ordered_basis(shape, params.k, opts["order"]))
    if reference is not None:
        calib = dataclasses.replace(calib, privunit=dataclasses.replace(params, reference=reference))
    u = engine.record_directions(x, calib, basis)
    v = u if opts["exact"] else draw(u, params, rng)
    if zeroed:
        v = v.copy()
        v[:, list(zeroed)] = 0.0
    if written_from is not None:
        calib = dataclasses.replace(calib, privunit=dataclasses.replace(calib.privunit, reference=written_from))
    params = calib.privunit
    if opts["noclip"]:
        lo, hi = value_range
        calib = dataclasses.replace(calib, privunit=dataclasses.replace(params, low=-1e300, high=1e300))
    out = engine.write_back(v, calib, basis, np.float32).reshape(x.shape)
    return out, float(np.mean(np.sum(u * v, axis=1)))


def grid(data: str, n_folds: int, releases: int, epsilons: list[float], variants: list[str],
         first_release: int = 0) -> dict:
    from tldp_cli.evaluate import weighted_f1

    warnings.simplefilter("ignore")
    x, y, folds, (lo, hi) = k_rule.DATA[data]()
    folds = folds[:n_folds]
    trained = np.unique(np.concatenate([a for a, _ in folds]))
    clean = [weighted_f1(x[a], y[a], x[b], y[b], "logistic", (lo, hi)) for a, b in folds]
    unit_norm = float(np.mean(np.linalg.norm((x[trained].reshape(len(trained), -1) - lo), axis=1)))
    rows = []
    for eps in epsilons:
        for variant in variants:
            opts = parse(variant)
            t0 = time.perf_counter()
            f1s, aligned = [], []
            for r in range(first_release, first_release + (1 if opts["exact"] else releases)):
                rng = np.random.default_rng([11, round(eps * 1000), r])  # paired across variants
                out = np.array(x, dtype=np.float64)
                out[trained], m = release(x[trained], eps, (lo, hi), opts, rng, unit_norm)
                aligned.append(m)
                f1s += [weighted_f1(out[a], y[a], x[b], y[b], "logistic", (lo, hi)) for a, b in folds]
            calib = calibration(eps, x.shape[1:], (lo, hi), opts)
            rows.append({"eps": eps, "variant": variant, "k": calib.privunit.k, "m": calib.privunit.alignment,
                         "mean_inner": float(np.mean(aligned)), "f1": float(np.mean(f1s)),
                         "f1_se": float(np.std(f1s, ddof=1) / math.sqrt(len(f1s))) if len(f1s) > 1 else None,
                         "f1s": [round(f, 5) for f in f1s], "seconds": round(time.perf_counter() - t0, 1)})
            print(f"{data} eps={eps:g} {variant}: F1 {rows[-1]['f1']:.4f} (k={calib.privunit.k}, "
                  f"m={calib.privunit.alignment:.3f}, {rows[-1]['seconds']} s)", flush=True)
    return {"data": data, "folds": n_folds, "releases": releases, "first_release": first_release,
            "f1_clean": float(np.mean(clean)),
            "sampler": "k_rule.privunit (inverse CDF) with the package's (gamma, p)", "rows": rows}


def check(data: str, eps: float, k: int | None, n_folds: int) -> dict:
    """The package's own sampler (perturb_array, seeded) against this script's, same records."""
    from tldp_cli import perturb_array
    from tldp_cli.evaluate import weighted_f1
    from tldp_cli.sampling import engine

    warnings.simplefilter("ignore")
    x, y, folds, (lo, hi) = k_rule.DATA[data]()
    folds = folds[:n_folds]
    opts = parse("" if k is None else f"k{k}")
    calib = calibration(eps, x.shape[1:], (lo, hi), opts)
    basis = engine.privunit_basis(calib)
    u = engine.record_directions(x, calib, basis)
    result = {}
    t0 = time.perf_counter()
    kwargs = {} if k is None else {"basis": f"dct:{k}"}
    package = perturb_array(x, eps=eps, value_range=(lo, hi), mechanism="privunit", seed="5eed" * 8,
                            allow_weak_seed=True, **kwargs).array
    result["package_seconds"] = round(time.perf_counter() - t0, 1)
    ours, _ = release(x, eps, (lo, hi), opts, np.random.default_rng(3))
    for name, out in (("package", package), ("research", ours)):
        f1 = [weighted_f1(out[a], y[a], x[b], y[b], "logistic", (lo, hi)) for a, b in folds]
        # the direction written back, as a check of the law: <B(out - r), B(x - r)> directions
        result[name] = {"f1": float(np.mean(f1)), "f1s": f1,
                        "mean_written_norm": float(np.mean(np.linalg.norm(out.reshape(len(out), -1), axis=1))),
                        "mean_cos_to_u": float(np.mean(np.sum(
                            engine.record_directions(out, calib, basis) * u, axis=1)))}
    result.update({"data": data, "eps": eps, "k": calib.privunit.k, "m": calib.privunit.alignment})
    print(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grid")
    g.add_argument("--data", choices=sorted(k_rule.DATA), default="mnist2000")
    g.add_argument("--folds", type=int, default=5)
    g.add_argument("--releases", type=int, default=1)
    g.add_argument("--eps", required=True)
    g.add_argument("--variants", required=True)
    g.add_argument("--first-release", type=int, default=0,
                   help="the index of the first release (its stream): continue a grid with more releases")
    g.add_argument("--name", required=True)
    c = sub.add_parser("check")
    c.add_argument("--data", choices=sorted(k_rule.DATA), default="mnist2000")
    c.add_argument("--eps", type=float, default=4.0)
    c.add_argument("--k", type=int, default=None)
    c.add_argument("--folds", type=int, default=2)
    c.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    if args.command == "grid":
        result = grid(args.data, args.folds, args.releases, [float(e) for e in args.eps.split(",")],
                      args.variants.split(","), args.first_release)
    else:
        result = check(args.data, args.eps, args.k, args.folds)
    result["command"] = "python docs/choosing-eps/k_eps.py " + " ".join(argv or sys.argv[1:])
    OUT.mkdir(exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
