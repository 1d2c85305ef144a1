"""Fit of a YAML (default the example VLM) at world size 1 on one GPU: measured tokens/s, MFU and step time beside
the simulator's prediction (``lightning-mm plan`` on the parts timed on this GPU), and a torch.profiler summary
(top kernels) of one training step. Writes its JSON after each phase. Without a GPU it says so and exits 0
(``--dry`` builds nothing and prints the phases).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

PREDICTED = re.compile(r"predicted iteration time ([0-9.eE+-]+) (\w+) on 1 devices")
TO_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def predict(config: str, out: Path) -> dict:
    """The simulator's iteration time for ``config`` from its parts timed on this GPU (``plan --write-profile``)."""
    from lightning_mm.planner import plan_cli
    from lightning_mm.trainer.cli import load_fit_config

    args = plan_cli.parse_args(["--config", config, "--write-profile", str(out / "parts_profile.json"),
                                "--out", str(out / "plan")])
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        plan_cli.run(args, *load_fit_config([config]))
    (out / "plan.log").write_text(text.getvalue())
    found = PREDICTED.search(text.getvalue())
    if not found or found.group(2) not in TO_SECONDS:
        return dict(status=f"unknown unit {found.group(2)!r} in plan.log" if found
                    else "no 'predicted iteration time' line in plan.log")
    return dict(status="ok", simulated_iteration_s=float(found.group(1)) * TO_SECONDS[found.group(2)])


def fit(config: str, steps: int, profile_step: int, out: Path, batch_size: int | None = None) -> dict:
    """``steps`` training steps, each timed (synchronised), step ``profile_step`` under torch.profiler: its top
    kernels by self CUDA time in ``profile_step.txt``, its trace in ``profile_step.trace.json``."""
    from lightning.pytorch.callbacks import Callback

    from lightning_mm.trainer.cli import load_fit_config

    steps_s, top = [], []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])

    class StepClock(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            torch.cuda.synchronize()
            if batch_idx == profile_step:
                profiler.__enter__()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            steps_s.append(time.perf_counter() - self.t0)
            if batch_idx != profile_step:
                return
            profiler.__exit__(None, None, None)
            events = profiler.key_averages()
            (out / "profile_step.txt").write_text(events.table(sort_by="self_cuda_time_total", row_limit=25))
            profiler.export_chrome_trace(str(out / "profile_step.trace.json"))
            key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
            top.extend(dict(name=e.key, self_cuda_ms=getattr(e, key) / 1e3, calls=e.count)
                       for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:25])

    batch = [f"--data.init_args.batch_size={batch_size}"] if batch_size else []
    module, datamodule, trainer = load_fit_config([config], [f"--trainer.max_steps={steps}",
                                                             "--trainer.log_every_n_steps=1",
                                                             f"--trainer.default_root_dir={out / 'fit'}", *batch])
    trainer.callbacks.append(StepClock())
    trainer.fit(module, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    warm = sorted(steps_s[2:]) or sorted(steps_s)
    return dict(steps=len(steps_s), step_s=steps_s, median_step_s=warm[len(warm) // 2] if warm else None,
                tokens_per_s=metrics.get("train/tokens_per_s"), mfu=metrics.get("train/mfu"), logged=metrics,
                profiled_step=profile_step, top_kernels=top)


def main(argv=None) -> int:
    args = harness.cli(__doc__, argv, config=("examples/gpu_vlm.yaml", "fit YAML"), steps=(20, "training steps"),
                       profile_step=(5, "step profiled with torch.profiler"),
                       out=dict(type=Path, help="folder (default results/gpu/fit_<device>)"),
                       no_predict=(False, "skip the simulator's prediction"), dry=(False, "print the phases, run none"),
                       batch_sizes=dict(type=int, nargs="+", default=[],
                                        help="then a fit at each of these batch sizes (MFU against the batch)"))
    phases = ["simulator prediction (plan --write-profile)"] * (not args.no_predict) + \
        [f"fit {args.steps} steps, profile step {args.profile_step}"] + \
        [f"fit {args.steps} steps at batch size {b}" for b in args.batch_sizes]
    if args.dry or not torch.cuda.is_available():
        print(("dry run" if args.dry else "no GPU present: nothing was measured") + "; phases: " + "; ".join(phases))
        return 0
    start, name = harness.record(), torch.cuda.get_device_name(0)
    out = args.out or harness.RESULTS / "gpu" / f"fit_{harness.slug(name)}"
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(benchmark=f"benchmarks/gpu_fit.py --config {args.config}", device=name, torch=torch.__version__,
               world_size=1, config=args.config)
    if not args.no_predict:
        doc["simulated"] = predict(args.config, out)
        harness.write(out / "fit.json", doc, start)
    doc["fit"] = measured = fit(args.config, args.steps, args.profile_step, out)
    sim = doc.get("simulated", {})
    if sim.get("simulated_iteration_s") and measured["median_step_s"] and measured["tokens_per_s"]:
        sim["tokens_per_s_at_simulated_step"] = \
            measured["tokens_per_s"] * measured["median_step_s"] / sim["simulated_iteration_s"]
    harness.write(out / "fit.json", doc, start)
    for b in args.batch_sizes:  # written after each: a run stopped by its time limit keeps what it measured
        run = fit(args.config, args.steps, -1, out, batch_size=b)
        doc.setdefault("batch_sizes", []).append(dict(batch_size=b, **{k: run[k] for k in (
            "median_step_s", "tokens_per_s", "mfu")}))
        harness.write(out / "fit.json", doc, start)
    for row in measured["top_kernels"][:10]:
        print(f"{row['self_cuda_ms']:10.3f} ms  x{row['calls']:<5d} {row['name'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
