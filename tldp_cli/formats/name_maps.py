"""The name map of --anonymize-names, shared by the formats that rename their records
(images, webdataset): where it goes and how it is written. It pairs the input's names
with the output's: it names the people in the data, so it is kept with the raw data
(beside the input by default, readable by its owner only), never with the release.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tldp_cli.files import output
from tldp_cli.files.checked_io import writing

SCHEMA = "tldp-name-map/1"
SENSITIVE = "names the records of the raw data: keep it with the raw data, never with the release"


def default_path(path: Path) -> Path:
    """photos/ -> photos.name-map.json beside it: with the raw data, outside the output."""
    if path.name in ("", ".", ".."):
        path = path.resolve()
    return path.with_name(path.name + ".name-map.json")


def destination(name_map: Path | None, source: Path, output_path: Path, manifest: Path, overwrite: bool) -> Path:
    """Where the name map goes (default: beside the input), checked as the output is: never
    inside the input or the output, never the output or manifest itself."""
    path = Path(name_map) if name_map is not None else default_path(source)
    output.check_destination(path, source, overwrite, "name map", folder=False)
    output.check_distinct({"output": output_path, "manifest": manifest, "name map": path})
    return path


def write(document: dict, tmp: Path, shown_as: Path) -> None:
    """Writes the name map to `tmp` (a temporary that becomes `shown_as`), readable by its
    owner only: it names the people in the data."""
    data = (json.dumps(document, indent=2) + "\n").encode()
    with writing(shown_as):
        with output.create_private(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
