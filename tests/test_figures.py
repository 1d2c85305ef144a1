"""Figures README.md and docs/ quote from benchmarks/results/*.json agree with the JSON (benchmarks/tables.py), and
every results JSON names the machine and the command that produced it. Pure: reads files, times nothing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MACHINE_KEYS = {"cpu", "cores", "l3", "torch", "load_average_start", "date", "command"}


def _tables():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _tables()
_CACHE: dict = {}  # results JSONs, read once for every document


@pytest.mark.parametrize("doc", tables.DOCUMENTS)
def test_quoted_figures_agree_with_their_json(doc):
    _, stale = tables.regenerate((ROOT / doc).read_text(), _CACHE)
    assert not stale, f"{doc} quotes figures that disagree with their JSON: {stale}; run python benchmarks/tables.py"


def test_a_changed_figure_is_caught_and_regenerated():
    quote = "<!-- results:benchmarks/results/encoder_cp_cpu.json:inline -->{}<!-- /results -->"
    right = tables.render("benchmarks/results/encoder_cp_cpu.json", "inline", {})
    new, stale = tables.regenerate("a cp 2 step is " + quote.format("9.99x") + " faster")
    assert stale == ["benchmarks/results/encoder_cp_cpu.json:inline"]
    assert new == "a cp 2 step is " + quote.format(right) + " faster"
    assert tables.regenerate(new) == (new, [])


def test_blocks_keep_their_layout():
    block = "<!-- results:benchmarks/results/cp_balance.json:imbalance -->\nold\n<!-- /results -->"
    new, _ = tables.regenerate(block)
    assert new.startswith("<!-- results:benchmarks/results/cp_balance.json:imbalance -->\n| layout |")
    assert new.endswith("|\n<!-- /results -->")


def test_unknown_quote_is_an_error():
    with pytest.raises(KeyError, match="no table"):
        tables.regenerate("<!-- results:benchmarks/results/cp_balance.json:nope -->x<!-- /results -->")


def test_the_documents_quote_results():
    quoted = {m["json"] for doc in tables.DOCUMENTS for m in tables.MARKER.finditer((ROOT / doc).read_text())}
    assert {"benchmarks/results/heterogeneity.json", "benchmarks/results/cp_balance.json",
            "benchmarks/results/balance_planning.json", "benchmarks/results/fault_tolerance_cpu.json"} <= quoted


@pytest.mark.parametrize("path", sorted(p.name for p in RESULTS.glob("*.json") if not p.name.endswith(".trace.json")))
def test_every_results_json_names_its_machine_and_command(path):
    machine = json.loads((RESULTS / path).read_text()).get("machine")
    assert isinstance(machine, dict), f"{path} has no machine record (benchmarks/_machine.py)"
    assert MACHINE_KEYS <= set(machine), f"{path}: machine record lacks {MACHINE_KEYS - set(machine)}"
    assert machine["command"].startswith("python benchmarks/")


def test_machine_record_names_cpu_cache_and_command():
    import _machine

    assert _machine._size("32768K") == 32 << 20 and _machine._size("16 MiB") == 16 << 20
    record = _machine.finish(_machine.record())
    assert MACHINE_KEYS | {"load_average_end", "duration_s"} <= set(record) and "_t0" not in record
    assert record["cores"] >= 1 and record["cpu"]
    assert "cores" in _machine.describe(record) and _machine.describe(None) == "an unrecorded machine"
