"""The application's shared behaviour (tldp_cli/cli/app.py): TLDP_DEBUG, a closed stdout."""

import pytest


@pytest.mark.parametrize("value", ["0", "false", "no", "off", "FALSE"])
def test_tldp_debug_set_to_a_false_value_shows_no_traceback(cli, tmp_path, monkeypatch, value):
    """A pipeline's `TLDP_DEBUG=0` (or false) is debugging off: one line, as without it."""
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"garbage")
    monkeypatch.setenv("TLDP_DEBUG", value)
    result = cli("perturb", bad, "--eps", 1)
    assert result.exit_code == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "bad.npy: not a dataset" in result.stderr


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_tldp_debug_set_to_a_true_value_shows_the_traceback(cli, tmp_path, monkeypatch, value):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"garbage")
    monkeypatch.setenv("TLDP_DEBUG", value)
    result = cli("plan", bad, "--eps", 1)
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "bad.npy: not a dataset" in result.stderr
