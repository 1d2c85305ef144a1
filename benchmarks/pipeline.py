"""Pipeline strategy throughput: modality-parallel vs colocated vs replicated encoders vs Lightning's FSDP.

``--setup``: eager vs lazy builds and folder loading; ``--sharding``: sharded dp and tp vs Lightning's FSDP strategies.
Layouts, models and commands: docs/pipeline.md, "Benchmark: `benchmarks/pipeline.py`" and the sections after it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import harness


# ----------------------------------------------------------------------------------------------- the layouts
def layouts(procs: int, accelerator: str) -> list[dict]:
    """One config per compared layout, all on ``procs`` processes."""
    if procs < 2:
        raise SystemExit("--procs must be >= 2 (a pipeline needs two stages)")
    valm = procs >= 4
    encoders = ["vision", "audio"] if valm else ["vision"]
    per_replica = procs if procs <= 4 else 4
    if procs % per_replica:
        raise SystemExit(f"--procs {procs}: use 2, 3, 4 or a multiple of 4")
    base = "fsdp" if accelerator == "gpu" else "ddp"
    out = [{"name": base, "strategy": base, "encoders": encoders}]
    if per_replica - len(encoders) >= 1:
        out.append({"name": "parallel", "strategy": "multimodal", "encoders": encoders, "placement": "parallel",
                    "encoder_pp": 1, "llm_pp": per_replica - len(encoders)})
    out.append({"name": "colocated", "strategy": "multimodal", "encoders": encoders, "placement": "colocated",
                "encoder_pp": 1, "llm_pp": per_replica - 1})
    out.append({"name": "replicated", "strategy": "multimodal", "encoders": encoders, "placement": "replicated",
                "encoder_pp": 1, "llm_pp": per_replica})
    return out


# ----------------------------------------------------------------------------------------------- one worker
def build_module(cfg: dict, args):
    import torch

    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    encoders = {}
    if "vision" in cfg["encoders"]:
        encoders["vision"] = lmm.ModalityEncoder(
            tiny_encoder("siglip", hidden_size=128, intermediate_size=256, num_hidden_layers=4, image_size=64,
                         patch_size=8), projector="mlp")
    if "audio" in cfg["encoders"]:
        encoders["audio"] = lmm.ModalityEncoder(
            tiny_encoder("whisper", d_model=128, encoder_ffn_dim=256, encoder_layers=4, max_source_positions=32),
            projector="linear")
    llm = tiny_language_model("llama", vocab_size=args.vocab, hidden_size=args.hidden,
                              intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.llm_layers,
                              num_attention_heads=8, num_key_value_heads=4)
    model = lmm.MultimodalModel(encoders, llm).freeze(encoders=True, projectors=False, language_model=False)
    return lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))

def _start_memory_measure(gpu: bool) -> tuple[bool, int]:
    """Reset the peak (VmHWM on CPU, CUDA's peak on GPU) and return (whether the CPU peak could be reset, the
    baseline bytes the growth is measured from)."""
    import torch

    torch.ones(1) + 1  # allocator warm-up before the measure
    reset = harness.rss_reset()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    return reset, torch.cuda.memory_allocated() if gpu else harness.proc_kb("VmRSS") * 1024


def _peaks(state: dict, base: int, reset: bool, gpu: bool) -> dict:
    """Peak growth in MiB at the first step and at the end, from ``base``."""
    return {"peak_first_step_mb": (state["peak_first_step"] - base) / 2**20,
            "peak_end_mb": (_peak_bytes(gpu) - base) / 2**20, "base_mb": base / 2**20,
            "peak_since": "before the build" if reset or gpu else "process start"}


def _peak_bytes(gpu: bool) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if gpu else harness.proc_kb("VmHWM") * 1024


def _meter(args, state: dict, mode: str):
    """A callback filling ``state`` (the three modes' measures in one): setup start and end, the first step's start,
    peak and end; "pipeline": the peak reset at train start; "pipeline" and "sharding": ``t0`` / ``t1`` around steps
    ``--warmup`` to ``--warmup + --steps`` (barriers); "sharding": the state bytes before the first timed step's
    optimiser step."""
    import lightning as L
    import torch
    import torch.distributed as dist

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


def _rate(trainer, cfg: dict, args, state: dict) -> dict:
    """Data-parallel degree, global batch and samples/s of the timed steps."""
    dp = trainer.strategy.layout.dp if cfg["strategy"] == "multimodal" else args.procs
    seconds = state["t1"] - state["t0"]
    return {"dp": dp, "global_batch": args.batch * dp, "seconds": seconds,
            "samples_per_s": args.batch * dp * args.steps / seconds}


def worker(cfg: dict, args, result: str) -> None:
    import lightning as L
    import torch

    import lightning_mm as lmm
    from lightning_mm.trainer.callbacks import PipelineTimeline

    torch.set_num_threads(args.threads)
    module = build_module(cfg, args)
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=args.batch * 64, batch_size=args.batch,
                                                  text_tokens=(args.text_tokens - 8, args.text_tokens))
    state, callbacks = {}, []
    if cfg["strategy"] == "multimodal":
        strategy = lmm.MultimodalParallelStrategy(
            encoders={e: lmm.ParallelSpec(pp=cfg["encoder_pp"]) for e in cfg["encoders"]},
            language_model=lmm.ParallelSpec(pp=cfg["llm_pp"]), num_microbatches=args.microbatches,
            encoder_placement=cfg["placement"], partition="frozen-aware")
        tag = f"pipeline_p{args.procs}_{args.accelerator}_{cfg['name']}"
        timeline = PipelineTimeline(steps=(args.warmup,), dirpath=str(Path(args.out) / tag))
        callbacks.append(timeline)
    elif cfg["strategy"] == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        strategy, timeline = FSDPStrategy(use_orig_params=True), None
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strategy, timeline = DDPStrategy(process_group_backend="gloo", start_method="popen"), None
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.procs, strategy=strategy,
                        max_steps=args.warmup + args.steps, callbacks=[*callbacks, _meter(args, state, "pipeline")],
                        **harness.QUIET)
    trainer.fit(module, data)
    ranks = harness.rank_rows(trainer, {"peak_mb": _peak_bytes(args.accelerator == "gpu") / 2**20,
                             "rss_start_mb": state["rss_start_kb"] / 1024,
                             "peak_since": "train start" if state["reset"] else "process start"})
    if ranks is None:
        return
    doc = {**cfg, **_rate(trainer, cfg, args, state), "ranks": ranks}
    if timeline is not None and timeline.results:
        measured, predicted = timeline.results[args.warmup]
        doc["bubble"] = measured.bubble_fraction
        doc["iteration_s"], doc["predicted_iteration_s"] = measured.iteration_time, predicted.iteration_time
        doc["partition"] = _partition(trainer.strategy.engine)
    harness.save(result, doc)


def _partition(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for plan in engine.plans.values():
        for e, sl in plan.encoders.items():
            out.setdefault(e, []).append(sl.end - sl.start)
        if plan.language_model is not None:
            out.setdefault("language_model", []).append(plan.language_model.end - plan.language_model.start)
    return out


# ----------------------------------------------------------------------------------------------- --setup
SETUP_RUNS = [
    {"name": "eager", "build": "eager", "source": "random"},
    {"name": "lazy", "build": "lazy", "source": "random"},
    {"name": "folder-eager", "build": "eager", "source": "folder"},
    {"name": "folder-lazy", "build": "lazy", "source": "folder"},
    {"name": "from_pretrained", "build": "eager", "source": "from_pretrained", "single": True},
]


def _setup_configs(args):
    import transformers

    vision = transformers.SiglipVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                             num_attention_heads=4, image_size=64, patch_size=8)
    llm = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.llm_layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False)
    return vision, llm


def save_folders(args, where: str) -> dict[str, str]:
    """The SigLIP and Llama of ``--setup`` (random values), written with ``save_pretrained``."""
    import torch
    import transformers

    torch.manual_seed(1)
    vision, llm = _setup_configs(args)
    folders = {"encoder": os.path.join(where, "siglip"), "llm": os.path.join(where, "llama")}
    transformers.SiglipVisionModel(vision).save_pretrained(folders["encoder"])
    transformers.LlamaForCausalLM(llm).save_pretrained(folders["llm"])
    return folders


def setup_worker(cfg: dict, args, result: str) -> None:
    """One ``--setup`` run: build as ``cfg`` says, fit ``--steps`` steps, write every rank's numbers."""
    import lightning as L
    import torch
    import transformers

    import lightning_mm as lmm

    torch.set_num_threads(args.threads)
    gpu, state = args.accelerator == "gpu", {}
    if cfg.get("single"):
        strategy, devices = "auto", 1
    else:
        strategy = lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec(pp=1)}, language_model=lmm.ParallelSpec(pp=args.procs - 1),
            num_microbatches=1, partition="uniform")
        devices = args.procs
    trainer = L.Trainer(accelerator=args.accelerator, devices=devices, strategy=strategy, max_steps=args.steps,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[_meter(args, state, "setup")],
                        **harness.QUIET)
    torch.manual_seed(0)
    reset, base = _start_memory_measure(gpu)
    start = time.perf_counter()

    def build():
        if cfg["source"] == "random":
            vision, llm = _setup_configs(args)
            encoder, lm = transformers.SiglipVisionModel(vision), transformers.LlamaForCausalLM(llm)
        elif cfg["source"] == "folder":
            encoder, lm = cfg["folders"]["encoder"], cfg["folders"]["llm"]
        else:
            encoder = transformers.SiglipVisionModel.from_pretrained(cfg["folders"]["encoder"])
            lm = transformers.LlamaForCausalLM.from_pretrained(cfg["folders"]["llm"])
        model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(encoder, projector="mlp")}, language_model=lm)
        return model.freeze(encoders=True, projectors=False, language_model=True)

    if cfg["build"] == "lazy":
        with trainer.init_module(empty_init=True):
            model = build()
    else:
        model = build()
    built = time.perf_counter()
    peak_build = _peak_bytes(gpu)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=args.batch * (args.steps + 1), batch_size=args.batch,
                                                  text_tokens=(args.text_tokens - 8, args.text_tokens))
    trainer.fit(module, data)
    ranks = harness.rank_rows(trainer, {
        "build_s": built - start, "setup_s": state["setup_end"] - state["setup_start"],
        "to_first_step_s": state["first_step"] - start, "to_first_step_end_s": state["first_step_end"] - start,
        "peak_build_mb": (peak_build - base) / 2**20, **_peaks(state, base, reset, gpu)})
    if ranks is not None:
        harness.save(result, {**cfg, "model_mb": model_bytes / 2**20, "ranks": ranks})


# ----------------------------------------------------------------------------------------------- --sharding
SHARDING_RUNS = [
    {"name": "no_shard", "strategy": "multimodal", "tp": 1, "sharding": "NO_SHARD"},
    {"name": "shard_grad_op", "strategy": "multimodal", "tp": 1, "sharding": "SHARD_GRAD_OP"},
    {"name": "full_shard", "strategy": "multimodal", "tp": 1, "sharding": "FULL_SHARD"},
    {"name": "tp2_no_shard", "strategy": "multimodal", "tp": 2, "sharding": "NO_SHARD"},
    {"name": "tp2_full_shard", "strategy": "multimodal", "tp": 2, "sharding": "FULL_SHARD"},
    {"name": "lightning_fsdp", "strategy": "fsdp", "tp": 1, "sharding": "FULL_SHARD"},
    {"name": "lightning_fsdp2", "strategy": "model_parallel", "tp": 1, "sharding": "FULL_SHARD"},
]


def _sharding_model(args):
    """SigLIP + MLP projector + Llama, everything trainable (``--sharding``)."""
    import transformers

    import lightning_mm as lmm

    vision, llm = _setup_configs(args)
    llm.intermediate_size = -(-llm.intermediate_size // 128) * 128  # divisible by tp (1365 -> 1408 at hidden 512)
    encoder = lmm.ModalityEncoder(transformers.SiglipVisionModel(vision), projector="mlp")
    model = lmm.MultimodalModel({"vision": encoder}, language_model=transformers.LlamaForCausalLM(llm))
    return model.freeze(encoders=False, projectors=False, language_model=False)


def _state_bytes(module, optimizer) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimiser state this rank holds: local tensors (a DTensor's local
    shard), each storage counted once (FSDP2's sharded gradients are views of one buffer per unit)."""
    import torch
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            n += storage.nbytes()
        return n

    params = list({id(p): p for p in module.parameters()}.values())
    out = {"params": total(params), "grads": total(p.grad for p in params),
           "optimizer": total(v for st in optimizer.state.values() for v in st.values())}
    out["total"] = sum(out.values())
    return out


def sharding_worker(cfg: dict, args, result: str) -> None:
    """One ``--sharding`` row; an exception on rank 0 is written as the row's error."""
    import traceback

    try:
        _sharding_worker(cfg, args, result)
    except BaseException:
        if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
            harness.save(result, {**cfg, "error": traceback.format_exc()[-3000:]})
        raise


def _sharding_worker(cfg: dict, args, result: str) -> None:
    import lightning as L
    import torch

    import lightning_mm as lmm

    torch.set_num_threads(args.threads)
    gpu, procs, state = args.accelerator == "gpu", args.procs, {}
    module_class = lmm.MultimodalLightningModule
    if cfg["strategy"] == "multimodal":
        strategy = lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec()}, language_model=lmm.ParallelSpec(tp=cfg["tp"]),
            encoder_placement="replicated", sharding_strategy=cfg["sharding"], num_microbatches=1)
    elif cfg["strategy"] == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy = FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={LlamaDecoderLayer},
                                use_orig_params=True, process_group_backend=None if gpu else "gloo")
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=procs, tensor_parallel_size=1,
                                         process_group_backend=None if gpu else "gloo")

        class FSDP2Module(lmm.MultimodalLightningModule):
            def configure_model(self):
                from torch.distributed.fsdp import fully_shard

                from lightning_mm.model.loading import materialise

                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.language_model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)
                materialise(self.model, self.trainer.strategy.root_device, seed=0)  # this rank's shards only

        module_class = FSDP2Module
    trainer = L.Trainer(accelerator=args.accelerator, devices=procs, strategy=strategy,
                        max_steps=args.warmup + args.steps, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[_meter(args, state, "sharding")], **harness.QUIET)
    torch.manual_seed(0)
    reset, base = _start_memory_measure(gpu)
    if cfg["strategy"] == "fsdp":
        model = _sharding_model(args)
    else:
        with trainer.init_module(empty_init=True):
            model = _sharding_model(args)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    module = module_class(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=args.batch * procs * (args.warmup + args.steps + 2),
                                                  batch_size=args.batch,
                                                  text_tokens=(args.text_tokens - 8, args.text_tokens))
    trainer.fit(module, data)
    ranks = harness.rank_rows(trainer, {**_peaks(state, base, reset, gpu),
                             "state_mb": {k: v / 2**20 for k, v in state["state_bytes"].items()},
                             "loss": float(trainer.callback_metrics.get("train/loss", float("nan")))})
    if ranks is not None:
        harness.save(result, {**cfg, **_rate(trainer, cfg, args, state), "model_mb": model_bytes / 2**20,
                              "ranks": ranks})

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
        run = sharding_worker if args.sharding else setup_worker if args.setup else worker
        return run(args.worker, args, args.result)
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
    configs = layouts(args.procs, args.accelerator)
    configs = configs[:1] + chosen(configs[1:])
    runs: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    for r in range(args.repeats):  # rotate the order so slow phases of a shared machine hit every layout
        for cfg in configs[r % len(configs):] + configs[:r % len(configs)]:
            runs[cfg["name"]].append(run(cfg))
    best = {name: max(done, key=lambda d: d["samples_per_s"]) for name, done in runs.items()}  # the least disturbed
    _save(args, start, "pipeline", [{**best[c["name"]], "all_samples_per_s": [d["samples_per_s"] for d in
                                                                              runs[c["name"]]]} for c in configs])

if __name__ == "__main__":
    main()
