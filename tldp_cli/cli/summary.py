"""The guarantee line perturb and plan print after a run: the certified figures, as the
manifest's `accounting` object states them (run/manifest.py renders it from the
accounting's Certificate), in words. Plain text from the manifest's numbers: nothing
here computes a figure."""

from __future__ import annotations

from typing import Any


def _scope(scope: dict[str, Any]) -> str:
    delta = scope["delta"]
    if delta == 0:
        d = "0" if scope["delta_log10"] is None else f"1e{scope['delta_log10']:.0f}"
    else:
        d = f"{delta:.3g}"
    text = f"eps={scope['epsilon']:.4g}, delta={d}"
    if scope.get("rho") is not None:
        text += f"; rho={scope['rho']:.4g} zCDP"
    return text


def guarantee_line(accounting: dict[str, Any], noise: str, ranges: int = 1) -> str:
    """The one-line statement of the guarantee of a manifest's `accounting`; `noise`: the
    manifest's noise; `ranges`: the declared ranges its records have (range_groups)."""
    worst = accounting.get("worst_case_of")
    over = f"calibrations, over record sizes and {ranges} ranges" if ranges > 1 else "record sizes"
    line = ("guarantee" + (f" (the worst of {worst} {over})" if worst else "")
            + f": each element ({_scope(accounting['per_element'])}); "
            f"each record ({_scope(accounting['per_record'])})")
    designed = accounting.get("designed")
    if designed:
        line += f"; as designed, each record (eps={designed['epsilon']:.4g}, delta={designed['delta']:.3g})"
    if "per_tensor" in accounting:  # model files: a record is a tensor; the file is one release
        count = len(accounting['per_tensor'])
        line += f"; whole file, {count} tensor{'s' if count != 1 else ''} ({_scope(accounting['per_file'])})"
    if noise in ("laplace", "gaussian"):
        line += "; float sampler: these figures hold for the real-valued mechanism only"
    return line
