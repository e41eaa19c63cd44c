"""The published manifest schema (docs/manifest.schema.json): every manifest the suite
writes is validated against it after each test (tests/conftest.py); here, that it holds
for real runs of every mechanism and of the options that add keys, that it is strict (a key
it does not declare, at any depth, makes a manifest invalid), that each key it declares is
described there and in docs/manifest.md, and that it rejects what is not a manifest.

A format or option that writes a new manifest key declares it in the schema (with its
description) and names it in docs/manifest.md: the suite fails until it does."""

import json
import re

import h5py
import jsonschema
import numpy as np
import pytest

from tests.builders import MANIFEST_SCHEMA, REPO, SEED, validate_manifest

SCHEMA = json.loads(MANIFEST_SCHEMA.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def _inputs(tmp_path):
    """A uint8 stack, a float stack, an HDF5 file of a uint8 and a uint16 array (two ranges),
    one of two float arrays of different record sizes, and a basis file for PrivUnit."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.integers(0, 256, (10, 8, 8), dtype=np.uint8))
    np.save(tmp_path / "f.npy", rng.uniform(-1, 1, (10, 8, 8)).astype(np.float32))
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f["a"] = rng.integers(0, 256, (6, 4, 4), dtype=np.uint8)
        f["b"] = rng.integers(0, 65536, (6, 3, 3), dtype=np.uint16)
    with h5py.File(tmp_path / "sizes.h5", "w") as f:
        f["a"] = rng.uniform(-1, 1, (6, 4, 4))
        f["b"] = rng.uniform(-1, 1, (6, 3, 6))
    basis, _ = np.linalg.qr(rng.normal(size=(64, 8)))
    np.save(tmp_path / "basis.npy", basis.T.copy())
    (tmp_path / "out").mkdir()


# name: (input, options); each adds keys the others do not (or another mechanism's values)
RUNS = {
    "default": ("x.npy", ()),
    "float gaussian": ("x.npy", ("--sampler", "float", "--noise", "gaussian")),
    "discrete gaussian": ("f.npy", ("--noise", "discrete-gaussian", "--range", "-1:1")),
    "baseline record budget": ("x.npy", ("--mechanism", "baseline", "--budget", "record")),
    "mvg": ("f.npy", ("--mechanism", "mvg", "--sampler", "float", "--range", "-1:1")),
    "idn": ("x.npy", ("--mechanism", "idn", "--sampler", "float")),
    "privunit dct": ("x.npy", ("--mechanism", "privunit", "--eps", "10")),
    "privunit basis file": ("x.npy", ("--mechanism", "privunit", "--eps", "10", "--basis", "basis.npy")),
    "clip": ("f.npy", ("--clip", "0.5", "--clip-input")),
    "several ranges": ("two.h5", ()),
    "mvg, record sizes": ("sizes.h5", ("--mechanism", "mvg", "--sampler", "float", "--range", "-1:1",
                                       "--budget", "element")),
    "privunit, record sizes": ("sizes.h5", ("--mechanism", "privunit", "--eps", "10", "--range", "-1:1")),
    "a range per array": ("two.h5", ("--range", "a=0:256", "--range", "b=0:65536")),
    "raw release": ("x.npy", ("--sampler", "float", "--range", "0:1e6", "--eps", "8", "--allow-raw-release")),
    "seeded with a ledger": ("x.npy", ("--seed", SEED, "--ledger", "releases.db")),
}


@pytest.mark.parametrize("run", RUNS)
def test_a_real_manifest_validates_and_every_object_in_it_is_closed(cli, tmp_path, run):
    """The run's manifest validates; the same manifest with one undeclared key added to any
    object in it (the top level, accounting, a scope, an input, a warning, ...) does not."""
    _inputs(tmp_path)
    source, options = RUNS[run]
    options = [str(tmp_path / o) if o in ("basis.npy", "releases.db") else o for o in options]
    result = cli("perturb", tmp_path / source, "--eps", "1", "--json", "-q", "--out", tmp_path / "out" / source,
                 *options)
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    VALIDATOR.validate(manifest)
    for where, obj in _objects(manifest):
        obj["not_a_declared_key"] = "x"
        assert not VALIDATOR.is_valid(manifest), f"{run}: an undeclared key in {where or 'the manifest'} validates"
        del obj["not_a_declared_key"]


def test_the_weights_entry_is_declared(cli, tmp_path):
    _inputs(tmp_path)
    mask = tmp_path / "mask.npy"
    made = cli("weight-mask", tmp_path / "x.npy", "--method", "constant", "--weight", "0.5", "--out", mask, "-q")
    assert made.exit_code == 0, made.stderr
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--weights", mask, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    VALIDATOR.validate(manifest)
    manifest["weights"]["not_a_declared_key"] = 1
    assert not VALIDATOR.is_valid(manifest)


def _objects(value, where=""):
    """Every JSON object in `value` with its path, the outermost first."""
    if isinstance(value, dict):
        yield where, value
        for key, item in list(value.items()):
            yield from _objects(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for item in value:
            yield from _objects(item, f"{where}[]")


def _declared(schema, where=""):
    """(path, name, subschema) of every property the schema declares, at any depth."""
    if isinstance(schema, dict):
        for name, sub in schema.get("properties", {}).items():
            yield f"{where}.{name}" if where else name, name, sub
        for key, sub in schema.items():
            if key == "properties":
                for name, prop in sub.items():
                    yield from _declared(prop, f"{where}.{name}" if where else name)
            elif key == "$defs":
                for name, prop in sub.items():
                    yield from _declared(prop, f"$defs.{name}")
            elif isinstance(sub, (dict, list)) and key not in ("if", "then"):
                yield from _declared(sub, where)
    elif isinstance(schema, list):
        for sub in schema:
            yield from _declared(sub, where)


def test_every_declared_key_has_a_description():
    undescribed = sorted({path for path, _, sub in _declared(SCHEMA) if "description" not in sub})
    assert not undescribed, f"keys without a description in {MANIFEST_SCHEMA.name}: {undescribed}"


def test_docs_manifest_names_every_declared_key():
    text = (REPO / "docs" / "manifest.md").read_text()
    named = set(re.findall(r"`([^`]+)`", text))
    absent = sorted({name for _, name, _ in _declared(SCHEMA)} - named)
    assert not absent, f"keys of {MANIFEST_SCHEMA.name} that docs/manifest.md does not name: {absent}"


@pytest.mark.damaged_manifests
def test_the_schema_rejects_a_damaged_manifest(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 8, 8), np.uint8))
    manifest = json.loads(cli("perturb", tmp_path / "x.npy", "--eps", "1", "--json", "-q").stdout)
    for field, value in (("accounting", None), ("epsilon", -1), ("noise", "uniform"),
                         ("outputs", [{"path": "x", "sha256": "not a digest"}]), ("a_key_tldp_never_writes", 1)):
        broken = dict(manifest, **{field: value})
        with pytest.raises(jsonschema.ValidationError):
            validate_manifest(broken)
