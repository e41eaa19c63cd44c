"""Zarr stores, formats 2 and 3: round trips, sharding, selection, damaged stores."""

import json
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from tests.builders import RoundTrip, siblings, tree_digest
from tldp_cli.formats import FormatOptions, zarr_store
from tldp_cli.run.pipeline import PerturbOptions, perturb

# zarr warns that consolidated metadata is not part of the format 3 spec.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

IMAGES = np.random.default_rng(0).integers(0, 256, (40, 8, 8), dtype=np.uint8)
# What perturb writes for uint8 data: the default exact sampler keeps integers integer (widened).
PERTURBED = np.int16


def make_group(path: Path, zarr_format: int, consolidated: bool = True) -> Path:
    """A group with attributes: images (perturbed), labels (1-D), sub/small (1-D)."""
    group = zarr.open_group(path, mode="w", zarr_format=zarr_format,
                            attributes={"title": "digits", "version": 3})
    extra = {"dimension_names": ["n", "y", "x"]} if zarr_format == 3 else {}
    images = group.create_array(
        "images", shape=IMAGES.shape, dtype="uint8", chunks=(10, 8, 8), fill_value=7,
        compressors=ZstdCodec(level=3) if zarr_format == 3 else numcodecs.Blosc(cname="zstd"),
        attributes={"units": "intensity"}, **extra)
    images[:] = IMAGES
    labels = group.create_array("labels", shape=(40,), dtype="int64", chunks=(16,))
    labels[:] = np.arange(40) % 10
    sub = group.create_group("meta", attributes={"source": "test"})
    small = sub.create_array("scale", shape=(3,), dtype="float64", attributes={"k": [1, 2]})
    small[:] = [0.5, 1.5, 2.5]
    if consolidated:
        zarr.consolidate_metadata(path)
    return path


def nodes(path: Path) -> dict:
    return dict(zarr.open_group(path, mode="r", use_consolidated=False).members(max_depth=None))


def read_path(path: Path, name: str) -> np.ndarray:
    return zarr.open_array(path, path=name, mode="r")[:]


def fast_level(compressors):
    """The compressors with the level perturbed arrays are written at."""
    lowered = []
    for c in compressors:
        if isinstance(c, ZstdCodec):
            c = ZstdCodec(level=1, checksum=c.checksum)
        elif isinstance(c, numcodecs.Blosc):
            c = numcodecs.Blosc(cname=c.cname, clevel=1, shuffle=c.shuffle, blocksize=c.blocksize)
        lowered.append(c)
    return tuple(lowered)


class ZarrGroupRoundTrip(RoundTrip):
    format = "zarr"
    zarr_format = 3
    # Everything is kept (--keep '*'), so the copy of what is not perturbed is checked whole;
    # what is left out by default: tests/formats/test_leftovers.py.
    extra_args = ("--keep", "*")

    def make_input(self, tmp_path):
        return make_group(tmp_path / "data.zarr", self.zarr_format)

    def read_arrays(self, path):
        return {"images": read_path(path, "images")}

    def assert_same_structure(self, original, perturbed):
        a_group = zarr.open_group(original, mode="r", use_consolidated=False)
        b_group = zarr.open_group(perturbed, mode="r", use_consolidated=False)
        assert b_group.metadata.zarr_format == self.zarr_format
        assert dict(b_group.attrs) == dict(a_group.attrs)
        a_nodes, b_nodes = nodes(original), nodes(perturbed)
        assert a_nodes.keys() == b_nodes.keys()
        for name, a in a_nodes.items():
            b = b_nodes[name]
            assert type(a) is type(b) and dict(a.attrs) == dict(b.attrs), name
            if isinstance(a, zarr.Group):
                continue
            assert (a.shape, a.chunks, a.shards) == (b.shape, b.chunks, b.shards), name
            assert a.filters == b.filters, name
            if name == "images":  # the same compressor, at level 1 (codec_levels)
                assert b.compressors == fast_level(a.compressors) != a.compressors
            else:
                assert a.compressors == b.compressors, name
            if self.zarr_format == 3:
                assert a.metadata.dimension_names == b.metadata.dimension_names, name
            if name == "images":
                assert b.dtype == PERTURBED and b.fill_value == PERTURBED(a.fill_value)
            else:
                assert b.dtype == a.dtype and b.fill_value == a.fill_value, name
                np.testing.assert_array_equal(b[:], a[:])
        # The input was consolidated: the output is too, and describes the new dtype.
        consolidated = zarr.open_consolidated(perturbed, mode="r", zarr_format=self.zarr_format)
        assert consolidated["images"].dtype == PERTURBED


class ZarrV3RoundTrip(ZarrGroupRoundTrip):
    zarr_format = 3


class ZarrV2RoundTrip(ZarrGroupRoundTrip):
    zarr_format = 2


def perturb_ok(cli, *args):
    # Records of 4 uint8 values keep raw values with probability above dp_delta at --eps 1, which
    # needs consent (tests/privacy/test_raw_release.py); these tests are about selecting and copying arrays.
    result = cli("perturb", *args, "--eps", "1", "--seed", "7", "--allow-weak-seed", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    return result


def assert_one_line_failure(result, exit_code, *words):
    assert result.exit_code == exit_code, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    for word in words:
        assert word in result.stderr


def test_sharded_output_keeps_shards_and_matches_any_chunking(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, (40, 64, 64), dtype=np.uint8)
    layouts = {"sharded": {"chunks": (10, 64, 64), "shards": (20, 64, 64)},
               "rechunked": {"chunks": (7, 32, 64)}}
    outputs = {}
    for name, layout in layouts.items():
        src = tmp_path / f"{name}.zarr"
        array = zarr.create_array(src, shape=images.shape, dtype="uint8", zarr_format=3,
                                  compressors=BloscCodec(cname="zstd"), **layout)
        array[:] = images
        # Small blocks, so the pipeline splits the two layouts differently (20 vs 7 records).
        perturb(PerturbOptions(input=src, eps=1.0, seed=7, allow_weak_seed=True,
                               out=tmp_path / f"{name}.out.zarr", block_elements=8 * 64 * 64))
        out = zarr.open_array(tmp_path / f"{name}.out.zarr", mode="r")
        assert (out.chunks, out.shards) == (array.chunks, array.shards)
        (blosc,) = out.compressors  # the input's, at level 1 (codec_levels)
        assert (blosc.cname.value, blosc.clevel, out.dtype) == ("zstd", 1, PERTURBED)
        outputs[name] = out[:]
    assert not np.array_equal(outputs["sharded"], images)
    np.testing.assert_array_equal(outputs["sharded"], outputs["rechunked"])


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_lone_array_saved_by_zarr_save_is_perturbed_planned_and_evaluated(cli, tmp_path, zarr_format):
    """zarr.save(path, array): a store that is one array at its root, named "/" (no group).
    perturb writes a store zarr.open reads as that array, plan and evaluate read it; a 1-D
    lone array is perturbed too (the store's only array: a batch of scalar records)."""
    src, flat = tmp_path / "x.zarr", tmp_path / "flat.zarr"
    zarr.save(src, IMAGES, zarr_format=zarr_format)
    zarr.save(flat, IMAGES[:, 0, 0].copy(), zarr_format=zarr_format)
    plan = cli("plan", src, "--eps", "1", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert [(i["dataset"], i["shape"]) for i in json.loads(plan.stdout)["inputs"]] == [("/", [40, 8, 8])]
    for store in (src, flat):
        result = cli("perturb", store, "--eps", "1", "--range", "/=0:256", "--out", tmp_path / f"o.{store.name}")
        assert result.exit_code == 0, result.stderr
        out = zarr.open(tmp_path / f"o.{store.name}", mode="r")
        assert isinstance(out, zarr.Array) and out.metadata.zarr_format == zarr_format
        raw = zarr.open(store, mode="r")[...]
        assert out.shape == raw.shape and out.dtype == PERTURBED and not np.array_equal(out[...], raw)
        checked = cli("evaluate", store, tmp_path / f"o.{store.name}")
        assert checked.exit_code == 0 and "every check passed" in checked.stderr, checked.stderr


def test_writer_handles_blocks_that_straddle_chunks_and_shards(tmp_path):
    src = tmp_path / "sharded.zarr"
    zarr.create_array(src, shape=(40, 4), dtype="int32", chunks=(5, 4), shards=(10, 4),
                      zarr_format=3)[:] = np.arange(160).reshape(40, 4)
    reader = zarr_store.open_reader(src, FormatOptions())
    [job] = reader.arrays()
    assert job.chunk_records == 10 and job.name == "/" and job.source["dataset"] == "/"
    writer = zarr_store.create_writer(reader, tmp_path / "out", np.dtype("float64"), FormatOptions())
    for start in range(0, 40, 3):
        block = job.read(start, min(start + 3, 40))
        writer.write(job, start, block.astype(np.float64) + 0.5)
    files = writer.close()
    reader.close()
    assert {f.relative_to(tmp_path / "out").as_posix() for f in files} == {
        "zarr.json", "c/0/0", "c/1/0", "c/2/0", "c/3/0"}
    out = zarr.open_array(tmp_path / "out", mode="r")
    np.testing.assert_array_equal(out[:], np.arange(160).reshape(40, 4) + 0.5)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_single_array_store(cli, tmp_path, zarr_format):
    src = tmp_path / "features.zarr"
    values = np.arange(90, dtype=np.int16).reshape(30, 3)
    zarr.create_array(src, shape=values.shape, dtype="int16", chunks=(10, 3), fill_value=-1,
                      attributes={"note": "x"}, zarr_format=zarr_format)[:] = values
    before = tree_digest(src)
    result = perturb_ok(cli, src, "--json")
    assert tree_digest(src) == before
    out = zarr.open_array(tmp_path / "features.tldp.zarr", mode="r")
    assert out.metadata.zarr_format == zarr_format
    # int16 data: integer noise, widened to int32 (the default exact sampler)
    assert out.dtype == np.int32 and out.fill_value == -1 and out.chunks == (10, 3)
    assert dict(out.attrs) == {} and out.shape == values.shape  # "note": free text, left out
    manifest = json.loads(result.stdout)
    assert manifest["inputs"][0]["dataset"] == "/"
    assert [d["name"] for d in manifest["dropped"]] == ["/@note"]


def metadata_json(path: Path, zarr_format: int) -> dict:
    return json.loads((path / ("zarr.json" if zarr_format == 3 else ".zarray")).read_text())


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype, fill_value", [("uint8", 7), ("int16", -1), ("float32", np.nan),
                                               ("float64", 0.5)])
def test_fill_value_is_written_as_zarr_python_writes_it(tmp_path, zarr_format, dtype, fill_value):
    """An integer array's fill value is a JSON integer (the Zarr 3 spec allows no fraction;
    strict readers such as tensorstore refuse 7.0), a float's a number or "NaN"."""
    src = tmp_path / "in.zarr"
    zarr.create_array(src, shape=(20, 4), dtype=dtype, chunks=(10, 4), fill_value=fill_value,
                      zarr_format=zarr_format)[:] = np.arange(80).reshape(20, 4) % 50
    out = tmp_path / "out.zarr"
    bounds = {} if np.dtype(dtype).kind in "iu" else {"value_range": (0.0, 50.0)}
    perturb(PerturbOptions(input=src, eps=1.0, seed=7, allow_weak_seed=True, out=out, **bounds))
    written = metadata_json(out, zarr_format)["fill_value"]
    output_dtype = zarr.open_array(out, mode="r").dtype
    reference = tmp_path / "reference.zarr"  # zarr-python's own writing of that dtype and fill
    zarr.create_array(reference, shape=(20, 4), dtype=output_dtype, chunks=(10, 4),
                      fill_value=fill_value, zarr_format=zarr_format)
    expected = metadata_json(reference, zarr_format)["fill_value"]
    assert type(written) is type(expected) and json.dumps(written) == json.dumps(expected)


def make_two(path: Path, rows_b: int) -> Path:
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("a", shape=(10, 4), dtype="uint8")[:] = 1
    group.create_group("g").create_array("b", shape=(rows_b, 4), dtype="uint8")[:] = 2
    return path


def test_default_selection_takes_arrays_with_the_same_records(cli, tmp_path):
    src = make_two(tmp_path / "two.zarr", rows_b=10)
    result = perturb_ok(cli, src)
    assert "perturbing arrays a, g/b of two.zarr (choose with --dataset)" in result.stderr
    out = tmp_path / "two.tldp.zarr"
    assert read_path(out, "a").dtype == PERTURBED and read_path(out, "g/b").dtype == PERTURBED


def test_ambiguous_selection_is_a_usage_error(cli, tmp_path):
    src = make_two(tmp_path / "two.zarr", rows_b=12)
    before = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_failure(result, 2, "--dataset", "a (10, 4)", "g/b (12, 4)")
    assert siblings(tmp_path) == before


@pytest.mark.parametrize("spelling", ["g/b", "/g/b"])
def test_dataset_chooses_and_the_rest_is_dropped_or_kept(cli, tmp_path, spelling):
    src = make_two(tmp_path / "two.zarr", rows_b=12)
    perturb_ok(cli, src, "--dataset", spelling)
    out = tmp_path / "two.tldp.zarr"
    assert read_path(out, "g/b").dtype == PERTURBED
    assert not (out / "a").exists()  # not chosen: left out
    perturb_ok(cli, src, "--dataset", spelling, "--keep", "a", "--out", tmp_path / "kept.zarr")
    a = zarr.open_array(tmp_path / "kept.zarr", path="a", mode="r")
    assert a.dtype == np.uint8 and (a[:] == 1).all()
    assert tree_digest(tmp_path / "kept.zarr" / "a") == tree_digest(src / "a")


@pytest.mark.parametrize("dataset, words", [("nope", ["nope", "does not exist"]),
                                            ("g", ["g is a group"])])
def test_dataset_that_is_not_an_array(cli, tmp_path, dataset, words):
    src = make_two(tmp_path / "two.zarr", rows_b=12)
    before = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1", "--dataset", dataset)
    assert_one_line_failure(result, 1, str(src), *words)
    assert siblings(tmp_path) == before


def _corrupt_root(src):
    (src / "zarr.json").write_text("{not json")


def _drop_array_metadata(src):
    (src / "images" / "zarr.json").unlink()


def _bad_array_metadata(src):
    (src / "images" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "array"}')


@pytest.mark.parametrize("damage", [_corrupt_root, _drop_array_metadata, _bad_array_metadata])
def test_damaged_group_store(cli, tmp_path, damage):
    src = make_group(tmp_path / "data.zarr", 3, consolidated=False)
    damage(src)
    before, files = siblings(tmp_path), tree_digest(src)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_failure(result, 1, str(src), "damaged Zarr store")
    assert siblings(tmp_path) == before and tree_digest(src) == files


DEEP = "[" * 200_000 + "]" * 200_000  # issue 27, item 13: json.loads raised RecursionError


def _nest_deeply(file: Path, key: str = "deep") -> None:
    """Puts DEEP into the JSON object of `file` (zarr-python wrote it) under `key`."""
    text = file.read_text().rstrip()
    assert text.endswith("}")
    file.write_text(text[:-1] + f', "{key}": {DEEP}}}')


@pytest.mark.parametrize("zarr_format, meta", [(3, "zarr.json"), (3, "images/zarr.json"), (2, ".zgroup"),
                                               (2, "images/.zarray"), (2, "images/.zattrs"),
                                               (2, "meta/.zattrs")])
def test_deeply_nested_metadata_is_refused_naming_its_file(cli, tmp_path, zarr_format, meta):
    """200,000 nested lists in Zarr metadata reached RecursionError (our own json.loads), or
    zarr-python's in .zattrs, and "unexpected error": refused before zarr-python reads it,
    as JSON it does not read, naming the file."""
    src = make_group(tmp_path / "data.zarr", zarr_format, consolidated=False)
    _nest_deeply(src / meta)
    before, files = siblings(tmp_path), tree_digest(src)
    assert_one_line_failure(cli("perturb", src, "--eps", "1"), 1,
                            f"{src}: damaged Zarr store: {meta} is not valid JSON (it nests lists and "
                            "objects more than 100 levels deep")
    assert siblings(tmp_path) == before and tree_digest(src) == files


@pytest.mark.parametrize("zarr_format, meta", [(2, ".zgroup"), (3, "zarr.json")])
def test_group_without_root_metadata_is_refused(cli, tmp_path, zarr_format, meta):
    src = make_group(tmp_path / "data.zarr", zarr_format, consolidated=False)
    (src / meta).unlink()
    # A format 2 group keeps its .zattrs and is reported as a damaged store. A format 3
    # group keeps nothing at its root and looks like a folder of stores, so it is not
    # claimed as Zarr; whichever module answers must still fail cleanly.
    assert zarr_store.can_open(src) == (zarr_format == 2)
    before, files = siblings(tmp_path), tree_digest(src)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_failure(result, 1, str(src))
    assert siblings(tmp_path) == before and tree_digest(src) == files


@pytest.mark.parametrize("zarr_format, meta", [(2, ".zarray"), (3, "zarr.json")])
def test_array_store_without_metadata(cli, tmp_path, zarr_format, meta):
    src = tmp_path / "lost.zarr"
    zarr.create_array(src, shape=(20, 4), dtype="uint8", chunks=(5, 4),
                      zarr_format=zarr_format)[:] = 3
    (src / meta).unlink()
    # Format 2 keeps .zattrs, which is metadata; chunks alone are not claimed as Zarr (folders
    # named 0..9 hold images), and the image reader names the damage.
    assert zarr_store.can_open(src) == (zarr_format == 2)
    before, files = siblings(tmp_path), tree_digest(src)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_failure(result, 1, str(src), "damaged Zarr store")
    assert siblings(tmp_path) == before and tree_digest(src) == files


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_delta_filter_is_kept_for_the_output_dtype(cli, tmp_path, zarr_format):
    """Regression: a Delta filter (lossless, a usual one for integer series) refused the run,
    "uses the delta filter for |u1 data, which cannot apply to the int16 output", as any
    uint8 array's output is int16. It is kept, set to the output dtype: the noisy values are
    stored exactly, the same as written without the filter."""
    import warnings

    from numcodecs import zarr3

    values = np.random.default_rng(4).integers(0, 256, (20, 4), dtype=np.uint8)
    arrays = {}
    for name, delta in (("delta", True), ("plain", False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "numcodecs codecs are not in the Zarr version 3 spec"
            filters = ([numcodecs.Delta(dtype="u1")] if zarr_format == 2 else [zarr3.Delta(dtype="u1")]) if delta else None
            zarr.create_array(tmp_path / f"{name}.zarr", shape=values.shape, dtype="uint8", chunks=(5, 4),
                              zarr_format=zarr_format, filters=filters)[:] = values
        out = tmp_path / f"{name}.out.zarr"
        result = cli("perturb", tmp_path / f"{name}.zarr", "--out", out, "--eps", "1", "--seed", "7",
                     "--allow-weak-seed", "--allow-raw-release")
        assert result.exit_code == 0, result.stderr
        arrays[name] = zarr.open_array(out, mode="r")
    assert arrays["delta"].dtype == np.int16
    np.testing.assert_array_equal(arrays["delta"][:], arrays["plain"][:])
    meta = arrays["delta"].metadata.to_dict()
    configs = meta["filters"] if zarr_format == 2 else [c.get("configuration", {}) for c in meta["codecs"]]
    assert any(np.dtype(c.get("dtype", "u1")) == np.int16 for c in configs if c and "dtype" in c)
    assert cli("evaluate", tmp_path / "delta.zarr", tmp_path / "delta.out.zarr").exit_code == 0


def test_a_narrowing_delta_filter_is_refused(cli, tmp_path):
    """A delta storing its differences in a narrower type (astype) can wrap: not carried over."""
    src = tmp_path / "delta.zarr"
    zarr.create_array(src, shape=(20, 4), dtype="uint8", chunks=(5, 4), zarr_format=2,
                      filters=[numcodecs.Delta(dtype="u1", astype="i1")])[:] = 3
    before = siblings(tmp_path)
    result = cli("perturb", src, "--eps", "1", "--allow-raw-release")
    assert_one_line_failure(result, 1, str(src), "delta")
    assert siblings(tmp_path) == before


def test_can_open_and_default_output(tmp_path):
    assert not zarr_store.can_open(tmp_path)
    (tmp_path / "photo.png").write_bytes(b"")
    assert not zarr_store.can_open(tmp_path)
    assert not zarr_store.can_open(tmp_path / "photo.png")
    assert zarr_store.default_output(Path("x/data.zarr")) == Path("x/data.tldp.zarr")
    assert zarr_store.default_output(Path("x/store")) == Path("x/store.tldp")


def test_compression_levels_are_lowered_and_recorded(cli, tmp_path):
    """Perturbed arrays keep their compressors at level 1 at most: noise compresses no
    better at higher levels. The manifest names each level changed; the output reads back."""
    src = tmp_path / "levels.zarr"
    group = zarr.open_group(src, mode="w", zarr_format=3)
    slow = group.create_array("slow", shape=IMAGES.shape, dtype="uint8", chunks=(10, 8, 8),
                              compressors=GzipCodec(level=6))
    slow[:] = IMAGES
    fast = group.create_array("fast", shape=(40, 4), dtype="uint8", chunks=(10, 4),
                              compressors=ZstdCodec(level=1))
    fast[:] = IMAGES[:, 0, :4]
    perturb_ok(cli, src, "--out", tmp_path / "o.zarr")
    manifest = json.loads((tmp_path / "o.zarr.manifest.json").read_text())
    assert manifest["codec_levels"] == {"slow": [{"codec": "gzip", "input_level": 6, "output_level": 1}]}
    out = zarr.open_group(tmp_path / "o.zarr", mode="r")
    assert out["slow"].compressors == (GzipCodec(level=1),)
    assert out["fast"].compressors == (ZstdCodec(level=1),)
    noisy = out["slow"][:]
    assert noisy.dtype == PERTURBED and not np.array_equal(noisy, IMAGES)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_fill_value_the_output_dtype_cannot_hold_is_its_least_value(tmp_path, zarr_format):
    """uint32's largest value as the fill of an int16 output used to wrap to -1, a value the
    noise takes; it saturates, as the missing-data markers do (cf.output_marker)."""
    src = tmp_path / "in.zarr"
    zarr.create_array(src, shape=(8, 4), dtype="uint32", chunks=(4, 4), fill_value=2**32 - 1,
                      zarr_format=zarr_format)[:] = np.arange(32).reshape(8, 4) % 50
    out = tmp_path / "out.zarr"
    perturb(PerturbOptions(input=src, eps=1.0, seed=7, allow_weak_seed=True, out=out,
                           value_range=(0.0, 100.0), allow_raw_release=True))
    assert zarr.open_array(out, mode="r").dtype == np.int16
    assert metadata_json(out, zarr_format)["fill_value"] == -32768


@pytest.mark.parametrize("shards", [None, (20, 8, 8)])
def test_blosc_shuffles_the_output_elements_not_the_inputs(tmp_path, shards):
    """Blosc's typesize (the element size its shuffle groups bytes by) follows the output
    dtype, as zarr-python sets it; it was the input's (1 for uint8 under an int16 output)."""
    src = tmp_path / "in.zarr"
    zarr.create_array(src, shape=IMAGES.shape, dtype="uint8", chunks=(10, 8, 8), shards=shards,
                      compressors=BloscCodec(cname="zstd", shuffle="shuffle"))[:] = IMAGES
    out = tmp_path / "out.zarr"
    perturb(PerturbOptions(input=src, eps=1.0, seed=7, allow_weak_seed=True, out=out,
                           allow_raw_release=True))
    codecs = metadata_json(out, 3)["codecs"]
    if shards:
        codecs = codecs[0]["configuration"]["codecs"]
    assert codecs[1]["name"] == "blosc" and codecs[1]["configuration"]["typesize"] == 2
    if not shards:  # each chunk file is a Blosc frame whose header states its typesize
        assert (out / "c" / "0" / "0" / "0").read_bytes()[3] == 2
    assert zarr.open_array(out, mode="r")[:].dtype == PERTURBED  # and zarr-python reads it back


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_copied_files_do_not_keep_the_input_s_times(cli, tmp_path, zarr_format):
    """Regression: the files the output copies from the input (a coordinate's chunks and
    metadata, the groups') and its folders kept the input's modification times (copytree), which
    travel with a tar or zip of the release and can date when a recording was made (the reason
    WebDataset members get time 0). They are now the run's, as every file the run writes."""
    import os
    import time

    import xarray as xr

    src = tmp_path / "in.zarr"
    data = np.random.default_rng(0).integers(0, 256, (4, 6, 5)).astype(np.float32)
    xr.Dataset({"v": (("time", "y", "x"), data)}, coords={"time": np.arange(4), "y": np.arange(6)}).to_zarr(
        src, mode="w", zarr_format=zarr_format, consolidated=False)
    recorded = time.mktime((2019, 3, 4, 5, 6, 7, 0, 0, -1))
    for path in [src, *src.rglob("*")]:
        os.utime(path, (recorded, recorded))
    out = tmp_path / "out.zarr"
    started = time.time() - 1
    result = cli("perturb", src, "--eps", "1", "--range", "0:256", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert (out / "y").is_dir()  # a coordinate, copied
    old = [p.relative_to(out).as_posix() for p in [out, *out.rglob("*")] if p.stat().st_mtime < started]
    assert old == []
