"""Which ranks reduce which gradients across replica groups whose layouts differ (Oobleck's layer-wise sync).

Replica groups of one layout pair rank r with rank r. Groups of different layouts cut the model into different
stages, so a parameter's gradient lives on a different rank in each group, and a rank of one group shares layers
with several ranks of another. Each trainable parameter is keyed by the stage that holds it in every group; the
parameters with one key form a bucket, reduced by one process group whose members are those stages' holder ranks
(one per group, and one such set per tensor-parallel index). There are at most the sum over groups of their
stage counts buckets, in the model's parameter order, so every rank issues its reductions in one global order.

Pure: names, stages and ranks in, buckets out; the runtime (``lightning_mm.parallel.layerwise_reduce``) reduces them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_mm.plan.layout import RankLayout


@dataclass(frozen=True)
class GroupHoldings:
    """One replica group's view: the stage holding each trainable parameter and each stage's holder ranks.

    ``stage_of``: parameter name -> stage name. A parameter two stages hold (input and output embeddings tied
    across stages) is listed under the stage whose copy is reduced; the runtime copies the result to the other.
    ``holders``: stage name -> the group-local rank of each tensor-parallel index that reduces the stage's
    gradients across groups (its data-parallel 0, context-parallel 0 rank; the rest receive the result in-group).
    """

    stage_of: Mapping[str, str]
    holders: Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class LayerBucket:
    """Parameters held by the same stage in every group, and who reduces them.

    ``stages[g]``: the stage of group g holding them. ``members[t]``: for tensor-parallel index t, the ``(group,
    group-local rank)`` pairs of the process group that reduces this bucket, one per group, in group order.
    """

    names: tuple[str, ...]
    stages: tuple[str, ...]
    members: tuple[tuple[tuple[int, int], ...], ...]

    def member_index(self, group: int, rank: int) -> tuple[int, int] | None:
        """``(tp index, position in that process group)`` of ``(group, rank)``, or None when it is no member."""
        for t, pairs in enumerate(self.members):
            if (group, rank) in pairs:
                return t, pairs.index((group, rank))
        return None


def holdings(layout: RankLayout, stage_params: Mapping[str, Sequence[str]]) -> GroupHoldings:
    """A group's holdings from its rank layout and the trainable parameter names each stage holds.

    A name two stages hold (tied embeddings) is reduced on the first of them in stage order. The holders of a
    stage are its data-parallel 0, context-parallel 0 ranks, one per tensor-parallel index.
    """
    stage_of: dict[str, str] = {}
    for stage in layout.stages:
        for name in stage_params.get(stage, ()):
            stage_of.setdefault(name, stage)
    holders = {s: tuple(layout.rank(s, 0, 0, t) for t in range(layout.tp[s])) for s in layout.stages}
    return GroupHoldings(stage_of, holders)


def layer_buckets(groups: Sequence[GroupHoldings], order: Sequence[str]) -> list[LayerBucket]:
    """The buckets of ``groups`` in ``order`` (every trainable parameter name, in the model's order).

    Raises, naming the fix, when the groups do not hold the same trainable parameters (different models or
    frozen sets) or reduce a stage with a different number of tensor-parallel ranks (v1 needs one tp degree).
    """
    if not groups:
        raise ValueError("layer_buckets needs at least one replica group")
    names = list(order)
    if len(set(names)) != len(names):
        raise ValueError("the parameter order names a parameter twice")
    for g, holding in enumerate(groups):
        missing = [n for n in names if n not in holding.stage_of]
        extra = sorted(set(holding.stage_of) - set(names))
        if missing or extra:
            raise ValueError(f"replica group {g} holds a different set of trainable parameters (missing {missing[:3]}, "
                             f"extra {extra[:3]}): every group must train the same model with the same frozen parts")
        unknown = sorted({s for s in holding.stage_of.values() if s not in holding.holders})
        if unknown:
            raise ValueError(f"replica group {g}: stages {unknown} hold parameters but have no holder ranks")
    widths = {len(h.holders[s]) for h in groups for s in set(h.stage_of.values())}
    if len(widths) > 1:
        raise ValueError(f"the replica groups reduce their stages with {sorted(widths)} tensor-parallel ranks; layer-"
                         "wise sync across groups needs one tp degree in every group (give every template the same tp)")
    buckets: dict[tuple[str, ...], list[str]] = {}
    for name in names:  # dicts keep insertion order: buckets in the order of their first parameter
        buckets.setdefault(tuple(h.stage_of[name] for h in groups), []).append(name)
    width = widths.pop()
    out = []
    for stages, members in buckets.items():
        pairs = tuple(tuple((g, groups[g].holders[s][t]) for g, s in enumerate(stages)) for t in range(width))
        out.append(LayerBucket(tuple(members), stages, pairs))
    return out


def buckets_of(buckets: Sequence[LayerBucket], group: int, rank: int) -> list[tuple[int, LayerBucket, int, int]]:
    """``(bucket index, bucket, tp index, position)`` for every bucket ``(group, rank)`` reduces, in bucket order."""
    out = []
    for i, b in enumerate(buckets):
        where = b.member_index(group, rank)
        if where is not None:
            out.append((i, b, *where))
    return out


__all__ = ["GroupHoldings", "LayerBucket", "buckets_of", "holdings", "layer_buckets"]
