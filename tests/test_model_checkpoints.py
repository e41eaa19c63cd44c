"""Model checkpoints that must still load and run after perturbation (issue 17): BatchNorm
statistics, --exclude, the tensors copied unchanged, and what is not a model file.

Files are written by the libraries people use (safetensors.torch / safetensors.numpy,
torch.save) and the outputs are reopened with them.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file as load_numpy, save_file as save_numpy

from tests.builders import assert_one_line_error
from tests.conftest import siblings, tree_digest
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
        assert (after["bn.running_var"] > 0).all()
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


@pytest.mark.parametrize("args,fragment", [
    (("--exclude", "conv*"), "--exclude conv* matches no tensor in the file"),
    (("--dataset", "fc.bias", "--exclude", "*.bias"), "named by --dataset and matched by --exclude *.bias")])
def test_exclude_usage_errors(cli, tmp_path, args, fragment):
    src = write_numpy_model(tmp_path / "m.safetensors")
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, *ARGS, *args), 2, str(src), fragment)
    assert_one_line_error(cli("plan", src, *ARGS, *args), 2, str(src), fragment)
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
