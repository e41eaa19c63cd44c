"""The library: perturb_array in a loop never repeats noise; a seed repeats it exactly."""

import ast
import importlib
import json
import re
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest

import tldp_cli
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.sampling import engine
from tldp_cli.sampling.rng import Streams

SEED = "98ab6f93e8be360eae780f2ba450c708"
FLAG = re.compile(r"(?<![\w-])--[a-z]")
BATCH = np.random.default_rng(3).integers(0, 256, (40, 8, 8), dtype=np.uint8)


def test_the_public_api_is_declared():
    assert set(tldp_cli.__all__) >= {"perturb_array", "perturb", "calibrate", "certify", "compose",
                                     "TldpError", "UsageError"}
    for name in tldp_cli.__all__:
        assert getattr(tldp_cli, name) is not None


def test_type_checkers_see_every_public_name_with_its_type():
    """Was: the public names existed only through the module's __getattr__, so mypy and
    pyright typed tldp_cli.perturb_array (and a misspelt tldp_cli.perturb_arary) as Any, py.typed
    notwithstanding. The stub tldp_cli/__init__.pyi imports each name from where __getattr__
    finds it, and the wheel ships it."""
    stub = Path(tldp_cli.__file__).with_suffix(".pyi")
    assert stub.is_file(), "tldp_cli/__init__.pyi, the public names for type checkers, is missing"
    tree = ast.parse(stub.read_text(encoding="utf-8"))
    seen = {alias.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == {name: tldp_cli._WHERE[name] for name in tldp_cli.__all__}
    stub_all = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and [ast.unparse(t) for t in node.targets] == ["__all__"])
    assert ast.literal_eval(stub_all) == tldp_cli.__all__
    assert any(isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "__version__" for node in tree.body)
    assert all(getattr(importlib.import_module(module), name) is getattr(tldp_cli, name)
               for name, module in seen.items())
    package_data = tomllib.loads((Path(tldp_cli.__file__).parents[1] / "pyproject.toml").read_text())
    assert "__init__.pyi" in package_data["tool"]["setuptools"]["package-data"]["tldp_cli"]


def test_every_public_name_says_what_it_is():
    """Was: help(tldp_cli.PerturbOptions) and help(tldp_cli.PerturbResult) showed only the
    signature dataclass writes in place of a docstring."""
    for name in tldp_cli.__all__:
        doc = getattr(tldp_cli, name).__doc__ or ""
        assert doc.strip() and not doc.startswith(f"{name}("), name


def test_two_unseeded_calls_draw_independent_noise():
    """Was: identical noise, so out1 - out2 gave the raw difference of two batches."""
    first = tldp_cli.perturb_array(BATCH, eps=1).array.astype(np.int64)
    second = tldp_cli.perturb_array(BATCH, eps=1).array.astype(np.int64)
    noise1, noise2 = first - BATCH, second - BATCH
    assert not np.array_equal(noise1, noise2)
    # independent draws: the correlation of the two noises is ~0 (2560 values: sd ~ 0.02)
    assert abs(np.corrcoef(noise1.ravel(), noise2.ravel())[0, 1]) < 0.1


def test_one_unseeded_streams_never_repeats_through_the_engine():
    calib = calibrate(mechanism="tldp", noise="gaussian", budget="element", epsilon=1.0,
                      range_width=256.0, elements=64)
    streams = Streams()
    a = engine.perturb_records(BATCH.reshape(40, 64), 0, "x", calib, streams)
    b = engine.perturb_records(BATCH.reshape(40, 64), 0, "x", calib, streams)
    assert not np.any(a == b)  # continuous noise: any equal value would be a repeat


def test_a_seed_repeats_exactly_and_another_seed_does_not():
    a = tldp_cli.perturb_array(BATCH, eps=1, seed=SEED).array
    b = tldp_cli.perturb_array(BATCH, eps=1, seed=SEED).array
    c = tldp_cli.perturb_array(BATCH, eps=1, seed="b9c39fb0fbae0da5ccb628c982d39ca6").array
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_the_figures_are_those_of_the_command(cli, tmp_path):
    np.save(tmp_path / "x.npy", BATCH)
    result = cli("perturb", tmp_path / "x.npy", "--eps", "2", "--noise", "gaussian", "--seed", SEED,
                 "--json", "-q")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    perturbed = tldp_cli.perturb_array(BATCH, eps=2, noise="gaussian", seed=SEED)
    assert perturbed.accounting["per_record"] == manifest["accounting"]["per_record"]
    assert perturbed.noise == manifest["noise"] == "discrete-gaussian"
    assert np.array_equal(perturbed.array, np.load(tmp_path / "x.tldp.npy"))


def test_float_data_needs_a_range_and_out_of_range_is_refused():
    values = np.random.default_rng(0).random((10, 4)).astype(np.float32)
    with pytest.raises(tldp_cli.UsageError, match="range"):
        tldp_cli.perturb_array(values, eps=1)
    with pytest.raises(tldp_cli.DataError, match="outside"):
        tldp_cli.perturb_array(values * 3, eps=1, value_range=(0, 1))
    clipped = tldp_cli.perturb_array(values * 3, eps=1, value_range=(0, 1), clip_input=True)
    assert clipped.array.shape == values.shape and clipped.array.dtype == np.float32


def test_nan_is_refused():
    values = np.zeros((3, 2), np.float64)
    values[1, 1] = np.nan
    with pytest.raises(tldp_cli.DataError, match="NaN"):
        tldp_cli.perturb_array(values, eps=1, value_range=(0, 1))


def test_weights_lower_the_retain_probability_only_where_given():
    values = np.full((20000, 4), 0.5, np.float32)
    weights = np.array([0.0, 0.0, 1.0, 1.0])  # the last two elements are never kept raw
    out = tldp_cli.perturb_array(values, eps=1, value_range=(0, 1), weights=weights, seed=SEED,
                                 sampler="float", allow_raw_release=True)
    kept = out.array == 0.5
    p = out.calibration.p  # e^-3 / (2 + e^-3), about 0.024
    assert abs(kept[:, :2].mean() - p) < 5 * np.sqrt(p / 40000) and not kept[:, 2:].any()


def test_torch_tensors_come_back_as_torch():
    torch = pytest.importorskip("torch")
    tensor = torch.rand(6, 5, dtype=torch.bfloat16)
    out = tldp_cli.perturb_array(tensor, eps=1, value_range=(0, 1))
    assert isinstance(out.array, torch.Tensor) and out.array.dtype == torch.bfloat16
    assert out.array.shape == tensor.shape


class _StandInDtype:
    """torch.float16 / torch.bfloat16 as perturb_array sees them (bfloat16 stood in by float32)."""

    is_floating_point = True

    def __init__(self, name, numpy_dtype):
        self.name, self.numpy_dtype = name, np.dtype(numpy_dtype)

    def __str__(self):
        return f"torch.{self.name}"


class _StandInTensor:
    """The few tensor methods perturb_array calls; .to(dtype) rounds as torch does, inf on overflow."""

    __module__ = "torch"

    def __init__(self, values, dtype=None):
        self.values, self.device = values, "cpu"
        self.dtype = dtype or _StandInDtype("float32", np.float32)

    def detach(self):
        return self

    def cpu(self):
        return self

    def float(self):
        return _StandInTensor(self.values.astype(np.float32))

    def numpy(self):
        return self.values

    def to(self, target):
        if isinstance(target, _StandInDtype):
            with np.errstate(over="ignore"):
                return _StandInTensor(self.values.astype(target.numpy_dtype), target)
        return self


def test_a_float16_tensor_saturates_at_65504_as_the_file_writers_do(monkeypatch):
    """Was: the float32 result .to(float16) overflowed to inf near the top of the range."""
    import types

    float16 = _StandInDtype("float16", np.float16)
    stand_in = types.SimpleNamespace(float16=float16, bfloat16=_StandInDtype("bfloat16", np.float32),
                                     from_numpy=_StandInTensor, Tensor=_StandInTensor)
    monkeypatch.setitem(__import__("sys").modules, "torch", stand_in)
    tensor = _StandInTensor(np.full((200, 8), 65000, np.float16), float16)
    out = tldp_cli.perturb_array(tensor, eps=0.5, value_range=(0, 65504), seed=SEED)
    values = out.array.values
    assert values.dtype == np.float16 and np.isfinite(values).all()
    assert values.max() == 65504 and values.min() >= -65504


def test_a_real_float16_tensor_stays_finite():
    torch = pytest.importorskip("torch")
    tensor = torch.full((200, 8), 65000, dtype=torch.float16)
    out = tldp_cli.perturb_array(tensor, eps=0.5, value_range=(0, 65504), seed=SEED)
    assert out.array.dtype == torch.float16 and bool(torch.isfinite(out.array).all())
    assert float(out.array.max()) == 65504


def test_perturb_options_take_str_paths(tmp_path):
    from tldp_cli import PerturbOptions, perturb

    np.save(tmp_path / "x.npy", np.arange(12, dtype=np.uint8).reshape(3, 4))
    result = perturb(PerturbOptions(input=str(tmp_path / "x.npy"), eps=1.0, out=str(tmp_path / "y.npy")))
    assert result.output == tmp_path / "y.npy" and result.output.exists()


def test_perturb_options_take_one_name_as_a_str(tmp_path):
    """Was: datasets="images" was iterated letter by letter ("dataset /i: no such dataset"), and
    keep="labels" refused as the pattern "l"; a str is one name, as on the command line."""
    import h5py

    from tldp_cli import PerturbOptions, perturb

    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["images"] = BATCH
        f["labels"] = np.arange(len(BATCH), dtype=np.int64)
        f["other"] = BATCH
    result = perturb(PerturbOptions(input=tmp_path / "x.h5", eps=1.0, datasets="images", keep="labels",
                                    out=tmp_path / "y.h5"))
    assert [entry["dataset"] for entry in result.manifest["inputs"]] == ["/images"]
    assert [entry["name"] for entry in result.manifest["unperturbed"]] == ["/labels"]
    result = perturb(PerturbOptions(input=tmp_path / "x.h5", eps=1.0, exclude="other", value_range=(0, 256),
                                    out=tmp_path / "z.h5"))
    assert [entry["dataset"] for entry in result.manifest["inputs"]] == ["/images"]  # /labels: 1-D labels
    assert [entry["name"] for entry in result.manifest["unperturbed"]] == ["/other"]  # --exclude copies it raw


def test_one_seed_gives_every_batch_of_one_shape_the_same_noise():
    """What docs/library.md's "A seed in a loop" warns of, and why each batch passes its own
    key: one seed on two batches of one shape draws the same noise, so their difference shows."""
    other = np.random.default_rng(4).integers(0, 256, BATCH.shape, dtype=np.uint8)
    first = tldp_cli.perturb_array(BATCH, eps=1, seed=SEED).array.astype(np.int64)
    second = tldp_cli.perturb_array(other, eps=1, seed=SEED).array.astype(np.int64)
    assert np.array_equal(first - BATCH, second - other)
    derived = "5f0e3f6b0d1c4a2e9b7d8c6a5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f"
    third = tldp_cli.perturb_array(other, eps=1, seed=derived).array.astype(np.int64)
    assert np.mean(third - other == first - BATCH) < 0.5


def _noise(batch, **given):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seed's warning
        return tldp_cli.perturb_array(batch, eps=1, **given).array.astype(np.int64) - batch


def test_one_seed_under_a_key_per_batch_draws_each_batch_its_own_noise():
    """Was: perturb_array had no key, so a seeded loop over batches repeated its noise (out1 -
    out2 gave batch1 - batch2) unless the caller derived a seed per batch (an HMAC recipe).
    Now key= names the batch: the streams of (seed, key) exactly as perturb_tensors derives
    them (rng.keyed_name), each key repeating itself, no key the noise it always had."""
    other = np.random.default_rng(4).integers(0, 256, BATCH.shape, dtype=np.uint8)
    keyed = {key: _noise(BATCH if i % 2 else other, seed=SEED, key=key)
             for i, key in enumerate(["batch 0", "batch 1", 2, b"batch 3"])}
    for a, b in [("batch 0", "batch 1"), ("batch 1", 2), (2, b"batch 3")]:
        assert np.mean(keyed[a] == keyed[b]) < 0.5, (a, b)  # the noise is independent, not repeated
    assert np.array_equal(_noise(other, seed=SEED, key="batch 0"), keyed["batch 0"])
    assert np.array_equal(_noise(BATCH, seed=SEED, key="2"), keyed[2])  # 2 is "2", as seeds
    assert np.array_equal(_noise(BATCH, seed=SEED, key="batch 3"), keyed[b"batch 3"])
    assert np.array_equal(_noise(BATCH, seed=SEED, key=None), _noise(BATCH, seed=SEED))  # today's noise
    with pytest.raises(tldp_cli.UsageError, match=r"^key names a batch: a str, bytes or int, not float$"):
        tldp_cli.perturb_array(BATCH, eps=1, seed=SEED, key=1.5)


def test_the_key_is_written_nowhere():
    """Like the seed, the key is a secret's part: the result holds neither."""
    key = "a key 7e1f0c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tldp_cli.perturb_array(BATCH, eps=1, seed=SEED, key=key)
    assert key not in repr(result) and SEED not in repr(result)
    assert key not in json.dumps([result.accounting, result.privunit, result.value_range])


@pytest.mark.parametrize("given", [dict(eps=np.float32(4), mechanism="privunit", value_range=(0, 1)),
                                   dict(eps=np.float32(1.5), clip=np.float32(1))], ids=["privunit", "clip"])
def test_numpy_scalars_as_options_give_a_manifest(tmp_path, given):
    """Was: eps=np.float32(4) with privunit, or clip=np.float32(1), reached the manifest as
    NumPy scalars and json.dump failed (TypeError: Object of type float32 is not JSON
    serializable) after the noise was drawn; the options are Python floats once checked."""
    floats = np.random.default_rng(5).random((10, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", floats)
    result = tldp_cli.perturb(tldp_cli.PerturbOptions(input=tmp_path / "x.npy", out=tmp_path / "y.npy", **given))
    assert json.loads(result.manifest_path.read_text())["epsilon"] == float(given["eps"])
    perturbed = tldp_cli.perturb_array(floats, **given)
    json.dumps([perturbed.accounting, perturbed.privunit, perturbed.value_range])


def test_a_record_epsilon_that_protects_nothing_is_warned_of_as_perturb_does():
    """Was: perturb_array returned a per-record eps of 256 in silence, where `tldp perturb`
    warns; now the same warning, a UserWarning in the library's words, at the caller's line."""
    with pytest.warns(UserWarning, match=r"^the certified eps per record is 256, above 100 .*lower eps|budget='record'") as caught:
        tldp_cli.perturb_array(BATCH, eps=4)
    [warning] = [w for w in caught if "certified eps" in str(w.message)]
    assert warning.filename == __file__ and not FLAG.search(str(warning.message))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tldp_cli.perturb_array(BATCH, eps=8, budget="record")
        tldp_cli.perturb_array(BATCH, eps=1)  # 64 per record


@pytest.mark.parametrize("given", [
    dict(dtype="float16"), dict(dtype="float32"), dict(dtype="float64", clip_input=True),
    dict(dtype="float32", sampler="float", noise="gaussian", allow_raw_release=True),
    dict(dtype="float32", weights=True), dict(dtype="float32", mechanism="privunit"),
    dict(dtype="float32", mechanism="idn", sampler="float"), dict(dtype="uint8"), dict(dtype="int32")])
def test_the_input_is_only_read(tmp_path, given):
    """What docs/library.md states: read-only arrays, non-contiguous views and memory maps go in
    and come out unchanged, and the output shares no memory with them."""
    given = dict(given)
    dtype = np.dtype(given.pop("dtype"))
    rng = np.random.default_rng(6)
    values = (rng.random((12, 6, 10)) * (1.3 if dtype.kind == "f" else 255)).astype(dtype)
    if given.pop("weights", False):
        given["weights"] = rng.random((6, 10))
    if dtype.kind == "f":
        given.setdefault("clip_input", False)
        values = np.clip(values, 0, 1) if not given["clip_input"] else values
        given["value_range"] = (0, 1)
    elif dtype == np.int32:
        given["value_range"] = (0, 256)
    np.save(tmp_path / "x.npy", values)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    read_only = values.copy()
    read_only.flags.writeable = False
    for array in (values, values[::-1, :, ::-1], np.asfortranarray(values), read_only, mapped):
        before = np.array(array)
        out = tldp_cli.perturb_array(array, eps=50, **given).array
        assert np.array_equal(array, before) and not np.shares_memory(out, array)
    assert np.array_equal(np.load(tmp_path / "x.npy"), values)


def test_a_seeded_call_warns_as_a_seeded_run_does():
    """Was: silent, where every seeded `tldp perturb` run warns that one seed on another input
    of the same shape repeats the noise (what a seeded loop over batches does)."""
    with pytest.warns(UserWarning, match="the same seed on another input of the same shape gives the same noise") as caught:
        tldp_cli.perturb_array(BATCH, eps=8, budget="record", seed=SEED)
    assert [w.filename for w in caught] == [__file__]


def test_a_seeded_call_says_to_pass_each_batch_its_own_key():
    """Was: the command's words alone, "use it for one release only", and no way to keep one
    seed's batches apart in the call; now it names key=, and a keyed call says to use each
    key once."""
    with pytest.warns(UserWarning, match=r"^a seed makes .* the same seed on another input of the same shape gives the same noise, "
                      r"so pass each batch its own key \(key=i in a loop\)") as caught:
        tldp_cli.perturb_array(BATCH, eps=8, budget="record", seed=SEED)
    assert [w.filename for w in caught] == [__file__]
    with pytest.warns(UserWarning, match="the same seed and key on another array .* use each key for one batch only"):
        tldp_cli.perturb_array(BATCH, eps=8, budget="record", seed=SEED, key="batch 0")


def test_a_masked_array_is_refused_not_unmasked():
    """Was: np.asarray dropped the mask, and the values under it (a fill value, often far out
    of range: clipped in silence with clip_input) were perturbed and released as data. A
    masked array without a masked value (netCDF4's variables read as one) is its data."""
    values = np.ma.masked_array(BATCH, mask=BATCH > 250)
    with pytest.raises(tldp_cli.UsageError, match=r"^array is a masked array with \d+ masked values, .* "
                       r"fill them \(array.filled\(value\)\) or compress them out"):
        tldp_cli.perturb_array(values, eps=1)
    unmasked = np.ma.masked_array(BATCH, mask=False)
    assert tldp_cli.perturb_array(unmasked, eps=1).array.shape == BATCH.shape
    assert type(tldp_cli.perturb_array(np.ma.masked_array(BATCH), eps=1).array) is np.ndarray


def test_a_torch_meta_tensor_is_refused_in_the_library_s_words():
    """Was: torch's NotImplementedError ("Cannot copy out of meta tensor; no data!"), not a
    TldpError, from a tensor that has a shape and no values."""
    torch = pytest.importorskip("torch")
    with pytest.raises(tldp_cli.UsageError, match=r"^array is a torch meta tensor: .* load its values first$"):
        tldp_cli.perturb_array(torch.empty(6, 5, device="meta"), eps=1, value_range=(0, 1))
    with pytest.raises(tldp_cli.UsageError, match="meta tensor"):
        tldp_cli.perturb_array(torch.nn.Parameter(torch.empty(6, 5, device="meta")), eps=1, value_range=(0, 1))


def test_plan_is_tldp_plan_json(cli, tmp_path):
    """Was: no library counterpart of `tldp plan` (a caller imported tldp_cli.run.plan, whose
    errors name the flags). tldp_cli.plan(options) returns what `tldp plan INPUT --json` prints,
    writes nothing, and its errors name the parameters, as tldp_cli.perturb's do."""
    floats = np.random.default_rng(7).random((20, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", floats)
    for flags, given in [(["--noise", "gaussian"], dict(noise="gaussian", value_range="0:1")),
                         (["--mechanism", "privunit", "--clip", "1"], dict(mechanism="privunit", clip=1.0)),
                         (["--budget", "record", "--dp-delta", "1e-6"], dict(budget="record", dp_delta=1e-6,
                                                                             value_range=(0, 1)))]:
        range_flags = ["--range", "0:1"] if "value_range" in given else []
        result = cli("plan", tmp_path / "x.npy", "--eps", "4", *flags, *range_flags, "--json", "-q")
        assert result.exit_code == 0, result.stderr
        options = tldp_cli.PerturbOptions(input=tmp_path / "x.npy", eps=4.0, **given)
        assert tldp_cli.plan(options) == json.loads(result.stdout), flags
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]
    phases = []
    tldp_cli.plan(tldp_cli.PerturbOptions(input=tmp_path / "x.npy", eps=1.0, value_range=(0, 1)),
                  phase=lambda label, what: phases.append(label))
    assert phases == ["reading", "planning"]
    with pytest.raises(tldp_cli.UsageError, match=r"value_range=\(lo, hi\)") as caught:
        tldp_cli.plan(tldp_cli.PerturbOptions(input=tmp_path / "x.npy", eps=1.0))
    assert not FLAG.search(str(caught.value))
    with pytest.raises(tldp_cli.UsageError, match=r"^eps must be a finite number > 0, not 0"):
        tldp_cli.plan(tldp_cli.PerturbOptions(input=tmp_path / "x.npy", eps=0, value_range=(0, 1)))
    with pytest.raises(tldp_cli.InputError):
        tldp_cli.plan(tldp_cli.PerturbOptions(input=tmp_path / "missing.npy", eps=1.0, value_range=(0, 1)))
