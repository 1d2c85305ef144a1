"""When FSDP reduce-scatters (``fsdp_reduce``): engine steps of several microbatches and accumulated batches under
FULL_SHARD, counting the reduce-scatters each rank launches, and the same steps in one process; the peak bytes a
step allocates."""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

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



def _storage(t) -> int:
    """A plain tensor's storage pointer (0 for anything else, or a storage FSDP freed)."""
    if type(t) is not torch.Tensor:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensor storages allocated inside it and still alive: an allocator-independent "peak
    allocated" for CPU runs (the resident set also holds what the allocator keeps after a free). An operation's
    output counts when its storage is none of its inputs' (not a view, not in place) and until its last tensor dies."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, {}  # storage pointer -> [tensors alive, bytes]

    def _free(self, key):
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs))}
        for t in pytree.tree_leaves(out):
            key = _storage(t)
            if not key or key in inputs and key not in self.storages:
                continue
            entry = self.storages.setdefault(key, [0, t.untyped_storage().nbytes()])
            if entry[0] == 0:
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(t, self._free, key)
        return out


MEMORY_LLM = dict(vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)


def step_memory(rank, world, fsdp_reduce: str, microbatches: int = 4) -> dict:
    """A trainable Llama of about 42M parameters (with a frozen tiny SigLIP) under FULL_SHARD over ``world``
    replicas (one stage each), SGD: the peak bytes this rank allocates in its second step (``LiveBytes``) and its
    stage's trainable parameter bytes."""
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))},
                                tiny_language_model("llama", **MEMORY_LLM))
    model.freeze(encoders=True, projectors=False, language_model=False)
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=2 * 8, seed=0, text_tokens=(8, 16))
    collate = lmm.data.MultimodalCollator(model)
    batches = [collate([data[s * 8 + r] for r in range(8)]) for s in range(2)]
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(), world, "replicated", ["vision"])
    engine = PipelineEngine(model, layout, rank, microbatches, sharding_strategy="FULL_SHARD",
                            fsdp_reduce=fsdp_reduce)
    params = engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=1e-3)
    peak = 0
    for i, batch in enumerate(batches):
        with LiveBytes() if i else contextlib.nullcontext() as mode:
            engine.run(replica_batch(batch, model, layout.dp, engine.coord.dp))
            engine.sync_gradients()
            opt.step()
            opt.zero_grad()
        peak = mode.peak if i else peak
    return {"peak": peak, "trainable_bytes": sum(p.numel() * p.element_size() for p in params)}
