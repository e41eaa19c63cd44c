"""Model files' tensors larger than a block are read, perturbed and written part by part
(ArrayJob.read_parts, Writer.part_writer): the bytes are those of the tensor perturbed whole,
the files load with the libraries that wrote them, and bad values are found in any part.
The memory this saves is measured in tests/run/test_memory.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from tests.builders import read_safetensors, read_sharded_model, write_safetensors, write_sharded_model
from tldp_cli.errors import DataError
from tldp_cli.run.pipeline import PerturbOptions, perturb
from tldp_cli.sampling.rng import STREAM_UNIT_ELEMENTS

SEED = "7c1822e9253f14f03f5423c622a036fa"
PART = STREAM_UNIT_ELEMENTS  # --block-elements: parts of one stream segment
WHOLE = 1 << 24  # a block larger than any tensor here: each read whole
BIG = (700, 1000)  # 700,000 elements: three parts of 2^18 (the last shorter)


def _tensors(dtype="float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"embed.weight": (rng.standard_normal(BIG) * 0.02).astype(dtype),
            "norm.weight": np.ones(64, dtype), "steps": np.arange(3)}


def _model(folder: Path, fmt: str) -> Path:
    """A model with a tensor of three parts, written by its library."""
    folder.mkdir()
    if fmt == "safetensors":  # float32, and the same values as bfloat16 (exactly: 7 mantissa bits)
        rounded = (_tensors()["embed.weight"].view("<u4") & 0xFFFF0000).view("<f4")
        return write_safetensors(folder / "model.safetensors", _tensors(), bf16={"lm_head.weight": rounded},
                                 metadata={"format": "pt"})
    if fmt == "sharded":
        return write_sharded_model(folder / "model", {**_tensors("float16"), "head.weight": np.ones(BIG, "float32")},
                                   max_shard_size=1 << 20)
    if fmt == "npz":
        np.savez(folder / "model.npz", **_tensors(), other=np.ones((600, 1000), ">f8"))
    else:
        np.savez_compressed(folder / "model.npz", **_tensors(), other=np.ones((600, 1000), ">f8"))
    return folder / "model.npz"


def _run(src: Path, out: Path, block: int, workers: int = 1) -> Path:
    perturb(PerturbOptions(input=src, out=out, eps=1.0, clip=0.1, seed=SEED, block_elements=block,
                           workers=workers))
    return out


def _files(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _read_back(path: Path, fmt: str) -> dict[str, np.ndarray]:
    """The tensors, as their consumers read them (bfloat16 through the format's own bits)."""
    if fmt == "safetensors":
        with safe_open(str(path), framework="np") as f:
            assert sorted(f.keys()) == ["embed.weight", "lm_head.weight", "norm.weight", "steps"]
        return read_safetensors(path)[2]
    if fmt == "sharded":
        return read_sharded_model(path)
    with np.load(path) as archive:
        return dict(archive)


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "npz", "npz-compressed"])
def test_tensors_perturbed_in_parts_are_the_bytes_perturbed_whole(tmp_path, fmt):
    src = _model(tmp_path / "in", fmt)
    whole = _run(src, tmp_path / f"whole-{src.name}", WHOLE)
    parts = _run(src, tmp_path / f"parts-{src.name}", PART)
    threads = _run(src, tmp_path / f"threads-{src.name}", PART, workers=3)
    assert _files(parts) == _files(whole) == _files(threads)
    raw, noisy = _read_back(src, fmt), _read_back(parts, fmt)
    assert raw.keys() == noisy.keys()
    for name, values in raw.items():
        assert noisy[name].shape == values.shape and noisy[name].dtype == values.dtype, name
        if values.dtype.kind == "f":
            noise = noisy[name].astype(np.float64) - np.clip(values.astype(np.float64), -0.1, 0.1)
            assert np.count_nonzero(noise) > 0.99 * noise.size, name
        else:
            np.testing.assert_array_equal(noisy[name], values)


def test_a_nan_in_a_later_part_is_named_by_its_element(tmp_path):
    tensors = _tensors()
    tensors["embed.weight"].reshape(-1)[600_123] = np.nan
    src = write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(DataError, match=r"model\.safetensors: tensor embed\.weight, NaN or Inf at record 0, "
                                        r"element 600123;"):
        _run(src, tmp_path / "out.safetensors", PART)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_values_outside_the_range_are_counted_in_every_part(tmp_path):
    tensors = _tensors()
    flat = tensors["embed.weight"].reshape(-1)
    flat[:] = 0
    flat[[5, 300_000, 300_001, 699_999]] = 2.0  # in the first part, the second, and the last
    src = write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(DataError, match=r"tensor embed\.weight: 4 values outside the declared range \[-1, 1\]"):
        perturb(PerturbOptions(input=src, out=tmp_path / "out.safetensors", eps=1.0, value_range=(-1.0, 1.0),
                               seed=SEED, block_elements=PART))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_unseeded_runs_in_parts_draw_fresh_noise_in_every_segment(tmp_path):
    """Without a seed, every segment of a tensor perturbed in parts draws from fresh key
    material: two runs share no noise (a fixed or reused key would repeat it exactly)."""
    src = _model(tmp_path / "in", "safetensors")
    noises = []
    for i in range(2):
        out = tmp_path / f"out{i}.safetensors"
        perturb(PerturbOptions(input=src, out=out, eps=1.0, clip=0.1, block_elements=PART, workers=2))
        noisy = read_safetensors(out)[2]["embed.weight"].astype(np.float64).reshape(-1)
        noises.append(noisy - np.clip(_tensors()["embed.weight"].astype(np.float64).reshape(-1), -0.1, 0.1))
    for start in range(0, noises[0].size, PART):  # each segment (and part)
        first, second = (n[start:start + PART] for n in noises)
        assert np.mean(first == second) < 0.01, start
        assert abs(np.corrcoef(first, second)[0, 1]) < 0.02, start
