"""The strategy's planner partitions: frozen-aware boundaries from the real layers' FLOPs (or a JSON profile),
and a pipeline cut that way still trains exactly like one process."""

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.partition_case import build_model, run_rank, run_reference

from lightning_mm.planner.model_costs import resolve_partition
from lightning_mm.planner import CostModel, LayerProfile, save_profile
from lightning_mm.planner.model_costs import PlannedPartition, flop_times, model_layer_costs, model_memory, sample_batch

STAGES = {"vision": 2, "language_model": 2}


@pytest.mark.slow
def test_projector_flops_match_hand_count():
    """The planner's FLOPs of the real parts equal a hand count: SigLIP layer dense 2t(4*32*32 + 2*32*64),
    projector 2t(2*32*192), where t = image tokens of the sample batch."""
    model = build_model()
    batch = sample_batch(model)
    t = sum(model.encoders["vision"].num_tokens(batch["vision"]))
    times = flop_times(model, batch)["vision"]
    assert times.weight_grad[-1] == pytest.approx(2 * t * 2 * 32 * 192)   # projector trainable: B_w = dense
    assert times.forward[-1] >= 2 * t * 2 * 32 * 192                     # + post-layernorm, GELU
    assert times.forward[1] > 2 * t * 8192 and times.forward[1] < 1.2 * 2 * t * 8192  # dense + small attention
    assert times.weight_grad[1] == 0 and times.frozen == [True] * 5 + [False]


def test_frozen_aware_differs_from_uniform_and_forward_only():
    """Frozen layers cost F only, the trainable projector F + B_d + B_w (about 4.5 layers): the last vision stage
    gets one layer. Forward-only (3F everywhere) sees a 1.5-layer projector and stays uniform."""
    model = build_model()
    assert resolve_partition(model, STAGES, "uniform")["vision"] == [2, 2]
    assert resolve_partition(model, STAGES, "forward-only")["vision"] == [2, 2]
    assert resolve_partition(model, STAGES, "frozen-aware")["vision"] == [3, 1]
    assert resolve_partition(model, STAGES, "auto") == resolve_partition(model, STAGES, "frozen-aware")


@pytest.mark.slow
def test_upstream_trainable_crosses_into_the_llm():
    """Only the LLM's last layer trainable: layers 0-2 run no backward, the last one does -> [3, 1]. A trainable
    projector upstream makes every LLM layer compute input gradients -> balanced [2, 2]."""
    model = build_model()
    model.freeze(projectors=True)
    model.language_model.model.layers[3].requires_grad_(True)
    costs = model_layer_costs(model)["language_model"]
    assert [c.in_backward for c in costs] == [False, False, False, True]
    assert resolve_partition(model, STAGES, "frozen-aware")["language_model"] == [3, 1]
    model.freeze(projectors=False)
    assert all(c.in_backward for c in model_layer_costs(model)["language_model"])
    assert resolve_partition(model, STAGES, "frozen-aware")["language_model"] == [2, 2]


@pytest.mark.slow
def test_model_memory_counts_state_and_what_backward_keeps():
    """State bytes = 4 per frozen weight, 16 per trainable one (weight, grad, two Adam moments), embed and head
    folded into the first and last layer; gradient bytes = the trainable weights'; activation bytes = the storages autograd saves in each part. The
    trainable projector keeps at least its input and the GELU's input and output (fp32); a trainable LLM layer
    keeps more than a frozen one, which keeps only what its input gradient needs."""
    model = build_model()
    batch = sample_batch(model)
    memory = model_memory(model, batch)
    enc = model.encoders["vision"]
    for module, params in (("vision", [*enc.module.parameters(), *enc.projector.parameters()]),
                           ("language_model", list(model.language_model.parameters()))):
        states, acts, grads, tp_bytes = memory[module]
        assert len(states) == len(acts) == len(grads) == len(tp_bytes) == len(model_layer_costs(model)[module])
        assert sum(states) == sum(p.numel() * (16 if p.requires_grad else 4) for p in params)
        assert sum(grads) == sum(p.numel() * 4 for p in params if p.requires_grad)  # fp32 gradients
    t = sum(enc.num_tokens(batch["vision"]))
    assert memory["vision"][1][-1] >= 4 * t * (32 + 2 * 192)
    rows, seq = batch["input_ids"].shape  # a tensor-parallel all-reduce of an LLM layer moves its hidden states
    assert memory["language_model"][3][1] == rows * seq * model.hidden_size * 4
    frozen_llm = memory["language_model"][1]
    assert all(a > 0 for a in frozen_llm)
    model.freeze(language_model=False)
    trainable_llm = model_memory(model, batch)["language_model"][1]
    assert all(b > a for a, b in zip(frozen_llm[1:-1], trainable_llm[1:-1]))


@pytest.mark.slow
def test_activation_checkpointing_is_costed_per_layer():
    """With recompute, a layer that takes part in backward costs one more forward of its own (not of the
    embedding or head folded into it) and keeps only its input; layers outside backward are unchanged."""
    model = build_model()
    batch = sample_batch(model)
    plain, again = model_layer_costs(model, batch=batch), model_layer_costs(model, batch=batch, recompute=True)
    # frozen SigLIP layers with nothing trainable upstream: no backward, nothing to recompute (the last one is
    # folded with the trainable projector, which is not checkpointed)
    assert again["vision"] == plain["vision"]
    # every LLM layer computes input gradients for the projector: one more forward of the layer alone
    layer_forward = flop_times(model, batch)["language_model"].forward[1:-1]
    for c, r, f in zip(plain["language_model"], again["language_model"], layer_forward):
        assert c.in_backward and r.forward == c.forward
        assert r.backward == pytest.approx(c.backward + f)
    memory, kept = model_memory(model, batch), model_memory(model, batch, recompute=True)
    hidden = model.embed(batch["input_ids"], {"vision": model.encoders["vision"](batch["vision"])})
    for layer in range(1, len(kept["language_model"][1]) - 1):  # a middle layer keeps its input hidden state only
        assert kept["language_model"][1][layer] == hidden.nbytes < memory["language_model"][1][layer]
    assert kept["language_model"][0] == memory["language_model"][0]


def _constant_profile(values):
    const = lambda v: CostModel(0.0, 0.0, v)  # noqa: E731
    return [LayerProfile(const(f), const(f), const(f)) for f in values]


def test_profile_json_drives_the_partition(tmp_path):
    """A measured profile (seconds per part) replaces FLOPs: an expensive first vision layer -> [1, 3]."""
    model = build_model()
    path = tmp_path / "costs.json"
    save_profile({"vision": _constant_profile([0.0, 9.0, 1.0, 1.0, 1.0, 0.1]),
                  "language_model": _constant_profile([0.0, 1, 1, 1, 1, 0.0])}, path)
    got = resolve_partition(model, STAGES, PlannedPartition("frozen-aware", str(path)))
    assert got == {"vision": [1, 3], "language_model": [2, 2]}
    save_profile({"vision": _constant_profile([1.0] * 3), "language_model": _constant_profile([1.0] * 6)}, path)
    with pytest.raises(ValueError, match="'vision' has 3 parts but the model has 6"):
        resolve_partition(model, STAGES, PlannedPartition("frozen-aware", str(path)))


def test_bad_requests_name_the_fix(tmp_path):
    import lightning_mm as lmm

    with pytest.raises(ValueError, match="unknown partition 'balanced'.*frozen-aware"):
        resolve_partition(build_model(), STAGES, "balanced")
    with pytest.raises(ValueError, match="only applies to a planner partition"):
        lmm.MultimodalParallelStrategy(partition="uniform", profile=str(tmp_path / "x.json"))
    path = tmp_path / "costs.json"
    save_profile({"language_model": _constant_profile([1.0] * 6)}, path)
    strategy = lmm.MultimodalParallelStrategy(partition="frozen-aware", profile=str(path))
    assert strategy.partition == PlannedPartition("frozen-aware", str(path))
    with pytest.raises(ValueError, match="no module 'vision'"):
        resolve_partition(build_model(), STAGES, strategy.partition)


@pytest.mark.slow
def test_frozen_aware_pipeline_trains_like_one_process():
    """vision pp=2 cut [3, 1] by the planner + LLM pp=1 (3 processes, 2 microbatches, 3 SGD steps)."""
    steps, rows = 3, 4
    ref_losses, ref_params = run_reference(steps, rows)
    results = run_distributed(run_rank, 3, "frozen-aware", 2, 1, 2, steps, rows)
    merged = {}
    for losses, params, sizes in results:
        assert sizes == {"vision.0": 3, "vision.1": 1}
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        merged.update(params)
    assert set(merged) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(merged[name], p, rtol=1e-4, atol=1e-6)


def test_plan_command_prints_stages_and_writes_timelines(tmp_path, capsys):
    """`lightning-mm plan` on the main-job YAML: one row per configured stage, the search, the files, and a YAML
    block that runs the auto plan."""
    from lightning_mm.trainer.cli import main

    main(["plan", "--config", "examples/tiny_valm_pp.yaml", "--devices", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for row in ("vision.0             vision[0:4]", "audio.0              audio[0:4]",
                "language_model.0     language_model[0:2]", "language_model.1     language_model[2:4]"):
        assert row in out
    assert "auto search on 8 devices" in out
    assert sum(line.startswith("predicted iteration") for line in out.splitlines()) == 2  # configured and auto
    assert {p.name for p in tmp_path.iterdir()} >= {"configured.trace.json", "auto.trace.json"}
    # the printed YAML builds the planned layout: its specs on its device count, its boundaries
    import yaml

    from lightning_mm import MultimodalParallelStrategy
    from lightning_mm.plan.layout import ParallelSpec, build_layout

    snippet = yaml.safe_load(out.split("same global batch; dp = ")[1].split("\n", 2)[2].split("\nwrote ")[0])
    args = snippet["trainer"]["strategy"]["init_args"]
    specs = {m: ParallelSpec(**e["init_args"]) for m, e in args["encoders"].items()}
    llm = ParallelSpec(**args["language_model"]["init_args"])
    layout = build_layout(specs, llm, snippet["trainer"]["devices"], args["encoder_placement"], ["vision", "audio"])
    dp = int(out.split("same global batch; dp = ")[1].split(")")[0])
    assert layout.dp == dp and snippet["trainer"]["devices"] <= 8
    assert {m: sum(v) for m, v in args["partition"].items()} == {"vision": 4, "audio": 4, "language_model": 4}
    strategy = MultimodalParallelStrategy(**{**args, "encoders": specs, "language_model": llm})
    assert strategy.partition == args["partition"] and strategy.encoder_placement == args["encoder_placement"]


def test_planner_modes_on_a_meta_model_say_what_to_give_instead():
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    with torch.device("meta"):
        model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model())
    with pytest.raises(ValueError, match="meta device.*profile="):
        resolve_partition(model, {"vision": 1, "language_model": 2}, "frozen-aware")
    assert resolve_partition(model, {"vision": 1, "language_model": 2}, {"language_model": [1, 3]}) == \
        {"vision": [4], "language_model": [1, 3]}
