"""benchmarks/bench.py keeps running against the library it measures (no timing is
asserted: the benchmark reports numbers, the tests only check it still works)."""

import json

import numpy as np

from tests.builders import load_script


def load_bench():
    return load_script("benchmarks/bench.py")


def test_engine_and_reference_sections_run_on_a_tiny_input():
    bench = load_bench()
    data = bench.mnist_like(np.random.default_rng(0), 300, bench.digits()).reshape(300, bench.ELEMENTS)
    engine, refs = bench.engine_and_references(data, reps=1)
    assert {(r["mechanism"], r["rng"], r["workers"]) for r in engine} == {
        (label, rng, workers) for label, _, _ in bench.MECHANISMS
        for rng in ("secure", "fast") for workers in (1, 2)}
    results = {"machine": bench.machine_info(), "engine": engine, "references": refs, "end_to_end": [],
               "peers": [{"peer": "OpenDP", "noise": "laplace", "error": "not installed"}],
               "engine_elements": data.size, "reps": 1, "workers": 2}
    results["targets"] = bench.targets(results)
    assert len(results["targets"]) == len(bench.MECHANISMS)  # no end-to-end or peer rows without data
    table = bench.markdown(results)
    # both engines: the exact sampler (the default) and the float one
    assert "| TLDP-G exact |" in table and "| TLDP-G float |" in table and "not installed" in table


def test_generated_records_are_real_digits_varied_in_their_low_bits():
    bench = load_bench()
    base = bench.digits()
    records = bench.mnist_like(np.random.default_rng(1), 500, base).reshape(500, -1)
    assert records.dtype == np.uint8
    digits = {row.tobytes() for row in base & 0xFC}
    assert all(row.tobytes() in digits for row in records & 0xFC)  # a sample digit up to its low bits
    assert len(np.unique(records, axis=0)) == 500


def test_privunit_section_runs_and_reports_ratios_to_tldp():
    bench = load_bench()
    data = bench.mnist_like(np.random.default_rng(0), 40, bench.digits()).reshape(40, bench.ELEMENTS)
    rows = bench.privunit_rates(data, reps=1)
    assert [(r["case"], r["epsilon"]) for r in rows] == [("TLDP-L exact", 1.0)] + [
        (case, eps) for eps in bench.PRIVUNIT_EPSILONS for case in ("projection", "privunit")] + [
        ("projection 3-D", bench.PRIVUNIT_EPSILONS[0]), ("privunit 3-D", bench.PRIVUNIT_EPSILONS[0])]
    assert rows[0]["ratio_to_tldp"] == 1.0 and all(r["melem_s"] > 0 for r in rows)
    # the 3-D cases: 2 records (volumes) of 16 digits each, the 32 first digits' values
    assert [r["records"] for r in rows] == [40] * 5 + [2] * 2
    assert [r["record_shape"] for r in rows] == [[28, 28]] * 5 + [[16, 28, 28]] * 2
    assert [r.get("elements", 40 * 784) for r in rows] == [40 * 784] * 5 + [32 * 784] * 2
    results = {"machine": bench.machine_info(), "engine": [], "references": {}, "end_to_end": [], "peers": [],
               "privunit": rows, "targets": [], "engine_elements": data.size, "reps": 1, "workers": 1}
    bench.MECHANISMS, saved = [], bench.MECHANISMS
    try:
        table = bench.markdown(results)
    finally:
        bench.MECHANISMS = saved
    assert "| privunit | 4 |" in table and "| projection | 10 |" in table


def test_privunit_only_prints_its_table_and_writes_its_numbers(tmp_path, capsys):
    bench = load_bench()
    bench.PRIVUNIT_RECORDS = 40
    assert bench.main(["--privunit-only", "--reps", "1", "--out", str(tmp_path / "r.json")]) == 0
    assert "| privunit | 10 | 128 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [r["case"] for r in saved["privunit"]][:2] == ["TLDP-L exact", "projection"]


def test_startup_section_times_each_path_against_the_interpreter(capsys):
    bench = load_bench()
    bench.STARTUP_CASES = [case for case in bench.STARTUP_CASES if case[0] in ("--version", "output exists")]
    rows = bench.startup_times(reps=1)
    assert [r["path"] for r in rows] == [bench.STARTUP_BASELINE[0], "--version", "output exists"]
    assert rows[0]["cpu_ratio"] == 1.0 and all(r["cpu_seconds"] > 0 and r["wall_ratio"] > 0 for r in rows)
    assert rows[2]["command"] == "tldp perturb d.npy --eps 1"
    bench.MECHANISMS = []  # no engine rows: the start-up targets alone
    targets = bench.targets({"startup": rows, "engine": [], "end_to_end": [], "peers": [],
                             "references": {"PCG64 standard_normal float32": {"melem_s": 1.0}}})
    assert [t["target"] for t in targets] == [
        "start-up: --version <= 1.5x python -c 'import numpy' (CPU)",
        "start-up: output exists <= 1.5x python -c 'import numpy' (CPU)"]
    assert "| output exists |" in "\n".join(bench.startup_markdown(rows, 1))


def test_planning_section_plans_photos_of_distinct_sizes():
    bench = load_bench()
    rows = bench.planning_times((1, 30))
    assert [(r["sizes"], r["calibrations"]) for r in rows] == [(1, 1), (30, 30)]
    assert len({h * w for h, w, _ in bench.photo_shapes(30)}) == 30
    assert rows[1]["per_record_approx_epsilon"] <= rows[1]["per_record_epsilon"]
    assert "| 30 |" in "\n".join(bench.planning_markdown(rows))
