"""What the steps of a run share: its RunContext (the checked options, the arrays, their
Calibrated, the format and its reader, the destinations, the weight masks and the random
streams) and its Report (where it says how it goes: Progress as blocks finish, each Phase
as it starts). Built by the pipeline and `tldp plan`; the manifest of a run is built from
it (run_manifest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tldp_cli import formats
from tldp_cli.formats import ArrayJob, FormatOptions
from tldp_cli.run.calibration import Calibrated
from tldp_cli.run.masks import Mask
from tldp_cli.run.options import PerturbOptions
from tldp_cli.sampling.rng import Streams

Progress = Callable[[int, int], None]  # (records just finished, total records)
Phase = Callable[[str, str], None]  # (a phase's label, what it does): as each phase of a run starts


@dataclass
class Report:
    """Where a run says how it goes: `records` as blocks finish (the progress bar), `phase`
    as each phase starts (reading the headers, planning, checking, perturbing, committing)."""

    records: Progress | None = None
    phase: Phase | None = None

    def tell(self, label: str, what: str) -> None:
        if self.phase is not None:
            self.phase(label, what)

    def done(self, records: int, total: int) -> None:
        if self.records is not None:
            self.records(records, total)


@dataclass(frozen=True)
class RunContext:
    """What the steps of a run share once it is calibrated, in place of long parameter
    lists: the checked options (options.checked_options), the input's arrays and their calibration,
    the format and its open reader, what the reader was told, and where the run says how
    it goes. A run that writes (pipeline's _perturb) adds its destinations, weight masks and random
    streams; `tldp plan` (run/plan.py) writes nothing and has none of them, and described
    records (tldp plan --elements) have no format or reader either."""

    options: PerturbOptions
    jobs: list[ArrayJob]
    calibrated: Calibrated
    module: formats.Format | None = None
    reader: Any = None  # the format's Reader
    format_options: FormatOptions = field(default_factory=FormatOptions)
    report: Report = field(default_factory=Report)
    destination: Path | None = None  # the output's final path (pipeline's _destinations)
    manifest_path: Path | None = None
    masks: dict[str, Mask] = field(default_factory=dict)  # --weights, by array name (masks.load_masks)
    weights_info: dict[str, Any] | None = None  # --weights as the manifest and --resume state them
    streams: Streams | None = None  # the run's random streams: they hold its secret key

    def writing(self) -> tuple[formats.Format, Path, Path, Streams]:
        """The format, destination, manifest path and streams of a run that writes (_perturb
        sets them all; `tldp plan`'s context has none)."""
        assert self.module is not None and self.destination is not None
        assert self.manifest_path is not None and self.streams is not None
        return self.module, self.destination, self.manifest_path, self.streams
