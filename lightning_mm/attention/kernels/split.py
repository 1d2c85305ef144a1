"""Work items of the forward and backward launches, with split-KV for heavy query tiles (seed 003, 3.3.2.2).

A query tile whose key-tile list is long is cut into pieces of at most ``chunk`` key tiles; the pieces run as
separate programs writing partial outputs + log-sum-exp, and a merge kernel combines them. ``chunk`` comes from
the workload: the total tile work spread over a few waves of the GPU's SMs, never below ``min_tiles``, so
only tiles heavier than the average program of a balanced launch are split. Items are ordered heaviest first
(longest-processing-time order), which alone balances launches that already have many programs.
"""

from __future__ import annotations

import math

import torch

WAVES = 4  # aim for programs no longer than 1/WAVES of a balanced launch per SM


def auto_chunk(counts: torch.Tensor, num_heads: int, num_sms: int, min_tiles: int) -> int:
    """Split length in key tiles for ``counts`` [B, nq] (key tiles per query tile); 0 = no split needed."""
    total = int(counts.sum()) * num_heads
    longest = int(counts.max()) if counts.numel() else 0
    chunk = max(min_tiles, math.ceil(total / (num_sms * WAVES)))
    return 0 if longest <= chunk else chunk


def forward_items(counts: torch.Tensor, chunk: int):
    """Items int32 [n, 5] = (b, q_tile, list_start, list_end, slot) and merges int32 [m, 4] = (b, q_tile, first_slot, pieces).

    ``slot = -1``: the item writes the final output; otherwise it writes partial piece ``slot`` of a merge.
    Every query tile gets at least one item (an empty list writes zeros and lse -inf).
    """
    flat = counts.reshape(-1).to(torch.int64).cpu()
    nq = counts.shape[1]
    if chunk > 0:
        pieces = torch.clamp((flat + chunk - 1) // chunk, min=1)
    else:
        pieces = torch.ones_like(flat)
    tile = torch.arange(len(flat)).repeat_interleave(pieces)
    first = torch.cumsum(pieces, 0) - pieces
    k = torch.arange(len(tile)) - first[tile]
    step = chunk if chunk > 0 else 1
    start = k * step
    end = torch.where(pieces[tile] > 1, torch.minimum(start + step, flat[tile]), flat[tile])
    split = pieces[tile] > 1
    slot = torch.full_like(tile, -1)
    slot[split] = torch.arange(int(split.sum()))
    items = torch.stack([tile // nq, tile % nq, start, end, slot], 1)
    order = torch.argsort(end - start, descending=True, stable=True)
    merged = (pieces > 1).nonzero().squeeze(1)
    slot_first = torch.cumsum(pieces[merged], 0) - pieces[merged]
    merges = torch.stack([merged // nq, merged % nq, slot_first, pieces[merged]], 1)
    return items[order].to(torch.int32), merges.to(torch.int32), int(split.sum())


def list_items(counts: torch.Tensor) -> torch.Tensor:
    """Items int32 [n, 3] = (b, tile, list length) for every tile of ``counts`` [B, n], heaviest first."""
    flat = counts.reshape(-1).to(torch.int64).cpu()
    n = counts.shape[1]
    idx = torch.argsort(flat, descending=True, stable=True)
    return torch.stack([idx // n, idx % n, flat[idx]], 1).to(torch.int32)
