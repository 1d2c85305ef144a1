"""Training metrics of MultimodalLightningModule: global throughput, MFU and pipeline bubbles (torchmetrics).

``train/tokens_per_s``: label tokens (tokens that carry a loss) per second of wall time, summed over every
data-parallel replica, i.e. the whole job's figure, not one rank's. Under MultimodalParallelStrategy every rank of
a replica sees the same batch, so exactly one rank per replica (its last LLM stage, CP rank 0) counts its tokens;
without the strategy every process is a replica. The time is the wall time between batch ends (data loading
included), the longest over ranks, over the batches since the last logging step (the value logged at a logging
step covers the whole interval; between them the progress bar shows the interval so far).

``train/mfu``: model FLOPs per second over ``world size x peak_flops``. Model FLOPs come from the planner's FLOP
model (`lightning_mm.planner.model_costs.model_layer_costs`: FLOPs counted by torch on the real layers of a
fixed synthetic sample, frozen-aware, so a frozen encoder costs its forward only), computed once before the
model is cut into stages and scaled linearly to each batch's tokens (LLM: sequence tokens incl. padding;
encoder: the tokens it emits). Recomputation under activation checkpointing is not model FLOPs and is not
counted; attention's quadratic term is scaled linearly, so long sequences are under-counted. A model built on the
meta device has no real layers to count before it is cut into stages: MFU is then not logged (a warning says
so). ``peak_flops`` is
per device; by default Lightning's table of GPU peaks for the training precision is used, and on CPU (no
table) the metric is omitted unless ``peak_flops`` is given.

``pipeline/bubble/<stage>``: per stage, the fraction of this step's schedule time a rank spent outside forward
and backward compute (waiting on peers, sending), averaged over the stage's ranks; logged every
``bubble_every_n_steps`` optimizer steps (default: at every logging step).

Both figures are torchmetrics `Metric` s whose states are reduced over all processes when logged.
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchmetrics import Metric

LANGUAGE_MODEL = "language_model"


class GlobalThroughput(Metric):
    """Label tokens and model FLOPs per second of the whole job: states summed over processes (each adds its
    share), seconds reduced by max."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("flops", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("seconds", torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")

    def update(self, tokens: float, flops: float, seconds: float) -> None:
        self.tokens += float(tokens)
        self.flops += float(flops)
        self.seconds += float(seconds)

    def compute(self) -> dict[str, torch.Tensor]:
        seconds = self.seconds.clamp_min(1e-12)
        return {"tokens_per_s": self.tokens / seconds, "flops_per_s": self.flops / seconds}


class FlopModel:
    """Model FLOPs (forward + backward, frozen-aware, no recompute) of a batch, from the planner's per-layer
    FLOP counts on a synthetic sample, scaled per module to the batch's tokens."""

    def __init__(self, model):
        from lightning_mm.planner.model_costs import model_layer_costs, sample_batch

        sample = sample_batch(model)
        costs = model_layer_costs(model, None, batch=sample)
        self.placeholder_ids = dict(model.placeholder_ids)
        counts = self.tokens(sample["input_ids"])
        self.per_token = {m: sum(c.forward + c.backward for c in layers) / max(counts[m], 1)
                          for m, layers in costs.items()}

    def tokens(self, input_ids: torch.Tensor) -> dict[str, int]:
        out = {LANGUAGE_MODEL: input_ids.numel()}
        for m, pid in self.placeholder_ids.items():
            out[m] = int((input_ids == pid).sum())
        return out

    def __call__(self, batch: dict) -> float:
        counts = self.tokens(batch["input_ids"])
        return float(sum(self.per_token.get(m, 0.0) * n for m, n in counts.items()))


def peak_device_flops(trainer) -> float | None:
    """Lightning's table of peak FLOP/s for the root device at the training precision (None on CPU / unknown)."""
    try:
        from lightning.fabric.utilities.throughput import get_available_flops
        from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

        device = trainer.strategy.root_device
        if device.type == "cpu":
            return None
        flops = get_available_flops(device, _plugin_to_compute_dtype(trainer.precision_plugin))
        return float(flops) if flops else None
    except Exception:  # noqa: BLE001  (an unknown device: no MFU rather than a failed run)
        return None


def rank_bubble(timings: list[tuple[str, int, float, float]]) -> float:
    """1 - (forward + backward time) / (first action start -> last action end) of one rank's step."""
    if not timings:
        return 0.0
    span = max(t[3] for t in timings) - min(t[2] for t in timings)
    busy = sum(t[3] - t[2] for t in timings if t[0] in ("forward", "backward"))
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def stage_bubbles(layout, timings, rank: int, world: int, device=None) -> dict[str, float]:
    """Every stage's bubble fraction of a step (mean over its ranks; ``timings``: this rank's, from the step's
    ``StepResult``): one all-reduce of ``world`` numbers; call on every rank."""
    import torch.distributed as dist

    values = torch.zeros(world, dtype=torch.float64, device=device)
    values[rank] = rank_bubble(timings)
    if dist.is_available() and dist.is_initialized() and world > 1:
        dist.all_reduce(values)
    out: dict[str, list[float]] = {}
    for r, v in enumerate(values.tolist()):
        out.setdefault(layout.coordinate(r).stage, []).append(v)
    return {s: sum(v) / len(v) for s, v in out.items()}


class TrainingMetrics(nn.Module):
    """What MultimodalLightningModule logs besides the loss (see the module docstring): call ``prepare`` in
    ``setup`` (before the strategy cuts the model), ``batch_start`` / ``batch_end`` in the batch hooks."""

    def __init__(self, peak_flops: float | None = None, bubble_every_n_steps: int | None = None):
        super().__init__()
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0 FLOP/s per device, got {peak_flops}")
        if bubble_every_n_steps is not None and bubble_every_n_steps < 0:
            raise ValueError(f"bubble_every_n_steps must be >= 0 (0: never), got {bubble_every_n_steps}")
        self.peak_flops, self.bubble_every_n_steps = peak_flops, bubble_every_n_steps
        self.throughput = GlobalThroughput()
        self.flop_model: FlopModel | None = None
        self._peak: float | None = None
        self._last: float | None = None

    def prepare(self, module, stage: str | None = None) -> None:
        """Resolve the peak FLOP/s and, when MFU can be computed, the FLOP model of the whole (uncut) model."""
        if stage not in (None, "fit") or module.attached_trainer is None:
            return
        self._peak = self.peak_flops if self.peak_flops is not None else peak_device_flops(module.trainer)
        if self._peak is None or self.flop_model is not None:
            return
        if any(p.is_meta for p in module.model.parameters()):
            rank_zero_warn("train/mfu is not logged: the model was built on the meta device, and the planner's FLOP "
                           "model counts FLOPs on real layers (build it eagerly, e.g. "
                           "trainer.init_module(empty_init=False), to log MFU)")
            self._peak = None
            return
        self.flop_model = FlopModel(module.model)

    def batch_start(self) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    @staticmethod
    def _counts_tokens(module) -> bool:
        """One rank per replica counts the replica's batch (every rank when each process is a replica); under
        per-module data parallelism one rank per group counts the group's batch."""
        strategy = module.pipeline
        if strategy is None or strategy.engine is None:
            return True
        layout, coord = strategy.layout, strategy.engine.coord
        first = not layout.per_module_dp or coord.dp % layout.per_group(layout.chain_of(coord.stage)) == 0
        return coord.stage == layout.stages[-1] and coord.cp == 0 and first

    def batch_end(self, module, batch: dict) -> None:
        from lightning_mm.loss import count_label_tokens

        trainer = module.trainer
        now = time.perf_counter()
        seconds, self._last = now - (self._last if self._last is not None else now), now
        mine = self._counts_tokens(module)
        tokens = float(count_label_tokens(batch["labels"])) if mine else 0.0
        flops = self.flop_model(batch) if (mine and self.flop_model is not None) else 0.0
        self.throughput.update(tokens, flops, seconds)
        value = self.throughput.compute()  # every rank, every batch: a small all-gather of three numbers
        module.log("train/tokens_per_s", value["tokens_per_s"].float(), prog_bar=True)
        if self._peak is not None and self.flop_model is not None:
            module.log("train/mfu", (value["flops_per_s"] / (trainer.world_size * self._peak)).float())
        if trainer._logger_connector.should_update_logs:  # the same on every rank; a new window starts
            self.throughput.reset()
        self._log_bubbles(module)

    def _log_bubbles(self, module) -> None:
        strategy, trainer = module.pipeline, module.trainer
        if strategy is None or strategy.engine is None or self.bubble_every_n_steps == 0:
            return
        if self.bubble_every_n_steps is None:
            due = trainer._logger_connector.should_update_logs
        else:
            due = (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % self.bubble_every_n_steps == 0
        if not due:
            return
        bubbles = stage_bubbles(strategy.layout, strategy.last_step.timings, trainer.global_rank, trainer.world_size,
                                device=strategy.root_device if strategy.process_group_backend == "nccl" else None)
        module.log_dict({f"pipeline/bubble/{s}": v for s, v in bubbles.items()}, rank_zero_only=True)
