"""A run's manifest and its way back: build_manifest puts it together from the run's
RunContext (manifest.build, with the Parts manifest_parts lists), and options_of_manifest
reads a manifest back into the options that calibrate as the run did (evaluate recomputes
a run's calibration from them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tldp_cli import formats
from tldp_cli.formats import ArrayJob, cf
from tldp_cli.privacy.mechanisms import PRIVUNIT
from tldp_cli.run import bases as bases_mod
from tldp_cli.run import manifest as manifest_mod
from tldp_cli.run import privacy_warnings
from tldp_cli.run.calibration import Calibrated
from tldp_cli.run.context import RunContext
from tldp_cli.run.options import COEFFICIENTS, RECORDS, PerturbOptions, checked_budget
from tldp_cli.sampling import discrete


def build_manifest(run: RunContext, writer=None, outputs: list[dict] | None = None) -> dict[str, Any]:
    """The manifest of a run (`tldp plan`: no writer, no outputs): everything it states
    comes from the calibration, the reader and the writer, never from the data.
    manifest.build joins the parts (manifest_parts), none writing a key another wrote."""
    options, calibrated, jobs, reader, streams = run.options, run.calibrated, run.jobs, run.reader, run.streams
    postprocessing = []
    if options.store == COEFFICIENTS:
        rounding = "no rounding" if calibrated.out_dtype == "float64" else "one rounding"
        postprocessing = [f"store V, each record's released unit vector, as its k coefficients in "
                          f"{calibrated.out_dtype} ({rounding}; privunit.stored): no write-back"]
    elif calibrated.largest.privunit is not None:
        ranges = sorted({(lo, hi) for lo, hi, _ in calibrated.bounds.values()}) or [(calibrated.lo, calibrated.hi)]
        shown = ", ".join(f"[{lo:g}, {hi:g}]" for lo, hi in ranges)
        clip = (f"clip to {shown}" if len(ranges) == 1
                else f"clip each record to its own declared range ({shown}: value_ranges)")
        postprocessing = [f"write back reference + c B^T (w * V) in the record's shape (c: privunit.output_scale, "
                          f"w: privunit.write_back), {clip}, cast to {calibrated.out_dtype}"]
    records_of = calibrated.records_of(jobs)
    return manifest_mod.build(
        calib=calibrated.largest, certified=calibrated.certified,
        value_range=(calibrated.lo, calibrated.hi),
        records=sum(job.records for job in jobs), rng=options.rng,
        calibrations=list(records_of.items()),
        # PrivUnit: a record spanning n arrays gets --eps / n in each
        epsilon=options.eps if calibrated.largest.privunit is not None else None,
        seeded=options.seed is not None, weak_seed=bool(streams and streams.weak_seed), weights=run.weights_info,
        inputs=reader.manifest_inputs() if reader else [job.source for job in jobs], outputs=outputs or [],
        preprocessing=(["clip"] if options.clip is not None else [])
        + (["clip_input"] if options.clip_input else []),
        postprocessing=postprocessing + ([note] if calibrated.grid and (note := discrete.saturation_note(calibrated.out_dtype))
                                         else [])  # (a note for integer output only)
        + (list(writer.postprocessing) if writer else []),
        output_dtype=(writer and writer.output_dtype) or str(calibrated.out_dtype),
        parts=manifest_parts(options, calibrated, jobs, reader, writer, list(run.masks)))


def manifest_parts(options: PerturbOptions, calibrated: Calibrated, jobs: list[ArrayJob], reader, writer,
                   masked: list[str]) -> list[manifest_mod.Part]:
    """What the format's reader and writer, the privacy warnings, the options, the
    missing-data markers, the rows, the sampler's grid, the ranges and PrivUnit add to
    the manifest, in the order the manifest lists them."""
    Part = manifest_mod.Part
    record = (reader and reader.record_description) or privacy_warnings.record_name(
        formats.get(reader.format) if reader else None, jobs, calibrated.rows,
        bool(reader and reader.records_are_tensors))
    warnings = [privacy_warnings.large_epsilon(calibrated.certified, record, checked_budget(options)),
                privacy_warnings.idle_weights(options.weights, jobs, calibrated.calib_of, masked,
                                              options.eps, checked_budget(options)),
                privacy_warnings.integer_clip(options.clip, jobs, calibrated.lo, calibrated.top,
                                              calibrated.top != calibrated.hi),
                privacy_warnings.kept_per_record(
                    list((reader.manifest_extra if reader else {}).get("unperturbed") or []), jobs,
                    bool(getattr(reader, "anonymized", False)), bool(reader and reader.records_are_tensors))]
    chosen: dict[str, Any] = {"sampler": options.sampler}
    if options.clip is not None:
        chosen["clip"] = {"norm": "linf", "bound": options.clip}
    if calibrated.raw_release:
        chosen["raw_release_allowed"] = {scope: delta for scope, delta in calibrated.raw_release}
    rows: dict[str, Any] = {}
    if any(len(row) > 1 for row in calibrated.rows):
        rows = {"row_datasets": [row for row in calibrated.rows if len(row) > 1],
                "row_records": _row_records(calibrated.rows, jobs)}
    ranges: dict[str, Any] = {}
    if calibrated.bounds:  # --range NAME=LO:HI, or dtypes of their own ranges: each array's range (and grid step)
        named = reader.manifest_name if reader else str
        # sorted by the name written: withheld names' order would tell who is who
        bounds = sorted(((named(name), bound) for name, bound in calibrated.bounds.items()),
                        key=lambda item: item[0])
        ranges["value_ranges"] = {name: [lo, hi] for name, (lo, hi, _) in bounds}
        if calibrated.grid is not None:
            ranges["granularities"] = {name: grid.granularity for name, (_, _, grid) in bounds if grid is not None}
    if calibrated.range_groups:
        ranges["range_groups"] = calibrated.range_groups
    sizes = {c.elements for c in calibrated.calibrations}
    return [
        Part("the reader", reader.manifest_extra if reader else {}),
        Part("the writer", writer.manifest_extra if writer else {}),  # e.g. dropped_filters
        Part("the privacy warnings", {"warnings": [w for w in warnings if w]} if any(warnings) else {}),
        Part("the options", chosen),
        Part("the missing-data markers", cf.marker_fields(calibrated.in_range_markers, options.public_missing)),
        Part("the rows", rows),
        Part("the sampler's grid", discrete.manifest_fields(calibrated.grid, options.granularity is None,
                                                            calibrated.out_dtype)
             if calibrated.grid is not None else {}),
        Part("the ranges", ranges),
        Part("the record sizes", {"elements_per_record_range": [min(sizes), max(sizes)]} if len(sizes) > 1 else {}),
        Part("PrivUnit", {"privunit": privunit_of_run(options, calibrated)}
             if calibrated.largest.privunit is not None else {}),
    ]


def privunit_of_run(options: PerturbOptions, calibrated: Calibrated) -> dict[str, Any] | None:
    """A --mechanism privunit run's `privunit` object, as its manifest states it (the basis, k,
    the reference, the output scale; with --store coefficients, what rebuilds the records);
    None for the other mechanisms."""
    if calibrated.largest.privunit is None:
        return None
    return manifest_mod.privunit_entry(
        calibrated.largest, bases_mod.parse_basis(options.basis), calibrated.user_basis,
        stored=str(calibrated.out_dtype) if options.store == COEFFICIENTS else None)


def options_of_manifest(m: dict[str, Any], input: Path) -> PerturbOptions:
    """The inverse of build_manifest for what `calibrate_run` reads: the options of the run whose
    manifest is `m`, over the input `input`, that decide its calibration. The noise is the
    noise as drawn (sampled_noise); the range is the declared one (--clip's (-C, C) as the
    range it set) with each array's own (--range NAME=LO:HI); the grid step only where it
    was given (--granularity); privunit's --basis as the run had it. What a manifest does
    not state (the seed, the weights' file, the output's paths) keeps its default."""
    acc = m.get("accounting") or {}
    automatic = str((m.get("grid") or {}).get("rule", "")).startswith("automatic")
    # The engine's float dtype: the output's (its first word: a Zarr store's label images keep
    # their integer dtype, named after it), or where each tensor keeps its own (model files),
    # the grid's rule ("float64: granularity times ..."); else not given
    written = str(m.get("output_dtype") or "").split(" ")[0]
    grid_dtype = str((m.get("grid") or {}).get("output_dtype_rule", "")).split(":")[0]
    float_dtype = next((d for d in (written, grid_dtype) if d in ("float32", "float64")), None)
    return PerturbOptions(
        input=input, eps=float(m["epsilon"]), mechanism=m["mechanism"], noise=m["noise"],
        budget=m["budget"], value_range=(float(m["value_range"][0]), float(m["value_range"][1])),
        ranges={name: (float(lo), float(hi)) for name, (lo, hi) in (m.get("value_ranges") or {}).items()},
        granularity=None if automatic else m.get("granularity"), dtype=float_dtype,
        dp_delta=float(acc.get("dp_delta", 1e-5)), basis=_basis_of_manifest(m),
        reference=_reference_of_manifest(m), allow_raw_release="raw_release_allowed" in m,
        store=COEFFICIENTS if isinstance((m.get("privunit") or {}).get("stored"), dict) else RECORDS)


def _basis_of_manifest(m: dict[str, Any]) -> str | None:
    """--basis as the privunit run had it: its file (checked against the manifest's sha256
    when loaded), dct:K where K was given, else dct (the default rule, recomputed); the
    inverse of manifest.privunit_entry."""
    unit = m.get("privunit")
    if m.get("mechanism") != PRIVUNIT or not isinstance(unit, dict):
        return None
    basis = unit.get("basis") or {}
    if basis.get("kind") == "file":
        return str(basis.get("path"))
    return f"dct:{unit.get('k')}" if str(unit.get("k_rule", "")).startswith("--basis") else "dct"


def _reference_of_manifest(m: dict[str, Any]) -> str | None:
    """--reference as the privunit run had it (manifest.privunit_entry's reference_option); a
    manifest from before the option had the zero rule for every record."""
    unit = m.get("privunit")
    if m.get("mechanism") != PRIVUNIT or not isinstance(unit, dict):
        return None
    return str(unit.get("reference_option", "zero"))


def _row_records(rows: list[list[str]], jobs: list[ArrayJob]) -> dict[str, Any]:
    """The subjects' records where rows join arrays: row i of every array of a row is one
    record, so there are as many as the row's arrays have rows, each of their elements."""
    by_name = {job.name: job for job in jobs}
    sizes = []  # (records, elements of each) per row of arrays
    for row in rows:
        members = [by_name[name] for name in row]
        sizes.append((members[0].records, sum(job.elements for job in members)))
    return {"records": sum(records for records, _ in sizes),
            "elements_per_record": max(elements for _, elements in sizes),
            "definition": "row i of every array of a row_datasets entry is one record (one subject); "
                          "elements_per_record is the largest such record's"}
