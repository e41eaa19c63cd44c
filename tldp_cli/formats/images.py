"""Folders of images (PNG, JPEG, BMP, TIFF, WebP): one image is one record; a multi-page
TIFF is one record of all its pages (one specimen's stack), written as a multi-page TIFF.
Palette images (mode P, PA: segmentation class masks) are label maps, not perturbed: left
out and listed (dropped), or copied raw where --keep names them.

Images are found recursively and keyed by their relative POSIX path, which also
keys their random streams. Opening the folder reads each image's header (shape,
mode, bit depth, orientation); its pixels are decoded once, when they are
perturbed, and a damaged one stops the run then (the output is never committed).
--skip-bad decodes every image up front instead, to skip the bad ones before the
run. No image is held in memory longer than its own perturbation.

Only colour channels are perturbed; an alpha channel is left out (RGBA written as RGB,
LA as L, listed under dropped), or copied back unchanged where --keep alpha names it.
The output folder mirrors the input: lossless PNG rounded and clipped to the
input's integer range (default; written by pixels.png, encoded for noise), or float
TIFF with the values as perturbed. With --copy-other, index files
(metadata.jsonl, metadata.csv) get the output names of renamed images, and lose
the rows naming images the output does not hold (skipped as unreadable, or
symbolic links), which the manifest lists under dropped; a metadata.parquet index,
which tldp cannot rewrite, is then left out (dropped).

Symbolic links inside the folder (to images, other files or directories, dangling
or not) are never followed: they are skipped, named in a message and listed in
the manifest (skipped_symbolic_links), with or without --copy-other, so nothing
outside the folder is read or copied. The folder's own path may be a link.

With --anonymize-names the output is flat, the images numbered in a random order
(000000.png, 000001.png, ...), and the manifest names no input file or folder: its
inputs entries and lists of skipped files give the new names or counts only. The
name map, written beside the raw data, pairs the original names with the new ones
and names the skipped files; evaluate pairs the images through it.

This module is the format's declaration (detection, the default output, FORMAT); the
format's own modules beside it, each over the next:
- images_writer.py: the output folder, image by image (ImageFolderWriter), and reading
  an image it wrote back (read_output, for evaluate);
- images_reader.py: the reader: which files are images, label maps, data never copied or
  skipped, the output's names (output_name) and the name map (read_name_map);
- images_index.py: the index files (metadata.jsonl, metadata.csv) rewritten to the
  output's names.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tldp_cli.files.output import not_earlier_output
from tldp_cli.formats import ArrayJob, DocRow, Format, FormatOptions, folder_output, listing, name_maps
from tldp_cli.formats import images_reader, images_writer

NAME = "images"


def can_open(path: Path) -> bool:
    return path.is_dir() and not any((path / marker).exists() for marker in images_reader.ZARR_MARKERS)


def default_output(path: Path) -> Path:
    return folder_output(path)


def default_name_map(path: Path) -> Path:
    """photos/ -> photos.name-map.json beside it: with the raw data, outside the output."""
    return name_maps.default_path(path)


def open_reader(path: Path, options: FormatOptions) -> images_reader.ImageFolderReader:
    return images_reader.ImageFolderReader(path, options, NAME)


def create_writer(reader: images_reader.ImageFolderReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> images_writer.ImageFolderWriter:
    return images_writer.ImageFolderWriter(reader, tmp_path, dtype, options)


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least the output needs on disk: PNG images 8 bits a value (noise does not
    compress), TIFF images the engine's dtype."""
    itemsize = 1 if options.image_format == "png" else np.dtype(dtype).itemsize
    return sum(job.records * job.elements for job in jobs) * itemsize


def is_earlier_output(path: Path, reader: images_reader.ImageFolderReader) -> bool:
    """A folder whose manifest names it is an earlier output if it holds images and the
    files --copy-other copies from this input, nothing else; one holding other files is
    refused naming them (a .DS_Store Finder left there, notes added to the release)."""
    copied = set(reader.others)
    strays = sorted(rel for directory, _, files in os.walk(path) for name in files
                    if Path(name).suffix.lower() not in images_reader.IMAGE_SUFFIXES
                    and (rel := (Path(directory) / name).relative_to(path).as_posix()) not in copied)
    if strays:
        raise not_earlier_output(path, listing(strays))
    return True


FORMAT = Format(
    name=NAME, title="folder of images", folder=True, records_are_files=True, record_noun="an image",
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    name_map_destination=name_maps.destination, write_name_map=name_maps.write,
    output_bytes=output_bytes, earlier_output=is_earlier_output, honours_keep=True,
    docs=(DocRow("folder of images (PNG, JPEG, BMP, TIFF, WebP)",
                 "any other directory (subfolders named `0` ... `9` included)",
                 "`tldp perturb sample_data/digits_png --eps 1`",
                 "`digits_png.tldp/` mirroring the relative paths, lossless PNG (a multi-page TIFF: "
                 "multi-page TIFF); palette images (label maps) left out ([below](#image-folders))"),),
)
