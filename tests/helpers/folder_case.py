"""``trainer.validate`` of a model built from ``save_pretrained`` folders, under the strategy or in one process.

``python folder_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0): the validation loss
(``val``), the world size and whether the model was built on meta. The model is
``MultimodalModel({"vision": ModalityEncoder(<encoder>)}, language_model=<llm>)`` with the projector initialised by
name from ``torch.initial_seed()`` (0 in every process). Keys of the JSON:

- ``llm``, ``encoder``: the folders (required)
- ``llm_pp``: run under MultimodalParallelStrategy (encoder pp 1 + LLM pp ``llm_pp`` processes); without it, plain
  single-device Lightning
- ``lazy``: build under ``trainer.init_module(empty_init=True)`` (meta; each rank reads its stage in setup)

The single-device run also reports ``val_random_init``: the loss of the same architecture built on meta and
materialised with the random initialisation by name (what a rank would hold if it ignored the folders).
"""

import json
import os
import sys

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.model.loading import is_meta, materialise


def module_of(model):
    return lmm.MultimodalLightningModule(model.freeze(encoders=True, projectors=False, language_model=True))


def main(spec: str, out: str):
    case = json.loads(spec)
    torch.set_num_threads(1)
    if "llm_pp" in case:
        strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec(pp=1)},
                                                  language_model=lmm.ParallelSpec(pp=case["llm_pp"]),
                                                  num_microbatches=2, fault_timeout=60)
        devices = 1 + case["llm_pp"]
    else:
        strategy, devices = "auto", 1
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, limit_val_batches=3)
    torch.manual_seed(0)

    def build():
        return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(case["encoder"])}, language_model=case["llm"])

    if case.get("lazy"):
        with trainer.init_module(empty_init=True):
            model = build()
    else:
        model = build()
    result = {"built_on_meta": is_meta(model), "world_size": trainer.world_size}
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=8, batch_size=4, val_samples=12)
    result["val"] = trainer.validate(module_of(model), data)[0]["val/loss"]
    if devices == 1:
        with torch.device("meta"):
            config = (model.encoders["vision"].module.config, model.language_model.config)
            random = lmm.MultimodalModel(
                {"vision": lmm.ModalityEncoder(type(model.encoders["vision"].module)(config[0]))},
                language_model=type(model.language_model)(config[1]))
        materialise(random, "cpu", seed=0)
        result["val_random_init"] = trainer.validate(module_of(random), data)[0]["val/loss"]
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
