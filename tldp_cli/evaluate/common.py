"""What the parts of `tldp evaluate` and `tldp sweep` share: the warning every report and
table opens with, the progress callback, and numbers made fit for JSON."""

from __future__ import annotations

import math
from typing import Callable

# Every report and sweep is computed from the raw data (a record's error and relative
# error give its exact norm), so it says so in its first field.
SENSITIVE = "computed from the raw data: keep it with the raw data, never with the release"

Progress = Callable[[int, int], None]


def finite(x: float | None) -> float | None:
    """JSON has no NaN/Inf: they become null."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None

