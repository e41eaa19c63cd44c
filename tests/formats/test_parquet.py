"""Parquet and Arrow files (formats/parquet_file.py, arrow_file.py, tables.py), made by
Hugging Face `datasets` and pyarrow, read back with `datasets.load_dataset("parquet")`,
`Dataset.from_file` and pyarrow."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.builders import SEED, RoundTrip, assert_one_line_error, run_measured_phase, siblings, tree_digest
from tldp_cli.formats import tables_writer

FEATURES = datasets.Features({
    "image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"]),
    "embedding": datasets.Sequence(datasets.Value("float32"), length=4),
    "grid": datasets.Array2D((2, 3), "float32"), "counts": datasets.Sequence(datasets.Value("int16")),
    "age": datasets.Value("float32"), "caption": datasets.Value("string")})


def _images(n: int, rng, size=(6, 5), fmt="PNG", mode="RGB") -> list[Image.Image]:
    out = []
    for _ in range(n):
        shape = (*size, 3) if mode == "RGB" else size
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(40, 200, shape, dtype=np.uint8), mode).save(buffer, fmt)
        buffer.seek(0)
        out.append(Image.open(buffer))
    return out


def hf_dataset(n: int = 12, fmt: str = "PNG", seed: int = 0) -> datasets.Dataset:
    """A dataset as people make one: images, a ClassLabel, tensors, lists, numbers and text."""
    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict({
        "image": _images(n, rng, fmt=fmt), "label": [i % 2 for i in range(n)],
        "embedding": rng.uniform(0, 1, (n, 4)).astype(np.float32).tolist(),
        "grid": rng.uniform(0, 1, (n, 2, 3)).astype(np.float32).tolist(),
        "counts": rng.integers(0, 100, (n, 3)).astype(np.int16).tolist(),
        "age": rng.uniform(20, 80, n).astype(np.float32).tolist(),
        "caption": [f"photo of Alice number {i}" for i in range(n)]}, features=FEATURES)


def to_parquet(ds: datasets.Dataset, path: Path, rows_per_group: int = 5) -> Path:
    ds.to_parquet(str(path), batch_size=rows_per_group)
    return path


RANGES = ("--range", "embedding=0:1", "--range", "grid=0:1", "--range", "counts=0:100")


def run(cli, src: Path, out: Path, *more):
    result = cli("perturb", src, "--eps", "2", "--seed", SEED, "--out", out, *RANGES, "--json", *more)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), result


def pixels(ds: datasets.Dataset) -> np.ndarray:
    return np.stack([np.asarray(image) for image in ds["image"]])


def test_a_datasets_parquet_file_is_perturbed_and_loads_with_its_features(cli, tmp_path):
    """Regression: `.parquet` was "not a dataset tldp can read"."""
    ds = hf_dataset()
    src = to_parquet(ds, tmp_path / "train.parquet")
    before = tree_digest(src)
    manifest, result = run(cli, src, tmp_path / "out.parquet")
    assert tree_digest(src) == before
    out = datasets.load_dataset("parquet", data_files=str(tmp_path / "out.parquet"), split="train")
    kept = {k: v for k, v in FEATURES.items() if k in ("image", "embedding", "grid", "counts")}
    assert out.features == datasets.Features(kept)
    assert len(out) == len(ds)
    original, noisy = pixels(ds), pixels(out)
    assert noisy.shape == original.shape and noisy.dtype == np.uint8 and not np.array_equal(noisy, original)
    assert all(image.format == "PNG" for image in out["image"])
    for name in ("embedding", "grid", "counts"):
        a, b = np.asarray(ds[name]), np.asarray(out[name])
        assert a.shape == b.shape and not np.array_equal(a, b), name
    # same row groups as the input
    source, written = pq.ParquetFile(src).metadata, pq.ParquetFile(tmp_path / "out.parquet").metadata
    assert [source.row_group(i).num_rows for i in range(source.num_row_groups)] == \
        [written.row_group(i).num_rows for i in range(written.num_row_groups)] == [5, 5, 2]
    dropped = {entry["name"]: entry for entry in manifest["dropped"]}
    assert set(dropped) == {"label", "age", "caption"}
    assert "ClassLabel" in dropped["label"]["reason"] and dropped["caption"]["kind"] == "column"
    assert [i["dataset"] for i in manifest["inputs"]] == ["image", "embedding", "grid", "counts"]
    assert manifest["row_datasets"] == [["image", "embedding", "grid", "counts"]]
    assert manifest["row_records"]["records"] == 12
    assert b"Alice" not in (tmp_path / "out.parquet").read_bytes()


def test_keep_copies_labels_text_and_image_paths(cli, tmp_path):
    ds = hf_dataset()
    src = tmp_path / "train.parquet"
    table = to_parquet(ds, src) and pq.read_table(src)
    paths = pa.array([f"alice_{i}.png" for i in range(len(ds))])
    images = pa.StructArray.from_arrays([table["image"].combine_chunks().field("bytes"), paths], ["bytes", "path"])
    pq.write_table(table.set_column(0, "image", images), src, row_group_size=4)
    manifest, _ = run(cli, src, tmp_path / "default.parquet")
    assert "image.path" in {entry["name"] for entry in manifest["dropped"]}
    default = pq.read_table(tmp_path / "default.parquet")
    assert default["image"].combine_chunks().field("path").null_count == len(ds)
    manifest, _ = run(cli, src, tmp_path / "kept.parquet", "--keep", "label", "--keep", "caption",
                      "--keep", "image.path")
    kept = datasets.load_dataset("parquet", data_files=str(tmp_path / "kept.parquet"), split="train")
    assert kept["label"] == ds["label"] and kept["caption"] == ds["caption"]
    assert list(kept.features) == ["image", "label", "embedding", "grid", "counts", "caption"]
    assert pq.read_table(tmp_path / "kept.parquet")["image"].combine_chunks().field("path").to_pylist() == \
        paths.to_pylist()
    assert {entry["name"] for entry in manifest["unperturbed"]} == {"label", "caption", "image.path"}
    assert {entry["name"] for entry in manifest["dropped"]} == {"age"}


def test_a_keep_naming_no_column_says_column(cli, tmp_path):
    """A table's --keep names columns: the refusal said "no dataset, attribute or file"."""
    src = to_parquet(hf_dataset(), tmp_path / "train.parquet")
    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "o.parquet", "--keep", "lable")
    assert result.exit_code == 2 and "--keep lable matches no dataset, attribute, column or file" in result.stderr
    assert not (tmp_path / "o.parquet").exists()


def test_a_numeric_column_is_perturbed_when_named(cli, tmp_path):
    ds = hf_dataset()
    src = to_parquet(ds, tmp_path / "train.parquet")
    result = cli("perturb", src, "--eps", "2", "--seed", SEED, "--out", tmp_path / "o.parquet",
                 "--dataset", "age", "--range", "0:100", "--json")
    assert result.exit_code == 0, result.stderr
    out = pq.read_table(tmp_path / "o.parquet")
    assert out.column_names == ["age"] and out.schema.field("age").type == pa.float32()
    assert not np.array_equal(out["age"].to_numpy(), np.asarray(ds["age"], np.float32))


def test_jpeg_images_stay_jpeg(cli, tmp_path):
    ds = hf_dataset(fmt="JPEG")
    src = to_parquet(ds, tmp_path / "train.parquet")
    manifest, _ = run(cli, src, tmp_path / "out.parquet")
    out = datasets.load_dataset("parquet", data_files=str(tmp_path / "out.parquet"), split="train")
    assert {image.format for image in out["image"]} == {"JPEG"}
    assert "JPEG as JPEG" in " ".join(manifest["postprocessing"])


def _mixed_sizes(tmp_path) -> tuple[datasets.Dataset, Path]:
    rng = np.random.default_rng(0)
    images = [image for size in ((6, 5), (7, 7), (4, 9)) for image in _images(3, rng, size=size)]
    ds = datasets.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(9)],
                                     "embedding": rng.uniform(0, 1, (9, 4)).tolist()},
                                    features=datasets.Features({"image": datasets.Image(), "label": FEATURES["label"],
                                                                "embedding": FEATURES["embedding"]}))
    return ds, to_parquet(ds, tmp_path / "mixed.parquet", rows_per_group=4)


def test_images_of_several_sizes_are_each_a_record(cli, tmp_path):
    """A column of images of several sizes (most photo datasets): each image a record of its
    own, as in an image folder; the same output whatever the workers."""
    ds, src = _mixed_sizes(tmp_path)
    outputs = []
    for workers in ("1", "3"):
        out = tmp_path / f"out{workers}.parquet"
        result = cli("perturb", src, "--eps", "2", "--seed", SEED, "--out", out, "--dataset", "image",
                     "--keep", "label", "--workers", workers, "--json")
        assert result.exit_code == 0, result.stderr
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    manifest = json.loads(result.stdout)
    assert len(manifest["inputs"]) == 9 and "row_datasets" not in manifest
    assert manifest["records"] == 9
    out = datasets.load_dataset("parquet", data_files=str(tmp_path / "out3.parquet"), split="train")
    assert out.features == datasets.Features({"image": datasets.Image(), "label": FEATURES["label"]})
    assert [np.asarray(i).shape for i in out["image"]] == [np.asarray(i).shape for i in ds["image"]]
    assert not any(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out["image"], ds["image"]))
    assert out["label"] == ds["label"]


def test_images_of_several_sizes_beside_other_columns_are_refused_in_one_line(cli, tmp_path):
    _, src = _mixed_sizes(tmp_path)
    result = cli("perturb", src, "--eps", "1", "--range", "embedding=0:1", "--out", tmp_path / "o.parquet")
    assert_one_line_error(result, 1, "mixed.parquet", "column image", "3 sizes", "--dataset image")
    assert not (tmp_path / "o.parquet").exists()


def test_a_damaged_file_is_refused_in_one_line_and_nothing_is_written(cli, tmp_path):
    src = to_parquet(hf_dataset(), tmp_path / "train.parquet")
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(src.read_bytes()[:-100])
    result = cli("perturb", damaged, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, "damaged.parquet", "not a readable Parquet file")
    assert siblings(tmp_path) == {"train.parquet", "damaged.parquet"}


def test_a_table_without_images_or_tensors_names_its_numeric_columns(cli, tmp_path):
    src = tmp_path / "people.parquet"
    pq.write_table(pa.table({"age": [31.0, 45.0], "name": ["Alice", "Bob"]}), src)
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_error(result, 1, "people.parquet", "no image or tensor column", "age", "--dataset")


def test_a_table_without_images_or_tensors_says_what_its_columns_hold(cli, tmp_path):
    """A datasets column of lists of images (Sequence(Image())) was refused as "no image or
    tensor column to perturb", which said nothing of the column of images the user sees."""
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    ds = datasets.Dataset.from_dict(
        {"views": [[{"bytes": png.getvalue(), "path": None}] * 2] * 3, "label": [0, 1, 0]},
        features=datasets.Features({"views": datasets.Sequence(datasets.Image()),
                                    "label": datasets.ClassLabel(names=["a", "b"])}))
    src = to_parquet(ds, tmp_path / "views.parquet")
    result = cli("perturb", src, "--eps", "1")
    assert_one_line_error(result, 1, f"{src}: no image or tensor column to perturb; not perturbed: views (lists of "
                          "struct<bytes: binary, path: string>), label (a label column (ClassLabel))")
    assert siblings(tmp_path) == {"views.parquet"}


def test_privunit_on_numeric_columns_says_to_hold_a_row_in_one_list_column(cli, tmp_path):
    """Each numeric column is an array of one number a row, which privunit cannot release
    as a direction; the refusal said only 'not records of shape ()', not the way out."""
    src = tmp_path / "features.parquet"
    pq.write_table(pa.table({"f0": [0.1, 0.5], "f1": [0.2, -0.3]}), src)
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "4", "--range", "-1:1",
                 "--dataset", "f0", "--dataset", "f1")
    assert_one_line_error(result, 2, "features.parquet", "column f0", "2 or more elements",
                          "one array of shape (records, values)", "one list column")
    assert siblings(tmp_path) == {"features.parquet"}


def test_blocks_come_in_row_order_so_the_writer_holds_few(tmp_path, monkeypatch):
    """Flat memory: with 40 row groups and blocks of one row group, the writer never holds
    more than a few blocks of any column (job by job, it would hold all of the first)."""
    from tldp_cli.run.pipeline import PerturbOptions, perturb

    rng = np.random.default_rng(3)
    n = 200
    table = pa.table({"a": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 256, n * 8, dtype=np.uint8)), 8),
                      "b": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 256, n * 2, dtype=np.uint8)), 2)})
    src = tmp_path / "wide.parquet"
    pq.write_table(table, src, row_group_size=5)
    held = []
    flush = tables_writer.TableWriter._flush

    def watched(self):
        held.append(max(len(pieces) for pieces in self.pending.values()))
        flush(self)

    monkeypatch.setattr(tables_writer.TableWriter, "_flush", watched)
    perturb(PerturbOptions(input=src, eps=1.0, out=tmp_path / "o.parquet", block_elements=40, workers=1))
    assert max(held) <= 2
    out = pq.read_table(tmp_path / "o.parquet")
    assert out.num_rows == n and pq.ParquetFile(tmp_path / "o.parquet").metadata.num_row_groups == 40


def test_an_arrow_stream_from_datasets_loads_with_dataset_from_file(cli, tmp_path):
    ds = hf_dataset()
    ds.save_to_disk(str(tmp_path / "saved"))
    src = next((tmp_path / "saved").glob("data-*.arrow"))
    manifest, _ = run(cli, src, tmp_path / "out.arrow")
    out = datasets.Dataset.from_file(str(tmp_path / "out.arrow"))
    assert list(out.features) == ["image", "embedding", "grid", "counts"]
    assert out.features["grid"] == FEATURES["grid"] and out.features["image"] == FEATURES["image"]
    assert (tmp_path / "out.arrow").read_bytes()[:4] == b"\xff\xff\xff\xff"  # a stream, as the input
    assert pixels(out).shape == pixels(ds).shape and not np.array_equal(pixels(out), pixels(ds))


class ParquetRoundTrip(RoundTrip):
    format = "parquet"
    extra_args = RANGES

    def make_input(self, tmp_path):
        return to_parquet(hf_dataset(), tmp_path / "train.parquet")

    def read_arrays(self, path):
        table = pq.read_table(path)
        images = [np.asarray(Image.open(io.BytesIO(b))) for b in table["image"].combine_chunks().field("bytes").to_pylist()]
        return {"image": np.stack(images), "embedding": np.asarray(table["embedding"].to_pylist()),
                "grid": np.asarray(table["grid"].to_pylist()), "counts": np.asarray(table["counts"].to_pylist())}

    def assert_same_structure(self, original, perturbed):
        a, b = pq.ParquetFile(original), pq.ParquetFile(perturbed)
        assert [a.metadata.row_group(i).num_rows for i in range(a.metadata.num_row_groups)] == \
            [b.metadata.row_group(i).num_rows for i in range(b.metadata.num_row_groups)]
        assert b.schema_arrow.names == ["image", "embedding", "grid", "counts"]
        for name in b.schema_arrow.names:
            assert b.schema_arrow.field(name).type == a.schema_arrow.field(name).type


class ArrowRoundTrip(RoundTrip):
    """An IPC file (ARROW1) as pyarrow writes it, with a fixed_shape_tensor column."""

    format = "arrow"
    extra_args = ("--range", "x=0:1")

    def make_input(self, tmp_path):
        rng = np.random.default_rng(4)
        tensor = pa.fixed_shape_tensor(pa.float32(), (3, 2))
        storage = pa.FixedSizeListArray.from_arrays(pa.array(rng.uniform(0, 1, 60).astype(np.float32)), 6)
        table = pa.table({"x": pa.ExtensionArray.from_storage(tensor, storage), "id": list(range(10))})
        path = tmp_path / "t.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=4):
                writer.write_batch(batch)
        return path

    def read_arrays(self, path):
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
        return {"x": table["x"].combine_chunks().to_numpy_ndarray()}

    def assert_same_structure(self, original, perturbed):
        with pa.memory_map(str(original)) as a, pa.memory_map(str(perturbed)) as b:
            ra, rb = pa.ipc.open_file(a), pa.ipc.open_file(b)
            assert rb.schema.names == ["x"] and rb.schema.field("x").type == ra.schema.field("x").type
            assert [rb.get_batch(i).num_rows for i in range(rb.num_record_batches)] == [4, 4, 2]


def test_an_empty_batch_beside_a_kept_column_is_written_empty(cli, tmp_path):
    """A batch of no rows (pyarrow writes one as asked) between others: the output keeps it,
    the kept column's values as they were (it crashed: no rows read to copy from)."""
    schema = pa.schema([("x", pa.float32()), ("label", pa.int64())])
    batches = [pa.record_batch([pa.array(np.arange(n, dtype=np.float32)), pa.array([i % 2 for i in range(n)])],
                               schema=schema) for n in (4, 0, 3)]
    src = tmp_path / "t.arrow"
    with pa.OSFile(str(src), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    result = cli("perturb", src, "--eps", "2", "--seed", SEED, "--out", tmp_path / "o.arrow", "--dataset", "x",
                 "--range", "0:10", "--keep", "label")
    assert result.exit_code == 0, result.stderr
    with pa.memory_map(str(tmp_path / "o.arrow")) as source:
        out = pa.ipc.open_file(source)
        assert [out.get_batch(i).num_rows for i in range(out.num_record_batches)] == [4, 0, 3]
        assert out.read_all()["label"].to_pylist() == [0, 1, 0, 1, 0, 1, 0]


def test_a_damaged_row_group_stops_the_run_in_one_line_and_nothing_is_written(cli, tmp_path):
    """The footer reads well, a data page does not: the run stops when it reaches it."""
    src = to_parquet(hf_dataset(), tmp_path / "train.parquet")
    data = bytearray(src.read_bytes())
    meta = pq.ParquetFile(src).metadata
    column = meta.row_group(1).column(0)  # image bytes of the second row group
    start = column.data_page_offset
    data[start + 8:start + column.total_compressed_size - 8] = b"\xff" * (column.total_compressed_size - 16)
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(bytes(data))
    result = cli("perturb", damaged, "--eps", "1", *RANGES, "--out", tmp_path / "o.parquet")
    assert_one_line_error(result, 1, "damaged.parquet")
    assert siblings(tmp_path) == {"train.parquet", "damaged.parquet"}


def test_each_columns_compression_and_the_format_version_are_kept(cli, tmp_path):
    table = pq.read_table(to_parquet(hf_dataset(), tmp_path / "hf.parquet"))
    src = tmp_path / "train.parquet"
    pq.write_table(table, src, row_group_size=4, version="1.0",
                   compression={"image.bytes": "zstd", "embedding.list.element": "gzip", "grid.list.element.list.element":
                                "snappy", "counts.list.element": "zstd"})
    run(cli, src, tmp_path / "out.parquet")
    def codecs(path):
        meta = pq.ParquetFile(path).metadata
        group = meta.row_group(0)
        return meta.format_version, {group.column(i).path_in_schema: group.column(i).compression
                                     for i in range(group.num_columns)}
    version, written = codecs(tmp_path / "out.parquet")
    assert version == codecs(src)[0]
    assert written == {k: v for k, v in codecs(src)[1].items() if k.split(".")[0] in
                       ("image", "embedding", "grid", "counts")}
    assert written["image.bytes"] == "ZSTD" and written["embedding.list.element"] == "GZIP"


def test_evaluate_checks_a_perturbed_table(cli, tmp_path):
    """The images were clipped to 8 bits (table_output): evaluate reports their noise without
    testing it against the mechanism's, and the other checks pass."""
    src = to_parquet(hf_dataset(n=30), tmp_path / "train.parquet")
    out = tmp_path / "out.parquet"
    result = cli("perturb", src, "--eps", "2", "--seed", SEED, "--out", out, "--dataset", "image", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["table_output"] == {"clipped": ["image"]}
    checked = cli("evaluate", src, out, "--json")
    assert checked.exit_code == 0, checked.stdout + checked.stderr


@pytest.mark.slow
def test_peak_memory_is_flat_in_the_number_of_rows(tmp_path):
    """Rows are read a row group at a time: 10 times the rows (61 MB of float32 tensors; a
    reader that keeps what it read adds them) raise the memory the perturbing phase takes
    by little. Blocks of one row group (--block-elements), so that both runs have more
    blocks than the workers hold at once, and measured as the rise above the memory held
    as the phase starts: the planning before it imports modules by the figures it
    computes, 45 MiB more for the smaller file here, which hid a growth that size in the
    peak of the whole run. (What the writer holds is bounded by
    test_blocks_come_in_row_order_so_the_writer_holds_few.)"""
    peaks, rises = [], []
    for rows in (2000, 20000):
        rng = np.random.default_rng(9)
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(rng.uniform(0, 1, rows * 768).astype(np.float32)), 768)
        extra = pa.FixedSizeListArray.from_arrays(pa.array(rng.uniform(0, 1, rows * 16).astype(np.float32)), 16)
        src = tmp_path / f"rows{rows}.parquet"
        pq.write_table(pa.table({"pixels": pixels, "extra": extra}), src, row_group_size=500)
        del pixels, extra
        code, stderr, peak, rise = run_measured_phase(tmp_path, "perturbing", "perturb", src, "--eps", "1",
                                                      "--range", "0:1", "--workers", "2", "-q",
                                                      "--block-elements", 1 << 18)
        assert code == 0, stderr
        peaks.append(peak)
        rises.append(rise)
    # 2 to 8 MiB here; 73 to 79 with a reader that keeps every row group it read
    grown_mib = (rises[1] - rises[0]) / (1 << 20)
    assert grown_mib < 24, f"perturbing took {grown_mib:.0f} MiB more for 10 times the rows"
    grown_mib = (peaks[1] - peaks[0]) / (1 << 20)
    assert grown_mib < 45, f"peak RSS grew by {grown_mib:.0f} MiB for 10 times the rows"


def test_the_alpha_channel_is_copied_back_and_16_bit_images_stay_16_bit(cli, tmp_path):
    rng = np.random.default_rng(6)
    rgba = [Image.fromarray(rng.integers(0, 256, (5, 4, 4), dtype=np.uint8), "RGBA") for _ in range(4)]
    deep = [Image.fromarray(rng.integers(0, 65536, (5, 4), dtype=np.uint16)) for _ in range(4)]
    features = datasets.Features({"rgba": datasets.Image(), "deep": datasets.Image()})
    ds = datasets.Dataset.from_dict({"rgba": rgba, "deep": deep}, features=features)
    src = to_parquet(ds, tmp_path / "t.parquet")
    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "o.parquet", "--range", "rgba=0:256",
                 "--range", "deep=0:65536", "--keep", "rgba.alpha")
    assert result.exit_code == 0, result.stderr
    out = datasets.load_dataset("parquet", data_files=str(tmp_path / "o.parquet"), split="train")
    assert out.features == features
    for a, b in zip(ds["rgba"], out["rgba"]):
        a, b = np.asarray(a), np.asarray(b)
        assert b.shape == (5, 4, 4) and np.array_equal(a[..., 3], b[..., 3]) and not np.array_equal(a, b)
    for a, b in zip(ds["deep"], out["deep"]):
        assert np.asarray(b).dtype == np.asarray(a).dtype and np.asarray(b).max() > 255


def test_a_truncated_arrow_stream_is_refused_in_one_line_and_nothing_is_written(cli, tmp_path):
    hf_dataset().save_to_disk(str(tmp_path / "saved"))
    data = next((tmp_path / "saved").glob("data-*.arrow")).read_bytes()
    src = tmp_path / "cut.arrow"
    src.write_bytes(data[:len(data) * 2 // 3])
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, "cut.arrow", "not a readable Arrow IPC stream")
    assert siblings(tmp_path) == {"saved", "cut.arrow"}


def test_a_column_of_palette_masks_is_a_label_map_left_out_or_kept(cli, tmp_path):
    """Segmentation datasets hold their masks as palette PNGs: class indices, not pixels."""
    rng = np.random.default_rng(8)
    masks = []
    for _ in range(4):
        mask = Image.fromarray(rng.integers(0, 3, (6, 5), dtype=np.uint8), "P")
        mask.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0])
        masks.append(mask)
    features = datasets.Features({"image": datasets.Image(), "mask": datasets.Image()})
    ds = datasets.Dataset.from_dict({"image": _images(4, rng), "mask": masks}, features=features)
    src = to_parquet(ds, tmp_path / "seg.parquet")
    def perturbed(out, *more):
        result = cli("perturb", src, "--eps", "2", "--out", out, "--json", *more)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    manifest = perturbed(tmp_path / "dropped.parquet")
    assert pq.read_table(tmp_path / "dropped.parquet").column_names == ["image"]
    assert "label maps" in {e["name"]: e["reason"] for e in manifest["dropped"]}["mask"]
    perturbed(tmp_path / "kept.parquet", "--keep", "mask")
    out = datasets.load_dataset("parquet", data_files=str(tmp_path / "kept.parquet"), split="train")
    assert out.features == features
    assert [np.asarray(m).tolist() for m in out["mask"]] == [np.asarray(m).tolist() for m in ds["mask"]]
    result = cli("perturb", src, "--eps", "1", "--dataset", "mask")
    assert_one_line_error(result, 1, "column mask", "palette")


def test_footer_metadata_outside_the_arrow_schema_is_listed_as_dropped_or_kept(cli, tmp_path):
    """Regression: key-value metadata a writer puts in the Parquet footer beside the Arrow
    schema (Spark, DuckDB, ParquetWriter.add_key_value_metadata) was left out unlisted, so
    the manifest's `dropped` did not say what the run left out, and --keep could not name it."""
    src = tmp_path / "t.parquet"
    table = pa.table({"x": pa.array([[1, 2], [3, 4]], type=pa.list_(pa.uint8(), 2))})
    with pq.ParquetWriter(src, table.schema) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata({"origin": "notes of Alice's clinic"})
    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "o.parquet", "--json")
    assert result.exit_code == 0, result.stderr
    assert {"name": "@origin", "kind": "schema metadata key"}.items() <= \
        next(d for d in json.loads(result.stdout)["dropped"] if d["name"] == "@origin").items()
    assert b"origin" not in pq.ParquetFile(tmp_path / "o.parquet").metadata.metadata
    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "k.parquet", "--keep", "@origin", "--json")
    assert result.exit_code == 0, result.stderr
    assert pq.ParquetFile(tmp_path / "k.parquet").metadata.metadata[b"origin"] == b"notes of Alice's clinic"
    assert "@origin" in [u["name"] for u in json.loads(result.stdout)["unperturbed"]]


def test_a_tables_alpha_channels_are_left_out_unless_keep_names_them(cli, tmp_path):
    """Regression: the alpha channels of an image column were copied raw by default (only
    listed under unperturbed), though a cut-out's alpha is its subject's silhouette. They are
    left out now (RGBA written as RGB, LA as L, PNG still), listed under dropped and named by
    the summary line; --keep COLUMN.alpha copies them raw, listed under unperturbed."""
    rng = np.random.default_rng(11)
    rgba = [rng.integers(0, 256, (5, 4, 4), dtype=np.uint8) for _ in range(2)]
    la = rng.integers(0, 256, (5, 4, 2), dtype=np.uint8)
    images = [Image.fromarray(a, "RGBA") for a in rgba] + [Image.fromarray(la, "LA")]
    images.append(Image.fromarray(rng.integers(0, 256, (5, 4, 3), dtype=np.uint8), "RGB"))
    ds = datasets.Dataset.from_dict({"photo": images}, features=datasets.Features({"photo": datasets.Image()}))
    src = to_parquet(ds, tmp_path / "t.parquet")

    def written(out: Path) -> list[Image.Image]:
        column = pq.read_table(out)["photo"].combine_chunks().field("bytes").to_pylist()
        return [Image.open(io.BytesIO(data)) for data in column]

    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "o.parquet", "--range", "0:256", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    entry = {e["name"]: e for e in manifest["dropped"]}.get("photo.alpha")
    assert entry is not None and entry["kind"] == "alpha channel" and "3 images of column photo" in entry["reason"]
    assert "dropped alpha channels" in result.stderr and "unperturbed" not in manifest
    assert [(im.format, im.mode, im.size) for im in written(tmp_path / "o.parquet")] == \
        [("PNG", "RGB", (4, 5))] * 2 + [("PNG", "L", (4, 5)), ("PNG", "RGB", (4, 5))]
    result = cli("perturb", src, "--eps", "2", "--out", tmp_path / "k.parquet", "--range", "0:256", "--json",
                 "--keep", "photo.alpha")
    assert result.exit_code == 0, result.stderr
    entry = {e["name"]: e for e in json.loads(result.stdout).get("unperturbed", [])}.get("photo.alpha")
    assert entry is not None and entry["kind"] == "alpha channel" and "3 images" in entry["reason"]
    assert "photo.alpha" in result.stderr.split("copied unchanged: ")[1]  # the summary line names it
    kept = written(tmp_path / "k.parquet")
    assert [im.mode for im in kept] == ["RGBA", "RGBA", "LA", "RGB"]
    assert all(np.array_equal(np.asarray(im)[..., -1], a[..., -1]) for im, a in zip(kept, [*rgba, la]))


def test_a_kept_image_column_writes_its_file_names_only_when_named(cli, tmp_path):
    """Regression: --keep COLUMN on an image column that is not perturbed copied the structs'
    `path` field (file names) raw while the manifest listed only the column; its paths now
    follow a perturbed column's rule: written as null and listed as dropped unless --keep
    names COLUMN.path."""
    rng = np.random.default_rng(12)
    features = datasets.Features({"embedding": datasets.Sequence(datasets.Value("float32"), length=4),
                                  "annotation": datasets.Image()})
    ds = datasets.Dataset.from_dict({"embedding": rng.uniform(0, 1, (4, 4)).astype(np.float32).tolist(),
                                     "annotation": _images(4, rng)}, features=features)
    src = to_parquet(ds, tmp_path / "t.parquet")
    table = pq.read_table(src)
    structs = table["annotation"].combine_chunks()
    names = pa.array([f"alice_{i}.png" for i in range(4)])
    with_names = pa.StructArray.from_arrays([structs.field("bytes"), names], ["bytes", "path"])
    pq.write_table(table.set_column(1, "annotation", with_names), src)

    def kept(out, *more):
        result = cli("perturb", src, "--eps", "2", "--out", out, "--dataset", "embedding", "--range", "0:1",
                     "--keep", "annotation", *more, "--json")
        assert result.exit_code == 0, result.stderr
        column = pq.read_table(out)["annotation"].combine_chunks()
        assert column.field("bytes").to_pylist() == structs.field("bytes").to_pylist()
        return json.loads(result.stdout), column.field("path").to_pylist()

    manifest, paths = kept(tmp_path / "o.parquet")
    assert paths == [None] * 4 and b"alice" not in (tmp_path / "o.parquet").read_bytes()
    assert {"name": "annotation.path", "kind": "image path field"}.items() <= \
        next(e for e in manifest["dropped"] if e["name"] == "annotation.path").items()
    manifest, paths = kept(tmp_path / "named.parquet", "--keep", "annotation.path")
    assert paths == names.to_pylist()
    assert {"annotation", "annotation.path"} <= {e["name"] for e in manifest["unperturbed"]}
    out = datasets.load_dataset("parquet", data_files=str(tmp_path / "o.parquet"), split="train")
    assert out.features == features


def test_icc_profiles_are_dropped_unless_kept(cli, tmp_path):
    """An ICC profile can hold free text (its description and copyright tags): left out and
    listed in dropped; --keep COLUMN.icc_profile writes it, listed under unperturbed."""
    from PIL import ImageCms

    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    rng = np.random.default_rng(8)
    images = []
    for _ in range(3):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (5, 4, 3), dtype=np.uint8)).save(buffer, "PNG", icc_profile=icc)
        images.append({"bytes": buffer.getvalue(), "path": None})
    features = datasets.Features({"photo": datasets.Image()})
    src = to_parquet(datasets.Dataset.from_dict({"photo": images}, features=features), tmp_path / "t.parquet")
    for out, keep in ((tmp_path / "o.parquet", ()), (tmp_path / "k.parquet", ("--keep", "photo.icc_profile"))):
        result = cli("perturb", src, "--eps", "2", "--out", out, "--range", "0:256", "--json", *keep)
        assert result.exit_code == 0, result.stderr
        entries = json.loads(result.stdout)["unperturbed" if keep else "dropped"]
        assert [(e["name"], e["kind"]) for e in entries] == [("photo.icc_profile", "colour profile")]
        for row in pq.read_table(out)["photo"].combine_chunks().field("bytes").to_pylist():
            with Image.open(io.BytesIO(row)) as im:
                assert im.info.get("icc_profile") == (icc if keep else None)


def test_record_budget_on_long_list_columns_computes_in_float64_unasked(cli, tmp_path):
    """Was: refused unless --dtype float64 (float32 cannot hold the grid values of records of
    1500 elements under --budget record); each column is written back in its own type anyway."""
    emb = np.random.default_rng(0).uniform(-1, 1, (5, 1500)).astype(np.float32)
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"emb": pa.array(list(emb), type=pa.list_(pa.float32()))}), src)
    args = ("--eps", "10", "--budget", "record", "--range", "-1:1")
    result = cli("perturb", src, *args, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["grid"]["output_dtype_rule"].startswith("float64: ")
    out = pq.read_table(tmp_path / "t.tldp.parquet")
    assert out.schema.field("emb").type == pa.list_(pa.float32())
    values = np.stack(out.column("emb").to_numpy(zero_copy_only=False))
    assert values.shape == emb.shape and np.isfinite(values).all() and not np.array_equal(values, emb)
    checked = cli("evaluate", src, tmp_path / "t.tldp.parquet")
    assert checked.exit_code == 0, checked.stderr
    refused = cli("perturb", src, *args, "--dtype", "float32", "--out", tmp_path / "f32.parquet")
    assert refused.exit_code == 2 and "--dtype float32 cannot hold the grid values" in refused.stderr


def test_a_features_id_is_left_out_of_the_footer_unless_kept(cli, tmp_path):
    """Regression: a feature's optional id (free text, `Value("float32", id=...)`) was copied
    into the output's `huggingface` schema metadata; it is listed as huggingface@features...id."""
    features = datasets.Features({"embedding": datasets.Sequence(datasets.Value("float32", id="MARK_ID"),
                                                                 length=4)})
    ds = datasets.Dataset.from_dict({"embedding": np.full((6, 4), 0.5, np.float32).tolist()}, features=features)
    src = to_parquet(ds, tmp_path / "train.parquet")
    assert b"MARK_ID" in pq.read_schema(src).metadata[b"huggingface"]
    args = ("perturb", src, "--eps", "2", "--range", "embedding=0:1", "--json")
    result = cli(*args, "--out", tmp_path / "out.parquet")
    assert result.exit_code == 0, result.stderr
    dropped = {e["name"]: e["kind"] for e in json.loads(result.stdout)["dropped"]}
    assert dropped == {"huggingface@features.embedding.feature.id": "feature id"}
    assert b"MARK_ID" not in (tmp_path / "out.parquet").read_bytes()
    out = datasets.load_dataset("parquet", data_files=str(tmp_path / "out.parquet"), split="train")
    assert out.features == datasets.Features({"embedding": datasets.Sequence(datasets.Value("float32"), length=4)})
    result = cli(*args, "--out", tmp_path / "kept.parquet", "--keep", "huggingface@features.*")
    assert result.exit_code == 0, result.stderr
    kept = datasets.load_dataset("parquet", data_files=str(tmp_path / "kept.parquet"), split="train")
    assert kept.features == features
