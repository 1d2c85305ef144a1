"""Train a tiled-image composite (LLaVA-NeXT, LLaVA-OneVision, InternVL; ``MultimodalModel.from_pretrained``) with
Lightning, in one process or under MultimodalParallelStrategy, described by a JSON argument.

``python tile_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0: per-step losses) and
``<out_dir>/params_<rank>.pt`` (the trainable parameters this rank owns, full names). Keys of the JSON:
``folder`` and ``kind`` (required), ``steps``, ``llm_pp`` / ``llm_cp`` (the LLM's pipeline stages and context-parallel
ranks under the strategy, vision one stage; without them plain single-device Lightning), ``sharding`` (the
strategy's ``sharding_strategy``), ``lazy`` (build under ``trainer.init_module(empty_init=True)``:
meta, each rank reads its stage in setup), ``vision_tp`` (the vision tower's tensor-parallel ranks), ``dp`` (replicas
of that layout; see ``composite_case``).

Samples are what the family's HF image processor returns for one or two random images of different sizes, so
rows differ in length (padding) and images in token counts.
"""

import json
import os
import sys

import numpy as np
import torch

import lightning_mm as lmm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from composite_case import train  # noqa: E402
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
    if {"llm_pp", "llm_cp", "vision_tp"} & set(case):
        pp, cp, tp = case.get("llm_pp", 1), case.get("llm_cp", 1), case.get("vision_tp", 1)
        strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec(pp=1, tp=tp)},
                                                  language_model=lmm.ParallelSpec(pp=pp, cp=cp), cp_block_size=8,
                                                  num_microbatches=2, fault_timeout=120,
                                                  sharding_strategy=case.get("sharding", "NO_SHARD"))
        devices = (tp + pp * cp) * case.get("dp", 1)
    else:
        strategy, devices = "auto", 1
    proc = image_processor(case["kind"])
    train(case, out, strategy, devices, lambda model: [sample(case["kind"], proc, i) for i in range(12)])

if __name__ == "__main__":
    main(*sys.argv[1:])
