"""Research: privunit's pre-emphasis and write-back on cross-validation folds of the MNIST *training* digits.

This script chose privunit's pre-emphasis (privacy/privunit.EMPHASIS_EXPONENT) and
measured the write-back variants docs/choosing-eps.md ("Pre-emphasis") lists as tried and
rejected. It reads ONLY the 2000 training digits of sample_data/mnist-subset.npz (x_train,
y_train; the 800 test digits are never read) through k_rule.py's `_mnist2000` (the same
5-fold split, seed 20261126), and uses its first two folds: 1600 training records and 400
held-out training digits each. The companion tables on scikit-learn's 8x8 digits come from
k_rule.py's `grid --paired` with the scales pre/BETA/D (docs/choosing-eps.md gives the commands).

RESEARCH CODE, NOT THE PRODUCT: k_rule.py's own NumPy PrivUnit2 (no floor on the cap's
share, which does not bind at eps <= 8 for k = 128), NumPy's PCG64 with a fixed seed.

A variant is named aA/WRITE[/DD]:
- A: the pre-emphasis exponent. The direction released is u = d z / |d z|, z the record's
  k = 128 lowest DCT-II coefficients, d_j = (1 + f_j)^A (f_j: the coefficient's frequency in
  cycles per record). A = 0: no pre-emphasis; A > 0 weighs the higher frequencies more,
  A < 0 the lower ones.
- WRITE: the write-back weights w in clip(c B^T (w * V), 0, 256), scaled to a mean square of
  1: "flat" (w = 1), "inverse" (w = 1/d: the pre-emphasis undone, the package's rule from
  m = E<V, u> = 0.1 up), "inverse+wiener" (1/d times the Wiener filter of the emphasised
  direction's prior d^2 (1 + f)^-2 at m: privacy/privunit.write_back_weights, the package's
  rule below m = 0.1), "wiener" (the same at A = 0: the rule before the pre-emphasis),
  "sqrt-inverse" (w = d^-1/2), "tiltT" (w = (1 + f)^T, A = 0).
- DD: the display divisor D of c = 256 sqrt(784) / D (default 8, the package's).

Every variant of one (eps, release) draws from the same stream (PCG64 seeded by eps and the
release's index), so their differences are paired. Each release covers all 2000 training
digits; each fold trains tldp evaluate's classifier (tldp_cli.evaluate.weighted_f1:
logistic regression on x / 256) on its 1600 released records and tests on its 400 clean
held-out ones. Prints one line per (eps, release, variant) with the two folds' F1, then the
mean per (eps, variant):

    python docs/choosing-eps/emphasis.py --eps 4,8 --variants a0/flat,a0/tilt-0.5,a0/tilt+0.5,a-0.5/flat,a0.5/flat,a-0.5/sqrt-inverse,a-1/flat
    python docs/choosing-eps/emphasis.py --eps 4 --variants a0.5/inverse,a1/inverse,a0.5/inverse/D16,a0/flat/D16
    python docs/choosing-eps/emphasis.py --eps 8,2 --variants a0/flat,a0.5/inverse,a1/inverse,a0.5/flat
    python docs/choosing-eps/emphasis.py --eps 8 --variants a0.5/inverse/D16,a0/flat/D16
    python docs/choosing-eps/emphasis.py --eps 2 --variants a0/wiener,a0.5/inverse+wiener,a0.5/inverse+wiener/D16
    python docs/choosing-eps/emphasis.py --eps 2 --variants a1/inverse+wiener

and, after the rule was fixed and measured on the test digits (so it chose nothing):

    python docs/choosing-eps/emphasis.py --eps 1 --variants a0/wiener,a0.5/inverse+wiener

(their output, as run: docs/choosing-eps/k_rule/emphasis-mnist2000.txt; some runs were
stopped before their last variants, which the file says).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import k_rule  # noqa: E402  (the research script beside this one)

K = 128
RELEASES = 2


def weights(name: str, f: np.ndarray, m: float) -> tuple[float, np.ndarray, float]:
    """(A, w of mean square 1, divisor D) of a variant aA/WRITE[/DD]."""
    from tldp_cli.privacy import privunit

    parts = name.split("/")
    a = float(parts[0][1:])
    divisor = float(parts[2][1:]) if len(parts) > 2 else 8.0
    write = parts[1]
    d = (1 + f) ** a
    if write == "flat":
        w = np.ones_like(f)
    elif write == "inverse":
        w = 1 / d
    elif write in ("inverse+wiener", "wiener"):
        w = privunit.write_back_weights(f, m, privunit.SPECTRAL_PRIOR_EXPONENT, None if a == 0 else a)
    elif write == "sqrt-inverse":
        w = d ** -0.5
    elif write.startswith("tilt"):
        w = (1 + f) ** float(write[4:])
    else:
        raise SystemExit(f"unknown write-back {write!r} in {name!r}")
    return a, w / math.sqrt(np.mean(w * w)), divisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eps", required=True, help="comma-separated per-record eps")
    parser.add_argument("--variants", required=True, help="comma-separated aA/WRITE[/DD]")
    args = parser.parse_args(argv)
    from tldp_cli.evaluate import weighted_f1

    warnings.simplefilter("ignore")
    x, y, folds, (lo, hi) = k_rule._mnist2000()
    folds = folds[:2]
    basis = k_rule.dct_basis(28, 28, K)
    f = k_rule.frequencies((28, 28), K)
    z = x.reshape(len(x), -1).astype(np.float64) @ basis.T
    results: dict[tuple[float, str], list[float]] = {}
    for eps in (float(e) for e in args.eps.split(",")):
        cal = k_rule.calibrate(eps, K)
        for release in range(RELEASES):
            for name in args.variants.split(","):
                a, w, divisor = weights(name, f, cal["m"])
                zd = z * (1 + f) ** a
                u = zd / np.linalg.norm(zd, axis=1, keepdims=True)
                rng = np.random.default_rng([7, int(eps * 1000), release])  # paired across variants
                v = k_rule.privunit(u, cal, rng)
                c = (hi - lo) * math.sqrt(784) / divisor
                out = np.clip((c * v * w) @ basis + lo, lo, hi).reshape(x.shape)
                f1 = [weighted_f1(out[t], y[t], x[h], y[h], "logistic", (lo, hi)) for t, h in folds]
                results.setdefault((eps, name), []).extend(f1)
                print(f"{eps:g} {release} {name} " + " ".join(f"{v:.4f}" for v in f1), flush=True)
    for (eps, name), f1 in results.items():
        print(f"{eps:g} {name}: {np.mean(f1):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
