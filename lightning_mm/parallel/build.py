"""Build: the whole model in, this rank's stage out (torchtitan's ``parallelize_*``).

``describe_stage`` says what a rank holds (its stage plans, owned parameters, schedule graphs, tied embeddings) and
changes nothing; ``build_stage`` then prunes the model to it and applies, each as one function over a named mesh of
``Meshes``, tensor parallelism (``apply_tp``), expert parallelism (``apply_ep``) and FSDP2 (``apply_fsdp``), and
materialises a lazily built model's owned tensors. The runner (``engine.py``) executes steps on the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_mm.parallel.comm import carries_device_tensors
from lightning_mm.parallel.expert_parallel import apply_ep
from lightning_mm.parallel.meshes import Meshes
from lightning_mm.parallel.pruning import owned_parameters, prune, tied_embedding_stages
from lightning_mm.parallel.sharding import apply_fsdp
from lightning_mm.parallel.tensor_parallel import apply_tp
from lightning_mm.plan.layout import RankLayout
from lightning_mm.plan.schedule import LANGUAGE_MODEL, StageGraph, build_stage_graph
from lightning_mm.plan.stages import StagePlan, stage_plans, uniform_partition


@dataclass(frozen=True)
class StageHolding:
    """What one rank holds: every stage's plan (``plans``), its own ``stage`` name, the schedule graphs for training
    (frozen-aware) and evaluation, the parameter names it owns, and the LLM's first and last stage when they hold
    copies of a tied embedding."""

    plans: dict[str, StagePlan]
    stage: str
    graph: StageGraph
    frozen_graph: StageGraph
    owned: frozenset[str]
    tie_stages: tuple[str, str] | None

    @property
    def plan(self) -> StagePlan:
        return self.plans[self.stage]


def describe_stage(model, layout: RankLayout, rank: int,
                   partition: dict[str, list[int]] | None = None) -> StageHolding:
    """What ``rank`` holds of ``model`` under ``layout`` (``partition``: layers per stage of each module, None for
    equal splits). Reads the model, changes nothing; raises when nothing is trainable."""
    encoder_names = model.pipeline_encoders  # a shared encoder runs on its owner's stages
    sizes = {e: len(model.encoders[e].layers) for e in encoder_names}
    sizes[LANGUAGE_MODEL] = len(model.llm_layers)
    layer_counts = {m: list((partition or {}).get(m) or uniform_partition(sizes[m], s))
                    for m, s in layout.module_stages.items()}
    plans = stage_plans(layer_counts, layout.placement, encoder_names, model.shared_encoders)
    params = dict(model.named_parameters(remove_duplicate=False))
    owned = {s: owned_parameters(model, p) for s, p in plans.items()}
    trainable = {s: any(params[n].requires_grad for n in names) for s, names in owned.items()}
    if not any(trainable.values()):
        raise ValueError("the model has no trainable parameter: unfreeze something (model.freeze(projectors=False))")
    module_stages = {e: layout.module_stages[e] for e in encoder_names}
    llm_stages = layout.module_stages[LANGUAGE_MODEL]
    stage = layout.coordinate(rank).stage
    tie_stages = tied_embedding_stages(model, llm_stages)
    mine = owned[stage]
    if tie_stages and stage == tie_stages[1]:  # the head keeps the tied weight, by its name
        embed = model.lm_family.embed_tokens(model.language_model).weight
        mine |= {n for n, p in params.items() if p is embed}
    return StageHolding(plans, stage, build_stage_graph(module_stages, llm_stages, layout.placement, trainable),
                        build_stage_graph(module_stages, llm_stages, layout.placement, {s: False for s in trainable}),
                        frozenset(mine), tie_stages)


@dataclass
class BuiltStage:
    """A rank's stage after ``build_stage``: where it runs, its meshes, ``run_stage`` (the forward, inside FSDP's
    root unit when sharded), the parameters whose gradients are summed over tp (``tp_allreduce``: kept whole by a
    tensor-parallel plan but fed per-head inputs), the expert-parallel ones and the ids of the FSDP-managed ones."""

    device: torch.device
    meshes: Meshes
    run_stage: Callable
    tp_allreduce: list[nn.Parameter]
    expert_params: list[nn.Parameter]
    fsdp_params: set[int]


def tp_meshes(layout: RankLayout, plan: StagePlan, meshes: Meshes) -> dict[str, object]:
    """The tp mesh of each module a stage runs with tensor parallelism (an encoder inside an LLM stage with tp 1 runs
    whole on every tp rank)."""
    if meshes.tp_mesh is None:
        return {}
    modules = ([LANGUAGE_MODEL] if plan.language_model is not None else []) + list(plan.encoders)
    return {m: meshes.tp_mesh for m in modules if layout.module_tp.get(m, 1) > 1}


def stage_device(model, device=None) -> torch.device:
    """Where a stage runs: ``device``, else where its parameters are (the CPU for a meta-built model)."""
    if device is not None:
        return torch.device(device)
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None or first.is_meta else first.device


def build_stage(model, holding: StageHolding, *, layout: RankLayout, rank: int, forward: Callable, device=None,
                sharding_strategy: str = "NO_SHARD", precision: str = "32-true",
                materialise: Callable[[nn.Module], None] | None = None, timeout=None,
                fsdp_reduce: str = "microbatch") -> BuiltStage:
    """Prune ``model`` to ``holding``'s stage, create every group (``Meshes.build``, on every rank, with the job's
    ``timeout``), then apply TP, EP and FSDP (``forward`` becomes the FSDP root unit's forward) and ``materialise``
    the owned tensors."""
    prune(model, set(holding.owned))
    device = stage_device(model, device)
    mesh_device = device.type if carries_device_tensors(dist.get_backend(), device.type) else "cpu"
    meshes = Meshes.build(layout, rank, device_type=mesh_device, sharded=sharding_strategy != "NO_SHARD",
                          tie_stages=holding.tie_stages, timeout=timeout)
    plan = holding.plan
    tp_allreduce = apply_tp(model, plan, tp_meshes(layout, plan, meshes))
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    tp_allreduce = [names[id(p)] for p in tp_allreduce]
    expert_params = apply_ep(model, plan, meshes.experts) if meshes.experts is not None else []
    run_stage, fsdp_params = forward, set()
    if meshes.shard_mesh is not None and layout.fsdp_ranks(holding.stage) > 1:
        run_stage = apply_fsdp(model, plan, meshes.shard_mesh, sharding_strategy, forward, precision, expert_params,
                               fsdp_reduce)
        fsdp_params = {id(p) for p in model.parameters()} - {id(p) for p in expert_params}
    if materialise is not None:
        materialise(model)
    # by name: FSDP (and materialising a lazy build) put new parameter objects in the modules
    return BuiltStage(device, meshes, run_stage, [model.get_parameter(n) for n in tp_allreduce], expert_params,
                      fsdp_params)
