import hashlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tldp_cli.cli import app

REPO = Path(__file__).resolve().parent.parent
# A good seed (128 bits, as `tldp seed` makes); tests that need several or a particular
# stream use small integers with --allow-weak-seed / allow_weak_seed=True instead.
SEED = "3f9c2a7d51e04b8a96d2c07e1fa85b43"


class Cli:
    def __init__(self):
        self.runner = CliRunner()

    def __call__(self, *args):
        return self.runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def cli():
    return Cli()


@pytest.fixture(autouse=True)
def _no_seed_from_the_environment(monkeypatch):
    """A TLDP_SEED exported in the shell that runs the tests would seed every run."""
    monkeypatch.delenv("TLDP_SEED", raising=False)


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under path (or of path itself): proves an input was not touched."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f.relative_to(path) if f != path else f.name): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in files}


def siblings(directory: Path) -> set[str]:
    return {p.name for p in Path(directory).iterdir()}


@pytest.fixture(scope="session")
def digits() -> np.ndarray:
    return np.load(REPO / "sample_data" / "digits.npy")


MANIFEST_SCHEMA = REPO / "docs" / "manifest.schema.json"


@pytest.fixture(autouse=True)
def _manifests_follow_the_published_schema(request):
    """Every manifest a test leaves in its tmp_path validates against docs/manifest.schema.json
    (tests that write broken manifests on purpose are marked damaged_manifests)."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is None or request.node.get_closest_marker("damaged_manifests"):
        return
    import json

    import jsonschema

    schema = json.loads(MANIFEST_SCHEMA.read_text())
    for path in tmp_path.rglob("*.json"):
        try:
            manifest = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, OSError):
            continue
        if isinstance(manifest, dict) and manifest.get("schema") == "tldp-manifest/1":
            jsonschema.validate(manifest, schema)
