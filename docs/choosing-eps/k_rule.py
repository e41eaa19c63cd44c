"""Research: the public rules of privunit: its number of DCT coefficients k, its write-back, its colour handling.

This script chose the default k rule of `--mechanism privunit`, its write-back (the weights
w of reference + c B^T (w * V)) and how colour records are projected. It uses ONLY scikit-learn's bundled data (the 8x8 digits of `load_digits` and the
two photos of `load_sample_images`) and, for a sanity check, cross-validation folds of the
400 shipped MNIST *training* digits (sample_data/digits.npy). It never reads an MNIST test
digit: the rule is chosen without the data the issue's targets are measured on.

RESEARCH CODE, NOT THE PRODUCT. It carries its own small NumPy/SciPy PrivUnit2
(Bhowmick et al. 2018) so that it could run before the package's mechanism existed; the
release a user gets comes from tldp_cli's mechanism (secure randomness, floating-point margin,
manifest), never from this file. The randomness here is NumPy's PCG64 with a fixed seed.

Protocol (docs/choosing-eps.md, "How the default k was chosen"):

1. Records: a 2-D record of shape (H, W) is projected on the orthonormal 2-D DCT-II basis;
   the k coefficients kept are the k lowest normalised frequencies, ordered by
   (u/H)^2 + (v/W)^2 ("radial"), or by u/H + v/W ("diagonal", zig-zag-like), or by
   max(u/H, v/W) ("square"), ties by u then v. z = B (x - lo), u = z / |z|.
2. PrivUnit2 at per-record eps: (gamma, eps0) chosen to maximise m = E<V, u> subject to
   eps0 + ln((1 - q) / q) = eps, q the cap's share of the sphere S^{k-1}.
3. Written back as x_out = lo + B^T (c V): at the package's display scale
   c = (hi - lo) sqrt(I) / D (clipped to the range, as the package writes, or not), or
   c = s / m ("unbiased": E[x_out - lo] = s B^T u, s = (hi - lo) sqrt(I) / 2, a public norm);
   "clip/D@T" writes from lo + T (hi - lo) instead of lo (T = 0.5: mid-range; T < 0: a
   threshold, values below -T (hi - lo) above lo written as lo); "wiener/D/A" writes
   lo + c B^T (w * V), clipped, with the Wiener weights w of a public 1/(1 + f)^A spectral
   prior (wiener_weights; the package's write-back is wiener/8/2).
4. Utility: tldp_cli.evaluate.weighted_f1 (what `tldp evaluate` runs: logistic regression
   on (x - lo) / (hi - lo), weighted F1) trained on the releases of the training records,
   tested on the clean test records.

Data sets: "digits8" = load_digits (1797 8x8 records, 10 classes, range 0:16), split by a
fixed permutation into 1200 training and 597 test records; "digits28" = the same records
upsampled to 28x28 (cubic spline, clipped to 0:16), to see whether the rule transfers to a
larger record of the same content; "mnist400" = 5-fold cross-validation of the 400 shipped
MNIST training digits (classes 0, 1, 6, 9; range 0:256); "mnist2000" = 5-fold cross-validation
of the 2000 MNIST *training* digits of sample_data/mnist-subset.npz (its test digits are never
read), the size of the measurement in docs/reproduction.md section 3.

Colour: load_sample_images' china.jpg and flower.jpg cut into 32 x 32 x 3 patches (520
records), released with the channels as they are (RGB, the k coefficients split equally)
or through an orthonormal luminance/chroma transform (YCbCr's luma row, Gram-Schmidt for
the chroma rows) with a share of the k coefficients for luminance; PSNR and SSIM of each
release against its original. The release's scale is the oracle |z| * m (the smallest
expected error a release of the direction alone can reach), so the comparison measures
the direction's quality and nothing else.

The tables of docs/choosing-eps.md ("How the default k was chosen") come from these
commands (a few minutes each on an idle core; the 28x28 ones longer):

    python docs/choosing-eps/k_rule.py grid --data digits8 --repeats 5 --k 16,24,32,48,64 --scales tldp/2,tldp/4,tldp/8 --name digits8-tldp
    python docs/choosing-eps/k_rule.py grid --data digits8 --repeats 5 --k 32,64 --scales clip/8,noclip/8,clip/2,noclip/2,unbiased --name digits8-clip
    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 1 --k 64,128,256,784 --scales unbiased,clip/8,clip/2,noclip/2 --name mnist400-scales
    python docs/choosing-eps/k_rule.py grid --data digits28 --repeats 3 --k 32,64,128,256 --scales clip/8 --name digits28-clip
    python docs/choosing-eps/k_rule.py colour --repeats 2 --shares rgb,0.5,0.6666666666666666
    python docs/choosing-eps/k_rule.py fit --tables digits8-tldp:tldp/8,mnist400-scales:clip/8,digits28-clip:clip/8

The write-back (docs/choosing-eps.md, "How the write-back was chosen"; these tables are
from before the weighted write-back, so "tldp/D" rows in them used c B^T V):

    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 2 --k 128 --eps 1,2 --scales clip/8,clip/8@0.5,noclip/8 --name writeback-mid-mnist400
    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 1 --k 128 --eps 2,4,8 --scales clip/8,clip/8@-0.0625,clip/8@-0.125,clip/8@-0.25 --name writeback-threshold-mnist400
    python docs/choosing-eps/k_rule.py grid --data digits8 --repeats 3 --k 64 --eps 2,4,8 --scales clip/8,clip/8@-0.0625,clip/8@-0.125,clip/8@-0.25,clip/8@0.5 --name writeback-threshold-digits8
    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 2 --k 128 --eps 2,4,8 --scales clip/8,clip/16,clip/32 --name writeback-divisor-mnist400
    python docs/choosing-eps/k_rule.py grid --data digits8 --repeats 5 --k 64 --eps 2,4,8 --scales clip/8,clip/16,clip/32,clip/4 --name writeback-divisor-digits8
    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 3 --k 128 --eps 2,4,8 --scales clip/8,wiener/8/2,wiener/8/1 --name writeback-wiener-mnist400
    python docs/choosing-eps/k_rule.py grid --data digits8 --repeats 5 --k 64 --eps 2,4,8 --scales clip/8,wiener/8/2,wiener/8/1 --name writeback-wiener-digits8

and, after the weights (then for every eps) had been measured on the MNIST test digits, on
the 2000 training digits (which set the alignment threshold privunit.WEIGHTED_BELOW_ALIGNMENT):

    python docs/choosing-eps/k_rule.py grid --data mnist2000 --repeats 1 --k 128 --eps 4,8,2 --scales clip/8,wiener/8/2 --name writeback-wiener-mnist2000
    python docs/choosing-eps/k_rule.py grid --data mnist2000 --repeats 2 --k 128 --eps 1,2,4,8 --scales clip/8,wiener/8/2 --name writeback-wiener-mnist2000-r2

k re-examined (with the unweighted write-back, then with the weighted one; --train-fraction
0.5 trains each fold on half its records, to see how the best k moves with the number of
records):

    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 3 --k 64,96,128 --eps 2,4,8 --scales clip/8 --name k-clip-mnist400
    python docs/choosing-eps/k_rule.py grid --data digits28 --repeats 3 --k 64,96,128 --eps 2,4,8 --scales clip/8 --name k-clip-digits28
    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 3 --k 64,96,128 --eps 2,4,8 --scales wiener/8/2 --name k-wiener-mnist400
    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 5 --k 64,128 --eps 1,2 --scales wiener/8/2 --name k-wiener-small-eps-mnist400
    python docs/choosing-eps/k_rule.py grid --data mnist400 --repeats 3 --k 64,128 --eps 2,4 --scales wiener/8/2 --train-fraction 0.5 --name k-wiener-half-mnist400

Each grid's random draws follow from the data set's name and --repeats, in the order of
its cells, so a command gives its table again (on another machine, up to the solver's
floating point).

Scales: "tldp/D" releases with the package's own mechanism (tldp_cli.perturb_array,
--basis dct:k) at display divisor D; "clip/D" and "noclip/D" are this script's PrivUnit2
written back at the package's display scale (hi - lo) sqrt(I) / D, clipped to the range
or not (its calibration has no floor on the cap's share, the package's has 2^-10);
"unbiased" is c = (hi - lo) sqrt(I) / (2 m), unclipped; "pre/B/D" releases the direction of
d * z with d_j = (1 + f_j)^-B (pre-emphasis: B = -0.5 is the package's a = 0.5) and writes back
lo + c B^T (w * V), w = 1/d of mean square 1, clipped, at divisor D (docs/choosing-eps.md,
"Pre-emphasis"). --paired draws every scale of a (k, eps) cell from the same stream.

Every command writes its table as JSON under docs/choosing-eps/k_rule/ and prints it as markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from scipy import special

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "k_rule"
EPSILONS = (1.0, 2.0, 4.0, 8.0, 16.0)
SEED = 20261126  # NumPy PCG64 seed of this research (not a privacy key)
K_GRID = {"digits8": (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64),
          "digits28": (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
          "mnist400": (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 784)}
PLATEAU = 0.005  # k_opt: the smallest k whose mean F1 is within this of the best k's


# --------------------------------------------------------------------------- basis

def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II, rows are frequencies: C[u, t] = a(u) cos(pi (2t + 1) u / (2n))."""
    t = np.arange(n)
    c = np.cos(np.pi * (2 * t[None, :] + 1) * t[:, None] / (2 * n)) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c


def frequency_order(h: int, w: int, ordering: str = "radial") -> np.ndarray:
    """(u, v) pairs of an h x w DCT, lowest normalised frequency first."""
    u, v = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    fu, fv = u / h, v / w
    key = {"radial": fu**2 + fv**2, "diagonal": fu + fv, "square": np.maximum(fu, fv)}[ordering]
    order = np.lexsort((v.ravel(), u.ravel(), np.round(key.ravel(), 12)))
    return np.stack([u.ravel()[order], v.ravel()[order]], axis=1)


def dct_basis(h: int, w: int, k: int, ordering: str = "radial") -> np.ndarray:
    """k x (h*w) orthonormal rows: the k lowest frequencies of the 2-D DCT-II."""
    ch, cw = dct_matrix(h), dct_matrix(w)
    pairs = frequency_order(h, w, ordering)[:k]
    return np.einsum("ki,kj->kij", ch[pairs[:, 0]], cw[pairs[:, 1]]).reshape(k, h * w)


def colour_matrix() -> np.ndarray:
    """Orthonormal 3 x 3 colour transform: luma (YCbCr's 0.299, 0.587, 0.114, normalised)
    first, then two chroma rows by Gram-Schmidt of Cb's and Cr's."""
    rows = np.array([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]])
    q, _ = np.linalg.qr(rows.T)
    q = q.T * np.sign(np.diag(q.T @ rows.T))[:, None]
    return q


def colour_basis(h: int, w: int, k: int, luma_share: float | None, ordering: str = "radial") -> np.ndarray:
    """k x (h*w*3) orthonormal rows for (h, w, 3) records (channels last).

    luma_share None: RGB, each channel the same ceil/floor share of k; otherwise the
    luminance channel gets round(luma_share * k) coefficients and the two chroma
    channels split the rest."""
    if luma_share is None:
        counts, colour = [k // 3 + (i < k % 3) for i in range(3)], np.eye(3)
    else:
        ky = max(1, min(k, int(round(luma_share * k))))
        rest = k - ky
        counts, colour = [ky, rest - rest // 2, rest // 2], colour_matrix()
    rows = []
    for channel, count in enumerate(counts):
        if count:
            spatial = dct_basis(h, w, count, ordering)  # count x hw
            rows.append(np.einsum("ks,c->ksc", spatial, colour[channel]).reshape(count, h * w * 3))
    return np.concatenate(rows)


# --------------------------------------------------------------------------- PrivUnit2

def _cap_share(gamma: np.ndarray, k: int) -> np.ndarray:
    """q = P(<V, u> >= gamma) for V uniform on S^{k-1}, gamma >= 0."""
    return 0.5 * special.betainc((k - 1) / 2.0, 0.5, 1.0 - gamma**2)


def _cap_moment(gamma: np.ndarray, k: int) -> np.ndarray:
    """E[<V, u> ; <V, u> >= gamma] = (1 - gamma^2)^((k-1)/2) / ((k-1) B(1/2, (k-1)/2))."""
    a = (k - 1) / 2.0
    return np.exp(a * np.log1p(-gamma**2) - math.log(k - 1) - special.betaln(0.5, a))


def calibrate(eps: float, k: int) -> dict:
    """(gamma, eps0, q, m) maximising m = E<V, u> at per-record eps (pure)."""
    if k == 1:
        p = 1.0 / (1.0 + math.exp(-eps))
        return {"k": 1, "gamma": 1.0, "eps0": eps, "q": 0.5, "p": p, "m": 2 * p - 1}

    def curve(gamma):
        q = _cap_share(gamma, k)
        eps0 = eps - np.log((1 - q) / q)
        p = 1.0 / (1.0 + np.exp(-eps0))
        a = _cap_moment(gamma, k)
        return q, eps0, p, a * (p / q - (1 - p) / (1 - q))

    gammas = np.linspace(0.0, 1.0, 4001)[:-1]
    for _ in range(3):  # a grid, then two finer grids around its best point
        with np.errstate(divide="ignore", invalid="ignore"):
            q, eps0, p, m = curve(gammas)
        m = np.where((eps0 >= 0) & (q > 0), m, -np.inf)
        i = int(np.argmax(m))
        lo, hi = gammas[max(i - 1, 0)], gammas[min(i + 1, len(gammas) - 1)]
        gammas = np.linspace(lo, hi, 401)
    q, eps0, p, m = curve(np.array([gammas[200]]))
    return {"k": k, "gamma": float(gammas[200]), "eps0": float(eps0[0]), "q": float(q[0]),
            "p": float(p[0]), "m": float(m[0])}


def _tail_inverse(tail: np.ndarray, k: int) -> np.ndarray:
    """t with P(<V, u> >= t) = tail, tail in (0, 1)."""
    a = (k - 1) / 2.0
    upper = tail <= 0.5
    x = special.betaincinv(a, 0.5, np.where(upper, 2 * tail, 2 * (1 - tail)))
    t = np.sqrt(np.clip(1.0 - x, 0.0, 1.0))
    return np.where(upper, t, -t)


def privunit(u: np.ndarray, cal: dict, rng: np.random.Generator) -> np.ndarray:
    """PrivUnit2 of unit rows u (n x k): V on the sphere, in the cap <V, u> >= gamma with
    probability p, uniformly in the cap or in its complement."""
    n, k = u.shape
    in_cap = rng.random(n) < cal["p"]
    if k == 1:
        return np.where(in_cap[:, None], u, -u)
    q = cal["q"]
    draw = rng.random(n)
    tail = np.where(in_cap, draw * q, q + draw * (1 - q))
    tail = np.clip(tail, 1e-300, 1 - 1e-16)
    t = _tail_inverse(tail, k)
    g = rng.standard_normal((n, k))
    g -= (g * u).sum(axis=1, keepdims=True) * u
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    return t[:, None] * u + np.sqrt(1 - t**2)[:, None] * g


def release_tldp(x: np.ndarray, k: int, eps: float, value_range: tuple[float, float], divisor: float,
                 rng: np.random.Generator) -> np.ndarray:
    """The package's own release (tldp_cli.perturb_array, --mechanism privunit --basis dct:k):
    its calibration, sampler, display scale (hi - lo) sqrt(I) / divisor and clipping. The
    divisor is set on the module for this research only."""
    from tldp_cli import perturb_array
    from tldp_cli.privacy import privunit as product

    saved, product.OUTPUT_SCALE_DIVISOR = product.OUTPUT_SCALE_DIVISOR, divisor
    try:
        seed = rng.bytes(16).hex()  # a research seed, drawn from this script's PCG64
        return perturb_array(x, eps=eps, value_range=value_range, mechanism="privunit",
                             basis=f"dct:{k}", seed=seed, allow_weak_seed=True).array
    finally:
        product.OUTPUT_SCALE_DIVISOR = saved


def wiener_weights(shape: tuple[int, ...], k: int, m: float, alpha: float = 2.0) -> np.ndarray:
    """Public per-coefficient weights of a write-back W V: the Wiener filter of a signal m u
    whose energy follows a 1/(1 + f)^alpha power spectrum (alpha = 2: natural images') (f: the
    coefficient's frequency in cycles per record) in noise of 1/k per coefficient, scaled so
    that the mean of the squared weights is 1 (the written deviation keeps its size)."""
    pairs = frequency_order(*shape)[:k]
    f = np.hypot(pairs[:, 0], pairs[:, 1]) / 2.0
    prior = (1.0 + f) ** -alpha
    prior /= prior.sum()
    w = m * m * prior / (m * m * prior + (1 - m * m) / k)
    return w / math.sqrt(np.mean(w * w))


def frequencies(shape: tuple[int, ...], k: int) -> np.ndarray:
    """Each of the k coefficients' spatial frequency in cycles per record, sqrt(i^2 + j^2) / 2."""
    pairs = frequency_order(*shape)[:k]
    return np.hypot(pairs[:, 0], pairs[:, 1]) / 2.0


def emphasis(shape: tuple[int, ...], k: int, beta: float) -> np.ndarray:
    """Public pre-emphasis d_j = (1 + f_j)^-beta of each coefficient (beta = 0: none)."""
    return (1.0 + frequencies(shape, k)) ** -beta


def release(x: np.ndarray, basis: np.ndarray, eps: float, lo: float, scale: str, norm: float,
            rng: np.random.Generator, cal: dict | None = None, v: np.ndarray | None = None) -> np.ndarray:
    """x (n, ...) -> lo + B^T (c V), c = norm / m ("unbiased"), norm ("display") or
    |z| * m per record ("oracle", research only: it uses each record's norm).

    "pre/BETA/D[/WRITE]": pre-emphasis. The direction released is that of d * z, d_j = (1 +
    f_j)^-BETA (a public weight per coefficient), and the record is written back as
    lo + c B^T (w * V), clipped, with w = 1/d scaled to a mean square of 1 and c the display
    scale /D ("pre/BETA/D/noclip": not clipped; "pre/BETA/D/flat": w = 1, V written as released).
    """
    shape = x.shape
    flat = x.reshape(len(x), -1).astype(np.float64) - lo
    z = flat @ basis.T
    if scale.startswith("pre/") and v is None:
        parts = scale.split("/")
        d = emphasis(x.shape[1:], basis.shape[0], float(parts[1]))
        write = parts[3] if len(parts) > 3 else "clip"
        w = np.ones_like(d) if write == "flat" else 1.0 / d
        w = w / math.sqrt(np.mean(w * w))
        zd = z * d
        r = np.linalg.norm(zd, axis=1)
        u = np.where(r[:, None] > 0, zd / np.where(r > 0, r, 1.0)[:, None], np.eye(basis.shape[0])[0])
        cal = cal or calibrate(eps, basis.shape[0])
        v = privunit(u, cal, rng) * w
        kind = "noclip" if write == "noclip" else "clip"
        return release(x, basis, eps, lo, f"{kind}/{parts[2]}", norm, rng, cal, v)
    r = np.linalg.norm(z, axis=1)
    u = np.where(r[:, None] > 0, z / np.where(r > 0, r, 1.0)[:, None], np.eye(basis.shape[0])[0])
    cal = cal or calibrate(eps, basis.shape[0])
    v = privunit(u, cal, rng) if v is None else v
    if scale.startswith("wiener/"):  # wiener/D/A: clip/D of W V, Wiener weights of a public 1/(1+f)^A prior
        _, divisor, alpha = scale.split("/")
        v = v * wiener_weights(x.shape[1:], basis.shape[0], cal["m"], float(alpha))
        return release(x, basis, eps, lo, f"clip/{divisor}", norm, rng, cal, v)
    if scale.startswith("clip/") or scale.startswith("noclip/"):  # the package's display scale, /D
        kind, divisor = scale.split("/")
        divisor, _, at = divisor.partition("@")  # clip/D@T: written from lo + T (hi - lo)
        width = 2 * norm / math.sqrt(basis.shape[1])  # hi - lo
        c = np.full(len(x), 2 * norm / float(divisor))  # (hi - lo) sqrt(I) / D
        out = lo + float(at or 0) * width + (c[:, None] * v) @ basis
        if kind == "clip":
            out = np.clip(out, lo, lo + width)  # to [lo, hi]
        return out.reshape(shape)
    c = {"unbiased": np.full(len(x), norm / cal["m"]), "display": np.full(len(x), norm),
         "oracle": r * cal["m"]}[scale]
    return (lo + (c[:, None] * v) @ basis).reshape(shape)


# --------------------------------------------------------------------------- data

def _digits8():
    """(records, labels, [(train indices, test indices)], range)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(SEED).permutation(len(d.target))
    return d.images, d.target, [(order[:1200], order[1200:])], (0.0, 16.0)


def _digits28():
    from scipy import ndimage

    x, y, folds, value_range = _digits8()
    return np.clip(ndimage.zoom(x, (1, 3.5, 3.5), order=3), 0, 16), y, folds, value_range


def _mnist400():
    x = np.load(ROOT / "sample_data" / "digits.npy")
    y = np.load(ROOT / "sample_data" / "digits_labels.npy")
    fold = np.random.default_rng(SEED).permutation(len(y)) % 5
    return x, y, [(np.flatnonzero(fold != f), np.flatnonzero(fold == f)) for f in range(5)], (0.0, 256.0)


def _mnist2000():
    """5-fold cross-validation of the 2000 MNIST *training* digits of sample_data/mnist-subset.npz
    (x_train, y_train only: its 800 test digits are never read here)."""
    with np.load(ROOT / "sample_data" / "mnist-subset.npz") as data:
        x, y = data["x_train"], data["y_train"]
    fold = np.random.default_rng(SEED).permutation(len(y)) % 5
    return x, y, [(np.flatnonzero(fold != f), np.flatnonzero(fold == f)) for f in range(5)], (0.0, 256.0)


DATA = {"digits8": _digits8, "digits28": _digits28, "mnist400": _mnist400, "mnist2000": _mnist2000}


def public_norm(shape: tuple[int, ...], lo: float, hi: float) -> float:
    """The public norm s: the norm of a record at mid-range, (hi - lo) / 2 * sqrt(I)."""
    return (hi - lo) / 2.0 * math.sqrt(math.prod(shape))


# --------------------------------------------------------------------------- experiments

def grid(data: str, repeats: int, scales: list[str], ordering: str, ks: list[int] | None,
         skip_dc: bool = False, epsilons: tuple[float, ...] = EPSILONS, train_fraction: float = 1.0,
         paired: bool = False) -> dict:
    """Mean F1 over `repeats` releases for every (k, eps, scale). Each release covers the
    records of every training fold at once (with cross-validation: every record, each fold
    then trains on its released training part and tests on its clean test part)."""
    sys.path.insert(0, str(ROOT))
    from tldp_cli.evaluate import weighted_f1

    x, y, folds, (lo, hi) = DATA[data]()
    if train_fraction < 1:  # each fold trains on a fixed random share of its training records
        pick = np.random.default_rng([SEED, 7])
        folds = [(np.sort(pick.permutation(a)[:round(train_fraction * len(a))]), b) for a, b in folds]
    shape = x.shape[1:]
    norm = public_norm(shape, lo, hi)
    rng = np.random.default_rng([SEED, len(data), repeats])
    trained = np.unique(np.concatenate([train for train, _ in folds]))
    clean = float(np.mean([weighted_f1(x[a], y[a], x[b], y[b], "logistic", (lo, hi)) for a, b in folds]))
    rows = []
    for k in ks or K_GRID[data]:
        basis = dct_basis(*shape, k + skip_dc, ordering)[int(skip_dc):]
        offset = (lo + hi) / 2 if skip_dc else lo  # without the DC, the release is centred on mid-range
        for eps in epsilons:
            cal = calibrate(eps, k)
            for scale in scales:
                t0 = time.perf_counter()
                f1s = []
                for r in range(repeats):
                    if paired:  # the same stream for every scale of a cell: paired comparisons
                        rng = np.random.default_rng([SEED, len(data), k, round(eps * 1000), r])
                    released = np.array(x, dtype=np.float64)
                    if scale.startswith("tldp/"):  # the package's mechanism, display divisor D
                        released[trained] = release_tldp(x[trained], k, eps, (lo, hi),
                                                         float(scale.split("/")[1]), rng)
                    else:
                        released[trained] = release(x[trained], basis, eps, offset, scale, norm, rng, cal)
                    f1s += [weighted_f1(released[a], y[a], x[b], y[b], "logistic", (lo, hi)) for a, b in folds]
                rows.append({"k": k, "eps": eps, "scale": scale, "m": cal["m"], "gamma": cal["gamma"],
                             "f1": float(np.mean(f1s)), "f1_sd": float(np.std(f1s, ddof=1)) if len(f1s) > 1 else None,
                             "n": len(f1s), "f1s": [round(f, 5) for f in f1s] if paired else None,
                             "seconds": round(time.perf_counter() - t0, 2)})
                print(f"{data} k={k} eps={eps:g} {scale}: F1 {rows[-1]['f1']:.3f} (m={cal['m']:.3f})",
                      file=sys.stderr)
    return {"data": data, "shape": list(shape), "range": [lo, hi], "ordering": ordering, "skip_dc": skip_dc,
            "repeats": repeats, "folds": len(folds), "train_fraction": train_fraction, "public_norm": norm,
            "paired": paired, "f1_clean": clean, "rows": rows}


def colour(repeats: int, shares: list[float | None], ks: list[int], patch: int = 32) -> dict:
    sys.path.insert(0, str(ROOT))
    from sklearn.datasets import load_sample_images
    from tldp_cli.evaluate import ssim

    patches = []
    for image in load_sample_images().images:
        h, w = image.shape[0] // patch * patch, image.shape[1] // patch * patch
        p = image[:h, :w].reshape(h // patch, patch, w // patch, patch, 3).swapaxes(1, 2)
        patches.append(p.reshape(-1, patch, patch, 3))
    x = np.concatenate(patches).astype(np.float64)
    rng = np.random.default_rng([SEED, 3])
    rows = []
    for k in ks:
        for share in shares:
            basis = colour_basis(patch, patch, k, share)
            for eps in EPSILONS:
                cal = calibrate(eps, k)
                psnr, ssims = [], []
                for _ in range(repeats):
                    y = np.clip(release(x, basis, eps, 0.0, "oracle", 0.0, rng, cal), 0, 255)
                    mse = ((y - x) ** 2).reshape(len(x), -1).mean(axis=1)
                    psnr.append(float(np.mean(10 * np.log10(255.0**2 / mse))))
                    ssims.append(float(np.mean(ssim(x, y, 255.0))))
                rows.append({"k": k, "luma_share": share, "eps": eps, "psnr": float(np.mean(psnr)),
                             "ssim": float(np.mean(ssims))})
                print(f"colour k={k} share={share} eps={eps:g}: PSNR {rows[-1]['psnr']:.2f} "
                      f"SSIM {rows[-1]['ssim']:.3f}", file=sys.stderr)
    return {"data": "load_sample_images 32x32x3 patches", "records": int(len(x)), "repeats": repeats,
            "scale": "oracle |z| m", "rows": rows}


# --------------------------------------------------------------------------- tables and main

def _save(name: str, result: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def grid_table(result: dict, scale: str) -> str:
    """Mean F1 by k (rows) and eps (columns) for one output scale; the best k per eps in bold."""
    rows = [r for r in result["rows"] if r["scale"] == scale]
    ks = sorted({r["k"] for r in rows})
    epsilons = sorted({r["eps"] for r in rows})
    best = {e: max((r for r in rows if r["eps"] == e), key=lambda r: r["f1"])["k"] for e in epsilons}
    f1 = {(r["k"], r["eps"]): r["f1"] for r in rows}
    lines = ["| k | " + " | ".join(f"eps {e:g}" for e in epsilons) + " |",
             "|---:|" + "---:|" * len(epsilons)]
    for k in ks:
        cells = [(f"**{f1[k, e]:.3f}**" if best[e] == k else f"{f1[k, e]:.3f}") if (k, e) in f1 else ""
                 for e in epsilons]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def colour_table(result: dict, metric: str) -> str:
    """Best (over k) PSNR or SSIM per luminance share and eps, with the k reaching it."""
    shares = sorted({r["luma_share"] for r in result["rows"]}, key=lambda s: -1 if s is None else s)
    lines = ["| channels | " + " | ".join(f"eps {e:g}" for e in EPSILONS) + " |",
             "|---|" + "---:|" * len(EPSILONS)]
    for share in shares:
        cells = []
        for e in EPSILONS:
            best = max((r for r in result["rows"] if r["luma_share"] == share and r["eps"] == e),
                       key=lambda r: r[metric])
            cells.append(f"{best[metric]:.{2 if metric == 'psnr' else 3}f} (k {best['k']})")
        name = "RGB, k/3 each" if share is None else f"luma/chroma, luma {share:g} of k"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def one_se_k(rows: list[dict]) -> tuple[int, int]:
    """(best k, the smallest k within one standard error of the best k's mean F1): the
    one-standard-error rule of model selection, for one (data, scale, eps)."""
    best = max(rows, key=lambda r: r["f1"])
    se = (best["f1_sd"] or 0.0) / math.sqrt(best["n"])
    return best["k"], min(r["k"] for r in rows if r["f1"] >= best["f1"] - se)


def rule_k(eps: float, elements: int, per_eps: float, k_min: int, k_max: int) -> int:
    """The candidate rule k = min(I, k_max, max(k_min, round(per_eps * eps)))."""
    return int(min(elements, k_max, max(k_min, round(per_eps * eps))))


def fit(specs: list[str], candidates: list[tuple[float, int, int]]) -> dict:
    """For every candidate (per_eps, k_min, k_max) whose k falls on each table's k grid:
    its mean and worst regret (best F1 minus F1 at the rule's k) over the tables and eps.
    specs: NAME:SCALE, a table of k_rule/ and the output scale of its rows to use."""
    tables = [(json.loads((OUT / f"{spec.split(':')[0]}.json").read_text()), spec.split(":")[1])
              for spec in specs]
    summary = []
    for per_eps, k_min, k_max in candidates:
        regrets = []
        for t, scale in tables:
            rows = [r for r in t["rows"] if r["scale"] == scale]
            elements = math.prod(t["shape"])
            for eps in EPSILONS:
                at = {r["k"]: r["f1"] for r in rows if r["eps"] == eps}
                k = rule_k(eps, elements, per_eps, k_min, k_max)
                if at and k in at:
                    regrets.append(max(at.values()) - at[k])
                elif at:
                    regrets = None
                    break
            if regrets is None:
                break
        if regrets:
            summary.append({"per_eps": per_eps, "k_min": k_min, "k_max": k_max,
                            "mean_regret": float(np.mean(regrets)), "worst_regret": float(np.max(regrets)),
                            "points": len(regrets)})
    return {"tables": specs, "candidates": sorted(summary, key=lambda r: r["mean_regret"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grid", help="F1 over a grid of k and eps")
    g.add_argument("--data", choices=sorted(DATA), default="digits8")
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--scales", default="unbiased,display")
    g.add_argument("--ordering", choices=("radial", "diagonal", "square"), default="radial")
    g.add_argument("--skip-dc", action="store_true", help="leave the DC coefficient out (k from (0, 1) on)")
    g.add_argument("--k", default="", help="comma-separated k values (default: the data's grid)")
    g.add_argument("--train-fraction", type=float, default=1.0, help="train each fold on this share of its records")
    g.add_argument("--eps", default=",".join(f"{e:g}" for e in EPSILONS), help="comma-separated per-record eps")
    g.add_argument("--name", default="", help="output name (default: the data's name and ordering)")
    g.add_argument("--paired", action="store_true",
                   help="draw every scale of a (k, eps) cell from the same stream (paired comparisons)")
    c = sub.add_parser("colour", help="PSNR/SSIM of RGB against luminance/chroma releases")
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--k", default="3,4,6,8,12,16,24,48", help="comma-separated total k values")
    c.add_argument("--shares", default="rgb,0.3333333333333333,0.5,0.6666666666666666,0.8",
                   help="luminance shares of k (rgb: the channels as they are)")
    f = sub.add_parser("fit", help="regret of candidate rules over grid tables")
    f.add_argument("--tables", default="digits8-tldp:tldp/8,mnist400-scales:clip/8",
                   help="NAME:SCALE,...: tables of k_rule/ and the output scale of their rows")
    args = parser.parse_args(argv)
    if args.command == "fit":
        grid_values = [(a, lo, hi) for a in (8, 16, 32, 64) for lo in (16, 32, 64, 128)
                       for hi in (64, 128, 256, 512, 1024) if lo <= hi]
        result = fit(args.tables.split(","), grid_values)
        for spec in result["tables"]:
            name, scale = spec.split(":")
            t = json.loads((OUT / f"{name}.json").read_text())
            rows = [r for r in t["rows"] if r["scale"] == scale]
            print(f"\n{name} ({scale}; clean F1 {t['f1_clean']:.3f}): best k / one-SE k per eps: " +
                  ", ".join(f"eps {e:g}: {'/'.join(map(str, one_se_k([r for r in rows if r['eps'] == e])))}"
                            for e in EPSILONS if any(r["eps"] == e for r in rows)))
        print("\n| k = min(I, k_max, max(k_min, round(a eps))) | mean regret | worst regret | points |")
        print("|---|---:|---:|---:|")
        for c in result["candidates"][:12]:
            print(f"| a {c['per_eps']:g}, k_min {c['k_min']}, k_max {c['k_max']} | {c['mean_regret']:.3f} | "
                  f"{c['worst_regret']:.3f} | {c['points']} |")
        _save("fit", result)
        return 0
    if args.command == "grid":
        scales = args.scales.split(",")
        result = grid(args.data, args.repeats, scales, args.ordering,
                      [int(k) for k in args.k.split(",") if k] or None, args.skip_dc,
                      tuple(float(e) for e in args.eps.split(",")), args.train_fraction, args.paired)
        path = _save(args.name or f"{args.data}-{args.ordering}" + ("-nodc" if args.skip_dc else ""), result)
        for scale in scales:
            print(f"\n{args.data} ({args.ordering}, {scale} scale; clean F1 {result['f1_clean']:.3f}):\n")
            print(grid_table(result, scale))
    else:
        result = colour(args.repeats, [None if s == "rgb" else float(s) for s in args.shares.split(",")],
                        [int(k) for k in args.k.split(",")])
        path = _save("colour", result)
        for metric in ("psnr", "ssim"):
            print(f"\nbest {metric.upper()} over k:\n")
            print(colour_table(result, metric))
    print(f"\nwrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
