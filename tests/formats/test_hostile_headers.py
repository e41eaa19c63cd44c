"""Hostile and damaged headers as properties: Hypothesis cuts, overwrites and invents the
bytes a reader trusts first (a .npy header, a PNG or TIFF image's, an HDF5 superblock,
a safetensors header length and JSON, Zarr metadata, an .npz member, a NIfTI header, a
Parquet footer) of files the real libraries wrote, and `tldp perturb` runs on them in
process. Whatever the bytes, the run either succeeds or refuses in the CLI's one way:
exit 1 (2 for bytes that make another valid file a usage error refuses), exactly one
line on stderr naming the file, no traceback and no "unexpected error" (a bug's line),
the input's bytes unchanged and nothing written beside it (no output, no manifest, no
temporary file). A header that cannot be right (cut short,
garbage) is always refused.

Few examples (TLDP_HYPOTHESIS_EXAMPLES raises the number) and no deadline, derandomized: a
run of the suite is repeatable.
"""

from __future__ import annotations

import io
import json
import os
import struct
import tempfile
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.numpy import save_file

from tests.builders import SEED, Cli, siblings, tree_digest

EXAMPLES = int(os.environ.get("TLDP_HYPOTHESIS_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

CLI = Cli()


def workdir(tmp_path: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=tmp_path))


def refused_or_perturbed(src: Path, *args, must_refuse: bool) -> None:
    """Runs perturb on src into a sibling; either a success, or the one-line refusal that
    names the file (exit 1) and leaves the folder as it was."""
    folder = src.parent
    before, around = tree_digest(src), siblings(folder)
    out = folder / ("out" + "".join(src.suffixes) if src.is_file() else "out")
    result = CLI("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, *args)
    assert tree_digest(src) == before, "the input was modified"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    event("perturbed" if result.exit_code == 0 else "refused")
    if result.exit_code == 0 and not must_refuse:
        return
    lines = result.stderr.strip().splitlines()
    # exit 2: bytes that make another valid file, one a usage error refuses (scaled NIfTI
    # data is float64: --range); a damaged one is exit 1
    assert result.exit_code in ((1,) if must_refuse else (1, 2)), (result.exit_code, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "unexpected error" not in lines[0], lines[0]
    assert src.name in lines[0], lines[0]
    assert siblings(folder) == around, "something was left beside the input"


def overwritten(raw: bytes, edits: list[tuple[int, bytes]], limit: int) -> bytes:
    """`raw` with each edit (position, bytes) written inside its first `limit` bytes."""
    data = bytearray(raw)
    for position, patch in edits:
        position %= min(limit, len(data))
        data[position:position + len(patch)] = patch[:len(data) - position]
    return bytes(data)


edits = st.lists(st.tuples(st.integers(0, 2**16), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)


# --------------------------------------------------------------------------- .npy

def npy_bytes(shape=(6, 4), dtype="uint8") -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.arange(np.prod(shape), dtype=dtype).reshape(shape))
    return buffer.getvalue()


NPY = npy_bytes()
NPY_HEADER = 10 + struct.unpack("<H", NPY[8:10])[0]  # magic, version, length, then the header


@PROPERTY
@given(cut=st.integers(0, len(NPY) - 1))
def test_a_npy_file_cut_short_is_refused(tmp_path, cut):
    src = workdir(tmp_path) / "x.npy"
    src.write_bytes(NPY[:cut])
    refused_or_perturbed(src, must_refuse=True)


@PROPERTY
@given(garbage=st.binary(min_size=1, max_size=NPY_HEADER - 10))
def test_a_npy_header_of_garbage_is_refused(tmp_path, garbage):
    src = workdir(tmp_path) / "x.npy"
    src.write_bytes(NPY[:10] + garbage.ljust(NPY_HEADER - 10, b" ") + NPY[NPY_HEADER:])
    refused_or_perturbed(src, must_refuse=not garbage.strip().startswith(b"{"))


@PROPERTY
@given(header=st.fixed_dictionaries({
    "descr": st.sampled_from(["|u1", "<i2", "<f4", ">f8", "|b1", "<c8", "|O", "<U3", "<u1x", "", "<f2"]),
    "fortran_order": st.sampled_from([False, True, 0, "no"]),
    "shape": st.lists(st.integers(-2, 2**40), max_size=4).map(tuple)}), version=st.sampled_from([1, 2, 3]))
def test_a_npy_header_that_lies_is_refused_unless_it_is_true(tmp_path, header, version):
    """Any dtype, order and shape (negative, huge, empty) over 24 bytes of data."""
    text = repr(header).encode()
    length_format = "<H" if version == 1 else "<I"
    text += b" " * (-(6 + 2 + struct.calcsize(length_format) + len(text) + 1) % 64) + b"\n"
    raw = b"\x93NUMPY" + bytes([version, 0]) + struct.pack(length_format, len(text)) + text + bytes(range(24))
    src = workdir(tmp_path) / "x.npy"
    src.write_bytes(raw)
    refused_or_perturbed(src, "--range", "0:1", must_refuse=False)


@PROPERTY
@given(changes=edits)
def test_a_npy_header_with_bytes_overwritten_is_perturbed_or_refused(tmp_path, changes):
    src = workdir(tmp_path) / "x.npy"
    src.write_bytes(overwritten(NPY, changes, NPY_HEADER))
    refused_or_perturbed(src, "--range", "0:1", must_refuse=False)


# --------------------------------------------------------------------------- images

def image_bytes(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3)).save(buffer, fmt)
    return buffer.getvalue()


IMAGES = {"png": image_bytes("PNG"), "tif": image_bytes("TIFF")}


def image_folder(tmp_path: Path, suffix: str, raw: bytes) -> Path:
    """A folder of two images, the second damaged."""
    root = workdir(tmp_path) / "photos"
    root.mkdir()
    (root / f"good.{suffix}").write_bytes(IMAGES[suffix])
    (root / f"bad.{suffix}").write_bytes(raw)
    return root


@PROPERTY
@given(suffix=st.sampled_from(list(IMAGES)), data=st.data())
def test_an_image_cut_short_is_refused(tmp_path, suffix, data):
    cut = data.draw(st.integers(0, len(IMAGES[suffix]) - 1), label="cut")
    root = image_folder(tmp_path, suffix, IMAGES[suffix][:cut])
    # cut in its last checksums (a PNG's zlib and CRC, its IEND), the pixels are whole: Pillow reads them
    refused_or_perturbed_image(root, f"bad.{suffix}", must_refuse=not pillow_decodes(IMAGES[suffix][:cut]))


def pillow_decodes(raw: bytes) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's on damaged TIFF tags
        try:
            with Image.open(io.BytesIO(raw)) as image:
                image.load()
            return True
        except (OSError, ValueError, SyntaxError):
            return False


@PROPERTY
@given(suffix=st.sampled_from(list(IMAGES)), changes=edits)
def test_an_image_header_with_bytes_overwritten_is_perturbed_or_refused(tmp_path, suffix, changes):
    root = image_folder(tmp_path, suffix, overwritten(IMAGES[suffix], changes, 64))
    refused_or_perturbed_image(root, f"bad.{suffix}", must_refuse=False)


def refused_or_perturbed_image(root: Path, name: str, must_refuse: bool) -> None:
    """As refused_or_perturbed, the line naming the damaged image (the folder is the input)."""
    before, around = tree_digest(root), siblings(root.parent)
    result = CLI("perturb", root, "--eps", "1", "--seed", SEED, "--out", root.parent / "out")
    assert tree_digest(root) == before
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    event("perturbed" if result.exit_code == 0 else "refused")
    if result.exit_code == 0 and not must_refuse:
        return
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr and "unexpected error" not in lines[0], lines[0]
    assert name in lines[0], lines[0]
    assert siblings(root.parent) == around


# --------------------------------------------------------------------------- HDF5

def hdf5_bytes(folder: Path) -> bytes:
    with h5py.File(folder / "made.h5", "w") as f:
        f.create_dataset("x", data=np.arange(96, dtype=np.uint8).reshape(8, 12), chunks=(4, 12), compression="gzip")
        f.create_dataset("y", data=np.arange(16, dtype=np.int16).reshape(8, 2))
    raw = (folder / "made.h5").read_bytes()
    (folder / "made.h5").unlink()
    return raw


@PROPERTY
@given(changes=st.lists(st.tuples(st.integers(8, 95), st.binary(min_size=1, max_size=8)), min_size=1,
                        max_size=3))
def test_an_hdf5_superblock_with_bytes_overwritten_is_perturbed_or_refused(tmp_path, changes):
    """The superblock (version 0: 96 bytes after the signature's 8): sizes, addresses,
    the root group's symbol table entry."""
    folder = workdir(tmp_path)
    src = folder / "d.h5"
    src.write_bytes(overwritten(hdf5_bytes(folder), changes, 96))
    refused_or_perturbed(src, must_refuse=False)


@PROPERTY
@given(data=st.data())
def test_an_hdf5_file_cut_short_is_refused(tmp_path, data):
    folder = workdir(tmp_path)
    raw = hdf5_bytes(folder)
    src = folder / "d.h5"
    src.write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1), label="cut")])
    refused_or_perturbed(src, must_refuse=True)


# --------------------------------------------------------------------------- safetensors

def safetensors_bytes(folder: Path) -> bytes:
    save_file({"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float16)},
              str(folder / "made.safetensors"), metadata={"format": "pt"})
    raw = (folder / "made.safetensors").read_bytes()
    (folder / "made.safetensors").unlink()
    return raw


@PROPERTY
@given(length=st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 400)))
def test_a_safetensors_header_length_that_lies_is_refused_unless_it_is_true(tmp_path, length):
    folder = workdir(tmp_path)
    raw = safetensors_bytes(folder)
    src = folder / "m.safetensors"
    src.write_bytes(struct.pack("<Q", length) + raw[8:])
    refused_or_perturbed(src, "--clip", "1", must_refuse=length != struct.unpack("<Q", raw[:8])[0])


@pytest.mark.parametrize("length", [2**40, 2**63 - 1, 2**64 - 1])
def test_a_huge_safetensors_header_length_is_damage_not_memory(tmp_path, length):
    """A length prefix of terabytes (a damaged file, or another file read as safetensors) was
    read as asked: "ran out of memory (MemoryError)" instead of naming the damage."""
    folder = workdir(tmp_path)
    src = folder / "m.safetensors"
    src.write_bytes(struct.pack("<Q", length) + safetensors_bytes(folder)[8:])
    result = CLI("perturb", src, "--eps", "1", "--clip", "1", "--format", "safetensors",
                 "--out", folder / "out.safetensors")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"tldp: error: {src}: not a valid safetensors file (its header of {length} bytes ends after the file, "
        f"{src.stat().st_size - 8} bytes in); it may be truncated or corrupt"]


tensor_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "BOOL", "F8_E4M3", "X", 7]),
    "shape": st.lists(st.integers(-1, 2**33), max_size=3),
    "data_offsets": st.lists(st.integers(-1, 80), min_size=0, max_size=3)})


@PROPERTY
@given(header=st.dictionaries(st.sampled_from(["w", "b", "__metadata__", ""]), tensor_entries, max_size=3),
       text=st.one_of(st.none(), st.binary(max_size=40)))
def test_a_safetensors_header_of_bogus_json_is_refused_unless_it_is_true(tmp_path, header, text):
    """Entries with any dtype, shape and offsets over 64 bytes of data, or bytes that are not JSON."""
    raw = json.dumps(header).encode() if text is None else text
    src = workdir(tmp_path) / "m.safetensors"
    src.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
    refused_or_perturbed(src, "--clip", "1", must_refuse=text is not None and not text.strip().startswith(b"{"))


# --------------------------------------------------------------------------- Zarr

json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.text("<>|fiu148 ",
                                                                                              max_size=4)),
                           lambda inner: st.lists(inner, max_size=3), max_leaves=6)


@PROPERTY
@given(zarr_format=st.sampled_from([2, 3]), changes=st.dictionaries(st.sampled_from(
    ["shape", "chunks", "dtype", "data_type", "chunk_grid", "codecs", "compressor", "filters", "fill_value",
     "order", "zarr_format", "node_type", "dimension_separator", "chunk_key_encoding"]), json_values, max_size=3),
    garbage=st.one_of(st.none(), st.binary(max_size=20)))
def test_zarr_metadata_that_lies_is_refused_unless_it_is_true(tmp_path, zarr_format, changes, garbage):
    """An array's metadata (.zarray or zarr.json) with fields replaced by any JSON, or not JSON."""
    folder = workdir(tmp_path)
    src = folder / "d.zarr"
    array = zarr.create_array(str(src), shape=(6, 4), chunks=(3, 4), dtype="uint8", zarr_format=zarr_format)
    array[...] = np.arange(24, dtype=np.uint8).reshape(6, 4)
    meta = src / (".zarray" if zarr_format == 2 else "zarr.json")
    if garbage is not None:
        meta.write_bytes(garbage)
    else:
        meta.write_text(json.dumps({**json.loads(meta.read_text()), **changes}))
    refused_or_perturbed(src, must_refuse=garbage is not None and not garbage.strip().startswith(b"{"))


# --------------------------------------------------------------------------- npz, NIfTI, Parquet

@PROPERTY
@given(changes=edits)
def test_an_npz_member_header_with_bytes_overwritten_is_perturbed_or_refused(tmp_path, changes):
    folder = workdir(tmp_path)
    np.savez(folder / "made.npz", w=np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    raw = (folder / "made.npz").read_bytes()
    (folder / "made.npz").unlink()
    start = raw.index(b"\x93NUMPY")  # the member's .npy header, inside the zip
    src = folder / "m.npz"
    src.write_bytes(raw[:start] + overwritten(raw[start:], changes, 128))
    refused_or_perturbed(src, "--clip", "1", must_refuse=False)


@PROPERTY
@given(changes=st.lists(st.tuples(st.integers(0, 351), st.binary(min_size=1, max_size=8)), min_size=1,
                        max_size=3), cut=st.one_of(st.none(), st.integers(0, 400)))
def test_a_nifti_header_damaged_or_cut_short_is_perturbed_or_refused(tmp_path, changes, cut):
    import nibabel as nib

    folder = workdir(tmp_path)
    nib.save(nib.Nifti1Image(np.arange(60, dtype=np.int16).reshape(3, 4, 5), np.eye(4)), folder / "made.nii")
    raw = (folder / "made.nii").read_bytes()
    (folder / "made.nii").unlink()
    src = folder / "scan.nii"
    src.write_bytes(overwritten(raw, changes, 352)[:cut])
    refused_or_perturbed(src, must_refuse=cut is not None and cut < 352)


@PROPERTY
@given(cut=st.integers(1, 200), changes=st.one_of(st.none(), edits))
def test_a_parquet_footer_damaged_or_cut_short_is_refused(tmp_path, cut, changes):
    """The footer (its metadata, length and PAR1) is the last bytes: cut or overwritten."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = workdir(tmp_path)
    pq.write_table(pa.table({"t": pa.array([[1.0, 2.0]] * 4, pa.list_(pa.float32()))}), folder / "made.parquet")
    raw = (folder / "made.parquet").read_bytes()
    (folder / "made.parquet").unlink()
    src = folder / "t.parquet"
    if changes is None:
        src.write_bytes(raw[:len(raw) - cut])
    else:
        footer = raw[-cut:]
        src.write_bytes(raw[:-cut] + overwritten(footer, changes, len(footer)))
    refused_or_perturbed(src, "--range", "t=0:3", must_refuse=changes is None)
