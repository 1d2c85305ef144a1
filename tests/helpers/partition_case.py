"""A model whose frozen-aware partition differs from uniform and forward-only (frozen SigLIP + a trainable MLP
projector about 1.5 encoder layers wide), trained pipelined with a planner partition and in one process."""

from __future__ import annotations

import torch
from torch import nn

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.parallel.layout import ParallelSpec, build_layout
from helpers.pipeline_case import global_batches


def build_model() -> lmm.MultimodalModel:
    torch.manual_seed(0)
    projector = nn.Sequential(nn.Linear(32, 192), nn.GELU(), nn.Linear(192, 32))
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector=projector)},
                                tiny_language_model("llama"))
    return model.freeze(encoders=True, projectors=False, language_model=True)


def run_reference(steps: int, rows: int, lr: float = 0.5):
    model = build_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in global_batches(model, steps, rows):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_rank(rank, world, partition, vision_pp, llm_pp, microbatches, steps, rows, lr=0.5):
    model = build_model()
    batches = global_batches(model, steps, rows)
    layout = build_layout({"vision": ParallelSpec(pp=vision_pp)}, ParallelSpec(pp=llm_pp), world, "parallel",
                          ["vision"])
    engine = PipelineEngine(model, layout, rank, microbatches, partition)
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=lr) if params else None
    losses = []
    for batch in batches:
        losses.append(float(engine.run(batch)))
        engine.sync_gradients()
        if opt:
            opt.step()
            opt.zero_grad()
    owned = {n: p.detach().clone() for n, p in model.named_parameters() if n in engine.owned and p.requires_grad}
    return losses, owned, {s: (p.encoders["vision"].end - p.encoders["vision"].start) for s, p in engine.plans.items()
                           if "vision" in p.encoders}
