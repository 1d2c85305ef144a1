"""FSDP2 (FULL_SHARD) composed with context parallelism under MultimodalParallelStrategy: the LLM sharded over its
CP ranks in each CP mode (all-gather, Ulysses, hybrid), and an encoder sharded over its encoder-CP ranks. Each case
also asserts which ranks FSDP manages parameters on, so a layout that silently ran unsharded fails.

Each case trains two SGD steps and compares the losses and every trainable parameter with plain single-process
Lightning on the same global batches (tests/helpers/trainer_case.py), as tests/test_tensor_parallel.py does for
FSDP with dp and tests/test_encoder_cp.py for encoder CP. FSDP shards a stage over its dp x cp ranks (the ranks
holding the same parameters), so with dp 1 these layouts shard over the CP ranks alone.
"""

import json

import pytest

from tests.test_encoder_cp import CASE as ENCODER_CP
from tests.test_lightning_contracts import assert_same_training, run

SGD = dict(steps=2, optimizer="sgd", lr=0.5, microbatches=2, modalities=["vision"])

LLM_CP = [  # (name, case, freeze, the sharded ranks): vision 1 stage (rank 0) + LLM, or (replicated) the encoder on
    # every LLM rank
    pytest.param("allgather_cp2", dict(llm_cp=2), "llm", [1, 2], marks=pytest.mark.combines("fsdp", "llm_cp")),
    ("ulysses_cp2", dict(llm_cp=2, cp_mode="ulysses"), "llm", [1, 2]),
    pytest.param("hybrid_cp4_ulysses2_replicated", dict(llm_cp=4, cp_mode="hybrid", ulysses=2, placement="replicated"),
                 "llm", [0, 1, 2, 3], marks=pytest.mark.combines("fsdp", "llm_cp", "placement")),
]


def sharded_ranks(out) -> list[int]:
    """The ranks of a run where FSDP manages parameters (``fsdp_<rank>.json`` of tests/helpers/trainer_case.py)."""
    return sorted(int(f.stem.split("_")[1]) for f in out.glob("fsdp_*.json") if json.loads(f.read_text()) > 0)


@pytest.mark.slow
@pytest.mark.parametrize("name, case, freeze, sharded", LLM_CP)
def test_full_shard_over_llm_cp_ranks_trains_like_one_process(tmp_path, name, case, freeze, sharded):
    """all-gather and Ulysses: vision + LLM cp 2 (3 processes; the LLM stage sharded over its 2 CP ranks); hybrid:
    cp 4 with Ulysses groups of 2, the encoder on every LLM rank (4 processes; the whole stage, projector
    included, sharded over the 4 CP ranks)."""
    ref = run({**SGD, "freeze": freeze}, tmp_path, "single")
    got = run({**SGD, **case, "freeze": freeze, "sharding": "FULL_SHARD"}, tmp_path, name)
    assert sharded_ranks(tmp_path / name) == sharded
    assert_same_training(got, ref)


@pytest.mark.slow
@pytest.mark.combines("fsdp", "encoder_cp")
def test_full_shard_over_encoder_cp_ranks_trains_like_one_process(tmp_path):
    """vision cp 2 + LLM 1 stage at one dp degree (3 processes), 0-5 images of different sizes per sample, the
    tower trained: the encoder stage is sharded over its 2 CP ranks, each encoding its share of the items (a rank
    with none runs the stand-in item, so both run every unit's collectives)."""
    ref = run({**ENCODER_CP, "freeze": "all"}, tmp_path, "single")
    got = run({**ENCODER_CP, "freeze": "all", "encoder_cp": [2], "llm_pp": 1, "sharding": "FULL_SHARD"},
              tmp_path, "encoder_cp2_fsdp")
    assert sharded_ranks(tmp_path / "encoder_cp2_fsdp") == [0, 1]  # the encoder's CP ranks; the LLM has one holder
    assert_same_training(got, ref)


@pytest.mark.slow
@pytest.mark.combines("fsdp", "encoder_cp", "balancing", note="balancing: the default entrain, not asserted")
def test_full_shard_over_encoder_cp_ranks_and_replicas_trains_like_one_process(tmp_path):
    """vision cp 2 + LLM 1 stage, dp 2 (6 processes, 'entrain' balancing), 0-5 images per sample, the tower trained:
    the encoder stage sharded over its 2 CP ranks x 2 replicas, the LLM stage over its 2 replicas, like one process's
    global batch. With this data one replica's second microbatch of the first step has no image while the other's
    CP ranks gather theirs: the units' backward order must not depend on which (``engine.head_output``)."""
    case = {**ENCODER_CP, "freeze": "all", "batch_size": 2, "dp": 2}
    ref = run(case, tmp_path, "single")
    got = run({**case, "encoder_cp": [2], "llm_pp": 1, "sharding": "FULL_SHARD"}, tmp_path, "encoder_cp2_dp2_fsdp")
    assert sharded_ranks(tmp_path / "encoder_cp2_dp2_fsdp") == list(range(6))
    assert_same_training(got, ref)


def test_fsdp_shards_each_stage_over_its_replicas_and_cp_ranks():
    """Which ranks FSDP shards each stage over, and the warning when a sharding strategy shards nothing."""
    from lightning_mm.parallel.sharding import nothing_to_shard
    from lightning_mm.plan.layout import ParallelSpec as P, build_layout

    def ranks(layout):
        return {s: layout.fsdp_ranks(s) for s in layout.stages}

    one_degree = build_layout({"vision": P(cp=2)}, P(cp=4, cp_mode="hybrid", ulysses=2), 12)
    assert ranks(one_degree) == {"vision.0": 4, "language_model.0": 8}  # dp 2 x cp
    assert ranks(build_layout({"vision": P(dp=1)}, P(dp=2), 3)) == {"vision.0": 1, "language_model.0": 2}
    per_module = build_layout({"vision": P(dp=2)}, P(dp=1, pp=2), 4)  # the tower over its 2 replicas
    assert ranks(per_module) == {"vision.0": 2, "language_model.0": 1, "language_model.1": 1}
    assert nothing_to_shard(per_module, "FULL_SHARD") is None
    whole = build_layout({"vision": P()}, P(pp=2), 3)  # one holder of every stage
    assert "shards nothing in this layout" in nothing_to_shard(whole, "FULL_SHARD")
    assert "shards nothing" in nothing_to_shard(whole, "SHARD_GRAD_OP")
    assert nothing_to_shard(whole, "NO_SHARD") is None
    assert nothing_to_shard(build_layout({"vision": P()}, P(cp=2), 3), "FULL_SHARD") is None
