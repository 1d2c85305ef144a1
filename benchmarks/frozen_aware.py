"""Frozen-aware vs frozen-unaware planning on the seeds' MLLM configurations (003 Table 3.2), simulated.

Models, setting and cost sources: docs/planner.md, "`benchmarks/frozen_aware.py`: the seeds' Table 3.2, reproduced".
Run: `python benchmarks/frozen_aware.py [--skip-free] [--configs MMM,LLL] [--layer-profile PROFILE.json]`.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import harness
from lightning_mm.planner import (ModuleSpec, ModuleTimes, chrome_trace, evaluate_plan, mllm_layer_costs,
                                  partition_module, plan_summary, search, timeline_png)
from lightning_mm.planner.costs import fit_cost_model

LM = "language_model"
# 003 Table 3.1: (layers, hidden, parameters)
LLAMA3 = {"S": (16, 2048, 1.0e9), "M": (32, 4096, 8.0e9), "L": (64, 5120, 32.0e9)}
QWEN2_VISION = {"S": (32, 1280, 0.6e9), "M": (48, 2560, 3.9e9), "L": (64, 3840, 11.6e9)}
PHI4_AUDIO = {"S": (24, 1024, 0.5e9), "M": (32, 3072, 3.4e9), "L": (48, 5120, 12.4e9)}
FAMILY_TABLES = {"llama3": LLAMA3, "qwen2_vision": QWEN2_VISION, "phi4_audio": PHI4_AUDIO}  # layer_profile.py's names
ENCODERS = {"vision": "qwen2_vision", "audio": "phi4_audio"}
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
SEED_STAGES = 6  # inferred (see docs/planner.md): 24 GPUs / (TP2 x CP2); "a maximum of 6 pipeline stages" (001)
STAGE_GPUS = 4
MICROBATCHES = 12
STAGE_COLUMNS = ("enc_fwd_ms", "llm_fwd_ms", "enc_bwd_ms", "llm_bwd_ms")

TEXT_TOKENS = 1000
VISION_PATCHES = (1288 // 14) * (728 // 14)  # Qwen2-VL resizes to multiples of 28: 92 x 52 patches of 14 px
VISION_MERGE = 4  # 2x2 patch merge before the LLM
AUDIO_TOKENS = 1500  # Phi-4 audio: 120 s at 80 ms per token
# per encoder: tokens in, tokens to the LLM, projector input features / encoder hidden
ENCODER_TOKENS = {"vision": (VISION_PATCHES, VISION_PATCHES // VISION_MERGE, VISION_MERGE),
                  "audio": (AUDIO_TOKENS, AUDIO_TOKENS, 1)}
SAMPLES_PER_MICROBATCH = 4
EFFECTIVE_FLOPS = 0.45 * 149.7e12  # A40 bf16 dense peak at 45% MFU
LINK_BYTES_PER_S = 25e9  # 200 Gb/s InfiniBand
ALLREDUCE = {"allreduce_bandwidth": LINK_BYTES_PER_S}  # data-parallel gradient all-reduce, timed by the search
MEMORY_LIMIT = 48e9
# the seeds train with activation recomputation (003 Fig. 3.1): a layer keeps only its bf16 input
ACTIVATION_BYTES = SAMPLES_PER_MICROBATCH * 2  # per token and hidden unit
BASELINES = ("forward-variance", "forward-only")
SOURCES = ("flops", "per_layer_loo", "seed_fitted")
SOURCE_NAMES = {"flops": "FLOP costs", "per_layer_loo": "leave-one-config-out", "seed_fitted": "seed-fitted profile",
                "measured": "measured layer profile"}
TIMES = ("forward_s", "input_grad_s", "weight_grad_s")


@dataclass(frozen=True)
class SeedFittedProfile:
    """Scales of the FLOP costs fitted to the seeds' published per-stage times: encoder forward per configuration
    ("MMM", or per encoder pair "MM" when `per_pair`), LLM forward and backward/forward per LLM size, and the
    inferred encoder stages of each configuration's aware and unaware row."""

    per_pair: bool
    encoder_forward: dict[str, float]
    llm_forward: dict[str, float]
    llm_backward_ratio: dict[str, float]
    splits: dict[str, tuple[int, int]]
    rms_log_error: float
    fitted_on: tuple[str, ...]


@dataclass(frozen=True)
class MeasuredProfile:
    """Per-layer seconds per microbatch measured by `benchmarks/layer_profile.py` on one device, by family, size
    and the benchmark's token count; projectors by modality and "<encoder size>-><LLM size>"."""

    path: str
    device: str
    meta: dict
    layers: dict
    projectors: dict

    def layer_times(self, family: str, size: str, tokens: int, gpus: int = 1) -> tuple[float, ...]:
        """(forward, input-grad, weight-grad) seconds of one layer on a stage of `gpus` devices (ideal TP/CP)."""
        samples = self.layers[family][size]["tokens"]
        if str(tokens) in samples:
            return tuple(samples[str(tokens)][k] / gpus for k in TIMES)
        if len(samples) < 3:  # a fit through fewer points would be a guess: measure the count instead
            raise KeyError(f"{self.path}: {family} {size} was measured at {sorted(samples, key=int)} tokens only, "
                           f"the benchmark needs {tokens}; re-run benchmarks/layer_profile.py")
        xs = sorted(samples, key=int)
        return tuple(fit_cost_model([int(x) for x in xs], [samples[x][k] for x in xs])(tokens) / gpus for k in TIMES)

    def llm_backward_ratio(self, size: str, tokens: int) -> float:
        """A frozen LLM layer's backward / forward: input grad + the recomputed forward."""
        f, d, _ = self.layer_times("llama3", size, tokens)
        return (d + f) / f


def load_measured_profile(path: Path | str) -> MeasuredProfile:
    """A `benchmarks/layer_profile.py` JSON holding every family and size of the tables and every projector pair."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != "lightning-mm layer profile":
        raise ValueError(f"{path} is not a layer profile of benchmarks/layer_profile.py (format {doc.get('format')!r})")
    missing = [f"{family} {size}" for family, table in FAMILY_TABLES.items() for size in table
               if size not in doc.get("layers", {}).get(family, {})]
    missing += [f"{m} projector {pair}" for m, family in ENCODERS.items() for e in FAMILY_TABLES[family]
                for pair in (f"{e}->{llm}" for llm in LLAMA3) if pair not in doc.get("projectors", {}).get(m, {})]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; re-run benchmarks/layer_profile.py")
    meta = {k: doc.get(k) for k in ("device_type", "torch", "transformers", "dtype", "tiny", "shrink", "audio_layer",
                                     "samples_per_microbatch")}
    return MeasuredProfile(str(path), doc.get("device", "?"), meta, doc["layers"], doc["projectors"])


def transformer_layer_times(tokens: int, hidden: int, params_per_layer: float, causal: bool,
                            gpus: int = 1) -> tuple[float, float, float]:
    """(forward, input-grad, weight-grad) seconds of one layer on one microbatch from FLOPs, on `gpus` devices."""
    attention = (2 if causal else 4) * tokens * tokens * hidden
    dense = 2 * tokens * params_per_layer
    return tuple(SAMPLES_PER_MICROBATCH * f / (gpus * EFFECTIVE_FLOPS) for f in (dense + attention,
                                                                                  dense + 2 * attention, dense))


def mllm_modules(vision: str | None, audio: str | None, llm: str, gpus: int = 1,
                 profile: SeedFittedProfile | None = None,
                 measured: MeasuredProfile | None = None) -> tuple[dict[str, ModuleSpec], float]:
    """Planner input for one configuration on stages of `gpus` devices, and its P2P latency (one microbatch of LLM
    hidden states): frozen encoders, each with a trainable 2-layer MLP projector as its last layer, and a frozen
    LLM. Times from FLOPs, rescaled to the seeds' by `profile`, or a `measured` layer profile's."""
    layers, hidden, params = LLAMA3[llm]
    scale = profile.encoder_forward[f"{vision}{audio}" + ("" if profile.per_pair else llm)] if profile else 1.0
    llm_tokens, raw = TEXT_TOKENS, {}
    for modality, size in (("vision", vision), ("audio", audio)):
        if not size:
            continue
        family, (tokens, out_tokens, merge) = ENCODERS[modality], ENCODER_TOKENS[modality]
        n, enc_hidden, enc_params = FAMILY_TABLES[family][size]
        proj_params = merge * enc_hidden * hidden + hidden * hidden
        if measured is not None:
            f, d, w = measured.layer_times(family, size, tokens, gpus)
            pf, pd, pw = (measured.projectors[modality][f"{size}->{llm}"][k] / gpus for k in TIMES)
        else:
            f, d, w = (scale * t for t in transformer_layer_times(tokens, enc_hidden, enc_params / n,
                                                                     causal=False, gpus=gpus))
            pf = pd = pw = scale * SAMPLES_PER_MICROBATCH * 2 * out_tokens * proj_params / (gpus * EFFECTIVE_FLOPS)
        raw[modality] = (ModuleTimes([f] * n + [pf], [d] * n + [pd], [w] * n + [pw], [True] * n + [False]),
                         [2.0 * enc_params / n] * n + [16.0 * proj_params],
                         [ACTIVATION_BYTES * tokens * enc_hidden] * n + [ACTIVATION_BYTES * out_tokens * hidden],
                         [0.0] * n + [4.0 * proj_params])  # fp32 gradients of the trainable projector
        llm_tokens += out_tokens
    if measured is not None:
        f, d, w = measured.layer_times("llama3", llm, llm_tokens, gpus)
    else:
        f, d, w = transformer_layer_times(llm_tokens, hidden, params / layers, causal=True, gpus=gpus)
    if profile:  # the published backward of a frozen layer = input grad + recomputed forward
        f, w = f * profile.llm_forward[llm], w * profile.llm_forward[llm]
        d = f * (profile.llm_backward_ratio[llm] - 1.0)
    llm_times = ModuleTimes([f] * layers, [d] * layers, [w] * layers, True)
    costs = mllm_layer_costs({name: r[0] for name, r in raw.items()}, llm_times, recompute=True)
    modules = {name: ModuleSpec(costs[name], *r[1:]) for name, r in raw.items()}
    modules[LM] = ModuleSpec(costs[LM], 2.0 * params / layers, ACTIVATION_BYTES * llm_tokens * hidden)
    return modules, SAMPLES_PER_MICROBATCH * llm_tokens * hidden * 2 / LINK_BYTES_PER_S


def stage_breakdown(plan) -> dict[str, float]:
    """The seeds' Table 3.2 columns for one plan, in ms: the slowest encoder / LLM stage's forward and backward."""
    def worst(kind, llm):
        return 1e3 * max([v for st, v in getattr(plan, kind).items() if st.startswith(LM) == llm], default=0.0)
    return dict(zip(STAGE_COLUMNS, (worst(kind, llm) for kind in ("forward", "backward") for llm in (False, True))))


def split(plan) -> str:
    """Encoder stages + LLM stages, e.g. '2+4' (colocated: the merged encoder module's stage count)."""
    pp = plan.pp()
    enc = [n for m, n in pp.items() if m != LM]
    enc_stages = (enc[0] if enc else 0) if plan.placement == "colocated" else sum(enc)
    return f"{enc_stages}+{pp[LM]}"


def describe(plan) -> str:
    pp = "/".join(f"{m[:1]}{n}" for m, n in plan.pp().items())
    return f"{plan.placement[:3]} dp{plan.dp} {pp}"


def colocated_plan(modules, enc_stages: int, latency: float, mode: str, stages: int = SEED_STAGES):
    """The `stages`-stage colocated layout with `enc_stages` encoder stages, boundaries by `mode`'s partition."""
    mode = mode if mode == "frozen-aware" else "forward-only"
    layers = {m: partition_module(spec.costs, stages - enc_stages if m == LM else enc_stages, mode)
              for m, spec in modules.items()}
    return evaluate_plan(modules, layers, "colocated", MICROBATCHES, 1, latency, STAGE_GPUS * MEMORY_LIMIT)


@functools.cache
def flop_stage_forward(key: str, enc_stages: int) -> tuple[float, float]:
    """FLOP-model forward (ms) of the slowest encoder stage and LLM stage of a forward-balanced colocated layout."""
    modules, latency = mllm_modules(*key, gpus=STAGE_GPUS)
    b = stage_breakdown(colocated_plan(modules, enc_stages, latency, "forward-only"))
    return b["enc_fwd_ms"], b["llm_fwd_ms"]


def _spread(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values)


@functools.cache
def infer_seed_splits(keys: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The encoder stage counts (aware row, unaware row) of each published configuration: per LLM size, the
    joint choice over its configurations minimising the spread of log(published / FLOP) forward, of the
    encoders per configuration and of the LLM per size (one scale each; brute force, 25 choices per config)."""
    out = {}
    for size in "SML":
        group = [k for k in keys if k[2] == size]
        best = None
        for combo in itertools.product(itertools.product(range(1, SEED_STAGES), repeat=2), repeat=len(group)):
            llm_logs, error = [], 0.0
            for key, rows in zip(group, combo):
                enc_logs = []
                for row, enc in zip(SEED_TABLE_3_2[key], rows):
                    enc_ms, llm_ms = flop_stage_forward(key, enc)
                    enc_logs.append(math.log(row[0] / enc_ms))
                    llm_logs.append(math.log(row[1] / llm_ms))
                error += _spread(enc_logs)
            error += _spread(llm_logs)
            if best is None or error < best[0]:
                best = (error, combo)
        out.update(zip(group, best[1]) if best else ())
    return out


def fit_seed_profile(keys: tuple[str, ...], per_pair: bool = False) -> SeedFittedProfile:
    """Scales of the FLOP costs fitted (geometric means) to the seeds' published per-stage times of the Table 3.2
    rows of `keys`; never to their iteration times, which are what the benchmark predicts."""
    splits = infer_seed_splits(keys)
    enc, fwd, ratio = {}, {}, {}
    for key in keys:
        for row, e in zip(SEED_TABLE_3_2[key], splits[key]):
            enc_ms, llm_ms = flop_stage_forward(key, e)
            enc.setdefault(key[:2] if per_pair else key, []).append(math.log(row[0] / enc_ms))
            fwd.setdefault(key[2], []).append(math.log(row[1] / llm_ms))
            ratio.setdefault(key[2], []).append(math.log(row[3] / row[1]))
    logs = (enc, fwd, ratio)
    residuals = [x - sum(v) / len(v) for log in logs for v in log.values() for x in v]
    return SeedFittedProfile(per_pair, *({k: math.exp(sum(v) / len(v)) for k, v in log.items()} for log in logs),
                             splits, math.sqrt(sum(r * r for r in residuals) / len(residuals)), keys)


def seed_setting_plans(key: str, profile: SeedFittedProfile | None, stages: int,
                       measured: MeasuredProfile | None = None):
    """Each planner's best layout for MLLM-<key> in the Table 3.2 setting, timed with the true costs; the free
    search (dp, stage counts <= `stages`, parallel or colocated); the best hand split of `stages`."""
    modules, latency = mllm_modules(*key, gpus=STAGE_GPUS, profile=profile, measured=measured)
    given = (modules, stages, MICROBATCHES, STAGE_GPUS * MEMORY_LIMIT, latency)
    plans = {mode: search(*given, mode=mode, placements=("colocated",), data_parallel=False, stages=stages,
                          **ALLREDUCE).best for mode in ("frozen-aware", *BASELINES)}
    hands = search(*given, data_parallel=False, stages=stages, placements=("colocated", "parallel"), **ALLREDUCE)
    best_hand = min((p for p in hands.candidates if p.fits_memory), key=lambda p: p.iteration_time)
    return plans, search(*given, **ALLREDUCE).best, best_hand


def describe_plans(plans, auto, best_hand) -> dict:
    aware = plans["frozen-aware"]
    out = {"aware_s": aware.iteration_time, "aware_split": split(aware), "aware_layers": aware.layers,
           "aware_stages_ms": stage_breakdown(aware), "aware_summary": plan_summary(aware),
           "auto_s": auto.iteration_time, "auto_plan": describe(auto), "best_hand_s": best_hand.iteration_time,
           "best_hand_plan": f"{best_hand.placement[:3]} {split(best_hand)}",
           "auto_vs_best_hand": best_hand.iteration_time / auto.iteration_time}
    for mode in BASELINES:
        plan = plans[mode]
        out[mode] = {"s": plan.iteration_time, "split": split(plan), "stages_ms": stage_breakdown(plan),
                     "ratio": plan.iteration_time / aware.iteration_time, "summary": plan_summary(plan)}
    return out


def seed_setting_row(key: str, stages: int, full: SeedFittedProfile, out: Path | None,
                     measured: MeasuredProfile | None = None) -> dict:
    """One configuration of 003 Table 3.2 on each cost source (FLOPs; the seed-fitted profile fitted on the other
    configurations only, and on all of them; a measured layer profile when given), and the seeds' inferred layouts
    re-timed with the seed-fitted profile (how well profile + simulator reproduce the seeds' published times)."""
    seed_aware, seed_unaware = SEED_TABLE_3_2[key]
    held_out = fit_seed_profile(tuple(k for k in SEED_TABLE_3_2 if k != key), per_pair=True)
    row = {"config": f"MLLM-{key}", "seed_aware_s": seed_aware[4], "seed_unaware_s": seed_unaware[4],
           "seed_ratio": seed_unaware[4] / seed_aware[4],
           "seed_splits": [f"{e}+{stages - e}" for e in full.splits[key]],
           "seed_aware_stages_ms": dict(zip(STAGE_COLUMNS, seed_aware[:4])),
           "seed_unaware_stages_ms": dict(zip(STAGE_COLUMNS, seed_unaware[:4]))}
    sources = {"flops": None, "per_layer_loo": held_out, "seed_fitted": full}
    if measured is not None:
        sources["measured"] = None
    for source, profile in sources.items():
        plans, auto, best_hand = seed_setting_plans(key, profile, stages, measured if source == "measured" else None)
        row[source] = describe_plans(plans, auto, best_hand)
        if out is not None and key == "MMM" and source != "per_layer_loo":
            on = f", layers measured on {measured.device}" if source == "measured" else ""
            for tag, mode in (("aware", "frozen-aware"), ("seeds_baseline", "forward-variance")):
                name = f"frozen_aware_{source}_{key}_{tag}"
                timeline_png(plans[mode].result, out / f"{name}.png", scale=1e3, xlabel=f"simulated time (ms{on})",
                             title=f"MLLM-{key}, {SOURCE_NAMES[source]}, {mode}: {split(plans[mode])}")
                chrome_trace(plans[mode].result, out / f"{name}.trace.json")
    modules, latency = mllm_modules(*key, gpus=STAGE_GPUS, profile=full)
    aware, unaware = (colocated_plan(modules, e, latency, mode, stages)
                      for e, mode in zip(full.splits[key], ("frozen-aware", "forward-variance")))
    row["seed_layouts_simulated_s"] = [aware.iteration_time, unaware.iteration_time]
    row["seed_layouts_simulated_ratio"] = unaware.iteration_time / aware.iteration_time
    row["ours_vs_seed_aware_layout"] = aware.iteration_time / row["seed_fitted"]["aware_s"]
    row["meets_seed"] = {s: row[s]["forward-variance"]["ratio"] >= row["seed_ratio"] - 0.005
                         for s in SOURCE_NAMES if s in row}
    return row


def hand_plans(modules, devices: int, microbatches: int, latency: float):
    """The plans a person would try: dp dividing the microbatches, LLM pp in {1,2,4,6,8}, encoder pp in
    {1,2,4}, parallel and colocated, frozen-aware boundaries."""
    encoders = [m for m in modules if m != LM]
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
                layers[LM] = partition_module(modules[LM].costs, lp)
                plans.append(evaluate_plan(modules, layers, placement, microbatches, dp, latency, MEMORY_LIMIT,
                                           **ALLREDUCE))
    return [p for p in plans if p.fits_memory]


def run_config(name: str, vision, audio, llm, devices: int, microbatches: int, out: Path | None) -> dict:
    """The free search of each mode on `devices` single GPUs (FLOP costs), with the ablations: pipeline only (no
    dp, the seeds' partitioning ablation), the aware plan's stage counts with forward-only boundaries, hand plans."""
    modules, latency = mllm_modules(vision, audio, llm)
    given = (modules, devices, microbatches, MEMORY_LIMIT, latency)
    started = time.perf_counter()
    aware = search(*given, **ALLREDUCE)
    unaware = search(*given, mode="forward-only", **ALLREDUCE)
    search_s = time.perf_counter() - started
    pp_aware, pp_unaware = (search(*given, mode=mode, data_parallel=False).best
                            for mode in ("frozen-aware", "forward-only"))
    b = aware.best
    same_layers = {m: partition_module(modules[m].costs, n, "forward-only") for m, n in b.pp().items()}
    boundaries_only = evaluate_plan(modules, same_layers, b.placement, microbatches, b.dp, latency, MEMORY_LIMIT,
                                    **ALLREDUCE)
    hands = hand_plans(modules, devices, microbatches, latency)
    hand = min(hands, key=lambda p: p.iteration_time) if hands else None
    if out is not None and name == "VALM-MMM":
        for tag, plan in (("aware", b), ("unaware", unaware.best)):
            timeline_png(plan.result, out / f"frozen_aware_{name}_{tag}.png", title=f"{name} {tag}: {describe(plan)}",
                         scale=1e3, xlabel="simulated time (ms, FLOP costs)")
            chrome_trace(plan.result, out / f"frozen_aware_{name}_{tag}.trace.json")
    seed = [r[4] for r in SEED_TABLE_3_2[name[5:]]] if name.startswith("VALM-") else None
    return {
        "config": name, "frozen_aware_s": b.iteration_time, "forward_only_s": unaware.best.iteration_time,
        "speedup": unaware.best.iteration_time / b.iteration_time,
        "pp_only_aware_s": pp_aware.iteration_time, "pp_only_forward_only_s": pp_unaware.iteration_time,
        "pp_only_speedup": pp_unaware.iteration_time / pp_aware.iteration_time,
        "pp_only_aware_plan": describe(pp_aware), "pp_only_unaware_plan": describe(pp_unaware),
        "boundaries_only_speedup": boundaries_only.iteration_time / b.iteration_time,
        "seed_aware_s": seed and seed[0], "seed_unaware_s": seed and seed[1],
        "seed_speedup": seed and seed[1] / seed[0],
        "aware_plan": describe(b), "unaware_plan": describe(unaware.best), "aware_layers": b.layers,
        "best_hand_s": hand and hand.iteration_time, "best_hand_plan": hand and describe(hand),
        "hand_plans": len(hands), "auto_vs_best_hand": hand and hand.iteration_time / b.iteration_time,
        "search_candidates": len(aware.candidates), "search_seconds": search_s, "aware_summary": plan_summary(b)}


def configurations():
    for vision, audio, llm in SEED_TABLE_3_2:
        yield f"VALM-{vision}{audio}{llm}", vision, audio, llm
    for size in "SML":
        yield f"VLM-{size}", size, None, size
        yield f"ALM-{size}", None, size, size


def main(argv=None):
    args = harness.cli(
        __doc__, argv, devices=24, microbatches=12, out=harness.RESULTS,
        stages=(SEED_STAGES, "fixed stage count of the Table 3.2 setting"),
        skip_free=(False, "only the Table 3.2 setting"),
        layer_profile=dict(type=Path, help="a benchmarks/layer_profile.py JSON: adds the 'measured layer profile' "
                                           "cost source to the Table 3.2 setting and writes frozen_aware_measured.json "
                                           "instead of frozen_aware.json"),
        configs=dict(help="comma-separated Table 3.2 configurations to run, e.g. MMM,LLL (default: all 9; the "
                          "profile fits always use all 9)"))
    start = harness.record()
    keys = tuple(SEED_TABLE_3_2)
    if args.configs:
        keys = tuple(k.strip().upper().removeprefix("MLLM-") for k in args.configs.split(","))
        if set(keys) - set(SEED_TABLE_3_2):
            raise SystemExit(f"--configs: unknown {sorted(set(keys) - set(SEED_TABLE_3_2))}; choose from "
                             f"{', '.join(SEED_TABLE_3_2)}")
    measured = load_measured_profile(args.layer_profile) if args.layer_profile else None
    args.out.mkdir(parents=True, exist_ok=True)
    full, per_pair = (fit_seed_profile(tuple(SEED_TABLE_3_2), per_pair=p) for p in (False, True))
    seed_rows = [seed_setting_row(key, args.stages, full, args.out, measured) for key in keys]
    sources = SOURCES + (("measured",) if measured is not None else ())
    rows = [] if args.skip_free else [run_config(*cfg, args.devices, args.microbatches, args.out)
                                      for cfg in configurations()]
    doc = {"devices": args.devices, "microbatches": args.microbatches, "memory_limit": MEMORY_LIMIT,
           "recompute": True, "effective_flops": EFFECTIVE_FLOPS, "stages": args.stages, "stage_gpus": STAGE_GPUS,
           "tokens": {"text": TEXT_TOKENS, "vision_patches": VISION_PATCHES,
                      "vision_to_llm": VISION_PATCHES // VISION_MERGE, "audio": AUDIO_TOKENS,
                      "samples_per_microbatch": SAMPLES_PER_MICROBATCH},
           "meets_seed_speedup": {s: f"{sum(r['meets_seed'][s] for r in seed_rows)}/{len(seed_rows)}" for s in sources},
           "auto_never_loses": all(min(r[s]["auto_vs_best_hand"] for s in sources) >= 1 - 1e-9 for r in seed_rows),
           "seed_fitted_profile": asdict(full), "per_pair_profile": asdict(per_pair), "seed_setting_rows": seed_rows,
           "rows": rows}
    name = "frozen_aware.json"
    if measured is not None:
        tokens = TEXT_TOKENS + VISION_PATCHES // VISION_MERGE + AUDIO_TOKENS
        doc["measured_layer_profile"] = {
            "path": measured.path, "device": measured.device, **measured.meta,
            "note": f"per-layer times measured on {measured.device}, divided by the {STAGE_GPUS} GPUs of a stage "
                    "(ideal TP/CP); not the seeds' A40s: compare speedups, not absolute times",
            "llm_backward_ratio": {k: measured.llm_backward_ratio(k, tokens) for k in LLAMA3}}
        name = "frozen_aware_measured.json"
    doc["machine"] = dict(harness.finish(start), note="simulated: the machine does not change these figures")
    kinds = {"meets_seed_speedup": "simulated", "auto_never_loses": "simulated", "seed_setting_rows": "simulated",
             "rows": "simulated", "seed_fitted_profile": "computed", "per_pair_profile": "computed",
             "measured_layer_profile": "measured"}
    harness.write(args.out / name, doc, sources={k: kinds.get(k, "setting") for k in doc if k != "machine"})
    harness.print_rows([dict(config=r["config"], seeds=r["seed_ratio"], **{s: r[s]["forward-variance"]["ratio"]
                                                                           for s in sources}) for r in seed_rows],
                       ["config", "seeds", *sources], "speedup over the seeds' baseline plan (simulated), per source")
    return seed_rows, rows


if __name__ == "__main__":
    main()
