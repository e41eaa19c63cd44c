"""The privacy manifest: build, write, read.

It travels with the perturbed data, so it holds no hash or statistic of the raw
input, and never the seed. `certified` is what accounting.certify_run returned for
the run (a Certificate); `accounting_entry` renders it as the manifest's `accounting`
object, the one place its keys are spelled (`guarantee_of` reads a scope back).

`build` is the one place a manifest is put together: its own fields (the calibration,
the accounting, the inputs and outputs) and the `Part`s others contribute (a format's
reader and writer, the sampler's grid, the missing-data markers, the rows, the ranges,
PrivUnit), joined by `assemble`. Each key comes from one part: a part writing a key
another part wrote raises KeyCollision (a bug, never a silent overwrite), except the
lists of SHARED_LISTS, which every part may add entries to. Every key any part writes
is declared in docs/manifest.schema.json and named in docs/manifest.md.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from tldp_cli import __version__
from tldp_cli.errors import InputError, OutputError, reason_of
from tldp_cli.files.checked_io import json_value
from tldp_cli.files.output import removed_during_run
from tldp_cli.privacy import mvg_idn, privunit
from tldp_cli.privacy.certificates import (Certificate, Designed, FileGuarantee, Guarantee, PrivUnitFigures,
                                           TensorFigures)
from tldp_cli.privacy.mechanisms import Calibration
from tldp_cli.sampling import projection

SCHEMA = "tldp-manifest/1"


# Keys several parts add entries to (a format's reader and writer, the missing-data
# markers): their lists are joined, in the order of the parts.
SHARED_LISTS = frozenset({"unperturbed", "dropped"})


class Part(NamedTuple):
    """Fields a contributor adds to the manifest; `owner` names it in a KeyCollision."""
    owner: str
    fields: Mapping[str, Any]


class KeyCollision(RuntimeError):
    """Two parts of a manifest wrote the same key: a bug in tldp, not in the input."""


def assemble(parts: Sequence[Part]) -> dict[str, Any]:
    """The manifest of `parts`, keys in the order the parts give them. Raises KeyCollision
    when a key (not one of SHARED_LISTS, whose lists are joined) comes from two parts."""
    manifest: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for owner, fields in parts:
        for key, value in fields.items():
            if key not in owners:
                owners[key], manifest[key] = owner, value
            elif key in SHARED_LISTS:
                manifest[key] = [*manifest[key], *value]
            else:
                raise KeyCollision(f"manifest key {key!r} written by both {owners[key]} and {owner}")
    return manifest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_path(output: Path) -> Path:
    return output.with_name(output.name + ".manifest.json")


def build(*, calib: Calibration, certified: Certificate, value_range: tuple[float, float], records: int,
          rng: str, seeded: bool, weights: dict | None, inputs: list[dict],
          outputs: list[dict], postprocessing: list[str], preprocessing: list[str],
          output_dtype: str, parts: Sequence[Part] = (),
          calibrations: list[tuple[Calibration, int]] | None = None,
          weak_seed: bool = False, epsilon: float | None = None) -> dict[str, Any]:
    """The manifest: its own fields, then those of `parts` (assemble: no key twice).
    `calib`: the calibration of the largest record, which the scalar fields
    (elements_per_record, noise_scale, calibration_epsilon, expected error) describe;
    `epsilon`: --eps where it is not calib's (PrivUnit: a record spanning n arrays gets
    --eps / n in each).
    `calibrations`: every calibration of the run with its number of records, when records
    differ in size; the retain probability is the largest of any, and more than one are
    listed under `calibrations`. `weak_seed`: the seed held fewer than rng.MIN_SEED_BITS
    bits or followed an obvious pattern (rng.PATTERN_BITS) and was accepted by request
    (--allow-weak-seed)."""
    every = [c for c, _ in calibrations] if calibrations else [calib]
    manifest: dict[str, Any] = {
        "schema": SCHEMA,
        "tool": {"name": "tldp", "version": __version__},
        "mechanism": calib.mechanism,
        "noise": calib.noise,
        "budget": calib.budget,
        "epsilon": calib.epsilon if epsilon is None else epsilon,
        "value_range": [value_range[0], value_range[1]],
        "range_width": calib.range_width,
        "elements_per_record": calib.elements,
        "records": records,
        "noise_scale": calib.scale,
        "noise_scale_kind": ("output_scale" if calib.privunit else
                             "b" if calib.noise.endswith("laplace") else "sigma"),
        "calibration_epsilon": calib.element_epsilon,
        "retain_probability": max(c.p for c in every) * (1 - _min_weight(weights)),
        "retain_probability_log10": _log10_retain(every, weights),
        "expected_l2_error_per_record": _finite(calib.expected_l2_error()),
        "weights": weights,
        "rng": rng,
        "seeded": seeded,
        "weak_seed": weak_seed,
        "accounting": accounting_entry(certified),
        "inputs": inputs,
        "outputs": outputs,
        "output_dtype": output_dtype,
        "preprocessing": preprocessing,
        "postprocessing": postprocessing,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if calibrations and len(dict.fromkeys(every)) > 1:
        manifest["calibrations"] = calibration_entries(calibrations, weights)
    if rng == "fast":  # the figures assume ideal randomness
        from tldp_cli.privacy import accounting  # certified already imported it

        manifest["accounting"]["notes"].append(accounting.FAST_RNG_NOTE)
    return assemble([Part("the calibration and accounting", manifest), *parts])


def accounting_entry(certified: Certificate) -> dict[str, Any]:
    """The manifest's `accounting` object: the certified figures (docs/manifest.md)."""
    entry: dict[str, Any] = {"per_element": scope_entry(certified.per_element),
                             "per_record": scope_entry(certified.per_record),
                             "dp_delta": certified.dp_delta, "accountant": certified.accountant,
                             "notes": list(certified.notes)}
    if certified.worst_case_of is not None:
        entry["worst_case_of"] = certified.worst_case_of
    if certified.designed is not None:
        entry["designed"] = designed_entry(certified.designed)
    if certified.privunit is not None:
        entry["privunit"] = privunit_figures_entry(certified.privunit)
    if certified.per_file is not None:
        entry["per_file"] = file_entry(certified.per_file)
    if certified.per_tensor is not None:
        entry["per_tensor"] = [tensor_entry(tensor) for tensor in certified.per_tensor]
    return entry


def scope_entry(scope: Guarantee) -> dict[str, Any]:
    """A scope's figures (per_element, per_record, ...), as the manifest states them."""
    return {"epsilon": scope.epsilon, "delta": scope.delta, "delta_log10": scope.delta_log10,
            "rho": scope.rho, "approx": {"delta": scope.approx_delta, "epsilon": scope.approx_epsilon},
            "point_mass_delta": scope.point_mass_delta,
            "point_mass_delta_log10": scope.point_mass_delta_log10}


def guarantee_of(entry: Mapping[str, Any]) -> Guarantee:
    """The Guarantee a scope's entry states (scope_entry read back: the release ledger's
    figures). A field an older entry lacks: no rho, no kept values, approx the headline."""
    approx = entry.get("approx") or {}
    return Guarantee(epsilon=entry["epsilon"], delta=entry["delta"], delta_log10=entry.get("delta_log10"),
                     rho=entry.get("rho"), approx_delta=approx.get("delta", entry["delta"]),
                     approx_epsilon=approx.get("epsilon", entry["epsilon"]),
                     point_mass_delta=entry.get("point_mass_delta") or 0.0,
                     point_mass_delta_log10=entry.get("point_mass_delta_log10"))


def ledger_figures(certified: Certificate) -> dict[str, Any]:
    """What the release ledger records of a run's figures: its accounting's per_element,
    per_record and per_file entries, and `charged`, the scope of one subject's data
    (accounting.subject_scope: a record, or a model file's whole file) that the ledger
    charges to each subject the release touches."""
    from tldp_cli.privacy import accounting  # the ledger's runs import it anyway

    entry = accounting_entry(certified)
    return {**{scope: entry[scope] for scope in ("per_element", "per_record", "per_file")},
            "charged": accounting.subject_scope(certified)[0]}


def file_entry(per_file: FileGuarantee) -> dict[str, Any]:
    """`accounting.per_file`: everything the run released, composed, and what it covers."""
    return {**scope_entry(per_file), "records": per_file.records, "elements": per_file.elements}


def tensor_entry(tensor: TensorFigures) -> dict[str, Any]:
    """An entry of `accounting.per_tensor`: a tensor's calibration and per-record figures."""
    calib = tensor.calibration
    return {"name": tensor.name, "elements": calib.elements, "noise_scale": calib.scale,
            "calibration_epsilon": calib.element_epsilon, "retain_probability": calib.p,
            "retain_probability_log10": calib.p_log10, **scope_entry(tensor.per_record)}


def designed_entry(designed: Designed) -> dict[str, Any]:
    """`accounting.designed` (MVG, IDN): the figure of the mechanism's own design condition."""
    entry: dict[str, Any] = {"epsilon": designed.epsilon, "delta": designed.delta, "scope": "record",
                             "condition": designed.condition}
    if designed.mvg is not None:
        params = designed.mvg
        entry.update(precision_budget=designed.precision_budget, unfolding=f"mode-{mvg_idn.MODE}",
                     rows=params.rows, columns=params.columns, r=params.r, H_r=params.h_r,
                     H_r_half=params.h_r_half, gamma=params.gamma, s2=params.s2, zeta=params.zeta,
                     alpha=params.alpha, beta=params.beta)
    else:
        entry.update(s2=designed.s2, zeta=designed.zeta)
    return entry


def privunit_figures_entry(figures: PrivUnitFigures) -> dict[str, Any]:
    """`accounting.privunit`: PrivUnit's split and its certified figures."""
    return dataclasses.asdict(figures)


def calibration_entries(calibrations: list[tuple[Calibration, int]], weights: dict | None) -> list[dict]:
    """One entry per calibration (record size), smallest records first."""
    entries = []
    for calib, records in sorted(calibrations, key=lambda cn: (cn[0].elements, cn[0].rows or 0)):
        entry: dict[str, Any] = {"elements_per_record": calib.elements, "records": records, "noise_scale": calib.scale,
                 "calibration_epsilon": calib.element_epsilon,
                 "retain_probability": calib.p * (1 - _min_weight(weights)),
                 "retain_probability_log10": _log10_retain([calib], weights),
                 "expected_l2_error_per_record": _finite(calib.expected_l2_error())}
        if calib.rows is not None:
            entry["rows"] = calib.rows
        if calib.privunit is not None:
            entry["privunit"] = privunit_split(calib)
        entries.append(entry)
    return entries


def privunit_split(calib: Calibration) -> dict[str, Any]:
    """One record size's PrivUnit parameters: its shape, k, the split and the write-back."""
    params = calib.privunit_params()
    return {"record_shape": list(params.record_shape), "k": params.k, "epsilon": calib.epsilon,
            "gamma": params.gamma, "p": params.p, "epsilon0": params.epsilon0,
            "output_scale": params.output_scale, "reference": params.reference}


def privunit_entry(calib: Calibration, choice: Any, user_basis: Any, stored: str | None = None) -> dict[str, Any]:
    """The manifest's `privunit` object (the largest record's; `calibrations` lists every
    size): the public basis, the reference point, the output scale and the rules that
    chose them (the certified figures are under accounting.privunit). `stored`: with
    --store coefficients, the dtype the coefficients are stored in (stored_entry)."""
    params = calib.privunit_params()
    if user_basis is not None:
        basis = {"kind": "file", "k": params.k, "path": str(user_basis.path), "sha256": user_basis.sha256,
                 "public": "declared public by the user (--basis FILE.npy); a basis learned from "
                           "the data released is not public",
                 "description": f"the {params.k} orthonormal rows of {user_basis.path.name}"}
        k_rule = "the rows of the basis file"
    else:
        basis = {"kind": "dct", "k": params.k, "layout": projection.describe_layout(params.record_shape),
                 "public": "computed from the record's shape and k alone",
                 "description": projection.dct_basis(params.record_shape, params.k).describe()}
        k_rule = ("--basis dct:K" if choice.k is not None else
                  f"default: {privunit.DEFAULT_K_RULE} (chosen without the released data: "
                  "docs/choosing-eps.md)")
    return {
        "basis": basis, "k": params.k, "k_rule": k_rule, "record_shape": list(params.record_shape),
        "gamma": params.gamma, "p": params.p, "epsilon0": params.epsilon0,
        "reference": params.reference, "reference_option": params.reference_option,
        "reference_rule": reference_rule(params),
        "output_scale": {"c": params.output_scale, "kind": "display",
                         "rule": f"(hi - lo) sqrt(I) / {privunit.OUTPUT_SCALE_DIVISOR}: the "
                                 "written deviation c B^T V has that norm (c B^T (w * V) about that "
                                 "norm); the record's own norm is not released"},
        "zero_record": "a record whose coefficients are all 0 has no direction: it is released "
                       "as the direction e_1 (the first coefficient)",
        "pre_emphasis": pre_emphasis_entry(params),
        "write_back": write_back_entry(params),
        "written": (f"V itself, k {stored} values per record (stored): no write-back" if stored
                    else "reference + c B^T (w * V), clipped to the declared range" if params.prior_exponent
                    is not None or params.emphasis_exponent is not None
                    else "reference + c B^T V, clipped to the declared range"),
        **({"stored": stored_entry(calib, user_basis, stored)} if stored else {}),
    }


def stored_entry(calib: Calibration, user_basis: Any, dtype: str) -> dict[str, Any]:
    """--store coefficients: what each row of the output holds, the order of its k values,
    the weights w, and how to rebuild the records --store records writes (public values only;
    docs/choosing-eps.md#storing-the-coefficients)."""
    from tldp_cli.sampling import engine

    params = calib.privunit_params()
    basis = engine.privunit_basis(calib) if user_basis is None else None
    weights = engine.write_back_weights(calib, basis)  # a user's basis: None, unweighted
    entry: dict[str, Any] = {
        "kind": "coefficients",
        "values": f"V, each record's released unit vector (PrivUnit's output, float64), "
                  + ("stored as computed (no rounding)" if dtype == "float64" else f"rounded once to {dtype}"),
        "dtype": dtype,
        "shape": "(records, k): row i holds record i's k coefficients, in the basis's order",
        "write_back_weights": [1.0] * params.k if weights is None else [float(w) for w in weights],
        "rebuild": "record = clip(reference + output_scale.c * (write_back_weights * V) @ B, value_range), "
                   "reshaped to record_shape (B: the k x I basis, one row per coefficient in order): the "
                   "record --store records writes, before its cast to the output dtype",
    }
    if basis is None:
        entry["basis_rows"] = "the rows of the basis file, in order (privunit.basis.path, its sha256)"
        return entry
    entry["coefficient_order"] = [[int(n) for n in row] for row in zip(*basis.index)]
    if projection.is_volume(params.record_shape):
        channels, depth, height, width, channels_last = projection.volume_layout(params.record_shape)
        entry["layout"] = {"channels": channels, "depth": depth, "height": height, "width": width,
                           "channels_last": channels_last}
        entry["basis_rows"] = ("row r of B is DCT-II row i (depth) times row j (height) times row l (width) "
                               "in channel c, [c, i, j, l] = coefficient_order[r], DCT-II row f of size n at "
                               "x = 0..n-1: sqrt((1 if f == 0 else 2) / n) cos(pi (2x + 1) f / (2n)); the "
                               "record's elements in layout order (channels, depth, height, width), or "
                               "(depth, height, width, channels) when layout.channels_last")
    else:
        channels, height, width, channels_last = projection.layout(params.record_shape)
        entry["layout"] = {"channels": channels, "height": height, "width": width, "channels_last": channels_last}
        entry["basis_rows"] = ("row r of B is DCT-II row i (height) times DCT-II row j (width) in channel c, "
                               "[c, i, j] = coefficient_order[r], DCT-II row f of size n at x = 0..n-1: "
                               "sqrt((1 if f == 0 else 2) / n) cos(pi (2x + 1) f / (2n)); the record's "
                               "elements in layout order (channels, height, width), channels moved last "
                               "when layout.channels_last")
    return entry


def rebuild_records(m: Any, coefficients: Any, basis: Any = None) -> Any:
    """The records a --store records run writes (before its cast to the output dtype), from
    the rows a --store coefficients run stored and its manifest `m`: reference + c B^T (w * V),
    clipped to the range (privunit.stored.rebuild; docs/choosing-eps.md#storing-the-coefficients).
    `m` may also be the Perturbed of perturb_array(..., mechanism="privunit", store="coefficients"),
    which carries the same privunit object and range. `basis`: a user's basis (--basis
    FILE.npy), its k x I rows, which the manifest names but does not hold. A function of the
    stored rows and public values only."""
    import numpy as np

    if not isinstance(m, Mapping):  # a Perturbed (run/arrays.py): its privunit object and range
        if not isinstance(getattr(m, "privunit", None), Mapping) or "stored" not in m.privunit:
            raise InputError("the result holds no stored coefficients: it is not of perturb_array(..., "
                             "mechanism=\"privunit\", store=\"coefficients\")")
        m = {"privunit": m.privunit, "value_range": list(m.value_range)}
    unit: Mapping[str, Any] = m["privunit"] if isinstance(m.get("privunit"), Mapping) else {}
    stored = unit.get("stored")
    if not isinstance(stored, Mapping):
        raise InputError("the manifest states no stored coefficients (privunit.stored): it is not of a "
                         "--store coefficients run")
    k, shape = int(unit["k"]), tuple(int(n) for n in unit["record_shape"])
    rows = np.asarray(coefficients, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != k:
        raise InputError(f"the stored coefficients have shape {rows.shape}; the manifest says (records, {k})")
    synthesis: Any
    if unit["basis"]["kind"] == "dct":
        synthesis = projection.dct_basis(shape, k)
        if [[int(n) for n in row] for row in zip(*synthesis.index)] != stored.get("coefficient_order"):
            raise InputError("the manifest's privunit.stored.coefficient_order is not this version's DCT order; "
                             "build B from it (docs/choosing-eps.md#storing-the-coefficients)")
    elif basis is None:
        raise InputError("the coefficients are in a user's basis, which the manifest names but does not "
                         "hold: pass basis=np.load(privunit.basis.path)")
    else:
        matrix = np.asarray(basis, dtype=np.float64)
        if matrix.shape != (k, math.prod(shape)):
            raise InputError(f"the basis has shape {matrix.shape}; the manifest's records need ({k}, "
                             f"{math.prod(shape)}): k rows of the record's elements (np.load(privunit.basis.path))")
        synthesis = projection.MatrixBasis(matrix, shape, "")
    weights = np.asarray(stored["write_back_weights"], dtype=np.float64)
    lo, hi = (float(v) for v in m["value_range"])
    records = synthesis.synthesize(float(unit["output_scale"]["c"]) * (weights * rows))
    records += float(unit["reference"])
    return np.clip(records, lo, hi, out=records)


def reference_rule(params: Any) -> str:
    """How --reference chose the reference point of records of this shape."""
    rule = f"{params.reference_rule}: {privunit.REFERENCE_RULES[params.reference_rule]}"
    if params.reference_option == "auto":
        colour = privunit.is_colour_image(params.record_shape)
        rule += (" (--reference auto: mid for colour images (H, W, 3 or 4, or a stack of them: D, H, W, 3 or 4), "
                 "zero for other records; "
                 f"these records are {'' if colour else 'not '}colour images)")
    return rule


def pre_emphasis_entry(params: Any) -> dict[str, Any]:
    """The public weight d of each coefficient before the normalisation (u = d z / |d z|)."""
    if params.emphasis_exponent is None:
        return {"weights": "none", "rule": "d = 1: pre-emphasis only for the DCT basis over two or "
                                           "three axes (an image and volume statistic)"}
    return {"weights": "spectral", "exponent": params.emphasis_exponent,
            "rule": privunit.EMPHASIS_RULE + "; u = d z / |d z|, and the write-back's w carries 1/d",
            "chosen": "on public digit data and MNIST training digits, not on the data this run "
                      "releases: docs/choosing-eps.md"}


def write_back_entry(params: Any) -> dict[str, Any]:
    """The write-back's public weights w of the released coefficients (post-processing)."""
    if params.prior_exponent is None and params.emphasis_exponent is not None:
        return {"weights": "inverse_emphasis", "alignment": params.alignment,
                "rule": f"w = 1/d (the pre-emphasis undone), mean square 1; the Wiener filter only at an "
                        f"alignment m = E<V, u> below {privunit.WEIGHTED_BELOW_ALIGNMENT:g}",
                "chosen": "on public digit data, not on the data this run releases: docs/choosing-eps.md"}
    if params.prior_exponent is None:
        return {"weights": "none", "alignment": params.alignment,
                "rule": "w = 1: weights only for the DCT basis over two or three axes (an image and volume "
                        "statistic: 1/d, and "
                        f"the Wiener filter at an alignment m = E<V, u> below {privunit.WEIGHTED_BELOW_ALIGNMENT:g})",
                "chosen": "on public digit data, not on the data this run releases: docs/choosing-eps.md"}
    emphasised = "" if params.emphasis_exponent is None else (
        "; with the pre-emphasis d: P_j proportional to d_j^2 (1 + f_j)^-2, and w times 1/d")
    return {"weights": "wiener", "prior_exponent": params.prior_exponent, "alignment": params.alignment,
            "rule": privunit.WRITE_BACK_RULE + emphasised + "; m = alignment = E<V, u>, below "
                    f"{privunit.WEIGHTED_BELOW_ALIGNMENT:g}",
            "chosen": "on public digit data, not on the data this run releases: docs/choosing-eps.md"}


def _min_weight(weights: dict | None) -> float:
    """The smallest weight; 0 when there are none or it is withheld (a data-derived mask)."""
    return (weights or {}).get("min") or 0.0


def _log10_retain(calibrations: list[Calibration], weights: dict | None) -> float | None:
    """log10 of the largest retain probability, (1 - w_min) max p."""
    logs = [c.p_log10 for c in calibrations if c.p_log10 is not None]
    if not logs:
        return None
    factor = 1 - _min_weight(weights)
    return None if factor <= 0 else max(logs) + math.log10(factor)


def to_json(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, allow_nan=False) + "\n"


def _finite(value: float) -> float | None:
    """JSON has no infinity: a figure beyond float64 is stated as null."""
    return value if math.isfinite(value) else None


def write(manifest: dict[str, Any], path: Path, shown_as: Path | None = None) -> None:
    """Writes the manifest to `path` (a temporary; `shown_as` is what errors name)."""
    try:
        with open(path, "x", encoding="utf-8") as f:
            f.write(to_json(manifest))
            f.flush()
            os.fsync(f.fileno())
    except FileNotFoundError:  # its work folder is gone
        raise removed_during_run(path) from None
    except OSError as exc:
        raise OutputError(f"{shown_as or path}: cannot write the manifest ({reason_of(exc)})") from None


def read(path: Path) -> dict[str, Any]:
    """The manifest at `path`; InputError naming it when it is not JSON (or nests deeper
    than checked_io.MAX_JSON_DEPTH), OSError when it cannot be read."""
    return json_value(Path(path).read_bytes(), f"{path}: not a readable JSON manifest: it")


_NUMBER = (int, float)
# The fields a reader of a manifest (tldp evaluate) relies on, with their JSON types.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "mechanism": str, "noise": str, "budget": str, "epsilon": _NUMBER, "value_range": list, "range_width": _NUMBER,
    "elements_per_record": int, "records": int, "noise_scale": _NUMBER, "accounting": dict, "inputs": list,
    "outputs": list}


def check(m: Any, path: Path) -> None:
    """Refuses, naming the first bad field, a manifest that is not one tldp wrote."""
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        raise InputError(f"{path}: not a {SCHEMA} manifest")
    for key, kind in _REQUIRED.items():
        value = m.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InputError(f"{path}: damaged manifest: {key!r} is missing or not a "
                             f"{getattr(kind, '__name__', 'number')}")
    lo_hi = m["value_range"]
    if len(lo_hi) != 2 or not all(isinstance(v, _NUMBER) for v in lo_hi):
        raise InputError(f"{path}: damaged manifest: 'value_range' is not [lo, hi]")
    for entry in m["outputs"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                and isinstance(entry.get("sha256"), str)):
            raise InputError(f"{path}: damaged manifest: an 'outputs' entry lacks its path or sha256")
    for entry in m["inputs"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)):
            raise InputError(f"{path}: damaged manifest: an 'inputs' entry lacks its path")
    problem = _nested_problem(m)
    if problem:
        raise InputError(f"{path}: damaged manifest: {problem}")


def _nested_problem(m: dict[str, Any]) -> str | None:
    """The first field inside a manifest that evaluate reads whose JSON type is wrong (a
    figure of the wrong type is a mismatch of evaluate's parameters check instead)."""
    accounting = m["accounting"]
    dp_delta = accounting.get("dp_delta")
    if not isinstance(dp_delta, _NUMBER) or isinstance(dp_delta, bool):
        return "'accounting.dp_delta' is missing or not a number"
    for scope in ("per_element", "per_record", "per_file"):
        value = accounting.get(scope)
        if not isinstance(value, dict) and (scope != "per_file" or value is not None):
            return f"'accounting.{scope}' is missing or not an object"
        if isinstance(value, dict) and not isinstance(value.get("approx", {}), dict):
            return f"'accounting.{scope}.approx' is not an object"
    for keys in (("grid",), ("weights",), ("privunit",), ("privunit", "basis"), ("accounting", "privunit")):
        parent = m if len(keys) == 1 else m.get(keys[0])
        value = parent.get(keys[-1]) if isinstance(parent, dict) else None
        if value is not None and not isinstance(value, dict):
            return f"'{'.'.join(keys)}' is not an object"
    if not isinstance(m.get("preprocessing", []), list):
        return "'preprocessing' is not a list"
    for entry in m["inputs"]:
        shape = entry.get("shape", [])
        if not (isinstance(shape, list) and all(type(n) is int for n in shape)):
            return "an 'inputs' entry's shape is not a list of integers"
        if not isinstance(entry.get("format", ""), str):
            return "an 'inputs' entry's format is not a string"
    return None
