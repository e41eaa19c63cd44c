#!/usr/bin/env python3
"""tldp benchmark: engine, end-to-end, reference limits and peers, measured in one run.

    python benchmarks/bench.py [--size-gb 2] [--out results.json] [--quick]

Prints a markdown table and writes every number as JSON. Needs the `bench` extra
for the peers (`pip install ".[bench]"`: OpenDP and diffprivlib); without them
the peer rows say so. Nothing here is a test: no number is asserted, the targets
of issues 6 and 18 are reported as pass or fail. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmark this checkout, installed or not

from tldp_cli.sampling import engine
from tldp_cli.files import output
from tldp_cli.run import pipeline  # noqa: E402
from tldp_cli.formats import ArrayJob  # noqa: E402
from tldp_cli.privacy.mechanisms import calibrate  # noqa: E402
from tldp_cli.sampling.rng import Streams  # noqa: E402

RECORD_SHAPE = (28, 28)  # MNIST-like records: 784 uint8 elements
ELEMENTS = 784
IMAGE_SHAPE = (224, 224, 3)  # the image folder: ImageNet-sized RGB photos
# The Pillow reference loop's Gaussian noise: TLDP-G's scale at eps = 1 for these images
# (Delta = 256, I = 224 x 224 x 3), so its PNGs hold as much noise as tldp's.
PILLOW_SIGMA = 181.0
RUN_NAMES = {"perturb": "perturb", "gaussian": "perturb --noise gaussian",
             "cast": "I/O only: cast, no noise",
             "pillow": "reference: Pillow decode + noise + default PNG save, 1 core"}
EPSILON = 1.0
MECHANISMS = [  # label, --mechanism, --noise (laplace, gaussian: the float sampler)
    ("TLDP-L exact", "tldp", "discrete-laplace"),
    ("TLDP-G exact", "tldp", "discrete-gaussian"),
    ("TLDP-L float", "tldp", "laplace"),
    ("TLDP-G float", "tldp", "gaussian"),
    ("Baseline Laplace float", "baseline", "laplace"),
    ("Baseline Gaussian float", "baseline", "gaussian"),
]
RNG_CHUNK = 1 << 20  # reference draws go into one reused buffer of this many values
SLAB_RECORDS = 1 << 16  # records generated and written at a time (about 51 MB)
GB = 1e9
MB = 1e6
FORMATS = ("npy", "hdf5", "hdf5-gzip", "zarr", "images")

# Runs one end-to-end job in a fresh interpreter so its peak RSS (VmHWM) is its own.
CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
import numpy as np
from tldp_cli import formats
from tldp_cli.run import pipeline
from tldp_cli.formats import FormatOptions

def status_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

src, out = Path(args["input"]), Path(args["output"])
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

rss_before = status_kib("VmRSS")
start, cpu_start = time.perf_counter(), cpu()
if args["kind"] in ("perturb", "gaussian"):
    noise = "gaussian" if args["kind"] == "gaussian" else "laplace"
    pipeline.perturb(pipeline.PerturbOptions(input=src, eps=args["epsilon"], out=out, noise=noise,
                                             workers=args["workers"], rng=args["rng"]))
elif args["kind"] == "pillow":  # the plain loop on one core: decode, noise, Pillow's default PNG save
    from PIL import Image
    rng = np.random.default_rng()
    out.mkdir()
    for path in sorted(src.iterdir()):
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)
        noisy = pixels + rng.normal(0, args["sigma"], pixels.shape).astype(np.float32)
        Image.fromarray(np.clip(np.rint(noisy), 0, 255).astype(np.uint8)).save(out / path.name)
else:  # the pipeline's reader, blocks, threads, writer and output hashes, a cast for the noise
    from tldp_cli.run.manifest import sha256_file
    module = formats.detect(src)
    options = FormatOptions()
    reader = module.open_reader(src, options)
    writer = module.create_writer(reader, out, np.dtype(np.int16), options)  # what perturb writes
    tasks = [(job, a, b) for job in reader.arrays() for a, b in pipeline.block_bounds(job, pipeline.BLOCK_ELEMENTS)]
    def process(job, a, b):
        writer.write(job, a, job.read(a, b).astype(np.int16))
    for (job, a, b), _ in pipeline._run_tasks(process, tasks, args["workers"]):
        if hasattr(writer, "block_written"):
            writer.block_written(job, a, b)
    written = writer.close()
    digests = writer.digests() if hasattr(writer, "digests") else {}
    hashes = [digests.get(f) or sha256_file(f) for f in written]
    reader.close()
seconds, cpu_seconds = time.perf_counter() - start, cpu() - cpu_start
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "rss_before_kib": rss_before,
                  "peak_rss_kib": status_kib("VmHWM")}))
"""


# ---------------------------------------------------------------- machine

def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    ram = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = round(int(line.split()[1]) * 1024 / GB, 1)
    except OSError:
        pass
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu, "cores": os.cpu_count(), "ram_gb": ram,
        "os": platform.platform(), "python": platform.python_version(),
        "versions": {name: version(name) for name in
                     ("tldp", "numpy", "randomgen", "h5py", "zarr", "pillow", "opendp", "diffprivlib")},
    }


# ---------------------------------------------------------------- data

def digits() -> np.ndarray:
    return np.load(REPO / "sample_data" / "digits.npy").reshape(-1, ELEMENTS)


def mnist_like(rng: np.random.Generator, count: int, base: np.ndarray) -> np.ndarray:
    """Real digits in random order, the low two bits of the ink varied so no two are equal."""
    records = base[rng.integers(0, len(base), count)]
    jitter = rng.integers(0, 4, records.shape, dtype=np.uint8)
    records ^= np.where(records > 3, jitter, 0).astype(np.uint8)
    return records.reshape(count, *RECORD_SHAPE)


def slabs(records: int):
    for start in range(0, records, SLAB_RECORDS):
        yield start, min(start + SLAB_RECORDS, records)


def make_npy(path: Path, records: int, rng, base) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
              "shape": (records, *RECORD_SHAPE)}
    with open(path, "wb") as f:  # plain writes: a memmap would count the file in our RSS
        np.lib.format.write_array_header_2_0(f, header)
        for start, stop in slabs(records):
            f.write(mnist_like(rng, stop - start, base).tobytes())


def make_hdf5(path: Path, records: int, rng, base, **filters) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        ds = f.create_dataset("images", shape=(records, *RECORD_SHAPE), dtype=np.uint8,
                              chunks=(1024, *RECORD_SHAPE), **filters)
        for start, stop in slabs(records):
            ds[start:stop] = mnist_like(rng, stop - start, base)


def make_hdf5_gzip(path: Path, records: int, rng, base) -> None:
    """netCDF-4's filters: shuffle, then deflate at level 4 (netCDF4-python's default)."""
    make_hdf5(path, records, rng, base, compression="gzip", compression_opts=4, shuffle=True)


def make_zarr(path: Path, records: int, rng, base) -> None:
    import zarr

    z = zarr.create_array(store=str(path), shape=(records, *RECORD_SHAPE), dtype=np.uint8,
                          chunks=(1024, *RECORD_SHAPE), zarr_format=3)  # default codecs: zstd
    for start, stop in slabs(records):
        z[start:stop] = mnist_like(rng, stop - start, base)


def make_images(path: Path, count: int, rng, base) -> None:
    """RGB photos of digits: each upscaled 8x, tinted per channel, on a smooth gradient."""
    from PIL import Image

    path.mkdir()
    h, w, _ = IMAGE_SHAPE
    gradient = np.add.outer(np.linspace(0, 60, h), np.linspace(0, 60, w))
    for i in range(count):
        digit = np.kron(base[rng.integers(0, len(base))].reshape(RECORD_SHAPE), np.ones((8, 8)))
        tint = rng.uniform(0.5, 1.0, 3)
        pixels = np.clip(digit[..., None] * tint * 0.75 + gradient[..., None], 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(path / f"{i:06d}.png")


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------- timing helpers

def best_seconds(run, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def interleaved_best(runs: list, reps: int) -> list[float]:
    """The best time of each run over `reps` rounds; each round runs every one in turn,
    so a load that comes and goes on the machine weighs on all of them alike."""
    best = [math.inf] * len(runs)
    for _ in range(reps):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def rate(elements: int, seconds: float) -> float:
    return elements / seconds / 1e6


# ---------------------------------------------------------------- engine and limits

def engine_cases(data: np.ndarray) -> list[tuple[dict, object]]:
    """perturb_records over the blocks the pipeline would make, in its thread runner."""
    job = ArrayJob(name="bench", shape=data.shape, dtype=data.dtype, read=None, source={})
    tasks = pipeline.block_bounds(job, pipeline.BLOCK_ELEMENTS)
    cases = []
    for label, mechanism, noise in MECHANISMS:
        calib = calibrate(mechanism=mechanism, noise=noise, budget="element", epsilon=EPSILON,
                          range_width=256, elements=ELEMENTS)
        # uint8 data: exact noise gives integers (int16, as perturb writes), float noise float32
        dtype = np.int16 if noise.startswith("discrete") else np.float32
        for kind in ("secure", "fast"):
            streams = Streams(kind)  # keyed from OS entropy, as without --seed

            def process(start, stop, calib=calib, streams=streams, dtype=dtype):
                engine.perturb_records(data[start:stop], start, "bench", calib, streams, None, dtype)

            for workers in (1, 2):
                cases.append(({"mechanism": label, "rng": kind, "workers": workers},
                              lambda process=process, workers=workers:
                              list(pipeline._run_tasks(process, tasks, workers))))
    return cases


def reference_cases(data: np.ndarray) -> list[tuple[str, str, object]]:
    """Single-core limits for the same number of elements: (name, what it bounds, run)."""
    n = data.size
    flat = data.reshape(-1)
    copy_u8 = np.empty_like(flat)
    cast_f32 = np.empty(n, np.float32)
    buf = np.empty(RNG_CHUNK, np.float32)
    pcg = np.random.Generator(np.random.PCG64())
    from randomgen import AESCounter

    aes = np.random.Generator(AESCounter())
    b = 256.0 / EPSILON

    def draws(fill):
        def run():
            for start in range(0, n, RNG_CHUNK):
                fill(min(RNG_CHUNK, n - start))
        return run

    return [
        ("numpy copy uint8 -> uint8", "memory bandwidth: the data copied once",
         lambda: np.copyto(copy_u8, flat)),
        ("numpy cast uint8 -> float32", "memory bandwidth: the float32 output written once",
         lambda: np.copyto(cast_f32, flat)),
        ("PCG64 standard_normal float32", "RNG limit for Gaussian noise (fast RNG)",
         draws(lambda k: pcg.standard_normal(dtype=np.float32, out=buf[:k]))),
        ("PCG64 laplace float64", "NumPy's Laplace sampler (float64 only)",
         draws(lambda k: pcg.laplace(0.0, b, k))),
        ("PCG64 standard_exponential float32", "the draw tldp's Laplace noise is built on",
         draws(lambda k: pcg.standard_exponential(dtype=np.float32, out=buf[:k]))),
        ("AES-CTR standard_normal float32", "RNG limit for Gaussian noise (secure RNG)",
         draws(lambda k: aes.standard_normal(dtype=np.float32, out=buf[:k]))),
        *codec_cases(n),
    ]


def codec_cases(n: int) -> list[tuple[str, str, object]]:
    """The Zarr output's codec alone: zstd over int16 noisy values (one 1024-record chunk,
    encoded n / chunk times), at the level tldp writes (1) and zstd's default (3)."""
    from numcodecs import Zstd

    chunk = 1024 * ELEMENTS
    noisy = (np.random.default_rng(0).laplace(128, 256.0 / EPSILON, chunk)).astype(np.int16).tobytes()

    def encode(level):
        codec = Zstd(level=level)
        return lambda: [codec.encode(noisy) for _ in range(max(1, n // chunk))]

    return [(f"zstd level {level} encode, int16 noise", "codec floor of the Zarr output", encode(level))
            for level in (1, 3)]


def engine_and_references(data: np.ndarray, reps: int) -> tuple[list[dict], dict[str, dict]]:
    """Engine rows and reference limits, measured in the same rounds."""
    engine_list, reference_list = engine_cases(data), reference_cases(data)
    seconds = interleaved_best([run for _, run in engine_list] + [run for *_, run in reference_list], reps)
    rows = []
    for (row, _), sec in zip(engine_list, seconds):
        rows.append({**row, "seconds": sec, "melem_s": rate(data.size, sec)})
        print(f"  engine {row['mechanism']:18} {row['rng']:6} {row['workers']}w {rows[-1]['melem_s']:8.1f} M/s",
              file=sys.stderr)
    refs = {}
    for (name, note, _), sec in zip(reference_list, seconds[len(engine_list):]):
        refs[name] = {"seconds": sec, "melem_s": rate(data.size, sec), "note": note}
        print(f"  reference {name:36} {refs[name]['melem_s']:9.1f} M/s", file=sys.stderr)
    return rows, refs


# ---------------------------------------------------------------- privunit (issue 28)

PRIVUNIT_EPSILONS = (4.0, 10.0)  # per-record eps: below and above the cap's floor (2^-10)
PRIVUNIT_RECORDS = 4096  # the first records of the engine's data (the sampler loops per record)
# The same values as volumes: 16 digits stacked into one (16, 28, 28) record (the default
# basis is then the 3-D DCT: sampling/projection.VolumeDctBasis), at the first eps.
VOLUME_DEPTH = 16


def privunit_cases(data: np.ndarray) -> list[tuple[dict, object]]:
    """--mechanism privunit on the same 784-element records as the engine, one worker,
    secure RNG: the projection alone (one matrix product for all the records: the
    default DCT basis at the default k), the whole mechanism (engine.perturb_records:
    projection, PrivUnit draw, write-back), and TLDP-L exact on the same records; and
    both again on the same values as (16, 28, 28) volumes (the 3-D DCT, `elements`)."""
    from tldp_cli.privacy.mechanisms import calibrate_privunit
    from tldp_cli.sampling import projection

    sample = data[:PRIVUNIT_RECORDS]
    records = sample.reshape(len(sample), *RECORD_SHAPE)
    streams = Streams("secure")
    tldp = calibrate(mechanism="tldp", noise="discrete-laplace", budget="element", epsilon=EPSILON,
                     range_width=256, elements=ELEMENTS)
    cases = [({"case": "TLDP-L exact", "epsilon": EPSILON, "k": None, "record_shape": list(RECORD_SHAPE)},
              lambda: engine.perturb_records(sample, 0, "bench", tldp, streams, None, np.int16))]
    for eps in PRIVUNIT_EPSILONS:
        calib = calibrate_privunit(epsilon=eps, record_shape=RECORD_SHAPE, value_range=(0.0, 256.0))
        basis = projection.dct_basis(RECORD_SHAPE, calib.privunit.k)
        k = calib.privunit.k
        cases.append(({"case": "projection", "epsilon": eps, "k": k, "record_shape": list(RECORD_SHAPE)},
                      lambda basis=basis: basis.project(records)))
        cases.append(({"case": "privunit", "epsilon": eps, "k": k, "record_shape": list(RECORD_SHAPE)},
                      lambda calib=calib: engine.perturb_records(records, 0, "bench", calib, streams,
                                                                 None, np.float32)))
    volume_shape = (VOLUME_DEPTH, *RECORD_SHAPE)
    volumes = records[:len(records) // VOLUME_DEPTH * VOLUME_DEPTH].reshape(-1, *volume_shape)
    calib = calibrate_privunit(epsilon=PRIVUNIT_EPSILONS[0], record_shape=volume_shape, value_range=(0.0, 256.0))
    basis = projection.dct_basis(volume_shape, calib.privunit.k)
    cases.append(({"case": "projection 3-D", "epsilon": PRIVUNIT_EPSILONS[0], "k": calib.privunit.k,
                   "record_shape": list(volume_shape), "elements": volumes.size}, lambda: basis.project(volumes)))
    cases.append(({"case": "privunit 3-D", "epsilon": PRIVUNIT_EPSILONS[0], "k": calib.privunit.k,
                   "record_shape": list(volume_shape), "elements": volumes.size},
                  lambda: engine.perturb_records(volumes, 0, "bench", calib, streams, None, np.float32)))
    return cases


def privunit_rates(data: np.ndarray, reps: int) -> list[dict]:
    """M input elements/s of each privunit case and its ratio to TLDP-L exact on the same
    values, measured in the same rounds; `records` counts the case's own records (of
    `record_shape`: 16 digits make one record of the 3-D cases)."""
    cases = privunit_cases(data)
    seconds = interleaved_best([run for _, run in cases], reps)
    elements = min(len(data), PRIVUNIT_RECORDS) * ELEMENTS
    rows = [{**row, "records": row.get("elements", elements) // math.prod(row["record_shape"]), "seconds": sec,
             "melem_s": rate(row.get("elements", elements), sec)} for (row, _), sec in zip(cases, seconds)]
    for row in rows:
        row["ratio_to_tldp"] = row["melem_s"] / rows[0]["melem_s"]
        print(f"  privunit {row['case']:12} eps {row['epsilon']:g} {row['melem_s']:9.1f} M/s "
              f"({row['ratio_to_tldp']:.2f}x TLDP-L exact)", file=sys.stderr)
    return rows


# ---------------------------------------------------------------- start-up (issue 30)

# What a shell loop or a CI job pays before tldp does anything: each path as a whole process
# (python -m tldp_cli, this checkout), against the interpreter's own start-up with NumPy.
STARTUP_BASELINE = ("python -c 'import numpy'", [sys.executable, "-c", "import numpy"], {})
STARTUP_CASES = [  # label, arguments of tldp, extra environment
    ("--version", ["--version"], {}),
    ("--help", ["--help"], {}),
    ("perturb --help", ["perturb", "--help"], {}),
    ("completion (TAB after 'tldp perturb d.npy --no')", [],
     {"_TLDP_COMPLETE": "complete_bash", "COMP_WORDS": "tldp perturb d.npy --no", "COMP_CWORD": "3"}),
    ("bad flag", ["perturb", "d.npy", "--eps", "1", "--bogus"], {}),
    ("usage error (--eps -1)", ["perturb", "d.npy", "--eps", "-1"], {}),
    ("bad value (--eps abc)", ["perturb", "d.npy", "--eps", "abc"], {}),
    ("missing input", ["perturb", "missing.npy", "--eps", "1"], {}),
    ("output exists", ["perturb", "d.npy", "--eps", "1"], {}),
]


def child_run(argv: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one process, its output thrown away."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def startup_times(reps: int, cached_bytecode: bool = True) -> list[dict]:
    """Median CPU and wall seconds of each start-up path over `reps` rounds (one warm-up
    round first); each round runs the baseline and every path in turn, and the ratios are
    the medians of the per-round ratios to that round's baseline. `cached_bytecode`: the
    checkout's modules run from bytecode the warm-up round writes (in the scratch folder),
    as those of an installed tool do (pip compiles them) and NumPy's do; without it, with
    PYTHONDONTWRITEBYTECODE set, each run compiles every tldp module it imports."""
    with tempfile.TemporaryDirectory(prefix="tldp-startup-") as folder:
        cwd = Path(folder)
        np.save(cwd / "d.npy", digits()[:10])
        (cwd / "d.tldp.npy").write_bytes(b"an earlier output")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("TLDP_SEED", None)
        if cached_bytecode:  # as an installed tool runs: pip compiles its modules; the warm-up round here
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(cwd / "pycache")
        runs = [STARTUP_BASELINE] + [(label, [sys.executable, "-m", "tldp_cli", *args], extra)
                                     for label, args, extra in STARTUP_CASES]
        samples: list[list[tuple[float, float]]] = [[] for _ in runs]
        for round_ in range(reps + 1):
            for i, (_, argv, extra) in enumerate(runs):
                sample = child_run(argv, {**env, **extra}, cwd)
                if round_:
                    samples[i].append(sample)
    base = samples[0]
    rows = []
    for (label, argv, extra), got in zip(runs, samples):
        row = {"path": label, "command": " ".join(["tldp", *argv[3:]]) if argv[1:3] == ["-m", "tldp_cli"]
               else label, "cpu_seconds": float(np.median([c for c, _ in got])),
               "wall_seconds": float(np.median([w for _, w in got])),
               "cpu_ratio": float(np.median([c / b[0] for (c, _), b in zip(got, base)])),
               "wall_ratio": float(np.median([w / b[1] for (_, w), b in zip(got, base)]))}
        rows.append(row)
        print(f"  start-up {label:48} {row['cpu_seconds']:.3f} s CPU {row['cpu_ratio']:.2f}x", file=sys.stderr)
    return rows


def startup_markdown(rows: list[dict], reps: int, cached: bool = True) -> list[str]:
    bytecode = "its bytecode cached, as installed" if cached else "every tldp module compiled on each run"
    lines = [f"Start-up (issue 30: each path as a whole process, `python -m tldp_cli` from this checkout, {bytecode}; "
             f"medians of {reps} rounds; ratio: to `python -c 'import numpy'` in the same round, target <= 1.5):",
             "", "| path | CPU s | wall s | ratio (CPU) | ratio (wall) |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['path']} | {r['cpu_seconds']:.3f} | {r['wall_seconds']:.3f} | {r['cpu_ratio']:.2f} | "
              f"{r['wall_ratio']:.2f} |" for r in rows]
    return lines


# ---------------------------------------------------------------- planning (issue 30)

PLAN_SIZES = (1, 100, 10_000)  # distinct record sizes planned at once
PLAN_SIDES = (200, 800)  # the photos' height and width in pixels, RGB


def photo_shapes(count: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """`count` RGB photo shapes of distinct sizes (H x W x 3 elements, H and W in PLAN_SIDES)."""
    rng = np.random.default_rng(seed)
    shapes, sizes = [], set()
    while len(shapes) < count:
        h, w = (int(v) for v in rng.integers(*PLAN_SIDES, size=2, endpoint=True))
        if h * w not in sizes:
            sizes.add(h * w)
            shapes.append((h, w, 3))
    return shapes


def _calibrate_run(options, jobs):
    """calibration.calibrate_run (pipeline.calibrate_run before run/calibration.py, pipeline.plan before
    issue 31: the benchmark runs on older checkouts too)."""
    try:
        from tldp_cli.run.calibration import calibrate_run as calibrate
    except ImportError:
        calibrate = getattr(pipeline, "calibrate_run", None) or pipeline.plan
    return calibrate(options, jobs)


def plan_seconds(count: int, noise: str = "discrete-laplace") -> dict:
    """calibration.calibrate_run, what `tldp plan photos/ --eps 1` runs once the headers are read, on
    `count` photos of distinct sizes (one record each, uint8): calibration and the certified
    figures, every one from the accounting. In this process: the imports are done, the
    accountant's caches are emptied first."""
    from tldp_cli.privacy import accounting

    for cached in (accounting.discrete_laplace_approx_epsilon, accounting.discrete_gaussian_epsilon):
        cached.cache_clear()
    getattr(accounting, "_PLD_EPSILONS", {}).clear()  # (absent before issue 30: compare with main)
    jobs = [ArrayJob(name=f"photo{i}.png", shape=(1, *shape), dtype=np.dtype(np.uint8), read=None,
                     source={"path": f"photo{i}.png"}) for i, shape in enumerate(photo_shapes(count))]
    options = pipeline.checked_options(pipeline.PerturbOptions(input=Path("photos"), eps=EPSILON, noise=noise))
    start, cpu_start = time.perf_counter(), time.process_time()
    calibrated = _calibrate_run(options, jobs)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {"sizes": count, "noise": options.noise, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "calibrations": len(calibrated.calibrations), "elements": [min(j.elements for j in jobs),
                                                                   max(j.elements for j in jobs)],
            "per_record_epsilon": calibrated.certified.per_record.epsilon,
            "per_record_approx_epsilon": calibrated.certified.per_record.approx_epsilon}


def planning_times(counts=PLAN_SIZES) -> list[dict]:
    _calibrate_run(pipeline.checked_options(pipeline.PerturbOptions(input=Path("warm-up"), eps=EPSILON)),
                   [ArrayJob(name="w", shape=(1, 8, 8, 3), dtype=np.dtype(np.uint8), read=None, source={})])
    rows = []
    for count in counts:
        rows.append(plan_seconds(count))
        print(f"  plan {count:6} distinct sizes: {rows[-1]['seconds']:.2f} s ({rows[-1]['cpu_seconds']:.2f} s CPU)",
              file=sys.stderr)
    return rows


def planning_markdown(rows: list[dict]) -> list[str]:
    lo, hi = PLAN_SIDES
    lines = [f"Planning (issue 30: `calibration.calibrate_run` as `tldp plan photos/ --eps 1` runs it after the "
             f"headers, on RGB photos of distinct sizes, {lo}-{hi} pixels a side; imports done, caches empty):", "",
             "| distinct sizes | elements per record | seconds | CPU seconds | per-record eps (approx) |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['sizes']:,} | {r['elements'][0]:,}-{r['elements'][1]:,} | {r['seconds']:.2f} | "
              f"{r['cpu_seconds']:.2f} | {r['per_record_approx_epsilon']:.6g} |" for r in rows]
    return lines


# ---------------------------------------------------------------- peers

def import_diffprivlib():
    """diffprivlib.mechanisms; diffprivlib 0.6.6's package __init__ imports its scikit-learn
    models, which fail on scikit-learn >= 1.8, so load the mechanisms without them."""
    try:
        import diffprivlib.mechanisms as mechanisms
        return mechanisms
    except ImportError as exc:
        if "sklearn" not in str(exc) and "scikit" not in str(exc):
            raise
    import importlib.util
    import types

    spec = importlib.util.find_spec("diffprivlib")
    for name in [m for m in sys.modules if m == "diffprivlib" or m.startswith("diffprivlib.")]:
        del sys.modules[name]
    package = types.ModuleType("diffprivlib")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["diffprivlib"] = package
    import diffprivlib.mechanisms as mechanisms
    return mechanisms


def peer_rates(data: np.ndarray, quick: bool, reps: int) -> list[dict]:
    """OpenDP's vector measurements (one call per record) and diffprivlib's Laplace
    (one randomise call per value) on a sample of the records, at the noise scale
    of TLDP-L / TLDP-G at the same epsilon; best of `reps`, like tldp's figures."""
    rows = []
    scales = {noise: calibrate(mechanism="tldp", noise=noise, budget="element", epsilon=EPSILON,
                               range_width=256.0, elements=ELEMENTS).scale
              for noise in ("laplace", "gaussian")}
    records = data.reshape(-1, ELEMENTS)
    try:
        import opendp.prelude as dp

        dp.enable_features("contrib")
        sample = records[: (16 if quick else 96)].astype(np.float32)
        domain = dp.vector_domain(dp.atom_domain(T="f32", nan=False), size=ELEMENTS)
        for noise, make, metric in (("laplace", dp.m.make_laplace, dp.l1_distance),
                                    ("gaussian", dp.m.make_gaussian, dp.l2_distance)):
            meas = make(domain, metric(T="f32"), scale=scales[noise])
            meas(sample[0])  # warm up

            def run(meas=meas):
                for record in sample:
                    meas(record)
            seconds = best_seconds(run, reps)
            rows.append({"peer": f"OpenDP {version('opendp')} make_{noise} (vector f32, per record)",
                         "noise": noise, "sample_elements": sample.size,
                         "melem_s": rate(sample.size, seconds)})
    except ImportError as exc:
        rows.append({"peer": "OpenDP", "noise": "laplace", "error": f"not installed ({exc})"})
        rows.append({"peer": "OpenDP", "noise": "gaussian", "error": f"not installed ({exc})"})
    try:
        mechanisms = import_diffprivlib()
        values = records[: (8 if quick else 64)].reshape(-1).astype(float).tolist()
        mech = mechanisms.Laplace(epsilon=EPSILON, sensitivity=256.0)  # scale 256/eps = TLDP-L's b
        mech.randomise(values[0])

        def run_dpl():
            for value in values:
                mech.randomise(value)
        seconds = best_seconds(run_dpl, reps)
        rows.append({"peer": f"diffprivlib {version('diffprivlib')} Laplace (randomise per value)",
                     "noise": "laplace", "sample_elements": len(values), "melem_s": rate(len(values), seconds)})
    except ImportError as exc:
        rows.append({"peer": "diffprivlib", "noise": "laplace", "error": f"not installed ({exc})"})
    for row in rows:
        if "melem_s" in row:
            print(f"  peer {row['peer']:60} {row['melem_s']:.4f} M/s", file=sys.stderr)
    return rows


# ---------------------------------------------------------------- end to end

def run_child(kind: str, src: Path, out: Path, workers: int) -> dict:
    args = {"kind": kind, "input": str(src), "output": str(out), "workers": workers,
            "rng": "secure", "epsilon": EPSILON, "sigma": PILLOW_SIGMA}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                            text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} {src.name} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def warm_page_cache(workdir: Path, nbytes: int) -> float:
    """Writes and deletes a scratch file of `nbytes`; returns the seconds it took.

    Virtual machines that hand freed memory back to their host (balloon or free-page
    reporting, as on Firecracker) make the first use of that memory slow: writing a
    file into memory no process used recently cost about 2 CPU seconds per GiB here,
    four times the cost of the same write a moment later. Writing and freeing as
    much page cache just before a run makes every run start from the same, warm
    state, so the figure measures tldp rather than the host's memory reclaim (the
    `.npy` writer's direct I/O does not go through the page cache, but HDF5, Zarr
    and image outputs do)."""
    scratch = workdir / "warm-up.bin"
    buf = np.zeros(1 << 24, np.uint8)
    start = time.perf_counter()
    with open(scratch, "wb") as f:
        for _ in range(0, nbytes, buf.nbytes):
            f.write(buf.data)
    scratch.unlink()
    os.sync()  # and the disk idle: no writeback left to compete with the run's (direct) writes
    return time.perf_counter() - start


def end_to_end(workdir: Path, records: int, images: int, workers: int, which: list[str],
               warm: bool = True, reps: int = 1) -> list[dict]:
    """Every run of every format `reps` times, in rounds (each round runs each case once in
    turn, so a passing load weighs on all alike); each row is the fastest of its runs, with
    the highest peak RSS of them."""
    rng = np.random.default_rng(2024)
    base = digits()
    cases = [  # format, maker, input name, units, elements per unit, extra runs
        ("npy", make_npy, "data.npy", records, ELEMENTS, ["cast"]),
        ("hdf5", make_hdf5, "data.h5", records, ELEMENTS, ["cast"]),
        ("hdf5-gzip", make_hdf5_gzip, "gzip.h5", records, ELEMENTS, []),
        ("zarr", make_zarr, "data.zarr", records, ELEMENTS, ["cast"]),
        ("images", make_images, "photos", images, int(np.prod(IMAGE_SHAPE)), ["gaussian", "pillow"]),
    ]
    cases = [case for case in cases if case[0] in which]
    made = {}
    for fmt, make, name, units, _, _ in cases:
        start = time.perf_counter()
        make(workdir / name, units, rng, base)
        os.sync()  # the input is on disk and in the page cache; no writeback during the runs
        made[fmt] = time.perf_counter() - start
    rows: dict[tuple[str, str], dict] = {}
    for _ in range(reps):
        for fmt, _, name, units, per_unit, extra in cases:
            src = workdir / name
            elements = units * per_unit
            for kind in ["perturb", *extra]:
                out = workdir / f"out-{kind}-{name}"
                warm_seconds = warm_page_cache(workdir, 4 * elements) if warm else None
                res = run_child(kind, src, out, workers)
                row = {"format": fmt, "run": kind, "records": units, "elements": elements,
                       "elements_per_record": per_unit, "input_bytes": tree_bytes(src),
                       "raw_bytes": elements, "output_bytes": tree_bytes(out),
                       "generate_seconds": made[fmt], "warm_up_seconds": warm_seconds,
                       "seconds": res["seconds"], "cpu_seconds": res["cpu_seconds"],
                       "melem_s": rate(elements, res["seconds"]),
                       "rss_before_mb": res["rss_before_kib"] * 1024 / MB,
                       "peak_rss_mb": res["peak_rss_kib"] * 1024 / MB}
                print(f"  e2e {fmt:6} {kind:7} {elements / 1e6:8.0f} M elements {row['seconds']:7.1f} s "
                      f"{row['melem_s']:7.1f} M/s peak RSS {row['peak_rss_mb']:.0f} MB", file=sys.stderr)
                best = rows.get((fmt, kind))
                if best is not None:
                    row["peak_rss_mb"] = max(row["peak_rss_mb"], best["peak_rss_mb"])
                    row["all_seconds"] = best["all_seconds"] + [row["seconds"]]
                    if best["seconds"] <= row["seconds"]:
                        row = {**best, "peak_rss_mb": row["peak_rss_mb"], "all_seconds": row["all_seconds"]}
                else:
                    row["all_seconds"] = [row["seconds"]]
                rows[fmt, kind] = row
                for written in workdir.glob(f"*out-{kind}-{name}*"):  # output and manifest
                    output.remove(written)
    for _, _, name, _, _, _ in cases:
        output.remove(workdir / name)
    return list(rows.values())


# ---------------------------------------------------------------- report

def find(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def targets(results: dict) -> list[dict]:
    engine_rows, refs, e2e, peers = (results["engine"], results["references"],
                                     results["end_to_end"], results["peers"])
    normal = refs["PCG64 standard_normal float32"]["melem_s"]
    out = []
    for label, _, _ in MECHANISMS:
        row = find(engine_rows, mechanism=label, rng="secure", workers=2)
        out.append({"target": f"engine {label}, secure RNG, 2 workers >= 1.5x PCG64 standard_normal float32 "
                              "(1 core)",
                    "measured": f"{row['melem_s']:.1f} M/s = {row['melem_s'] / normal:.2f}x",
                    "required": f">= {1.5 * normal:.1f} M/s", "pass": row["melem_s"] >= 1.5 * normal})
    npy = find(e2e, format="npy", run="perturb")
    if npy:
        eng = find(engine_rows, mechanism="TLDP-L exact", rng="secure", workers=2)["melem_s"]
        floor = find(e2e, format="npy", run="cast")
        out.append({"target": "end-to-end .npy -> .npy (TLDP-L exact, secure) >= half the engine rate",
                    "measured": f"{npy['melem_s']:.1f} M/s = {npy['melem_s'] / eng:.2f}x engine"
                                + (f" (I/O only: {floor['melem_s']:.0f} M/s)" if floor else ""),
                    "required": f">= {eng / 2:.1f} M/s", "pass": npy["melem_s"] >= eng / 2})
        out.append({"target": "end-to-end .npy -> .npy (exact default) >= 0.75x PCG64 standard_normal "
                              "float32 (1 core) (issue 18)",
                    "measured": f"{npy['melem_s']:.1f} M/s = {npy['melem_s'] / normal:.2f}x",
                    "required": f">= {0.75 * normal:.1f} M/s", "pass": npy["melem_s"] >= 0.75 * normal})
        for fmt in ("hdf5", "hdf5-gzip", "zarr"):  # issue 18: the same data and options as the .npy run
            row = find(e2e, format=fmt, run="perturb")
            if row:
                out.append({"target": f"end-to-end {fmt} -> {fmt} >= 0.75x .npy -> .npy (issue 18)",
                            "measured": f"{row['melem_s']:.1f} M/s = {row['melem_s'] / npy['melem_s']:.2f}x",
                            "required": f">= {0.75 * npy['melem_s']:.1f} M/s",
                            "pass": row["melem_s"] >= 0.75 * npy["melem_s"]})
    reference = find(e2e, format="images", run="pillow")
    for kind in ("perturb", "gaussian") if reference else ():
        row = find(e2e, format="images", run=kind)
        ratio = row["melem_s"] / reference["melem_s"]
        out.append({"target": f"images {RUN_NAMES[kind]} >= 4x Pillow decode + noise + PNG save (1 core)",
                    "measured": f"{row['melem_s']:.1f} M/s = {ratio:.2f}x", "pass": ratio >= 4,
                    "required": f">= {4 * reference['melem_s']:.1f} M/s"})
    for row in e2e:  # the target names .npy; every format is held to it
        if row["run"] in ("perturb", "gaussian"):
            out.append({"target": f"peak RSS of {row['format']} -> {row['format']} < 300 MB "
                                  f"({row['elements'] / 1e9:.2g} G elements)",
                        "measured": f"{row['peak_rss_mb']:.0f} MB", "required": "< 300 MB",
                        "pass": row["peak_rss_mb"] < 300})
    for row in results.get("startup", [])[1:]:  # issue 30; the first row is the baseline itself
        out.append({"target": f"start-up: {row['path']} <= 1.5x python -c 'import numpy' (CPU)",
                    "measured": f"{row['cpu_ratio']:.2f}x", "required": "<= 1.5x", "pass": row["cpu_ratio"] <= 1.5})
    for peer in peers:
        if "ratio" in peer:
            out.append({"target": f"> 300x {peer['peer']}", "measured": f"{peer['ratio']:.0f}x",
                        "required": "> 300x", "pass": peer["ratio"] > 300})
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM; {m['os']}; "
             f"Python {m['python']}, " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
             + f"; {m['date']}", ""]
    eng = results["engine"]
    lines += [f"Engine (`engine.perturb_records`, {results['engine_elements'] / 1e6:.0f} M uint8 elements in "
              f"784-element records, int16 output (exact) or float32 (float), blocks of {pipeline.BLOCK_ELEMENTS >> 20} Mi elements, "
              "million elements/s, best of "
              f"{results['reps']}):", "",
              "| mechanism | secure, 1 worker | secure, 2 workers | fast, 1 worker | fast, 2 workers |",
              "|---|---:|---:|---:|---:|"]
    for label, _, _ in MECHANISMS:
        cells = [f"{find(eng, mechanism=label, rng=k, workers=w)['melem_s']:.1f}"
                 for k in ("secure", "fast") for w in (1, 2)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Reference limits (one core, same number of elements):", "",
              "| reference | M elements/s | what it bounds |", "|---|---:|---|"]
    for name, r in results["references"].items():
        lines.append(f"| {name} | {r['melem_s']:.1f} | {r['note']} |")
    if results["end_to_end"]:
        lines += ["", f"End to end (`pipeline.perturb`, TLDP-L with the default exact sampler, secure RNG, "
                  f"{results['workers']} workers, output int16 or PNG, input in the page cache, output hashed for the "
                  "manifest and fsynced"
                  + ("; page cache warmed before each run" if results.get("warm_up") else "")
                  + (f"; the fastest of {results['e2e_reps']} rounds" if results.get("e2e_reps", 1) > 1 else "")
                  + "):",
                  "", "| format | run | records x I | input | output | seconds | CPU seconds | M elements/s "
                  "| peak RSS |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in results["end_to_end"]:
            run = RUN_NAMES[r["run"]]
            lines.append(f"| {r['format']} | {run} | {r['records']:,} x {r['elements_per_record']:,} | "
                         f"{r['input_bytes'] / GB:.2f} GB | {r['output_bytes'] / GB:.2f} GB | {r['seconds']:.1f} | "
                         f"{r['cpu_seconds']:.1f} | "
                         f"{r['melem_s']:.1f} | {r['peak_rss_mb']:.0f} MB |")
    if results.get("startup"):
        lines += [""] + startup_markdown(results["startup"], results["startup_reps"])
    if results.get("planning"):
        lines += [""] + planning_markdown(results["planning"])
    if results.get("privunit"):
        first = results["privunit"][0]
        lines += ["", f"privunit (issue 28; {first['records']:,} of the same records, secure RNG, 1 worker, "
                  "M input elements/s, best of the rounds; ratio: to TLDP-L exact on the same records):", "",
                  "| case | per-record ε | k | M elements/s | ratio to TLDP-L exact |", "|---|---:|---:|---:|---:|"]
        for r in results["privunit"]:
            lines.append(f"| {r['case']} | {r['epsilon']:g} | {r['k'] or '-'} | {r['melem_s']:.1f} | "
                         f"{r['ratio_to_tldp']:.2f}x |")
    lines += ["", "Peers (same noise scale as TLDP at eps = 1, on a sample; the ratio is tldp's engine "
              "rate, secure RNG, 1 worker, over the peer's):", "",
              "| peer | sample | M elements/s | tldp / peer | time for the end-to-end dataset |",
              "|---|---:|---:|---:|---:|"]
    for p in results["peers"]:
        if "error" in p:
            lines.append(f"| {p['peer']} ({p['noise']}) | - | {p['error']} | - | - |")
        else:
            lines.append(f"| {p['peer']} | {p['sample_elements']:,} | {p['melem_s']:.4f} | {p['ratio']:,.0f}x | "
                         f"{p['scaled_hours']:.1f} h |")
    lines += ["", "Targets (issues 6 and 18):", "", "| target | measured | required | result |", "|---|---|---|---|"]
    for t in results["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {t['required']} | {'pass' if t['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def privunit_only(reps: int, out: Path | None) -> int:
    """--privunit-only: the privunit section on the engine's records, printed and saved."""
    records = PRIVUNIT_RECORDS
    data = mnist_like(np.random.default_rng(1), records, digits()).reshape(records, ELEMENTS)
    results = {"machine": machine_info(), "reps": reps, "privunit": privunit_rates(data, reps),
               "command": " ".join(["python", "benchmarks/bench.py", *sys.argv[1:]])}
    lines = ["| case | per-record ε | k | M elements/s | ratio to TLDP-L exact |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['epsilon']:g} | {r['k'] or '-'} | {r['melem_s']:.1f} | {r['ratio_to_tldp']:.2f}x |"
              for r in results["privunit"]]
    print("\n".join(lines))
    if out:
        out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def startup_and_planning_only(args, out: Path | None) -> int:
    """--startup-only, --planning-only: those sections (issue 30), printed and saved."""
    results = {"machine": machine_info(), "command": " ".join(["python", "benchmarks/bench.py", *sys.argv[1:]])}
    lines = []
    if args.startup_only:
        reps = args.reps or (3 if args.quick else 15)
        cached = not args.startup_uncached
        results["startup_reps"], results["startup"] = reps, startup_times(reps, cached)
        results["startup_bytecode"] = "cached" if cached else "compiled on every run"
        lines += startup_markdown(results["startup"], reps, cached)
    if args.planning_only:
        counts = (1, 100) if args.quick else PLAN_SIZES
        results["planning"] = planning_times(counts)
        lines += ([""] if lines else []) + planning_markdown(results["planning"])
    print("\n".join(lines))
    if out:
        out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=None,
                        help="size of the generated uint8 dataset for the end-to-end runs (default 2; "
                             "the image folder gets a tenth of it)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and one repetition, for a check that everything runs "
                             "(implies --size-gb 0.05 unless given)")
    parser.add_argument("--reps", type=int, default=None,
                        help="rounds of the engine, reference and peer timings; each figure is the best "
                             "(default 3; 1 with --quick)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the generated data goes (default: the system temporary directory)")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="do not write and delete a scratch file of the output's size before each "
                             "end-to-end run (see warm_page_cache)")
    parser.add_argument("--e2e-reps", type=int, default=1,
                        help="rounds of the end-to-end runs; each figure is the fastest (default 1)")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"end-to-end runs to make, comma-separated (default {','.join(FORMATS)}; "
                             "'none' for engine, references and peers only)")
    parser.add_argument("--privunit-only", action="store_true",
                        help="measure only the privunit section (and TLDP-L exact on the same records)")
    parser.add_argument("--startup-only", action="store_true",
                        help="measure only the start-up of --version, --help, completion and usage errors "
                             "against python -c 'import numpy' (15 rounds; --reps sets them)")
    parser.add_argument("--startup-uncached", action="store_true",
                        help="start-up with PYTHONDONTWRITEBYTECODE as the environment has it: each run "
                             "compiles the tldp modules it imports (default: their bytecode cached, as "
                             "an installed tool has it)")
    parser.add_argument("--planning-only", action="store_true",
                        help="measure only tldp plan's accounting on photos of 1, 100 and 10,000 distinct "
                             "sizes (1 and 100 with --quick)")
    args = parser.parse_args(argv)
    if args.startup_only or args.planning_only:
        return startup_and_planning_only(args, args.out)
    if args.privunit_only:
        return privunit_only(args.reps or (1 if args.quick else 3), args.out)
    which = [] if args.formats == "none" else args.formats.split(",")
    if set(which) - set(FORMATS):
        parser.error(f"--formats: choose from {', '.join(FORMATS)} or none")
    size_gb = args.size_gb or (0.05 if args.quick else 2.0)
    if size_gb <= 0:
        parser.error("--size-gb must be positive")
    reps = args.reps or (1 if args.quick else 3)
    e2e_reps = args.e2e_reps
    if reps < 1 or e2e_reps < 1:
        parser.error("--reps and --e2e-reps must be at least 1")
    workers = os.cpu_count() or 1

    results = {"machine": machine_info(), "command": " ".join(["python", "benchmarks/bench.py", *sys.argv[1:]]),
               "size_gb": size_gb, "reps": reps, "e2e_reps": e2e_reps, "workers": workers, "epsilon": EPSILON,
               "warm_up": not args.no_warm_up}
    print(f"machine: {results['machine']['cpu']}, {workers} cores", file=sys.stderr)

    engine_elements = (1 << 24) if args.quick else (1 << 26)  # 4 or 16 blocks
    records = engine_elements // ELEMENTS
    base = digits()
    data = mnist_like(np.random.default_rng(1), records, base).reshape(records, ELEMENTS)
    results["engine_elements"] = data.size
    results["engine"], results["references"] = engine_and_references(data, reps)
    results["privunit"] = privunit_rates(data, reps)
    results["peers"] = peer_rates(data, args.quick, reps)
    for peer in results["peers"]:
        if "melem_s" in peer:
            label = "TLDP-L float" if peer["noise"] == "laplace" else "TLDP-G float"
            ours = find(results["engine"], mechanism=label, rng="secure", workers=1)["melem_s"]
            peer["ratio"] = ours / peer["melem_s"]
            peer["scaled_hours"] = size_gb * GB / (peer["melem_s"] * 1e6) / 3600
    del data

    results["end_to_end"] = []
    if which:
        records = int(size_gb * GB) // ELEMENTS
        images = max(4, int(size_gb * GB / 10) // int(np.prod(IMAGE_SHAPE)))
        parent = args.workdir or Path(tempfile.gettempdir())
        need = 6 * size_gb * GB  # every input (about 2.6 x size), one output at a time, and a margin
        if shutil.disk_usage(parent).free < need:
            print(f"bench: {parent} has less than {need / GB:.0f} GB free; use --workdir or a smaller --size-gb",
                  file=sys.stderr)
            return 1
        workdir = Path(tempfile.mkdtemp(prefix="tldp-bench-", dir=parent))
        try:
            results["end_to_end"] = end_to_end(workdir, records, images, workers, which,
                                               warm=not args.no_warm_up, reps=e2e_reps)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    results["startup_reps"] = 3 if args.quick else 15
    results["startup"] = startup_times(results["startup_reps"])
    results["planning"] = planning_times((1, 100) if args.quick else PLAN_SIZES)
    results["targets"] = targets(results)
    table = markdown(results)
    results["markdown"] = table
    print(table)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
