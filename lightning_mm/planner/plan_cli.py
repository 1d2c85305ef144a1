"""``lightning-mm plan --config <yaml> [--devices N] [--profile costs.json]``: what the strategy of a YAML will
run (stages, layers, forward + backward per stage, predicted iteration time and bubbles) and what the
auto-parallel search would pick on N devices, with timeline PNGs and Chrome traces.

The YAML is the one ``lightning-mm fit`` takes (parsed by LightningCLI with ``run=False``, nothing launches).
Costs are per microbatch of the configured data module's first batch: FLOPs counted on the real layers, shown
in GFLOP (or seconds with ``--device-flops``), or seconds from ``--profile`` (write one for this machine with
``--write-profile``).
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

from lightning_mm.parallel.schedule import LANGUAGE_MODEL
from lightning_mm.planner.costs import save_profile
from lightning_mm.planner.model_costs import model_layer_costs, model_memory, profile_model
from lightning_mm.planner.search import ModuleSpec, Plan, evaluate_plan, plan_summary, search
from lightning_mm.planner.simulator import chrome_trace, timeline_png


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lightning-mm plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, action="append", help="the fit YAML (repeatable, as for fit)")
    p.add_argument("--devices", type=int, default=None, help="device budget of the search (default: the YAML's)")
    p.add_argument("--profile", default=None, help="JSON profile (seconds per part) instead of FLOP counts")
    p.add_argument("--write-profile", default=None, help="profile this model's parts on this machine to this JSON")
    p.add_argument("--device-flops", type=float, default=None, help="FLOP/s per device: show FLOP costs in seconds")
    p.add_argument("--memory-limit", type=float, default=math.inf, help="bytes per device for the search")
    p.add_argument("--allreduce-bandwidth", type=float, default=math.inf,
                   help="bytes/s per device for the data-parallel gradient all-reduce (default: free)")
    p.add_argument("--out", default="plan", help="folder for the timeline PNGs and Chrome traces")
    return p.parse_args(argv)


def load_config(configs: list[str]):
    """(MultimodalLightningModule, data module, trainer) of a fit YAML, instantiated but not run."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_mm.data.synthetic import SyntheticMultimodalDataModule
    from lightning_mm.module import MultimodalLightningModule

    args = [a for c in configs for a in ("--config", c)]
    with warnings.catch_warnings():  # "args and sys.argv both given": argv here is plan's own
        warnings.filterwarnings("ignore", message=".*args parameter is intended")
        cli = LightningCLI(MultimodalLightningModule, SyntheticMultimodalDataModule, subclass_mode_data=True, args=args,
                           run=False, save_config_callback=None)
    return cli.model, cli.datamodule, cli.trainer


def first_microbatch(module, datamodule, trainer, num_microbatches: int) -> dict:
    """Microbatch 0 of the data module's first training batch (the unit the simulator costs)."""
    from lightning_mm.data.microbatch import split_microbatches

    trainer.strategy.connect(module)
    datamodule.trainer = trainer
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    return split_microbatches(batch, num_microbatches, module.model)[0]


def module_specs(model, costs: dict, scale: float, batch: dict, recompute: bool = False) -> dict[str, ModuleSpec]:
    """Planner input per module: layer costs (scaled to the display unit), model-state bytes, activation
    bytes per in-flight microbatch and gradient bytes per layer, measured on ``batch``."""
    from lightning_mm.planner.costs import LayerCost

    memory = model_memory(model, batch, recompute)
    specs = {}
    for module, layer_costs in costs.items():
        scaled = [LayerCost(c.forward * scale, c.backward * scale, c.trainable, c.in_backward) for c in layer_costs]
        specs[module] = ModuleSpec(scaled, *memory[module])
    return specs


def configured_plan(model, strategy, specs: dict[str, ModuleSpec], devices: int,
                    memory_limit: float = math.inf, allreduce_bandwidth: float = math.inf) -> Plan:
    """The strategy's own layout and partition, simulated."""
    from lightning_mm.parallel.layout import ParallelSpec, build_layout
    from lightning_mm.parallel.stages import resolve_partition

    enc_specs = strategy.encoder_specs if strategy.encoder_specs is not None else {
        e: ParallelSpec() for e in model.encoders}
    layout = build_layout(enc_specs, strategy.language_model_spec, devices, strategy.encoder_placement,
                          list(model.encoders))
    layers = resolve_partition(model, layout.module_stages, strategy.partition, strategy.activation_checkpointing)
    return evaluate_plan(specs, layers, layout.placement, strategy.num_microbatches * layout.dp, layout.dp,
                         memory_limit=memory_limit, allreduce_bandwidth=allreduce_bandwidth)


def strategy_yaml(plan: Plan) -> str:
    """The fit-YAML lines that run ``plan``: trainer devices and the strategy's specs, placement, microbatches
    per replica and the planned boundaries (the search already timed them)."""
    import yaml

    spec = lambda pp: {"class_path": "lightning_mm.ParallelSpec", "init_args": {"pp": pp}}  # noqa: E731
    pp = plan.pp()
    args = {"encoders": {m: spec(n) for m, n in pp.items() if m != LANGUAGE_MODEL},
            "language_model": spec(pp[LANGUAGE_MODEL]), "encoder_placement": plan.placement,
            "num_microbatches": plan.microbatches_per_replica, "partition": {m: list(v) for m, v in plan.layers.items()}}
    doc = {"trainer": {"devices": plan.devices,
                       "strategy": {"class_path": "lightning_mm.MultimodalParallelStrategy", "init_args": args}}}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)


def _write(plan: Plan, out: Path, name: str, unit: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png, trace = out / f"{name}.png", out / f"{name}.trace.json"
    chrome_trace(plan.result, trace)  # one trace second = one cost unit (s or GFLOP)
    try:
        timeline_png(plan.result, png, title=f"{name}: iteration {plan.iteration_time:.4g} {unit}")
    except ImportError as err:
        print(f"(no PNG: {err})")
        return [trace]
    return [png, trace]


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    module, datamodule, trainer = load_config(args.config)
    strategy, model = trainer.strategy, module.model
    if not hasattr(strategy, "encoder_placement"):
        raise SystemExit("the YAML's trainer.strategy is not lightning_mm.MultimodalParallelStrategy; plan needs it")
    profile = args.profile or args.write_profile or getattr(strategy.partition, "profile", None)
    if math.isfinite(args.allreduce_bandwidth) and not (profile or args.device_flops):
        raise SystemExit("--allreduce-bandwidth needs costs in seconds: add --device-flops (FLOP/s per device) "
                         "or --profile / --write-profile")
    mb = first_microbatch(module, datamodule, trainer, strategy.num_microbatches)
    if args.write_profile:
        save_profile(profile_model(model), args.write_profile, meta={"config": args.config})
        print(f"wrote {args.write_profile}")
    recompute = strategy.activation_checkpointing
    costs = model_layer_costs(model, profile, batch=mb, recompute=recompute)
    if profile:
        unit, scale = "s", 1.0
    elif args.device_flops:
        unit, scale = "s", 1.0 / args.device_flops
    else:
        unit, scale = "GFLOP", 1e-9
    specs = module_specs(model, costs, scale, mb, recompute)
    devices = trainer.num_devices * trainer.num_nodes
    out = Path(args.out)
    source = f"profile {profile}" if profile else "FLOPs counted on the real layers"
    print(f"costs per microbatch in {unit} ({source})\n")
    mine = configured_plan(model, strategy, specs, devices, args.memory_limit, args.allreduce_bandwidth)
    files = _write(mine, out, "configured", unit)
    print(plan_summary(mine, f"configured: {devices} devices, placement={mine.placement}, dp={mine.dp}, "
                             f"partition={strategy.partition!r}"))
    budget = args.devices or devices
    best = search(specs, budget, mine.microbatches_per_replica * mine.dp, args.memory_limit,
                  allreduce_bandwidth=args.allreduce_bandwidth).best
    files += _write(best, out, "auto", unit)
    print()
    print(plan_summary(best, f"auto search on {budget} devices: placement={best.placement}, dp={best.dp}, "
                             f"pp={best.pp()}"))
    print(f"\nconfigured / auto predicted iteration time: {mine.iteration_time / best.iteration_time:.3f}x")
    print(f"\nto run the auto plan, put this in the fit YAML (the data module's batch_size is per replica: keep "
          f"batch_size x dp the same for the same global batch; dp = {best.dp}):\n")
    print(strategy_yaml(best))
    print("wrote " + ", ".join(str(f) for f in files))
