"""Video: encoder context parallelism on one long video (frames/s) and decoding under LLM pp 2 (tokens/s), on CPU.

One run, CPU processes (gloo), one torch thread per process, a tiny Qwen2-VL composite written with
``save_pretrained`` from a config (nothing downloaded; the text model of tests/test_hf_composites.py, a vision
tower of ``--depth`` blocks of width ``--embed-dim`` so that the encoder dominates a training step):

1. Encoder context parallelism: every batch holds one video of ``--frames`` temporal patches of
   ``--side`` x ``--side`` patches (one ``video_token_id`` placeholder, expanded by ``MultimodalCollator``), trained
   (everything trainable, SGD) with ``MultimodalParallelStrategy(encoders={"vision": ParallelSpec(cp=N)},
   language_model=ParallelSpec())`` for N in ``--cps``: N encoder ranks + 1 LLM rank. The video's temporal
   patches are spread over the encoder's CP ranks (``VideoInputs.cp_pieces``). Reported: frames per second
   (temporal patches x temporal_patch_size per second of step time, median over ``--steps`` steps after
   ``--warmup``; step time = rank 0's time from one step's end to the next) and the ratio to cp 1.
2. Decoding: ``trainer.predict`` with ``MultimodalLightningModule(model, generation={"max_new_tokens": 32,
   "do_sample": False})`` under ``encoders={"vision": ParallelSpec()}, language_model=ParallelSpec(pp=2)``
   (3 ranks) against one-process ``model.generate`` on the same prompts (rows with images and videos,
   ``tests/helpers/composite_case.py`` ``sample(i, videos=True)``): generated tokens (rows x new tokens) per second
   of wall time, median over ``--repeats`` batches after one warm-up batch, and whether the tokens agree.

Every case runs in fresh processes (Lightning's popen launcher re-runs this script for the other ranks). Writes
benchmarks/results/video_cpu.json (with the machine record: every figure is measured on that machine) and prints
the tables. On a 2-core machine cp 2 (3 processes) already shares the cores and cp 4 (5 processes) oversubscribes
them: no speedup is to be expected there; the table reports what is measured.

    python benchmarks/video.py [--quick] [--frames 48] [--side 8] [--depth 6] [--embed-dim 128] [--cps 1,2,4]
                               [--steps 5] [--warmup 2] [--repeats 3] [--timeout 300]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402
from pipeline import _error_line  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))  # tests.* (the composite's configs and samples)
RESULTS = Path(__file__).resolve().parent / "results"
PATCH, TEMPORAL, CHANNELS = 4, 2, 3  # the tower's patch, temporal patch and channels (a patch row of 96 values)
MAX_NEW_TOKENS = 32


# ----------------------------------------------------------------------------------------------- model and data
def save_model(folder: Path, depth: int, embed_dim: int) -> str:
    """A Qwen2-VL composite like ``tests.test_hf_composites.save_composite("qwen2_vl", ...)`` with a larger tower."""
    import torch
    import transformers as tf

    from tests.test_hf_composites import IMG, MROPE, TEXT, VEND, VSTART, save_hf
    from tests.helpers.composite_case import VID

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
    rows = frames * side * side
    return {"input_ids": torch.tensor(ids),
            "video": {"pixel_values_videos": torch.randn(rows, CHANNELS * TEMPORAL * PATCH * PATCH, generator=g),
                      "video_grid_thw": torch.tensor([[frames, side, side]])}}


def prompts(model, rows: int) -> dict:
    """``rows`` prompts with images and videos (``composite_case.sample(i, videos=True)``), collated."""
    import lightning_mm as lmm
    from tests.helpers.composite_case import sample

    return lmm.data.MultimodalCollator(model)([sample(i, videos=True) for i in range(rows)])


def _load(folder: str):
    import torch

    import lightning_mm as lmm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    return lmm.MultimodalModel.from_pretrained(folder)


def _trainer(strategy, devices: int, callbacks: list, **kw):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                     num_sanity_val_steps=0, callbacks=callbacks, **kw)


# ----------------------------------------------------------------------------------------------- workers
def cp_worker(cfg: dict, result: str) -> None:
    """Train ``warmup + steps`` steps on one-video batches under encoder cp ``cfg["cp"]``; rank 0 writes its times."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_mm as lmm

    model = _load(cfg["folder"]).freeze(encoders=False, projectors=False, language_model=False)
    total = cfg["warmup"] + cfg["steps"]
    ends, losses = [], []

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
    data = DataLoader([video_sample(i, cfg["frames"], cfg["side"]) for i in range(total)], batch_size=1,
                      collate_fn=lmm.data.MultimodalCollator(model))
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        steps = [b - a for a, b in zip(ends, ends[1:])]
        Path(result).write_text(json.dumps({"all_steps_s": steps, "steps_s": steps[cfg["warmup"]:],
                                            "losses": losses, "processes": trainer.world_size}))


def generate_worker(cfg: dict, result: str) -> None:
    """One-process ``model.generate`` (``cfg["pp"]`` 0) or ``trainer.predict`` with generation under LLM pp
    ``cfg["pp"]``: one warm-up batch, then ``repeats`` timed batches of the same prompts."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import lightning_mm as lmm

    model = _load(cfg["folder"]).eval()
    batch = prompts(model, cfg["rows"])
    generation = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
    if not cfg["pp"]:
        times, ids = [], None
        with torch.no_grad():
            for _ in range(1 + cfg["repeats"]):
                t0 = time.perf_counter()
                ids = model.generate(**batch, **generation)
                times.append(time.perf_counter() - t0)
        Path(result).write_text(json.dumps({"batch_s": times[1:], "generated": ids.tolist(), "processes": 1}))
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
    module = lmm.MultimodalLightningModule(model, generation=generation)
    out = trainer.predict(module, DataLoader([batch] * (1 + cfg["repeats"]), batch_size=None))
    if trainer.global_rank == 0:
        Path(result).write_text(json.dumps({"batch_s": times[1:], "generated": out[0]["generated_ids"].tolist(),
                                            "processes": trainer.world_size}))


# ----------------------------------------------------------------------------------------------- the driver
def launch(cfg: dict, timeout: float) -> dict:
    """One case in fresh processes, in a session of their own (all of it ended afterwards: ranks left waiting in a
    collective when another failed); a case that writes no result gets its error line instead."""
    with tempfile.TemporaryDirectory() as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg), "--result", str(result)]
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = f"killed after {timeout:.0f} s"
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if not result.exists():
            return {"error": f"exit {code}: {_error_line(log.read_text(errors='replace'))}"}
        return json.loads(result.read_text())


def encoder_cp(args, folder: str, where: str) -> list[dict]:
    rows = []
    for cp in args.cps:
        start = time.time()
        cfg = {"part": "cp", "folder": folder, "cp": cp, "frames": args.frames, "side": args.side,
               "steps": args.steps, "warmup": args.warmup}
        doc = launch(cfg, args.timeout)
        row = {"cp": cp, "encoder_ranks": cp, "llm_ranks": 1, "measured_on": where, **doc}
        if "error" not in doc:
            row["step_s"] = statistics.median(doc["steps_s"])
            row["frames_per_s"] = args.frames * TEMPORAL / row["step_s"]
        rows.append(row)
        print(f"cp {cp}: " + (row["error"] if "error" in row else f"{row['frames_per_s']:.1f} frames/s")
              + f" ({time.time() - start:.0f} s with launch)", flush=True)
    base = next((r for r in rows if r["cp"] == 1 and "error" not in r), None)
    for r in rows:
        if base is not None and "error" not in r:
            r["vs_cp1"] = r["frames_per_s"] / base["frames_per_s"]
    return rows


def decoding(args, folder: str, where: str) -> list[dict]:
    rows = []
    for name, pp in (("one process, model.generate", 0), ("trainer.predict, vision pp 1 + LLM pp 2", 2)):
        start = time.time()
        doc = launch({"part": "generate", "folder": folder, "pp": pp, "rows": args.rows, "repeats": args.repeats},
                     args.timeout)
        row = {"name": name, "llm_pp": pp or None, "measured_on": where, **doc}
        if "error" not in doc:
            row["new_tokens"] = len(doc["generated"]) * len(doc["generated"][0])  # rows x decode steps
            row["batch_s_median"] = statistics.median(doc["batch_s"])
            row["tokens_per_s"] = row["new_tokens"] / row["batch_s_median"]
        rows.append(row)
        print(f"{name}: " + (row["error"] if "error" in row else f"{row['tokens_per_s']:.1f} tokens/s")
              + f" ({time.time() - start:.0f} s with launch)", flush=True)
    base = rows[0]
    for r in rows:
        if "error" not in r and "error" not in base:
            r["vs_one_process"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["same_tokens_as_one_process"] = r["generated"] == base["generated"]
    return rows


def render(doc: dict) -> str:
    """The two tables, each with a note naming the machine they were measured on."""
    where, s, cores = _machine.describe(doc["machine"]), doc["settings"], doc["machine"]["cores"]
    how = "CPU processes, gloo, 1 torch thread per process"
    failed = lambda r, n: ["error: " + r["error"][:120]] + [""] * (n - 1)  # noqa: E731
    cp_rows = [[r["cp"], r["cp"] + 1, *(failed(r, 4) if "error" in r else [
        f"{r['step_s']:.3f}", f"{r['frames_per_s']:.1f}", f"{r.get('vs_cp1', float('nan')):.2f}x",
        f"{r['losses'][-1]:.4f}"])] for r in doc["encoder_cp"]]
    first = (f"Encoder context parallelism, measured on {where} ({how}): one video of {s['frames']} temporal "
             f"patches ({s['frames'] * TEMPORAL} frames, {s['side']}x{s['side']} patches each) per batch, tower "
             f"depth {s['depth']} width {s['embed_dim']}, median of {s['steps']} steps after {s['warmup']}. The "
             f"machine has {cores} cores: cp N runs N encoder ranks + 1 LLM rank, so cp 4 (5 processes) "
             "oversubscribes it and no speedup is expected there.\n\n"
             + tables.table(["vision cp", "processes", "step s (measured)", "frames/s (measured)", "vs cp 1",
                             "last loss"], cp_rows, "rrrrrr"))
    dec_rows = [[r["name"], r.get("processes", ""), *(failed(r, 5) if "error" in r else [
        r["new_tokens"], f"{r['batch_s_median']:.3f}", f"{r['tokens_per_s']:.1f}",
        f"{r.get('vs_one_process', float('nan')):.2f}x", "yes" if r.get("same_tokens_as_one_process", True) else
        "no"])] for r in doc["decoding"]]
    second = (f"Decoding, measured on {where} ({how}): {s['rows']} prompts with images and videos, greedy, "
              f"{MAX_NEW_TOKENS} new tokens each, median of {s['repeats']} batches after one.\n\n"
              + tables.table(["decoding", "processes", "new tokens", "batch s (measured)", "tokens/s (measured)",
                              "vs one process", "same tokens"], dec_rows, "lrrrrrl"))
    return first + "\n\n" + second


def regenerate_quotes(json_path: str) -> None:
    """Rewrite the doc quotes of this JSON only (tables.main rewrites every stale quote, other benchmarks' too)."""
    cache: dict = {}
    for name in tables.DOCUMENTS:
        path = ROOT / name
        new, changed = tables.regenerate(path.read_text(), cache, only=json_path)
        if changed:
            path.write_text(new)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller run (16 temporal patches, 3 steps, 2 repeats)")
    p.add_argument("--frames", type=int, default=48, help="temporal patches of the video")
    p.add_argument("--side", type=int, default=8, help="patches per side of each temporal patch")
    p.add_argument("--depth", type=int, default=6, help="vision tower blocks")
    p.add_argument("--embed-dim", type=int, default=128, help="vision tower width")
    p.add_argument("--cps", default="1,2,4", help="encoder context-parallel sizes")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=4, help="decoding prompts")
    p.add_argument("--repeats", type=int, default=3, help="timed decoding batches")
    p.add_argument("--timeout", type=float, default=300, help="seconds per case")
    p.add_argument("--out", default=str(RESULTS / "video_cpu.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.frames, args.steps, args.warmup, args.repeats = min(args.frames, 16), 3, 1, 2
    args.cps = [int(x) for x in str(args.cps).split(",")]
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        cfg = json.loads(args.worker)
        return (cp_worker if cfg["part"] == "cp" else generate_worker)(cfg, args.result)
    start = _machine.record()
    where = f"this machine ({start['cpu']}, {start['cores']} cores; CPU processes, gloo)"
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(Path(tmp) / "qwen2_vl", args.depth, args.embed_dim)
        cp_rows = encoder_cp(args, folder, where)
        dec_rows = decoding(args, folder, where)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "result", "out")}
    settings["temporal_patch_size"] = TEMPORAL
    doc = {"how": "measured", "measured_on": where, "backend": "gloo", "threads_per_process": 1,
           "settings": settings, "encoder_cp": cp_rows, "decoding": dec_rows, "machine": _machine.finish(start)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(render(doc))
    try:
        regenerate_quotes(str(out.resolve().relative_to(ROOT)))
    except ValueError:  # written outside the repository: quoted nowhere
        pass


if __name__ == "__main__":
    main()
