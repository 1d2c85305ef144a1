"""A pipeline training case run on every rank, and the same training in one process (the reference)."""

from __future__ import annotations

import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.parallel.layout import ParallelSpec, build_layout

FREEZE = {"projectors": dict(encoders=True, projectors=False, language_model=True),
          "encoder": dict(encoders=False, projectors=False, language_model=True),
          "llm": dict(encoders=True, projectors=False, language_model=False)}


def build_model(modalities: tuple[str, ...], freeze: str, llm: str = "llama"):
    torch.manual_seed(0)
    kinds = {"vision": ("siglip", "mlp"), "audio": ("whisper", "linear"), "image2": ("qwen2_vl", "linear")}
    encoders = {m: lmm.ModalityEncoder(tiny_encoder(kinds[m][0]), projector=kinds[m][1]) for m in modalities}
    model = lmm.MultimodalModel(encoders, tiny_language_model(llm))
    return model.freeze(**FREEZE[freeze])


def global_batches(model, steps: int, rows: int, layout: str = "ee", seed: int = 0):
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=steps * rows, seed=seed,
                                               layout="ee" if layout == "mp" else layout)
    collate = lmm.data.MultimodalCollator(model, seq_len=160 if layout == "mp" else None, pack=layout == "mp")
    return [collate([data[s * rows + r] for r in range(rows)]) for s in range(steps)]


def replica_batch(batch: dict, dp: int, d: int) -> dict:
    from lightning_mm.data.microbatch import split_microbatches

    return split_microbatches(batch, dp, _MODEL_FOR_SPLIT[0])[d]


_MODEL_FOR_SPLIT = [None]


def run_reference(modalities, freeze, steps, rows, layout="ee", lr=0.5):
    model = build_model(modalities, freeze)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in global_batches(model, steps, rows, layout):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_rank(rank, world, modalities, freeze, encoder_pp, llm_pp, placement, microbatches, steps, rows,
             layout="ee", lr=0.5, llm_cp=1, cp_method="lpt", cp_block=8):
    model = build_model(modalities, freeze)
    batches = global_batches(model, steps, rows, layout)
    _MODEL_FOR_SPLIT[0] = model
    specs = {m: ParallelSpec(pp=encoder_pp[i]) for i, m in enumerate(modalities)}
    plan = build_layout(specs, ParallelSpec(pp=llm_pp, cp=llm_cp), world, placement, list(modalities))
    engine = PipelineEngine(model, plan, rank, microbatches, cp_distribution=cp_method, cp_block_size=cp_block)
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=lr) if params else None  # a fully frozen stage has nothing to step
    d = engine.coord.dp
    losses = []
    for batch in batches:
        local = replica_batch(batch, plan.dp, d)
        losses.append(float(engine.run(local)))
        engine.sync_gradients()
        if opt:
            opt.step()
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters() if n in engine.owned and p.requires_grad}
    return losses, params
