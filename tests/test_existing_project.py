"""lightning-mm inside an existing Lightning project: ``use_bitfield_attention`` and ``pack_multimodal`` on plain HF
models, and the ``ContextParallel`` callback under Lightning's own DDPStrategy / ModelParallelStrategy (FSDP2).

The model is a tiny HF composite built from a config (LLaVA or Qwen2-VL, fp32); nothing downloads.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_mm import masks
from lightning_mm.attention import use_bitfield_attention
from lightning_mm.attention.bitfield_hf import UnsupportedModelError, bitfield_adapter, hf_words
from lightning_mm.data import PackingCollator, pack_multimodal
from tests.helpers.existing_project_case import IMG, VSTART, sample, tiny_model, unpacked_inputs

KINDS = ["llava", "qwen2_vl"]


def _token_sums(logits, labels):
    """Per-row-position cross-entropy (sum reduction per token) of HF-aligned labels: [B, S-1]."""
    lg, tg = logits[:, :-1].float(), labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), ignore_index=-100,
                                           reduction="none")
    return ce.reshape(tg.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_rows_give_per_sample_losses_and_gradients(kind):
    """Samples packed into rows (with bitfield attention) give each sample's own loss, and the gradients of the
    summed token losses equal those of the samples run one by one through the unchanged HF model."""
    ref = tiny_model(kind).eval()
    model = use_bitfield_attention(copy.deepcopy(ref))
    samples = [sample(kind, i) for i in range(6)]
    # one by one, the HF model as it is
    ref_sums = []
    for s in samples:
        out = ref(**unpacked_inputs(kind, s))
        n = int((out.logits.new_tensor(0) + (unpacked_inputs(kind, s)["labels"][:, 1:] != -100).sum()).item())
        ref_sums.append(out.loss * n)
    torch.stack(ref_sums).sum().backward()
    # packed rows
    batch = pack_multimodal(samples, 48, model.config)
    assert batch["input_ids"].shape[0] < len(samples)  # several samples share a row
    out = model(**batch)
    per_token = _token_sums(out.logits, batch["labels"])
    seg = batch["segment_ids"][:, 1:]  # the segment of the predicted token
    got = {}
    for r in range(per_token.shape[0]):
        for s in range(int(batch["segment_ids"][r].max()) + 1):
            here = (batch["segment_ids"][r] == s) & (batch["attention_mask"][r] == 1)
            if bool(here.any()):  # which sample this is (first-fit may reorder them)
                i = next(i for i, x in enumerate(samples) if torch.equal(x["input_ids"][0], batch["input_ids"][r][here]))
                got[i] = per_token[r][seg[r] == s].sum()
    assert sorted(got) == list(range(len(samples)))
    got = [got[i] for i in range(len(samples))]
    torch.testing.assert_close(torch.stack(got).detach(), torch.stack(ref_sums).detach(), rtol=1e-5, atol=1e-5)
    # HF's own outputs.loss of the packed batch is the mean over its label tokens
    n_labels = int((batch["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(out.loss.detach(), per_token.sum().detach() / n_labels, rtol=1e-5, atol=1e-6)
    per_token.sum().backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        if a.grad is None:  # LLaVA's last vision layer feeds nothing (vision_feature_layer=-2)
            assert b.grad is None, name
            continue
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packing_layout_and_words():
    """Rows, labels (first token of every sample and placeholders ignored), positions restarting per sample,
    media concatenated in placeholder order, bidirectional image spans on request."""
    model = tiny_model("llava")
    samples = [sample("llava", i) for i in range(5)]
    batch = PackingCollator(model.config, 40)(samples)
    rows, length = batch["input_ids"].shape
    assert length == 40 and batch["bam"].dtype == torch.int64
    starts = (batch["position_ids"] == 0) & (batch["attention_mask"] == 1)
    assert bool((batch["labels"][starts] == -100).all())
    assert bool((batch["labels"][batch["input_ids"] == IMG] == -100).all())
    assert bool((batch["bam"][batch["attention_mask"] == 0] == 0).all())
    assert batch["pixel_values"].shape[0] == int((batch["input_ids"] == IMG).sum()) // 4
    order = []  # images appear in the rows in the order the samples were placed
    for r in range(rows):
        for s in range(int(batch["segment_ids"][r].max()) + 1):
            ids = batch["input_ids"][r][(batch["segment_ids"][r] == s) & (batch["attention_mask"][r] == 1)]
            if len(ids):
                order.append(ids)
    assert sum(int((o == VSTART).sum()) for o in order) == batch["pixel_values"].shape[0]
    bi = pack_multimodal(samples, 40, model.config, modality_attention="bidirectional")["bam"]
    assert bool((bi[batch["input_ids"] == IMG] == 2).all())  # the image bit alone
    dense = masks.to_dense(bi, batch["segment_ids"])
    r, j = torch.nonzero(batch["input_ids"] == IMG)[0].tolist()
    assert bool(dense[r, j, j + 1])  # an image token sees the next one
    qwen = tiny_model("qwen2_vl")
    qb = pack_multimodal([sample("qwen2_vl", i) for i in range(4)], 48, qwen.config, num_rows=3)
    assert qb["position_ids"].shape == (3, 3, 48) and qb["input_ids"].shape == (3, 48)
    assert qb["image_grid_thw"].shape[1] == 3 and "mm_token_type_ids" in qb


def test_mrope_positions_of_a_packed_sample_equal_hf_rope_index():
    model = tiny_model("qwen2_vl")
    samples = [sample("qwen2_vl", i, n_images=2) for i in range(3)]
    batch = pack_multimodal(samples, 80, model.config)
    at = 0
    for s in samples:  # all in row 0, in order
        n = s["input_ids"].shape[1]
        theirs, _ = model.model.get_rope_index(s["input_ids"], (s["input_ids"] == IMG).int(),
                                               image_grid_thw=s["image_grid_thw"])
        assert torch.equal(batch["position_ids"][:, 0, at:at + n], theirs[:, 0])
        at += n


def test_words_from_hf_inputs():
    """Segments from position restarts (1-D and M-RoPE), padding from attention_mask, the causal default."""
    model = tiny_model("llava")
    ids = torch.tensor([[5, 6, IMG, IMG, 7, 8, 9, 0]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    am = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    bam, seg = hf_words(model.config, ids, am, pos)
    assert seg.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    assert bam[0, -1] == 0 and len(set(bam[0, :-1].tolist())) == 1
    _, seg3 = hf_words(model.config, ids, am, pos[None].expand(3, -1, -1))
    assert torch.equal(seg3, seg)
    with pytest.raises(ValueError, match="input_ids"):
        hf_words(model.config, None)


def test_use_bitfield_attention_refuses_what_it_cannot_serve():
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        use_bitfield_attention(torch.nn.Linear(2, 2))
    model = tiny_model("llava")
    decoder = model.model.language_model
    cls = type(decoder)
    saved = cls._supports_attention_backend
    cls._supports_attention_backend = False
    try:
        with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
            use_bitfield_attention(model)
    finally:
        cls._supports_attention_backend = saved
    use_bitfield_attention(model)
    assert use_bitfield_attention(model) is model and bitfield_adapter(model) is not None
    with pytest.raises(ValueError, match="remove it first"):
        use_bitfield_attention(model, modality_attention="bidirectional")
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="raise max_length"):
        pack_multimodal([sample("llava", 3)], 8, model.config)
    with pytest.raises(ValueError, match="videos"):
        pack_multimodal([{"input_ids": torch.tensor([1, 2]), "pixel_values_videos": torch.zeros(1)}], 8,
                        model.config)
