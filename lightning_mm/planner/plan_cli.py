"""``lightning-mm plan --config <yaml> [--devices N] [--profile costs.json]``: what the strategy of a YAML will
run (stages, layers, forward + backward per stage, predicted iteration time and bubbles) and what the
auto-parallel search would pick on N devices, with timeline PNGs and Chrome traces.

The YAML is the one ``lightning-mm fit`` takes (the CLI parses it with ``run=False``, nothing launches, and hands
the instantiated objects to ``run``).
Costs are per microbatch of the configured data module's first batch: FLOPs counted on the real layers, shown
in GFLOP (the timeline's axis is then work, not time; ``--device-flops`` turns them into ms), or seconds from
``--profile`` (write one for this machine with ``--write-profile``), shown in ms. Memory is in GiB, bandwidth in
GB/s. Files go to a new ``lightning_logs/plan_N`` beside the runs' ``version_N`` folders (``default_out``), or
``--out``.
``--data-stats`` reads the training data's metadata (no tensors), reports its encoder:LLM workload ratio and
Entrain's profiling batch size, and scales the costs to the data's mean work per sample
(``lightning_mm.planner.data_stats.plan_data_stats``), so both plans are timed on the data, not the first batch.
``--encoder-cp 1 2 4`` searches the encoders' context parallelism (items split over ranks, parallel placement);
its split is that of the first microbatch's items, or of microbatches drawn from the data with ``--data-stats``.
``--per-module-dp`` searches each module's own (dp, tp, pp) instead (DistTrain's orchestration,
``lightning_mm.planner.orchestration``; encoders on their own devices) and prints a YAML with ``dp`` on every spec.
A mixture-of-experts LLM is planned with its active parameters, its experts' memory at 1/ep per rank and the
all-to-all of expert parallelism (``--ep 1,2,4`` searches ep, default the YAML's ``language_model`` ep;
``--ep-bandwidth`` times the all-to-all; ``lightning_mm.planner.moe_costs``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_mm.plan.items import encoder_width
from lightning_mm.plan.schedule import LANGUAGE_MODEL
from lightning_mm.planner.costs import save_profile
from lightning_mm.planner.model_costs import model_layer_costs, model_memory, profile_model
from lightning_mm.planner.search import AttentionShape, ModuleSpec, Plan, cp_mode_label, encoder_cp_label, \
    evaluate_plan, search, stage_cp, stage_layers
from lightning_mm.planner.simulator import chrome_trace, timeline_png


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lightning-mm plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, action="append", help="the fit YAML (repeatable, as for fit)")
    p.add_argument("--devices", type=int, default=None, help="device budget of the search (default: the YAML's)")
    p.add_argument("--profile", default=None, help="JSON profile (seconds per part) instead of FLOP counts")
    p.add_argument("--write-profile", default=None, help="profile this model's parts on this machine to this JSON")
    p.add_argument("--device-flops", type=float, default=None,
                   help="FLOP/s per device: show FLOP costs as time (ms)")
    p.add_argument("--memory-limit", type=float, default=math.inf, help="GiB per device for the search")
    p.add_argument("--allreduce-bandwidth", type=float, default=math.inf,
                   help="GB/s per device for the data-parallel gradient all-reduce (default: free)")
    p.add_argument("--tp", default="1", help="tensor-parallel degrees the search tries, comma-separated (e.g. 1,2,4)")
    p.add_argument("--sharding", default="NO_SHARD",
                   help="sharding strategies the search tries, comma-separated (NO_SHARD,SHARD_GRAD_OP,FULL_SHARD)")
    p.add_argument("--tp-bandwidth", type=float, default=math.inf,
                   help="GB/s per device for tensor-parallel all-reduces (default: free; NVLink ~ 300-450)")
    p.add_argument("--cp", default=None,
                   help="context-parallel degrees of the LLM stages the search tries, comma-separated (default: the "
                        "YAML's language_model cp)")
    p.add_argument("--cp-mode", default=None,
                   help="CP modes the search tries, comma-separated (allgather,ulysses,hybrid; hybrid with every valid "
                        "Ulysses degree K; default: the YAML's cp_mode)")
    p.add_argument("--cp-bandwidth", type=float, default=math.inf,
                   help="GB/s per rank for context-parallel traffic: the LLM's attention and encoder CP's feature "
                        "gather (default: free)")
    p.add_argument("--encoder-cp", nargs="+", default=None,
                   help="context-parallel degrees of the encoders the search tries (items split over ranks; parallel "
                        "placement only), e.g. 1 2 4 or 1,2,4; every combination over the encoders (default: the "
                        "YAML's encoder cps)")
    p.add_argument("--ep", default=None,
                   help="expert-parallel degrees of a mixture-of-experts LLM the search tries, comma-separated (each "
                        "with every dp it divides; default: the YAML's language_model ep)")
    p.add_argument("--ep-bandwidth", type=float, default=math.inf,
                   help="GB/s per rank for expert parallelism's token all-to-all (default: free)")
    p.add_argument("--out", default=None,
                   help="folder for the timeline PNGs and Chrome traces (default: a new lightning_logs/plan_N, "
                        "beside the runs' version_N folders)")
    p.add_argument("--data-stats", action="store_true",
                   help="read the training data's metadata: report its encoder:LLM workload ratio and Entrain's "
                        "profiling batch size, and plan on the data's mean work per sample instead of the first batch")
    p.add_argument("--data-stats-samples", type=int, default=2000,
                   help="samples --data-stats reads (a seeded subset of larger data sets; default 2000)")
    p.add_argument("--per-module-dp", action="store_true",
                   help="search each module's own dp, tp (from --tp) and pp on --devices (DistTrain's per-module data "
                        "parallelism; encoder_placement parallel) and print a YAML with dp on every ParallelSpec")
    p.add_argument("--templates", action="store_true",
                   help="write Oobleck pipeline templates (one layout per node count n0 .. N - f x n0) to --out "
                        "(default lightning_logs/plan_N/templates.yaml); needs --nodes and --devices-per-node")
    p.add_argument("--nodes", type=int, default=None, help="with --templates: nodes of the cluster (N)")
    p.add_argument("--devices-per-node", type=int, default=None, help="with --templates: devices per node (M)")
    p.add_argument("--failures", type=int, default=1,
                   help="with --templates: simultaneous node failures to survive (f, default 1)")
    return p.parse_args(argv)


def first_microbatch(module, datamodule, trainer, num_microbatches: int) -> dict:
    """Microbatch 0 of the data module's first training batch (the unit the simulator costs)."""
    from lightning_mm.data.microbatch import split_microbatches

    trainer.strategy.connect(module)
    datamodule.trainer = trainer
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    return split_microbatches(batch, num_microbatches, module.model)[0]


def _attention_dims(cfg, heads: int) -> tuple[int, int]:
    """(KV heads, head size) of the LLM's attention layers; where a config gives them per layer
    (``per_layer_config``: Gemma 4's global layers have their own) the layer moving the most K/V bytes, an upper
    bound for the others (its config refuses one global ``head_dim``)."""
    per_layer = [(getattr(c, "num_key_value_heads", None) or heads, getattr(c, "head_dim", None))
                 for c in (getattr(cfg, "per_layer_config", None) or [])]
    if per_layer and all(d for _, d in per_layer):
        return max(per_layer, key=lambda kd: kd[0] * kd[1])
    return (getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)


def attention_shape(model, batch: dict) -> AttentionShape:
    """The LLM's attention as context parallelism moves it for ``batch``: tokens of the microbatch (rows x
    sequence; every term of the byte model is linear in them), heads, KV heads, head dim, parameter bytes, and
    the Gated DeltaNet layers and their heads (context parallelism splits them by heads, with all-to-alls)."""
    lm = model.language_model
    cfg = getattr(lm.config, "text_config", None) or lm.config
    heads = cfg.num_attention_heads
    kv_heads, head_dim = _attention_dims(cfg, heads)
    seq = batch.get("bam") if batch.get("bam") is not None else batch["input_ids"]
    dtype_bytes = next(lm.parameters()).element_size()
    from lightning_mm.model.linear_attention import LINEAR, layer_types

    ids = tuple(i for i, kind in enumerate(layer_types(lm.config)) if kind == LINEAR)
    linear = ({} if not ids else dict(
        linear_value_heads=cfg.linear_num_value_heads, linear_key_heads=cfg.linear_num_key_heads,
        linear_key_dim=cfg.linear_key_head_dim, linear_value_dim=cfg.linear_value_head_dim, linear_ids=ids))
    return AttentionShape(int(seq.numel()), heads, kv_heads, head_dim, dtype_bytes, **linear)


def module_specs(model, costs: dict, scale: float, batch: dict, recompute: bool = False,
                 microbatches: dict | None = None) -> dict[str, ModuleSpec]:
    """Planner input per module: layer costs (scaled to the display unit), model-state bytes, activation
    bytes per in-flight microbatch and gradient bytes per layer, measured on ``batch``; the LLM's attention
    shape (what context parallelism communicates); per encoder, the items encoder CP splits and the bytes of the
    features it gathers: those of ``batch``, or with ``microbatches`` (``DataStats.microbatches``: per encoder,
    microbatches of (encoder tokens, work, emitted tokens) items drawn from the data) theirs, the feature bytes at
    their mean emitted tokens."""
    from lightning_mm.planner.costs import LayerCost
    from lightning_mm.planner.data_stats import microbatch_items
    from lightning_mm.planner.moe_costs import expert_layer_bytes, expert_shape
    from lightning_mm.planner.workload import WorkloadModel

    memory = model_memory(model, batch, recompute)
    if microbatches is None:
        microbatches = {e: (tuple(items),) for e, items in
                        microbatch_items(model, WorkloadModel.from_model(model), batch).items()}
    lm = model.language_model
    cfg = getattr(lm.config, "text_config", None) or lm.config
    token_bytes = cfg.hidden_size * next(lm.parameters()).element_size()  # one projected feature token
    # (Qwen3-VL: and one block per DeepStack layer, packed beside it)
    specs = {}
    for module, layer_costs in costs.items():
        scaled = [LayerCost(c.forward * scale, c.backward * scale, c.trainable, c.in_backward) for c in layer_costs]
        if module == LANGUAGE_MODEL:
            expert_state, expert_grads = expert_layer_bytes(model)
            specs[module] = ModuleSpec(scaled, *memory[module], attention=attention_shape(model, batch),
                                       expert_bytes=expert_state, expert_grad_bytes=expert_grads,
                                       experts=expert_shape(model, batch))
            continue
        mbs = microbatches.get(module, ())
        emitted = sum(n for mb in mbs for _, _, n in mb) / max(1, len(mbs))
        specs[module] = ModuleSpec(scaled, *memory[module], items=[[(t, w) for t, w, _ in mb] for mb in mbs],
                                   item_width=encoder_width(model.encoders[module].config),
                                   feature_bytes=emitted * token_bytes * (1 + model.deepstack.get(module, 0)))
    return specs


def configured_plan(model, strategy, specs: dict[str, ModuleSpec], devices: int, memory_limit: float = math.inf,
                    allreduce_bandwidth: float = math.inf, tp_bandwidth: float = math.inf,
                    cp_bandwidth: float = math.inf, samples_per_microbatch: int = 1,
                    ep_bandwidth: float = math.inf) -> Plan:
    """The strategy's own layout and partition, simulated (with the largest tp of its stages, the LLM's CP
    degree and mode, its expert-parallel degree (all-to-all over ``ep_bandwidth``) and the encoders' CP degrees; with ``dp`` on the specs, each module's own dp and tp, an
    encoder's microbatch position holding LLM dp x ``samples_per_microbatch`` samples)."""
    from lightning_mm.plan.layout import ParallelSpec, build_layout, single_process_specs
    from lightning_mm.planner.model_costs import resolve_partition

    enc_specs = strategy.encoder_specs if strategy.encoder_specs is not None else {
        e: ParallelSpec() for e in model.pipeline_encoders}
    llm_spec, placement = strategy.language_model_spec, None
    if devices == 1:
        enc_specs, llm_spec, placement = single_process_specs(list(enc_specs))
    if llm_spec.dp is not None:  # per-module data parallelism: every module's own dp and tp
        return _configured_per_module(model, strategy, specs, enc_specs, memory_limit, allreduce_bandwidth,
                                      tp_bandwidth, cp_bandwidth, samples_per_microbatch)
    layout = build_layout(enc_specs, llm_spec, devices, placement or strategy.encoder_placement,
                          model.pipeline_encoders)
    layers = resolve_partition(model, layout.module_stages, strategy.partition, strategy.activation_checkpointing)
    return evaluate_plan(specs, layers, layout.placement, strategy.num_microbatches * layout.dp, layout.dp,
                         memory_limit=memory_limit, allreduce_bandwidth=allreduce_bandwidth,
                         tp=max(layout.tp.values()), sharding=strategy.sharding_strategy, tp_bandwidth=tp_bandwidth,
                         cp=llm_spec.cp, cp_mode=layout.cp_mode, ulysses=layout.ulysses,
                         cp_bandwidth=cp_bandwidth, encoder_cp={e: s.cp for e, s in enc_specs.items()},
                         ep=layout.ep, ep_bandwidth=ep_bandwidth, fsdp_reduce=strategy.fsdp_reduce)


def _configured_per_module(model, strategy, specs, enc_specs, memory_limit, allreduce_bandwidth, tp_bandwidth,
                           cp_bandwidth, samples) -> Plan:
    """A YAML whose ParallelSpecs carry ``dp``, simulated with each module's own dp and tp."""
    from dataclasses import replace

    from lightning_mm.plan.layout import replica_layout
    from lightning_mm.planner.model_costs import resolve_partition

    llm_spec = strategy.language_model_spec
    missing = [e for e, s in enc_specs.items() if s.dp is None]
    if missing:
        raise SystemExit(f"language_model has dp={llm_spec.dp} but encoders {missing} have none: per-module data "
                         "parallelism needs dp on every ParallelSpec (or on none)")
    layout = replica_layout({e: replace(s, dp=None) for e, s in enc_specs.items()}, replace(llm_spec, dp=None),
                            strategy.encoder_placement, model.pipeline_encoders)
    layers = resolve_partition(model, layout.module_stages, strategy.partition, strategy.activation_checkpointing)
    return evaluate_plan(specs, layers, layout.placement, strategy.num_microbatches * llm_spec.dp,
                         {**{e: s.dp for e, s in enc_specs.items()}, LANGUAGE_MODEL: llm_spec.dp},
                         memory_limit=memory_limit, allreduce_bandwidth=allreduce_bandwidth,
                         tp={**{e: s.tp for e, s in enc_specs.items()}, LANGUAGE_MODEL: llm_spec.tp},
                         sharding=strategy.sharding_strategy, tp_bandwidth=tp_bandwidth, cp=llm_spec.cp,
                         cp_mode=layout.cp_mode, ulysses=layout.ulysses, cp_bandwidth=cp_bandwidth,
                         encoder_cp={e: s.cp for e, s in enc_specs.items()}, samples_per_microbatch=samples,
                         fsdp_reduce=strategy.fsdp_reduce)


def strategy_yaml(plan: Plan) -> str:
    """The fit-YAML lines that run ``plan``: trainer devices and the strategy's specs (``Plan.parallel_specs``: the
    LLM's with its cp, cp_mode and hybrid's ulysses, an encoder's with its cp; every module's dp under per-module
    data parallelism), placement, microbatches per replica and the planned boundaries (the search already timed
    them). Unequal dps outside parallel placement raise (the runtime does not serve them)."""
    import yaml

    from lightning_mm.planner.search import check_module_dp

    if plan.module_dp:
        check_module_dp(plan.module_dp, plan.placement, plan.samples_per_microbatch)

    def spec(s):  # pp and tp always (and dp under per-module data parallelism), CP fields where not the defaults
        args = {"pp": s.pp, "tp": s.tp, **({"dp": s.dp} if s.dp is not None else {}),
                **({"ep": s.ep} if s.ep > 1 else {})}
        if s.cp > 1:
            args["cp"] = s.cp
            if s.cp_mode != "allgather" or s is llm_spec:
                args["cp_mode"] = s.cp_mode
            if s.cp_mode == "hybrid":
                args["ulysses"] = s.ulysses
        return {"class_path": "lightning_mm.ParallelSpec", "init_args": args}

    encoder_specs, llm_spec = plan.parallel_specs()
    args = {"encoders": {m: spec(s) for m, s in encoder_specs.items()},
            "language_model": spec(llm_spec), "encoder_placement": plan.placement,
            "num_microbatches": plan.microbatches_per_replica, "sharding_strategy": plan.sharding,
            "partition": {m: list(v) for m, v in plan.layers.items()}}
    doc = {"trainer": {"devices": plan.devices,
                       "strategy": {"class_path": "lightning_mm.MultimodalParallelStrategy", "init_args": args}}}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)


@dataclass(frozen=True)
class Units:
    """How costs are shown: ``name`` ("ms" or "GFLOP"), the factor from planner units to it, and whether the
    costs are times (a profile or --device-flops) or amounts of work (FLOP counts)."""

    name: str
    factor: float
    is_time: bool


GIB = 2 ** 30


def stage_table(plan: Plan, title: str, units: Units) -> str:
    """Per stage: layers, its CP mode (LLM stages with cp > 1; "hybrid(K=..)" with the Ulysses degree; "items" for
    an encoder with CP, which splits its items; "-" without CP) and CP degree (its ranks per replica / tp),
    forward and backward per microbatch, busy time, bubble, peak in-flight microbatches, memory (and the gradient
    all-reduce and the CP communication, encoder CP's gather included, when they are costed), every number with its
    unit; then the iteration."""
    r, u = plan.result, units.name
    held = stage_layers(plan)
    sync = {s: sum(e.end - e.start for e in r.events if e.stage == s and e.kind == "sync") for s in r.stages}
    cp_comm = {s: plan.cp_comm.get(s, 0.0) for s in r.stages}
    ep_comm = {s: plan.ep_comm.get(s, 0.0) for s in r.stages}
    cols = ["cp mode", "cp"] + (["ep"] if plan.ep > 1 else []) + [
        f"forward ({u})", f"backward ({u})", f"busy ({u})", "bubble", "in flight", "memory (GiB)"]
    if any(sync.values()):
        cols.append(f"all-reduce ({u})")
    if any(cp_comm.values()):
        cols.append(f"cp comm ({u})")
    if any(ep_comm.values()):
        cols.append(f"ep all-to-all ({u})")
    widths = [max({"cp mode": 12, "cp": 3, "ep": 3}.get(c, 10), len(c)) for c in cols]
    header = f"{'stage':<20} {'layers':<34} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths))
    lines = [title, header, "-" * len(header)]
    f = units.factor
    for stage in r.stages:
        degree = stage_cp(plan, stage)
        mode = cp_mode_label(plan) if stage.startswith(LANGUAGE_MODEL + ".") else ("items" if degree > 1 else "-")
        llm_stage = stage.startswith(LANGUAGE_MODEL + ".")
        values = [mode, str(degree)] + ([str(plan.ep) if llm_stage else "-"] if plan.ep > 1 else []) + [
                  f"{plan.forward[stage] * f:.4g}", f"{plan.backward[stage] * f:.4g}",
                  f"{r.busy[stage] * f:.4g}", f"{r.bubble_fraction[stage]:.1%}", f"{r.peak_inflight[stage]:d}",
                  f"{plan.memory[stage] / GIB:.3g}"]
        if any(sync.values()):
            values.append(f"{sync[stage] * f:.4g}")
        if any(cp_comm.values()):
            values.append(f"{cp_comm[stage] * f:.4g}")
        if any(ep_comm.values()):
            values.append(f"{ep_comm[stage] * f:.4g}")
        lines.append(f"{stage:<20} {held[stage]:<34} " + " ".join(f"{v:>{w}}" for v, w in zip(values, widths)))
    what = "predicted iteration time" if units.is_time else "predicted iteration (critical-path work per device)"
    lines.append(f"{what} {plan.iteration_time * f:.4g} {u} on {plan.devices} devices "
                 f"({'fits' if plan.fits_memory else 'EXCEEDS'} memory)")
    return "\n".join(lines)


def _write(plan: Plan, out: Path, name: str, units: Units) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png, trace = out / f"{name}.png", out / f"{name}.trace.json"
    chrome_trace(plan.result, trace)  # one trace second = one planner cost unit (s, or GFLOP of work)
    value = plan.iteration_time * units.factor
    if units.is_time:
        title, xlabel = f"{name}: predicted iteration {value:.4g} {units.name}", f"time ({units.name})"
    else:
        title = f"{name}: {value:.4g} GFLOP of critical-path work"
        xlabel = "work (GFLOP; --device-flops or --profile give time)"
    try:
        timeline_png(plan.result, png, title=title, scale=units.factor, xlabel=xlabel)
    except ImportError as err:
        print(f"(no PNG: {err})")
        return [trace]
    return [png, trace]


def default_out(trainer) -> Path:
    """A new ``plan_N`` (the first N not taken) in the folder of the YAML's runs (its logger's ``root_dir``,
    ``<default_root_dir>/lightning_logs`` without one), beside their ``version_N``: no run's folder is written, and
    a second plan does not overwrite the first."""
    logger = trainer.logger
    root = Path(getattr(logger, "root_dir", None) or Path(trainer.default_root_dir) / "lightning_logs")
    n = 0
    while (root / f"plan_{n}").exists():
        n += 1
    return root / f"plan_{n}"


def prepared_for_profile(model, trainer):
    """The model on the Trainer's device (the strategy's root device) and in its precision's parameter dtype."""
    model = trainer.precision_plugin.convert_module(model)
    return model.to(trainer.strategy.root_device)


def device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def run(args: argparse.Namespace, module, datamodule, trainer) -> None:
    """The report for ``args`` (``parse_args``) on a fit YAML's LightningModule, data module and trainer, built
    by the CLI (``lightning_mm.trainer.cli.plan_main``: ``lightning-mm plan``) and not run."""
    strategy, model = trainer.strategy, module.model
    if not hasattr(strategy, "encoder_placement"):
        raise SystemExit("the YAML's trainer.strategy is not lightning_mm.MultimodalParallelStrategy; plan needs it")
    profile = args.profile or args.write_profile or getattr(strategy.partition, "profile", None)
    _check_bandwidths_have_times(args, profile)
    mb = first_microbatch(module, datamodule, trainer, strategy.num_microbatches)
    if args.write_profile:
        _write_profile(args, model, trainer)
    costs, microbatches = _planning_costs(args, model, datamodule, trainer, mb, profile)
    scale, units = _cost_units(args, profile)
    specs = module_specs(model, costs, scale, mb, strategy.activation_checkpointing, microbatches)
    devices = trainer.num_devices * trainer.num_nodes
    out = Path(args.out) if args.out else default_out(trainer)
    options = _SearchOptions.of(args, strategy)
    print(_costs_header(args, profile, units, options))
    rows = int(mb["input_ids"].shape[0])  # samples per planner microbatch
    if args.templates:
        return _templates(args, specs, strategy.num_microbatches, options.tp_degrees, units, out)
    mine = configured_plan(model, strategy, specs, devices, options.memory_limit, options.allreduce_bandwidth,
                           options.tp_bandwidth, options.cp_bandwidth, rows, options.ep_bandwidth)
    files = _write(mine, out, "configured", units)
    print(stage_table(mine, f"configured: {devices} devices, placement={mine.placement}, dp={mine.dp}, "
                            f"tp={mine.tp}, cp={mine.cp}, cp_mode={cp_mode_label(mine)}, "
                            f"encoder_cp={encoder_cp_label(mine)}, ep={mine.ep}, sharding={mine.sharding}, "
                            f"partition={strategy.partition!r}", units))
    budget = args.devices or devices
    if args.per_module_dp:
        return _per_module(specs, mine, budget, rows, options, out, units, files)
    if budget == 1:  # the strategy's debug mode: the configured plan above is the only one
        print("\nno auto search on 1 device: the whole model runs in one process (the plan above)")
        print("wrote " + ", ".join(str(f) for f in files))
        return
    _auto_search(specs, mine, budget, options, out, units, files)


def _check_bandwidths_have_times(args: argparse.Namespace, profile) -> None:
    """A bandwidth times communication, so it needs costs in seconds (a profile or ``--device-flops``)."""
    for flag, value in (("--allreduce-bandwidth", args.allreduce_bandwidth), ("--cp-bandwidth", args.cp_bandwidth),
                        ("--ep-bandwidth", args.ep_bandwidth)):
        if math.isfinite(value) and not (profile or args.device_flops):
            raise SystemExit(f"{flag} needs costs in seconds: add --device-flops (FLOP/s per device) "
                             "or --profile / --write-profile")


def _write_profile(args: argparse.Namespace, model, trainer) -> None:
    """``--write-profile``: the model's parts timed on the Trainer's device in its precision, as training runs."""
    save_profile(profile_model(prepared_for_profile(model, trainer),
                               forward_context=trainer.precision_plugin.forward_context),
                 args.write_profile, meta={"config": args.config, "precision": str(trainer.precision),
                                           "device": device_name(trainer.strategy.root_device)})
    model.to("cpu")
    print(f"wrote {args.write_profile}")


def _planning_costs(args: argparse.Namespace, model, datamodule, trainer, mb: dict, profile):
    """(layer costs of ``mb``, the microbatches of items encoder CP splits): FLOPs or seconds (``profile``) of the
    first microbatch, and None (its own items); with ``--data-stats`` the costs scaled from it to the data's mean
    work per sample and microbatches drawn from the data (``planner.data_stats``), its statistics printed."""
    costs = model_layer_costs(model, profile, batch=mb, recompute=trainer.strategy.activation_checkpointing)
    if not args.data_stats:
        return costs, None
    from lightning_mm.planner.data_stats import plan_data_stats

    stats, costs, factors = plan_data_stats(model, datamodule, trainer, mb, costs, args.devices,
                                            args.data_stats_samples)
    print("data statistics (work: the planner's FLOP model, per sample)\n" + stats.summary())
    print("costs scaled to the data's mean work: " + ", ".join(f"{m} x{f:.3g}" for m, f in factors.items())
          + "\n")
    return costs, stats.microbatches


def _cost_units(args: argparse.Namespace, profile) -> tuple[float, Units]:
    """(what the layer costs are multiplied by, how the planner's costs are shown): seconds in ms with a profile or
    ``--device-flops``, else GFLOP."""
    if profile:
        return 1.0, Units("ms", 1e3, True)
    if args.device_flops:
        return 1.0 / args.device_flops, Units("ms", 1e3, True)
    return 1e-9, Units("GFLOP", 1.0, False)


@dataclass(frozen=True)
class _SearchOptions:
    """What the search is asked for, in the planner's units (bytes, bytes/s): the memory limit per device, the
    bandwidths, and the degrees tried: ``--tp``, ``--sharding``, and the YAML's own LLM CP degree and mode, ep and
    encoder CP degrees where ``--cp``, ``--cp-mode``, ``--ep`` and ``--encoder-cp`` are not given."""

    memory_limit: float
    allreduce_bandwidth: float
    tp_bandwidth: float
    cp_bandwidth: float
    ep_bandwidth: float
    tp_degrees: list[int]
    shardings: list[str]
    cp_degrees: list[int]
    cp_modes: list[str]
    ep_degrees: list[int]
    encoder_cp: list[int]

    @classmethod
    def of(cls, args: argparse.Namespace, strategy) -> _SearchOptions:
        llm_spec = strategy.language_model_spec
        return cls(
            memory_limit=args.memory_limit * GIB, allreduce_bandwidth=args.allreduce_bandwidth * 1e9,
            tp_bandwidth=args.tp_bandwidth * 1e9, cp_bandwidth=args.cp_bandwidth * 1e9,
            ep_bandwidth=args.ep_bandwidth * 1e9,
            tp_degrees=[int(t) for t in args.tp.split(",")], shardings=args.sharding.split(","),
            cp_degrees=[int(c) for c in args.cp.split(",")] if args.cp else [llm_spec.cp],
            cp_modes=args.cp_mode.split(",") if args.cp_mode else [llm_spec.cp_mode],
            ep_degrees=[int(e) for e in args.ep.split(",")] if args.ep else [llm_spec.ep],
            encoder_cp=([int(c) for arg in args.encoder_cp for c in arg.split(",") if c] if args.encoder_cp else
                        sorted({s.cp for s in (strategy.encoder_specs or {}).values()}) or [1]))


def _costs_header(args: argparse.Namespace, profile, units: Units, options: _SearchOptions) -> str:
    """The line above the tables: the costs' unit and source, and the communication that is timed."""
    source = f"profile {profile}" if profile else "FLOPs counted on the real layers" + (
        f" at {args.device_flops:.4g} FLOP/s per device" if args.device_flops else "")
    cp_timed = math.isfinite(options.cp_bandwidth)
    return (f"costs per microbatch in {units.name} ({source}); memory in GiB"
            + (f"; gradient all-reduce at {args.allreduce_bandwidth:g} GB/s"
               if math.isfinite(options.allreduce_bandwidth) else "")
            + (f"; CP attention traffic at {args.cp_bandwidth:g} GB/s" if cp_timed else "")
            + (" (and encoder CP's feature gather)" if cp_timed and max(options.encoder_cp) > 1 else "")
            + (f"; expert all-to-all at {args.ep_bandwidth:g} GB/s" if math.isfinite(options.ep_bandwidth) else "")
            + "\n")


def _auto_search(specs: dict[str, ModuleSpec], mine: Plan, budget: int, options: _SearchOptions, out: Path,
                 units: Units, files: list) -> None:
    """The auto-parallel search on ``budget`` devices for the configured plan's global batch: what it left out and
    why, its table, the configured / auto ratio, why devices stay idle and the YAML that runs its plan."""
    found = search(specs, budget, mine.microbatches_per_replica * mine.dp, options.memory_limit,
                   allreduce_bandwidth=options.allreduce_bandwidth, tp_degrees=options.tp_degrees,
                   sharding_strategies=options.shardings, tp_bandwidth=options.tp_bandwidth,
                   cp_degrees=options.cp_degrees, cp_modes=options.cp_modes, cp_bandwidth=options.cp_bandwidth,
                   encoder_cp_degrees=options.encoder_cp, ep_degrees=options.ep_degrees,
                   ep_bandwidth=options.ep_bandwidth)
    best = found.best
    files += _write(best, out, "auto", units)
    print()
    for reason in found.rejected:
        print(f"not searched: {reason}")
    print(stage_table(best, f"auto search on {budget} devices: placement={best.placement}, dp={best.dp}, "
                            f"tp={best.tp}, cp={best.cp}, cp_mode={cp_mode_label(best)}, "
                            f"encoder_cp={encoder_cp_label(best)}, ep={best.ep}, sharding={best.sharding}, "
                            f"pp={best.pp()}", units))
    print(f"\nconfigured / auto predicted iteration time: {mine.iteration_time / best.iteration_time:.3f}x")
    why = fewer_devices_reason(best, found.candidates, budget)
    if why:
        print(f"\n{why}")
    print(f"\nto run the auto plan, put this in the fit YAML (the data module's batch_size is per replica: keep "
          f"batch_size x dp the same for the same global batch; dp = {best.dp}):\n")
    print(strategy_yaml(best))
    print(NOTATION)
    print("wrote " + ", ".join(str(f) for f in files))


NOTATION = ("# partition lists each module's layers per pipeline stage: [4] is one stage holding all 4 layers,\n"
            "# [2, 2] two stages of 2 layers (pp = the list's length). In the tables, 'busy' is a stage's forward\n"
            "# + backward per iteration, 'bubble' the share of the iteration it waits, 'in flight' the microbatches\n"
            "# whose activations it holds at once.")


def fewer_devices_reason(best: Plan, candidates: list[Plan], budget: int) -> str:
    """Why the best plan leaves devices idle: replicas are whole, and (where one was searched) the fastest plan
    using every device is predicted slower."""
    if best.devices >= budget:
        return ""
    ranks = best.devices // best.dp if not best.module_dp else best.devices
    text = (f"why {best.devices} of {budget} devices: a replica of this layout spans {ranks} ranks, and data "
            f"parallelism copies whole replicas ({best.dp} x {ranks} = {best.devices}); ")
    full = [c for c in candidates if c.devices == budget]
    if not full:
        return text + f"no layout searched fills all {budget} devices, so {budget - best.devices} stay idle"
    other = min(full, key=lambda c: c.iteration_time)
    return text + (f"the fastest layout that uses all {budget} (dp={other.dp}, pp={other.pp()}, tp={other.tp}, "
                   f"placement={other.placement}) is predicted to take "
                   f"{other.iteration_time / best.iteration_time:.3f}x this plan's iteration time, no less, so the "
                   "smaller layout is proposed (ties go to fewer devices)")


def module_degrees(plan: Plan) -> str:
    """Every module's dp x tp x pp, e.g. ``vision 3x1x1, language_model 2x1x2``."""
    return ", ".join(f"{m} {plan.module_dp[m]}x{plan.module_tp[m]}x{pp}" for m, pp in plan.pp().items())


def _per_module(specs: dict[str, ModuleSpec], mine: Plan, budget: int, rows: int, options: _SearchOptions,
                out: Path, units: Units, files: list) -> None:
    """``--per-module-dp``: DistTrain's orchestration on ``budget`` devices (each sharding tried), its table, the
    configured / per-module ratio and the YAML with dp on every ParallelSpec."""
    from lightning_mm.planner.orchestration import search_per_module_dp

    found = min((search_per_module_dp(specs, budget, mine.microbatches_per_replica * mine.dp,
                                      samples_per_microbatch=rows, tp_degrees=options.tp_degrees,
                                      memory_limit=options.memory_limit,
                                      allreduce_bandwidth=options.allreduce_bandwidth,
                                      tp_bandwidth=options.tp_bandwidth, sharding=sharding)
                 for sharding in options.shardings),
                key=lambda r: (r.best.iteration_time, r.best.devices))
    best = found.best
    files += _write(best, out, "auto", units)
    print()
    print(stage_table(best, f"per-module dp search on {budget} devices (dp x tp x pp): {module_degrees(best)}, "
                            f"sharding={best.sharding}; Eq. 1-2 estimate {found.estimate * units.factor:.4g} "
                            f"{units.name}, {found.subproblems} subproblems solved in "
                            f"{found.solve_seconds * 1e3:.1f} ms", units))
    print(f"\nconfigured / per-module predicted iteration time: {mine.iteration_time / best.iteration_time:.3f}x")
    print(f"\nto run the per-module plan, put this in the fit YAML (the data module's batch_size is per LLM "
          f"replica: keep batch_size x {best.dp} the same for the same global batch):\n")
    print(strategy_yaml(best))
    print("wrote " + ", ".join(str(f) for f in files))


def plan_template(specs: dict[str, ModuleSpec], nodes: int, devices_per_node: int, num_microbatches: int,
                  memory_limit: float = math.inf, tp_degrees=(1,), allreduce_bandwidth: float = math.inf,
                  tp_bandwidth: float = math.inf, placements=("parallel", "colocated")):
    """The fastest of the search's candidate layouts (``candidate_layouts`` per tp and dp; NO_SHARD, no CP) that
    fill ``nodes`` x ``devices_per_node`` devices within ``memory_limit``, every stage's tp ranks on one node,
    simulated (``evaluate_plan``), as a ``PipelineTemplate`` timed at N =
    ``num_microbatches`` and 2N: its fill and time per microbatch (where only a dp that N does not divide fills the
    devices, N becomes the next multiple of the device count). None when none fits. Ties on time go to the
    smaller dp, then to the earlier candidate (tp, then dp, then the search's order).

    Simulating every candidate at N microbatches is the cost, so each is first simulated at one microbatch per
    replica, which gives its stage costs and a lower bound on its time at N (``_time_bound``); candidates are then
    simulated in the order of their bounds, and those whose bound exceeds the best time found are never
    simulated: they cannot win. The answer is the one simulating all of them gives."""
    import time

    from lightning_mm.plan.templates import PipelineTemplate
    from lightning_mm.planner.search import candidate_layouts

    candidates: dict[int, list] = {}  # per replica budget: the same layouts whatever the tp, dp and batch

    def layouts(budget):
        if budget not in candidates:
            candidates[budget] = list(candidate_layouts(specs, budget, placements))
        return candidates[budget]

    def evaluate(option, microbatches):
        tp, dp, placement, layers = option
        return evaluate_plan(specs, layers, placement, microbatches, dp, tp=tp, memory_limit=memory_limit,
                             tp_bandwidth=tp_bandwidth, allreduce_bandwidth=allreduce_bandwidth)

    def fastest(microbatches):  # the search's candidate layouts that fill the devices
        options = _filling_options(devices, microbatches, tp_degrees, layouts)
        return _fastest_usable(options, microbatches, evaluate, devices, devices_per_node)

    start, devices = time.perf_counter(), nodes * devices_per_node
    best = fastest(num_microbatches)
    if best is None and num_microbatches % devices:  # a dp that fills the devices may not divide the batch
        num_microbatches = -(-num_microbatches // devices) * devices
        best = fastest(num_microbatches)
    if best is None:
        return None
    twice = evaluate_plan(specs, best.layers, best.placement, 2 * num_microbatches, best.dp, memory_limit=memory_limit,
                          tp=best.tp, allreduce_bandwidth=allreduce_bandwidth, tp_bandwidth=tp_bandwidth)
    per_mb = max((twice.iteration_time - best.iteration_time) / num_microbatches, 1e-30)
    encoders, llm = best.parallel_specs()
    return PipelineTemplate(nodes, devices_per_node, {**encoders, LANGUAGE_MODEL: llm},
                            {m: tuple(v) for m, v in best.layers.items()}, best.placement, best.dp, per_mb,
                            max(best.iteration_time - num_microbatches * per_mb, 0.0), time.perf_counter() - start)


def _filling_options(devices: int, microbatches: int, tp_degrees, layouts) -> list[tuple]:
    """(tp, dp, placement, layers) for every tp dividing ``devices``, every dp dividing both the devices per tp rank
    and ``microbatches``, and every layout of ``layouts(devices per replica)`` that fills the ``devices``."""
    from lightning_mm.plan.layout import ParallelSpec, replica_layout

    options = []
    for tp in (t for t in tp_degrees if devices % t == 0):
        for dp in (d for d in range(1, devices // tp + 1) if (devices // tp) % d == 0 and microbatches % d == 0):
            for placement, layers in layouts(devices // (dp * tp)):
                encoders = {m: ParallelSpec(pp=len(v), tp=tp) for m, v in layers.items() if m != LANGUAGE_MODEL}
                llm = ParallelSpec(pp=len(layers[LANGUAGE_MODEL]), tp=tp)
                layout = replica_layout(encoders, llm, placement, replicas=dp)
                # every chain at one degree: dp replicas of all stages' ranks (world_size, counted faster)
                if dp * sum(layout.widths.values()) == devices:
                    options.append((tp, dp, placement, layers))
    return options


def _fastest_usable(options: list[tuple], microbatches: int, evaluate, devices: int,
                    devices_per_node: int) -> Plan | None:
    """The fastest of ``options`` simulated at ``microbatches`` (``evaluate(option, microbatches)``) that fills the
    ``devices`` within memory with every stage's tp ranks on one node, ties to the smaller dp, then to the earlier
    option; None if none does. Each option is first simulated at one microbatch per replica for a lower bound on its
    time (``_time_bound``); the options are simulated in the order of their bounds, until a bound exceeds the time of
    a usable plan."""
    from lightning_mm.plan.layout import check_node_locality

    local: dict[int, bool] = {}  # the node-locality check per option (slow: only for plans that can win)

    def usable(i, plan):  # fills the devices within memory, every stage's tp ranks on one node
        if plan.devices != devices or not plan.fits_memory:
            return False
        if i not in local:
            try:
                check_node_locality(plan.layout, devices_per_node)
                local[i] = True
            except ValueError:
                local[i] = False
        return local[i]

    probes = [evaluate(o, o[1]) for o in options]  # one microbatch per replica
    bounds = [_time_bound(p, microbatches // p.dp) for p in probes]
    plans, best = {}, math.inf
    for i in sorted(range(len(options)), key=bounds.__getitem__):
        if bounds[i] > best:
            break  # this bound and every later one exceed the time of a usable plan: none of them can win
        plans[i] = probes[i] if options[i][1] == microbatches else evaluate(options[i], microbatches)
        if plans[i].iteration_time < best and usable(i, plans[i]):
            best = plans[i].iteration_time
    order = sorted(plans, key=lambda i: (plans[i].iteration_time, plans[i].dp, i))
    return next((plans[i] for i in order if usable(i, plans[i])), None)


def _time_bound(probe: Plan, microbatches: int) -> float:
    """A lower bound on the simulated 1F1B time of ``probe``'s layout at ``microbatches`` per replica, from its
    per-stage costs (``probe``: the layout simulated at one microbatch). Every stage runs its actions in turn, so a
    stage takes at least its microbatches' forwards (and backwards, where it trains) plus its gradient sync; LLM
    stage k starts microbatch 0 only after stages 0..k-1 ran its forward, and after its last backward that
    gradient still passes back through the training stages before it. Scaled down by 1e-9 for rounding."""
    trained = {e.stage for e in probe.result.events if e.kind == "backward"}
    sync = {e.stage: e.end - e.start for e in probe.result.events if e.kind == "sync"}
    llm = [f"{LANGUAGE_MODEL}.{k}" for k in range(len(probe.layers[LANGUAGE_MODEL]))]
    bound = 0.0
    for stage, forward in probe.forward.items():
        work = microbatches * (forward + (probe.backward[stage] if stage in trained else 0.0))
        if stage not in llm:
            bound = max(bound, work + sync.get(stage, 0.0))
    ahead, behind = 0.0, 0.0  # forwards before LLM stage k; backwards of the training stages before it
    for stage in llm:
        work = microbatches * (probe.forward[stage] + (probe.backward[stage] if stage in trained else 0.0))
        bound = max(bound, ahead + work + max(behind if stage in trained else 0.0, sync.get(stage, 0.0)))
        ahead += probe.forward[stage]
        behind += probe.backward[stage] if stage in trained else 0.0
    return bound * (1 - 1e-9)


def build_templates(specs: dict[str, ModuleSpec], nodes: int, devices_per_node: int, failures: int,
                    num_microbatches: int, memory_limit: float = math.inf, progress=None, **search_kwargs):
    """Oobleck's pipeline templates: ``plan_template`` for each node count n from n0 (the fewest nodes whose
    devices hold the model within ``memory_limit``) to ``nodes`` - ``failures`` x n0. ``progress(template)`` is
    called after each."""
    from lightning_mm.plan.templates import Templates

    def template(n):
        t = plan_template(specs, n, devices_per_node, num_microbatches, memory_limit, **search_kwargs)
        if t is not None and progress:
            progress(t)
        return t

    templates = []
    for n in range(1, nodes // (failures + 1) + 1):  # n0: the fewest nodes that hold the model
        first = template(n)
        if first is not None:
            templates.append(first)
            break
    if not templates:
        raise SystemExit(f"the model does not fit {nodes // (failures + 1)} nodes x {devices_per_node} devices "
                         f"within the memory limit, so {failures + 1} groups cannot run on {nodes} nodes: add nodes, "
                         "lower --failures, raise --memory-limit or recompute activations")
    for n in range(templates[0].nodes + 1, nodes - failures * templates[0].nodes + 1):
        t = template(n)
        if t is None:
            raise SystemExit(f"no layout fills {n} nodes x {devices_per_node} devices within the memory limit, "
                             f"though {templates[0].nodes} nodes fit; try other --tp degrees")
        templates.append(t)
    return Templates(tuple(templates), failures, {"nodes": nodes, "num_microbatches": num_microbatches})


def _templates(args, specs, num_microbatches: int, tp_degrees, units: Units, out: Path) -> None:
    """``--templates``: build, print one row per template (with its planning time) and write the YAML."""
    if not args.nodes or not args.devices_per_node:
        raise SystemExit("--templates needs --nodes N and --devices-per-node M")
    templates = build_templates(specs, args.nodes, args.devices_per_node, args.failures, num_microbatches,
                                args.memory_limit * GIB, tp_degrees=tp_degrees,
                                allreduce_bandwidth=args.allreduce_bandwidth * 1e9,
                                tp_bandwidth=args.tp_bandwidth * 1e9)
    path = Path(args.out) if args.out else out / "templates.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    templates.save(path)
    print(f"pipeline templates for {args.nodes} nodes x {args.devices_per_node} devices, f={args.failures} "
          f"(times of one step of {num_microbatches} microbatches, {units.name})")
    header = f"{'nodes':>5} {'dp':>3} {'tp':>3} {'layers per stage':<40} {'step':>10} {'planning (s)':>12}"
    print(header + "\n" + "-" * len(header))
    for t in templates.templates:
        cut = "; ".join(f"{m} {list(v)}" for m, v in t.partition.items())
        print(f"{t.nodes:>5} {t.dp:>3} {t.specs[LANGUAGE_MODEL].tp:>3} {cut:<40} "
              f"{t.step_time(num_microbatches) * units.factor:>10.4g} {t.planning_seconds:>12.3f}")
    print(f"wrote {path}")
