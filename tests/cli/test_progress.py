"""The progress display (issue 30): on a terminal, a phase's label once it has lasted a second,
then the labelled records bar; nothing on a pipe or with -q; -v one line per phase."""

import io
import os
import subprocess
import sys
import time

import pytest

from tldp_cli.cli.app import Display, progress_bar


class _Terminal(io.StringIO):
    def __init__(self, tty: bool = True):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def _terminal(monkeypatch, tty: bool = True) -> _Terminal:
    """Set in the test itself: pytest puts its own capture back on sys.stderr after fixtures."""
    terminal = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", terminal)
    return terminal


def _run(display: Display, planning: float) -> None:
    display.phase("reading", "the headers")
    display.phase("planning", "calibrating")
    time.sleep(planning)
    display.phase("perturbing", "10 records")
    display.advance(0, 10)
    display.advance(4, 10)
    display.advance(6, 10)
    display.close()


def test_a_long_phase_is_labelled_then_the_records_bar_has_its_unit(monkeypatch):
    stderr = _terminal(monkeypatch)
    _run(Display(quiet=False, verbose=False), planning=1.6)
    shown = stderr.getvalue()
    assert "tldp: planning (00:01)" in shown, shown  # the phase's own time
    assert "tldp: reading" not in shown  # it took less than a second
    assert "tldp: perturbing" in shown and "/10 [" in shown and " records/s" in shown, shown


def test_a_short_phase_shows_no_label(monkeypatch):
    stderr = _terminal(monkeypatch)
    _run(Display(quiet=False, verbose=False), planning=0.2)
    shown = stderr.getvalue()
    assert "planning" not in shown and "tldp: perturbing" in shown


@pytest.mark.parametrize("quiet, tty", [(True, True), (False, False)])
def test_nothing_with_quiet_or_off_a_terminal(monkeypatch, quiet, tty):
    terminal = _terminal(monkeypatch, tty)
    _run(Display(quiet=quiet, verbose=False), planning=1.3)
    assert terminal.getvalue() == ""


def test_verbose_is_one_line_per_phase_even_off_a_terminal(monkeypatch):
    terminal = _terminal(monkeypatch, tty=False)
    _run(Display(quiet=False, verbose=True), planning=0)
    assert terminal.getvalue().splitlines() == [
        "tldp: reading: the headers", "tldp: planning: calibrating", "tldp: perturbing: 10 records"]


def test_evaluate_s_and_sweep_s_bars_are_labelled_as_perturb_s(monkeypatch):
    """evaluate's bar read " 53%|... | 10698/20000 [00:02<00:01, 5141.03rec/s]": no "tldp:",
    no word of what it counts, beside perturb's "tldp: perturbing: ... records/s"."""
    stderr = _terminal(monkeypatch)
    advance, close = progress_bar(False, "evaluating", "records")
    advance(0, 10)
    advance(4, 10)
    close()
    shown = stderr.getvalue()
    assert "tldp: evaluating:" in shown and "/10 [" in shown and " records/s" in shown, shown
    quiet = _terminal(monkeypatch)
    advance, close = progress_bar(True, "sweeping", "runs")
    assert advance is None and quiet.getvalue() == ""


@pytest.mark.slow
@pytest.mark.parametrize("rows, columns", [(24, 100), (0, 0), (0, 100)])
def test_the_tldp_command_on_a_terminal_shows_the_records_bar(tmp_path, rows, columns):
    """A real process whose stderr is a terminal (a pty); also one that reports no size, as
    `script`'s, `docker exec -t`'s and CI jobs' pseudo-terminals do (tqdm showed nothing there)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = dict(os.environ)
    process = subprocess.Popen(
        [sys.executable, "-m", "tldp_cli", "perturb", "sample_data/digits.npy", "--eps", "1",
         "--out", str(tmp_path / "o.npy"), "--block-elements", "784"],
        stderr=follower, stdout=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=120) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "tldp: perturbing" in shown and "/400" in shown and "records/s" in shown, shown
    assert "tldp: wrote" in shown
