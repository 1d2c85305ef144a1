"""Per-module data parallelism's exchange: the features an encoder replica sends to each language-model replica of
its group, and their gradients back, as the batch's routing says (``plan/routing.py``: one table that sender and
receiver both compute from the group's batch). The runner (``engine.py``) calls it on the edges between chains of
different degrees; it only executes the routing, it does not decide it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mm.data.cp_plans import GroupRouter
from lightning_mm.data.microbatch import as_one_microbatch, deferrals
from lightning_mm.plan.layout import RankLayout
from lightning_mm.plan.routing import Routing
from lightning_mm.plan.schedule import LANGUAGE_MODEL


class RoutedExchange:
    """One rank's side of the routed exchange for one step. ``rows(batch, tokens)`` routes the group's batch (the
    same on every rank of the group, checked); ``chunks`` holds, per (microbatch, peer stage), the features received
    from each sender replica until ``assemble`` joins them, then how they were joined until ``split_gradients``."""

    def __init__(self, router: GroupRouter, layout: RankLayout, rank: int, device: torch.device, replica_group):
        self.router, self.layout, self.device, self.replica_group = router, layout, device, replica_group
        self.coord = layout.coordinate(rank)
        self.stage = self.coord.stage
        self.chunks: dict = {}

    def routed(self, peer: str) -> bool:
        """Whether messages with ``peer`` follow the routing (an edge between chains of different degrees)."""
        return self.layout.chain_of(peer) != self.layout.chain_of(self.stage)

    def rows(self, batch: dict, tokens: dict[str, list[int]], language_model: bool):
        """This stage's encoder and LLM microbatch rows in its group's batch, and the deferrals every stage of the
        group schedules with (those of any of its language-model replicas); checks that every rank of the group
        routes alike. ``tokens``: feature tokens of each modality per row."""
        per_replica = self.router.rows(batch)
        self.routing: Routing = self.router(batch)
        self.row_tokens = tokens
        self.chunks = {}
        check_same_routing(self.routing, self.replica_group, self.device)
        deferred = tuple(sorted({m for enc, llm in per_replica for m in deferrals(enc, llm)}))
        chain = self.layout.chain_of(self.stage)
        j = self.coord.dp % self.layout.per_group(chain)
        if language_model:
            return (*per_replica[j], deferred)
        rows = self.routing.encoder_rows[chain][j]
        return rows, rows, deferred

    def whole_batch(self, batch: dict, tokens: dict[str, list[int]], language_model: bool) -> list[int]:
        """Generation: the group's batch routed as a step of one microbatch routes it (each language-model
        replica's rows whole, every encoder's rows shared over its replicas by the same LPT); this stage's rows of
        it (the loader's microbatch plan and routing are dropped: ``as_one_microbatch``). Checks that every rank of
        the group routes alike."""
        whole = as_one_microbatch(batch)
        router = GroupRouter(self.router.encoders, self.router.encoder_replicas, self.router.llm_replicas, 1,
                             self.router.shared)
        self.routing, self.row_tokens, self.chunks = router(whole), tokens, {}
        check_same_routing(self.routing, self.replica_group, self.device)
        chain = self.layout.chain_of(self.stage)
        j = self.coord.dp % self.layout.per_group(chain)
        return self.routing.llm_rows[j][0] if language_model else self.routing.encoder_rows[chain][j][0]

    def feature_index(self, m: int, llm_replica: int, key: str) -> torch.Tensor:
        """Rows (feature tokens) of this encoder replica's microbatch ``m`` output ``key`` (a modality: the chain's
        own, or one sharing its tower) that go to ``llm_replica``."""
        name = self.layout.chain_of(self.stage)
        per_group = self.layout.per_group
        i, j = self.coord.dp % per_group(name), llm_replica % per_group(LANGUAGE_MODEL)
        tokens = self.row_tokens[key]
        start, at = {}, 0
        for r in self.routing.encoder_rows[name][i][m]:
            start[r] = at
            at += tokens[r]
        index = [start[r] + t for r in self.routing.sent_rows(name, i, j, m) for t in range(tokens[r])]
        return torch.tensor(index, dtype=torch.long, device=self.device)

    def receive(self, m: int, peer: str, replica: int, message: dict) -> None:
        """File the features ``replica`` of ``peer``'s chain sent for microbatch ``m``."""
        self.chunks.setdefault((m, peer), []).append((replica, message))

    def assemble(self, m: int, peer: str) -> dict:
        """Microbatch ``m``'s features from every replica of ``peer``'s encoder, each modality in this replica's
        row order (new tensors: a deferring microbatch's features serve two backwards, so they are leaves like any
        message; ``split_gradients`` takes their gradients back apart)."""
        parts = self.chunks[(m, peer)]
        orders = {k: self._order(m, peer, parts, k) for k in parts[0][1]}
        self.chunks[(m, peer)] = (orders, [(i, {k: t.shape[0] for k, t in part.items()}) for i, part in parts])
        return {k: torch.cat([part[k] for _, part in parts]).index_select(0, orders[k]) for k in parts[0][1]}

    def _order(self, m: int, peer: str, parts: list, key: str) -> torch.Tensor:
        """Where each feature token of modality ``key``, in this replica's row order, lies in the senders' parts
        joined in arrival order."""
        name = self.layout.chain_of(peer)
        per_group = self.layout.per_group
        j = self.coord.dp % per_group(LANGUAGE_MODEL)
        tokens = self.row_tokens[key]
        start, at = {}, 0
        for i, _ in parts:
            for r in self.routing.sent_rows(name, i % per_group(name), j, m):
                start[r] = at
                at += tokens[r]
        return torch.tensor([start[r] + t for r in self.routing.llm_rows[j][m] if r in start
                             for t in range(tokens[r])], dtype=torch.long, device=self.device)

    def split_gradients(self, m: int, peer: str, grads: dict) -> list[tuple[int, dict]]:
        """The gradients of ``assemble``'s features as one message per sender replica."""
        orders, parts = self.chunks.pop((m, peer))
        out = [(i, {}) for i, _ in parts]
        for k, g in grads.items():
            pieces = torch.zeros_like(g).index_copy_(0, orders[k], g).split([sizes[k] for _, sizes in parts])
            for (_, msg), piece in zip(out, pieces):
                msg[k] = piece
        return out


def check_same_routing(routing: Routing, group, device) -> None:
    """Raise on every rank of ``group`` unless all of them route the batch alike (``Routing.fingerprint``)."""
    if group is None:
        return
    mine = routing.fingerprint()
    both = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if both.tolist() != [mine, -mine]:
        raise RuntimeError(f"the ranks {dist.get_process_group_ranks(group)} that share a batch routed it differently "
                           "between the modules' replicas (per-module data parallelism); every rank of a group must "
                           "see the same batch and the same routing: let MultimodalParallelStrategy build the "
                           "training loader, with the same seed on every rank")
