"""Round trips as properties, format by format: Hypothesis draws small inputs (shapes,
dtypes, trees, attributes and metadata) that the library people use writes (NumPy, h5py,
zarr-python, safetensors, Pillow, nibabel, pyarrow, datasets, webdataset,
huggingface_hub), `tldp perturb` runs on them with a fixed seed, and the library reads
the output back: the same structure (names, shapes, dtypes by the format's rule,
attributes and metadata), whatever the values. What a run leaves out must be what the
manifest lists under `dropped`; with --keep '*' nothing is left out and what is not
perturbed comes through with the same values. The input is never touched.

Every registered format has a case here (test_every_registered_format_has_a_property_case).
Few examples (TLDP_HYPOTHESIS_EXAMPLES raises the number) and no deadline (each runs the
CLI in-process), derandomized: a run of the suite is repeatable.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

import h5py
import numpy as np
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.builders import SEED, Cli, read_sharded_model, tree_digest, write_sharded_model
from tldp_cli import formats

EXAMPLES = int(os.environ.get("TLDP_HYPOTHESIS_EXAMPLES", "12"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FEWER = settings(PROPERTY, max_examples=max(1, EXAMPLES // 2))  # a folder of files per example

CLI = Cli()

# Names no reader gives a meaning to (not CF, not netCDF's or xarray's bookkeeping): "u_" first.
names = st.text("abcdefgh", min_size=1, max_size=4).map(lambda s: "u_" + s)
attribute_values = st.one_of(
    st.integers(-1000, 1000), st.floats(-1e6, 1e6, allow_nan=False, width=32), st.booleans(),
    st.text("abcdefghijklmnop xyzäé€", max_size=12),
    st.lists(st.integers(-100, 100), min_size=1, max_size=4).map(lambda v: np.array(v, dtype=np.int32)),
    st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=3).map(lambda v: np.array(v, dtype=np.float64)))
attributes = st.dictionaries(names, attribute_values, max_size=3)


def records(draw_dims=2) -> st.SearchStrategy[tuple[int, ...]]:
    """A record's shape: up to `draw_dims` axes of 1 to 4."""
    return st.lists(st.integers(1, 4), min_size=1, max_size=draw_dims).map(tuple)


def values(draw, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values in the range the run declares: 0:1 for floats, the dtype's for integers."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.uniform(0, 1, shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, int(info.max) + 1, shape).astype(dtype)


def workdir(tmp_path: Path) -> Path:
    """A folder of its own for each example (tmp_path is one for all; the manifests left in
    it are checked against the schema when the test ends)."""
    return Path(tempfile.mkdtemp(dir=tmp_path))


def perturbed(src: Path, out: Path, *args) -> dict:
    """`tldp perturb` with a fixed seed: succeeds, leaves the input as it was; the manifest."""
    before = tree_digest(src)
    result = CLI("perturb", src, "--eps", "2", "--seed", SEED, "--out", out, "--json", *args)
    assert result.exit_code == 0, result.stderr
    assert tree_digest(src) == before, "the input was modified"
    return json.loads(result.stdout)


def key(name: str) -> str:
    """An array's or attribute's name as the manifest gives it, without the leading '/'."""
    return name.lstrip("/")


def listed(manifest: dict, section: str) -> set[str]:
    return {key(entry["name"]) for entry in manifest.get(section, [])}


def assert_same(a, b, where: str) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
    else:
        assert a == b, (where, a, b)


def assert_tree_kept(before: dict, after: dict, manifest: dict, keep_all: bool, perturbed_dtype) -> None:
    """`before`/`after`: {name: ("array", shape, dtype) | ("group",) | ("attribute", value)}
    by the manifest's names. What is missing from the output is exactly what the manifest
    drops (nothing with --keep '*'); arrays keep their shapes, the perturbed ones take
    perturbed_dtype(name, input dtype), the others keep their dtype; attributes their values."""
    dropped = listed(manifest, "dropped")
    # a dropped array's attributes go with it
    gone = {name for name in before if name in dropped or name.split("@")[0] in dropped}
    assert set(after) == set(before) - gone, (sorted(before), sorted(after), sorted(dropped))
    assert not (keep_all and dropped), dropped
    chosen = {key(entry["dataset"]) for entry in manifest["inputs"] if "dataset" in entry}
    for name, entry in after.items():
        if entry[0] == "array":
            _, shape, dtype = before[name]
            assert entry[1] == shape, name
            expected = perturbed_dtype(name, dtype) if name in chosen else dtype
            assert entry[2] == expected, (name, entry[2], expected)
        elif entry[0] == "attribute":
            assert_same(before[name][1], entry[1], name)
        else:
            assert entry == before[name], name


def run_dtype(manifest: dict):
    """The formats whose perturbed arrays share the run's output dtype (the manifest's)."""
    return lambda name, dtype: np.dtype(manifest["output_dtype"])


keep_modes = st.sampled_from([(), ("--keep", "*")])


# --------------------------------------------------------------------------- npy

@PROPERTY
@given(n=st.integers(1, 6), record=records(3), dtype=st.sampled_from(["uint8", "int8", "uint16", "int16",
       "<f4", ">f4", "<f8", ">f8"]), fortran=st.booleans(), data=st.data())
def test_npy(tmp_path, n, record, dtype, fortran, data):
    folder = workdir(tmp_path)
    x = values(data.draw, (n, *record), dtype)
    np.save(folder / "in.npy", np.asfortranarray(x) if fortran else x)
    float_range = ("--range", "0:1") if np.dtype(dtype).kind == "f" else ()
    manifest = perturbed(folder / "in.npy", folder / "out.npy", *float_range)
    out = np.load(folder / "out.npy")
    assert out.shape == x.shape and out.dtype == np.dtype(manifest["output_dtype"])
    assert manifest["inputs"][0]["shape"] == list(x.shape) and np.dtype(manifest["inputs"][0]["dtype"]) == x.dtype


# --------------------------------------------------------------------------- HDF5, Zarr

@st.composite
def trees(draw):
    """Arrays sharing their first axis (all perturbed), one in a group, a 1-D one (not
    perturbed: dropped or kept), and attributes on the root, the group and the arrays."""
    n = draw(st.integers(1, 5))
    arrays = {}
    for name in draw(st.lists(st.sampled_from(["x", "g/y", "g/h/z", "g/a b", "é"]), min_size=1, max_size=3,
                              unique=True)):
        dtype = draw(st.sampled_from(["uint8", "int8", "int16", "uint16", "float32", "float64", ">f4", ">i2"]))
        arrays[name] = values(draw, (n, *draw(records())), dtype)
    if draw(st.booleans()):
        arrays["labels"] = np.arange(n, dtype=np.int64)
    groups = sorted({name.rsplit("/", 1)[0] for name in arrays if "/" in name} |
                    {"g" for name in arrays if name.startswith("g/h")})
    attrs = {node: draw(attributes) for node in ["", *groups, *arrays]}
    return arrays, groups, attrs


def ranges(arrays: dict) -> list[str]:
    return [arg for name, x in arrays.items() if x.dtype.kind == "f" for arg in ("--range", f"{name}=0:1")]


def _described(kind_of) -> dict:
    return {key(name): entry for name, entry in kind_of.items()}


def hdf5_tree(path: Path) -> dict:
    tree = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            tree[name] = ("array", obj.shape, obj.dtype) if isinstance(obj, h5py.Dataset) else ("group",)
            tree.update({f"{name}@{a}": ("attribute", v) for a, v in obj.attrs.items()})
        f.visititems(visit)
        tree.update({f"@{a}": ("attribute", v) for a, v in f.attrs.items()})
    return tree


@PROPERTY
@given(tree=trees(), keep=keep_modes, chunked=st.booleans())
def test_hdf5(tmp_path, tree, keep, chunked):
    arrays, groups, attrs = tree
    folder = workdir(tmp_path)
    with h5py.File(folder / "in.h5", "w") as f:
        for group in groups:
            f.require_group(group)
        for name, x in arrays.items():
            f.create_dataset(name, data=x, **({"chunks": True, "compression": "gzip"} if chunked else {}))
        for node, a in attrs.items():
            f[node or "/"].attrs.update(a)
    manifest = perturbed(folder / "in.h5", folder / "out.h5", *ranges(arrays), *keep)
    assert_tree_kept(hdf5_tree(folder / "in.h5"), hdf5_tree(folder / "out.h5"), manifest, bool(keep),
                     run_dtype(manifest))


def zarr_tree(path: Path) -> dict:
    tree = {}
    root = zarr.open_group(str(path), mode="r")

    def visit(group, prefix):
        for name, member in group.members():
            full = f"{prefix}{name}"
            if isinstance(member, zarr.Array):
                tree[full] = ("array", member.shape, member.dtype)
            else:
                tree[full] = ("group",)
                visit(member, full + "/")
            tree.update({f"{full}@{a}": ("attribute", v) for a, v in member.attrs.asdict().items()})
    visit(root, "")
    tree.update({f"@{a}": ("attribute", v) for a, v in root.attrs.asdict().items()})
    return tree


def _json_value(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


@PROPERTY
@given(tree=trees(), keep=keep_modes, zarr_format=st.sampled_from([2, 3]), data=st.data())
def test_zarr(tmp_path, tree, keep, zarr_format, data):
    arrays, groups, attrs = tree
    folder = workdir(tmp_path)
    root = zarr.open_group(str(folder / "in.zarr"), mode="w", zarr_format=zarr_format)
    for group in groups:
        root.require_group(group)
    for name, x in arrays.items():
        chunks = (data.draw(st.integers(1, len(x)), label=f"{name} chunk"), *x.shape[1:])
        root.create_array(name, shape=x.shape, dtype=x.dtype, chunks=chunks)[...] = x
    for node, a in attrs.items():
        (root[node] if node else root).attrs.update({k: _json_value(v) for k, v in a.items()})
    manifest = perturbed(folder / "in.zarr", folder / "out.zarr", *ranges(arrays), *keep)
    assert zarr.open_group(str(folder / "out.zarr"), mode="r").metadata.zarr_format == zarr_format
    assert_tree_kept(zarr_tree(folder / "in.zarr"), zarr_tree(folder / "out.zarr"), manifest, bool(keep),
                     run_dtype(manifest))


# --------------------------------------------------------------------------- model files

MODEL_ARGS = ("--clip", "0.5", "--allow-raw-release")
tensor_names = st.lists(st.sampled_from(["w", "layer.0.weight", "layer.0.bias", "head", "step", "enc/emb", "ü"]),
                        min_size=1, max_size=4, unique=True)


@st.composite
def tensors(draw, dtypes=("float32", "float64", "float16", ">f4", "int64", "bool")):
    """Named tensors of any shape (a scalar too): floats are perturbed, the others copied."""
    found = {}
    for name in draw(tensor_names):
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
        # the first a float: a model file without one is refused (nothing to perturb)
        dtype = np.dtype(draw(st.sampled_from([d for d in dtypes if not found and np.dtype(d).kind == "f"]
                                              or dtypes)))
        found[name] = np.asarray(values(draw, shape, "float32") - 0.5, dtype) if dtype.kind == "f" else \
            np.random.default_rng(len(found)).integers(0, 2, shape).astype(dtype)
    return found


def model_tree(arrays: dict[str, np.ndarray], metadata: dict | None = None) -> dict:
    tree = {name: ("array", x.shape, x.dtype) for name, x in arrays.items()}
    return tree | {f"@{k}": ("attribute", v) for k, v in (metadata or {}).items()}


def kept_dtype(name, dtype):
    return dtype


@PROPERTY
@given(arrays=tensors(), compressed=st.booleans())
def test_npz(tmp_path, arrays, compressed):
    folder = workdir(tmp_path)
    (np.savez_compressed if compressed else np.savez)(folder / "in.npz", **arrays)
    manifest = perturbed(folder / "in.npz", folder / "out.npz", *MODEL_ARGS)
    with np.load(folder / "in.npz") as a, np.load(folder / "out.npz") as b:
        assert list(b.keys()) == list(a.keys())  # the members, in their order
        before, after = model_tree(dict(a)), model_tree(dict(b))
    assert_tree_kept(before, after, manifest, False, kept_dtype)


def safetensors_tree(path: Path) -> dict:
    with safe_open(str(path), framework="np") as f:
        return model_tree({name: f.get_tensor(name) for name in f.keys()}, f.metadata())


@PROPERTY
@given(arrays=tensors(("float32", "float64", "float16", "int64", "bool")),
       metadata=st.dictionaries(names, st.text("abcxyz äé€\n", max_size=8), max_size=3), keep=keep_modes)
def test_safetensors(tmp_path, arrays, metadata, keep):
    folder = workdir(tmp_path)
    save_file(arrays, str(folder / "in.safetensors"), metadata={"format": "pt", **metadata})
    manifest = perturbed(folder / "in.safetensors", folder / "out.safetensors", *MODEL_ARGS, *keep)
    assert_tree_kept(safetensors_tree(folder / "in.safetensors"), safetensors_tree(folder / "out.safetensors"),
                     manifest, bool(keep), kept_dtype)


@FEWER
@given(arrays=tensors(("float32", "float16", "int64")), shard_bytes=st.integers(8, 64))
def test_sharded_safetensors(tmp_path, arrays, shard_bytes):
    if sum(x.nbytes for x in arrays.values()) <= shard_bytes or len(arrays) < 2:
        arrays = {**arrays, "extra.a": np.ones((4, 4), np.float32), "extra.b": np.ones(8, np.float32)}
    folder = workdir(tmp_path)
    write_sharded_model(folder / "in", arrays, max_shard_size=shard_bytes)
    manifest = perturbed(folder / "in", folder / "out", *MODEL_ARGS)
    before, after = read_sharded_model(folder / "in"), read_sharded_model(folder / "out")
    assert sorted(p.name for p in (folder / "out").iterdir()) == sorted(p.name for p in (folder / "in").iterdir())
    index = json.loads((folder / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((folder / "in" / "model.safetensors.index.json").read_text())["weight_map"]
    assert_tree_kept(model_tree(before), model_tree(after), manifest, False, kept_dtype)


# --------------------------------------------------------------------------- images, NIfTI

MODES = {"L": (), "RGB": (3,), "RGBA": (4,), "LA": (2,), "I;16": ()}


@st.composite
def pictures(draw) -> Image.Image:
    mode = draw(st.sampled_from(list(MODES)))
    size = (draw(st.integers(1, 7)), draw(st.integers(1, 7)))  # (height, width)
    if mode == "I;16":
        return Image.fromarray(values(draw, size, "uint16"))  # Pillow: mode I;16
    return Image.fromarray(values(draw, (*size, *MODES[mode]), "uint8"), mode)


def image_tree(root: Path) -> dict:
    tree = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".json")):
        with Image.open(path) as image:
            tree[path.relative_to(root).as_posix()] = (image.format, image.mode, image.size)
    return tree


@PROPERTY
@given(files=st.dictionaries(st.sampled_from(["a.png", "b.png", "sub/c.png", "sub/deeper/d.png", "e.tif"]),
                             pictures(), min_size=1, max_size=4))
def test_images(tmp_path, files):
    folder = workdir(tmp_path)
    for name, image in files.items():
        (folder / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        image.save(folder / "in" / name)
    perturbed(folder / "in", folder / "out")
    # every image comes out as PNG under its path, in its mode (bit depth) without alpha, and size
    opaque = {"RGBA": "RGB", "LA": "L"}  # the alpha channel is left out (unless --keep alpha)
    assert image_tree(folder / "out") == {str(Path(name).with_suffix(".png")): ("PNG", opaque.get(mode, mode), size)
                                          for name, (_, mode, size) in image_tree(folder / "in").items()}


@PROPERTY
@given(shape=st.lists(st.integers(1, 4), min_size=3, max_size=4).map(tuple),
       dtype=st.sampled_from(["uint8", "int16", "float32"]), zooms=st.lists(st.sampled_from([0.5, 1.0, 2.5]),
       min_size=4, max_size=4), gz=st.booleans(), data=st.data())
def test_nifti(tmp_path, shape, dtype, zooms, gz, data):
    import nibabel as nib

    folder = workdir(tmp_path)
    affine = np.diag([*zooms[:3], 1.0])
    affine[:3, 3] = data.draw(st.lists(st.integers(-90, 90), min_size=3, max_size=3), label="origin")
    img = nib.Nifti1Image(values(data.draw, shape, dtype), affine)
    img.set_data_dtype(np.dtype(dtype))
    img.header.set_zooms(tuple(zooms[:len(shape)]))
    img.header.set_xyzt_units("mm", "sec")
    suffix = ".nii.gz" if gz else ".nii"
    nib.save(img, folder / f"in{suffix}")
    float_range = ("--range", "0:1") if dtype == "float32" else ()
    perturbed(folder / f"in{suffix}", folder / f"out{suffix}", *float_range)
    a, b = nib.load(folder / f"in{suffix}"), nib.load(folder / f"out{suffix}")
    assert b.shape == a.shape and np.array_equal(b.affine, a.affine)
    assert b.header.get_zooms() == a.header.get_zooms() and b.header.get_xyzt_units() == ("mm", "sec")
    assert np.asarray(b.dataobj).shape == shape


# --------------------------------------------------------------------------- tables

@st.composite
def tables(draw):
    """Tensor columns (lists of numbers, one shape per row), a label and a text column,
    schema metadata; the table's rows cut into row groups (record batches) anywhere."""
    import pyarrow as pa

    n = draw(st.integers(1, 6))
    columns, ranges_ = {}, []
    for name in draw(st.lists(st.sampled_from(["t0", "t1", "t2"]), min_size=1, max_size=2, unique=True)):
        dtype = draw(st.sampled_from(["float32", "float64", "int16", "uint8"]))
        x = values(draw, (n, draw(st.integers(1, 4))), dtype)
        columns[name] = pa.array(list(x), type=pa.list_(pa.from_numpy_dtype(x.dtype)))
        ranges_ += ["--range", f"{name}=0:1"] if x.dtype.kind == "f" else []
    if draw(st.booleans()):
        columns["label"] = pa.array(range(n), pa.int64())
    if draw(st.booleans()):
        columns["caption"] = pa.array([f"row {i}" for i in range(n)])
    metadata = draw(st.dictionaries(names, st.text("abc", max_size=4), max_size=2))
    table = pa.table(columns).replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()} or None)
    return table, ranges_, draw(st.integers(1, n))


def table_tree(schema, sizes: list[int]) -> dict:
    tree = {name: ("array", (), schema.field(name).type) for name in schema.names}
    tree |= {f"@{k.decode()}": ("attribute", v) for k, v in (schema.metadata or {}).items()}
    return tree | {"": ("group", tuple(sizes))}


def table_dtype(name, dtype):
    return dtype  # a column keeps its type (numbers rounded and clipped back into it)


@PROPERTY
@given(table=tables(), keep=keep_modes)
def test_parquet(tmp_path, table, keep):
    import pyarrow.parquet as pq

    table, ranges_, group = table
    folder = workdir(tmp_path)
    pq.write_table(table, folder / "in.parquet", row_group_size=group)

    def tree(path):
        f = pq.ParquetFile(path)
        return table_tree(f.schema_arrow, [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)])
    manifest = perturbed(folder / "in.parquet", folder / "out.parquet", *ranges_, *keep)
    assert_tree_kept(tree(folder / "in.parquet"), tree(folder / "out.parquet"), manifest, bool(keep), table_dtype)


@PROPERTY
@given(table=tables(), keep=keep_modes, stream=st.booleans())
def test_arrow(tmp_path, table, keep, stream):
    import pyarrow as pa

    table, ranges_, batch = table
    folder = workdir(tmp_path)
    with pa.OSFile(str(folder / "in.arrow"), "wb") as sink, \
            (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema) as writer:
        for part in table.to_batches(max_chunksize=batch):
            writer.write_batch(part)

    def tree(path):
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source) if stream else pa.ipc.open_file(source)
            batches = list(reader) if stream else [reader.get_batch(i) for i in range(reader.num_record_batches)]
            return table_tree(reader.schema, [b.num_rows for b in batches])
    manifest = perturbed(folder / "in.arrow", folder / "out.arrow", *ranges_, *keep)
    assert_tree_kept(tree(folder / "in.arrow"), tree(folder / "out.arrow"), manifest, bool(keep), table_dtype)


@FEWER
@given(table=tables(), shards=st.integers(1, 2))
def test_hf_dataset(tmp_path, table, shards):
    import datasets

    table, ranges_, _ = table
    folder = workdir(tmp_path)
    dataset = datasets.Dataset(table.replace_schema_metadata(None))
    dataset.save_to_disk(str(folder / "in"), num_shards=min(shards, len(dataset)))
    manifest = perturbed(folder / "in", folder / "out", *ranges_)
    a, b = datasets.load_from_disk(str(folder / "in")), datasets.load_from_disk(str(folder / "out"))
    assert sorted(p.name for p in (folder / "out").iterdir()) == sorted(p.name for p in (folder / "in").iterdir())
    assert len(b) == len(a)
    features = {name: ("array", (), feature) for name, feature in a.features.items()}
    assert_tree_kept(features, {name: ("array", (), feature) for name, feature in b.features.items()},
                     manifest, False, table_dtype)


# --------------------------------------------------------------------------- WebDataset

@st.composite
def samples(draw):
    """Samples of one or two shards: an image, maybe a .npy array and a class label."""
    found = []
    for i in range(draw(st.integers(1, 4))):
        sample = {"__key__": f"s{i}", draw(st.sampled_from(["png", "jpg"])): draw(pictures()).convert("RGB")}
        if draw(st.booleans()):
            sample["depth.npy"] = values(draw, (draw(st.integers(1, 3)), 2), "uint8")
        if draw(st.booleans()):
            sample["cls"] = i % 3
        found.append(sample)
    return found, draw(st.integers(1, len(found)))


def shard_tree(folder: Path) -> dict:
    tree = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                name = f"{shard.name}/{member.name}"
                raw = tar.extractfile(member).read()
                if member.name.endswith((".png", ".jpg")):
                    with Image.open(io.BytesIO(raw)) as image:
                        tree[name] = ("group", image.mode, image.size)
                elif member.name.endswith(".npy"):
                    tree[name] = ("group", np.load(io.BytesIO(raw)).shape)
                else:
                    tree[name] = ("group",)
    return tree


@PROPERTY
@given(drawn=samples(), keep=st.sampled_from([(), ("--keep", "cls")]))
def test_webdataset(tmp_path, drawn, keep):
    import webdataset as wds

    found, per_shard = drawn
    keep = keep if any("cls" in sample for sample in found) else ()  # a --keep matching nothing: exit 2
    folder = workdir(tmp_path)
    (folder / "in").mkdir()
    for start in range(0, len(found), per_shard):
        with wds.TarWriter(str(folder / "in" / f"part-{start:04d}.tar"), mtime=1_700_000_000) as sink:
            for sample in found[start:start + per_shard]:
                sink.write(sample)
    manifest = perturbed(folder / "in", folder / "out", *keep)
    before = shard_tree(folder / "in")
    # images come out as KEY.png in their mode and size, arrays in their shape, in the same
    # shards; class labels only with --keep cls (else listed under dropped, by extension)
    expected = {(name.rsplit(".", 1)[0] + ".png" if name.endswith(".jpg") else name): entry
                for name, entry in before.items() if keep or not name.endswith(".cls")}
    assert shard_tree(folder / "out") == expected
    assert ("cls" in {entry["name"] for entry in manifest.get("dropped", [])}) == \
        (not keep and any(name.endswith(".cls") for name in before))


def test_every_registered_format_has_a_property_case():
    cases = {name.removeprefix("test_").replace("_", "-") for name in globals() if name.startswith("test_")}
    assert set(formats.names()) <= cases, set(formats.names()) - cases
