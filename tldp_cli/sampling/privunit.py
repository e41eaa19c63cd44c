"""PrivUnit's sampler: a unit vector V from the cap {v : <v, u> >= gamma} with probability
p, else from the rest of the sphere, drawn so that the certified figure holds for the
bytes written (docs/guarantee.md, "PrivUnit").

The record enters through one thing only: which side of the floating-point cap test
[fl(<V, u>) >= gamma] a candidate falls on. Candidates are uniform unit vectors drawn
independently of the record (Gaussians from 53-bit uniforms by the polar method,
normalised), and the first one on the chosen side is released; its bits are a function
of the random stream alone. So the output's law has density p / q_f(u) on the computed cap and
(1 - p) / (1 - q_f(u)) off it against the law of one candidate, with q_f(u) the
candidates' share of the computed cap; privacy/privunit.float_margin bounds q_f(u) for
every u, and accounting.privunit_epsilon turns the bounds into the certified figure.
Sampling the cap directly (t = <V, u> from its marginal, then a direction orthogonal to
u) would be cheaper, but its rounding errors depend on u beyond the cap test, and no
pure bound covers them.

The cost is about p/q + (1-p)/(1-q) candidates of k Gaussians each per record
(privacy/privunit.MIN_CAP_PROBABILITY keeps q away from 0). Draws, in their order: one
uniform for the side (exactly p = p_numerator / 2^53), then batches of candidates (the
polar method's pairs of uniforms, gaussian_pairs), of a size that depends on the side
and on q only.
"""

from __future__ import annotations

import math

import numpy as np

# A batch of candidates holds at most this many values (8 MiB of float64).
BATCH_VALUES = 1 << 20


def gaussian_pairs(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` pairs of independent standard Gaussians, as two arrays (the pairs' first and
    second values), by Marsaglia's polar method exactly as privacy/privunit.float_margin
    analyses it: rounds of n pairs of 53-bit uniforms (n first values, then n second ones),
    v = 2U - 1 (exact), s = fl(fl(v1^2) + fl(v2^2)), the first `count` pairs with 0 < s < 1
    in the order drawn (the others, and any left over, are discarded), then
    v fl(sqrt(fl(fl(-2 fl(ln s)) / s)))."""
    firsts, seconds, squares = [], [], []
    need = count
    while need:
        n = need + need // 3 + 16
        v = rng.random((2, n))
        v *= 2.0
        v -= 1.0
        s = v[0] * v[0]
        s += v[1] * v[1]
        accepted = np.flatnonzero((s > 0) & (s < 1))[:need]
        firsts.append(v[0, accepted])
        seconds.append(v[1, accepted])
        squares.append(s[accepted])
        need -= accepted.size
    s = np.concatenate(squares)
    factor = np.log(s)
    factor *= -2.0
    factor /= s
    np.sqrt(factor, out=factor)
    return np.concatenate(firsts) * factor, np.concatenate(seconds) * factor


def row_inner_products(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fl(<a_j, b_j>) for each row j of the (n, k) arrays a and b (b may be one row,
    broadcast), computed the same way for every row: the k products, then a fixed pairwise
    sum (the first and second halves of the columns added element by element, an odd last
    column carried), every operation one IEEE float64 operation on one element. So a row's
    result is a function of that row alone, whatever its position in the array, the array's
    size or alignment, the BLAS or the number of threads: the cap test's accepted set is a
    set of candidates, and every candidate has the same law, as the argument of
    docs/guarantee.md needs. A BLAS product (batch @ u) gives the same row different
    roundings at different positions (its blocking, vector kernels and threads).
    Error: at most gamma_(ceil(log2 k) + 1) sum |a_i b_i| <= gamma_k |a| |b|."""
    terms = a * b
    while terms.shape[1] > 1:
        half = terms.shape[1] // 2
        summed = terms[:, :half] + terms[:, half:2 * half]
        terms = summed if terms.shape[1] == 2 * half else np.concatenate([summed, terms[:, 2 * half:]], axis=1)
    return terms[:, 0]


def candidates(rng: np.random.Generator, count: int, k: int) -> np.ndarray:
    """`count` uniform unit vectors of R^k: candidate j is the Gaussian pairs j * ceil(k/2)
    to (j + 1) * ceil(k/2) - 1 (gaussian_pairs) side by side, the last value dropped for odd k, divided by
    its norm (row_inner_products, so that a candidate's bits do not depend on its position
    in the batch; a vector of norm 0, impossible for exact Gaussians, becomes e_1: still a
    function of the stream alone)."""
    pairs = (k + 1) // 2
    first, second = gaussian_pairs(rng, count * pairs)
    g = np.empty((count, 2 * pairs))
    g[:, 0::2] = first.reshape(count, pairs)
    g[:, 1::2] = second.reshape(count, pairs)
    g = g[:, :k]
    norm = np.sqrt(row_inner_products(g, g))
    zero = ~(norm > 0)
    if zero.any():
        g = g.copy()
        g[zero] = 0.0
        g[zero, 0] = 1.0
        norm[zero] = 1.0
    return g / norm[:, None]


def unit_directions(z: np.ndarray) -> np.ndarray:
    """Each row of z divided by its norm (first scaled by its largest |value|, so the norm
    neither overflows nor underflows); a row of zeros becomes the fixed public vector e_1."""
    z = np.asarray(z, dtype=np.float64)
    top = np.abs(z).max(axis=1)
    zero = ~(top > 0)
    w = z / np.where(zero, 1.0, top)[:, None]
    norm = np.sqrt(np.einsum("ij,ij->i", w, w))
    u = w / np.where(zero, 1.0, norm)[:, None]
    u[zero] = 0.0
    u[zero, 0] = 1.0
    return u


def batch_size(cap: bool, q: float, k: int) -> int:
    """Candidates per batch: about two expected successes' worth (public: the side and q)."""
    share = q if cap else 1 - q
    return int(max(1, min(math.ceil(2 / share), BATCH_VALUES // k)))


def sample(rng: np.random.Generator, u: np.ndarray, gamma: float, p_numerator: int, q: float) -> np.ndarray:
    """One PrivUnit draw for the unit vector u (k values): the side, P(cap) = p_numerator /
    2^53 exactly, then candidates until one falls on that side of [fl(<V, u>) >= gamma],
    with fl(<V, u>) computed by row_inner_products: the same for a candidate wherever it
    lies in its batch."""
    k = u.shape[0]
    cap = bool(rng.random() < p_numerator * 2.0**-53)  # p_numerator < 2^53: exact
    size = batch_size(cap, q, k)
    while True:
        batch = candidates(rng, size, k)
        hits = np.flatnonzero((row_inner_products(batch, u) >= gamma) == cap)
        if hits.size:
            return batch[hits[0]]
