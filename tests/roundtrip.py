"""The round-trip contract every input format runs (one subclass per format).

A subclass says how to make a real input file in tmp_path, how to read its
perturbable arrays back, and how to check that everything else came through
unchanged. The base class runs perturb through the CLI and checks what holds
for every format.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.conftest import SEED, Cli, siblings, tree_digest
from tldp_cli.run.manifest import sha256_file


class RoundTrip:
    extra_args: tuple[str, ...] = ()

    # --- what a format's subclass provides -------------------------------------------
    def make_input(self, tmp_path: Path) -> Path:
        raise NotImplementedError

    def read_arrays(self, path: Path) -> dict[str, np.ndarray]:
        """The perturbed (or perturbable) arrays, keyed by name."""
        raise NotImplementedError

    def assert_same_structure(self, original: Path, perturbed: Path) -> None:
        """Everything but the perturbed values: tree, attributes, untouched data, layout."""
        raise NotImplementedError

    # --- the shared contract ----------------------------------------------------------
    def _run(self, cli: Cli, src: Path, out: Path, *more):
        return cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, *self.extra_args, *more)

    def test_round_trip(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        before = tree_digest(src)
        out = tmp_path / "out"
        result = self._run(cli, src, out, "--json")
        assert result.exit_code == 0, result.stderr
        assert tree_digest(src) == before, "the input was modified"
        manifest = json.loads(result.stdout)
        self.assert_same_structure(src, out)
        original, perturbed = self.read_arrays(src), self.read_arrays(out)
        assert original.keys() == perturbed.keys()
        for name, array in original.items():
            assert perturbed[name].shape == array.shape, name
            assert not np.array_equal(perturbed[name].astype(np.float64), array.astype(np.float64)), name
        text = json.dumps(manifest)
        assert manifest["seeded"] is True and manifest["weak_seed"] is False and SEED not in text
        assert "seed" not in text.replace('"seeded"', "").replace('"weak_seed"', "")
        assert manifest["inputs"] and all({"path", "format", "shape", "dtype"} <= set(i) for i in manifest["inputs"])
        for entry in manifest["outputs"]:
            assert sha256_file(Path(entry["path"])) == entry["sha256"]
        assert Path(str(out) + ".manifest.json").is_file()
        assert not [n for n in siblings(tmp_path) if ".tmp-" in n], "temporary files left behind"

    def test_same_seed_same_output(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        for name in ("a", "b"):
            assert self._run(cli, src, tmp_path / name).exit_code == 0
        first, second = self.read_arrays(tmp_path / "a"), self.read_arrays(tmp_path / "b")
        for key in first:
            np.testing.assert_array_equal(first[key], second[key])

    def test_workers_give_identical_output(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        for name, workers in (("serial", "1"), ("threads", "3")):
            assert self._run(cli, src, tmp_path / name, "--workers", workers).exit_code == 0
        serial, threads = self.read_arrays(tmp_path / "serial"), self.read_arrays(tmp_path / "threads")
        for key in serial:
            np.testing.assert_array_equal(serial[key], threads[key])

    def test_refuses_to_overwrite(self, cli, tmp_path):
        src = self.make_input(tmp_path)
        out = tmp_path / "out"
        assert self._run(cli, src, out).exit_code == 0
        written = tree_digest(out)
        again = self._run(cli, src, out)
        assert again.exit_code == 1
        assert "--overwrite" in again.stderr and len(again.stderr.strip().splitlines()) == 1
        assert tree_digest(out) == written
        assert self._run(cli, src, out, "--overwrite").exit_code == 0
