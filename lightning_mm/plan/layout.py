"""ParallelSpec and the rank layout: the one place that says which rank runs what.

A replica (one data-parallel copy of the whole pipeline DAG) holds ``sum(stage ranks)`` consecutive ranks:
encoder stages first (in ``encoders`` order), then the LLM stages; an LLM stage spans ``cp`` ranks. Replica
``d`` starts at rank ``d * ranks_per_replica``. Every rank therefore has one coordinate
(stage, dp, cp). Pure: no process group, so every check runs before one is created.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_mm.plan.placement import LANGUAGE_MODEL, PLACEMENTS, placement_table


@dataclass(frozen=True)
class ParallelSpec:
    """How one module is parallelised: pipeline stages, context-parallel ranks, tensor-parallel ranks."""

    pp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self):
        for k in ("pp", "cp", "tp"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelSpec.{k} must be an int >= 1, got {v!r}")
        if self.tp > 1:
            raise ValueError("ParallelSpec(tp>1): tensor parallelism is not yet supported; use tp=1")

    @property
    def size(self) -> int:
        return self.pp * self.cp * self.tp


@dataclass(frozen=True)
class Coordinate:
    stage: str
    dp: int
    cp: int


@dataclass
class RankLayout:
    """Stages of one replica, in order, with their widths (cp), and the derived data-parallel size."""

    stages: list[str]
    widths: dict[str, int]
    dp: int
    placement: str
    module_stages: dict[str, int] = field(default_factory=dict)  # pp per module (encoders and language_model)

    @property
    def ranks_per_replica(self) -> int:
        return sum(self.widths[s] for s in self.stages)

    @property
    def world_size(self) -> int:
        return self.ranks_per_replica * self.dp

    def _offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for s in self.stages:
            out[s] = at
            at += self.widths[s]
        return out

    def rank(self, stage: str, dp: int = 0, cp: int = 0) -> int:
        return dp * self.ranks_per_replica + self._offsets()[stage] + cp

    def coordinate(self, rank: int) -> Coordinate:
        dp, local = divmod(rank, self.ranks_per_replica)
        for s, off in self._offsets().items():
            if off <= local < off + self.widths[s]:
                return Coordinate(s, dp, local - off)
        raise AssertionError(rank)

    def stage_ranks(self, stage: str, dp: int) -> list[int]:
        return [self.rank(stage, dp, c) for c in range(self.widths[stage])]

    def dp_group_ranks(self, stage: str, cp: int) -> list[int]:
        """Replicas of one stage-rank: gradients are summed over these."""
        return [self.rank(stage, d, cp) for d in range(self.dp)]

    def grad_group_ranks(self, stage: str) -> list[int]:
        """Every rank holding the same parameters as ``stage`` (all replicas and CP ranks)."""
        return [self.rank(stage, d, c) for d in range(self.dp) for c in range(self.widths[stage])]

    def chains(self) -> dict[str, list[str]]:
        """The stages of each module pipeline in order: one chain per encoder ("parallel"), one fused encoder chain
        ("colocated"), and the LLM's. Each chain gets one device mesh."""
        out: dict[str, list[str]] = {}
        for stage in self.stages:
            out.setdefault(stage.rsplit(".", 1)[0], []).append(stage)
        return out

    def mesh_ranks(self, chain: str) -> list[list[list[list[int]]]]:
        """Global ranks of a chain as a [dp][pp][cp][tp] array (the dims of its DeviceMesh; tp is 1 for now)."""
        stages = self.chains()[chain]
        return [[[[self.rank(s, d, c)] for c in range(self.widths[s])] for s in stages] for d in range(self.dp)]

    def replica_ranks(self, dp: int) -> list[int]:
        return list(range(dp * self.ranks_per_replica, (dp + 1) * self.ranks_per_replica))


def build_layout(encoders: dict[str, ParallelSpec], language_model: ParallelSpec, world_size: int,
                 placement: str = "parallel", model_encoders: list[str] | None = None) -> RankLayout:
    """Lay out ranks, or raise (with the fix) when the specs do not fit ``world_size``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown encoder_placement {placement!r}; choose one of {PLACEMENTS}")
    if model_encoders is not None:
        missing = [m for m in model_encoders if m not in encoders]
        unknown = [m for m in encoders if m not in model_encoders]
        if unknown:
            raise ValueError(f"encoder specs name unknown modules {unknown}; the model's encoders are {model_encoders}")
        if missing:
            raise ValueError(f"modality {missing[0]!r} has no ParallelSpec; add encoders={{{missing[0]!r}: "
                             "ParallelSpec(pp=1)}} to the strategy")
    for name, spec in encoders.items():
        if spec.cp > 1:
            raise ValueError(f"encoder {name!r}: context parallelism is for the language model only; use cp=1")
    table = placement_table({n: s.pp for n, s in encoders.items()}, language_model.pp, placement)
    stages = list(table)
    widths = {s: language_model.cp if table[s][0][0] == LANGUAGE_MODEL else 1 for s in stages}
    per_replica = sum(widths.values())
    if world_size % per_replica:
        raise ValueError(f"{world_size} devices cannot hold whole replicas of {per_replica} ranks "
                         f"({' + '.join(f'{s}x{widths[s]}' for s in stages)}); use a multiple of {per_replica} "
                         "devices or change the ParallelSpecs")
    module_stages = {n: s.pp for n, s in encoders.items()}
    module_stages[LANGUAGE_MODEL] = language_model.pp
    return RankLayout(stages, widths, world_size // per_replica, placement, module_stages)
