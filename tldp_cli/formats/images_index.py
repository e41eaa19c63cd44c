"""The index files of a folder of images (formats/images.py), as Hugging Face's imagefolder
reads them: metadata.jsonl or metadata.csv, whose file_name column (or any *_file_name one)
names images by their paths relative to the index's own folder. With --copy-other the
reader rewrites them (rewritten): the names of images the output renames follow (only
their suffix changes), and the rows naming images the output does not hold are dropped.
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
from pathlib import Path

from tldp_cli.errors import InputError, reason_of
from tldp_cli.files.checked_io import json_value

# Index files that name the images, as Hugging Face's imagefolder reads them: a file_name
# column (or any *_file_name one) of paths relative to the index's own folder.
INDEX_FILES = ("metadata.jsonl", "metadata.csv")
# imagefolder's third index, which tldp cannot rewrite (Parquet): not copied when it would
# name images the output does not hold.
PARQUET_INDEX = "metadata.parquet"


def rewritten(rel: str, text: str, out_names: dict[str, str], unwritten: dict[str, str],
              where: Path) -> tuple[str, list[dict]]:
    """The index file `rel` (its `text`, read from `where`) as the output holds it, and its
    rows dropped ({name, kind, reason}, as the manifest's dropped lists them). `out_names`:
    each image's output name; `unwritten`: the files the output does not hold (name -> why)."""
    names = _IndexNames(rel, out_names, unwritten)
    rewrite = _rewrite_csv if rel.endswith(".csv") else _rewrite_jsonl
    text, rows = rewrite(text, names, where)
    return text, [{"name": f"{rel} {row}", "kind": "index row",
                   "reason": f"names {value}, {unwritten[names.path(value)]}: not in the output"}
                  for row, value in rows]


def _is_name_column(key: object) -> bool:
    return isinstance(key, str) and (key == "file_name" or key.endswith("_file_name"))


class _IndexNames:
    """The names in the index file at `index_rel`: a file_name value resolved to the
    input's file it names (path), and to the output's name for it (rename). Only a renamed
    image's suffix changes, so a value keeps its own spelling ("./a.jpg" -> "./a.png");
    names of anything but a renamed image are kept. `unwritten`: the files the output does
    not hold (name -> why), whose rows are dropped."""

    def __init__(self, index_rel: str, out_names: dict[str, str], unwritten: dict[str, str]):
        self.folder = posixpath.dirname(index_rel)
        self.out_names = out_names
        self.unwritten = unwritten

    def path(self, value: str) -> str:
        return posixpath.normpath(posixpath.join(self.folder, value))

    def rename(self, value: str) -> str:
        out = self.out_names.get(self.path(value))
        suffix = posixpath.splitext(value)[1]
        return value if out is None or not suffix else value[:-len(suffix)] + posixpath.splitext(out)[1]

    def not_written(self, row: dict) -> str | None:
        """The first file_name value of the row that names a file not written, if any."""
        return next((v for k, v in row.items() if _is_name_column(k) and isinstance(v, str)
                     and self.path(v) in self.unwritten), None)


def unreadable(where: Path, problem: str) -> InputError:
    return InputError(f"{where}: {problem}, so the image names in it cannot be rewritten to the "
                      "output's; fix it or leave out --copy-other")


def _rewrite_jsonl(text: str, names: _IndexNames, where: Path) -> tuple[str, list[tuple[str, str]]]:
    """The text with image names renamed and the rows naming a file not written left out;
    and those rows ("line N", the file_name value)."""
    lines: list[str | None] = list(text.split("\n"))  # as JSON Lines readers split: not at U+2028
    dropped = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json_value(line, f"line {number}")
        except InputError as exc:  # not JSON, or nested too deeply to parse
            raise unreadable(where, str(exc)) from None
        if not isinstance(row, dict):
            raise unreadable(where, f"line {number} is not a JSON object")
        gone = names.not_written(row)
        if gone is not None:
            lines[number - 1] = None
            dropped.append((f"line {number}", gone))
            continue
        renamed = {k: names.rename(v) if _is_name_column(k) and isinstance(v, str) else v
                   for k, v in row.items()}
        if renamed != row:
            dumped = json.dumps(renamed, ensure_ascii=False)
            try:
                dumped.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (a name that is not UTF-8): a \u escape
                dumped = json.dumps(renamed)
            lines[number - 1] = dumped + ("\r" if line.endswith("\r") else "")
    return "\n".join(line for line in lines if line is not None), dropped


def _rewrite_csv(text: str, names: _IndexNames, where: Path) -> tuple[str, list[tuple[str, str]]]:
    """As _rewrite_jsonl; rows are numbered from the first after the header ("row N")."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as exc:
        raise unreadable(where, f"not readable as CSV ({reason_of(exc)})") from None
    if not rows:
        return text, []
    columns = [i for i, name in enumerate(rows[0]) if _is_name_column(name)]
    kept, dropped = [], []
    for number, row in enumerate(rows[1:], 1):
        gone = names.not_written({rows[0][i]: row[i] for i in columns if i < len(row)})
        if gone is not None:
            dropped.append((f"row {number}", gone))
        else:
            kept.append([names.rename(v) if i in columns else v for i, v in enumerate(row)])
    if kept == rows[1:]:
        return text, []
    written = io.StringIO(newline="")
    csv.writer(written, lineterminator="\r\n" if "\r\n" in text else "\n").writerows([rows[0], *kept])
    return written.getvalue(), dropped
