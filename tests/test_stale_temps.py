"""A run killed with SIGKILL (no cleanup runs) leaves its hidden temporary output; the
next run into the same destination on this host removes it, and nothing else."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

from tldp_cli.pipeline import PerturbOptions, perturb, remove_stale_temps, temp_sibling


def test_killed_run_temporary_is_removed_by_the_next_run(cli, tmp_path):
    src = tmp_path / "in.npy"
    np.save(src, np.random.default_rng(0).integers(0, 256, (4000, 28, 28), dtype=np.uint8))
    out = tmp_path / "out.npy"
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from tldp_cli.pipeline import PerturbOptions, perturb
        def progress(done, total):
            os.kill(os.getpid(), signal.SIGKILL)
        perturb(PerturbOptions(input=Path({str(src)!r}), epsilon=1.0, out=Path({str(out)!r}),
                               block_elements=1 << 16), progress=progress)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith(".out.npy.tmp-")]
    live = temp_sibling(out)  # a run of this (live) process: kept
    live.write_bytes(b"in progress")
    other = tmp_path / ".other.npy.tmp-x-1-00000000"  # another destination's: kept
    other.write_bytes(b"")

    result = cli("perturb", src, "--eps", "1", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert f"removed {left}" in result.stderr
    assert not left.exists() and live.exists() and other.exists()
    assert np.load(out).shape == (4000, 28, 28)


def test_only_dead_processes_of_this_host_are_removed(tmp_path):
    out = tmp_path / "x.npy"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    mine = temp_sibling(out)
    host = mine.name.split(".tmp-")[1].rsplit("-", 2)[0]
    dead = tmp_path / f".x.npy.tmp-{host}-{dead_pid}-0123abcd"
    elsewhere = tmp_path / f".x.npy.tmp-{host}zz-{dead_pid}-0123abcd"  # another host: unknown
    for path in (mine, dead, elsewhere):
        path.mkdir()  # a folder, as an image-folder output's
    assert remove_stale_temps(out) == [dead]
    assert mine.exists() and elsewhere.exists() and not dead.exists()
    assert os.getpid() == int(mine.name.rsplit("-", 2)[1])


def test_library_run_reports_the_removal(tmp_path):
    src = tmp_path / "in.npy"
    np.save(src, np.zeros((10, 3), np.uint8))
    out = tmp_path / "out.npy"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = temp_sibling(out).name.split(".tmp-")[1].rsplit("-", 2)[0]
    stale = tmp_path / f".out.npy.tmp-{host}-{int(done.stdout)}-89abcdef"
    stale.write_bytes(b"half written")
    result = perturb(PerturbOptions(input=src, epsilon=1.0, out=out))
    assert any(str(stale) in m for m in result.messages) and not stale.exists()
