"""Builders shared by the test modules: inputs in every format, closed forms the tests
compare against, assertions on one-line errors, the CLI runner, and the round-trip
contract every input format runs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import struct
import sys
from pathlib import Path
from unittest import mock

import h5py
import numpy as np
import typer.main
import typer.testing
import zarr
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import save_file
from scipy.stats import norm
from typer.testing import CliRunner

from tldp_cli.cli import app
from tldp_cli.run.manifest import sha256_file

REPO = Path(__file__).resolve().parent.parent


def load_script(relative: str):
    """A script of the repository that is not part of the package (docs/make_cli_reference.py,
    benchmarks/bench.py), imported as a module."""
    import importlib.util

    path = REPO / relative
    if str(path.parent) not in sys.path:  # as when it runs: it imports the scripts beside it
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
# A good seed (128 bits, as `tldp seed` makes); tests that need several or a particular
# stream use small integers with --allow-weak-seed / allow_weak_seed=True instead.
SEED = "3f9c2a7d51e04b8a96d2c07e1fa85b43"
MANIFEST_SCHEMA = REPO / "docs" / "manifest.schema.json"


def validate_manifest(manifest: dict) -> None:
    """jsonschema.validate(manifest, docs/manifest.schema.json): the same check and error
    (jsonschema.ValidationError), with the schema checked and its validator built once a
    session instead of at every call (0.1 to 0.2 s each, paid by every test that leaves a
    manifest)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_manifest_validator().iter_errors(manifest))
    if error is not None:
        raise error


@functools.cache
def _manifest_validator():
    import jsonschema

    schema = json.loads(MANIFEST_SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


class Cli:
    """`tldp` as a test runs it: cli("perturb", path, "--eps", 1) -> a typer Result."""

    def __init__(self):
        self.runner = CliRunner()

    def __call__(self, *args):
        # CliRunner.invoke builds the Click command from `app` at every call (20 to 60 ms, over
        # a thousand calls); it is built once here, as a `tldp` process builds it once.
        # _get_command is typer's private name: without it (a later typer), build it every call.
        patch = (mock.patch.object(typer.testing, "_get_command", _click_command)
                 if hasattr(typer.testing, "_get_command") else contextlib.nullcontext())
        with patch:
            return self.runner.invoke(app, [str(a) for a in args])


@functools.cache
def _click_command(typer_app):
    return typer.main.get_command(typer_app)


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under path (or of path itself): proves an input was not touched."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f.relative_to(path) if f != path else f.name): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in files}


def siblings(directory: Path) -> set[str]:
    return {p.name for p in Path(directory).iterdir()}


# `tldp ARGS` that writes, as it exits, its peak resident memory (VmHWM, KiB) to REPORT;
# with a PHASE, also its resident memory as the run's phase PHASE started (context.Report)
# and its peak from then on (the peak is reset there, through /proc/self/clear_refs).
_MEASURED = """import atexit, sys
def status(key):
    with open("/proc/self/status") as lines:
        return int(next(line for line in lines if line.startswith(key + ":")).split()[1])
marks = []
def report(path=sys.argv[1]):
    with open(path, "w") as out:
        out.write(" ".join(map(str, [*marks, status("VmHWM")])))
atexit.register(report)
phase = sys.argv[2]
if phase:
    from tldp_cli.run import context
    tell = context.Report.tell
    def marked(self, label, what):
        if label == phase and not marks:
            marks.extend([status("VmHWM"), status("VmRSS")])
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        tell(self, label, what)
    context.Report.tell = marked
sys.argv = ["tldp", *sys.argv[3:]]
from tldp_cli.entry import main
main()
"""
# The allocators give freed memory back at once, so that a peak is what the process held,
# not what its allocators kept: pyarrow's mimalloc purges freed pages after a delay (1 s), so
# what it keeps depends on how many batches were read in the last second (on the machine's
# speed); glibc raises its mmap threshold after the first large free, after which large
# blocks are kept in the heap when freed.
MEASURED_ENV = {"MIMALLOC_PURGE_DELAY": "0", "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def run_measured(tmp_path: Path, *args, timeout: float = 300) -> tuple[int, str, int]:
    """`tldp *args` in a process of its own: (exit code, stderr, its peak resident memory in
    bytes). Linux only: the peak is the process's own VmHWM, read as it exits (wait4's
    ru_maxrss would count the test process's memory, which the child had before exec), with
    MEASURED_ENV. Mark tests that use it slow."""
    code, stderr, marks = _measured(tmp_path, "", args, timeout)
    return code, stderr, marks[-1]


def run_measured_phase(tmp_path: Path, phase: str, *args, timeout: float = 300) -> tuple[int, str, int, int]:
    """run_measured, and how far the resident memory rose above what it was as the run's
    phase `phase` (context.Report: "perturbing") started: (exit code, stderr, peak, rise),
    in bytes. The rise leaves out what the run holds before the phase (the modules its
    planning imported, which depend on the figures it computes)."""
    code, stderr, marks = _measured(tmp_path, phase, args, timeout)
    assert len(marks) == 3, f"the run never reached its {phase} phase: {stderr}"
    before, at_start, after = marks
    return code, stderr, max(before, after), after - at_start


def _measured(tmp_path: Path, phase: str, args, timeout: float) -> tuple[int, str, list[int]]:
    import subprocess
    import sys

    report = tmp_path.parent / f"{tmp_path.name}.vmhwm"  # beside tmp_path: not among its files
    done = subprocess.run([sys.executable, "-c", _MEASURED, report, phase, *map(str, args)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          timeout=timeout, env={**os.environ, **MEASURED_ENV})
    return (done.returncode, done.stderr.decode(errors="backslashreplace"),
            [int(kib) * 1024 for kib in report.read_text().split()])


def mixture_loss_atoms(d: int, b: float, p: float) -> dict[float, float]:
    """Privacy loss of one element of the discrete Laplace TLDP mixture for the inputs 0 and
    d, outcome by outcome on -T..d+T (no lumping): {loss: mass under input 0}, equal losses
    merged and rounded up by 1e-9; the mass beyond T (< 1e-18) as an infinite loss."""
    from collections import defaultdict

    a = math.exp(-1 / b)
    T = math.ceil(45 * b) + 1
    y = np.arange(-T, d + T + 1)
    c = (1 - p) * (1 - a) / (1 + a)
    upper, lower = c * a ** np.abs(y).astype(float), c * a ** np.abs(y - d).astype(float)
    upper[y == 0] += p
    lower[y == d] += p
    atoms = defaultdict(float)
    for loss, mass in zip(np.log(upper) - np.log(lower), upper):
        atoms[round(float(loss), 9) + 1e-9] += float(mass)
    atoms[math.inf] += max(0.0, 1 - float(upper.sum()))
    return atoms


def composed_losses(atoms_list) -> dict[float, float]:
    """The loss distribution of independent elements: every combination of their atoms."""
    from collections import defaultdict

    dist = {0.0: 1.0}
    for atoms in atoms_list:
        combined = defaultdict(float)
        for l0, p0 in dist.items():
            for l1, p1 in atoms.items():
                combined[round(l0 + l1, 9)] += p0 * p1
        dist = combined
    return dist


def exact_delta(dist: dict[float, float], eps: float) -> float:
    """Hockey-stick divergence E[(1 - e^(eps - L))+] of a loss distribution."""
    return sum(m * (1.0 if loss == math.inf else -math.expm1(eps - loss)) for loss, m in dist.items()
               if loss > eps)


def exact_epsilon(dist: dict[float, float], delta: float) -> float:
    lo, hi = 0.0, max(loss for loss in dist if loss != math.inf) + 1
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exact_delta(dist, mid) > delta else (lo, mid)
    return hi


def bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = values.astype("<f4").view("<u4")
    assert not (bits & 0xFFFF).any(), "not exactly representable in bfloat16"
    return (bits >> 16).astype("<u2")


def write_safetensors(path: Path, tensors: dict, bf16: dict | None = None, metadata=None) -> Path:
    """With the safetensors library; bfloat16 tensors (given as float32, which NumPy's API
    cannot hold) by the format's specification, then checked by the library."""
    if not bf16:
        save_file(tensors, str(path), metadata=metadata)
        return path
    codes = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "bool": "BOOL"}
    parts = [(n, codes[v.dtype.name], v.shape, np.ascontiguousarray(v, v.dtype.newbyteorder("<")).tobytes())
             for n, v in tensors.items()]
    parts += [(n, "BF16", v.shape, bf16_bits(v).tobytes()) for n, v in bf16.items()]
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, code, shape, data in parts:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(p[3] for p in parts))
    with safe_open(str(path), framework="np") as f:
        assert sorted(f.keys()) == sorted(header.keys() - {"__metadata__"})
    return path


def write_sharded_model(folder: Path, tensors: dict[str, np.ndarray], max_shard_size: int,
                        extra_files: dict[str, str] | None = None) -> Path:
    """A sharded model folder as huggingface_hub's save_torch_state_dict writes one, with
    NumPy arrays: split by split_state_dict_into_shards_factory (names sharing an array's
    storage kept in one shard), a name sharing another's storage left out and named in
    the index's metadata (a tied weight), each shard saved by safetensors.numpy with
    {"format": "pt"}, the index as json.dump(indent=2); then `extra_files` (name -> text)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    def storage(array: np.ndarray) -> int:
        return id(array if array.base is None else array.base)

    # save_torch_state_dict: a name sharing another's storage goes, the index names the weight it shares
    kept, ties, state = {}, {}, {}
    for name, array in tensors.items():
        if storage(array) in kept:
            ties[name] = kept[storage(array)]
        else:
            kept[storage(array)] = name
            state[name] = array
    split = split_state_dict_into_shards_factory(
        state, get_storage_size=lambda t: t.nbytes, get_storage_id=storage,
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    assert split.is_sharded
    folder.mkdir()
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name] for name in names}, str(folder / filename), metadata={"format": "pt"})
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {**split.metadata, **ties}, "weight_map": split.tensor_to_filename}, f, indent=2)
    for name, text in (extra_files or {}).items():
        (folder / name).write_text(text)
    return folder


def read_sharded_model(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a sharded model folder, as huggingface_hub's loader finds them: each
    name of the index's weight_map read from its shard with safe_open."""
    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    tensors = {}
    for name, shard in index["weight_map"].items():
        with safe_open(str(Path(folder) / shard), framework="np") as f:
            tensors[name] = f.get_tensor(name)
    return tensors


def read_safetensors(path: Path) -> tuple[bytes, dict, dict[str, np.ndarray]]:
    """The header bytes, __metadata__ and every tensor (bfloat16 as float32), parsed here
    without tldp's reader."""
    raw = Path(path).read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    codes = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "BOOL": "?", "BF16": "<u2"}
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        array = np.frombuffer(data[begin:end], codes[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            array = (array.astype("<u4") << 16).view("<f4")
        tensors[name] = array
    return raw[:8 + length], header.get("__metadata__", {}), tensors


def one_line_error(result, code) -> str:
    """The one line a refused command wrote on stderr (exit `code`, no traceback, nothing on
    stdout)."""
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


def assert_one_line_error(result, code, *fragments):
    line = one_line_error(result, code)
    for fragment in fragments:
        assert fragment in line, line


def analytic_gaussian_delta(eps, sigma, sensitivity):
    """Balle and Wang (2018), Theorem 8: the exact delta of a Gaussian mechanism at eps."""
    a = sensitivity / (2 * sigma)
    b = eps * sigma / sensitivity
    return norm.cdf(a - b) - math.exp(eps + norm.logcdf(-a - b))


DATA = np.random.default_rng(5).integers(0, 256, (200, 8, 8), dtype=np.uint8)


def make_npy(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, DATA)
    return path, lambda out: np.load(out)


def make_hdf5(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=DATA, chunks=(10, 8, 8), compression="gzip")
    return path, lambda out: h5py.File(out, "r")["x"][...]


def make_zarr(tmp_path):
    path = tmp_path / "d.zarr"
    z = zarr.create_array(store=str(path), shape=DATA.shape, dtype=DATA.dtype, chunks=(10, 8, 8),
                          shards=(20, 8, 8), zarr_format=3)
    z[:] = DATA
    return path, lambda out: zarr.open_array(str(out), mode="r")[...]


def make_images(tmp_path):
    path = tmp_path / "imgs"
    path.mkdir()
    for i in range(30):
        Image.fromarray(DATA[i]).save(path / f"{i:02d}.png")
    return path, lambda out: np.stack([np.asarray(Image.open(out / f"{i:02d}.png")) for i in range(30)])


# --------------------------------------------------------------------------- round trip
# The round-trip contract every registered format runs (tests/formats/test_round_trip.py,
# parametrised over the registry): a case, a subclass beside the format's other tests, says
# which format it is, how to make a real input file in tmp_path, how to read its perturbable
# arrays back, and how to check that everything else came through unchanged; the base class
# runs perturb through the CLI and checks what holds for every format.

class RoundTrip:
    format: str  # the registered format's name (formats.FORMAT_MODULES)
    extra_args: tuple[str, ...] = ()
    out_suffix = ""  # what an output's name must end with (NIfTI: .nii or .nii.gz)

    # --- what a format's subclass provides -------------------------------------------
    def make_input(self, tmp_path: Path) -> Path:
        raise NotImplementedError

    def read_arrays(self, path: Path) -> dict[str, np.ndarray]:
        """The perturbed (or perturbable) arrays, keyed by name."""
        raise NotImplementedError

    def assert_same_structure(self, original: Path, perturbed: Path) -> None:
        """Everything but the perturbed values: tree, attributes, untouched data, layout."""
        raise NotImplementedError

    # --- the shared contract ----------------------------------------------------------
    def _out(self, tmp_path: Path, name: str) -> Path:
        return tmp_path / (name + self.out_suffix)

    def _run(self, cli: Cli, src: Path, out: Path, *more):
        return cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, *self.extra_args, *more)

    def check_round_trip(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        before = tree_digest(src)
        out = self._out(tmp_path, "out")
        result = self._run(cli, src, out, "--json")
        assert result.exit_code == 0, result.stderr
        assert tree_digest(src) == before, "the input was modified"
        manifest = json.loads(result.stdout)
        self.assert_same_structure(src, out)
        original, perturbed = self.read_arrays(src), self.read_arrays(out)
        assert original.keys() == perturbed.keys()
        for name, array in original.items():
            assert perturbed[name].shape == array.shape, name
            assert not np.array_equal(perturbed[name].astype(np.float64), array.astype(np.float64)), name
        text = json.dumps(manifest)
        assert manifest["seeded"] is True and manifest["weak_seed"] is False and SEED not in text
        assert "seed" not in text.replace('"seeded"', "").replace('"weak_seed"', "")
        assert manifest["inputs"] and all({"path", "format", "shape", "dtype"} <= set(i) for i in manifest["inputs"])
        for entry in manifest["outputs"]:
            assert sha256_file(Path(entry["path"])) == entry["sha256"]
        assert Path(str(out) + ".manifest.json").is_file()
        assert not [n for n in siblings(tmp_path) if ".tmp-" in n], "temporary files left behind"

    def check_same_seed_same_output(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        for name in ("a", "b"):
            assert self._run(cli, src, self._out(tmp_path, name)).exit_code == 0
        first, second = self.read_arrays(self._out(tmp_path, "a")), self.read_arrays(self._out(tmp_path, "b"))
        for key in first:
            np.testing.assert_array_equal(first[key], second[key])

    def check_workers_give_identical_output(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        for name, workers in (("serial", "1"), ("threads", "3")):
            assert self._run(cli, src, self._out(tmp_path, name), "--workers", workers).exit_code == 0
        serial = self.read_arrays(self._out(tmp_path, "serial"))
        threads = self.read_arrays(self._out(tmp_path, "threads"))
        for key in serial:
            np.testing.assert_array_equal(serial[key], threads[key])

    def check_refuses_to_overwrite(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        out = self._out(tmp_path, "out")
        assert self._run(cli, src, out).exit_code == 0
        written = tree_digest(out)
        again = self._run(cli, src, out)
        assert again.exit_code == 1
        assert "--overwrite" in again.stderr and len(again.stderr.strip().splitlines()) == 1
        assert tree_digest(out) == written
        assert self._run(cli, src, out, "--overwrite").exit_code == 0


def refuse_direct_open(monkeypatch, code: int = errno.EINVAL) -> None:
    """os.open fails with O_DIRECT (EINVAL: as on a filesystem without direct I/O)."""
    real_open = os.open

    def refuse(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)


def disk_full_after(monkeypatch, writes: int) -> None:
    """os.pwrite fails with ENOSPC after `writes` calls, from whichever thread."""
    real_pwrite = os.pwrite
    calls = []

    def pwrite(fd, data, position):
        calls.append(position)
        if len(calls) > writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, position)

    monkeypatch.setattr(os, "pwrite", pwrite)


def refuse_direct_writes(monkeypatch) -> list[int]:
    """os.pwrite refuses (EINVAL) on a descriptor opened with O_DIRECT, as a device does
    whose alignment the writes miss; returns the positions refused."""
    real_pwrite = os.pwrite
    refused: list[int] = []

    def refuse(fd, data, position):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(position)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, position)

    monkeypatch.setattr(os, "pwrite", refuse)
    return refused


def perturb_on_threads_and_dask(tmp_path: Path, src: Path, suffix: str, **options) -> tuple[Path, Path]:
    """The same seeded run (eps 3, small blocks) on 2 threads and on a local Dask cluster:
    the two outputs' paths, for a test that they are equal."""
    import distributed

    from tldp_cli.run.pipeline import PerturbOptions, perturb

    outs = tmp_path / f"threads{suffix}", tmp_path / f"dask{suffix}"
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address="127.0.0.1:0") as cluster:
        for out, how in zip(outs, ({"workers": 2},
                                   {"scheduler": "dask", "dask_address": cluster.scheduler_address})):
            perturb(PerturbOptions(input=src, eps=3.0, seed=SEED, out=out, block_elements=640, **options, **how))
    return outs
