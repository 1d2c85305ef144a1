"""Routing between modules of different data-parallel degrees (per-module data parallelism; DistTrain, seed 004).

Every rank of a group (``RankLayout.num_groups``) sees the same batch: the samples of the group's language-model
replicas, replica after replica. Language-model replica ``j`` trains its own rows, cut into microbatches as today.
Microbatch ``m`` of every replica together forms ``G_m``. An encoder with another number of replicas in the group
splits the rows of ``G_m`` that hold its items over its replicas by LPT on their work (the item work of encoder
context parallelism, summed per row): heaviest first, ties to the lower replica, each replica's rows ascending. An
encoder with as many replicas as the language model pairs replica ``j`` with replica ``j``
(``RankLayout.peer_replicas``). A row without items of an encoder routes nothing to it. Encoder replica ``i`` sends
language-model replica ``j`` the features of the rows of ``G_m`` it encoded that ``j`` trains (possibly none: every
pair exchanges a message each microbatch), and the feature gradients return the same way.

Pure: the sender and the receiver compute the same ``Routing`` from the batch alone (``fingerprint`` lets the
runtime check that they did). Choices where the seed is open are in docs/per_module_dp.md.
"""

from __future__ import annotations

import hashlib
import heapq

from lightning_mm.plan.schedule import Action


class Routing:
    """``llm_rows[j][m]``: the rows of language-model replica ``j``'s encoder microbatch ``m`` (batch row indices,
    ascending); ``encoder_rows[e][i][m]``: the rows encoder ``e``'s replica ``i`` encodes in microbatch ``m``. Not a
    collection or dataclass, so Lightning's ``transfer_batch_to_device`` leaves it as it is."""

    def __init__(self, llm_rows: list[list[list[int]]], encoder_rows: dict[str, list[list[list[int]]]]):
        self.llm_rows, self.encoder_rows = llm_rows, encoder_rows

    def __repr__(self) -> str:
        return f"Routing(llm_rows={self.llm_rows}, encoder_rows={self.encoder_rows})"

    def sent_rows(self, encoder: str, i: int, j: int, m: int) -> list[int]:
        """Rows whose ``encoder`` features replica ``i`` sends language-model replica ``j`` in microbatch ``m``."""
        mine = set(self.llm_rows[j][m])
        return [r for r in self.encoder_rows[encoder][i][m] if r in mine]

    def fingerprint(self) -> int:
        """A 62-bit digest of the whole table (ranks compare it before the step's first message)."""
        text = repr((self.llm_rows, sorted(self.encoder_rows.items())))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def route(llm_rows: list[list[list[int]]], work: dict[str, list[float]], encoder_replicas: dict[str, int]) -> Routing:
    """The routing of one group's batch. ``llm_rows[j][m]``: rows of replica ``j``'s encoder microbatch ``m``;
    ``work[e][r]``: encoder ``e``'s work of row ``r`` (0: no item); ``encoder_replicas[e]``: its replicas in the
    group."""
    counts = {len(replica) for replica in llm_rows}
    if len(counts) != 1:
        raise ValueError(f"every language-model replica needs the same number of microbatches, got {llm_rows}")
    num_microbatches = counts.pop()
    out: dict[str, list[list[list[int]]]] = {}
    for name, replicas in encoder_replicas.items():
        if replicas < 1:
            raise ValueError(f"encoder {name!r} needs at least one replica, got {replicas}")
        w = work[name]
        out[name] = [[] for _ in range(replicas)]
        for m in range(num_microbatches):
            if replicas == len(llm_rows):  # as many as the LLM's: replica j encodes LLM replica j's rows
                shares = [[r for r in replica[m] if w[r] > 0] for replica in llm_rows]
            else:
                shares = lpt([r for replica in llm_rows for r in replica[m] if w[r] > 0], w, replicas)
            for i, mine in enumerate(shares):
                out[name][i].append(mine)
    return Routing([[list(rows) for rows in replica] for replica in llm_rows], out)


def lpt(rows: list[int], work: list[float], replicas: int) -> list[list[int]]:
    """``rows`` over ``replicas`` by LPT on ``work[row]``: heaviest first (ties: lower row), each to the least
    loaded replica (ties: lower replica); each replica's rows ascending."""
    heap = [(0.0, i) for i in range(replicas)]
    out: list[list[int]] = [[] for _ in range(replicas)]
    for r in sorted(rows, key=lambda r: (-work[r], r)):
        load, i = heapq.heappop(heap)
        out[i].append(r)
        heapq.heappush(heap, (load + work[r], i))
    return [sorted(rows) for rows in out]


def check_group_batch(rows_per_replica: int, num_microbatches: int, llm_replicas: int,
                      encoder_replicas: dict[str, int]) -> None:
    """Refuse (with the fix) a batch too small to give every encoder replica rows in a microbatch: microbatch
    ``m`` of the group's ``llm_replicas`` replicas holds ``llm_replicas * rows_per_replica / num_microbatches``
    rows, which must be at least each encoder's replicas in the group."""
    per_microbatch = llm_replicas * (rows_per_replica // max(num_microbatches, 1))
    short = {e: n for e, n in encoder_replicas.items() if n > per_microbatch}
    if short:
        name, n = next(iter(short.items()))
        need = -(-n // llm_replicas) * num_microbatches
        raise ValueError(f"encoder {name!r} has {n} replicas for each group of {llm_replicas} language-model "
                         f"replicas, but a microbatch gives the group only {per_microbatch} samples "
                         f"(batch_size={rows_per_replica} per language-model replica, num_microbatches="
                         f"{num_microbatches}); raise batch_size to at least {need} or lower the encoder's dp")


def expand_replicas(actions: dict[str, list[Action]], replicas: dict[str, int], peers) -> dict[str, list[Action]]:
    """The stage-level action lists of a schedule as the action lists of every replica (``"stage#d"``): each
    message action becomes one action per peer replica, ``peers(stage, peer, d)`` (``RankLayout.peer_replicas``),
    in order, so ``check_rendezvous`` proves the many-to-many exchanges of per-module data parallelism."""
    out = {}
    for stage, acts in actions.items():
        for d in range(replicas[stage]):
            out[f"{stage}#{d}"] = [a if a.peer is None else Action(a.kind, a.microbatch, f"{a.peer}#{p}")
                                   for a in acts for p in ([None] if a.peer is None else peers(stage, a.peer, d))]
    return out
