"""Peak memory does not grow with the input: measured (peak RSS), never timed."""

import subprocess
import sys
import textwrap

import numpy as np

from tldp_cli.pipeline import PerturbOptions, perturb

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tldp_cli.pipeline import PerturbOptions, perturb
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    perturb(PerturbOptions(input=src, epsilon=1.0, out=out, rng="fast", seed=1,
                           block_elements=1 << 18))
    # VmHWM belongs to this process image; ru_maxrss would include the forking parent's.
    status = Path("/proc/self/status").read_text().splitlines()
    print(next(line.split()[1] for line in status if line.startswith("VmHWM:")))  # KiB
""")


def peak_rss_kib(tmp_path, records):
    src = tmp_path / f"in{records}.npy"
    data = np.lib.format.open_memmap(src, mode="w+", dtype=np.uint8, shape=(records, 1000))
    for start in range(0, records, 10_000):
        data[start:start + 10_000] = start % 251
    del data
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / f"out{records}.npy")],
                            capture_output=True, text=True, check=True)
    return int(result.stdout.strip())


def test_peak_memory_is_flat_in_input_size(tmp_path):
    # 10 MB and 120 MB of uint8 input (40 MB and 480 MB of float32 output), blocks of 0.25 M
    # elements. Holding either array whole would add over 110 MiB; the allowance covers
    # allocator fragmentation, which does not grow with the input.
    small = peak_rss_kib(tmp_path, 10_000)
    large = peak_rss_kib(tmp_path, 120_000)
    grown_mib = (large - small) / 1024
    assert grown_mib < 50, f"peak RSS grew by {grown_mib:.0f} MiB for 12x the input"


def test_block_size_does_not_change_the_output(tmp_path):
    src = tmp_path / "x.npy"
    np.save(src, np.random.default_rng(0).integers(0, 256, (3000, 50), dtype=np.uint8))
    outs = []
    for i, block in enumerate([1 << 12, 1 << 16, 1 << 22]):
        out = tmp_path / f"o{i}.npy"
        perturb(PerturbOptions(input=src, epsilon=1.0, out=out, seed=11, block_elements=block))
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
