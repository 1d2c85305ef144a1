"""A model whose frozen-aware partition differs from uniform and forward-only (frozen SigLIP + a trainable MLP
projector about 1.5 encoder layers wide), trained pipelined with a planner partition and in one process."""

from __future__ import annotations

import torch
from torch import nn

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.planner.model_costs import resolve_partition
from lightning_mm.plan.layout import ParallelSpec, build_layout
from helpers.pipeline_case import global_batches, train_engine, train_reference


def build_model() -> lmm.MultimodalModel:
    torch.manual_seed(0)
    projector = nn.Sequential(nn.Linear(32, 192), nn.GELU(), nn.Linear(192, 32))
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector=projector)},
                                tiny_language_model("llama"))
    return model.freeze(encoders=True, projectors=False, language_model=True)


def run_reference(steps: int, rows: int, lr: float = 0.5):
    model = build_model()
    return train_reference(model, global_batches(model, steps, rows), lr)


def run_rank(rank, world, partition, vision_pp, llm_pp, microbatches, steps, rows, lr=0.5):
    model = build_model()
    batches = global_batches(model, steps, rows)
    layout = build_layout({"vision": ParallelSpec(pp=vision_pp)}, ParallelSpec(pp=llm_pp), world, "parallel",
                          ["vision"])
    engine = PipelineEngine(model, layout, rank, microbatches, resolve_partition(model, layout.module_stages, partition))
    losses, owned = train_engine(engine, model, batches, lr)
    return losses, owned, {s: (p.encoders["vision"].end - p.encoders["vision"].start) for s, p in engine.plans.items()
                           if "vision" in p.encoders}
