"""Work items of the forward and backward launches, with split-KV for heavy query tiles (seed 003, 3.3.2.2).

A query tile whose key-tile list is long is cut into pieces of at most ``chunk`` key tiles; the pieces run as
separate programs writing partial outputs + log-sum-exp, and a merge kernel combines them. ``chunk`` comes from
the shapes: the worst-case tile work spread over a few waves of the GPU's SMs, never below ``min_tiles``.
Everything here is built on the lists' device with shapes known on the host, so no launch waits for a host
read: the grids are sized by the worst case and programs whose piece is empty store nothing. Items are ordered
heaviest first (longest-processing-time order), which balances launches that already have many programs.
"""

from __future__ import annotations

import math

import torch

WAVES = 4  # aim for programs no longer than 1/WAVES of a balanced launch per SM


def auto_chunk(num_tiles: int, num_key_tiles: int, num_heads: int, num_sms: int, min_tiles: int) -> int:
    """Split length in key tiles for ``num_tiles`` query tiles of up to ``num_key_tiles`` key tiles each;
    0 = no split needed. From shapes only (the worst case), so it needs no host read."""
    total = num_tiles * num_key_tiles * num_heads
    chunk = max(min_tiles, math.ceil(total / (num_sms * WAVES)))
    return 0 if num_key_tiles <= chunk else chunk


def forward_items(counts: torch.Tensor, chunk: int, num_key_tiles: int):
    """Items int32 [n, 5] = (b, q_tile, list_start, list_end, slot), merges int32 [m, 4] = (b, q_tile,
    first_slot, pieces), and the number of partial-output slots.

    ``slot = -1``: the item writes the final output; ``slot >= 0``: partial piece ``slot`` of a merge; ``-2``: an
    empty piece past its tile's list, which stores nothing. Every query tile's first item runs (an empty list
    writes zeros and lse -inf). A merge with ``pieces <= 1`` stores nothing.
    """
    b, nq = counts.shape
    flat = counts.reshape(-1).to(torch.int64)
    dev = flat.device
    tile = torch.arange(b * nq, device=dev)
    if chunk <= 0 or chunk >= num_key_tiles:
        zero = torch.zeros_like(flat)
        items = torch.stack([tile // nq, tile % nq, zero, flat, zero - 1], 1)
        order = torch.argsort(flat, descending=True, stable=True)
        return items[order].to(torch.int32).contiguous(), torch.zeros(0, 4, dtype=torch.int32, device=dev), 0
    most = math.ceil(num_key_tiles / chunk)  # pieces of the longest possible list
    pieces = torch.clamp((flat + chunk - 1) // chunk, min=1)
    t = tile.repeat_interleave(most)
    k = torch.arange(most, device=dev).repeat(b * nq)
    start = k * chunk
    end = torch.minimum(start + chunk, flat[t])
    split = pieces[t] > 1
    slot = torch.where(split, t * most + k, torch.full_like(t, -1))
    slot = torch.where(k < pieces[t], slot, torch.full_like(t, -2))
    end = torch.where(slot == -2, start, end)
    items = torch.stack([t // nq, t % nq, start, end, slot], 1)
    order = torch.argsort(end - start, descending=True, stable=True)
    merges = torch.stack([tile // nq, tile % nq, tile * most, pieces], 1)
    return items[order].to(torch.int32).contiguous(), merges.to(torch.int32).contiguous(), b * nq * most


def list_items(counts: torch.Tensor) -> torch.Tensor:
    """Items int32 [n, 2] = (b, tile) for every tile of ``counts`` [B, n], heaviest first (on ``counts``' device)."""
    flat = counts.reshape(-1).to(torch.int64)
    n = counts.shape[1]
    idx = torch.argsort(flat, descending=True, stable=True)
    return torch.stack([idx // n, idx % n], 1).to(torch.int32).contiguous()
