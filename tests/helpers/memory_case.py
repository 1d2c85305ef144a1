"""Each rank's peak resident memory while a large LLM trains one step under MultimodalParallelStrategy.

``python memory_case.py '<json>' <out_dir>`` writes ``<out_dir>/memory_<rank>.json`` on every rank. The model is a
SigLIP encoder (tiny) + a Llama of the given size, the encoder and the LLM frozen (the projector is the only
trainable part, AdamW: its state is a few KiB), built eagerly on every rank or under
``trainer.init_module(empty_init=True)`` (meta, each rank materialises its stage in ``strategy.setup``).

Memory is the Linux resident-set high-water mark (``VmHWM`` in ``/proc/self/status``), reset to the current resident
set by writing 5 to ``/proc/self/clear_refs``: once right before the model is built (``build_peak``: the peak of the
build) and once right before ``trainer.fit`` (``fit_peak``: the peak of setup and training). Each is reported as a
growth above the resident set at its reset (bytes). Keys of the JSON (all optional):

- ``lazy``: build under ``init_module(empty_init=True)`` (default False: eager, the whole model on every rank)
- ``llm``: overrides of the Llama config (default: hidden 1024, 12 layers, vocab 32000, intermediate 2048, untied)
- ``llm_pp`` (default 4), ``placement`` (default "replicated": the encoder inside LLM stage 0, so ``llm_pp``
  processes; "parallel" adds one encoder rank), ``steps`` (default 1), ``text_tokens`` (default [8, 12])
- ``llm_folder``, ``encoder_folder``: build the LLM and the encoder from these ``save_pretrained`` folders instead
  (lazily, each rank then reads its stage's tensors from their safetensors while it materialises)
"""

import gc
import json
import os
import sys
import time

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model

LLM = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=16,
           num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False)


def status_bytes(key: str) -> int:
    """A ``/proc/self/status`` field (kB there) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def reset_peak() -> int:
    """Reset the high-water mark to the current resident set; returns that resident set (bytes)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


class SplitPeak(L.Callback):
    """Splits ``fit_peak`` at the start of training: ``setup_peak`` (setup: each rank cuts and materialises its
    stage) above the resident set before fit, ``train_peak`` (the steps) above the resident set at their start."""

    def on_train_start(self, trainer, pl_module):
        self.at_setup_end = status_bytes("VmHWM")
        self.before_train = reset_peak()


def build(case):
    if case.get("llm_folder"):
        model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(case["encoder_folder"])}, case["llm_folder"])
        return model.freeze(encoders=True, projectors=False, language_model=True)
    llm = tiny_language_model("llama", **{**LLM, **case.get("llm", {})})
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, llm)
    return model.freeze(encoders=True, projectors=False, language_model=True)


def main(spec: str, out: str):
    case = json.loads(spec)
    torch.set_num_threads(1)
    pp, placement = case.get("llm_pp", 4), case.get("placement", "replicated")
    strategy = lmm.MultimodalParallelStrategy(
        encoders={"vision": lmm.ParallelSpec(pp=1)}, language_model=lmm.ParallelSpec(pp=pp),
        encoder_placement=placement, num_microbatches=1, fault_timeout=120)
    split = SplitPeak()
    trainer = L.Trainer(accelerator="cpu", devices=pp + (placement != "replicated"), strategy=strategy,
                        max_steps=case.get("steps", 1), logger=False, enable_checkpointing=False, callbacks=[split],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    torch.manual_seed(0)
    torch.ones(1) + 1  # allocator warm-up before any measure
    before_build = reset_peak()
    start = time.perf_counter()
    if case.get("lazy"):
        with trainer.init_module(empty_init=True):
            model = build(case)
    else:
        model = build(case)
    build_seconds = time.perf_counter() - start
    build_peak = status_bytes("VmHWM") - before_build
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=8, batch_size=1,
                                                  text_tokens=tuple(case.get("text_tokens", (8, 12))))
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    llm = sum(p.numel() * p.element_size() for p in model.language_model.parameters())
    before_fit = reset_peak()
    start = time.perf_counter()
    trainer.fit(module, data)
    fit_seconds = time.perf_counter() - start
    end_peak = status_bytes("VmHWM")  # since the reset at the start of training
    fit_peak = max(split.at_setup_end, end_peak) - before_fit
    engine = trainer.strategy.engine
    owned = dict(module.model.named_parameters())
    stage = sum(owned[n].numel() * owned[n].element_size() for n in engine.owned if n in owned)
    doc = {"rank": trainer.global_rank, "stage": engine.stage, "lazy": bool(case.get("lazy")),
           "model_bytes": full, "llm_bytes": llm, "stage_bytes": stage,
           "rss_before_build": before_build, "rss_before_fit": before_fit, "rss_after_fit": status_bytes("VmRSS"),
           "build_peak": build_peak, "fit_peak": fit_peak, "setup_peak": split.at_setup_end - before_fit,
           "train_peak": end_peak - split.before_train,
           # the peak of build, setup and training together, above the resident set before the build
           "total_peak": max(before_build + build_peak, before_fit + fit_peak) - before_build,
           "build_seconds": build_seconds, "fit_seconds": fit_seconds,
           "trainable": sorted(n for n, p in module.model.named_parameters() if p.requires_grad and n in engine.owned)}
    with open(os.path.join(out, f"memory_{trainer.global_rank}.json"), "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
