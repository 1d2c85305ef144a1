"""Contiguous stage partitioning minimising the slowest stage (003 Eq. 3.5), exact by dynamic programming."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from lightning_mm.plan.stages import uniform_partition


def _check(costs: Sequence[float], num_stages: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > len(costs):
        raise ValueError(
            f"cannot split {len(costs)} layers into {num_stages} stages (every stage needs a layer); "
            f"use pp <= {len(costs)} for this module"
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {list(costs)}")


def partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage, contiguous and non-empty, minimising the maximum stage cost.

    D(i,1) = P_i; D(i,s) = min_{s-1<=j<i} max(D(j,s-1), P_i - P_j), P_i = sum of the first i costs. Among
    optimal splits each boundary is the earliest one, so ties put fewer layers in early stages (which
    hold more in-flight activations under 1F1B). O(N^2 S), vectorised over (i, j); the DP's tables are kept per
    cost list (up to the next power of two of S), since a search asks for many stage counts of the same layers.
    """
    _check(costs, num_stages)
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    if not math.isfinite(prefix[-1]):
        return _partition_loops(prefix, num_stages)
    cut = _cuts(tuple(prefix), 1 << (num_stages - 1).bit_length())
    sizes, i = [], len(costs)
    for s in range(num_stages, 1, -1):
        j = int(cut[s, i])
        sizes.append(i - j)
        i = j
    sizes.append(i)
    return sizes[::-1]


@functools.lru_cache(maxsize=64)
def _cuts(prefix: tuple[float, ...], stages: int) -> np.ndarray:
    """cut[s, i]: the earliest optimal last boundary of i layers in s stages, for every s <= ``stages`` (the DP of
    ``partition``; argmin takes the first minimum, as the loop's strict ``<`` does)."""
    n = len(prefix) - 1
    p = np.asarray(prefix)
    span = p[:, None] - p[None, :]  # span[i, j] = P_i - P_j
    upper = np.tril(np.ones((n + 1, n + 1), dtype=bool), -1)  # j < i
    best = p.copy()  # D(., 1)
    cut = np.zeros((min(stages, n) + 1, n + 1), dtype=np.int64)
    for s in range(2, min(stages, n) + 1):
        value = np.maximum(best[None, :], span)
        valid = upper.copy()
        valid[:, :s - 1] = False
        value[~valid] = np.inf
        j = np.argmin(value[s:], axis=1)
        best = np.full(n + 1, np.inf)
        best[s:] = value[np.arange(s, n + 1), j]
        cut[s, s:] = j
    cut.setflags(write=False)
    return cut


def _partition_loops(prefix: list[float], num_stages: int) -> list[int]:
    """``partition``'s DP one element at a time (non-finite costs, where inf - inf must behave as in Python)."""
    n = len(prefix) - 1
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(1, n + 1):
        best[1][i] = prefix[i]
    for s in range(2, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(num_stages, 1, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    sizes.append(i)
    return sizes[::-1]


def stage_sums(values: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """Sum `values` over consecutive groups of `sizes` layers (e.g. per-stage forward time)."""
    if sum(sizes) != len(values):
        raise ValueError(f"stage sizes {list(sizes)} cover {sum(sizes)} layers but there are {len(values)}")
    out, start = [], 0
    for size in sizes:
        out.append(float(sum(values[start : start + size])))
        start += size
    return out


PARTITION_MODES = ("frozen-aware", "forward-only", "uniform")


def partition_module(costs, num_stages: int, mode: str = "frozen-aware") -> list[int]:
    """Layers per stage for one module from its `LayerCost`s: "frozen-aware" balances F + B (Eq. 3.1-3.3),
    "forward-only" balances 3F (the seeds' frozen-unaware baseline), "uniform" balances layer counts."""
    if mode == "frozen-aware":
        return partition([c.total for c in costs], num_stages)
    if mode == "forward-only":
        return partition([3.0 * c.forward for c in costs], num_stages)
    if mode == "uniform":
        return uniform_partition(len(costs), num_stages)
    raise ValueError(f"unknown partition mode {mode!r}; use one of {PARTITION_MODES}")
