"""The WebDataset format's reader (formats/webdataset.py): which members are perturbed (image
and .npy members, each a record of its own; a sample's members one subject's row), which
are copied (--keep), dropped or withheld (formats.leftovers), the files beside the shards,
and with --anonymize-names the samples' new keys and what the manifest may name.
"""

from __future__ import annotations

import datetime as _dt
import secrets
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tldp_cli import __version__
from tldp_cli.errors import InputError, UsageError
from tldp_cli.formats import (DATASET_FORMATS, ArrayJob, FormatOptions, Reader, check_numeric_dtype, data_file,
                              decode_reason, leftovers, listing, name_maps, pixels, plural)
from tldp_cli.formats.webdataset_shards import (ARRAY, FOLDER, IMAGE, IMAGE_EXTENSIONS, LEFTOVER, NEVER,
                                                PICKLE_EXTENSIONS, SHARD_SUFFIX, Member, ReadMember, Shard,
                                                is_compressed_shard, output_name, probe_array, probe_image, scan,
                                                shard_files)

LABEL_REASON = "a label or metadata member, not perturbed"
OTHER_FILE_REASON = "a file beside the shards, not perturbed"
FILES_WITHHELD = "files beside the shards"  # how --anonymize-names lists them: a count, not their names
ANONYMOUS_DIGITS = 6  # --anonymize-names: keys 000000, 000001, ...: at least this many digits
NO_KEY = "(no extension)"  # how the manifest names members without a key, anonymized
NO_KEY_REASON = ("a member without an extension, so of no sample: its name is the input's "
                 "(--anonymize-names writes none)")
# --anonymize-names writes a member's extension as it is. Public by rule: a file type alone
# (what webdataset's encoders and decoders dispatch on: the last component), optionally
# gzipped (json.gz). Any other extension (seg.png, meta.json, smith.png) may be the rest of
# a name (alice.smith.png: key alice) and is written only where --keep declares it.
TYPE_EXTENSIONS = frozenset((
    *IMAGE_EXTENSIONS, *PICKLE_EXTENSIONS,
    # webdataset's writer's handlers and autodecode's decoders, in their words
    *"cls cls2 class count index inx id txt text transcript html htm npy npz ten tenbin tb json jsn mp "
     "msgpack msg cbor img image pbm pgm ppm gif".split(),
    # other common members' types
    *"csv tsv xml yaml yml md jsonl parquet safetensors pt dcm nii wav flac mp3 ogg opus m4a mp4 avi mov "
     "mkv webm".split()))
UNDECLARED = "(undeclared extension)"  # how the manifest names members whose extension is withheld
UNDECLARED_REASON = ("a label or metadata member whose extension is no file type alone and not declared "
                     "with --keep, so may be the rest of a name (--anonymize-names writes none; "
                     "--keep EXTENSION declares it and copies the members raw)")
FIELD_REASON = "kept by --keep (declared a field name, not part of a sample's name)"
FOLDER_ENTRIES = "folder entries"
FOLDER_REASON = "tar folder entries, whose names are the input's: not written (--anonymize-names)"


def _public_extension(extension: str) -> bool:
    """A file type alone (png, cls, json), or gzipped (json.gz): names no one (TYPE_EXTENSIONS)."""
    parts = extension.split(".")
    if len(parts) == 2 and parts[1] == "gz":
        parts = parts[:1]
    return len(parts) == 1 and parts[0] in TYPE_EXTENSIONS


class WebDatasetReader(Reader):
    def __init__(self, path: Path, options: FormatOptions, name: str):
        self.path = path
        self.format = name  # the format's name (formats/webdataset.py's NAME): sources, the manifest's key
        self.messages: list[str] = []
        if options.datasets:
            raise UsageError(f"{path}: --dataset applies to {DATASET_FORMATS}, not WebDataset "
                             "shards: every image and .npy member is perturbed")
        if options.image_format != "png":
            raise UsageError(f"{path}: --image-format {options.image_format}: WebDataset image members "
                             "are written as PNG")
        if options.copy_other or options.skip_bad:
            raise UsageError(f"{path}: --{'copy-other' if options.copy_other else 'skip-bad'} applies to "
                             "folders of images, not WebDataset shards (--keep NAME copies a file beside "
                             "the shards; a member that cannot be decoded stops the run)")
        self.base, rels, self.others, self.links = shard_files(path)
        if not rels:
            links = [rel for rel in self.links if rel.lower().endswith(SHARD_SUFFIX)]
            hint = (f" but {plural(len(links), 'symbolic link')} to shards, which tldp does not follow in a "
                    f"folder: name them with a brace pattern ('{path}/NAME-{{000..009}}.tar'), whose "
                    "links it follows" if links else "")
            raise InputError(f"{path}: no .tar shards in the folder{hint}")
        compressed = [rel for rel in rels if is_compressed_shard(Path(rel))]
        if compressed:
            raise InputError(f"{self.base / compressed[0]}: a compressed shard, which tldp does not read "
                             "member by member; decompress it first (gunzip, zstd -d) and give the .tar")
        self.shards = [scan(self.base / rel, rel) for rel in rels]
        self.anonymized = options.anonymize_names
        self.left = leftovers.Leftovers(list(options.keep))
        self.new_keys = self._anonymize() if self.anonymized else {}
        self.jobs = self._jobs()
        if not self.jobs:
            raise InputError(f"{path}: no image or .npy members to perturb in "
                             f"{plural(len(self.shards), 'shard')}")
        self._leftovers(self.left)
        self.samples = self._samples()
        self.manifest_extra: dict[str, Any] = {**self.left.manifest_extra(), self.format: {
            "shards": len(self.shards), "samples": self.sample_count,
            "perturbed_members": len(self.jobs),
            "members_renamed": sum(output_name(m.name, m.kind) != m.name for s in self.shards for m in s.members)}}
        if self.anonymized:
            self.name_map_id = secrets.token_hex(16)  # ties the manifest to its name map
            self.manifest_extra["anonymized_names"] = {
                "name_map_id": self.name_map_id,
                "rule": "each sample's key renamed to its number in the samples' order across the shards "
                        "(000000, 000001, ...), the same for all its members; folder entries and members "
                        "without a key left out; the shards keep their names, inputs name them so and not "
                        "by the input's path; files left out and links skipped are counts; the name map "
                        "kept with the raw data pairs the keys and names those files"}
        grouped = [row for rows in self.samples.values() for row in rows if len(row) > 1]
        self.record_description = (
            "a sample: its perturbed members (images, .npy arrays) together, composed" if grouped
            else "one member of a sample (an image or a .npy array)")
        self._report()
        if options.dtype is not None and all(m.kind == IMAGE for s in self.shards for m in s.members if m.job):
            # asked for, but PNG members hold the images' own integers (.npy members would take it)
            self.messages.append(pixels.dtype_not_applied(options.dtype, "the image members"))

    def _anonymize(self) -> dict[str, str]:
        """--anonymize-names: each sample's key becomes its number in the samples' order across
        the shards, in each of its members' names (a key that comes back in its shard keeps
        its number: one subject, _samples); a member without a key is never written. Returns
        the name map's pairs, "SHARD/KEY" -> the new key."""
        numbers: dict[tuple[str, str], int] = {}
        for shard, member in self._keyed_members():
            numbers.setdefault((shard.rel, str(member.key)), len(numbers))
        self._check_extensions()
        digits = max(ANONYMOUS_DIGITS, len(str(len(numbers) - 1)))
        for shard in self.shards:
            for member in shard.members:
                if member.kind == FOLDER:
                    continue  # not written (WebDatasetWriter)
                if member.key is None:
                    member.kind, member.reason, member.withheld = NEVER, NO_KEY_REASON, NO_KEY
                    continue
                # its name is the key, then what follows it (".seg.png")
                member.out_name = f"{numbers[shard.rel, member.key]:0{digits}d}{member.out_name[len(member.key):]}"
        return {f"{rel}/{key}": f"{number:0{digits}d}" for (rel, key), number in numbers.items()}

    def _check_extensions(self) -> None:
        """--anonymize-names writes each member's extension as it is: all of its base name after
        the first dot (webdataset's rule). Only a file type alone is public by rule
        (_public_extension); any other (seg.png, or smith.png of alice.smith.png, however many
        samples hold it) is written only where --keep declares it, listed as a field name. An
        undeclared one is refused on a perturbed member, before anything is written; a label
        member is dropped anyway, and listed without its extension (UNDECLARED)."""
        fields: dict[str, int] = {}
        for shard, member in self._keyed_members():
            extension = str(member.extension)
            if _public_extension(extension):
                continue
            if self.left.kept(extension):  # declared: a label member is then copied, under its name
                if member.kind in (IMAGE, ARRAY):
                    fields[extension] = fields.get(extension, 0) + 1
                continue
            if member.kind in (IMAGE, ARRAY):
                raise InputError(
                    f"{shard.path}: member {member.name!r}: its extension {extension!r} (all of its base name "
                    "after the first dot, which webdataset and --anonymize-names keep) is not a file type "
                    f"alone, so it may be part of a name; if it is a field of the samples, declare it with "
                    f"--keep {extension}; otherwise rename the files before making the shards (KEY.FIELD, "
                    "with no dot in KEY)")
            member.kind, member.reason, member.withheld = NEVER, UNDECLARED_REASON, UNDECLARED
        for extension, count in fields.items():
            self.left.copied(extension, "field name", FIELD_REASON, members=count)

    def _keyed_members(self) -> Iterator[tuple[Shard, Member]]:
        """Each (shard, member) of a sample: a member with a key (an extension), not a folder entry."""
        for shard in self.shards:
            for member in shard.members:
                if member.key is not None and member.kind != FOLDER:
                    yield shard, member

    def _jobs(self) -> list[ArrayJob]:
        jobs = []
        for shard in self.shards:
            written: dict[str, str] = {}
            for member in shard.members:
                if member.kind in (IMAGE, ARRAY):
                    self._probe(shard, member)
                    jobs.append(self._job(shard, member))
                clash = written.get(member.out_name)
                if clash is not None:
                    raise InputError(f"{shard.path}: members {clash} and {member.name} would both be "
                                     f"written as {member.out_name} (images are written as PNG); rename one")
                written[member.out_name] = member.name
        return jobs

    def _probe(self, shard: Shard, member: Member) -> None:
        where = f"{shard.path}: member {member.name}"
        try:
            if member.kind == IMAGE:
                header = probe_image(shard.path, member)
                member.shape, member.dtype, member.has_alpha = header.shape, header.dtype, header.has_alpha
                member.has_icc = header.has_icc
            else:
                member.shape, member.dtype = probe_array(shard.path, member)
        except InputError:
            raise
        except pixels.Unsupported as exc:
            raise InputError(f"{where}: {exc}") from None
        except MemoryError:
            raise
        except Exception as exc:
            what = "an image" if member.kind == IMAGE else "a .npy array"
            raise InputError(f"{where}: cannot be decoded as {what} ({decode_reason(exc)})") from None
        check_numeric_dtype(Path(f"{shard.path}: member {member.name}"), member.dtype)

    def _job(self, shard: Shard, member: Member) -> ArrayJob:
        member.job = f"{shard.rel}/{member.out_name}"  # as in the output: evaluate pairs them by it
        dtype = member.decoded_dtype.newbyteorder("=")
        return ArrayJob(name=member.job, shape=(1, *member.shape), dtype=dtype,
                        read=ReadMember(shard.path, member.name, member.offset, member.size, member.kind,
                                        member.shape, dtype),
                        source={"path": str(shard.path), "format": self.format,
                                "dataset": member.out_name if self.anonymized else member.name,
                                "shape": list(member.shape), "dtype": str(member.dtype)})

    def _leftovers(self, left: leftovers.Leftovers) -> None:
        """Labels and metadata by extension, and the files beside the shards: dropped and
        listed, or copied raw where --keep names them."""
        counts: dict[tuple[str, str], int] = {}
        for shard in self.shards:
            for member in shard.members:
                if member.kind in (LEFTOVER, NEVER):
                    key = (member.label, LEFTOVER if member.kind == LEFTOVER else member.reason)
                    counts[key] = counts.get(key, 0) + 1
        self.kept_extensions: set[str] = set()
        for (label, what), count in counts.items():
            if what != LEFTOVER:
                left.kept(label)  # a --keep naming it is used: it is refused below, not unmatched
                left.dropped.append({"name": label, "kind": "member", "members": count,
                                     "reason": what if label == UNDECLARED else f"{what}: never copied raw"})
            elif left.kept(label):
                self.kept_extensions.add(label)
                left.unperturbed.append({"name": label, "kind": "member", "members": count,
                                         "reason": leftovers.KEPT})
            else:
                left.dropped.append({"name": label, "kind": "member", "members": count,
                                     "reason": LABEL_REASON})
        self._files_beside(left)
        self.keep_alpha = left.alpha_channels(sum(member.has_alpha for shard in self.shards
                                                  for member in shard.members if member.job), "image member")
        keys = len({(shard.path, member.key) for shard in self.shards for member in shard.members if member.job})
        if keys and not self.anonymized:  # written as they are: listed, so the summary line names them
            left.copied("sample keys", "name", f"the keys of {plural(keys, 'sample')} (member names without their "
                                               "extensions), written as they are: often file names, which can "
                                               "name a person; --anonymize-names numbers them")
        folders = sum(member.kind == FOLDER for shard in self.shards for member in shard.members)
        if folders and self.anonymized:
            left.dropped.append({"name": FOLDER_ENTRIES, "kind": "member", "members": folders,
                                 "reason": FOLDER_REASON})
        self.keep_icc = left.icc_profiles(sum(member.has_icc for shard in self.shards
                                              for member in shard.members if member.job), "image member")
        left.considered(job.name for job in self.jobs)
        left.check(self.path)

    def _files_beside(self, left: leftovers.Leftovers) -> None:
        """The files beside the shards: copied raw under their names where --keep names them,
        else dropped and listed, by name, or with --anonymize-names counted (their names can
        name people; the name map lists them, as an image folder's skipped files)."""
        self.kept_files: list[str] = []
        self.files_left_out: list[str] = []
        for rel in self.others:
            never = data_file(self.base / rel)
            if never:
                left.kept(rel)  # a --keep naming it is used: it is refused, not unmatched
                self.files_left_out.append(rel)
                if not self.anonymized:
                    left.drop(rel, "file", f"{never}: never copied raw")
            elif left.kept(rel):
                self.kept_files.append(rel)
                left.copied(rel, "file", leftovers.KEPT)
            else:
                self.files_left_out.append(rel)
                if not self.anonymized:
                    left.drop(rel, "file", OTHER_FILE_REASON)
        if self.anonymized and self.files_left_out:
            left.drop(FILES_WITHHELD, "file", f"{plural(len(self.files_left_out), 'file')} beside the shards, not "
                                              "perturbed and not named by --keep (which never copies a data file); "
                                              "their names withheld (--anonymize-names): the name map lists them")

    def _samples(self) -> dict[str, list[list[str]]]:
        """By shard, the perturbed members of each sample: the members of one key. A key
        that comes back after other keys' members (which webdataset reads as a second
        sample) is the same subject's, so its members join the first ones' record: counted
        apart, each would carry a figure that leaves the other out."""
        found: dict[str, list[list[str]]] = {}
        self.sample_count = 0
        for shard in self.shards:
            rows: dict[str, list[str]] = {}
            for member in shard.members:
                if member.key is None or member.kind == FOLDER:
                    continue
                row = rows.setdefault(member.key, [])
                if member.job is not None:
                    row.append(member.job)
            self.sample_count += len(rows)
            found[shard.rel] = [row for row in rows.values() if row]
        return found

    def _report(self) -> None:
        labels = (LABEL_REASON, UNDECLARED_REASON)
        never = [e for e in self.left.dropped if e["kind"] == "member" and e["reason"] not in (*labels, FOLDER_REASON)]
        for entry in never:
            self.messages.append(f"dropped the {entry['name']} members ({plural(entry['members'], 'member')}): "
                                 f"{entry['reason']}, not even with --keep")
        if self.anonymized and self.files_left_out:
            self.messages.append(f"dropped {plural(len(self.files_left_out), 'file')} beside the shards (named in "
                                 "the name map; --keep NAME copies one raw)")
        files = [e["name"] for e in self.left.dropped if e["kind"] == "file" and e["reason"] == OTHER_FILE_REASON]
        if files:
            self.messages.append(f"dropped {plural(len(files), 'file')} beside the shards: {listing(files)} "
                                 "(--keep NAME copies one raw)")
        data = [e["name"] for e in self.left.dropped
                if e["kind"] == "file" and e["reason"] != OTHER_FILE_REASON and e["name"] != FILES_WITHHELD]
        if data:
            self.messages.append(f"dropped {plural(len(data), 'file')} holding data beside the shards, never "
                                 f"copied raw, not even with --keep: {listing(data)} (the manifest's dropped "
                                 "says why)")
        dropped = [e for e in self.left.dropped if e["kind"] == "member" and e["reason"] in labels]
        kept = [e for e in self.left.unperturbed if e["kind"] == "member"]
        if dropped:
            self.messages.append(f"dropped the {', '.join(e['name'] for e in dropped)} members "
                                 f"({plural(sum(e['members'] for e in dropped), 'member')}; the manifest's "
                                 "dropped lists them; --keep EXTENSION copies labels raw)")
        if kept:
            self.messages.append(f"copied the {', '.join(e['name'] for e in kept)} members raw (--keep)")
        if self.links:  # with --anonymize-names a count: the name map names them
            self.manifest_extra["skipped_symbolic_links"] = len(self.links) if self.anonymized else self.links
            self.messages.append(f"skipped {plural(len(self.links), 'symbolic link')}: "
                                 + ("named in the name map" if self.anonymized else listing(self.links)))
        if self.anonymized:
            self.messages.append(f"renamed the keys of {plural(len(self.new_keys), 'sample')} to their numbers "
                                 "in order, 000000, 000001, ... (the name map pairs them)")
        renamed = self.manifest_extra[self.format]["members_renamed"]
        if renamed and not self.anonymized:
            self.messages.append(f"{plural(renamed, 'image member')} written as PNG under the same key "
                                 "(KEY.jpg -> KEY.png)")

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def manifest_inputs(self) -> list[dict[str, Any]]:
        """The arrays' sources; with --anonymize-names each names its shard as the output does
        (its name in the folder of shards), not by the input's path, whose folders can name people."""
        if not self.anonymized:
            return super().manifest_inputs()
        shard_of = {m.job: s.rel for s in self.shards for m in s.members if m.job is not None}
        return [{**job.source, "path": shard_of[job.name]} for job in self.jobs]

    def name_map(self, output_path: Path, manifest_path: Path) -> dict:
        """The name map: the sample keys the output withholds. It can name the people in the data."""
        return {"schema": name_maps.SCHEMA, "sensitive": name_maps.SENSITIVE,
                "tool": {"name": "tldp", "version": __version__}, "name_map_id": self.name_map_id,
                "input": str(self.path), "output": str(output_path), "manifest": str(manifest_path),
                "samples": self.new_keys, "files_left_out": self.files_left_out,
                "skipped_symbolic_links": self.links,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}

    def output_dtype(self, dtype: np.dtype) -> str:
        """Image members as PNG of their own bit depth, .npy members of the engine's dtype."""
        members = [m for s in self.shards for m in s.members if m.job is not None]
        image_dtypes = sorted({str(m.decoded_dtype.newbyteorder("=")) for m in members if m.kind == IMAGE})
        kinds = [" and ".join(f"{d} PNG" for d in image_dtypes)] if image_dtypes else []
        return ", ".join(kinds + ([f"{np.dtype(dtype)} .npy"] if any(m.kind == ARRAY for m in members) else []))

    def rows(self, jobs: list[ArrayJob]) -> list[list[str]] | None:
        """The perturbed members of a sample are one subject's record; every member is in
        one row (a sample of one member is a row of one)."""
        wanted = {job.name for job in jobs}
        rows = [[name for name in row if name in wanted] for shard in self.samples.values() for row in shard]
        rows = [row for row in rows if row]
        return rows if any(len(row) > 1 for row in rows) else None
