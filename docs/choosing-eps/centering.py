"""Research: does centering the records on a mean image before PrivUnit close issue 28's gap?

privunit releases u = d * B(x - r) / ||.|| (r the public reference, 0 for images), so a record
spends part of its unit norm on what every record shares (the mean digit). Centering on a mean
image r = mean, and writing back mean + c B^T (w * V), gives the classifier-relevant part the
whole unit norm. This script measures, WITHOUT any MNIST test digit, with `tldp evaluate`'s
classifier (tldp_cli.evaluate.weighted_f1), what that is worth, on k_rule.py's data sets
("mnist2000": 5-fold cross-validation of the 2000 MNIST *training* digits; "mnist400": of the
400 shipped training digits; "digits8": scikit-learn's 8x8 digits), each fold's training
records released, its held-out records clean. Variants (the V of round 2 of one (eps, release,
fold) is drawn from the same stream in every variant: paired differences):

  base        the package's pipeline (k_eps.release: its calibration, basis, pre-emphasis,
              directions and write-back), reference 0
  oracle      reference = the NON-private mean image of the fold's training records, written
              back from it (an upper bound, not a mechanism)
  oracleK     the same with the mean projected on the K lowest DCT coefficients
  dc          each record's own mean value subtracted before the projection (a public map of
              the record: no extra eps), V's DC coefficient zeroed, written back from the fold's
              mean value (a single number, here the NON-private one: the control's best case)
  dc0         the same written back from 0 (the package's reference)
  level       the package's pipeline with the reference point (--reference VALUE) at dc's level:
              u = B(x - level) / ||.||, written back from it
  twoF/K      a private two-round mechanism: each record spends eps1 = F * eps on a first
              PrivUnit release of u1 = (B_K x, T) / ||(B_K x, T)|| (its K lowest DCT
              coefficients and a public constant T = (hi - lo) sqrt(I) / 4, which carries the
              scale: the mean is estimated as T * mean(V1[:K]) / mean(V1[K]), a ratio of means of
              LDP outputs, i.e. post-processing), then eps - eps1 on the package's pipeline
              centred on that estimate. Pure composition: eps1 + (eps - eps1) = eps.
  twoF/Ks     the same with each mean coefficient shrunk by max(0, 1 - se^2 / mean^2), se its
              standard error estimated from the releases (post-processing too)

    python docs/choosing-eps/centering.py grid --data digits8 --folds 1 --releases 5 \\
        --eps 2,4,8 --variants base,oracle,dc,dc0 --name oracle-digits8

Prints one line per (eps, variant) and writes JSON under docs/choosing-eps/centering/ (the
command is stored in it). RESEARCH CODE, NOT THE PRODUCT: NumPy's PCG64 with a fixed seed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import k_eps  # noqa: E402  (the research scripts beside this one; k_eps puts the package on the path)
import k_rule  # noqa: E402

OUT = HERE / "centering"


def estimate_mean(x: np.ndarray, eps1: float, k1: int, value_range, rng: np.random.Generator,
                  shrink: bool = False):
    """Round 1 of the two-round mechanism: (the mean image estimated from one PrivUnit release
    per record of (B_K x, T) / ||.|| at eps1, the alignment m1)."""
    from tldp_cli.sampling import privunit, projection

    lo, hi = value_range
    shape = x.shape[1:]
    params = k_eps.calibration(eps1, shape, value_range, k_eps.parse(f"k{k1 + 1}")).privunit
    basis = projection.dct_basis(shape, k1)
    t = (hi - lo) * math.sqrt(math.prod(shape)) / 4.0
    z = basis.project(np.asarray(x, np.float64) - lo)
    u = privunit.unit_directions(np.concatenate([z, np.full((len(z), 1), t)], axis=1))
    released = k_eps.draw(u, params, rng)
    v = released.mean(axis=0)
    if shrink:  # each mean coefficient times max(0, 1 - se^2 / mean^2), se from the releases themselves
        se2 = released.var(axis=0, ddof=1) / len(released)
        v[:k1] *= np.clip(1.0 - se2[:k1] / np.maximum(v[:k1] ** 2, 1e-300), 0.0, 1.0)
    # the scale's estimate mean(T / rho) is floored at 0.05 (a public rule): a ratio of noisy means
    mean = lo + basis.synthesize((t * v[:k1] / max(v[k1], 0.05 * params.alignment))[None])[0]
    return mean, params.alignment


def fold_release(x: np.ndarray, eps: float, value_range, variant: str, streams) -> tuple[np.ndarray, dict]:
    """The fold's training records x released by `variant` (module docstring)."""
    from tldp_cli.sampling import projection

    lo, hi = value_range
    opts = k_eps.parse("")
    info = {}
    mean = np.asarray(x, np.float64).mean(axis=0)
    if variant == "base":
        out, inner = k_eps.release(x, eps, value_range, opts, streams(2))
    elif variant.startswith("oracle"):
        ref = mean
        if variant != "oracle":
            k1 = int(variant[6:])
            basis = projection.dct_basis(x.shape[1:], k1)
            ref = lo + basis.synthesize(basis.project(mean[None] - lo))[0]
        out, inner = k_eps.release(x, eps, value_range, opts, streams(2), reference=ref)
    elif variant == "level":
        out, inner = k_eps.release(x, eps, value_range, opts, streams(2), reference=float(mean.mean()))
    elif variant in ("dc", "dc0"):
        own = np.asarray(x, np.float64).mean(axis=tuple(range(1, x.ndim)), keepdims=True)
        out, inner = k_eps.release(x, eps, value_range, opts, streams(2), reference=own,
                                   written_from=float(mean.mean()) if variant == "dc" else lo, zeroed=(0,))
    elif variant.startswith("two"):
        share, k1 = variant[3:].split("/")
        eps1 = float(share) * eps
        ref, m1 = estimate_mean(x, eps1, int(k1.rstrip("s")), value_range, streams(1), k1.endswith("s"))
        out, inner = k_eps.release(x, eps - eps1, value_range, opts, streams(2), reference=ref)
        norms = np.linalg.norm((np.asarray(x, np.float64) - mean).reshape(len(x), -1), axis=1)
        info = {"eps1": eps1, "m1": m1,
                "mean_error_over_rms_deviation": float(np.linalg.norm(ref - mean) / np.sqrt(np.mean(norms**2)))}
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    info["mean_inner"] = inner
    return out, info


def grid(data: str, n_folds: int, releases: int, epsilons: list[float], variants: list[str],
         train_size: int | None = None, save=lambda result: None) -> dict:
    """The rows of every (eps, variant); `save` is called with the result so far after each row."""
    from tldp_cli.evaluate import weighted_f1

    warnings.simplefilter("ignore")
    x, y, folds, (lo, hi) = k_rule.DATA[data]()
    folds = folds[:n_folds]
    if train_size is not None:  # each fold's first train_size training records of a fixed permutation
        folds = [(np.sort(np.random.default_rng([7, f]).permutation(a)[:train_size]), b)
                 for f, (a, b) in enumerate(folds)]
    clean = [weighted_f1(x[a], y[a], x[b], y[b], "logistic", (lo, hi)) for a, b in folds]
    rows = []
    result = {"data": data, "folds": len(folds), "releases": releases, "train_size": train_size,
              "training_records_per_fold": [len(a) for a, _ in folds], "f1_clean": float(np.mean(clean)),
              "sampler": "k_rule.privunit (inverse CDF) with the package's (gamma, p)", "rows": rows}
    for eps in epsilons:
        for variant in variants:
            t0 = time.perf_counter()
            f1s, infos = [], []
            for r in range(releases):
                for f, (a, b) in enumerate(folds):
                    def streams(n, r=r, f=f):  # round n's generator of (eps, release, fold)
                        return np.random.default_rng([10 + n, round(eps * 1000), r, f])
                    out, info = fold_release(x[a], eps, (lo, hi), variant, streams)
                    infos.append(info)
                    f1s.append(weighted_f1(out, y[a], x[b], y[b], "logistic", (lo, hi)))
            row = {"eps": eps, "variant": variant, "f1": float(np.mean(f1s)),
                   "f1_sd": float(np.std(f1s, ddof=1)) if len(f1s) > 1 else None,
                   "f1_se": float(np.std(f1s, ddof=1) / math.sqrt(len(f1s))) if len(f1s) > 1 else None,
                   "f1s": [round(v, 5) for v in f1s], "seconds": round(time.perf_counter() - t0, 1)}
            for key in infos[0]:
                row[key] = float(np.mean([i[key] for i in infos]))
            base = next((b for b in rows if b["eps"] == eps and b["variant"] == "base"), None)
            if base is not None and variant != "base":
                diff = np.array(f1s) - np.array(base["f1s"])
                row["paired_gain"] = float(diff.mean())
                row["paired_gain_se"] = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else None
            rows.append(row)
            gain = f", gain {row['paired_gain']:+.4f}" if "paired_gain" in row else ""
            print(f"{data} eps={eps:g} {variant}: F1 {row['f1']:.4f}{gain} ({row['seconds']} s)", flush=True)
            save(result)
    return result


def table(names: list[str]) -> str:
    """The markdown rows of docs/choosing-eps.md: F1 mean ± sd over folds x releases, and the
    paired gain over base ± its standard error, per (JSON, variant) and eps."""
    lines = []
    for name in names:
        result = json.loads((OUT / f"{name}.json").read_text())
        epsilons = sorted({row["eps"] for row in result["rows"]})
        for variant in dict.fromkeys(row["variant"] for row in result["rows"]):
            cells = []
            for eps in epsilons:
                row = next((r for r in result["rows"] if r["eps"] == eps and r["variant"] == variant), None)
                if row is None:
                    cells.append("")
                    continue
                cell = f"{row['f1']:.3f} ± {row['f1_sd']:.3f}"
                if "paired_gain" in row:
                    cell += f" ({row['paired_gain']:+.3f} ± {row['paired_gain_se']:.3f})"
                cells.append(cell)
            lines.append(f"| {name} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grid")
    g.add_argument("--data", choices=sorted(k_rule.DATA), default="mnist2000")
    g.add_argument("--folds", type=int, default=5)
    g.add_argument("--releases", type=int, default=3)
    g.add_argument("--eps", required=True)
    g.add_argument("--variants", required=True, help="comma-separated; put base first for paired gains")
    g.add_argument("--train-size", type=int, default=None, help="release only this many training records per fold")
    g.add_argument("--name", required=True)
    t = sub.add_parser("table", help="print the markdown rows of the named JSON files")
    t.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "table":
        print(table(args.names))
        return 0
    command = "python docs/choosing-eps/centering.py " + " ".join(argv or sys.argv[1:])

    def save(result: dict) -> None:  # after every row: a stopped run keeps what it measured
        OUT.mkdir(exist_ok=True)
        (OUT / f"{args.name}.json").write_text(json.dumps({**result, "command": command}, indent=1) + "\n")

    save(grid(args.data, args.folds, args.releases, [float(e) for e in args.eps.split(",")],
              args.variants.split(","), args.train_size, save))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
