"""`tldp audit`."""

import json
from enum import Enum
from typing import Annotated, Optional

import typer

from tldp_cli.cli.options import Eps, MechanismOption, BudgetOption, BasisOption, DtypeOption, RngOption, Quiet, Debug, AllowWeakSeed, Mechanism, Noise, OutDtype, RngKind, Sampler, SeedFile, resolve_seed
from tldp_cli.cli.app import app, debugging, fail, run


class AuditScope(str, Enum):
    both = "both"
    element = "element"
    record = "record"


@app.command("audit", no_args_is_help=True)
def audit_command(
    eps: Eps,
    noise: Annotated[Optional[Noise], typer.Option(
        help="As for perturb. Default: laplace; gaussian for mvg and idn.", show_default=False)] = None,
    sampler: Annotated[Sampler, typer.Option(
        help="As for perturb: exact audits laplace and gaussian as perturb draws them for float "
             "data (discrete noise on its automatic grid); float audits the continuous samplers, "
             "whose floating-point leak the audit detects. --noise discrete-* audits integer "
             "data.")] = Sampler.exact,
    mechanism: MechanismOption = Mechanism.tldp,
    budget: BudgetOption = None,
    basis: BasisOption = None,
    value_range: Annotated[str, typer.Option(
        "--range", metavar="LO:HI", help="The declared value range; the neighbours sit at its ends.")] = "0:256",
    elements: Annotated[str, typer.Option(
        "--elements", metavar="I", help="Elements per record, or the record's shape (28x28; "
                                        "mvg needs it).")] = "1",
    dp_delta: Annotated[float, typer.Option(
        help="delta at which (epsilon, delta) figures are certified, as for perturb.")] = 1e-5,
    granularity: Annotated[Optional[float], typer.Option(
        metavar="G", help="Discrete noise on float data snapped to multiples of G, as for "
                          "perturb. Default: integer data (an integer --range).",
        show_default=False)] = None,
    samples: Annotated[int, typer.Option(
        help="Draws of each neighbour per scope, in elements (the record scope draws "
             "SAMPLES // I records). About 100 bytes of memory each (at most 2e7).")] = 1_000_000,
    confidence: Annotated[float, typer.Option(
        help="Probability that every lower bound in the report holds.")] = 0.95,
    scope: Annotated[AuditScope, typer.Option(
        help="element: two records that differ in one element; record: two records at opposite "
             "ends of the range (privunit: two records of far-apart directions).")] = AuditScope.both,
    seed: Annotated[Optional[str], typer.Option(
        metavar="HEX", help="Make the audit reproducible with this secret key, as for perturb "
                            "(or --seed-file, $TLDP_SEED).", show_default=False)] = None,
    seed_file: SeedFile = None,
    allow_weak_seed: AllowWeakSeed = False,
    rng: RngOption = RngKind.secure,
    dtype: DtypeOption = OutDtype.float32,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON to stdout.")] = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Look for evidence that a mechanism leaks more than its certified figures.

    Runs the mechanism on two neighbouring inputs, chooses the most telling event on
    half the draws and bounds its probabilities on the other half (Clopper-Pearson):
    the audited eps is a lower bound on the true privacy loss at the stated
    confidence. Exit 1 when it exceeds a certified figure (VIOLATION). A lower
    bound is never a certificate: "ok" means no violation was found, and figures
    above the reach (about ln of the draws) cannot be contradicted at that size.

    \b
    Examples:
      tldp audit --eps 1 --elements 4 --range 0:1
      tldp audit --eps 1 --noise gaussian --elements 784 --samples 4000000 --json > audit.json
      tldp audit --eps 2 --mechanism mvg --sampler float --elements 28x28 --scope record --seed-file audit.seed
      tldp audit --eps 1 --noise discrete-laplace --elements 16 --range 0:256
      tldp audit --eps 4 --mechanism privunit --elements 8x8 --range -1:1

    The third finds the leak of the float sampler's low-order bits: VIOLATION, exit 1
    (docs/audit.md).
    """
    from tldp_cli import audit as audit_mod
    from tldp_cli.privacy.mechanisms import default_noise
    from tldp_cli.run.options import parse_range

    debug = debugging(debug)

    def action():
        return audit_mod.run(
            mechanism=mechanism.value, budget=budget.value if budget else None, epsilon=eps,
            noise=noise.value if noise is not None else default_noise(mechanism.value),
            value_range=parse_range(value_range), shape=audit_mod.parse_shape(elements),
            dp_delta=dp_delta, granularity=granularity, samples=samples, confidence=confidence,
            scopes=audit_mod.SCOPES if scope is AuditScope.both else (scope.value,),
            seed=resolve_seed(seed, seed_file), allow_weak_seed=allow_weak_seed,
            rng=rng.value, dtype=dtype.value, sampler=sampler.value, basis=basis)

    report = run(debug, action)
    if not quiet:
        for line in audit_mod.format_report(report):
            typer.echo(f"tldp: {line}" if not line.startswith(" ") else line, err=True)
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False))
    if report["verdict"] == "VIOLATION":
        worst = max((row for s in report["scopes"] for row in s["claims"]),
                    key=lambda row: row["epsilon_lower_bound"] - row["certified_epsilon"])
        fail(f"audit found a privacy VIOLATION: eps >= {worst['epsilon_lower_bound']:.4g} at "
              f"delta {worst['delta']:.3g}, certified {worst['certified_epsilon']:.4g} "
              f"(confidence {report['confidence']:g})", 1)
    if report["verdict"] == "MISCALIBRATED":
        worst = next(row for row in report["request"]["scopes"] if not row["consistent"])
        fail(f"the audited calibration is not the request's: it certifies eps "
              f"{worst['certified_epsilon']:.4g} {worst['scope'].replace('_', ' ')} where --eps "
              f"{report['epsilon']:g} implies {worst['requested_epsilon']:.4g}", 1)
    if not quiet:
        typer.echo(f"tldp: consistent: no audited lower bound exceeds its certified figure "
                   f"(confidence {report['confidence']:g}); this is evidence, not a proof", err=True)


