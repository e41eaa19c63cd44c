"""Discrete Laplace and discrete Gaussian noise: exact samplers vectorised over whole
arrays, grid snapping for float data, and the integer engine behind --noise
discrete-laplace|discrete-gaussian.

Exactness. Continuous noise computed in floating point leaks the input through the
low-order bits of the output (Mironov 2012). These samplers draw integers whose
distribution is exactly the target probability mass function (total-variation
distance 0, nothing added to delta), from 64-bit words of the per-unit generator:

- Discrete Laplace, P(z) proportional to alpha^|z| with alpha = e^(-1/b): a sign bit and
  |Z| from one 32-bit half of a 64-bit word per value (-0 is 0). |Z| is inverted from
  31 uniform bits against fixed-point tables of its cumulative distribution whose
  entries are proven by interval arithmetic (Python integers and correctly rounded
  decimal exp), using integer comparisons only; a guide table indexed by the uniform's
  top bits gives the answer for most uniforms in two lookups, the next entry or a
  binary search for the rest. A uniform that ties with a table entry draws further
  words and compares against the exact value to as many bits as it takes. Beyond the
  table |Z| continues as a geometric (memorylessness). For a scale too large for one
  table of 2^16 entries: a sign bit and a geometric magnitude split into base-2^16
  digits (independent truncated geometrics), (sign -, 0) rejected (Canonne, Kamath and
  Steinke 2020, Algorithm 2's construction).
- Discrete Gaussian N_Z(0, sigma^2), sigma up to about 8800: the same inversion of |Z|,
  P(|Z| = k) proportional to 2 exp(-k^2 / (2 sigma^2)) (1 for k = 0), against proven
  floors whose normalising sum is bounded by interval arithmetic; the 2^-40 of the mass
  beyond the table by exact rejection from a geometric. No floating-point step.
- Larger sigma: CKS20 Algorithm 3, rejection from the discrete Laplace of scale
  t = floor(sigma) + 1, accepting with probability exp(-(|y| - sigma^2/t)^2 / (2 sigma^2)).
  The acceptance compares a 32-bit uniform with a float64 exp (tabulated over |y|) and
  decides only when the uniform lies more than 2^-40 away; within the margin it compares
  against the exact value. This is exact as long as NumPy's float64 exp errs by less
  than 2^-41 on [0, 1] (it errs by a few units in 2^-53; the test suite checks it
  against decimal arithmetic).
- The keep-the-raw-value step of TLDP is an exact Bernoulli(p) per element against the
  binary expansion of p (p rounded down to a float, so the realised p never exceeds
  the one the accounting uses); it draws nothing when p underflows to 0.

Grid. Integer data is perturbed on the integers: the declared range [lo, hi) holds the
W = hi - lo values lo..hi-1. Float data is snapped to the grid G*Z (round to nearest,
ties to even): values in [lo, hi] land on the grid points round(lo/G)..round(hi/G),
W of them, and the noise is added in grid units. Output values are G * integer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal
from fractions import Fraction

import numpy as np

from tldp_cli.errors import DataError, UsageError
from tldp_cli.privacy.distributions import gaussian_norm
from tldp_cli.privacy.types import DISCRETE_NOISES, is_discrete  # noqa: F401 (discrete.is_discrete)

BITS = 31  # uniform bits inverted per 32-bit candidate word (the lowest bit is the sign)
TABLE_MAX = 1 << 16  # entries of one inversion table, and the base of the digit split
TAIL_BITS = 16  # a top-level table covers all but 2^-16 of the mass
GUIDE_BITS = 17  # at most 2^17 guide entries per table (1 MiB)
ACCEPT_MARGIN = 2.0**-40  # discrete Gaussian acceptance: float decisions only outside it
ACCEPT_TABLE_MAX = 1 << 20  # entries of the discrete Gaussian's acceptance table
# Samplers work through an array in rounds of at most this many candidates: a stream
# unit's noise in one round. Each round is a dozen NumPy calls and two worker threads hand
# the GIL over at every call: rounds of 2^16 made four times the handovers and gave two
# workers 1.4x one worker's rate for the discrete Laplace, rounds of 2^18 1.7x
# (docs/performance.md). The value decides the order of draws (rng.STREAM_LAYOUT).
CHUNK = 1 << 18
_FIXED = 192  # bits of the fixed-point arithmetic that proves the table entries
_LN2 = math.log(2)


# --------------------------------------------------------------------------- exact reals
# A real x in [0, 1] is given by a function bits -> (lo, hi), integers with
# lo <= x * 2^bits <= hi and hi - lo small; more bits, a narrower interval.

_EMAX = 999_999_999


def _contexts(bits: int) -> tuple[Context, Context, Context]:
    digits = bits * 30103 // 100000 + 30  # bits * log10(2) and a margin
    floor, ceiling, unrounded = (Context(prec=digits, rounding=r, Emin=-_EMAX, Emax=_EMAX)
                                 for r in (ROUND_FLOOR, ROUND_CEILING, None))
    return floor, ceiling, unrounded


def _decimal_bounds(q: Fraction, down: Context, up: Context) -> tuple[Decimal, Decimal]:
    n, d = Decimal(q.numerator), Decimal(q.denominator)
    return down.divide(n, d), up.divide(n, d)


def exp_neg_interval(q: Fraction, bits: int) -> tuple[int, int]:
    """lo <= exp(-q) * 2^bits <= hi for rational q >= 0.

    decimal's exp is correctly rounded (within half a unit in the last digit), so one
    digit of slack on each side makes the bounds rigorous.
    """
    down, up, near = _contexts(bits)
    q_lo, q_hi = _decimal_bounds(q, down, up)
    e_lo, e_hi = near.exp(q_hi.copy_negate()), near.exp(q_lo.copy_negate())
    slack = Decimal(f"1e{1 - down.prec}")
    scale = Decimal(1 << bits)
    lo = down.multiply(down.multiply(e_lo, down.subtract(1, slack)), scale)
    hi = up.multiply(up.multiply(e_hi, up.add(1, slack)), scale)
    return int(lo.to_integral_value(ROUND_FLOOR)), int(hi.to_integral_value(ROUND_CEILING))


def _floor_bits(interval, bits: int) -> int:
    """floor(x * 2^bits), exactly: more precision until the interval decides it."""
    extra = 32
    while True:
        lo, hi = interval(bits + extra)
        if lo >> extra == hi >> extra:
            return lo >> extra
        extra *= 2


class _Uniform:
    """A uniform U in [0, 1) of which the first `bits` bits are known (`value`); further
    bits are drawn from the generator when a comparison needs them, and kept, so several
    comparisons see one U."""

    def __init__(self, bits: int, value: int, rng: np.random.Generator):
        self.bits, self.value, self.rng = bits, value, rng

    def below(self, interval) -> bool:
        """U < x. Each tie of the known prefix with x's costs 2^-64 and one more word."""
        while True:
            c = _floor_bits(interval, self.bits)
            if self.value < c:
                return True
            if self.value > c:
                return False
            self.bits += 64
            self.value = (self.value << 64) | int(self.rng.bit_generator.random_raw())


def _geometric_cdf(s: Fraction, m: int, size: int | None):
    """F(m) of Geom(e^-s) (P(M >= k) = e^(-ks)), truncated to {0..size-1} when size is given."""
    def interval(bits: int) -> tuple[int, int]:
        guard = bits + 16
        one = 1 << guard
        e_lo, e_hi = exp_neg_interval((m + 1) * s, guard)
        num_lo, num_hi = one - e_hi, one - e_lo
        if size is None:
            if e_hi <= 1:
                # 0 < e^-(m+1)s <= 2^-guard: F(m) 2^bits lies strictly between 2^bits - 1
                # and 2^bits, so its floor is known without resolving e^-(m+1)s, which for
                # tiny scales (s in the thousands) would take tens of thousands of bits.
                return (1 << bits) - 1, (1 << bits) - 1
            return num_lo >> 16, -((-num_hi) >> 16)
        n_lo, n_hi = exp_neg_interval(size * s, guard)
        den_lo, den_hi = one - n_hi, one - n_lo
        lo = (num_lo << bits) // den_hi
        hi = -((-(num_hi << bits)) // den_lo)
        return lo, hi
    return interval


# --------------------------------------------------------------------------- geometric
def _uint32_words(rng: np.random.Generator, size: int) -> np.ndarray:
    """`size` uniform uint32: the halves of ceil(size / 2) 64-bit words, low half first."""
    return rng.bit_generator.random_raw((size + 1) // 2).view(np.uint32)[:size]


class _Level:
    """Inversion of one geometric variable Geom(beta), beta = e^-s: on {0..size-1}
    (truncated) or on all of N (top level, size None) with the tail by recursion.

    A guide table (Chen and Asau 1974) answers most uniforms from their top bits with two
    lookups: guide[j] is the least m with c[m] >= j 2^shift, so a uniform u whose top
    bits are j has c[m - 1] < u, and m is the answer when also u < c[m]. The others (a
    table entry inside their guide cell, a tie with an entry, the tail) are settled apart."""

    def __init__(self, s: Fraction, size: int | None, bits: int):
        self.s, self.size, self.bits = s, size, bits
        if size is None:
            self.entries = int(min(TABLE_MAX, max(1, math.ceil(TAIL_BITS * _LN2 / float(s)))))
        else:
            self.entries = size
        self._index(self._table())

    def _index(self, table: list[int]) -> None:
        """The table c (floor(2^bits F(m)) for m < entries) and its guide."""
        bits = self.bits
        self.c = np.array(table, dtype=np.uint32)  # entries <= 2^bits <= 2^31
        guide_bits = min(GUIDE_BITS, bits, max(4, (self.entries - 1).bit_length() + 2))
        self.shift = bits - guide_bits
        starts = np.arange(1 << guide_bits, dtype=np.uint64) << np.uint64(self.shift)
        # Capped at K - 1: a uniform beyond the table then fails u < c[K - 1], settled apart.
        self.guide = np.minimum(np.searchsorted(self.c, starts, side="left"),
                                self.entries - 1).astype(np.intp)

    def _table(self) -> list[int]:
        """floor(2^bits F(m)) for every entry, proven by fixed-point interval arithmetic."""
        P = _FIXED
        one = 1 << P
        b_lo, b_hi = exp_neg_interval(self.s, P)
        count = self.entries if self.size is None else self.size
        powers = []
        p_lo = p_hi = one
        for _ in range(count):
            p_lo = (p_lo * b_lo) >> P
            p_hi = -((-p_hi * b_hi) >> P)
            powers.append((p_lo, p_hi))
        shift = P - self.bits
        out = []
        if self.size is None:
            for m, (lo, hi) in enumerate(powers):
                f_lo, f_hi = (one - hi) >> shift, (one - lo) >> shift
                out.append(f_lo if f_lo == f_hi else
                           _floor_bits(_geometric_cdf(self.s, m, None), self.bits))
            return out
        den_lo, den_hi = one - powers[-1][1], one - powers[-1][0]
        for m, (lo, hi) in enumerate(powers[:-1]):
            f_lo = ((one - hi) << P) // den_hi >> shift
            f_hi = -((-((one - lo) << P)) // den_lo) >> shift
            out.append(f_lo if f_lo == f_hi else
                       _floor_bits(_geometric_cdf(self.s, m, self.size), self.bits))
        out.append(1 << self.bits)  # F(size - 1) = 1 exactly: no uniform reaches it
        return out

    def invert(self, u: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The variable for uniforms u (uint32 < 2^bits, one per element): min{m : U < F(m)}."""
        m = np.take(self.guide, np.right_shift(u, self.shift, dtype=np.intp))  # intp: take's fast path
        # Settled where u < c[m] (the guide gives c[m - 1] < u): F(m - 1) <= U < F(m).
        rest = np.flatnonzero(u >= np.take(self.c, m))
        if rest.size:
            m[rest] = self._settle(m[rest] + 1, u[rest], rng)
        return m

    def _settle(self, m: np.ndarray, u: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The uniforms the guide did not settle, given c[m - 1] <= u: the next entry
        settles most, a search the others; then ties and the tail."""
        c, K = self.c, self.entries
        far = np.flatnonzero(np.take(c, m, mode="clip") <= u)  # m = K: c[K - 1] <= u, the tail
        if far.size:
            m[far] = np.searchsorted(c, u[far], side="right")  # c[m - 1] <= u < c[m]
        for i in np.flatnonzero(np.take(c, m - 1) == u):
            m[i] = self._resolve(int(m[i]), int(u[i]), rng)
        if self.size is None:
            tail = np.flatnonzero(m == K)
            if tail.size:
                m[tail] += self.tail(rng, tail.size)
        return m

    def tail(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """M - K given M >= K: by memorylessness the same geometric."""
        return self.draw(rng, size)

    def cdf(self, m: int):
        """F(m) as an interval function of the bits (see _Uniform.below)."""
        return _geometric_cdf(self.s, m, self.size)

    def _resolve(self, m: int, u: int, rng: np.random.Generator) -> int:
        """min{j : U < F(j)} given c[m - 1] <= u <= c[m], when u ties with entries."""
        c = self.c
        while m > 0 and c[m - 1] == u:
            m -= 1
        uniform = _Uniform(self.bits, u, rng)
        while m < self.entries and c[m] == u and not uniform.below(self.cdf(m)):
            m += 1
        return m

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return self.invert(_uint32_words(rng, size) >> (32 - self.bits), rng)


class Geometric:
    """Exact Geom(e^-s) on {0, 1, ...}: base-2^16 digits, each an independent truncated
    geometric, and a top digit with its tail; one uint32 per digit."""

    def __init__(self, s: Fraction, bits: int = BITS):
        if s <= 0:
            raise ValueError("the geometric parameter s must be > 0")
        self.levels: list[_Level] = []
        while math.ceil(TAIL_BITS * _LN2 / float(s)) > TABLE_MAX:
            self.levels.append(_Level(s, TABLE_MAX, bits))
            s *= TABLE_MAX
        self.levels.append(_Level(s, None, bits))

    def from_words(self, u: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The variable, with the first digit inverted from the given uniforms."""
        m = self.levels[0].invert(u, rng)
        weight = 1
        for level in self.levels[1:]:
            weight *= TABLE_MAX
            m += weight * level.draw(rng, m.size)
        return m


GAUSS_TAIL_BITS = 40  # a discrete Gaussian table covers all but about 2^-40 of the mass


def _gaussian_sums(s2: Fraction, entries: int, P: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Fixed-point intervals (P fraction bits) of A(m) = 1 + 2 sum_{k=1..m} e(k), e(k) =
    exp(-k^2 / (2 s2)), for m < entries, and of their limit S. The terms come from the
    recurrence e(k + 1) = e(k) r(k), r(k) = exp(-(2k + 1) / (2 s2)) = r(k - 1) exp(-1/s2),
    summed past the table until the rest, at most e(k) / (1 - r(k)) (the ratios fall),
    is below 2^(-P/2): S is known to about P/2 bits."""
    one = 1 << P
    q_lo, q_hi = exp_neg_interval(1 / s2, P)
    r_lo, r_hi = exp_neg_interval(1 / (2 * s2), P)
    e_lo = e_hi = a_lo = a_hi = one
    prefix = [(a_lo, a_hi)]
    while True:
        e_lo, e_hi = (e_lo * r_lo) >> P, -((-e_hi * r_hi) >> P)
        r_lo, r_hi = (r_lo * q_lo) >> P, -((-r_hi * q_hi) >> P)
        rest_hi = -((-e_hi * one) // (one - r_hi))  # the terms from this one on
        if len(prefix) >= entries and rest_hi <= one >> (P // 2):
            return prefix, (a_lo, a_hi + 2 * rest_hi)
        a_lo, a_hi = a_lo + 2 * e_lo, a_hi + 2 * e_hi
        if len(prefix) < entries:
            prefix.append((a_lo, a_hi))


class _GaussianMagnitude(_Level):
    """|Z| for Z ~ N_Z(0, s2), inverted like a geometric level: P(|Z| = 0) = 1/S and
    P(|Z| = k) = 2 e(k)/S, so F(m) = A(m)/S (see _gaussian_sums); the table entries are
    proven floors of F. The tail beyond the table is drawn by exact rejection."""

    def __init__(self, s2: Fraction, bits: int):
        self.s2, self.size, self.bits = s2, None, bits
        self.entries = gaussian_entries(math.sqrt(s2))
        self._sums_at: dict[int, tuple] = {}  # precision -> _gaussian_sums
        self._tail_proposal: Geometric | None = None
        self._index(self._table())

    def _sums(self, P: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
        if P not in self._sums_at:
            self._sums_at[P] = _gaussian_sums(self.s2, self.entries, P)
        return self._sums_at[P]

    def _table(self) -> list[int]:
        P = _FIXED
        while True:  # more precision in the rare case an entry is not decided
            prefix, (s_lo, s_hi) = self._sums(P)
            table = [(a_lo << self.bits) // s_hi for a_lo, _ in prefix]
            if all(entry == (a_hi << self.bits) // s_lo for entry, (_, a_hi) in zip(table, prefix)):
                return table
            P *= 2

    def cdf(self, m: int):
        def interval(bits: int) -> tuple[int, int]:
            P = _FIXED
            while P < 2 * (bits + 16):  # S is known to P/2 bits
                P *= 2
            prefix, (s_lo, s_hi) = self._sums(P)
            a_lo, a_hi = prefix[m]
            return (a_lo << bits) // s_hi, -((-(a_hi << bits)) // s_lo)
        return interval

    def tail(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """|Z| - K given |Z| >= K: g ~ Geom(exp(-K/s2)) accepted with probability
        exp(-g^2 / (2 s2)), since e(K + g) / e(K) = exp(-K g / s2) exp(-g^2 / (2 s2))."""
        if self._tail_proposal is None:
            self._tail_proposal = Geometric(self.entries / self.s2, self.bits)
        out = np.empty(size, np.int64)
        for i in range(size):
            while True:
                g = int(self._tail_proposal.from_words(_uint32_words(rng, 1) >> (32 - self.bits), rng)[0])
                if g == 0:  # accepted with probability 1 (an exact 1 has no floor to settle)
                    out[i] = 0
                    break
                uniform = _Uniform(64, int(rng.bit_generator.random_raw()), rng)
                gamma = Fraction(g * g) / (2 * self.s2)
                if uniform.below(lambda b, gamma=gamma: exp_neg_interval(gamma, b)):
                    out[i] = g
                    break
        return out


def gaussian_entries(sigma: float) -> int:
    """Entries of the table of |Z| for sigma: past them lies about 2^-GAUSS_TAIL_BITS of the mass."""
    return math.ceil(sigma * math.sqrt(2 * GAUSS_TAIL_BITS * _LN2)) + 1


def _abs_laplace_cdf(s: Fraction, m: int):
    """P(|Z| <= m) = 1 - 2 e^-(m+1)s / (1 + e^-s) for the discrete Laplace with a = e^-s."""
    def interval(bits: int) -> tuple[int, int]:
        guard = bits + 16
        one = 1 << guard
        p_lo, p_hi = exp_neg_interval((m + 1) * s, guard)
        if p_hi <= 1:  # 0 < 1 - F < 2^-(bits + 15): see _geometric_cdf
            return (1 << bits) - 1, (1 << bits) - 1
        a_lo, a_hi = exp_neg_interval(s, guard)
        t_lo = (2 * p_lo << guard) // (one + a_hi)
        t_hi = -((-(2 * p_hi << guard)) // (one + a_lo))
        return (one - t_hi) >> 16, -((-(one - t_lo)) >> 16)
    return interval


class _LaplaceMagnitude(_Level):
    """|Z| of the discrete Laplace with a = e^-s, inverted like a geometric level:
    P(|Z| = 0) = (1 - a)/(1 + a), P(|Z| = k) = 2 (1 - a) a^k / (1 + a). Beyond the table,
    |Z| - K is Geom(a) again (K >= 1), so no value is ever rejected."""

    def __init__(self, s: Fraction, bits: int):
        self.s, self.size, self.bits = s, None, bits
        self.entries = int(min(TABLE_MAX, max(1, math.ceil(TAIL_BITS * _LN2 / float(s)))))
        self._tail_geometric: Geometric | None = None
        self._index(self._table())

    def _table(self) -> list[int]:
        P = _FIXED
        one = 1 << P
        a_lo, a_hi = exp_neg_interval(self.s, P)
        shift = P - self.bits
        out = []
        p_lo, p_hi = a_lo, a_hi  # a^(m + 1)
        for m in range(self.entries):
            t_lo = (2 * p_lo << P) // (one + a_hi)
            t_hi = -((-(2 * p_hi << P)) // (one + a_lo))
            f_lo, f_hi = (one - t_hi) >> shift, (one - t_lo) >> shift
            out.append(f_lo if f_lo == f_hi else _floor_bits(self.cdf(m), self.bits))
            p_lo, p_hi = (p_lo * a_lo) >> P, -((-p_hi * a_hi) >> P)
        return out

    def cdf(self, m: int):
        return _abs_laplace_cdf(self.s, m)

    def tail(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self._tail_geometric is None:
            self._tail_geometric = Geometric(self.s, self.bits)
        return self._tail_geometric.from_words(_uint32_words(rng, size) >> (32 - self.bits), rng)


def _signed_draws(magnitude: _Level, rng: np.random.Generator, size: int) -> np.ndarray:
    """`size` values of a symmetric integer noise from its |Z| level: one uint32 each, bit 0
    the sign (-0 is 0) and the top bits the uniform of |Z|."""
    out = np.empty(size, np.int64)
    for start in range(0, size, CHUNK):
        words = _uint32_words(rng, min(CHUNK, size - start))
        m = magnitude.invert(words >> (32 - magnitude.bits), rng)
        out[start:start + m.size] = DiscreteLaplace.signed(m, np.bitwise_and(words, 1, dtype=np.int64))
    return out


# --------------------------------------------------------------------------- samplers
class DiscreteLaplace:
    """Exact two-sided geometric noise, P(z) = (1 - a)/(1 + a) a^|z|, a = e^(-1/scale)."""

    def __init__(self, scale: float, bits: int = BITS):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"the discrete Laplace scale must be finite and > 0, not {scale}")
        if not 1 <= bits <= BITS:
            raise ValueError(f"bits must be in 1..{BITS}")
        self.scale = float(scale)
        self.bits = bits
        s = 1 / Fraction(self.scale)
        # One table for |Z| when one suffices (no rejection); digits of a geometric otherwise.
        single = math.ceil(TAIL_BITS * _LN2 / float(s)) <= TABLE_MAX
        self.absolute = _LaplaceMagnitude(s, bits) if single else None
        self.accept = (1 + math.exp(-1 / self.scale)) / 2  # 1 - P(sign -, magnitude 0)

    @functools.cached_property
    def magnitude(self) -> Geometric:
        """The geometric magnitude of the sign-and-rejection construction."""
        return Geometric(1 / Fraction(self.scale), self.bits)

    def candidates(self, words: np.ndarray, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """From uint32 words (bit 0 the sign, the top `bits` bits the magnitude's uniform):
        the magnitudes, the signs (1 for -) and the positions to reject (sign -,
        magnitude 0: -0 would count zero twice)."""
        m = self.magnitude.from_words(words >> (32 - self.bits), rng)
        negative = np.bitwise_and(words, 1, dtype=np.int64)
        return m, negative, np.flatnonzero(m < negative)

    @staticmethod
    def signed(m: np.ndarray, negative: np.ndarray) -> np.ndarray:
        """m with its sign, in place: two's complement, -m = (m ^ -1) + 1."""
        m ^= -negative
        m += negative
        return m

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.absolute is not None:
            return _signed_draws(self.absolute, rng, size)
        # Draws a few more than needed and keeps the first `size` not rejected, in order:
        # still independent draws of the target.
        out = np.empty(size, np.int64)
        filled = 0
        while filled < size:
            need = size - filled
            m, negative, reject = self.candidates(
                _uint32_words(rng, min(CHUNK, math.ceil(need / self.accept) + 16)), rng)
            z = np.delete(self.signed(m, negative), reject) if reject.size else self.signed(m, negative)
            z = z[:need]
            out[filled:filled + z.size] = z
            filled += z.size
        return out


class DiscreteGaussian:
    """Exact N_Z(0, sigma^2), P(z) proportional to exp(-z^2 / (2 sigma^2)).

    Tabulated (sigma up to about 8800, a table of at most TABLE_MAX entries): one uint32 per
    value, a sign bit and |Z| inverted from 31 bits against proven floors of its
    distribution (_GaussianMagnitude), -0 being 0. Otherwise CKS20's Algorithm 3: a round
    of n candidates draws n/2 64-bit words, their first n uint32 halves discrete Laplace
    candidates, the next n the uniforms V of their acceptance. V is accepted outright below
    lo(|y|) = floor(2^32 (T - margin)), T the float64 exp of the acceptance probability,
    rejected at or above hi = ceil(2^32 (T + margin)), and decided exactly in between.
    lo is a table over |y| up to where T < margin (lo = 0 for every larger |y|)."""

    def __init__(self, sigma: float, bits: int = BITS, margin: float = ACCEPT_MARGIN,
                 tabulated: bool | None = None):
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"the discrete Gaussian sigma must be finite and > 0, not {sigma}")
        self.sigma = float(sigma)
        self.bits = bits
        s2 = Fraction(self.sigma) ** 2
        if tabulated is None:
            tabulated = gaussian_entries(self.sigma) <= TABLE_MAX
        self.magnitude = _GaussianMagnitude(s2, bits) if tabulated else None
        if not tabulated:
            self._rejection(s2, bits, margin)

    def _rejection(self, s2: Fraction, bits: int, margin: float) -> None:
        """What CKS20's rejection sampler needs."""
        self.t = math.floor(self.sigma) + 1
        self.base = DiscreteLaplace(self.t, bits)
        self.margin = margin
        self._s2, self._centre = s2, s2 / self.t
        self.centre = float(self._centre)
        self.inv_2s2 = 1.0 / (2.0 * self.sigma**2)
        # lo <= V < lo + band holds every undecided V (hi - lo <= 2^33 margin + 2)
        self.band = min(2**32 - 1, math.ceil(2.0**33 * margin) + 2)
        reach = math.ceil(self.centre + self.sigma * math.sqrt(2 * math.log(1 / min(margin, 0.5)))) + 2
        self.lo = self._thresholds(np.arange(reach))[0] if reach <= ACCEPT_TABLE_MAX else None
        # Accepted fraction of the candidates (only sizes the rounds; never affects values).
        a = math.exp(-1 / self.t)
        self.accept = self.base.accept * gaussian_norm(self.sigma) / (
            (1 + a) / (1 - a) * math.exp(self.sigma**2 / (2 * self.t**2)))

    def _thresholds(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """lo and hi - 1 (uint32) for magnitudes m; magnitudes too large for float64 get
        lo = 0, hi - 1 = 2^32 - 1: every V undecided."""
        gap = m.astype(np.float64) - self.centre
        threshold = np.exp(gap * gap * -self.inv_2s2)
        huge = m > 1 << 50
        lo = np.where(huge, 0, np.clip(np.floor((threshold - self.margin) * 2.0**32), 0, 2**32 - 1))
        hi = np.where(huge, 2**32, np.clip(np.ceil((threshold + self.margin) * 2.0**32), 1, 2**32))
        return lo.astype(np.uint32), (hi - 1).astype(np.uint32)

    def _accept_interval(self, y: int):
        gamma = (abs(y) - self._centre) ** 2 / (2 * self._s2)
        return lambda bits: exp_neg_interval(gamma, bits)

    def _accept(self, m: np.ndarray, v: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Acceptance of magnitudes m with uint32 uniforms v (the first 32 bits of V)."""
        lo = np.take(self.lo, m, mode="clip") if self.lo is not None else self._thresholds(m)[0]
        accept = v < lo
        near = v - lo < self.band  # lo <= v < lo + band (uint32 wraps below lo)
        if self.lo is None:
            near |= m > 1 << 50
        maybe = np.flatnonzero(near)
        if maybe.size:
            lo, hi = self._thresholds(m[maybe])
            for i in maybe[(v[maybe] >= lo) & (v[maybe] <= hi)]:
                accept[i] = _Uniform(32, int(v[i]), rng).below(self._accept_interval(int(m[i])))
        return accept

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.magnitude is not None:
            return _signed_draws(self.magnitude, rng, size)
        out = np.empty(size, np.int64)
        # As DiscreteLaplace.sample: enough candidates for one round, most of the time.
        filled = 0
        while filled < size:
            need = size - filled
            count = min(CHUNK, math.ceil(need / self.accept + 4 * math.sqrt(need)) + 16)
            words = rng.bit_generator.random_raw(count).view(np.uint32)
            m, negative, reject = self.base.candidates(words[:count], rng)
            accept = self._accept(m, words[count:], rng)
            accept[reject] = False
            z = self.base.signed(m, negative)[accept][:need]
            out[filled:filled + z.size] = z
            filled += z.size
        return out


@functools.lru_cache(maxsize=32)
def sampler(noise: str, scale: float) -> DiscreteLaplace | DiscreteGaussian:
    if noise == "discrete-laplace":
        return DiscreteLaplace(scale)
    if noise == "discrete-gaussian":
        return DiscreteGaussian(scale)
    raise ValueError(f"not a discrete noise: {noise}")


def retain_mask(rng: np.random.Generator, p: float, size: int) -> np.ndarray:
    """Positions kept, each independently with probability exactly p (a float, so a
    dyadic rational): 64-bit words against p's binary expansion."""
    if p <= 0.0:
        return np.empty(0, np.int64)
    exact = Fraction(p)
    threshold = math.floor(exact * 2**64)
    words = rng.bit_generator.random_raw(size)
    if threshold >= 1 << 64:
        return np.arange(size)
    kept = words < np.uint64(threshold)
    if exact * 2**64 != threshold:
        for i in np.flatnonzero(words == np.uint64(threshold)):
            kept[i] = _Uniform(64, threshold, rng).below(_rational(exact))
    return np.flatnonzero(kept)


def _rational(x: Fraction):
    def interval(bits: int) -> tuple[int, int]:
        lo = (x.numerator << bits) // x.denominator
        return lo, lo + 1
    return interval


# --------------------------------------------------------------------------- grid, dtype
@dataclass(frozen=True)
class Grid:
    """Where the discrete noise is added: the integers (granularity None) or G*Z."""

    granularity: float | None
    low: int  # the smallest value, in grid units
    high: int  # the largest value, in grid units

    @property
    def values(self) -> int:
        """W: how many grid values the declared range holds."""
        return self.high - self.low + 1

    @property
    def range_width(self) -> float:
        """What calibrate takes as range_width (see mechanisms.calibrate)."""
        return float(self.values) if self.granularity is None else self.granularity * (self.high - self.low)


def auto_granularity(lo: float, hi: float, epsilon: float) -> float:
    """The largest power of two at most (hi - lo) / (1024 max(1, eps)): rounding moves a
    value by at most 1/2048 of the range (and of the noise scale Delta/eps). A range or an
    eps at float64's edge has none: 0 or inf, which resolve_grid refuses."""
    step = (hi - lo) / (1024 * max(1.0, epsilon))
    return 2.0 ** math.floor(math.log2(step)) if math.isfinite(step) and step > 0 else step


def resolve_grid(lo: float, hi: float, dtypes: list[np.dtype], granularity: float | None,
                 epsilon: float, where: object) -> Grid:
    """The grid for data of these dtypes declared in [lo, hi) (integers) or [lo, hi] (floats)."""
    if all(np.dtype(d).kind in "iu" for d in dtypes):
        if granularity is not None:
            raise UsageError(f"{where}: --granularity applies to float data; integer data is "
                             "perturbed on the integers")
        if lo != math.floor(lo) or hi != math.floor(hi):
            raise UsageError(f"{where}: discrete noise on integer data needs an integer --range "
                             f"(LO and HI whole numbers), not {lo:g}:{hi:g}")
        grid = Grid(None, int(lo), int(hi) - 1)
    else:
        if granularity is None:
            granularity = auto_granularity(lo, hi, epsilon)
            if not (math.isfinite(granularity) and granularity > 0):
                raise UsageError(f"{where}: the range {lo:g}:{hi:g} with --eps {epsilon:g} is beyond float64 "
                                 "arithmetic (no grid step for the discrete noise); express the values in other "
                                 "units or lower --eps")
        elif not (math.isfinite(granularity) and granularity > 0):
            raise UsageError(f"--granularity must be a finite number > 0, not {granularity}")
        low, high = np.rint(np.array([lo, hi]) / granularity)
        if not (abs(low) < 2**53 and abs(high) < 2**53):
            raise UsageError(f"{where}: --granularity {granularity:g} is too fine for the range "
                             f"{lo:g}:{hi:g} (more than 2^53 grid steps)")
        grid = Grid(float(granularity), int(low), int(high))
    if grid.values < 2:
        raise UsageError(f"{where}: the range {lo:g}:{hi:g} holds a single grid value; "
                         "there is nothing to protect" + ("" if grid.granularity is None
                                                          else " (choose a finer --granularity)"))
    if grid.values > 2**52:
        raise UsageError(f"{where}: the range {lo:g}:{hi:g} holds {grid.values} grid values; "
                         "discrete noise needs at most 2^52 (declare a narrower --range)")
    return grid


def tail_bound(noise: str, scale: float) -> int:
    """T with P(|Z| > T) < 2^-64 for one draw of the noise (grid units).

    Discrete Laplace: P(|Z| > T) <= 2 a^(T+1); discrete Gaussian: sub-Gaussian with
    variance proxy sigma^2 (CKS20), P(|Z| > T) <= 2 exp(-T^2 / (2 sigma^2)).
    """
    if noise == "discrete-laplace":
        return math.ceil(65 * _LN2 * scale)
    return math.ceil(scale * math.sqrt(2 * 65 * _LN2))


def output_dtype(grid: Grid, noise: str, scale: float, float_dtype: str) -> np.dtype:
    """Integer data: the smallest of int8/16/32/64 holding every value within the tail bound
    of the noise around the range. Grid data: float_dtype, if G * n stays exact for every
    such grid value n."""
    t = tail_bound(noise, scale)
    low, high = grid.low - t, grid.high + t
    if grid.granularity is None:
        for int_type in (np.int8, np.int16, np.int32, np.int64):
            info = np.iinfo(int_type)
            if info.min <= low and high <= info.max:
                return np.dtype(int_type)
        raise UsageError(f"the range {grid.low}..{grid.high} and noise of scale {scale:.4g} do not fit "
                         "int64; declare a narrower --range")
    dtype = np.dtype(float_dtype)
    exact = 2**24 if dtype == np.float32 else 2**53
    if max(abs(low), abs(high)) > exact:
        raise UsageError(f"--dtype {float_dtype} cannot hold the grid values exactly (up to "
                         f"{max(abs(low), abs(high))} steps of {grid.granularity:g}); use --dtype float64 "
                         "or a coarser --granularity")
    if not grid.granularity >= np.finfo(dtype).tiny:  # smaller: the values flush to 0 or lose digits
        raise UsageError(f"--dtype {float_dtype} cannot hold grid steps of {grid.granularity:.3g}; "
                         "express the values in smaller units (a wider range) or use --dtype float64")
    largest = grid.granularity * max(abs(low), abs(high))
    if not largest < np.finfo(dtype).max:  # G times the steps: a value past it would be inf
        raise UsageError(f"--dtype {float_dtype} cannot hold values up to {largest:.3g} (the range and "
                         "the noise's tail); express the values in larger units or use --dtype float64")
    return dtype


def manifest_fields(grid: Grid, automatic: bool, dtype: np.dtype) -> dict:
    """What the manifest records about the grid and the output dtype."""
    if grid.granularity is None:
        rule = "integer data: the integers, [lo, hi) holds lo..hi-1"
    elif automatic:
        rule = "automatic: the largest power of two at most (hi - lo) / (1024 max(1, eps))"
    else:
        rule = "--granularity"
    dtype_rule = ("the smallest of int8, int16, int32, int64 holding every grid value within the "
                  "noise's 2^-64 tail bound of the range" if dtype.kind == "i" else
                  f"{dtype}: granularity times the grid value, rounded to {dtype} (exact for a "
                  "power-of-two granularity)")
    return {"granularity": grid.granularity,
            "grid": {"rule": rule, "low": grid.low, "high": grid.high, "values": grid.values,
                     "sensitivity_steps": grid.values - 1, "output_dtype_rule": dtype_rule}}


def saturation_note(dtype: np.dtype) -> str | None:
    if dtype.kind != "i":
        return None
    info = np.iinfo(dtype)
    return (f"saturate at the {dtype} limits [{info.min}, {info.max}] (reached with probability "
            "below 2^-64 per element; never wraps)")


# --------------------------------------------------------------------------- engine
def snap(values: np.ndarray, granularity: float | None, grid: Grid | None = None) -> np.ndarray:
    """Grid units as int64: integers as they are; floats rounded to the nearest multiple
    of G (ties to even). Float values must be integral when there is no granularity.

    The division is done in float64 whatever the input dtype: in float32 or float16 a value
    inside the range can round past the last grid point, or overflow to inf. With `grid`,
    the grid units are also clipped into [grid.low, grid.high] (the range is validated in
    the input dtype, whose rounding of hi can lie a little above it).
    """
    if granularity is not None:
        units = np.rint(values.astype(np.float64) / granularity)
        if grid is not None:
            np.clip(units, grid.low, grid.high, out=units)
        return units.astype(np.int64)
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    rounded = np.rint(values)
    if not np.array_equal(rounded, values):
        raise DataError("discrete noise without a granularity needs integer values")
    return rounded.astype(np.int64)
