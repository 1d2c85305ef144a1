"""Video: encoder context parallelism on one long video (frames/s) and decoding under LLM pp 2 (tokens/s), on CPU.

CPU processes (gloo), one torch thread each, a tiny Qwen2-VL composite written with ``save_pretrained`` (the text
model of tests/test_hf_composites.py, a vision tower of ``--depth`` blocks of width ``--embed-dim``):

1. Encoder context parallelism: every batch holds one video of ``--frames`` temporal patches of ``--side`` x
   ``--side`` patches, trained with ``encoders={"vision": ParallelSpec(cp=N)}`` for N in ``--cps`` (N encoder ranks
   + 1 LLM rank): frames per second (median over ``--steps`` after ``--warmup``) and the ratio to cp 1.
2. Decoding: ``trainer.predict`` with greedy generation of 32 tokens under LLM pp 2 (3 ranks) against
   one-process ``model.generate`` on the same prompts with images and videos: tokens per second (median over
   ``--repeats`` batches after a warm-up one), and whether the tokens agree.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

sys.path.insert(1, str(harness.ROOT))  # tests.* (the composite's configs and samples)
PATCH, TEMPORAL, CHANNELS = 4, 2, 3  # the tower's patch, temporal patch and channels (a patch row of 96 values)
MAX_NEW_TOKENS = 32


def save_model(folder: Path, depth: int, embed_dim: int) -> str:
    """A Qwen2-VL composite like ``tests.test_hf_composites.save_composite("qwen2_vl", ...)`` with a larger tower."""
    import torch
    import transformers as tf

    from tests.helpers.composite_case import VID
    from tests.test_hf_composites import IMG, MROPE, TEXT, VEND, VSTART, save_hf

    vision = dict(depth=depth, embed_dim=embed_dim, hidden_size=TEXT["hidden_size"], num_heads=max(1, embed_dim // 32),
                  patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=TEMPORAL, in_channels=CHANNELS)
    cfg = tf.Qwen2VLConfig(text_config=dict(TEXT, rope_parameters=MROPE), vision_config=vision, image_token_id=IMG,
                           video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    return save_hf(tf.Qwen2VLForConditionalGeneration(cfg), "qwen2_vl", folder)


def video_sample(i: int, frames: int, side: int) -> dict:
    """Text, one long video (``frames`` temporal patches of side x side patches, one placeholder), text."""
    import torch

    from tests.helpers.composite_case import VID
    from tests.test_hf_composites import VEND, VSTART

    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(1, 90, (6,), generator=g).tolist() + [VSTART, VID, VEND] + \
        torch.randint(1, 90, (10,), generator=g).tolist()
    return {"input_ids": torch.tensor(ids),
            "video": {"pixel_values_videos": torch.randn(frames * side * side, CHANNELS * TEMPORAL * PATCH * PATCH,
                                                         generator=g),
                      "video_grid_thw": torch.tensor([[frames, side, side]])}}


def _load(folder: str):
    import torch

    import lightning_mm as lmm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    return lmm.MultimodalModel.from_pretrained(folder)


def _trainer(strategy, devices: int, callbacks: list, **kw):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, use_distributed_sampler=False,
                     num_sanity_val_steps=0, callbacks=callbacks, **harness.QUIET, **kw)


def cp_worker(cfg: dict, result: str) -> None:
    """Train ``warmup + steps`` steps on one-video batches under encoder cp ``cfg["cp"]``; rank 0 writes its times."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_mm as lmm

    model = _load(cfg["folder"]).freeze(encoders=False, projectors=False, language_model=False)
    total, ends, losses = cfg["warmup"] + cfg["steps"], [], []

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                ends.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())
            losses.append(float(outputs["loss"]))

    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec(cp=cfg["cp"])},
                                              language_model=lmm.ParallelSpec())
    trainer = _trainer(strategy, cfg["cp"] + 1, [Clock()], max_steps=total)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    trainer.fit(module, DataLoader([video_sample(i, cfg["frames"], cfg["side"]) for i in range(total)], batch_size=1,
                                   collate_fn=lmm.data.MultimodalCollator(model)))
    steps = [b - a for a, b in zip(ends, ends[1:])]
    harness.save(result, {"all_steps_s": steps, "steps_s": steps[cfg["warmup"]:], "losses": losses,
                          "processes": trainer.world_size}, trainer)


def generate_worker(cfg: dict, result: str) -> None:
    """One-process ``model.generate`` (``cfg["pp"]`` 0) or ``trainer.predict`` with generation under LLM pp
    ``cfg["pp"]``: one warm-up batch, then ``repeats`` timed batches of the same prompts."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import lightning_mm as lmm
    from tests.helpers.composite_case import sample

    model = _load(cfg["folder"]).eval()
    batch = lmm.data.MultimodalCollator(model)([sample(i, videos=True) for i in range(cfg["rows"])])
    generation = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
    if not cfg["pp"]:
        with torch.no_grad():
            times, _, ids = harness.repeat(lambda: model.generate(**batch, **generation), 1 + cfg["repeats"])
        harness.save(result, {"batch_s": times[1:], "generated": ids.tolist(), "processes": 1})
        return
    starts, times = [], []

    class Clock(L.Callback):
        def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            dist.barrier()
            starts.append(time.perf_counter())

        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            dist.barrier()
            times.append(time.perf_counter() - starts[-1])

    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                              language_model=lmm.ParallelSpec(pp=cfg["pp"]))
    trainer = _trainer(strategy, cfg["pp"] + 1, [Clock()])
    out = trainer.predict(lmm.MultimodalLightningModule(model, generation=generation),
                          DataLoader([batch] * (1 + cfg["repeats"]), batch_size=None))
    harness.save(result, {"batch_s": times[1:], "generated": out[0]["generated_ids"].tolist(),
                          "processes": trainer.world_size}, trainer)


def launch(cfg: dict, timeout: float, what: str) -> dict:
    doc = harness.launch(__file__, cfg, timeout, what, fail=False)
    return {"error": harness.error_line(doc["error"])} if "error" in doc else doc


def encoder_cp(args, folder: str, where: str) -> list[dict]:
    rows = []
    for cp in args.cps:
        cfg = {"part": "cp", "folder": folder, "cp": cp, "frames": args.frames, "side": args.side,
               "steps": args.steps, "warmup": args.warmup}
        row = {"cp": cp, "encoder_ranks": cp, "llm_ranks": 1, "measured_on": where,
               **launch(cfg, args.timeout, f"cp {cp}")}
        if "error" not in row:
            row["step_s"] = statistics.median(row["steps_s"])
            row["frames_per_s"] = args.frames * TEMPORAL / row["step_s"]
        rows.append(row)
    base = next((r for r in rows if r["cp"] == 1 and "error" not in r), None)
    for r in rows:
        if base is not None and "error" not in r:
            r["vs_cp1"] = r["frames_per_s"] / base["frames_per_s"]
    return rows


def decoding(args, folder: str, where: str) -> list[dict]:
    rows = []
    for name, pp in (("one process, model.generate", 0), ("trainer.predict, vision pp 1 + LLM pp 2", 2)):
        cfg = {"part": "generate", "folder": folder, "pp": pp, "rows": args.rows, "repeats": args.repeats}
        row = {"name": name, "llm_pp": pp or None, "measured_on": where, **launch(cfg, args.timeout, name)}
        if "error" not in row:
            row["new_tokens"] = len(row["generated"]) * len(row["generated"][0])  # rows x decode steps
            row["batch_s_median"] = statistics.median(row["batch_s"])
            row["tokens_per_s"] = row["new_tokens"] / row["batch_s_median"]
        rows.append(row)
    base = rows[0]
    for r in rows:
        if "error" not in r and "error" not in base:
            r["vs_one_process"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["same_tokens_as_one_process"] = r["generated"] == base["generated"]
    return rows


def main(argv=None) -> None:
    args = harness.cli(
        __doc__, argv, quick=(False, "a smaller run (16 temporal patches, 3 steps, 2 repeats)"),
        frames=(48, "temporal patches of the video"), side=(8, "patches per side of each temporal patch"),
        depth=(6, "vision tower blocks"), embed_dim=(128, "vision tower width"),
        cps=("1,2,4", "encoder context-parallel sizes"), steps=5, warmup=2, rows=(4, "decoding prompts"),
        repeats=(3, "timed decoding batches"), timeout=(300.0, "seconds per case"),
        out=str(harness.RESULTS / "video_cpu.json"), worker=True)
    if args.worker:
        return (cp_worker if args.worker["part"] == "cp" else generate_worker)(args.worker, args.result)
    if args.quick:
        args.frames, args.steps, args.warmup, args.repeats = min(args.frames, 16), 3, 1, 2
    args.cps = [int(x) for x in str(args.cps).split(",")]
    start = harness.record()
    where = f"this machine ({start['cpu']}, {start['cores']} cores; CPU processes, gloo)"
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(Path(tmp) / "qwen2_vl", args.depth, args.embed_dim)
        cp_rows, dec_rows = encoder_cp(args, folder, where), decoding(args, folder, where)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "result", "out")}
    harness.write(args.out, {"how": "measured", "measured_on": where, "backend": "gloo", "threads_per_process": 1,
                             "settings": {**settings, "temporal_patch_size": TEMPORAL}, "encoder_cp": cp_rows,
                             "decoding": dec_rows}, start)
    harness.print_rows(cp_rows, ["cp", "processes", "step_s", "frames_per_s", "vs_cp1", "error"], "encoder cp")
    harness.print_rows(dec_rows, ["name", "processes", "new_tokens", "batch_s_median", "tokens_per_s",
                                  "vs_one_process", "same_tokens_as_one_process", "error"], "decoding")


if __name__ == "__main__":
    main()
