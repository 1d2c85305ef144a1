"""Every pipeline layout trains exactly like the unparallelised model in one process (gloo, CPU, fp32, SGD)."""

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.pipeline_case import check_like_reference, run_rank, run_reference

from lightning_mm.plan.layout import ParallelSpec, build_layout

# (modalities, freeze, encoder pp, llm pp, placement, dp, microbatches)
CASES = [
    (("vision",), "projectors", (1,), 1, "parallel", 1, 2),
    (("vision",), "llm", (2,), 2, "parallel", 1, 4),
    pytest.param((("vision", "audio"), "encoder", (2, 1), 2, "parallel", 1, 2), marks=pytest.mark.ci),
    (("vision", "audio"), "projectors", (1, 1), 3, "parallel", 1, 4),
    (("vision", "audio"), "llm", (1, 2), 1, "parallel", 2, 2),
    pytest.param((("vision", "audio"), "encoder", (2, 2), 1, "colocated", 1, 2),
                 marks=[pytest.mark.ci, pytest.mark.combines("pipeline", "placement")]),
    pytest.param((("vision", "audio"), "llm", (1, 1), 2, "replicated", 2, 2),
                 marks=pytest.mark.combines("pipeline", "placement")),
    (("vision", "image2"), "encoder", (1, 1), 2, "replicated", 1, 4),
]


def world_of(case):
    mods, _, enc_pp, llm_pp, placement, dp, _ = case
    specs = {m: ParallelSpec(pp=p) for m, p in zip(mods, enc_pp)}
    return build_layout(specs, ParallelSpec(pp=llm_pp), 720720, placement).ranks_per_replica * dp


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'+'.join(c[0])}-{c[1]}-enc{c[2]}-llm{c[3]}-{c[4]}-dp{c[5]}")
def test_layout_trains_like_one_process(case):
    mods, freeze, enc_pp, llm_pp, placement, dp, microbatches = case
    steps, rows = 3, 4 * dp
    ref_losses, ref_params = run_reference(mods, freeze, steps, rows)
    results = run_distributed(run_rank, world_of(case), mods, freeze, enc_pp, llm_pp, placement, microbatches,
                              steps, rows)
    check_like_reference(results, ref_losses, ref_params)


def test_bad_specs_fail_before_any_process_group():
    import torch.distributed as dist

    vis = {"vision": ParallelSpec()}
    with pytest.raises(ValueError, match="cannot hold whole replicas of 3 ranks.*multiple of 3"):
        build_layout(vis, ParallelSpec(pp=2), 4)
    with pytest.raises(ValueError, match="modality 'audio' has no ParallelSpec"):
        build_layout(vis, ParallelSpec(), 2, model_encoders=["vision", "audio"])
    with pytest.raises(ValueError, match="unknown modules"):
        build_layout({"video": ParallelSpec()}, ParallelSpec(), 2, model_encoders=["vision"])
    with pytest.raises(ValueError, match="same pp"):
        build_layout({"a": ParallelSpec(pp=1), "b": ParallelSpec(pp=2)}, ParallelSpec(), 4, "colocated")
    from helpers.pipeline_case import build_model

    from lightning_mm.planner.model_costs import resolve_partition
    model = build_model(("vision",), "llm")
    with pytest.raises(ValueError, match="'language_model' has 4 layers but pp=5 stages"):
        resolve_partition(model, {"vision": 1, "language_model": 5}, "uniform")
    with pytest.raises(ValueError, match=r"partition\['vision'\] = \[3, 2\]"):
        resolve_partition(model, {"vision": 2, "language_model": 1}, {"vision": [3, 2]})
    assert not dist.is_initialized()


# (modalities, freeze, encoder pp, llm pp, llm cp, placement, dp, microbatches, layout, cp distribution)
CP_CASES = [
    (("vision",), "llm", (1,), 1, 2, "parallel", 1, 2, "ee", "lpt"),
    pytest.param((("vision",), "encoder", (1,), 2, 2, "parallel", 1, 2, "ep", "zigzag"),
                 marks=pytest.mark.combines("pipeline", "llm_cp")),
    pytest.param((("vision", "audio"), "llm", (1, 1), 1, 2, "replicated", 2, 2, "ee", "random"),
                 marks=pytest.mark.combines("llm_cp", "placement")),
    pytest.param((("vision",), "llm", (1,), 1, 4, "replicated", 1, 1, "mp", "lpt"),
                 marks=pytest.mark.combines("llm_cp", "placement", "packing")),  # "mp": packed rows
    pytest.param((("vision",), "projectors", (1,), 1, 2, "parallel", 1, 1, "mp", "contiguous"),
                 marks=pytest.mark.combines("llm_cp", "packing")),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: f"{'+'.join(c[0])}-{c[1]}-llm{c[3]}-cp{c[4]}-{c[5]}-dp{c[6]}"
                                                        f"-{c[8]}-{c[9]}")
def test_context_parallel_layout_trains_like_one_process(case):
    mods, freeze, enc_pp, llm_pp, cp, placement, dp, microbatches, layout, method = case
    steps, rows = 2, 4 * dp
    ref_losses, ref_params = run_reference(mods, freeze, steps, rows, layout)
    specs = {m: ParallelSpec(pp=p) for m, p in zip(mods, enc_pp)}
    world = build_layout(specs, ParallelSpec(pp=llm_pp, cp=cp), 720720, placement).ranks_per_replica * dp
    results = run_distributed(run_rank, world, mods, freeze, enc_pp, llm_pp, placement, microbatches, steps, rows,
                              layout, 0.5, cp, method, 8)
    check_like_reference(results, ref_losses, ref_params)


# (modalities, freeze, encoder pp, llm pp, llm cp, microbatches)
CHECKPOINT_CASES = [
    pytest.param((("vision", "audio"), "encoder", (2, 1), 2, 1, 2),
                 marks=pytest.mark.combines("activation_checkpointing", "pipeline")),
    pytest.param((("vision",), "llm", (1,), 1, 2, 2),
                 marks=[pytest.mark.ci, pytest.mark.combines("activation_checkpointing", "llm_cp")]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=lambda c: f"{'+'.join(c[0])}-{c[1]}-llm{c[3]}-cp{c[4]}")
def test_activation_checkpointing_trains_like_one_process(case):
    """Recomputing every layer in backward (CP collectives included) changes nothing numerically; layers that
    take part in backward run forward twice per microbatch, layers under no_grad once."""
    from helpers.pipeline_case import build_model, run_rank_checkpointed

    mods, freeze, enc_pp, llm_pp, cp, microbatches = case
    steps, rows = 2, 4
    ref_losses, ref_params = run_reference(mods, freeze, steps, rows)
    specs = {m: ParallelSpec(pp=p) for m, p in zip(mods, enc_pp)}
    world = build_layout(specs, ParallelSpec(pp=llm_pp, cp=cp), 720720, "parallel").ranks_per_replica
    results = run_distributed(run_rank_checkpointed, world, mods, freeze, enc_pp, llm_pp, microbatches, steps, rows, cp)
    merged, calls = {}, {}
    for losses, params, rank_calls in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        merged.update(params)
        for name, n in rank_calls.items():
            calls.setdefault(name, set()).add(n)
    assert set(merged) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(merged[name], p, rtol=1e-4, atol=1e-5, msg=name)
    model = build_model(mods, freeze)
    layers = {f"language_model.{i}" for i in range(len(model.llm_layers))}
    layers |= {f"{m}.{i}" for m in mods for i in range(len(model.encoders[m].layers))}
    assert set(calls) == layers  # every layer ran on some rank
    runs = steps * microbatches
    for name, counts in calls.items():
        in_backward = freeze == "encoder" or name.startswith("language_model")
        assert counts == {2 * runs if in_backward else runs}, (name, counts)


def _tied_model():
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    lm = tiny_language_model("llama", tie_word_embeddings=True)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, lm)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    return model.freeze(encoders=True, projectors=False, language_model=False)


def _tied_rank(rank, world):
    from helpers.pipeline_case import global_batches, train_engine

    from lightning_mm.parallel.engine import PipelineEngine

    model = _tied_model()
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(pp=2), world, "parallel", ["vision"])
    engine = PipelineEngine(model, layout, rank, 2)
    return train_engine(engine, model, global_batches(model, 3, 4))


@pytest.mark.slow
def test_tied_embeddings_across_llm_stages_train_like_one_process():
    """The first and last LLM stage each hold the tied weight (under the embedding's name) and sum its gradient."""
    from helpers.pipeline_case import global_batches, train_reference

    model = _tied_model()
    ref_losses, ref_params = train_reference(model, global_batches(model, 3, 4))
    merged = {}
    for losses, params in run_distributed(_tied_rank, 3):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            if name in merged:  # the tied weight on the first and last LLM stage stays identical
                torch.testing.assert_close(p, merged[name], rtol=0, atol=0)
            merged[name] = p
    assert set(merged) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(merged[name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_module_meshes_are_dp_pp_cp_tp_arrays_of_the_layout():
    layout = build_layout({"vision": ParallelSpec(pp=2), "audio": ParallelSpec()}, ParallelSpec(pp=2, cp=2), 14,
                          "parallel", ["vision", "audio"])
    assert layout.chains() == {"vision": ["vision.0", "vision.1"], "audio": ["audio.0"],
                               "language_model": ["language_model.0", "language_model.1"]}
    assert layout.mesh_ranks("vision") == [[[[0]], [[1]]], [[[7]], [[8]]]]
    assert layout.mesh_ranks("language_model") == [[[[3], [4]], [[5], [6]]], [[[10], [11]], [[12], [13]]]]
    every = sorted(r for chain in layout.chains() for r in torch.tensor(layout.mesh_ranks(chain)).flatten().tolist())
    assert every == list(range(14))
