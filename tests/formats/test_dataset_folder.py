"""Hugging Face dataset folders (formats/dataset_folder.py) written by `Dataset.save_to_disk`
and read back with `datasets.load_from_disk`."""

from __future__ import annotations

import json
import shutil

import datasets
import numpy as np
import pyarrow as pa

from tests.builders import RoundTrip, assert_one_line_error, tree_digest
from tests.formats.test_parquet import FEATURES, RANGES, hf_dataset, pixels, run


def saved(tmp_path, shards: int = 2):
    ds = hf_dataset(n=14)
    ds.save_to_disk(str(tmp_path / "train"), num_shards=shards)
    return ds, tmp_path / "train"


def test_a_save_to_disk_folder_is_perturbed_and_loads_with_its_features(cli, tmp_path):
    """Regression: a save_to_disk folder was "no images in train (found 4 files that are not images)"."""
    ds, src = saved(tmp_path)
    before = tree_digest(src)
    manifest, _ = run(cli, src, tmp_path / "out", "--keep", "label")
    assert tree_digest(src) == before
    out = datasets.load_from_disk(str(tmp_path / "out"))
    assert out.features == datasets.Features({k: v for k, v in FEATURES.items()
                                              if k in ("image", "label", "embedding", "grid", "counts")})
    assert out["label"] == ds["label"] and len(out) == len(ds)
    assert pixels(out).shape == pixels(ds).shape and not np.array_equal(pixels(out), pixels(ds))
    assert not np.array_equal(np.asarray(out["grid"]), np.asarray(ds["grid"]))
    shards = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert shards == sorted(p.name for p in src.iterdir())
    state, original = json.loads((tmp_path / "out" / "state.json").read_text()), json.loads((src / "state.json").read_text())
    assert state["_data_files"] == original["_data_files"] and state["_fingerprint"] != original["_fingerprint"]
    with pa.memory_map(str(tmp_path / "out" / "data-00001-of-00002.arrow")) as f:
        assert pa.ipc.open_stream(f).read_all().num_rows == 7
    assert {e["name"] for e in manifest["dropped"]} >= {"age", "caption"}
    assert manifest["row_records"]["records"] == 14


def test_other_files_and_dataset_info_fields_follow_the_keep_rule(cli, tmp_path):
    _, src = saved(tmp_path, shards=1)
    info = json.loads((src / "dataset_info.json").read_text())
    info["description"] = "photos of Alice's family"
    (src / "dataset_info.json").write_text(json.dumps(info))
    (src / "cache-0123.arrow").write_bytes((src / "data-00000-of-00001.arrow").read_bytes())
    manifest, _ = run(cli, src, tmp_path / "out")
    dropped = {e["name"] for e in manifest["dropped"]}
    assert {"cache-0123.arrow", "dataset_info.json@description"} <= dropped
    assert not (tmp_path / "out" / "cache-0123.arrow").exists()
    assert "Alice" not in (tmp_path / "out" / "dataset_info.json").read_text()
    manifest, _ = run(cli, src, tmp_path / "kept", "--keep", "dataset_info.json@description")
    assert json.loads((tmp_path / "kept" / "dataset_info.json").read_text())["description"] == info["description"]
    assert datasets.load_from_disk(str(tmp_path / "kept")).info.description == info["description"]

def test_keep_never_copies_the_cache_and_indices_files_that_hold_the_rows(cli, tmp_path):
    """Regression: --keep cache-XXXX.arrow copied the raw rows `map` caches (and the row order
    `shuffle` caches) into the output; model and image folders never copy a data file."""
    _, src = saved(tmp_path, shards=1)
    loaded = datasets.load_from_disk(str(src))
    loaded.map(lambda row: {"twice": row["label"] * 2})  # cache-*.arrow: every row, raw
    loaded.shuffle(seed=0)  # cache-*.arrow: the indices
    caches = sorted(p.name for p in src.glob("cache-*.arrow"))
    assert len(caches) == 2, caches
    before = tree_digest(src)
    for pattern in [*caches, "cache-*"]:
        result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out", *RANGES, "--keep", "label",
                     "--keep", pattern)
        assert_one_line_error(result, 2, f"{src}/cache-", ": holds arrow data", "never copies it raw")
        assert not (tmp_path / "out").exists() and tree_digest(src) == before
    manifest, _ = run(cli, src, tmp_path / "out", "--keep", "label")
    assert set(caches) <= {e["name"] for e in manifest["dropped"]}
    assert not list((tmp_path / "out").glob("cache-*"))
    assert datasets.load_from_disk(str(tmp_path / "out"))["label"] == loaded["label"]



def test_a_state_naming_a_missing_shard_is_refused_in_one_line(cli, tmp_path):
    _, src = saved(tmp_path)
    (src / "data-00001-of-00002.arrow").unlink()
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, "state.json", "data-00001-of-00002.arrow", "not a file of the folder")
    assert not (tmp_path / "train.tldp").exists()


def test_a_damaged_or_foreign_shard_is_refused_saying_what_it_is(cli, tmp_path):
    """A save_to_disk folder of one shard cut short before its schema was refused as "not a
    Arrow IPC stream (the folder's other shards are)": there were no other shards, and the
    file was damaged, which the line did not say."""
    _, src = saved(tmp_path, shards=1)
    shard = src / "data-00000-of-00001.arrow"
    table = pa.ipc.open_stream(shard.read_bytes()).read_all()
    shard.write_bytes(shard.read_bytes()[:200])
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, f"{shard}: not a readable Arrow IPC stream, as the folder's data "
                          "files are; it may be truncated or corrupt")
    with pa.ipc.new_file(str(shard), table.schema) as writer:  # the IPC file format, not a stream
        writer.write_table(table)
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, f"{shard}: an Arrow IPC file, where the folder's data files are "
                          "Arrow IPC streams")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train"]


class DatasetFolderRoundTrip(RoundTrip):
    format = "hf-dataset"
    extra_args = RANGES

    def make_input(self, tmp_path):
        return saved(tmp_path)[1]

    def read_arrays(self, path):
        ds = datasets.load_from_disk(str(path))
        return {"image": pixels(ds), "embedding": np.asarray(ds["embedding"]), "grid": np.asarray(ds["grid"]),
                "counts": np.asarray(ds["counts"])}

    def assert_same_structure(self, original, perturbed):
        assert sorted(p.name for p in perturbed.iterdir()) == sorted(p.name for p in original.iterdir())
        assert list(datasets.load_from_disk(str(perturbed)).features) == ["image", "embedding", "grid", "counts"]


def hub_folder(tmp_path):
    """A dataset as the Hub lays it out: Parquet shards per split under data/, a dataset card."""
    root = tmp_path / "hub"
    (root / "data").mkdir(parents=True)
    train, test = hf_dataset(n=10), hf_dataset(n=4, seed=1)
    for i in range(2):
        train.shard(2, i, contiguous=True).to_parquet(str(root / "data" / f"train-0000{i}-of-00002.parquet"))
    test.to_parquet(str(root / "data" / "test-00000-of-00001.parquet"))
    (root / "README.md").write_text("---\nlicense: mit\n---\n# Photos of Alice's family\n")
    (root / ".git" / "objects").mkdir(parents=True)  # a clone of the Hub's repository
    (root / ".git" / "objects" / "ab").write_bytes(b"x")
    return root, train, test


def test_a_hub_folder_of_parquet_shards_is_one_table_and_loads_with_its_splits(cli, tmp_path):
    root, train, test = hub_folder(tmp_path)
    manifest, _ = run(cli, root, tmp_path / "out")
    out = datasets.load_dataset(str(tmp_path / "out"))
    assert set(out) == {"train", "test"} and len(out["train"]) == 10 and len(out["test"]) == 4
    assert list(out["train"].features) == ["image", "embedding", "grid", "counts"]
    assert out["train"].features["image"] == FEATURES["image"] and out["test"].features["grid"] == FEATURES["grid"]
    assert not np.array_equal(pixels(out["test"]), pixels(test))
    assert not (tmp_path / "out" / "README.md").exists() and not (tmp_path / "out" / ".git").exists()
    assert {e["name"] for e in manifest["dropped"]} >= {"README.md", ".git/"}
    assert manifest["row_records"]["records"] == 14
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*.parquet")) == \
        sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet"))


def test_a_macos_archives_resource_forks_are_not_read_as_parquet(cli, tmp_path):
    """Regression: a Hub folder unzipped from a macOS archive has __MACOSX/ (AppleDouble files,
    ._train-...parquet) and ._ files beside the shards: they were read as Parquet shards and
    stopped the run. They are left out unread and listed, as hidden folders are (formats.is_hidden)."""
    root, _, _ = hub_folder(tmp_path)
    fork = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(40)
    (root / "__MACOSX" / "data").mkdir(parents=True)
    (root / "__MACOSX" / "data" / "._train-00000-of-00002.parquet").write_bytes(fork)
    (root / "data" / "._test-00000-of-00001.parquet").write_bytes(fork)
    manifest, _ = run(cli, root, tmp_path / "out")
    assert manifest["row_records"]["records"] == 14
    dropped = {e["name"]: e for e in manifest["dropped"]}
    assert "hidden" in dropped["__MACOSX/"]["reason"] and "data/._test-00000-of-00001.parquet" in dropped
    assert not (tmp_path / "out" / "__MACOSX").exists()


def test_an_imagefolder_with_a_parquet_index_stays_an_image_folder(cli, tmp_path):
    root, _, _ = hub_folder(tmp_path)
    from PIL import Image

    Image.new("L", (4, 4)).save(root / "a.png")
    from tldp_cli import formats

    assert formats.detect(root).name == "images"


def test_a_format_naming_a_dropped_column_still_loads(cli, tmp_path):
    ds = hf_dataset(n=6).with_format("numpy", columns=["grid", "caption"])
    ds.save_to_disk(str(tmp_path / "train"))
    result = cli("perturb", tmp_path / "train", "--eps", "1", "--dataset", "grid", "--range", "0:1",
                 "--out", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    out = datasets.load_from_disk(str(tmp_path / "out"))
    assert out.format["type"] == "numpy" and out.format["columns"] == ["grid"]
    assert out[0]["grid"].shape == (2, 3)


def dataset_dict(tmp_path, train_shards: int = 2):
    """A DatasetDict as DatasetDict.save_to_disk writes it: dataset_dict.json and a save_to_disk
    folder per split (train in `train_shards` shards)."""
    dd = datasets.DatasetDict({"train": hf_dataset(n=10), "test": hf_dataset(n=4, seed=1)})
    dd.save_to_disk(str(tmp_path / "dd"), num_shards={"train": train_shards, "test": 1})
    return dd, tmp_path / "dd"


def test_a_dataset_dict_folder_releases_every_split_and_loads_as_a_dataset_dict(cli, tmp_path):
    """Regression: DatasetDict.save_to_disk's folder (dataset_dict.json and a folder per split)
    was refused ("a DatasetDict folder ...; perturb the splits' folders instead"); before that,
    "no images in dd". Every split is perturbed, in one release whose records are the rows of
    every split; load_from_disk gives a DatasetDict of the same splits, features and rows."""
    dd, src = dataset_dict(tmp_path)
    before = tree_digest(src)
    manifest, result = run(cli, src, tmp_path / "out", "--keep", "label")
    assert tree_digest(src) == before
    out = datasets.load_from_disk(str(tmp_path / "out"))
    assert isinstance(out, datasets.DatasetDict) and list(out) == ["train", "test"]
    kept = datasets.Features({k: v for k, v in FEATURES.items() if k in ("image", "label", "embedding", "grid", "counts")})
    for split in ("train", "test"):
        assert out[split].features == kept and len(out[split]) == len(dd[split])
        assert out[split]["label"] == dd[split]["label"]
        assert pixels(out[split]).shape == pixels(dd[split]).shape
        assert not np.array_equal(pixels(out[split]), pixels(dd[split]))
        assert not np.array_equal(np.asarray(out[split]["grid"]), np.asarray(dd[split]["grid"]))
        state = json.loads((tmp_path / "out" / split / "state.json").read_text())
        original = json.loads((src / split / "state.json").read_text())
        assert state["_data_files"] == original["_data_files"] and state["_fingerprint"] != original["_fingerprint"]
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")) == \
        sorted(p.relative_to(src).as_posix() for p in src.rglob("*"))
    assert json.loads((tmp_path / "out" / "dataset_dict.json").read_text()) == {"splits": ["train", "test"]}
    assert manifest["splits"] == [{"name": "train", "rows": 10}, {"name": "test", "rows": 4}]
    assert manifest["row_records"]["records"] == 14
    assert {e["name"] for e in manifest["dropped"]} >= {"age", "caption"}
    assert "a DatasetDict of 2 splits (train: 10 rows, test: 4 rows)" in result.stderr


def test_a_dataset_dicts_files_follow_the_keep_rule_split_by_split(cli, tmp_path):
    _, src = dataset_dict(tmp_path, train_shards=1)
    info = json.loads((src / "test" / "dataset_info.json").read_text())
    info["description"] = "photos of Alice's family"
    (src / "test" / "dataset_info.json").write_text(json.dumps(info))
    (src / "train" / "cache-0123.arrow").write_bytes((src / "train" / "data-00000-of-00001.arrow").read_bytes())
    manifest, _ = run(cli, src, tmp_path / "out")
    dropped = {e["name"] for e in manifest["dropped"]}
    assert {"train/cache-0123.arrow", "test/dataset_info.json@description"} <= dropped
    assert not (tmp_path / "out" / "train" / "cache-0123.arrow").exists()
    assert "Alice" not in (tmp_path / "out" / "test" / "dataset_info.json").read_text()
    run(cli, src, tmp_path / "kept", "--keep", "test/dataset_info.json@description")
    kept = datasets.load_from_disk(str(tmp_path / "kept"))
    assert kept["test"].info.description == info["description"] and not kept["train"].info.description


def test_a_split_is_released_alone_by_its_folder_and_dataset_names_columns(cli, tmp_path):
    _, src = dataset_dict(tmp_path)
    manifest, _ = run(cli, src / "test", tmp_path / "test_out")
    assert len(datasets.load_from_disk(str(tmp_path / "test_out"))) == 4 and "splits" not in manifest
    result = cli("perturb", src, "--eps", "1", "--dataset", "train", *RANGES)
    assert_one_line_error(result, 1, "no column train", "train is a split: perturb its folder", str(src / "train"))
    result = cli("perturb", src, "--eps", "1", "--dataset", "grid", "--range", "0:1", "--out", tmp_path / "grid_only",
                 "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    out = datasets.load_from_disk(str(tmp_path / "grid_only"))
    assert list(out["test"].features) == ["grid"] and len(out["train"]) == 10
    assert manifest["records"] == 14
    assert not (tmp_path / "dd.tldp").exists()


def test_a_dataset_dict_whose_splits_differ_or_whose_index_is_damaged_is_refused_in_one_line(cli, tmp_path):
    _, src = dataset_dict(tmp_path)
    (src / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, f"{src / 'dataset_dict.json'}: names split validation", "not a dataset folder")
    (src / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../train"]}))
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, "names split '../train', which is not a split name")
    shutil.copytree(src / "train", src / "__MACOSX")  # a split name to datasets; a macOS archive's folder to tldp
    (src / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "__MACOSX"]}))
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, "names split __MACOSX, a folder tldp never reads")
    shutil.rmtree(src / "__MACOSX")
    (src / "dataset_dict.json").write_text("{not json")
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, str(src / "dataset_dict.json"))
    shutil.rmtree(src)
    datasets.DatasetDict({"train": hf_dataset(n=4), "test": hf_dataset(n=2).remove_columns("grid")}).save_to_disk(str(src))
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, "has other columns or types than train/data-00000-of-00001.arrow",
                          "perturb each split's folder on its own")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dd"]


def test_a_split_or_shard_given_twice_by_a_link_is_refused_in_one_line(cli, tmp_path):
    """Regression: a split folder linking to another split (or a state.json naming a shard
    twice, or two shard names linked to one file) released the same rows twice, each copy a
    record at the manifest's per-record figure, so a person in them spent twice that; a shard
    named twice failed after the work, "cannot write (File exists)"."""
    _, src = dataset_dict(tmp_path)
    shutil.rmtree(src / "test")
    (src / "test").symlink_to(src / "train", target_is_directory=True)
    result = cli("perturb", src, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, f"{src / 'test'}: the same split folder as {src / 'train'}", "released twice")
    _, one = saved(tmp_path / "single", shards=2)
    state = json.loads((one / "state.json").read_text())
    (one / "state.json").write_text(json.dumps(dict(state, _data_files=state["_data_files"][:1] * 2)))
    result = cli("perturb", one, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, f"{one / 'state.json'}: names data-00000-of-00002.arrow twice")
    (one / "state.json").write_text(json.dumps(state))
    (one / "data-00001-of-00002.arrow").unlink()
    (one / "data-00001-of-00002.arrow").symlink_to(one / "data-00000-of-00002.arrow")
    result = cli("perturb", one, "--eps", "1", *RANGES)
    assert_one_line_error(result, 1, f"{one / 'data-00001-of-00002.arrow'}: the same file as "
                          f"{one / 'data-00000-of-00002.arrow'}", "released twice")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dd", "single"]
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["train"]


def test_state_json_keeps_datasets_own_keys_only(cli, tmp_path):
    """Regression: state.json was copied whole but its _fingerprint, so a key datasets never
    writes (another tool's note) and the data files' other fields reached the output raw. Now
    the keys save_to_disk writes are kept, the data files by their names; any other key is
    left out and listed as SPLIT/state.json@KEY unless --keep names it."""
    _, src = dataset_dict(tmp_path, train_shards=1)
    written = {}  # split -> state.json as datasets wrote it
    for split in ("train", "test"):
        state = written[split] = json.loads((src / split / "state.json").read_text())
        planted = dict(state, notes="exported for Alice Smith",
                       _data_files=[dict(state["_data_files"][0], source="/home/alice/clinic/scans.csv")])
        (src / split / "state.json").write_text(json.dumps(planted))
    manifest, _ = run(cli, src, tmp_path / "out")
    for split in ("train", "test"):
        text = (tmp_path / "out" / split / "state.json").read_text()
        assert "Alice" not in text and "alice" not in text
        assert json.loads(text) == dict(written[split], _fingerprint=json.loads(text)["_fingerprint"])
    assert {"train/state.json@notes", "test/state.json@notes"} <= {e["name"] for e in manifest["dropped"]}
    assert len(datasets.load_from_disk(str(tmp_path / "out"))["test"]) == 4
    run(cli, src, tmp_path / "kept", "--keep", "test/state.json@notes")
    assert json.loads((tmp_path / "kept" / "test" / "state.json").read_text())["notes"] == "exported for Alice Smith"
    assert "notes" not in json.loads((tmp_path / "kept" / "train" / "state.json").read_text())


def test_a_later_shards_own_schema_metadata_is_listed_as_dropped(cli, tmp_path):
    """The output's shards are all written with the first shard's schema metadata. Regression:
    a later shard's own keys (a split's shard that another tool wrote: a note, a column's
    description) were left out without a word in the manifest."""
    _, src = dataset_dict(tmp_path, train_shards=1)
    shard = src / "test" / "data-00000-of-00001.arrow"
    table = pa.ipc.open_stream(shard.read_bytes()).read_all()  # in memory: the file is written over
    grid = table.schema.field("grid").with_metadata({b"description": b"Alice's scans"})
    schema = table.schema.set(table.schema.get_field_index("grid"), grid)
    schema = schema.with_metadata({**schema.metadata, b"exported_by": b"alice@clinic"})
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table.cast(schema))
    manifest, _ = run(cli, src, tmp_path / "out")
    dropped = {e["name"]: e["kind"] for e in manifest["dropped"]}
    assert dropped["test/data-00000-of-00001.arrow@exported_by"] == "schema metadata key"
    assert dropped["test/data-00000-of-00001.arrow@grid.description"] == "schema metadata key"
    assert not any(name.startswith("train/") and "@" in name and "dataset_info" not in name for name in dropped)
    assert b"alice" not in (tmp_path / "out" / "test" / "data-00000-of-00001.arrow").read_bytes().lower()
    assert len(datasets.load_from_disk(str(tmp_path / "out"))["test"]) == 4


class DatasetDictRoundTrip(RoundTrip):
    format = "hf-dataset"
    extra_args = RANGES

    def make_input(self, tmp_path):
        return dataset_dict(tmp_path)[1]

    def read_arrays(self, path):
        dd = datasets.load_from_disk(str(path))
        return {f"{split}/{name}": values for split in dd for name, values in (
            ("image", pixels(dd[split])), ("embedding", np.asarray(dd[split]["embedding"])),
            ("grid", np.asarray(dd[split]["grid"])), ("counts", np.asarray(dd[split]["counts"])))}

    def assert_same_structure(self, original, perturbed):
        assert sorted(p.relative_to(perturbed).as_posix() for p in perturbed.rglob("*")) == \
            sorted(p.relative_to(original).as_posix() for p in original.rglob("*"))
        dd = datasets.load_from_disk(str(perturbed))
        assert {split: len(ds) for split, ds in dd.items()} == {"train": 10, "test": 4}
        assert all(list(ds.features) == ["image", "embedding", "grid", "counts"] for ds in dd.values())


def _embedding_run(cli, src, out, *more):
    result = cli("perturb", src, "--eps", "2", "--out", out, "--range", "embedding=0:1", "--json", *more)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_feature_ids_dataset_name_and_version_description_are_left_out_unless_kept(cli, tmp_path):
    """Regression: every feature's optional `id` (free text, `Value("float32", id=...)`), the
    dataset_name (a local folder's name) and the version's description were copied raw into
    dataset_info.json and the shards' `huggingface` schema metadata."""
    features = datasets.Features({
        "embedding": datasets.Sequence(datasets.Value("float32", id="MARK_VALUE"), length=4),
        "label": datasets.ClassLabel(names=["cat", "dog"], id="MARK_LABEL")})
    info = datasets.DatasetInfo(dataset_name="alice_smith_scans",
                                version=datasets.Version("1.2.3", description="MARK_VERSION"), features=features)
    rng = np.random.default_rng(0)
    ds = datasets.Dataset.from_dict({"embedding": rng.uniform(0, 1, (8, 4)).astype(np.float32).tolist(),
                                     "label": [i % 2 for i in range(8)]}, features=features, info=info)
    ds.save_to_disk(str(tmp_path / "train"))
    src = tmp_path / "train"
    assert "MARK_VALUE" in (src / "dataset_info.json").read_text()  # the library writes them
    manifest = _embedding_run(cli, src, tmp_path / "out", "--keep", "label")
    dropped = {e["name"]: e for e in manifest["dropped"]}
    assert {"dataset_info.json@features.embedding.feature.id", "dataset_info.json@features.label.id",
            "huggingface@features.embedding.feature.id", "huggingface@features.label.id",
            "dataset_info.json@dataset_name", "dataset_info.json@version.description"} <= set(dropped)
    assert dropped["huggingface@features.label.id"]["kind"] == "feature id"
    out = tmp_path / "out"
    texts = [p.read_bytes() for p in out.iterdir()]
    for marker in (b"MARK_", b"alice_smith"):
        assert not any(marker in text for text in texts), marker
    loaded = datasets.load_from_disk(str(out))
    assert loaded.features == datasets.Features({
        "embedding": datasets.Sequence(datasets.Value("float32"), length=4),
        "label": datasets.ClassLabel(names=["cat", "dog"])})
    assert loaded.info.version == datasets.Version("1.2.3") and loaded["label"] == ds["label"]
    _embedding_run(cli, src, tmp_path / "kept", "--keep", "label", "--keep", "*.id",
                   "--keep", "dataset_info.json@dataset_name", "--keep", "dataset_info.json@version.description")
    kept = datasets.load_from_disk(str(tmp_path / "kept"))
    assert kept.features == features and kept.info.dataset_name == "alice_smith_scans"
    assert kept.info.version.description == "MARK_VERSION"
    with pa.memory_map(str(tmp_path / "kept" / "data-00000-of-00001.arrow")) as f:
        assert b"MARK_LABEL" in pa.ipc.open_stream(f).schema.metadata[b"huggingface"]


def test_a_struct_field_named_id_is_a_column_not_a_feature_id(cli, tmp_path):
    """A struct's fields are names (a dict without _type): its field `id` stays."""
    features = datasets.Features({"embedding": datasets.Sequence(datasets.Value("float32"), length=4),
                                  "meta": {"id": datasets.Value("int64")}})
    ds = datasets.Dataset.from_dict({"embedding": np.ones((4, 4), np.float32).tolist(),
                                     "meta": [{"id": i} for i in range(4)]}, features=features)
    ds.save_to_disk(str(tmp_path / "train"))
    manifest = _embedding_run(cli, tmp_path / "train", tmp_path / "out", "--keep", "meta")
    assert not [e for e in manifest["dropped"] if e["kind"] == "feature id"]
    assert datasets.load_from_disk(str(tmp_path / "out")).features == features
