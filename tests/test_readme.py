"""CI installs and tests exactly as README's quick start says."""

import re
import tomllib

from tests.builders import REPO


def test_ci_runs_the_quick_start_commands():
    """A user's one-line install (runtime dependencies only) and the sample run, then the
    contributors' line (the dev extra, the tests): CI runs each command, in that order."""
    readme = (REPO / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    install, perturb, contributors = [line.strip() for line in quick_start.strip().splitlines()]
    assert install.endswith("python -m pip install .")
    install_dev, test = contributors.split(" && ")
    # every test, on every core (pytest-xdist): the suite stays well under ten minutes on 2
    assert install_dev == 'python -m pip install ".[dev]"' and test == "python -m pytest -q -n auto"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    lines = [install.rsplit("&& ", 1)[1], perturb.split(" --out")[0], install_dev, test]
    found = [next((i for i, line in enumerate(ci) if line.startswith(command)), None) for command in lines]
    assert None not in found and found == sorted(found), dict(zip(lines, found))


def test_the_dev_extra_holds_only_what_the_tests_use():
    """Every package of the dev extra is imported by the tests, runs them (pytest,
    pytest-xdist, import-linter) or is run by CI (.ci/run: mypy); none repeats a runtime
    dependency."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=\[;]", r)[0].lower() for r in project["dependencies"]}
    dev = [re.split(r"[<>=\[;]", r)[0].lower() for r in project["optional-dependencies"]["dev"]]
    assert not runtime & set(dev), runtime & set(dev)
    imported_as = {"scikit-learn": "sklearn", "opencv-python-headless": "cv2", "dask": "distributed",
                   "netcdf4": "netCDF4", "ome-zarr": "ome_zarr", "scikit-image": "skimage",
                   "ome-zarr-models": "ome_zarr_models", "import-linter": "lint-imports",
                   "pytest-xdist": "xdist"}
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    ci = (REPO / ".ci" / "run").read_text()

    def used(module: str) -> bool:
        if re.search(rf"^python -m {module}\b", ci, re.M):  # a check CI runs beside the tests
            return True
        if module == "lint-imports":  # import-linter's command, run by tests/test_architecture.py
            return '"lint-imports"' in tests
        if module == "xdist":  # pytest's plugin, which CI's test run starts with -n
            return re.search(r"^python -m pytest .*-n \w", ci, re.M) is not None
        return re.search(rf"^\s*(import|from) {module}\b|importorskip\(\"{module}[\".]", tests, re.M) is not None

    unused = [name for name in dev if not used(imported_as.get(name, name))]
    assert not unused, f"the tests never use {unused}"


def test_install_hints_name_our_distribution():
    """'tldp' on the package index is another project: every hint names ours."""
    name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
    assert name == "tldp-tensors"
    texts = [p.read_text() for p in [REPO / "README.md", REPO / "CHANGELOG.md",
                                     *(REPO / "tldp_cli").rglob("*.py"), *(REPO / "docs").rglob("*.md")]]
    for text in texts:
        for extra in re.findall(r"pip install '([\w-]+)\[", text):
            assert extra == name
