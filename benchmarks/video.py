"""Video: encoder context parallelism on one long video (frames/s) and decoding under LLM pp 2 (tokens/s), on CPU.

A tiny Qwen2-VL composite (the text model of tests/test_hf_composites.py, a tower of ``--depth`` blocks of width
``--embed-dim``) on gloo processes of one thread: 1. one video of ``--frames`` temporal patches of ``--side`` x
``--side`` patches per batch, trained under ``encoders={"vision": ParallelSpec(cp=N)}`` for N in ``--cps`` (N encoder
ranks + 1 LLM rank), against cp 1; 2. greedy generation of 32 tokens with ``trainer.predict`` under LLM pp 2 (3 ranks)
against one-process ``model.generate`` on the same prompts with images and videos, and whether the tokens agree.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import transformers as tf
from lightning.pytorch.callbacks import LambdaCallback
from torch.utils.data import DataLoader

import harness
import lightning_mm as lmm

sys.path.insert(1, str(harness.ROOT))  # tests.* (the composite's configs and samples)
from tests.helpers.composite_case import VID, sample  # noqa: E402
from tests.test_hf_composites import IMG, MROPE, TEXT, VEND, VSTART, save_hf  # noqa: E402

PATCH, TEMPORAL, CHANNELS = 4, 2, 3  # the tower's patch, temporal patch and channels (a patch row of 96 values)
MAX_NEW_TOKENS = 32


def save_model(folder: Path, depth: int, embed_dim: int) -> str:
    """A Qwen2-VL composite like ``tests.test_hf_composites.save_composite("qwen2_vl", ...)`` with a larger tower."""
    vision = dict(depth=depth, embed_dim=embed_dim, hidden_size=TEXT["hidden_size"], num_heads=max(1, embed_dim // 32),
                  patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=TEMPORAL, in_channels=CHANNELS)
    cfg = tf.Qwen2VLConfig(text_config=dict(TEXT, rope_parameters=MROPE), vision_config=vision, image_token_id=IMG,
                           video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    return save_hf(tf.Qwen2VLForConditionalGeneration(cfg), "qwen2_vl", folder)


def video_sample(i: int, frames: int, side: int) -> dict:
    """Text, one long video (``frames`` temporal patches of side x side patches, one placeholder), text."""
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(1, 90, (6,), generator=g).tolist() + [VSTART, VID, VEND] + \
        torch.randint(1, 90, (10,), generator=g).tolist()
    rows = torch.randn(frames * side * side, CHANNELS * TEMPORAL * PATCH * PATCH, generator=g)
    return {"input_ids": torch.tensor(ids),
            "video": {"pixel_values_videos": rows, "video_grid_thw": torch.tensor([[frames, side, side]])}}


def _load(folder: str):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return lmm.MultimodalModel.from_pretrained(folder)


def _trainer(vision, pp: int, callbacks: list, **kw):
    """A Trainer of ``vision.cp + pp`` CPU processes: the vision encoder under ``vision``, the LLM in ``pp`` stages."""
    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": vision}, language_model=lmm.ParallelSpec(pp=pp))
    return L.Trainer(accelerator="cpu", devices=vision.cp + pp, strategy=strategy, use_distributed_sampler=False,
                     num_sanity_val_steps=0, callbacks=callbacks, **harness.QUIET, **kw)


def cp_worker(cfg: dict, result: str) -> None:
    """Train ``warmup + steps`` steps on one-video batches under encoder cp ``cfg["cp"]``; rank 0 writes its times."""
    model = _load(cfg["folder"]).freeze(encoders=False, projectors=False, language_model=False)
    total, ends, losses = cfg["warmup"] + cfg["steps"], [], []

    def step_end(trainer, module, outputs, batch, batch_idx):
        ends.append(time.perf_counter())
        losses.append(float(outputs["loss"]))

    clock = LambdaCallback(on_train_start=lambda *_: ends.append(time.perf_counter()), on_train_batch_end=step_end)
    trainer = _trainer(lmm.ParallelSpec(cp=cfg["cp"]), 1, [clock], max_steps=total)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    trainer.fit(module, DataLoader([video_sample(i, cfg["frames"], cfg["side"]) for i in range(total)], batch_size=1,
                                   collate_fn=lmm.data.MultimodalCollator(model)))
    steps = [b - a for a, b in zip(ends, ends[1:])]
    harness.save(result, {"all_steps_s": steps, "steps_s": steps[cfg["warmup"]:], "losses": losses,
                          "processes": trainer.world_size}, trainer)


def generate_worker(cfg: dict, result: str) -> None:
    """One-process ``model.generate`` (``cfg["pp"]`` 0) or ``trainer.predict`` with generation under LLM pp
    ``cfg["pp"]``: one warm-up batch, then ``repeats`` timed batches of the same prompts."""
    model = _load(cfg["folder"]).eval()
    batch = lmm.data.MultimodalCollator(model)([sample(i, videos=True) for i in range(cfg["rows"])])
    generation = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
    if not cfg["pp"]:
        with torch.no_grad():
            times, _, ids = harness.repeat(lambda: model.generate(**batch, **generation), 1 + cfg["repeats"])
        return harness.save(result, {"batch_s": times[1:], "generated": ids.tolist(), "processes": 1})
    marks = []

    def mark(*_):
        dist.barrier()
        marks.append(time.perf_counter())

    trainer = _trainer(lmm.ParallelSpec(), cfg["pp"], [LambdaCallback(on_predict_batch_start=mark,
                                                                      on_predict_batch_end=mark)])
    out = trainer.predict(lmm.MultimodalLightningModule(model, generation=generation),
                          DataLoader([batch] * (1 + cfg["repeats"]), batch_size=None))
    times = [end - begin for begin, end in zip(marks[::2], marks[1::2])]
    harness.save(result, {"batch_s": times[1:], "generated": out[0]["generated_ids"].tolist(),
                          "processes": trainer.world_size}, trainer)


def measure(cases: list[tuple[dict, dict]], args, where: str) -> list[dict]:
    """Each (row, worker config) run in processes of its own: the row, the worker's JSON or its error."""
    rows = []
    for row, cfg in cases:
        doc = harness.launch(__file__, cfg, args.timeout, row.get("name", f"cp {row.get('cp')}"), fail=False)
        rows.append({**row, "measured_on": where, **({"error": harness.error_line(doc["error"])} if "error" in doc
                                                      else doc)})
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
        cp_rows = measure([({"cp": cp, "encoder_ranks": cp, "llm_ranks": 1},
                            {"part": "cp", "folder": folder, "cp": cp, "frames": args.frames, "side": args.side,
                             "steps": args.steps, "warmup": args.warmup}) for cp in args.cps], args, where)
        dec_rows = measure([({"name": name, "llm_pp": pp or None},
                             {"part": "generate", "folder": folder, "pp": pp, "rows": args.rows,
                              "repeats": args.repeats})
                            for name, pp in (("one process, model.generate", 0),
                                             ("trainer.predict, vision pp 1 + LLM pp 2", 2))], args, where)
    cp_ok, dec_ok = ([r for r in rows if "error" not in r] for rows in (cp_rows, dec_rows))
    for r in cp_ok:
        r["step_s"] = statistics.median(r["steps_s"])
        r["frames_per_s"] = args.frames * TEMPORAL / r["step_s"]
    for r in dec_ok:
        r["new_tokens"] = len(r["generated"]) * len(r["generated"][0])  # rows x decode steps
        r["batch_s_median"] = statistics.median(r["batch_s"])
        r["tokens_per_s"] = r["new_tokens"] / r["batch_s_median"]
    base = next((r for r in cp_ok if r["cp"] == 1), None)
    for r in cp_ok if base is not None else []:
        r["vs_cp1"] = r["frames_per_s"] / base["frames_per_s"]
    for r in dec_ok if dec_rows[0] in dec_ok else []:
        r["vs_one_process"] = r["tokens_per_s"] / dec_rows[0]["tokens_per_s"]
        r["same_tokens_as_one_process"] = r["generated"] == dec_rows[0]["generated"]
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "result", "out")}
    harness.write(args.out, {"how": "measured", "measured_on": where, "backend": "gloo", "threads_per_process": 1,
                             "settings": {**settings, "temporal_patch_size": TEMPORAL}, "encoder_cp": cp_rows,
                             "decoding": dec_rows}, start)
    harness.print_rows(cp_rows, ["cp", "processes", "step_s", "frames_per_s", "vs_cp1", "error"], "encoder cp")
    harness.print_rows(dec_rows, ["name", "processes", "new_tokens", "batch_s_median", "tokens_per_s",
                                  "vs_one_process", "same_tokens_as_one_process", "error"], "decoding")


if __name__ == "__main__":
    main()
