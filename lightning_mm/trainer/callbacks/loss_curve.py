"""LossCurve: at the end of ``fit``, rank 0 draws the training (and validation) loss to ``loss.png`` in the run's
log folder, beside Lightning's ``metrics.csv`` (``lightning-mm fit`` adds it; matplotlib is the ``plots`` extra)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


class LossCurve(pl.Callback):
    """Records ``train/loss`` of every optimizer step and ``val/loss`` of every validation, and writes
    ``<trainer.log_dir>/<filename>`` at the end of fit (the folder is resolved in ``setup`` on every rank, since
    ``trainer.log_dir`` is a collective under a multi-process strategy). ``points[name] = [(step, loss), ...]``."""

    def __init__(self, filename: str = "loss.png"):
        self.filename = filename
        self.points: dict[str, list[tuple[int, float]]] = {"train/loss": [], "val/loss": []}
        self.path: Path | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self.path = Path(trainer.log_dir or trainer.default_root_dir) / self.filename

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if trainer.is_global_zero and loss is not None:
            self.points["train/loss"].append((trainer.global_step, float(loss)))

    def on_validation_epoch_end(self, trainer, pl_module):
        value = trainer.callback_metrics.get("val/loss")
        if trainer.is_global_zero and value is not None and not trainer.sanity_checking:
            self.points["val/loss"].append((trainer.global_step, float(value)))

    def on_fit_end(self, trainer, pl_module):
        if trainer.is_global_zero and self.path is not None and self.points["train/loss"]:
            try:
                write_loss_png(self.points, self.path)
            except ImportError:
                rank_zero_warn("LossCurve: matplotlib is not installed (pip install 'lightning-mm[plots]'); no "
                               f"{self.filename} written")


def write_loss_png(points: dict[str, list[tuple[int, float]]], path: Path) -> Path:
    """One line per series: loss (mean cross-entropy per label token, nats) against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, series in points.items():
        if series:
            steps, values = zip(*series)
            ax.plot(steps, values, marker="o" if name.startswith("val") else None, markersize=3, linewidth=1.2,
                    label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per label token)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
