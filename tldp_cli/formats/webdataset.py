"""WebDataset shards: uncompressed .tar files whose members, grouped by key, are samples.

Input. One run reads a folder of shards (every .tar in it, in subfolders too), one .tar
file, or a brace pattern of shards as WebDataset takes it (`shards/train-{000000..000009}.tar`,
`{train,val}/part-{0..3}.tar`; quoted, so that the shell leaves the braces alone). A
shard's members are grouped as WebDataset groups them (webdataset.tariterators): a
member's key is its path up to the first dot of its base name, its extension the rest
(`images/0001.seg.png`: key `images/0001`, extension `seg.png`), and consecutive members
with the same key are one sample.

Records. Each image member (its last extension png, jpg, jpeg, bmp, tif, tiff or webp;
decoded as image folders decode theirs, formats/pixels.py) and each numeric .npy member
is one record of its own, an array named SHARD/MEMBER by the member's name in the output
(`train-000000.tar/0001.png` for 0001.jpg), which keys its random streams and --range. The perturbed members of one sample are one
subject's (`rows`): the per-record figure composes them, and --budget record spreads
--eps over them, as for arrays that share their rows.

Everything else is a label or metadata (.cls, .json, .txt, ...): by the rule of
formats/leftovers.py it is left out of the output and listed in the manifest's `dropped`,
one entry per extension with the number of members, unless --keep names its extension
(`--keep cls`, `--keep meta.json`; globs too), which copies those members raw (listed in
`unperturbed`). Members that hold what tldp never copies raw (DICOM, NIfTI, Python pickles:
.pyd, .pickle, .pth, torch.save's zip; images in formats tldp does not read: .gif, .ppm, ...;
data tldp perturbs on its own, by the last extension, a format's suffix: .npz, .safetensors,
.parquet, .h5, ...) are dropped even when --keep names them. Files in the folder beside
the shards are dropped and listed (kind "file"), or copied raw when --keep names them.

Output. A folder holding each shard under its own relative name, members in the input's
order: image members as lossless PNG (`0001.jpg` becomes `0001.png`, in the same sample),
clipped and rounded to the image's integer range, alpha channel and ICC profile dropped
unless --keep alpha, --keep icc_profile; .npy members as .npy of the run's output dtype and the same
shape. Tar headers are written anew, deterministic: each member's name and mode from the
input, a constant modification time (MTIME: the input's can date a recording), no
owner (uid, gid 0, names blank) and none of the input's PAX records but those a long or
non-ASCII name needs. The sample keys are written as they are (often file names, which
can name a person): listed in `unperturbed` as "sample keys". With --anonymize-names each
sample's key becomes its number in the samples' order across the shards (000000,
000001, ...: the order the output holds them in anyway), the same for all its members,
so webdataset groups them as before; the name map, kept with the raw data, pairs the
keys. The manifest then names each shard as the output does (not by the input's path), and
counts the files beside the shards it leaves out and the links it skips (the name map names
them), as an image folder's. Folder entries and members without a key (no extension) are then not written,
their names being the input's; the shards keep their names. An extension is written only
when it is a file type alone (TYPE_EXTENSIONS) or --keep declares it a field name (seg.png):
any other may be the rest of a name (alice.smith.jpg: extension smith.jpg, shared by every
Smith), so it is refused on a perturbed member and withheld from the manifest on a dropped
label member. A shard is written member by member as its records come back, so
memory holds a few members whatever the shard's size.

Refused, with one line: compressed shards (.tar.gz: decompress them first), members
whose path is absolute or climbs out with `..`, links (symbolic and hard), devices,
FIFOs and sparse members, two members of one name, a member that runs past the end of
its shard, and two image members of a sample that would both be written as KEY.png.
Symbolic links inside a shard folder are skipped and listed (nothing outside it is read).

This module is the format's declaration (detection, the default output, FORMAT); the
format's own modules beside it, each over the next:
- webdataset_writer.py: the output shards, written member by member (WebDatasetWriter);
- webdataset_reader.py: the reader (WebDatasetReader): which members are perturbed, kept,
  dropped or withheld, the samples' rows and --anonymize-names' keys;
- webdataset_shards.py: the shards and their members: brace patterns, finding and
  scanning the shards (what is refused), a member's kind, reading its bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tldp_cli.formats import ArrayJob, DocRow, Format, FormatOptions, folder_output, name_maps
from tldp_cli.formats import webdataset_reader, webdataset_shards, webdataset_writer
from tldp_cli.formats.webdataset_shards import (COMPRESSED_SUFFIXES, IMAGE_EXTENSIONS, SHARD_SUFFIX,
                                                is_compressed_shard, is_pattern, is_tar, pattern_base)

NAME = "webdataset"


def can_open(path: Path) -> bool:
    """A tar file (the ustar magic), a compressed shard (refused by the reader with the
    reason), or a folder holding .tar files and no images (not a Zarr store)."""
    if path.is_file():
        return is_tar(path) or is_compressed_shard(path)
    if not path.is_dir() or any((path / marker).exists() for marker in ("zarr.json", ".zarray", ".zgroup")):
        return False
    found = False
    for _, _, files in os.walk(path):
        for name in files:
            lower = name.lower()
            if lower.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS:
                return False
            found = found or lower.endswith(SHARD_SUFFIX) or lower.endswith(COMPRESSED_SUFFIXES)
    return found


def default_output(path: Path) -> Path:
    """A folder beside the input: shards/ -> shards.tldp/, train-000.tar -> train-000.tldp/,
    shards/train-{0..9}.tar -> shards.tldp/."""
    if is_pattern(path):
        path = pattern_base(path)
    elif path.is_file() and path.name.lower().endswith(SHARD_SUFFIX):
        return path.with_name(path.name[:-len(SHARD_SUFFIX)] + ".tldp")
    return folder_output(path)


def open_reader(path: Path, options: FormatOptions) -> webdataset_reader.WebDatasetReader:
    return webdataset_reader.WebDatasetReader(path, options, NAME)


def name_map_destination(name_map: Path | None, source: Path, output_path: Path, manifest: Path,
                         overwrite: bool) -> Path:
    """name_maps.destination; a brace pattern's goes beside the folder of its shards."""
    return name_maps.destination(name_map, pattern_base(source) if is_pattern(source) else source, output_path,
                                 manifest, overwrite)


def create_writer(reader: webdataset_reader.WebDatasetReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> webdataset_writer.WebDatasetWriter:
    return webdataset_writer.WebDatasetWriter(reader, tmp_path, dtype, options)


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least the output needs: image members 8 or 16 bits a value (noise does not
    compress), arrays the engine's dtype."""
    total = 0
    for job in jobs:
        is_image = job.source.get("dataset", "").lower().rsplit(".", 1)[-1] in IMAGE_EXTENSIONS
        total += job.records * job.elements * (job.dtype.itemsize if is_image else np.dtype(dtype).itemsize)
    return total


def is_earlier_output(path: Path, reader: webdataset_reader.WebDatasetReader) -> bool:
    """A folder whose manifest names it is an earlier output if it holds only this input's
    shards (by name) and the files --keep copies."""
    expected = {shard.rel for shard in reader.shards} | set(reader.kept_files)
    for directory, _, files in os.walk(path):
        for name in files:
            if (Path(directory) / name).relative_to(path).as_posix() not in expected:
                return False
    return True


FORMAT = Format(
    name=NAME, title="WebDataset shards", folder=True, file_input=True, pattern_input=is_pattern,
    pattern_files=webdataset_shards.pattern_files,
    honours_keep=True, member_noun="member",
    name_map_destination=name_map_destination, write_name_map=name_maps.write,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    output_bytes=output_bytes, earlier_output=is_earlier_output,
    docs=(DocRow("WebDataset shards: a folder of `.tar` files, one `.tar`, or a brace pattern "
                 "(`'shards/train-{000000..000009}.tar'`)",
                 "the tar header's `ustar` magic; a folder holding `.tar` files and no images",
                 "`tldp perturb shards/ --eps 1`",
                 "`shards.tldp/`: the same shards and member order, images as PNG, `.npy` arrays; labels "
                 "left out unless `--keep EXT` ([below](#webdataset-shards-tar))"),),
)
