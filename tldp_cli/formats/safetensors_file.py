"""safetensors files (Hugging Face), read as a model-parameter file: each tensor is
one record (see tensor_files).

Tensors keep their dtype and shape, so the output reuses the input's header: names,
dtypes, shapes, order and data offsets all come through, byte for byte. Of
`__metadata__` (free text: author, training data, ...) only `format` is kept, which
transformers needs, and the keys --keep names (formats.leftovers); the others are left
out and listed in the manifest (`dropped`). Perturbed tensors are written at their
offsets (part by part for a tensor larger than a block, in flat memory); the others
are copied unchanged.

Reading and writing are safetensors_io's (shared with the shards of a sharded model
folder): the `safetensors.numpy` API, which also validates the header; bfloat16 tensors
are read from their offsets as float32 (exactly) and written back rounded to bfloat16.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from tldp_cli.formats import (ArrayJob, DocRow, Format, FormatOptions, Reader, Writer, leftovers, tensor_files,
                              tldp_name)
from tldp_cli.files.checked_io import fsync_file
from tldp_cli.formats.safetensors_io import (MAX_HEADER, METADATA_REASON, STRUCTURAL_METADATA, ReadParts,
                                             ReadTensor, TensorBlocks, header_with, parse, start_output)

NAME = "safetensors"


def can_open(path: Path) -> bool:
    """8 bytes of little-endian header length, then a JSON object (a file shorter than its
    header says is one, truncated: the reader says so)."""
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9:
        return False
    length = struct.unpack("<Q", head[:8])[0]
    return 2 <= length <= MAX_HEADER and head[8:9] == b"{"


def default_output(path: Path) -> Path:
    return tldp_name(path, path.suffix)


class SafetensorsReader(Reader):
    format = NAME
    records_are_tensors = True  # the manifest gets per-tensor figures
    keeps_dtypes = True  # each tensor written back in its dtype

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.header, self.metadata, self.entries = parse(path)
        self.data_start = len(self.header)
        tensors = [e.tensor for e in self.entries]
        chosen, self.messages, unperturbed = tensor_files.select(path, tensors, options.datasets,
                                                                 options.exclude)
        left = leftovers.Leftovers(list(options.keep), unperturbed=unperturbed)
        left.considered(t.name for t in tensors)
        kept = {key: value for key, value in self.metadata.items()
                if left.attribute("", key, STRUCTURAL_METADATA, "metadata key", METADATA_REASON)}
        left.check(path)
        self.manifest_extra = left.manifest_extra()
        self.out_header = self.header if kept == self.metadata else header_with(self.header, kept)
        names = {t.name for t in chosen}
        self.jobs = [tensor_files.job(path, NAME, e.tensor, ReadTensor(path, e, self.data_start),
                                      ReadParts(path, e, self.data_start))
                     for e in self.entries if e.tensor.name in names]

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def close(self) -> None:
        pass


def open_reader(path: Path, options: FormatOptions) -> SafetensorsReader:
    return SafetensorsReader(path, options)


class SafetensorsWriter(Writer):
    def __init__(self, reader: SafetensorsReader, tmp_path: Path, dtype: np.dtype):
        self.path = tmp_path
        chosen = {job.name for job in reader.jobs}
        tensors = [e.tensor for e in reader.entries if e.tensor.name in chosen]
        variances = tensor_files.variances(tensors)
        self.postprocessing = tensor_files.postprocessing(tensors, dtype, variances)
        self.output_dtype = tensor_files.output_dtype(tensors)
        self._blocks = start_output(reader.path, reader.data_start, reader.entries, reader.out_header, tmp_path,
                                    chosen, variances)

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        self._blocks(job, start, block)

    def block_writer(self) -> TensorBlocks:
        return self._blocks

    def part_writer(self):
        return self._blocks.part

    def close(self) -> list[Path]:
        fsync_file(self.path)
        return [self.path]


def create_writer(reader: SafetensorsReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> SafetensorsWriter:
    return SafetensorsWriter(reader, tmp_path, dtype)


FORMAT = Format(
    name=NAME, title=".safetensors file", suffixes=(".safetensors",), member_noun="tensor",
    selects_arrays=True, honours_exclude=True, honours_keep=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    docs=(DocRow("`.safetensors` model file", "8-byte little-endian header length and a JSON header",
                 "`tldp perturb docs/type3/model.safetensors --eps 1 --clip 0.1`",
                 "`model.tldp.safetensors`: the same tensor entries byte for byte (names, dtypes, shapes, "
                 "order, offsets); of `__metadata__` only `format`"),),
)
