"""The manifest is assembled in one place (run/manifest.py's build) from the parts the
format's reader and writer, the sampler and the run contribute: a key two parts write is
refused (KeyCollision), never silently overwritten; `unperturbed` and `dropped` entries
from several parts are joined in the parts' order."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tldp_cli.formats import ArrayJob
from tldp_cli.run import manifest
from tldp_cli.run.calibration import calibrate_run
from tldp_cli.run.context import RunContext
from tldp_cli.run.options import PerturbOptions, checked_options
from tldp_cli.run.run_manifest import build_manifest

JOBS = [ArrayJob("x", (20, 4, 4), np.dtype("uint8"), lambda a, b: np.zeros((b - a, 4, 4), np.uint8),
                 {"path": "x.npy", "format": "npy", "shape": [20, 4, 4], "dtype": "uint8"})]


def reader(**extra):
    """A reader as build_manifest asks it (formats.Reader's defaults), with `extra` as its
    manifest_extra."""
    return SimpleNamespace(manifest_extra=extra, record_description=None, format="npy", records_are_tensors=False,
                           manifest_inputs=lambda: [job.source for job in JOBS], manifest_name=lambda name: name)


def writer(**extra):
    return SimpleNamespace(manifest_extra=extra, postprocessing=(), output_dtype=None)


def run_manifest(reader_part, writer_part, **options):
    opts = checked_options(PerturbOptions(input=Path("x.npy"), eps=1.0, **options))
    return build_manifest(RunContext(opts, JOBS, calibrate_run(opts, JOBS), reader=reader_part), writer_part)


@pytest.mark.parametrize("key", ["epsilon", "accounting", "sampler", "granularity", "grid", "records"])
def test_a_format_writing_a_key_the_run_writes_is_refused(key):
    with pytest.raises(manifest.KeyCollision, match=f"'{key}' written by both"):
        run_manifest(reader(**{key: "the format's"}), writer())


def test_the_reader_and_the_writer_writing_one_key_is_refused():
    with pytest.raises(manifest.KeyCollision, match="'dropped_filters' written by both the reader and the writer"):
        run_manifest(reader(dropped_filters={"a": ["x"]}), writer(dropped_filters={"b": ["y"]}))


def test_unperturbed_and_dropped_entries_of_several_parts_are_joined_in_order():
    first, second, third = ({"name": n, "kind": "file", "reason": "r"} for n in ("a", "b", "c"))
    m = run_manifest(reader(unperturbed=[first], dropped=[second]), writer(unperturbed=[third], dropped=[first]))
    assert m["unperturbed"] == [first, third] and m["dropped"] == [second, first]


def test_the_parts_keep_their_order_after_the_manifests_own_fields():
    m = run_manifest(reader(zeta_key=1, alpha_key=2), writer(image_output={"format": "png", "clipped": True}),
                     ranges={"x": (0.0, 100.0)})
    keys = list(m)
    assert keys.index("created") < keys.index("zeta_key") < keys.index("alpha_key") < keys.index("image_output") \
        < keys.index("sampler") < keys.index("granularity") < keys.index("grid") < keys.index("value_ranges") \
        < keys.index("granularities")


def test_assemble_alone():
    parts = [manifest.Part("one", {"a": 1, "dropped": [1]}), manifest.Part("two", {"b": 2, "dropped": [2]})]
    assert manifest.assemble(parts) == {"a": 1, "dropped": [1, 2], "b": 2}
    with pytest.raises(manifest.KeyCollision, match="'a' written by both one and three"):
        manifest.assemble([*parts, manifest.Part("three", {"a": 3})])


@pytest.mark.parametrize("rng", ["secure", "fast"])
def test_the_fast_generator_is_stated_among_what_the_figures_assume(cli, tmp_path, rng):
    """--rng fast (PCG64, predictable from its output): the figures assume ideal randomness,
    and the manifest's accounting.notes says so; the secure generator's manifest does not."""
    import json

    from tldp_cli.privacy import accounting

    src = tmp_path / "x.npy"
    np.save(src, np.arange(48, dtype=np.uint8).reshape(3, 16))
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "out.npy", "--rng", rng, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    notes = json.loads(result.stdout)["accounting"]["notes"]
    assert (accounting.FAST_RNG_NOTE in notes) == (rng == "fast")
    assert json.loads((tmp_path / "out.npy.manifest.json").read_text())["accounting"]["notes"] == notes
