"""Data heterogeneity: iteration time and microbatch forward-time spread of batch balancing (none / disttrain /
entrain), simulated at the seeds' scale, measured on CPU processes, and the planning time.

a) Simulated (every figure labelled "simulated"): Qwen2.5-Vision (32 layers, hidden 1280, 14-px patches, 2x2 merge)
   + Llama-3.2-1B / 3B, built on the meta device from transformers configs (no weights) and costed by the runtime's
   own ``WorkloadModel.from_model`` (forward FLOPs x 3 for trainable modules), with one correction: 28 of the
   tower's 32 blocks attend within 8x8-patch windows, so their quadratic term becomes linear. Seconds = FLOPs /
   (tp x EFFECTIVE_FLOPS); the vision tower's seconds per FLOP are VISION_SLOWDOWN (kappa) times the LLM's, kappa
   calibrated so that the LLaVA-like set has the published mean vision:text workload ratio (2.43, Entrain
   Fig. 4.5) with Llama-1B (FLOPs alone cannot reach it). B 512, dp 4, tp 2, 32 microbatches, vision pp 4 + LLM
   pp 4 per replica (Entrain's Table 4.1 setting: 64 GPUs). Iteration time = the slowest replica's (as Entrain
   measures it; the gradient all-reduce is not modelled). Published numbers (Entrain Table 4.3, Fig. 4.12) are
   printed beside them, labelled "published".
b) ``--measure``: samples/s of each method on 6 CPU processes (gloo; tiny Qwen2-VL vision pp 1 + tiny Llama pp 2,
   dp 2) on the same global batches of a 0-8-image set, and the encoder's per-microbatch forward-time std from the
   engine's timings ("measured, 2-core CPU, gloo").
c) Planning time of ``plan_batch`` per 512-sample global batch (goal < 50 ms), timed with
   ``benchmarks/balance_planning.py``'s ``planning_ms`` on these data sets.

Writes benchmarks/results/heterogeneity.json, heterogeneity.png (bars) and heterogeneity_timeline_<method>.png
(replica 0 of one simulated mixed-set batch, deferred work hatched).

    python benchmarks/heterogeneity.py [--batches 16] [--vision-pp 4 --llm-pp 4] [--repeats 10] [--measure [--steps 4]]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_mm.data.metadata import SampleMeta
from lightning_mm.plan.balance import METHODS, BatchPlan
from lightning_mm.plan.schedule import build_stage_graph
from lightning_mm.planner.heterogeneity import compare_methods, simulate_plan
from lightning_mm.planner.workload import Quadratic, WorkloadModel

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

B, DP, TP, K, VISION_PP, LLM_PP = 512, 4, 2, 32, 4, 4
EFFECTIVE_FLOPS = 60e12  # per GPU: 40% of an A40's 149.7 TFLOP/s bf16 dense peak (Entrain's hardware)
PUBLISHED_VISION_TEXT_RATIO = 2.43  # Entrain Fig. 4.5, LLaVA-150K, mean of per-sample vision:text workload ratios
PUBLISHED_SPEEDUP = 1.40  # Entrain Fig. 4.12: throughput up to 1.40x
# Entrain Table 4.3, forward-time std (units unstated), (DistTrain, DIP, Entrain). The table prints the LLaVA
# Llama-1b row equal to the vision row (a repeated row).
TABLE_4_3 = {
    "synthchart": {"vision": (208.07, 102.13, 19.60), "llama-1b": (77.92, 37.45, 18.79),
                   "llama-3b": (164.55, 84.36, 40.24)},
    "llava": {"vision": (17.98, 14.82, 8.11), "llama-1b": (17.98, 14.82, 8.11), "llama-3b": (32.92, 33.27, 31.66)},
}

VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
LLAMA = {"llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
         "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)}


def _balance_planning():
    path = HERE / "balance_planning.py"
    if "balance_planning" not in sys.modules:
        spec = importlib.util.spec_from_file_location("balance_planning", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["balance_planning"] = module
        spec.loader.exec_module(module)
    return sys.modules["balance_planning"]


# ------------------------------------------------------------------------------------------------ cost model

def seed_workload(llm: str) -> tuple[WorkloadModel, dict]:
    """WorkloadModel.from_model of Qwen2.5-Vision + ``llm`` built on meta (everything trainable), the vision
    quadratic corrected for window attention."""
    import lightning_mm as lmm
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = LLAMA[llm]
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel(
            Qwen2_5_VLVisionConfig(**VISION, out_hidden_size=cfg["hidden_size"]))
        # the tower's merger already maps to the LLM's width: no extra projector
        model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tower, projector=torch.nn.Identity())},
                                    LlamaForCausalLM(LlamaConfig(**cfg)))
    model.freeze(encoders=False, projectors=False, language_model=False)
    work = WorkloadModel.from_model(model)
    q = work.encoders["vision"]
    full = len(VISION["fullatt_block_indexes"]) / VISION["depth"]
    window = (VISION["window_size"] // VISION["patch_size"]) ** 2  # 64 patches per window
    vision = Quadratic(q.a * full, q.b + q.a * (1 - full) * window, q.c)
    params = {"vision_params": sum(p.numel() for p in tower.parameters()),
              "llm_params": sum(p.numel() for p in model.language_model.parameters()),
              "from_model": {"vision": [q.a, q.b], "language_model": [work.language_model.a, work.language_model.b]},
              "vision_window_corrected": [vision.a, vision.b]}
    return WorkloadModel({"vision": vision}, work.language_model), params


# ------------------------------------------------------------------------------------------------ data sets

def _patches(h: int, w: int) -> int:
    """Qwen2.5-VL's resize (sides to multiples of 28, at least 56) in 14-px patches."""
    h, w = (max(56, round(x / 28) * 28) for x in (h, w))
    return (h // 14) * (w // 14)


def _lognormal(g, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * float(torch.randn(1, generator=g)))))))


def _meta(images: list[int], text: int) -> SampleMeta:
    return SampleMeta(text, {"vision": tuple((p, p // 4) for p in images)} if images else {})


def llava_like(n: int, seed: int) -> list[SampleMeta]:
    """LLaVA-150K-like: 90% one image, 5% two, 5% text-only; sides 336-672 px; text log-normal, median 150."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        u = float(torch.rand(1, generator=g))
        count = 1 if u < 0.90 else 2 if u < 0.95 else 0
        images = [_patches(*torch.randint(336, 673, (2,), generator=g).tolist()) for _ in range(count)]
        out.append(_meta(images, _lognormal(g, 150, 0.7, 16, 2048)))
    return out


def synthchart_like(n: int, seed: int) -> list[SampleMeta]:
    """SynthChartNet-like: one large chart image (sides 672-1344 px), short text (log-normal, median 40)."""
    g = torch.Generator().manual_seed(seed)
    return [_meta([_patches(*torch.randint(672, 1345, (2,), generator=g).tolist())], _lognormal(g, 40, 0.5, 8, 256))
            for _ in range(n)]


def mixed(n: int, seed: int) -> list[SampleMeta]:
    """Mixed: 0-8 images (uniform count) of 224-896 px sides; text log-normal, median 200, heavy tail."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        count = int(torch.randint(0, 9, (1,), generator=g))
        images = [_patches(*torch.randint(224, 897, (2,), generator=g).tolist()) for _ in range(count)]
        out.append(_meta(images, _lognormal(g, 200, 1.0, 16, 4096)))
    return out


DATASETS = {"llava": llava_like, "synthchart": synthchart_like, "mixed": mixed}


def calibrate_vision_slowdown(work: WorkloadModel, samples: int = 8192) -> tuple[float, float]:
    """kappa such that kappa x mean(encoder FLOPs / LLM FLOPs) over LLaVA-like samples = 2.43; and that mean."""
    enc, llm = work.works(llava_like(samples, 10_000))
    ratio = float((enc / llm).mean())
    return PUBLISHED_VISION_TEXT_RATIO / ratio, ratio


# ------------------------------------------------------------------------------------------------ a) simulated

def simulate_seed_scale(batches: int, repeats: int) -> tuple[list[dict], list[dict], dict]:
    graph = build_stage_graph({"vision": VISION_PP}, LLM_PP, "parallel",
                              {**{f"vision.{i}": True for i in range(VISION_PP)},
                               **{f"language_model.{i}": True for i in range(LLM_PP)}})
    bp = _balance_planning()
    rows, plan_rows, info, timelines = [], [], {}, None
    kappa = None
    for llm in LLAMA:
        work, params = seed_workload(llm)
        if kappa is None:  # calibrated once, on Llama-1B (Fig. 4.5's ratio); the same hardware factor for 3B
            kappa, flop_ratio = calibrate_vision_slowdown(work)
            info.update(vision_slowdown=kappa, llava_flop_ratio_1b=flop_ratio)
        per_work = 1.0 / (TP * EFFECTIVE_FLOPS)  # work units are forward + backward FLOPs (x3 of the forward)
        rates = {"vision": (kappa * per_work / 3, kappa * per_work * 2 / 3),
                 "language_model": (per_work / 3, per_work * 2 / 3)}
        info[llm] = params
        for name, make in DATASETS.items():
            works = [work.works(make(B, 1000 * s + 1)) for s in range(batches)]
            enc_all, llm_all = torch.cat([w[0] for w in works]), torch.cat([w[1] for w in works])
            ratio = float((kappa * enc_all / llm_all).mean())
            t = time.perf_counter()
            reports, sims = compare_methods(graph, works, rates, DP, K, keep=True)
            wall = time.perf_counter() - t
            base = reports["none"].iteration_time
            # ablation: entrain's plans with their LLM work kept in place (no deferral)
            kept = statistics.fmean(simulate_plan(graph, BatchPlan(sim.plan.assignment), enc, l, rates).iteration_time
                                    for sim, (enc, l) in zip(sims["entrain"], works))
            for method, r in reports.items():
                idle = statistics.fmean(v / r.iteration_time for v in r.idle.values())
                published = TABLE_4_3.get(name, {})
                pub_col = {"disttrain": 0, "entrain": 2}.get(method)
                rows.append(dict(
                    dataset=name, llm=llm, method=method, label="simulated",
                    iteration_s=r.iteration_time, iteration_s_per_batch=list(r.iteration_times),
                    speedup_vs_none=base / r.iteration_time,
                    vision_forward_std_ms=1e3 * r.module_forward_std("vision"),
                    llm_forward_std_ms=1e3 * r.module_forward_std("language_model"),
                    mean_idle_fraction=idle, idle_s_per_rank=r.idle, deferred_samples=r.deferred_samples,
                    vision_text_workload_ratio=ratio,
                    **({"iteration_s_without_deferral": kept} if method == "entrain" else {}),
                    published_vision_std=None if pub_col is None or not published else published["vision"][pub_col],
                    published_llm_std=None if pub_col is None or not published else published[llm][pub_col],
                    published_label="published (Entrain Table 4.3, units unstated)" if published and
                    pub_col is not None else None))
            print(f"  simulated {llm} {name}: {batches} batches x {len(METHODS)} methods in {wall:.1f} s")
            if name == "mixed" and llm == "llama-1b":
                timelines = {m: sims[m][0].replicas[0] for m in ("none", "entrain")}
            for method in METHODS:
                times = [t for enc, l in works[:2] for t in bp.planning_ms(enc, l, method, repeats, DP, K,
                                                                           VISION_PP + LLM_PP)]
                plan_rows.append(dict(dataset=name, llm=llm, method=method, label="measured, planning on this CPU",
                                      plan_ms_median=statistics.median(times), plan_ms_max=max(times),
                                      goal_ms=bp.GOAL_PLAN_MS))
    info["timelines"] = timelines
    return rows, plan_rows, info


# ------------------------------------------------------------------------------------------------ b) measured

MEASURE = dict(microbatches=4, batch_size=8, items=(0, 8), max_side=7, text=(8, 64), samples=96)


def worker(spec: str, out: str) -> None:
    """One Lightning run (re-launched for every rank by Lightning): vision pp 1 + LLM pp 2, dp 2 on gloo."""
    case = json.loads(spec)
    torch.set_num_threads(1)
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    import lightning_mm as lmm
    from lightning_mm.data.synthetic import SyntheticMultimodalDataset
    from lightning_mm.model import tiny_encoder, tiny_language_model

    class Images(SyntheticMultimodalDataset):
        """Images of 2..2*max_side patches a side (the default gives 2 or 4)."""

        def _items(self, enc, n, g):
            m = enc.config.spatial_merge_size
            side = lambda: m * int(torch.randint(1, case["max_side"] + 1, (1,), generator=g))  # noqa: E731
            return enc.family.random_inputs(enc.config, n, generator=g, grids=[(1, side(), side()) for _ in range(n)])

    class Data(lmm.data.SyntheticMultimodalDataModule):
        def _dataset(self, n, seed):
            h = self.hparams
            return Images(self.model, n, tuple(h.text_tokens), tuple(h.items_per_sample), "ee", seed)

        def _loader(self, n, seed, shuffle):  # every method: the same DistributedSampler global batches
            data = self._dataset(n, seed)
            sampler = DistributedSampler(data, shuffle=shuffle, seed=seed,
                                         **self.trainer.strategy.distributed_sampler_kwargs)
            return DataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler, collate_fn=self.collator(),
                              drop_last=True)

    class Timer(L.Callback):
        def __init__(self):
            self.steps, self.encoder = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            dist.barrier()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            dist.barrier()
            self.steps.append(time.perf_counter() - self.t0)
            engine = trainer.strategy.engine
            if engine.stage.startswith("vision"):
                self.encoder.append([end - start for kind, _, start, end in engine.timings if kind == "forward"])

    torch.manual_seed(0)
    vision = lmm.ModalityEncoder(tiny_encoder("qwen2_vl", embed_dim=64, num_heads=4, depth=4))
    llm = tiny_language_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=4)
    model = lmm.MultimodalModel({"vision": vision}, llm)
    model.freeze(encoders=False, projectors=False, language_model=False)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec(pp=1)},
                                              language_model=lmm.ParallelSpec(pp=2),
                                              num_microbatches=case["microbatches"],
                                              batch_balancing=case["method"], process_group_backend="gloo")
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=6, strategy=strategy, max_steps=case["steps"], callbacks=[timer],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    data = Data(num_samples=case["samples"], batch_size=case["batch_size"], text_tokens=tuple(case["text"]),
                items_per_sample=tuple(case["items"]))
    trainer.fit(module, data)
    engine = trainer.strategy.engine
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"stage": engine.stage, "dp": engine.coord.dp, "steps": timer.steps, "encoder": timer.encoder}, f)


def measure(steps: int, warmup: int) -> list[dict]:
    rows = []
    global_batch = MEASURE["batch_size"] * 2
    for method in METHODS:
        case = {**MEASURE, "method": method, "steps": steps + warmup}
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(case), out], capture_output=True,
                                  text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode:
                raise RuntimeError(f"measured run {method} failed:\n{proc.stderr[-4000:]}")
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        step_s = statistics.median(ranks[0]["steps"][warmup:])
        encoder = [r for r in ranks if r["stage"].startswith("vision")]
        stds = [statistics.stdev(mb) for r in encoder for mb in r["encoder"][warmup:] if len(mb) > 1]
        rows.append(dict(method=method, label="measured, 2-core CPU, gloo", processes=len(ranks),
                         global_batch=global_batch, steps=steps, warmup=warmup, step_s_median=step_s,
                         samples_per_s=global_batch / step_s, step_s=ranks[0]["steps"],
                         encoder_forward_std_ms=1e3 * statistics.fmean(stds) if stds else None,
                         wall_s=time.perf_counter() - t))
        print(f"  measured {method}: {global_batch / step_s:.2f} samples/s")
    return rows


# ------------------------------------------------------------------------------------------------ output

def plot(rows: list[dict], timelines, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    from lightning_mm.planner.simulator import timeline_png

    keys = [(d, l) for l in LLAMA for d in DATASETS]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.27
    for i, method in enumerate(METHODS):
        by = {(r["dataset"], r["llm"]): r for r in rows if r["method"] == method}
        x = [j + (i - 1) * width for j in range(len(keys))]
        axes[0].bar(x, [by[k]["speedup_vs_none"] for k in keys], width, label=method)
        axes[1].bar(x, [by[k]["vision_forward_std_ms"] for k in keys], width, label=method)
    for ax, title in ((axes[0], "simulated throughput vs none (x)"),
                      (axes[1], "simulated vision microbatch forward std (ms)")):
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{d}\n{l}" for d, l in keys], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[0].axhline(PUBLISHED_SPEEDUP, color="grey", linestyle="--", linewidth=0.8)
    axes[0].text(len(keys) - 0.5, PUBLISHED_SPEEDUP, "published: up to 1.40x (Fig. 4.12)", ha="right",
                 va="bottom", fontsize=7, color="grey")
    fig.suptitle(f"Batch balancing, simulated: Qwen2.5-Vision + Llama-3.2, B {B}, dp {DP}, tp {TP}, {K} microbatches,"
                 f" vision pp {VISION_PP} + LLM pp {LLM_PP}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    for method, result in (timelines or {}).items():
        timeline_png(result, path.with_name(f"heterogeneity_timeline_{method}.png"),
                     title=f"simulated, mixed set, Llama-1B, replica 0, {method}: {result.iteration_time:.2f} s",
                     xlabel="time (s)")


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main() -> None:
    global VISION_PP, LLM_PP
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=16, help="simulated global batches per data set")
    ap.add_argument("--vision-pp", type=int, default=VISION_PP, help="vision stages per replica (simulated)")
    ap.add_argument("--llm-pp", type=int, default=LLM_PP, help="LLM stages per replica (simulated)")
    ap.add_argument("--repeats", type=int, default=10, help="timed planning runs per batch (2 batches)")
    ap.add_argument("--measure", action="store_true", help="also run the CPU processes (6 ranks, a few minutes)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per method (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    VISION_PP, LLM_PP = args.vision_pp, args.llm_pp
    print(f"a) simulated: B {B}, dp {DP}, tp {TP}, {K} microbatches, vision pp {VISION_PP} + LLM pp {LLM_PP}")
    rows, plan_rows, info = simulate_seed_scale(args.batches, args.repeats)
    timelines = info.pop("timelines")
    print(f"vision seconds per FLOP = {info['vision_slowdown']:.2f} x the LLM's (LLaVA-like FLOP ratio "
          f"{info['llava_flop_ratio_1b']:.2f} -> published workload ratio {PUBLISHED_VISION_TEXT_RATIO})")
    print(f"{'data':10} {'llm':8} {'method':9} | {'iter s':>7} {'x none':>6} {'vis std':>8} {'llm std':>8} "
          f"{'idle':>5} {'defer':>5} | {'pub vis':>7} {'pub llm':>7}")
    print(f"{'':29}| {'simulated':^45} | {'published':^15}")
    for r in rows:
        print(f"{r['dataset']:10} {r['llm']:8} {r['method']:9} | {r['iteration_s']:7.3f} {r['speedup_vs_none']:6.3f} "
              f"{r['vision_forward_std_ms']:8.2f} {r['llm_forward_std_ms']:8.2f} {r['mean_idle_fraction']:5.2f} "
              f"{r['deferred_samples']:5.1f} | {_fmt(r['published_vision_std'], '7.2f')} "
              f"{_fmt(r['published_llm_std'], '7.2f')}")
    ratios = []
    for name in TABLE_4_3:
        for llm in LLAMA:
            get = {r["method"]: r for r in rows if r["dataset"] == name and r["llm"] == llm}
            pub = TABLE_4_3[name]
            ratios.append(dict(dataset=name, llm=llm,
                               simulated_vision=get["disttrain"]["vision_forward_std_ms"] /
                               max(get["entrain"]["vision_forward_std_ms"], 1e-12),
                               published_vision=pub["vision"][0] / pub["vision"][2],
                               simulated_llm=get["disttrain"]["llm_forward_std_ms"] /
                               max(get["entrain"]["llm_forward_std_ms"], 1e-12),
                               published_llm=pub[llm][0] / pub[llm][2],
                               simulated_speedup_vs_disttrain=get["disttrain"]["iteration_s"] /
                               get["entrain"]["iteration_s"]))
    print("forward std ratio disttrain/entrain (simulated vs published Table 4.3), and entrain's speedup over "
          "disttrain (simulated; published: up to 1.40x over the baselines, Fig. 4.12):")
    for q in ratios:
        print(f"  {q['dataset']:10} {q['llm']:8} vision {q['simulated_vision']:6.2f} (published "
              f"{q['published_vision']:5.2f})  llm {q['simulated_llm']:6.2f} (published {q['published_llm']:5.2f})  "
              f"speedup {q['simulated_speedup_vs_disttrain']:.3f}")
    print("entrain with its deferrals dropped (simulated ablation; same plans, LLM work kept in place):")
    for r in rows:
        if r["method"] == "entrain":
            print(f"  {r['dataset']:10} {r['llm']:8} {r['iteration_s_without_deferral']:7.3f} s vs "
                  f"{r['iteration_s']:7.3f} s with deferral")
    print("c) planning time per global batch of 512 (ms, this CPU):")
    for r in plan_rows:
        print(f"  {r['dataset']:10} {r['llm']:8} {r['method']:9} median {r['plan_ms_median']:6.2f} "
              f"max {r['plan_ms_max']:6.2f} (goal < {r['goal_ms']:.0f})")
    measured = []
    if args.measure:
        print("b) measured, 2-core CPU, gloo: 6 processes (vision pp 1 + LLM pp 2, dp 2), tiny models")
        measured = measure(args.steps, args.warmup)
        for r in measured:
            print(f"  {r['method']:9} {r['samples_per_s']:7.2f} samples/s  step {r['step_s_median']:.3f} s  "
                  f"encoder microbatch forward std {_fmt(r['encoder_forward_std_ms'], '.2f')} ms")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "heterogeneity.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps(dict(
        setting=dict(batch=B, dp=DP, tp=TP, microbatches=K, vision_pp=VISION_PP, llm_pp=LLM_PP,
                     effective_flops_per_gpu=EFFECTIVE_FLOPS, batches=args.batches,
                     cost_source="WorkloadModel.from_model on meta-built transformers models (Qwen2.5-VL vision "
                                 "tower, LlamaForCausalLM), window-attention corrected; vision slowdown calibrated",
                     allreduce="not modelled", **info),
        published=dict(table_4_3=TABLE_4_3, speedup_up_to=PUBLISHED_SPEEDUP,
                       vision_text_workload_ratio=PUBLISHED_VISION_TEXT_RATIO,
                       label="published (Entrain: Table 4.3, Fig. 4.5, Fig. 4.12)"),
        simulated=rows, std_ratios=ratios, planning=plan_rows,
        measured=measured or previous.get("measured", []),
        machine=platform.processor() or platform.machine(), torch=torch.__version__), indent=1))
    print(f"wrote {out}")
    plot(rows, timelines, RESULTS / "heterogeneity.png")


if __name__ == "__main__":
    main()
