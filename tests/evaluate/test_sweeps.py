"""evaluate/sweeps.py: writing a sweep's tables."""

import pytest

from tldp_cli.errors import OutputError
from tldp_cli.evaluate import sweeps


def test_a_sweep_that_fails_to_write_leaves_no_folder(tmp_path, monkeypatch):
    """A sweep interrupted or failing while it writes its tables says 'nothing was written':
    the --out folder it made (and the folders above it it made) went with them; it stayed."""
    def full(contents, overwrite, private=False):
        raise OutputError(f"{next(iter(contents))}: cannot write (No space left on device)")

    monkeypatch.setattr(sweeps.output, "write_files", full)
    monkeypatch.setattr(sweeps, "_plot", lambda *args: b"png")
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(OutputError):
        sweeps.write_sweep({"rows": [], "budget": "element"}, existing / "new" / "sweep")
    assert list(tmp_path.iterdir()) == [existing] and list(existing.iterdir()) == []
