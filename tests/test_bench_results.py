"""The benchmark numbers a reader can cite: README.md's table is the rendering of the newest results file in
bench/results/ (so a README left behind by a new run fails here), and that file says where and under what
load it was measured. Reads files only; runs no benchmark."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
bench_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_run)


def test_readme_block_is_the_rendering_of_the_newest_results_file():
    newest = bench_run.newest_results()
    readme = (REPO / "README.md").read_text(encoding="utf8")
    assert bench_run.readme_section(readme) == bench_run.readme_block(newest), (
        f"README.md's benchmark block is not the rendering of {newest.name}: run `python bench/run.py --readme`"
    )


def test_newest_results_file_describes_its_machine_and_load():
    newest = bench_run.newest_results()
    results = json.loads(newest.read_text(encoding="utf8"))
    machine = results["machine"]
    assert set(bench_run.MACHINE_FIELDS) <= machine.keys()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", machine["date"])
    assert newest.name == f"{machine['date']}-{machine['slug']}.json"
    assert len(machine["load_before"]) == len(machine["load_after"]) == 3
    assert machine["cores"] >= 1 and machine["torch_threads"] >= 1
    assert results["entries"]
    for entry in results["entries"]:
        assert {"name", "unit", "note", "benchmark", "load_before", "load_after"} <= entry.keys(), entry["name"]
        if bench_run.is_budget(entry):
            assert {"seconds", "budget_s"} <= entry.keys() and "reference" not in entry
        else:
            assert entry["ratio"] > 0 and {"ours", "reference"} <= entry.keys()


def test_machine_slug_names_the_cpu_its_vector_isa_and_cores():
    assert bench_run.machine_slug("Intel(R) Xeon(R) Processor", "AVX512", 2) == "intel-xeon-avx512-2c"
    assert bench_run.machine_slug("AMD EPYC 7B13 64-Core Processor", "AVX2", 16) == "amd-epyc-7b13-avx2-16c"
    assert (bench_run.machine_slug("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "AVX512", 8)
            == "intel-xeon-platinum-8481c-avx512-8c")  # fmt: skip


def test_a_stale_readme_block_is_told_apart(tmp_path):
    """The check above can fail: a README rendered from another results file differs from the newest one's."""
    newest = json.loads(bench_run.newest_results().read_text(encoding="utf8"))
    older = {**newest, "entries": [{**e, "ratio": e.get("ratio", 1) * 1.5} for e in newest["entries"]]}
    assert bench_run.render_markdown(older, "older.json") != bench_run.render_markdown(newest, "older.json")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench_run.BEGIN}\nold table\n{bench_run.END}\nrest\n", encoding="utf8")
    bench_run.update_readme(readme, bench_run.newest_results())
    text = readme.read_text(encoding="utf8")
    assert bench_run.readme_section(text) == bench_run.readme_block()
    assert text.startswith(f"intro\n{bench_run.BEGIN}\n") and text.endswith(f"\n{bench_run.END}\nrest\n")
