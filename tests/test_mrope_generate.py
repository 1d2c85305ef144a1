"""One-process ``MultimodalModel.generate`` for M-RoPE composites (Qwen2-VL, Qwen2.5-VL): greedy tokens and the
logits of every step equal HF's own composite ``generate`` on the left-padded batch (fp32, tiny random models
saved by ``tests.test_hf_composites.save_composite``, nothing downloaded).

Batches: two rows with 2 and 1 images of different grids, the shorter padded (``batch_for``); two rows of which one
ends in an image's placeholders (there each axis goes on from the prompt's last token, not from its maximum); a
text-only pair. Decoding at other positions (the cache length, as 1-D text generation would) changes the logits.
"""

from __future__ import annotations

import pytest
import torch

import lightning_mm as lmm
from helpers.text_lm_case import left_padded
from lightning_mm.model import composites
from tests.test_hf_composites import IMG, PAD, VEND, VSTART, batch_for, load_hf, save_composite

VID = 101  # the composites' video_token_id

STEPS = 8


def _hf_kwargs(ours: dict) -> dict:
    """HF's keyword arguments for our right-padded batch: the same rows padded on the left (HF's composites decode
    batches so), the images' and videos' inputs as they are."""
    ids, mask = ours["input_ids"], ours["attention_mask"]
    left_ids, left_mask = left_padded(ids, mask, PAD)
    return {**ours.get("vision", {}), **ours.get("video", {}), "input_ids": left_ids, "attention_mask": left_mask,
            "mm_token_type_ids": (left_ids == IMG).int() + 2 * (left_ids == VID).int()}


def _ending_in_an_image() -> dict:
    """Row 0: text then an image (4 x 8 patches: 2 x 4 tokens) as the prompt's last tokens, padded; row 1: text, an
    image (8 x 8), text."""
    g = torch.Generator().manual_seed(3)
    rows = [[5, 6, 7, VSTART] + [IMG] * 8, [9, 10, VSTART] + [IMG] * 16 + [VEND, 11, 12, 13]]
    grids = torch.tensor([[1, 4, 8], [1, 8, 8]])
    ids = torch.full((2, max(map(len, rows))), PAD)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "vision": {"pixel_values": pixels, "image_grid_thw": grids}}


def _text_only() -> dict:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, PAD, PAD, PAD]])
    return {"input_ids": ids, "attention_mask": ids.ne(PAD).long()}


def _generate(model, batch: dict):
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True,
                              output_logits=True)


def _assert_like_hf(model, ref, batch: dict) -> tuple:
    """Our tokens equal HF's and every step's logits agree within 1e-4; returns ours and HF's logits."""
    hf_kwargs = _hf_kwargs(batch)
    with torch.no_grad():
        theirs = ref.generate(**hf_kwargs, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True,
                              output_logits=True)
    ours = _generate(model, batch)
    assert torch.equal(ours.sequences, theirs.sequences[:, hf_kwargs["input_ids"].shape[1]:]), \
        (ours.sequences, theirs.sequences)
    assert len(ours.logits) == len(theirs.logits) == STEPS
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"step {step}")
    return ours.logits, theirs.logits


def _models(kind: str, tmp_path):
    folder = save_composite(kind, tmp_path / kind)
    return lmm.MultimodalModel.from_pretrained(folder).eval(), load_hf(kind, folder).eval()


def test_qwen2_vl_generate_equals_hf_and_follows_its_positions(tmp_path, monkeypatch):
    """Two rows with different numbers and sizes of images, one padded: HF's tokens and logits, with the positions
    computed or given (the collator's ``position_ids``); decoding at the cache length instead changes every step's
    logits after the first."""
    from lightning_mm.model import generation

    model, ref = _models("qwen2_vl", tmp_path)
    batch, _ = batch_for("qwen2_vl", ref.config)
    logits, _ = _assert_like_hf(model, ref, batch)
    given = composites.fill_positions(model, batch)
    assert given["position_ids"].shape == (*batch["input_ids"].shape, 3)
    assert all(torch.equal(a, b) for a, b in zip(_generate(model, given).logits, logits))

    monkeypatch.setattr(generation, "next_positions", lambda p: torch.full_like(p[:, -1], p.shape[1]))
    shifted = _generate(model, batch).logits
    assert torch.equal(shifted[0], logits[0])  # the prompt is where it was
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(shifted[1:], logits[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_generate_equals_hf_on_images_ending_a_prompt_and_on_text(kind, tmp_path):
    """Both families: the two-image batch (Qwen2.5-VL), a prompt ending in an image's placeholders (its axes go on
    from different last positions), and text alone."""
    model, ref = _models(kind, tmp_path)
    if kind != "qwen2_vl":  # the fast test covers Qwen2-VL's
        _assert_like_hf(model, ref, batch_for(kind, ref.config)[0])
    batch = _ending_in_an_image()
    positions = model.position_ids_fn(batch["input_ids"], {"vision": batch["vision"]}, batch["attention_mask"])
    last = positions[0, int(batch["attention_mask"][0].sum()) - 1]
    assert len(set(last.tolist())) == 3  # last + 1 on each axis is not max + 1 on all three
    _assert_like_hf(model, ref, batch)
    _assert_like_hf(model, ref, _text_only())


@pytest.mark.slow
def test_beams_and_several_sequences_keep_the_positions(tmp_path):
    """transformers' options apply: beam search and ``num_return_sequences`` expand each prompt's positions with
    it, and give HF's tokens."""
    model, ref = _models("qwen2_vl", tmp_path)
    batch, _ = batch_for("qwen2_vl", ref.config)
    hf_kwargs = _hf_kwargs(batch)
    options = dict(max_new_tokens=4, do_sample=False, num_beams=2, num_return_sequences=2)
    with torch.no_grad():
        theirs = ref.generate(**hf_kwargs, **options)[:, hf_kwargs["input_ids"].shape[1]:]
        ours = model.generate(**batch, **options)
    assert ours.shape == (4, 4) and torch.equal(ours, theirs)
