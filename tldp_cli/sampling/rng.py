"""Random streams: which bit generator, and how each unit of records gets its own.

A run has one 256-bit root key: SHA-256 of the seed when one is given, fresh OS
entropy otherwise. Each stream unit (a fixed group of consecutive records of one
array) gets a generator keyed by SHA-256(root, array name, unit index), so the
output does not depend on how the reader blocks the data, nor on the order or
the thread in which units run. A record larger than a unit (a model's tensor) is
cut into segments of STREAM_UNIT_ELEMENTS elements, each with a generator keyed by
the record and the segment, so it can be perturbed part by part in flat memory. The seed and the root key never leave this module.

A seed is a secret key: whoever has it regenerates the noise and subtracts it. It
is a string of hex digits (`tldp seed`, secrets.token_hex(16)), or, from Python, a
non-negative integer, which keys the streams as its decimal digits (so 42, "42" and
`--seed 42` agree, and integer seeds give the noise they gave before seeds were
keys). Seeds of fewer than MIN_SEED_BITS bits, and seeds that follow an obvious pattern
(constant, repeated, counting, padded), are refused unless allowed (tests, demos).
"""

from __future__ import annotations

import collections
import hashlib
import math
import operator
import secrets

import numpy as np

from tldp_cli.errors import UsageError

RNG_KINDS = ("secure", "fast")

# Records are grouped into stream units of at most this many elements (at least half
# as many when records are small): large enough that creating a unit's generator is
# cheap against its draws, small enough that its noise stays in a core's cache.
STREAM_UNIT_ELEMENTS = 1 << 18

# Names the layout of the random streams: which records a unit holds (records_per_unit),
# how a unit's key is derived, and the order in which the engine draws from a unit.
# Bump it with any change to those: a resumed run (--resume) refuses to mix blocks
# drawn under another layout.
STREAM_LAYOUT = 6  # 2: float32 Gaussian noise from ziggurat.py; 3: exact samplers on 32-bit candidates;
                  # 4: their rounds of discrete.CHUNK = 2^18 candidates (2^16 before);
                  # 5: an array smaller than a unit is a unit of its own size;
                  # 6: a record larger than a unit draws in segments of a unit's elements


# The bits a seed holds cannot be measured, only bounded. Its length bounds them: 4 bits
# per hex digit of a string, the binary length of an integer; 128 bits puts guessing out
# of reach, and trying the seeds 0..99 takes seconds. A long seed can still be guessable:
# "000...0", "deadbeef" repeated, 0123456789abcdef..., 42 padded with zeros. So a seed is
# also weak when one of a few simple models (below) describes it in fewer than
# PATTERN_BITS bits: a guesser tries those first. Each model is a prefix code (Kraft), so
# a uniformly random seed of b bits gets a description under PATTERN_BITS bits with
# probability at most 2^(PATTERN_BITS - b) (the counting argument): 2^-40 for `tldp seed`'s
# 128 bits. Digits typed by hand or a hash of a password still pass: make seeds with `tldp seed`.
MIN_SEED_BITS = 128
# An integer's binary length drops with its leading zero bits: secrets.randbits(128) is
# under 128 bits long half the time, under 96 with probability 2^-32. So an integer seed
# needs MIN_INT_SEED_BITS; 2^96 guesses are as far out of reach as 2^128.
MIN_INT_SEED_BITS = 96
PATTERN_BITS = 88
# The models: few distinct symbols, and few distinct steps from one symbol to the next
# (counting), each on the hex digits and on their groups of 2, 4 and 8 (bytes, 16- and
# 32-bit words); a repeated block; a run of one symbol (padding). At most 16 of them: 4
# bits say which; an integer is also read as its decimal digits: 1 bit more.
PATTERN_MODEL_BITS = 4
SEED_BYTES = MIN_SEED_BITS // 8
MAKE_SEED = "make one with `tldp seed` (or python -c \"import secrets; print(secrets.token_hex(16))\")"


def seed_text(seed: str | int) -> tuple[str, int]:
    """The text the seed's key is derived from, and how many bits of key material it
    holds (its length, see MIN_SEED_BITS). Error messages never show the seed."""
    if isinstance(seed, str):
        text = seed.strip().lower()
        if not text or not all(c in "0123456789abcdef" for c in text):
            raise UsageError(f"a seed is a string of hex digits (0-9, a-f); {MAKE_SEED}")
        return text, 4 * len(text)
    try:
        number = operator.index(seed)
    except TypeError:
        raise UsageError(f"a seed is a string of hex digits, not a {type(seed).__name__}; "
                         f"{MAKE_SEED}") from None
    if number < 0:
        raise UsageError(f"an integer seed must be >= 0; {MAKE_SEED}")
    return str(number), number.bit_length()


def new_seed() -> str:
    """A fresh seed from the OS's secure source (`tldp seed`): 32 hex digits, 128 bits."""
    return secrets.token_hex(SEED_BYTES)


def _log2_choose(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def _type_bits(symbols: list[int], alphabet: int) -> float:
    """Bits of a two-part code for a sequence: how many distinct symbols (k), which ones,
    how often each occurs, then which arrangement of those counts it is."""
    n = len(symbols)
    counts = sorted(collections.Counter(symbols).values())
    k = len(counts)
    arrangements = math.lgamma(n + 1) - sum(math.lgamma(c + 1) for c in counts)
    return (math.log2(min(n, alphabet)) + _log2_choose(alphabet, k) + _log2_choose(n - 1, k - 1)
            + arrangements / math.log(2))


def _steps(symbols: list[int], alphabet: int) -> list[int]:
    return [(b - a) % alphabet for a, b in zip(symbols, symbols[1:])]


def _pattern_bits(symbols: list[int], alphabet: int) -> float:
    """The shortest description of the sequence among the simple models (bits, the
    choice of model included): what a guesser who tries patterns first has to search."""
    n, per = len(symbols), math.log2(alphabet)
    if n < 2:
        return per * n
    bits = []
    for width in (1, 2, 4, 8) if alphabet == 16 else (1,):  # digits, bytes, 16- and 32-bit words
        if n % width or n // width < 2:
            continue
        words = [int("".join(f"{d:x}" for d in symbols[i:i + width]), 16) for i in range(0, n, width)]
        size = alphabet ** width
        bits += [_type_bits(words, size), per * width + _type_bits(_steps(words, size), size)]
    period = next((p for p in range(1, n) if symbols[p:] == symbols[:-p]), n)  # the shortest
    bits.append(math.log2(n) + per * period)
    run, longest = 1, 1
    for a, b in zip(symbols, symbols[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    bits.append(2 * math.log2(n) + per * (n - longest + 1))  # where, how long, which, the rest
    return PATTERN_MODEL_BITS + min(bits)


def pattern_bits(seed: str | int) -> float:
    """The fewest bits in which a simple model (see PATTERN_BITS) describes the seed: its
    hex digits, or an integer's decimal digits and its hex digits."""
    text, _ = seed_text(seed)
    if isinstance(seed, str):
        return _pattern_bits([int(c, 16) for c in text], 16)
    return 1 + min(_pattern_bits([int(c) for c in text], 10),
                   _pattern_bits([int(c, 16) for c in format(int(text), "x")], 16))


def check_seed(seed: str | int, allow_weak_seed: bool = False) -> bool:
    """Whether the seed is weak (under MIN_SEED_BITS bits of key material, or an obvious
    pattern: see PATTERN_BITS); raises UsageError for something that is not a seed, and
    for a weak seed unless allowed."""
    _, bits = seed_text(seed)
    least = MIN_SEED_BITS if isinstance(seed, str) else MIN_INT_SEED_BITS
    if bits < least:
        if not allow_weak_seed:
            raise UsageError(f"the seed is a secret key and holds only {bits} bits of key material, "
                             f"few enough to guess; use at least {MIN_SEED_BITS} bits "
                             f"({MIN_SEED_BITS // 4} random hex digits): {MAKE_SEED}, or pass "
                             "--allow-weak-seed for tests and demos")
        return True
    described = pattern_bits(seed)
    if described < PATTERN_BITS and not allow_weak_seed:
        raise UsageError(f"the seed is a secret key and follows an obvious pattern (a constant, "
                         f"repeated, counting or padded sequence, or few distinct digits: "
                         f"{described:.0f} bits describe it), which a guesser tries first; use "
                         f"{MIN_SEED_BITS // 4} random hex digits: {MAKE_SEED}, or pass "
                         "--allow-weak-seed for tests and demos")
    return described < PATTERN_BITS


def keyed_name(name: str, key: str | bytes | int | None) -> str:
    """The stream name of array `name` in the release `key` names (a caller's batch, round
    or client): `key`, a NUL, then `name`, so one seed under distinct keys draws distinct
    noise. No key (None or empty) is `name` itself, the streams of an unkeyed call. A str
    key is its UTF-8, bytes their own bytes (b"x" is "x"), an int its decimal digits (7 is
    "7", as integer seeds are). The key, like the seed, is never written anywhere."""
    if key is None or isinstance(key, (str, bytes)) and not key:
        return name
    if isinstance(key, bytes):
        text = key.decode("utf-8", "surrogateescape")  # generator() encodes it back to these bytes
    elif isinstance(key, str):
        text = key
    elif isinstance(key, bool) or not hasattr(key, "__index__"):
        raise UsageError(f"key names a batch: a str, bytes or int, not {type(key).__name__}")
    else:
        text = str(operator.index(key))
    try:
        text.encode("utf-8", "surrogateescape")  # as generator() encodes it
    except UnicodeEncodeError:
        raise UsageError("key is a str with a lone surrogate, which has no bytes: pass it as bytes") from None
    return f"{text}\0{name}"


def records_per_unit(elements_per_record: int, array_records: int | None = None) -> int:
    """A power of two, so units line up with the power-of-two chunks of stored arrays
    and a block of whole chunks draws no noise it does not use. An array of
    `array_records` records, fewer than that, is one unit of its own size: a 28x28 image
    or a bias vector draws its own noise, not that of a unit of 256 or 4096 records."""
    unit = 1 << max(0, (STREAM_UNIT_ELEMENTS // elements_per_record).bit_length() - 1)
    return unit if array_records is None else max(1, min(unit, array_records))


def segments(elements_per_record: int) -> bool:
    """Whether a record of this many elements draws in segments of STREAM_UNIT_ELEMENTS
    (each from generator(name, record, segment)) rather than as (part of) a unit."""
    return elements_per_record > STREAM_UNIT_ELEMENTS


class Streams:
    """Factory of per-unit generators. `kind`: "secure" (AES-128 in counter mode,
    randomgen's AESCounter) or "fast" (PCG64, predictable from its output).

    Seeded, generator(name, unit) is a pure function of the seed, the array name and the
    unit: the output is reproducible whatever the blocking, the workers or the scheduler.
    Unseeded, every call draws fresh key material as well, so no two calls ever repeat
    noise: a library caller perturbing batch after batch with one Streams (or the same
    batch twice) gets independent noise each time, never a difference that cancels it."""

    def __init__(self, kind: str = "secure", seed: str | int | None = None,
                 allow_weak_seed: bool = False):
        if kind not in RNG_KINDS:
            raise ValueError(f"rng must be one of {RNG_KINDS}")
        self.kind = kind
        self.seeded = seed is not None
        self.weak_seed = seed is not None and check_seed(seed, allow_weak_seed)
        if seed is None:
            self._root = secrets.token_bytes(32)
        else:
            self._root = hashlib.sha256(b"tldp-seed/1\0" + seed_text(seed)[0].encode()).digest()

    def __repr__(self) -> str:  # never show the key
        return f"Streams(kind={self.kind!r}, seeded={self.seeded})"

    def generator(self, array_name: str, unit: int, segment: int | None = None) -> np.random.Generator:
        """The generator of a stream unit; `segment`: of that segment of a record larger
        than a unit (segments, the unit is the record's index)."""
        fresh = b"" if self.seeded else secrets.token_bytes(16)
        # A file name that is not UTF-8 comes from os.fsdecode with lone surrogates for the
        # bytes it could not decode: surrogateescape gives the name's own bytes back (and
        # every other name the UTF-8 it always had).
        name = array_name.encode("utf-8", "surrogateescape")
        part = b"" if segment is None else b"\0segment" + segment.to_bytes(8, "little")
        key = hashlib.sha256(
            self._root + b"\0" + name + b"\0" + unit.to_bytes(8, "little") + part + fresh
        ).digest()
        if self.kind == "secure":
            from randomgen import AESCounter

            return np.random.Generator(AESCounter(key=int.from_bytes(key[:16], "little"), counter=0))
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(key, "little"))))
