"""What `tldp` imports before it answers (issue 30): --version, --help, shell completion,
a bad flag, a bad option value and a missing input answer with Typer, the format
registry and the option checks only (no NumPy, no pydantic, no accountant, no format
library); an existing output, found once the input's header is read and its calibration
made, without pydantic, the accountant (dp-accounting, SciPy,
tldp_cli.privacy.accounting) or another format's library; the usage and path errors
of evaluate, sweep and audit without the accountant; a run imports the library of the
format it reads and no other's (detection tries each format without importing its
library). Not timed:
benchmarks/bench.py --startup-only measures the times (docs/performance.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
# The accountant and every library a format, a tool or an extra brings.
HEAVY = ("dp_accounting", "scipy", "tldp_cli.privacy.accounting", "h5py", "zarr", "numcodecs", "PIL",
         "nibabel", "safetensors", "netCDF4", "xarray", "dask", "distributed", "tqdm", "sklearn",
         "matplotlib", "torch")
# What the command line alone needs: the parser and the option checks, not the library.
# Typer coerces option values through pydantic: tldp_cli.cli.coercion does it without.
CLI_ONLY = HEAVY + ("numpy", "pydantic", "tldp_cli.run.pipeline", "tldp_cli.formats.npy", "tldp_cli.sampling.engine")

PROBE = r"""
import json, sys
out, sys.argv = sys.argv[1], ["tldp", *sys.argv[2:]]
from tldp_cli.entry import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def imported(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[int, set[str]]:
    """The exit code of `tldp ARGS` in a fresh interpreter and the modules it had imported."""
    out = tmp_path / "modules.json"
    environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    environ.pop("TLDP_SEED", None)
    subprocess.run([sys.executable, "-c", PROBE, str(out), *args], cwd=tmp_path, env=environ,
                   capture_output=True, timeout=120, check=False)
    found = json.loads(out.read_text())
    return found["code"], set(found["modules"])


def heavy_among(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return [name for name in names if name in modules]


@pytest.fixture
def npy(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, np.zeros((4, 3), np.uint8))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--version"], ["--help"], ["perturb", "--help"], ["plan", "--help"], ["evaluate", "--help"],
    ["audit", "--help"], ["weight-mask", "--help"], ["ledger", "--help"], ["seed", "--help"],
    ["perturb"],  # a bare command: its help, exit 2
], ids=" ".join)
def test_version_and_help_import_no_library(tmp_path, args):
    code, modules = imported(tmp_path, *args)
    assert code in (0, 2) and heavy_among(modules, CLI_ONLY) == []


@pytest.mark.slow
@pytest.mark.parametrize("words", ["tldp pe", "tldp perturb d.npy --no", "tldp perturb d.npy --format "])
def test_shell_completion_imports_no_library(tmp_path, npy, words):
    code, modules = imported(tmp_path, env={"_TLDP_COMPLETE": "complete_bash", "COMP_WORDS": words,
                                            "COMP_CWORD": str(len(words.split()) - (not words.endswith(" ")))})
    assert code == 0 and heavy_among(modules, CLI_ONLY) == []


@pytest.mark.slow
def test_a_bad_flag_imports_no_library(tmp_path, npy):
    code, modules = imported(tmp_path, "perturb", str(npy), "--eps", "1", "--bogus")
    assert code == 2 and heavy_among(modules, CLI_ONLY) == []


@pytest.mark.slow
@pytest.mark.parametrize("args, code", [
    (["perturb", "missing.npy", "--eps", "1"], 1),
    (["plan", "missing.npy", "--eps", "1"], 1),
    (["perturb", "d.npy", "--eps", "-1"], 2),
    (["plan", "d.npy", "--eps", "-1"], 2),
    (["perturb", "d.npy", "--eps", "abc"], 2),
    (["perturb", "d.npy", "--eps", "1", "--noise", "uniform"], 2),
    (["perturb", "d.npy", "--eps", "1", "--workers", "0"], 2),
    (["perturb", "d.npy", "--eps", "1", "--range", "1:0"], 2),
    (["perturb", "d.npy", "--eps", "1", "--max-record-eps", "1"], 2),
    (["perturb", "-", "--eps", "1"], 2),
    (["perturb", "s3://bucket/era.zarr", "--eps", "1"], 2),
    (["perturb", "d.npy", "--eps", "1", "--out", "-"], 2),
    (["plan", "--eps", "1"], 2),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_usage_and_path_errors_import_no_library(tmp_path, npy, args, code):
    """Refused by the option checks and formats.detect, before the pipeline is imported."""
    got, modules = imported(tmp_path, *args)
    assert got == code and heavy_among(modules, CLI_ONLY) == []


@pytest.mark.slow
@pytest.mark.parametrize("args, code", [
    (["perturb", "d.npy", "--eps", "1", "--out", ""], 2),  # checked with the destinations
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_destination_errors_import_no_accountant(tmp_path, npy, args, code):
    got, modules = imported(tmp_path, *args)
    assert got == code and heavy_among(modules, HEAVY + ("pydantic",)) == []


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_an_existing_output_is_refused_before_the_accountant(tmp_path, npy, noise):
    """The options are calibrated (their usage errors first), then the destination is
    checked, and only then are the certified figures computed."""
    (tmp_path / "d.tldp.npy").write_bytes(b"earlier")
    code, modules = imported(tmp_path, "perturb", "d.npy", "--eps", "1", "--noise", noise)
    assert code == 1 and heavy_among(modules, HEAVY + ("pydantic",)) == []
    assert (tmp_path / "d.tldp.npy").read_bytes() == b"earlier"


@pytest.mark.slow
@pytest.mark.parametrize("args, code", [
    (["evaluate", "missing.npy", "d.npy"], 1),
    (["sweep", "missing.npy", "--eps", "1,2", "--out", "sweep/"], 1),
    (["sweep", "d.npy", "--eps", "abc", "--out", "sweep/"], 2),
    (["audit", "--eps", "-1", "--elements", "4", "--range", "0:1"], 2),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_the_tools_usage_and_path_errors_import_no_accountant(tmp_path, npy, args, code):
    """evaluate, sweep and audit import the accountant where they certify a figure."""
    got, modules = imported(tmp_path, *args)
    assert got == code and heavy_among(modules, HEAVY + ("pydantic",)) == []


# The formats' libraries, and SQLite, which a run uses with --ledger only.
FORMAT_LIBRARIES = ("h5py", "zarr", "numcodecs", "PIL", "tifffile", "nibabel", "safetensors", "pyarrow",
                    "netCDF4", "xarray", "torch", "sqlite3")
SAMPLE = REPO / "sample_data"


@pytest.fixture
def npz(tmp_path):
    """A model file of float tensors, as np.savez writes it."""
    path = tmp_path / "m.npz"
    rng = np.random.default_rng(0)
    np.savez(path, **{"dense.weight": rng.normal(0, 0.05, (8, 4)).astype(np.float32),
                      "dense.bias": np.zeros(4, np.float32)})
    return path


@pytest.fixture
def image_folder(tmp_path):
    """A folder of two PNG images, as Pillow writes them."""
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(2):
        Image.fromarray(np.full((6, 5), 40 * i, np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("args, libraries", [
    (["plan", str(SAMPLE / "digits.npy"), "--eps", "1"], ()),
    (["plan", str(SAMPLE / "digits.npy"), "--eps", "1", "--noise", "gaussian"], ()),
    (["plan", str(SAMPLE / "digits.npy"), "--eps", "4", "--mechanism", "privunit"], ()),
    (["perturb", str(SAMPLE / "digits.npy"), "--eps", "1", "--out", "o.npy"], ()),
    (["perturb", str(SAMPLE / "digits.npy"), "--eps", "1", "--noise", "gaussian", "--out", "o.npy"], ()),
    (["plan", "m.npz", "--eps", "1", "--clip", "0.1"], ()),
    (["perturb", "m.npz", "--eps", "1", "--clip", "0.1", "--out", "o.npz"], ()),
    (["plan", str(SAMPLE / "digits.zarr"), "--eps", "1"], ("zarr", "numcodecs")),
    (["plan", str(SAMPLE / "digits.h5"), "--eps", "1", "--dataset", "images"], ("h5py",)),
    (["plan", "imgs", "--eps", "1"], ("PIL", "tifffile")),  # a folder: not a Zarr store
], ids=lambda v: " ".join(Path(a).name for a in v) if isinstance(v, list) else "+".join(v) or "-")
def test_a_run_imports_the_library_of_its_format_only(tmp_path, npz, image_folder, args, libraries):
    """Detection tries HDF5 and Zarr before .npz, the other files and folders: neither
    imports h5py or zarr to say no. The accountant is imported where a figure needs it:
    Laplace noise's epsilon at dp_delta (approx) is dp-accounting's privacy-loss
    distribution, Gaussian noise's the analytic Gaussian; PrivUnit's are closed forms."""
    code, modules = imported(tmp_path, *args)
    assert code == 0
    assert heavy_among(modules, tuple(n for n in FORMAT_LIBRARIES if n not in libraries)) == []
    assert all(name in modules for name in libraries)  # the probe sees what a run imports
    assert ("dp_accounting" in modules) == ("privunit" not in args)
    if args[0] == "perturb":
        assert (tmp_path / args[-1]).is_file()
