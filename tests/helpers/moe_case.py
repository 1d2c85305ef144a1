"""A mixture-of-experts LLM (vision tower + Qwen3-MoE or Mixtral) trained through the pipeline on every rank, and
the same microbatches trained in one process (the reference)."""

from __future__ import annotations

import torch

import lightning_mm as lmm
from lightning_mm import loss as losses
from lightning_mm.data.microbatch import microbatch_rows, split_microbatches
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.plan.layout import ParallelSpec, build_layout

from helpers.pipeline_case import global_batches, replica_batch


def build_moe_model(kind: str, aux: bool, silent_experts: tuple[int, ...] = ()):
    """Siglip + MLP projector + a tiny MoE LLM (8 experts, top-2), everything trainable. ``silent_experts``: experts
    no token is routed to (their router logits pushed to -1e4 after HF's router computed them, then HF's top-k
    again), to force an expert-parallel rank that receives nothing for them."""
    torch.manual_seed(0)
    lm = tiny_language_model(kind, output_router_logits=aux, router_aux_loss_coef=0.5 if aux else 0.01)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")}, lm)
    if silent_experts:
        for router in model.lm_family.routers(model.language_model).values():
            router.register_forward_hook(_silence(list(silent_experts)))
    return model


def _silence(experts: list[int]):
    """A forward hook on an HF top-k router (Qwen3-MoE's, Mixtral's: softmax, top-k, optional renormalisation) that
    routes no token to ``experts``."""
    def hook(router, args, out):
        logits = out[0].index_fill(-1, torch.tensor(experts, device=out[0].device), -1e4)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if getattr(router, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index
    return hook


def train_reference(model, batches, microbatches: int, dp: int = 1, lr: float = 0.5):
    """SGD in one process over the microbatches the engine runs (each replica's rows cut the same way): the step's
    loss is the token loss over the global batch plus ``coef`` times the mean of the per-microbatch aux losses.
    Returns (losses, aux losses, trainable parameters, gradient norm of each step)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    coef = model.lm_family.aux_loss_coef(model.language_model)
    out_losses, auxes, norms = [], [], []
    for batch in batches:
        count = losses.count_label_tokens(batch["labels"])
        total, aux_total = 0.0, 0.0
        for d in range(dp):
            rows = replica_batch(batch, model, dp, d)
            for mb in split_microbatches(rows, microbatch_rows(rows, microbatches)[1], model):
                out = model(**mb)
                loss = losses.normalise(out.loss_sum, count) + coef * out.aux_loss / (microbatches * dp)
                loss.backward()
                total += float(loss.detach())
                aux_total += float(out.aux_loss.detach()) / (microbatches * dp)
        norms.append(float(torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for p in model.parameters() if p.grad is not None]))))
        opt.step()
        opt.zero_grad()
        out_losses.append(total)
        auxes.append(aux_total)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out_losses, auxes, params, norms


def world_of(llm: dict, dp: int) -> int:
    return (1 + llm.get("pp", 1) * llm.get("cp", 1) * llm.get("tp", 1)) * dp


def run_rank(rank, world, kind, aux, llm, dp, microbatches, steps, rows, checkpointing=False, sharding="NO_SHARD",
             silent_experts=()):
    """Vision pp 1 + the MoE LLM under ``ParallelSpec(**llm)``, ``dp`` replicas: (losses, aux losses, owned
    trainable parameters as full tensors, the last step's expert load, (expert weight elements held here, expert
    weight elements of this stage's layers), the global gradient norm of each step)."""
    from lightning_mm.parallel.expert_parallel import local_expert_count
    from torch.distributed.tensor import DTensor

    model = build_moe_model(kind, aux, silent_experts)
    batches = global_batches(model, steps, rows)
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(**llm), world, "parallel", ["vision"])
    engine = PipelineEngine(model, layout, rank, microbatches, activation_checkpointing=checkpointing,
                            cp_block_size=8, sharding_strategy=sharding)
    experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n and n in engine.owned]
    held = (local_expert_count(experts), sum(p.numel() for p in experts))
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=0.5)
    step_losses, auxes, norms = [], [], []
    for batch in batches:
        step_losses.append(float(engine.run(replica_batch(batch, model, layout.dp, engine.coord.dp)).loss))
        auxes.append(float(engine.router_metrics.metrics["aux_loss"]))
        engine.sync_gradients()
        norms.append(float(engine.global_grad_norm()))
        opt.step()
        opt.zero_grad()
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters() if n in engine.owned and p.requires_grad}
    return step_losses, auxes, full, engine.router_metrics.metrics["expert_load"], held, norms
