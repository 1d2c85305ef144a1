"""The planner and simulator with a mixture-of-experts LLM: active-parameter work, expert memory at 1/ep, the
all-to-all of expert parallelism, and ep in the search and in `lightning-mm plan` (pure, one process)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mm.planner.costs import LayerCost
from lightning_mm.planner.moe_costs import ExpertShape, all_to_all_bytes
from lightning_mm.planner.search import ModuleSpec, evaluate_plan, search

LM = "language_model"


def _vlm(**llm):
    from lightning_mm import ModalityEncoder, MultimodalModel
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    return MultimodalModel({"vision": ModalityEncoder(tiny_encoder("siglip"), projector="mlp")},
                           tiny_language_model("qwen3_moe", **llm))


def test_workload_counts_top_k_experts_per_token():
    """Tiny Qwen3-MoE (hidden 32, 4 heads of 8, 2 KV heads, 8 experts of width 16, top-2, vocab 128, 4 layers):
    a token runs q 32x32 + k 16x32 + v 16x32 + o 32x32 = 3072 attention weights, the 8x32 = 256 router and 2 of the
    8 experts (gate_up 32x32 + down 32x16 = 1536 each), not all 8 (12288)."""
    from lightning_mm.planner.workload import WorkloadModel

    model = _vlm()
    per_layer = 3072 + 256 + 2 * 1536
    head = 128 * 32
    assert WorkloadModel.from_model(model).language_model.b == 3.0 * 2.0 * (4 * per_layer + head)
    top4 = _vlm(num_experts_per_tok=4)
    assert WorkloadModel.from_model(top4).language_model.b == 3.0 * 2.0 * (4 * (3072 + 256 + 4 * 1536) + head)


@pytest.mark.slow
def test_flop_times_count_the_routed_computation():
    """torch's FlopCounterMode counts the ops the layer runs: transformers' experts run each expert on its routed
    tokens only (one ``aten._grouped_mm``, which torch does not count: ``model_costs`` counts it), so top-4 routing
    adds exactly 2 x tokens x 2 more experts' weights per layer over top-2, in forward and in the weight gradients."""
    from lightning_mm.planner.model_costs import flop_times, part_tokens, sample_batch

    top2, top4 = _vlm(), _vlm(num_experts_per_tok=4)
    batch = sample_batch(top2)
    tokens = part_tokens(top2, batch)[LM]
    f2, f4 = flop_times(top2, batch)[LM], flop_times(top4, batch)[LM]
    for layer in range(1, 5):  # parts: embed, 4 layers, head
        assert f4.forward[layer] - f2.forward[layer] == 2 * tokens * 2 * 1536
        assert f2.forward[layer] >= 2 * tokens * (3072 + 256 + 2 * 1536)  # attention + router + 2 experts
        assert f4.weight_grad[layer] - f2.weight_grad[layer] == 2 * tokens * 2 * 1536  # expert weight gradients


def _specs(model):
    from lightning_mm.planner.model_costs import model_layer_costs, sample_batch
    from lightning_mm.planner.plan_cli import module_specs

    batch = sample_batch(model)
    return module_specs(model, model_layer_costs(model, batch=batch), 1e-9, batch)


def test_stage_memory_holds_half_the_experts_at_ep_2():
    """The LLM stage's model state per rank loses half of its experts' bytes (weights + gradient + two Adam
    moments, 16 bytes per fp32 trainable element, from the real model's expert parameters) at ep 2."""
    model = _vlm()
    experts = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                  for layer in model.llm_layers)
    assert experts == 4 * 8 * (32 * 32 + 32 * 16)
    specs = _specs(model)
    assert sum(specs[LM].expert_bytes) == 16 * experts
    layers = {"vision": [4], LM: [4]}
    one = evaluate_plan(specs, layers, "parallel", 2, dp=2)
    two = evaluate_plan(specs, layers, "parallel", 2, dp=2, ep=2)
    assert one.memory[f"{LM}.0"] - two.memory[f"{LM}.0"] == pytest.approx(16 * experts / 2)
    assert one.memory["vision.0"] == two.memory["vision.0"]
    assert two.parallel_specs()[1].ep == 2 and two.layout.ep == 2
    with pytest.raises(ValueError, match="ep=2 splits the experts over data-parallel replicas, but dp=1"):
        evaluate_plan(specs, layers, "parallel", 2, dp=1, ep=2)
    with pytest.raises(ValueError, match="does not divide the 8 experts"):
        evaluate_plan(specs, layers, "parallel", 3, dp=3, ep=3)


def test_all_to_all_bytes_follow_the_formula():
    assert all_to_all_bytes(1000, 2, 64, 2, 1) == {"forward": 0.0, "backward": 0.0}
    for ep in (2, 4, 8):
        b = all_to_all_bytes(1000, 2, 64, 2, ep)
        assert b["forward"] + b["backward"] == pytest.approx(4 * 1000 * 2 * 64 * 2 * (ep - 1) / ep)
    assert all_to_all_bytes(1000, 2, 64, 2, 4)["forward"] > all_to_all_bytes(1000, 2, 64, 2, 2)["forward"]


def _moe_llm(layers=1, state=100.0, expert=90.0, routed=None):
    shape = ExpertShape(num_experts=8, top_k=2, hidden=64, tokens=1000, dtype_bytes=2)
    costs = [LayerCost(1.0, 2.0, True, True) for _ in range(layers)]
    expert_bytes = [expert if routed is None or routed[i] else 0.0 for i in range(layers)]
    return {LM: ModuleSpec(costs, state, 0.0, state / 4, expert_bytes=expert_bytes,
                           expert_grad_bytes=[b / 4 for b in expert_bytes], experts=shape)}


def test_all_to_all_time_is_added_per_routed_layer():
    """Each routed layer adds 2 all-to-alls to its forward and 2 to its backward (dense layers none); at ep 1
    nothing; the time grows with (ep - 1) / ep."""
    modules = _moe_llm(layers=3, routed=[True, False, True])
    bw = 1e6
    base = evaluate_plan(modules, {LM: [3]}, "parallel", 4, dp=4, ep_bandwidth=bw)
    assert base.ep_comm == {} and base.forward[f"{LM}.0"] == 3.0
    for ep in (2, 4):
        plan = evaluate_plan(modules, {LM: [3]}, "parallel", 4, dp=4, ep=ep, ep_bandwidth=bw)
        one = 1000 * 2 * 64 * 2 * (ep - 1) / ep / bw  # one all-to-all of one layer
        assert plan.forward[f"{LM}.0"] == pytest.approx(3.0 + 2 * 2 * one)
        assert plan.backward[f"{LM}.0"] == pytest.approx(6.0 + 2 * 2 * one)
        assert plan.ep_comm[f"{LM}.0"] == pytest.approx(2 * 4 * one)
        comm = [e.comm for e in plan.result.events if e.kind == "forward"]
        assert comm and all(c == pytest.approx(2 * 2 * one) for c in comm)
    # gradients: the experts' 1/ep over dp/ep replicas, the rest over dp
    from lightning_mm.planner.search import allreduce_seconds

    plan = evaluate_plan(modules, {LM: [3]}, "parallel", 4, dp=4, ep=2, allreduce_bandwidth=1.0)
    grads, expert_grads = 3 * 25.0, 2 * 90.0 / 4
    sync = [e.end - e.start for e in plan.result.events if e.kind == "sync"]
    assert sync == [pytest.approx(allreduce_seconds(grads - expert_grads, 4, 1.0)
                                  + allreduce_seconds(expert_grads / 2, 2, 1.0))]


def test_search_picks_ep_when_memory_forces_it():
    """One LLM layer of 100 bytes, 90 of them experts, on 2 devices: dp 2 x ep 1 holds 100 bytes per rank, dp 2 x
    ep 2 holds 10 + 45. Under a 60-byte limit only ep 2 fits; without a limit ep 1 wins (ep 2 pays its all-to-all;
    with a free all-to-all the tie goes to the smaller ep); FULL_SHARD with ep 2 holds 5 + 45."""
    modules = _moe_llm()
    forced = search(modules, 2, 2, memory_limit=60.0, ep_degrees=(1, 2), ep_bandwidth=1e9).best
    assert (forced.dp, forced.ep) == (2, 2) and forced.memory[f"{LM}.0"] == pytest.approx(55.0)
    free = search(modules, 2, 2, ep_degrees=(1, 2), ep_bandwidth=1e9).best
    assert (free.dp, free.ep) == (2, 1)
    assert search(modules, 2, 2, ep_degrees=(1, 2)).best.ep == 1
    with pytest.raises(ValueError, match="no layout fits"):
        search(modules, 2, 2, memory_limit=60.0)  # ep not searched
    found = search(modules, 2, 2, ep_degrees=(1, 3), sharding_strategies=("NO_SHARD", "FULL_SHARD"))
    assert any("ep=3: does not divide the 8 experts" in r for r in found.rejected)
    # FSDP shards the non-expert state over dp; the experts stay at 1 / ep (outside FSDP)
    sharded = search(modules, 2, 2, ep_degrees=(2,), sharding_strategies=("FULL_SHARD",)).best
    assert (sharded.ep, sharded.sharding) == (2, "FULL_SHARD")
    assert sharded.memory[f"{LM}.0"] == pytest.approx(10.0 / 2 + 90.0 / 2)
    dense = {LM: ModuleSpec([LayerCost(1.0, 2.0, True, True)], 100.0)}
    assert any("no routed experts" in r for r in search(dense, 2, 2, ep_degrees=(1, 2)).rejected)


MOE_YAML = """
trainer:
  devices: 4
  strategy:
    class_path: lightning_mm.MultimodalParallelStrategy
    init_args:
      encoders:
        vision: {class_path: lightning_mm.ParallelSpec, init_args: {pp: 1}}
      language_model: {class_path: lightning_mm.ParallelSpec, init_args: {pp: 1, ep: 2}}
      num_microbatches: 2
model:
  model:
    init_args:
      language_model:
        class_path: transformers.Qwen3MoeForCausalLM
        init_args:
          config:
            class_path: transformers.Qwen3MoeConfig
            init_args: {vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 4,
                        num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 512,
                        moe_intermediate_size: 16, num_experts: 8, num_experts_per_tok: 2, tie_word_embeddings: false}
"""


@pytest.mark.slow
def test_plan_cli_simulates_the_yamls_ep(tmp_path, capsys):
    """`lightning-mm plan` on a YAML with `language_model: {ep: 2}`: the configured plan is simulated at ep 2 (its
    table shows the ep column and the all-to-all), and the search tries --ep 1,2."""
    from pathlib import Path

    from lightning_mm.trainer.cli import plan_main as plan

    root = Path(__file__).resolve().parents[1]
    extra = tmp_path / "moe.yaml"
    extra.write_text(MOE_YAML)
    plan(["--config", str(root / "examples/tiny_vlm.yaml"), "--config", str(extra), "--ep", "1,2",
          "--device-flops", "1e9", "--ep-bandwidth", "0.001", "--out", str(tmp_path / "plan")])
    out = capsys.readouterr().out
    configured = out[out.index("configured: 4 devices"):out.index("auto search")]
    assert "dp=2" in configured and "ep=2" in configured.splitlines()[0]
    assert " ep " in configured and "ep all-to-all (ms)" in configured
    assert "auto search on 4 devices" in out and math.isfinite(float(out.split("predicted iteration time ")[1].split()[0]))
