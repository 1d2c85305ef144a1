"""The global sampler: every step's global batch, whatever groups are alive, and each group's share of it."""

from __future__ import annotations

import math

import torch

from lightning_mm.fault_tolerance.config import TOKEN_KEY
from lightning_mm.plan.balance import plan_batch

def global_batches_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


def global_batch_indices(step: int, num_samples: int, global_batch: int, shuffle: bool = True,
                         seed: int = 0) -> list[int]:
    """The sample indices of global step ``step``: epoch ``step // batches per epoch`` in the order of a
    ``DistributedSampler`` with one replica (``randperm`` under ``seed + epoch`` when shuffled); an incomplete last
    global batch is dropped. Depends on the step only, so every group and a restarted group agree."""
    per_epoch = global_batches_per_epoch(num_samples, global_batch)
    if per_epoch < 1:
        raise ValueError(f"the data set has {num_samples} samples, fewer than one global batch of {global_batch}")
    epoch, i = divmod(step, per_epoch)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    else:
        order = list(range(num_samples))
    return order[i * global_batch:(i + 1) * global_batch]


def group_shares(num_samples: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` slices of ``num_samples`` in proportion to ``weights`` (largest remainder,
    ties to the earlier member), one per member in quorum order."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"group_shares needs positive weights, got {weights}")
    total = float(sum(weights))
    exact = [num_samples * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))[:num_samples - sum(counts)]:
        counts[i] += 1
    while num_samples >= len(counts) and 0 in counts:  # every member gets a sample while there are enough
        counts[counts.index(0)] += 1
        counts[max(range(len(counts)), key=lambda i: (counts[i], -i))] -= 1
    out, at = [], 0
    for c in counts:
        out.append((at, at + c))
        at += c
    return out


def microbatch_plan(rows: int, rows_per_microbatch: int) -> list[int]:
    """Each row's microbatch: ``ceil(rows / rows_per_microbatch)`` contiguous microbatches whose sizes differ by at
    most one (a group with a larger share runs more microbatches of about the usual size)."""
    count = max(1, min(rows, math.ceil(rows / max(1, rows_per_microbatch))))
    base, extra = divmod(rows, count)
    return [m for m in range(count) for _ in range(base + (m < extra))]


def placed_rows(indices: list[int], replicas: int, members: list[int], rows_per_microbatch: int,
                method: str | None = None, work=None, num_stages: int = 2) -> list[tuple[int, int, int, int]] | None:
    """A group's share of a step over its ``replicas`` data-parallel replicas x as many microbatches as a
    replica's part needs (``microbatch_plan``): the rows of the replicas in ``members`` (this rank's replica, or
    the replicas of its per-module data-parallel group) as ``(index, encoder mb, LLM mb, position in members)``.
    Contiguous, or placed by ``plan_batch(method)`` as the balanced loader places them without fault tolerance.
    None where the share does not split evenly over the replicas (a quorum short of groups can leave one
    uneven)."""
    per_replica, rest = divmod(len(indices), replicas)
    if rest or not per_replica:
        return None
    plan = microbatch_plan(per_replica, rows_per_microbatch)
    if method is None:
        return [(indices[r * per_replica + i], m, m, j) for j, r in enumerate(members) for i, m in enumerate(plan)]
    encoder_work, llm_work = work(indices)
    placed = plan_batch(encoder_work, llm_work, replicas, plan[-1] + 1, method, num_stages=num_stages)
    later = {s for d in placed.deferred for s in d.samples}
    return [(indices[s], m, m + 1 if s in later else m, j) for j, r in enumerate(members)
            for m, samples in enumerate(placed.assignment[r]) for s in samples]


class StepTokens:
    """The training loader under fault tolerance: one small token per global batch of the epoch; the strategy
    loads the real samples after each step's quorum (``FaultTolerantTraining.begin_step``)."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for i in range(self.length):
            yield {TOKEN_KEY: torch.tensor([i])}
