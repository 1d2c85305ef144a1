"""Frozen-aware vs frozen-unaware planning on the seeds' MLLM configurations (003 Table 3.2), simulated.

Models, setting and cost sources: docs/planner.md, "`benchmarks/frozen_aware.py`: the seeds' Table 3.2, reproduced".
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
from lightning_mm.planner.costs import fit_cost_model

LM = "language_model"
# 003 Table 3.1: (layers, hidden, parameters)
LLAMA3 = {"S": (16, 2048, 1.0e9), "M": (32, 4096, 8.0e9), "L": (64, 5120, 32.0e9)}
QWEN2_VISION = {"S": (32, 1280, 0.6e9), "M": (48, 2560, 3.9e9), "L": (64, 3840, 11.6e9)}
PHI4_AUDIO = {"S": (24, 1024, 0.5e9), "M": (32, 3072, 3.4e9), "L": (48, 5120, 12.4e9)}
FAMILY_TABLES = {"llama3": LLAMA3, "qwen2_vision": QWEN2_VISION, "phi4_audio": PHI4_AUDIO}  # layer_profile.py's names
MODALITY = {"qwen2_vision": "vision", "phi4_audio": "audio"}
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
SAMPLES_PER_MICROBATCH = 4
EFFECTIVE_FLOPS = 0.45 * 149.7e12  # A40 bf16 dense peak at 45% MFU
LINK_BYTES_PER_S = 25e9  # 200 Gb/s InfiniBand
ALLREDUCE = {"allreduce_bandwidth": LINK_BYTES_PER_S}  # data-parallel gradient all-reduce, timed by the search
MEMORY_LIMIT = 48e9
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # Korthikanti et al., flash attention, bf16
CHECKPOINT_BYTES_PER_TOKEN_HIDDEN = 2  # with activation recomputation a layer keeps only its bf16 input
RECOMPUTE = True  # the seeds train with activation checkpointing (003 Fig. 3.1)
BASELINES = ("forward-variance", "forward-only")
SOURCES = ("flops", "per_layer_loo", "seed_fitted")
SOURCE_NAMES = {"flops": "FLOP costs", "per_layer_loo": "leave-one-config-out", "seed_fitted": "seed-fitted profile",
                "measured": "measured layer profile"}


@dataclass(frozen=True)
class SeedFittedProfile:
    """FLOP costs rescaled to the seeds' published per-stage times: published / FLOP forward of the encoders (per
    configuration "MMM", or per encoder pair "MM" when `per_pair`) and of the LLM per size, the LLM's published
    backward / forward per size, and the layouts the fit inferred for the published rows (config -> encoder
    stages of the aware and the unaware row)."""

    per_pair: bool
    encoder_forward: dict[str, float]
    llm_forward: dict[str, float]
    llm_backward_ratio: dict[str, float]
    splits: dict[str, tuple[int, int]]
    rms_log_error: float
    fitted_on: tuple[str, ...]


@dataclass(frozen=True)
class MeasuredProfile:
    """Per-layer times measured by `benchmarks/layer_profile.py` on one device: seconds per microbatch of
    SAMPLES_PER_MICROBATCH samples, keyed by family ("llama3", "qwen2_vision", "phi4_audio"), size and the
    benchmark's token count; projectors by modality and "<encoder size>-><LLM size>"."""

    path: str
    device: str
    meta: dict
    layers: dict
    projectors: dict

    def _entry(self, samples: dict, tokens: int, what: str) -> dict:
        if str(tokens) in samples:
            return samples[str(tokens)]
        if len(samples) < 3:  # a fit through fewer points would be a guess: measure the count instead
            raise KeyError(f"{self.path}: {what} was measured at {sorted(samples, key=int)} tokens only, the benchmark "
                           f"needs {tokens}; re-run benchmarks/layer_profile.py")
        xs = sorted(samples, key=int)
        return {k: fit_cost_model([int(x) for x in xs], [samples[x][k] for x in xs])(tokens)
                for k in ("forward_s", "input_grad_s", "weight_grad_s", "activation_bytes_frozen")}

    def layer_times(self, family: str, size: str, tokens: int, gpus: int = 1) -> tuple[float, float, float]:
        """(forward, input-grad, weight-grad) seconds of one layer on one microbatch, on a stage of `gpus` devices
        (the measured one-device times / gpus: ideal TP/CP scaling, as `transformer_layer_times`)."""
        e = self._entry(self.layers[family][size]["tokens"], tokens, f"{family} {size}")
        return tuple(e[k] / gpus for k in ("forward_s", "input_grad_s", "weight_grad_s"))

    def projector_times(self, modality: str, enc_size: str, llm_size: str, gpus: int = 1) -> tuple[float, float, float]:
        e = self.projectors[modality][f"{enc_size}->{llm_size}"]
        return tuple(e[k] / gpus for k in ("forward_s", "input_grad_s", "weight_grad_s"))

    def activation_bytes(self, family: str, size: str, tokens: int) -> float:
        """Bytes a frozen layer saves for its backward per microbatch (no recomputation)."""
        return self._entry(self.layers[family][size]["tokens"], tokens, f"{family} {size}")["activation_bytes_frozen"]

    def llm_backward_ratio(self, size: str, tokens: int) -> float:
        """A frozen LLM layer's backward / forward: input grad (+ the recomputed forward under recomputation)."""
        f, d, _ = self.layer_times("llama3", size, tokens)
        return (d + (f if RECOMPUTE else 0.0)) / f

    def describe(self) -> dict:
        return {"path": self.path, "device": self.device, **self.meta}


def load_measured_profile(path: Path | str) -> MeasuredProfile:
    """Read a `benchmarks/layer_profile.py` JSON; every family and size of the tables and every projector pair must be
    in it."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != "lightning-mm layer profile":
        raise ValueError(f"{path} is not a layer profile of benchmarks/layer_profile.py (format {doc.get('format')!r})")
    missing = [f"{family} {size}" for family, table in FAMILY_TABLES.items() for size in table
               if size not in doc.get("layers", {}).get(family, {})]
    missing += [f"{m} projector {e}->{l}" for family, m in MODALITY.items() for e in FAMILY_TABLES[family]
                for l in LLAMA3 if f"{e}->{l}" not in doc.get("projectors", {}).get(m, {})]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; re-run benchmarks/layer_profile.py")
    meta = {k: doc.get(k) for k in ("device_type", "torch", "transformers", "dtype", "tiny", "shrink", "audio_layer",
                                     "samples_per_microbatch")}
    return MeasuredProfile(str(path), doc.get("device", "?"), meta, doc["layers"], doc["projectors"])


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
                   gpus: int = 1, scale: float = 1.0, measured: MeasuredProfile | None = None,
                   llm_size: str | None = None):
    """A frozen encoder of `table[size]` plus a trainable 2-layer MLP projector as its last layer; times x `scale`
    (FLOP costs), or the `measured` layer profile's (its projector: the `llm_size` pair's). Returns its times and,
    per layer, model-state, activation and gradient bytes."""
    layers, hidden, params = table[size]
    proj_params = in_features_factor * hidden * llm_hidden + llm_hidden * llm_hidden
    if measured is not None:
        family = next(name for name, t in FAMILY_TABLES.items() if t is table)
        f, d, w = measured.layer_times(family, size, enc_tokens, gpus)
        pf, pd, pw = measured.projector_times(MODALITY[family], size, llm_size, gpus)
    else:
        f, d, w = (scale * t for t in transformer_layer_times(enc_tokens, hidden, params / layers, causal=False,
                                                               gpus=gpus))
        pf = pd = pw = scale * SAMPLES_PER_MICROBATCH * 2 * llm_tokens * proj_params / (gpus * EFFECTIVE_FLOPS)
    times = ModuleTimes([f] * layers + [pf], [d] * layers + [pd], [w] * layers + [pw], [True] * layers + [False])
    param_bytes = [2.0 * params / layers] * layers + [16.0 * proj_params]
    act = SAMPLES_PER_MICROBATCH * _bytes_per_token_hidden()
    layer_act = act * enc_tokens * hidden
    if measured is not None and not RECOMPUTE:
        layer_act = measured.activation_bytes(family, size, enc_tokens)
    activations = [layer_act] * layers + [act * llm_tokens * llm_hidden]
    grads = [0.0] * layers + [4.0 * proj_params]  # fp32 gradients of the trainable projector
    return times, param_bytes, activations, grads


def mllm_modules(vision: str | None, audio: str | None, llm: str, gpus: int = 1,
                 profile: SeedFittedProfile | None = None,
                 measured: MeasuredProfile | None = None) -> tuple[dict[str, ModuleSpec], float]:
    """Planner input for one configuration and its P2P latency (one microbatch of LLM hidden states).
    `gpus`: devices per stage. `profile`: rescale the FLOP times to the seeds' published ones (VALM configs).
    `measured`: every layer's times from a measured layer profile instead of FLOPs."""
    layers, hidden, params = LLAMA3[llm]
    enc_scale = profile.encoder_forward[f"{vision}{audio}" + ("" if profile.per_pair else llm)] if profile else 1.0
    llm_tokens = TEXT_TOKENS
    raw = {}
    if vision:
        raw["vision"] = encoder_module(QWEN2_VISION, vision, VISION_PATCHES, VISION_PATCHES // VISION_MERGE,
                                       VISION_MERGE, hidden, gpus, enc_scale, measured, llm)
        llm_tokens += VISION_PATCHES // VISION_MERGE
    if audio:
        raw["audio"] = encoder_module(PHI4_AUDIO, audio, AUDIO_TOKENS, AUDIO_TOKENS, 1, hidden, gpus, enc_scale,
                                      measured, llm)
        llm_tokens += AUDIO_TOKENS
    if measured is not None:
        f, d, w = measured.layer_times("llama3", llm, llm_tokens, gpus)
    else:
        f, d, w = transformer_layer_times(llm_tokens, hidden, params / layers, causal=True, gpus=gpus)
    if profile:  # the published backward of a frozen layer = input grad + (recomputed forward)
        f, w = f * profile.llm_forward[llm], w * profile.llm_forward[llm]
        d = f * (profile.llm_backward_ratio[llm] - (1.0 if RECOMPUTE else 0.0))
    llm_times = ModuleTimes([f] * layers, [d] * layers, [w] * layers, True)
    costs = mllm_layer_costs({name: r[0] for name, r in raw.items()}, llm_times, recompute=RECOMPUTE)
    modules = {name: ModuleSpec(costs[name], *r[1:]) for name, r in raw.items()}
    llm_act = SAMPLES_PER_MICROBATCH * _bytes_per_token_hidden() * llm_tokens * hidden
    if measured is not None and not RECOMPUTE:
        llm_act = measured.activation_bytes("llama3", llm, llm_tokens)
    modules[LM] = ModuleSpec(costs[LM], 2.0 * params / layers, llm_act)
    latency = SAMPLES_PER_MICROBATCH * llm_tokens * hidden * 2 / LINK_BYTES_PER_S
    return modules, latency


def stage_breakdown(plan) -> dict[str, float]:
    """The seeds' Table 3.2 columns for one plan, in ms: the slowest encoder / LLM stage's forward and backward."""
    def worst(kind, llm):
        values = [v for st, v in getattr(plan, kind).items() if (st.startswith(LM)) == llm]
        return 1e3 * max(values) if values else 0.0
    return {"enc_fwd_ms": worst("forward", False), "llm_fwd_ms": worst("forward", True),
            "enc_bwd_ms": worst("backward", False), "llm_bwd_ms": worst("backward", True)}


def split(plan) -> str:
    """Encoder stages + LLM stages, e.g. '2+4' (colocated: the merged encoder module's stage count)."""
    pp = plan.pp()
    enc = [n for m, n in pp.items() if m != LM]
    enc_stages = (enc[0] if enc else 0) if plan.placement == "colocated" else sum(enc)
    return f"{enc_stages}+{pp[LM]}"


def colocated_plan(modules, enc_stages: int, latency: float, mode: str, stages: int = SEED_STAGES):
    """The `stages`-stage colocated layout with `enc_stages` encoder stages, boundaries by `mode`'s partition."""
    layers = {m: partition_module(spec.costs, stages - enc_stages if m == LM else enc_stages,
                                  "forward-only" if mode != "frozen-aware" else mode) for m, spec in modules.items()}
    return evaluate_plan(modules, layers, "colocated", MICROBATCHES, 1, latency, STAGE_GPUS * MEMORY_LIMIT)


@functools.lru_cache(maxsize=None)
def flop_stage_forward(key: str, enc_stages: int) -> tuple[float, float]:
    """FLOP-model forward (ms) of the slowest encoder stage and LLM stage of a forward-balanced colocated layout."""
    modules, latency = mllm_modules(key[0], key[1], key[2], gpus=STAGE_GPUS)
    b = stage_breakdown(colocated_plan(modules, enc_stages, latency, "forward-only"))
    return b["enc_fwd_ms"], b["llm_fwd_ms"]


def _spread(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values)


@functools.lru_cache(maxsize=None)
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
    mean = lambda logs: {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}  # noqa: E731
    residuals = [x - sum(v) / len(v) for logs in (enc, fwd, ratio) for v in logs.values() for x in v]
    return SeedFittedProfile(per_pair, mean(enc), mean(fwd), mean(ratio), splits,
                           math.sqrt(sum(r * r for r in residuals) / len(residuals)), keys)


def seed_setting_plans(key: str, profile: SeedFittedProfile | None, stages: int,
                       measured: MeasuredProfile | None = None):
    """Each planner's best layout for MLLM-<key> in the Table 3.2 setting, timed with the true costs."""
    modules, latency = mllm_modules(key[0], key[1], key[2], gpus=STAGE_GPUS, profile=profile, measured=measured)
    kwargs = dict(placements=("colocated",), data_parallel=False, stages=stages)
    memory = STAGE_GPUS * MEMORY_LIMIT
    plans = {mode: search(modules, stages, MICROBATCHES, memory, latency, mode=mode, **kwargs, **ALLREDUCE).best
             for mode in ("frozen-aware", *BASELINES)}
    # auto (the free search: dp, stage counts <= `stages`, parallel or colocated) vs every hand split of `stages`
    auto = search(modules, stages, MICROBATCHES, memory, latency, **ALLREDUCE).best
    hands = [p for p in search(modules, stages, MICROBATCHES, memory, latency, data_parallel=False, stages=stages,
                               placements=("colocated", "parallel"), **ALLREDUCE).candidates if p.fits_memory]
    best_hand = min(hands, key=lambda p: p.iteration_time)
    return plans, auto, best_hand


def describe_plans(plans, auto, best_hand) -> dict:
    aware = plans["frozen-aware"]
    out = {"aware_s": aware.iteration_time, "aware_split": split(aware), "aware_layers": aware.layers,
           "aware_stages_ms": stage_breakdown(aware), "aware_summary": plan_summary(aware),
           "auto_s": auto.iteration_time, "auto_plan": describe(auto), "best_hand_s": best_hand.iteration_time,
           "best_hand_plan": f"{best_hand.placement[:3]} {split(best_hand)}",
           "auto_vs_best_hand": best_hand.iteration_time / auto.iteration_time}
    for mode in BASELINES:
        plan = plans[mode]
        out[mode] = {"s": plan.iteration_time, "split": split(plan),
                     "ratio": plan.iteration_time / aware.iteration_time, "stages_ms": stage_breakdown(plan),
                     "summary": plan_summary(plan)}
    return out


def active_sources(measured: MeasuredProfile | None) -> tuple[str, ...]:
    return SOURCES + (("measured",) if measured is not None else ())


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
    sources = (("flops", None), ("per_layer_loo", held_out), ("seed_fitted", full))
    for source, profile in sources + ((("measured", None),) if measured is not None else ()):
        plans, auto, best_hand = seed_setting_plans(key, profile, stages, measured if source == "measured" else None)
        row[source] = describe_plans(plans, auto, best_hand)
        if out is not None and key == "MMM" and source != "per_layer_loo":
            xlabel = ("simulated time (ms)" if source != "measured"
                      else f"simulated time (ms, layers measured on {measured.device})")
            for tag, mode in (("aware", "frozen-aware"), ("seeds_baseline", "forward-variance")):
                name = f"frozen_aware_{source}_{key}_{tag}"
                timeline_png(plans[mode].result, out / f"{name}.png", scale=1e3, xlabel=xlabel,
                             title=f"MLLM-{key}, {SOURCE_NAMES[source]}, {mode}: {split(plans[mode])}")
                chrome_trace(plans[mode].result, out / f"{name}.trace.json")
    modules, latency = mllm_modules(key[0], key[1], key[2], gpus=STAGE_GPUS, profile=full)
    seed_layouts = [colocated_plan(modules, e, latency, mode, stages)
                    for e, mode in zip(full.splits[key], ("frozen-aware", "forward-variance"))]
    row["seed_layouts_simulated_s"] = [p.iteration_time for p in seed_layouts]
    row["seed_layouts_simulated_ratio"] = seed_layouts[1].iteration_time / seed_layouts[0].iteration_time
    row["ours_vs_seed_aware_layout"] = seed_layouts[0].iteration_time / row["seed_fitted"]["aware_s"]
    row["meets_seed"] = {s: row[s]["forward-variance"]["ratio"] >= row["seed_ratio"] - 0.005
                         for s in active_sources(measured)}
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


def describe(plan) -> str:
    pp = "/".join(f"{m[:1]}{n}" for m, n in plan.pp().items())
    return f"{plan.placement[:3]} dp{plan.dp} {pp}"


def run_config(name: str, vision, audio, llm, devices: int, microbatches: int, out: Path | None):
    modules, latency = mllm_modules(vision, audio, llm)
    started = time.perf_counter()
    aware = search(modules, devices, microbatches, MEMORY_LIMIT, latency, **ALLREDUCE)
    unaware = search(modules, devices, microbatches, MEMORY_LIMIT, latency, mode="forward-only", **ALLREDUCE)
    search_s = time.perf_counter() - started
    # pipeline only (no DP), the setting of the seeds' partitioning ablation
    pp_aware = search(modules, devices, microbatches, MEMORY_LIMIT, latency, data_parallel=False)
    pp_unaware = search(modules, devices, microbatches, MEMORY_LIMIT, latency, mode="forward-only", data_parallel=False)
    # same stage counts and placement as the aware plan, only the boundaries forward-only
    b = aware.best
    same_layers = {m: partition_module(modules[m].costs, n, "forward-only") for m, n in b.pp().items()}
    boundaries_only = evaluate_plan(modules, same_layers, b.placement, microbatches, b.dp, latency, MEMORY_LIMIT,
                                    **ALLREDUCE)
    hands = hand_plans(modules, devices, microbatches, latency)
    best_hand = min(hands, key=lambda p: p.iteration_time) if hands else None
    if out is not None and name in ("MMM", "VALM-MMM"):
        for tag, plan in (("aware", aware.best), ("unaware", unaware.best)):
            timeline_png(plan.result, out / f"frozen_aware_{name}_{tag}.png", title=f"{name} {tag}: {describe(plan)}",
                         scale=1e3, xlabel="simulated time (ms, FLOP costs)")
            chrome_trace(plan.result, out / f"frozen_aware_{name}_{tag}.trace.json")
    entry = SEED_TABLE_3_2.get(name.split("-")[-1]) if name.startswith("VALM") else None
    seed = (entry[0][4], entry[1][4]) if entry else None
    return {
        "config": name, "frozen_aware_s": aware.best.iteration_time, "forward_only_s": unaware.best.iteration_time,
        "speedup": unaware.best.iteration_time / aware.best.iteration_time,
        "pp_only_aware_s": pp_aware.best.iteration_time, "pp_only_forward_only_s": pp_unaware.best.iteration_time,
        "pp_only_speedup": pp_unaware.best.iteration_time / pp_aware.best.iteration_time,
        "pp_only_aware_plan": describe(pp_aware.best), "pp_only_unaware_plan": describe(pp_unaware.best),
        "boundaries_only_speedup": boundaries_only.iteration_time / aware.best.iteration_time,
        "seed_aware_s": seed[0] if seed else None, "seed_unaware_s": seed[1] if seed else None,
        "seed_speedup": seed[1] / seed[0] if seed else None, "aware_plan": describe(aware.best),
        "unaware_plan": describe(unaware.best), "aware_layers": aware.best.layers,
        "best_hand_s": best_hand.iteration_time if best_hand else None,
        "best_hand_plan": describe(best_hand) if best_hand else None, "hand_plans": len(hands),
        "auto_vs_best_hand": best_hand.iteration_time / aware.best.iteration_time if best_hand else None,
        "search_candidates": len(aware.candidates), "search_seconds": search_s,
        "aware_summary": plan_summary(aware.best),
    }


def configurations():
    for v, a, l in SEED_TABLE_3_2:
        yield f"VALM-{v}{a}{l}", v, a, l
    for size in "SML":
        yield f"VLM-{size}", size, None, size
        yield f"ALM-{size}", None, size, size


def main(argv=None):
    args = harness.cli(
        __doc__, argv, devices=24, microbatches=12,
        stages=(SEED_STAGES, "fixed stage count of the Table 3.2 setting"), out=harness.RESULTS,
        no_recompute=(False, "keep full activations (no checkpointing)"),
        skip_free=(False, "only the Table 3.2 setting"),
        layer_profile=dict(type=Path, help="a benchmarks/layer_profile.py JSON: adds the 'measured layer profile' "
                                           "cost source to the Table 3.2 setting and writes frozen_aware_measured.json "
                                           "instead of frozen_aware.json"),
        configs=dict(help="comma-separated Table 3.2 configurations to run, e.g. MMM,LLL (default: all 9; the "
                          "profile fits always use all 9)"))
    start = harness.record()
    global RECOMPUTE
    RECOMPUTE = not args.no_recompute
    keys = tuple(SEED_TABLE_3_2)
    if args.configs:
        keys = tuple(k.strip().upper().removeprefix("MLLM-") for k in args.configs.split(","))
        if [k for k in keys if k not in SEED_TABLE_3_2]:
            raise SystemExit(f"--configs: unknown {[k for k in keys if k not in SEED_TABLE_3_2]}; choose from "
                             f"{', '.join(SEED_TABLE_3_2)}")
    measured = load_measured_profile(args.layer_profile) if args.layer_profile else None
    args.out.mkdir(parents=True, exist_ok=True)
    full, per_pair = fit_seed_profile(tuple(SEED_TABLE_3_2)), fit_seed_profile(tuple(SEED_TABLE_3_2), per_pair=True)
    seed_rows = [seed_setting_row(key, args.stages, full, args.out, measured) for key in keys]
    sources = active_sources(measured)
    rows = [] if args.skip_free else [run_config(*cfg, args.devices, args.microbatches, args.out)
                                      for cfg in configurations()]
    doc = {"devices": args.devices, "microbatches": args.microbatches, "memory_limit": MEMORY_LIMIT,
           "recompute": RECOMPUTE, "effective_flops": EFFECTIVE_FLOPS, "stages": args.stages, "stage_gpus": STAGE_GPUS,
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
            **measured.describe(), "note": f"per-layer times measured on {measured.device}, divided by the "
            f"{STAGE_GPUS} GPUs of a stage (ideal TP/CP); not the seeds' A40s: compare speedups, not absolute times",
            "llm_backward_ratio": {k: measured.llm_backward_ratio(k, tokens) for k in LLAMA3}}
        name = "frozen_aware_measured.json"
    doc["machine"] = dict(harness.finish(start), note="simulated: the machine does not change these figures")
    simulated = ("meets_seed_speedup", "auto_never_loses", "seed_setting_rows", "rows")
    fitted = ("seed_fitted_profile", "per_pair_profile")
    harness.write(args.out / name, doc, sources={k: "simulated" if k in simulated else "computed" if k in fitted else
                                                 "measured" if k == "measured_layer_profile" else "setting"
                                                 for k in doc if k != "machine"})
    harness.print_rows([dict(config=r["config"], seeds=r["seed_ratio"], **{s: r[s]["forward-variance"]["ratio"]
                                                                           for s in sources}) for r in seed_rows],
                       ["config", "seeds", *sources], "speedup over the seeds' baseline plan (simulated), per source")
    return seed_rows, rows


if __name__ == "__main__":
    main()
