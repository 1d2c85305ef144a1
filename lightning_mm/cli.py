"""``lightning-mm``: LightningCLI for MultimodalLightningModule (fit/validate/...), every argument YAML-settable."""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_mm  # noqa: F401  (registers the attention and the strategy)


EXTRA_COMMANDS = {
    "plan": "Predict a fit YAML's iteration time, bubbles and memory per stage, and search the best layout for N "
            "devices (lightning-mm plan --help).",
    "export": "Write a checkpoint as HuggingFace folders loadable with from_pretrained (lightning-mm export --help).",
}


class MultimodalCLI(LightningCLI):
    """LightningCLI in subclass mode: ``model`` and ``data`` take any LightningModule / LightningDataModule as
    ``class_path`` + ``init_args``; a ``model`` section without ``class_path`` means MultimodalLightningModule,
    a missing ``data`` section the synthetic data. ``--empty_init true`` builds everything on the meta device, as
    ``trainer.init_module(empty_init=True)`` does in Python: under MultimodalParallelStrategy each rank then
    materialises (or reads from the model's folders) only its own stage."""

    def __init__(self, *args, **kwargs):
        super().__init__(pl.LightningModule, pl.LightningDataModule, *args, subclass_mode_model=True,
                         subclass_mode_data=True, **kwargs)

    def _add_subcommands(self, parser, **kwargs) -> None:
        """Lightning's fit/validate/test/predict, plus a help line each for ``plan`` and ``export`` (``main``
        routes those two before LightningCLI parses anything)."""
        from jsonargparse import ArgumentParser

        super()._add_subcommands(parser, **kwargs)
        for name, text in EXTRA_COMMANDS.items():
            parser._subcommands_action.add_subcommand(name, ArgumentParser(description=text), help=text)

    def parse_arguments(self, parser, args) -> None:
        with warnings.catch_warnings():  # plan / export / main pass args taken from sys.argv on purpose
            warnings.filterwarnings("ignore", message=".*args parameter is intended")
            super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"model": {"class_path": "lightning_mm.module.MultimodalLightningModule"},
                             "data": {"class_path": "lightning_mm.data.synthetic.SyntheticMultimodalDataModule"}})
        parser.add_argument("--empty_init", type=bool, default=False,
                            help="build the model on the meta device; each rank of MultimodalParallelStrategy "
                                 "materialises only its stage (needs that strategy)")

    def instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if not config.get("empty_init"):
            return super().instantiate_classes()
        with torch.device("meta"):
            super().instantiate_classes()
        from lightning_mm.strategy import MultimodalParallelStrategy

        if not isinstance(self.trainer.strategy, MultimodalParallelStrategy):
            raise ValueError(f"--empty_init builds the model on the meta device, which only MultimodalParallelStrategy "
                             f"materialises (per stage); the trainer's strategy is "
                             f"{type(self.trainer.strategy).__name__}: set trainer.strategy to "
                             "lightning_mm.MultimodalParallelStrategy (or 'multimodal'), or drop --empty_init")


def main(args: list[str] | None = None) -> None:
    """Entry point: ``lightning-mm fit --config examples/tiny_vlm.yaml``; ``lightning-mm plan --config ...``;
    ``lightning-mm export --config ... --ckpt_path ... --out_dir ...``."""
    from_argv = args is None
    args = sys.argv[1:] if args is None else args
    if args[:1] == ["plan"]:  # the planner's report, not a Trainer run (lightning_mm/planner/plan_cli.py)
        from lightning_mm.planner.plan_cli import main as plan

        return plan(args[1:])
    if args[:1] == ["export"]:  # a checkpoint as HF folders (lightning_mm/checkpoint.py)
        from lightning_mm.checkpoint import export_main

        return export_main(args[1:])
    from lightning_mm.callbacks import LossCurve

    # args=None when they come from sys.argv: LightningCLI warns when given both
    MultimodalCLI(args=None if from_argv else args, save_config_kwargs={"overwrite": True},
                  trainer_defaults={"callbacks": [LossCurve()]})  # fit writes loss.png beside metrics.csv


if __name__ == "__main__":
    main()
