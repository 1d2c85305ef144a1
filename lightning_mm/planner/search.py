"""Auto-parallel search (001 Algorithm 1, loosely coupled) over pipeline stage counts and encoder placement.

For every data-parallel degree and every LLM stage count, the LLM is partitioned and its slowest stage sets
the target; each encoder gets the fewest stages whose slowest stage fits under it (encoder-parallel), or all
encoders share one stage count fused stage by stage (encoder-colocated). Neighbouring encoder stage counts
are tried too. Every candidate is timed by simulating the strategy's own 1F1B action lists with the true
(frozen-aware) costs, and rejected if a stage exceeds the per-device memory limit. Tensor parallelism, sharding,
the LLM's context parallelism (degree and mode) and the encoders' context parallelism (items split over ranks,
parallel placement only) are searched around that, and so is a mixture-of-experts LLM's expert parallelism
(``ep``: experts split over data-parallel ranks, their all-to-all costed; ``planner.moe_costs``).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_mm.plan.cp_comm import cp_communication_bytes, gdn_communication_bytes
from lightning_mm.plan.items import item_work, shard_items
from lightning_mm.plan.layout import CP_MODES, ParallelSpec, RankLayout, replica_layout
from lightning_mm.plan.placement import LANGUAGE_MODEL, placement_table, stage_name
from lightning_mm.plan.schedule import StageGraph, build_stage_graph
from lightning_mm.planner.costs import LayerCost
from lightning_mm.planner.moe_costs import ExpertShape, all_to_all_bytes
from lightning_mm.planner.partition import partition, partition_module, stage_sums
from lightning_mm.planner.simulator import SimulationResult, simulate_1f1b


SEARCH_MODES = ("frozen-aware", "forward-only", "forward-variance")


@dataclass(frozen=True)
class AttentionShape:
    """What the LLM's context-parallel attention moves depends on: tokens per microbatch sequence, query and
    key/value heads (whole model, before tensor parallelism), head dimension and bytes per element."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    linear_layers: int = 0  # Gated DeltaNet layers (Qwen3.5), which context parallelism splits by heads
    linear_value_heads: int = 0  # their value heads: the CP degree must divide them
    linear_key_heads: int = 0  # their query / key heads and head dims: what their all-to-alls move
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_ids: tuple[int, ...] = ()  # which LLM layers (0-based) are GDN layers; the others are attention
    # per CP degree, each rank's tokens of the microbatch as the CP planner splits it (``cp_comm.rank_token_counts``
    # of its plan: LPT blocks of packed rows are uneven); the entry of length cp is used, a cp without one is even
    rank_tokens: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        ids = tuple(sorted(int(i) for i in self.linear_ids))
        object.__setattr__(self, "linear_ids", ids)
        object.__setattr__(self, "rank_tokens", tuple(tuple(int(n) for n in c) for c in self.rank_tokens))
        if any(sum(c) != self.seq_len for c in self.rank_tokens):
            raise ValueError(f"AttentionShape: rank_tokens {self.rank_tokens} must each sum to seq_len={self.seq_len} "
                             "(the microbatch's tokens over its CP ranks); take them from rank_token_counts")
        if ids and not self.linear_layers:
            object.__setattr__(self, "linear_layers", len(ids))
        shape = (self.linear_value_heads, self.linear_key_heads, self.linear_key_dim, self.linear_value_dim)
        if self.linear_layers and (len(ids) != self.linear_layers or min(shape) < 1):
            raise ValueError(f"AttentionShape: {self.linear_layers} Gated DeltaNet layers need linear_ids (their "
                             f"{self.linear_layers} layer indices, got {len(ids)}) and positive linear_value_heads, "
                             f"linear_key_heads, linear_key_dim, linear_value_dim (got {shape}): what their CP "
                             "all-to-alls move; plan_cli.attention_shape reads them from the model's config")


def cp_degrees_of(cp: int, mode: str) -> list[int]:
    """The Ulysses degrees ``mode`` can run with on ``cp`` ranks: [1] for allgather (or cp 1), [cp] for ulysses,
    every K with 1 < K < cp dividing cp for hybrid (none for a cp without such divisors)."""
    if mode not in CP_MODES:
        raise ValueError(f"unknown cp_mode {mode!r}; choose one of {CP_MODES}")
    if cp == 1 or mode == "allgather":
        return [1]
    if mode == "ulysses":
        return [cp]
    return [k for k in range(2, cp) if cp % k == 0]


def cp_heads_problem(attention: AttentionShape | None, tp: int, degree: int) -> str | None:
    """Why the LLM's heads cannot run Ulysses over ``degree`` ranks at tensor parallelism ``tp`` (None if they
    can): the runtime's own check (``check_ulysses_heads``) on the heads per tp rank."""
    if degree == 1 or attention is None:
        return None
    from lightning_mm.attention.ulysses import check_ulysses_heads

    if attention.heads % tp or attention.kv_heads % tp:
        return (f"{attention.heads} query / {attention.kv_heads} key-value heads do not split over tp={tp}")
    try:
        check_ulysses_heads(attention.heads // tp, attention.kv_heads // tp, degree, f"language_model (tp={tp})")
    except ValueError as err:
        return str(err)
    return None


def cp_layer_bytes(attention: AttentionShape, cp: int, mode: str, ulysses: int | None, tp: int = 1,
                   linear: bool = False) -> dict:
    """CP bytes of one LLM layer of one microbatch at these degrees (heads per tp rank): an attention layer's
    ``cp_communication_bytes`` for ``mode``, a Gated DeltaNet layer's (``linear``) headwise all-to-alls
    (``gdn_communication_bytes``, the same in every mode, padded to the fullest rank of ``attention.rank_tokens``
    where it gives the split at ``cp``)."""
    if linear:
        split = next((c for c in attention.rank_tokens if len(c) == cp), None)
        return gdn_communication_bytes(attention.seq_len, cp, attention.linear_key_heads // tp,
                                       attention.linear_value_heads // tp, attention.linear_key_dim,
                                       attention.linear_value_dim, attention.dtype_bytes, rank_tokens=split)
    return cp_communication_bytes(mode, attention.seq_len, cp, attention.heads // tp, attention.kv_heads // tp,
                                  attention.head_dim, ulysses if mode == "hybrid" else None, attention.dtype_bytes)


@functools.lru_cache(maxsize=1024)
def _item_split(items, width: int, ranks: int) -> tuple[float, float]:
    slowest = total = fullest = tokens = 0.0
    for mb in items:
        sizes, work = [t for t, _ in mb], [w for _, w in mb]
        shards = shard_items(item_work(sizes, width), ranks)
        slowest += max(sum(work[i] for i in s) for s in shards)
        fullest += max(sum(sizes[i] for i in s) for s in shards)
        total, tokens = total + sum(work), tokens + sum(sizes)
    return (slowest / total if total > 0 else 1.0 / ranks), (fullest / tokens if tokens > 0 else 1.0 / ranks)


def encoder_cp_split(spec: "ModuleSpec", ranks: int) -> tuple[float, float]:
    """(work share, token share) of the busiest of an encoder's ``ranks`` CP ranks: what its stages' compute and
    kept activations are multiplied by, and (tokens) how full the gather's padded per-rank slot is. With
    ``spec.items`` the runtime's own split (``shard_items`` on ``item_work``) of each sample microbatch, then
    sum over microbatches of the busiest rank's work / sum of the work (one image on 2 ranks: no gain); without
    items, 1 / ranks (work assumed to split evenly)."""
    if ranks == 1:
        return 1.0, 1.0
    if not spec.items:
        return 1.0 / ranks, 1.0 / ranks
    return _item_split(spec.items, spec.item_width, ranks)


def encoder_gather_seconds(spec: "ModuleSpec", ranks: int, bandwidth: float, token_share: float) -> tuple[float, float]:
    """(forward, backward) seconds of an encoder CP gather per microbatch on its last stage: the forward all-gather
    receives (ranks - 1) slots of the busiest rank's features (``feature_bytes x token_share``; (ranks-1)/ranks of
    the features when even), the backward all-reduces the whole feature gradient (ring: 2 (ranks-1)/ranks of it)."""
    if ranks == 1 or spec.feature_bytes <= 0:
        return 0.0, 0.0
    return ((ranks - 1) * spec.feature_bytes * token_share / bandwidth,
            allreduce_seconds(spec.feature_bytes, ranks, bandwidth))


@dataclass(frozen=True)
class ModuleSpec:
    """Planner input for one module: frozen-aware layer costs (projector last for an encoder), model-state
    bytes per layer (weights, plus grads and optimizer state where trainable), activation bytes per layer
    held for each in-flight microbatch (counted only for layers that take part in backward) and gradient
    bytes per layer (what data parallelism all-reduces every step). ``tp_bytes`` per layer: what one of its
    tensor-parallel all-reduces moves (its output hidden states for one microbatch; two in forward, two in
    backward). ``attention`` (the LLM's): the shape context parallelism's communication is computed from;
    without it CP communication is free.

    An encoder's context parallelism (``evaluate_plan(encoder_cp=)``) reads two more: ``items``, per sample
    microbatch the (encoder tokens, work) of each item (image, clip), from which the runtime's LPT split over the
    CP ranks is recomputed (``item_width``: the tower's width, what ``plan.items.item_work`` weighs the tokens with;
    without items the work is assumed to split evenly); ``feature_bytes``, the bytes of one microbatch's projected
    features (feature tokens x LLM hidden size x bytes per element), what its last stage all-gathers.

    A mixture-of-experts LLM's expert parallelism (``evaluate_plan(ep=)``) reads three more: ``expert_bytes`` per
    layer, the share of ``param_bytes`` that is routed experts (held at 1 / ep per rank), ``expert_grad_bytes`` the
    share of ``grad_bytes`` (reduced only over the ranks holding the same experts), and ``experts``
    (``planner.moe_costs.ExpertShape``: expert count, top-k, hidden size, tokens per microbatch), which its all-to-all
    bytes are computed from; a layer with expert bytes is a routed layer."""

    costs: Sequence[LayerCost]
    param_bytes: Sequence[float] | float = 0.0
    activation_bytes: Sequence[float] | float = 0.0
    grad_bytes: Sequence[float] | float = 0.0
    tp_bytes: Sequence[float] | float = 0.0
    attention: AttentionShape | None = None
    items: Sequence[Sequence[tuple[float, float]]] | None = None
    item_width: int = 0
    feature_bytes: float = 0.0
    expert_bytes: Sequence[float] | float = 0.0
    expert_grad_bytes: Sequence[float] | float = 0.0
    experts: ExpertShape | None = None

    def __post_init__(self):  # hashable items: the CP split is cached per (items, width, ranks)
        if self.items is not None:
            object.__setattr__(self, "items", tuple(tuple((int(t), float(w)) for t, w in mb) for mb in self.items))

    def per_layer(self, value) -> list[float]:
        return [float(value)] * len(self.costs) if isinstance(value, (int, float)) else [float(v) for v in value]


@dataclass(frozen=True)
class Plan:
    """One evaluated layout: layers per stage per module, placement, DP degree and its simulation."""

    placement: str
    layers: dict[str, list[int]]
    dp: int
    microbatches_per_replica: int
    forward: dict[str, float]
    backward: dict[str, float]
    memory: dict[str, float]
    result: SimulationResult
    fits_memory: bool = True
    tp: int = 1
    sharding: str = "NO_SHARD"
    cp: int = 1  # the LLM stages' context-parallel degree (encoder stages have none)
    cp_mode: str = "allgather"
    ulysses: int = 1  # the Ulysses degree: 1 (allgather), cp (ulysses), K (hybrid)
    cp_comm: dict[str, float] = field(default_factory=dict)  # per stage: CP seconds per microbatch (fwd + bwd)
    encoder_cp: dict[str, int] = field(default_factory=dict)  # encoders with context parallelism: their degree
    module_dp: dict[str, int] = field(default_factory=dict)  # per-module data parallelism: every module's dp, or {}
    module_tp: dict[str, int] = field(default_factory=dict)  # per-module tensor parallelism: every module's tp, or {}
    samples_per_microbatch: int = 1  # samples in one planner microbatch (what the encoder split is counted in)
    ep: int = 1  # the LLM's expert-parallel degree
    ep_comm: dict[str, float] = field(default_factory=dict)  # per stage: expert all-to-all seconds per mb (fwd + bwd)

    @property
    def iteration_time(self) -> float:
        return self.result.iteration_time

    @property
    def stages_per_replica(self) -> int:
        return len(self.forward)

    def parallel_specs(self) -> tuple[dict[str, ParallelSpec], ParallelSpec]:
        """(encoder specs, LLM spec) that run this plan, as a user writes them in the strategy (with every module's
        ``dp`` under per-module data parallelism)."""
        return _parallel_specs(self.layers, self.tp, self.cp, self.cp_mode, self.ulysses, self.encoder_cp,
                               self.module_tp, self.module_dp, self.ep)

    @functools.cached_property
    def layout(self) -> RankLayout:
        """The rank layout of this plan (``plan.layout.replica_layout``, the one source of rank counts). Under
        per-module data parallelism: one replica of every chain's stages at the LLM's dp (stage widths); ``devices``
        counts each chain's own replicas."""
        encoders, llm = self.parallel_specs()
        if self.module_dp:
            encoders, llm = {e: replace(s, dp=None) for e, s in encoders.items()}, replace(llm, dp=None)
        return replica_layout(encoders, llm, self.placement, replicas=self.dp)

    @property
    def devices(self) -> int:
        """World size: sum over stages of its width x its chain's dp (replicas x ranks per replica when uniform)."""
        if not self.module_dp:
            return self.layout.world_size
        widths, table = self.layout.widths, self.stage_modules()
        return sum(w * self.module_dp[table[s]] for s, w in widths.items())

    def stage_modules(self) -> dict[str, str]:
        """The module whose dp and tp each stage takes (the first module it holds)."""
        encoders = {e: len(v) for e, v in self.layers.items() if e != LANGUAGE_MODEL}
        return {s: parts[0][0] for s, parts in
                placement_table(encoders, len(self.layers[LANGUAGE_MODEL]), self.placement).items()}

    def pp(self) -> dict[str, int]:
        return {m: len(sizes) for m, sizes in self.layers.items()}


@dataclass(frozen=True)
class SearchResult:
    best: Plan
    candidates: list[Plan] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)  # CP modes / degrees the model's heads cannot take, why


def _parallel_specs(layers, tp, cp, cp_mode, ulysses, encoder_cp, module_tp=None,
                    module_dp=None, ep: int = 1) -> tuple[dict[str, ParallelSpec], ParallelSpec]:
    module_tp, module_dp = module_tp or {}, module_dp or {}
    llm = ParallelSpec(pp=len(layers[LANGUAGE_MODEL]), cp=cp, tp=module_tp.get(LANGUAGE_MODEL, tp),
                       cp_mode=cp_mode if cp > 1 else "allgather",
                       ulysses=ulysses if cp > 1 and cp_mode == "hybrid" else None, dp=module_dp.get(LANGUAGE_MODEL),
                       ep=ep)
    return {e: ParallelSpec(pp=len(v), cp=encoder_cp.get(e, 1), tp=module_tp.get(e, tp), dp=module_dp.get(e))
            for e, v in layers.items() if e != LANGUAGE_MODEL}, llm


def _module_degrees(value, modules: dict[str, "ModuleSpec"], what: str) -> dict[str, int]:
    """A per-module ``dp`` / ``tp`` dict, checked: one int >= 1 for every module, no other names."""
    if set(value) != set(modules) or any(not isinstance(v, int) or v < 1 for v in value.values()):
        raise ValueError(f"per-module {what} needs one int >= 1 for every module {list(modules)}, got {value!r}")
    return dict(value)


def encoder_samples(llm_dp: int, encoder_dp: int, samples_per_microbatch: int = 1) -> int:
    """Samples the busiest encoder replica encodes per microbatch position m: G_m = the ``llm_dp`` LLM replicas'
    microbatch m (``samples_per_microbatch`` each), split over ``encoder_dp`` replicas: ceil(|G_m| / dp_e)."""
    return -(-llm_dp * samples_per_microbatch // encoder_dp)


def check_module_dp(module_dp: dict[str, int], placement: str, samples_per_microbatch: int = 1) -> None:
    """Raise (with the fix) for per-module dps the runtime does not serve: unequal dps outside parallel placement,
    and an encoder with more replicas than samples at one microbatch position (one would get none)."""
    if len(set(module_dp.values())) > 1 and placement != "parallel":
        raise ValueError(f"per-module dp {module_dp} needs encoder_placement='parallel': colocated encoders share "
                         "stages and replicated encoders run inside the LLM's first stage, so they have the LLM's dp; "
                         "give every module the same dp or use encoder_placement='parallel'")
    llm_dp = module_dp[LANGUAGE_MODEL]
    for e, d in module_dp.items():
        if d > llm_dp * samples_per_microbatch:
            need = -(-d // llm_dp)
            raise ValueError(f"encoder {e!r} has dp={d} but each microbatch position holds {llm_dp} x "
                             f"{samples_per_microbatch} samples (language_model dp x samples per microbatch), so a "
                             f"replica would get none; use {e} dp <= {llm_dp * samples_per_microbatch}, or LLM "
                             f"microbatches of >= {need} samples")


def _check_modules(modules: dict[str, ModuleSpec]) -> None:
    if LANGUAGE_MODEL not in modules:
        raise ValueError(f"modules needs a {LANGUAGE_MODEL!r} entry (the LLM); got {list(modules)}")
    for name, spec in modules.items():
        if not spec.costs:
            raise ValueError(f"module {name!r} has no layers; give its per-layer costs")


def _encoders(modules: dict[str, ModuleSpec]) -> list[str]:
    return [m for m in modules if m != LANGUAGE_MODEL]


def _stage_table(modules, layers, placement) -> dict[str, tuple[float, float, float, float, float, bool, float]]:
    """Per graph stage: (forward, backward, param bytes, activation bytes, gradient bytes, holds a trainable
    parameter, tensor-parallel all-reduce bytes)."""
    table = {}

    def stages_of(module):
        spec, start = modules[module], 0
        fwd, bwd = [c.forward for c in spec.costs], [c.backward for c in spec.costs]
        pb, ab, gb, tb = (spec.per_layer(v) for v in (spec.param_bytes, spec.activation_bytes, spec.grad_bytes,
                                                       spec.tp_bytes))
        for size in layers[module]:
            sl = slice(start, start + size)
            start += size
            kept = sum(a for a, c in zip(ab[sl], spec.costs[sl]) if c.in_backward)  # no_grad layers keep none
            yield (sum(fwd[sl]), sum(bwd[sl]), sum(pb[sl]), kept, sum(gb[sl]), any(c.trainable for c in spec.costs[sl]),
                   sum(tb[sl]))

    def add(a, b):
        return tuple(x + y for x, y in zip(a[:5], b[:5])) + (a[5] or b[5], a[6] + b[6])

    rows = {m: list(stages_of(m)) for m in modules}
    encoder_stages = {e: len(layers[e]) for e in _encoders(modules)}
    for stage, parts in placement_table(encoder_stages, len(layers[LANGUAGE_MODEL]), placement).items():
        for module, i in parts:
            table[stage] = add(table[stage], rows[module][i]) if stage in table else rows[module][i]
    return table


def plan_graph(modules: dict[str, ModuleSpec], layers: dict[str, list[int]], placement: str) -> StageGraph:
    """The stage graph of a layout; which stages are trainable comes from the layer costs."""
    table = _stage_table(modules, layers, placement)
    enc_stages = {e: len(layers[e]) for e in _encoders(modules)}
    return build_stage_graph(enc_stages, len(layers[LANGUAGE_MODEL]), placement, {s: r[5] for s, r in table.items()})


def allreduce_seconds(num_bytes: float, dp: int, bandwidth: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``dp`` devices: 2 (dp-1)/dp x bytes / bandwidth (DistTrain's
    "DP comm = volume / bandwidth", 004)."""
    return 0.0 if dp <= 1 or num_bytes <= 0 else 2.0 * (dp - 1) / dp * num_bytes / bandwidth


SHARDING_TRAFFIC = {"NO_SHARD": 1.0, "SHARD_GRAD_OP": 1.0, "FULL_SHARD": 1.5}  # x one all-reduce of the gradients


def state_bytes_per_device(param_bytes: float, trainable: bool, dp: int, tp: int, sharding: str,
                           fsdp_reduce: str = "microbatch") -> float:
    """Model-state bytes of one stage on one device at its peak: tensor parallelism splits weights, gradients and
    optimiser state tp ways; FULL_SHARD shards all of it over dp, SHARD_GRAD_OP all but the weights (a quarter of a
    trainable fp32 AdamW stage's state, all of a frozen one's). With ``fsdp_reduce="step"`` a trainable sharded
    stage holds its gradients (another quarter) whole until the step's last backward instead of its shard of them."""
    per_tp = param_bytes / tp
    held = per_tp / 4 * (1 - 1 / dp) if trainable and fsdp_reduce == "step" else 0.0
    if sharding == "FULL_SHARD":
        return per_tp / dp + held
    if sharding == "SHARD_GRAD_OP":
        weights = per_tp / 4 if trainable else per_tp
        return weights + (per_tp - weights) / dp + held
    return per_tp


def evaluate_plan(modules: dict[str, ModuleSpec], layers: dict[str, list[int]], placement: str, num_microbatches: int,
                  dp: int | dict[str, int] = 1, p2p_latency: float = 0.0, memory_limit: float = math.inf,
                  allreduce_bandwidth: float = math.inf, tp: int | dict[str, int] = 1, sharding: str = "NO_SHARD",
                  tp_bandwidth: float = math.inf, cp: int = 1, cp_mode: str = "allgather", ulysses: int | None = None,
                  cp_bandwidth: float = math.inf, encoder_cp: dict[str, int] | None = None,
                  samples_per_microbatch: int = 1, ep: int = 1, ep_bandwidth: float = math.inf,
                  fsdp_reduce: str = "microbatch") -> Plan:
    """Simulate one layout on one DP replica (num_microbatches / dp microbatches) with the true costs. With
    dp > 1 each stage then all-reduces its gradients over its dp replicas: a ring moves 2 (dp-1)/dp of the
    bytes through each device's link of ``allreduce_bandwidth`` bytes/s (FSDP's FULL_SHARD moves 1.5 times that:
    two all-gathers and a reduce-scatter, timed once per step for either ``fsdp_reduce``, whose "step" memory
    ``state_bytes_per_device`` counts). With ``tp`` > 1 every stage's compute is split tp ways and each layer
    all-reduces its output twice in forward and twice in backward over ``tp_bandwidth`` bytes/s.

    With ``cp`` > 1 every LLM stage spans cp x tp ranks: its LLM layers' compute and kept activations are split
    cp ways, its gradients are reduced (and sharded) over dp x cp ranks, and every LLM layer moves
    ``cp_layer_bytes`` per microbatch (an attention layer ``cp_communication_bytes`` for ``cp_mode``,
    ``ulysses``: hybrid's K; a Gated DeltaNet layer its headwise all-to-alls) in forward, and again
    in backward where the layer takes part in it, over ``cp_bandwidth`` bytes/s per rank (the LLM's
    ``ModuleSpec.attention`` gives the shape; without it CP communication is free). A mode the LLM's heads
    cannot take raises, with the reason.

    ``encoder_cp={encoder: N}`` (encoder context parallelism, parallel placement only: the layout's check)
    gives each of that encoder's stages N x tp ranks, each encoding a share of every microbatch's items: the
    stages' compute and kept activations are multiplied by the busiest rank's share (``encoder_cp_split``: the
    runtime's LPT item split when ``ModuleSpec.items`` holds the microbatches' items, else 1/N, work assumed to
    split evenly); parameters and optimiser state stay whole on every CP rank (sharding, if any, spans dp x N, and
    the gradients are reduced over dp x N ranks, as the runtime does). Its last stage adds the feature all-gather to
    its forward and the feature-gradient all-reduce to its backward (``encoder_gather_seconds`` over
    ``cp_bandwidth``; free without ``ModuleSpec.feature_bytes``), shown in ``Plan.cp_comm``.

    Per-module data parallelism (DistTrain): ``dp={module: degree}`` for every module (``tp`` may be such a dict
    too). The LLM's dp replicas each run ``num_microbatches / dp[language_model]`` microbatches; microbatch
    position m of all of them (G_m, ``samples_per_microbatch`` samples each) is split over an encoder's replicas, so
    that encoder's stages cost ``encoder_samples(...) / samples_per_microbatch`` times a microbatch (compute,
    collectives and kept activations: its busiest replica, which gates G_m). Each chain reduces (and shards) its
    gradients over its own dp. One replica per chain is simulated: all replicas of a chain run the same work, so
    this is exact for per-microbatch costs. Equal degrees give exactly the single-dp numbers. Unequal degrees
    outside parallel placement, or an encoder replica left without samples, raise (``check_module_dp``).

    ``ep`` > 1 (a mixture-of-experts LLM's expert parallelism; ``ep`` must divide dp and the LLM's expert count,
    with NO_SHARD and one dp for every module, as the runtime requires): on every LLM stage the routed experts'
    model state (``ModuleSpec.expert_bytes``) counts at 1 / ep per rank, their gradients
    (``expert_grad_bytes`` / ep) are all-reduced over the dp / ep replicas holding the same experts (x cp ranks),
    the other gradients over dp as today; each routed layer adds its dispatch and combine all-to-alls
    (``planner.moe_costs.all_to_all_bytes`` for the rank's tokens, the microbatch's over cp x tp) over ``ep_bandwidth``
    bytes/s per rank to its forward, and again to its backward where it takes part in it (``Plan.ep_comm``). The
    compute is unchanged (dropless routing, load assumed balanced)."""
    if sharding not in SHARDING_TRAFFIC:
        raise ValueError(f"unknown sharding {sharding!r}; use one of {tuple(SHARDING_TRAFFIC)}")
    _check_modules(modules)
    degrees = _checked_degrees(modules, layers, placement, num_microbatches, dp=dp, tp=tp, cp=cp, cp_mode=cp_mode,
                               ulysses=ulysses, encoder_cp=encoder_cp, samples_per_microbatch=samples_per_microbatch,
                               ep=ep)
    stages = _plan_stages(modules, layers, placement, degrees)
    moe = _llm_expert_parts(modules, layers, placement)  # stage -> (expert state, expert grads, routed, in backward)
    cp_fwd, cp_bwd = _cp_seconds(modules, layers, placement, stages, degrees, cp_bandwidth)
    ep_f, ep_b = _ep_seconds(modules[LANGUAGE_MODEL].experts, moe, stages.table, degrees, ep_bandwidth)
    fwd, bwd, comm_f, comm_b, kept = _stage_seconds(stages, tp_bandwidth, (cp_fwd, cp_bwd), (ep_f, ep_b))
    for s, n in stages.samples.items():  # per-module dp: an encoder stage's work per microbatch position
        for values in (fwd, bwd, comm_f, comm_b, kept, cp_fwd, cp_bwd):
            values[s] *= n
    sync, state, experts_held = _sync_and_state(stages, moe, degrees, sharding, allreduce_bandwidth)
    per_replica = num_microbatches // degrees.dp
    result = simulate_1f1b(stages.graph, per_replica, fwd, bwd, p2p_latency, sync, comm_f, comm_b)
    memory = {s: state_bytes_per_device(state[s], r[5], stages.dp[s] * stages.ranks[s], stages.tp[s], sharding,
                                        fsdp_reduce)
              + experts_held[s] + kept[s] * result.peak_inflight[s] for s, r in stages.table.items()}
    d = degrees
    return Plan(placement, {m: list(v) for m, v in layers.items()}, d.dp, per_replica, fwd, bwd, memory, result,
                all(v <= memory_limit for v in memory.values()), d.tp, sharding, d.cp,
                d.cp_mode if d.cp > 1 else "allgather", d.ulysses, {s: cp_fwd[s] + cp_bwd[s] for s in stages.table},
                d.encoder_cp, d.module_dp, d.module_tp, d.samples_per_microbatch, d.ep,
                {s: ep_f[s] + ep_b[s] for s in stages.table} if d.ep > 1 else {})


@dataclass(frozen=True)
class _Degrees:
    """The degrees one ``evaluate_plan`` runs with, checked: the LLM's dp and tp (every module's under per-module
    parallelism, else empty), the LLM's CP degree, mode and Ulysses degree, the encoders' CP degrees above 1, the
    expert-parallel degree and the samples in one microbatch."""

    dp: int
    tp: int
    module_dp: dict[str, int]
    module_tp: dict[str, int]
    cp: int
    cp_mode: str
    ulysses: int
    encoder_cp: dict[str, int]
    ep: int
    samples_per_microbatch: int


def _checked_degrees(modules, layers, placement, num_microbatches, *, dp, tp, cp, cp_mode, ulysses, encoder_cp,
                     samples_per_microbatch, ep) -> _Degrees:
    """``evaluate_plan``'s degrees for this layout, or the ValueError (with the fix) for one the runtime refuses:
    per-module degrees, the CP mode and its Ulysses degree, the stage sizes, the encoders' CP, ep and the layout."""
    module_dp = _module_degrees(dp, modules, "dp") if isinstance(dp, dict) else {}
    module_tp = _module_degrees(tp, modules, "tp") if isinstance(tp, dict) else {}
    if module_dp:
        if not isinstance(samples_per_microbatch, int) or samples_per_microbatch < 1:
            raise ValueError(f"samples_per_microbatch must be an int >= 1, got {samples_per_microbatch!r}")
        check_module_dp(module_dp, placement, samples_per_microbatch)
        dp = module_dp[LANGUAGE_MODEL]
    llm_tp = module_tp.get(LANGUAGE_MODEL, tp)
    k = _ulysses_degree(modules[LANGUAGE_MODEL].attention, llm_tp, cp, cp_mode, ulysses)
    if num_microbatches % dp:
        raise ValueError(f"num_microbatches={num_microbatches} is not divisible by dp={dp}; pick dp dividing it")
    _check_stage_sizes(modules, layers, placement)
    encoder_cp = {e: n for e, n in (encoder_cp or {}).items() if n != 1}
    unknown = [e for e in encoder_cp if e not in _encoders(modules)]
    if unknown:
        raise ValueError(f"encoder_cp names {unknown}, which are not encoders of these modules "
                         f"({_encoders(modules)}); give a degree per encoder name")
    check_ep(ep, dp, modules[LANGUAGE_MODEL].experts, bool(module_dp))
    replica_layout(*_parallel_specs(layers, llm_tp, cp, cp_mode, k, encoder_cp, module_tp, ep=ep), placement)
    return _Degrees(dp, llm_tp, module_dp, module_tp, cp, cp_mode, k, encoder_cp, ep, samples_per_microbatch)


def _ulysses_degree(attention: AttentionShape | None, tp: int, cp: int, cp_mode: str, ulysses: int | None) -> int:
    """The Ulysses degree ``cp_mode`` runs with on ``cp`` ranks (1 for allgather, cp for ulysses, ``ulysses`` for
    hybrid), checked against the mode's valid degrees and the LLM's heads at tensor parallelism ``tp``."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be an int >= 1, got {cp!r}")
    degrees = cp_degrees_of(cp, cp_mode)
    k = 1 if cp == 1 or cp_mode == "allgather" else (cp if cp_mode == "ulysses" else ulysses)
    if k not in degrees:
        raise ValueError(f"cp_mode={cp_mode!r} with cp={cp} runs with ulysses in {degrees}, got ulysses={ulysses!r}"
                         + ("" if degrees else f"; cp={cp} has no divisor strictly between 1 and cp"))
    problem = cp_heads_problem(attention, tp, k)
    if problem:
        raise ValueError(f"cp_mode={cp_mode!r} (Ulysses degree {k}) does not fit: {problem}")
    return k


def _check_stage_sizes(modules: dict[str, ModuleSpec], layers: dict[str, list[int]], placement: str) -> None:
    """Raise unless every module's stage sizes are >= 1 and cover its layers (colocated: equal encoder stage counts)."""
    if placement == "colocated" and len({len(layers[e]) for e in _encoders(modules)}) > 1:
        counts = {e: len(layers[e]) for e in _encoders(modules)}
        raise ValueError(f"colocated placement needs equal encoder stage counts, got {counts}")
    for module, sizes in layers.items():
        if sum(sizes) != len(modules[module].costs) or min(sizes) < 1:
            raise ValueError(f"{module}: stage sizes {sizes} must be >= 1 and cover its {len(modules[module].costs)} "
                             "layers")


@dataclass(frozen=True)
class _Stages:
    """Per graph stage of one layout: its summed layers (``_stage_table``) and the graph; its tp and dp (those of the
    first module it holds); under per-module dp, the samples its busiest replica encodes per microbatch position
    (relative to a microbatch; else empty); its LLM part (``_llm_stage_parts``, zeros without one), what context
    parallelism splits; the ranks its parameters are replicated over (the LLM's cp, an encoder's CP degree, else 1)
    and the busiest CP rank's (work, token) share (``encoder_cp_split``)."""

    table: dict[str, tuple[float, float, float, float, float, bool, float]]
    graph: StageGraph
    tp: dict[str, int]
    dp: dict[str, int]
    samples: dict[str, float]
    llm: dict[str, tuple[float, float, float, int, int]]
    ranks: dict[str, int]
    share: dict[str, tuple[float, float]]


def _plan_stages(modules, layers, placement, degrees: _Degrees) -> _Stages:
    table = _stage_table(modules, layers, placement)
    graph = plan_graph(modules, layers, placement)
    owner = {s: parts[0][0] for s, parts in placement_table({e: len(layers[e]) for e in _encoders(modules)},
                                                               len(layers[LANGUAGE_MODEL]), placement).items()}
    stage_tp = {s: degrees.module_tp.get(owner[s], degrees.tp) for s in table}
    stage_dp = {s: degrees.module_dp.get(owner[s], degrees.dp) for s in table}
    per_mb = degrees.samples_per_microbatch
    samples = {s: encoder_samples(degrees.dp, stage_dp[s], per_mb) / per_mb
               for s in table} if degrees.module_dp else {}
    llm = _llm_stage_parts(modules, layers, placement)  # stage -> (fwd, bwd, kept, layers, layers in backward)
    split = {s: llm.get(s, (0.0, 0.0, 0.0, 0, 0)) for s in table}
    ranks = {s: degrees.cp if s in llm else 1 for s in table}
    share = {s: (1.0, 1.0) for s in table}
    for e, n in degrees.encoder_cp.items():
        split_e = encoder_cp_split(modules[e], n)
        for i in range(len(layers[e])):
            ranks[stage_name(e, i)], share[stage_name(e, i)] = n, split_e
    return _Stages(table, graph, stage_tp, stage_dp, samples, split, ranks, share)


def _cp_seconds(modules, layers, placement, stages: _Stages, degrees: _Degrees,
                bandwidth: float) -> tuple[dict, dict]:
    """Per stage, (forward, backward) seconds of context-parallel communication per microbatch: its LLM layers'
    ``cp_layer_bytes`` (attention and Gated DeltaNet layers each their own; backward for the layers taking part in
    it) and, on an encoder's last stage, the feature gather (``encoder_gather_seconds``)."""
    cp_fwd, cp_bwd = dict.fromkeys(stages.table, 0.0), dict.fromkeys(stages.table, 0.0)
    for e, n in degrees.encoder_cp.items():
        last = stage_name(e, len(layers[e]) - 1)
        cp_fwd[last], backward = encoder_gather_seconds(modules[e], n, bandwidth, stages.share[last][1])
        cp_bwd[last] = backward if stages.graph.node(last).needs_backward else 0.0
    spec = modules[LANGUAGE_MODEL]
    if degrees.cp == 1 or spec.attention is None:
        return cp_fwd, cp_bwd
    linear = set(spec.attention.linear_ids)
    per_kind = {kind: cp_layer_bytes(spec.attention, degrees.cp, degrees.cp_mode, degrees.ulysses, degrees.tp, kind)
                for kind in (False, True)}

    def row(sl: slice):  # (forward, backward) bytes of the slice's layers
        kinds = [(i in linear, c.in_backward) for i, c in zip(range(len(spec.costs))[sl], spec.costs[sl])]
        return (sum(per_kind[k]["forward"] for k, _ in kinds),
                sum(per_kind[k]["backward"] for k, back in kinds if back))
    for s, (fwd, bwd) in _per_llm_stage(modules, layers, placement, row).items():
        cp_fwd[s] += fwd / bandwidth
        cp_bwd[s] += bwd / bandwidth
    return cp_fwd, cp_bwd


def _ep_seconds(experts: ExpertShape | None, moe: dict, table: dict, degrees: _Degrees,
                bandwidth: float) -> tuple[dict, dict]:
    """Per stage, (forward, backward) seconds of expert parallelism's dispatch and combine all-to-alls per
    microbatch: one pair per routed layer (per routed layer in backward), zero with ep 1."""
    ep_f, ep_b = dict.fromkeys(table, 0.0), dict.fromkeys(table, 0.0)
    if degrees.ep > 1 and experts is not None:
        a2a = all_to_all_bytes(experts.tokens / (degrees.cp * degrees.tp), experts.top_k, experts.hidden,
                               experts.dtype_bytes, degrees.ep)
        for s, (_, _, routed, routed_b) in moe.items():
            ep_f[s], ep_b[s] = routed * a2a["forward"] / bandwidth, routed_b * a2a["backward"] / bandwidth
    return ep_f, ep_b


def _stage_seconds(stages: _Stages, tp_bandwidth: float, cp: tuple[dict, dict], ep: tuple[dict, dict]):
    """Per stage and microbatch: (forward, backward, communication in forward, in backward, kept activation
    bytes). Compute and kept activations split over the stage's CP ranks (the LLM part) at the busiest rank's
    share, compute over its tp ranks; each layer's tensor-parallel all-reduces, and ``cp`` and ``ep`` seconds
    ((forward, backward) per stage), added."""
    table, split, ranks, share, stage_tp = stages.table, stages.llm, stages.ranks, stages.share, stages.tp
    (cp_fwd, cp_bwd), (ep_f, ep_b) = cp, ep
    tp_comm = {s: 2 * allreduce_seconds(r[6], stage_tp[s], tp_bandwidth) for s, r in table.items()}
    compute_f = {s: (r[0] - split[s][0] + split[s][0] / ranks[s]) * share[s][0] for s, r in table.items()}
    compute_b = {s: (r[1] - split[s][1] + split[s][1] / ranks[s]) * share[s][0] for s, r in table.items()}
    comm_f = {s: tp_comm[s] + cp_fwd[s] + ep_f[s] for s in table}
    comm_b = {s: (tp_comm[s] if r[1] > 0 else 0.0) + cp_bwd[s] + ep_b[s] for s, r in table.items()}
    fwd = {s: compute_f[s] / stage_tp[s] + tp_comm[s] + cp_fwd[s] + ep_f[s] for s in table}
    bwd = {s: compute_b[s] / stage_tp[s] + (tp_comm[s] if r[1] > 0 else 0.0) + cp_bwd[s] + ep_b[s]
           for s, r in table.items()}
    kept = {s: (r[3] - split[s][2] + split[s][2] / ranks[s]) * share[s][1] for s, r in table.items()}
    return fwd, bwd, comm_f, comm_b, kept


def _sync_and_state(stages: _Stages, moe: dict, degrees: _Degrees, sharding: str, bandwidth: float):
    """Per stage: (gradient sync seconds per step, model-state bytes sharding applies to, expert bytes held per
    rank). Gradients are all-reduced over the stage's dp x CP ranks; with ep > 1 the experts (outside FSDP, whole
    on every tp rank) count at 1 / ep of their state per rank, their gradients all-reduced over the dp / ep
    replicas, CP and tp ranks holding the same experts."""
    table, traffic = stages.table, SHARDING_TRAFFIC[sharding]
    sync = {s: traffic * allreduce_seconds(r[4] / stages.tp[s], stages.dp[s] * stages.ranks[s], bandwidth)
            for s, r in table.items()}
    state, experts_held = {s: r[2] for s, r in table.items()}, dict.fromkeys(table, 0.0)
    if degrees.ep > 1:
        ep = degrees.ep
        for s, (expert_state, expert_grads, _, _) in moe.items():
            state[s], experts_held[s] = table[s][2] - expert_state, expert_state / ep
            sync[s] = (traffic * allreduce_seconds((table[s][4] - expert_grads) / stages.tp[s],
                                                   stages.dp[s] * stages.ranks[s], bandwidth)
                       + allreduce_seconds(expert_grads / ep, stages.dp[s] // ep * stages.ranks[s] * stages.tp[s],
                                           bandwidth))
    return sync, state, experts_held


def check_ep(ep: int, dp: int, experts: ExpertShape | None, per_module_dp: bool = False) -> None:
    """Raise (with the fix) for an expert-parallel degree the runtime does not serve (``check_expert_parallel``):
    ep must divide dp and the expert count; the search costs it with one dp for every module."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be an int >= 1, got {ep!r}")
    if ep == 1:
        return
    if experts is None:
        raise ValueError(f"ep={ep} needs a mixture-of-experts language model (ModuleSpec.experts); use ep=1")
    if experts.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the {experts.num_experts} experts; choose an ep dividing "
                         f"{experts.num_experts}")
    if dp % ep:
        raise ValueError(f"ep={ep} splits the experts over data-parallel replicas, but dp={dp}; use an ep dividing dp")
    if per_module_dp:
        raise ValueError("the planner does not cost expert parallelism with per-module data-parallel degrees (the "
                         "strategy runs it); search with one dp for every module")


def _llm_expert_parts(modules, layers, placement) -> dict[str, tuple[float, float, int, int]]:
    """Per graph stage holding LLM layers: the model-state and gradient bytes of its routed experts, its routed
    layer count and the count of those taking part in backward (what expert parallelism splits and dispatches)."""
    spec = modules[LANGUAGE_MODEL]
    eb, eg = spec.per_layer(spec.expert_bytes), spec.per_layer(spec.expert_grad_bytes)

    def row(sl: slice):
        routed = [b > 0 for b in eb[sl]]
        return (sum(eb[sl]), sum(eg[sl]), sum(routed),
                sum(1 for r, c in zip(routed, spec.costs[sl]) if r and c.in_backward))
    return _per_llm_stage(modules, layers, placement, row)


def _llm_stage_parts(modules, layers, placement) -> dict[str, tuple[float, float, float, int, int]]:
    """Per graph stage holding LLM layers: their forward, backward, kept activation bytes, layer count and count
    of those taking part in backward (what context parallelism splits and what its attention communicates)."""
    spec = modules[LANGUAGE_MODEL]
    ab = spec.per_layer(spec.activation_bytes)

    def row(sl: slice):
        costs = spec.costs[sl]
        kept = sum(a for a, c in zip(ab[sl], costs) if c.in_backward)
        return (sum(c.forward for c in costs), sum(c.backward for c in costs), kept, len(costs),
                sum(1 for c in costs if c.in_backward))
    return _per_llm_stage(modules, layers, placement, row)


def _per_llm_stage(modules, layers, placement, row) -> dict[str, tuple]:
    """``row(layer slice)`` of each LLM pipeline slice, keyed by the graph stage that runs it."""
    rows, start = [], 0
    for size in layers[LANGUAGE_MODEL]:
        rows.append(row(slice(start, start + size)))
        start += size
    encoder_stages = {e: len(layers[e]) for e in _encoders(modules)}
    return {stage: rows[i] for stage, parts in placement_table(encoder_stages, len(layers[LANGUAGE_MODEL]),
                                                               placement).items()
            for module, i in parts if module == LANGUAGE_MODEL}


def forward_only_modules(modules: dict[str, ModuleSpec]) -> dict[str, ModuleSpec]:
    """What the frozen-unaware baseline believes about time: every layer does backward and backward =
    2 x forward. It still knows which layers keep activations, so memory is not mis-estimated."""
    out = {}
    for name, spec in modules.items():
        kept = [a if c.in_backward else 0.0 for a, c in zip(spec.per_layer(spec.activation_bytes), spec.costs)]
        believed = [LayerCost(c.forward, 2.0 * c.forward, True, True) for c in spec.costs]
        out[name] = ModuleSpec(believed, spec.param_bytes, kept, spec.grad_bytes, attention=spec.attention,
                               items=spec.items, item_width=spec.item_width, feature_bytes=spec.feature_bytes,
                               expert_bytes=spec.expert_bytes, expert_grad_bytes=spec.expert_grad_bytes,
                               experts=spec.experts)
    return out


def _planning_weights(spec: ModuleSpec) -> list[float]:
    return [c.total for c in spec.costs]


class _Partitions:
    """Frozen-aware partitions and their planning-weight bottlenecks, cached per (module, stage count)."""

    def __init__(self, modules: dict[str, ModuleSpec]):
        self.modules = modules
        self.weights = {m: _planning_weights(spec) for m, spec in modules.items()}
        self._sizes: dict[tuple[str, int], list[int]] = {}

    def sizes(self, module: str, count: int) -> list[int]:
        key = (module, count)
        if key not in self._sizes:
            self._sizes[key] = partition_module(self.modules[module].costs, count)
        return self._sizes[key]

    def stage_weights(self, module: str, count: int) -> list[float]:
        return stage_sums(self.weights[module], self.sizes(module, count))

    def fewest_stages_under(self, module: str, target: float) -> int:
        """Greedy packing: the exact minimum number of contiguous stages each <= target (capped at layers)."""
        count, load = 1, 0.0
        for w in self.weights[module]:
            if load + w > target and load > 0:
                count, load = count + 1, 0.0
            load += w
        return min(count, len(self.weights[module]))

    def fused_count_under(self, names: list[str], target: float) -> int:
        """Fewest common stage count whose fused stage (stage i of every encoder on one device) is <= target."""
        limit = min(len(self.weights[e]) for e in names)
        for count in range(max(self.fewest_stages_under(e, target) for e in names), limit + 1):
            fused = [sum(v) for v in zip(*(self.stage_weights(e, count) for e in names))]
            if max(fused) <= target:
                return count
        return limit

    def water_fill(self, names: list[str], devices: int, widths: dict[str, int] | None = None,
                   shares: dict[str, float] | None = None) -> list[int] | None:
        """Share `devices` among encoder stages, one stage at a time to the current slowest (None if too few). A
        stage of encoder e takes ``widths[e]`` devices (its CP degree) and its weight counts ``shares[e]`` (its
        busiest CP rank's share)."""
        widths, shares = widths or {}, shares or {}
        left = devices - sum(widths.get(e, 1) for e in names)
        if left < 0:
            return None
        counts = {e: 1 for e in names}
        while True:
            growable = [e for e in names if counts[e] < len(self.weights[e]) and widths.get(e, 1) <= left]
            if not growable:
                break
            slowest = max(growable, key=lambda e: max(self.stage_weights(e, counts[e])) * shares.get(e, 1.0))
            counts[slowest] += 1
            left -= widths.get(slowest, 1)
        return [counts[e] for e in names]


def _neighbours(count: int, limit: int) -> list[int]:
    return [c for c in (count - 1, count, count + 1) if 1 <= c <= limit]


def candidate_layouts(modules: dict[str, ModuleSpec], budget: int, placements: Sequence[str], llm_width: int = 1,
                      encoder_cp: dict[str, int] | None = None):
    """Yield (placement, layers per stage per module) for one replica's device budget (001 Algorithm 1):
    per LLM stage count, encoder stage counts matched to the LLM's slowest stage (and their neighbours),
    plus the best share of the remaining devices when the matched counts do not fit. An LLM stage takes
    ``llm_width`` of the budget's units (its cp), an encoder stage one, or its CP degree ``encoder_cp[e]`` (then
    only parallel placement is proposed, and its stages are matched at the busiest CP rank's share of the work)."""
    encoders = _encoders(modules)
    parts = _Partitions(modules)
    widths = {e: n for e, n in (encoder_cp or {}).items() if n > 1}
    shares = {e: encoder_cp_split(modules[e], n)[0] for e, n in widths.items()}
    if widths:
        placements = [p for p in placements if p == "parallel"]
    llm_layers = len(modules[LANGUAGE_MODEL].costs)
    for llm_pp in range(1, min(llm_layers, budget // llm_width) + 1):
        llm_sizes = parts.sizes(LANGUAGE_MODEL, llm_pp)
        target = max(parts.stage_weights(LANGUAGE_MODEL, llm_pp))
        if "replicated" in placements:
            lead = sum(sum(parts.weights[e]) for e in encoders)
            llm_w = [parts.weights[LANGUAGE_MODEL][0] + lead] + parts.weights[LANGUAGE_MODEL][1:]
            yield "replicated", {**{e: [len(modules[e].costs)] for e in encoders}, LANGUAGE_MODEL: partition(llm_w, llm_pp)}
        if not encoders:
            if "replicated" not in placements:
                yield "parallel", {LANGUAGE_MODEL: llm_sizes}
            continue
        spare = budget - llm_pp * llm_width
        if "parallel" in placements:
            options = [_neighbours(parts.fewest_stages_under(e, target / shares.get(e, 1.0)), len(modules[e].costs))
                       for e in encoders]
            choices = [c for c in itertools.product(*options)
                       if sum(n * widths.get(e, 1) for e, n in zip(encoders, c)) <= spare]
            filled = parts.water_fill(encoders, spare, widths, shares)
            if filled is not None:
                choices.append(tuple(filled))
            for counts in dict.fromkeys(choices):
                yield "parallel", {**{e: parts.sizes(e, c) for e, c in zip(encoders, counts)}, LANGUAGE_MODEL: llm_sizes}
        if "colocated" in placements:
            limit = min(len(modules[e].costs) for e in encoders)
            matched = parts.fused_count_under(encoders, target)
            counts = [c for c in _neighbours(matched, limit) if c <= spare]
            if matched > spare and spare >= 1:
                counts.append(spare)
            for count in dict.fromkeys(counts):
                yield "colocated", {**{e: parts.sizes(e, count) for e in encoders}, LANGUAGE_MODEL: llm_sizes}


def _compositions(total: int, limits: Sequence[int]):
    """Every tuple of len(limits) counts, each in [1, limit], summing to `total`."""
    if not limits:
        if total == 0:
            yield ()
        return
    rest = len(limits) - 1
    for first in range(1, min(limits[0], total - rest) + 1):
        for tail in _compositions(total - first, limits[1:]):
            yield (first, *tail)


def fixed_stage_layouts(modules: dict[str, ModuleSpec], stages: int, placements: Sequence[str]):
    """Yield (placement, layers per stage per module) for EVERY split of exactly `stages` stages between the
    modules (the seeds' fixed-layout setting: the device count and the total stage count are given, the
    planner chooses how many stages each module gets and where the boundaries go). Boundaries per module by
    the Eq. 3.5 DP on the given costs."""
    encoders = _encoders(modules)
    parts = _Partitions(modules)
    llm_layers = len(modules[LANGUAGE_MODEL].costs)
    enc_layers = [len(modules[e].costs) for e in encoders]
    if "replicated" in placements or not encoders:
        if stages <= llm_layers:
            if encoders:
                lead = sum(sum(parts.weights[e]) for e in encoders)
                llm_w = [parts.weights[LANGUAGE_MODEL][0] + lead] + parts.weights[LANGUAGE_MODEL][1:]
                yield "replicated", {**{e: [n] for e, n in zip(encoders, enc_layers)}, LANGUAGE_MODEL: partition(llm_w, stages)}
            else:
                yield "parallel", {LANGUAGE_MODEL: parts.sizes(LANGUAGE_MODEL, stages)}
    if not encoders:
        return
    for llm_pp in range(1, min(llm_layers, stages - 1) + 1):
        spare = stages - llm_pp
        llm_sizes = parts.sizes(LANGUAGE_MODEL, llm_pp)
        if "parallel" in placements:
            for counts in _compositions(spare, enc_layers):
                yield "parallel", {**{e: parts.sizes(e, c) for e, c in zip(encoders, counts)}, LANGUAGE_MODEL: llm_sizes}
        if "colocated" in placements and spare <= min(enc_layers):
            yield "colocated", {**{e: parts.sizes(e, spare) for e in encoders}, LANGUAGE_MODEL: llm_sizes}


def search(modules: dict[str, ModuleSpec], num_devices: int, num_microbatches: int, memory_limit: float = math.inf,
           p2p_latency: float = 0.0, placements: Sequence[str] = ("parallel", "colocated"), mode: str = "frozen-aware",
           data_parallel: bool = True, stages: int | None = None, allreduce_bandwidth: float = math.inf,
           tp_degrees: Sequence[int] = (1,), sharding_strategies: Sequence[str] = ("NO_SHARD",),
           tp_bandwidth: float = math.inf, cp_degrees: Sequence[int] = (1,), cp_modes: Sequence[str] = ("allgather",),
           cp_bandwidth: float = math.inf, encoder_cp_degrees: Sequence[int] = (1,), ep_degrees: Sequence[int] = (1,),
           ep_bandwidth: float = math.inf) -> SearchResult:
    """Pick DP degree, stage counts, boundaries and placement minimising the simulated time of one global
    batch of `num_microbatches`. Two frozen-unaware baselines believe backward = 2 x forward everywhere and
    partition by that belief; their chosen layout is then re-timed with the true costs (`best`), while
    `candidates` keep the believed times:
    - `mode="forward-only"` ranks candidates by the believed simulated time (the strongest unaware planner);
    - `mode="forward-variance"` ranks them by the variance of forward time across stages, the seeds' own
      baseline ("tries to minimize variance of forward time across pipeline stages", 003 sec. 3.5.3).

    `stages=S` fixes the number of pipeline stages per replica (the seeds' Table 3.2 setting: same devices
    and stage count for both modes): every split of S stages between the modules is enumerated (001
    Algorithm 1's matched counts are not used), and only dp with dp * S <= num_devices is tried.
    `allreduce_bandwidth` (bytes/s per device) times each stage's gradient all-reduce when dp > 1 (default:
    free, which favours data parallelism). ``tp_degrees`` and ``sharding_strategies`` are searched too (every
    stage of a candidate gets the same tp); ``tp_bandwidth`` (bytes/s) times the tensor-parallel all-reduces.
    ``cp_degrees`` (the LLM stages' context parallelism) and ``cp_modes`` are searched too, hybrid with every
    valid Ulysses degree K; ``cp_bandwidth`` (bytes/s per rank) times each mode's ``cp_communication_bytes``
    (``evaluate_plan``). Modes or degrees the LLM's heads cannot take are skipped, their reasons in
    ``SearchResult.rejected``. ``encoder_cp_degrees``: the encoders' context-parallel degrees tried, every
    combination over the encoders; a degree above 1 only with parallel placement (``replica_layout`` refuses it
    otherwise; the reason goes to ``rejected``), whose encoder stage counts are then matched at the busiest CP
    rank's share of the work. The default ``(1,)`` searches no encoder CP. ``ep_degrees``: the expert-parallel
    degrees of a mixture-of-experts LLM tried, each with every dp it divides (and that divides the LLM's expert
    count; NO_SHARD only, as the runtime); ``ep_bandwidth`` (bytes/s per rank) times their all-to-alls
    (``evaluate_plan``). Equal times go to fewer devices, then to the smaller ep."""
    _check_modules(modules)
    _check_search(num_devices, mode, stages, cp_modes)
    planning = modules if mode == "frozen-aware" else forward_only_modules(modules)
    llm, rejected = modules[LANGUAGE_MODEL], []
    cp_options = _cp_options(cp_degrees, cp_modes, tp_degrees, llm.attention, rejected)
    encoder_cp = _encoder_cp_options(_encoders(modules), encoder_cp_degrees, placements, rejected)
    ep_options = _ep_options(ep_degrees, llm.experts, rejected)
    grid = [(d, t, sh, c, m, k, e) for c, m, k, t in cp_options for d in range(1, num_devices // (t * c) + 1)
            for sh in (sharding_strategies if d * c > 1 else ("NO_SHARD",))
            for e in ep_options
            if num_microbatches % d == 0 and (data_parallel or d == 1)
            and (stages is None or d * t * stages <= num_devices)
            and d % e == 0]
    evaluate = functools.partial(evaluate_plan, num_microbatches=num_microbatches, p2p_latency=p2p_latency,
                                 memory_limit=memory_limit, allreduce_bandwidth=allreduce_bandwidth,
                                 tp_bandwidth=tp_bandwidth, cp_bandwidth=cp_bandwidth, ep_bandwidth=ep_bandwidth)
    # The frozen-aware search also times the layouts the forward-only belief would propose (true costs): the DP
    # minimises the slowest stage, and among equal bottlenecks where the heavier stages sit changes the 1F1B
    # time a little, so without them the aware search could lose to the unaware one by a fraction of a percent.
    proposers = [planning] if planning is not modules else [modules, forward_only_modules(modules)]
    candidates = _candidate_plans(planning, proposers, itertools.product(grid, encoder_cp), evaluate,
                                  num_devices=num_devices, placements=placements, stages=stages)
    if not candidates:
        why = ("; rejected: " + "; ".join(rejected)) if rejected else ""
        raise ValueError(f"no layout with stages={stages} and placements={tuple(placements)} exists for these modules "
                         "(every module needs at least one stage, and no more stages than layers)" + why)
    best = _best_plan(candidates, mode, memory_limit, suggest_ep=llm.experts is not None and max(ep_options) == 1)
    if planning is not modules:
        best = evaluate(modules, best.layers, best.placement, dp=best.dp, tp=best.tp, sharding=best.sharding,
                        cp=best.cp, cp_mode=best.cp_mode, ulysses=best.ulysses, encoder_cp=best.encoder_cp,
                        ep=best.ep)
    return SearchResult(best, candidates, rejected)


def _check_search(num_devices: int, mode: str, stages: int | None, cp_modes: Sequence[str]) -> None:
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if mode not in SEARCH_MODES:
        raise ValueError(f"unknown search mode {mode!r}; use one of {SEARCH_MODES}")
    if stages is not None and not (isinstance(stages, int) and 1 <= stages <= num_devices):
        raise ValueError(f"stages must be an int in [1, num_devices={num_devices}], got {stages!r}")
    for m in cp_modes:
        cp_degrees_of(1, m)  # an unknown mode raises


def _cp_options(cp_degrees, cp_modes, tp_degrees, attention: AttentionShape | None,
                rejected: list[str]) -> list[tuple[int, str, int, int]]:
    """The (cp, cp_mode, Ulysses degree, tp) the search tries: every CP degree with each mode (allgather alone at
    cp 1), every valid Ulysses degree of the mode and every tp, where the LLM's heads can run them (for an LLM with
    Gated DeltaNet layers, CP degrees that divide their value heads); the others go to ``rejected``, with the
    reason."""
    options = []
    for c in dict.fromkeys(cp_degrees):
        if not isinstance(c, int) or c < 1:
            raise ValueError(f"cp degrees must be ints >= 1, got {c!r}")
        if c > 1 and attention is not None and attention.linear_layers and attention.linear_value_heads % c:
            rejected.append(f"cp={c}: the language model's {attention.linear_layers} Gated DeltaNet layers are split "
                            f"by heads over the CP ranks, and cp={c} does not divide their "
                            f"{attention.linear_value_heads} value heads")
            continue
        for m in (("allgather",) if c == 1 else dict.fromkeys(cp_modes)):
            ks = cp_degrees_of(c, m)
            if not ks:
                rejected.append(f"cp={c} cp_mode='hybrid': cp={c} has no divisor K with 1 < K < cp")
            for t in tp_degrees:
                for k in ks:
                    problem = cp_heads_problem(attention, t, k)
                    if problem:
                        rejected.append(f"cp={c} cp_mode={m!r}" + (f" ulysses={k}" if m == "hybrid" else "")
                                        + f" tp={t}: {problem}")
                    else:
                        options.append((c, m, k, t))
    return options


def _encoder_cp_options(encoders: list[str], encoder_cp_degrees, placements: Sequence[str],
                        rejected: list[str]) -> list[dict[str, int]]:
    """Every combination of the encoders' CP degrees; for each placement other than parallel, why it refuses a
    degree above 1 goes to ``rejected``."""
    degrees = list(dict.fromkeys(encoder_cp_degrees))
    if not degrees or any(not isinstance(n, int) or n < 1 for n in degrees):
        raise ValueError(f"encoder_cp_degrees must be ints >= 1, got {tuple(encoder_cp_degrees)!r}")
    if any(n > 1 for n in degrees) and encoders:
        for p in placements:
            if p != "parallel":
                try:
                    replica_layout({encoders[0]: ParallelSpec(cp=max(degrees))}, ParallelSpec(), p)
                except ValueError as err:
                    rejected.append(f"encoder cp > 1 with placement {p!r}: {err}")
    return [dict(zip(encoders, c)) for c in itertools.product(degrees, repeat=len(encoders))]


def _ep_options(ep_degrees, experts: ExpertShape | None, rejected: list[str]) -> list[int]:
    """The expert-parallel degrees the LLM's experts take (1, and those dividing the expert count); why the others
    do not goes to ``rejected``."""
    degrees = list(dict.fromkeys(ep_degrees))
    if not degrees or any(not isinstance(e, int) or e < 1 for e in degrees):
        raise ValueError(f"ep_degrees must be ints >= 1, got {tuple(ep_degrees)!r}")
    for e in degrees:
        if e > 1 and experts is None:
            rejected.append(f"ep={e}: the language model has no routed experts (ModuleSpec.experts)")
        elif e > 1 and experts.num_experts % e:
            rejected.append(f"ep={e}: does not divide the {experts.num_experts} experts")
    return [e for e in degrees if e == 1 or (experts is not None and experts.num_experts % e == 0)]


def _candidate_plans(planning: dict[str, ModuleSpec], proposers: list[dict[str, ModuleSpec]], options, evaluate, *,
                     num_devices: int, placements: Sequence[str], stages: int | None) -> list[Plan]:
    """Every layout the ``proposers`` propose for each option ((dp, tp, sharding, cp, cp_mode, Ulysses degree, ep),
    encoders' CP degrees), timed once with the ``planning`` costs (``evaluate``: ``evaluate_plan`` with the search's
    batch and bandwidths), that fits ``num_devices``. Encoder CP only with parallel placement."""
    candidates = []
    for (dp, tp, sharding, cp, cp_mode, k, ep), ecp in options:
        seen = set()
        for proposer in proposers:
            layouts = (candidate_layouts(proposer, num_devices // (dp * tp), placements, cp, ecp) if stages is None
                       else fixed_stage_layouts(proposer, stages, placements))
            for placement, layers in layouts:
                key = (placement, tuple((m, tuple(v)) for m, v in layers.items()))
                if key not in seen and (placement == "parallel" or all(n == 1 for n in ecp.values())):
                    seen.add(key)
                    plan = evaluate(planning, layers, placement, dp=dp, tp=tp, sharding=sharding, cp=cp,
                                    cp_mode=cp_mode, ulysses=k, encoder_cp=ecp, ep=ep)
                    if plan.devices <= num_devices:
                        candidates.append(plan)
    return candidates


def _best_plan(candidates: list[Plan], mode: str, memory_limit: float, suggest_ep: bool) -> Plan:
    """The candidate within ``memory_limit`` that ``mode`` ranks first (equal times to fewer devices, then the
    smaller ep), or the ValueError with what would make one fit (``suggest_ep``: splitting the experts)."""
    feasible = [p for p in candidates if p.fits_memory]
    if not feasible:
        need = min((max(p.memory.values()) for p in candidates), default=math.nan)
        raise ValueError(
            f"no layout fits {memory_limit:.3g} bytes per device (the smallest needs {need:.3g}); "
            "add devices, raise memory_limit, or recompute activations (MultimodalParallelStrategy("
            "activation_checkpointing=True); costs and memory with recompute=True)"
            + ("; or split the experts over data-parallel ranks (ep_degrees=(1, 2, ...))" if suggest_ep else "")
        )
    if mode == "forward-variance":
        return min(feasible, key=lambda p: (statistics.pvariance(p.forward.values()), p.iteration_time, p.devices,
                                            p.ep))
    return min(feasible, key=lambda p: (p.iteration_time, p.devices, p.ep))


def cp_mode_label(plan: Plan) -> str:
    """The LLM's CP mode as the tables print it: "-" without CP, "hybrid(K=4)" with its Ulysses degree."""
    if plan.cp == 1:
        return "-"
    return f"hybrid(K={plan.ulysses})" if plan.cp_mode == "hybrid" else plan.cp_mode


def encoder_cp_label(plan: Plan) -> str:
    """The encoders' CP degrees as the tables print them: "-" without encoder CP, else e.g. "vision:2,audio:1"."""
    if not plan.encoder_cp:
        return "-"
    return ",".join(f"{e}:{plan.encoder_cp.get(e, 1)}" for e in plan.layers if e != LANGUAGE_MODEL)


def stage_cp(plan: Plan, stage: str) -> int:
    """The CP degree of one stage of ``plan``: the LLM's cp, an encoder's CP degree, 1 for colocated stages."""
    return plan.layout.cp[stage]


def stage_layers(plan: Plan) -> dict[str, str]:
    """Per stage, the layer ranges it holds, e.g. ``"language_model[0:3]+vision[0:12]"``."""
    ranges = {}
    for module, sizes in plan.layers.items():
        start = 0
        for i, size in enumerate(sizes):
            ranges[(module, i)] = f"{module}[{start}:{start + size}]"
            start += size
    table = placement_table({m: len(s) for m, s in plan.layers.items() if m != LANGUAGE_MODEL},
                            len(plan.layers[LANGUAGE_MODEL]), plan.placement)
    return {stage: "+".join(ranges[part] for part in parts) for stage, parts in table.items()}


def plan_summary(plan: Plan, title: str | None = None) -> str:
    """A printable table: per stage its layers, forward + backward, busy, bubble and peak memory, then the
    predicted iteration time (what `lightning-mm plan` prints)."""
    r = plan.result
    lines = [title or f"placement={plan.placement}  dp={plan.dp}  tp={plan.tp}  cp={plan.cp}  "
                      f"cp_mode={cp_mode_label(plan)}  encoder_cp={encoder_cp_label(plan)}  ep={plan.ep}  "
                      f"sharding={plan.sharding}  "
                      f"microbatches/replica={plan.microbatches_per_replica}"]
    held = stage_layers(plan)
    header = f"{'stage':<20} {'layers':<34} {'forward':>10} {'backward':>10} {'busy':>10} {'bubble':>7} {'inflight':>8} {'memory':>10}"
    lines += [header, "-" * len(header)]
    for stage in r.stages:
        lines.append(
            f"{stage:<20} {held[stage]:<34} {plan.forward[stage]:>10.4g} {plan.backward[stage]:>10.4g} "
            f"{r.busy[stage]:>10.4g} {r.bubble_fraction[stage]:>7.1%} {r.peak_inflight[stage]:>8d} {plan.memory[stage]:>10.3g}"
        )
    lines.append(f"predicted iteration time {plan.iteration_time:.4g} on {plan.devices} devices ({'fits' if plan.fits_memory else 'EXCEEDS'} memory)")
    return "\n".join(lines)
