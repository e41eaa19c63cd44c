"""The Zarr format's writer (formats/zarr_store.py): the output store, a copy of the input
without the perturbed arrays' chunks and what is left out, their metadata rewritten
(zarr_metadata.py), the noisy records written by _Blocks (chunk files through
zarr_chunks.py, or zarr-python), OME-Zarr levels regenerated (zarr_ome.py) and the
consolidated metadata rebuilt; reopened by --resume; and --store coefficients' writer.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from tldp_cli.errors import InputError, OutputError, UsageError, reason_of
from tldp_cli.files.checked_io import Background, flushed_files
from tldp_cli.files.output import removed_during_run, shown
from tldp_cli.formats import ArrayJob, Writer, dropped_filters
from tldp_cli.formats import cf, zarr_chunks
from tldp_cli.formats import zarr_cf, zarr_metadata, zarr_ome, zarr_reader, zarr_tree

@dataclass
class _Blocks:
    """Writes blocks of records through zarr. Picklable (the open arrays are not pickled:
    each process opens its own), so Dask workers can write their blocks themselves.
    Blocks must cover whole shards (pipeline.block_bounds): two writers filling
    different chunks of one shard would lose one of them."""

    root: Path
    source: Path  # the input, named in messages
    paths: dict[str, str]  # job name -> the array's path in the store
    zarr_format: zarr_tree.ZarrFormat
    dtype: np.dtype
    missing: dict[str, list[tuple]] = field(default_factory=dict)  # job name -> CF (stored, output) markers
    bounds: dict[str, tuple[float, float, float | None]] = field(default_factory=dict)  # FormatOptions.value_bounds
    labels: dict[str, np.dtype] = field(default_factory=dict)  # job name -> its label image's integer dtype

    def __post_init__(self) -> None:
        self._arrays: dict[str, Any] = {}
        self.digests: dict[Path, str] = {}  # chunk files written here; in Dask workers it stays empty
        # Chunk files go to disk from a thread of their own, so that the workers go on
        # computing while the direct writes wait for the disk; Dask workers write their
        # own (None).
        self._disk: Background | None = Background(lambda item: zarr_chunks.write_files(*item),
                                                   f"tldp write {self.root.name}", depth=8)
        self._on_disk: dict[tuple[str, int], Future] = {}  # by (job name, first record) of the block

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_arrays", "digests", "_disk", "_on_disk")}

    def __setstate__(self, state):
        self.__dict__.update(state, _arrays={}, digests={}, _disk=None, _on_disk={})

    def array(self, job_name: str):
        """(the open array, its plain chunk files' layout or None)"""
        if job_name not in self._arrays:
            array = zarr_tree.open_node(LocalStore(self.root), self.source, self.paths[job_name], "array",
                          self.zarr_format, mode="r+")
            chunk_files = zarr_chunks.of_array(array)
            if chunk_files is not None:
                chunk_files.codec  # built now: an unknown codec fails before any block runs
            self._arrays[job_name] = array, chunk_files
        return self._arrays[job_name]

    def open_arrays(self) -> None:
        """Opens every array now, so that a bad codec fails before any block runs."""
        try:
            for job_name in self.paths:
                self.array(job_name)
        except BaseException:
            self.flush()
            raise

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> tuple[int, bool]:
        """Writes the block; returns how many noisy values it moved off missing-data markers,
        and whether the input held missing values there."""
        array, chunk_files = self.array(job.name)
        if job.name in self.labels:
            block = zarr_ome.to_label_dtype(block, self.labels[job.name])
        else:
            block = np.asarray(block, dtype=self.dtype)
        kept = 0, False
        if job.name in self.missing:
            block = block.copy()  # the caller's block is not ours to change
            kept = cf.restore_missing(job, start, block, self.missing[job.name], self.bounds.get(job.name))
        try:
            if chunk_files is None or not chunk_files.aligned(start, len(block)):
                array[start:start + len(block)] = block
                return kept
            directory = self.root / self.paths[job.name]
            files = chunk_files.encoded(directory, start, block)
        except OSError:
            raise
        except Exception as exc:
            raise InputError(f"{self.source}: cannot encode array {job.name} as {self.dtype} with "
                             f"its codecs ({reason_of(exc)})") from None
        self.digests.update((path, hashlib.sha256(data).hexdigest()) for path, data in files)
        if self._disk is None:
            zarr_chunks.write_files(directory, files)
        else:
            self._on_disk[job.name, start] = self._disk.put((directory, files))
        return kept

    def wait(self, job_name: str, start: int) -> None:
        """Returns once the block's chunk files are written; raises the failure to write them."""
        on_disk = self._on_disk.pop((job_name, start), None)
        if on_disk is not None:
            on_disk.result()

    def flush(self) -> None:
        """Waits for every chunk file queued; raises the failure to write them, if any."""
        if self._disk is not None:
            self._disk.close()


def _copy_store(reader: zarr_reader.ZarrReader, root: Path, metadata: dict[str, dict], attributes: dict[str, dict],
                perturbed: set[str]) -> None:
    """Copies the input store to `root` but the perturbed arrays' chunks and what the reader
    leaves out (arrays, files: formats.leftovers), then writes the rewritten metadata
    (`metadata`, by node path) and Zarr 2 attributes (`attributes`), with every other node's
    attributes less those left out."""
    left_out = reader.left_out | reader.left_out_files

    def skip(directory: str, entries: list[str]) -> list[str]:
        rel = Path(directory).relative_to(reader.path).as_posix()
        rel = rel if rel != "." else ""
        return [e for e in entries if (rel in metadata and e not in zarr_tree.METADATA_FILES)
                or posixpath.join(rel, e) in left_out]

    # The reader refused links; one made since is copied as a link, not followed. Contents and
    # modes only: the input's times can date a recording, so the copies get the run's time
    # (copytree gives folders the input's; they are reset below).
    shutil.copytree(reader.path, root, ignore=skip, symlinks=True, copy_function=shutil.copy)
    for directory, _, _ in os.walk(root):
        os.utime(directory)
    nodes = {n.path: n for n in reader.nodes}
    for path, attrs in reader.attributes.items():
        if path in perturbed:
            continue  # in `metadata` or `attributes` already
        if reader.zarr_format == 2:
            attributes[path] = attrs
        elif path in metadata:  # a regenerated level
            metadata[path]["attributes"] = attrs
        else:
            metadata[path] = {**nodes[path].meta, "attributes": attrs}
    for path, meta in metadata.items():
        name = "zarr.json" if reader.zarr_format == 3 else ".zarray"  # (Zarr 2: arrays only here)
        (root / path / name).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    for path, attrs in attributes.items():  # Zarr 2 keeps attributes in a file of their own
        (root / path / ".zattrs").write_text(json.dumps(attrs, indent=2), encoding="utf-8")


# Zarr's LocalStore writes through temporary files named like this; a killed run leaves them.
_STORE_TEMP = re.compile(r"\.[0-9a-f]{32}\.partial$")


class ZarrWriter(Writer):
    def __init__(self, reader: zarr_reader.ZarrReader, tmp_path: Path, dtype: np.dtype, reopen: bool = False,
                 bounds: dict[str, tuple[float, float, float | None]] | None = None):
        self.root = tmp_path
        self.dtype = np.dtype(dtype)
        self.messages: list[str] = []  # a line added in finish() is shown too
        self.postprocessing: list[str]
        self.manifest_extra: dict[str, Any]
        if tmp_path.resolve().is_relative_to(reader.path.resolve()):
            raise OutputError(f"{tmp_path.parent}: the output cannot go inside the input store "
                              f"{reader.path}")
        nodes = {n.path: n for n in reader.nodes}
        names = {job.name: job.name.strip("/") for job in reader.jobs}
        self.labels = reader.label_dtypes(self.dtype)  # privunit: integer label images keep their dtype
        self.output_dtype = zarr_ome.label_output_dtype(self.dtype, self.labels, reader.pyramids)
        # Rewritten before anything is copied, so an impossible filter fails fast.
        metadata, dropped, lowered = {}, {}, {}
        # (the manifest's key, the array's path, its output fill): each array perturbed, then
        # each level a pyramid regenerates from its perturbed full resolution
        written = [(job_name, path, zarr_cf.output_fill(reader.handles[path], reader.encodings.get(job_name)))
                   for job_name, path in names.items()]
        written += [(path, path, reader.handles[path].fill_value)
                    for path in (level for p in reader.regenerated for level in p.levels[1:])]
        for key, path, fill in written:
            metadata[path], lossy, levels = zarr_metadata.output_metadata(
                nodes[path], fill, reader.zarr_format, self.labels.get(path, self.dtype),
                f"{reader.path}: array {zarr_tree.display(path)}")
            if lossy:
                dropped[key] = lossy
            if levels:
                lowered[key] = levels
        self.postprocessing, self.manifest_extra = dropped_filters(dropped)
        if lowered:  # the values are the same at any level: only the CPU spent differs
            self.manifest_extra["codec_levels"] = lowered
        attributes = self._cf_attributes(reader, names, metadata)
        self.pyramids = reader.regenerated
        if self.pyramids:
            self.postprocessing = [*self.postprocessing, *(zarr_ome.regeneration_step(p) for p in self.pyramids)]
            self.manifest_extra = {**self.manifest_extra,
                                   "multiscale_images": [p.describe() for p in self.pyramids]}
        job_of = {path: job_name for job_name, path in names.items()}
        windows = {p: zarr_ome.declared_window((bounds or {}).get(job_of.get(p.levels[0], "")),
                                               self.labels.get(p.levels[0], self.dtype))
                   for p in reader.raw_statistics}
        self.postprocessing += [zarr_ome.statistics_step(p, fields, windows[p])
                                for p, fields in reader.raw_statistics.items() if fields]
        self.postprocessing += zarr_ome.label_steps(reader.pyramids, self.labels)
        self.messages += [f"array {name}: written without the input's lossy "
                          f"filter{'s' if len(lossy) > 1 else ''} {', '.join(lossy)}, so the noisy "
                          "values are stored exactly" for name, lossy in dropped.items()]
        meta_file = self.meta_file = "zarr.json" if reader.zarr_format == 3 else ".zarray"
        if reopen:
            for path, meta in metadata.items():
                try:
                    same = json.loads((tmp_path / path / meta_file).read_text(encoding="utf-8")) == meta
                except (OSError, UnicodeDecodeError, ValueError):
                    same = False
                if not same:
                    raise OutputError(f"{tmp_path}: the partial output does not match this input "
                                      f"(array {zarr_tree.display(path)}); remove it to start over")
            for leftover in [p for p in tmp_path.rglob("*") if _STORE_TEMP.search(p.name)]:
                leftover.unlink()
        else:
            _copy_store(reader, tmp_path, metadata, attributes, set(names.values()))
            for pyramid in self.pyramids:
                zarr_ome.describe_multiscale(tmp_path, pyramid, reader.zarr_format)
            for pyramid, fields in reader.raw_statistics.items():
                if fields:
                    zarr_ome.drop_raw_statistics(tmp_path, pyramid, reader.zarr_format, windows[pyramid])
        self.blocks = _Blocks(tmp_path, reader.path, names, reader.zarr_format, self.dtype, self.missing,
                              bounds or {}, {name: self.labels[path] for name, path in names.items()
                                             if path in self.labels})
        # (job name, first record) -> noisy values moved off its markers, per block written
        self.moved: dict[tuple[str, int], int] = {}
        self.held: dict[tuple[str, int], bool] = {}  # ... whether its input held missing values (stderr only)
        self.blocks.open_arrays()
        self.consolidate = [n.path for n in reader.nodes if n.consolidated]
        self.zarr_format = reader.zarr_format

    def _cf_attributes(self, reader: zarr_reader.ZarrReader, names: dict[str, str],
                       metadata: dict[str, dict]) -> dict[str, dict]:
        """Rewrites the perturbed arrays' CF attributes (cf.describe tells the manifest): in
        their metadata (Zarr 3); returns the .zattrs to write (Zarr 2)."""
        self.missing: dict[str, list[tuple]] = {}
        dropped_attrs, zattrs = {}, {}
        for job_name, path in names.items():
            array = reader.handles[path]
            attrs, dropped, pairs = zarr_cf.cf_output_attrs(f"{reader.path}: array {job_name}", array,
                                                            reader.attributes.get(path, array.attrs.asdict()),
                                                            reader.encodings.get(job_name),
                                                            self.labels.get(path, self.dtype))
            if dropped:
                dropped_attrs[job_name] = dropped
            if pairs:
                self.missing[job_name] = pairs
            if attrs != array.attrs.asdict():
                if reader.zarr_format == 3:
                    metadata[path]["attributes"] = attrs
                else:
                    zattrs[path] = attrs
        steps, extra = cf.describe(reader.encodings, {name: str(reader.handles[names[name]].dtype)
                                                      for name in reader.encodings},
                                   dropped_attrs, self.missing, self.dtype)
        self.postprocessing += steps
        self.manifest_extra = {**self.manifest_extra, **extra}
        return zattrs

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        # One key per block: thread-safe.
        self.moved[job.name, start], self.held[job.name, start] = self.blocks(job, start, block)

    def block_written(self, job: ArrayJob, start: int, stop: int) -> None:
        self.blocks.wait(job.name, start)  # written before --resume journals it

    def block_note(self, job: ArrayJob, start: int) -> dict[str, Any]:
        if (job.name, start) not in self.moved:
            return {}
        return {"moved_off_markers": self.moved[job.name, start], "held_missing": self.held[job.name, start]}

    def resumed(self, notes: dict[tuple[str, int], dict[str, Any]]) -> None:
        """The blocks an interrupted run wrote count in moved_off_markers (and the missing
        values they held in the message about them) as well."""
        for key, note in notes.items():
            if "moved_off_markers" in note:
                self.moved[key] = note["moved_off_markers"]
                self.held[key] = bool(note.get("held_missing"))

    def digests(self) -> dict[Path, str]:
        return dict(self.blocks.digests)

    def block_writer(self) -> _Blocks | None:
        """None where CF markers are kept: the blocks come back, so that the moves are counted."""
        return None if self.missing else self.blocks

    def finish(self) -> None:
        """Wait for the chunk files and check that each array's metadata is still there,
        regenerate the lower levels of multiscale images from the perturbed full
        resolution, then rebuild consolidated metadata; only a complete output is worth it."""
        self.blocks.flush()  # the lower levels are read from the chunk files
        for path in self.blocks.paths.values():
            if not (self.root / path / self.meta_file).is_file():  # zarr-python makes removed folders again
                raise OutputError(f"{shown(self.root / path)}: its metadata was removed while tldp wrote "
                                  "it (another program?); nothing was written")
        for chunk in self.blocks.digests:  # the chunk files this process wrote
            if not chunk.is_file():
                raise removed_during_run(chunk)
        for pyramid in self.pyramids:
            zarr_ome.regenerate(self.root, self.blocks.source, pyramid, self.zarr_format,
                                self.labels.get(pyramid.levels[0], self.dtype))
        if self.consolidate:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "consolidated metadata is not in the v3 spec"
                # Nested groups first, the root last.
                for path in sorted(self.consolidate, key=lambda p: (p == "", -p.count("/"))):
                    zarr.consolidate_metadata(LocalStore(self.root), path=path,
                                              zarr_format=self.zarr_format)
        cf.count_moves(self.manifest_extra, [(name, count) for (name, _), count in self.moved.items()])
        held = sorted({name for (name, _), held in self.held.items() if held})
        if held:
            self.messages.append(cf.missing_message(held))

    def close(self) -> list[Path]:
        """Waits for the chunk files (each flushed to disk as it is written), then flushes
        every other file: metadata, files copied, chunks written through zarr-python or
        by another process."""
        self.blocks.flush()
        return flushed_files(self.root, self.blocks.digests)


class ZarrCoefficientWriter(ZarrWriter):
    """--store coefficients: the store the records writer makes (the same groups, kept
    arrays, attributes and files), but each perturbed array holds its records' released
    coefficients, (records, k) in the engine's dtype, chunked along axis 0 as the input (no
    shards), with none of the input array's attributes (its units and fill values describe
    records). Where the array names its dimensions (xarray), axis 0 keeps its name and axis 1
    is `coefficient`, and its coordinates attribute names only the arrays written on the
    record dimension alone (cf.coefficient_coordinates). Missing values cannot be marked in
    coefficients, and multiscale images (OME-Zarr), whose lower levels are images, are refused."""

    def __init__(self, reader: zarr_reader.ZarrReader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype):
        if any(job.name.strip("/") in p.levels for p in reader.pyramids for job in jobs):
            raise UsageError(f"{reader.path}: --store coefficients applies to arrays of records, not to "
                             "multiscale images (OME-Zarr), whose lower levels are images")
        super().__init__(reader, tmp_path, dtype)
        self.blocks.flush()  # the records-shaped arrays' writer: replaced below
        store = LocalStore(tmp_path)
        perturbed = {j.name.strip("/") for j in jobs}
        for job in jobs:
            path = job.name.strip("/")
            names = zarr_cf.dimension_names(reader.handles[path])
            dimensions = None if names is None else [names[0], cf.COEFFICIENT_DIMENSION]
            if dimensions and posixpath.join(posixpath.dirname(path), cf.COEFFICIENT_DIMENSION) in reader.handles:
                raise UsageError(f"{reader.path}: --store coefficients names the new dimension "
                                 f"{cf.COEFFICIENT_DIMENSION}, which an array beside {zarr_tree.display(path)} has "
                                 "as its name")
            attributes: dict[str, Any] = dict(_coefficient_coordinates(reader, path, perturbed)) if dimensions else {}
            if dimensions and reader.zarr_format == 2:
                attributes["_ARRAY_DIMENSIONS"] = dimensions
            try:
                zarr.create_array(
                    store=store, name=path, shape=job.shape, dtype=self.dtype, fill_value=np.nan,  # (V is never NaN)
                    chunks=(min(job.records, job.chunk_records or job.records), job.shape[1]),
                    zarr_format=reader.zarr_format, overwrite=True,
                    dimension_names=dimensions if reader.zarr_format == 3 else None, attributes=attributes)
            except OSError as exc:
                raise OutputError(f"{shown(tmp_path)}: cannot write array {zarr_tree.display(path)} "
                                  f"({reason_of(exc)})") from None
        self.blocks = _Blocks(tmp_path, reader.path, self.blocks.paths, reader.zarr_format, self.dtype)
        self.blocks.open_arrays()

    def _cf_attributes(self, reader: zarr_reader.ZarrReader, names: dict[str, str],
                       metadata: dict[str, dict]) -> dict[str, dict]:
        self.missing = {}  # no attribute of the input array is written, and no marker put back
        return {}


def _coefficient_coordinates(reader: zarr_reader.ZarrReader, path: str, perturbed: set[str]) -> dict[str, str]:
    """The coordinates attribute of an array written as coefficients (xarray's): its input's,
    naming only the arrays written on its record dimension alone (cf.coefficient_coordinates),
    so that xarray still reads a station's kept elev(station) as its coordinate; {} if none."""
    by_path = {"/" + name: name for name in reader.handles}
    dimensions_of = zarr_cf.dimension_lookup(reader.handles)

    def dimensions(word: str) -> tuple[str, ...] | None:
        target = cf.variable(word, posixpath.dirname("/" + path), by_path)
        if target is None or target in reader.left_out or target in perturbed:
            return None  # not written, or coefficients itself
        return dimensions_of("/" + target)

    text = zarr_cf.text_lookup(reader.handles)("/" + path, "coordinates")
    found = cf.coefficient_coordinates(text, dimensions, dimensions_of("/" + path)[0])
    return {"coordinates": found} if found else {}
