"""The application's shared behaviour (tldp_cli/cli/app.py): TLDP_DEBUG, a closed stdout."""

import os
import subprocess
import sys

import pytest

from tests.builders import REPO


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


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["seed", "--json"],
    ["--version"],
    ["plan", "--elements", "28x28", "--records", "100", "--range", "0:256", "--eps", "8", "--json", "-q"],
])
def test_a_closed_stdout_is_one_line_and_exit_1(args):
    """`tldp ... --json | head -c 10` once head has gone: Click made it a silent exit 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run([sys.executable, "-m", "tldp_cli", *args], stdout=write_end,
                                 stderr=subprocess.PIPE, timeout=120, cwd=REPO)
    finally:
        os.close(write_end)
    stderr = process.stderr.decode()
    assert process.returncode == 1
    assert stderr.startswith("tldp: error: standard output: closed") and "broken pipe" in stderr, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr


@pytest.mark.parametrize("raised", ["interrupt", "wrapped"])
def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(cli, monkeypatch, raised):
    """Ctrl-C or SIGTERM while a command imports what it needs (before its run starts):
    Typer made it a silent exit 130, and Python 3.11's wrapping of one that lands in a
    class's __set_name__ (a RuntimeError) a traceback and exit 1."""
    from tldp_cli.sampling import rng

    def interrupted():
        if raised == "interrupt":
            raise KeyboardInterrupt
        raise RuntimeError("Error calling __set_name__") from KeyboardInterrupt()

    monkeypatch.setattr(rng, "new_seed", interrupted)
    result = cli("seed")
    assert result.exit_code == 130
    assert result.stderr == "tldp: error: interrupted; nothing was written\n"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [
    ["seed", "--json"],
    ["--help"],
    ["plan", "--elements", "28x28", "--records", "100", "--range", "0:256", "--eps", "8", "--json", "-q"],
])
def test_a_full_stdout_is_one_line_and_exit_1(args):
    """`tldp ... --json > m.json` on a full disk: Typer showed a traceback."""
    with open("/dev/full", "wb") as full:
        process = subprocess.run([sys.executable, "-m", "tldp_cli", *args], stdout=full,
                                 stderr=subprocess.PIPE, timeout=120, cwd=REPO)
    stderr = process.stderr.decode()
    assert process.returncode == 1
    assert stderr == "tldp: error: standard output: cannot write (No space left on device)\n", stderr


def test_json_printed_inside_a_run_to_a_full_stdout_is_one_line(monkeypatch, capsys):
    """evaluate's and sweep's --json print inside their run: it said `I/O: No space left...`."""
    import errno
    import io

    from tldp_cli.cli.app import emit_json, run

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(SystemExit) as exited:
        run(False, lambda: emit_json({"figure": 1}, True, None, False))
    assert exited.value.code == 1
    assert capsys.readouterr().err == "tldp: error: standard output: cannot write (No space left on device)\n"


def test_ctrl_c_during_an_import_inside_a_run_is_exit_130(capsys):
    """perturb imports its pipeline inside its run: a Ctrl-C landing in a class's __set_name__
    there (Python 3.11 wraps it in a RuntimeError) was 'unexpected error ...; please report it', exit 1."""
    from tldp_cli.cli.app import run

    def importing():
        raise RuntimeError("Error calling __set_name__ on 'Field' instance") from KeyboardInterrupt()

    with pytest.raises(SystemExit) as exited:
        run(False, importing)
    assert exited.value.code == 130
    assert capsys.readouterr().err == "tldp: error: interrupted; nothing was written\n"


@pytest.mark.parametrize("args, help_command", [
    (["frobnicate"], "tldp --help"),  # an unknown command: it had no hint at all
    (["--bogus"], "tldp --help"),
    (["perturb", "x.npy", "--copy-other=maybe"], "tldp perturb --help"),  # Click gives this one no context
    (["perturb", "x.npy", "--bogus"], "tldp perturb --help"),
])
def test_a_usage_error_points_to_the_help_that_answers_it(cli, args, help_command):
    from tests.builders import one_line_error

    line = one_line_error(cli(*args), 2)
    assert line.startswith("tldp: error: ") and line.endswith(f" (see '{help_command}')"), line
    assert ". (see" not in line, line


@pytest.mark.parametrize("hidden, args, extra", [
    # was exit 2
    (("distributed",), ["perturb", "{npy}", "--eps", "1", "--range", "0:1", "--scheduler", "dask"], "dask"),
    (("matplotlib",), ["sweep", "{npy}", "--eps", "1", "--range", "0:1", "--out", "{tmp}/sweep"], "eval"),
    (("cv2",), ["weight-mask", "{npy}", "--method", "faces", "--range", "0:1", "--out", "{tmp}/m.npy"], "faces"),
])
def test_a_missing_extra_is_one_line_naming_the_pip_command_exit_1(cli, tmp_path, monkeypatch, hidden, args, extra):
    """The command line is right, the installation lacks a library: exit 1 for each extra
    (--scheduler dask without Dask exited 2, the others 1), in the same words, nothing written."""
    import re

    import numpy as np

    from tests.builders import one_line_error

    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((4, 8, 8), np.float32))
    for name in [n for n in sys.modules if n.split(".")[0] in hidden] + list(hidden):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    line = one_line_error(cli(*[a.format(npy=npy, tmp=tmp_path) for a in args]), 1)
    assert re.fullmatch(rf"tldp: error: \S.* needs \S.*, an optional extra: pip install 'tldp-tensors\[{extra}\]'",
                        line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


def test_quiet_silences_stderr_s_chatter_never_the_result_on_stdout(cli, tmp_path):
    """-q: `tldp ledger -q` printed nothing at all, its listing included, where `tldp seed -q`
    printed the seed."""
    import json

    import numpy as np

    src, ledger = tmp_path / "x.npy", tmp_path / "ledger.db"
    np.save(src, np.zeros((4, 8), np.float32))
    released = cli("perturb", src, "--eps", "1", "--range", "0:1", "--ledger", ledger, "-q", "--json")
    assert released.exit_code == 0 and released.stderr == "", released.stderr
    assert json.loads(released.stdout)["epsilon"] == 1  # the result, on stdout
    loud, quiet = cli("ledger", ledger), cli("ledger", ledger, "-q")
    assert loud.exit_code == quiet.exit_code == 0
    assert "releases:" in loud.stdout and quiet.stdout == loud.stdout and quiet.stderr == ""
    seed = cli("seed", "-q")
    assert seed.exit_code == 0 and len(seed.stdout.strip()) == 32 and seed.stderr == ""


def test_quiet_still_warns_about_a_seed_file_others_can_read(cli, tmp_path):
    """A warning that asks for a change no manifest records is printed under -q (the seed file
    was used without a word), as a deprecated alias's warning is."""
    import numpy as np

    src = tmp_path / "x.npy"
    np.save(src, np.zeros((4, 8), np.float32))
    loose = tmp_path / "loose.seed"
    loose.write_text("5f1c2a9e8b7d6c4f3a2b1e0d9c8b7a6f\n")
    loose.chmod(0o644)
    seeded = cli("perturb", src, "--eps", "1", "--range", "0:1", "--seed-file", loose, "--out", tmp_path / "s.npy",
                 "-q")
    assert seeded.exit_code == 0 and seeded.stderr.splitlines() == [
        f"tldp: warning: other users may read or write the seed file {loose} (mode 0644); it holds a secret "
        f"key: chmod 600 {loose}"], seeded.stderr
