"""The published manifest schema (docs/manifest.schema.json): every manifest the suite
writes is validated against it after each test (tests/conftest.py); here, that it holds
for a real run and rejects what is not a manifest."""

import json

import jsonschema
import numpy as np
import pytest

from tests.builders import MANIFEST_SCHEMA

SCHEMA = json.loads(MANIFEST_SCHEMA.read_text())


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("args", [(), ("--sampler", "float", "--noise", "gaussian"),
                                  ("--mechanism", "baseline", "--budget", "record")])
def test_a_real_manifest_validates(cli, tmp_path, args):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).integers(0, 256, (10, 8, 8), dtype=np.uint8))
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--json", "-q", *args)
    assert result.exit_code == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), SCHEMA)


@pytest.mark.damaged_manifests
def test_the_schema_rejects_a_damaged_manifest(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 8, 8), np.uint8))
    manifest = json.loads(cli("perturb", tmp_path / "x.npy", "--eps", "1", "--json", "-q").stdout)
    for field, value in (("accounting", None), ("epsilon", -1), ("noise", "uniform"),
                         ("outputs", [{"path": "x", "sha256": "not a digest"}])):
        broken = dict(manifest, **{field: value})
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)
