"""Every DeviceMesh and process group of a rank, built once from the layout and then looked up by name.

Like torchtitan's ``ParallelDims.build_mesh``: the rank layout (``plan/layout.py``) says which ranks form each group;
``Meshes.build`` creates them all, in the same order on every rank (``new_group`` and ``DeviceMesh`` are collective
over the world), and the runtime only reads them. No other module creates a group or a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_mm.plan.layout import RankLayout
from lightning_mm.plan.schedule import LANGUAGE_MODEL

MESH_DIMS = ("dp", "pp", "cp", "tp")
SHARD_MESH_DIMS = ("pp", "dp_cp", "tp")  # FSDP and TP meshes must share a root
EP_MESH_DIMS = ("edp", "ep", "pp", "cp", "tp")


def new_groups(members: list[list[int]], rank: int, backend: str | None = None, desc: str | None = None,
               timeout: timedelta | None = None):
    """Create one process group per rank list, in the given order (call on every rank); returns the one holding
    ``rank``, or None where that list has a single rank or no list holds it. ``desc`` names the groups in torch's
    flight recorder and so in the watchdog's messages; ``timeout`` (None: torch's default for the backend) is the
    job's."""
    mine = None
    for ranks in members:
        group = dist.new_group(ranks, backend=backend, group_desc=desc, timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            mine = group
    return mine


def hybrid_groups(ranks: list[int], k: int, rank: int, timeout: timedelta | None = None) -> dict:
    """The groups of hybrid CP over one CP group (global ``ranks`` in CP-rank order): the Ulysses groups of CP ranks
    ``g*K .. g*K+K-1`` and the gather groups of CP ranks ``j, K+j, 2K+j, ...``; returns ``{"ulysses": ...,
    "gather": ...}`` for ``rank`` (empty when it is not in ``ranks``). Every rank calls it for every CP group, in the
    same order."""
    mine = {}
    n = len(ranks)
    for name, members in [("ulysses", [ranks[g * k:(g + 1) * k] for g in range(n // k)]),
                          ("gather", [ranks[j::k] for j in range(k)])]:
        for m in members:
            group = dist.new_group(m, group_desc=f"cp {name}", timeout=timeout)
            if rank in m:
                mine[name] = group
    return mine


def context_parallel_groups(layout: RankLayout, rank: int, cp_group, timeout: timedelta | None = None):
    """What this rank's CP attention takes as its group: the plain CP group for ``"allgather"``, else a
    ``ContextParallelGroups``; for ``"hybrid"`` the groups of every LLM stage, replica and tp rank are created here."""
    from lightning_mm.attention.ulysses import ContextParallelGroups

    mode, k = layout.cp_mode, layout.ulysses
    if mode == "allgather" or (mode == "ulysses" and cp_group is None):
        return cp_group
    if mode == "ulysses":
        return ContextParallelGroups("ulysses", cp_group, ulysses=cp_group)
    mine = {}
    for stage in [s for s in layout.stages if layout.cp[s] > 1]:
        for d in range(layout.dp):
            for t in range(layout.tp[stage]):
                mine.update(hybrid_groups([layout.rank(stage, d, c, t) for c in range(layout.cp[stage])], k, rank,
                                          timeout))
    if layout.cp[layout.coordinate(rank).stage] == 1:
        return cp_group
    return ContextParallelGroups("hybrid", cp_group, ulysses=mine["ulysses"], gather=mine["gather"])


def device_mesh(device_type: str, ranks, dims: tuple[str, ...], rank: int, timeout: timedelta | None) -> DeviceMesh:
    """A ``DeviceMesh`` of ``ranks`` whose groups (on the ranks it holds) time out after ``timeout``. torch gives a
    mesh's groups the backend's default (NCCL 10 min, gloo 30 min) and takes another one only inside a backend's
    options object (``backend_override``, a private ``_timeout`` field), so it is set after the fact: the one place
    that calls ``distributed_c10d._set_pg_timeout``."""
    mesh = DeviceMesh(device_type, torch.as_tensor(ranks), mesh_dim_names=dims)
    if timeout is not None and rank in mesh.mesh.flatten().tolist():
        for dim in dims:
            dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh


def module_meshes(layout: RankLayout, device_type: str, rank: int,
                  timeout: timedelta | None = None) -> dict[str, DeviceMesh]:
    """One ``DeviceMesh`` per module chain with named dims ("dp", "pp", "cp", "tp")."""
    return {chain: device_mesh(device_type, layout.mesh_ranks(chain), MESH_DIMS, rank, timeout)
            for chain in layout.chains()}


def ep_mesh_ranks(layout: RankLayout) -> torch.Tensor:
    """The LLM chain's ranks as a ``[dp / ep, ep, pp, cp, tp]`` array (``EP_MESH_DIMS``)."""
    ranks = torch.tensor(layout.mesh_ranks(LANGUAGE_MODEL))
    return ranks.view(layout.dp // layout.ep, layout.ep, *ranks.shape[1:])


def expert_grad_ranks(layout: RankLayout) -> list[list[int]]:
    """Every group of ranks holding the same experts: per (stage, ep index), all groups, CP ranks and tp ranks."""
    ranks = ep_mesh_ranks(layout)
    return [ranks[:, e, s].flatten().tolist() for s in range(ranks.shape[2]) for e in range(layout.ep)]


@dataclass
class ExpertMeshes:
    """Expert parallelism's meshes: ``ep`` / ``tp`` (None on a rank outside the LLM) and ``grad``, the ranks holding
    the same experts (their gradients are summed there only)."""

    ep: DeviceMesh | None = None
    tp: DeviceMesh | None = None
    grad: object = None
    grad_size: int = 1

    @classmethod
    def build(cls, layout: RankLayout, rank: int, device_type: str, timeout: timedelta | None = None) -> "ExpertMeshes":
        mesh = device_mesh(device_type, ep_mesh_ranks(layout), EP_MESH_DIMS, rank, timeout)
        mine = rank in mesh.mesh.flatten().tolist()
        members = expert_grad_ranks(layout)
        size = next((len(r) for r in members if rank in r), 1)
        return cls(mesh["ep"] if mine else None, mesh["tp"] if mine else None,
                   new_groups(members, rank, desc="expert gradients", timeout=timeout), size)


@dataclass
class Meshes:
    """The groups one rank runs with. ``mesh``: the DeviceMesh of its module chain (dims ``MESH_DIMS``); ``dp`` /
    ``cp`` / ``tp``: its dims' groups (None when of size 1); ``cp_attention``: what the CP attention takes;
    ``tp_mesh``: the 1-D tp mesh DTensor takes; ``shard_mesh``: the dp x cp mesh FSDP shards over (None without
    FSDP or of size 1). ``grad``: every rank holding this rank's parameter shards (replicas x CP ranks of the same tp
    rank); ``replica``: every rank that sees this rank's batch (its replica; under per-module data parallelism its
    group of replicas); ``headers``: a gloo group over every rank for message headers (``comm.py``); ``tie``: the
    LLM's first and last stage of this replica when they share tied embeddings; ``experts``: expert parallelism's."""

    meshes: dict[str, DeviceMesh]
    mesh: DeviceMesh
    dp: object = None
    cp: object = None
    cp_attention: object = None
    tp_mesh: DeviceMesh | None = None
    tp: object = None
    shard_mesh: DeviceMesh | None = None
    grad: object = None
    grad_size: int = 1
    headers: object = None
    replica: object = None
    tie: object = None
    experts: ExpertMeshes | None = None

    @classmethod
    def build(cls, layout: RankLayout, rank: int, *, device_type: str = "cpu", sharded: bool = False,
              tie_stages: tuple[str, str] | None = None, timeout: timedelta | None = None) -> "Meshes":
        """Create every group of the layout (call on every rank, with the same arguments); ``timeout``: the job's
        process-group timeout, for every group (None: torch's default for the backend)."""
        coord = layout.coordinate(rank)
        chain = coord.stage.rsplit(".", 1)[0]
        meshes = module_meshes(layout, device_type, rank, timeout)
        mesh, replicas = meshes[chain], layout.replicas(chain)
        cp = mesh["cp"].get_group() if layout.cp[coord.stage] > 1 else None
        out = cls(meshes, mesh, dp=mesh["dp"].get_group() if replicas > 1 else None, cp=cp,
                  cp_attention=context_parallel_groups(layout, rank, cp, timeout))
        tp_source = mesh
        if sharded:
            shard = {c: device_mesh(device_type, layout.shard_mesh_ranks(c), SHARD_MESH_DIMS, rank, timeout)
                     for c in layout.chains()}
            tp_source = shard[chain]
            out.shard_mesh = tp_source["dp_cp"] if replicas * layout.cp[coord.stage] > 1 else None
        out.tp_mesh = tp_source["tp"] if layout.tp[coord.stage] > 1 else None
        out.tp = out.tp_mesh.get_group() if out.tp_mesh is not None else None
        grads = [layout.grad_group_ranks(s, t) for s in layout.stages for t in range(layout.tp[s])]
        out.grad = new_groups(grads, rank, desc="gradients", timeout=timeout)
        out.grad_size = len(layout.grad_group_ranks(coord.stage, coord.tp))
        out.headers = dist.new_group(backend="gloo", group_desc="stage message headers", timeout=timeout)
        out.replica = new_groups([layout.group_ranks(g) for g in range(layout.num_groups)], rank, desc="replica",
                                 timeout=timeout)
        if tie_stages is not None:
            first, last = tie_stages
            out.tie = new_groups([[layout.rank(first, d, c, t), layout.rank(last, d, c, t)] for d in range(layout.dp)
                                  for c in range(layout.cp[first]) for t in range(layout.tp[first])], rank,
                                 desc="tied weights", timeout=timeout)
        if layout.ep > 1:
            out.experts = ExpertMeshes.build(layout, rank, device_type, timeout)
        return out
