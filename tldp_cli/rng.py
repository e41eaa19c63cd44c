"""Random streams: which bit generator, and how each unit of records gets its own.

A run has one 256-bit root key: SHA-256 of the seed when one is given, fresh OS
entropy otherwise. Each stream unit (a fixed group of consecutive records of one
array) gets a generator keyed by SHA-256(root, array name, unit index), so the
output does not depend on how the reader blocks the data, nor on the order or
the thread in which units run. The seed and the root key never leave this module.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np

RNG_KINDS = ("secure", "fast")

# Records are grouped into stream units of at most this many elements (at least half
# as many when records are small): large enough that creating a unit's generator is
# cheap against its draws, small enough that its noise stays in a core's cache.
STREAM_UNIT_ELEMENTS = 1 << 18

# Names the layout of the random streams: which records a unit holds (records_per_unit),
# how a unit's key is derived, and the order in which the engine draws from a unit.
# Bump it with any change to those: a resumed run (--resume) refuses to mix blocks
# drawn under another layout.
STREAM_LAYOUT = 2  # 2: float32 Gaussian noise from ziggurat.py instead of NumPy's sampler


def records_per_unit(elements_per_record: int) -> int:
    """A power of two, so units line up with the power-of-two chunks of stored arrays
    and a block of whole chunks draws no noise it does not use."""
    return 1 << max(0, (STREAM_UNIT_ELEMENTS // elements_per_record).bit_length() - 1)


class Streams:
    """Factory of per-unit generators. `kind`: "secure" (AES-128 in counter mode,
    randomgen's AESCounter) or "fast" (PCG64, predictable from its output)."""

    def __init__(self, kind: str = "secure", seed: int | None = None):
        if kind not in RNG_KINDS:
            raise ValueError(f"rng must be one of {RNG_KINDS}")
        self.kind = kind
        self.seeded = seed is not None
        if seed is None:
            self._root = secrets.token_bytes(32)
        else:
            self._root = hashlib.sha256(b"tldp-seed/1\0" + str(int(seed)).encode()).digest()

    def __repr__(self) -> str:  # never show the key
        return f"Streams(kind={self.kind!r}, seeded={self.seeded})"

    def generator(self, array_name: str, unit: int) -> np.random.Generator:
        key = hashlib.sha256(
            self._root + b"\0" + array_name.encode() + b"\0" + unit.to_bytes(8, "little")
        ).digest()
        if self.kind == "secure":
            from randomgen import AESCounter

            return np.random.Generator(AESCounter(key=int.from_bytes(key[:16], "little"), counter=0))
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(key, "little"))))
