"""Frozen-aware vs forward-only (frozen-unaware) planning on the seeds' MLLM configurations.

Per-layer costs come from FLOP counts of the seeds' model table (003 Table 3.1: layers, hidden, params) on
the seeds' data (1k text tokens + one 1280x720 image + one 2-minute audio clip per sample, microbatch 4,
global batch 48 -> 12 microbatches, 24 A40-48GB devices). Encoders and LLM frozen, projectors trainable.
For every configuration the planner's search runs twice: believing backward = 2 x forward (the baseline),
and frozen-aware; both chosen layouts are timed by the simulator with the true costs. The seeds' measured
ratios (003 Table 3.2) are printed beside ours. The auto search is also compared with a grid of hand plans.

    python benchmarks/frozen_aware.py [--devices 24] [--microbatches 12] [--no-recompute] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

from lightning_mm.planner import (
    ModuleSpec,
    ModuleTimes,
    chrome_trace,
    evaluate_plan,
    mllm_layer_costs,
    partition_module,
    plan_summary,
    search,
    timeline_png,
)

# 003 Table 3.1: (layers, hidden, parameters)
LLAMA3 = {"S": (16, 2048, 1.0e9), "M": (32, 4096, 8.0e9), "L": (64, 5120, 32.0e9)}
QWEN2_VISION = {"S": (32, 1280, 0.6e9), "M": (48, 2560, 3.9e9), "L": (64, 3840, 11.6e9)}
PHI4_AUDIO = {"S": (24, 1024, 0.5e9), "M": (32, 3072, 3.4e9), "L": (48, 5120, 12.4e9)}
# 003 Table 3.2: iteration time (s) frozen-aware, frozen-unaware, for MLLM-<vision><audio><LLM>
SEED_TABLE_3_2 = {"SSS": (21.81, 25.67), "MMM": (70.37, 173.01), "LLM": (87.43, 177.39), "LLL": (143.76, 247.79),
                  "LLS": (1.0, 1.0), "SSL": (1.0, 1.0)}

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


def transformer_layer_times(tokens: int, hidden: int, params_per_layer: float, causal: bool) -> tuple[float, float, float]:
    """(forward, input-grad, weight-grad) seconds of one layer on one microbatch, from FLOPs per sample."""
    attention = (2 if causal else 4) * tokens * tokens * hidden
    dense = 2 * tokens * params_per_layer
    per_sample = (dense + attention, dense + 2 * attention, dense)
    return tuple(SAMPLES_PER_MICROBATCH * f / EFFECTIVE_FLOPS for f in per_sample)


def _bytes_per_token_hidden() -> int:
    return CHECKPOINT_BYTES_PER_TOKEN_HIDDEN if RECOMPUTE else ACTIVATION_BYTES_PER_TOKEN_HIDDEN


def encoder_module(table, size: str, enc_tokens: int, llm_tokens: int, in_features_factor: int, llm_hidden: int):
    """A frozen encoder of `table[size]` plus a trainable 2-layer MLP projector as its last layer."""
    layers, hidden, params = table[size]
    f, d, w = transformer_layer_times(enc_tokens, hidden, params / layers, causal=False)
    proj_params = in_features_factor * hidden * llm_hidden + llm_hidden * llm_hidden
    pf = SAMPLES_PER_MICROBATCH * 2 * llm_tokens * proj_params / EFFECTIVE_FLOPS
    times = ModuleTimes([f] * layers + [pf], [d] * layers + [pf], [w] * layers + [pf], [True] * layers + [False])
    param_bytes = [2.0 * params / layers] * layers + [16.0 * proj_params]
    act = SAMPLES_PER_MICROBATCH * _bytes_per_token_hidden()
    activations = [act * enc_tokens * hidden] * layers + [act * llm_tokens * llm_hidden]
    return times, param_bytes, activations


def mllm_modules(vision: str | None, audio: str | None, llm: str) -> tuple[dict[str, ModuleSpec], float]:
    """Planner input for one configuration and its P2P latency (one microbatch of LLM hidden states)."""
    layers, hidden, params = LLAMA3[llm]
    llm_tokens = TEXT_TOKENS
    raw = {}
    if vision:
        raw["vision"] = encoder_module(QWEN2_VISION, vision, VISION_PATCHES, VISION_PATCHES // VISION_MERGE, VISION_MERGE, hidden)
        llm_tokens += VISION_PATCHES // VISION_MERGE
    if audio:
        raw["audio"] = encoder_module(PHI4_AUDIO, audio, AUDIO_TOKENS, AUDIO_TOKENS, 1, hidden)
        llm_tokens += AUDIO_TOKENS
    f, d, w = transformer_layer_times(llm_tokens, hidden, params / layers, causal=True)
    llm_times = ModuleTimes([f] * layers, [d] * layers, [w] * layers, True)
    costs = mllm_layer_costs({name: r[0] for name, r in raw.items()}, llm_times, recompute=RECOMPUTE)
    modules = {name: ModuleSpec(costs[name], r[1], r[2]) for name, r in raw.items()}
    llm_act = SAMPLES_PER_MICROBATCH * _bytes_per_token_hidden() * llm_tokens * hidden
    modules["language_model"] = ModuleSpec(costs["language_model"], 2.0 * params / layers, llm_act)
    latency = SAMPLES_PER_MICROBATCH * llm_tokens * hidden * 2 / LINK_BYTES_PER_S
    return modules, latency


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
    seed = SEED_TABLE_3_2.get(name.split("-")[-1]) if name.startswith("VALM") else None
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
    for v, a, l in ("SSS", "MMM", "LLM", "LLL", "LLS", "SSL"):
        yield f"VALM-{v}{a}{l}", v, a, l
    for size in "SML":
        yield f"VLM-{size}", size, None, size
        yield f"ALM-{size}", None, size, size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=24)
    parser.add_argument("--microbatches", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-recompute", action="store_true", help="keep full activations (no checkpointing)")
    args = parser.parse_args(argv)
    global RECOMPUTE
    RECOMPUTE = not args.no_recompute
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run_config(*cfg, args.devices, args.microbatches, args.out) for cfg in configurations()]
    fmt = lambda v, spec: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)  # noqa: E731
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
           "effective_flops": EFFECTIVE_FLOPS, "rows": rows}
    (args.out / "frozen_aware.json").write_text(json.dumps(doc, indent=1))
    return rows


if __name__ == "__main__":
    main()
