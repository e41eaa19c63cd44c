"""Paths tldp reads and writes are local: a stream (`-`) or a URL is refused with the
reason, quoted as given (a Path would fold a URL's '//' into '/'). No imports beyond `re`:
the CLI checks every path option with it while parsing the command line."""

from __future__ import annotations

import re

REMOTE = "remote paths are not supported; copy the data locally"
STDIN = "reading from stdin is not supported; save the stream to a .npy file first"
STDOUT = "tldp writes files, not standard output; give a file or folder path (--json prints the manifest or report)"
STREAM = "standard input and output are not supported here; give a file name"

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def problem(text: str, stream: str) -> str | None:
    """What is wrong with `text` as a local path, if anything: `stream` for `-`."""
    if text == "-":
        return stream
    if _URL.match(text):
        return f"{text}: {REMOTE}"
    return None
