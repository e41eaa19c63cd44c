"""CI installs and tests exactly as README's quick start says."""

import re
import tomllib

from tests.builders import REPO


def test_ci_runs_the_quick_start_commands():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    install, perturb, test = [line.strip() for line in quick_start.strip().splitlines()]
    assert install.endswith('python -m pip install ".[dev]"')
    assert 'python -m pip install ".[dev]"' in ci
    assert perturb.split(" --out")[0] in ci
    assert test in ci.splitlines()


def test_install_hints_name_our_distribution():
    """'tldp' on the package index is another project: every hint names ours."""
    name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
    assert name == "tldp-tensors"
    texts = [p.read_text() for p in [REPO / "README.md", REPO / "CHANGELOG.md",
                                     *(REPO / "tldp_cli").rglob("*.py"), *(REPO / "docs").rglob("*.md")]]
    for text in texts:
        for extra in re.findall(r"pip install '([\w-]+)\[", text):
            assert extra == name
