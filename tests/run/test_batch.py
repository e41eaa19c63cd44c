"""Several inputs in one call (run/batch.py): the accountant's work is done once per distinct
calibration, and the figures are those each input gets alone."""

import numpy as np

from tldp_cli.privacy import accounting
from tldp_cli.run import batch, calibration, pipeline
from tldp_cli.run.pipeline import PerturbOptions


def _counting(monkeypatch, name):
    calls = []
    real = getattr(accounting, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(accounting, name, spy)
    return calls


def test_inputs_of_one_calibration_are_certified_once(tmp_path, monkeypatch):
    """Float Laplace: the accountant's PLD composition took 0.2 s per input, every input."""
    rng = np.random.default_rng(1)
    inputs = []
    for i in range(3):
        inputs.append(tmp_path / f"x{i}.npy")
        np.save(inputs[-1], rng.random((5, 16), dtype=np.float32))
    np.save(tmp_path / "y.npy", rng.random((5, 17), dtype=np.float32))  # another record size
    inputs.append(tmp_path / "y.npy")
    calibration._certified.cache_clear()
    calls = _counting(monkeypatch, "certify_file")
    options = PerturbOptions(input=inputs[0], eps=1, sampler="float", noise="laplace", value_range=(0.0, 1.0),
                             allow_raw_release=True)
    outcomes = list(batch.perturb_each(batch.prepare(options, inputs)))
    assert [o.error for o in outcomes] == [None] * 4
    assert len(calls) == 2  # one per calibration: x0..x2 share theirs
    figures = [o.result.manifest["accounting"] for o in outcomes]
    assert figures[0] == figures[1] == figures[2] != figures[3]
    calibration._certified.cache_clear()  # alone, without the cache: the same figures
    alone = pipeline.perturb(PerturbOptions(input=inputs[2], eps=1, sampler="float", noise="laplace",
                                            value_range=(0.0, 1.0), allow_raw_release=True,
                                            out=tmp_path / "alone.npy"))
    assert alone.manifest["accounting"] == figures[2]


def test_model_files_keep_their_own_tensor_names(tmp_path):
    """Tensors of the same shapes under other names share the figures, not the names."""
    np.savez(tmp_path / "m1.npz", w=np.zeros((4, 4), np.float32), b=np.zeros(4, np.float32))
    np.savez(tmp_path / "m2.npz", kernel=np.zeros((4, 4), np.float32), bias=np.zeros(4, np.float32))
    options = PerturbOptions(input=tmp_path / "m1.npz", eps=1, clip=0.1, allow_raw_release=True)
    outcomes = list(batch.perturb_each(batch.prepare(options, [tmp_path / "m1.npz", tmp_path / "m2.npz"])))
    names = [[t["name"] for t in o.result.manifest["accounting"]["per_tensor"]] for o in outcomes]
    assert sorted(names[0]) == ["b", "w"] and sorted(names[1]) == ["bias", "kernel"]
