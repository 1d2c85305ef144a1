"""The mesh builder on real gloo ranks: every group a rank runs with takes the job's process-group timeout, not
torch's default for its backend (NCCL 10 min, gloo 30 min), which would otherwise apply to every group but the world."""

from datetime import timedelta

import pytest
import torch

from lightning_mm import ParallelSpec
from lightning_mm.plan.layout import build_layout
from tests.helpers.distributed import run_distributed

TIMEOUT = timedelta(seconds=77)


def _timeouts(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mm.parallel.meshes import Meshes

    # 2 replicas of vision pp 1 beside the LLM's cp 4 (hybrid: Ulysses and gather groups of 2), experts over ep 2
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(cp=4, ep=2, cp_mode="hybrid", ulysses=2), world,
                          "parallel", ["vision"])
    out = Meshes.build(layout, rank, sharded=True, timeout=TIMEOUT)
    groups = {"headers": out.headers, "grad": out.grad, "replica": out.replica}
    for name, mesh in [*out.meshes.items(), ("shard", out.shard_mesh), ("tp", out.tp_mesh),
                       ("ep", out.experts and out.experts.ep), ("expert tp", out.experts and out.experts.tp)]:
        if isinstance(mesh, DeviceMesh) and rank in mesh.mesh.flatten().tolist():
            groups.update({f"{name} mesh {d}": mesh.get_group(d) for d in mesh.mesh_dim_names})
    cp = out.cp_attention
    groups.update({"cp": out.cp, "ulysses": getattr(cp, "ulysses", None), "gather": getattr(cp, "gather", None),
                   "expert gradients": out.experts and out.experts.grad})
    return {k: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for k, g in groups.items() if g is not None and dist.get_rank(g) >= 0}


@pytest.mark.slow
def test_every_group_of_a_rank_takes_the_jobs_timeout():
    found = run_distributed(_timeouts, 10)
    llm = found[-1]  # an LLM rank: its meshes, the shard mesh, cp (hybrid), ep, replica and gradient groups
    assert {"cp", "ulysses", "gather", "expert gradients", "ep mesh ep", "language_model mesh tp",
            "shard mesh dp_cp", "headers", "grad", "replica"} <= set(llm), sorted(llm)
    for rank, timeouts in enumerate(found):
        assert set(timeouts.values()) == {TIMEOUT.total_seconds()}, (rank, timeouts)
