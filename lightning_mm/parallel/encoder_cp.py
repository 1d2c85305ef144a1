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
