"""Pipeline strategy throughput: modality-parallel vs colocated vs replicated encoders vs Lightning's FSDP.

One run trains the same model on the same number of processes with each layout, through a real
``lightning.Trainer``, and reports samples/s (after warm-up steps), peak memory per rank during training
(CPU: the resident-set high-water mark, reset at train start; GPU: torch's peak allocated), and the bubble
fraction per rank from the engine's recorded timings (``PipelineTimeline``). The baseline is Lightning's
``FSDPStrategy``; Lightning refuses FSDP on CPU ("requires a GPU accelerator"), so on CPU the baseline is
Lightning's ``DDPStrategy`` and the table says so. With ``--repeats R`` every layout runs R times in rotating
order and the best run is reported (all are kept in the JSON).

Layouts for P processes (VLM = SigLIP + Llama below 4 processes, VALM = SigLIP + Whisper + Llama from 4):
  parallel    every encoder pp=1 on its own ranks, LLM pp = R - #encoders   (R ranks per replica)
  colocated   encoders fused in one stage,           LLM pp = R - 1          (= parallel with one encoder)
  replicated  encoders inside LLM stage 0,           LLM pp = R
R = P for P <= 4, else 4 (dp = P / 4). Encoders frozen; projectors and LLM trainable; partition="frozen-aware".
On CPU use no more processes than cores; the model is sized so that compute dominates P2P.

    python benchmarks/pipeline.py [--procs 2] [--steps 5] [--warmup 2] [--repeats 1] [--accelerator cpu|gpu]
                                  [--out benchmarks/results]        (gpu: one GPU per process)

``--setup`` measures building and loading instead (``pipeline_setup_p<P>_<accelerator>.json``): the same model
(SigLIP + projector + a Llama of ``--hidden``/``--llm-layers``/``--vocab``; encoder and LLM frozen, the projector
trained with SGD, ``partition="uniform"``) on P processes (vision pp 1, LLM pp P-1, parallel placement), built
  eager          randomly initialised on every rank (the whole model), then pruned to the stage in setup
  lazy           under ``trainer.init_module(empty_init=True)``: meta, each rank initialises its stage in setup
  folder-eager   from ``save_pretrained`` folders, read whole on every rank (``ModalityEncoder("dir")``, ...)
  folder-lazy    from the same folders under ``init_module(empty_init=True)``: each rank reads its stage
  from_pretrained  HF ``from_pretrained`` of the same folders in one process, plain single-device Lightning
and reports per rank the peak resident set (CPU; GPU: torch's peak allocated) above the one before the model is
built, at the first training step (build + setup) and at the end (``--steps`` steps), the build time (constructor),
the setup time (``strategy.setup``: callback ``setup`` to ``on_fit_start``: prune, materialise, optimiser) and
rank 0's wall time from the build to the start and to the end of the first training step (with P processes this
includes launching the other ranks: their interpreter start, imports and builds). On CPU, transformers'
``from_pretrained`` leaves the weights memory-mapped from the safetensors files: they are read (and become resident)
when first used, in the first step, so compare its "to its end" and end memory, not its build time alone.

    python benchmarks/pipeline.py --setup --procs 4 --hidden 512 --llm-layers 12 --vocab 32000 --steps 1

``--sharding`` compares sharded data parallelism and tensor parallelism with Lightning's own sharding strategies
(``pipeline_sharding_p<P>_<accelerator>.json``), in one run on P processes: SigLIP (hidden 128, 4 layers) + MLP
projector + a Llama of ``--hidden``/``--llm-layers``/``--vocab`` (untied), everything trainable, AdamW, built on
meta under ``trainer.init_module(empty_init=True)`` and materialised sharded, ``--batch`` samples per replica
(the Llama's intermediate size rounded up to a multiple of 128, so that tp 2 divides it):
  no_shard, shard_grad_op, full_shard   MultimodalParallelStrategy(sharding_strategy=...), replicated encoders,
                                        LLM pp 1 tp 1: dp = P
  tp2_no_shard, tp2_full_shard          the same with LLM tp 2 (the encoders inside the tp group): dp = P / 2
  lightning_fsdp                        Lightning's FSDPStrategy(FULL_SHARD), one unit per Llama decoder layer, the
                                        model built eagerly (FSDP1 cannot initialise HF modules from meta)
  lightning_fsdp2                       Lightning's ModelParallelStrategy(data_parallel_size=P, tensor_parallel_size=1);
                                        configure_model applies fully_shard per Llama decoder layer and on the root
                                        (the MultimodalModel), then materialises the shards with
                                        lightning_mm.model.loading.materialise (the same initial values)
The Lightning rows train the same ``MultimodalLightningModule`` (its loss is the HF causal-LM loss of the whole
model). Per rank: the peak memory growth (CPU: VmHWM above the resident set before the model is built, as in
``--setup``; GPU: peak allocated), at the first training step and at the end, and the bytes of the parameters,
gradients and optimiser state this rank holds (local tensors, each storage counted once) right before the optimiser
step of step ``--warmup``; samples/s over ``--steps`` steps after ``--warmup``; the last step's loss per rank (the
global loss under MultimodalParallelStrategy, each rank's own under Lightning's). A row that fails keeps its error
text instead of numbers; each row runs at most ``--timeout`` seconds.

    python benchmarks/pipeline.py --sharding --procs 4 --hidden 512 --llm-layers 8 --vocab 32000 --batch 1 \
                                  --warmup 2 --steps 3 --text-tokens 64 --timeout 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


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
    llm = tiny_language_model("llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                              num_hidden_layers=args.llm_layers, num_attention_heads=8, num_key_value_heads=4)
    model = lmm.MultimodalModel(encoders, llm).freeze(encoders=True, projectors=False, language_model=False)
    return lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))


def _start_memory_measure(gpu: bool) -> tuple[bool, int]:
    """Reset the peak (VmHWM on CPU, CUDA's peak on GPU) and return (whether the CPU peak could be reset, the
    baseline bytes the growth is measured from)."""
    torch.ones(1) + 1  # allocator warm-up before the measure
    reset = _rss_reset()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    return reset, torch.cuda.memory_allocated() if gpu else _status_kb("VmRSS") * 1024


def _rss_reset() -> bool:
    """Reset this process's peak-RSS mark (Linux clear_refs 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def worker(cfg: dict, args, result: str) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_mm as lmm
    from lightning_mm.trainer.callbacks import PipelineTimeline

    torch.set_num_threads(args.threads)
    module = build_module(cfg, args)
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=args.batch * 64, batch_size=args.batch,
                                                  text_tokens=(args.text_tokens - 8, args.text_tokens))
    gpu = args.accelerator == "gpu"
    callbacks = []
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
    state = {}

    class Meter(L.Callback):
        def on_train_start(self, trainer, pl_module):
            state["reset"] = _rss_reset()
            state["rss_start_kb"] = _status_kb("VmRSS")
            if gpu:
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == args.warmup:
                dist.barrier()
                state["t0"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == args.warmup + args.steps:
                dist.barrier()
                state["t1"] = time.perf_counter()

    callbacks.append(Meter())
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.procs, strategy=strategy,
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, data)
    mine = {"rank": trainer.global_rank,
            "stage": getattr(getattr(trainer.strategy, "engine", None), "stage", "whole model"),
            "peak_mb": (torch.cuda.max_memory_allocated() / 2**20 if gpu else _status_kb("VmHWM") / 1024),
            "rss_start_mb": state["rss_start_kb"] / 1024,
            "peak_since": "train start" if state["reset"] else "process start"}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if trainer.global_rank != 0:
        return
    dp = trainer.strategy.layout.dp if cfg["strategy"] == "multimodal" else args.procs
    seconds = state["t1"] - state["t0"]
    doc = {**cfg, "dp": dp, "global_batch": args.batch * dp, "seconds": seconds,
           "samples_per_s": args.batch * dp * args.steps / seconds, "ranks": ranks}
    if timeline is not None and timeline.results:
        measured, predicted = timeline.results[args.warmup]
        doc["bubble"] = measured.bubble_fraction
        doc["iteration_s"], doc["predicted_iteration_s"] = measured.iteration_time, predicted.iteration_time
        doc["partition"] = {m: [sl for sl in sizes] for m, sizes in _partition(trainer.strategy.engine).items()}
    Path(result).write_text(json.dumps(doc))


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


def _peak_bytes(gpu: bool) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if gpu else _status_kb("VmHWM") * 1024


def setup_worker(cfg: dict, args, result: str) -> None:
    """One ``--setup`` run: build as ``cfg`` says, fit ``--steps`` steps, write every rank's numbers."""
    import lightning as L
    import torch
    import torch.distributed as dist
    import transformers

    import lightning_mm as lmm

    torch.set_num_threads(args.threads)
    gpu = args.accelerator == "gpu"
    state = {}

    class Meter(L.Callback):
        def setup(self, trainer, pl_module, stage):
            state["setup_start"] = time.perf_counter()

        def on_fit_start(self, trainer, pl_module):
            state["setup_end"] = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if "first_step" not in state:
                state["first_step"] = time.perf_counter()
                state["peak_first_step"] = _peak_bytes(gpu)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state.setdefault("first_step_end", time.perf_counter())

    if cfg.get("single"):
        strategy, devices = "auto", 1
    else:
        strategy = lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec(pp=1)}, language_model=lmm.ParallelSpec(pp=args.procs - 1),
            num_microbatches=1, partition="uniform")
        devices = args.procs
    trainer = L.Trainer(accelerator=args.accelerator, devices=devices, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[Meter()])
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
    engine = getattr(trainer.strategy, "engine", None)
    mine = {"rank": trainer.global_rank, "stage": engine.stage if engine is not None else "whole model",
            "build_s": built - start, "setup_s": state["setup_end"] - state["setup_start"],
            "to_first_step_s": state["first_step"] - start, "to_first_step_end_s": state["first_step_end"] - start,
            "peak_build_mb": (peak_build - base) / 2**20,
            "peak_first_step_mb": (state["peak_first_step"] - base) / 2**20,
            "peak_end_mb": (_peak_bytes(gpu) - base) / 2**20, "base_mb": base / 2**20,
            "peak_since": "before the build" if reset or gpu else "process start"}
    ranks = [mine]
    if trainer.world_size > 1:
        ranks = [None] * trainer.world_size
        dist.all_gather_object(ranks, mine)
    if trainer.global_rank == 0:
        Path(result).write_text(json.dumps({**cfg, "model_mb": model_bytes / 2**20, "ranks": ranks}))


def setup_table(rows: list[dict], accelerator: str) -> str:
    lines = [f"{'build':<16} {'processes':>9} {'peak MB/rank at first step':<34} {'peak MB/rank at end':<30} "
             f"{'build s (max)':>13} {'setup s (max)':>13} {'rank 0 to 1st step s':>20} {'to its end s':>12}"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        ranks = r["ranks"]
        first = " ".join(f"{x['peak_first_step_mb']:.0f}" for x in ranks)
        end = " ".join(f"{x['peak_end_mb']:.0f}" for x in ranks)
        lines.append(f"{r['name']:<16} {len(ranks):>9} {first:<34} {end:<30} "
                     f"{max(x['build_s'] for x in ranks):>13.2f} {max(x['setup_s'] for x in ranks):>13.2f} "
                     f"{ranks[0]['to_first_step_s']:>20.1f} {ranks[0]['to_first_step_end_s']:>12.1f}")
    unit = "peak allocated" if accelerator == "gpu" else "peak resident set"
    lines.append(f"model {rows[0]['model_mb']:.0f} MB of parameters; memory: {unit} above the one before the model is "
                 f"built ({rows[0]['ranks'][0]['peak_since']}), per rank in rank order (rank 0 = vision encoder, then "
                 "the LLM stages); build s: the model's constructor; setup s: strategy.setup (prune, materialise, "
                 "optimiser); rank 0 to 1st step: from its build to the start (and end) of its first training step")
    return "\n".join(lines)


def setup_main(args, argv: list[str]) -> None:
    only = set(args.only.split(",")) if args.only else None
    runs = [c for c in SETUP_RUNS if only is None or c["name"] in only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = save_folders(args, tmp)
        for cfg in runs:
            start = time.time()
            rows.append(run_config({**cfg, "folders": folders}, argv, args.timeout,
                                   stderr_log=str(Path(args.out) / f"pipeline_setup_{cfg['name']}.stderr.txt")))
            print(f"{cfg['name']}: done ({time.time() - start:.0f} s with launch)", flush=True)
    for r in rows:
        r.pop("folders", None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"procs": args.procs, "accelerator": args.accelerator, "args": vars(args) | {"worker": None, "machine": None},
           "rows": rows, "machine": _machine.finish(args.machine)}
    (out / f"pipeline_setup_p{args.procs}_{args.accelerator}.json").write_text(json.dumps(doc, indent=1))
    print(setup_table(rows, args.accelerator))
    tables.main(["--quiet"])


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
            Path(result).write_text(json.dumps({**cfg, "error": traceback.format_exc()[-3000:]}))
        raise


def _sharding_worker(cfg: dict, args, result: str) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_mm as lmm

    torch.set_num_threads(args.threads)
    gpu = args.accelerator == "gpu"
    procs = args.procs
    state: dict = {}

    class Meter(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if "peak_first_step" not in state:
                state["peak_first_step"] = _peak_bytes(gpu)
            if trainer.global_step == args.warmup:
                dist.barrier()
                state["t0"] = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == args.warmup:
                state["state_bytes"] = _state_bytes(pl_module, optimizer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == args.warmup + args.steps:
                dist.barrier()
                state["t1"] = time.perf_counter()

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
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Meter()])
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
    engine = getattr(trainer.strategy, "engine", None)
    mine = {"rank": trainer.global_rank, "stage": engine.stage if engine is not None else "whole model",
            "peak_first_step_mb": (state["peak_first_step"] - base) / 2**20,
            "peak_end_mb": (_peak_bytes(gpu) - base) / 2**20, "base_mb": base / 2**20,
            "peak_since": "before the build" if reset or gpu else "process start",
            "state_mb": {k: v / 2**20 for k, v in state["state_bytes"].items()},
            "loss": float(trainer.callback_metrics.get("train/loss", float("nan")))}
    ranks = [None] * trainer.world_size
    dist.all_gather_object(ranks, mine)
    if trainer.global_rank != 0:
        return
    dp = trainer.strategy.layout.dp if cfg["strategy"] == "multimodal" else procs
    seconds = state["t1"] - state["t0"]
    Path(result).write_text(json.dumps({
        **cfg, "dp": dp, "global_batch": args.batch * dp, "model_mb": model_bytes / 2**20, "seconds": seconds,
        "samples_per_s": args.batch * dp * args.steps / seconds, "ranks": ranks}))


def _run_isolated(cfg: dict, argv: list[str], timeout: float) -> dict:
    """One row in fresh processes (own session: on a timeout every process of the row is ended); a row that
    writes no result gets the tail of its stderr as its error."""
    import signal

    with tempfile.TemporaryDirectory() as tmp:
        result, log = os.path.join(tmp, "result.json"), os.path.join(tmp, "stderr.txt")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", json.dumps(cfg), "--result", result]
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = f"killed after {timeout:.0f} s"
            try:  # the row's other ranks, left waiting in a collective when rank 0 failed or timed out
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        stderr = Path(log).read_text(errors="replace")
        if not os.path.exists(result):
            return {**cfg, "error": f"no result (exit {code}):\n{stderr[-3000:]}"}
        doc = json.loads(Path(result).read_text())
        if code != 0 and "error" not in doc:
            doc["exit"] = f"exit code {code} after writing results: {stderr.strip()[-300:]}"
        return doc


def _error_line(error: str) -> str:
    """The first exception's message (a teardown error raised while handling it comes after)."""
    error = error.split("During handling of the above exception")[0]
    lines = [x.strip() for x in error.strip().splitlines() if x.strip()]
    return lines[-1] if lines else error


def sharding_table(rows: list[dict], accelerator: str) -> str:
    base = next((r for r in rows if r["name"] == "no_shard" and "error" not in r), None)
    lines = [f"{'row':<15} {'layout':<33} {'samples/s':>9} {'vs no_shard':>11} {'loss':>7} "
             f"{'peak growth MiB/rank, 1st step':<31} {'at the end':<20} {'state MiB/rank (p+g+opt)':<25}"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        layout = _sharding_layout(r)
        if "error" in r:
            lines.append(f"{r['name']:<15} {layout:<33} error: {_error_line(r['error'])[:150]}")
            continue
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        loss = sum(x["loss"] for x in r["ranks"]) / len(r["ranks"])
        first = " ".join(f"{x['peak_first_step_mb']:.0f}" for x in r["ranks"])
        peak = " ".join(f"{x['peak_end_mb']:.0f}" for x in r["ranks"])
        state = " ".join(f"{x['state_mb']['total']:.0f}" for x in r["ranks"])
        lines.append(f"{r['name']:<15} {layout:<33} {r['samples_per_s']:>9.3f} {ratio:>10.2f}x {loss:>7.4f} "
                     f"{first:<31} {peak:<20} {state:<25}")
    first_ok = next((r for r in rows if "error" not in r), None)
    if first_ok is not None:
        unit = "peak allocated" if accelerator == "gpu" else "VmHWM above the resident set"
        lines.append(f"model {first_ok['model_mb']:.0f} MiB of fp32 parameters, all trainable, AdamW; loss: the last "
                     "step's, mean over ranks; peak growth: "
                     f"{unit} before the (meta) build; state: local parameters + gradients + AdamW moments before "
                     "the optimiser step; per rank in rank order")
    return "\n".join(lines)


def _sharding_layout(r: dict) -> str:
    if r["strategy"] == "fsdp":
        return "Lightning FSDPStrategy FULL_SHARD"
    if r["strategy"] == "model_parallel":
        return "Lightning ModelParallel FSDP2"
    dp = r.get("dp", "?")
    return f"{'tp2 x ' if r['tp'] > 1 else ''}dp{dp} {r['sharding']}"


def sharding_main(args, argv: list[str]) -> None:
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for cfg in SHARDING_RUNS:
        if only is not None and cfg["name"] not in only:
            continue
        start = time.time()
        row = _run_isolated({**cfg, "dp": args.procs // cfg["tp"]}, argv, args.timeout)
        rows.append(row)
        what = (f"error: {_error_line(row['error'])[:200]}" if "error" in row
                else f"{row['samples_per_s']:.3f} samples/s")
        print(f"{cfg['name']}: {what} ({time.time() - start:.0f} s with launch)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"procs": args.procs, "accelerator": args.accelerator, "args": vars(args) | {"worker": None, "machine": None},
           "baseline": "no_shard", "rows": rows, "machine": _machine.finish(args.machine)}
    (out / f"pipeline_sharding_p{args.procs}_{args.accelerator}.json").write_text(json.dumps(doc, indent=1))
    print(sharding_table(rows, args.accelerator))
    tables.main(["--quiet"])


# ----------------------------------------------------------------------------------------------- the driver
def run_config(cfg: dict, argv: list[str], timeout: float, stderr_log: str | None = None) -> dict:
    """One layout in fresh processes; on a failure its whole stderr goes to ``stderr_log`` (when given)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", json.dumps(cfg), "--result", result]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        if not os.path.exists(result):
            if stderr_log is not None:
                Path(stderr_log).parent.mkdir(parents=True, exist_ok=True)
                Path(stderr_log).write_text(proc.stderr)
            raise RuntimeError(f"{cfg['name']} failed{f' (stderr in {stderr_log})' if stderr_log else ''}:\n"
                               f"{proc.stderr[-4000:]}")
        doc = json.loads(Path(result).read_text())
        if proc.returncode != 0:  # measured and written, then failed in teardown: keep it, say so
            doc["exit"] = f"exit code {proc.returncode} after writing results: {proc.stderr.strip()[-200:]}"
            print(f"warning: {cfg['name']}: {doc['exit']}", flush=True)
        return doc


def _short(stage: str) -> str:
    return stage.replace("language_model", "llm").replace("encoders", "enc")


def table(rows: list[dict], accelerator: str) -> str:
    base = rows[0]
    lines = [f"baseline: {base['name']}" + (" (Lightning's FSDPStrategy refuses CPU, so DDPStrategy)"
                                             if base["name"] == "ddp" else ""),
             f"{'layout':<11} {'stages (dp)':<38} {'samples/s':>9} {'vs base':>7} {'peak MB/rank':<28} "
             f"{'bubble per rank':<40} {'meas/pred':>9}  all runs (samples/s)"]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        stages = "whole model" if r["strategy"] != "multimodal" else " ".join(
            f"{_short(m)}{v}" for m, v in r.get("partition", {}).items())
        mem = " ".join(f"{x['peak_mb']:.0f}(+{x['peak_mb'] - x['rss_start_mb']:.0f})" for x in r["ranks"])
        bubble = " ".join(f"{_short(s)}={v:.0%}" for s, v in r.get("bubble", {}).items())
        ratio = r.get("iteration_s", 0) / r["predicted_iteration_s"] if r.get("predicted_iteration_s") else None
        stages = f"{stages} ({r['dp']})"
        lines.append(f"{r['name']:<11} {stages:<38} {r['samples_per_s']:>9.2f} "
                     f"{r['samples_per_s'] / base['samples_per_s']:>6.2f}x {mem:<28} {bubble:<40} "
                     f"{'' if ratio is None else format(ratio, '.2f'):>9}  "
                     + " ".join(f"{v:.2f}" for v in r.get("all_samples_per_s", [])))
    unit = "peak allocated" if accelerator == "gpu" else f"peak RSS since {rows[0]['ranks'][0]['peak_since']}"
    lines.append(f"memory: {unit} per rank (+ growth above the RSS at train start); bubble: idle / iteration of "
                 "one recorded step per rank; meas/pred: measured / simulated iteration with that step's stage costs")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--steps", type=int, default=5, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="samples per replica (per rank for DDP/FSDP)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--llm-layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=512, help="the Llama's vocabulary")
    p.add_argument("--setup", action="store_true",
                   help="measure eager vs lazy (meta) builds and folder loading instead of throughput")
    p.add_argument("--sharding", action="store_true",
                   help="measure sharded data parallelism and tensor parallelism vs Lightning's FSDP strategies")
    p.add_argument("--text-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (cores / procs)")
    p.add_argument("--only", default=None, help="comma-separated layout names to run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--repeats", type=int, default=1, help="runs per layout (best kept): noisy shared machines")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        run = sharding_worker if args.sharding else setup_worker if args.setup else worker
        return run(json.loads(args.worker), args, args.result)
    args.machine = _machine.record()
    if args.setup:
        return setup_main(args, argv)
    if args.sharding:
        return sharding_main(args, argv)
    configs = layouts(args.procs, args.accelerator)
    if args.only:
        keep = set(args.only.split(","))
        configs = [configs[0]] + [c for c in configs[1:] if c["name"] in keep]
    runs: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    for r in range(args.repeats):  # rotate the order so slow phases of a shared machine hit every layout
        for cfg in configs[r % len(configs):] + configs[:r % len(configs)]:
            start = time.time()
            runs[cfg["name"]].append(run_config(cfg, argv, args.timeout))
            print(f"{cfg['name']}: {runs[cfg['name']][-1]['samples_per_s']:.2f} samples/s "
                  f"({time.time() - start:.0f} s with launch)", flush=True)
    rows = []
    for cfg in configs:  # the least disturbed run of each layout (highest samples/s); all kept in the JSON
        best = max(runs[cfg["name"]], key=lambda d: d["samples_per_s"])
        rows.append({**best, "all_samples_per_s": [d["samples_per_s"] for d in runs[cfg["name"]]]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"procs": args.procs, "accelerator": args.accelerator, "args": vars(args) | {"worker": None, "machine": None},
           "baseline": rows[0]["name"], "rows": rows, "machine": _machine.finish(args.machine)}
    (out / f"pipeline_p{args.procs}_{args.accelerator}.json").write_text(json.dumps(doc, indent=1))
    print(table(rows, args.accelerator))
    tables.main(["--quiet"])


if __name__ == "__main__":
    main()
