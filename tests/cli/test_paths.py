"""Paths the commands refuse while parsing the command line (issue 30): `-` (a stream) and
URLs, one line, exit 2, the URL quoted as given, nothing written."""

import numpy as np
import pytest

from tests.builders import assert_one_line_error, siblings

REMOTE = "remote paths are not supported; copy the data locally"
STDIN = "reading from stdin is not supported; save the stream to a .npy file first"


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, np.zeros((3, 4), np.uint8))
    return path


@pytest.mark.parametrize("url", ["s3://bucket/era.zarr", "gs://bucket/x.npy", "https://host/x.npy",
                                 "http://host/x.npy", "hf://datasets/x", "file:///tmp/x.npy"])
@pytest.mark.parametrize("command", ["perturb", "plan"])
def test_a_url_as_input_is_refused_as_given(cli, tmp_path, url, command):
    """It used to say 's3:/bucket/era.zarr: no such file' (the URL folded by Path)."""
    before = siblings(tmp_path)
    result = cli(command, url, "--eps", "1")
    assert_one_line_error(result, 2, url, REMOTE)
    assert siblings(tmp_path) == before


@pytest.mark.parametrize("command", ["perturb", "plan"])
def test_stdin_as_input_is_refused_with_the_reason(cli, command):
    """It used to say '-: no such file or directory'."""
    assert_one_line_error(cli(command, "-", "--eps", "1"), 2, STDIN)


@pytest.mark.parametrize("args", [
    ["perturb", "{data}", "--eps", "1", "--out", "URL"],
    ["perturb", "{data}", "--eps", "1", "--manifest", "URL"],
    ["perturb", "{data}", "--eps", "1", "--weights", "URL"],
    ["perturb", "{data}", "--eps", "1", "--ledger", "URL"],
    ["perturb", "{data}", "--eps", "1", "--preview", "URL"],
    ["perturb", "{data}", "--eps", "1", "--seed-file", "URL"],
    ["perturb", "{data}", "--eps", "1", "--mechanism", "privunit", "--basis", "URL"],
    ["audit", "--eps", "1", "--elements", "4", "--range", "0:1", "--mechanism", "privunit", "--basis", "URL"],
    ["evaluate", "URL", "{data}"],
    ["evaluate", "{data}", "URL"],
    ["evaluate", "{data}", "{data}", "--labels", "URL"],
    ["sweep", "{data}", "--eps", "1", "--out", "URL"],
    ["weight-mask", "URL", "--method", "constant", "--weight", "1", "--out", "m.npy"],
    ["weight-mask", "{data}", "--method", "box", "--boxes", "URL", "--out", "m.npy"],
    ["ledger", "URL"],
])
def test_every_path_option_refuses_a_url(cli, data, args):
    url = "s3://bucket/some//key"
    result = cli(*[url if a == "URL" else a.format(data=data) for a in args])
    assert_one_line_error(result, 2, url, REMOTE)


@pytest.mark.parametrize("args, fragment", [
    (["perturb", "{data}", "--eps", "1", "--preview", "-"], "tldp writes files, not standard output"),
    (["perturb", "{data}", "--eps", "1", "--weights", "-"], STDIN),
    (["ledger", "-"], "standard input and output are not supported"),
    (["evaluate", "-", "{data}"], STDIN),
    (["weight-mask", "-", "--method", "constant", "--weight", "1", "--out", "m.npy"], STDIN),
])
def test_a_dash_is_refused_with_the_reason(cli, data, args, fragment):
    assert_one_line_error(cli(*[a.format(data=data) for a in args]), 2, fragment)


def test_a_file_named_dash_is_still_reachable(cli, tmp_path, monkeypatch):
    """`./-` names a file called '-', as for any other tool."""
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "-.npy", np.zeros((3, 4), np.uint8))
    (tmp_path / "-.npy").rename(tmp_path / "-")
    result = cli("plan", "./-", "--eps", "1", "--format", "npy", "-q")
    assert result.exit_code == 0, result.stderr
