"""Pairing and integrity: ORIGINAL paired with PERTURBED the way `perturb` wrote them
(array by array, or image file by image file through the name map), the outputs' sha256
against the manifest, and shapes and record counts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from tldp_cli import formats
from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.formats import FormatOptions
from tldp_cli.privacy.mechanisms import Calibration
from tldp_cli.run import manifest as manifest_mod

if TYPE_CHECKING:
    from tldp_cli.run.bases import UserBasis


class Pair:
    """One array (or one image) of the original and its perturbed counterpart."""

    def __init__(self, name, job, perturbed_shape, read_perturbed, calib):
        self.name = name
        self.job = job
        self.perturbed_shape = tuple(perturbed_shape)
        self.read_perturbed = read_perturbed
        self.calib = calib


def _image_format(m: dict) -> str:
    """How an image folder's output was written (the manifest's image_output)."""
    return (m.get("image_output") or {}).get("format", "png")


def is_clipped(m: dict) -> bool:
    """Whether the writer rounded and clipped the noisy values (8/16-bit PNG; a table's
    image and integer columns)."""
    return bool((m.get("image_output") or {}).get("clipped")) or bool((m.get("table_output") or {}).get("clipped"))


def open_original(original: Path, m: dict, input_format: str | None):
    module = formats.detect(original, input_format)
    datasets = [i["dataset"] for i in m.get("inputs", []) if isinstance(i, dict) and "dataset" in i]
    # the field names a WebDataset run under --anonymize-names declared with --keep (seg.png)
    fields = [u["name"] for u in m.get("unperturbed") or [] if isinstance(u, dict) and u.get("kind") == "field name"]
    options = FormatOptions(datasets=datasets if module.selects_arrays else [],
                            image_format=_image_format(m) if module.records_are_files else "png",
                            skip_bad=bool(m.get("skipped_bad_images")),
                            anonymize_names=module.name_map and bool(m.get("anonymized_names")), keep=fields)
    return module, module.open_reader(original, options)


def pair_up(module, reader, perturbed: Path, m: dict, calibs: Mapping[str, Calibration | None],
           issues: list[dict], renamed: dict[str, str] | None = None,
           input_format: str | None = None, basis: UserBasis | None = None) -> list[Pair]:
    """`renamed`: an --anonymize-names run's name map, original name -> output name;
    `input_format`: --format, which the perturbed data shares with the original; `basis`:
    a privunit run's user basis (user_basis_of), which a --store coefficients output needs."""
    jobs = reader.arrays()
    if module.records_are_files:
        from tldp_cli.formats import images_reader, images_writer

        fmt = _image_format(m)
        if not perturbed.is_dir():
            raise InputError(f"{perturbed}: the original is a folder of images, so the perturbed "
                             "data must be a folder too")
        pairs = []
        for image in reader.images:
            job = next(j for j in jobs if j.name == image.rel)
            if renamed is not None and image.rel not in renamed:
                issues.append({"check": "pairing", "passed": False,
                               "detail": f"{image.rel}: not in the name map"})
                continue
            out_path = perturbed / (renamed[image.rel] if renamed is not None
                                    else images_reader.output_name(image.rel, fmt, image.pages > 1))
            if not out_path.is_file():
                issues.append({"check": "pairing", "passed": False,
                               "detail": f"{out_path}: missing (perturbed copy of {image.rel})"})
                continue
            try:
                shape = (1, *images_writer.read_output(out_path).shape)
            except Exception as exc:
                issues.append({"check": "pairing", "passed": False,
                               "detail": f"{out_path}: cannot be read ({reason_of(exc)})"})
                continue

            def read(start, stop, p=out_path):
                return images_writer.read_output(p)[None]

            pairs.append(Pair(image.rel, job, shape, read, calibs[job.name]))
        return pairs

    out_module = formats.detect(perturbed, input_format)
    if out_module.name != module.name:
        raise InputError(f"{perturbed}: is {out_module.name} but the original is {module.name}")
    datasets = [j.source["dataset"] for j in jobs if "dataset" in j.source]
    out_reader = out_module.open_reader(perturbed, FormatOptions(datasets=datasets if out_module.selects_arrays
                                                                 else []))
    out_jobs = {j.name: j for j in out_reader.arrays()}
    pairs = []
    for job in jobs:
        out = out_jobs.get(job.name)
        if out is None:
            issues.append({"check": "pairing", "passed": False,
                           "detail": f"{perturbed}: has no array {job.name}"})
            continue
        pairs.append(Pair(job.name, job, out.shape, out.read, calibs[job.name]))
    if isinstance((m.get("privunit") or {}).get("stored"), dict):
        return rebuilt_pairs(pairs, m, issues, basis)
    return pairs


def rebuilt_pairs(pairs: list[Pair], m: dict, issues: list[dict], user: UserBasis | None) -> list[Pair]:
    """A --store coefficients output: each pair reads the records its stored rows rebuild
    (manifest.rebuild_records, the records --store records writes), so the perturbed data is
    compared record by record as that of a records run; a pair whose rows are not
    (records, k) keeps its shape, which the shape check fails."""
    unit = m["privunit"]
    basis = None if user is None else user.matrix
    issues.append({"check": "coefficients", "passed": True,
                   "detail": "PERTURBED holds each record's k released coefficients (--store coefficients): "
                             "compared as the records they rebuild (privunit.stored.rebuild)"})
    rebuilt = []
    for pair in pairs:
        if len(pair.perturbed_shape) != 2 or pair.perturbed_shape[1] != unit["k"]:
            rebuilt.append(pair)
            continue

        def read(start, stop, rows=pair.read_perturbed):
            return manifest_mod.rebuild_records(m, rows(start, stop), basis)

        rebuilt.append(Pair(pair.name, pair.job, (pair.perturbed_shape[0], *pair.job.record_shape), read,
                            pair.calib))
    return rebuilt


def user_basis_of(m: dict, manifest_path: Path, given: Path | None) -> UserBasis | None:
    """The user's basis of a --mechanism privunit --basis FILE.npy run (None for any other run),
    loaded and checked against the manifest's privunit.basis.sha256: `given` (evaluate's
    --basis), else the path the manifest records (as perturb was given it), else, when that
    is relative and not found, the same path beside the manifest."""
    from tldp_cli.run import bases

    unit = m.get("privunit") if m.get("mechanism") == "privunit" else None
    stated = unit.get("basis") if isinstance(unit, dict) else None
    if not isinstance(stated, dict) or stated.get("kind") != bases.FILE:
        if given is not None:
            raise UsageError(f"--basis applies to a run of --mechanism privunit --basis FILE.npy; "
                             f"{manifest_path} is not one")
        return None
    path = given
    if path is None:
        recorded = Path(str(stated.get("path")))
        beside = manifest_path.parent / recorded
        path = beside if not recorded.is_absolute() and not recorded.exists() and beside.exists() else recorded
        if not path.exists():
            where = " (nor beside the manifest)" if not recorded.is_absolute() else ""
            raise InputError(f"{recorded}: the run's basis (privunit.basis.path) is not found{where}; "
                             "pass it with --basis FILE.npy")
    user = bases.load_basis(path)
    if user.sha256 != stated.get("sha256"):
        raise InputError(f"{path}: not the run's basis: its sha256 {user.sha256} differs from the manifest's "
                         f"privunit.basis.sha256 {stated.get('sha256')}"
                         + ("" if given is not None else "; pass the run's basis with --basis FILE.npy"))
    return user


def _output_root(entries: list[str], perturbed: Path) -> Path | None:
    """The output path the manifest recorded for a folder output (Zarr, images): each
    entry is that path / the file's path inside the folder. The ancestor of the entries
    named as `perturbed`; for a folder renamed since the run, the ancestor under which
    `perturbed` holds the most of them (the deepest of equals); None if it holds none.
    Either way every file is then checked against its sha256."""
    name = perturbed.resolve().name
    common = Path(os.path.commonpath(entries)) if entries else None
    if len(entries) == 1:
        common = Path(entries[0]).parent
    ancestors = [] if common is None else [common, *common.parents]
    named = next((a for a in ancestors if a.name and a.name == name), None)
    if named is not None or not ancestors:
        return named
    held = [sum((perturbed / Path(e).relative_to(a)).is_file() for e in entries) for a in ancestors]
    return ancestors[held.index(max(held))] if max(held) else None


def check_hashes(m: dict, perturbed: Path) -> list[dict]:
    checks = []
    entries = [o.get("path", "") for o in m.get("outputs", []) if isinstance(o, dict)]
    if not entries:
        return [{"check": "sha256", "passed": False, "detail": "the manifest lists no outputs"}]
    if perturbed.is_file():
        located = {Path(entries[0]): perturbed} if len(entries) == 1 else {}
        if len(entries) != 1:
            return [{"check": "sha256", "passed": False,
                     "detail": f"the manifest lists {len(entries)} outputs but {perturbed} is one file"}]
    else:
        root = _output_root(entries, perturbed)
        if root is None:
            return [{"check": "sha256", "passed": False,
                     "detail": f"{perturbed} holds none of the manifest's outputs (nor do they lie "
                               f"under a folder named {perturbed.name})"}]
        located = {Path(e): perturbed / Path(e).relative_to(root) for e in entries}
    bad, missing = [], []
    for entry in m["outputs"]:
        actual = located[Path(entry["path"])]
        if not actual.is_file():
            missing.append(str(actual))
        elif manifest_mod.sha256_file(actual) != entry.get("sha256"):
            bad.append(str(actual))
    checks.append({"check": "sha256", "passed": not bad and not missing, "files": len(entries),
                   "mismatched": bad, "missing": missing,
                   "detail": (f"{len(bad)} file(s) differ from the manifest's sha256"
                              + (f", {len(missing)} missing" if missing else "")) if bad or missing
                   else f"all {len(entries)} output file(s) match"})
    if perturbed.is_dir():
        listed = {a.resolve() for a in located.values()}
        extra = sorted(str(p) for p in perturbed.rglob("*") if p.is_file() and p.resolve() not in listed)
        checks.append({"check": "unlisted_files", "passed": not extra, "files": extra,
                       "detail": f"{len(extra)} file(s) not in the manifest" if extra
                       else "no file outside the manifest"})
    return checks


def shape_check(m: dict, jobs, pairs: list[Pair]) -> dict:
    problems = []
    for pair in pairs:
        if pair.perturbed_shape != pair.job.shape:
            problems.append(f"{pair.name}: perturbed shape {pair.perturbed_shape}, original {pair.job.shape}")
    records = sum(j.records for j in jobs)
    if m.get("records") != records:
        problems.append(f"manifest says {m.get('records')} records, the original has {records}")
    elements = max((j.elements for j in jobs), default=0)
    if m.get("elements_per_record") != elements:
        problems.append(f"manifest says {m.get('elements_per_record')} elements per record, "
                        f"the original has {elements}")
    stated = sorted(tuple(i.get("shape", [])) for i in m.get("inputs", []) if isinstance(i, dict))
    actual = sorted(tuple(j.source["shape"]) for j in jobs)
    if stated != actual:
        problems.append("the manifest's input shapes differ from the original's")
    return {"check": "shapes", "passed": not problems,
            "detail": "; ".join(problems[:3]) if problems
            else f"{len(pairs)} array(s), {records} records, shapes agree"}


def read_manifest(perturbed: Path, manifest_path: Path | None) -> tuple[dict, Path]:
    manifest_path = Path(manifest_path) if manifest_path else manifest_mod.default_path(perturbed)
    if not manifest_path.is_file():
        raise InputError(f"{manifest_path}: manifest not found (give it with --manifest)")
    m = manifest_mod.read(manifest_path)  # InputError naming it when it is not JSON
    manifest_mod.check(m, manifest_path)
    return m, manifest_path


def input_named(m: dict, renamed: dict[str, str] | None) -> dict:
    """`m` with the arrays it keys figures by (value_ranges, granularities) under the input's
    names again, which an --anonymize-names manifest gives by output name (name map:
    input name -> output name)."""
    if not renamed:
        return m
    back = {out: name for name, out in renamed.items()}
    return {**m, **{key: {back.get(name, name): value for name, value in m[key].items()}
                    for key in ("value_ranges", "granularities") if isinstance(m.get(key), dict)}}


def name_map_of(m: dict, original: Path, name_map: Path | None, manifest_path: Path) -> dict[str, str] | None:
    """An --anonymize-names run's name map (original name -> output name); None otherwise."""
    from tldp_cli.formats import images, images_reader

    anonymized = m.get("anonymized_names")
    sources = [formats.of_source(i) for i in m.get("inputs") or [] if isinstance(i, dict)]
    if anonymized and not any(f is not None and f.records_are_files for f in sources):
        # WebDataset: the original's reader, anonymizing too, names the samples as perturb did
        return None
    if not anonymized:
        if name_map is not None:
            raise UsageError(f"--name-map applies to outputs of perturb --anonymize-names; "
                             f"{manifest_path} says the names were kept")
        return None
    if not isinstance(anonymized, dict) or not isinstance(anonymized.get("name_map_id"), str):
        raise InputError(f"{manifest_path}: damaged manifest: 'anonymized_names' lacks its name_map_id")
    return images_reader.read_name_map(name_map or images.default_name_map(original), anonymized["name_map_id"])

