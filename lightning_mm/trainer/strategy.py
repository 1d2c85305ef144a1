"""MultimodalParallelStrategy: modality-parallel pipelines with data parallelism, as a Lightning strategy.

Launch, process groups, samplers and teardown are Lightning's DDP machinery (plain ``python script.py``,
torchrun, SLURM; NCCL on GPU, gloo on CPU); the model is never wrapped in DDP. The model is built on the meta
device (``trainer.init_module()``), each rank keeps only its pipeline stage and materialises it, and
``training_step`` runs the whole 1F1B schedule (forward and backward of every microbatch) through
:class:`PipelineEngine`, so Lightning's own backward runs its hooks and finishes the gradient reduction. The
loaders each rank iterates are made in ``trainer/loaders.py``, checkpoints written and read by
``lightning_mm.checkpoint``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
from collections import deque
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from typing_extensions import override
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mm import checkpoint as ckpt
from lightning_mm.data.microbatch import PLAN_KEY
from lightning_mm.trainer.launch import CheckedLauncher, mark_failed, release_process_groups_at_exit
from lightning_mm.fault_tolerance.watchdog import (FaultWatchdog, enable_flight_recorder, is_peer_loss,
                                                   launched_ranks_watched, rank_labels)
from lightning_mm.fault_tolerance import FaultTolerance, as_fault_tolerance
from lightning_mm.fault_tolerance.training import FaultTolerantTraining
from lightning_mm.model.loading import materialise
from lightning_mm.model.multimodal import MultimodalModel
from lightning_mm.parallel.comm import check_backend
from lightning_mm.parallel.engine import PipelineEngine, StepResult, check_same_batch
from lightning_mm.parallel.sharding import check_sharding, nothing_to_shard
from lightning_mm.parallel.tensor_parallel import check_tensor_parallel, dtensor_parameters_pinned
from lightning_mm.parallel.context import check_context_parallel
from lightning_mm.plan.balance import METHODS as BALANCING_METHODS
from lightning_mm.plan.layout import (ParallelSpec, RankLayout, build_layout, check_node_locality,
                                      single_process_specs)
from lightning_mm.plan.placement import LANGUAGE_MODEL
from lightning_mm.planner.model_costs import PlannedPartition, planner_request, resolve_partition
from lightning_mm.planner.workload import WorkloadModel
from lightning_mm.trainer.loaders import prepare_loader

DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_FAULT_TIMEOUT = 60.0  # seconds: a dead rank ends the others well before DEFAULT_TIMEOUT
Partition = str | dict[str, list[int]] | PlannedPartition  # layers per stage, or how the planner finds them


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
    ``activation_checkpointing=True`` recomputes each encoder/LLM layer's forward in backward from its input.
    ``ParallelSpec(tp=N)`` splits a module's layers over N ranks (DTensor; docs/parallelism.md), and
    ``sharding_strategy`` ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD") shards each stage's state over its data-parallel
    ranks with FSDP2, reduce-scattering gradients after every microbatch's backward, or with ``fsdp_reduce="step"`` once
    per optimiser step (less traffic, unsharded gradients held through the step). ``parallel_devices`` may repeat a GPU
    (``["cuda:0"] * 4`` with ``Trainer(devices=1)``: 4 ranks on one GPU, with ``process_group_backend="gloo"``, since
    NCCL refuses it). ``batch_balancing`` places each global batch's samples over replicas and microbatches by their
    encoder and LLM work ("none": contiguous slices; "disttrain"; "entrain", which also defers LLM work of an overloaded
    microbatch to the next one; docs/balancing.md). The default (None) is "entrain" where the training loader allows it
    (a map-style data set with ``sample_metadata``, a DistributedSampler and a batch size) and "none" otherwise; a
    method given by name raises when the loader cannot serve it.
    """

    strategy_name = "multimodal"

    def __init__(self, encoders: dict[str, ParallelSpec] | None = None, language_model: ParallelSpec | None = None,
                 num_microbatches: int = 1, partition: str | dict[str, list[int]] = "uniform",
                 encoder_placement: str = "parallel", cp_distribution: str = "lpt", cp_block_size: int = 128,
                 profile: str | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = DEFAULT_TIMEOUT, start_method: str = "popen",
                 save_frozen_parameters: bool = False, fault_timeout: float | None = DEFAULT_FAULT_TIMEOUT,
                 activation_checkpointing: bool = False, sharding_strategy: str = "NO_SHARD",
                 fsdp_reduce: str = "microbatch", batch_balancing: str | None = None,
                 fault_tolerance: FaultTolerance | None = None, accelerator=None,
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
            self.partition = planner_request(partition, profile)
        self.cp_distribution, self.cp_block_size = cp_distribution, cp_block_size
        self.activation_checkpointing = bool(activation_checkpointing)
        check_sharding(sharding_strategy, fsdp_reduce)
        self.sharding_strategy, self.fsdp_reduce = sharding_strategy, fsdp_reduce
        if batch_balancing is not None and batch_balancing not in BALANCING_METHODS:
            raise ValueError(f"unknown batch_balancing {batch_balancing!r}; use one of {BALANCING_METHODS}")
        self.batch_balancing = batch_balancing
        self.batch_plans: deque[dict] = deque(maxlen=100)  # the last steps' balancing, bounded over a long run
        self.layout: RankLayout | None = None
        self.engine: PipelineEngine | None = None
        self.last_step: StepResult | None = None  # the last pipeline step's loss, timings and rows (callbacks)
        if fault_timeout is not None and fault_timeout <= 0:
            raise ValueError(f"fault_timeout must be > 0 seconds (or None to disable), got {fault_timeout}")
        if fault_timeout is not None and timeout is not None and fault_timeout >= timeout.total_seconds():
            raise ValueError(f"fault_timeout={fault_timeout} s must be shorter than the process-group timeout "
                             f"({timeout.total_seconds():g} s), or faults are only noticed when collectives time out")
        self.save_frozen_parameters, self.fault_timeout, self.timeout = save_frozen_parameters, fault_timeout, timeout
        self.watchdog: FaultWatchdog | None = None
        self.model_fingerprint: dict[str, list[int]] = {}
        self.trainable_names: list[str] = []
        self.workload: WorkloadModel | None = None  # per-sample work for batch balancing, from the whole model
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

    def plan_layout(self) -> tuple[RankLayout, Partition]:
        """This run's rank layout and partition (``resolve_layout``), checked; the caller keeps them."""
        return resolve_layout(self.multimodal_model(), encoder_specs=self.encoder_specs,
                              language_model_spec=self.language_model_spec, placement=self.encoder_placement,
                              partition=self.partition, world_size=self.num_nodes * self.num_processes,
                              ranks_per_node=self.num_processes, fault_tolerance=self.fault_tolerance)

    @override
    def setup_environment(self) -> None:
        self.layout, self.partition = self.plan_layout()
        check_launch_environment(self.cluster_environment, self.world_size, self._launcher)
        check_backend(self._get_process_group_backend(), self.parallel_devices or [self.root_device],
                      tensor_parallel=any(t > 1 for t in self.layout.tp.values()),
                      context_parallel=any(c > 1 for c in self.layout.cp.values()),
                      sharded=self.sharding_strategy != "NO_SHARD", expert_parallel=self.layout.ep > 1)
        if self.fault_timeout is not None:
            enable_flight_recorder()  # the watchdog reads which collectives a stalled run waits in
        if problem := nothing_to_shard(self.layout, self.sharding_strategy):
            rank_zero_warn(problem)
        with launched_ranks_watched(getattr(self._launcher, "procs", [])):
            super().setup_environment()
        release_process_groups_at_exit()
        if self.fault_timeout is not None and self.world_size > 1:
            self.watchdog = FaultWatchdog(self.global_rank, self.world_size, self.fault_timeout,
                                          labels=rank_labels(self.layout)).start()

    @override
    def _configure_launcher(self) -> None:
        """Lightning's launcher, with the layout checked before it spawns any rank (``lightning_mm.trainer.launch``)."""
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            self._launcher = CheckedLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                             check=self.plan_layout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        """The language model's replicas; a rank of per-module data parallelism names its group's first replica
        (``process_dataloader`` then loads every replica of the group)."""
        if self.layout.per_module_dp:
            first = self.layout.group_of(self.global_rank) * self.layout.per_group(LANGUAGE_MODEL)
            return {"num_replicas": self.layout.dp, "rank": first}
        return {"num_replicas": self.layout.dp, "rank": self.layout.coordinate(self.global_rank).dp}

    # ------------------------------------------------------------------ building
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        """``trainer.init_module()`` and ``configure_model`` build on the meta device (nothing allocated); each rank
        materialises only its stage in ``setup``. ``empty_init=False`` builds eagerly on the CPU instead."""
        if empty_init is False:
            with torch.device("cpu"), self.precision_plugin.tensor_init_context():
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
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
        self.workload = WorkloadModel.from_model(model)
        layer_counts = resolve_partition(model, self.layout.module_stages, self.partition,
                                         recompute=self.activation_checkpointing)
        seed = int(self.broadcast(torch.initial_seed()))  # one init seed for every rank, seeded or not
        self.engine = PipelineEngine(model, self.layout, self.global_rank, self.num_microbatches, layer_counts,
                                     self.cp_distribution, self.cp_block_size, self.activation_checkpointing,
                                     device=self.root_device, forward_context=self.precision_plugin.forward_context,
                                     loss_backward=self.loss_backward,
                                     materialise=lambda m: materialise(m, self.root_device, seed),
                                     sharding_strategy=self.sharding_strategy, timeout=self.timeout,
                                     precision=str(self.precision_plugin.precision), fsdp_reduce=self.fsdp_reduce)
        model.pipeline_stage = self.engine.stage

    @override
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

    @override
    def configure_ddp(self) -> None:  # the model is pipelined, never wrapped in DDP
        pass

    # ------------------------------------------------------------------ the steps
    # The engine enters the precision plugin's forward context around each stage forward and scales the loss
    # itself, so the steps are not wrapped in autocast as a whole (backward would run under it).
    @contextmanager
    def step_progress(self):
        """Tell the watchdog a step began and ended (a run where no step does for ``fault_timeout`` is checked
        for a collective only some ranks entered)."""
        if self.watchdog is not None:
            self.watchdog.progress()
        yield
        if self.watchdog is not None:
            self.watchdog.progress()

    @override
    def training_step(self, *args, **kwargs):
        with self.step_progress():
            if self.ft is not None:  # the quorum, then this step's share of the global batch
                args = (self.ft.begin_step(args[0]), *args[1:])
            return self.lightning_module.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args, **kwargs):
        with self.step_progress():
            return self.lightning_module.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args, **kwargs):
        with self.step_progress():
            return self.lightning_module.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args, **kwargs):
        with self.step_progress():
            return self.lightning_module.predict_step(*args, **kwargs)

    def run_pipeline(self, batch: dict, train: bool = True) -> torch.Tensor:
        """The schedule over the batch's microbatches (forward and backward); the global normalised loss."""
        check_same_batch(batch, self.engine.groups.replica)
        if train and "encoder" in (batch.get(PLAN_KEY) or {}):  # what each step's balancing did, for callbacks, tests
            self.batch_plans.append({k: list(batch[PLAN_KEY][k]) for k in ("encoder", "llm")})
        weight = self.ft.loss_weight() if self.ft is not None and train else 1.0  # accumulation across groups
        self.last_step = self.engine.run(batch, train=train, sync=not self._accumulating,
                                         loss_scale=weight / self.lightning_module.trainer.accumulate_grad_batches)
        return self.last_step.loss

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
    @override
    def block_backward_sync(self):
        """Lightning enters this on micro-steps that only accumulate: gradients are reduced once per optimiser
        step, in the backward of the micro-step that steps."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @override
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

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        if self.ft is not None:  # the closure repeats until the replica groups commit it
            closure = self.ft.committed(closure, optimizer)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        optimizer.zero_grad()  # see MultimodalLightningModule.optimizer_zero_grad
        if self.watchdog is not None:
            self.watchdog.progress()
        return out

    def clip_gradients_by_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over every stage and replica."""
        return self.engine.clip_gradients(max_norm)

    # ------------------------------------------------------------------ data order (exact resume)
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The loader this rank iterates (``trainer/loaders.py``): resumable, balanced over replicas and
        microbatches, per-module data-parallel or fault-tolerant, with its CP plans under context parallelism."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return prepare_loader(super().process_dataloader(dataloader),
                              stage=trainer.state.stage if trainer is not None else None, layout=self.layout,
                              rank=self.global_rank, num_microbatches=self.num_microbatches,
                              batch_balancing=self.batch_balancing, engine=self.engine, workload=self.workload,
                              fault_tolerance=self.ft)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint loads into this rank's stage and optimiser, which exist after setup

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores optimisers by parameter name

    @override
    def lightning_module_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's trainable parameters (and frozen ones if ``save_frozen_parameters``), full names."""
        return ckpt.stage_state_dict(self.lightning_module.model, owned=self.engine.owned,
                                     frozen=self.save_frozen_parameters)

    @override
    def optimizer_state(self, optimizer) -> dict:
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return ckpt.optimizer_state_by_name(optimizer, ckpt.parameter_names(self.lightning_module.model))

    def checkpoint_layout(self) -> dict:
        """This run as a checkpoint records it (layout.json): the rank layout, world size and model."""
        return {**self.layout.to_dict(), "world_size": self.world_size, "parameters": self.model_fingerprint,
                "trainable": self.trainable_names, "frozen_saved": self.save_frozen_parameters}

    @override
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Collective: a DCP folder keyed by the unparallelised names, written atomically (``checkpoint.py``)."""
        if storage_options is not None:
            raise TypeError("MultimodalParallelStrategy writes DCP folders itself: storage_options is not supported")
        ckpt.save_checkpoint(os.path.abspath(self.broadcast(str(filepath))), checkpoint, rank=self.global_rank,
                             layout=self.checkpoint_layout(), device=self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Collective: this rank's parameters, optimiser state (by name) and RNG; a bad checkpoint raises everywhere."""
        path = os.path.abspath(self.broadcast(str(checkpoint_path)))
        return ckpt.load_checkpoint(path, model=self.lightning_module.model, owned=self.engine.owned,
                                    optimizers=self.optimizers, rank=self.global_rank, layout=self.checkpoint_layout(),
                                    device=self.root_device)

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint already loaded this stage's parameters

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint already loaded the optimisers by parameter name

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True)

    # ------------------------------------------------------------------ faults
    @override
    def on_exception(self, exception: BaseException) -> None:
        mark_failed()
        if self.watchdog is not None:
            if is_peer_loss(exception):  # let the watchdog name the rank that went away (it ends this process)
                self.watchdog.blame(self.fault_timeout + 2 * self.watchdog.interval)
            self.watchdog.report_failure(exception)
        super().on_exception(exception)

    @override
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


def resolve_layout(model: MultimodalModel, *, encoder_specs: dict[str, ParallelSpec] | None,
                   language_model_spec: ParallelSpec, placement: str, partition: Partition, world_size: int,
                   ranks_per_node: int, fault_tolerance: FaultTolerance | None) -> tuple[RankLayout, Partition]:
    """The rank layout and partition of ``world_size`` ranks (a fault-tolerance template's for that size where
    there are templates, else the given ones), checked against ``model``, before any process group."""
    encoders = model.pipeline_encoders  # an encoder sharing another's tower runs on its stages
    specs = encoder_specs if encoder_specs is not None else {e: ParallelSpec() for e in encoders}
    if world_size == 1:  # debug mode: the whole model in this process, whatever the specs say
        if any(s.size > 1 for s in [*specs.values(), language_model_spec]):
            rank_zero_warn("MultimodalParallelStrategy on 1 device runs the whole model in one process; the "
                           "ParallelSpecs apply from 2 devices on")
        specs, lm_spec, placement = single_process_specs(list(specs))
        return build_layout(specs, lm_spec, 1, placement, encoders), partition
    lm_spec = language_model_spec
    if fault_tolerance is not None and fault_tolerance.templates:
        template = fault_tolerance.template(world_size)  # re-formed groups take the layout of their size
        if problem := fault_tolerance.elastic_launch_problem():
            rank_zero_warn(problem)
        specs = {e: template.specs.get(e, ParallelSpec()) for e in encoders}
        lm_spec, placement = template.specs["language_model"], template.placement
        partition = {m: list(v) for m, v in template.partition.items()}
    layout = build_layout(specs, lm_spec, world_size, placement, encoders)
    check_tensor_parallel(model, {e: s.tp for e, s in specs.items()}, lm_spec.tp)
    check_context_parallel(model, lm_spec)
    check_node_locality(layout, ranks_per_node)
    return layout, partition


def check_launch_environment(cluster_environment, world_size: int, launcher) -> None:
    """LOCAL_RANK without WORLD_SIZE in the environment (left over from an earlier Trainer run in this process
    or shell) makes Lightning believe another launcher started the other ranks: rank 0 would wait for them
    forever. Raise instead, before any process group."""
    if (isinstance(cluster_environment, LightningEnvironment) and world_size > 1
            and not torch.distributed.is_initialized()  # later Trainer calls: WORLD_SIZE is gone by then
            and "LOCAL_RANK" in os.environ and "WORLD_SIZE" not in os.environ
            and not getattr(launcher, "procs", None)):
        raise RuntimeError(f"LOCAL_RANK={os.environ['LOCAL_RANK']} is set in the environment but WORLD_SIZE is "
                           f"not, so Lightning starts none of the other {world_size - 1} ranks and would "
                           "wait for them forever; unset LOCAL_RANK (and NODE_RANK) in this shell or process, "
                           "or launch every rank yourself (torchrun, SLURM)")


StrategyRegistry.register("multimodal", MultimodalParallelStrategy,
                          description="modality-parallel pipelines with data parallelism (lightning-mm)")
