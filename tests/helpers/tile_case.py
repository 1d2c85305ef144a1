"""Train a tiled-image composite (LLaVA-NeXT, LLaVA-OneVision, InternVL; ``MultimodalModel.from_pretrained``) with
Lightning, in one process or under MultimodalParallelStrategy, described by a JSON argument.

``python tile_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0: per-step losses) and
``<out_dir>/params_<rank>.pt`` (the trainable parameters this rank owns, full names). Keys of the JSON:
``folder`` and ``kind`` (required), ``steps``, ``llm_pp`` (the LLM's pipeline stages under the strategy, vision one
stage; without it plain single-device Lightning), ``lazy`` (build under ``trainer.init_module(empty_init=True)``:
meta, each rank reads its stage in setup), ``vision_tp`` (the vision tower's tensor-parallel ranks).

Samples are what the family's HF image processor returns for one or two random images of different sizes, so
rows differ in length (padding) and images in token counts.
"""

import json
import os
import sys

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

import lightning_mm as lmm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_tile_composites import IMG, encode, image_processor  # noqa: E402

SIZES = [(40, 20), (17, 33), (30, 30), (45, 16), (16, 16), (20, 50)]


def sample(kind: str, proc, i: int) -> dict:
    from PIL import Image

    g = torch.Generator().manual_seed(i)
    rng = np.random.default_rng(i)
    sizes = [SIZES[(i + k) % len(SIZES)] for k in range(1 + i % 2)]
    imgs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    ids = torch.randint(1, 90, (3 + i % 3,), generator=g).tolist()
    for _ in imgs:
        ids += [IMG] + torch.randint(1, 90, (2,), generator=g).tolist()
    return {"input_ids": torch.tensor(ids + [5, 6]), "vision": encode(kind, proc, imgs)}


def main(spec: str, out: str):
    case = json.loads(spec)
    torch.set_num_threads(1)
    if "llm_pp" in case or "vision_tp" in case:
        pp, tp = case.get("llm_pp", 1), case.get("vision_tp", 1)
        strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec(pp=1, tp=tp)},
                                                  language_model=lmm.ParallelSpec(pp=pp),
                                                  num_microbatches=2, fault_timeout=120)
        devices = tp + pp
    else:
        strategy, devices = "auto", 1
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=case.get("steps", 3),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    torch.manual_seed(0)
    if case.get("lazy"):
        with trainer.init_module(empty_init=True):
            model = lmm.MultimodalModel.from_pretrained(case["folder"])
    else:
        model = lmm.MultimodalModel.from_pretrained(case["folder"])
    model.freeze(encoders=False, projectors=False, language_model=False)
    losses = []

    class Module(lmm.MultimodalLightningModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            super().on_train_batch_end(outputs, batch, batch_idx)
            losses.append(float(outputs["loss"]))

    module = Module(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    proc = image_processor(case["kind"])
    data = DataLoader([sample(case["kind"], proc, i) for i in range(12)], batch_size=4,
                      collate_fn=lmm.data.MultimodalCollator(model))
    trainer.fit(module, data)
    engine = getattr(trainer.strategy, "engine", None)
    from torch.distributed.tensor import DTensor

    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    torch.save({n: full(p).detach().cpu() for n, p in module.model.named_parameters()
                if p.requires_grad and (engine is None or n in engine.owned)},
               os.path.join(out, f"params_{trainer.global_rank}.pt"))
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"train": losses}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
