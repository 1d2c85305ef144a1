"""One rank's torchft glue: the quorum per step, the share of the global batch, the cross-group reduction and
commit, healing, and the step counters Lightning sees."""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, RandomSampler

from lightning_mm.fault_tolerance import abandon, layerwise
from lightning_mm.fault_tolerance.config import (FaultTolerance, FaultToleranceError, _NoNcclNotes, check_reachable,
                                                 import_torchft)
from lightning_mm.fault_tolerance.links import GroupLinks
from lightning_mm.fault_tolerance.redo import EarlyRedo
from lightning_mm.fault_tolerance.sampler import StepTokens, global_batches_per_epoch
from lightning_mm.fault_tolerance.shares import StepShares
from lightning_mm.fault_tolerance.snapshot import AgentSnapshots

log = logging.getLogger("lightning_mm.fault_tolerance")


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


def unservable(trainer, strategy) -> list[str]:
    """The settings of a run that fault tolerance cannot serve, each with what to do instead."""
    reasons = []
    if trainer.accumulate_grad_batches != 1 and strategy.fault_tolerance.global_batch is not None:
        reasons.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches} with global_batch (replica groups "
                       "of different layouts exchange no per-batch label counts: raise global_batch instead)")
    if str(strategy.precision_plugin.precision) == "16-mixed":  # not bf16-mixed, which the message offers
        reasons.append("precision='16-mixed' (the grad scaler's skipped steps are not coordinated across "
                       "replica groups: use bf16-mixed or 32-true)")
    module = strategy.lightning_module
    if module is not None and not module.automatic_optimization:
        reasons.append("manual optimisation (the strategy serves the commit inside Lightning's automatic "
                       "optimizer_step)")
    return reasons


def job_fingerprint(strategy, data: dict, num_groups: int, *, across_layouts: bool) -> int:
    """Everything groups must share to train one model together: layout, model, global batch, data order (across
    layouts: only model, sharding, tensor parallelism and data)."""
    lay = strategy.layout
    doc = {"layout": lay.to_dict(), "world_size": strategy.world_size, "model": strategy.model_fingerprint,
           "sharding": strategy.sharding_strategy, "groups": num_groups,
           "data": [data.get(k) for k in ("global_batch", "num_samples", "shuffle", "seed")]}
    if across_layouts:
        doc = {k: v for k, v in doc.items() if k in ("model", "sharding", "data")}
        doc["tp"] = sorted(set(lay.tp.values()))
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:7], "big")


def rank_training_state(strategy) -> dict:
    """This rank's trainable parameters, optimiser and scheduler states (local shards) and Lightning's step."""
    module = strategy.lightning_module
    params = {n: _local(p).detach() for n, p in module.model.named_parameters()
              if n in strategy.engine.owned and p.requires_grad}
    return {"params": params, "optimizers": [_localise(o.state_dict()) for o in strategy.optimizers],
            "schedulers": [cfg.scheduler.state_dict() for cfg in strategy.lr_scheduler_configs],
            "lightning_step": int(module.trainer.global_step)}


def load_rank_training_state(strategy, state: dict) -> None:
    """A peer's :func:`rank_training_state` into this rank's parameters, optimiser and schedulers."""
    named = dict(strategy.lightning_module.model.named_parameters())
    with torch.no_grad():
        for n, t in state["params"].items():
            _local(named[n]).copy_(t)
    for opt, sd in zip(strategy.optimizers, state["optimizers"]):
        opt.load_state_dict(_optimizer_state_like(opt, sd))
    for cfg, sd in zip(strategy.lr_scheduler_configs, state["schedulers"]):
        cfg.scheduler.load_state_dict(sd)


def quorum_recorder(base: type, *args):
    """A torchft process group of class ``base`` that also records its last ``configure``: torchft's public call
    telling a process group of a new quorum (its store, this group's position, the number of groups, the quorum id).
    """

    class QuorumRecorder(base):
        last: dict | None = None

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None):
            # recorded first: a quorum whose process group fails to configure is still a new quorum (its step fails)
            self.last = dict(store=store_addr.split("/torchft/", 1)[0], replica_id=replica_id, index=rank,
                             groups=world_size, quorum_id=quorum_id)
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                              global_ranks)

    return QuorumRecorder(*args)


def reduce_across_groups(manager, params: list, count: torch.Tensor) -> None:
    """Each group's gradients (its mean over its ``count`` label tokens) times ``count``, summed over the quorum and
    divided by the summed counts: the gradient of the whole global batch's loss; a parameter without a gradient in
    every group keeps none. Left as they are when the all-reduce failed (the commit vote then fails)."""
    device = count.device
    sizes = [_local(p).numel() for p in params]
    n = sum(sizes)
    flat = torch.zeros(n + len(params) + 1, dtype=torch.float32, device=device)
    at = 0
    for p, k in zip(params, sizes):
        if p.grad is not None:
            flat[at:at + k] = _local(p.grad).detach().reshape(-1).float() * count[0]
        at += k
    flat[n:n + len(params)] = torch.tensor([float(p.grad is not None) for p in params], device=device)
    flat[-1] = count[0]
    manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return
    total = torch.clamp(flat[-1], min=1.0)
    used, at = flat[n:n + len(params)].tolist(), 0  # one host read
    for p, k, u in zip(params, sizes, used):
        if not u > 0:
            p.grad = None
        else:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _local(p.grad).copy_((flat[at:at + k] / total).view_as(_local(p)))
        at += k


@dataclass
class StepState:
    """This rank's view of the quorum and the step between torchft calls (the Manager owns the committed step)."""

    quorum_id: int | None = None  # the quorum the group last trained in
    participants: int = 0  # groups sharing the step's global batch
    started: bool = False  # the first step of this process ran
    healed_to: int | None = None  # the step a peer's state healed this rank to, until the heal is counted
    after_failure: bool = False  # the last attempt failed: waiting for the next quorum is lost time
    label_tokens: torch.Tensor | None = None  # the step's label tokens over the group: its weight across groups
    sync: layerwise.QuorumSync | None = None  # across layouts: this quorum's buckets and their process groups


class FaultTolerantTraining(EarlyRedo, StepShares, AgentSnapshots):
    """One rank's torchft glue, owned by ``MultimodalParallelStrategy`` (``strategy.ft``): torchft's Manager for
    the quorum, the commit and the committed step, a :class:`StepState` for the rest."""

    def __init__(self, config: FaultTolerance, strategy):
        self.config, self.strategy = config, strategy
        self.manager = None
        self.data: dict | None = None
        self.state = StepState()
        self.stats = {"quorum_changes": 0, "healed_steps": 0, "redone_steps": 0, "lost_seconds": 0.0}
        self.events: list[dict] = []  # quorum changes, heals and redos, for logs and tests
        self.shares: dict[int, int] = {}  # step -> samples of the global batch this group took
        self.layerwise = config.global_batch is not None  # groups may differ in layout
        self._nominal_microbatches = strategy.num_microbatches
        self._recorder = self._doc = self._pg_class = self._links = None
        self.reset_shares()
        self.reset_redo()

    # ------------------------------------------------------------------ before training
    def check_before_setup(self, trainer) -> None:
        """What fault tolerance cannot serve, and the lighthouse's reachability: errors before any model build."""
        import_torchft()
        self.accumulate = trainer.accumulate_grad_batches
        reasons = unservable(trainer, self.strategy)
        if reasons:
            raise FaultToleranceError("fault_tolerance cannot serve this run: " + "; ".join(reasons))
        check_reachable(self.config)

    def connect(self, trainer) -> None:
        """Start this rank's torchft Manager (group rank 0 runs the group's manager server, the others join it)."""
        Manager, ProcessGroupGloo, ProcessGroupNCCL = import_torchft()
        s = self.strategy
        if len(s.optimizers) != 1:
            raise FaultToleranceError(f"fault_tolerance serves one optimiser, the module configured "
                                      f"{len(s.optimizers)}")
        c = self.config
        timeout = timedelta(seconds=c.timeout)
        pg_class = ProcessGroupNCCL if s.root_device.type == "cuda" else ProcessGroupGloo
        if self.layerwise:  # the Manager only records each quorum's store; gradients go over per-bucket groups
            from torchft.process_group import ProcessGroupDummy

            layerwise.check_servable(s)
            self._recorder, self._pg_class = quorum_recorder(ProcessGroupDummy, 0, 1), pg_class
        else:
            self._recorder = quorum_recorder(pg_class, timeout)
        if s.root_device.type != "cuda":
            logging.getLogger("torchft.manager").addFilter(_NoNcclNotes())
        env = s.cluster_environment
        kw = dict(pg=self._recorder, load_state_dict=self.load_state_dict, state_dict=self.state_dict,
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
        if s.world_size > 1:  # a rank that ends ends its group at once (links.py)
            self._links = GroupLinks(s.global_rank, s.world_size, c.replica_group).start(env.main_address)
        log.info("fault tolerance: replica group %s, group rank %s, lighthouse %s", c.replica_group,
                 s.global_rank, c.url)

    def shutdown(self) -> None:
        if self._links is not None:
            self._links.close()
            self._links = None
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
                         seed=seed, global_batch=global_batch, num_samples=len(dataset),
                         balance=self._balancing(dataloader, dataset), placed=self._placed_collate(dataloader))
        k = self.accumulate  # Lightning steps at an epoch's end: whole optimiser steps per epoch
        return StepTokens(max(k, global_batches_per_epoch(len(dataset), global_batch) // k * k))

    def fingerprint(self) -> int:
        """Everything groups must share to train one model together (:func:`job_fingerprint`)."""
        return job_fingerprint(self.strategy, self.data or {}, self.config.num_replica_groups,
                               across_layouts=self.layerwise)

    # ------------------------------------------------------------------ the step
    def begin_step(self, token) -> dict:
        """The quorum (healing when behind), then this rank's share of the step's global batch, planned in
        microbatches, on the device."""
        if self.data is None:
            raise FaultToleranceError("fault_tolerance: the training loader was not prepared by the strategy")
        if self._micro == 0:  # the first micro-batch of a step (or of its redo): the quorum, then every share
            self.snapshot_boundary(self.strategy.lightning_module.trainer)  # the agents' snapshot (snapshot.py)
            self.load_step(*self.position_for_step())
        batch = self._next_micro_batch()
        if isinstance(token, dict):  # hooks after training_step (on_train_batch_end, callbacks) see the real batch
            token.clear()
            token.update(batch)
            return token
        return batch

    # ------------------------------------------------------------------ the quorum
    def join_quorum(self) -> tuple[int, int]:
        """This step's quorum (a new one checked and, across layouts, healed by name): torchft's committed step,
        which Lightning's step counters follow, and this group's position among the groups sharing the step."""
        st, m = self.state, self.manager
        trainer = self.strategy.lightning_module.trainer
        if not st.started:
            self._start(trainer)
        quorum_s = self._wait_for_quorum()
        step = m.current_step()
        self._count_lost_time(step, quorum_s)
        quorum_id = self._recorder.last["quorum_id"]
        if quorum_id != st.quorum_id:  # every member of a new quorum sees it at the same point
            step = self._new_quorum(quorum_id, step, quorum_s)
        if self.layerwise:  # torchft counts only the groups at the newest step; every group of the quorum trains
            st.participants, position = len(st.sync.group_ids), st.sync.index
        else:
            st.participants, position = m.num_participants(), m.participating_rank()
        set_lightning_step(trainer, step)
        if position is None:
            raise FaultToleranceError(f"replica group {self.config.replica_group} is not a participant of quorum "
                                      f"{st.quorum_id}")
        return step, position

    def _start(self, trainer) -> None:
        """The first step of this process: SIGTERM (torchrun stopping a failed group, a preemption) ends the rank at
        once, even inside a blocking torchft call, so its group stops heartbeating and the other groups go on after
        the heartbeat timeout (Lightning's handler, registered after setup, would wait for the call to return); a
        run resumed from a checkpoint starts at the step Lightning restored, and one that the agents re-formed
        from a snapshot at the snapshot's step (``snapshot.py``)."""
        self.state.started = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        m = self.manager
        if m.current_step() < trainer.global_step:
            m.load_state_dict({"step": trainer.global_step, "batches_committed": m.batches_committed()})
        self.load_agent_snapshot(trainer)

    def _wait_for_quorum(self) -> float:
        """The step's quorum, in seconds. A fresh job waits (up to quorum_timeout) for every planned group, so that
        no group trains alone from step 0 while the others are still starting; later a quorum is whoever is alive
        (a group behind a quorum's newest step, torchft's ``participating_rank() is None``, joins a job under way:
        a group that merged into another or stays down is not waited for)."""
        m, c = self.manager, self.config
        t0 = time.perf_counter()
        self.quorum()
        while (m.current_step() == 0 and m.participating_rank() is not None
               and self._quorum_size() < c.num_replica_groups
               and time.perf_counter() - t0 < c.quorum_timeout):
            time.sleep(0.2)
            self.quorum()
        return time.perf_counter() - t0

    def quorum(self) -> None:
        try:
            # across layouts torchft cannot heal (it copies rank r's state to rank r): heal_by_name does
            self.manager.start_quorum(allow_heal=not self.layerwise,
                                      timeout=timedelta(seconds=self.config.quorum_timeout))
        except Exception as e:
            raise FaultToleranceError(
                f"replica group {self.config.replica_group}: no quorum of at least {self.config.min_replicas} replica "
                f"groups within {self.config.quorum_timeout:g} s (lighthouse {self.config.lighthouse}): {e}") from e

    def _count_lost_time(self, step: int, quorum_s: float) -> None:
        """Waiting for a quorum after a failed attempt is lost time, and so is a heal from a peer."""
        st = self.state
        if st.after_failure:
            self.stats["lost_seconds"] += quorum_s
            st.after_failure = False
        if st.healed_to is not None:
            self.stats["healed_steps"] += 1
            self.stats["lost_seconds"] += quorum_s
            self._event("healed", step=step, seconds=round(quorum_s, 3))
            st.healed_to = None

    def _new_quorum(self, quorum_id: int, step: int, quorum_s: float) -> int:
        """A quorum the group has not trained in: counted and its groups checked to train one job; across layouts,
        its buckets' process groups configured and the groups behind healed by name. Returns the step."""
        s, st, c = self.strategy, self.state, self.config
        st.quorum_id = quorum_id
        self.stats["quorum_changes"] += 1
        self._event("quorum", step=step, participants=self._quorum_size(), quorum_id=quorum_id)
        if not self.layerwise:
            self.check_same_job()
            return step
        if self._doc is None:  # after the loader is known (the data settings are in the fingerprint)
            self._doc = layerwise.holdings_doc(s, self.fingerprint())
        if st.sync is not None:
            layerwise.release(st.sync)
        st.sync = layerwise.setup_quorum(layerwise.group_view(self._recorder.last, s.world_size), c.replica_group,
                                         s.global_rank, self._doc, step, timedelta(seconds=c.timeout),
                                         self._bucket_process_group)
        self.warn_missing(sorted(set(range(c.num_replica_groups)) - set(st.sync.group_ids)))
        return self._heal_by_name(step, quorum_s)

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
                f"replica group {self.config.replica_group}: the replica groups of quorum {self.state.quorum_id} "
                "differ in their rank layout, model, global batch or data order; every group must run the same "
                "strategy settings, devices, model and data (only replica_group differs)")
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

    def _quorum_size(self) -> int:
        """Groups in the current quorum (torchft's participants are only those at the newest step when it does not
        heal, which it does not across layouts)."""
        if self.layerwise and self._recorder.last is not None:
            return self._recorder.last["groups"]
        return self.manager.num_participants()

    # ------------------------------------------------------------------ reduction and commit
    def reduce_and_commit(self) -> bool:
        """Sum the gradients across the quorum's groups (weighted by label tokens), then torchft's commit vote."""
        if self.layerwise:
            return self.sync_layers_and_commit()
        reduce_across_groups(self.manager, self.strategy.engine.trainable_parameters(), self._take_label_tokens())
        return self.manager.should_commit(timeout=timedelta(seconds=self.config.timeout))

    def sync_layers_and_commit(self) -> bool:
        """Each bucket of layers reduced with the other groups' holders of it (weighted by label tokens), then
        torchft's commit vote; a failed reduction (a group lost inside the step) is reported and fails the vote."""
        from lightning_mm.parallel.layerwise_reduce import sync_layers

        s, m, sync = self.strategy, self.manager, self.state.sync
        params = layerwise.weighted_params(s)
        try:
            sync_layers(sync.buckets, sync.index, s.global_rank, params, self._take_label_tokens(),
                        sync.process_groups, wait=self._wait_or_abandon)
        except Exception as e:  # noqa: BLE001  (torchft decides: the vote fails and the step is redone)
            m.report_error(e)
        if s.engine.groups.grad is not None:  # the stage's data- and context-parallel copies take the result
            layerwise.copy_to_stage_copies(params, self._stage_holder(), s.engine.groups.grad, device=s.root_device)
        return m.should_commit(timeout=timedelta(seconds=self.config.timeout))

    def _wait_or_abandon(self, works: list) -> None:
        """The cross-group reductions, abandoned (``PeerGroupLost``) as soon as the lighthouse marks a group of
        the quorum as no longer heartbeating (``abandon.py``)."""
        c, sync = self.config, self.state.sync
        peers = [f"lmm_group_{g}" for g in sync.group_ids if g != c.replica_group]
        try:  # the lighthouse is read 10 times a second: its heartbeat timeout is seconds
            abandon.wait_or_abandon(works, lambda: abandon.lost_groups(abandon.lighthouse_heartbeats(c.url), peers),
                                    check_every=0.1)
        except abandon.PeerGroupLost as e:  # the groups lost, for an early redo (redo.py)
            self.note_lost(int(name.rsplit("_", 1)[1]) for name in e.groups)
            raise
        except Exception:
            self.note_lost(self.failed_bucket_peers(works))
            raise

    def _take_label_tokens(self) -> torch.Tensor:
        """The step's label-token count (zero when the step computed none), cleared for the next attempt."""
        count, self.state.label_tokens = self.state.label_tokens, None
        return count if count is not None else torch.zeros(1, device=self.strategy.root_device)

    def committed(self, closure, optimizer):
        """Lightning's closure, repeated until the quorum commits it (torchft's own optimiser wrapper refuses
        closures). A failed attempt's gradients are dropped; the optimiser steps once, after the commit."""

        def run():
            while True:
                t0 = time.perf_counter()
                result = closure()
                result, t0 = self.settle_early_redo(closure, optimizer, result, t0)  # its quorum checked (redo.py)
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
                self.state.after_failure = True
                self._micro, self._replay = 0, self.accumulate > 1
                self.expect_quorum()  # the redo is computed before its quorum forms (redo.py)

        return run

    # ------------------------------------------------------------------ healing
    def _stage_holder(self) -> int:
        """The rank of this rank's stage (and tp index) that reduces across groups: its dp 0, cp 0 rank."""
        coord = self.strategy.layout.coordinate(self.strategy.global_rank)
        return self.strategy.layout.rank(coord.stage, 0, 0, coord.tp)

    def _heal_by_name(self, step: int, quorum_s: float) -> int:
        """Every member of a quorum with a group behind takes part; the group behind takes the newest step."""
        s, sync = self.strategy, self.state.sync
        if len(set(sync.steps)) == 1:
            return step
        params = layerwise.weighted_params(s)
        healed = layerwise.heal_by_name(sync, s.global_rank, params, s.optimizers[0],
                                        [cfg.scheduler for cfg in s.lr_scheduler_configs], s.root_device)
        if healed is None:
            return step
        if s.engine.groups.grad is not None:
            layerwise.copy_to_stage_copies(params, self._stage_holder(), s.engine.groups.grad,
                                           optimizer=s.optimizers[0], device=s.root_device)
        self.manager.load_state_dict({"step": healed, "batches_committed": self.manager.batches_committed()})
        self.stats["healed_steps"] += 1
        self.stats["lost_seconds"] += quorum_s
        self._event("healed", step=healed, seconds=round(quorum_s, 3), by="name")
        return healed

    def _bucket_process_group(self, store_addr: str, replica_id: str, rank: int, world_size: int):
        pg = self._pg_class(timedelta(seconds=self.config.timeout))
        pg.configure(store_addr, replica_id, rank, world_size)
        return pg

    def state_dict(self) -> dict:
        """This rank's part of the training state (sent to the same rank of a recovering group)."""
        return rank_training_state(self.strategy)

    def load_state_dict(self, state: dict) -> None:
        load_rank_training_state(self.strategy, state)
        self.state.healed_to = state["lightning_step"]

    # ------------------------------------------------------------------ logs
    def _event(self, kind: str, **info) -> None:
        info = {"event": kind, "group": self.config.replica_group, **info, "at": round(time.time(), 3)}
        self.events.append(info)
        if self.strategy.global_rank == 0:
            log.warning("fault tolerance: %s", json.dumps(info))

    def log_metrics(self) -> None:
        s = self.strategy
        trainer = s.lightning_module.trainer
        if s.global_rank != 0 or not trainer.loggers:
            return
        metrics = {"ft/participants": float(self.state.participants),
                   **{f"ft/{k}": float(v) for k, v in self.stats.items()}}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self.manager.current_step())


def set_lightning_step(trainer, step: int) -> None:
    """Move Lightning's optimiser-step counters (``trainer.global_step``) and its batches that stepped (the logging
    step) to torchft's committed step (after a heal, or a resume that the quorum moved): through the optimiser
    progress's ``increment_by`` and the epoch loop's own checkpoint hooks. Lightning 2.6 has no public setter of
    the batches that stepped; its checkpoint key names it."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.automatic_optimization.optim_progress.optimizer.step
    delta = step - progress.total.completed
    if delta:
        progress.increment_by(delta)
        state = loop.on_save_checkpoint()
        state["_batches_that_stepped"] += delta
        loop.on_load_checkpoint(state)
