"""LoRA training and generation under Lightning, one process or under MultimodalParallelStrategy.

``python lora_generation_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0: per-step losses,
and what ``trainer.predict`` with ``generation=`` gave: every rank's generated ids in order, or the error it
raised) and ``<out_dir>/params_<rank>.pt`` (this rank's trainable parameters by full name). JSON keys:
``devices`` (1: plain Lightning), ``llm_pp``, ``llm_tp``, ``sharding`` (sharding_strategy), ``placement``,
``steps``, ``predict`` (default true), ``lora_modules`` (default q_proj and v_proj), ``precision`` (the Trainer's;
the expected tokens then come from ``generate`` under the same autocast).
"""

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.model.generation import whole_model_on_rank

GENERATION = {"max_new_tokens": 4, "do_sample": False}


def build():
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model())
    model.freeze(encoders=True, projectors=False)
    return model


def batches(model, n, rows, seed):
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=n * rows, seed=seed)
    collate = lmm.data.MultimodalCollator(model)
    return [collate([data[i * rows + r] for r in range(rows)]) for i in range(n)]


def main(spec: str, out: str):
    case = json.loads(spec)
    devices = case.get("devices", 1)
    strategy = "auto"
    if devices > 1:
        strategy = lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec(pp=1)},
            language_model=lmm.ParallelSpec(pp=case.get("llm_pp", 1), tp=case.get("llm_tp", 1)),
            encoder_placement=case.get("placement", "parallel"), num_microbatches=2, fault_timeout=60,
            sharding_strategy=case.get("sharding", "NO_SHARD"))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=case.get("steps", 2),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        precision=case.get("precision", "32-true"))
    model = build()
    module = lmm.MultimodalLightningModule(
        model, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), generation=GENERATION,
        lora={"modules": case.get("lora_modules", ["q_proj", "v_proj"]), "r": 4, "alpha": 8,
              "init_lora_weights": False})
    losses = []
    module.on_train_batch_end = lambda outputs, batch, i: losses.append(float(outputs["loss"]))
    train = batches(model, case.get("steps", 2), 4, seed=1)
    trainer.fit(module, DataLoader(train, batch_size=None))
    rank, world = trainer.global_rank, trainer.world_size
    owned = getattr(trainer.strategy, "engine", None)
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    torch.save({n: full(p.detach()) for n, p in module.model.named_parameters()
                if p.requires_grad and (owned is None or n in owned.owned)}, os.path.join(out, f"params_{rank}.pt"))
    # each data-parallel replica predicts its own prompts: rank r takes batch r (every rank of a replica the same)
    prompts = batches(model, 2, 2, seed=2)
    replica = 0 if owned is None else owned.coord.dp
    result = {"train": losses}
    if not case.get("predict", True):
        if rank == 0:
            with open(os.path.join(out, "result.json"), "w") as f:
                json.dump(result, f)
        return
    try:
        got = trainer.predict(module, DataLoader([prompts[replica]], batch_size=None))[0]["generated_ids"]
        gathered = [None] * world
        if world > 1:
            dist.all_gather_object(gathered, got.tolist())
        else:
            gathered = [got.tolist()]
        result["generated"] = gathered
        if owned is None or whole_model_on_rank(owned, module.model):  # else the model is cut into stages
            with trainer.precision_plugin.forward_context():  # the autocast trainer.predict ran under
                result["expected"] = [module.model.generate(**p, **GENERATION).tolist() for p in prompts]
    except RuntimeError as e:
        result["error"] = str(e)
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
