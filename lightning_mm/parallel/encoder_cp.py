"""Encoder context parallelism: each CP rank of an encoder stage encodes its share of the microbatch's items
(``plan/items.py``); the encoder's last stage all-gathers the projected features in item order.

Every CP rank of the encoder then holds the whole feature tensor and passes it on; the LLM's first-stage rank ``c``
reads it from encoder CP rank ``c % cp`` (``RankLayout.activation_sources``) and sends its feature gradient back
there, so the gathered features' gradients summed over the encoder's CP ranks are the whole gradient. Backward
sums them over the CP group and keeps this rank's items' rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mm.data.microbatch import PLAN_KEY
from lightning_mm.plan.items import gather_order

ITEMS_KEY = "cp_items"  # in a microbatch: {encoder: (item indices per CP rank, LLM tokens per item)}


class _GatherItems(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, counts, order, group):
        rank = dist.get_rank(group)
        width = max(counts)
        padded = local.new_zeros(width, local.shape[-1])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        whole = torch.cat([p[:n] for p, n in zip(parts, counts)])
        ctx.group, ctx.order, ctx.first, ctx.count = group, order, sum(counts[:rank]), counts[rank]
        return whole.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # each rank holds part of the gradient (its LLM readers')
        whole = torch.zeros_like(grad).index_copy_(0, ctx.order, grad)  # back to gathered (rank) order
        return whole[ctx.first: ctx.first + ctx.count], None, None, None


def gather_items(local: torch.Tensor, counts: list[int], order: torch.Tensor, group) -> torch.Tensor:
    """Every rank's item features ``[counts[r], H]`` as one tensor in item order (``order`` from
    ``plan.items.gather_order``); autograd returns each item's gradient to the rank that encoded it."""
    return _GatherItems.apply(local, counts, order, group)


def item_shards(item_planners: dict, mbs: list[dict], plans=None) -> None:
    """Put each microbatch's item plan of every encoder with CP in it (``mb[ITEMS_KEY]``; ``item_planners``:
    ``EncoderItems`` per encoder): which CP rank encodes
    which item, and each item's LLM tokens. The data loader's (``plans``) when the batch carries them, else made
    here (``EncoderItems.plan``: a host read of the items' sizes per microbatch)."""
    for name, planner in item_planners.items():
        given = None if plans is None else plans.items.get(name)
        for m, mb in enumerate(mbs):
            if name not in mb:
                continue
            plan = planner.plan(mb[name]) if given is None else given[m] if len(given) == len(mbs) else None
            items = planner.family.num_items(planner.family.cp_pieces(mb[name]))
            if plan is None or len(plan[1]) != items or len(plan[0]) != planner.ranks:
                raise ValueError(f"the batch's CP plan (batch['{PLAN_KEY}']['cp']) does not fit microbatch {m} "
                                 f"of {len(mbs)} ({items} items of {name!r} over {planner.ranks} CP ranks): it "
                                 "was made for another batch or layout; let MultimodalParallelStrategy wrap the "
                                 "loader (it plans for its own layout) or drop the plan from the batch")
            mb.setdefault(ITEMS_KEY, {})[name] = plan


def no_item_features(enc, device, empty: torch.Tensor | None = None) -> torch.Tensor:
    """The projected features of no item (of ``empty``, a ``[0, output_dim]`` input, when given), in the dtype the
    projector gives (autocast included); it takes part in the gather and its backward like any rank's."""
    if empty is None:
        weight = next(enc.projector.parameters(), None)
        empty = torch.zeros(0, enc.output_dim, device=device, dtype=torch.float32 if weight is None else weight.dtype,
                            requires_grad=torch.is_grad_enabled())
    blocks = 1 + enc.family.deepstack_layers(enc.config)  # DeepStack features packed beside the features
    out = enc.projector(empty)
    return out if blocks == 1 else out.repeat(1, blocks)


def gather_item_features(local: torch.Tensor, shards, tokens, group) -> torch.Tensor:
    """Every CP rank's item features (``local``: this rank's), in item order, over ``group``."""
    counts = [sum(tokens[i] for i in items) for items in shards]
    order = torch.tensor(gather_order(shards, tokens), dtype=torch.long, device=local.device)
    return gather_items(local, counts, order, group)
