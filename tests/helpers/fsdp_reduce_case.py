"""When FSDP reduce-scatters (``fsdp_reduce``): engine steps of several microbatches and accumulated batches under
FULL_SHARD, counting the reduce-scatters each rank launches, and the same steps in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from helpers.pipeline_case import build_model, global_batches, replica_batch
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.plan.layout import ParallelSpec, build_layout

STEPS, ACCUMULATE, ROWS, MICROBATCHES = 2, 2, 4, 2


def run_reference() -> tuple[list[float], dict]:
    """One process: each optimiser step sums the gradients of ``ACCUMULATE`` batches of loss / ACCUMULATE (as
    Lightning's accumulation), SGD."""
    model = build_model(("vision",), "encoder")
    batches = global_batches(model, STEPS * ACCUMULATE, ROWS)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for i, batch in enumerate(batches):
        loss = model(**batch).loss
        (loss / ACCUMULATE).backward()
        losses.append(float(loss.detach()))
        if i % ACCUMULATE == ACCUMULATE - 1:
            opt.step()
            opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_rank(rank, world, fsdp_reduce: str, placement: str, llm_pp: int):
    """(losses, owned trainable parameters, reduce-scatters launched in each optimiser step) of one rank."""
    launched = [0]
    reduce_scatter = dist.reduce_scatter_single  # FSDP2's reduce-scatter (torch 2.13), looked up at every call

    def counted(*args, **kwargs):
        launched[0] += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    model = build_model(("vision",), "encoder")
    batches = global_batches(model, STEPS * ACCUMULATE, ROWS)
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(pp=llm_pp), world, placement, ["vision"])
    engine = PipelineEngine(model, layout, rank, MICROBATCHES, sharding_strategy="FULL_SHARD",
                            fsdp_reduce=fsdp_reduce)
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=0.5) if params else None
    losses, per_step = [], []
    for i, batch in enumerate(batches):
        last = i % ACCUMULATE == ACCUMULATE - 1
        mine = replica_batch(batch, model, layout.dp, engine.coord.dp)
        losses.append(float(engine.run(mine, loss_scale=1 / ACCUMULATE, sync=last).loss))
        if last:
            engine.sync_gradients()
            if opt:
                opt.step()
                opt.zero_grad()
            per_step.append(launched[0] - sum(per_step))
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    return losses, {n: full(p.detach()).clone() for n, p in model.named_parameters()
                    if n in engine.owned and p.requires_grad}, per_step
