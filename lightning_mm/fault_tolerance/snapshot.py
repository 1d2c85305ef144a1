"""Snapshots for a re-configuration that restarts every replica group (``lightning-mm agent --snapshot-dir``).

Groups re-form by restarting and heal from a group that kept training. When the table's move restarts every group
(two groups: A lost a node for good and borrows one from B, ``plan/reconfigure.py``'s ``snapshot_from``), no
group can give the state live, so the donor, which is healthy, writes it first. Keys on the agents' store
(``agent.py``'s ``lmm/agent/`` prefix), which the training processes reach through ``LMM_AGENT_STORE``:

- ``snapshot/request/<group>``: ``{"epoch", "group", "path"}``, set by the leader before the assignment;
- ``snapshot/at/<epoch>``: the committed step the donor snapshots after, set by its group rank 0 at the first step
  boundary that sees the request: the next step (the group's other ranks may already be past this boundary, but
  none can commit the next step before rank 0 votes, so every rank sees the key at that step's boundary);
- ``snapshot/done/<epoch>``: ``{"step", "path", "group"}`` once the snapshot is complete (``{"failed": ...}``
  when the donor's agent gave up waiting).

The donor's ranks save with ``trainer.save_checkpoint`` (the strategy's DCP folder, keyed by parameter name, so
any layout loads it: pp 3 -> pp 2), record the key and wait to be stopped; its agents stop it only then, and no
agent starts a group of that assignment before it. Every process started while the assignment names a snapshot
loads it at its first step, before its first quorum, if it is ahead of its own state: the groups go on from the
donor's step.
"""

from __future__ import annotations

import os
import time

from lightning_mm.fault_tolerance.agent import AGENT_STORE_ENV, AgentStore
from lightning_mm.fault_tolerance.config import FaultToleranceError, parse_address


def agent_store_from_env(timeout: float = 60.0):
    """A client of the agents' store named by ``LMM_AGENT_STORE`` (set by ``lightning-mm agent``), or None."""
    address = os.environ.get(AGENT_STORE_ENV)
    if not address:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    host, port = parse_address(address)
    return AgentStore(dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout)))


class AgentSnapshots:
    """The training side (a mixin of ``FaultTolerantTraining``): the donor's snapshot at a step boundary, and the
    load at a process's first step."""

    _agent_store = None
    _agent_store_read = False
    _stale_requests: set = set()

    def agent_store(self):
        if not self._agent_store_read:
            self._agent_store, self._agent_store_read, self._stale_requests = agent_store_from_env(), True, set()
        return self._agent_store

    def snapshot_boundary(self, trainer) -> None:
        """At a step boundary of a running process (before the quorum): if the agents asked this group for a
        snapshot, fix its step (rank 0), and at that step write it, record it and wait to be stopped."""
        s = self.agent_store()
        if s is None or not self.state.started:
            return
        req = s.get(f"snapshot/request/{self.config.replica_group}")
        if req is None or req["epoch"] in self._stale_requests:
            return
        epoch, step, rank = req["epoch"], self.manager.current_step(), self.strategy.global_rank
        if s.get(f"snapshot/done/{epoch}") is not None:  # an earlier process of this group wrote it
            self._stale_requests.add(epoch)
            return
        at = s.get(f"snapshot/at/{epoch}")
        if at is None:
            if rank == 0:
                s.set(f"snapshot/at/{epoch}", step + 1)
            return
        if step < at:
            return
        trainer.save_checkpoint(req["path"])
        if rank == 0:
            s.set(f"snapshot/done/{epoch}", {"step": step, "path": req["path"], "group": self.config.replica_group})
        self._event("snapshot", step=step, path=req["path"], epoch=epoch)
        while True:  # the agents stop this group now (SIGTERM): it must not commit another step
            time.sleep(1.0)

    def load_agent_snapshot(self, trainer) -> None:
        """At this process's first step, before its first quorum: the snapshot the current assignment names, if it
        is ahead of this group's step (parameters and optimiser state by name, schedulers, the step)."""
        s = self.agent_store()
        assignment = s.get("assignment") if s is not None else None
        snap = (assignment or {}).get("snapshot")
        if snap is None:
            return
        deadline = time.monotonic() + self.config.quorum_timeout
        while (done := s.get(f"snapshot/done/{snap['epoch']}")) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        if done is None or "failed" in done:
            why = done["failed"] if done else f"not written within quorum_timeout={self.config.quorum_timeout:g} s"
            raise FaultToleranceError(
                f"replica group {self.config.replica_group}: the snapshot of group {snap['group']} that every group "
                f"re-forms from ({snap['path']}) is missing: {why}. Resume the job from its last checkpoint "
                "(trainer.fit(ckpt_path=...))")
        if done["step"] <= self.manager.current_step():
            return
        st = self.strategy
        meta = st.load_checkpoint(done["path"])
        for cfg, sd in zip(st.lr_scheduler_configs, meta.get("lr_schedulers", [])):
            cfg.scheduler.load_state_dict(sd)
        self.manager.load_state_dict({"step": done["step"], "batches_committed": self.manager.batches_committed()})
        self._event("snapshot_loaded", step=done["step"], path=done["path"], epoch=snap["epoch"])
