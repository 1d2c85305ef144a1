"""Per-module data parallelism (DistTrain's disaggregated orchestration), simulated at the seed's scale.

Every figure is "simulated" (the planner's discrete-event simulator on a FLOP cost model) or "published"
(DistTrain, seed 004). Setup: A800 bf16 peak 312 TFLOP/s, layers running at KERNEL_EFFICIENCY of it, 8-GPU nodes
(tensor parallelism inside a node over NVLink, gradients across nodes over the RoCE rail), ViT-H/16 (32 layers,
hidden 1280, MLP 5120: 0.63B) + a 2-layer MLP projector + Llama-3-7B/13B/70B shapes (the seed's Table 1), 8192-token
samples with IMAGES_PER_SAMPLE 512x512 images (1024 patch tokens each; the seed's Fig. 5 prints no values: an
assumption), LLM microbatch = 1 sample. Per-layer FLOPs are counted from the shapes (GEMMs 2 x tokens x params,
attention 4 s^2 h, causal halved; B_d = F_gemm + 2 F_attn, B_w = F_gemm) and made frozen-aware by the planner's
``mllm_layer_costs``; the LLM recomputes activations (its costs then carry the extra forward, its stages keep only
their layer inputs), weights are sharded ZeRO-2 style (``SHARD_GRAD_OP``) and each device has 80 GiB.

Rows per (model, GPUs, global batch):
- uniform: Megatron's rigid layout, one dp; LLM tp 8 and pp 1/2/10, the encoder one stage of 8 ranks splitting the
  images (encoder context parallelism 8), the largest dp dividing the batch that fits the GPUs;
- flop-ratio: GPUs split in proportion to each module's work (the seed's strawman), LLM at Megatron's tp/pp;
- per-module: ``search_per_module_dp`` (tp in 1/2/4/8 per module), with its solve and replay times.
Reported: GPUs, every module's dp x tp x pp, iteration time, samples/s, MFU (model FLOPs without recomputation /
(time x GPUs x peak)), bubble (1 - device-weighted busy / (time x GPUs)), the Eq. 1-2 estimate, planning ms; then
the search's time on the 72B at Table 2's GPU counts (median of --repeats runs). The generator (SD-2.1) and StepCCL
are not modelled: compare ratios, not absolute MFU.

``--measured`` also runs ``benchmarks/per_module_dp_cpu.py`` (uniform vs per-module dp trained on CPU processes,
its own JSON).

Writes benchmarks/results/per_module_dp.json, prints the table and rewrites the figures README.md and docs/ quote
from it (benchmarks/tables.py).

    python benchmarks/per_module_dp.py [--repeats 5] [--models 9B,15B,72B] [--measured]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from lightning_mm.planner.costs import LayerCost, ModuleTimes, mllm_layer_costs
from lightning_mm.planner.orchestration import flop_ratio_split, search_per_module_dp
from lightning_mm.planner.partition import partition_module
from lightning_mm.planner.search import ModuleSpec, Plan, evaluate_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEAK = 312e12  # A800 bf16 dense FLOP/s
KERNEL_EFFICIENCY = 0.6  # achieved share of the peak inside a layer (an assumption; sets absolute MFU, not ratios)
TP_BANDWIDTH = 150e9  # bytes/s per GPU for tensor-parallel all-reduces (NVLink 300 GB/s bidirectional)
DP_BANDWIDTH = 12.5e9  # bytes/s per GPU for gradient all-reduces (4 x 200 Gb/s RoCE per 8-GPU node)
MEMORY = 80 * 2**30
SEQ, IMAGES_PER_SAMPLE, IMAGE_TOKENS = 8192, 4, 1024
VIT_H = dict(layers=32, hidden=1280, mlp=5120, heads=16)
LLAMA = {"9B": dict(layers=32, hidden=4096, ffn=11008, heads=32, groups=32, megatron_pp=1),
         "15B": dict(layers=40, hidden=5120, ffn=13824, heads=40, groups=40, megatron_pp=2),
         "72B": dict(layers=80, hidden=8192, ffn=28672, heads=64, groups=8, megatron_pp=10)}
VOCAB = 128256
SCALES = {"8.1": {"9B": (1296, 1920), "15B": (1296, 1920), "72B": (1296, 1920)},
          "8.2.1": {"9B": (98, 128), "15B": (98, 64), "72B": (98, 40)}}
TABLE_2 = {112: (240, 0.133), 324: (480, 0.441), 648: (960, 0.641), 1296: (1920, 0.922)}  # GPUs: (batch, seconds)
PUBLISHED = {"8.1": {"9B": "MFU 1.7-2.8x, throughput 1.7-2.2x (9B/15B)", "15B": "MFU 1.7-2.8x, throughput 1.7-2.2x",
                     "72B": "MFU 1.2x, throughput 1.3x"},
             "8.2.1": {m: "MFU 1.3-2.7x, throughput 1.4-2.7x (vs Megatron and flop-ratio)" for m in LLAMA}}
SETTINGS = {"trained": False, "encoder frozen": True}


# ----------------------------------------------------------------------------------------------------- cost model
def llm_layer_flops(cfg: dict) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) FLOPs of one decoder layer on one 8192-token sample."""
    h, kv = cfg["hidden"], cfg["hidden"] * cfg["groups"] // cfg["heads"]
    gemm = 2 * SEQ * (2 * h * h + 2 * h * kv + 3 * h * cfg["ffn"])
    attn = 2 * SEQ * SEQ * h  # 4 s^2 h, causal half
    return gemm + attn, gemm + 2 * attn, gemm


def vit_layer_flops(llm_hidden: int) -> tuple[float, float, float]:
    """The same for one ViT-H block on a sample's images (bidirectional attention within each image)."""
    h, t = VIT_H["hidden"], IMAGE_TOKENS
    gemm = 2 * t * (4 * h * h + 2 * h * VIT_H["mlp"]) * IMAGES_PER_SAMPLE
    attn = 4 * t * t * h * IMAGES_PER_SAMPLE
    return gemm + attn, gemm + 2 * attn, gemm


def module_specs(model: str, encoder_frozen: bool) -> tuple[dict[str, ModuleSpec], float]:
    """Planner input (seconds per 1-sample microbatch, bytes) and the model FLOPs of one sample (F + B, frozen-aware,
    without recomputation)."""
    cfg = LLAMA[model]
    h = cfg["hidden"]
    lf, ld, lw = llm_layer_flops(cfg)
    vf, vd, vw = vit_layer_flops(h)
    proj = 2 * IMAGE_TOKENS * IMAGES_PER_SAMPLE * (VIT_H["hidden"] * h + h * h)  # the projector, on the last block
    head = 2 * SEQ * h * VOCAB  # embedding lookup is free; the LM head and loss ride on the last layer
    v_layers, l_layers = VIT_H["layers"], cfg["layers"]
    last_d, last_w = (0.0, proj) if encoder_frozen else (vd + proj, vw + proj)  # frozen: only the projector trains
    vit = ModuleTimes([vf] * (v_layers - 1) + [vf + proj], [vd] * (v_layers - 1) + [last_d],
                      [vw] * (v_layers - 1) + [last_w], [encoder_frozen] * (v_layers - 1) + [False])
    llm = ModuleTimes([lf] * (l_layers - 1) + [lf + head], [ld] * (l_layers - 1) + [ld + head],
                      [lw] * (l_layers - 1) + [lw + head], False)
    flops = mllm_layer_costs({"vision": vit}, llm)
    model_flops = sum(c.total for costs in flops.values() for c in costs)
    recomputed = mllm_layer_costs({"vision": vit}, llm, recompute={"language_model": True})
    rate = KERNEL_EFFICIENCY * PEAK
    v_params = 4 * VIT_H["hidden"] ** 2 + 2 * VIT_H["hidden"] * VIT_H["mlp"]
    l_params = 2 * h * h + 2 * h * h * cfg["groups"] // cfg["heads"] + 3 * h * cfg["ffn"]
    specs = {}
    for name, params, kept, tokens, width in (
            ("vision", v_params, 34 * IMAGE_TOKENS * IMAGES_PER_SAMPLE * VIT_H["hidden"],
             IMAGE_TOKENS * IMAGES_PER_SAMPLE, VIT_H["hidden"]),
            ("language_model", l_params, 2 * SEQ * h, SEQ, h)):
        costs = [LayerCost(c.forward / rate, c.backward / rate, c.trainable, c.in_backward) for c in recomputed[name]]
        specs[name] = ModuleSpec(costs, param_bytes=[(16 if c.trainable else 2) * params for c in costs],
                                 activation_bytes=kept, grad_bytes=[2 * params if c.trainable else 0 for c in costs],
                                 tp_bytes=2 * tokens * width)
    return specs, model_flops


# ----------------------------------------------------------------------------------------------------------- rows
def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, max(1, at_most) + 1) if n % d == 0)


COMMON = dict(memory_limit=MEMORY, allreduce_bandwidth=DP_BANDWIDTH, tp_bandwidth=TP_BANDWIDTH,
              sharding="SHARD_GRAD_OP")


def uniform_row(specs, model: str, gpus: int, batch: int) -> Plan:
    """Megatron's rigid layout: one dp, LLM tp 8 pp 1/2/10, the encoder one 8-rank stage splitting the images."""
    pp = LLAMA[model]["megatron_pp"]
    dp = largest_divisor(batch, gpus // (8 * (pp + 1)))
    layers = {"vision": [len(specs["vision"].costs)],
              "language_model": partition_module(specs["language_model"].costs, pp)}
    return evaluate_plan(specs, layers, "parallel", batch, dp, tp={"vision": 1, "language_model": 8},
                         encoder_cp={"vision": 8}, **COMMON)


def flop_ratio_row(specs, model: str, gpus: int, batch: int) -> Plan:
    """GPUs in proportion to each module's work; the LLM keeps Megatron's tp 8 and pp, the encoder tp 1 pp 1."""
    pp = LLAMA[model]["megatron_pp"]
    work = {m: sum(c.total for c in s.costs) for m, s in specs.items()}
    share = flop_ratio_split(work, gpus)
    dp = largest_divisor(batch, min(int(share["language_model"]), gpus - 1) // (8 * pp))
    vision_dp = min(dp, max(1, min(gpus - 8 * pp * dp, round(share["vision"]))))
    layers = {"vision": [len(specs["vision"].costs)],
              "language_model": partition_module(specs["language_model"].costs, pp)}
    return evaluate_plan(specs, layers, "parallel", batch, {"vision": vision_dp, "language_model": dp},
                         tp={"vision": 1, "language_model": 8}, **COMMON)


def degrees(plan: Plan) -> str:
    pp = plan.pp()
    if plan.module_dp:
        return ", ".join(f"{'ViT' if m == 'vision' else 'LLM'} {plan.module_dp[m]}x{plan.module_tp[m]}x{pp[m]}"
                         for m in ("vision", "language_model"))
    cp = plan.encoder_cp.get("vision", 1)
    return f"ViT {plan.dp}x{cp}(cp)x{pp['vision']}, LLM {plan.dp}x{plan.tp}x{pp['language_model']}"


def metrics(plan: Plan, batch: int, model_flops: float) -> dict:
    r = plan.result
    widths = plan.layout.widths
    dp_of = plan.stage_modules()
    per_stage = {s: widths[s] * (plan.module_dp.get(dp_of[s], plan.dp) if plan.module_dp else plan.dp)
                 for s in r.stages}
    busy = sum(r.busy[s] * n for s, n in per_stage.items())
    return dict(gpus=plan.devices, layout=degrees(plan), iteration_s=plan.iteration_time,
                samples_per_s=batch / plan.iteration_time,
                mfu=batch * model_flops / (plan.iteration_time * plan.devices * PEAK),
                bubble=1 - busy / (plan.iteration_time * sum(per_stage.values())),
                peak_memory_gib=max(plan.memory.values()) / 2**30, fits_memory=plan.fits_memory)


def run_case(model: str, setting: str, gpus: int, batch: int, repeats: int) -> dict:
    specs, model_flops = module_specs(model, SETTINGS[setting])
    rows = {"uniform": metrics(uniform_row(specs, model, gpus, batch), batch, model_flops),
            "flop-ratio": metrics(flop_ratio_row(specs, model, gpus, batch), batch, model_flops)}
    times, found = [], None
    for _ in range(repeats):
        found = search_per_module_dp(specs, gpus, batch, **COMMON)
        times.append(found.solve_seconds + found.replay_seconds)
    rows["per-module"] = dict(metrics(found.best, batch, model_flops), estimate_s=found.estimate,
                              planning_ms=statistics.median(times) * 1e3,
                              solve_ms=found.solve_seconds * 1e3, replay_ms=found.replay_seconds * 1e3,
                              subproblems=found.subproblems)
    base = rows["uniform"]
    for row in rows.values():
        row["mfu_vs_uniform"] = row["mfu"] / base["mfu"]
        row["throughput_vs_uniform"] = row["samples_per_s"] / base["samples_per_s"]
    return dict(model=f"MLLM-{model}", setting=setting, gpus=gpus, batch=batch, rows=rows)


def table_2(repeats: int) -> list[dict]:
    """The search's wall time on the 72B at Table 2's GPU counts and batches (median of ``repeats``)."""
    specs, _ = module_specs("72B", False)
    out = []
    for gpus, (batch, published) in TABLE_2.items():
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            found = search_per_module_dp(specs, gpus, batch, **COMMON)
            runs.append(time.perf_counter() - start)
        out.append(dict(gpus=gpus, batch=batch, search_ms=statistics.median(runs) * 1e3,
                        solve_ms=found.solve_seconds * 1e3, replay_ms=found.replay_seconds * 1e3,
                        subproblems=found.subproblems, published_ms=published * 1e3, layout=degrees(found.best)))
    return out


def print_tables(doc: dict) -> None:
    head = (f"{'scale':<6} {'model':<10} {'setting':<15} {'row':<11} {'GPUs':>5} {'dp x tp x pp':<28} {'iter s':>7} "
            f"{'samples/s':>9} {'MFU':>6} {'bubble':>6} {'MFU x':>6} {'tput x':>6} {'Eq.1-2 s':>8} {'plan ms':>7}")
    print("simulated (planner's simulator, FLOP cost model; published ratios beside)\n" + head + "\n" + "-" * len(head))
    for case in doc["cases"]:
        for name, r in case["rows"].items():
            extra = (f" {r['estimate_s']:>8.2f} {r['planning_ms']:>7.1f}" if name == "per-module" else "")
            print(f"{case['scale']:<6} {case['model']:<10} {case['setting']:<15} {name:<11} {r['gpus']:>5} "
                  f"{r['layout']:<28} {r['iteration_s']:>7.2f} {r['samples_per_s']:>9.1f} {r['mfu']:>6.1%} "
                  f"{r['bubble']:>6.1%} {r['mfu_vs_uniform']:>6.2f} {r['throughput_vs_uniform']:>6.2f}{extra}")
        print(f"{'':<6} published (§{case['scale']}): {case['published']}")
    print("\nsearch time, MLLM-72B (simulated layouts; wall time on this CPU vs published CVXPY times, Table 2)")
    print(f"{'GPUs':>5} {'batch':>6} {'search ms':>9} {'solve ms':>8} {'replay ms':>9} {'subproblems':>11} "
          f"{'published ms':>12}  layout")
    for r in doc["table_2"]:
        print(f"{r['gpus']:>5} {r['batch']:>6} {r['search_ms']:>9.1f} {r['solve_ms']:>8.1f} {r['replay_ms']:>9.1f} "
              f"{r['subproblems']:>11} {r['published_ms']:>12.0f}  {r['layout']}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each search (median)")
    p.add_argument("--models", default="9B,15B,72B")
    p.add_argument("--out", default=str(RESULTS / "per_module_dp.json"))
    p.add_argument("--measured", action="store_true",
                   help="also measure uniform vs per-module dp on CPU processes (benchmarks/per_module_dp_cpu.py)")
    args = p.parse_args(argv)
    start = _machine.record()
    models = args.models.split(",")
    work = [(scale, m, setting) for scale in SCALES for m in models
            for setting in (SETTINGS if scale == "8.2.1" else ("trained",))]
    cases = []
    for scale, model, setting in tqdm(work, desc="cases", disable=None):
        gpus, batch = SCALES[scale][model]
        cases.append(dict(scale=scale, published=PUBLISHED[scale][model],
                          **run_case(model, setting, gpus, batch, args.repeats)))
    doc = dict(
        what="per-module data parallelism (DistTrain orchestration) vs one dp and a FLOP-ratio split, simulated",
        assumptions=dict(peak_flops=PEAK, kernel_efficiency=KERNEL_EFFICIENCY, tp_bandwidth=TP_BANDWIDTH,
                         dp_bandwidth=DP_BANDWIDTH, memory_bytes=MEMORY, seq=SEQ, images_per_sample=IMAGES_PER_SAMPLE,
                         image_tokens=IMAGE_TOKENS, llm_recompute=True, sharding="SHARD_GRAD_OP",
                         microbatch_samples=1),
        cases=cases, table_2=table_2(args.repeats),
        published=dict(mfu_disttrain="51.8-54.7% (§8.1)", ratios=PUBLISHED, table_2_ms={g: s * 1e3 for g, (_, s) in
                                                                                     TABLE_2.items()}),
        machine=_machine.finish(start))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print_tables(doc)
    print(f"\nwrote {args.out}")
    if args.measured:
        import per_module_dp_cpu

        per_module_dp_cpu.main([])
    tables.main(["--quiet"])
    return doc


if __name__ == "__main__":
    main()
