"""``lightning-mm``: LightningCLI for MultimodalLightningModule (fit/validate/...), every argument YAML-settable."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_mm  # noqa: F401  (registers the attention and the strategy)


class MultimodalCLI(LightningCLI):
    """LightningCLI in subclass mode: ``model`` and ``data`` take any LightningModule / LightningDataModule as
    ``class_path`` + ``init_args``; a ``model`` section without ``class_path`` means MultimodalLightningModule,
    a missing ``data`` section the synthetic data."""

    def __init__(self, *args, **kwargs):
        super().__init__(pl.LightningModule, pl.LightningDataModule, *args, subclass_mode_model=True,
                         subclass_mode_data=True, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"model": {"class_path": "lightning_mm.module.MultimodalLightningModule"},
                             "data": {"class_path": "lightning_mm.data.synthetic.SyntheticMultimodalDataModule"}})


def main(args: list[str] | None = None) -> None:
    """Entry point: ``lightning-mm fit --config examples/tiny_vlm.yaml``; ``lightning-mm plan --config ...``;
    ``lightning-mm export --config ... --ckpt_path ... --out_dir ...``."""
    args = sys.argv[1:] if args is None else args
    if args[:1] == ["plan"]:  # the planner's report, not a Trainer run (lightning_mm/planner/plan_cli.py)
        from lightning_mm.planner.plan_cli import main as plan

        return plan(args[1:])
    if args[:1] == ["export"]:  # a checkpoint as HF folders (lightning_mm/checkpoint.py)
        from lightning_mm.checkpoint import export_main

        return export_main(args[1:])
    MultimodalCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
