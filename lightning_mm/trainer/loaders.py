"""The loaders a rank of ``MultimodalParallelStrategy`` iterates, made from those Lightning prepared.

:func:`prepare_loader` is the one entry point (the strategy's ``process_dataloader``). Depending on the run:

- ``fault_tolerance``: the training loader becomes the fault-tolerant runner's step tokens (its samples are chosen
  per step, after the quorum);
- per-module data parallelism: every loader is rebuilt to give each rank its group's batch (``plan/routing.py``);
- training with ``batch_balancing``: the loader is rebuilt over balanced global batches (``data/balanced.py``);
- otherwise the loader resumes where a checkpoint left off (``data/resumable.py``), except prediction loaders,
  whose sampler records the batch indices prediction writers use;

and under context parallelism the batches also carry this rank's CP plans, made in the loader's workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler

from lightning_mm.data.balanced import (BalancedBatchSampler, BalancedCollate, BalancedDataset, balancing_obstacle,
                                        metadata_works, no_work)
from lightning_mm.data.cp_plans import CPPlanCollate
from lightning_mm.data.resumable import ResumableDataLoader, loader_options, resumable
from lightning_mm.plan.balance import plan_batch
from lightning_mm.plan.placement import LANGUAGE_MODEL
from lightning_mm.plan.routing import check_group_batch
from lightning_mm.planner.heterogeneity import num_pipeline_stages

if TYPE_CHECKING:
    from lightning_mm.fault_tolerance.training import FaultTolerantTraining
    from lightning_mm.parallel.engine import PipelineEngine
    from lightning_mm.plan.layout import RankLayout
    from lightning_mm.planner.workload import WorkloadModel

DEFAULT_BALANCING = "entrain"  # where the training loader allows it


def prepare_loader(loader, *, stage: RunningStage | None, layout: RankLayout | None, rank: int,
                   num_microbatches: int, batch_balancing: str | None, engine: PipelineEngine | None,
                   workload: WorkloadModel | None, fault_tolerance: FaultTolerantTraining | None):
    """The loader this rank iterates in ``stage`` (None: outside a Trainer's loops) in place of ``loader``.

    ``batch_balancing`` places the training batches over replicas and microbatches (None: ``DEFAULT_BALANCING``
    where the loader allows it, else "none"); ``workload`` gives each sample's work for it. ``engine`` (this rank's
    stage, once built) has the CP planners and the routing between modules' replicas."""
    training = stage == RunningStage.TRAINING
    if fault_tolerance is not None and training:
        return fault_tolerance.training_loader(loader)
    if layout is not None and layout.per_module_dp and stage is not None:
        return _group_loader(loader, training=training, layout=layout, rank=rank, num_microbatches=num_microbatches,
                             batch_balancing=batch_balancing, engine=engine, workload=workload)
    method = _training_balancing(loader, batch_balancing) if training else "none"
    if method != "none":
        loader = _balanced_loader(loader, method=method, layout=layout, rank=rank, num_microbatches=num_microbatches,
                                  engine=engine, workload=workload)
    elif stage != RunningStage.PREDICTING:  # predict loaders: nothing to resume; Lightning reads their indices
        loader = resumable(loader)
    return loader if fault_tolerance is not None else _with_cp_plans(loader, engine)


def _training_balancing(loader, batch_balancing: str | None) -> str:
    """``batch_balancing`` if given, else ``DEFAULT_BALANCING`` where ``loader`` allows it, else "none" (said)."""
    if batch_balancing is not None:
        return batch_balancing
    if obstacle := balancing_obstacle(loader):
        rank_zero_info(f"batch_balancing: the training loader is not balanced ({obstacle}); its batches are cut "
                       "into contiguous microbatches")
        return "none"
    return DEFAULT_BALANCING


def _with_cp_plans(loader, engine: PipelineEngine | None):
    """``loader`` whose collate function also makes the context-parallel plans this rank's stage executes
    (encoder item shards, LLM block owners; ``data/cp_plans.py``), in its workers instead of in the step. Only
    where this stage runs CP and the loader is a torch DataLoader; other batches are planned in the step (and
    every batch under ``fault_tolerance``, whose steps change the microbatch count)."""
    if engine is None or not (engine.item_planners or engine.block_owners) or not isinstance(loader, DataLoader):
        return loader
    collate = loader.collate_fn
    if isinstance(collate, CPPlanCollate):  # a loader prepared before (fit, then validate)
        collate = collate.collate
    loader.collate_fn = CPPlanCollate(collate, engine.num_microbatches, engine.item_planners, engine.block_owners)
    return loader


def _group_loader(loader, *, training: bool, layout: RankLayout, rank: int, num_microbatches: int,
                  batch_balancing: str | None, engine: PipelineEngine, workload: WorkloadModel | None):
    """Per-module data parallelism: ``loader`` rebuilt to give every rank its group's batch, the batches its
    DistributedSampler gives each language-model replica of the group, one after the other, placed by
    ``batch_balancing`` (training) or in contiguous microbatches, with the routing of their rows between the
    modules' replicas (``plan/routing.py``) made in the loader."""
    sampler, batch_size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
    inner = getattr(loader.batch_sampler, "_batch_sampler", None)  # Lightning's predict index wrapper
    if not isinstance(sampler, DistributedSampler) and inner is not None:
        sampler, batch_size = getattr(inner, "sampler", None), getattr(inner, "batch_size", None)
    if not isinstance(sampler, DistributedSampler) or batch_size is None:
        raise TypeError("per-module data parallelism (ParallelSpec(dp=...)) loads the samples of several "
                        "language-model replicas on every rank, from the loader's DistributedSampler and "
                        f"batch_size; this loader has a {type(sampler).__name__} and batch_size "
                        f"{batch_size}: keep Lightning's use_distributed_sampler=True "
                        "and give the DataLoader a batch_size")
    replicas = layout.per_group(LANGUAGE_MODEL)
    check_group_batch(batch_size, num_microbatches, replicas,
                      {e: layout.per_group(e) for e in engine.model.pipeline_encoders})
    method = (batch_balancing or DEFAULT_BALANCING) if training else "none"
    if method != "none" and balancing_obstacle(loader):
        if batch_balancing is not None:
            raise TypeError(f"batch_balancing={method!r} cannot serve this training loader: "
                            f"{balancing_obstacle(loader)}; set batch_balancing='none'")
        method = "none"
    first = layout.group_of(rank) * replicas
    return _planned_loader(loader, sampler, batch_size, method=method, replica=list(range(first, first + replicas)),
                           layout=layout, num_microbatches=num_microbatches, engine=engine, workload=workload,
                           router=engine.exchange.router, equal=training)


def _balanced_loader(loader, *, method: str, layout: RankLayout, rank: int, num_microbatches: int,
                     engine: PipelineEngine, workload: WorkloadModel | None):
    """The training loader rebuilt over balanced global batches (``data/balanced.py``): the same samples per
    step as its DistributedSampler gives every replica, placed by ``plan_batch(method=batch_balancing)``."""
    if obstacle := balancing_obstacle(loader):
        raise TypeError(f"batch_balancing={method!r} cannot serve this training loader: {obstacle}; keep "
                        "Lightning's use_distributed_sampler=True, a map-style data set with sample_metadata(i) "
                        "and a batch_size, or set batch_balancing='none'")
    rank_zero_info(f"batch balancing: {method!r} places each global batch over {layout.dp} replicas x "
                   f"{num_microbatches} microbatches (logged: balance/imbalance_before, "
                   "balance/imbalance_after, balance/deferred_samples)")
    return _planned_loader(loader, loader.sampler, loader.batch_size, method=method,
                           replica=layout.coordinate(rank).dp, layout=layout, num_microbatches=num_microbatches,
                           engine=engine, workload=workload)


def _planned_loader(loader, sampler: DistributedSampler, batch_size: int, *, method: str, replica: int | list[int],
                    layout: RankLayout, num_microbatches: int, engine: PipelineEngine, workload: WorkloadModel | None,
                    router=None, equal: bool = True) -> ResumableDataLoader:
    """``loader`` rebuilt over the global batches of its DistributedSampler (``data/balanced.py``): the samples
    of ``replica`` (an index, or the list of a group's replicas), placed by ``plan_batch(method)`` ("none":
    contiguous; of equal sizes with ``equal``, else differing by at most one: evaluation and generation take any
    batch size), with ``router``'s routing (per-module data parallelism) in each batch."""
    model = engine.model
    depth = num_pipeline_stages(engine.graph)  # DistTrain orders microbatches to fill this pipeline
    work = metadata_works(sampler.dataset, workload, model) if method != "none" else no_work
    batches = BalancedBatchSampler(
        sampler.dataset, batch_size, layout.dp, replica, num_microbatches,
        plan=lambda enc, llm, r, k: plan_batch(enc, llm, r, k, method, num_stages=depth, equal=equal), work=work,
        shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
    collate = BalancedCollate(loader.collate_fn, model.placeholder_ids, router=router)
    return ResumableDataLoader(BalancedDataset(sampler.dataset), batch_sampler=batches,
                               **{**loader_options(loader), "collate_fn": collate})
