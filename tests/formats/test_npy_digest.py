"""The .npy writer hashes its output while the run goes on: the manifest's sha256 must
be the file's, whatever the order the blocks land in."""

import hashlib
import json

import numpy as np
import pytest

from tldp_cli.formats import FormatOptions, npy
from tldp_cli.run.pipeline import PerturbOptions, perturb


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("workers", [1, 3])
def test_manifest_sha256_is_the_output_file(tmp_path, workers):
    src = tmp_path / "x.npy"
    np.save(src, np.random.default_rng(0).integers(0, 256, (1000, 7, 3), dtype=np.uint8))
    out = tmp_path / "y.npy"
    result = perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=2, allow_weak_seed=True, workers=workers,
                                    block_elements=700))  # many blocks
    [entry] = json.loads(result.manifest_path.read_text())["outputs"]
    assert entry["sha256"] == sha256(out)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_blocks_written_out_of_order(tmp_path, elsewhere):
    """Blocks written by the writer are hashed from memory; blocks written elsewhere
    (Dask workers, through block_writer) are read back when the pipeline reports them."""
    src = tmp_path / "x.npy"
    data = np.arange(60, dtype=np.float64).reshape(20, 3)
    np.save(src, data)
    reader = npy.open_reader(src, FormatOptions())
    writer = npy.create_writer(reader, tmp_path / "y.npy", np.dtype(np.float32), FormatOptions())
    job = reader.job
    write = writer.block_writer() if elsewhere else writer.write
    for start, stop in [(12, 20), (0, 5), (5, 12)]:
        write(job, start, data[start:stop])
        if elsewhere:
            writer.block_written(job, start, stop)
        if stop != 12:
            assert writer.digests() == {}  # records 5..12 are missing: no digest to trust
    for start, stop in [(0, 5), (12, 20)]:
        writer.block_written(job, start, stop)  # reported again: no effect
    [path] = writer.close()
    assert writer.digests() == {path: sha256(path)}
    np.testing.assert_array_equal(np.load(path), data.astype(np.float32))
