"""Ranks with nothing to do: a replica whose samples are all text-only (or have no audio) under FSDP, trained on
every rank and, as the reference, in one process."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import lightning_mm as lmm
from helpers.pipeline_case import build_model, replica_batch, train_reference
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.plan.layout import ParallelSpec, build_layout


def uneven_batches(model, steps: int, rows: int, without: tuple[str, ...]) -> list[dict]:
    """Global batches whose first half of rows (replica 0's share) has 1-3 items of every modality and whose second
    half (replica 1's) has none of ``without`` (text-only when it names every encoder)."""
    full = lmm.data.SyntheticMultimodalDataset(model, steps * rows, items_per_sample=(1, 3), seed=1)
    partial = lmm.data.SyntheticMultimodalDataset(model, steps * rows, items_per_sample=(1, 3), seed=2)
    collate = lmm.data.MultimodalCollator(model)
    out = []
    for s in range(steps):
        mine = [full[s * rows + r] for r in range(rows // 2)]
        other = [dict(partial[s * rows + r]) for r in range(rows // 2)]
        for sample in other:
            for name in without:
                sample.pop(name, None)
                sample["input_ids"] = sample["input_ids"][sample["input_ids"] != model.placeholder_ids[name]]
        out.append(collate(mine + other))
    return out


def run_reference(modalities, freeze, without, steps=2, rows=4):
    model = build_model(modalities, freeze)
    return train_reference(model, uneven_batches(model, steps, rows, without))


def run_rank(rank, world, modalities, freeze, without, placement, llm_pp, sharding, steps=2, rows=4):
    model = build_model(modalities, freeze)
    batches = uneven_batches(model, steps, rows, without)
    layout = build_layout({m: ParallelSpec() for m in modalities}, ParallelSpec(pp=llm_pp), world, placement,
                          list(modalities))
    engine = PipelineEngine(model, layout, rank, 2, sharding_strategy=sharding)
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=0.5) if params else None
    losses = []
    for batch in batches:
        losses.append(float(engine.run(replica_batch(batch, model, layout.dp, engine.coord.dp)).loss))
        engine.sync_gradients()
        if opt:
            opt.step()
            opt.zero_grad()
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    return losses, {n: full(p.detach()).clone() for n, p in model.named_parameters()
                    if n in engine.owned and p.requires_grad}


def sparse_global_batches(model, steps: int, rows: int) -> list[dict]:
    """Global batches of 1-3 images per sample (images of different sizes) but for: in the first step the first
    row holds one image and the second none (a microbatch of two rows with one item: one encoder replica, or one
    encoder CP rank, gets nothing), in the second step the third and fourth rows are text-only (a microbatch with no
    image at all)."""
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=steps * rows, seed=0, items_per_sample=(1, 3))
    single = lmm.data.SyntheticMultimodalDataset(model, num_samples=1, seed=3, items_per_sample=(1, 1))
    collate = lmm.data.MultimodalCollator(model)
    empty = {0: (1,), 1: (2, 3)}
    out = []
    for s in range(steps):
        samples = [dict(data[s * rows + r]) for r in range(rows)]
        if s == 0:
            samples[0] = dict(single[0])
        for r in empty.get(s, ()):
            samples[r].pop("vision")
            ids = samples[r]["input_ids"]
            samples[r]["input_ids"] = ids[ids != model.placeholder_ids["vision"]]
        out.append(collate(samples))
    return out


def run_per_module_rank(rank, world, encoder_specs, llm_spec, steps=3, rows=4, microbatches=2,
                        fsdp_reduce="microbatch"):
    """(losses, owned trainable parameters, (local, full) element counts of this rank's encoder parameters) of one
    rank of ``encoder_specs`` / ``llm_spec`` (per-module dp, encoder cp) under FULL_SHARD, on
    ``sparse_global_batches``."""
    from helpers.per_module_dp_case import build_model as build, group_batch, layout_of

    model = build(("vision",), "encoder")
    batches = sparse_global_batches(model, steps, rows)
    layout = layout_of(("vision",), encoder_specs, llm_spec, world)
    engine = PipelineEngine(model, layout, rank, microbatches, sharding_strategy="FULL_SHARD",
                            fsdp_reduce=fsdp_reduce)
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=0.5) if params else None
    losses = []
    for batch in batches:
        losses.append(float(engine.run(group_batch(batch, model, layout, rank)).loss))
        engine.sync_gradients()
        if opt:
            opt.step()
            opt.zero_grad()
    encoder = [p for n, p in model.named_parameters() if n in engine.owned and n.startswith("encoders.")]
    sizes = (sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in encoder),
             sum(p.numel() for p in encoder))
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    return losses, {n: full(p.detach()).clone() for n, p in model.named_parameters()
                    if n in engine.owned and p.requires_grad}, sizes


def run_per_module_reference(steps=3, rows=4):
    from helpers.per_module_dp_case import build_model as build

    model = build(("vision",), "encoder")
    return train_reference(model, sparse_global_batches(model, steps, rows))
