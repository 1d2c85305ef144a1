"""``lightning-mm``: LightningCLI for MultimodalLightningModule (fit/validate/...), every argument YAML-settable."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_mm  # noqa: F401  (registers the attention and the strategy)
from lightning_mm.fault_tolerance import FaultTolerance

# Lightning 2.6's own pytree helper builds torch's deprecated LeafSpec on every fit: nothing a user can change
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        module=r"lightning\.pytorch\.utilities\._pytree")


EXTRA_COMMANDS = {
    "plan": "Predict a fit YAML's iteration time, bubbles and memory per stage, and search the best layout for N "
            "devices (lightning-mm plan --help).",
    "export": "Write a checkpoint as HuggingFace folders loadable with from_pretrained (lightning-mm export --help).",
    "lighthouse": "Run the torchft quorum service of fault-tolerant replica groups (lightning-mm lighthouse --help; "
                  "docs/fault_tolerance.md).",
    "agent": "Run one node's agent: it chooses the replica group whose rendezvous this node's torchrun joins, so "
             "that nodes move between groups (lightning-mm agent --help; docs/fault_tolerance.md).",
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
        """Lightning's fit/validate/test/predict, plus a help line each for ``plan``, ``export`` and
        ``lighthouse`` (``main`` routes those before LightningCLI parses anything)."""
        from jsonargparse import ArgumentParser

        super()._add_subcommands(parser, **kwargs)
        for name, text in EXTRA_COMMANDS.items():
            parser._subcommands_action.add_subcommand(name, ArgumentParser(description=text), help=text)

    def parse_arguments(self, parser, args) -> None:
        with warnings.catch_warnings():  # plan / export / main pass args taken from sys.argv on purpose
            warnings.filterwarnings("ignore", message=".*args parameter is intended")
            super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"model": {"class_path": "lightning_mm.trainer.module.MultimodalLightningModule"},
                             "data": {"class_path": "lightning_mm.data.synthetic.SyntheticMultimodalDataModule"}})
        parser.add_argument("--empty_init", type=bool, default=False,
                            help="build the model on the meta device; each rank of MultimodalParallelStrategy "
                                 "materialises only its stage (needs that strategy)")
        if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
            # torchrun --nnodes MIN:MAX: the nodes of this (re)start (Lightning rejects a num_nodes that differs)
            nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
            parser.set_defaults({"trainer.num_nodes": nodes})
        parser.add_argument("--fault_tolerance", type=Optional[FaultTolerance], default=None,
                            help="torchft replica groups (docs/fault_tolerance.md): MultimodalParallelStrategy's "
                                 "fault_tolerance, e.g. --fault_tolerance.lighthouse host:29510")

    def before_instantiate_classes(self) -> None:
        """``--fault_tolerance.*`` becomes the strategy's ``fault_tolerance`` argument."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        ft = config.get("fault_tolerance")
        if ft is None:
            return
        strategy = config.get("trainer", {}).get("strategy")
        if "MultimodalParallelStrategy" not in str(getattr(strategy, "class_path", "")):
            raise ValueError(f"--fault_tolerance sets MultimodalParallelStrategy's fault_tolerance, but "
                             f"trainer.strategy is {strategy!r}; give --trainer.strategy "
                             "lightning_mm.MultimodalParallelStrategy (its class_path form, as the examples do)")
        strategy.init_args.fault_tolerance = ft

    def instantiate_trainer(self, **kwargs):
        """Lightning's, except that ``trainer.logger`` left at its default without TensorBoard installed gets the
        ``CSVLogger`` Lightning falls back to there, named here (so no warning about tensorboardX): metrics go to
        ``<default_root_dir>/lightning_logs/version_N/metrics.csv`` as before. A replica group of a fault-tolerant
        job logs to ``lightning_logs/group_<g>/version_N`` (groups on one host would share the folder)."""
        config = self.config_init
        trainer = config.get(str(self.subcommand), config).get("trainer", {})
        if "logger" in kwargs or trainer.get("logger") not in (None, True):
            return super().instantiate_trainer(**kwargs)
        ft = getattr(trainer.get("strategy"), "fault_tolerance", None)
        name = "lightning_logs" if ft is None else os.path.join("lightning_logs", f"group_{ft.replica_group}")
        save_dir = trainer.get("default_root_dir") or os.getcwd()
        if not (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")):
            from lightning.pytorch.loggers import CSVLogger

            kwargs["logger"] = CSVLogger(save_dir=save_dir, name=name)
        elif ft is not None:
            from lightning.pytorch.loggers import TensorBoardLogger

            kwargs["logger"] = TensorBoardLogger(save_dir=save_dir, name=name)
        return super().instantiate_trainer(**kwargs)

    def instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if not config.get("empty_init"):
            return super().instantiate_classes()
        with torch.device("meta"):
            super().instantiate_classes()
        from lightning_mm.trainer.strategy import MultimodalParallelStrategy

        if not isinstance(self.trainer.strategy, MultimodalParallelStrategy):
            raise ValueError(f"--empty_init builds the model on the meta device, which only MultimodalParallelStrategy "
                             f"materialises (per stage); the trainer's strategy is "
                             f"{type(self.trainer.strategy).__name__}: set trainer.strategy to "
                             "lightning_mm.MultimodalParallelStrategy (or 'multimodal'), or drop --empty_init")


def load_fit_config(configs: list[str], extra: list[str] = ()):
    """(LightningModule, data module, trainer) of fit YAML(s), instantiated as ``lightning-mm fit`` would, not run
    (what ``plan`` and ``export`` start from)."""
    args = [a for cfg in configs for a in ("--config", cfg)] + list(extra)
    cli = MultimodalCLI(run=False, args=args, save_config_callback=None)
    return cli.model, cli.datamodule, cli.trainer


def plan_main(args: list[str]) -> None:
    """``lightning-mm plan --config cfg.yaml [...]``: the planner's report on a fit YAML
    (``lightning_mm.planner.plan_cli``)."""
    from lightning_mm.planner import plan_cli

    ns = plan_cli.parse_args(args)
    plan_cli.run(ns, *load_fit_config(ns.config))


def _configured_seed(configs: list[str]):
    """``seed_everything`` as the fit config(s) set it (the last one wins); None when absent."""
    import yaml

    seed = None
    for cfg in configs:
        with open(cfg) as f:
            data = yaml.safe_load(f) or {}
        if isinstance(data, dict) and "seed_everything" in data:
            seed = data["seed_everything"]
    return seed


def export_main(args: list[str]) -> None:
    """``lightning-mm export --config cfg.yaml [--config more.yaml] --ckpt_path CKPT --out_dir DIR``.

    The model is built from the fit config(s) (as ``lightning-mm fit`` built it), the checkpoint's parameters are
    copied in, and it is written by ``model.save_pretrained``: a model from a composite folder as one folder of
    that composite class, any other one part by part (``lightning_mm.model.hf_parts``). Parameters the checkpoint
    does not hold (frozen ones, unless trained with ``save_frozen_parameters=True``) keep the values the config
    builds, which are the trained run's only under the same fixed ``seed_everything``: without one the export
    refuses."""
    import argparse

    from lightning_mm.checkpoint import (CheckpointError, check_same_model, load_weights, model_fingerprint,
                                         read_layout)

    parser = argparse.ArgumentParser(prog="lightning-mm export",
                                     description="write a checkpoint as HF folders (encoders, projectors, LLM)")
    parser.add_argument("--config", required=True, action="append",
                        help="the fit config that built the model (repeat it as for fit: later ones override)")
    parser.add_argument("--ckpt_path", required=True, help="a lightning-mm checkpoint folder")
    parser.add_argument("--out_dir", required=True)
    ns = parser.parse_args(args)
    layout = read_layout(ns.ckpt_path)  # a bad checkpoint fails before the model is built
    module, _, _ = load_fit_config(ns.config, ["--trainer.logger=false"])
    model = module.model
    check_same_model(layout["parameters"], model_fingerprint(model), ns.ckpt_path)
    stored = {n for n in layout["parameters"] if n in layout["trainable"] or layout.get("frozen_saved")}
    rebuilt = [n for n, _ in model.named_parameters() if n not in stored]
    seed = _configured_seed(ns.config)
    if rebuilt and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise CheckpointError(
            f"{ns.ckpt_path} holds only the trainable parameters; the other {len(rebuilt)} (e.g. {rebuilt[0]}) come "
            f"from the model as the config builds it, and the config sets seed_everything={seed!r} (a random seed), "
            "so they would not be the ones the run trained with. Set seed_everything to the run's seed (in the "
            "config.yaml LightningCLI saved beside its logs, or its 'Seed set to N' line), or train with "
            "MultimodalParallelStrategy(save_frozen_parameters=True)")
    built = {n: p.detach().clone() for n, p in model.named_parameters() if n not in layout["trainable"]}
    load_weights(ns.ckpt_path, model)
    manifest = model.save_pretrained(ns.out_dir)  # a composite's folder, or one folder per part
    now = dict(model.named_parameters())
    differ = [n for n, v in built.items() if not torch.equal(v, now[n])]
    if differ:
        print(f"note: {len(differ)} frozen parameters in {ns.ckpt_path} (e.g. {differ[0]}) differ from the ones the "
              "config builds (another seed or base weights); the export has the checkpoint's", file=sys.stderr)
    if "composite" in manifest:
        print(f"exported the model as {manifest['composite']} to {ns.out_dir}")
        return
    print(f"exported {', '.join(manifest['encoders'])} (encoders and projectors) and the language model "
          f"({manifest['language_model']['class']}) to {ns.out_dir}")


VERBOSE_ENV = "LMM_VERBOSE"  # LMM_VERBOSE=1: a recognised bad input prints its traceback too (as --verbose does)


def input_error_types() -> tuple[type[BaseException], ...]:
    """The errors of bad input that the command line reports in one message (they name the problem and the fix):
    a model folder, a rank layout the devices cannot hold, a data file or record, a checkpoint."""
    from lightning_mm.checkpoint import CheckpointError
    from lightning_mm.data.conversation import BadRecordError
    from lightning_mm.data.records import DataFileError
    from lightning_mm.model.loading import ModelFolderError
    from lightning_mm.plan.layout import LayoutError

    return ModelFolderError, LayoutError, DataFileError, BadRecordError, CheckpointError


def input_error(err: BaseException) -> BaseException | None:
    """The recognised bad-input error in ``err``'s chain (jsonargparse wraps an error raised while it builds the
    YAML's objects in its own ValueError, with the original as ``__cause__``); None when there is none. Only
    ``__cause__`` is followed: an error raised while handling another (``__context__``) is a failure of its own."""
    types, seen = input_error_types(), set()
    while err is not None and id(err) not in seen:
        if isinstance(err, types):
            return err
        seen.add(id(err))
        err = err.__cause__
    return None


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def report_input_error(command: str, err: BaseException) -> None:
    """One message on stderr for a recognised bad input, without the traceback (``--verbose`` keeps it)."""
    rank = os.environ.get("LOCAL_RANK", "0")
    who = " ".join(["lightning-mm", command] if command else ["lightning-mm"])
    who += f" (local rank {rank})" if rank != "0" else ""
    sys.stderr.write(f"{who}: error: {err}\n(--verbose or {VERBOSE_ENV}=1 prints the traceback)\n")
    sys.stderr.flush()


def outputs_line(trainer) -> str | None:
    """Where ``fit`` wrote its outputs: the log folder and the files in it (metrics.csv, loss.png, config.yaml),
    and the checkpoint folder. Reads no collective (rank 0 calls it alone); None without a log folder."""
    from lightning_mm.trainer.callbacks import LossCurve

    folder = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
    curve = next((c for c in trainer.callbacks if isinstance(c, LossCurve) and c.path is not None), None)
    if folder is None and curve is not None:
        folder = curve.path.parent
    if folder is None or not os.path.isdir(folder):
        return None
    files = sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))
    line = f"logs: {_shown(folder)}{os.sep} ({', '.join(files)})"
    ckpt = trainer.checkpoint_callback
    dirpath = getattr(ckpt, "dirpath", None)
    if dirpath and os.path.isdir(dirpath) and os.listdir(dirpath):
        line += f"; checkpoints: {_shown(dirpath)}{os.sep}"
    return line


def _shown(path) -> str:
    """``path`` relative to the working folder when it lies inside it, else absolute."""
    path = os.path.abspath(path)
    inside = os.path.relpath(path)
    return path if inside.startswith(os.pardir) else inside


def main(args: list[str] | None = None) -> None:
    """Entry point: ``lightning-mm fit --config examples/tiny_vlm.yaml``; ``lightning-mm plan --config ...``;
    ``lightning-mm export --config ... --ckpt_path ... --out_dir ...``.

    From the command line (``args`` None), a recognised bad input (``input_error_types``) ends the command with
    its one-line message and exit status 1; ``--verbose`` (anywhere in the arguments) or ``LMM_VERBOSE=1`` keeps
    the traceback. Called with ``args``, it raises as any function does."""
    from_argv = args is None
    args = list(sys.argv[1:] if args is None else args)
    if "--verbose" in args:
        args = [a for a in args if a != "--verbose"]
        os.environ[VERBOSE_ENV] = "1"  # the ranks Lightning starts inherit it
        if from_argv:
            sys.argv[1:] = args
    try:
        run_command(args, from_argv)
    except Exception as err:
        found = input_error(err) if from_argv and not verbose() else None
        if found is None:
            raise
        commands = ("fit", "validate", "test", "predict", *EXTRA_COMMANDS)
        report_input_error(next((a for a in args if a in commands), ""), found)
        raise SystemExit(1) from None


def run_command(args: list[str], from_argv: bool) -> None:
    """``lightning-mm <command>``: ``plan``, ``export`` and ``lighthouse`` here, the rest through LightningCLI;
    after ``fit``, rank 0 prints where the run's logs went."""
    if args[:1] == ["plan"]:  # the planner's report, not a Trainer run
        return plan_main(args[1:])
    if args[:1] == ["export"]:  # a checkpoint as HF folders
        return export_main(args[1:])
    if args[:1] == ["lighthouse"]:  # the torchft quorum service of fault-tolerant replica groups
        from lightning_mm.fault_tolerance import lighthouse_main

        return lighthouse_main(args[1:])
    if args[:1] == ["agent"]:  # the per-node agent that moves nodes between replica groups
        from lightning_mm.fault_tolerance.agent import agent_main

        raise SystemExit(agent_main(args[1:]))
    from lightning_mm.trainer.callbacks import LossCurve

    # args=None when they come from sys.argv: LightningCLI warns when given both
    cli = MultimodalCLI(args=None if from_argv else args, save_config_kwargs={"overwrite": True},
                        trainer_defaults={"callbacks": [LossCurve()]})  # fit writes loss.png beside metrics.csv
    if cli.subcommand == "fit" and cli.trainer.is_global_zero:
        line = outputs_line(cli.trainer)
        if line:
            print(line, flush=True)


if __name__ == "__main__":
    main()
