"""Qwen3.5's Gated DeltaNet layers under context parallelism (headwise all-to-all): a layer against the same
layer in one process on CP ranks holding out-of-order blocks, and Qwen3.5 / Qwen3.5-MoE composites trained under
the strategy (LLM cp 2 and 4, packed and unpacked rows, samples of 0 to 5 images; ep 2 with FSDP; vision pp 1
with LLM pp 2 x dp 2) against one process, all in fp32; cp that does not divide the value heads is refused before
any group."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_distributed

import lightning_mm as lmm
from lightning_mm.model import linear_attention as la

BLOCK = 8


def _gdn(key_heads: int, value_heads: int, key_dim: int = 8, value_dim: int = 6):
    """A Qwen3.5 GDN layer (HF's class, segment-aware) with random weights; ``dt_bias`` and the convolution random too,
    so every head differs."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                            linear_key_head_dim=key_dim, linear_value_head_dim=value_dim, linear_conv_kernel_dim=4,
                            num_hidden_layers=1, layer_types=["linear_attention"])
    gdn = la.segment_aware(Qwen3_5GatedDeltaNet(cfg, layer_idx=0))
    with torch.no_grad():
        gdn.dt_bias.normal_()
        gdn.norm.weight.normal_()
    return gdn


def _inputs(lengths: list[int], seq: int):
    """Row 0: samples of ``lengths`` packed (then padding); row 1: one sample of 70 tokens (then padding)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, seq, 32, generator=g)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]
                         + [torch.full((seq - sum(lengths),), len(lengths) - 1)])
    segments = torch.stack([segments, torch.zeros(seq, dtype=torch.long)])
    bam = torch.ones(2, seq, dtype=torch.int64)
    bam[0, sum(lengths):] = 0
    bam[1, 70:] = 0
    weights = torch.randn(2, seq, 32, generator=g)
    return hidden, bam, segments, weights


def _headwise_rank(rank, world, heads, lengths, seq, method):
    import torch.distributed as dist

    from lightning_mm.parallel.context import distribute, token_index

    gdn = _gdn(*heads)
    hidden, bam, segments, weights = _inputs(lengths, seq)
    plan = distribute(bam, world, method, BLOCK, segments)
    index = token_index(plan[rank], BLOCK, seq)
    local = hidden.index_select(1, index).requires_grad_(True)
    cache = {}
    kw = dict(bam=bam.index_select(1, index), segment_ids=segments.index_select(1, index),
              token_index=index.expand(2, -1), cp_group=dist.group.WORLD, attn_cache=cache)
    out = gdn(local, **kw)
    (out * weights.index_select(1, index)).sum().backward()
    out2 = gdn(local.detach(), **kw)  # a second layer of the microbatch reuses the gathered layout
    assert "gdn_headwise" in cache and torch.equal(out2, out.detach())
    return index, plan, out.detach(), local.grad, {n: p.grad for n, p in gdn.named_parameters()}


# (key heads, value heads), cp, packed lengths, distribution: cp 4 over 2 key heads repeats them (one per value head)
HEADWISE = [pytest.param((2, 4), 2, [13, 40, 3, 20], "lpt", id="k2v4-cp2-lpt", marks=pytest.mark.ci),
            pytest.param((2, 4), 4, [70, 1, 30], "lpt", id="k2v4-cp4-lpt"),
            pytest.param((4, 8), 4, [9, 64, 5], "zigzag", id="k4v8-cp4-zigzag")]


@pytest.mark.slow
@pytest.mark.parametrize("heads,cp,lengths,method", HEADWISE)
def test_headwise_layer_equals_one_process(heads, cp, lengths, method):
    """A GDN layer on CP ranks holding blocks out of order (LPT, zigzag), packed and unpacked rows with padding:
    every rank's outputs and input gradients equal one process's at its tokens, and the parameters' gradients
    summed over the ranks equal one process's (each rank's own convolution rows, ``A_log`` and ``dt_bias``
    entries). The plans really interleave: some rank holds a block after a block of another rank."""
    seq = 136
    gdn = _gdn(*heads)
    hidden, bam, segments, weights = _inputs(lengths, seq)
    hidden.requires_grad_(True)
    ref = gdn(hidden, bam=bam, segment_ids=segments, attn_cache={})
    (ref * weights).sum().backward()
    results = run_distributed(_headwise_rank, cp, heads, lengths, seq, method, timeout=800)
    plan = results[0][1]
    assert any(bool((p[1:] - p[:-1] > 1).any()) for p in plan), plan  # out of order: not contiguous chunks
    grads = {n: torch.zeros_like(p) for n, p in gdn.named_parameters()}
    for index, _, out, grad_in, param_grads in results:
        torch.testing.assert_close(out, ref.detach().index_select(1, index), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad_in, hidden.grad.index_select(1, index), atol=1e-5, rtol=1e-5)
        for n, g in param_grads.items():
            grads[n] += g
    for n, p in gdn.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-4, msg=n)


def test_cp_that_does_not_divide_the_value_heads_is_refused_before_any_group(tmp_path):
    """Qwen3.5 with 4 GDN value heads: cp 3 (the layout check the strategy's setup runs) names the GDN value heads
    and the cp values that work; cp 2 and 4 pass."""
    from lightning_mm.parallel.context import check_context_parallel
    from lightning_mm.trainer.strategy import resolve_layout
    from tests.test_hf_composites import save_composite

    model = lmm.MultimodalModel.from_pretrained(save_composite("qwen3_5", tmp_path / "src"))
    assert model.language_model.config.linear_num_value_heads == 4
    with pytest.raises(ValueError, match=r"cp=3.*does not divide its 4 value heads.*choose cp among \[1, 2, 4\]"):
        check_context_parallel(model, lmm.ParallelSpec(cp=3))
    for cp in (1, 2, 4):
        check_context_parallel(model, lmm.ParallelSpec(cp=cp))
    with pytest.raises(ValueError, match=r"language_model cp=3: .*Gated DeltaNet"):  # the strategy's setup check
        resolve_layout(model, encoder_specs=None, language_model_spec=lmm.ParallelSpec(cp=3),
                       placement="replicated", partition="uniform", world_size=3, ranks_per_node=3,
                       fault_tolerance=None)


def _trains_like_one_process(kind: str, case: dict, tmp_path, text: dict | None = None, reference: dict | None = None):
    """The composite of ``kind`` trained 3 steps in one process (``reference``: extra keys of that run) and under
    the strategy with ``case`` (samples of 0 to 5 images): equal losses and trained parameters, the GDN layers'
    included (all of them trained)."""
    from tests.helpers.composite_case import run_case
    from tests.test_hf_composites import save_composite

    folder = save_composite(kind, tmp_path / "src", **({"text": text} if text else {}))
    base = {"folder": folder, "images": 5, **({"pack": case["pack"]} if "pack" in case else {})}
    ref_losses, ref_params = run_case("composite_case.py", {**base, **(reference or {})}, tmp_path, "single")
    start = dict(lmm.MultimodalModel.from_pretrained(folder).named_parameters())
    gdn = [n for n in ref_params if ".linear_attn." in n]
    assert len(gdn) == 6 * 9 and all(not torch.equal(ref_params[n], start[n]) for n in gdn)
    losses, params = run_case("composite_case.py", {**base, **case}, tmp_path, "parallel")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("kind,case", [
    ("qwen3_5", {"llm_cp": 2}),
    pytest.param("qwen3_5", {"llm_cp": 4, "pack": 128, "microbatches": 1},
                 marks=pytest.mark.combines("llm_cp", "packing")),
    pytest.param("qwen3_5_moe", {"llm_cp": 2, "pack": 128, "microbatches": 1},
                 marks=pytest.mark.combines("llm_cp", "packing")),
    ("qwen3_5_moe", {"llm_cp": 4, "microbatches": 1}),  # the aux loss is a mean over microbatches: one, as one process
], ids=["dense-cp2", "dense-cp4-packed", "moe-cp2-packed", "moe-cp4"])
def test_qwen3_5_under_llm_context_parallelism_trains_like_one_process(kind, case, tmp_path):
    """Qwen3.5 and Qwen3.5-MoE composites, samples of 0 to 5 images, packed rows and one sample a row: LLM cp 2 and
    4 (LPT plans; the GDN layers headwise, the attention layers all-gather their keys under the bitfield mask) give
    one process's losses and trained parameters."""
    _trains_like_one_process(kind, case, tmp_path)


@pytest.mark.slow
@pytest.mark.combines("ep", "fsdp", "packing")
def test_qwen3_5_moe_with_expert_parallelism_and_fsdp_trains_like_one_process(tmp_path):
    """Qwen3.5-MoE, ep 2 over 2 FSDP (FULL_SHARD) replicas, packed rows of samples of 0 to 5 images: one process's
    losses (load-balancing loss included) and trained parameters. The load-balancing loss of a step is the mean of
    its microbatches' (docs/moe.md), not the loss of the whole batch in one forward, so the reference runs each
    replica's rows as one microbatch, and the sampler's rows stay on their replica (``batch_balancing="none"``)."""
    _trains_like_one_process("qwen3_5_moe", {"ep": 2, "dp": 2, "sharding": "FULL_SHARD", "pack": 128,
                                             "microbatches": 1, "balancing": "none"}, tmp_path,
                             reference={"replicas": 2})


@pytest.mark.slow
@pytest.mark.combines("pipeline", "packing")
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_with_llm_pipeline_and_data_parallelism_trains_like_one_process(kind, tmp_path):
    """Qwen3.5 and Qwen3.5-MoE, vision pp 1 beside LLM pp 2 (cut between GDN layers) x dp 2, packed rows of samples
    of 0 to 5 images: one process's losses and trained parameters. For the MoE the sampler's rows stay on their
    replica and the reference runs each replica's rows as one microbatch (its load-balancing loss is a mean over
    microbatches)."""
    moe = {"balancing": "none"} if kind == "qwen3_5_moe" else {}
    _trains_like_one_process(kind, {"llm_pp": 2, "dp": 2, "pack": 128, "microbatches": 1, **moe,
                                    "partition": {"vision": [2], "language_model": [2, 6]}}, tmp_path,
                             reference={"replicas": 2} if moe else None)


@pytest.mark.slow
@pytest.mark.combines("tp", "packing")
def test_qwen3_5_with_llm_tensor_parallelism_trains_like_one_process(tmp_path):
    """Qwen3.5, vision 1 rank beside the LLM over 2 tensor-parallel ranks (transformers' plan: the attention and
    MLP split colwise/rowwise, the GDN layers' projections colwise with gathered outputs), packed rows of samples of
    0 to 5 images: one process's losses and trained parameters."""
    _trains_like_one_process("qwen3_5", {"llm_tp": 2, "pack": 128, "microbatches": 1}, tmp_path)
