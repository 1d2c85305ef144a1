"""Pipeline strategy throughput: modality-parallel vs colocated vs replicated encoders vs Lightning's FSDP.

``--setup``: eager vs lazy builds and folder loading; ``--sharding``: sharded dp and tp vs Lightning's FSDP strategies.
Layouts, models and commands: docs/pipeline.md, "Benchmark: `benchmarks/pipeline.py`" and the sections after it.
"""

import contextlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import transformers
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.tensor import DTensor
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.model.loading import materialise
from lightning_mm.trainer.callbacks import PipelineTimeline

SETUP_RUNS = [
    {"name": "eager", "build": "eager", "source": "random"},
    {"name": "lazy", "build": "lazy", "source": "random"},
    {"name": "folder-eager", "build": "eager", "source": "folder"},
    {"name": "folder-lazy", "build": "lazy", "source": "folder"},
    {"name": "from_pretrained", "build": "eager", "source": "from_pretrained", "single": True},
]
SHARDING_RUNS = [
    {"name": "no_shard", "strategy": "multimodal", "tp": 1, "sharding": "NO_SHARD"},
    {"name": "shard_grad_op", "strategy": "multimodal", "tp": 1, "sharding": "SHARD_GRAD_OP"},
    {"name": "full_shard", "strategy": "multimodal", "tp": 1, "sharding": "FULL_SHARD"},
    {"name": "tp2_no_shard", "strategy": "multimodal", "tp": 2, "sharding": "NO_SHARD"},
    {"name": "tp2_full_shard", "strategy": "multimodal", "tp": 2, "sharding": "FULL_SHARD"},
    {"name": "lightning_fsdp", "strategy": "fsdp", "tp": 1, "sharding": "FULL_SHARD"},
    {"name": "lightning_fsdp2", "strategy": "model_parallel", "tp": 1, "sharding": "FULL_SHARD"},
]


def layouts(procs: int, accelerator: str) -> list[dict]:
    """The data-parallel baseline, then one config per encoder placement, all on ``procs`` processes."""
    per_replica = min(procs, 4)
    if procs < 2 or procs % per_replica:
        raise SystemExit(f"--procs {procs}: use 2, 3, 4 or a multiple of 4 (a pipeline needs two stages)")
    encoders = ["vision", "audio"] if procs >= 4 else ["vision"]
    base = "fsdp" if accelerator == "gpu" else "ddp"
    llm_pp = {"parallel": per_replica - len(encoders), "colocated": per_replica - 1, "replicated": per_replica}
    return [{"name": base, "strategy": base, "encoders": encoders}] + [
        {"name": p, "strategy": "multimodal", "encoders": encoders, "placement": p, "encoder_pp": 1, "llm_pp": pp}
        for p, pp in llm_pp.items() if pp >= 1]


def configs(args):
    """The SigLIP and Llama configs of ``--setup`` and ``--sharding``."""
    vision = transformers.SiglipVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                             num_attention_heads=4, image_size=64, patch_size=8)
    llm = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.llm_layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False)
    return vision, llm


def build_model(cfg: dict, args, mode: str):
    """pipeline: tiny SigLIP (+ Whisper) + Llama, encoders frozen; setup: SigLIP + Llama from configs, folders or
    ``from_pretrained`` (``cfg["source"]``), only the projector trained; sharding: everything trained."""
    if mode == "pipeline":
        towers = {"vision": lambda: lmm.ModalityEncoder(tiny_encoder(
                      "siglip", hidden_size=128, intermediate_size=256, num_hidden_layers=4, image_size=64,
                      patch_size=8), projector="mlp"),
                  "audio": lambda: lmm.ModalityEncoder(tiny_encoder(
                      "whisper", d_model=128, encoder_ffn_dim=256, encoder_layers=4, max_source_positions=32),
                      projector="linear")}
        llm = tiny_language_model("llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                  intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.llm_layers,
                                  num_attention_heads=8, num_key_value_heads=4)
        model = lmm.MultimodalModel({e: towers[e]() for e in cfg["encoders"]}, llm)
        return model.freeze(encoders=True, projectors=False, language_model=False)
    vision, llm = configs(args)
    if mode == "sharding":
        llm.intermediate_size = -(-llm.intermediate_size // 128) * 128  # divisible by tp (1365 -> 1408 at hidden 512)
    source, folders = cfg.get("source", "random"), cfg.get("folders")
    if source == "random":
        encoder, lm = transformers.SiglipVisionModel(vision), transformers.LlamaForCausalLM(llm)
    elif source == "folder":
        encoder, lm = folders["encoder"], folders["llm"]
    else:
        encoder = transformers.SiglipVisionModel.from_pretrained(folders["encoder"])
        lm = transformers.LlamaForCausalLM.from_pretrained(folders["llm"])
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(encoder, projector="mlp")}, language_model=lm)
    return model.freeze(encoders=mode == "setup", projectors=False, language_model=mode == "setup")


def save_folders(args, where: str) -> dict[str, str]:
    """The SigLIP and Llama of ``--setup`` (random values), written with ``save_pretrained``."""
    torch.manual_seed(1)
    vision, llm = configs(args)
    folders = {"encoder": os.path.join(where, "siglip"), "llm": os.path.join(where, "llama")}
    transformers.SiglipVisionModel(vision).save_pretrained(folders["encoder"])
    transformers.LlamaForCausalLM(llm).save_pretrained(folders["llm"])
    return folders


class FSDP2Module(lmm.MultimodalLightningModule):
    """Lightning's ``ModelParallelStrategy`` row: FSDP2's ``fully_shard`` on every Llama layer and the root."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.language_model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        materialise(self.model, self.trainer.strategy.root_device, seed=0)  # this rank's shards only


def strategy(cfg: dict, args, mode: str):
    backend = None if args.accelerator == "gpu" else "gloo"
    if cfg.get("single"):
        return "auto"
    if mode == "setup":
        return lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec(pp=1)}, language_model=lmm.ParallelSpec(pp=args.procs - 1),
            num_microbatches=1, partition="uniform")
    if cfg["strategy"] == "multimodal" and mode == "sharding":
        return lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec()}, language_model=lmm.ParallelSpec(tp=cfg["tp"]),
            encoder_placement="replicated", sharding_strategy=cfg["sharding"], num_microbatches=1)
    if cfg["strategy"] == "multimodal":
        return lmm.MultimodalParallelStrategy(
            encoders={e: lmm.ParallelSpec(pp=cfg["encoder_pp"]) for e in cfg["encoders"]},
            language_model=lmm.ParallelSpec(pp=cfg["llm_pp"]), num_microbatches=args.microbatches,
            encoder_placement=cfg["placement"], partition="frozen-aware")
    if cfg["strategy"] == "fsdp" and mode == "sharding":
        return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={LlamaDecoderLayer},
                            use_orig_params=True, process_group_backend=backend)
    if cfg["strategy"] == "fsdp":
        return FSDPStrategy(use_orig_params=True)
    if cfg["strategy"] == "ddp":
        return DDPStrategy(process_group_backend="gloo", start_method="popen")
    return ModelParallelStrategy(data_parallel_size=args.procs, tensor_parallel_size=1,
                                 process_group_backend=backend)


def _peak_bytes(gpu: bool) -> int:
    return torch.cuda.max_memory_allocated() if gpu else harness.proc_kb("VmHWM") * 1024


def _state_bytes(module, optimizer) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimiser state this rank holds: local tensors (a DTensor's local
    shard), each storage counted once (FSDP2's sharded gradients are views of one buffer per unit)."""
    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes():
                    seen.add(storage.data_ptr())
                    n += storage.nbytes()
        return n

    params = list({id(p): p for p in module.parameters()}.values())
    out = {"params": total(params), "grads": total(p.grad for p in params),
           "optimizer": total(v for st in optimizer.state.values() for v in st.values())}
    out["total"] = sum(out.values())
    return out


def _meter(args, state: dict, mode: str):
    """A callback filling ``state``: setup start and end, the first step's start, peak and end; pipeline: the peak
    reset at train start; pipeline and sharding: ``t0`` / ``t1`` around the timed steps (barriers); sharding: the
    state bytes before the first timed step's optimiser step."""
    gpu, timed = args.accelerator == "gpu", mode != "setup"

    class Meter(L.Callback):
        def setup(self, trainer, pl_module, stage):
            state["setup_start"] = time.perf_counter()

        def on_fit_start(self, trainer, pl_module):
            state["setup_end"] = time.perf_counter()

        def on_train_start(self, trainer, pl_module):
            if mode == "pipeline":
                state["reset"], state["rss_start_kb"] = harness.rss_reset(), harness.proc_kb("VmRSS")
                if gpu:
                    torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if "first_step" not in state:
                state["first_step"], state["peak_first_step"] = time.perf_counter(), _peak_bytes(gpu)
            if timed and trainer.global_step == args.warmup:
                dist.barrier()
                state["t0"] = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if mode == "sharding" and trainer.global_step == args.warmup:
                state["state_bytes"] = _state_bytes(pl_module, optimizer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state.setdefault("first_step_end", time.perf_counter())
            if timed and trainer.global_step == args.warmup + args.steps:
                dist.barrier()
                state["t1"] = time.perf_counter()

    return Meter()


def _partition(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for plan in engine.plans.values():
        slices = {**plan.encoders, "language_model": plan.language_model}
        for module, sl in slices.items():
            if sl is not None:
                out.setdefault(module, []).append(sl.end - sl.start)
    return out


def worker(cfg: dict, args, result: str) -> None:
    """One run of a layout or of a ``--setup`` / ``--sharding`` row; an exception on rank 0 is its error."""
    try:
        _worker(cfg, args, result, "sharding" if args.sharding else "setup" if args.setup else "pipeline")
    except BaseException:
        if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
            harness.save(result, {**cfg, "error": traceback.format_exc()[-3000:]})
        raise


def _worker(cfg: dict, args, result: str, mode: str) -> None:
    torch.set_num_threads(args.threads)
    gpu, state, timeline = args.accelerator == "gpu", {}, None
    callbacks = [_meter(args, state, mode)]
    if mode == "pipeline" and cfg["strategy"] == "multimodal":
        tag = f"pipeline_p{args.procs}_{args.accelerator}_{cfg['name']}"
        timeline = PipelineTimeline(steps=(args.warmup,), dirpath=str(Path(args.out) / tag))
        callbacks.insert(0, timeline)  # its end-of-step gather inside the meter's step time
    steps = args.steps if mode == "setup" else args.warmup + args.steps
    trainer = L.Trainer(accelerator=args.accelerator, devices=1 if cfg.get("single") else args.procs,
                        strategy=strategy(cfg, args, mode), max_steps=steps, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=callbacks, **harness.QUIET)
    torch.manual_seed(0)
    torch.ones(1) + 1  # allocator warm-up before the measure
    reset = harness.rss_reset()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if gpu else harness.proc_kb("VmRSS") * 1024
    start = time.perf_counter()
    lazy = cfg.get("build") == "lazy" or (mode == "sharding" and cfg["strategy"] != "fsdp")
    with trainer.init_module(empty_init=True) if lazy else contextlib.nullcontext():
        model = build_model(cfg, args, mode)
    built, peak_build = time.perf_counter(), _peak_bytes(gpu)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    module_class = FSDP2Module if cfg.get("strategy") == "model_parallel" else lmm.MultimodalLightningModule
    optimizer = torch.optim.AdamW if mode == "sharding" else torch.optim.SGD
    samples = {"pipeline": 64, "setup": steps + 1, "sharding": args.procs * (steps + 2)}[mode] * args.batch
    trainer.fit(module_class(model, optimizer=lambda p: optimizer(p, lr=1e-4 if mode == "sharding" else 1e-3)),
                lmm.data.SyntheticMultimodalDataModule(num_samples=samples, batch_size=args.batch,
                                                       text_tokens=(args.text_tokens - 8, args.text_tokens)))
    peaks = {"peak_first_step_mb": (state["peak_first_step"] - base) / 2**20,
             "peak_end_mb": (_peak_bytes(gpu) - base) / 2**20, "base_mb": base / 2**20,
             "peak_since": "before the build" if reset or gpu else "process start"}
    if mode == "pipeline":
        mine = {"peak_mb": _peak_bytes(gpu) / 2**20, "rss_start_mb": state["rss_start_kb"] / 1024,
                "peak_since": "train start" if state["reset"] else "process start"}
    elif mode == "setup":
        mine = {"build_s": built - start, "setup_s": state["setup_end"] - state["setup_start"],
                "to_first_step_s": state["first_step"] - start,
                "to_first_step_end_s": state["first_step_end"] - start,
                "peak_build_mb": (peak_build - base) / 2**20, **peaks}
    else:
        mine = {**peaks, "state_mb": {k: v / 2**20 for k, v in state["state_bytes"].items()},
                "loss": float(trainer.callback_metrics.get("train/loss", float("nan")))}
    ranks = harness.rank_rows(trainer, mine)
    if ranks is None:
        return
    doc = dict(cfg)
    if mode != "setup":
        dp = trainer.strategy.layout.dp if cfg["strategy"] == "multimodal" else args.procs
        seconds = state["t1"] - state["t0"]
        doc.update(dp=dp, global_batch=args.batch * dp, seconds=seconds,
                   samples_per_s=args.batch * dp * args.steps / seconds)
    if mode != "pipeline":
        doc["model_mb"] = model_mb
    doc["ranks"] = ranks
    if timeline is not None and timeline.results:
        measured, predicted = timeline.results[args.warmup]
        doc.update(bubble=measured.bubble_fraction, iteration_s=measured.iteration_time,
                   predicted_iteration_s=predicted.iteration_time, partition=_partition(trainer.strategy.engine))
    harness.save(result, doc)


def _save(args, start: dict, name: str, rows: list[dict]) -> None:
    baseline = {"pipeline": rows[0]["name"], "pipeline_sharding": "no_shard"}.get(name)
    doc = {"procs": args.procs, "accelerator": args.accelerator, "args": vars(args) | {"worker": None, "machine": None},
           **({"baseline": baseline} if baseline else {}), "rows": rows,
           "model_mb": next((r["model_mb"] for r in rows if "model_mb" in r), None)}
    harness.write(Path(args.out) / f"{name}_p{args.procs}_{args.accelerator}.json", doc, start,
                  sources={"model_mb": "computed", "args": "setting", "procs": "setting", "accelerator": "setting",
                           "baseline": "setting"})


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = harness.cli(
        __doc__, argv, procs=2, accelerator=dict(default="cpu", choices=["cpu", "gpu"]),
        steps=(5, "timed steps after warm-up"), warmup=2, batch=(8, "samples per replica (per rank for DDP/FSDP)"),
        microbatches=4, hidden=192, llm_layers=6, vocab=(512, "the Llama's vocabulary"),
        setup=(False, "measure eager vs lazy (meta) builds and folder loading instead of throughput"),
        sharding=(False, "measure sharded data parallelism and tensor parallelism vs Lightning's FSDP strategies"),
        text_tokens=128, threads=(1, "torch threads per process (cores / procs)"),
        only=dict(help="comma-separated layout names to run"), out=str(harness.RESULTS), timeout=900.0,
        repeats=(1, "runs per layout (best kept): noisy shared machines"), worker=True)
    if args.worker:
        return worker(args.worker, args, args.result)
    start, only = harness.record(), set(args.only.split(",")) if args.only else None
    chosen = lambda runs: [c for c in runs if only is None or c["name"] in only]  # noqa: E731
    run = lambda cfg, fail=True: harness.launch(__file__, cfg, args.timeout, cfg["name"], argv, fail)  # noqa: E731
    if args.setup:
        with tempfile.TemporaryDirectory() as tmp:
            folders = save_folders(args, tmp)
            rows = [run({**cfg, "folders": folders}) for cfg in chosen(SETUP_RUNS)]
        return _save(args, start, "pipeline_setup", [{k: v for k, v in r.items() if k != "folders"} for r in rows])
    if args.sharding:
        return _save(args, start, "pipeline_sharding",
                     [run({**cfg, "dp": args.procs // cfg["tp"]}, fail=False) for cfg in chosen(SHARDING_RUNS)])
    runs = layouts(args.procs, args.accelerator)
    runs = runs[:1] + chosen(runs[1:])
    done: dict[str, list[dict]] = {c["name"]: [] for c in runs}
    for r in range(args.repeats):  # rotate the order so slow phases of a shared machine hit every layout
        for cfg in runs[r % len(runs):] + runs[:r % len(runs)]:
            done[cfg["name"]].append(run(cfg))
    best = {name: max(rows, key=lambda d: d["samples_per_s"]) for name, rows in done.items()}  # the least disturbed
    _save(args, start, "pipeline", [{**best[c["name"]], "all_samples_per_s": [d["samples_per_s"] for d in
                                                                              done[c["name"]]]} for c in runs])


if __name__ == "__main__":
    main()
