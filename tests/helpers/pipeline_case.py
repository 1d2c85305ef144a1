"""A pipeline training case run on every rank, and the same training in one process (the reference)."""

from __future__ import annotations

import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.plan.layout import ParallelSpec, build_layout

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


def replica_batch(batch: dict, model, dp: int, d: int) -> dict:
    """Replica ``d``'s share of a global batch (what the distributed sampler would give it)."""
    from lightning_mm.data.microbatch import split_microbatches

    return split_microbatches(batch, dp, model)[d]


def train_reference(model, batches, lr=0.5):
    """SGD on the unparallelised model, one global batch per step: (losses, trainable parameters)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train_engine(engine, model, batches, lr=0.5):
    """The same SGD through a PipelineEngine on this rank's replica share: (losses, owned trainable parameters)."""
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=lr) if params else None  # a fully frozen stage has nothing to step
    losses = []
    for batch in batches:
        losses.append(float(engine.run(replica_batch(batch, model, engine.layout.dp, engine.coord.dp)).loss))
        engine.sync_gradients()
        if opt:
            opt.step()
            opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()
                    if n in engine.owned and p.requires_grad}


def run_reference(modalities, freeze, steps, rows, layout="ee", lr=0.5):
    model = build_model(modalities, freeze)
    return train_reference(model, global_batches(model, steps, rows, layout), lr)


def _case(world, modalities, freeze, encoder_pp, llm_pp, placement, steps, rows, layout, llm_cp, cp_mode="allgather",
          ulysses=None):
    """(model, global batches, rank layout) of one pipeline case, the same on every rank."""
    model = build_model(modalities, freeze)
    batches = global_batches(model, steps, rows, layout)
    specs = {m: ParallelSpec(pp=encoder_pp[i]) for i, m in enumerate(modalities)}
    llm = ParallelSpec(pp=llm_pp, cp=llm_cp, cp_mode=cp_mode, ulysses=ulysses)
    return model, batches, build_layout(specs, llm, world, placement, list(modalities))


def run_rank(rank, world, modalities, freeze, encoder_pp, llm_pp, placement, microbatches, steps, rows,
             layout="ee", lr=0.5, llm_cp=1, cp_method="lpt", cp_block=8, cp_mode="allgather", ulysses=None):
    model, batches, plan = _case(world, modalities, freeze, encoder_pp, llm_pp, placement, steps, rows, layout, llm_cp,
                                 cp_mode, ulysses)
    engine = PipelineEngine(model, plan, rank, microbatches, cp_distribution=cp_method, cp_block_size=cp_block)
    return train_engine(engine, model, batches, lr)


def run_rank_checkpointed(rank, world, modalities, freeze, encoder_pp, llm_pp, microbatches, steps, rows,
                          llm_cp=1, layout="ee", cp_mode="allgather", ulysses=None):
    """`run_rank` with activation checkpointing on, also returning how often each owned layer started a forward
    (a pre-hook: a recomputation stops once it has rebuilt what backward needs, before the layer returns)."""
    model, batches, plan = _case(world, modalities, freeze, encoder_pp, llm_pp, "parallel", steps, rows, layout, llm_cp,
                                 cp_mode, ulysses)
    layers = {f"language_model.{i}": layer for i, layer in enumerate(model.llm_layers)}
    layers.update({f"{m}.{i}": layer for m in modalities for i, layer in enumerate(model.encoders[m].layers)})
    engine = PipelineEngine(model, plan, rank, microbatches, cp_block_size=8, activation_checkpointing=True)
    kept = {id(m) for m in model.modules()}  # the engine pruned the other stages' layers
    calls: dict[str, int] = {}
    for name, layer in layers.items():
        if id(layer) in kept:
            layer.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    losses, params = train_engine(engine, model, batches, lr=0.5)
    return losses, params, calls


def check_like_reference(results, ref_losses, ref_params):
    """Every rank's losses equal one process's; replicas of a stage agree bit for bit; the parameters of every
    stage equal one process's after the steps."""
    merged = {}
    for losses, params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            if name in merged:
                torch.testing.assert_close(p, merged[name], rtol=0, atol=0)
            merged[name] = p
    assert set(merged) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(merged[name], p, rtol=1e-4, atol=1e-5, msg=name)
    assert ref_losses[0] != ref_losses[-1]
