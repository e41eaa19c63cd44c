"""Reads of input files that cannot hang or recurse without end (files/checked_io.py,
issue 27): open_regular for the files found by listing a folder, json_value for JSON."""

import json
import os

import pytest

from tldp_cli.errors import InputError
from tldp_cli.files import checked_io
from tldp_cli.files.checked_io import MAX_JSON_DEPTH, json_value, open_regular


def test_a_regular_file_opens_and_reads_as_usual(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\0\1\2" * 1000)
    with open_regular(tmp_path / "a.bin") as f:
        assert f.read() == b"\0\1\2" * 1000


def test_a_fifo_or_a_device_is_refused_unopened(tmp_path, alarm):
    os.mkfifo(tmp_path / "f.png")
    for path, kind in ((tmp_path / "f.png", "a FIFO"), ("/dev/null", "a device"), (tmp_path, "a folder")):
        with pytest.raises(InputError, match=f"not a regular file \\({kind}\\); tldp reads only regular files"):
            open_regular(path)


def test_a_file_swapped_for_a_fifo_after_its_check_is_refused_once_open(tmp_path, monkeypatch, alarm):
    """The check before opening can be overtaken: the open file is checked again, and it
    was opened non-blocking, so the open itself did not wait."""
    os.mkfifo(tmp_path / "f.png")
    regular = os.stat(__file__)
    monkeypatch.setattr(checked_io.os, "stat", lambda path: regular)  # "regular" when checked
    with pytest.raises(InputError, match="f.png: not a regular file \\(a FIFO\\)"):
        open_regular(tmp_path / "f.png")


def test_a_link_is_refused_where_links_are_not_followed(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / "l.png").symlink_to(tmp_path / "a.png")
    with open_regular(tmp_path / "l.png") as f:
        assert f.read() == b"x"
    with pytest.raises(InputError, match="l.png: not a regular file \\(a symbolic link\\)"):
        open_regular(tmp_path / "l.png", follow_links=False)
    regular = os.lstat(tmp_path / "a.png")  # a link put in place after the check: O_NOFOLLOW
    monkeypatch.setattr(checked_io.os, "lstat", lambda path: regular)
    with pytest.raises(OSError):
        open_regular(tmp_path / "l.png", follow_links=False)


def test_json_as_deep_as_the_limit_is_read_and_deeper_is_refused():
    assert json_value("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "x") is not None
    nested = {"a": [{"b": [1, {"c": "d"}]}]}
    assert json_value(json.dumps(nested).encode(), "x") == nested
    deeper = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    for text in (deeper, '{"k": ' + deeper + "}", "[" * 200_000 + "]" * 200_000):  # the last: RecursionError
        with pytest.raises(InputError, match=f"^f.json is not valid JSON \\(it nests lists and objects more "
                                             f"than {MAX_JSON_DEPTH} levels deep; tldp reads none deeper\\)$"):
            json_value(text, "f.json")


def test_text_that_is_not_json_is_named():
    with pytest.raises(InputError, match="^data.zarr: zarr.json is not valid JSON \\(Expecting property name"):
        json_value("{not json", "data.zarr: zarr.json")
    with pytest.raises(InputError, match="is not valid JSON"):
        json_value(b"\xff\xfe\xff", "f.json")
