"""--resume refuses an interrupted run written by another tldp version or random-stream
layout: its blocks may hold other noise for the same seed, or other record ranges."""

import json

import numpy as np
import pytest

from tests.conftest import SEED
from tests.test_resume import BLOCK, interrupted, options, read_store
from tldp_cli import __version__, rng
from tldp_cli.errors import UsageError
from tldp_cli.pipeline import perturb
from tldp_cli.resume import partial_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def header(out):
    return json.loads((partial_path(out) / "journal.jsonl").read_text().splitlines()[0])


def rewrite_header(out, **fields):
    """Edit the journal's first line as another tldp would have written it."""
    journal = partial_path(out) / "journal.jsonl"
    first, *rest = journal.read_text().splitlines()
    entry = {k: v for k, v in {**json.loads(first), **fields}.items() if v is not None}
    journal.write_text("\n".join([json.dumps(entry), *rest]) + "\n")


def test_the_journal_records_version_and_layout_never_the_seed(tmp_path):
    _, out = interrupted(tmp_path)
    first = header(out)
    assert first["tldp"] == __version__
    assert first["stream_layout"] == rng.STREAM_LAYOUT
    assert first["stream_unit_elements"] == rng.STREAM_UNIT_ELEMENTS
    assert SEED not in (partial_path(out) / "journal.jsonl").read_text()


@pytest.mark.parametrize("fields, named", [
    ({"tldp": "0.0.1"}, f'tldp version "0.0.1" (now "{__version__}")'),
    ({"tldp": None}, f'tldp version unknown (now "{__version__}")'),  # a journal from before
    ({"stream_layout": 0}, f"random-stream layout 0 (now {rng.STREAM_LAYOUT})"),
    ({"stream_unit_elements": 1 << 16}, f"stream unit elements 65536 (now {rng.STREAM_UNIT_ELEMENTS})"),
], ids=["version", "no-version", "layout", "unit-elements"])
def test_resume_refuses_another_version_or_layout(tmp_path, fields, named):
    src, out = interrupted(tmp_path)
    rewrite_header(out, **fields)
    journal = (partial_path(out) / "journal.jsonl").read_bytes()
    with pytest.raises(UsageError, match="the interrupted run .* was written by another tldp") as error:
        perturb(options(src, out, resume=True))
    assert named in str(error.value)
    assert str(error.value).count("(now ") == 1  # only what differs is named
    assert (partial_path(out) / "journal.jsonl").read_bytes() == journal  # kept for that tldp
    assert not out.exists()


def test_a_layout_bump_in_this_tldp_is_refused(tmp_path, monkeypatch):
    src, out = interrupted(tmp_path)
    monkeypatch.setattr(rng, "STREAM_LAYOUT", rng.STREAM_LAYOUT + 1)
    with pytest.raises(UsageError, match=rf"random-stream layout {rng.STREAM_LAYOUT - 1} "
                                         rf"\(now {rng.STREAM_LAYOUT}\)"):
        perturb(options(src, out, resume=True))


def test_refusal_through_the_cli_is_one_line_exit_2(cli, tmp_path):
    src, out = interrupted(tmp_path)
    rewrite_header(out, tldp="0.0.1")
    args = ("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, "--block-elements", BLOCK)
    result = cli(*args, "--resume")
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert 'tldp version "0.0.1"' in result.stderr and "without --resume" in result.stderr
    started_over = cli(*args)  # what the message offers
    assert started_over.exit_code == 0, started_over.stderr
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))


def test_the_same_version_and_layout_still_resume(tmp_path):
    src, out = interrupted(tmp_path)
    perturb(options(src, out, resume=True))
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))
