"""Throughput of the exact discrete samplers on one core (elements per CPU second).

    python benchmarks/discrete_speed.py

Draws stream units of 2^18 elements from fresh AES-CTR generators, as the engine does.
"""

import sys
import time

import numpy as np

import tldp_cli.sampling.engine  # noqa: F401  (its malloc settings, as in a run)
from tldp_cli.sampling.discrete import DiscreteGaussian, DiscreteLaplace
from tldp_cli.sampling.rng import STREAM_UNIT_ELEMENTS, Streams


def rate(sampler, streams: Streams, units: int) -> float:
    sampler.sample(streams.generator("warm-up", 0), STREAM_UNIT_ELEMENTS)
    start = time.process_time()  # CPU time: other processes on the machine do not count
    for unit in range(units):
        sampler.sample(streams.generator("bench", unit), STREAM_UNIT_ELEMENTS)
    return units * STREAM_UNIT_ELEMENTS / (time.process_time() - start)


def main(units: int = 200) -> None:
    streams = Streams("secure", seed=0, allow_weak_seed=True)  # a benchmark: the noise is thrown away
    print(f"numpy {np.__version__}; {units} units of {STREAM_UNIT_ELEMENTS} elements, AES-CTR")
    for scale in (2.0, 256.0, 2560.0, 200704.0):
        print(f"discrete-laplace  b={scale:<9g} {rate(DiscreteLaplace(scale), streams, units) / 1e6:6.1f} M elements/s")
    for sigma in (181.0, 5069.0, 20000.0):  # 20000: beyond the table of |Z|, CKS20's rejection
        print(f"discrete-gaussian sigma={sigma:<5g} {rate(DiscreteGaussian(sigma), streams, units) / 1e6:6.1f} M elements/s")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
