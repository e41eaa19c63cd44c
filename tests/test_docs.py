"""The documentation stays true to itself: the CLI reference is current, every
relative link (and anchor) resolves, and README.md stays a front page."""

import re
from pathlib import Path

import pytest

from tests.builders import REPO, load_script

README_MAX_LINES = 220
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_cli_reference_is_current():
    script = load_script("docs/make_cli_reference.py")
    assert (REPO / "docs" / "cli.md").read_text(encoding="utf-8") == script.generate(), (
        "docs/cli.md is stale: run python docs/make_cli_reference.py")


def test_cli_reference_covers_every_command():
    script = load_script("docs/make_cli_reference.py")
    from tldp_cli.cli import app

    names = script.commands(app)
    assert set(names) >= {"perturb", "plan", "ledger", "weight-mask", "evaluate", "audit", "seed"}
    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for name in names:
        assert f"## `tldp {name}`" in page
        assert f"Usage: tldp {name} " in page


def test_check_mode_reports_a_stale_page(tmp_path, monkeypatch):
    script = load_script("docs/make_cli_reference.py")
    page = tmp_path / "cli.md"
    monkeypatch.setattr(script, "PAGE", page)
    monkeypatch.setattr(script, "REPO", tmp_path)
    assert script.main(["--check"]) == 1  # missing
    page.write_text("# out of date\n")
    assert script.main(["--check"]) == 1
    assert script.main([]) == 0
    assert script.main(["--check"]) == 0


def test_format_tables_are_the_registry_s():
    script = load_script("docs/make_format_table.py")
    page = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    assert page == script.generate(page), "docs/formats.md is stale: run python docs/make_format_table.py"


def test_format_tables_list_every_registered_format():
    from tldp_cli import formats

    script = load_script("docs/make_format_table.py")
    text = "\n".join(script.tables())
    for fmt in formats.registered():
        assert f"| `{fmt.name}` |" in text and all(row.example in text for row in fmt.docs)


def test_every_format_says_what_it_perturbs_keeps_and_drops():
    """docs/formats.md has a section per registered format, each with its Perturbed, Kept
    and Dropped lines (a new format adds its own)."""
    from tldp_cli import formats

    page = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    part = page.split("## Perturbed, kept and dropped, format by format\n", 1)[1].split("\n## ", 1)[0]
    sections = dict(re.findall(r"^### `([^`]+)`\n(.*?)(?=^### |\Z)", part, re.M | re.S))
    assert set(formats.names()) <= set(sections), sorted(set(formats.names()) - set(sections))
    for name, text in sections.items():
        lines = [line for line in text.splitlines() if line.startswith("- **")]
        assert [line.split(":**")[0] for line in lines] == ["- **Perturbed", "- **Kept", "- **Dropped"], name


def test_format_table_check_mode_reports_a_stale_page(tmp_path, monkeypatch):
    script = load_script("docs/make_format_table.py")
    page = tmp_path / "formats.md"
    monkeypatch.setattr(script, "PAGE", page)
    monkeypatch.setattr(script, "REPO", tmp_path)
    page.write_text(f"# Formats\n\n{script.BEGIN}\n| old | table |\n{script.END}\n\nmore\n")
    assert script.main(["--check"]) == 1
    assert script.main([]) == 0
    assert script.main(["--check"]) == 0
    text = page.read_text()
    assert text.startswith("# Formats\n\n") and text.endswith("\n\nmore\n") and "| old |" not in text


def _without_code(text: str) -> str:
    """The text outside fenced code blocks, with inline code spans blanked (lines kept)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, seen = set(), {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    text = _without_code(path.read_text(encoding="utf-8"))
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


def test_slugs_follow_github():
    assert _slug("Interrupted runs and `--resume`") == "interrupted-runs-and---resume"
    assert _slug("Discrete noise: exact, integer-valued") == "discrete-noise-exact-integer-valued"
    assert _slug("Model files (`.npz`, `.safetensors`)") == "model-files-npz-safetensors"
    assert _slug("`tldp perturb`") == "tldp-perturb"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_readme_links_every_docs_page():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in _links(REPO / "README.md")}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_architecture_drawings_are_the_code_s():
    script = load_script("docs/make_architecture_graph.py")
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert page == script.generate(page), "docs/architecture.md is stale: run python docs/make_architecture_graph.py"


def test_architecture_drawings_have_no_arrow_up_and_one_per_imported_layer():
    script = load_script("docs/make_architecture_graph.py")
    drawn = "\n".join(script.drawings())
    arrows = [(int(a), int(b)) for a, b in re.findall(r"L(\d+) -->\|\d+\| L(\d+)", drawn)]
    assert arrows and all(a < b for a, b in arrows), arrows
    assert '"cli"' in drawn and "L1 -->" in drawn  # the command line imports the layers below it


def test_architecture_drawing_draws_an_import_that_runs_up(tmp_path):
    """The drawing is of the imports the code has, not of the contract: an import of a
    higher layer is drawn as an arrow up."""
    script = load_script("docs/make_architecture_graph.py")
    layers = [["tldp_cli.cli"], ["tldp_cli.run"], ["tldp_cli.errors"]]
    lines = script.flowchart(layers, {"tldp_cli.errors": {"tldp_cli.cli.app"}, "tldp_cli.cli.app": {"tldp_cli.run.x"}})
    assert "    L2 -->|1| L0" in lines and "    L0 -->|1| L1" in lines


def test_the_library_page_s_examples_run(tmp_path, monkeypatch):
    """docs/library.md's Python blocks (and README's) run as written, from the repository's sample data (the
    model-parameters block is a loop's body: it gets a model, a round and a client), and the
    page shows the typed results of tldp_cli.certify and tldp_cli.compose."""
    import numpy as np

    import tldp_cli
    from tldp_cli.privacy.certificates import Certificate, Guarantee

    page = (REPO / "docs" / "library.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    readme = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(encoding="utf-8"), flags=re.S | re.M)
    assert readme, "README.md shows no Python block"
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    loop = {"params": {"w": np.zeros((3, 4), np.float32), "b": np.zeros(3, np.float32)}, "r": 0, "c": 1, "rounds": 5}
    names: dict = {}
    for where, block in [*(("docs/library.md", b) for b in blocks), *(("README.md", b) for b in readme)]:
        names = dict(loop)
        exec(compile(block, where, "exec"), names)
    top_level = [b for b in blocks if "tldp_cli.certify(" in b and "tldp_cli.compose(" in b]
    assert len(top_level) == 1, "docs/library.md shows no tldp_cli.certify / compose example"
    names = {}
    exec(compile(top_level[0], "docs/library.md", "exec"), names)
    assert isinstance(names["cert"], Certificate) and isinstance(names["total"], Guarantee)
    # Was: noise="laplace" at a per-record eps of 4, the float sampler's figures, which a run of
    # the default sampler (discrete-laplace) refuses: the example gives what a run is certified
    calib = names["calib"]
    run = tldp_cli.perturb_array(np.load(REPO / "sample_data" / "digits.npy")[:4], eps=calib.epsilon,
                                 noise=calib.noise, budget=calib.budget)
    assert run.noise == calib.noise and run.accounting["per_record"]["epsilon"] == names["cert"].per_record.epsilon


def test_the_coefficients_rebuild_runs_and_gives_the_records_run(cli, tmp_path, monkeypatch):
    """docs/choosing-eps.md's rebuild from --store coefficients runs as written on the output of
    the command beside it, and gives the records a --store records run of the same seed writes."""
    import numpy as np

    from tests.builders import SEED

    page = (REPO / "docs" / "choosing-eps.md").read_text(encoding="utf-8")
    section = page.split("### Storing the coefficients", 1)[1].split("\n## ", 1)[0]
    command = re.findall(r"^```sh\n(tldp perturb .*?)\n```", section, flags=re.S | re.M)[0].split()
    (block,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    (tmp_path / "sample_data").mkdir()
    (tmp_path / "sample_data" / "digits.npy").symlink_to(REPO / "sample_data" / "digits.npy")
    monkeypatch.chdir(tmp_path)
    assert command[:2] == ["tldp", "perturb"] and "--store" in command
    result = cli(*command[1:], "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    names: dict = {}
    exec(compile(block, "docs/choosing-eps.md", "exec"), names)
    records = cli(*command[1:-2], "--seed", SEED, "--out", "records.npy")
    assert records.exit_code == 0, records.stderr
    written = np.load("records.npy")
    assert names["records"].shape == written.shape == (400, 28, 28)
    assert np.abs(names["records"] - written).max() < 1e-3


def _documented_json_keys(page: str, marker: str) -> set[str]:
    """The top-level keys the bullet list after `marker` on docs/`page` documents: in each
    bullet, every run of backticked names (`a`, `b` and `c`) that ends in a colon, once the
    parenthesised remarks are dropped."""
    text = (REPO / "docs" / page).read_text(encoding="utf-8").split(marker, 1)[1]
    lines = text.split("\n- ", 1)[1].split("\n\n", 1)[0]
    keys = set()
    for bullet in ("- " + lines).split("\n- "):
        flat = " ".join(bullet.split())
        while re.search(r"\([^()]*\)", flat):
            flat = re.sub(r"\s*\([^()]*\)", "", flat)
        for run in re.findall(r"((?:`\w+`(?:, | and ))*`\w+`):", flat):
            keys.update(re.findall(r"`(\w+)`", run))
    return keys


def test_documented_keys_are_the_json_outputs_keys(cli, tmp_path, digits):
    """docs/evaluate.md and docs/audit.md list exactly the top-level keys that
    `evaluate --json`, `sweep --json` and `audit --json` (tldp and privunit) print."""
    import json

    import numpy as np

    np.save(tmp_path / "x.npy", digits[:20])
    np.save(tmp_path / "y.npy", np.arange(20) % 2)
    ran = cli("perturb", tmp_path / "x.npy", "--eps", "5", "--out", tmp_path / "p.npy", "-q")
    assert ran.exit_code == 0, ran.stderr
    outputs = {
        "evaluate": [cli("evaluate", tmp_path / "x.npy", tmp_path / "p.npy", "--json", "-q")],
        "sweep": [cli("sweep", tmp_path / "x.npy", "--eps", "1", "--methods", "TLDP-L", "--out",
                      tmp_path / "sweep", "--json", "-q")],
        "audit": [cli("audit", "--eps", "1", "--elements", "4", "--range", "0:1", "--samples", "4000",
                      "--json", "-q"),
                  cli("audit", "--eps", "4", "--mechanism", "privunit", "--elements", "2x2",
                      "--range", "-1:1", "--samples", "4000", "--json", "-q")],
    }
    emitted = {}
    for name, results in outputs.items():
        assert all(r.exit_code == 0 for r in results), [r.stderr for r in results]
        emitted[name] = set().union(*(json.loads(r.stdout) for r in results))
    documented = {"evaluate": _documented_json_keys("evaluate.md", "## The JSON report\n"),
                  "sweep": _documented_json_keys("evaluate.md", "`sweep.json`, `--json` and `--report PATH`"),
                  "audit": _documented_json_keys("audit.md", "## The JSON report\n")}
    wrong = [f"{name} --json: undocumented {sorted(emitted[name] - documented[name])}, "
             f"documented but not printed {sorted(documented[name] - emitted[name])}"
             for name in outputs if documented[name] != emitted[name]]
    assert not wrong, "; ".join(wrong)
