"""Per-module data parallelism (DistTrain's disaggregated orchestration), simulated at the seed's scale.

Setting, rows and comparisons: docs/per_module_dp.md, "Benchmark (simulated)"; run ``python
benchmarks/per_module_dp.py --repeats 5``. Measured on CPU processes: ``per_module_dp_cpu.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from lightning_mm.planner.costs import LayerCost, ModuleTimes, mllm_layer_costs
from lightning_mm.planner.orchestration import _Module, flop_ratio_split, search_per_module_dp
from lightning_mm.planner.partition import partition_module
from lightning_mm.planner.search import ModuleSpec, Plan, encoder_samples, evaluate_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests import this file by path
import harness  # noqa: E402

PEAK = 312e12  # A800 bf16 dense FLOP/s
KERNEL_EFFICIENCY = 0.6  # achieved share of the peak inside a layer (an assumption; sets absolute MFU, not ratios)
TP_BANDWIDTH = 150e9  # bytes/s per GPU for tensor-parallel all-reduces (NVLink 300 GB/s bidirectional)
DP_BANDWIDTH = 12.5e9  # bytes/s per GPU for gradient all-reduces (4 x 200 Gb/s RoCE per 8-GPU node)
MEMORY = 80 * 2**30
SEQ, IMAGES_PER_SAMPLE, IMAGE_TOKENS, VOCAB = 8192, 4, 1024, 128256
VIT_H = dict(layers=32, hidden=1280, mlp=5120, heads=16)
LLAMA = {"9B": dict(layers=32, hidden=4096, ffn=11008, heads=32, groups=32, megatron_pp=1),
         "15B": dict(layers=40, hidden=5120, ffn=13824, heads=40, groups=40, megatron_pp=2),
         "72B": dict(layers=80, hidden=8192, ffn=28672, heads=64, groups=8, megatron_pp=10)}
SCALES = {"8.1": {"9B": (1296, 1920), "15B": (1296, 1920), "72B": (1296, 1920)},
          "8.2.1": {"9B": (98, 128), "15B": (98, 64), "72B": (98, 40)}}
TABLE_2 = {112: (240, 0.133), 324: (480, 0.441), 648: (960, 0.641), 1296: (1920, 0.922)}  # GPUs: (batch, seconds)
PUBLISHED = {"8.1": {"9B": "MFU 1.7-2.8x, throughput 1.7-2.2x (9B/15B)", "15B": "MFU 1.7-2.8x, throughput 1.7-2.2x",
                     "72B": "MFU 1.2x, throughput 1.3x"},
             "8.2.1": {m: "MFU 1.3-2.7x, throughput 1.4-2.7x (vs Megatron and flop-ratio)" for m in LLAMA}}
SETTINGS = {"trained": False, "encoder frozen": True}
COMMON = dict(memory_limit=MEMORY, allreduce_bandwidth=DP_BANDWIDTH, tp_bandwidth=TP_BANDWIDTH,
              sharding="SHARD_GRAD_OP")


# ----------------------------------------------------------------------------------------------------- cost model
def _fbw(gemm: float, attn: float) -> tuple[float, float, float]:
    """A layer's (forward, input-gradient, weight-gradient) FLOPs from its GEMM and attention FLOPs."""
    return gemm + attn, gemm + 2 * attn, gemm


def _ending(every, last, n: int) -> list:
    return [every] * (n - 1) + [last]


def module_specs(model: str, encoder_frozen: bool) -> tuple[dict[str, ModuleSpec], float]:
    """Planner input (seconds per 1-sample microbatch, bytes) and the model FLOPs of one sample (F + B, frozen-aware,
    without recomputation): Llama decoder layers on 8192 tokens (causal), ViT-H blocks on a sample's images
    (attention within each image)."""
    cfg, images, vh = LLAMA[model], IMAGE_TOKENS * IMAGES_PER_SAMPLE, VIT_H["hidden"]
    h, kv = cfg["hidden"], cfg["hidden"] * cfg["groups"] // cfg["heads"]
    lf, ld, lw = _fbw(2 * SEQ * (2 * h * h + 2 * h * kv + 3 * h * cfg["ffn"]), 2 * SEQ * SEQ * h)
    vf, vd, vw = _fbw(2 * images * (4 * vh * vh + 2 * vh * VIT_H["mlp"]), 4 * IMAGE_TOKENS * images * vh)
    proj = 2 * images * (vh * h + h * h)  # the projector, on the last block
    head = 2 * SEQ * h * VOCAB  # embedding lookup is free; the LM head and loss ride on the last layer
    last_d, last_w = (0.0, proj) if encoder_frozen else (vd + proj, vw + proj)  # frozen: only the projector trains
    n = VIT_H["layers"]
    vit = ModuleTimes(_ending(vf, vf + proj, n), _ending(vd, last_d, n), _ending(vw, last_w, n),
                      _ending(encoder_frozen, False, n))
    llm = ModuleTimes(*(_ending(x, x + head, cfg["layers"]) for x in (lf, ld, lw)), False)
    model_flops = sum(c.total for costs in mllm_layer_costs({"vision": vit}, llm).values() for c in costs)
    recomputed = mllm_layer_costs({"vision": vit}, llm, recompute={"language_model": True})
    rate = KERNEL_EFFICIENCY * PEAK
    specs = {}
    for name, params, kept, tokens, width in (
            ("vision", 4 * vh ** 2 + 2 * vh * VIT_H["mlp"], 34 * images * vh, images, vh),
            ("language_model", 2 * h * h + 2 * h * h * cfg["groups"] // cfg["heads"] + 3 * h * cfg["ffn"],
             2 * SEQ * h, SEQ, h)):
        costs = [LayerCost(c.forward / rate, c.backward / rate, c.trainable, c.in_backward) for c in recomputed[name]]
        specs[name] = ModuleSpec(costs, param_bytes=[(16 if c.trainable else 2) * params for c in costs],
                                 activation_bytes=kept, grad_bytes=[2 * params if c.trainable else 0 for c in costs],
                                 tp_bytes=2 * tokens * width)
    return specs, model_flops


# ----------------------------------------------------------------------------------------------------------- rows
def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, max(1, at_most) + 1) if n % d == 0)


def uniform_row(specs, model: str, gpus: int, batch: int) -> Plan:
    """Megatron's rigid layout: one dp, LLM tp 8 pp 1/2/10, the encoder one 8-rank stage splitting the images."""
    pp = LLAMA[model]["megatron_pp"]
    dp = largest_divisor(batch, gpus // (8 * (pp + 1)))
    layers = {"vision": [len(specs["vision"].costs)],
              "language_model": partition_module(specs["language_model"].costs, pp)}
    return evaluate_plan(specs, layers, "parallel", batch, dp, tp={"vision": 1, "language_model": 8},
                         encoder_cp={"vision": 8}, **COMMON)


def flop_ratio_row(specs, model: str, gpus: int, batch: int) -> Plan:
    """GPUs in proportion to each module's work (DistTrain's FLOP-ratio baseline): the LLM at Megatron's tp 8 and pp,
    the largest dp dividing the batch that its share holds; the encoder at tp 1, the rest of its share as replicas x
    stages at the fewest stages (1, 2, 4, ...) whose replicas fit memory (else the last tried)."""
    share = flop_ratio_split({m: sum(c.total for c in s.costs) for m, s in specs.items()}, gpus)
    pp = LLAMA[model]["megatron_pp"]
    dp = largest_divisor(batch, int(min(share["language_model"], gpus - 1)) // (8 * pp))
    layers = {"language_model": partition_module(specs["language_model"].costs, pp)}
    vision, spare, plan = _Module(specs["vision"]), gpus - 8 * pp * dp, None
    counts = [p for p in (2 ** i for i in range(6)) if p <= min(spare, len(specs["vision"].costs))]
    for vision_pp in counts:
        vision_dp = min(dp, max(1, min(spare, round(share["vision"])) // vision_pp))
        held = vision.stage_memory(vision.chain(1, TP_BANDWIDTH), 1, vision_pp, vision_dp, pp, batch // dp,
                                   encoder_samples(dp, vision_dp), COMMON["sharding"])
        if held > MEMORY and vision_pp != counts[-1]:
            continue
        layers["vision"] = partition_module(specs["vision"].costs, vision_pp)
        plan = evaluate_plan(specs, layers, "parallel", batch, {"vision": vision_dp, "language_model": dp},
                             tp={"vision": 1, "language_model": 8}, **COMMON)
        if plan.fits_memory:
            break
    return plan


def degrees(plan: Plan) -> str:
    pp = plan.pp()
    if plan.module_dp:
        return ", ".join(f"{'ViT' if m == 'vision' else 'LLM'} {plan.module_dp[m]}x{plan.module_tp[m]}x{pp[m]}"
                         for m in ("vision", "language_model"))
    cp = plan.encoder_cp.get("vision", 1)
    return f"ViT {plan.dp}x{cp}(cp)x{pp['vision']}, LLM {plan.dp}x{plan.tp}x{pp['language_model']}"


def metrics(plan: Plan, batch: int, model_flops: float, given: int) -> dict:
    """A row's figures; ``mfu`` counts the GPUs the layout uses, ``mfu_given`` the ``given`` GPUs (idle ones too)."""
    r, dp_of = plan.result, plan.stage_modules()
    per_stage = {s: plan.layout.widths[s] * (plan.module_dp.get(dp_of[s], plan.dp) if plan.module_dp else plan.dp)
                 for s in r.stages}
    busy = sum(r.busy[s] * n for s, n in per_stage.items())
    flops_per_s = batch * model_flops / plan.iteration_time
    return dict(gpus=plan.devices, given=given, layout=degrees(plan), iteration_s=plan.iteration_time,
                samples_per_s=batch / plan.iteration_time, mfu=flops_per_s / (plan.devices * PEAK),
                mfu_given=flops_per_s / (given * PEAK),
                bubble=1 - busy / (plan.iteration_time * sum(per_stage.values())),
                peak_memory_gib=max(plan.memory.values()) / 2**30, fits_memory=plan.fits_memory)


def searched(specs, gpus: int, batch: int, model_flops: float, repeats: int = 1) -> dict:
    """The per-module search's row on ``gpus`` GPUs, its Eq. 1-2 estimate and its median planning time."""
    times, found = [], None
    for _ in range(repeats):
        found = search_per_module_dp(specs, gpus, batch, **COMMON)
        times.append(found.solve_seconds + found.replay_seconds)
    return dict(metrics(found.best, batch, model_flops, gpus), estimate_s=found.estimate,
                planning_ms=statistics.median(times) * 1e3, solve_ms=found.solve_seconds * 1e3,
                replay_ms=found.replay_seconds * 1e3, subproblems=found.subproblems)


def pair(row: dict, base: dict) -> dict:
    """``row`` against ``base`` on the same given GPUs: the throughput ratio, which is then also the MFU ratio."""
    assert row["given"] == base["given"], (row["given"], base["given"])
    return dict(gpus=row["given"], layout=row["layout"], base_layout=base["layout"], used=row["gpus"],
                base_used=base["gpus"], ratio=row["samples_per_s"] / base["samples_per_s"],
                mfu=row["mfu_given"], base_mfu=base["mfu_given"], fits=row["fits_memory"] and base["fits_memory"])


def run_case(model: str, setting: str, gpus: int, batch: int, repeats: int) -> dict:
    """The three rows on the scale's ``gpus``, then each comparison at equal GPU counts: the baseline's layout on the
    GPUs it uses against the per-module search of exactly that count (and the FLOP-ratio split of the uniform's)."""
    specs, model_flops = module_specs(model, SETTINGS[setting])
    plans = {"uniform": uniform_row(specs, model, gpus, batch), "flop-ratio": flop_ratio_row(specs, model, gpus, batch)}
    rows = {k: metrics(p, batch, model_flops, gpus) for k, p in plans.items()}
    rows["per-module"] = searched(specs, gpus, batch, model_flops, repeats)
    for row in rows.values():
        row["mfu_vs_uniform"] = row["mfu"] / rows["uniform"]["mfu"]
        row["throughput_vs_uniform"] = row["samples_per_s"] / rows["uniform"]["samples_per_s"]
    own = {k: metrics(p, batch, model_flops, p.devices) for k, p in plans.items()}  # each on the GPUs it uses
    equal = {f"per-module vs {k}": pair(searched(specs, own[k]["given"], batch, model_flops), own[k])
             for k in ("flop-ratio", "uniform")}
    n_u = plans["uniform"].devices
    equal["flop-ratio vs uniform"] = pair(metrics(flop_ratio_row(specs, model, n_u, batch), batch, model_flops, n_u),
                                          own["uniform"])
    return dict(model=f"MLLM-{model}", setting=setting, gpus=gpus, batch=batch, rows=rows, equal_gpus=equal)


def table_2(repeats: int) -> list[dict]:
    """The 72B search at Table 2's GPU counts and batches: wall time (median and minimum of ``repeats``), process CPU
    time (median: what load does not stretch) and the load average."""
    specs, _ = module_specs("72B", False)
    out = []
    for gpus, (batch, published) in TABLE_2.items():
        runs, cpu, found = harness.repeat(lambda: search_per_module_dp(specs, gpus, batch, **COMMON), repeats)
        out.append(dict(gpus=gpus, batch=batch, search_ms=statistics.median(runs) * 1e3,
                        search_cpu_ms=statistics.median(cpu) * 1e3, search_ms_min=min(runs) * 1e3,
                        load_average=os.getloadavg()[0], solve_ms=found.solve_seconds * 1e3,
                        replay_ms=found.replay_seconds * 1e3, subproblems=found.subproblems,
                        published_ms=published * 1e3, layout=degrees(found.best)))
    return out


def main(argv=None) -> dict:
    args = harness.cli(__doc__, argv, repeats=(5, "timed runs of each search (median)"), models="9B,15B,72B",
                       out=str(harness.RESULTS / "per_module_dp.json"))
    start = harness.record()
    work = [(scale, m, setting) for scale in SCALES for m in args.models.split(",")
            for setting in (SETTINGS if scale == "8.2.1" else ("trained",))]
    cases = [dict(scale=scale, published=PUBLISHED[scale][model],
                  **run_case(model, setting, *SCALES[scale][model], args.repeats))
             for scale, model, setting in tqdm(work, desc="cases", disable=None)]
    doc = dict(
        what="per-module data parallelism (DistTrain orchestration) vs one dp and a FLOP-ratio split, simulated",
        assumptions=dict(peak_flops=PEAK, kernel_efficiency=KERNEL_EFFICIENCY, tp_bandwidth=TP_BANDWIDTH,
                         dp_bandwidth=DP_BANDWIDTH, memory_bytes=MEMORY, seq=SEQ, images_per_sample=IMAGES_PER_SAMPLE,
                         image_tokens=IMAGE_TOKENS, llm_recompute=True, sharding="SHARD_GRAD_OP",
                         microbatch_samples=1),
        cases=cases, table_2=table_2(args.repeats),
        published=dict(mfu_disttrain="51.8-54.7% (§8.1)", ratios=PUBLISHED,
                       table_2_ms={g: s * 1e3 for g, (_, s) in TABLE_2.items()}))
    harness.write(args.out, doc, start, sources={"cases": "simulated", "assumptions": "setting"})
    return doc


if __name__ == "__main__":
    main()
