"""Regenerate every figure README.md and docs/*.md quote from a benchmark's results JSON, or check them.

A quote sits between ``<!-- results:benchmarks/results/X.json:NAME -->`` and ``<!-- /results -->`` (a block when it
starts on a new line, else inline); its text is rendered from the JSON by the function registered as (X.json, NAME):
mostly ``grid`` specs (rows from the JSON, columns as format strings), the rest short functions. Every benchmark
rewrites the quotes after writing its JSON (``harness.write``); ``--check`` (and tests/test_figures.py) fails when a
quote disagrees with its JSON.

    python benchmarks/tables.py [--check]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import textwrap
from pathlib import Path

import harness

ROOT = harness.ROOT
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- results:(?P<json>[^:\s]+):(?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /results -->", re.S)
RENDERERS: dict = {}  # (json path, quote name) -> fn(data) -> text
MIB = 2 ** 20


def quotes(json_name: str, fns: dict) -> None:
    """Register each ``fn(data) -> text`` of ``fns`` as the quote NAME of ``benchmarks/results/<json_name>``."""
    RENDERERS.update({(f"benchmarks/results/{json_name}", name): fn for name, fn in fns.items()})


def renderer(json_name: str, name: str):
    """``quotes`` as a decorator, for one function."""
    def register(fn):
        quotes(json_name, {name: fn})
        return fn
    return register


def table(header: list[str], rows: list[list], align: str) -> str:
    """A markdown table; ``align`` is one letter per column ('l' or 'r')."""
    rule = ["---:" if a == "r" else "---" for a in align]
    return "\n".join("| " + " | ".join(line) + " |" for line in [header, rule, *[[str(c) for c in r] for r in rows]])


def grid(json_name: str, name: str, rows, align: str, columns: list, before="", after="") -> None:
    """Register a table quote: one row per item of ``rows`` (a key of the JSON or a function of it); each column a
    (header, cell) pair, the cell a format string over the item or a function of it, or a bare header where the
    items are lists of cells; ``before`` and ``after`` around the table: format strings over the JSON (``{on}``: the
    machine line) or functions of it."""
    def text(spec, data: dict) -> str:
        return spec.format_map({**data, "on": _machine_line(data)}) if isinstance(spec, str) else spec(data)

    def cell(spec, item, i: int) -> str:
        return item[i] if spec is None else spec.format_map(item) if isinstance(spec, str) else spec(item)

    columns = [(c, None) if isinstance(c, str) else c for c in columns]

    def render(data: dict) -> str:
        items = data[rows] if isinstance(rows, str) else rows(data)
        cells = [[cell(c, r, i) for i, (_, c) in enumerate(columns)] for r in items]
        return text(before, data) + table([h for h, _ in columns], cells, align) + text(after, data)
    quotes(json_name, {name: render})


def _machine_line(data: dict) -> str:
    m = data.get("machine")
    return f"{harness.describe(m)}; `{m['command']}`" if isinstance(m, dict) and m.get("command") else \
        harness.describe(m)


def _where(data: dict) -> str:
    return f"{data['machine']['cpu']} ({data['machine']['cores']} cores)"


def _loaded(data: dict) -> str:
    m = data["machine"]
    return f"{m['cpu']}, {m['cores']} cores, load average {m['load_average_start'][0]:.1f} at start"


def _range(values, spec=".2f", unit="") -> str:
    values = list(values)
    a, b = format(min(values), spec), format(max(values), spec)
    return f"{a}{unit}" if a == b else f"{a}-{b}{unit}"


def _pct(values) -> str:
    return _range([100 * v for v in values], ".0f", "%")


def _wrap(text: str) -> str:
    """Prose at most 120 characters a line; a line starting with "- " is a bullet (continued indented)."""
    return "\n".join(textwrap.fill(p, 120, subsequent_indent="  " if p.startswith("- ") else "",
                                   break_long_words=False, break_on_hyphens=False) for p in text.split("\n"))


def _opt(key: str, fmt: str = ".2f", missing: str = ""):
    """A cell of ``key`` in ``fmt``, ``missing`` where the row lacks it."""
    return lambda r: format(r[key], fmt) if key in r else missing


def _met(ok) -> str:
    return "met" if ok else "missed"


# ---------------------------------------- cp_balance.json, balance_planning.json

_CP_NAMES = {("mp", ""): "MP (int16 segment ids, as the collator makes them)",
             ("ee", "256-token items"): "EE with 256-token items",
             **{("mp", f"int{b} segment ids"): f"MP with int{b} segment ids" for b in (32, 64)},
             **{(x, v): f"{x.upper()}, {v}" for x in ("ep", "mp") for v in ("cold cache", "just written")}}
_CP_METHODS = ["lpt", "random", "zigzag", "contiguous"]


def _plan_rows(data: dict, variant: str, layouts=("ep", "ee", "mp")) -> list[dict]:
    return [next(r for r in data["planning_1m"] if r["layout"] == x and r.get("variant", "") == variant)
            for x in layouts]


def _imbalance(data: dict) -> dict:
    return {(r["layout"], r["tokens"], r["cp"], r["method"]): r["imbalance"] for r in data["balance"]}


def cp_planning_goal(data: dict) -> str:
    warm, cold = _plan_rows(data, ""), _plan_rows(data, "cold cache", ("ep", "mp"))
    if any("plan_cpu_ms_median" not in r for r in warm + cold):
        return "not measured in CPU time"
    ms = lambda rows, key="plan_cpu_ms_median": _range([r[key] for r in rows])  # noqa: E731
    m = data["machine"]
    return (f"with the arrays in the cache, {ms(warm)} ms of CPU time ({ms(warm, 'plan_ms_median')} ms wall, EP / EE "
            f"/ MP medians); from memory (cold cache), {ms(cold)} ms of CPU time ({ms(cold, 'plan_ms_median')} ms "
            f"wall), of which one numpy read of the {_range([r['array_bytes'] / MIB for r in cold], '.0f')} MB of "
            f"words and segment ids takes {ms(cold, 'read_ms_median')} ms (measured by `benchmarks/cp_balance.py "
            f"--only planning` on {m['cpu']}, {m['cores']} cores, {m.get('l3', '?')} L3, load average "
            f"{_range([r['load_average'] for r in warm + cold], '.1f')} during the cases)")


def cp_imbalance_rows(data: dict) -> list[dict]:
    index = _imbalance(data)
    keys = sorted({k[:3] for k in index}, key=lambda k: (["ep", "ee", "mp"].index(k[0]), k[1], k[2]))
    return [dict(layout=x.upper(), tokens=f"{t >> 10}k", cp=c, **{m: index[(x, t, c, m)] for m in _CP_METHODS})
            for x, t, c in keys]


def cp_goal(data: dict) -> str:
    index = _imbalance(data)
    lpt, zz = ([index[(x, 65536, 8, m)] for x in ("ee", "mp")] for m in ("lpt", "zigzag"))
    return (f"**{_met(all(v <= data['goals']['lpt_imbalance_64k_cp8'] for v in lpt))}** (EE {lpt[0]:.4f}, MP "
            f"{lpt[1]:.4f}; zigzag {zz[0]:.4f} and {zz[1]:.4f}; deterministic, computed by `benchmarks/cp_balance.py`)")


def cp_modes_bytes_rows(data: dict) -> list[dict]:
    index = {(r["tokens"], r["cp"], r["kv_heads"]): r for r in data["modes_bytes"]}
    keys = [(1 << 20, cp, kv) for kv in (8, 64) for cp in (4, 8, 16)] + [(1 << 16, 8, 8)]
    return [dict(index[k], size=f"{k[0] >> 20}M" if k[0] >= 1 << 20 else f"{k[0] >> 10}k") for k in keys]


grid("cp_balance.json", "planning", "planning_1m", "lrrrrrrrrrl", [
    ("layout (1M tokens, cp 8)", lambda r: _CP_NAMES.get((r["layout"], r.get("variant", "")), r["layout"].upper())),
    ("runs", "{runs}"), ("arrays MB", lambda r: f"{r['array_bytes'] / MIB:.0f}" if "array_bytes" in r else ""),
    ("distribute median ms", "{plan_ms_median:.2f}"), ("min ms", "{plan_ms_min:.2f}"),
    ("CPU median ms", _opt("plan_cpu_ms_median")), ("read arrays ms", _opt("read_ms_median")),
    ("workload median ms", "{workload_ms_median:.2f}"), ("LPT median ms", "{lpt_ms_median:.2f}"),
    ("load avg", "{load_average:.1f}"),
    ("goal 1 ms (wall / CPU)", lambda r: _met(r["met"]) + (f" / {_met(r['met_cpu'])}" if "met_cpu" in r else ""))],
     before=lambda d: (f"Measured on {_machine_line(d)} (1 thread, median and minimum of "
                       f"{d['machine'].get('repeats', 'the')} repeats of one call; load average at each case's start "
                       "in the table):\n\n"))
grid("cp_balance.json", "imbalance", cp_imbalance_rows, "lrrrrrr",
     [("layout", "{layout}"), ("tokens", "{tokens}"), ("cp", "{cp}"), *[(m, f"{{{m}:.4f}}") for m in _CP_METHODS]])
grid("cp_balance.json", "modes-bytes", cp_modes_bytes_rows, "rrrrrr", [
    ("tokens", "{size}"), ("cp", "{cp}"), ("KV heads", "{kv_heads}"), ("allgather", "{allgather_mib:.0f}"),
    ("ulysses", "{ulysses_mib:.0f}"),
    ("hybrid (K)", lambda r: "-" if r["hybrid_mib"] is None else f"{r['hybrid_mib']:.0f} ({r['hybrid_ulysses']})")])
quotes("cp_balance.json", {
    "planning-goal": cp_planning_goal, "goal": cp_goal,
    "planning-inline": lambda d: (
        "{:.2f} / {:.2f} / {:.2f} ms (EP / EE / MP medians with the arrays in the cache, measured by "
        "`benchmarks/cp_balance.py --only planning` on {}, {} cores, load average {:.1f}), but {} ms when the words "
        "and segment ids come from memory (EP / MP, cold cache)".format(
            *[r["plan_ms_median"] for r in _plan_rows(d, "")], d["machine"]["cpu"], d["machine"]["cores"],
            d["machine"]["load_average_start"][0],
            _range(r["plan_ms_median"] for r in _plan_rows(d, "cold cache", ("ep", "mp"))))),
    "evict": lambda d: (f"{d['machine']['evict_bytes'] >> 20} MB (four times the {d['machine']['l3']} L3 the "
                        f"measuring machine reports{'' if d['machine'].get('l3_bytes') else ', assumed'})"),
    "modes-work": lambda d: (
        f"at most {max(r['allgather_lpt'] for r in d['modes_work']):.4f} for allgather-LPT, exactly 1 for Ulysses, "
        f"and at most {max(r['hybrid'] for r in d['modes_work'] if r['hybrid'] is not None):.4f} for hybrid over "
        f"EP/EE/MP at 64k-1M tokens and cp 2-16 (computed by `benchmarks/cp_balance.py`)")})
grid("balance_planning.json", "table", "rows", "lrrrrr", [
    ("method", "{method}"), ("plan median ms", "{plan_ms_median:.2f}"), ("plan min ms", "{plan_ms_min:.2f}"),
    ("encoder max/mean", "{enc_max_over_mean:.3f}"), ("LLM max/mean", "{llm_max_over_mean:.3f}"),
    ("deferrals", "{deferrals:.1f}")],
     before="Measured on {on}; {repeats} timed runs of one batch, loads over {seeds} seeds:\n\n")
quotes("balance_planning.json", {"inline": lambda d: (
    "{disttrain:.1f} ms (disttrain) and {entrain:.1f} ms (entrain) per 512-sample batch, ".format_map(
        {r["method"]: r["plan_ms_median"] for r in d["rows"]})
    + "medians measured by `benchmarks/balance_planning.py` on {cpu} ({cores} cores, load average {0:.1f})".format(
        d["machine"]["load_average_start"][0], **d["machine"]))})


# ---------------------------------------- heterogeneity.json

def _seeds(data: dict, mixed: bool = False) -> list[dict]:
    return [q for q in data["summary"] if (q["dataset"] == "mixed") == mixed]


def _llm(name: str) -> str:
    return name.replace("llama-", "").upper()


@renderer("heterogeneity.json", "calibration")
def het_calibration(data: dict) -> str:
    cal = data["setting"]["calibration"]
    rows = []
    for i, q in enumerate(next(iter(cal.values()))["checks"]):
        t, checks = q["target"], [c["checks"][i] for c in cal.values()]
        rows.append([q["figure"], q["statistic"].replace("_", " "),
                     f"{t:.2f}" if isinstance(t, float) else f"{t[0]:.2f}-{t[1]:.2f}",
                     *[f"{c['value']:.2f} {'met' if c['met'] else 'MISSED'}" for c in checks]])
    for label, key in (("vision", "kappa"), ("Llama-3B", "llm_3b_factor")):
        rows.append([f"{label} seconds per FLOP / Llama-1B's (fitted)", "", "",
                     *[f"{c[key]:.2f}" for c in cal.values()]])
    return table(["published figure", "statistic", "published (a split: the interval it implies)",
                  *[f"calibration \"{n}\"" for n in cal]], rows, "lllrrr")


def het_std_rows(data: dict) -> list[list]:
    pub, rows = data["published"]["table_4_3"], []
    get = {(r["dataset"], r["llm"], r["method"]): r for r in data["simulated"]}
    for d, llm in [(d, llm) for d in ("synthchart", "llava") for llm in ("llama-1b", "llama-3b")]:
        for module, key, pkey in (("vision", "vision", "vision"), ("LLM", "llm", llm)):
            dt, en, no = (get[(d, llm, m)][f"{key}_forward_std_ms"] for m in ("disttrain", "entrain", "none"))
            p = pub[d][pkey]
            rows.append([d, _llm(llm), module, f"{p[0]:.2f} / {p[1]:.2f} / {p[2]:.2f}", f"{p[0] / p[2]:.2f}",
                         f"{dt:.2f} / {en:.2f}", f"{no:.2f}", f"{dt / max(en, 1e-12):.2f}"])
    return rows


def het_planning_rows(data: dict) -> list[dict]:
    got = {m: [r for r in data["planning"] if r["method"] == m] for m in ("none", "disttrain", "entrain")}
    return [dict(method=m, median=statistics.median(r["plan_ms_median"] for r in g),
                 worst=max(r["plan_ms_median"] for r in g), slowest=max(r["plan_ms_max"] for r in g))
            for m, g in got.items()]


_SET = [("set", "{dataset}"), ("LLM", lambda r: _llm(r["llm"]))]
grid("heterogeneity.json", "vs-disttrain", _seeds, "llrllrrr", [
    *_SET, ("vision:LLM workload (simulated)", "{vision_text_workload_ratio:.2f}"),
    ("entrain split (simulated)", "{entrain_split[0]}/{entrain_split[1]}"),
    ("entrain split (published)", lambda q: "/".join(map(str, q["published_entrain_split"] or [])) or "-"),
    ("disttrain splits from 1-sample profiles (simulated)",
     lambda q: ", ".join(f"{k} ({v:.0%})" for k, v in q["disttrain_splits"].items())),
    ("entrain over disttrain, profiled splits (simulated)", "{entrain_over_disttrain:.3f}"),
    ("entrain over disttrain, best split each (simulated)", "{entrain_over_disttrain_best:.3f}")])
grid("heterogeneity.json", "std", het_std_rows, "lllrrrrr", [
    "set", "LLM", "module", "published std DistTrain / DIP / Entrain (Table 4.3)", "published DistTrain / Entrain",
    "simulated std ms disttrain / entrain", "simulated std ms none", "simulated disttrain / entrain"])
grid("heterogeneity.json", "iterations", "simulated", "lllrlrrrr", [
    *_SET, ("method", "{method}"), ("simulated iteration s, profiled split", "{iteration_s:.3f}"),
    ("best split", "{best_split}"), ("iteration s, best split", "{iteration_s_best:.3f}"),
    ("over none, both at entrain's split", "{speedup_vs_none:.3f}"),
    ("idle", "{mean_idle_fraction:.2f}"), ("deferred samples", "{deferred_samples:.1f}")])
grid("heterogeneity.json", "ablation",
     lambda d: [r for r in d["simulated"] if r["method"] == "entrain" and r["deferred_samples"] > 0], "llrr", [
         *_SET, ("without deferral (simulated)", "{iteration_s_without_deferral:.3f} s"),
         ("with deferral (simulated)", "{iteration_s_at_entrain_split:.3f} s")])
grid("heterogeneity.json", "planning", het_planning_rows, "lrrr", [
    ("method", "{method}"), ("median of medians ms", "{median:.2f}"), ("worst median ms", "{worst:.2f}"),
    ("slowest single run ms", "{slowest:.2f}")],
     before="Measured on {on}; `plan_batch` timed with `benchmarks/balance_planning.py`'s `planning_ms` on 2 batches "
            "of each set and LLM:\n\n")
grid("heterogeneity.json", "measured", "measured", "lrrrr", [
    ("method", "{method}"), ("samples/s", "{samples_per_s:.2f}"), ("median step s", "{step_s_median:.3f}"),
    ("measured steps s", lambda r: _range(r["step_s"][r["warmup"]:], ".2f")),
    ("encoder microbatch forward std ms", "{encoder_forward_std_ms:.2f}")],
     before=lambda d: (f"Measured on {harness.describe(d.get('measured_machine'))} (`python "
                       "benchmarks/heterogeneity.py --measure`):\n\n"))
quotes("heterogeneity.json", {
    "calibration-inline": lambda d: (
        f"the vision tower's seconds per FLOP are {d['setting']['vision_slowdown']:.2f} x Llama-1B's and Llama-3B's "
        f"{d['setting']['llm_3b_factor']:.2f} x Llama-1B's (fitted to the published splits and the 1.27 ratio, "
        "table below)"),
    "mean-over-sum": lambda d: (
        f"the mean of per-sample ratios is {d['setting']['llava_1b_mean_over_sum']:.3f} x the ratio of sums on the "
        f"LLaVA-like set (computed from the generated samples), while 2.43 beside 9:7 needs at least "
        f"{d['setting']['fig_4_5_needs_mean_over_sum']:.2f} x"),
    "vs-disttrain-inline": lambda d: (
        f"entrain over disttrain {_range([q['entrain_over_disttrain'] for q in _seeds(d)], '.2f', 'x')} with each "
        f"method's split chosen by its own profile, "
        f"{_range([q['entrain_over_disttrain_best'] for q in _seeds(d)], '.2f', 'x')} with each at its best split "
        "(simulated at the seeds' scale on the LLaVA- and SynthChart-like sets; published: up to 1.40x over "
        "DistTrain and DIP, Fig. 4.12)"),
    "vs-none-inline": lambda d: (
        f"entrain {_range([q['entrain_over_none'] for q in _seeds(d)], '.2f', 'x')} and disttrain "
        f"{_range([q['disttrain_over_none'] for q in _seeds(d)], '.2f', 'x')} over contiguous microbatches (\"none\", "
        f"which the paper does not run) on the seeds' sets, "
        f"{_range([q['entrain_over_none'] for q in _seeds(d, mixed=True)], '.2f', 'x')}"
        f" (entrain) on the mixed set the paper does not have (simulated)")})


# ---------------------------------------- fault_tolerance_cpu.json

def ft_rows(data: dict) -> list[list[str]]:
    ft, dp, f, c = (data["runs"][k] for k in ("ft", "dp", "ft_fail", "ckpt_fail"))
    pairs = list(zip(ft.get("earlier_samples_per_s", []) + [ft["samples_per_s"]],
                     dp.get("earlier_samples_per_s", []) + [dp["samples_per_s"]]))
    return [
        ["samples/s, no failure, FT on / FT off (paired runs)", " and ".join(f"{a:.1f} / {b:.1f}" for a, b in pairs)
         + ": ratio " + " and ".join(f"{a / b:.2f}" for a, b in pairs)],
        ["FT: SIGKILL -> the surviving group's next committed step",
         f"{f['kill_to_next_commit_s']:.2f} s (step time {f['step_s_before']:.2f} s)"],
        ["FT: SIGKILL -> restarted group's ranks up (torchrun restart + imports)",
         f"{f['kill_to_restarted_process_start_s']:.1f} s"],
        ["FT: heal of the restarted group (copy from its peer)", f"{f['heal_s']:.2f} s"],
        [f"FT: SIGKILL -> restarted group commits again (step {f['healed_at_step'] + 1})",
         f"{f['kill_to_rejoined_s']:.1f} s"],
        ["FT: samples/s before / during / after the failure (survivor's commits)",
         f"{f['samples_per_s_before']:.1f} / {f['samples_per_s_during']:.1f} / {f['samples_per_s_after']:.1f}"],
        ["ckpt-restart: steps since the last checkpoint",
         f"{c['lost_steps']} (kill after step {c['kill']['step']}, checkpoint at {c['last_checkpoint_step']})"],
        ["ckpt-restart: SIGKILL -> restarted ranks up (torchrun restart + imports)",
         f"{c['kill_to_restarted_process_start_s']:.1f} s"],
        ["ckpt-restart: `fit()` -> training starts (setup + checkpoint load)",
         f"{c['fit_to_train_start_s (setup + checkpoint load)']:.2f} s"],
        [f"ckpt-restart: SIGKILL -> first step after resume (step {c['first_step_after_resume']}) / back at step "
         f"{c['kill']['step']}",
         f"{c['kill_to_first_step_after_resume_s']:.1f} s / {c['kill_to_same_step_again_s']:.1f} s"]]


def ft_compare_rows(data: dict) -> list[list[str]]:
    ft, ck = data["runs"]["ft_fail"], data["runs"]["ckpt_fail"]
    stall_ft, stall_ck = ft["kill_to_next_commit_s"], ck["kill_to_first_step_after_resume_s"]
    degraded, groups = ft["kill_to_rejoined_s"] - stall_ft, 2
    total_ft = stall_ft + degraded / groups  # the survivor of G groups runs at (G - 1) / G with a device per rank
    return [["stall: the job makes no step (measured)", f"{stall_ft:.1f} s (kill -> next committed step)",
             f"{stall_ck:.1f} s (kill -> first step after resume)", f"{stall_ck / stall_ft:.1f}x"],
            ["total time lost (stall + degraded steps; computed from the formula below)",
             f"{total_ft:.1f} s ({stall_ft:.1f} s stall + {degraded:.1f} s degraded at {groups - 1}/{groups} "
             f"throughput, costing {degraded / groups:.1f} s)", f"{ck['lost_s']:.1f} s (measured; no degraded phase)",
             f"{ck['lost_s'] / total_ft:.1f}x"]]


grid("fault_tolerance_cpu.json", "table", ft_rows, "ll", ["measured, 2-core CPU, gloo", "value"],
     before="Measured on {on}:\n\n")
grid("fault_tolerance_cpu.json", "compare", ft_compare_rows, "lllr",
     ["like with like", "FT", "checkpoint-restart", "checkpoint-restart / FT"])
quotes("fault_tolerance_cpu.json", {
    "inline": lambda d: (
        f"kill to the next committed step {d['runs']['ft_fail']['kill_to_next_commit_s']:.1f} s and heal "
        f"{d['runs']['ft_fail']['heal_s']:.1f} s vs {d['runs']['ckpt_fail']['kill_to_first_step_after_resume_s']:.1f}"
        f" s to the first step after a checkpoint-restart (stall vs stall), measured on {_where(d)} with gloo"),
    "lost": lambda d: (f"{d['runs']['ckpt_fail']['expected_lost_s_formula']:.1f} s in the JSON's "
                       "`expected_lost_s_formula`, computed from the measured phases above"),
    "step": lambda d: (f"its measured step times are "
                       f"{_range(d['runs'][k]['step_s_before'] for k in ('ft_fail', 'ckpt_fail'))} s")})

# ---------------------------------------- pipeline*.json (pipeline.py; --setup; --sharding)

_SETUP_NAMES = {"eager": "eager (random, every rank)", "lazy": "lazy (random, meta)",
                "folder-eager": "folder, eager on every rank", "folder-lazy": "folder, lazy (meta)",
                "from_pretrained": "HF `from_pretrained`, one process"}
_SHARDING_NAMES = {"no_shard": ("lightning-mm NO_SHARD", "dp 4"),
                   "shard_grad_op": ("lightning-mm SHARD_GRAD_OP", "dp 4"),
                   "full_shard": ("lightning-mm FULL_SHARD", "dp 4"),
                   "tp2_no_shard": ("lightning-mm NO_SHARD", "tp 2 x dp 2"),
                   "tp2_full_shard": ("lightning-mm FULL_SHARD", "tp 2 x dp 2"),
                   "lightning_fsdp": ("Lightning `FSDPStrategy` FULL_SHARD", "dp 4"),
                   "lightning_fsdp2": ("Lightning `ModelParallelStrategy` + `fully_shard`", "dp 4")}


def _mb(ranks, key: str) -> str:
    return " ".join(f"{x[key]:.0f}" for x in ranks)


def _sharding_runs(data: dict) -> list[dict]:
    repeat = json.loads((ROOT / "benchmarks/results/pipeline_sharding_p4_cpu_repeat.json").read_text())
    return [{r["name"]: r for r in d["rows"]} for d in (data, repeat)]


def pipeline_rows(data: dict) -> list[list[str]]:
    rows, base = [], data["rows"][0]["samples_per_s"]

    def short(name: str) -> str:
        return name.replace("language_model", "llm").replace("encoders", "enc")

    for r in data["rows"]:
        stages = "whole model" if r["strategy"] != "multimodal" else ", ".join(
            f"{short(m)}{v}" for m, v in r.get("partition", {}).items())
        ratio = r["iteration_s"] / r["predicted_iteration_s"] if r.get("predicted_iteration_s") else None
        rows.append([r["name"] + (" (baseline)" if r is data["rows"][0] else ""), f"{stages} ({r['dp']})",
                     f"{r['samples_per_s']:.2f}", f"{r['samples_per_s'] / base:.2f}x",
                     ", ".join(f"{x['peak_mb']:.0f} (+{x['peak_mb'] - x['rss_start_mb']:.0f})" for x in r["ranks"]),
                     ", ".join(f"{short(s)} {v:.0%}" for s, v in r.get("bubble", {}).items()),
                     "" if ratio is None else f"{ratio:.2f}", ", ".join(f"{v:.2f}" for v in r["all_samples_per_s"])])
    return rows


def sharding_rows(data: dict) -> list[list[str]]:
    runs, rows = _sharding_runs(data), []
    for name, (strategy, layout) in _SHARDING_NAMES.items():
        r = runs[0].get(name)
        if r is not None and "error" in r:
            line = r["error"].strip().splitlines()[-1].split(". ")[0]
            rows.append([strategy, layout, f"error (both runs): `` {line} ``", "", "", ""])
        elif r is not None:
            st = r["ranks"][0]["state_mb"]
            ratios = [run[name]["samples_per_s"] / run["no_shard"]["samples_per_s"] for run in runs]
            rows.append([strategy, layout, " / ".join(f"{x:.2f}" for x in ratios),
                         f"{statistics.fmean(x['loss'] for x in r['ranks']):.4f}", _mb(r["ranks"], "peak_end_mb"),
                         f"{st['total']:.0f} ({st['params']:.0f} + {st['grads']:.0f} + {st['optimizer']:.0f})"])
    return rows


grid("pipeline_p2_cpu.json", "table", pipeline_rows, "llrrllrl", [
    "layout", "stages (dp)", "samples/s (best)", "vs DDP", "peak RSS MB per rank (growth in training)",
    "bubble per rank", "measured / simulated", "all runs"], before="Measured on {on}:\n\n")
grid("pipeline_setup_p4_cpu.json", "table", "rows", "lrllrrrr", [
    ("build", lambda r: _SETUP_NAMES.get(r["name"], r["name"])), ("processes", lambda r: len(r["ranks"])),
    ("peak MiB per rank at the first step", lambda r: _mb(r["ranks"], "peak_first_step_mb")),
    ("peak MiB per rank at the end", lambda r: _mb(r["ranks"], "peak_end_mb")),
    ("build s", lambda r: f"{max(x['build_s'] for x in r['ranks']):.2f}"),
    ("setup s", lambda r: f"{max(x['setup_s'] for x in r['ranks']):.2f}"),
    ("rank 0 to 1st step s", "{ranks[0][to_first_step_s]:.1f}"),
    ("to its end s", "{ranks[0][to_first_step_end_s]:.1f}")],
     before="Measured on {on}:\n\n")
grid("pipeline_sharding_p4_cpu.json", "table", sharding_rows, "llrrll", [
    "strategy", "layout", "samples/s vs NO_SHARD dp 4 (run 1 / run 2)", "loss", "peak growth MiB per rank",
    "state MiB per rank (params + grads + AdamW)"],
     before="Measured on {on} (run 1) and `pipeline_sharding_p4_cpu_repeat.json` (run 2):\n\n")


def _growth(rows) -> list[float]:
    return [x["peak_mb"] - x["rss_start_mb"] for r in rows for x in r["ranks"]]


@renderer("pipeline_p2_cpu.json", "reading")
def pipeline_reading(data: dict) -> str:
    by, base = {r["name"]: r for r in data["rows"]}, data["rows"][0]
    split = [by[n] for n in ("parallel", "colocated")]
    rep = by["replicated"]
    sim = [r["iteration_s"] / r["predicted_iteration_s"] for r in data["rows"] if r.get("predicted_iteration_s")]
    noise = max(max(r["all_samples_per_s"]) / min(r["all_samples_per_s"]) for r in data["rows"])
    return _wrap(f"Reading (measured): on 2 devices a model that fits one device trains fastest with plain data "
                 f"parallelism (no bubbles). Parallel/colocated put the frozen encoder alone on rank 0 "
                 f"(idle {_pct(max(r['bubble'].values()) for r in split)}, measured) and the whole LLM on rank 1, so "
                 f"they run at {_range([r['samples_per_s'] / base['samples_per_s'] for r in split])}x"
                 f" of DDP's samples/s, as the simulator predicts (measured / simulated iteration time "
                 f"{_range(sim)} over the pipeline rows); replicated balances the LLM over both ranks (frozen-aware "
                 f"boundaries {rep['partition']['language_model']}) and loses its {_pct(rep['bubble'].values())}"
                 f" 1F1B bubble (measured by `PipelineTimeline`). With one encoder, parallel and colocated are the "
                 f"same graph. Memory is the robust result: training grows each pipeline rank's RSS by "
                 f"{_range(_growth(data['rows'][1:]), '.0f')} MB against {_range(_growth([base]), '.0f')} MB for DDP "
                 f"(measured), which keeps gradients and optimiser state of the whole trainable LLM on every rank. The "
                 f"two measured runs of one layout differ by up to {noise:.1f}x (the last column): on that machine "
                 f"only larger differences are meaningful.")


@renderer("pipeline_setup_p4_cpu.json", "reading")
def pipeline_setup_reading(data: dict) -> str:
    by = {r["name"]: r["ranks"] for r in data["rows"]}
    first = lambda name, i: by[name][i]["peak_first_step_mb"]  # noqa: E731
    setup = [x["build_s"] + x["setup_s"] for r in data["rows"] for x in r["ranks"]]
    launch = [r["ranks"][0]["to_first_step_s"] for r in data["rows"] if len(r["ranks"]) > 1]
    hf = by["from_pretrained"][0]
    return _wrap("Reading (every figure measured, from the table above):\n"
            f"- Memory: eager builds put the whole model on every rank "
            f"({_range([x['peak_first_step_mb'] for x in by['eager']], '.0f')} MiB; from folders "
            f"{_range([x['peak_first_step_mb'] for x in by['folder-eager']], '.0f')}, about the model plus the largest "
            f"tensor being read, the embedding or head). "
            f"Lazy builds hold the stage: {_range([first('lazy', 0), first('folder-lazy', 0)], '.0f')} MiB on the "
            f"encoder rank, {_range([first('lazy', 2), first('folder-lazy', 2)], '.0f')} on the middle LLM stage, "
            f"{_range([first('lazy', 1), first('lazy', 3)], '.0f')} on the stages with the embeddings or the head "
            f"(from folders: plus the tensor being read, {first('folder-lazy', 1):.0f} and "
            f"{first('folder-lazy', 3):.0f}). At the end the last stage reaches "
            f"{_range([by[n][3]['peak_end_mb'] for n in ('lazy', 'folder-lazy')], '.0f')} MiB in both lazy variants: "
            f"the step's logits over the vocabulary and their gradient, not parameters (the eager peak already "
            f"covered it).\n"
            f"- Time: at this size build + setup take at most {max(setup):.1f} s per rank in every variant. Rank 0's "
            f"{_range(launch, '.0f')} s to the first step is launching the {len(by['eager']) - 1} other processes "
            f"(interpreter start, torch/Lightning/transformers imports, their builds) on "
            f"{data['machine']['cores']} shared cores. `from_pretrained` (transformers 5, CPU) leaves the weights "
            f"memory-mapped from the safetensors files: they are read when first used, in the first step "
            f"({hf['to_first_step_s']:.1f} s to its start, {hf['to_first_step_end_s']:.1f} s to its end, "
            f"{hf['peak_end_mb']:.0f} MiB at the end: the whole model plus the whole model's activations in one "
            f"process).")


@renderer("pipeline_sharding_p4_cpu.json", "reading")
def pipeline_sharding_reading(data: dict) -> str:
    runs = _sharding_runs(data)
    by = runs[0]
    state = {n: r["ranks"][0]["state_mb"]["total"] for n, r in by.items() if "ranks" in r}
    peak = lambda n: [x["peak_end_mb"] for x in by[n]["ranks"]]  # noqa: E731
    ratio = lambda n, d="no_shard": [run[n]["samples_per_s"] / run[d]["samples_per_s"] for run in runs]  # noqa: E731
    sharded = peak("shard_grad_op") + peak("full_shard")
    cut = [1 - max(sharded) / min(peak("no_shard")), 1 - min(sharded) / max(peak("no_shard"))]
    losses = [x["loss"] for x in by["lightning_fsdp2"]["ranks"]]
    first = [x["peak_first_step_mb"] for n in ("shard_grad_op", "full_shard") for x in by[n]["ranks"]]
    more = [a - b for a, b in zip(peak("lightning_fsdp2"), peak("full_shard"))]
    return _wrap("Reading (every figure measured, from the table above):\n"
            f"- State: sharding over 4 ranks leaves each a quarter of NO_SHARD's {state['no_shard']:.0f} MiB "
            f"({state['full_shard']:.0f}), tp 2 half ({state['tp2_no_shard']:.0f}: the replicated encoder and norms "
            f"make it slightly more), tp 2 x FULL_SHARD over dp 2 a quarter again ({state['tp2_full_shard']:.0f}: the "
            f"tp shards sharded once more). Lightning's FSDP2 row holds the same {state['lightning_fsdp2']:.0f} MiB.\n"
            f"- Loss: the three dp 4 rows give the same loss, and Lightning's FSDP2 row the same value as the mean of "
            f"its 4 ranks' losses ({', '.join(f'{x:.4f}' for x in losses)}): the same model, initial values and data "
            f"order. The tp 2 rows train on a global batch of 2, hence another loss.\n"
            f"- Peak memory: sharding lowers the resident-set peak by {_pct(cut)} "
            f"({_range(sharded, '.0f')} MiB against {_range(peak('no_shard'), '.0f')}), much less than the state's "
            f"{1 - state['full_shard'] / state['no_shard']:.0%}: at this size the peak on a CPU also holds the "
            f"activations and logits, each unit's gathered parameters and unsharded gradients while they are in use, "
            f"gloo's buffers, and memory the allocator keeps after a free. At the first step (after setup) the "
            f"sharded rows stand at {_range(first, '.0f')} MiB against "
            f"{_range([x['peak_first_step_mb'] for x in by['no_shard']['ranks']], '.0f')} for NO_SHARD although they "
            f"hold a quarter of the parameters: materialising a shard draws the full tensor's initial values first "
            f"(so that they equal one process's). The state column is the allocator-independent number; a GPU's peak "
            f"allocated would show the difference more directly.\n"
            f"- Throughput: on that CPU the sharded dp 4 rows are not slower than NO_SHARD "
            f"({_range(ratio('shard_grad_op') + ratio('full_shard'))}x in both runs; each rank's AdamW step covers a "
            f"quarter of the parameters, against the extra gathers of FSDP). Lightning's FSDP2 row reaches "
            f"{_range(ratio('lightning_fsdp2', 'full_shard'))}x of lightning-mm's FULL_SHARD with the same state per "
            f"rank and a {_range(more, '.0f')} MiB higher peak per rank: its root unit holds the embedding, the head "
            f"and the SigLIP, gathered at once, which lightning-mm shards as units of their own. The tp 2 rows: "
            f"{_range(ratio('tp2_no_shard'))}x (NO_SHARD) and {_range(ratio('tp2_full_shard'))}x (FULL_SHARD) of "
            f"dp 4's samples/s on the same 4 processes.")


for _json in ("pipeline_setup_p4_cpu.json", "pipeline_sharding_p4_cpu.json"):
    quotes(_json, {"model": lambda d: f"{d['model_mb']:.0f} MiB"})


# ---------------------------------------- checkpoint.json

def checkpoint_rows(data: dict) -> list[list[str]]:
    o, f = data["checkpoint"]["ours"], data["checkpoint"]["fsdp"]
    return [["size (MB)", f"{o['bytes'] / 1e6:.2f}", f"{f['bytes'] / 1e6:.2f}", f"{o['bytes'] / f['bytes']:.2f}"],
            *[[f"{k} (s)", f"{o[k + '_s']:.3f}", f"{f[k + '_s']:.3f}", f"{o[k + '_s'] / f[k + '_s']:.2f}"]
              for k in ("save", "load")]]


def checkpoint_faults(data: dict) -> list[list[str]]:
    t = data["fault_to_exit_s"]
    return [["SIGKILL rank 1", f"{t['kill rank 1, watchdog 5 s']:.2f} s",
             f"{t['kill rank 1, no watchdog']:.2f} s (gloo sees the closed socket; Lightning's child observer)"],
            ["SIGSTOP rank 1 (frozen, sockets open: a lost node / hung device)",
             f"{t['freeze rank 1, watchdog 5 s']:.2f} s",
             f"{t['freeze rank 1, no watchdog']:.2f} s (the process-group timeout)"]]


grid("checkpoint.json", "table", checkpoint_rows, "lrrr", ["", "ours", "FSDP2 (Lightning)", "ours/FSDP2"],
     before="Measured on {on}:\n\n")
grid("checkpoint.json", "faults", checkpoint_faults, "lrr",
     ["fault (measured, same run)", "watchdog (fault_timeout 5 s)", "no watchdog"])


# ---------------------------------------- cp_modes_cpu.json

_CP_MODES = {"cp1": "cp 1", "allgather2": "allgather cp 2", "ulysses2": "ulysses cp 2", "allgather4": "allgather cp 4",
             "ulysses4": "ulysses cp 4", "hybrid2x2": "hybrid 2x2"}


def _at(mode: dict, tokens: int) -> dict | None:
    return next((x for x in mode["lengths"] if x["tokens"] == tokens), None)


def _reached(data: dict) -> int:
    """The longest row every mode ran."""
    return min(max(x["tokens"] for x in m["lengths"]) for m in data["modes"].values())


@renderer("cp_modes_cpu.json", "table")
def cp_modes_table(data: dict) -> str:
    tokens = _reached(data)
    at = {k: _at(m, tokens) for k, m in data["modes"].items()}
    one = at["cp1"]
    rows = [[_CP_MODES.get(k, k),
             f"{x['step_s']:.1f}" + ("" if k == "cp1" else f" ({one['step_s'] / x['step_s']:.2f})"),
             f"{max(x['cpu_s']):.1f}" + ("" if k == "cp1" else f" ({max(one['cpu_s']) / max(x['cpu_s']):.2f})"),
             f"{sum(x['cpu_s']):.1f}", f"{max(x['peak_rss_mib']):.0f}", f"{x['load_1min']:.1f}"] for k, x in at.items()]
    return f"Measured on {_machine_line(data)}:\n\n" + table([
        f"mode ({tokens >> 10}k tokens)", "step s (x cp 1)", "busiest rank CPU s (x cp 1)", "CPU s, all ranks",
        "peak RSS MiB / rank", "load average"], rows, "lrrrrr")


@renderer("cp_modes_cpu.json", "stopped")
def cp_modes_stopped(data: dict) -> str:
    modes = data["modes"]
    stopped = {k: m["stopped"] for k, m in modes.items() if m.get("stopped")}
    reached = _reached(data)
    guess = {k: float(re.search(r"~([\d.]+) s", v["skipped"])[1]) for k, v in stopped.items()}
    cp2 = [v for k, v in guess.items() if modes[k]["cp"] == 2]
    cp4_load = [_at(m, reached)["load_1min"] for m in modes.values() if m["cp"] == 4]
    first = {v["tokens"] for v in stopped.values()}
    return (f"Every mode reached {reached >> 10}k tokens (measured). "
            f"{'/'.join(f'{t >> 10}k' for t in sorted(first))} stopped at the {data['cap_s']:.0f} s step cap "
            f"(about {_range(cp2, '.0f')} s estimated by the benchmark at cp 2, about {guess['cp1']:.0f} s at cp 1), "
            f"not at memory; the load average was {_range(cp4_load, '.1f')} during the cp 4 {reached >> 10}k steps")


@renderer("cp_modes_cpu.json", "reading")
def cp_modes_reading(data: dict) -> str:
    modes, one, top = data["modes"], data["modes"]["cp1"], _reached(data)
    shorter = [x["tokens"] for x in one["lengths"] if x["tokens"] < top] or [top]
    gain = [_at(one, t)["step_s"] / _at(m, t)["step_s"] for t in shorter for m in modes.values() if m["cp"] == 2]
    extra = {cp: [sum(_at(m, top)["cpu_s"]) / sum(_at(one, top)["cpu_s"]) - 1 for m in modes.values()
                  if m["cp"] == cp] for cp in (2, 4)}
    limit = {k: round(m["projected_memory_limit_tokens"] / 1024) for k, m in modes.items()}
    rest = [v for k, v in limit.items() if k not in ("allgather4", "hybrid2x2", "allgather2")]
    return (f"At {' and '.join(f'{t >> 10}k' for t in shorter)}, cp 2 gave {_range(gain)}x in wall time (measured). "
            f"At {top >> 10}k the communication and the "
            f"split add {_pct(extra[2])} to the total CPU time at cp 2 and {_pct(extra[4])} at cp 4 (measured). "
            f"With the {data['projected_memory_limit'].split('reaching ')[1].split(' of')[0]} memory limit that the "
            f"benchmark applies, a straight line through the summed peaks projects (estimated, not run) the memory "
            f"bound at about {limit['allgather4']}k tokens for allgather cp 4, {limit['hybrid2x2']}k for hybrid, "
            f"{limit['allgather2']}k for allgather cp 2 and {_range(rest, '.0f')}k for the others")


quotes("cp_modes_cpu.json", {
    "machine": lambda d: (
        f"The runs were measured on the {d['machine']['cores']}-core {d['machine']['cpu']} machine "
        f"({d['machine']['l3']} L3) with gloo, {d['threads_per_rank']} thread per rank, load average "
        f"{d['load_average_before'][0]:.1f} before and {d['load_average_after'][0]:.1f} after (other jobs shared it)"),
    "wall": lambda d: f"{d['wall_s'] / 60:.0f} min of wall time, measured (`wall_s` in the JSON)"})


# ---------------------------------------- frozen_aware.json

_SOURCES = {"flops": "FLOP costs", "per_layer_loo": "leave-one-config-out", "seed_fitted": "seed-fitted profile"}


def _cfg(row: dict) -> str:
    return row["config"].removeprefix("MLLM-")


def _fa_sources(data: dict) -> list[str]:
    return [s for s in _SOURCES if s in data["seed_setting_rows"][0]]


@renderer("frozen_aware.json", "table")
def frozen_aware_table(data: dict) -> str:
    sources = _fa_sources(data)
    rows = [[r["config"], f"{r['seed_ratio']:.2f}x", *[c for s, x in ((s, r[s]) for s in sources) for c in (
        f"{x['aware_split']}/{x['forward-variance']['split']}", f"{x['forward-variance']['ratio']:.2f}x",
        "yes" if r["meets_seed"][s] else "NO")]] for r in data["seed_setting_rows"]]
    rows.append(["meets", "", *[c for s in sources for c in ("", "", data["meets_seed_speedup"][s])]])
    header = [h for s in sources for h in (f"{_SOURCES[s]}: a/u", "speedup (simulated)", "meets")]
    return table(["config", "seeds' speedup (published)", *header], rows, "lr" + "lrl" * len(sources))


@renderer("frozen_aware.json", "ratios")
def frozen_aware_ratios(data: dict) -> str:
    flops = [r["flops"]["aware_stages_ms"]["llm_bwd_ms"] / r["flops"]["aware_stages_ms"]["llm_fwd_ms"]
             for r in data["seed_setting_rows"]]
    p, back = data["seed_fitted_profile"], data["seed_fitted_profile"]["llm_backward_ratio"]
    return (f"FLOPs give a frozen LLM backward of {_range(flops, '.1f')}x its forward (computed; B_d ~ F plus one "
            f"recomputed F); the seeds' published times give {back['S']:.1f}x (LLM-S) and "
            f"{_range([back['M'], back['L']], '.1f')}x (LLM-M/L), and their encoders run at "
            f"{_range(p['encoder_forward'].values(), '.1f')}x their FLOP time while their LLM runs at "
            f"{_range(p['llm_forward'].values(), '.1f')}x (fitted)")


@renderer("frozen_aware.json", "retimed")
def frozen_aware_retimed(data: dict) -> str:
    rows = {_cfg(r): r for r in data["seed_setting_rows"]}
    extra = [pub - sim for r in rows.values()
             for pub, sim in zip((r["seed_aware_s"], r["seed_unaware_s"]), r["seed_layouts_simulated_s"])]
    lls = rows["LLS"]
    return ("The simulator over-predicts the seeds' ratios when it re-times their two inferred layouts (e.g. "
            + ", ".join(f"{k} {rows[k]['seed_layouts_simulated_ratio']:.2f}x simulated vs {rows[k]['seed_ratio']:.2f}x "
                        f"published" for k in ("SSS", "MMM"))
            + f"): their published iteration times carry {_range(extra, '.0f')} s that 1F1B over their per-stage "
            f"times does not explain (LLS: {lls['seed_layouts_simulated_s'][0]:.0f} s simulated vs "
            f"{lls['seed_aware_s']:.0f} s published)")


@renderer("frozen_aware.json", "free")
def frozen_aware_free(data: dict) -> str:
    plans = [p for r in data["rows"] for p in (r["aware_plan"], r["unaware_plan"])]
    dp = [int(re.search(r"dp(\d+)", p)[1]) for p in plans]
    llm = [int(re.search(r"l(\d+)$", p)[1]) for p in plans]
    gains = sorted(data["rows"], key=lambda r: -r["speedup"])[:2]
    return (f"with dp allowed the best layouts are dp {_range(dp, '.0f')} with {_range(llm, '.0f')} LLM stages for "
            f"both modes, and the gain stays {_range([r['speedup'] for r in data['rows']])}x ("
            + ", ".join(f"{r['config']} {r['speedup']:.2f}x" for r in gains) + "; simulated)")


def _faster(data: dict) -> list[dict]:
    return [r for r in data["seed_setting_rows"] if r["ours_vs_seed_aware_layout"] > 1.005]


quotes("frozen_aware.json", {
    "loo-mmm": lambda d: next(
        f"MMM gets {r['per_layer_loo']['forward-variance']['ratio']:.2f}x (simulated; seeds {r['seed_ratio']:.2f}x, "
        "published)" for r in d["seed_setting_rows"] if _cfg(r) == "MMM"),
    "seed-fitted-faster": lambda d: (
        f"faster on {len(_faster(d))} configs ("
        + ", ".join(f"{_cfg(r)} {r['ours_vs_seed_aware_layout']:.2f}x" for r in _faster(d)) + "; simulated)"),
    "auto-vs-hand": lambda d: "the free auto search beats the best 6-stage hand split by up to " + ", ".join(
        f"{max(r[s]['auto_vs_best_hand'] for r in d['seed_setting_rows']):.2f}x ({_SOURCES[s]})"
        for s in _fa_sources(d)) + ", simulated",
    "duration": lambda d: (f"{d['machine']['duration_s']:.0f} s of wall time measured on {_where(d)} (`duration_s` in "
                           "the JSON)")})


# ---------------------------------------- the others

quotes("quickstart_cpu.json", {
    "main-job": lambda d: (f"{d['main_job_s']:.0f} s of wall time (measured by `benchmarks/quickstart.py` on "
                           f"{_loaded(d)}; less on an idle machine)"),
    "make-data": lambda d: (f"`make_conversation_data.py` took {d['make_conversation_data_s']:.0f} s (measured by "
                            f"`benchmarks/quickstart.py` on {_loaded(d)})"),
    "scan": lambda d: (f"about {round(d['scan']['records_per_s'], -3):,.0f} records per second on one CPU core "
                       f"(measured by `benchmarks/quickstart.py` on {d['scan']['records']:,} copies of the example's "
                       f"records, {_loaded(d)})")})

quotes("encoder_cp_cpu.json", {
    "inline": lambda d: f"{d['speedup_cp2']:.2f}x measured on {_where(d)} with gloo",
    "sentence": lambda d: (f"takes {d['step_s']['cp1']:.3f} s at cp 1 and {d['step_s']['cp2']:.3f} s at cp 2 "
                           f"({d['speedup_cp2']:.2f}x; medians, measured on {_machine_line(d)})")})


def _image_steps(data: dict) -> dict:
    return {(r["vision"], r["cp"], r["shard_images"]): r["step_s_median"] for r in data["rows"]}


@renderer("callback_images_cpu.json", "sentence")
def callback_images_sentence(data: dict) -> str:
    by = _image_steps(data)
    split = {v: (by[(v, 2, True)], by[(v, 2, False)]) for v in ("frozen", "trained")}
    gain = [whole / part for part, whole in split.values()]
    vs_one = [by[(v, 1, True)] / by[(v, 2, True)] for v in ("frozen", "trained")]
    return (f"a cp 2 step takes {_range(gain, '.2f', 'x')} less time with the images split than with every image "
            f"on every rank, with the vision tower frozen ({split['frozen'][0]:.2f} vs {split['frozen'][1]:.2f} s) "
            f"or trained ({split['trained'][0]:.2f} vs {split['trained'][1]:.2f} s). The row is short, so cp 2 "
            f"itself is slower than one process there ({_range(vs_one, '.2f', 'x')})")


quotes("callback_images_cpu.json", {"inline": lambda d: (
    _range([_image_steps(d)[(v, 2, False)] / _image_steps(d)[(v, 2, True)] for v in ("frozen", "trained")], ".2f", "x")
    + f" faster than encoding every image on every rank, measured on {_where(d)}")})


# ---------------------------------------- per_module_dp.json, per_module_dp_cpu.json, moe_cpu.json

def _pm_rows(data: dict, scale: str | None = None) -> list[dict]:
    return [c["rows"]["per-module"] for c in data["cases"] if scale is None or c["scale"] == scale]


def _pm_at(data: dict) -> dict:
    return {c["model"]: c["rows"]["per-module"] for c in data["cases"] if c["scale"] == "8.1"}


grid("per_module_dp.json", "cases",
     lambda d: [dict(r, case=c, row=name) for c in d["cases"] for name, r in c["rows"].items()], "llllrlrrrrrrrr", [
         ("scale", "§{case[scale]}"), ("LLM", lambda r: r["case"]["model"].removeprefix("MLLM-")),
         ("setting", "{case[setting]}"), ("row", "{row}"), ("GPUs", "{gpus}"), ("dp x tp x pp", "{layout}"),
         ("iteration (s)", "{iteration_s:.2f}"), ("samples/s", "{samples_per_s:.1f}"), ("MFU", "{mfu:.1%}"),
         ("bubble", "{bubble:.1%}"), ("MFU x", "{mfu_vs_uniform:.2f}"), ("throughput x", "{throughput_vs_uniform:.2f}"),
         ("Eq. 1-2 (s)", _opt("estimate_s")), ("planning (ms)", _opt("planning_ms", ".0f"))],
     after="\n\nSimulated by {on} (planning: this CPU's wall time).")


@renderer("per_module_dp.json", "gains")
def per_module_dp_gains(data: dict) -> str:
    at, small = _pm_at(data), _pm_rows(data, "8.2.1")
    g = lambda m: f"{at[m]['mfu_vs_uniform']:.2f}x / {at[m]['throughput_vs_uniform']:.2f}x"  # noqa: E731
    return (f"At 1296 GPUs, simulated per-module gains over the rigid layout are {g('MLLM-9B')} (MFU / throughput, "
            f"9B), {g('MLLM-15B')} (15B) and {g('MLLM-72B')} (72B); at 98 GPUs they are "
            f"{_range([r['mfu_vs_uniform'] for r in small], '.2f', 'x')} MFU and "
            f"{_range([r['throughput_vs_uniform'] for r in small], '.2f', 'x')} throughput")


grid("per_module_dp.json", "equal-gpus",
     lambda d: [dict(r, case=c, pair=name) for c in d["cases"] for name, r in c.get("equal_gpus", {}).items()],
     "llllrllrrrl", [
         ("scale", "§{case[scale]}"), ("LLM", lambda r: r["case"]["model"].removeprefix("MLLM-")),
         ("setting", "{case[setting]}"), ("comparison", "{pair}"), ("GPUs", "{gpus}"), ("layout", "{layout}"),
         ("baseline layout", "{base_layout}"), ("MFU", "{mfu:.1%}"), ("baseline MFU", "{base_mfu:.1%}"),
         ("ratio", "{ratio:.3f}x"), ("fits", lambda r: "yes" if r["fits"] else "no (baseline over 80 GiB)")],
     after="\n\nSimulated by {on}. MFU over the GPUs given (idle ones count), so the ratio is both the MFU and "
           "the throughput ratio.")


@renderer("per_module_dp.json", "equal-gains")
def per_module_dp_equal_gains(data: dict) -> str:
    pairs = [c["equal_gpus"] for c in data["cases"] if "equal_gpus" in c]
    if not pairs:
        return "not measured at equal GPU counts"
    ratio = lambda k: [p[k]["ratio"] for p in pairs if p[k]["fits"]]  # noqa: E731
    below = sum(r < 1 for r in ratio("per-module vs flop-ratio"))
    return (f"at equal GPU counts, per-module dp runs {_range(ratio('per-module vs flop-ratio'), '.2f', 'x')} the "
            f"FLOP-ratio split's throughput (below it in {below} of {len(ratio('per-module vs flop-ratio'))} cases), "
            f"{_range(ratio('per-module vs uniform'), '.2f', 'x')} the uniform layout's, and the FLOP-ratio split "
            f"{_range(ratio('flop-ratio vs uniform'), '.2f', 'x')} the uniform layout's (simulated by "
            f"`benchmarks/per_module_dp.py` on {_where(data)}; cases whose baseline does not fit 80 GiB left out)")


grid("per_module_dp.json", "table-2", "table_2", "rrrrrrrrl", [
    ("GPUs", "{gpus}"), ("batch", "{batch}"), ("search (ms)", "{search_ms:.0f}"),
    ("min (ms)", _opt("search_ms_min", ".0f")), ("CPU (ms)", _opt("search_cpu_ms", ".0f")),
    ("load avg", _opt("load_average", ".1f")), ("published (ms)", "{published_ms:.0f}"),
    ("subproblems", "{subproblems}"), ("layout", "{layout}")],
     after="\n\nSearch times measured on {on}; layouts simulated.")


quotes("per_module_dp.json", {
    "mfu": lambda d: f"{_pct([r['mfu'] for r in _pm_rows(d)])} (simulated, the per-module rows)",
    "estimate": lambda d: "within {:.1%} of the simulated time in every row (computed from the table)".format(max(
        abs(r["estimate_s"] / r["iteration_s"] - 1) for c in d["cases"] for r in c["rows"].values()
        if "estimate_s" in r)),
    "replay": lambda d: next(
        f"the 72B at {t['gpus']} GPUs solves {t['subproblems']} inner problems (the subproblems column), and its "
        f"replay, one simulation, takes {t['replay_ms']:.0f} ms of the {t['search_ms']:.0f} (measured on "
        f"{_where(d)})" for t in [max(d["table_2"], key=lambda x: x["gpus"])]),
    "search-goal": lambda d: next(
        f"the 72B search at {t['gpus']} GPUs took {t['search_ms']:.0f} ms of wall time (median; minimum "
        f"{t['search_ms_min']:.0f} ms) and {t['search_cpu_ms']:.0f} ms of CPU time at load average "
        f"{t['load_average']:.1f} on {_where(d)}: the 100 ms goal is "
        f"{'met' if t['search_ms'] <= 100 else 'missed'} in wall time and "
        f"{'met' if t['search_cpu_ms'] <= 100 else 'missed'} in CPU time"
        for t in [max(d["table_2"], key=lambda x: x["gpus"])] if "search_cpu_ms" in t) if any(
        "search_cpu_ms" in t for t in d["table_2"]) else "not measured in CPU time",
    "search-1296": lambda d: (f"{_pm_at(d)['MLLM-9B']['planning_ms']:.0f}, {_pm_at(d)['MLLM-15B']['planning_ms']:.0f} "
                              f"and {_pm_at(d)['MLLM-72B']['planning_ms']:.0f} ms (measured on {_where(d)})")})


grid("per_module_dp_cpu.json", "table", "rows", "lrrrrl", [
    ("layout", "{layout}"), ("step (s)", "{step_s:.3f}"), ("busiest rank CPU (s)", "{busiest_cpu_s:.3f}"),
    ("step vs uniform", "{step_speedup:.2f}x"), ("busiest CPU vs uniform", "{busiest_cpu_speedup:.2f}x"),
    ("CPU s per rank", lambda r: ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s_per_rank"].items()))],
     after="\n\nMeasured on {on}.")
grid("moe_cpu.json", "table", "rows", "lrrrrrrl", [
    ("layout", "{layout}"), ("step (s)", "{step_s:.3f}"),
    ("tokens/s", _opt("tokens_per_s", ".0f", "nan")),
    ("busiest rank CPU (s)", "{busiest_cpu_s:.3f}"), ("step vs dp", "{step_vs_ep1:.2f}x"),
    ("expert weights per rank (MiB)", lambda r: f"{r['expert_bytes_per_rank'] / MIB:.2f}"),
    ("all weights per rank (MiB)", lambda r: f"{r['param_bytes_per_rank'] / MIB:.2f}"),
    ("expert load max/mean per layer", lambda r: ", ".join(f"{v:.2f}" for v in r["expert_imbalance_per_layer"] or []))],
     after=lambda d: (
         f"\n\nMeasured on {d['settings']['world']} gloo processes (one thread each; {d['settings']['steps']} timed "
         f"steps of {d['settings']['batch']} samples) on {_machine_line(d)}. The machine is shared and loaded: wall "
         "times include waiting for the other rank and other jobs; the busiest rank's CPU seconds are its own work."
         + "".join(f" {r['layout']}: {r['all_to_all_bytes_measured'] / MIB:.3f} MiB sent to other ranks by the "
                   f"expert all-to-alls per rank and step, measured from the dispatch split sizes, against "
                   f"{r['all_to_all_bytes_model'] / MIB:.3f} MiB from the planner's byte model on the same "
                   f"tokens (uniform routing)." for r in d["rows"] if r.get("all_to_all_bytes_model"))))
grid("moe_cpu.json", "simulated", lambda d: d["simulated"]["rows"], "rrrrrrr", [
    ("ep", "{ep}"), ("all-to-all GB/s (assumed)", "{ep_bandwidth_GBps:.0f}"),
    ("GiB per rank", "{memory_GiB_per_rank:.1f}"),
    ("iteration (s)", "{iteration_s:.3f}"),
    ("all-to-all MB per rank, routed layer and microbatch", _opt("all_to_all_MB_per_layer_microbatch", ".1f", "nan")),
    ("all-to-all per microbatch and stage (ms)", lambda r: f"{r['all_to_all_s_per_microbatch_stage'] * 1e3:.1f}"),
    ("forward + backward per microbatch and stage (ms)",
     lambda r: f"{r['forward_backward_s_per_microbatch_stage'] * 1e3:.1f}")],
     after=lambda d: (
         "\n\nSimulated by the planner (`evaluate_plan`; no model built): Qwen3-30B-A3B shapes, dp "
         "{dp} x pp {pp}, {microbatches} microbatches of {tokens_per_microbatch} tokens, ".format_map(d["simulated"])
         + f"{d['simulated']['assumed_flops_per_device'] / 1e12:.0f} TFLOP/s per device assumed, 16 bytes of state per "
         "parameter, activations not counted."))


# ---------------------------------------- gdn_cpu.json (gdn.py)

def _gdn_pairs(data: dict) -> list[dict]:
    by = {(r["layer"], r["tokens"]): r for r in data["rows"]}
    return [{"tokens": n, "gdn": by[("linear_attention", n)], "attn": by[("full_attention", n)]}
            for n in sorted({r["tokens"] for r in data["rows"]})]


@renderer("gdn_cpu.json", "crossover")
def gdn_crossover(data: dict) -> str:
    longer = [r["tokens"] for r in _gdn_pairs(data) if r["attn"]["step_s"] > r["gdn"]["step_s"]]
    if not longer:  # short lengths only (a quick run): no crossover, and no length to fit at
        return "the attention layer never took longer than the GDN layer (measured)"
    fit = max(abs(r["fitted_s"] / r["step_s"] - 1) for r in data["rows"] if r["tokens"] == max(longer))
    return (f"the attention layer took longer than the GDN layer from {min(longer)} tokens on (measured), and at "
            f"{max(longer)} tokens the fitted model is within {100 * fit:.0f}% of both")


grid("gdn_cpu.json", "layers", _gdn_pairs, "rrrrrr", [
    ("tokens", "{tokens}"), ("GDN layer (s)", lambda r: f"{r['gdn']['step_s']:.3f}"),
    ("GDN fitted (s)", lambda r: f"{r['gdn']['fitted_s']:.3f}"),
    ("attention layer (s)", lambda r: f"{r['attn']['step_s']:.3f}"),
    ("attention fitted (s)", lambda r: f"{r['attn']['fitted_s']:.3f}"),
    ("attention / GDN", lambda r: f"{r['attn']['step_s'] / r['gdn']['step_s']:.2f}")],
     before=lambda d: f"Measured on {_machine_line(d)} (forward + backward of one sequence, median of "
                      f"{d['settings']['repeats']}, hidden {d['settings']['hidden']}, "
                      f"{d['settings']['threads']} thread); fitted: the planner's FLOPs x one least-squares "
                      "constant per layer type:\n\n")
grid("gdn_cpu.json", "simulated", lambda d: d["simulated"]["rows"], "rrrrrrr", [
    ("cp", "{cp}"), ("step (s)", "{step_s:.3f}"), ("speedup", "{speedup:.2f}x"),
    ("CP comm (s)", "{cp_comm_s:.3f}"), ("GDN layer MB", "{gdn_layer_MB:.0f}"),
    ("attention layer MB", "{attention_layer_MB:.0f}"),
    ("step, attention's bytes at every layer (s)", "{step_s_attention_bytes_everywhere:.3f}")],
     before=lambda d: (
         "Simulated by the planner (`evaluate_plan`, no model run): a Qwen3.5-9B-like text model (hidden "
         "{hidden_size}, {num_hidden_layers} layers, attention {num_attention_heads} query / {num_key_value_heads} KV "
         "heads of {head_dim}, GDN {linear_num_key_heads} key heads / {linear_num_value_heads} value heads of "
         "{linear_key_head_dim}; our assumption of its shapes) ".format_map(d["simulated"]["model"])
         + "with {pattern}, one microbatch of {tokens} tokens, {cp_mode}, ".format_map(d["simulated"])
         + f"{d['simulated']['assumed_flops_per_device'] / 1e12:.0f} TFLOP/s per device and "
         f"{d['simulated']['cp_bandwidth_GBps']:.0f} GB/s of CP bandwidth per rank assumed; MB per rank, layer and "
         "forward:\n\n"))

# ---------------------------------------- oobleck.json, oobleck_measured.json (oobleck.py [--measured])

grid("oobleck.json", "throughput", lambda d: [dict(m["cells"][f], freq=f, model=n) for f in ("6h", "1h", "10m")
                                              for n, m in d["throughput"].items()], "llrrrrr", [
    ("failure every", "{freq}"), ("model", "{model}"), ("re-forming (sim.)", "{oobleck:.2f}"),
    ("identical groups (sim.)", "{identical:.2f}"), ("checkpoint-restart (sim.)", "{checkpoint:.2f}"),
    ("Oobleck (seed)", "{seed_oobleck:.2f}"), ("Varuna (seed)", "{seed_varuna:.2f}")])


grid("oobleck.json", "planning", "planning", "rrrrrrrrr", [
    ("nodes", "{nodes}"), ("GPUs per node", "{gpus_per_node}"), ("layers", "{layers}"),
    ("this planner (s, measured)", "{seconds:.3g}"), ("CPU (s)", _opt("cpu_seconds", ".3g")),
    ("load avg", _opt("load_average", ".1f")), ("seed (s)", "{seed_seconds:,.2f}"),
    ("faster", "{speedup:,.1f}x"),
    ("faster in CPU time", lambda r: f"{r['speedup_cpu']:,.1f}x" if "speedup_cpu" in r else "")],
     after="\n\nMeasured on {on} (this planner: median of the repeats' wall and CPU times; the load average at each "
           "cell in the table).")


def _oobleck_goal(d: dict) -> str:
    worst = min(d["planning"], key=lambda r: r["speedup"])
    cpu = min(d["planning"], key=lambda r: r.get("speedup_cpu", r["speedup"]))
    met = lambda x: "meets" if x >= 10 else "misses"  # noqa: E731
    text = (f"the least gain is {worst['speedup']:,.1f}x in wall time ({worst['nodes']} nodes x "
            f"{worst['gpus_per_node']} GPUs, {worst['layers']} layers), which {met(worst['speedup'])} the goal of 10x")
    if "speedup_cpu" in cpu:
        text += (f"; in CPU time the least is {cpu['speedup_cpu']:,.1f}x ({cpu['nodes']} x {cpu['gpus_per_node']}, "
                 f"{cpu['layers']} layers), which {met(cpu['speedup_cpu'])} it")
    return text + f" (measured on {_where(d)})"


quotes("oobleck.json", {"speedup": lambda d: _range([r["speedup"] for r in d["planning"]], ",.1f", "x"),
                        "goal": _oobleck_goal})

_MEASURED_NAMES = {"reforming": "re-forming (group 0 loses a node, re-forms at the 1-node template)",
                   "identical": "identical groups (group 0 loses a rank, stays down)",
                   "checkpoint_restart": "checkpoint-restart (one 4-rank job, checkpoint every {save} steps)"}


@renderer("oobleck_measured.json", "table")
def oobleck_measured(data: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    rows = []
    for name, label in _MEASURED_NAMES.items():
        r = data["runs"].get(name)
        if r is None:
            continue
        rate = " / ".join(f"{f(r[f'steps_per_s_{k}'])} ({f(r[f'samples_per_s_{k}'], '.1f')})"
                          for k in ("before", "during", "after"))
        if name == "reforming":
            heal = (f"healed by name in {f(r.get('heal_s'))} s (restart {r.get('restart')}, at step "
                    f"{r.get('healed_at_step')}); kill -> re-formed rank up "
                    f"{f(r.get('kill_to_reformed_process_start_s'), '.1f')} s")
        elif name == "checkpoint_restart":
            heal = (f"resumed from {r.get('resumed_from')}; kill -> step {r['kill']['step'] + 1} committed again "
                    f"{f(r.get('kill_to_killed_step_committed_s'), '.1f')} s")
        else:
            heal = "the lost group never returns"
        rows.append([label.format(save=data["settings"]["save_every"]), rate, f(r["kill_to_first_commit_s"], ".1f"),
                     f(r.get("kill_to_recovered_s"), ".1f"), heal])
    s = data["settings"]
    head = ["run", "committed steps/s (samples/s) before / during / after", "kill -> next commit (s)",
            "kill -> recovered (s)", "recovery"]
    return (table(head, rows, "lrrrl") + f"\n\nMeasured with CPU processes (gloo), {s['steps']} steps, global batch "
            f"{s['global_batch']}, the kill inside step {s['kill_step'] + 1}, on {_machine_line(data)}.")


# ---------------------------------------- driver

def render(json_path: str, name: str, cache: dict) -> str:
    if (json_path, name) not in RENDERERS:
        raise KeyError(f"no table {name!r} for {json_path} (known: {sorted(RENDERERS)})")
    if json_path not in cache:
        cache[json_path] = json.loads((ROOT / json_path).read_text())
    return RENDERERS[(json_path, name)](cache[json_path])


def show(json_name: str, data: dict) -> str:
    """Every quote of ``benchmarks/results/<json_name>`` rendered from ``data`` (those it has the figures for)."""
    out = []
    for (path, name), fn in RENDERERS.items():
        if Path(path).name == json_name:
            try:
                out.append(fn(data))
            except (KeyError, IndexError, StopIteration, TypeError, ValueError, ZeroDivisionError, OSError):
                pass  # a partial run (--only ...) lacks what this quote needs
    return "\n\n".join(out)


def regenerate(text: str, cache: dict | None = None) -> tuple[str, list[str]]:
    """``text`` with every quote regenerated, and the quotes that changed."""
    cache, changed = {} if cache is None else cache, []

    def sub(match) -> str:
        body = render(match["json"], match["name"], cache)
        if match["body"].startswith("\n"):  # a block: keep the blank-line layout around it
            body = "\n" + body + "\n"
        if body != match["body"]:
            changed.append(f"{match['json']}:{match['name']}")
        return f"<!-- results:{match['json']}:{match['name']} -->{body}<!-- /results -->"

    return MARKER.sub(sub, text), changed


def main(argv: list[str] | None = None) -> int:
    args = harness.cli(__doc__, argv, check=(False, "fail when a quoted figure disagrees with its JSON"), quiet=False)
    cache, stale = {}, []
    for doc in DOCUMENTS:
        new, changed = regenerate((ROOT / doc).read_text(), cache)
        stale += [f"{doc}: {c}" for c in changed]
        if changed and not args.check:
            (ROOT / doc).write_text(new)
    if args.check and stale:
        print("quoted figures that disagree with their results JSON (run python benchmarks/tables.py):")
        print("\n".join("  " + s for s in stale))
        return 1
    if not args.quiet:
        print("\n".join(f"regenerated {s}" for s in stale) or "every quoted figure agrees with its JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
