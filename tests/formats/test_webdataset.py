"""WebDataset shards, written with webdataset's TarWriter and ShardWriter and read back
with webdataset.WebDataset: a folder, one .tar or a brace pattern of shards in one run."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import braceexpand
import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from tests.builders import (SEED, RoundTrip, assert_one_line_error, run_measured, siblings, tree_digest,
                            validate_manifest)
from tldp_cli.formats import webdataset_shards

MTIME = 1_700_000_000
SECRET = "Alice Smith"


def image(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w) if channels == 1 else (h, w, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def png_bytes(values: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(values).save(out, format="PNG")
    return out.getvalue()


def shards(folder: Path, samples: int = 7, per_shard: int = 3, **extra) -> Path:
    """Samples written as people write them (ShardWriter): an RGB jpg, a .npy array, a
    class and a JSON record naming a person."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=per_shard, verbose=0, mtime=MTIME) as sink:
        for i in range(samples):
            sink.write({"__key__": f"sample{i:04d}", "jpg": image(16, 12, seed=i),
                        "npy": np.random.default_rng(100 + i).integers(0, 256, (4, 5)).astype(np.uint8),
                        "cls": i % 3, "json": {"name": SECRET, "age": 40 + i}, **extra})
    return folder


def read_samples(urls, decode: str = "rgb8") -> list[dict]:
    dataset = wds.WebDataset(urls, shardshuffle=False).decode(decode)
    return [{k: v for k, v in sample.items() if not k.startswith("__") or k == "__key__"} for sample in dataset]


def shard_urls(folder: Path) -> list[str]:
    return [str(p) for p in sorted(folder.rglob("*.tar"))]


def run(cli, src, out: Path, *more) -> dict:
    result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, *more)
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    validate_manifest(manifest)
    return manifest


class WebDatasetRoundTrip(RoundTrip):
    format = "webdataset"

    def make_input(self, tmp_path):
        root = tmp_path / "shards"
        root.mkdir()
        with wds.TarWriter(str(root / "a.tar"), mtime=MTIME) as sink:
            sink.write({"__key__": "x/0", "png": image(9, 7, 3), "depth.npy": np.arange(12, dtype=np.uint8).reshape(3, 4),
                        "cls": 1})
            sink.write({"__key__": "x/1", "png": image(5, 6, 1, seed=1), "cls": 2})
        with wds.TarWriter(str(root / "b.tar"), mtime=MTIME) as sink:
            sink.write({"__key__": "y", "png": png_bytes(image(4, 4, 4, seed=2)), "txt": SECRET})
        return root

    def read_arrays(self, path):
        found = {}
        for sample in read_samples(shard_urls(path), decode="pil"):
            for ext, value in sample.items():
                if ext == "png":
                    found[f"{sample['__key__']}.png"] = np.asarray(value)[..., :3] if value.mode == "RGBA" \
                        else np.asarray(value)
                elif ext.endswith("npy"):
                    found[f"{sample['__key__']}.{ext}"] = value
        return found

    def assert_same_structure(self, original, perturbed):
        assert sorted(p.name for p in perturbed.iterdir()) == ["a.tar", "b.tar"]
        for name in ("a.tar", "b.tar"):
            with tarfile.open(original / name) as a, tarfile.open(perturbed / name) as b:
                kept = [m.name for m in a.getmembers() if not m.name.endswith((".cls", ".txt"))]
                assert [m.name for m in b.getmembers()] == kept
                assert all((m.uid, m.gid, m.uname, m.gname, m.mtime) == (0, 0, "", "", 0) for m in b)
        with tarfile.open(perturbed / "b.tar") as tar, Image.open(tar.extractfile("y.png")) as rgba:
            assert (rgba.mode, rgba.size) == ("RGB", (4, 4))  # the alpha channel left out (unless --keep alpha)


def test_webdataset_iterates_the_output_with_the_same_samples(cli, tmp_path):
    src = shards(tmp_path / "shards")
    before = tree_digest(src)
    out = tmp_path / "out"
    manifest = run(cli, src, out)
    assert tree_digest(src) == before
    assert sorted(siblings(out)) == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    original, perturbed = read_samples(shard_urls(src)), read_samples(shard_urls(out))
    assert [s["__key__"] for s in perturbed] == [s["__key__"] for s in original]
    for a, b in zip(original, perturbed):
        assert set(b) == {"__key__", "png", "npy"}  # the jpg is a png now; labels dropped
        assert b["png"].shape == a["jpg"].shape and b["png"].dtype == np.uint8
        assert b["npy"].shape == a["npy"].shape and b["npy"].dtype == np.int16  # exact noise on uint8
        assert not np.array_equal(b["npy"], a["npy"])
    raw = b"".join(p.read_bytes() for p in out.iterdir())
    assert SECRET.encode() not in raw and b"bigdata" not in raw  # the JSON label, TarWriter's owner
    dropped = {e["name"]: e for e in manifest["dropped"]}
    assert dropped["cls"]["members"] == 7 and dropped["json"]["members"] == 7
    assert manifest["webdataset"] == {"shards": 3, "samples": 7, "perturbed_members": 14, "members_renamed": 7}
    assert len(manifest["inputs"]) == 14 and manifest["inputs"][0]["dataset"] == "sample0000.jpg"
    # a sample's image and array are one subject's record
    assert manifest["row_datasets"][0] == ["train-000000.tar/sample0000.png", "train-000000.tar/sample0000.npy"]
    assert manifest["row_records"]["records"] == 7


def test_evaluate_pairs_the_members_of_the_output(cli, tmp_path):
    src = shards(tmp_path / "shards", samples=4)
    out = tmp_path / "out"
    run(cli, src, out)
    result = cli("evaluate", src, out, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["sha256"]["passed"] and "8 array(s)" in checks["shapes"]["detail"]


def test_keep_copies_the_named_labels_raw_and_lists_them(cli, tmp_path):
    src = shards(tmp_path / "shards")
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--keep", "cls")
    for a, b in zip(read_samples(shard_urls(src)), read_samples(shard_urls(out))):
        assert b["cls"] == a["cls"] and "json" not in b
    assert [e for e in manifest["unperturbed"] if e["kind"] != "name"] == [
        {"name": "cls", "kind": "member", "members": 7, "reason": "kept by --keep"}]
    assert [e["name"] for e in manifest["dropped"]] == ["json"]
    typo = cli("perturb", src, "--eps", "1", "--out", tmp_path / "o2", "--keep", "clss")
    assert_one_line_error(typo, 2, "--keep clss matches no")


def test_budget_record_spreads_eps_over_a_samples_members(cli, tmp_path):
    src = shards(tmp_path / "shards", samples=4)
    manifest = run(cli, src, tmp_path / "out", "--budget", "record", "--eps", "50")
    assert manifest["accounting"]["per_record"]["epsilon"] <= 50 + 1e-9
    assert manifest["accounting"]["per_record"]["epsilon"] > 40


def test_a_brace_pattern_reads_the_shards_it_names(cli, tmp_path):
    src = shards(tmp_path / "shards", samples=9)
    pattern = str(src / "train-{000001..000002}.tar")
    before = tree_digest(src)
    result = cli("perturb", pattern, "--eps", "1", "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "shards.tldp"  # beside the folder that holds the shards
    assert sorted(siblings(out)) == ["train-000001.tar", "train-000002.tar"]
    assert [s["__key__"] for s in read_samples(shard_urls(out))] == [f"sample{i:04d}" for i in range(3, 9)]
    assert tree_digest(src) == before
    missing = cli("perturb", str(src / "train-{000002..000004}.tar"), "--eps", "1", "--out", tmp_path / "x")
    assert_one_line_error(missing, 1, "train-000003.tar: no such shard")


@pytest.mark.parametrize("pattern", ["s-{0..3}.tar", "s-{00..10}.tar", "{a,b}/s-{1..2}.tar", "s-{3..1}.tar",
                                     "x{y}.tar", "s-{000000..000002}.tar"])
def test_brace_patterns_expand_as_webdataset_expands_them(pattern):
    assert webdataset_shards.expand_braces(pattern) == list(braceexpand.braceexpand(pattern))


@pytest.mark.parametrize("pattern", ["s-{a,{b,c}}.tar", "s-{0..2.tar", "s-0..2}.tar", "s-}{.tar"])
def test_nested_or_unbalanced_braces_are_refused(cli, tmp_path, pattern):
    result = cli("perturb", str(tmp_path / pattern), "--eps", "1")
    assert_one_line_error(result, 2, "braces")


def test_one_tar_is_an_input_and_its_output_a_folder(cli, tmp_path):
    src = tmp_path / "one.tar"
    with wds.TarWriter(str(src)) as sink:
        sink.write({"__key__": "k", "png": image(6, 6, 1), "cls": 3})
    result = cli("perturb", src, "--eps", "1", "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "one.tldp"
    assert siblings(out) == {"one.tar"}
    (sample,) = read_samples(str(out / "one.tar"), "l8")
    assert sample["png"].shape == (6, 6)
    again = cli("perturb", src, "--eps", "1", "--format", "webdataset", "--out", tmp_path / "o2")
    assert again.exit_code == 0, again.stderr


def test_an_output_named_like_a_tar_file_is_refused(cli, tmp_path):
    """Regression: `--out released.tar` on one shard made a folder named released.tar (holding
    one.tar), which webdataset.WebDataset("released.tar") cannot open."""
    src = tmp_path / "one.tar"
    with wds.TarWriter(str(src)) as sink:
        sink.write({"__key__": "k", "png": image(6, 6, 1)})
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--out", tmp_path / "released.tar"), 2,
                          "released.tar", "is a folder", "one.tldp")
    assert siblings(tmp_path) == before


def test_a_tar_shard_is_no_longer_refused(cli, tmp_path):
    """Regression: before, `tldp perturb shard.tar` said "not a dataset tldp can read"."""
    src = tmp_path / "shard.tar"
    with wds.TarWriter(str(src)) as sink:
        sink.write({"__key__": "k", "jpg": image(8, 8)})
    result = cli("perturb", src, "--eps", "1")
    assert result.exit_code == 0, result.stderr
    assert "not a dataset" not in result.stderr


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _info(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = size, kind, link
    return info


@pytest.mark.parametrize("bad, fragment", [
    (_info("/etc/0.png"), "absolute"),
    (_info("../0.png"), "climbs out"),
    (_info("a/../../0.png"), "climbs out"),
    (_info("1.png", kind=tarfile.SYMTYPE, link="/etc/passwd"), "symbolic link"),
    (_info("1.png", kind=tarfile.LNKTYPE, link="0.png"), "hard link"),
    (_info("1.png", kind=tarfile.CHRTYPE), "device"),
    (_info("1.png", kind=tarfile.FIFOTYPE), "FIFO"),
])
def test_members_that_escape_or_are_not_files_are_refused(cli, tmp_path, bad, fragment):
    data = png_bytes(image(4, 4))
    src = _tar(tmp_path / "bad.tar", [(_info("0.png", len(data)), data), (bad, None)])
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--out", out)
    assert_one_line_error(result, 1, str(src), fragment)
    assert not out.exists() and siblings(tmp_path) == {"bad.tar"}


@pytest.mark.parametrize("option", ["--copy-other", "--skip-bad", "--dataset=x", "--image-format=tiff"])
def test_image_folder_options_are_refused(cli, tmp_path, option):
    src = shards(tmp_path / "shards", samples=1)
    assert_one_line_error(cli("perturb", src, "--eps", "1", option), 2, str(src), option.split("=")[0])


def test_a_truncated_shard_and_a_compressed_one_are_refused(cli, tmp_path):
    data = png_bytes(image(30, 30))
    src = _tar(tmp_path / "cut.tar", [(_info("0.png", len(data)), data)])
    src.write_bytes(src.read_bytes()[:800])
    assert_one_line_error(cli("perturb", src, "--eps", "1"), 1, str(src))
    packed = tmp_path / "packed.tar.gz"
    with wds.TarWriter(str(packed)) as sink:
        sink.write({"__key__": "k", "png": image(4, 4)})
    assert_one_line_error(cli("perturb", packed, "--eps", "1"), 1, "compressed shard", "decompress")


def test_two_images_of_one_key_written_as_one_png_are_refused(cli, tmp_path):
    a, b = png_bytes(image(4, 4)), png_bytes(image(4, 4, seed=1))
    src = _tar(tmp_path / "s.tar", [(_info("k.jpg", len(a)), a), (_info("k.png", len(b)), b)])
    assert_one_line_error(cli("perturb", src, "--eps", "1"), 1, "k.jpg and k.png", "k.png")


def dicom_bytes() -> bytes:
    return b"\0" * 128 + b"DICM" + b"\x10\x00\x10\x00PN\x0c\x00" + SECRET.encode() + b" "


@pytest.mark.parametrize("name", ["k.dcm", "k.scan"])
def test_a_dicom_member_is_dropped_with_the_reason_even_when_kept(cli, tmp_path, name):
    """Issue 29 item 5 inside a shard: never perturbed, never copied, the reason given."""
    image_data, scan = png_bytes(image(4, 4)), dicom_bytes()
    src = _tar(tmp_path / "s.tar", [(_info("k.png", len(image_data)), image_data), (_info(name, len(scan)), scan)])
    out = tmp_path / "out"
    extension = name.split(".", 1)[1]
    result = cli("perturb", src, "--eps", "1", "--out", out, "--keep", extension)
    assert result.exit_code == 0, result.stderr
    assert "DICOM" in result.stderr and "not even with --keep" in result.stderr
    with tarfile.open(out / "s.tar") as tar:
        assert tar.getnames() == ["k.png"]
    assert SECRET.encode() not in (out / "s.tar").read_bytes()
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    (entry,) = manifest["dropped"]
    assert entry["name"] == extension and "DICOM" in entry["reason"] and "never copied" in entry["reason"]
    assert [e["name"] for e in manifest["unperturbed"]] == ["sample keys"]


def test_a_torch_checkpoint_member_is_dropped_with_the_reason_even_when_kept(cli, tmp_path):
    """Regression: a .pt member written by torch.save (a pickle in a zip, not a raw pickle)
    was a label member, copied raw by --keep pt; pickles are never copied."""
    from tests.formats.test_sharded_models import torch_saved

    saved = torch_saved(tmp_path / "state.pt", {"owner": SECRET, "exp_avg": [0.1, 0.2]}).read_bytes()
    src = shards(tmp_path / "in", samples=3, pt=saved)
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--keep", "pt")
    for sample in read_samples(shard_urls(out)):
        assert "pt" not in sample
    assert all(saved not in p.read_bytes() for p in out.rglob("*.tar"))
    entry = {e["name"]: e for e in manifest["dropped"]}["pt"]
    assert entry["members"] == 3 and "PyTorch checkpoint" in entry["reason"] and "never copied" in entry["reason"]


def test_images_in_formats_tldp_does_not_read_are_never_copied_even_when_kept(cli, tmp_path):
    """Regression: --keep gif copied a sample's GIF image (the record itself, beside its
    perturbed PNG) raw; an image folder's --copy-other never copies such images."""
    def encoded(values: np.ndarray, fmt: str) -> bytes:
        out = io.BytesIO()
        Image.fromarray(values).save(out, format=fmt)
        return out.getvalue()

    src = tmp_path / "in"
    src.mkdir()
    with wds.TarWriter(str(src / "s.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"k{i}", "png": png_bytes(image(6, 6, seed=i)),
                        "gif": encoded(image(6, 6, seed=i), "GIF"), "face.ppm": encoded(image(6, 6, seed=i), "PPM"),
                        "cls": i})
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out", "--keep", "gif", "--keep", "face.ppm",
                 "--keep", "cls")
    assert result.exit_code == 0, result.stderr
    with tarfile.open(tmp_path / "out" / "s.tar") as tar:
        assert sorted(tar.getnames()) == ["k0.cls", "k0.png", "k1.cls", "k1.png", "k2.cls", "k2.png"]
    dropped = {e["name"]: e for e in json.loads((tmp_path / "out.manifest.json").read_text())["dropped"]}
    for name, kind in [("gif", "GIF"), ("face.ppm", "PPM")]:
        assert dropped[name]["members"] == 3 and f"does not read ({kind};" in dropped[name]["reason"]
        assert f"dropped the {name} members (3 members)" in result.stderr


def test_copy_other_never_copies_a_shard_out_of_an_image_folder(cli, tmp_path):
    """A .tar beside images holds data tldp reads: --copy-other leaves it out (before, it was copied)."""
    folder = tmp_path / "photos"
    folder.mkdir()
    Image.fromarray(image(5, 5)).save(folder / "a.png")
    with wds.TarWriter(str(folder / "more.tar")) as sink:
        sink.write({"__key__": "k", "png": image(4, 4)})
    out = tmp_path / "out"
    result = cli("perturb", folder, "--eps", "1", "--copy-other", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert siblings(out) == {"a.png"}
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert [e["name"] for e in manifest["dropped"]] == ["more.tar"]


def test_files_beside_the_shards_are_dropped_or_kept_by_name(cli, tmp_path):
    src = shards(tmp_path / "shards", samples=2)
    (src / "README.md").write_text(f"collected from {SECRET}\n")
    out = tmp_path / "out"
    manifest = run(cli, src, out)
    assert "README.md" not in siblings(out)
    assert {"name": "README.md", "kind": "file", "reason": "a file beside the shards, not perturbed"} in manifest["dropped"]
    kept = run(cli, src, tmp_path / "kept", "--keep", "README.md")
    assert (tmp_path / "kept" / "README.md").read_text() == (src / "README.md").read_text()
    assert {"name": "README.md", "kind": "file", "reason": "kept by --keep"} in kept["unperturbed"]
    (src / "scan.dcm").write_bytes(dicom_bytes())  # a DICOM file beside the shards: never copied
    dicom = run(cli, src, tmp_path / "dicom", "--keep", "scan.dcm")
    assert not (tmp_path / "dicom" / "scan.dcm").exists()
    (entry,) = [e for e in dicom["dropped"] if e["name"] == "scan.dcm"]
    assert entry["reason"].startswith("DICOM") and "never copied raw" in entry["reason"]


@pytest.mark.slow
def test_memory_stays_flat_however_many_members_a_shard_holds(tmp_path):
    """Members are written as their records come back: 32 members of 4 MB (128 MB of
    int16 output) peak no higher than 4 of them."""
    rng = np.random.default_rng(0)
    peaks = {}
    for count in (4, 32):
        src = tmp_path / f"s{count}.tar"
        with wds.TarWriter(str(src)) as sink:
            for i in range(count):
                sink.write({"__key__": f"k{i:03d}", "npy": rng.integers(0, 256, (2048, 2048), dtype=np.uint8),
                            "cls": i})
        code, stderr, peaks[count] = run_measured(tmp_path, "perturb", src, "--eps", "1", "--workers", "1",
                                                  "--out", tmp_path / f"o{count}")
        assert code == 0, stderr
    assert peaks[32] < peaks[4] + 24 * 2**20, peaks


def test_links_in_a_folder_are_skipped_and_a_pattern_follows_them(cli, tmp_path):
    """As the Hugging Face cache keeps shards: a snapshot folder of links to blobs."""
    blobs = shards(tmp_path / "blobs", samples=4)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for shard in sorted(blobs.iterdir()):
        (snapshot / shard.name).symlink_to(shard)
    assert_one_line_error(cli("perturb", snapshot, "--eps", "1"), 1, "2 symbolic links", "pattern")
    out = tmp_path / "out"
    run(cli, str(snapshot / "train-{000000..000001}.tar"), out)
    assert sorted(siblings(out)) == ["train-000000.tar", "train-000001.tar"]


def test_alpha_channels_are_left_out_unless_keep_alpha_names_them(cli, tmp_path):
    """Regression: an image member's alpha channel was copied raw by default (only listed
    under unperturbed), though a cut-out's alpha is its subject's silhouette. It is left out
    now (RGBA written as RGB, LA as L), listed under dropped and named by the summary line;
    --keep alpha copies it raw, listed under unperturbed; evaluate pairs either output."""
    folder = tmp_path / "shards"
    folder.mkdir()
    rgba, la = image(6, 6, 4), image(5, 4, 2, seed=1)
    with wds.TarWriter(str(folder / "a.tar")) as sink:
        sink.write({"__key__": "k", "png": png_bytes(rgba)})
        sink.write({"__key__": "j", "png": png_bytes(image(6, 6, 3))})
        sink.write({"__key__": "m", "png": png_bytes(la)})

    def written(out: Path) -> dict[str, Image.Image]:
        with tarfile.open(out / "a.tar") as tar:
            found = {m.name: Image.open(io.BytesIO(tar.extractfile(m).read())) for m in tar.getmembers()}
        return {name: image.copy() for name, image in found.items()}

    result = cli("perturb", folder, "--eps", "1", "--out", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    (entry,) = manifest["dropped"]
    assert entry["name"] == "alpha" and entry["kind"] == "alpha channel" and "2 image members" in entry["reason"]
    assert [e["kind"] for e in manifest["unperturbed"]] == ["name"]  # the sample keys only
    assert "dropped alpha channels" in result.stderr
    out = written(tmp_path / "out")
    assert {name: (im.mode, im.size) for name, im in out.items()} == {
        "k.png": ("RGB", (6, 6)), "j.png": ("RGB", (6, 6)), "m.png": ("L", (4, 5))}
    assert cli("evaluate", folder, tmp_path / "out", "--json", "-q").exit_code == 0
    result = cli("perturb", folder, "--eps", "1", "--out", tmp_path / "kept", "--json", "--keep", "alpha")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    (entry,) = [e for e in manifest["unperturbed"] if e["kind"] != "name"]
    assert entry["name"] == "alpha" and entry["kind"] == "alpha channel" and "2 image members" in entry["reason"]
    assert "alpha" in result.stderr.split("copied unchanged: ")[1] and "dropped" not in manifest
    kept = written(tmp_path / "kept")
    assert (kept["k.png"].mode, kept["m.png"].mode) == ("RGBA", "LA")
    assert np.array_equal(np.asarray(kept["k.png"])[..., 3], rgba[..., 3])
    assert np.array_equal(np.asarray(kept["m.png"])[..., 1], la[..., 1])
    assert cli("evaluate", folder, tmp_path / "kept", "--json", "-q").exit_code == 0


def test_a_key_that_comes_back_later_in_its_shard_is_one_record(cli, tmp_path):
    """Regression: members of one key apart in the shard (k0.png, k1.png, k0.depth.png) were
    two records, each with the figure of one member, though they are one subject's."""
    folder = tmp_path / "shards"
    folder.mkdir()
    members = [(name, png_bytes(image(4, 4, 1, seed=i))) for i, name in
               enumerate(("k0.png", "k1.png", "k0.depth.png"))]
    _tar(folder / "a.tar", [(_info(name, len(data)), data) for name, data in members])
    result = cli("perturb", folder, "--eps", "1", "--out", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["row_datasets"] == [["a.tar/k0.png", "a.tar/k0.depth.png"]]
    assert manifest["row_records"]["elements_per_record"] == 32
    assert manifest["webdataset"]["samples"] == 2


def test_a_glob_gives_every_float_member_its_range(cli, tmp_path):
    """Regression: shards of images and float `.npy` members (embeddings) could be perturbed
    only with one --range NAME=LO:HI per member (a bare --range applies to the images too,
    which then lie outside it); --range '*.npy=0:1' names them all, the images keep their
    dtype's range."""
    src = shards(tmp_path / "shards", samples=4, per_shard=2, **{"emb.npy": np.full(3, 0.5, np.float32)})
    manifest = run(cli, src, tmp_path / "out", "--range", "*.emb.npy=0:1")
    ranges = manifest["value_ranges"]
    assert {name: r for name, r in ranges.items() if name.endswith(".emb.npy")} == {
        f"train-00000{i // 2}.tar/sample{i:04d}.emb.npy": [0.0, 1.0] for i in range(4)}
    assert all(r == [0.0, 256.0] for name, r in ranges.items() if not name.endswith(".emb.npy"))
    result = cli("perturb", src, "--eps", "1", "--range", "*.emb.npy=0:1", "--range", "train-000000.tar/*=0:2")
    assert_one_line_error(result, 2, "has a range already")


def test_a_shard_given_beside_its_brace_pattern_is_refused_as_given_twice(cli, tmp_path):
    """Regression: `tldp perturb 'shards/train-{000000..000002}.tar' shards/train-000000.tar`
    released the shard twice, with noise of its own each time, each manifest stating one
    release (the check of inputs given twice compared the pattern's text, not its shards)."""
    src = shards(tmp_path / "shards")
    (tmp_path / "out").mkdir()
    pattern = f"{src}/train-{{000000..000002}}.tar"
    for second in (src / "train-000001.tar", src):
        result = cli("perturb", pattern, second, "--eps", "1", "--out", tmp_path / "out")
        assert_one_line_error(result, 2, "given twice" if second != src else "inside another input")
    assert siblings(tmp_path / "out") == set()
    result = cli("perturb", f"{src}/train-{{000000..000001}}.tar", src / "train-000002.tar", "--eps", "1",
                 "--out", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.stderr


def test_icc_profiles_are_dropped_unless_kept(cli, tmp_path):
    """An image member's ICC profile can hold free text (its description and copyright tags):
    left out and listed in dropped; --keep icc_profile writes it, listed under unperturbed."""
    from PIL import ImageCms

    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    src = tmp_path / "shards"
    src.mkdir()
    with wds.ShardWriter(str(src / "train-%06d.tar"), maxcount=3, verbose=0, mtime=MTIME) as sink:
        for i in range(4):
            buffer = io.BytesIO()
            Image.fromarray(image(8, 6, seed=i)).save(buffer, "PNG", icc_profile=icc)
            sink.write({"__key__": f"s{i}", "png": buffer.getvalue()})
    for out, keep in ((tmp_path / "out", ()), (tmp_path / "kept", ("--keep", "icc_profile"))):
        manifest = run(cli, src, out, "--range", "0:256", *keep)
        entries = [e for e in manifest["unperturbed" if keep else "dropped"] if e["kind"] != "name"]
        assert [(e["name"], e["kind"]) for e in entries] == [("icc_profile", "colour profile")]
        assert "4 image members" in entries[0]["reason"]
        for url in shard_urls(out):
            with tarfile.open(url) as tar:
                for member in tar.getmembers():
                    with Image.open(tar.extractfile(member)) as im:
                        assert im.info.get("icc_profile") == (icc if keep else None)


def test_member_times_are_constant_and_sample_keys_are_listed(cli, tmp_path):
    """Regression: each member's mtime was copied from the input (it can date when a subject
    was recorded), and the sample keys (often file names naming a person) were written raw
    without being listed. Now every mtime is 0 and the keys are listed under unperturbed."""
    src = tmp_path / "shards"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, name in enumerate(["alice_smith.png", "alice_smith.cls", "bob_jones.png"]):
            data = png_bytes(image(5, 4, seed=i)) if name.endswith("png") else b"1"
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_600_000_000 + 86_400 * i
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--range", "0:256")
    with tarfile.open(out / "a.tar") as tar:
        assert [(m.name, m.mtime) for m in tar.getmembers()] == [("alice_smith.png", 0), ("bob_jones.png", 0)]
    keys = [e for e in manifest["unperturbed"] if e["name"] == "sample keys"]
    assert len(keys) == 1 and keys[0]["kind"] == "name" and "2 samples" in keys[0]["reason"]


def named_shards(folder: Path) -> Path:
    """ShardWriter's shards whose keys are people's names, in a folder per person: 5 samples
    over 2 shards, each a jpg, a .npy and a class."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=3, verbose=0, mtime=MTIME) as sink:
        for i, person in enumerate(["alice_smith", "bob_jones", "carol_white", "dan_brown", "eve_black"]):
            sink.write({"__key__": f"{person}/photo", "jpg": image(8, 6, seed=i),
                        "npy": np.full((2, 3), i, np.uint8), "cls": i})
    return folder


def test_anonymize_names_numbers_the_samples_in_order(cli, tmp_path):
    """--anonymize-names: each sample's key becomes its number in order across the shards, in
    every one of its members' names (webdataset groups them as before, the kept class with its
    image); no key is in the manifest or the output; the name map beside the input pairs them."""
    src = named_shards(tmp_path / "shards")
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--range", "0:256", "--keep", "cls", "--anonymize-names")
    samples = read_samples(shard_urls(out))
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(5)]
    assert [s["cls"] for s in samples] == list(range(5))  # each sample's members stay together
    assert all(s["png"].shape == (8, 6, 3) and s["npy"].shape == (2, 3) for s in samples)
    with tarfile.open(src / "train-000001.tar") as before, tarfile.open(out / "train-000001.tar") as after:
        renamed = {"dan_brown/photo": "000003", "eve_black/photo": "000004"}
        assert after.getnames() == [renamed[name.split(".")[0]] + "." + name.split(".")[1].replace("jpg", "png")
                                    for name in before.getnames()]  # in the input's order
    text = json.dumps(manifest) + "".join(Path(u).read_bytes().decode("latin-1") for u in shard_urls(out))
    for person in ["alice_smith", "bob_jones", "carol_white", "dan_brown", "eve_black", "photo"]:
        assert person not in text
    assert "sample keys" not in {e["name"] for e in manifest["unperturbed"]}
    assert manifest["inputs"][0]["dataset"] == "000000.png"
    assert manifest["row_datasets"][0] == ["train-000000.tar/000000.png", "train-000000.tar/000000.npy"]
    name_map = tmp_path / "shards.name-map.json"
    document = json.loads(name_map.read_text())
    assert document["name_map_id"] == manifest["anonymized_names"]["name_map_id"]
    assert document["samples"] == {"train-000000.tar/alice_smith/photo": "000000",
                                   "train-000000.tar/bob_jones/photo": "000001",
                                   "train-000000.tar/carol_white/photo": "000002",
                                   "train-000001.tar/dan_brown/photo": "000003",
                                   "train-000001.tar/eve_black/photo": "000004"}
    assert name_map.stat().st_mode & 0o777 == 0o600
    evaluated = cli("evaluate", src, out, "--json", "-q")  # pairs the members without the name map
    assert evaluated.exit_code == 0, evaluated.stderr
    report = json.loads(evaluated.stdout)
    assert report["ok"] and {c["check"]: c for c in report["checks"]}["shapes"]["passed"]


def test_anonymize_names_leaves_out_folder_entries_and_members_without_a_key(cli, tmp_path):
    """A shard made by tar from a folder: its folder entries and a README (no extension, no
    key) carry the input's names, so neither is written; both are listed as dropped."""
    people = tmp_path / "people"
    (people / "alice_smith").mkdir(parents=True)
    (people / "alice_smith" / "0001.png").write_bytes(png_bytes(image(5, 4)))
    (people / "alice_smith" / "README").write_text("Alice Smith's photos")
    src = tmp_path / "shards"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tar:
        tar.add(people / "alice_smith", arcname="alice_smith")
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--range", "0:256", "--anonymize-names")
    with tarfile.open(out / "a.tar") as tar:
        assert tar.getnames() == ["000000.png"]
    dropped = {e["name"]: e["members"] for e in manifest["dropped"] if e["kind"] == "member"}
    assert dropped == {"folder entries": 1, "(no extension)": 1}
    assert "alice" not in json.dumps(manifest)


def test_anonymize_names_refuses_an_extension_no_other_sample_has(cli, tmp_path):
    """webdataset keys a member by its base name up to the first dot: alice.smith.jpg is key
    alice, extension smith.jpg. An extension that no other sample holds may be the rest of a
    name, so --anonymize-names refuses it, naming the shard and the member, and writes nothing
    (before, the output held 000000.smith.png and the manifest's dropped smith.cls)."""
    src = tmp_path / "shards"
    src.mkdir()
    with wds.TarWriter(str(src / "a.tar"), mtime=MTIME) as sink:
        sink.write({"__key__": "alice", "smith.jpg": image(8, 6, seed=0), "smith.cls": 0})
        sink.write({"__key__": "bob", "jones.jpg": image(8, 6, seed=1)})
    with tarfile.open(src / "a.tar") as tar:
        assert sorted(tar.getnames()) == ["alice.smith.cls", "alice.smith.jpg", "bob.jones.jpg"]
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, "--range", "0:256",
                 "--anonymize-names")
    assert_one_line_error(result, 1, str(src / "a.tar"), "member 'alice.smith.", "rename")
    assert siblings(tmp_path) == {"shards"}  # no output, manifest or name map
    assert run(cli, src, out, "--range", "0:256")["outputs"]  # without the option: the names as they are


def test_anonymize_names_keeps_the_field_names_keep_declares(cli, tmp_path):
    """Multi-part extensions that are field names (mask.seg.png) are kept where --keep declares
    them: webdataset reads the same fields back under the new keys, and the manifest lists the
    field name as kept. A label member's undeclared multi-part extension (meta.json) is dropped
    and listed without its name; a known type alone (jpg) needs no declaration."""
    src = tmp_path / "shards"
    src.mkdir()
    with wds.TarWriter(str(src / "a.tar"), mtime=MTIME) as sink:
        for i, person in enumerate(["alice_smith", "bob_jones", "carol_white"]):
            sample = {"__key__": person, "jpg": image(8, 6, seed=i), "mask.seg.png": image(8, 6, 1, seed=9 + i)}
            sink.write({**sample, "meta.json": {"id": i}} if i else sample)
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--range", "0:256", "--anonymize-names", "--keep", "mask.seg.png")
    samples = read_samples(shard_urls(out))
    assert [s["__key__"] for s in samples] == ["000000", "000001", "000002"]
    assert all(s["mask.seg.png"].shape == (8, 6, 3) for s in samples)
    assert {e["name"]: e["members"] for e in manifest["dropped"] if e["kind"] == "member"} == \
        {"(undeclared extension)": 2}
    assert {"name": "mask.seg.png", "kind": "field name", "members": 3,
            "reason": "kept by --keep (declared a field name, not part of a sample's name)"} in manifest["unperturbed"]
    assert "smith" not in json.dumps(manifest) and "meta.json" not in json.dumps(manifest)
    evaluated = cli("evaluate", src, out, "--json", "-q")  # reopens the original with the field declared
    assert evaluated.exit_code == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["ok"]


def test_anonymize_names_refuses_a_multi_part_extension_two_samples_share(cli, tmp_path):
    """Regression: an extension that is really part of a name, shared by two samples (two Smiths:
    a.smith.png and b.smith.png beside samples holding png), passed the check that another
    sample holds it, and --anonymize-names wrote 000000.smith.png. webdataset's key ends at the
    first dot of the base name, its decoders read the type from the last component: only a
    known type alone is public by rule, any other extension must be declared with --keep. The
    undeclared one is refused (nothing written); declared, it is kept and listed."""
    src = tmp_path / "shards"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tar:
        for name, seed in [("a.smith.png", 0), ("b.smith.png", 1), ("c.png", 2), ("d.png", 3)]:
            data = png_bytes(image(6, 5, seed=seed))
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, "--range", "0:256",
                 "--anonymize-names")
    assert_one_line_error(result, 1, str(src / "a.tar"), "member 'a.smith.png'", "--keep smith.png", "rename")
    assert siblings(tmp_path) == {"shards"}  # no output, manifest or name map
    manifest = run(cli, src, out, "--range", "0:256", "--anonymize-names", "--keep", "smith.png")
    with tarfile.open(out / "a.tar") as tar:
        assert tar.getnames() == ["000000.smith.png", "000001.smith.png", "000002.png", "000003.png"]
    assert {"name": "smith.png", "kind": "field name", "members": 2,
            "reason": "kept by --keep (declared a field name, not part of a sample's name)"} in manifest["unperturbed"]


def test_anonymize_names_lists_undeclared_label_extensions_without_their_names(cli, tmp_path):
    """Regression: a label member's extension that is part of a name (a.smith.json, b.smith.json)
    was listed by name in the manifest's dropped (smith.json) under --anonymize-names. It is now
    dropped and listed as an undeclared extension; a known type (cls) is still listed by name."""
    src = tmp_path / "shards"
    src.mkdir()
    with wds.TarWriter(str(src / "a.tar"), mtime=MTIME) as sink:
        for key in ("a", "b"):
            sink.write({"__key__": key, "png": image(6, 5), "smith.json": {"x": 1}, "cls": 1})
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--range", "0:256", "--anonymize-names")
    dropped = {e["name"]: e["members"] for e in manifest["dropped"] if e["kind"] == "member"}
    assert dropped == {"(undeclared extension)": 2, "cls": 2}
    assert "smith" not in json.dumps(manifest)
    with tarfile.open(out / "a.tar") as tar:
        assert tar.getnames() == ["000000.png", "000001.png"]


def test_plan_takes_anonymize_names_and_describes_what_perturb_writes(cli, tmp_path):
    """plan --anonymize-names says what perturb --anonymize-names would write: the keys numbered,
    no 'sample keys' written unchanged, no key in its lines or its JSON; it writes nothing."""
    src = named_shards(tmp_path / "shards")
    before = siblings(tmp_path)
    plain = cli("plan", src, "--eps", "1", "--range", "0:256")
    assert plain.exit_code == 0 and "sample keys" in plain.stderr
    planned = cli("plan", src, "--eps", "1", "--range", "0:256", "--anonymize-names", "--json")
    assert planned.exit_code == 0, planned.stderr
    assert "sample keys" not in planned.stderr and "renamed the keys of 5 samples" in planned.stderr
    for person in ["alice_smith", "eve_black", "photo"]:
        assert person not in planned.stdout + planned.stderr
    assert json.loads(planned.stdout)["inputs"][0]["dataset"] == "000000.png"
    assert siblings(tmp_path) == before
    manifest = run(cli, src, tmp_path / "out", "--range", "0:256", "--anonymize-names")
    assert json.loads(planned.stdout)["dropped"] == manifest["dropped"]


def test_an_explicit_dtype_that_does_not_apply_to_png_members_is_said(cli, tmp_path):
    """Regression: --dtype float32 on shards holding only images was accepted and ignored (the
    members are PNG of their own bit depth), while image folders said so. Said once, by perturb
    and plan, in the image folders' words; not without --dtype, nor where .npy members take it."""
    src = tmp_path / "images"
    src.mkdir()
    with wds.TarWriter(str(src / "train-000000.tar"), mtime=MTIME) as sink:
        for i in range(3):
            sink.write({"__key__": f"s{i}", "png": image(8, 6, seed=i), "cls": i})
    note = "--dtype float32 does not apply to PNG output: the image members are written at their own bit depth"
    for command in (("plan",), ("perturb", "--seed", SEED, "--out", tmp_path / "out")):
        given = cli(*command, src, "--eps", "1", "--dtype", "float32")
        assert given.exit_code == 0, given.stderr
        assert sum(note in line for line in given.stderr.splitlines()) == 1, given.stderr
        default = cli(*command, src, "--eps", "1", *(("--overwrite",) if command[0] == "perturb" else ()))
        assert default.exit_code == 0 and "--dtype" not in default.stderr, default.stderr
    decoded = read_samples(shard_urls(tmp_path / "out"), decode="rgb8")
    assert [s["png"].dtype for s in decoded] == [np.uint8] * 3
    mixed = cli("plan", shards(tmp_path / "mixed"), "--eps", "1", "--dtype", "float32")  # .npy members: float32
    assert mixed.exit_code == 0 and "does not apply" not in mixed.stderr, mixed.stderr


def test_anonymize_names_withholds_the_input_folder_and_the_names_of_what_it_leaves_out(cli, tmp_path):
    """Regression: under --anonymize-names the manifest still named the input's folder in every
    `inputs` path (shards/alice_smith_sessions/a.tar), each file beside the shards it dropped
    (notes on alice smith.txt) and each symbolic link it skipped, and the messages listed them,
    where an image folder's manifest names none of its input's names (counts instead, the names
    in the name map). Now the same: `path` is the shard's name as the output holds it, the files
    and links are counts, and the name map lists them."""
    src = tmp_path / "alice_smith_sessions"
    named_shards(src)
    (src / "notes on alice smith.txt").write_text("private")
    np.save(src / "alice smith raw.npy", np.zeros(3))  # data: never copied
    (src / "link to alice smith.tar").symlink_to(src / "train-000000.tar")
    out = tmp_path / "out"
    result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, "--range", "0:256",
                 "--anonymize-names")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out.manifest.json").read_text())
    validate_manifest(manifest)
    assert "alice" not in json.dumps(manifest).lower()
    assert {i["path"] for i in manifest["inputs"]} == {"train-000000.tar", "train-000001.tar"}
    assert manifest["skipped_symbolic_links"] == 1
    files = {e["name"]: e["reason"] for e in manifest["dropped"] if e["kind"] == "file"}
    assert set(files) == {"files beside the shards"} and "2 files" in files["files beside the shards"]
    for line in result.stderr.lower().splitlines():
        if "wrote" not in line and "name map" not in line:
            assert "alice" not in line, line
    document = json.loads((tmp_path / "alice_smith_sessions.name-map.json").read_text())
    assert document["files_left_out"] == ["alice smith raw.npy", "notes on alice smith.txt"]
    assert document["skipped_symbolic_links"] == ["link to alice smith.tar"]
    plain = run(cli, src, tmp_path / "plain", "--range", "0:256")  # without the option: named, as documented
    assert {e["name"] for e in plain["dropped"] if e["kind"] == "file"} == {"notes on alice smith.txt",
                                                                          "alice smith raw.npy"}


def test_members_holding_data_tldp_reads_are_never_copied_even_when_kept(cli, tmp_path):
    """Regression: --keep npz (safetensors, parquet, h5) copied members holding data tldp
    perturbs on its own raw, beside the perturbed samples; the same files beside the shards
    (formats.data_file) are refused. Now dropped with the reason, as torch zips are."""
    import h5py
    from safetensors.numpy import save as save_safetensors

    def npz(values: np.ndarray) -> bytes:
        out = io.BytesIO()
        np.savez(out, emb=values)
        return out.getvalue()

    def h5(values: np.ndarray) -> bytes:
        out = io.BytesIO()
        with h5py.File(out, "w") as f:
            f["emb"] = values
        return out.getvalue()

    secret = np.full((2, 3), 1234.5678)
    members = {"npz": npz(secret), "st.safetensors": save_safetensors({"emb": secret}), "feat.h5": h5(secret)}
    src = tmp_path / "in"
    src.mkdir()
    with wds.TarWriter(str(src / "s.tar"), mtime=MTIME) as sink:
        for i in range(3):
            sink.write({"__key__": f"k{i}", "png": png_bytes(image(6, 6, seed=i)), "cls": i, **members})
    out = tmp_path / "out"
    manifest = run(cli, src, out, "--keep", "npz", "--keep", "st.safetensors", "--keep", "feat.h5",
                   "--keep", "cls")
    with tarfile.open(out / "s.tar") as tar:
        assert sorted(tar.getnames()) == ["k0.cls", "k0.png", "k1.cls", "k1.png", "k2.cls", "k2.png"]
    assert secret.tobytes() not in (out / "s.tar").read_bytes()
    dropped = {e["name"]: e for e in manifest["dropped"]}
    for name, fmt in [("npz", "npz"), ("st.safetensors", "safetensors"), ("feat.h5", "hdf5")]:
        assert dropped[name]["members"] == 3, dropped
        assert dropped[name]["reason"].startswith(f"{fmt} data, which tldp perturbs on its own")
        assert "never copied" in dropped[name]["reason"]
    assert [e["name"] for e in manifest["unperturbed"] if e["kind"] == "member"] == ["cls"]
