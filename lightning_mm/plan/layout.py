"""ParallelSpec and the rank layout: the one place that says which rank runs what.

A replica (one data-parallel copy of the whole pipeline DAG) holds ``sum(stage widths)`` consecutive ranks:
encoder stages first (in ``encoders`` order), then the LLM stages. An encoder stage spans ``tp`` ranks, an LLM
stage ``cp x tp`` ranks (cp-major). Replica ``d`` starts at rank ``d * ranks_per_replica``. Every rank therefore
has one coordinate (stage, dp, cp, tp). Pure: no process group, so every check runs before one is created.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace

from lightning_mm.plan.placement import LANGUAGE_MODEL, PLACEMENTS, placement_table


CP_MODES = ("allgather", "ulysses", "hybrid")


class LayoutError(ValueError):
    """ParallelSpecs, a placement or a device count that cannot make a rank layout; the message says which fix."""


@dataclass(frozen=True)
class ParallelSpec:
    """How one module is parallelised: pipeline stages, context-parallel ranks, tensor-parallel ranks.

    ``cp_mode``: how the ``cp`` ranks attend: ``"allgather"`` (keys and values all-gathered, queries local, any
    head count), ``"ulysses"`` (all-to-all: each rank attends the whole sequence for heads / cp heads) or
    ``"hybrid"`` (Ulysses inside groups of ``ulysses`` ranks, all-gather across the cp / ulysses groups).
    ``ulysses``: the Ulysses degree of ``"hybrid"`` (a divisor of cp strictly between 1 and cp); ``"ulysses"``
    implies cp and ``"allgather"`` 1. See docs/context_parallel.md for when each wins.
    ``dp``: this module's own data-parallel degree (DistTrain's per-module widths, docs/per_module_dp.md); None on
    every module keeps one degree derived from the device count, otherwise every module gives one.
    ``ep``: expert parallelism of a mixture-of-experts language model: each stage's routed experts split over
    ``ep`` of its data-parallel ranks (docs/moe.md)."""

    pp: int = 1
    cp: int = 1
    tp: int = 1
    cp_mode: str = "allgather"
    ulysses: int | None = None
    dp: int | None = None
    ep: int = 1

    def __post_init__(self):
        for k in ("pp", "cp", "tp", "ep"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"ParallelSpec.{k} must be an int >= 1, got {v!r}")
        if self.cp_mode not in CP_MODES:
            raise LayoutError(f"unknown cp_mode {self.cp_mode!r}; choose one of {CP_MODES}")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise LayoutError(f"ParallelSpec.dp must be an int >= 1 or None, got {self.dp!r}")
        k = self.ulysses
        if k is not None and (not isinstance(k, int) or k < 1):
            raise LayoutError(f"ParallelSpec.ulysses must be an int >= 1 or None, got {k!r}")
        if self.cp_mode == "allgather" and k not in (None, 1):
            raise LayoutError(f"ulysses={k} needs cp_mode='hybrid' (Ulysses inside groups of {k} ranks) or "
                             "cp_mode='ulysses'; with cp_mode='allgather' leave ulysses unset")
        if self.cp_mode == "ulysses" and k not in (None, self.cp):
            raise LayoutError(f"cp_mode='ulysses' runs Ulysses over all cp={self.cp} ranks, not ulysses={k}; use "
                             f"cp_mode='hybrid' with ulysses={k} (all-gather across the groups), or leave ulysses unset")
        if self.cp_mode == "hybrid":
            if k is None or not 1 < k < self.cp or self.cp % k:
                divisors = [d for d in range(2, self.cp) if self.cp % d == 0]
                raise LayoutError(f"cp_mode='hybrid' needs ulysses = K with 1 < K < cp and K dividing cp={self.cp}, got "
                                 f"ulysses={k}; " + (f"choose K in {divisors}" if divisors else
                                                     f"cp={self.cp} has no such divisor: use cp_mode='ulysses' or "
                                                     "'allgather', or a cp with divisors (4, 6, 8, ...)"))

    @property
    def size(self) -> int:
        return self.pp * self.cp * self.tp

    @property
    def ulysses_degree(self) -> int:
        """Ranks each Ulysses all-to-all spans: 1 (allgather, or no CP), cp (ulysses), ulysses (hybrid)."""
        if self.cp == 1 or self.cp_mode == "allgather":
            return 1
        return self.cp if self.cp_mode == "ulysses" else self.ulysses


@dataclass(frozen=True)
class Coordinate:
    stage: str
    dp: int
    cp: int
    tp: int = 0


@dataclass(frozen=True)
class RankLayout:
    """Which rank runs what: the stages of the pipeline DAG, in order, with their context- and tensor-parallel sizes,
    and how many data-parallel replicas each module chain has. ``widths[stage] = cp[stage] * tp[stage]`` ranks.
    Frozen; ``to_dict`` / ``from_dict`` and equality are what checkpoints, resume checks and fault tolerance compare.

    Words: a *chain* is the run of stages of one module pipeline (one per encoder under "parallel" placement, one
    fused encoder chain under "colocated", the LLM's), named by ``chain_of(stage)``; a *replica* is one
    data-parallel copy of a chain. ``replicas_per_chain`` gives every chain's degree; they differ under per-module
    data parallelism (``per_module_dp``). Ranks come in ``num_groups = gcd(degrees)`` equal *groups*; group ``k``
    holds ``replicas(chain) / num_groups`` consecutive replicas of each chain, chain after chain in stage order, and
    every rank of a group sees the same batch: the samples of the group's language-model replicas. With one degree
    a group is one replica of the whole DAG. ``dp`` is the language model's degree (the replicas the sampler
    serves)."""

    stages: list[str]
    cp: dict[str, int]
    tp: dict[str, int]
    replicas_per_chain: dict[str, int]
    placement: str
    module_stages: dict[str, int] = field(default_factory=dict)  # pp per module (encoders and language_model)
    module_tp: dict[str, int] = field(default_factory=dict)  # tp per module (encoders in an LLM stage: 1 or its tp)
    cp_mode: str = "allgather"  # the LLM's CP attention (ParallelSpec.cp_mode)
    ulysses: int = 1  # its Ulysses degree: 1 for allgather, cp for ulysses, K for hybrid
    ep: int = 1  # the LLM's expert-parallel degree (ParallelSpec.ep): experts split over ep of its replicas

    def __post_init__(self):
        missing = sorted(set(self.chains()) - set(self.replicas_per_chain))
        if missing:
            raise LayoutError(f"RankLayout.replicas_per_chain has no degree for the chains {missing}")

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def dp(self) -> int:
        """The language model's data-parallel degree."""
        return self.replicas(LANGUAGE_MODEL)

    @property
    def widths(self) -> dict[str, int]:
        return {s: self.cp[s] * self.tp[s] for s in self.stages}

    @property
    def per_module_dp(self) -> bool:
        """Whether chains differ in data-parallel degree (modules exchange samples across replicas)."""
        return len(set(self.replicas(c) for c in self.chains())) > 1

    def replicas(self, chain: str) -> int:
        """Data-parallel replicas of a chain (``chain_of(stage)``)."""
        return self.replicas_per_chain[chain]

    @staticmethod
    def chain_of(stage: str) -> str:
        return stage.rsplit(".", 1)[0]

    @property
    def num_groups(self) -> int:
        return math.gcd(*(self.replicas(c) for c in self.chains()))

    def per_group(self, chain: str) -> int:
        """Replicas of ``chain`` in each group."""
        return self.replicas(chain) // self.num_groups

    def chain_width(self, chain: str) -> int:
        return sum(self.widths[s] for s in self.chains()[chain])

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one replica of every chain: the ranks of one group when all chains share one degree."""
        return sum(self.widths[s] for s in self.stages)

    @property
    def group_size(self) -> int:
        return sum(self.per_group(c) * self.chain_width(c) for c in self.chains())

    @property
    def world_size(self) -> int:
        return self.group_size * self.num_groups

    def _offsets(self) -> dict[str, tuple[int, int]]:
        """``{stage: (offset of its chain in a group, offset of the stage in one replica of its chain)}``."""
        out, chain_at = {}, 0
        for chain, stages in self.chains().items():
            at = 0
            for s in stages:
                out[s] = (chain_at, at)
                at += self.widths[s]
            chain_at += self.per_group(chain) * at
        return out

    def rank(self, stage: str, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        chain = self.chain_of(stage)
        group, j = divmod(dp, self.per_group(chain))
        chain_at, at = self._offsets()[stage]
        return group * self.group_size + chain_at + j * self.chain_width(chain) + at + cp * self.tp[stage] + tp

    def coordinate(self, rank: int) -> Coordinate:
        group, local = divmod(rank, self.group_size)
        for s, (chain_at, at) in self._offsets().items():
            chain = self.chain_of(s)
            width = self.chain_width(chain)
            if not chain_at <= local < chain_at + self.per_group(chain) * width:
                continue
            j, inner = divmod(local - chain_at, width)
            if at <= inner < at + self.widths[s]:
                cp, tp = divmod(inner - at, self.tp[s])
                return Coordinate(s, group * self.per_group(chain) + j, cp, tp)
        raise AssertionError(rank)

    def group_of(self, rank: int) -> int:
        """The group (of ranks that see the same batch) a rank belongs to."""
        return rank // self.group_size

    def group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def peer_replicas(self, stage: str, peer: str, dp: int) -> list[int]:
        """The replicas of ``peer``'s chain that replica ``dp`` of ``stage``'s chain exchanges messages with: the same
        replica within a chain, every replica of the group across chains of different degrees."""
        chain, other = self.chain_of(stage), self.chain_of(peer)
        if self.per_group(chain) == self.per_group(other):
            return [dp]
        group = dp // self.per_group(chain)
        return list(range(group * self.per_group(other), (group + 1) * self.per_group(other)))

    def stage_ranks(self, stage: str, dp: int) -> list[int]:
        return [self.rank(stage, dp, c, t) for c in range(self.cp[stage]) for t in range(self.tp[stage])]

    def grad_group_ranks(self, stage: str, tp: int = 0) -> list[int]:
        """Every rank holding the same parameters (the same tensor-parallel shard) as ``stage``'s tp rank ``tp``:
        all replicas of its chain and CP ranks."""
        return [self.rank(stage, d, c, tp) for d in range(self.replicas(self.chain_of(stage)))
                for c in range(self.cp[stage])]

    def activation_sources(self, sender: str, receiver: str, dp: int, sender_dp: int | None = None) -> dict[int, int]:
        """``{receiver rank: sender rank}`` for the activations replica ``sender_dp`` (default ``dp``) of ``sender``
        passes to replica ``dp`` of ``receiver``: CP rank ``c % cp[sender]`` (the same CP rank between stages of
        equal cp; an encoder's CP ranks all hold the whole gathered features), tp rank ``t % tp[sender]``.
        Tensor-parallel ranks hold whole (replicated) activations, so any one of them is a source."""
        sd = dp if sender_dp is None else sender_dp
        return {self.rank(receiver, dp, c, t): self.rank(sender, sd, c % self.cp[sender], t % self.tp[sender])
                for c in range(self.cp[receiver]) for t in range(self.tp[receiver])}

    def gradient_sources(self, sender: str, receiver: str, dp: int, receiver_dp: int | None = None
                         ) -> dict[int, list[int]]:
        """``{sender rank: [receiver ranks]}`` whose input gradients (of replica ``dp`` of ``sender``'s activations)
        replica ``receiver_dp`` (default ``dp``) of ``receiver`` returns and the sender sums: those of the receiver's CP
        ranks that read from it (every CP rank when ``sender`` has no CP; none for an encoder CP rank no LLM rank
        reads from), from the tp rank ``t % tp[receiver]`` (tp ranks of a stage compute the same input gradient)."""
        rd = dp if receiver_dp is None else receiver_dp
        return {self.rank(sender, dp, c, t): [self.rank(receiver, rd, rc, t % self.tp[receiver])
                                              for rc in range(self.cp[receiver]) if rc % self.cp[sender] == c]
                for c in range(self.cp[sender]) for t in range(self.tp[sender])}

    def fsdp_ranks(self, stage: str) -> int:
        """Ranks a sharding strategy shards ``stage`` over: its chain's replicas x its CP ranks (they hold the same
        parameters)."""
        return self.replicas(self.chain_of(stage)) * self.cp[stage]

    def chains(self) -> dict[str, list[str]]:
        """The stages of each module pipeline in order: one chain per encoder ("parallel"), one fused encoder chain
        ("colocated"), and the LLM's. Each chain gets one device mesh."""
        out: dict[str, list[str]] = {}
        for stage in self.stages:
            out.setdefault(self.chain_of(stage), []).append(stage)
        return out

    def mesh_ranks(self, chain: str) -> list[list[list[list[int]]]]:
        """Global ranks of a chain as a [dp][pp][cp][tp] array (the dims of its DeviceMesh)."""
        stages = self.chains()[chain]
        return [[[[self.rank(s, d, c, t) for t in range(self.tp[s])] for c in range(self.cp[s])] for s in stages]
                for d in range(self.replicas(chain))]

    def shard_mesh_ranks(self, chain: str) -> list[list[list[int]]]:
        """Global ranks of a chain as a [pp][dp x cp][tp] array: the mesh of sharded data parallelism, whose
        "dp_cp" dim holds the ranks with the same parameters and whose "tp" dim TP shares with it."""
        return [[[self.rank(s, d, c, t) for t in range(self.tp[s])] for d in range(self.replicas(chain))
                 for c in range(self.cp[s])] for s in self.chains()[chain]]

    def to_dict(self) -> dict:
        """The layout as plain data, every field (checkpoints, resume checks, fault tolerance's fingerprint)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "RankLayout":
        """The layout ``to_dict`` wrote (extra keys ignored); also reads the form of earlier checkpoints (a ``dp``
        for every chain, or ``chain_dp`` where chains differed)."""
        data = dict(data)
        if "replicas_per_chain" not in data:
            chains = dict.fromkeys(cls.chain_of(s) for s in data["stages"])
            data["replicas_per_chain"] = data.get("chain_dp") or {c: data["dp"] for c in chains}
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def with_replicas(self, replicas: int) -> "RankLayout":
        """The same layout with ``replicas`` data-parallel replicas of every chain."""
        return replace(self, replicas_per_chain={c: replicas for c in self.chains()})


def check_node_locality(layout: RankLayout, ranks_per_node: int) -> None:
    """Raise unless every stage's cp x tp ranks sit on one node: their collectives run every layer and need the
    node's links (NVLink), while pipeline and data-parallel traffic may cross nodes."""
    if ranks_per_node < 1 or layout.world_size <= ranks_per_node:
        return
    for stage in layout.stages:
        for d in range(layout.replicas(layout.chain_of(stage))):
            ranks = layout.stage_ranks(stage, d)
            if ranks[0] // ranks_per_node != ranks[-1] // ranks_per_node:
                raise LayoutError(
                    f"stage {stage!r} of replica {d} spans ranks {ranks[0]}-{ranks[-1]}, across nodes "
                    f"{ranks[0] // ranks_per_node} and {ranks[-1] // ranks_per_node} ({ranks_per_node} ranks per node); "
                    "its tensor- and context-parallel ranks must share a node: change the ParallelSpecs so that each "
                    f"replica's stage widths {layout.widths} pack into nodes of {ranks_per_node} ranks, or use a "
                    "number of devices per node that a replica fills whole")


def single_process_specs(encoders: list[str]) -> tuple[dict[str, ParallelSpec], ParallelSpec, str]:
    """The specs and placement of one device (debug mode): the whole model in one process, whatever the
    configured specs say (the strategy runs it so; the planner simulates it so)."""
    return {e: ParallelSpec() for e in encoders}, ParallelSpec(), "replicated"


def build_layout(encoders: dict[str, ParallelSpec], language_model: ParallelSpec, world_size: int,
                 placement: str = "parallel", model_encoders: list[str] | None = None) -> RankLayout:
    """Lay out ranks, or raise (with the fix) when the specs do not fit ``world_size``."""
    layout = replica_layout(encoders, language_model, placement, model_encoders)
    if layout.per_module_dp:
        if layout.world_size != world_size:
            parts = " + ".join(f"{c} {layout.replicas(c)}x{layout.chain_width(c)}" for c in layout.chains())
            raise LayoutError(f"the ParallelSpecs' data-parallel degrees need {layout.world_size} devices ({parts}: "
                             f"dp x ranks of one replica per module), got {world_size}; change the devices or the "
                             "modules' dp")
        if layout.dp % layout.ep:
            raise LayoutError(f"language_model ep={layout.ep} splits experts over its data-parallel replicas, but its "
                             f"dp={layout.dp}; give the language model a dp that {layout.ep} divides, or an ep "
                             f"dividing {layout.dp}")
        return layout
    per_replica = layout.ranks_per_replica
    if world_size % per_replica:
        raise LayoutError(f"{world_size} devices cannot hold whole replicas of {per_replica} ranks "
                         f"({' + '.join(f'{s}x{layout.widths[s]}' for s in layout.stages)}); use a multiple of "
                         f"{per_replica} devices or change the ParallelSpecs")
    layout = layout.with_replicas(world_size // per_replica)
    if layout.dp % layout.ep:
        raise LayoutError(f"language_model ep={layout.ep} splits experts over data-parallel ranks, but there are "
                         f"{layout.dp} replicas; use {per_replica * layout.ep}*k devices or an ep dividing "
                         f"{layout.dp}")
    return layout


def replica_layout(encoders: dict[str, ParallelSpec], language_model: ParallelSpec, placement: str = "parallel",
                   model_encoders: list[str] | None = None, replicas: int = 1) -> RankLayout:
    """The layout of ``replicas`` data-parallel replicas of the specs (``build_layout`` without a world size),
    or raise (with the fix) when the specs cannot run."""
    if placement not in PLACEMENTS:
        raise LayoutError(f"unknown encoder_placement {placement!r}; choose one of {PLACEMENTS}")
    if model_encoders is not None:
        missing = [m for m in model_encoders if m not in encoders]
        unknown = [m for m in encoders if m not in model_encoders]
        if unknown:
            raise LayoutError(f"encoder specs name unknown modules {unknown}; the model's encoders are {model_encoders}")
        if missing:
            raise LayoutError(f"modality {missing[0]!r} has no ParallelSpec; add encoders={{{missing[0]!r}: "
                             "ParallelSpec(pp=1)}} to the strategy")
    for name, spec in encoders.items():
        if spec.ep > 1:
            raise LayoutError(f"encoder {name!r}: ep={spec.ep}, but expert parallelism applies to a mixture-of-experts "
                             "language model only; leave the encoder's ep unset")
        if spec.cp > 1 and placement != "parallel":
            raise LayoutError(f"encoder {name!r}: context parallelism shards an encoder's items over the CP ranks of "
                             f"its own stages, which needs encoder_placement='parallel' (got {placement!r}); or use cp=1")
        if spec.cp > 1 and spec.cp_mode != "allgather":
            raise LayoutError(f"encoder {name!r}: encoder context parallelism splits items (images, clips) over ranks "
                             f"and gathers the features; cp_mode={spec.cp_mode!r} is for the language model: leave "
                             "the encoder's cp_mode unset")
    chain_dp = module_dp(encoders, language_model, placement)
    table = placement_table({n: s.pp for n, s in encoders.items()}, language_model.pp, placement)
    specs = {**encoders, LANGUAGE_MODEL: language_model}
    stages = list(table)
    cp = {s: specs[table[s][0][0]].cp for s in stages}
    tp = {}
    for s in stages:
        modules = [m for m, _ in table[s]]
        tp[s] = specs[modules[0]].tp
        in_llm_stage = modules[0] == LANGUAGE_MODEL  # an encoder there may also run whole on every rank (tp 1)
        wrong = [m for m in modules[1:] if specs[m].tp not in ((1, tp[s]) if in_llm_stage else (tp[s],))]
        if wrong:
            raise LayoutError(f"stage {s!r} holds {modules}, which must share its tensor-parallel ranks: give "
                             f"{wrong} tp={tp[s]}" + (" (or tp=1: run whole on every rank)" if in_llm_stage else "")
                             + ", or use encoder_placement='parallel'")
    if chain_dp and len(set(chain_dp.values())) == 1:  # one degree: today's layout, at that degree
        replicas, chain_dp = language_model.dp, {}
    chains = dict.fromkeys(RankLayout.chain_of(s) for s in stages)  # differing degrees need parallel placement
    per_chain = {c: chain_dp[c] for c in chains} if chain_dp else dict.fromkeys(chains, replicas)
    return RankLayout(stages, cp, tp, per_chain, placement,
                      {n: s.pp for n, s in specs.items()}, {n: s.tp for n, s in specs.items()},
                      language_model.cp_mode, language_model.ulysses_degree, language_model.ep)


def module_dp(encoders: dict[str, ParallelSpec], language_model: ParallelSpec, placement: str) -> dict[str, int]:
    """Each module chain's data-parallel degree from the specs' ``dp`` (empty when no spec gives one), or raise
    (with the fix) when per-module degrees cannot run."""
    specs = {**encoders, LANGUAGE_MODEL: language_model}
    given = {n: s.dp for n, s in specs.items() if s.dp is not None}
    if not given:
        return {}
    if len(given) < len(specs):
        missing = [n for n in specs if n not in given]
        raise LayoutError(f"ParallelSpec.dp is given for {sorted(given)} but not for {missing}: per-module data "
                         "parallelism needs dp on every module (encoders and language_model), or on none (one "
                         "degree derived from the device count)")
    if len(set(given.values())) > 1 and placement != "parallel":
        raise LayoutError(f"per-module data-parallel degrees {given} need encoder_placement='parallel' (each encoder "
                         f"its own ranks); with {placement!r} the encoders share the language model's ranks, so give "
                         "every module the same dp")
    return given
