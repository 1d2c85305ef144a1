"""Gradient reduction over the ranks that hold the same parameters (data-parallel replicas and CP ranks).

As DDP does: trainable parameters are cut into buckets of about ``bucket_mb`` in reverse registration order
(roughly the order backward produces them); during the last backward of a step that synchronises, a hook on
each parameter marks its gradient ready, and a bucket is flattened and all-reduced asynchronously as soon as it
and every earlier bucket are ready, while backward goes on. ``finish`` launches what is left in the same order on
every rank, waits, and copies the sums back. Sums, not averages: each replica's loss is already divided by the
global label count. A parameter no rank used this step keeps ``grad=None`` (as in one process), decided by one
small all-reduce of "used" flags. Every tensor lives on the parameters' device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_mm.fault_tolerance.watchdog import waiting
from lightning_mm.parallel.tensor_parallel import local, shards


class GradientReducer:
    def __init__(self, params: list[torch.nn.Parameter], group, bucket_mb: float = 25.0):
        self.params, self.group = params, group
        self.buckets: list[list[int]] = []
        limit, size, bucket = bucket_mb * 2**20, 0, []
        for i in reversed(range(len(params))):
            bucket.append(i)
            size += local(params[i]).numel() * params[i].element_size()
            if size >= limit:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.armed = False
        self._reset()
        if group is not None:
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.launched: list[tuple] = []  # (bucket index, flat buffer, work)

    def arm(self) -> None:
        """The next backward is this step's last: start reducing buckets as they fill."""
        self._reset()
        self.armed = self.group is not None

    def _ready(self, i: int) -> None:
        if not self.armed:
            return
        b = self.bucket_of[i]
        self.missing[b] -= 1
        while len(self.launched) < len(self.buckets) and self.missing[len(self.launched)] == 0:
            self._launch(len(self.launched))

    def _launch(self, b: int) -> None:
        flat = torch.cat([local(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in (self.params[i] for i in self.buckets[b])])  # buckets are never empty
        self.launched.append((b, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """Complete the reduction (launching what backward did not), in bucket order on every rank."""
        if self.group is None or not self.params:
            return
        device = self.params[0].device
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32, device=device)
        early = len(self.launched)
        for b in range(early, len(self.buckets)):
            self._launch(b)
        with waiting("gradient all-reduce", group=self.group):
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)
            for _, _, work in self.launched:
                work.wait()
        for b, flat, work in self.launched:
            at = 0
            for i in self.buckets[b]:
                p = self.params[i]
                shard = local(p)
                part = flat[at:at + shard.numel()].view_as(shard)
                at += shard.numel()
                if p.grad is None:
                    p.grad = part.clone() if shard is p else DTensor.from_local(
                        part.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                else:
                    local(p.grad).copy_(part)
        for p, u in zip(self.params, used.tolist()):
            if not u:
                p.grad = None
        self.armed = False
        self._reset()


def global_grad_norm(params: list[torch.nn.Parameter], copies: int, device) -> torch.Tensor:
    """L2 norm of every trainable gradient of the whole model. ``copies`` ranks hold each of this rank's
    parameters whole (replicas x CP ranks x tp ranks); a tensor-parallel or sharded DTensor is held by that many
    divided by its number of shards. Each rank's squares are divided by their holders before the world all-reduce.
    Gradients of one weight go through torch's multi-tensor norm (a few kernels, not three per parameter)."""
    by_weight: dict[float, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_weight.setdefault(shards(p) / copies, []).append(local(p.grad).detach())
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for weight, grads in by_weight.items():
        sq += torch.nn.utils.get_total_norm(grads).double().square() * weight
    dist.all_reduce(sq)
    return sq.sqrt()


def all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum gradients over ``group`` (tied weights between stages; per-head norms under tensor parallelism)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with waiting("gradient all-reduce", group=group):
        dist.all_reduce(flat, group=group)
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


def clip_(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients by ``min(1, max_norm / norm)`` without reading the norm on the host."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local(p.grad).mul_(coef.to(p.grad.dtype))
