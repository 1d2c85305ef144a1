"""Per-module data parallelism cases: each rank trains its group's batch through a PipelineEngine; the reference
trains the unparallelised model in one process on the global batches."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import lightning_mm as lmm
from lightning_mm.data.microbatch import split_microbatches
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.plan.layout import ParallelSpec, build_layout

from helpers.pipeline_case import FREEZE, train_reference

KINDS = {"vision": ("qwen2_vl", "linear"), "audio": ("whisper", "linear")}  # Qwen2-VL: images of different sizes


def build_model(modalities: tuple[str, ...], freeze: str, llm: str = "llama"):
    """``llm``: the tiny LLM kind; a mixture-of-experts one without its load-balancing loss (a mean over
    microbatches, which no split of the batch reproduces)."""
    torch.manual_seed(0)
    encoders = {m: lmm.ModalityEncoder(tiny_encoder(KINDS[m][0]), projector=KINDS[m][1]) for m in modalities}
    kw = {"output_router_logits": False} if llm != "llama" else {}
    return lmm.MultimodalModel(encoders, tiny_language_model(llm, **kw)).freeze(**FREEZE[freeze])


def global_batches(model, steps: int, rows: int, seed: int = 0):
    """Samples of 0 to 5 items of each modality (some text-only), images of different sizes."""
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=steps * rows, seed=seed, items_per_sample=(0, 5))
    collate = lmm.data.MultimodalCollator(model)
    return [collate([data[s * rows + r] for r in range(rows)]) for s in range(steps)]


def layout_of(modalities, encoder_specs, llm_spec, world=None):
    specs = {m: ParallelSpec(**encoder_specs[m]) for m in modalities}
    llm = ParallelSpec(**llm_spec)
    if world is None:
        world = sum(s.dp * s.size for s in [*specs.values(), llm])
    return build_layout(specs, llm, world, "parallel", list(modalities))


def group_batch(batch: dict, model, layout, rank: int) -> dict:
    """The batch of ``rank``'s group: its language-model replicas' shares of the global batch, in order."""
    return split_microbatches(batch, layout.num_groups, model)[layout.group_of(rank)]


def run_rank(rank, world, modalities, freeze, encoder_specs, llm_spec, microbatches, steps, rows, lr=0.5,
             probe=False, sharding="NO_SHARD", llm="llama"):
    """(losses, owned trainable parameters, probe) of one rank. ``probe``: on the language model's first stage, the
    features its embedding got in the first step, per microbatch, with the global rows of each microbatch."""
    model = build_model(modalities, freeze, llm)
    batches = global_batches(model, steps, rows)
    layout = layout_of(modalities, encoder_specs, llm_spec, world)
    engine = PipelineEngine(model, layout, rank, microbatches, cp_block_size=8, sharding_strategy=sharding)
    seen = []
    if probe and engine.feeds_on_encoders:
        embed = engine.model.embed
        engine.model.embed = lambda ids, features: (seen.append({k: v.detach().clone() for k, v in features.items()}),
                                                    embed(ids, features))[1]
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=lr) if params else None
    losses, probed = [], None
    for batch in batches:
        step = engine.run(group_batch(batch, model, layout, rank))
        losses.append(float(step.loss))
        if probe and probed is None and engine.feeds_on_encoders:
            first = layout.group_of(rank) * (rows // layout.num_groups)
            probed = [(features, [first + r for r in mb]) for features, mb in zip(seen, step.rows)]
        engine.sync_gradients()
        if opt:
            opt.step()
            opt.zero_grad()
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    owned = {n: full(p.detach()).clone() for n, p in model.named_parameters() if n in engine.owned and p.requires_grad}
    return losses, owned, probed


def run_reference(modalities, freeze, steps, rows, lr=0.5, llm="llama"):
    model = build_model(modalities, freeze, llm)
    return train_reference(model, global_batches(model, steps, rows), lr)
