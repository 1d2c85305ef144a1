"""A step redone after a replica group was lost inside it, computed while the lighthouse still waits.

When a group dies inside a step, the survivors' cross-group reduction fails within milliseconds (gloo: the dead
peer's sockets closed) or at the lighthouse check (``abandon.py``), but the lighthouse forms the next quorum only
once the lost group's heartbeat is older than its heartbeat timeout. Redoing the step only after that quorum
costs the heartbeat timeout plus a whole step. Instead, the survivors compute the redo at once with the quorum
they expect (the last one without the groups they saw lost: the share of the global batch that quorum gives
them), then join the real quorum and check it is that one (same groups, same order, same templates, same step, no
heal). If it is, the gradients computed meanwhile are reduced and committed: the stall is the heartbeat timeout
plus the reduction and commit. If not (another group also left or joined, or the lost group came back), they are
dropped and the step is computed again with the real quorum's share: never a wrong gradient, only no gain.

A mixin of ``FaultTolerantTraining`` (``training.py``), whose state it reads. Only layer-wise groups (those with
``global_batch``) without gradient accumulation redo early: their reduction names the lost groups bucket by
bucket, and every rank of the group agrees on them (one all-reduce inside the group) before any computes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_mm.plan.layer_sync import buckets_of


class EarlyRedo:
    """Which peer groups the last attempt saw lost (``note_lost``), the quorum expected without them
    (``expect_quorum``), the redo's step and position from it (``expected_position``), the check against the
    real quorum (``expectation_held``) and the fallback when it fails (``settle_early_redo``)."""

    _lost: set
    _expected: dict | None
    _joined: tuple[int, int] | None

    def reset_redo(self) -> None:
        self._lost, self._expected, self._joined = set(), None, None

    def note_lost(self, groups) -> None:
        """Replica-group ids this rank saw fail in the step's reduction."""
        self._lost |= set(groups)

    def failed_bucket_peers(self, works: list) -> set[int]:
        """The peer groups of the buckets whose reduction failed, where a bucket's process group joins this group
        with exactly one other (with more, which one was lost is unknown: none is named)."""
        sync, rank = self.state.sync, self.strategy.global_rank
        lost = set()
        for (_, bucket, t, _), work in zip(buckets_of(sync.buckets, sync.index, rank), works):
            try:
                work.wait()
            except Exception:  # noqa: BLE001  (the failure itself is reported by the caller)
                others = {sync.group_ids[g] for g, _ in bucket.members[t] if g != sync.index}
                if len(others) == 1:
                    lost |= others
        return lost

    def expect_quorum(self) -> None:
        """After a failed vote: the groups any rank of this group saw lost (a MAX all-reduce over the group's
        ranks, which all reach this point), and the quorum expected without them. None is expected when no group
        was named, or outside layer-wise groups without accumulation."""
        st, s, lost = self.state, self.strategy, self._lost
        self._lost, self._expected = set(), None
        if not self.layerwise or self.accumulate != 1 or st.sync is None:
            return
        ids = st.sync.group_ids
        seen = torch.tensor([int(g in lost) for g in ids], dtype=torch.int64, device=s.root_device)
        if s.world_size > 1:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        keep = [i for i, flag in enumerate(seen.tolist()) if not flag or i == st.sync.index]
        if len(keep) == len(ids):
            return
        self._expected = {"group_ids": [ids[i] for i in keep], "index": keep.index(st.sync.index),
                          "templates": [st.sync.templates[i] for i in keep], "step": self.manager.current_step()}

    def expected_position(self) -> tuple[int, int]:
        """The redo's step and this group's position in the expected quorum (its groups share the global batch)."""
        e = self._expected
        self.state.participants = len(e["group_ids"])
        return e["step"], e["index"]

    def share_templates(self) -> list:
        """The templates the step's global batch is split by: the expected quorum's while redoing early."""
        if self._expected is not None:
            return self._expected["templates"]
        return super().share_templates()

    def expectation_held(self, computed: float = 0.0) -> bool:
        """Join the real quorum and compare it with the expected one; when they differ, the next computation of
        the step takes the real quorum's share without joining again (the other groups already wait for this
        group's reduction). ``computed``: the early computation's seconds, for the record."""
        e, self._expected = self._expected, None
        step, position = self.join_quorum()
        sync = self.state.sync
        held = (step == e["step"] and position == e["index"] and sync.group_ids == e["group_ids"]
                and sync.templates == e["templates"])
        self._event("early_redo", step=step, held=held, groups=sync.group_ids, computed=round(computed, 3))
        if not held:
            self._joined = (step, position)
        return held

    def settle_early_redo(self, closure, optimizer, result, started: float) -> tuple:
        """After an attempt's closure: an early redo joins the real quorum (``join_quorum`` counts its wait as lost
        time). When it is not the expected one (the fallback), the early computation is dropped and counted as
        lost time, and the step is computed again with the real quorum's share. Returns the closure's result and
        the start of the attempt's own time (its computation and reduction, without the quorum's wait)."""
        if self._expected is None:
            return result, started
        early = time.perf_counter() - started
        if self.expectation_held(early):
            return result, time.perf_counter() - early
        self.stats["lost_seconds"] += early
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        return closure(), started

    def position_for_step(self) -> tuple[int, int]:
        """The step and this group's position: the expected quorum's (early redo), the one already joined (an
        expectation that did not hold), or a new quorum."""
        if self._expected is not None:
            return self.expected_position()
        if self._joined is not None:
            joined, self._joined = self._joined, None
            return joined
        return self.join_quorum()


__all__ = ["EarlyRedo"]
