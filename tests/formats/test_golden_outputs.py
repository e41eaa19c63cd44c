"""Seeded outputs, manifests and messages of every format, against golden hashes.

A seeded run is a pure function of its input, options and seed: the same bytes every
time, whatever the code's internal shape. This test keeps, for one run per format (and a
few option variants: --exclude, --keep, arrays sharing rows), the sha256 of

- each output file (HDF5 files, which store each object's modification time, by their
  content: every object, attribute, layout and value, read with h5py),
- the manifest, after removing what legitimately varies between runs and machines (the
  time it was made, the tool's version; paths are made relative to the run's folder and
  the HDF5 outputs' sha256 replaced by their content digest),
- the lines the run printed (the same paths made relative).

Any change in what a run writes or says fails it. A deliberate change regenerates the
file from the code that makes it (`TLDP_GOLDEN_UPDATE=1 python -m pytest
tests/formats/test_golden_outputs.py`) and says so in its commit; so does an upgrade of a
library whose encoders change their bytes (zlib-ng, numcodecs, h5py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import xarray as xr
from safetensors.numpy import save_file

from tests.builders import REPO, write_sharded_model

GOLDEN = REPO / "tests" / "fixtures" / "golden_outputs.json"
SAMPLES = REPO / "sample_data"
# A fixed strong seed (128 bits, random-looking): weak ones are refused without --allow-weak-seed.
SEED = "7c1822e9253f14f03f5423c622a036fa"
HDF5_SUFFIXES = (".h5", ".nc")


def _tensors(digits: np.ndarray) -> dict[str, np.ndarray]:
    """A small model made from the digits: weights, a bias, a count."""
    w = digits[:64].reshape(64, 784).astype(np.float32) / 255 - 0.5
    return {"layer.weight": w, "layer.bias": w[:, :10].sum(axis=1) / 10,
            "head.weight": w[:10, :32].copy(), "steps": np.array([400], dtype=np.int64)}


def _npz(tmp: Path, digits: np.ndarray) -> Path:
    path = tmp / "model.npz"
    np.savez(path, **_tensors(digits))
    return path


def _safetensors(tmp: Path, digits: np.ndarray) -> Path:
    path = tmp / "model.safetensors"
    save_file(_tensors(digits), str(path), metadata={"format": "pt"})
    return path


def _sharded(tmp: Path, digits: np.ndarray) -> Path:
    """The model of _tensors in two shards (the weight alone in one), a configuration and a model card."""
    return write_sharded_model(tmp / "model", _tensors(digits), max_shard_size=100_000,
                               extra_files={"config.json": '{"_name_or_path": "x", "model_type": "mlp"}',
                                            "README.md": "trained on digits"})


def _netcdf(tmp: Path, digits: np.ndarray) -> Path:
    path = tmp / "digits.nc"
    labels = np.load(SAMPLES / "digits_labels.npy")
    ds = xr.Dataset({"images": (("sample", "y", "x"), digits[:100], {"units": "1", "long_name": "pixel"}),
                     "labels": (("sample",), labels[:100].astype(np.int16))},
                    coords={"sample": np.arange(100, dtype=np.int32)}, attrs={"title": "digits"})
    ds.to_netcdf(path, engine="netcdf4")
    return path


def _nifti(tmp: Path, digits: np.ndarray) -> Path:
    """A 4-D series (28 x 28 x 5 voxels, 4 frames) as nibabel writes it, with header text."""
    import nibabel as nib

    path = tmp / "series.nii.gz"
    data = digits[:20].reshape(4, 5, 28, 28).transpose(3, 2, 1, 0).astype(np.int16)
    img = nib.Nifti1Image(data, np.diag([0.5, 0.5, 2.0, 1.0]))
    img.header["descrip"] = b"digits as a scan"
    img.set_data_dtype(np.int16)
    img.to_filename(str(path))
    return path


def _digit_images(digits: np.ndarray):
    import io

    from PIL import Image

    images = []
    for digit in digits:
        buffer = io.BytesIO()
        Image.fromarray(digit).save(buffer, "PNG")
        images.append({"bytes": buffer.getvalue(), "path": None})
    return images


def _hf_digits(digits: np.ndarray):
    """The first 40 digits and their labels as a Hugging Face dataset (Image, ClassLabel)."""
    import datasets

    labels = np.load(SAMPLES / "digits_labels.npy")[:40]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    return datasets.Dataset.from_dict({"image": _digit_images(digits[:40]), "label": labels.tolist()},
                                      features=features)


def _parquet(tmp: Path, digits: np.ndarray) -> Path:
    path = tmp / "digits.parquet"
    _hf_digits(digits).to_parquet(str(path), batch_size=16)
    return path


def _arrow(tmp: Path, digits: np.ndarray) -> Path:
    """An Arrow IPC file (pyarrow) of 28x28 tensors and labels, in batches of 16."""
    import pyarrow as pa

    tensors = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(digits[:40].reshape(-1)), 28), 28)
    table = pa.table({"pixels": tensors, "label": np.load(SAMPLES / "digits_labels.npy")[:40]})
    path = tmp / "digits.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=16):
            writer.write_batch(batch)
    return path


def _saved(tmp: Path, digits: np.ndarray) -> Path:
    path = tmp / "digits_saved"
    _hf_digits(digits).save_to_disk(str(path), num_shards=2)
    return path


def _webdataset(tmp: Path, digits: np.ndarray) -> Path:
    """Two shards as webdataset's ShardWriter writes them (a fixed mtime): each sample a
    digit as PNG, a 7 x 7 .npy of it, its class and a JSON record."""
    import webdataset as wds

    folder = tmp / "shards"
    folder.mkdir()
    labels = np.load(SAMPLES / "digits_labels.npy")
    with wds.ShardWriter(str(folder / "digits-%03d.tar"), maxcount=4, verbose=0, mtime=1_700_000_000) as sink:
        for i in range(6):
            sink.write({"__key__": f"d{i:03d}", "png": digits[i], "npy": digits[i, ::4, ::4].copy(),
                        "cls": int(labels[i]), "json": {"source": "mnist"}})
    return folder


def _sample(name: str):
    return lambda tmp, digits: SAMPLES / name


# case: (how the input is made in tmp, then the options)
CASES = {
    "npy": (_sample("digits.npy"), ()),
    "hdf5": (_sample("digits.h5"), ()),
    "hdf5-rows": (_sample("digits.h5"), ("--dataset", "images", "--dataset", "labels")),
    "netcdf": (_netcdf, ("--keep", "*")),
    "zarr": (_sample("digits.zarr"), ("--dataset", "images", "--dataset", "labels")),
    "images": (_sample("digits_png"), ()),
    "npz": (_npz, ("--clip", "0.5", "--exclude", "steps")),
    "safetensors": (_safetensors, ("--clip", "0.5", "--keep", "steps")),
    "sharded-safetensors": (_sharded, ("--clip", "0.5")),
    "nifti": (_nifti, ("--range", "0:256")),
    "parquet": (_parquet, ()),
    "arrow": (_arrow, ("--keep", "label")),
    "hf-dataset": (_saved, ("--keep", "label")),
    "webdataset": (_webdataset, ("--keep", "cls")),
}


def _value(value) -> object:
    """An HDF5 value as JSON-able text."""
    if isinstance(value, h5py.Reference):
        return "reference"  # its address is where the object lies: the content is compared anyway
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O" or value.dtype.names:
            return [str(value.dtype), repr(value.tolist())]
        return [str(value.dtype), list(value.shape), hashlib.sha256(value.tobytes()).hexdigest()]
    if isinstance(value, np.generic):
        return [str(value.dtype), repr(value.item())]
    return repr(value)


def _hdf5_content(path: Path) -> str:
    """sha256 of an HDF5 file's content: every link, attribute (in order), dataset layout
    and value, but not the object headers' modification times."""
    described = []

    def attrs(obj):
        return [[key, str(obj.attrs.get_id(key).dtype), _value(obj.attrs[key])] for key in obj.attrs]

    with h5py.File(path, "r") as f:
        def visit(name: str, obj) -> None:
            link = f.get(name, getlink=True)
            entry = [name, type(link).__name__, attrs(obj)]
            if isinstance(obj, h5py.Dataset):
                entry += [str(obj.dtype), list(obj.shape), obj.chunks, obj.compression,
                          _value(obj.compression_opts), obj.shuffle, obj.fletcher32, obj.scaleoffset,
                          _value(obj.fillvalue), _value(obj[()]), obj.id.get_create_plist().get_layout()]
            elif isinstance(obj, h5py.Group):
                entry.append(list(obj))
            described.append(entry)

        described.append(["/", attrs(f), list(f)])
        f.visititems(visit)
    return hashlib.sha256(json.dumps(described, default=repr).encode()).hexdigest()


def _digest(path: Path) -> str:
    if path.suffix in HDF5_SUFFIXES:
        return "content:" + _hdf5_content(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _relative(text: str, tmp: Path) -> str:
    return text.replace(str(tmp), "<tmp>").replace(str(REPO), "<repo>")


def _manifest(path: Path, tmp: Path) -> dict:
    manifest = json.loads(path.read_text())
    del manifest["created"], manifest["tool"]["version"]
    for entry in manifest["outputs"]:
        file = Path(entry["path"])
        if file.suffix in HDF5_SUFFIXES:
            entry["sha256"] = _digest(file)
    return json.loads(_relative(json.dumps(manifest), tmp))


def _run(cli, case: str, tmp: Path, digits: np.ndarray) -> dict:
    make, options = CASES[case]
    (tmp / "in").mkdir()
    source = make(tmp / "in", digits)
    seed = tmp / "release.seed"
    seed.write_text(SEED + "\n")
    seed.chmod(0o600)
    out = tmp / "out"
    out.mkdir()
    destination = out / source.name
    result = cli("perturb", source, "--eps", "1", "--seed-file", seed, "--out", destination, *options)
    assert result.exit_code == 0, result.stderr
    files = [destination] if destination.is_file() else sorted(p for p in destination.rglob("*") if p.is_file())
    manifest = _manifest(Path(f"{destination}.manifest.json"), tmp)
    return {
        "outputs": {str(f.relative_to(out)): _digest(f) for f in files},
        "manifest": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(),
        "messages": hashlib.sha256(_relative(result.stderr, tmp).encode()).hexdigest(),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_run_matches_golden(cli, tmp_path, digits, case):
    found = _run(cli, case, tmp_path, digits)
    if os.environ.get("TLDP_GOLDEN_UPDATE"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[case] = found
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
        pytest.skip(f"golden hashes of {case} written to {GOLDEN.name}")
    golden = json.loads(GOLDEN.read_text())
    assert found == golden[case], f"{case}: the seeded run's output, manifest or messages changed"


def test_every_case_has_golden_hashes():
    assert sorted(json.loads(GOLDEN.read_text())) == sorted(CASES)
