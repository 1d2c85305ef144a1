"""MultimodalParallelStrategy: modality-parallel pipelines with data parallelism, as a Lightning strategy.

Launch, process groups, samplers and teardown are Lightning's DDP machinery (plain ``python script.py``,
torchrun, SLURM; NCCL on GPU, gloo on CPU); the model is never wrapped in DDP. The model is built on the meta
device (``trainer.init_module()``), each rank keeps only its pipeline stage and materialises it, and
``training_step`` runs the whole 1F1B schedule (forward and backward of every microbatch) through
:class:`PipelineEngine`, so Lightning's own backward runs its hooks and finishes the gradient reduction.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, DistributedSampler
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mm import checkpoint as ckpt
from lightning_mm.data.balanced import (BalancedBatchSampler, BalancedCollate, BalancedDataset,
                                        balancing_obstacle, metadata_works, no_work)
from lightning_mm.data.cp_plans import CPPlanCollate
from lightning_mm.data.microbatch import PLAN_KEY
from lightning_mm.data.resumable import ResumableDataLoader, loader_options, resumable
from lightning_mm.trainer.launch import CheckedLauncher, mark_failed, release_process_groups_at_exit
from lightning_mm.fault_tolerance.watchdog import FaultWatchdog, is_peer_loss, launched_ranks_watched, rank_labels
from lightning_mm.fault_tolerance import FaultTolerance, as_fault_tolerance
from lightning_mm.fault_tolerance.training import FaultTolerantTraining
from lightning_mm.model.loading import materialise
from lightning_mm.model.multimodal import MultimodalModel
from lightning_mm.parallel.comm import check_backend
from lightning_mm.parallel.engine import PipelineEngine, check_same_batch
from lightning_mm.parallel.sharding import SHARDING_STRATEGIES
from lightning_mm.parallel.tensor_parallel import check_tensor_parallel, dtensor_parameters_pinned
from lightning_mm.parallel.context import check_context_parallel
from lightning_mm.plan.balance import METHODS as BALANCING_METHODS, plan_batch
from lightning_mm.plan.layout import ParallelSpec, RankLayout, build_layout, check_node_locality
from lightning_mm.plan.placement import LANGUAGE_MODEL
from lightning_mm.plan.routing import check_group_batch
from lightning_mm.planner.model_costs import resolve_partition
from lightning_mm.planner.heterogeneity import num_pipeline_stages
from lightning_mm.planner.workload import WorkloadModel

DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_FAULT_TIMEOUT = 60.0  # seconds: a dead rank ends the others well before DEFAULT_TIMEOUT
DEFAULT_BALANCING = "entrain"  # where the training loader allows it


class MultimodalParallelStrategy(DDPStrategy):
    """Encoders and the LLM cut into pipeline stages on disjoint ranks, replicated over data-parallel groups.

    ``encoders`` maps each encoder name to its ParallelSpec (default ``ParallelSpec()`` for every encoder of the
    model); ``language_model`` is the LLM's. The data-parallel size is ``devices / ranks per replica``.
    ``partition``: "uniform", explicit ``{module: [layers per stage]}``, or the planner's "frozen-aware" /
    "forward-only" / "auto" (costs: FLOPs of the real layers, or the JSON ``profile``). ``encoder_placement``: "parallel"
    (modality parallelism), "colocated" (Megatron-style fused encoder stages) or "replicated" (encoders whole in
    the LLM's first stage). Each rank's batch is cut into ``num_microbatches``. ``language_model=ParallelSpec(cp=N)``
    shards every LLM sequence over N ranks in blocks of ``cp_block_size`` tokens distributed by ``cp_distribution``
    ("lpt", "zigzag", "random", "contiguous"); shorter sequences pad themselves to N blocks.
    ``activation_checkpointing=True`` keeps only each encoder/LLM layer's input and recomputes its forward in
    backward (less activation memory, about one more forward of compute); the planner partitions accordingly.
    ``ParallelSpec(tp=N)`` splits a module's layers over N ranks (DTensor; docs/parallelism.md), and
    ``sharding_strategy`` ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD") shards each stage's state over its
    data-parallel ranks with FSDP2. ``parallel_devices`` (Lightning's: the local ranks' devices) may repeat a GPU,
    e.g. ``["cuda:0"] * 4`` with ``Trainer(devices=1)`` runs 4 ranks on one GPU; NCCL refuses that, so give
    ``process_group_backend="gloo"`` (pipeline and data parallelism; stage messages go through host memory).
    ``batch_balancing`` places each global batch's samples over replicas and microbatches by their encoder and LLM
    work ("none": contiguous slices; "disttrain"; "entrain", which also defers LLM work of an overloaded
    microbatch to the next one; docs/balancing.md). The default (None) is "entrain" where the training loader
    allows it (a map-style data set with ``sample_metadata``, a DistributedSampler and a batch size) and "none"
    otherwise; a method given by name raises when the loader cannot serve it.
    """

    strategy_name = "multimodal"

    def __init__(self, encoders: dict[str, ParallelSpec] | None = None, language_model: ParallelSpec | None = None,
                 num_microbatches: int = 1, partition: str | dict[str, list[int]] = "uniform",
                 encoder_placement: str = "parallel", cp_distribution: str = "lpt", cp_block_size: int = 128,
                 profile: str | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = DEFAULT_TIMEOUT, start_method: str = "popen",
                 save_frozen_parameters: bool = False, fault_timeout: float | None = DEFAULT_FAULT_TIMEOUT,
                 activation_checkpointing: bool = False, sharding_strategy: str = "NO_SHARD",
                 batch_balancing: str | None = None, fault_tolerance: FaultTolerance | None = None, accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None, precision_plugin=None, **unknown):
        if unknown:
            known = [p for p in inspect.signature(MultimodalParallelStrategy.__init__).parameters
                     if p not in ("self", "unknown")]
            raise TypeError(f"MultimodalParallelStrategy got unknown arguments {sorted(unknown)}; it takes {known} "
                            "(DDP's own wrapper options do not apply: the model is pipelined, never wrapped in "
                            "DistributedDataParallel)")
        if parallel_devices is not None:  # a YAML gives strings ("cuda:0")
            parallel_devices = [torch.device(d) for d in parallel_devices]
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.encoder_specs = encoders
        self.language_model_spec = language_model or ParallelSpec()
        self.num_microbatches, self.partition, self.encoder_placement = num_microbatches, partition, encoder_placement
        if profile is not None:
            from lightning_mm.planner.model_costs import planner_request

            self.partition = planner_request(partition, profile)
        self.cp_distribution, self.cp_block_size = cp_distribution, cp_block_size
        self.activation_checkpointing = bool(activation_checkpointing)
        if sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"unknown sharding_strategy {sharding_strategy!r}; use one of {SHARDING_STRATEGIES} "
                             "(the names of Lightning's FSDPStrategy)")
        self.sharding_strategy = sharding_strategy
        if batch_balancing is not None and batch_balancing not in BALANCING_METHODS:
            raise ValueError(f"unknown batch_balancing {batch_balancing!r}; use one of {BALANCING_METHODS}")
        self.batch_balancing = batch_balancing
        self.batch_plans: list[dict] = []
        self.layout: RankLayout | None = None
        self.engine: PipelineEngine | None = None
        if fault_timeout is not None and fault_timeout <= 0:
            raise ValueError(f"fault_timeout must be > 0 seconds (or None to disable), got {fault_timeout}")
        if fault_timeout is not None and timeout is not None and fault_timeout >= timeout.total_seconds():
            raise ValueError(f"fault_timeout={fault_timeout} s must be shorter than the process-group timeout "
                             f"({timeout.total_seconds():g} s), or faults are only noticed when collectives time out")
        self.save_frozen_parameters, self.fault_timeout = save_frozen_parameters, fault_timeout
        self.watchdog: FaultWatchdog | None = None
        self.model_fingerprint: dict[str, list[int]] = {}
        self.trainable_names: list[str] = []
        self._accumulating = False
        self.fault_tolerance = as_fault_tolerance(fault_tolerance)  # torchft replica groups (fault_tolerance/)
        self.ft = FaultTolerantTraining(self.fault_tolerance, self) if self.fault_tolerance is not None else None

    # ------------------------------------------------------------------ layout, before any process group
    def multimodal_model(self) -> MultimodalModel:
        """The module's ``model``, checked before any process group exists."""
        module = self.lightning_module
        model = getattr(module, "model", None)
        if not isinstance(model, MultimodalModel):
            raise TypeError(f"MultimodalParallelStrategy runs a LightningModule whose `model` attribute is a "
                            f"lightning_mm.MultimodalModel and whose steps call `compute_loss` (use or subclass "
                            f"lightning_mm.MultimodalLightningModule); got {type(module).__name__} with model "
                            f"{type(model).__name__}")
        return model

    def plan_layout(self) -> RankLayout:
        model = self.multimodal_model()
        encoders = model.pipeline_encoders  # an encoder sharing another's tower runs on its stages
        specs = self.encoder_specs if self.encoder_specs is not None else {e: ParallelSpec() for e in encoders}
        world = self.num_nodes * self.num_processes
        if world == 1:  # debug mode: the whole model in this process, whatever the specs say
            if any(s.size > 1 for s in [*specs.values(), self.language_model_spec]):
                rank_zero_warn("MultimodalParallelStrategy on 1 device runs the whole model in one process; the "
                               "ParallelSpecs apply from 2 devices on")
            return build_layout({e: ParallelSpec() for e in specs}, ParallelSpec(), 1, "replicated", encoders)
        lm_spec, placement = self.language_model_spec, self.encoder_placement
        if self.fault_tolerance is not None and self.fault_tolerance.templates:
            template = self.fault_tolerance.template(world)  # re-formed groups take the layout of their size
            if problem := self.fault_tolerance.elastic_launch_problem():
                rank_zero_warn(problem)
            specs = {e: template.specs.get(e, ParallelSpec()) for e in encoders}
            lm_spec, placement = template.specs["language_model"], template.placement
            self.partition = {m: list(v) for m, v in template.partition.items()}
        layout = build_layout(specs, lm_spec, world, placement, encoders)
        if layout.disaggregated and self.fault_tolerance is not None:
            raise ValueError("fault_tolerance runs replica groups of one data-parallel degree; per-module degrees "
                             f"({ {c: layout.replicas(c) for c in layout.chains()} }) are not served with it: give "
                             "every module the same dp (or none), or drop fault_tolerance")
        check_tensor_parallel(model, {e: s.tp for e, s in specs.items()}, lm_spec.tp)
        check_context_parallel(model, lm_spec)
        check_node_locality(layout, self.num_processes)
        return layout

    def setup_environment(self) -> None:
        self.layout = self.plan_layout()
        self.check_launch_environment()
        check_backend(self._get_process_group_backend(), self.parallel_devices or [self.root_device],
                      tensor_parallel=any(t > 1 for t in self.layout.tp.values()),
                      context_parallel=any(c > 1 for c in self.layout.cp.values()),
                      sharded=self.sharding_strategy != "NO_SHARD")
        with launched_ranks_watched(getattr(self._launcher, "procs", [])):
            super().setup_environment()
        release_process_groups_at_exit()
        if self.fault_timeout is not None and self.world_size > 1:
            self.watchdog = FaultWatchdog(self.global_rank, self.world_size, self.fault_timeout,
                                          labels=rank_labels(self.layout)).start()

    def _configure_launcher(self) -> None:
        """Lightning's launcher, with the layout checked before it spawns any rank (``lightning_mm.trainer.launch``)."""
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            self._launcher = CheckedLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                             check=self.plan_layout)

    def check_launch_environment(self) -> None:
        """LOCAL_RANK without WORLD_SIZE in the environment (left over from an earlier Trainer run in this process
        or shell) makes Lightning believe another launcher started the other ranks: rank 0 would wait for them
        forever. Raise instead, before any process group."""
        if (isinstance(self.cluster_environment, LightningEnvironment) and self.world_size > 1
                and not torch.distributed.is_initialized()  # later Trainer calls: WORLD_SIZE is gone by then
                and "LOCAL_RANK" in os.environ and "WORLD_SIZE" not in os.environ
                and not getattr(self._launcher, "procs", None)):
            raise RuntimeError(f"LOCAL_RANK={os.environ['LOCAL_RANK']} is set in the environment but WORLD_SIZE is "
                               f"not, so Lightning starts none of the other {self.world_size - 1} ranks and would "
                               "wait for them forever; unset LOCAL_RANK (and NODE_RANK) in this shell or process, "
                               "or launch every rank yourself (torchrun, SLURM)")

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """The language model's replicas; a rank of per-module data parallelism names its group's first replica
        (``process_dataloader`` then loads every replica of the group)."""
        if self.layout.disaggregated:
            first = self.layout.group_of(self.global_rank) * self.layout.per_group(LANGUAGE_MODEL)
            return {"num_replicas": self.layout.dp, "rank": first}
        return {"num_replicas": self.layout.dp, "rank": self.layout.coordinate(self.global_rank).dp}

    # ------------------------------------------------------------------ building
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        """``trainer.init_module()`` and ``configure_model`` build on the meta device (nothing allocated); each rank
        materialises only its stage in ``setup``. ``empty_init=False`` builds eagerly on the CPU instead."""
        if empty_init is False:
            with torch.device("cpu"), self.precision_plugin.tensor_init_context():
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer) -> None:
        if self.ft is not None and trainer.state.fn == TrainerFn.FITTING:
            self.ft.check_before_setup(trainer)  # unservable settings, an unreachable lighthouse: before any build
        self.accelerator.setup(trainer)
        module, model = self.lightning_module, self.multimodal_model()
        if self.engine is None or self.engine.model is not model:
            self.build_stage(module, model)
        with dtensor_parameters_pinned(module, self.engine.fsdp_params):
            try:
                module.to(self.root_device)  # what is left: this stage, metrics, buffers
            except NotImplementedError as e:
                if "meta tensor" not in str(e):
                    raise
                module.to_empty(device="cpu")  # the run ends here: let teardown move the module without this error
                raise RuntimeError(f"{type(module).__name__} holds tensors on the meta device outside its `model` (e.g. "
                                   "torchmetrics metrics created under trainer.init_module()); only `model` is "
                                   "materialised per stage: create those under `with torch.device('cpu'):` or outside "
                                   "trainer.init_module()") from e
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.ft is not None:
                self.ft.connect(trainer)
        self.setup_precision_plugin()
        self.use_sharded_grad_scaler()

    def build_stage(self, module, model) -> None:
        """Cut ``model`` to this rank's stage and materialise it (once: validate/test/predict after fit reuse it)."""
        if getattr(model, "pipeline_stage", None) is not None:
            raise RuntimeError("this MultimodalModel was already cut into pipeline stages by another Trainer's "
                               "strategy; run trainer.validate/test/predict on that Trainer, or build the model again")
        self.precision_plugin.convert_module(module)
        self.model_fingerprint = ckpt.model_fingerprint(model)  # before pruning
        self.trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.workload = WorkloadModel.from_model(model)  # per-sample work for batch balancing, from the whole model
        layer_counts = resolve_partition(model, self.layout.module_stages, self.partition,
                                         recompute=self.activation_checkpointing)
        seed = int(self.broadcast(torch.initial_seed()))  # one init seed for every rank, seeded or not
        self.engine = PipelineEngine(model, self.layout, self.global_rank, self.num_microbatches, layer_counts,
                                     self.cp_distribution, self.cp_block_size, self.activation_checkpointing,
                                     device=self.root_device, forward_context=self.precision_plugin.forward_context,
                                     loss_backward=self.loss_backward,
                                     materialise=lambda m: materialise(m, self.root_device, seed),
                                     sharding_strategy=self.sharding_strategy,
                                     precision=str(self.precision_plugin.precision))
        model.pipeline_stage = self.engine.stage

    def model_to_device(self) -> None:  # setup moves the pruned stage only
        pass

    def use_sharded_grad_scaler(self) -> None:
        """16-mixed: every rank must skip a step whose gradients overflowed on any stage, so the scaler's
        found-inf flags are all-reduced (FSDP's ShardedGradScaler does exactly that over the world group)."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            self.precision_plugin.scaler = ShardedGradScaler(
                self.root_device.type, init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0 ** 16,
                growth_factor=scaler.get_growth_factor(), backoff_factor=scaler.get_backoff_factor(),
                growth_interval=scaler.get_growth_interval(), enabled=scaler.is_enabled())

    def configure_ddp(self) -> None:  # the model is pipelined, never wrapped in DDP
        pass

    # ------------------------------------------------------------------ the steps
    # The engine enters the precision plugin's forward context around each stage forward and scales the loss
    # itself, so the steps are not wrapped in autocast as a whole (backward would run under it).
    def training_step(self, *args, **kwargs):
        if self.ft is not None:  # the quorum, then this step's share of the global batch
            args = (self.ft.begin_step(args[0]), *args[1:])
        return self.lightning_module.training_step(*args, **kwargs)

    def validation_step(self, *args, **kwargs):
        return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args, **kwargs):
        return self.lightning_module.predict_step(*args, **kwargs)

    def run_pipeline(self, batch: dict, train: bool = True) -> torch.Tensor:
        """The schedule over the batch's microbatches (forward and backward); the global normalised loss."""
        check_same_batch(batch, self.engine.groups.replica)
        if train and "encoder" in (batch.get(PLAN_KEY) or {}):  # what each step's balancing did, for callbacks, tests
            self.batch_plans.append({k: list(batch[PLAN_KEY][k]) for k in ("encoder", "llm")})
        return self.engine.run(batch, train=train, sync=not self._accumulating,
                               loss_scale=1.0 / self.lightning_module.trainer.accumulate_grad_batches)

    def predict_pipeline(self, batch: dict) -> dict:
        """Forward only; ``logits`` [B, S, V] on the ranks holding the LLM head (None elsewhere) and the greedy
        next-token ids [B, S] on every rank of the replica."""
        check_same_batch(batch, self.engine.groups.replica)
        return self.engine.predict(batch)

    def loss_backward(self, loss: torch.Tensor) -> None:
        """Backward of the last stage's loss, scaled by the precision plugin's grad scaler (16-mixed)."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        (scaler.scale(loss) if scaler is not None else loss).backward()

    @contextmanager
    def block_backward_sync(self):
        """Lightning enters this on micro-steps that only accumulate: gradients are reduced once per optimiser
        step, in the backward of the micro-step that steps."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """The schedule already ran backward. Lightning's backward hooks run here on every rank, around the
        gradient sum over replicas (and CP ranks), which happens once per optimiser step."""
        module = self.lightning_module
        self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward
        if not self._accumulating:
            self.engine.sync_gradients()
        return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward

    def discard_gradients(self) -> None:
        """Drop this step's gradients on every rank alike (``nan_guard="skip"``), finishing any reduction."""
        self.engine.sync_gradients()
        for opt in self.optimizers:
            opt.zero_grad()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        if self.ft is not None:  # the closure repeats until the replica groups commit it
            closure = self.ft.committed(closure, optimizer)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        optimizer.zero_grad()  # see MultimodalLightningModule.optimizer_zero_grad
        return out

    def clip_gradients_by_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over every stage and replica."""
        return self.engine.clip_gradients(max_norm)

    # ------------------------------------------------------------------ data order (exact resume)
    def process_dataloader(self, dataloader):
        """Batches resume where a checkpoint left off (Lightning saves and restores the loader's state; predict
        loaders stay as Lightning made them, whose sampler records the batch indices prediction writers use); the
        training batches are placed over replicas and microbatches by ``batch_balancing``; under context
        parallelism every loader's batches carry this rank's CP plans (``with_cp_plans``)."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.ft is not None and trainer is not None and trainer.training:
            return self.ft.training_loader(dataloader)  # samples are chosen per step, after the quorum
        if self.layout is not None and self.layout.disaggregated and trainer is not None:
            return self.group_dataloader(dataloader, trainer.training)
        if self.batch_balancing != "none" and trainer is not None and trainer.training:
            obstacle = balancing_obstacle(dataloader)
            if self.batch_balancing is not None or not obstacle:
                return self.with_cp_plans(self.balanced_dataloader(dataloader,
                                                                   self.batch_balancing or DEFAULT_BALANCING))
            rank_zero_info(f"batch_balancing: the training loader is not balanced ({obstacle}); its batches are cut "
                           "into contiguous microbatches")
        if trainer is not None and trainer.predicting:  # nothing to resume; Lightning reads its batch indices
            return self.with_cp_plans(dataloader)
        return self.with_cp_plans(resumable(dataloader))

    def with_cp_plans(self, dataloader):
        """``dataloader`` whose collate function also makes the context-parallel plans this rank's stage executes
        (encoder item shards, LLM block owners; ``data/cp_plans.py``), in its workers instead of in the step. Only
        where this stage runs CP and the loader is a torch DataLoader, and not under ``fault_tolerance`` (whose
        steps change the microbatch count); other batches are planned in the step."""
        engine = self.engine
        if engine is None or not (engine.item_planners or engine.block_owners) or self.ft is not None or \
                not isinstance(dataloader, DataLoader):
            return dataloader
        collate = dataloader.collate_fn
        if isinstance(collate, CPPlanCollate):  # a loader this strategy processed before (fit, then validate)
            collate = collate.collate
        dataloader.collate_fn = CPPlanCollate(collate, engine.num_microbatches, engine.item_planners,
                                              engine.block_owners)
        return dataloader

    def group_dataloader(self, dataloader, training: bool):
        """Per-module data parallelism: ``dataloader`` rebuilt to give every rank its group's batch, the batches
        its DistributedSampler gives each language-model replica of the group, one after the other, placed by
        ``batch_balancing`` (training) or in contiguous microbatches, with the routing of their rows between the
        modules' replicas (``plan/routing.py``) made in the loader."""
        sampler, batch_size = getattr(dataloader, "sampler", None), getattr(dataloader, "batch_size", None)
        inner = getattr(dataloader.batch_sampler, "_batch_sampler", None)  # Lightning's predict index wrapper
        if not isinstance(sampler, DistributedSampler) and inner is not None:
            sampler, batch_size = getattr(inner, "sampler", None), getattr(inner, "batch_size", None)
        if not isinstance(sampler, DistributedSampler) or batch_size is None:
            raise TypeError("per-module data parallelism (ParallelSpec(dp=...)) loads the samples of several "
                            "language-model replicas on every rank, from the loader's DistributedSampler and "
                            f"batch_size; this loader has a {type(sampler).__name__} and batch_size "
                            f"{batch_size}: keep Lightning's use_distributed_sampler=True "
                            "and give the DataLoader a batch_size")
        layout, model = self.layout, self.multimodal_model()
        replicas = layout.per_group(LANGUAGE_MODEL)
        check_group_batch(batch_size, self.num_microbatches, replicas,
                          {e: layout.per_group(e) for e in model.pipeline_encoders})
        method = (self.batch_balancing or DEFAULT_BALANCING) if training else "none"
        if method != "none" and balancing_obstacle(dataloader):
            if self.batch_balancing is not None:
                raise TypeError(f"batch_balancing={method!r} cannot serve this training loader: "
                                f"{balancing_obstacle(dataloader)}; set batch_balancing='none'")
            method = "none"
        first = layout.group_of(self.global_rank) * replicas
        return self.planned_loader(dataloader, sampler, batch_size, method, list(range(first, first + replicas)),
                                   self.engine.router)

    def balanced_dataloader(self, dataloader, method: str):
        """The training loader rebuilt over balanced global batches (``data/balanced.py``): the same samples per
        step as its DistributedSampler gives every replica, placed by ``plan_batch(method=batch_balancing)``."""
        obstacle = balancing_obstacle(dataloader)
        if obstacle:
            raise TypeError(f"batch_balancing={method!r} cannot serve this training loader: {obstacle}; keep "
                            "Lightning's use_distributed_sampler=True, a map-style data set with sample_metadata(i) "
                            "and a batch_size, or set batch_balancing='none'")
        rank_zero_info(f"batch balancing: {method!r} places each global batch over {self.layout.dp} replicas x "
                       f"{self.num_microbatches} microbatches (logged: balance/imbalance_before, "
                       "balance/imbalance_after, balance/deferred_samples)")
        return self.planned_loader(dataloader, dataloader.sampler, dataloader.batch_size, method,
                                   self.layout.coordinate(self.global_rank).dp)

    def planned_loader(self, dataloader, sampler, batch_size: int, method: str, replica, router=None):
        """``dataloader`` rebuilt over the global batches of its DistributedSampler (``data/balanced.py``): the
        samples of ``replica`` (an index, or the list of a group's replicas), placed by ``plan_batch(method)``
        ("none": contiguous), with ``router``'s routing (per-module data parallelism) in each batch."""
        model = self.multimodal_model()
        depth = num_pipeline_stages(self.engine.graph)  # DistTrain orders microbatches to fill this pipeline
        work = metadata_works(sampler.dataset, self.workload, model) if method != "none" else no_work
        batches = BalancedBatchSampler(
            sampler.dataset, batch_size, self.layout.dp, replica, self.num_microbatches,
            plan=lambda enc, llm, r, k: plan_batch(enc, llm, r, k, method, num_stages=depth), work=work,
            shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
        collate = BalancedCollate(dataloader.collate_fn, model.placeholder_ids, router=router)
        return ResumableDataLoader(BalancedDataset(sampler.dataset), batch_sampler=batches,
                                   **{**loader_options(dataloader), "collate_fn": collate})

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint loads into this rank's stage and optimiser, which exist after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores optimisers by parameter name

    def parameter_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.lightning_module.model.named_parameters()}

    def lightning_module_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's trainable parameters (and frozen ones if ``save_frozen_parameters``), full names."""
        return {f"model.{n}": p.detach() for n, p in self.lightning_module.model.named_parameters()
                if n in self.engine.owned and (p.requires_grad or self.save_frozen_parameters)}

    def optimizer_state(self, optimizer) -> dict:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        return ckpt.optimizer_state_by_name(optimizer, self.parameter_names())

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Collective: a DCP folder keyed by the unparallelised names, written atomically (see checkpoint.py)."""
        if storage_options is not None:
            raise TypeError("MultimodalParallelStrategy writes DCP folders itself: storage_options is not supported")
        path = os.path.abspath(self.broadcast(str(filepath)))
        tensors = {f"model/{k.removeprefix('model.')}": v for k, v in checkpoint.pop("state_dict").items()}
        groups = []
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors.update(ckpt.optimizer_tensors(i, state))
            groups.append(state["param_groups"])
        tensors.update(ckpt.rng_tensors(self.global_rank))
        meta = ckpt.plain({**checkpoint, "optimizer_param_groups": groups})
        layout = {**self.layout.to_dict(), "world_size": self.world_size,
                  "parameters": self.model_fingerprint, "trainable": self.trainable_names,
                  "frozen_saved": self.save_frozen_parameters}
        ckpt.save_sharded(path, tensors, meta, layout, self.global_rank)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Collective: this rank's parameters, optimiser state (by name) and RNG; returns Lightning's state.

        Every check (folder, format, sizes, model identity, checksums of the files this rank reads) runs on
        every rank before the collective DCP read, so a bad checkpoint raises everywhere instead of hanging."""
        path = os.path.abspath(self.broadcast(str(checkpoint_path)))
        layout = ckpt.read_layout(path)
        ckpt.check_same_model(layout["parameters"], self.model_fingerprint, path)
        md = ckpt.read_dcp_metadata(path)
        model, names = self.lightning_module.model, self.parameter_names()
        target, missing = {}, []
        for n, p in model.named_parameters():
            if n not in self.engine.owned:
                continue
            if f"model/{n}" in md.state_dict_metadata:
                target[f"model/{n}"] = p.detach()
            elif p.requires_grad:
                missing.append(n)
        if missing:
            rank_zero_warn(f"{len(missing)} trainable parameters (e.g. {missing[0]}) are not in {path}; they keep "
                           "the values the model was built with")
        target.update(ckpt.optimizer_targets(md, self.optimizers, names))
        same_ranks = (layout["world_size"] == self.world_size and layout["stages"] == self.layout.stages
                      and layout.get("cp") == self.layout.cp and layout.get("tp") == self.layout.tp
                      and layout.get("chain_dp") == self.layout.to_dict().get("chain_dp"))
        rng = {k: ckpt.empty_like_entry(md, k) for k in md.state_dict_metadata
               if same_ranks and k.startswith(f"rng/{self.global_rank}/")}
        if not same_ranks:
            rank_zero_warn(f"{path} was written by another rank layout: random states are not restored")
        target.update(rng)
        ckpt.verify_files(path, layout, ckpt.files_for_keys(md, set(target)))
        meta = ckpt.load_meta(path)
        ckpt.load_tensors(path, target)
        groups = meta.pop("optimizer_param_groups", [])
        for i, opt in enumerate(self.optimizers):
            ckpt.load_optimizer_by_name(opt, i, names, target, groups[i] if i < len(groups) else None)
        if rng:
            ckpt.set_rng_tensors(self.global_rank, rng)
        return meta

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint already loaded this stage's parameters

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint already loaded the optimisers by parameter name

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)

    # ------------------------------------------------------------------ faults
    def on_exception(self, exception: BaseException) -> None:
        mark_failed()
        if self.watchdog is not None:
            if is_peer_loss(exception):  # let the watchdog name the rank that went away (it ends this process)
                self.watchdog.blame(self.fault_timeout + 2 * self.watchdog.interval)
            self.watchdog.report_failure(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.ft is not None:
            self.ft.shutdown()
        if self.watchdog is not None:
            self.watchdog.finish()
            self.watchdog = None
        module = self.lightning_module
        with dtensor_parameters_pinned(module, self.engine.fsdp_params if self.engine else set()) \
                if module is not None else contextlib.nullcontext():
            super().teardown()  # moves the module to the CPU: tensor-parallel and meta tensors stay

StrategyRegistry.register("multimodal", MultimodalParallelStrategy,
                          description="modality-parallel pipelines with data parallelism (lightning-mm)")
