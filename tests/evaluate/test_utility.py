"""The task utility's optional dependencies: without the eval extra, evaluate and sweep say
what to install, in one line and before any work, instead of an "unexpected error"."""

import sys

import numpy as np
import pytest

from tests.builders import assert_one_line_error
from tldp_cli import evaluate as ev

HINT = "tldp-tensors[eval]"


def _without(monkeypatch, package):
    """`import package` (and its submodules, some already imported) now raises ImportError."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def released(cli, tmp_path):
    """A small perturbed copy, its labels and a labelled test set."""
    rng = np.random.default_rng(0)
    src, out = tmp_path / "d.npy", tmp_path / "d.tldp.npy"
    np.save(src, rng.integers(0, 256, (20, 4, 4), dtype=np.uint8))
    np.save(tmp_path / "y.npy", np.arange(20) % 2)
    np.save(tmp_path / "t.npy", rng.integers(0, 256, (6, 4, 4), dtype=np.uint8))
    np.save(tmp_path / "ty.npy", np.arange(6) % 2)
    assert cli("perturb", src, "--eps", "1", "--out", out, "-q").exit_code == 0
    task = ["--labels", tmp_path / "y.npy", "--test", tmp_path / "t.npy", "--test-labels", tmp_path / "ty.npy"]
    return src, out, task


def test_evaluate_with_labels_without_scikit_learn_says_what_to_install(cli, released, monkeypatch):
    """It failed "unexpected error (ModuleNotFoundError: No module named 'sklearn'); please
    report it", once every check had run: weighted_f1 imported sklearn before need()."""
    src, out, task = released
    _without(monkeypatch, "sklearn")
    assert_one_line_error(cli("evaluate", src, out, *task), 1, "needs scikit-learn", HINT)


def test_a_task_without_scikit_learn_is_refused_before_any_data_is_read(released, monkeypatch):
    src, out, task = released
    _without(monkeypatch, "sklearn")
    monkeypatch.setattr(ev.report, "read_manifest", lambda *a, **k: pytest.fail("read the manifest"))
    with pytest.raises(ev.TldpError, match=r"needs scikit-learn.*tldp-tensors\[eval\]"):
        ev.evaluate(src, out, labels=task[1], test=task[3], test_labels=task[5])
    with pytest.raises(ev.TldpError, match="needs scikit-learn"):  # the library's own entry too
        ev.weighted_f1(np.zeros((2, 3)), np.arange(2), np.zeros((2, 3)), np.arange(2), "logistic", (0, 1))


def test_sweep_without_matplotlib_is_refused_before_it_sweeps(cli, released, tmp_path, monkeypatch):
    """It swept every eps (minutes on real data), then failed drawing the plots."""
    src, _, _ = released
    _without(monkeypatch, "matplotlib")
    monkeypatch.setattr(ev, "sweep", lambda *a, **k: pytest.fail("swept without matplotlib"))
    result = cli("sweep", src, "--eps", "1", "--out", tmp_path / "sweep")
    assert_one_line_error(result, 1, "needs matplotlib", HINT)
    assert not (tmp_path / "sweep").exists()
