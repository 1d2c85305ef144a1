"""Fault-tolerant replica groups (torchft): a quorum per step, gradients summed across the groups of the quorum,
a commit or a redo, healing from a peer, and the global sampler that keeps every step's global batch.

A replica group is one whole launch of the strategy (its own torchrun / Lightning launch, with its pipeline, tp,
cp and FSDP inside, exactly as without fault tolerance). Every group has the same rank layout, so rank r of every
group holds the same part of the model: torchft's process group joins rank r of every group in the quorum, and a
restarted group's rank r heals from rank r of a healthy group.

Per optimiser step (``MultimodalParallelStrategy`` calls these; nothing here is spread through the engine):

1. ``begin_step`` (in ``training_step``): the quorum (synchronous: a group behind the others loads a peer's
   state here, before it computes anything); the step number is torchft's committed step, so the global batch
   is ``global_batch_indices(step)``, cut over the groups of the quorum in proportion to their size
   (``group_shares``) and over the group's own data-parallel replicas; the share is loaded and collated here,
   after the quorum, and cut into as many microbatches as it needs (a group that takes a lost group's share runs
   more microbatches of the usual size).
2. The pipeline runs forward and backward; the strategy's ``backward`` sums gradients inside the group as always.
3. ``reduce_and_commit`` (in the closure the strategy serves to Lightning's ``optimizer_step``): one all-reduce
   across groups of ``C_g * grad`` (``C_g``: the group's label tokens; each group's loss is normalised by its own
   count), divided by the sum of the counts, so the gradient is that of the whole global batch's loss; then
   ``should_commit``. A step that lost a member is discarded (gradients dropped, no optimiser update) and redone
   with a new quorum; Lightning's optimiser step then runs once, on the committed gradients.

The training math is therefore that of an uninterrupted run over the same global batches, whatever groups come
and go (``tests/test_fault_tolerance.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, RandomSampler

from lightning_mm import ft_layerwise as layerwise
from lightning_mm.data.microbatch import PLAN_KEY

log = logging.getLogger(__name__)

REPLICA_GROUP_ENV = "LMM_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
TOKEN_KEY = "ft_step_token"


class FaultToleranceError(RuntimeError):
    """A fault-tolerance setting or situation the run cannot go on with (raised before training where possible)."""


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (also ``"http://host:port"`` and ``"[::1]:port"``) -> (host, port)."""
    text = address.strip()
    for prefix in ("http://", "https://"):
        text = text.removeprefix(prefix)
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"fault_tolerance.lighthouse must be 'host:port' (e.g. 'localhost:29510'), got {address!r}")
    return host, int(port)


@dataclasses.dataclass
class FaultTolerance:
    """Fault-tolerant data parallelism across replica groups (torchft; ``pip install lightning-mm[ft]``).

    ``lighthouse``: "host:port" of the torchft lighthouse (``lightning-mm lighthouse``; default ``$TORCHFT_LIGHTHOUSE``).
    ``replica_group``: this group's id, 0..``num_replica_groups``-1 (default ``$LMM_REPLICA_GROUP``).
    ``num_replica_groups``: how many groups the job is planned with: the global batch is the loader's batch size x
    the group's data-parallel size x this, whatever groups are alive. ``min_replicas``: the fewest groups a step
    commits with. ``timeout`` (s): cross-group collectives, commits and healing; ``quorum_timeout`` (s): how long a
    quorum may take (a group waits that long for ``min_replicas`` groups); ``connect_timeout`` (s): reaching the
    lighthouse and peers. ``heartbeat_interval`` (s): how often a group tells the lighthouse it is alive.
    ``max_retries``: consecutive failed commits before the group gives up (None: never). ``manager_port``: the port
    of group rank 0's torchft manager (0: any free one). ``hostname``: the name other groups reach this group's
    manager and checkpoint server by (default: this host's name). ``global_batch``: samples per step, whatever groups
    are alive; when given, the groups may differ in pipeline stages and encoder placement (each parameter's
    gradient is reduced with the groups' holders of its layer, keyed by name), and every group must give the
    same value. ``templates``: a templates file (``lightning-mm plan --templates``); with it a group takes the layout
    of its world size at every (re)start (a group launched with ``torchrun --nnodes MIN:MAX`` that loses a node
    re-forms at a smaller template), and each group's share of the global batch follows its template's planned
    speed. It needs ``global_batch``."""

    lighthouse: str = ""
    replica_group: int | None = None
    num_replica_groups: int = 1
    min_replicas: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0
    heartbeat_interval: float = 0.1
    max_retries: int | None = None
    manager_port: int = 0
    hostname: str | None = None
    global_batch: int | None = None
    templates: str | None = None

    def __post_init__(self):
        if not self.lighthouse:
            self.lighthouse = os.environ.get(LIGHTHOUSE_ENV, "")
        if not self.lighthouse:
            raise ValueError("fault_tolerance.lighthouse is not set: give 'host:port' of the lighthouse "
                             f"(lightning-mm lighthouse) or set ${LIGHTHOUSE_ENV}")
        parse_address(self.lighthouse)
        if self.replica_group is None:
            env = os.environ.get(REPLICA_GROUP_ENV)
            if env is None or not env.strip().lstrip("-").isdigit():
                raise ValueError(f"fault_tolerance.replica_group is not set: give this group's id (0..num_replica_groups"
                                 f"-1), or set ${REPLICA_GROUP_ENV} in each group's launch")
            self.replica_group = int(env)
        if self.num_replica_groups < 1:
            raise ValueError(f"fault_tolerance.num_replica_groups must be >= 1, got {self.num_replica_groups}")
        if not 0 <= self.replica_group < self.num_replica_groups:
            raise ValueError(f"fault_tolerance.replica_group={self.replica_group} is not in 0..{self.num_replica_groups - 1} "
                             f"(num_replica_groups={self.num_replica_groups})")
        if not 1 <= self.min_replicas <= self.num_replica_groups:
            raise ValueError(f"fault_tolerance.min_replicas must be in 1..num_replica_groups={self.num_replica_groups}, "
                             f"got {self.min_replicas}")
        for name in ("timeout", "quorum_timeout", "connect_timeout", "heartbeat_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fault_tolerance.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError(f"fault_tolerance.max_retries must be >= 0 or None, got {self.max_retries}")
        if self.templates and self.global_batch is None:
            raise ValueError("fault_tolerance.templates needs fault_tolerance.global_batch: groups re-formed at other "
                             "templates must agree on the samples of a step")
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"fault_tolerance.global_batch must be >= 1 samples (or None), got {self.global_batch}")
        if not 0 <= self.manager_port < 65536:
            raise ValueError(f"fault_tolerance.manager_port must be a port (0: any), got {self.manager_port}")

    def template(self, world_size: int):
        """The template of ``world_size`` devices from ``templates`` (a ValueError names the sizes covered)."""
        from lightning_mm.plan.templates import Templates

        return Templates.load(self.templates).template_for(world_size)

    @property
    def address(self) -> tuple[str, int]:
        return parse_address(self.lighthouse)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def as_fault_tolerance(value) -> FaultTolerance | None:
    """None, a FaultTolerance or its fields as a dict (a YAML) -> a FaultTolerance (or None)."""
    if value is None or isinstance(value, FaultTolerance):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(FaultTolerance)}
        if unknown:
            raise TypeError(f"fault_tolerance got unknown fields {sorted(unknown)}; it takes "
                            f"{[f.name for f in dataclasses.fields(FaultTolerance)]}")
        return FaultTolerance(**value)
    raise TypeError(f"fault_tolerance must be a lightning_mm.FaultTolerance or a dict of its fields, got {type(value)}")


def check_reachable(config: FaultTolerance) -> None:
    """A fast TCP connect to the lighthouse, with a message saying how to start one."""
    host, port = config.address
    try:
        with socket.create_connection((host, port), timeout=min(config.connect_timeout, 5.0)):
            pass
    except OSError as e:
        raise FaultToleranceError(
            f"the fault-tolerance lighthouse at {host}:{port} is unreachable ({e}); start it before the replica groups "
            f"(`lightning-mm lighthouse --min_replicas {config.min_replicas} --bind [::]:{port}`, or torchft's "
            f"`torchft_lighthouse`) and check fault_tolerance.lighthouse / ${LIGHTHOUSE_ENV}") from None


class _NoNcclNotes(logging.Filter):
    """Drops torchft's note that it cannot reset NCCL's flight recorder: a gloo run has no NCCL to trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def quiet_torchft() -> None:
    """torchft's Rust side logs ~9 INFO lines per step and group (quorum, commit votes) to stderr; it reads
    ``RUST_LOG`` once, when first imported. Default it to warnings; ``RUST_LOG=info`` brings the lines back. The
    project's own lines (``fault tolerance: {"event": ...}``, lost groups) are unaffected."""
    os.environ.setdefault("RUST_LOG", "warn")


def import_torchft():
    quiet_torchft()
    try:
        import torchft  # noqa: F401
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    except ImportError as e:
        raise FaultToleranceError(f"fault_tolerance needs torchft: pip install 'lightning-mm[ft]' ({e})") from None
    return Manager, ProcessGroupGloo, ProcessGroupNCCL


# ---------------------------------------------------------------------------------------------- the global sampler
def global_batches_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


def global_batch_indices(step: int, num_samples: int, global_batch: int, shuffle: bool = True,
                         seed: int = 0) -> list[int]:
    """The sample indices of global step ``step``: epoch ``step // batches per epoch`` in the order of a
    ``DistributedSampler`` with one replica (``randperm`` under ``seed + epoch`` when shuffled); an incomplete last
    global batch is dropped. Depends on the step only, so every group and a restarted group agree."""
    per_epoch = global_batches_per_epoch(num_samples, global_batch)
    if per_epoch < 1:
        raise ValueError(f"the data set has {num_samples} samples, fewer than one global batch of {global_batch}")
    epoch, i = divmod(step, per_epoch)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    else:
        order = list(range(num_samples))
    return order[i * global_batch:(i + 1) * global_batch]


def group_shares(num_samples: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` slices of ``num_samples`` in proportion to ``weights`` (largest remainder,
    ties to the earlier member), one per member in quorum order."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"group_shares needs positive weights, got {weights}")
    total = float(sum(weights))
    exact = [num_samples * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))[:num_samples - sum(counts)]:
        counts[i] += 1
    while num_samples >= len(counts) and 0 in counts:  # every member gets a sample while there are enough
        counts[counts.index(0)] += 1
        counts[max(range(len(counts)), key=lambda i: (counts[i], -i))] -= 1
    out, at = [], 0
    for c in counts:
        out.append((at, at + c))
        at += c
    return out


def microbatch_plan(rows: int, rows_per_microbatch: int) -> list[int]:
    """Each row's microbatch: ``ceil(rows / rows_per_microbatch)`` contiguous microbatches whose sizes differ by at
    most one (a group with a larger share runs more microbatches of about the usual size)."""
    count = max(1, min(rows, math.ceil(rows / max(1, rows_per_microbatch))))
    base, extra = divmod(rows, count)
    return [m for m in range(count) for _ in range(base + (m < extra))]


class StepTokens:
    """The training loader under fault tolerance: one small token per global batch of the epoch; the strategy
    loads the real samples after each step's quorum (``FaultTolerantTraining.begin_step``)."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for i in range(self.length):
            yield {TOKEN_KEY: torch.tensor([i])}


# ---------------------------------------------------------------------------------------------- per-step glue
def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _localise(state: Any) -> Any:
    """Every DTensor of a (nested) state as its local shard (what the checkpoint transport sends)."""
    if isinstance(state, dict):
        return {k: _localise(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_localise(v) for v in state)
    return _local(state).detach() if isinstance(state, torch.Tensor) else state


def _optimizer_state_like(optimizer, state: dict) -> dict:
    """A peer's optimiser state (local shards) with DTensor state rebuilt on this rank's DTensor parameters."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in state["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params))
    out = {}
    for i, entries in state["state"].items():
        p = by_id.get(i)
        if isinstance(p, DTensor):
            entries = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                             stride=p.stride())
                       if isinstance(v, torch.Tensor) and v.shape == p.to_local().shape and v.dim() else v
                       for k, v in entries.items()}
        out[i] = entries
    return {"state": out, "param_groups": state["param_groups"]}


class FaultTolerantTraining:
    """One rank's torchft glue, owned by ``MultimodalParallelStrategy`` (``strategy.ft``)."""

    def __init__(self, config: FaultTolerance, strategy):
        self.config, self.strategy = config, strategy
        self.manager = None
        self.data: dict | None = None
        self.stats = {"quorum_changes": 0, "healed_steps": 0, "redone_steps": 0, "lost_seconds": 0.0}
        self.participants = 0
        self._quorum_id = None
        self._first = True
        self._healed_to: int | None = None
        self._after_failure = False
        self._nominal_microbatches = strategy.num_microbatches
        self._schedules: dict[int, dict] = {}
        self._count = None
        self.events: list[dict] = []  # quorum changes, heals and redos, for logs and tests
        self.shares: dict[int, int] = {}  # step -> samples of the global batch this group took
        self.layerwise = config.global_batch is not None  # groups may differ in layout
        self._recorder = self._sync = self._doc = self._pg_class = None

    # ------------------------------------------------------------------ before training
    def check_before_setup(self, trainer) -> None:
        """What fault tolerance cannot serve, and the lighthouse's reachability: errors before any model build."""
        import_torchft()
        s = self.strategy
        reasons = []
        if trainer.accumulate_grad_batches != 1:
            reasons.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches} (each optimiser step is one "
                           "quorum and one commit: raise the batch size or num_microbatches instead)")
        if "16-mixed" in str(s.precision_plugin.precision):
            reasons.append("precision='16-mixed' (the grad scaler's skipped steps are not coordinated across "
                           "replica groups: use bf16-mixed or 32-true)")
        if s.batch_balancing not in (None, "none"):
            reasons.append(f"batch_balancing={s.batch_balancing!r} (the fault-tolerant global sampler places each "
                           "step's samples; use batch_balancing=None or 'none')")
        module = s.lightning_module
        if module is not None and not module.automatic_optimization:
            reasons.append("manual optimisation (the strategy serves the commit inside Lightning's automatic "
                           "optimizer_step)")
        if reasons:
            raise FaultToleranceError("fault_tolerance cannot serve this run: " + "; ".join(reasons))
        check_reachable(self.config)

    def connect(self, trainer) -> None:
        """Start this rank's torchft Manager (group rank 0 runs the group's manager server, the others join it)."""
        Manager, ProcessGroupGloo, ProcessGroupNCCL = import_torchft()
        s = self.strategy
        if len(s.optimizers) != 1:
            raise FaultToleranceError(f"fault_tolerance serves one optimiser, the module configured {len(s.optimizers)}")
        c = self.config
        timeout = timedelta(seconds=c.timeout)
        pg = ProcessGroupNCCL(timeout) if s.root_device.type == "cuda" else ProcessGroupGloo(timeout)
        if self.layerwise:  # the Manager only records each quorum's store; gradients go over per-bucket groups
            layerwise.check_servable(s)
            pg = layerwise.recorder_class()
            self._pg_class = type(ProcessGroupNCCL(timeout) if s.root_device.type == "cuda" else
                                  ProcessGroupGloo(timeout))
        self._recorder = pg
        if s.root_device.type != "cuda":
            logging.getLogger("torchft.manager").addFilter(_NoNcclNotes())
        env = s.cluster_environment
        kw = dict(pg=pg, load_state_dict=self.load_state_dict, state_dict=self.state_dict,
                  min_replica_size=c.min_replicas, use_async_quorum=False, timeout=timeout,
                  quorum_timeout=timedelta(seconds=c.quorum_timeout),
                  connect_timeout=timedelta(seconds=c.connect_timeout), rank=s.global_rank, world_size=s.world_size,
                  store_addr=env.main_address, store_port=env.main_port, lighthouse_addr=c.url,
                  replica_id=f"lmm_group_{c.replica_group}", port=c.manager_port or None,
                  hostname=c.hostname or socket.gethostname(),
                  heartbeat_interval=timedelta(seconds=c.heartbeat_interval), init_sync=False,
                  max_retries=c.max_retries)
        # torchft keeps the manager's address under a fixed key of the group's store, which outlives a torchrun
        # restart: rank 0 writes the new one before any other rank reads it
        if s.global_rank == 0:
            self.manager = Manager(**kw)
        if s.world_size > 1:
            dist.barrier()
        if s.global_rank != 0:
            self.manager = Manager(**kw)
        log.info("fault tolerance: replica group %s, group rank %s, lighthouse %s", c.replica_group,
                 s.global_rank, c.url)

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ------------------------------------------------------------------ data
    def training_loader(self, dataloader) -> StepTokens:
        """Remember what the loader reads (data set, per-replica batch size, collation, order) and hand Lightning
        step tokens instead: the samples of a step are chosen after its quorum."""
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            shuffle, seed = sampler.shuffle, sampler.seed
        else:
            shuffle, seed = isinstance(sampler, RandomSampler), 0
        batch_size = getattr(dataloader, "batch_size", None)
        dataset = getattr(dataloader, "dataset", None)
        if batch_size is None or dataset is None or not hasattr(dataset, "__getitem__"):
            raise FaultToleranceError("fault_tolerance needs a training DataLoader over a map-style data set with a "
                                      "batch_size (its samples are chosen per step after the quorum)")
        s = self.strategy
        global_batch = self.config.global_batch or batch_size * s.layout.dp * self.config.num_replica_groups
        self.data = dict(dataset=dataset, collate=dataloader.collate_fn, batch_size=batch_size, shuffle=shuffle,
                         seed=seed, global_batch=global_batch, num_samples=len(dataset))
        return StepTokens(global_batches_per_epoch(len(dataset), global_batch) or 1)

    def fingerprint(self) -> int:
        """Everything groups must share to train one model together: layout, model, global batch, data order."""
        s = self.strategy
        lay = s.layout
        d = self.data or {}
        doc = {"stages": lay.stages, "cp": lay.cp, "tp": lay.tp, "dp": lay.dp, "placement": lay.placement,
               "module_stages": lay.module_stages, "world_size": s.world_size, "model": s.model_fingerprint,
               "sharding": s.sharding_strategy, "groups": self.config.num_replica_groups,
               "data": [d.get(k) for k in ("global_batch", "num_samples", "shuffle", "seed")]}
        if self.layerwise:  # groups may differ in their layout, not in tensor parallelism
            doc = {k: v for k, v in doc.items() if k in ("model", "sharding", "data")}
            doc["tp"] = sorted(set(lay.tp.values()))
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).digest()
        return int.from_bytes(digest[:7], "big")

    # ------------------------------------------------------------------ the step
    def begin_step(self, token) -> dict:
        """The quorum (healing when behind), then this rank's share of the step's global batch, on the device."""
        s = self.strategy
        trainer = s.lightning_module.trainer
        m = self.manager
        if self.data is None:
            raise FaultToleranceError("fault_tolerance: the training loader was not prepared by the strategy")
        if self._first:  # a run resumed from a checkpoint starts at the step Lightning restored
            self._first = False
            # SIGTERM (torchrun stopping a failed group, a preemption) ends the rank at once, even inside a blocking
            # torchft call, so its group stops heartbeating and the other groups go on after the heartbeat timeout
            # (Lightning's handler, registered after setup, would wait for the call to return)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if m.current_step() < trainer.global_step:
                m.load_state_dict({"step": trainer.global_step, "batches_committed": m.batches_committed()})
        t0 = time.perf_counter()
        self.quorum()
        # a fresh job starts with every planned group (up to quorum_timeout), so that no group trains alone from
        # step 0 while the others are still starting; later a quorum is whoever is alive
        while (m.current_step() == 0 and self._quorum_size() < self.config.num_replica_groups
               and time.perf_counter() - t0 < self.config.quorum_timeout):
            time.sleep(0.2)
            self.quorum()
        quorum_s = time.perf_counter() - t0
        if self._after_failure:  # waiting for the new quorum after a failed attempt is lost time too
            self.stats["lost_seconds"] += quorum_s
            self._after_failure = False
        step = m.current_step()
        if self._healed_to is not None:
            self.stats["healed_steps"] += 1
            self.stats["lost_seconds"] += quorum_s
            self._event("healed", step=step, seconds=round(quorum_s, 3))
            self._healed_to = None
        participants, me = m.num_participants(), m.participating_rank()
        quorum_id = self._recorder.last["quorum_id"] if self.layerwise else m._quorum_id
        if quorum_id != self._quorum_id:  # every member of a new quorum sees it at the same point
            self._quorum_id = quorum_id
            self.stats["quorum_changes"] += 1
            self._event("quorum", step=step, participants=self._quorum_size(), quorum_id=self._quorum_id)
            if self.layerwise:
                if self._doc is None:  # after the loader is known (the data settings are in the fingerprint)
                    self._doc = layerwise.holdings_doc(s, self.fingerprint())
                if self._sync is not None:
                    layerwise.release(self._sync)
                self._sync = layerwise.setup_quorum(
                    layerwise.group_view(self._recorder.last, s.world_size), self.config.replica_group, s.global_rank,
                    self._doc, step, timedelta(seconds=self.config.timeout),
                    lambda addr, rid, pos, size: self._configured(addr, rid, pos, size))
                self.warn_missing(sorted(set(range(self.config.num_replica_groups)) - set(self._sync.group_ids)))
                step = self._heal_by_name(step, quorum_s)
            else:
                self.check_same_job()
        weights = None
        if self.layerwise:  # torchft counts only the groups at the newest step; every group of the quorum trains
            participants, me, weights = len(self._sync.group_ids), self._sync.index, self._sync.speeds
        self.participants = participants
        set_lightning_step(trainer, step)
        if me is None:
            raise FaultToleranceError(f"replica group {self.config.replica_group} is not a participant of quorum "
                                      f"{self._quorum_id}")
        d = self.data
        indices = global_batch_indices(step, d["num_samples"], d["global_batch"], d["shuffle"], d["seed"])
        lo, hi = group_shares(len(indices), weights or [1.0] * participants)[me]
        self.shares[step] = hi - lo
        dp = s.layout.dp
        rlo, rhi = group_shares(hi - lo, [1.0] * dp)[s.layout.coordinate(s.global_rank).dp]
        mine = indices[lo:hi][rlo:rhi]
        if not mine:
            raise FaultToleranceError(
                f"step {step}: {participants} replica groups of {dp} data-parallel replicas share a global batch of "
                f"{len(indices)} samples, so a replica gets none; raise the batch size or lower num_replica_groups")
        batch = d["collate"]([d["dataset"][i] for i in mine])
        batch = self.plan_microbatches(batch)
        batch = s.batch_to_device(batch)
        from lightning_mm import loss as losses

        count = losses.count_label_tokens(batch["labels"]).reshape(1).to(s.root_device, torch.float32)
        if s.engine.groups.dp is not None:
            dist.all_reduce(count, group=s.engine.groups.dp)
        self._count = count
        if isinstance(token, dict):  # hooks after training_step (on_train_batch_end, callbacks) see the real batch
            token.clear()
            token.update(batch)
            return token
        return batch

    def quorum(self) -> None:
        try:
            # across layouts torchft cannot heal (it copies rank r's state to rank r): heal_by_name does
            self.manager.start_quorum(allow_heal=not self.layerwise,
                                      timeout=timedelta(seconds=self.config.quorum_timeout))
        except Exception as e:
            raise FaultToleranceError(
                f"replica group {self.config.replica_group}: no quorum of at least {self.config.min_replicas} replica "
                f"groups within {self.config.quorum_timeout:g} s (lighthouse {self.config.lighthouse}): {e}") from e

    def plan_microbatches(self, batch: dict) -> dict:
        """Microbatches of about the usual row count (more of them for a larger share), as a microbatch plan."""
        s = self.strategy
        rows = batch["input_ids"].shape[0]
        per = max(1, self.data["batch_size"] // self._nominal_microbatches)
        plan = microbatch_plan(rows, per)
        self.use_microbatches(plan[-1] + 1)
        ids = batch["input_ids"]
        tokens = {name: (ids == pid).sum(1).tolist() for name, pid in s.multimodal_model().placeholder_ids.items()}
        batch[PLAN_KEY] = {"encoder": list(plan), "llm": list(plan), "tokens": tokens}
        return batch

    def use_microbatches(self, count: int) -> None:
        s = self.strategy
        self._schedules.setdefault(s.engine.num_microbatches, s.engine.schedules)  # schedules per microbatch count
        if s.engine.num_microbatches != count:
            s.engine.schedules = self._schedules.setdefault(count, {})
            s.engine.num_microbatches = s.num_microbatches = count

    def check_same_job(self) -> None:
        """Every group of a new quorum must run the same layout, model and data: compared over the quorum."""
        m = self.manager
        h = self.fingerprint()
        present = [0] * self.config.num_replica_groups  # which groups are in the quorum: a MAX of one-hot rows
        present[self.config.replica_group] = 1
        t = torch.tensor([h, -h, *present], dtype=torch.int64, device=self.strategy.root_device)
        m.allreduce(t, reduce_op=dist.ReduceOp.MAX).wait()
        if m.errored() is not None:
            return
        if int(t[0]) != -int(t[1]):
            raise FaultToleranceError(
                f"replica group {self.config.replica_group}: the replica groups of quorum {self._quorum_id} differ in "
                "their rank layout, model, global batch or data order; every group must run the same strategy "
                "settings, devices, model and data (only replica_group differs)")
        self.warn_missing([g for g, p in enumerate(t[2:].tolist()) if not p])

    def warn_missing(self, missing: list[int]) -> None:
        """A warning (group rank 0) naming the planned replica groups absent from the quorum."""
        if not missing or self.strategy.global_rank != 0:
            return
        c = self.config
        when = (f"did not join within quorum_timeout={c.quorum_timeout:g} s" if self.manager.current_step() == 0
                else "left the quorum")
        log.warning("fault tolerance: replica group(s) %s of %d %s; training goes on with %d group(s), each taking "
                    "a larger share of the global batch (a group joins at the next quorum once it reaches the "
                    "lighthouse %s)", ", ".join(map(str, missing)), c.num_replica_groups, when,
                    c.num_replica_groups - len(missing), c.lighthouse)

    def reduce_and_commit(self) -> bool:
        """Sum the gradients across the quorum's groups (weighted by label tokens), then torchft's commit vote."""
        s, m = self.strategy, self.manager
        if self.layerwise:
            return self.sync_layers_and_commit()
        params = s.engine.trainable_parameters()
        device = s.root_device
        sizes = [_local(p).numel() for p in params]
        n = sum(sizes)
        flat = torch.zeros(n + len(params) + 1, dtype=torch.float32, device=device)
        count = self._count if self._count is not None else torch.zeros(1, device=device)
        at = 0
        for p, k in zip(params, sizes):
            if p.grad is not None:
                flat[at:at + k] = _local(p.grad).detach().reshape(-1).float() * count[0]
            at += k
        flat[n:n + len(params)] = torch.tensor([float(p.grad is not None) for p in params], device=device)
        flat[-1] = count[0]
        m.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        if m.errored() is None:
            total = torch.clamp(flat[-1], min=1.0)
            at = 0
            for i, (p, k) in enumerate(zip(params, sizes)):
                used = bool(flat[n + i] > 0)
                if not used:
                    p.grad = None
                else:
                    part = (flat[at:at + k] / total).view_as(_local(p))
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    _local(p.grad).copy_(part)
                at += k
        ok = m.should_commit(timeout=timedelta(seconds=self.config.timeout))
        self._count = None
        return ok

    def sync_layers_and_commit(self) -> bool:
        """Each bucket of layers reduced with the other groups' holders of it (weighted by label tokens), then
        torchft's commit vote; a failed reduction (a group lost inside the step) is reported and fails the vote."""
        from lightning_mm.parallel.layer_sync import sync_layers

        s, m, sync = self.strategy, self.manager, self._sync
        count = self._count if self._count is not None else torch.zeros(1, device=s.root_device)
        try:
            sync_layers(sync.buckets, sync.index, s.global_rank, layerwise.weighted_params(s), count,
                        sync.process_groups)
        except Exception as e:  # noqa: BLE001  (torchft decides: the vote fails and the step is redone)
            m.report_error(e)
        ok = m.should_commit(timeout=timedelta(seconds=self.config.timeout))
        self._count = None
        return ok

    def _quorum_size(self) -> int:
        """Groups in the current quorum (torchft's participants are only those at the newest step when it does not
        heal, which it does not across layouts)."""
        if self.layerwise and self._recorder.last is not None:
            return self._recorder.last["groups"]
        return self.manager.num_participants()

    def _heal_by_name(self, step: int, quorum_s: float) -> int:
        """Every member of a quorum with a group behind takes part; the group behind takes the newest step."""
        s, sync = self.strategy, self._sync
        if len(set(sync.steps)) == 1:
            return step
        healed = layerwise.heal_by_name(sync, s.global_rank, layerwise.weighted_params(s), s.optimizers[0],
                                        [cfg.scheduler for cfg in s.lr_scheduler_configs], s.root_device)
        if healed is None:
            return step
        self.manager.load_state_dict({"step": healed, "batches_committed": self.manager.batches_committed()})
        self.stats["healed_steps"] += 1
        self.stats["lost_seconds"] += quorum_s
        self._event("healed", step=healed, seconds=round(quorum_s, 3), by="name")
        return healed

    def _configured(self, store_addr: str, replica_id: str, rank: int, world_size: int):
        pg = self._pg_class(timedelta(seconds=self.config.timeout))
        pg.configure(store_addr, replica_id, rank, world_size)
        return pg

    def committed(self, closure, optimizer):
        """Lightning's closure, repeated until the quorum commits it (torchft's own optimiser wrapper refuses
        closures). A failed attempt's gradients are dropped; the optimiser steps once, after the commit."""

        def run():
            while True:
                t0 = time.perf_counter()
                result = closure()
                if self.reduce_and_commit():
                    self.use_microbatches(self._nominal_microbatches)
                    self.log_metrics()
                    return result
                lost = time.perf_counter() - t0
                self.stats["redone_steps"] += 1
                self.stats["lost_seconds"] += lost
                self._event("redo", step=self.manager.current_step(), seconds=round(lost, 3),
                            error=str(self.manager.errored() or "")[:200])
                optimizer.zero_grad(set_to_none=True)
                self._after_failure = True

        return run

    # ------------------------------------------------------------------ healing
    def state_dict(self) -> dict:
        """This rank's part of the training state (sent to the same rank of a recovering group)."""
        s = self.strategy
        module = s.lightning_module
        trainer = module.trainer
        params = {n: _local(p).detach() for n, p in module.model.named_parameters()
                  if n in s.engine.owned and p.requires_grad}
        return {"params": params, "optimizers": [_localise(o.state_dict()) for o in s.optimizers],
                "schedulers": [cfg.scheduler.state_dict() for cfg in s.lr_scheduler_configs],
                "lightning_step": int(trainer.global_step)}

    def load_state_dict(self, state: dict) -> None:
        s = self.strategy
        module = s.lightning_module
        named = dict(module.model.named_parameters())
        with torch.no_grad():
            for n, t in state["params"].items():
                _local(named[n]).copy_(t)
        for opt, sd in zip(s.optimizers, state["optimizers"]):
            opt.load_state_dict(_optimizer_state_like(opt, sd))
        for cfg, sd in zip(s.lr_scheduler_configs, state["schedulers"]):
            cfg.scheduler.load_state_dict(sd)
        self._healed_to = state["lightning_step"]

    # ------------------------------------------------------------------ logs
    def _event(self, kind: str, **info) -> None:
        info = {"event": kind, "group": self.config.replica_group, **info}
        self.events.append(info)
        if self.strategy.global_rank == 0:
            log.warning("fault tolerance: %s", json.dumps(info))

    def log_metrics(self) -> None:
        s = self.strategy
        trainer = s.lightning_module.trainer
        if s.global_rank != 0 or not trainer.loggers:
            return
        metrics = {"ft/participants": float(self.participants), **{f"ft/{k}": float(v) for k, v in self.stats.items()}}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self.manager.current_step())


def set_lightning_step(trainer, step: int) -> None:
    """Move Lightning's optimiser-step counters (``trainer.global_step``) to torchft's committed step (after a
    heal, or a resume that the quorum moved)."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.automatic_optimization.optim_progress.optimizer.step
    delta = step - progress.total.completed
    if delta:
        for tracker in (progress.total, progress.current):
            tracker.ready += delta
            tracker.completed += delta
        loop._batches_that_stepped += delta


def lighthouse_banner(bind: str, announced: str, min_replicas: int) -> str:
    """What the lighthouse is bound to and the ``fault_tolerance.lighthouse`` value groups give to reach it
    (torchft announces this host's name, which a server bound to a loopback address does not answer on)."""
    host, port = parse_address(bind)
    if host in ("::", "0.0.0.0", ""):
        reach, where = f"{urlparse(announced).hostname or socket.gethostname()}:{port}", "every interface"
    else:
        reach, where = f"{'[' + host + ']' if ':' in host else host}:{port}", "this address only"
    return (f"lighthouse bound to {bind} ({where}), min_replicas={min_replicas}; replica groups reach it with "
            f"fault_tolerance.lighthouse={reach} (or TORCHFT_LIGHTHOUSE={reach})")


def lighthouse_main(args: list[str] | None = None) -> None:
    """``lightning-mm lighthouse``: run a torchft lighthouse (the quorum service every replica group reaches)."""
    import argparse

    parser = argparse.ArgumentParser(prog="lightning-mm lighthouse",
                                     description="the torchft lighthouse of fault-tolerant replica groups")
    parser.add_argument("--bind", default="[::]:29510", help="address to listen on (default [::]:29510)")
    parser.add_argument("--min_replicas", type=int, default=1, help="fewest replica groups a quorum has")
    parser.add_argument("--join_timeout_ms", type=int, default=60000,
                        help="how long a quorum waits for groups that heartbeat but have not asked to join")
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=5000,
                        help="a group silent this long is dead: the others go on without it")
    parser.add_argument("--quorum_tick_ms", type=int, default=100)
    a = parser.parse_args(args)
    quiet_torchft()
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as e:
        raise SystemExit(f"lightning-mm lighthouse needs torchft: pip install 'lightning-mm[ft]' ({e})")
    server = LighthouseServer(bind=a.bind, min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                              quorum_tick_ms=a.quorum_tick_ms, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    print(lighthouse_banner(a.bind, server.address(), a.min_replicas), flush=True)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        signal.sigwait(stop)
    finally:
        server.shutdown()
