"""Figures README.md and docs/ quote from benchmarks/results/*.json agree with the JSON (benchmarks/tables.py), and
every results JSON names the machine and the command that produced it. Pure: reads files, times nothing."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MACHINE_KEYS = {"cpu", "cores", "l3", "torch", "load_average_start", "load_average_end", "date", "commit",
                "command"}


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


def machine_problems(doc: dict) -> list[str]:
    """Why the machine records of a results JSON cannot back its figures: a record must be written by the run
    itself (``benchmarks/harness.py``), with the load, the date, the commit and the exact command."""
    problems = []
    for key in ("machine", "measured_machine"):
        m = doc.get(key)
        if m is None and key == "measured_machine":
            continue
        if not isinstance(m, dict):
            problems.append(f"no {key} record")
            continue
        if "recorded_from" in m:
            problems.append(f"{key} was written afterwards, not measured by the run: re-run `{m.get('command')}`")
        if MACHINE_KEYS - set(m):
            problems.append(f"{key} lacks {sorted(MACHINE_KEYS - set(m))}")
        load = m.get("load_average_start")
        if not (isinstance(load, list) and load and all(isinstance(x, (int, float)) for x in load)):
            problems.append(f"{key} has no load average at the start ({load!r})")
        if not str(m.get("command") or "").startswith("python benchmarks/"):
            problems.append(f"{key} does not name the command that ran ({m.get('command')!r})")
    return problems


@pytest.mark.parametrize("path", sorted(p.name for p in RESULTS.glob("*.json") if not p.name.endswith(".trace.json")))
def test_every_results_json_names_its_machine_and_command(path):
    problems = machine_problems(json.loads((RESULTS / path).read_text()))
    assert not problems, f"{path}: " + "; ".join(problems)


def test_a_reconstructed_or_incomplete_machine_record_is_rejected():
    import harness as _machine

    good = {**_machine.finish(_machine.record()), "command": "python benchmarks/x.py"}
    assert machine_problems({"machine": good, "rows": []}) == []
    planted = {"recorded_from": {**good, "recorded_from": "added afterwards"},
               "load": {**good, "load_average_start": None},
               "command": {k: v for k, v in good.items() if k != "command"},
               "commit": {k: v for k, v in good.items() if k != "commit"}}
    for what, record in planted.items():
        assert machine_problems({"machine": record}), what
    assert machine_problems({"machine": good, "measured_machine": planted["recorded_from"]})
    assert machine_problems({"rows": []}) == ["no machine record"]


def test_machine_record_names_cpu_cache_and_command():
    import harness as _machine

    assert _machine._size("32768K") == 32 << 20 and _machine._size("16 MiB") == 16 << 20
    record = _machine.finish(_machine.record())
    assert MACHINE_KEYS | {"load_average_end", "duration_s"} <= set(record) and "_t0" not in record
    assert record["cores"] >= 1 and record["cpu"]
    assert "cores" in _machine.describe(record) and _machine.describe(None) == "an unrecorded machine"


# ---------------------------------------- every figure with a unit says where it came from
#
# A figure is a number followed by a time, size, speed or ratio unit ("0.41 ms", "874 MiB", "1.2x", "36%",
# "12.5 GB/s", "3.1 samples/s"). Each sentence that holds one must either quote a results JSON (a results marker,
# whose renderer names the machine) or say how the number was obtained (SOURCE_WORDS), or say that it is a setting
# or a requirement rather than a result (SETTING_WORDS: "default 60 s", "heartbeat timeout 2 s", "the goal is
# < 50 ms"). Fenced code blocks, code spans and HTML comments are not prose and are skipped; a table counts as one
# sentence together with the paragraph just above it (its caption), and text in double quotes is a quotation (of a
# published source, named beside it). Sentences are split at ". " before a capital,
# "(", "*" or "`" (after common abbreviations), and list items and headings stand alone.

SOURCE_WORDS = ("measured", "simulated", "published", "fitted", "computed", "assumed", "estimated")
SETTING_WORDS = ("default", "timeout", "goals?", "set to", "asserts")
_FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
                     r"(?:\s?(?:[mµu]?s|min|minutes?|seconds?|hours?|[KMGT]i?B|[KMGT]b|[KMGT]i?B/s|[KMGT]b/s|TF/s"
                     r"|TFLOP/s|(?:[a-z]+)/s)|x|%)(?![\w/])")
_LABEL = re.compile(r"\b(?:" + "|".join(SOURCE_WORDS + SETTING_WORDS) + r")\b", re.I)
_ABBREVIATIONS = ("e.g.", "i.e.", "Fig.", "Figs.", "Eq.", "Eqs.", "vs.", "cf.", "l.", "ll.", "No.")


def unlabelled_figures(text: str) -> list[str]:
    """The sentences of a markdown text that hold a figure with a unit but say nowhere how it was obtained."""
    text = tables.MARKER.sub(" RESULTS ", text)
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"``.*?``|`[^`]*`", "CODE", text, flags=re.S)
    text = re.sub(r'"[^"\n]*(?:\n[^"\n]*)*"', "QUOTE", text)  # a quotation: its source is named beside it
    for a in _ABBREVIATIONS:
        text = text.replace(" " + a, " " + a.replace(".", ""))
    found, previous = [], ""
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|"):
            units = [previous + "\n" + block]  # a table with its caption
        else:
            units = [s for item in re.split(r"\n(?=\s*(?:[-*+]|\d+\.|#+) )", block)
                     for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(*`])", item)]
        previous = block
        for sentence in units:
            if _FIGURE.search(sentence) and "RESULTS" not in sentence and not _LABEL.search(sentence):
                found.append(" ".join(sentence.split()))
    return found


@pytest.mark.parametrize("doc", tables.DOCUMENTS)
def test_every_figure_with_a_unit_says_where_it_came_from(doc):
    found = unlabelled_figures((ROOT / doc).read_text())
    assert not found, (f"{doc}: figures with a unit whose sentence says neither how they were obtained "
                       f"({', '.join(SOURCE_WORDS)}) nor that they are a setting, and quote no results JSON:\n  "
                       + "\n  ".join(s[:200] for s in found))


def test_the_figure_lint_flags_only_unlabelled_figures():
    assert unlabelled_figures("A step takes 0.41 ms. It is fast.") == ["A step takes 0.41 ms."]
    assert unlabelled_figures("Ours is 1.2x faster and 30% smaller (estimated).") == []
    assert unlabelled_figures("Measured: 3 GiB per rank, e.g. 12.5 GB/s over the link.") == []
    assert unlabelled_figures("The default is 60 s. A stage = 4 GPUs, hybrid 2x2, dp 2 x tp 2.") == []
    assert unlabelled_figures("```bash\nrun   # 4 min\n```\nRun `sleep 5s`.") == []
    quote = "<!-- results:benchmarks/results/encoder_cp_cpu.json:inline -->1.50x<!-- /results -->"
    assert unlabelled_figures(f"It is {quote} faster.") == []
    assert unlabelled_figures("Throughput:\n\n| mode | samples/s |\n| --- | ---: |\n| a | 2.1x |") != []
    assert unlabelled_figures("Simulated:\n\n| mode | samples/s |\n| --- | ---: |\n| a | 2.1x |") == []


# ---------------------------------------- a quote says how its figures were obtained, as its JSON records it

class _Reads(dict):
    """A results JSON that records which of its top-level entries a renderer reads."""

    def __init__(self, data: dict):
        super().__init__(data)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


_SOURCE_WORDS = {"measured": r"measur", "simulated": r"simulat", "computed": r"comput|formula|calculat|expected",
                 "published": r"publish|paper|seed", "setting": r""}


def label_problems(text: str) -> list[str]:
    """Quotes whose paragraph (the rendered quote with the text around it up to a blank line; for a block, with the
    caption above it) does not say how an entry it reads was obtained, by the results JSON's own ``obtained`` record (``harness.obtained``)."""
    import harness as _machine

    problems = []
    for match in tables.MARKER.finditer(text):
        data = json.loads((ROOT / match["json"]).read_text())
        reads = _Reads(data)
        body = tables.RENDERERS[(match["json"], match["name"])](reads)
        sources = data.get("obtained") or _machine.obtained(data)
        start = text.rfind("\n\n", 0, match.start()) + 1
        if not text[start:match.start()].strip():  # a block quote: its caption is the paragraph above
            start = text.rfind("\n\n", 0, max(start - 1, 0)) + 1
        end = text.find("\n\n", match.end())
        paragraph = text[start:match.start()] + body + text[match.end():end if end >= 0 else len(text)]
        for key in sorted(reads.read & set(sources)):
            if not re.search(_SOURCE_WORDS[sources[key]], paragraph, re.I):
                problems.append(f"{match['json']}:{match['name']} reads {key!r} ({sources[key]}) and its paragraph "
                                f"does not say so")
    return problems


@pytest.mark.parametrize("doc", tables.DOCUMENTS)
def test_every_quote_says_how_its_figures_were_obtained(doc):
    problems = label_problems((ROOT / doc).read_text())
    assert not problems, f"{doc}:\n  " + "\n  ".join(problems)


def test_the_label_check_follows_the_json_not_the_wording(tmp_path, monkeypatch):
    import harness as _machine

    path = tmp_path / "planted.json"
    path.write_text(json.dumps({"machine": _machine.finish(_machine.record()), "rows": [1.5],
                                "obtained": {"rows": "simulated"}}))
    monkeypatch.setitem(tables.RENDERERS, (str(path), "t"), lambda d: f"{d['rows'][0]}x")
    quote = f"<!-- results:{path}:t -->x<!-- /results -->"
    assert label_problems(f"It is {quote} faster.") and label_problems(f"It is {quote} faster (measured).")
    assert label_problems(f"It is {quote} faster (simulated).") == []


def benchmark_figures_not_quoted(text: str) -> list[str]:
    """Sentences that name a benchmark (a script under benchmarks/ or a results JSON) and hold a figure with a unit
    that is not quoted from a results JSON: such a figure can contradict the JSON without any test noticing."""
    text = tables.MARKER.sub(" RESULTS ", text)
    found = []
    for block in re.split(r"\n\s*\n", text):
        for item in re.split(r"\n(?=\s*(?:[-*+]|\d+\.|#+) )", block):
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(*`])", item.replace("e.g.", "eg")):
                if re.search(r"benchmarks/\w+\.(?:py|sh)|results/\w+\.json", sentence) and _FIGURE.search(
                        re.sub(r"`[^`]*`", "CODE", sentence)):
                    found.append(" ".join(sentence.split()))
    return found


def test_changelog_figures_of_a_benchmark_come_from_its_json():
    found = benchmark_figures_not_quoted((ROOT / "CHANGELOG.md").read_text())
    assert not found, ("CHANGELOG.md states figures of a benchmark that are not quoted from its results JSON (quote "
                       "them with a results marker, or give no number and name the docs page):\n  "
                       + "\n  ".join(s[:240] for s in found))


def test_the_changelog_check_catches_a_figure_beside_its_benchmark():
    assert benchmark_figures_not_quoted("- `benchmarks/checkpoint.py`: save 0.33x of FSDP2's time.")
    assert not benchmark_figures_not_quoted("- `benchmarks/checkpoint.py`: save faster (docs/checkpoints.md).")
    quote = "<!-- results:benchmarks/results/encoder_cp_cpu.json:inline -->1.5x<!-- /results -->"
    assert not benchmark_figures_not_quoted(f"- `benchmarks/encoder_cp.py`: a cp 2 step is {quote} faster.")
