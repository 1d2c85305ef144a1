"""Layer-wise gradient sync across replica groups of different layouts (the plan is ``plan/layer_sync.py``).

Each bucket is reduced by its own process group of holder ranks, one per replica group. A holder contributes
``weight * grad`` (its group's label-token count times the group's mean gradient), a used flag per parameter and
its weight; the sum divided by the summed weight is the gradient one process would have over the union of the
groups' samples. A parameter no group used keeps ``grad = None``, as in one process. The reductions of all of a
rank's buckets are issued before any is waited on (each process group carries one reduction a step, so the order
cannot deadlock), and the used flags of all buckets are read on the host once.

The process groups are any ``torch.distributed.ProcessGroup``: torchft's reconfigurable ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` configured per quorum (a store prefix per bucket and tp index), or ``new_group`` groups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from lightning_mm.plan.layer_sync import LayerBucket, buckets_of


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def bucket_process_groups(buckets: Sequence[LayerBucket], group: int, rank: int,
                          make: Callable[[int, int, int, int], dist.ProcessGroup]) -> dict[int, dist.ProcessGroup]:
    """``{bucket index: process group}`` for the buckets ``(group, rank)`` reduces; ``make(bucket index, tp index,
    position, size)`` builds one (a torchft group configured under a store prefix of the bucket, say)."""
    return {i: make(i, t, pos, len(b.members[t])) for i, b, t, pos in buckets_of(buckets, group, rank)}


def sync_layers(buckets: Sequence[LayerBucket], group: int, rank: int, params: Mapping[str, torch.nn.Parameter],
                weight: torch.Tensor, process_groups: Mapping[int, dist.ProcessGroup],
                wait: Callable[[list], None] | None = None) -> None:
    """Replace the gradients of the buckets ``(group, rank)`` holds by their weighted mean over the groups.

    ``params``: this rank's parameters by name (local shards under tensor parallelism); ``weight``: a one-element
    tensor on the parameters' device, this group's weight (its label tokens); ``wait(works)``: waits for the
    issued reductions first (a fault-tolerant caller may give up on them and raise).
    """
    mine = buckets_of(buckets, group, rank)
    pending = []
    for i, bucket, _, _ in mine:
        ps = [params[n] for n in bucket.names]
        flat = torch.cat([(_local(p.grad).reshape(-1).float() if p.grad is not None else
                           torch.zeros(_local(p).numel(), device=weight.device)) * weight for p in ps]
                         + [torch.tensor([float(p.grad is not None) for p in ps], device=weight.device),
                            weight.reshape(1).float()])
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        pending.append((ps, flat, process_groups[i].allreduce([flat], opts)))
    if wait is not None:
        wait([work for _, _, work in pending])
    for _, _, work in pending:
        work.wait()
    if not pending:
        return
    used = torch.cat([flat[-1 - len(ps):-1] for ps, flat, _ in pending]).tolist()  # one host read for all buckets
    at = 0
    for ps, flat, _ in pending:
        total = torch.clamp(flat[-1], min=torch.finfo(flat.dtype).tiny)
        offset = 0
        for p in ps:
            n = _local(p).numel()
            if used[at]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local(p.grad).copy_((flat[offset:offset + n] / total).view_as(_local(p)))
            else:
                p.grad = None
            offset += n
            at += 1


__all__ = ["bucket_process_groups", "sync_layers"]
