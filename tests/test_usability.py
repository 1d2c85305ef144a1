"""What a new user meets first: the command listing, units in the planner's tables, the defaults of a run under the
strategy (summary of the whole model, timeline callback without arguments, global throughput, MFU, bubbles, the
loss curve), and short context-parallel sequences."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoint_runs import ROOT, case_env
from tests.helpers.distributed import run_distributed

EXAMPLE = os.path.join(ROOT, "examples", "tiny_valm_pp.yaml")


# ------------------------------------------------------------------------------------------------ the command line
def test_help_lists_plan_and_export_without_warnings():
    proc = subprocess.run([sys.executable, "-m", "lightning_mm.trainer.cli", "--help"], capture_output=True, text=True,
                          timeout=120, env=case_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    for command in ("fit", "validate", "test", "predict", "plan", "export", "lighthouse", "agent"):
        assert any(line.strip().startswith(command + " ") for line in lines), (command, proc.stdout)
    assert "{fit,validate,test,predict,plan,export,lighthouse,agent}" in proc.stdout
    assert "args parameter is intended" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_plan_headers_carry_units_and_files_go_to_a_plan_folder(tmp_path, monkeypatch, capsys):
    from lightning_mm.trainer.cli import main
    from lightning_mm.planner import plan_cli

    drawn = []
    monkeypatch.setattr(plan_cli, "timeline_png", lambda result, path, **kw: drawn.append((Path(path).name, kw)))
    monkeypatch.chdir(tmp_path)
    main(["plan", "--config", EXAMPLE, "--devices", "8"])  # FLOP costs, no --out
    out = capsys.readouterr().out
    for header in ("forward (GFLOP)", "backward (GFLOP)", "busy (GFLOP)", "memory (GiB)"):
        assert header in out
    assert "(critical-path work per device)" in out and "GFLOP on 4 devices" in out
    plan_dir = tmp_path / "lightning_logs" / "plan_0"  # beside the runs' version_N folders, not in one
    assert {p.name for p in plan_dir.iterdir()} >= {"configured.trace.json", "auto.trace.json"}
    assert not (tmp_path / "plan").exists() and not list((tmp_path / "lightning_logs").glob("version_*"))
    assert f"wrote {plan_dir.relative_to(tmp_path)}" in out or f"wrote {plan_dir}" in out
    assert drawn and all("GFLOP" in kw["title"] and kw["xlabel"].startswith("work (GFLOP") for _, kw in drawn)

    drawn.clear()
    main(["plan", "--config", EXAMPLE, "--devices", "8", "--device-flops", "1e12", "--allreduce-bandwidth", "10",
          "--out", str(tmp_path / "mine")])
    out = capsys.readouterr().out
    for header in ("forward (ms)", "backward (ms)", "busy (ms)", "memory (GiB)", "all-reduce (ms)"):
        assert header in out
    assert "gradient all-reduce at 10 GB/s" in out and "predicted iteration time" in out and " ms on " in out
    assert (tmp_path / "mine" / "configured.trace.json").exists()
    assert drawn and all(kw["xlabel"] == "time (ms)" and kw["title"].endswith(" ms") for _, kw in drawn)


# ------------------------------------------------------------------------------------------------ a default run
@pytest.mark.parametrize("bounds", [{"max_steps": 7}, {"max_epochs": 2}])
def test_progress_bar_shows_steps_of_max_steps_and_only_real_bounds(bounds, tmp_path):
    """StepProgressBar (the examples' bar): with max_steps the training bar counts optimizer steps against it across
    epochs (4 batches per epoch, 7 steps: the second epoch starts at 4/7), the description names no epoch bound
    when there is none (Lightning's reads "Epoch 0/-2"), and the logger's version prints as an integer."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mm.trainer.callbacks import StepProgressBar

    seen = []

    class Recording(StepProgressBar):
        def _update(self, progress_bar_id, current, visible=True, hard=False):
            if progress_bar_id is not None and progress_bar_id == self.train_progress_bar_id:
                task = self.progress.tasks[progress_bar_id]
                seen.append((self.trainer.current_epoch, task.description, current, task.total))
            super()._update(progress_bar_id, current, visible, hard)

    bar = Recording()
    trainer = L.Trainer(accelerator="cpu", devices=1, limit_train_batches=4, limit_val_batches=0,
                        callbacks=[bar], logger=CSVLogger(tmp_path), enable_checkpointing=False,
                        enable_model_summary=False, **bounds)
    trainer.fit(BoringModel())
    assert bar.get_metrics(trainer, trainer.lightning_module)["v_num"] == "0"
    last = {epoch: (desc, current, total) for epoch, desc, current, total in seen}
    if "max_steps" in bounds:
        assert [c for _, _, c, _ in seen if c] == [1, 2, 3, 4, 4, 5, 6, 7]  # steps, on from epoch 0 into epoch 1
        assert {total for *_, total in seen} == {7}
        assert last[1][0].strip() == "Epoch 1 · steps"
    else:  # bounded by epochs: Lightning's count of the epoch's batches, with its bound
        assert last[0][0].strip() == "Epoch 0/1" and last[1][1:] == (4, 4)


@pytest.mark.slow
def test_defaults_under_the_strategy(tmp_path):
    """PipelineTimeline() with no arguments finishes (it used to hang: the log dir was asked on rank 0 only); the
    whole model's summary is printed once; tokens/s, MFU and per-stage bubbles are logged; loss.png is written."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "usability_case.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=400, env=case_env())
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    log_dir = Path(result["log_dir"])
    assert result["timeline_steps"] == [3]
    written = {p.name for p in (log_dir / "timeline").iterdir()}
    assert {"timeline-step3.trace.json", "predicted-step3.trace.json"} <= written
    # the whole model, once: both stages, the ranks holding them, every part with trainable / frozen counts
    assert text.count("Whole model across 2 ranks (2 pipeline stages, data-parallel size 1)") == 1, text[-4000:]
    table = text.split("Whole model across")[1]
    assert "language_model.0  0      encoders.vision" in table and "language_model.1  1      language_model" in table
    assert "encoders.vision.projector" in table and "layers 2-3, norm/head" in table
    assert "Trainable params:" in table and "Frozen params:" in table
    assert "| Name" not in text  # Lightning's per-rank table is replaced
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"train/tokens_per_s", "train/mfu", "pipeline/bubble/language_model.0",
            "pipeline/bubble/language_model.1", "timeline/iteration_s"} <= logged, logged
    bubbles = [float(r["pipeline/bubble/language_model.1"]) for r in rows if r["pipeline/bubble/language_model.1"]]
    assert len(bubbles) == 3 and all(0 <= b < 1 for b in bubbles)  # steps 2, 4, 6 (bubble_every_n_steps=2)
    assert all(0 < float(r["train/mfu"]) for r in rows if r["train/mfu"])
    assert (log_dir / "loss.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------------------ metrics
def test_tokens_per_s_sums_every_replica():
    """Two replicas counting 100 and 200 tokens in 1 s and 2 s: the job did 300 tokens in 2 s. The metric's own
    reduction runs with a stand-in for the all-gather between the two processes."""
    from lightning_mm.trainer.callbacks.throughput import GlobalThroughput

    metrics = []
    peers = {}

    def gather(tensor, group=None):  # torchmetrics syncs states in add_state order: tokens, flops, seconds
        i = peers.setdefault("i", 0)
        peers["i"] = i + 1
        other = [getattr(metrics[1], name) for name in ("tokens", "flops", "seconds")][i % 3]
        return [tensor, other]

    for rank in (0, 1):
        metric = GlobalThroughput(dist_sync_fn=gather, distributed_available_fn=lambda: True)
        metric.update(tokens=100 * (rank + 1), flops=1e6 * (rank + 1), seconds=1.0 + rank)
        metrics.append(metric)
    value = {k: float(v) for k, v in metrics[0].compute().items()}
    assert value == {"tokens_per_s": 150.0, "flops_per_s": 1.5e6}
    assert float(metrics[0].tokens) == 100  # local state is restored after the synced compute


@pytest.mark.slow
def test_flop_model_scales_with_tokens_and_skips_frozen_backward():
    from lightning_mm.trainer.callbacks.throughput import FlopModel, rank_bubble
    from lightning_mm.planner.model_costs import sample_batch
    from tests.helpers.pipeline_case import build_model

    model = build_model(("vision",), "projectors")  # encoder and LLM frozen, projector trainable
    flops = FlopModel(model)
    batch = sample_batch(model)
    twice = {k: torch.cat([v, v]) if k == "input_ids" else v for k, v in batch.items()}
    assert flops(twice) == pytest.approx(2 * flops(batch))
    trainable = FlopModel(build_model(("vision",), "llm"))  # the LLM trains: its weight gradients cost too
    assert trainable.per_token["language_model"] > flops.per_token["language_model"]
    assert trainable.per_token["vision"] == pytest.approx(flops.per_token["vision"])  # frozen, upstream of all
    # bubble of one rank: 2 s of compute in a 4 s schedule
    assert rank_bubble([("recv_fwd", 0, 0.0, 1.0), ("forward", 0, 1.0, 2.0), ("backward", 0, 3.0, 4.0)]) == 0.5


# ------------------------------------------------------------------------------------------------ context parallel
@pytest.mark.slow
def test_short_context_parallel_sequences_pad_themselves():
    """Sequences shorter than cp x cp_block_size (here ~60 tokens, cp 2, blocks of 128) train exactly like one
    process; the padding is inert."""
    from lightning_mm.parallel.context import pad_for_context_parallel
    from tests.helpers.pipeline_case import build_model, global_batches, run_rank, run_reference

    model = build_model(("vision",), "llm")
    batch = global_batches(model, 1, 2)[0]
    assert batch["input_ids"].shape[1] < 256
    padded = pad_for_context_parallel(batch, 2, 128)
    assert padded["input_ids"].shape[1] == 256 and padded["bam"][:, batch["bam"].shape[1]:].eq(0).all()
    assert padded["labels"][:, batch["labels"].shape[1]:].eq(-100).all()
    assert pad_for_context_parallel(batch, 2, 16) is batch  # long enough: untouched
    with pytest.raises(ValueError, match="cp_block_size >= 1"):
        pad_for_context_parallel(batch, 2, 0)

    steps, rows = 2, 4
    ref_losses, ref_params = run_reference(("vision",), "llm", steps, rows)
    results = run_distributed(run_rank, 3, ("vision",), "llm", (1,), 1, "parallel", 2, steps, rows, "ee", 0.5, 2,
                              "lpt", 128)
    merged = {}
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        merged.update(params)
    for name, p in ref_params.items():
        torch.testing.assert_close(merged[name], p, rtol=1e-4, atol=1e-6)
