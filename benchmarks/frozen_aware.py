"""Frozen-aware vs forward-only (frozen-unaware) planning on the seeds' MLLM configurations.

Per-layer costs come from FLOP counts of the seeds' model table (003 Table 3.1: layers, hidden, params) on
the seeds' data (1k text tokens + one 1280x720 image + one 2-minute audio clip per sample, microbatch 4,
global batch 48 -> 12 microbatches, 24 A40-48GB devices). Encoders and LLM frozen, projectors trainable,
activation recomputation on.

Headline table (the seeds' Table 3.2 setting, 003 sec. 3.5.3): ONE pipeline of a fixed 6 stages (24 GPUs,
each stage a TP2 x CP2 group of 4 GPUs, modelled as 4x the FLOP/s and memory of one GPU), encoders
colocated (merged module, each encoder cut into the same number of stages and fused stage-wise). Both modes
choose how many of the 6 stages go to the encoders and to the LLM and where the boundaries lie: the
frozen-unaware mode believing backward = 2 x forward for every layer, the frozen-aware mode with Eq. 3.1-3.3.
Both chosen layouts run the same frozen-aware execution (frozen layers skip their gradients) and are timed
by the simulator. Printed beside the seeds' ratios, with per-stage forward/backward times beside the seeds'.

Second table (the previous benchmark, kept): each mode searches its own dp / stage counts / placement on 24
single-GPU devices, and the auto search is compared with a grid of hand plans.

    python benchmarks/frozen_aware.py [--skip-free] [--no-recompute] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from lightning_mm.parallel.schedule import build_stage_graph
from lightning_mm.planner import (
    ModuleSpec,
    ModuleTimes,
    chrome_trace,
    evaluate_plan,
    mllm_layer_costs,
    partition_module,
    plan_summary,
    search,
    simulate_1f1b,
    timeline_png,
)

# 003 Table 3.1: (layers, hidden, parameters)
LLAMA3 = {"S": (16, 2048, 1.0e9), "M": (32, 4096, 8.0e9), "L": (64, 5120, 32.0e9)}
QWEN2_VISION = {"S": (32, 1280, 0.6e9), "M": (48, 2560, 3.9e9), "L": (64, 3840, 11.6e9)}
PHI4_AUDIO = {"S": (24, 1024, 0.5e9), "M": (32, 3072, 3.4e9), "L": (48, 5120, 12.4e9)}
# 003 Table 3.2 (sec. 3.5.3), MLLM-<vision><audio><LLM>, per mode (aware, unaware): per-stage forward ms of
# the encoder and LLM stages, per-stage backward ms of the encoder and LLM stages, iteration time s.
SEED_TABLE_3_2 = {
    "SSS": ((301.61, 149.40, 1.04, 518.43, 21.81), (207.13, 296.25, 0.86, 1032.63, 25.67)),
    "MMS": ((903.86, 102.61, 2.72, 346.54, 40.34), (635.56, 297.62, 1.19, 1032.12, 41.21)),
    "LLS": ((1240.50, 298.37, 1.41, 1029.98, 66.14), (1259.13, 297.92, 1.15, 1030.14, 66.20)),
    "SSM": ((464.98, 331.43, 3.53, 3017.01, 66.56), (388.33, 388.73, 2.30, 4030.74, 73.94)),
    "MMM": ((2330.90, 273.89, 2.09, 2418.27, 70.37), (712.72, 1159.76, 1.60, 12113.67, 173.01)),
    "LLM": ((2199.91, 376.11, 4.15, 4023.22, 87.43), (1403.97, 1161.76, 1.56, 12109.73, 177.39)),
    "SSL": ((773.10, 741.17, 3.55, 6309.11, 138.45), (774.19, 708.62, 3.84, 6306.18, 137.62)),
    "MML": ((2280.58, 705.73, 3.11, 6311.23, 138.97), (1015.60, 1154.85, 2.78, 10546.34, 180.28)),
    "LLL": ((5316.08, 736.05, 4.00, 6315.46, 143.76), (1597.36, 1686.28, 3.06, 15878.58, 247.79)),
}
# Encoder + LLM stages (aware, unaware) INFERRED from Table 3.2's per-stage forward times: the LLM's per-stage
# forward x its stage count ~ its whole forward (e.g. LLM-L 1686 ms ~ 32 of 64 layers, 736 ms ~ 13 layers;
# LLM-M 1160 ms ~ all 32 layers, 274 ms ~ 8 layers); 6 stages in all. Not stated by the seeds.
SEED_INFERRED_SPLITS = {"SSS": ((4, 2), (5, 1)), "MMM": ((2, 4), (5, 1)), "LLL": ((1, 5), (4, 2)),
                        "LLS": ((5, 1), (5, 1)), "SSL": ((1, 5), (1, 5))}
SEED_STAGES = 6  # inferred (see docs/planner.md): 24 GPUs / (TP2 x CP2); "a maximum of 6 pipeline stages" (001)
STAGE_GPUS = 4

TEXT_TOKENS = 1000
VISION_PATCHES = (1288 // 14) * (728 // 14)  # Qwen2-VL resizes to multiples of 28: 92 x 52 patches of 14 px
VISION_MERGE = 4  # 2x2 patch merge before the LLM
AUDIO_TOKENS = 1500  # Phi-4 audio: 120 s at 80 ms per token
SAMPLES_PER_MICROBATCH = 4
EFFECTIVE_FLOPS = 0.45 * 149.7e12  # A40 bf16 dense peak at 45% MFU
LINK_BYTES_PER_S = 25e9  # 200 Gb/s InfiniBand
MEMORY_LIMIT = 48e9
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # Korthikanti et al., flash attention, bf16
CHECKPOINT_BYTES_PER_TOKEN_HIDDEN = 2  # with activation recomputation a layer keeps only its bf16 input
RECOMPUTE = True  # the seeds train with activation checkpointing (003 Fig. 3.1)


def transformer_layer_times(tokens: int, hidden: int, params_per_layer: float, causal: bool,
                            gpus: int = 1) -> tuple[float, float, float]:
    """(forward, input-grad, weight-grad) seconds of one layer on one microbatch, from FLOPs per sample, on a
    stage of `gpus` devices (ideal TP/CP scaling)."""
    attention = (2 if causal else 4) * tokens * tokens * hidden
    dense = 2 * tokens * params_per_layer
    per_sample = (dense + attention, dense + 2 * attention, dense)
    return tuple(SAMPLES_PER_MICROBATCH * f / (gpus * EFFECTIVE_FLOPS) for f in per_sample)


def _bytes_per_token_hidden() -> int:
    return CHECKPOINT_BYTES_PER_TOKEN_HIDDEN if RECOMPUTE else ACTIVATION_BYTES_PER_TOKEN_HIDDEN


def encoder_module(table, size: str, enc_tokens: int, llm_tokens: int, in_features_factor: int, llm_hidden: int,
                   gpus: int = 1):
    """A frozen encoder of `table[size]` plus a trainable 2-layer MLP projector as its last layer."""
    layers, hidden, params = table[size]
    f, d, w = transformer_layer_times(enc_tokens, hidden, params / layers, causal=False, gpus=gpus)
    proj_params = in_features_factor * hidden * llm_hidden + llm_hidden * llm_hidden
    pf = SAMPLES_PER_MICROBATCH * 2 * llm_tokens * proj_params / (gpus * EFFECTIVE_FLOPS)
    times = ModuleTimes([f] * layers + [pf], [d] * layers + [pf], [w] * layers + [pf], [True] * layers + [False])
    param_bytes = [2.0 * params / layers] * layers + [16.0 * proj_params]
    act = SAMPLES_PER_MICROBATCH * _bytes_per_token_hidden()
    activations = [act * enc_tokens * hidden] * layers + [act * llm_tokens * llm_hidden]
    return times, param_bytes, activations


def mllm_modules(vision: str | None, audio: str | None, llm: str, gpus: int = 1,
                 llm_backward_ratio: float | None = None) -> tuple[dict[str, ModuleSpec], float]:
    """Planner input for one configuration and its P2P latency (one microbatch of LLM hidden states).
    `gpus`: devices per stage. `llm_backward_ratio` (a what-if, not the default): replace every LLM layer's
    backward (B_d + recomputed F from FLOPs) by this multiple of its forward."""
    layers, hidden, params = LLAMA3[llm]
    llm_tokens = TEXT_TOKENS
    raw = {}
    if vision:
        raw["vision"] = encoder_module(QWEN2_VISION, vision, VISION_PATCHES, VISION_PATCHES // VISION_MERGE, VISION_MERGE, hidden, gpus)
        llm_tokens += VISION_PATCHES // VISION_MERGE
    if audio:
        raw["audio"] = encoder_module(PHI4_AUDIO, audio, AUDIO_TOKENS, AUDIO_TOKENS, 1, hidden, gpus)
        llm_tokens += AUDIO_TOKENS
    f, d, w = transformer_layer_times(llm_tokens, hidden, params / layers, causal=True, gpus=gpus)
    llm_times = ModuleTimes([f] * layers, [d] * layers, [w] * layers, True)
    costs = mllm_layer_costs({name: r[0] for name, r in raw.items()}, llm_times, recompute=RECOMPUTE)
    if llm_backward_ratio is not None:
        costs["language_model"] = [replace(c, backward=llm_backward_ratio * c.forward) for c in costs["language_model"]]
    modules = {name: ModuleSpec(costs[name], r[1], r[2]) for name, r in raw.items()}
    llm_act = SAMPLES_PER_MICROBATCH * _bytes_per_token_hidden() * llm_tokens * hidden
    modules["language_model"] = ModuleSpec(costs["language_model"], 2.0 * params / layers, llm_act)
    latency = SAMPLES_PER_MICROBATCH * llm_tokens * hidden * 2 / LINK_BYTES_PER_S
    return modules, latency


def stage_breakdown(plan) -> dict[str, float]:
    """The seeds' Table 3.2 columns for one plan, in ms: the slowest encoder / LLM stage's forward and backward."""
    def worst(kind, llm):
        values = [v for st, v in getattr(plan, kind).items() if (st.startswith("language_model")) == llm]
        return 1e3 * max(values) if values else 0.0
    return {"enc_fwd_ms": worst("forward", False), "llm_fwd_ms": worst("forward", True),
            "enc_bwd_ms": worst("backward", False), "llm_bwd_ms": worst("backward", True)}


def split(plan) -> str:
    """Encoder stages + LLM stages, e.g. '2+4' (colocated: the merged encoder module's stage count)."""
    pp = plan.pp()
    enc = [n for m, n in pp.items() if m != "language_model"]
    enc_stages = (enc[0] if enc else 0) if plan.placement == "colocated" else sum(enc)
    return f"{enc_stages}+{pp['language_model']}"


def seed_setting_row(key: str, stages: int, out: Path | None) -> dict:
    """003 Table 3.2 setting for MLLM-<key>: fixed `stages` colocated stages of STAGE_GPUS devices, dp 1."""
    memory = STAGE_GPUS * MEMORY_LIMIT
    kwargs = dict(placements=("colocated",), data_parallel=False, stages=stages)
    modules, latency = mllm_modules(key[0], key[1], key[2], gpus=STAGE_GPUS)
    aware = search(modules, stages, 12, memory, latency, **kwargs).best
    unaware = search(modules, stages, 12, memory, latency, mode="forward-only", **kwargs).best
    seed_aware, seed_unaware = SEED_TABLE_3_2[key]
    # what-if: the seeds' own measured LLM backward/forward ratio (aware row) instead of FLOPs (B_d + recompute)
    seed_ratio = seed_aware[3] / seed_aware[1]
    w_modules, _ = mllm_modules(key[0], key[1], key[2], gpus=STAGE_GPUS, llm_backward_ratio=seed_ratio)
    w_aware = search(w_modules, stages, 12, memory, latency, **kwargs).best
    w_unaware = search(w_modules, stages, 12, memory, latency, mode="forward-only", **kwargs).best
    # auto (the free search: dp, stage counts <= `stages`, parallel or colocated) vs every hand split of `stages`
    auto = search(modules, stages, 12, memory, latency).best
    hands = [p for p in search(modules, stages, 12, memory, latency, data_parallel=False, stages=stages,
                               placements=("colocated", "parallel")).candidates if p.fits_memory]
    best_hand = min(hands, key=lambda p: p.iteration_time)
    if out is not None and key == "MMM":
        for tag, plan in (("aware", aware), ("unaware", unaware)):
            timeline_png(plan.result, out / f"frozen_aware_seedsetting_{key}_{tag}.png", title=f"MLLM-{key} {tag}: {split(plan)}")
            chrome_trace(plan.result, out / f"frozen_aware_seedsetting_{key}_{tag}.trace.json")
    llm_costs = modules["language_model"].costs
    return {
        "config": f"MLLM-{key}",
        "aware_s": aware.iteration_time, "unaware_s": unaware.iteration_time,
        "ratio": unaware.iteration_time / aware.iteration_time,
        "seed_aware_s": seed_aware[4], "seed_unaware_s": seed_unaware[4], "seed_ratio": seed_unaware[4] / seed_aware[4],
        "aware_split": split(aware), "unaware_split": split(unaware),
        "aware_layers": aware.layers, "unaware_layers": unaware.layers,
        "aware_stages_ms": stage_breakdown(aware), "unaware_stages_ms": stage_breakdown(unaware),
        "seed_aware_stages_ms": dict(zip(("enc_fwd_ms", "llm_fwd_ms", "enc_bwd_ms", "llm_bwd_ms"), seed_aware[:4])),
        "seed_unaware_stages_ms": dict(zip(("enc_fwd_ms", "llm_fwd_ms", "enc_bwd_ms", "llm_bwd_ms"), seed_unaware[:4])),
        "llm_bwd_over_fwd": sum(c.backward for c in llm_costs) / sum(c.forward for c in llm_costs),
        "seed_llm_bwd_over_fwd": seed_ratio,
        "enc_over_llm_forward": sum(c.forward for m, sp in modules.items() if m != "language_model" for c in sp.costs)
        / sum(c.forward for c in llm_costs),
        "whatif_seed_bwd_ratio": w_unaware.iteration_time / w_aware.iteration_time,
        "whatif_aware_split": split(w_aware), "whatif_unaware_split": split(w_unaware),
        "auto_s": auto.iteration_time, "auto_plan": describe(auto),
        "best_hand_s": best_hand.iteration_time, "best_hand_plan": f"{best_hand.placement[:3]} {split(best_hand)}",
        "hand_plans": len(hands), "auto_vs_best_hand": best_hand.iteration_time / auto.iteration_time,
        "aware_summary": plan_summary(aware), "unaware_summary": plan_summary(unaware),
    }


def print_seed_setting(rows, stages: int) -> bool:
    print(f"003 Table 3.2 setting: one pipeline of {stages} stages x {STAGE_GPUS} GPUs, encoders colocated, 12 microbatches"
          " of 4 samples, recompute; FLOP costs")
    header = (f"{'config':<10} {'aware s':>8} {'unaware s':>9} {'ours':>6} {'seeds':>6} {'meets':>5} {'split a/u':>9} "
              f"{'ours aware: encF llmF llmB ms':>30} {'seeds aware':>24} {'ours unaware':>24} {'seeds unaware':>24} "
              f"{'B/F llm':>11} {'E/L fwd':>7} {'what-if':>7} {'auto/hand':>9}")
    print(header)
    print("-" * len(header))
    ms = lambda d: f"{d['enc_fwd_ms']:>7.0f} {d['llm_fwd_ms']:>7.0f} {d['llm_bwd_ms']:>8.0f}"  # noqa: E731
    for r in rows:
        r["meets_seed"] = r["ratio"] >= r["seed_ratio"] - 0.005
        print(f"{r['config']:<10} {r['aware_s']:>8.2f} {r['unaware_s']:>9.2f} {r['ratio']:>5.2f}x {r['seed_ratio']:>5.2f}x "
              f"{'yes' if r['meets_seed'] else 'NO':>5} {r['aware_split'] + '/' + r['unaware_split']:>9} "
              f"{ms(r['aware_stages_ms']):>30} {ms(r['seed_aware_stages_ms']):>24} {ms(r['unaware_stages_ms']):>24} "
              f"{ms(r['seed_unaware_stages_ms']):>24} {r['llm_bwd_over_fwd']:>4.1f}/{r['seed_llm_bwd_over_fwd']:<5.1f} "
              f"{r['enc_over_llm_forward']:>7.2f} {r['whatif_seed_bwd_ratio']:>6.2f}x {r['auto_vs_best_hand']:>8.2f}x")
    print("ours/seeds = unaware / aware iteration time; split a/u = encoder+LLM stages chosen aware / unaware; per-stage"
          " columns = slowest encoder stage forward, slowest LLM stage forward and backward (ms, one microbatch);"
          " B/F llm = LLM backward/forward ours (FLOPs: B_d + recompute) / seeds' (Table 3.2 aware row); E/L fwd ="
          " total encoder / LLM forward (FLOPs); what-if = our ratio with the seeds' B/F put in place of ours;"
          " auto/hand = best hand split of the same stages / free auto search (>= 1: auto never loses)")
    meets = all(r["meets_seed"] for r in rows)
    never_loses = all(r["auto_vs_best_hand"] >= 1 - 1e-9 for r in rows)
    print(f"goal 'match the seeds' speedups': {'HOLDS' if meets else 'DOES NOT HOLD'} "
          f"({sum(r['meets_seed'] for r in rows)}/{len(rows)} configs); 'auto never loses to a hand plan': "
          f"{'HOLDS' if never_loses else 'DOES NOT HOLD'}")
    return meets and never_loses


def seed_stage_times_in_simulator() -> list[dict]:
    """Our 1F1B simulator fed with the seeds' own per-stage times (Table 3.2) on the inferred splits: separates
    what the schedule model predicts from what the FLOP cost model predicts."""
    rows = []
    for key, splits in SEED_INFERRED_SPLITS.items():
        times = []
        for (enc, llm), row in zip(splits, SEED_TABLE_3_2[key]):
            trainable = {**{f"encoders.{i}": i == enc - 1 for i in range(enc)}, **{f"language_model.{i}": False for i in range(llm)}}
            graph = build_stage_graph({"vision": enc, "audio": enc}, llm, "colocated", trainable)
            fwd = {**{f"encoders.{i}": row[0] for i in range(enc)}, **{f"language_model.{i}": row[1] for i in range(llm)}}
            bwd = {**{f"encoders.{i}": row[2] if i == enc - 1 else 0.0 for i in range(enc)},
                   **{f"language_model.{i}": row[3] for i in range(llm)}}
            times.append(simulate_1f1b(graph, 12, fwd, bwd).iteration_time / 1e3)
        aware, unaware = SEED_TABLE_3_2[key][0][4], SEED_TABLE_3_2[key][1][4]
        rows.append({"config": f"MLLM-{key}", "splits_aware_unaware": splits, "sim_aware_s": times[0],
                     "sim_unaware_s": times[1], "sim_ratio": times[1] / times[0], "seed_aware_s": aware,
                     "seed_unaware_s": unaware, "seed_ratio": unaware / aware})
    print("Seeds' per-stage times (Table 3.2) in our simulator, splits inferred (enc+LLM aware / unaware):")
    for r in rows:
        (ea, la), (eu, lu) = r["splits_aware_unaware"]
        print(f"  {r['config']:<10} {ea}+{la}/{eu}+{lu}  simulated {r['sim_aware_s']:6.1f} s / {r['sim_unaware_s']:6.1f} s ="
              f" {r['sim_ratio']:.2f}x   seeds measured {r['seed_aware_s']:6.1f} s / {r['seed_unaware_s']:6.1f} s = {r['seed_ratio']:.2f}x")
    return rows


def hand_plans(modules, devices: int, microbatches: int, latency: float):
    """The plans a person would try: dp dividing the microbatches, LLM pp in {1,2,4,6,8}, encoder pp in
    {1,2,4}, parallel and colocated, frozen-aware boundaries."""
    encoders = [m for m in modules if m != "language_model"]
    plans = []
    for dp, lp in itertools.product([d for d in (1, 2, 3, 4, 6, 12) if microbatches % d == 0], (1, 2, 4, 6, 8)):
        for counts in itertools.product((1, 2, 4), repeat=len(encoders)):
            for placement in ("parallel", "colocated"):
                if placement == "colocated" and len(set(counts)) > 1:
                    continue
                stages = lp + (sum(counts) if placement == "parallel" else (counts[0] if counts else 0))
                if stages * dp > devices:
                    continue
                layers = {e: partition_module(modules[e].costs, c) for e, c in zip(encoders, counts)}
                layers["language_model"] = partition_module(modules["language_model"].costs, lp)
                plans.append(evaluate_plan(modules, layers, placement, microbatches, dp, latency, MEMORY_LIMIT))
    return [p for p in plans if p.fits_memory]


def describe(plan) -> str:
    pp = "/".join(f"{m[:1]}{n}" for m, n in plan.pp().items())
    return f"{plan.placement[:3]} dp{plan.dp} {pp}"


def run_config(name: str, vision, audio, llm, devices: int, microbatches: int, out: Path | None):
    modules, latency = mllm_modules(vision, audio, llm)
    started = time.perf_counter()
    aware = search(modules, devices, microbatches, MEMORY_LIMIT, latency)
    unaware = search(modules, devices, microbatches, MEMORY_LIMIT, latency, mode="forward-only")
    search_s = time.perf_counter() - started
    # pipeline only (no DP), the setting of the seeds' partitioning ablation
    pp_aware = search(modules, devices, microbatches, MEMORY_LIMIT, latency, data_parallel=False)
    pp_unaware = search(modules, devices, microbatches, MEMORY_LIMIT, latency, mode="forward-only", data_parallel=False)
    # same stage counts and placement as the aware plan, only the boundaries forward-only
    b = aware.best
    same_layers = {m: partition_module(modules[m].costs, n, "forward-only") for m, n in b.pp().items()}
    boundaries_only = evaluate_plan(modules, same_layers, b.placement, microbatches, b.dp, latency, MEMORY_LIMIT)
    hands = hand_plans(modules, devices, microbatches, latency)
    best_hand = min(hands, key=lambda p: p.iteration_time) if hands else None
    if out is not None and name in ("MMM", "VALM-MMM"):
        for tag, plan in (("aware", aware.best), ("unaware", unaware.best)):
            timeline_png(plan.result, out / f"frozen_aware_{name}_{tag}.png", title=f"{name} {tag}: {describe(plan)}")
            chrome_trace(plan.result, out / f"frozen_aware_{name}_{tag}.trace.json")
    entry = SEED_TABLE_3_2.get(name.split("-")[-1]) if name.startswith("VALM") else None
    seed = (entry[0][4], entry[1][4]) if entry else None
    return {
        "config": name,
        "frozen_aware_s": aware.best.iteration_time,
        "forward_only_s": unaware.best.iteration_time,
        "speedup": unaware.best.iteration_time / aware.best.iteration_time,
        "pp_only_aware_s": pp_aware.best.iteration_time,
        "pp_only_forward_only_s": pp_unaware.best.iteration_time,
        "pp_only_speedup": pp_unaware.best.iteration_time / pp_aware.best.iteration_time,
        "pp_only_aware_plan": describe(pp_aware.best),
        "pp_only_unaware_plan": describe(pp_unaware.best),
        "boundaries_only_speedup": boundaries_only.iteration_time / aware.best.iteration_time,
        "seed_aware_s": seed[0] if seed else None,
        "seed_unaware_s": seed[1] if seed else None,
        "seed_speedup": seed[1] / seed[0] if seed else None,
        "aware_plan": describe(aware.best),
        "unaware_plan": describe(unaware.best),
        "aware_layers": aware.best.layers,
        "best_hand_s": best_hand.iteration_time if best_hand else None,
        "best_hand_plan": describe(best_hand) if best_hand else None,
        "hand_plans": len(hands),
        "auto_vs_best_hand": best_hand.iteration_time / aware.best.iteration_time if best_hand else None,
        "search_candidates": len(aware.candidates),
        "search_seconds": search_s,
        "aware_summary": plan_summary(aware.best),
    }


def configurations():
    for v, a, l in SEED_TABLE_3_2:
        yield f"VALM-{v}{a}{l}", v, a, l
    for size in "SML":
        yield f"VLM-{size}", size, None, size
        yield f"ALM-{size}", None, size, size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=24)
    parser.add_argument("--microbatches", type=int, default=12)
    parser.add_argument("--stages", type=int, default=SEED_STAGES, help="fixed stage count of the Table 3.2 setting")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-recompute", action="store_true", help="keep full activations (no checkpointing)")
    parser.add_argument("--skip-free", action="store_true", help="only the Table 3.2 setting")
    args = parser.parse_args(argv)
    global RECOMPUTE
    RECOMPUTE = not args.no_recompute
    args.out.mkdir(parents=True, exist_ok=True)
    seed_rows = [seed_setting_row(key, args.stages, args.out) for key in SEED_TABLE_3_2]
    goal = print_seed_setting(seed_rows, args.stages)
    print()
    seed_sim = seed_stage_times_in_simulator()
    rows = [] if args.skip_free else [run_config(*cfg, args.devices, args.microbatches, args.out) for cfg in configurations()]
    fmt = lambda v, spec: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)  # noqa: E731
    if rows:
        print()
        print(f"Free layouts: each mode searches dp / stage counts / placement on {args.devices} single-GPU devices")
        header = (f"{'config':<10} {'aware s':>8} {'unaware s':>9} {'speedup':>7} {'bounds':>6} {'seed':>5} "
                  f"{'aware plan':<22} {'unaware plan':<22} {'best hand s':>11} {'auto/hand':>9} {'PP-only':>7} "
                  f"{'PP aware plan':<22} {'PP unaware plan':<22}")
        print(header)
        print("-" * len(header))
        for r in rows:
            print(f"{r['config']:<10} {r['frozen_aware_s']:>8.2f} {r['forward_only_s']:>9.2f} {r['speedup']:>6.2f}x "
                  f"{r['boundaries_only_speedup']:>5.2f}x {fmt(r['seed_speedup'], '>4.2f')}x {r['aware_plan']:<22} "
                  f"{r['unaware_plan']:<22} {fmt(r['best_hand_s'], '>11.2f')} {fmt(r['auto_vs_best_hand'], '>8.2f')}x "
                  f"{r['pp_only_speedup']:>6.2f}x {r['pp_only_aware_plan']:<22} {r['pp_only_unaware_plan']:<22}")
        print("speedup = forward-only plan / frozen-aware plan (both timed with true costs); bounds = same stage counts,"
              " only boundaries forward-only; seed = 003 Table 3.2; auto/hand = best hand plan / auto plan (>= 1: auto wins);"
              " PP-only = the same speedup with dp fixed to 1 (all devices in one pipeline)")
    doc = {"devices": args.devices, "microbatches": args.microbatches, "memory_limit": MEMORY_LIMIT, "recompute": RECOMPUTE,
           "effective_flops": EFFECTIVE_FLOPS, "stages": args.stages, "stage_gpus": STAGE_GPUS,
           "tokens": {"text": TEXT_TOKENS, "vision_patches": VISION_PATCHES, "vision_to_llm": VISION_PATCHES // VISION_MERGE,
                      "audio": AUDIO_TOKENS, "samples_per_microbatch": SAMPLES_PER_MICROBATCH},
           "goal_holds": goal, "seed_setting_rows": seed_rows, "seed_stage_times_simulated": seed_sim, "rows": rows}
    (args.out / "frozen_aware.json").write_text(json.dumps(doc, indent=1))
    return seed_rows, rows


if __name__ == "__main__":
    main()
