"""Model checkpoints that must still load and run after perturbation (issue 17): BatchNorm
statistics, --exclude, the tensors copied unchanged, and what is not a model file.

Files are written by the libraries people use (safetensors.torch / safetensors.numpy,
torch.save) and the outputs are reopened with them.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy

from tests.builders import assert_one_line_error, siblings, tree_digest
from tldp_cli.formats.tensor_files import NORM_REASON

ARGS = ("--eps", "1", "--clip", "0.5", "--allow-raw-release")
STATS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def small_net():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("conv", torch.nn.Conv2d(3, 8, 3))
    net.add_module("bn", torch.nn.BatchNorm2d(8))
    net.add_module("relu", torch.nn.ReLU())
    net.add_module("flat", torch.nn.Flatten())
    net.add_module("fc", torch.nn.Linear(8 * 4 * 4, 10))
    net.train()
    for _ in range(3):  # running statistics of real batches, num_batches_tracked = 3
        net(torch.randn(16, 3, 6, 6) * 2 + 1)
    return net.eval()


def run_forward(net, state) -> "np.ndarray":
    import torch

    net.load_state_dict(state)
    with torch.no_grad():
        return net(torch.randn(4, 3, 6, 6)).numpy()


def manifest_of(result) -> dict:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_torch_batchnorm_model_loads_and_runs(cli, tmp_path):
    pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    net = small_net()
    src = tmp_path / "net.safetensors"
    save_file(net.state_dict(), str(src))
    result = cli("perturb", src, *ARGS, "--json")
    m = manifest_of(result)
    assert {u["name"]: u["reason"] for u in m["unperturbed"]} == {name: NORM_REASON for name in STATS}
    assert sorted(t["name"] for t in m["accounting"]["per_tensor"]) == [
        "bn.bias", "bn.weight", "conv.bias", "conv.weight", "fc.bias", "fc.weight"]
    copied = ", ".join(u["name"] for u in m["unperturbed"])
    assert f"copied unchanged: {copied} ({NORM_REASON})" in result.stderr
    before, after = load_file(str(src)), load_file(str(tmp_path / "net.tldp.safetensors"))
    for name in STATS:
        assert after[name].dtype == before[name].dtype and after[name].equal(before[name])
    assert not after["conv.weight"].equal(before["conv.weight"])
    assert np.isfinite(run_forward(net, after)).all()


def test_opted_in_variance_is_perturbed_and_stays_positive(cli, tmp_path):
    pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    net = small_net()
    src = tmp_path / "net.safetensors"
    save_file(net.state_dict(), str(src))
    floats = [n for n, t in net.state_dict().items() if t.is_floating_point()]
    # Running variances near 0 after clipping to 0.5: at eps 0.1 most noisy values are negative.
    result = cli("perturb", src, "--eps", "0.1", "--clip", "0.5", "--allow-raw-release", "--json",
                 *[arg for name in floats for arg in ("--dataset", name)])
    m = manifest_of(result)
    assert [u["name"] for u in m["unperturbed"]] == ["bn.num_batches_tracked"]
    assert any("variances (bn.running_var)" in step for step in m["postprocessing"])
    after = load_file(str(tmp_path / "net.tldp.safetensors"))
    assert (after["bn.running_var"] > 0).all()
    # the noise took some below 0: raised to float32's smallest positive normal value
    assert (after["bn.running_var"] == np.finfo(np.float32).tiny).any()
    assert not after["bn.running_mean"].equal(net.state_dict()["bn.running_mean"])
    assert np.isfinite(run_forward(net, after)).all()


def batchnorm_forward(tensors: dict, x: np.ndarray) -> np.ndarray:
    """A BatchNorm layer in inference mode, then a linear layer, in NumPy."""
    normed = (x - tensors["bn.running_mean"]) / np.sqrt(tensors["bn.running_var"] + 1e-5)
    return (normed * tensors["bn.weight"] + tensors["bn.bias"]) @ tensors["fc.weight"].T + tensors["fc.bias"]


def write_numpy_model(path: Path) -> Path:
    rng = np.random.default_rng(3)
    save_numpy({"bn.weight": np.ones(32, np.float32), "bn.bias": np.zeros(32, np.float32),
                "bn.running_mean": rng.normal(0, 0.1, 32).astype(np.float32),
                "bn.running_var": rng.uniform(1e-4, 1e-3, 32).astype(np.float32),
                "bn.num_batches_tracked": np.array(7, np.int64),
                "fc.weight": rng.normal(0, 0.1, (4, 32)).astype(np.float32),
                "fc.bias": np.zeros(4, np.float32)}, str(path))
    return path


@pytest.mark.parametrize("opt_in", [False, True])
def test_numpy_batchnorm_stays_finite(cli, tmp_path, opt_in):
    """Without torch: safetensors.numpy files, the layer computed in NumPy."""
    src = write_numpy_model(tmp_path / "m.safetensors")
    named = ("--dataset", "bn.running_var", "--dataset", "fc.weight") if opt_in else ()
    m = manifest_of(cli("perturb", src, "--eps", "0.1", *ARGS[2:], "--json", *named))
    before, after = load_numpy(str(src)), load_numpy(str(tmp_path / "m.tldp.safetensors"))
    assert after["bn.num_batches_tracked"] == 7 and after["bn.num_batches_tracked"].dtype == np.int64
    if opt_in:
        assert (after["bn.running_var"] > 0).all() and (after["bn.running_var"] == np.finfo(np.float32).tiny).any()
        assert (after["bn.running_var"] != before["bn.running_var"]).any()
        assert "bn.running_mean" in [u["name"] for u in m["unperturbed"]]
    else:
        np.testing.assert_array_equal(after["bn.running_var"], before["bn.running_var"])
    out = batchnorm_forward(after, np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32))
    assert np.isfinite(out).all()


def test_exclude_leaves_out_matching_tensors(cli, tmp_path):
    src = write_numpy_model(tmp_path / "m.safetensors")
    result = cli("perturb", src, *ARGS, "--exclude", "*.bias", "--exclude", "fc.*", "--json")
    m = manifest_of(result)
    reasons = {u["name"]: u["reason"] for u in m["unperturbed"]}
    assert reasons["bn.bias"] == reasons["fc.bias"] == "--exclude *.bias"
    assert reasons["fc.weight"] == "--exclude fc.*"
    assert [t["name"] for t in m["accounting"]["per_tensor"]] == ["bn.weight"]
    before, after = load_numpy(str(src)), load_numpy(str(tmp_path / "m.tldp.safetensors"))
    for name in reasons:
        np.testing.assert_array_equal(after[name], before[name])
    assert "fc.weight (--exclude fc.*)" in result.stderr


@pytest.mark.parametrize("args,code,fragment", [
    # a name the file lacks is an input error, as --dataset of a missing tensor is
    (("--exclude", "conv*"), 2, "--exclude conv* matches no tensor in the file"),
    (("--dataset", "nosuch"), 1, "no such tensor in the file"),
    (("--dataset", "fc.bias", "--exclude", "*.bias"), 2, "named by --dataset and matched by --exclude *.bias")])
def test_exclude_errors(cli, tmp_path, args, code, fragment):
    src = write_numpy_model(tmp_path / "m.safetensors")
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, *ARGS, *args), code, str(src), fragment)
    assert_one_line_error(cli("plan", src, *ARGS, *args), code, str(src), fragment)
    assert siblings(tmp_path) == before


def test_exclude_on_a_format_without_names(cli, tmp_path):
    src = tmp_path / "x.npy"
    np.save(src, np.zeros((4, 3), np.float32))
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--range", "0:1", "--exclude", "a"), 2,
                          str(src), "--exclude applies to model files")


def test_plan_lists_what_would_be_copied(cli, tmp_path):
    src = write_numpy_model(tmp_path / "m.safetensors")
    result = cli("plan", src, *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    unperturbed = [u["name"] for u in json.loads(result.stdout)["unperturbed"]]
    assert sorted(unperturbed) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    assert f"copied unchanged: {', '.join(unperturbed)} ({NORM_REASON})" in result.stderr


def test_torch_save_checkpoint_is_refused_clearly(cli, tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "net.pt"
    torch.save(small_net().state_dict(), src)
    digest = tree_digest(src)
    assert_one_line_error(cli("perturb", src, *ARGS), 1, str(src), "PyTorch checkpoint",
                          "safetensors.torch.save_file")
    assert tree_digest(src) == digest and siblings(tmp_path) == {"net.pt"}


# --------------------------------------------------------------------------- Keras weights

def write_keras_weights(path: Path) -> Path:
    """The layout Keras 3's Model.save_weights writes (saving_lib.H5IOStore): the model's own
    /vars, each layer's variables at /layers/<snake_case class name>[_N]/vars/<i>.
    BatchNormalization: gamma, beta, moving_mean, moving_variance."""
    import h5py

    rng = np.random.default_rng(7)
    layers = {"conv2d": [rng.normal(0, 0.1, (3, 3, 3, 8)), np.zeros(8)],
              "batch_normalization": [np.ones(8), np.zeros(8), rng.normal(0, 0.1, 8),
                                      rng.uniform(1e-4, 1e-3, 8)],
              "dense": [rng.normal(0, 0.1, (128, 10)), np.zeros(10)]}
    with h5py.File(path, "w") as f:
        f.create_group("vars")
        for layer, weights in layers.items():
            group = f.create_group(f"layers/{layer}").create_group("vars")
            for i, w in enumerate(weights):
                group[str(i)] = w.astype(np.float32)
        f.create_group("optimizer").create_group("vars")["0"] = np.int64(12)  # iterations, a scalar
    return path


def h5_layout(path: Path) -> dict:
    import h5py

    layout = {}
    with h5py.File(path, "r") as f:
        layout["/"] = dict(f.attrs)
        f.visititems(lambda name, obj: layout.__setitem__(name, (
            type(obj).__name__, dict(obj.attrs),
            (obj.shape, obj.dtype.str, obj.chunks) if hasattr(obj, "dtype") else None)))
    return layout


def test_keras_weights_are_tensors_and_keep_the_layout(cli, tmp_path):
    import h5py

    src = write_keras_weights(tmp_path / "model.weights.h5")
    result = cli("perturb", src, *ARGS, "--json")
    m = manifest_of(result)
    out = tmp_path / "model.tldp.weights.h5"
    assert h5_layout(out) == h5_layout(src)
    bn = "/layers/batch_normalization/vars/"
    assert {u["name"]: u["reason"] for u in m["unperturbed"]} == {
        bn + "2": NORM_REASON, bn + "3": NORM_REASON,
        "/optimizer/vars/0": "int64: only float16, bfloat16, float32, float64 tensors are perturbed"}
    # each weight is one record: a bias of 8 values is one record of 8 elements
    per_tensor = {t["name"]: t["elements"] for t in m["accounting"]["per_tensor"]}
    assert per_tensor["/layers/conv2d/vars/1"] == 8 and per_tensor["/layers/dense/vars/0"] == 1280
    assert m["records"] == 6 and "keras weights" in result.stderr.lower()
    with h5py.File(src, "r") as a, h5py.File(out, "r") as b:
        for name in (bn + "2", bn + "3", "optimizer/vars/0"):
            np.testing.assert_array_equal(b[name][()], a[name][()])
        assert not np.array_equal(b["layers/dense/vars/0"][()], a["layers/dense/vars/0"][()])
        assert np.isfinite(b["layers/dense/vars/0"][()]).all()


def test_keras_opted_in_moving_variance_stays_positive(cli, tmp_path):
    import h5py

    src = write_keras_weights(tmp_path / "model.weights.h5")
    variance = "layers/batch_normalization/vars/3"
    m = manifest_of(cli("perturb", src, "--eps", "0.1", *ARGS[2:], "--json", "--dataset", variance,
                        "--dataset", "/layers/dense/vars/0"))
    assert any(f"variances (/{variance})" in step for step in m["postprocessing"])
    with h5py.File(tmp_path / "model.tldp.weights.h5", "r") as f:
        assert (f[variance][()] > 0).all() and f[variance].dtype == np.float32


def test_keras_exclude_and_a_plain_hdf5_file_is_not_a_model(cli, tmp_path):
    import h5py

    src = write_keras_weights(tmp_path / "model.weights.h5")
    m = manifest_of(cli("plan", src, *ARGS, "--json", "--exclude", "/layers/dense/*"))
    assert {u["name"] for u in m["unperturbed"]} >= {"/layers/dense/vars/0", "/layers/dense/vars/1"}
    plain = tmp_path / "data.h5"
    with h5py.File(plain, "w") as f:
        f["vars/0"] = np.zeros((5, 3), np.float32)
        f["x"] = np.zeros((5, 3), np.float32)  # not a variable: a dataset file
    m = manifest_of(cli("plan", plain, "--eps", "1", "--range", "0:1", "--json", "--exclude", "x"))
    assert "per_tensor" not in m["accounting"] and m["records"] == 5


def test_a_pickled_checkpoint_is_refused_with_the_way_to_convert_it(cli, tmp_path):
    """Legacy torch.save files (and any pickle) are never loaded: they can run code."""
    import pickle

    src = tmp_path / "old.pth"
    src.write_bytes(pickle.dumps({"weight": [0.1, 0.2]}, protocol=2))
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--clip", "1"), 1, str(src), "a Python pickle",
                          "safetensors")
    assert siblings(tmp_path) == before


def write_record_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    save_numpy({"w": rng.uniform(-1, 1, (40, 50)).astype(np.float16),
                "b": rng.uniform(-1, 1, 10).astype(np.float32)}, str(path))
    return path


def test_record_budget_on_a_model_computes_in_float64_unasked(cli, tmp_path):
    """Was: a tensor of 2000 elements under --budget record was refused unless --dtype float64
    (float32 cannot hold the grid values); each tensor is written back in its own dtype anyway."""
    src = write_record_model(tmp_path / "m.safetensors")
    args = ("--eps", "10", "--budget", "record", "--range", "-1:1")
    m = manifest_of(cli("perturb", src, *args, "--json"))
    assert m["grid"]["output_dtype_rule"].startswith("float64: ")
    assert "float16 tensors rounded to float16 (nearest even) after the noise" in m["postprocessing"][0]
    assert m["output_dtype"] == "float16 and float32 (each tensor keeps its dtype)"
    before, after = load_numpy(str(src)), load_numpy(str(tmp_path / "m.tldp.safetensors"))
    for name in before:
        assert after[name].dtype == before[name].dtype and np.isfinite(after[name]).all()
        assert not np.array_equal(after[name], before[name])
    plan = cli("plan", src, *args)
    assert plan.exit_code == 0 and "values float64" in plan.stderr, plan.stderr
    checked = cli("evaluate", src, tmp_path / "m.tldp.safetensors")
    assert checked.exit_code == 0, checked.stderr


def test_record_budget_on_a_model_in_float32_asked_is_still_refused(cli, tmp_path):
    src = write_record_model(tmp_path / "m.safetensors")
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, "--eps", "10", "--budget", "record", "--range", "-1:1",
                              "--dtype", "float32"), 2, str(src), "--dtype float32 cannot hold the grid values")
    assert siblings(tmp_path) == before


def test_dataset_takes_globs_as_exclude_does(cli, tmp_path):
    """Was: --dataset 'fc.*' was read as a tensor's name and refused (no such tensor)."""
    src = write_numpy_model(tmp_path / "m.safetensors")
    m = manifest_of(cli("perturb", src, *ARGS, "--dataset", "fc.*", "--dataset", "bn.weight", "--json"))
    assert sorted(t["name"] for t in m["accounting"]["per_tensor"]) == ["bn.weight", "fc.bias", "fc.weight"]
    reasons = {u["name"]: u["reason"] for u in m["unperturbed"]}
    assert reasons == {name: "not named by --dataset" for name in
                       ("bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked")}
    before, after = load_numpy(str(src)), load_numpy(str(tmp_path / "m.tldp.safetensors"))
    assert not np.array_equal(after["fc.weight"], before["fc.weight"])
    np.testing.assert_array_equal(after["bn.bias"], before["bn.bias"])
    # --exclude leaves out of a glob's tensors; the other dtypes it matches are copied, as by default
    m = manifest_of(cli("perturb", src, *ARGS, "--dataset", "bn.*", "--exclude", "*.running_*",
                        "--out", tmp_path / "bn.safetensors", "--json"))
    assert sorted(t["name"] for t in m["accounting"]["per_tensor"]) == ["bn.bias", "bn.weight"]
    reasons = {u["name"]: u["reason"] for u in m["unperturbed"]}
    assert reasons["bn.running_var"] == "--exclude *.running_*" and reasons["bn.num_batches_tracked"].startswith("int64")


@pytest.mark.parametrize("pattern,fragment", [
    ("conv.*", "tensor conv.*: no such tensor in the file"),
    ("*.num_batches_*", "--dataset *.num_batches_* matches no floating-point tensor")])
def test_a_dataset_glob_that_matches_nothing_is_refused(cli, tmp_path, pattern, fragment):
    src = write_numpy_model(tmp_path / "m.safetensors")
    before = siblings(tmp_path)
    for command in ("perturb", "plan"):
        assert_one_line_error(cli(command, src, *ARGS, "--dataset", pattern), 1, str(src), fragment)
    assert siblings(tmp_path) == before


def test_evaluate_recalibrates_a_model_run_in_the_dtype_it_asked_for(cli, tmp_path):
    """Was: evaluate recalibrated a model file's --dtype float64 run in float32 (its output_dtype
    names the tensors' dtypes) and failed: 'its parameters cannot be calibrated'."""
    src = write_record_model(tmp_path / "m.safetensors")
    out = tmp_path / "out.safetensors"
    result = cli("perturb", src, "--eps", "10", "--budget", "record", "--range", "-1:1", "--dtype", "float64",
                 "--out", out)
    assert result.exit_code == 0, result.stderr
    checked = cli("evaluate", src, out)
    assert checked.exit_code == 0, checked.stderr
