"""One Lightning run, single process or under MultimodalParallelStrategy, described by a JSON argument.

``python trainer_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0: per-step losses,
validation/test loss, predicted ids) and ``<out_dir>/params_<rank>.pt`` (this rank's trainable parameters, full
names), so a test can compare any layout with one process; under the strategy also ``<out_dir>/fsdp_<rank>.json``
(how many parameters FSDP manages there). Keys of the JSON (all optional):

- ``devices`` (1 and none of ``STRATEGY_KEYS``: plain single-device Lightning, no strategy), ``encoder_pp`` / ``encoder_tp`` /
  ``encoder_cp`` ([vision, audio]), ``llm_pp``, ``llm_cp`` (blocks of 8 tokens), ``cp_mode``, ``ulysses``, ``llm_tp``, ``sharding``
  (sharding_strategy), ``fsdp_reduce``,
  ``placement`` (encoder_placement), ``recompute`` (activation_checkpointing), ``microbatches``, ``accumulate``,
  ``precision``, ``steps``, ``batch_size`` (per replica), ``freeze``, ``state_bytes`` (write
  ``state_<rank>.json``: bytes held before the second step),
  ``optimizer`` ("adamw" default, "sgd"), ``lr``, ``clip``, ``llm``, ``llm_layers``, ``llm_config`` (more config
  overrides of the tiny LLM), ``llm_ep`` (the LLM's expert parallelism), ``vision`` (tiny encoder name)
- ``lazy``: build under ``trainer.init_module(empty_init=True)`` (meta, materialised per stage)
- ``nan_at``: the step whose loss is made NaN (``nan_guard="skip"`` drops it)
- ``validate`` / ``test`` / ``predict``: run ``trainer.validate/test/predict`` after fitting
- ``consolidate``: save a checkpoint after fit and consolidate it on rank 0 while the group is alive
- ``balancing`` (batch_balancing), ``items`` ([min, max] items per sample), ``modalities`` (default
  ["vision", "audio"]), ``plans``: rank 0 writes each step's batch plan (``plans.json``)
- ``encoder_dp`` / ``llm_dp``: per-module data parallelism (every module's ``ParallelSpec.dp``); ``batch_size`` stays
  per language-model replica
- ``workers``: the loaders' ``num_workers`` (default 0)
- ``pack``: rows of ``pack`` tokens with samples packed into them (``segment_ids``); ``text_tokens`` ([min, max]);
  or ``layout`` ("ee" default, "mp": packed) with ``seq_len``
- ``lora``: LoRA adapters (r 4, alpha 8, random A and B) on these LLM modules, e.g. ["q_proj", "v_proj"]
- ``save_every``: a checkpoint every that many optimiser steps during fit (``<out_dir>/ckpt/step=<n>.ckpt``; one
  written after fit holds no loader position: its loops state has no ``combined_loader``); ``resume``: fit
  from this checkpoint
- ``accelerator`` ("cpu" default, "cuda"), ``backend`` (process_group_backend), ``share_gpu``: every rank on
  cuda:0 (the strategy's ``parallel_devices``); on CUDA each rank writes ``memory_<rank>.json`` (peak allocated)
"""

import json
import os
import sys

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model

FREEZE = {"projectors": dict(encoders=True, projectors=False, language_model=True),
          "llm": dict(encoders=True, projectors=False, language_model=False),
          "all": dict(encoders=False, projectors=False, language_model=False)}


class Data(lmm.data.SyntheticMultimodalDataModule):
    """Each replica reads its share of one seeded permutation (DistributedSampler), so dp replicas together see
    exactly the global batch one process sees."""

    def _loader(self, n, seed, shuffle):
        strategy = self.trainer.strategy
        kw = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        if not isinstance(strategy, lmm.MultimodalParallelStrategy):
            kw = {"num_replicas": 1, "rank": 0}
        data = self._dataset(n, seed)
        sampler = DistributedSampler(data, shuffle=shuffle, seed=seed, **kw)
        return DataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler, collate_fn=self.collator(),
                          drop_last=True, num_workers=self.hparams.num_workers)

    def test_dataloader(self):
        return self._loader(self.hparams.val_samples, self.hparams.seed + 2, shuffle=False)

    def predict_dataloader(self):
        return self._loader(self.hparams.val_samples, self.hparams.seed + 3, shuffle=False)


class Module(lmm.MultimodalLightningModule):
    def __init__(self, *args, nan_at=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.nan_at, self.losses, self.aux_losses, self.packed = nan_at, [], [], []

    def compute_loss(self, batch, train=True):
        loss = super().compute_loss(batch, train)
        if train and self.nan_at is not None and self.global_step == self.nan_at:
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.losses.append(float(outputs["loss"]))
        if "segment_ids" in batch:  # packed rows: the most samples one row of this batch holds
            segs, mask = batch["segment_ids"], batch["attention_mask"].bool()
            self.packed.append(max(len(set(segs[r][mask[r]].tolist())) for r in range(len(segs))))
        if "train/aux_loss" in self.trainer.callback_metrics:  # what this step logged (a mixture-of-experts LLM)
            self.aux_losses.append(float(self.trainer.callback_metrics["train/aux_loss"]))


class StateBytes(L.Callback):
    """Right before the second optimiser step: bytes of this rank's parameters, gradients and optimiser state
    (the local tensors it holds) -> ``state_<rank>.json``."""

    def __init__(self, out):
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != 1:
            return
        def size(tensors):  # each storage once (FSDP's gradient shards are views of one buffer per unit)
            storages = {}
            for t in tensors:
                storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            return sum(storages.values())

        params = list({id(p): p for p in pl_module.parameters()}.values())
        state = {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None),
                 "optimizer": size(v for s in optimizer.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)}
        state["total"] = sum(state.values())
        with open(os.path.join(self.out, f"state_{trainer.global_rank}.json"), "w") as f:
            json.dump(state, f)


def build(case):
    encoders = {"vision": lambda: lmm.ModalityEncoder(tiny_encoder(case.get("vision", "siglip"))),
                "audio": lambda: lmm.ModalityEncoder(tiny_encoder("whisper"), projector="linear")}
    model = lmm.MultimodalModel({m: encoders[m]() for m in case.get("modalities", ["vision", "audio"])},
                                tiny_language_model(case.get("llm", "llama"), num_hidden_layers=case.get("llm_layers", 4),
                                                    **case.get("llm_config", {})))
    model = model.freeze(**FREEZE[case.get("freeze", "llm")])
    return model


# any of these runs the case under MultimodalParallelStrategy, even when it comes to one process
STRATEGY_KEYS = {"llm_pp", "llm_tp", "llm_cp", "llm_dp", "llm_ep", "encoder_tp", "encoder_cp", "encoder_dp", "sharding"}


def main(spec: str, out: str):
    case = json.loads(spec)
    dp = case.get("dp", 1)
    if case.get("devices", 1) == 1 and not STRATEGY_KEYS & set(case):
        strategy, devices, dp_batch = "auto", 1, case.get("batch_size", 4) * dp
    else:
        enc, enc_tp, enc_cp = case.get("encoder_pp", [1, 1]), case.get("encoder_tp", [1, 1]), case.get("encoder_cp", [1, 1])
        modalities = case.get("modalities", ["vision", "audio"])
        enc_dp = case.get("encoder_dp", [None, None])
        llm = lmm.ParallelSpec(pp=case.get("llm_pp", 1), cp=case.get("llm_cp", 1), tp=case.get("llm_tp", 1),
                               cp_mode=case.get("cp_mode", "allgather"), ulysses=case.get("ulysses"),
                               dp=case.get("llm_dp"), ep=case.get("llm_ep", 1))
        specs = {m: lmm.ParallelSpec(pp=enc[i], tp=enc_tp[i], cp=enc_cp[i], dp=enc_dp[i])
                 for i, m in enumerate(modalities)}
        strategy = lmm.MultimodalParallelStrategy(
            encoders=specs,
            batch_balancing=case.get("balancing"),
            language_model=llm, num_microbatches=case.get("microbatches", 1), cp_block_size=8,
            sharding_strategy=case.get("sharding", "NO_SHARD"), fsdp_reduce=case.get("fsdp_reduce", "microbatch"),
            encoder_placement=case.get("placement", "parallel"),
            activation_checkpointing=case.get("recompute", False), fault_timeout=60,
            process_group_backend=case.get("backend"))
        encoder_ranks = {"replicated": 0, "colocated": enc[0] * enc_tp[0]}.get(  # colocated: one fused chain
            case.get("placement"), sum(enc[i] * enc_tp[i] * enc_cp[i] for i in range(len(modalities))))
        devices = case.get("devices") or (encoder_ranks + llm.size) * dp
        if llm.dp is not None:  # per-module data parallelism: each module's replicas
            devices = case.get("devices") or sum(s.dp * s.size for s in [*specs.values(), llm])
        dp_batch = case.get("batch_size", 4)
    callbacks = [StateBytes(out)] if case.get("state_bytes") else []
    if case.get("save_every"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{step}",
                                                             every_n_train_steps=case["save_every"], save_top_k=-1))
    accelerator = case.get("accelerator", "cpu")
    if case.get("share_gpu") and strategy != "auto":
        strategy.parallel_devices, devices = [torch.device("cuda", 0)] * devices, 1
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=case.get("steps", 3),
                        callbacks=callbacks,
                        logger=False, enable_checkpointing=bool(case.get("save_every")), enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        accumulate_grad_batches=case.get("accumulate", 1), precision=case.get("precision", "32-true"),
                        limit_val_batches=2, limit_test_batches=2, limit_predict_batches=1,
                        gradient_clip_val=case.get("clip"))
    torch.manual_seed(0)
    if case.get("lazy"):
        with trainer.init_module(empty_init=True):
            model = build(case)
    else:
        model = build(case)
    optimizer = torch.optim.SGD if case.get("optimizer") == "sgd" else torch.optim.AdamW
    lora = case.get("lora") and {"modules": case["lora"], "r": 4, "alpha": 8, "init_lora_weights": False}
    module = Module(model, optimizer=lambda p: optimizer(p, lr=case.get("lr", 1e-2)),
                    nan_guard="skip" if "nan_at" in case else None, nan_at=case.get("nan_at"), lora=lora)
    data = Data(num_samples=64, batch_size=dp_batch, val_samples=2 * dp_batch, items_per_sample=case.get("items", (1, 2)),
                num_workers=case.get("workers", 0), layout=case.get("layout") or ("mp" if case.get("pack") else "ee"),
                seq_len=case.get("seq_len") or case.get("pack"), text_tokens=case.get("text_tokens", (8, 24)))
    trainer.fit(module, data, ckpt_path=case.get("resume"))
    result = {"train": module.losses}
    if module.packed:
        result["packed"] = module.packed
    if module.aux_losses:  # a mixture-of-experts LLM
        result["aux_loss"] = module.aux_losses
    if case.get("validate"):
        result["val"] = trainer.validate(module, data)[0]["val/loss"]
    if case.get("test"):
        result["test"] = trainer.test(module, data)[0]["test/loss"]
    if case.get("predict"):
        preds = trainer.predict(module, data)
        result["predicted_ids"] = preds[0]["predicted_ids"].tolist()
        result["has_logits"] = preds[0]["logits"] is not None
    rank = trainer.global_rank
    owned = getattr(trainer.strategy, "engine", None)
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    torch.save({n: full(p.detach()).cpu() for n, p in module.model.named_parameters()
                if p.requires_grad and (owned is None or n in owned.owned)}, os.path.join(out, f"params_{rank}.pt"))
    if owned is not None:  # how many parameters FSDP manages on this rank (0: its stage is not sharded)
        with open(os.path.join(out, f"fsdp_{rank}.json"), "w") as f:
            json.dump(len(owned.fsdp_params), f)
    if accelerator == "cuda":
        with open(os.path.join(out, f"memory_{rank}.json"), "w") as f:
            json.dump({"peak_allocated": torch.cuda.max_memory_allocated()}, f)
    if case.get("plans"):
        result["plans"] = list(getattr(trainer.strategy, "batch_plans", []))
        result["deferred_samples"] = getattr(getattr(trainer.train_dataloader, "batch_sampler", None),
                                             "deferred_samples", 0)
    if case.get("consolidate"):
        path = os.path.join(out, "ckpt")
        trainer.save_checkpoint(path)
        if rank == 0:
            from lightning_mm.checkpoint import consolidate

            result["consolidated"] = sorted(consolidate(path))
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
