"""StepProgressBar: Lightning's RichProgressBar showing what bounds the run.

Lightning's bar counts the batches of the current epoch and describes a run bounded by ``max_steps`` alone as
``Epoch 0/-2`` (``max_epochs`` is -1 there), and the Rich columns print the logger's integer version as a float
(``v_num: 0.000``). This bar counts optimizer steps against ``max_steps`` across epochs when ``max_steps`` is set
(``Epoch 0 · steps ━━━━ 12/30``), names an epoch bound only when there is one (``Epoch 1/4``), and prints the
version as it is (``v_num: 0``). Everything else (validation bars, metrics, theme) is RichProgressBar's.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training bar shows optimizer steps of ``max_steps`` (when set) and whose
    description carries only real bounds. Takes RichProgressBar's arguments (``refresh_rate``, ``leave``,
    ``theme``, ``console_kwargs``)."""

    def _counts_steps(self) -> bool:
        max_steps = self.trainer.max_steps
        return max_steps is not None and max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        """``max_steps`` when it bounds the run (the bar's total); else the epoch's batches, as Lightning's."""
        if self._counts_steps():
            return self.trainer.max_steps
        return super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        text = f"Epoch {current_epoch}"
        if max_epochs is not None and max_epochs >= 0:  # -1: no epoch bound (max_steps or time bounds the run)
            text += f"/{max_epochs - 1}"
        if self._counts_steps():
            text += " · steps"
        if len(self.validation_description) > len(text):  # as Lightning pads it, against flicker
            text = f"{text:{len(self.validation_description)}}"
        return text

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self._counts_steps():  # a new epoch goes on from the steps already taken
            self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._counts_steps():
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:  # resumed mid-epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        if isinstance(items.get("v_num"), int):  # the Rich columns format numbers as floats
            items["v_num"] = str(items["v_num"])
        return items


__all__ = ["StepProgressBar"]
