"""Qwen3.5 (dense and MoE): Gated DeltaNet layers under packing against each sample run alone by HF's own
composite, the segmented convolution and chunked delta rule against transformers' torch functions, ``generate``
against HF's (context parallelism, and its refusal of a cp that does not divide the GDN value heads, are in
``tests/test_gdn_context_parallel.py``; loss, logits, gradients and ``save_pretrained`` against
HF's class are in ``tests/test_hf_composites.py``).

Folders are written by ``save_pretrained`` from tiny random composites (``save_composite``; nothing downloaded):
eight text layers, GDN at 0-2 and 4-6, gated full attention at 3 and 7.
"""

from __future__ import annotations

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import linear_attention as la
from tests.test_hf_composites import IMG, VEND, VSTART, load_hf, save_composite

PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def _sample(seed: int, text: int, grids: list[tuple[int, int, int]]) -> dict:
    """A sample of ``text`` random tokens with one placeholder per image (between vision start / end) spread in."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 90, (text,), generator=g).tolist()
    for i, _ in enumerate(grids):
        at = 3 + 4 * i
        ids[at:at] = [VSTART, IMG, VEND]
    sample = {"input_ids": torch.tensor(ids)}
    if grids:
        sample["vision"] = {"pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g),
                            "image_grid_thw": torch.tensor(grids)}
    return sample


# a second sample longer than a chunk of the delta rule (64 tokens), so its state crosses chunks
SAMPLES = [_sample(1, 12, [(1, 8, 8)]), _sample(2, 70, []), _sample(3, 9, [(1, 4, 8)]), _sample(4, 20, [(1, 8, 4)])]


@pytest.mark.parametrize("cls", ["Qwen3_5VisionModel", "Qwen3_5MoeVisionModel"])
def test_tower_split_into_stages_equals_hf_tower(cls):
    """Qwen3.5's tower run as two pipeline stages through its family adapter gives HF's merged features."""
    from lightning_mm.model.families import ENCODER_FAMILIES

    fam = ENCODER_FAMILIES[cls]
    torch.manual_seed(0)
    tower = fam.tiny(depth=4)
    assert type(tower).__name__ == cls and fam.deepstack_layers(tower.config) == 0
    inputs = fam.random_inputs(tower.config, 2, torch.Generator().manual_seed(0), grids=[(1, 8, 4), (1, 4, 4)])
    expected = fam.reference(tower, inputs)
    assert expected.shape == (12, 48) and fam.output_dim(tower) == 48
    hidden, ctx = fam.embed(tower, inputs)
    for layer in tower.blocks[:2]:
        hidden = fam.run_layer(tower, layer, hidden, ctx)
    sent = fam.stage_output(tower, hidden, ctx)
    ctx = fam.context(tower, inputs)
    hidden = fam.stage_input(tower, sent, ctx)
    for layer in tower.blocks[2:]:
        hidden = fam.run_layer(tower, layer, hidden, ctx)
    torch.testing.assert_close(fam.final(tower, hidden, ctx), expected, rtol=0, atol=0)


def _hf_alone(ref, collator, sample: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """HF's composite on one sample alone: (logits, loss x label tokens, label tokens)."""
    e = collator.expand(sample)
    ids, labels = e["input_ids"][None], e["labels"][None]
    out = ref(input_ids=ids, labels=labels, mm_token_type_ids=(ids == IMG).int(), **sample.get("vision", {}))
    n = int(labels[0, 1:].ne(-100).sum())
    return out.logits[0], out.loss * n, n


def _packed_batch(model):
    collator = lmm.data.MultimodalCollator(model, seq_len=130, pack=True)
    batch = collator(SAMPLES)
    assert batch["input_ids"].shape == (2, 130) and [r for r, *_ in _spans(batch)] == [0, 0, 0, 1]
    return collator, batch


def _spans(batch) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sample of a packed batch, in packing order."""
    spans = []
    for r, row in enumerate(batch["segment_ids"].tolist()):
        real = batch["attention_mask"][r].tolist()
        for seg in sorted({s for s, m in zip(row, real) if m}):
            at = [i for i, (s, m) in enumerate(zip(row, real)) if m and s == seg]
            spans.append((r, at[0], at[-1] + 1))
    return spans


@pytest.mark.parametrize("kind", ["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_packed_rows_equal_each_sample_alone_in_hf(kind, tmp_path, monkeypatch):
    """Three samples packed in one row (the second longer than a delta-rule chunk) and one padded in another:
    every sample's logits (its first tokens included), the loss and every gradient equal HF's composite run on
    each sample alone. With the GDN layers blind to the boundaries the later samples' logits differ."""
    folder = save_composite(kind, tmp_path / "src", text={"output_router_logits": False})
    ref, model = load_hf(kind, folder), lmm.MultimodalModel.from_pretrained(folder)
    collator, batch = _packed_batch(model)
    spans = _spans(batch)
    ours = {k: v for k, v in batch.items() if k != "item_counts"}
    out = model(**ours)
    total, count = 0.0, 0
    for (r, a, e), sample in zip(spans, SAMPLES):
        logits, loss_sum, n = _hf_alone(ref, collator, sample)
        torch.testing.assert_close(out.logits[r, a:e], logits, atol=1e-4, rtol=1e-4)
        total, count = total + loss_sum, count + n
    if kind == "qwen3_5":  # the MoE's load-balancing loss is per forward call: one here, four in HF
        torch.testing.assert_close(out.loss, total / count, atol=1e-5, rtol=1e-5)
        out.loss.backward()
        (total / count).backward()
        mine = dict(model.named_parameters())
        from lightning_mm.model import composites

        compared = 0
        for name, p in ref.named_parameters():
            if p.grad is not None:
                ours_grad = mine[composites.to_ours(model.composite.spec, name)].grad
                torch.testing.assert_close(ours_grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
                compared += 1
        assert compared > 50

    blind = la.segment_layout
    monkeypatch.setattr(la, "segment_layout", lambda bam, segment_ids, chunk=la.CHUNK: blind(bam, None, chunk))
    with torch.no_grad():
        leaked = model(**ours).logits
    for r, a, e in spans[1:3]:  # the first tokens of the second and third samples see the first's state
        assert (leaked[r, a:a + 2] - out.logits[r, a:a + 2]).abs().max() > 1e-3


@pytest.mark.parametrize("lengths,chunk", [((13, 3, 20), 8), ((70, 1, 64, 9), 64)])
def test_segmented_conv_and_delta_rule_equal_transformers_per_sample(lengths, chunk):
    """``segmented_causal_conv`` and ``chunked_delta_rule`` over samples packed in one row (and a second row of one
    sample, padded) equal transformers' ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule`` on each sample
    alone, samples shorter than, as long as and longer than a chunk included; grouped value heads (4 on 2)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    g = torch.Generator().manual_seed(0)
    s = sum(lengths)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    segments = torch.stack([segments, (torch.arange(s) >= lengths[0]).long()])  # row 1: one sample, then padding
    bam = torch.ones(2, s, dtype=torch.int64)
    bam[1, lengths[0]:] = 0
    layout = la.segment_layout(bam, segments, chunk)
    q, k = torch.randn(2, s, 2, 8, generator=g), torch.randn(2, s, 2, 8, generator=g)
    v = torch.randn(2, s, 4, 6, generator=g)
    gate, beta = -torch.rand(2, s, 4, generator=g), torch.rand(2, s, 4, generator=g)
    x, w = torch.randn(2, 5, s, generator=g), torch.randn(5, 4, generator=g)
    out = la.chunked_delta_rule(q, k, v, gate, beta, layout)
    conv = la.segmented_causal_conv(x, w, None, layout.run)
    spans = [(0, a, a + n) for a, n in zip(torch.tensor((0,) + lengths).cumsum(0).tolist(), lengths)]
    for r, a, e in spans + [(1, 0, lengths[0])]:
        expected, _ = hf.torch_chunk_gated_delta_rule(q[r:r + 1, a:e], k[r:r + 1, a:e], v[r:r + 1, a:e],
                                                      gate[r:r + 1, a:e], beta[r:r + 1, a:e], chunk_size=chunk,
                                                      use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[r:r + 1, a:e], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv[r:r + 1, :, a:e], hf.causal_conv1d_fn(x[r:r + 1, :, a:e], w),
                                   atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_generate_equals_hf_generate(kind, tmp_path):
    """One-process ``generate`` (the GDN layers' convolution and recurrent states in the cache their config lays
    out): greedy tokens and every step's logits equal HF's composite ``generate`` on the left-padded batch."""
    from tests.test_hf_composites import batch_for
    from tests.test_mrope_generate import _assert_like_hf

    # HF's MoE composite adds its aux loss in every decoding step and fails at the second without this
    folder = save_composite(kind, tmp_path / "src", text={"output_router_logits": False})
    model, ref = lmm.MultimodalModel.from_pretrained(folder).eval(), load_hf(kind, folder).eval()
    _assert_like_hf(model, ref, batch_for(kind, ref.config)[0])


@pytest.mark.slow
def test_planner_costs_linear_attention_layers_linearly_and_cuts_inside_their_runs(tmp_path):
    """FLOPs counted on the real layers: a GDN layer's forward grows linearly with the tokens, a full-attention
    layer's faster (its scores); the workload model's quadratic term counts the 2 attention layers only, its
    linear term the GDN layers' recurrent work; a 3-stage partition cuts between two GDN layers; the search offers
    the CP degrees that divide the GDN value heads (4) and says why it leaves out cp 3."""
    from lightning_mm.planner.model_costs import _flops, part_runners, planned_partition, sample_batch
    from lightning_mm.planner.plan_cli import attention_shape
    from lightning_mm.planner.search import _cp_options
    from lightning_mm.planner.workload import WorkloadModel, linear_attention_token_flops

    model = lmm.MultimodalModel.from_pretrained(save_composite("qwen3_5", tmp_path / "src"))
    types = model.lm_family.layer_types(model.language_model)
    assert types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    flops, tokens = {}, {}
    for text in (52, 244):
        batch = sample_batch(model, rows=1, text_tokens=text)
        tokens[text] = batch["input_ids"].shape[1]
        parts = part_runners(model, batch)["language_model"][1:-1]  # the layers, without embed and head
        with torch.no_grad():  # forward FLOPs, counted by torch's FlopCounterMode as the planner counts them
            flops[text] = [_flops(lambda run=run, x=x: run(x)) for run, x, _, _ in parts]
    growth = tokens[244] / tokens[52]
    assert tokens[52] == 64 and growth == 4  # whole chunks of the delta rule
    for i, kind in enumerate(types):
        ratio = flops[244][i] / flops[52][i]
        if kind == "linear_attention":
            assert ratio == pytest.approx(growth, rel=1e-2), i  # b T + c: a small constant c
        else:
            assert ratio > growth * 1.5, i

    cfg = model.language_model.config
    work = WorkloadModel.from_model(model).language_model
    width = cfg.num_attention_heads * cfg.head_dim
    assert work.a == pytest.approx(3.0 * 4.0 * width * 2)  # trainable: (F + B) / F = 3; two attention layers
    weights = sum(p.numel() for layer in model.llm_layers for p in layer.parameters() if p.dim() >= 2)
    head = model.language_model.lm_head.weight.numel()
    assert work.b == pytest.approx(3.0 * (2.0 * (weights + head) + 6 * linear_attention_token_flops(cfg)))

    sizes = planned_partition(model, {"language_model": 3})["language_model"]
    cuts = [sum(sizes[:k]) for k in (1, 2)]  # the first layer of stages 2 and 3
    assert sum(sizes) == 8 and any(types[c - 1] == types[c] == "linear_attention" for c in cuts), sizes

    rejected = []
    shape = attention_shape(model, sample_batch(model, rows=1))
    assert shape.linear_layers == 6
    assert shape.linear_value_heads == 4
    assert shape.linear_ids == (0, 1, 2, 4, 5, 6)  # what the CP byte model charges the GDN all-to-alls to
    assert (shape.linear_key_heads, shape.linear_key_dim, shape.linear_value_dim) == (
        cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    assert {c for c, *_ in _cp_options([1, 2, 3, 4], ["allgather", "ulysses"], [1], shape, rejected)} == {1, 2, 4}
    assert rejected == ["cp=3: the language model's 6 Gated DeltaNet layers are split by heads over the CP ranks, "
                        "and cp=3 does not divide their 4 value heads"]


@pytest.mark.slow
def test_pipeline_cut_inside_a_run_of_gdn_layers_trains_like_one_process(tmp_path):
    """LLM pp 2 cut between GDN layers 1 and 2 (the hidden state is all that crosses; each GDN layer's state
    lives inside it), on packed rows: one process's losses and trained parameters, the GDN ones included."""
    from tests.helpers.composite_case import run_case

    folder = save_composite("qwen3_5", tmp_path / "src")
    ref_losses, ref_params = run_case("composite_case.py", {"folder": folder, "pack": 96}, tmp_path, "single")
    assert len(ref_losses) == 3
    start = dict(lmm.MultimodalModel.from_pretrained(folder).named_parameters())
    gdn = [n for n in ref_params if ".linear_attn." in n]
    assert len(gdn) == 6 * 9 and all(not torch.equal(ref_params[n], start[n]) for n in gdn)  # all trained
    case = {"folder": folder, "pack": 96, "llm_pp": 2, "partition": {"vision": [2], "language_model": [2, 6]}}
    losses, params = run_case("composite_case.py", case, tmp_path, "pp2")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)
