"""Gemma 3 (local sliding-window and global layers) and other sliding-window LLMs inside MultimodalModel train
exactly like transformers' own model (fp32, tiny random models, sequences longer than the window)."""

import copy

import pytest
import torch

import lightning_mm as lmm
from helpers.text_lm_case import compare_with_hf, left_padded
from lightning_mm.model import families, tiny_language_model


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_gemma3_text_with_window_shorter_than_sequence_equals_hf(implementation):
    torch.manual_seed(0)
    lm = tiny_language_model("gemma3_text", sliding_window=5)
    assert families.layer_windows(lm) == [5, 5, None, 5]
    assert lm.config.query_pre_attn_scalar ** -0.5 != lm.config.head_dim ** -0.5  # the layer's scaling must be used
    ids = torch.randint(0, 128, (2, 29))
    labels = ids.clone()
    labels[0, :4] = -100
    out = compare_with_hf(lm, ids, labels, implementation=implementation)
    # the window matters: without it the model computes something else
    wide = copy.deepcopy(lm)
    wide.config.sliding_window = 1000
    for layer in wide.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 1000
    assert not torch.allclose(lmm.MultimodalModel({}, wide)(input_ids=ids).logits, out.logits, atol=1e-3)


def test_gemma3_text_left_padding_equals_hf():
    torch.manual_seed(1)
    lm = tiny_language_model("gemma3_text", sliding_window=4, num_hidden_layers=6)  # HF's 5 local : 1 global
    assert families.layer_windows(lm) == [4, 4, 4, 4, 4, None]
    ids = torch.randint(0, 128, (2, 21))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 6] = -100  # HF would score it from the logits of a padding token
    compare_with_hf(lm, ids, labels, attention_mask=mask)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_other_sliding_window_families_equal_hf(kind):
    torch.manual_seed(2)
    extra = dict(use_sliding_window=True, max_window_layers=2) if kind == "qwen2" else {}
    lm = tiny_language_model(kind, sliding_window=6, **extra)
    assert any(w == 6 for w in families.layer_windows(lm))
    ids = torch.randint(0, 128, (2, 23))
    compare_with_hf(lm, ids, ids.clone(), implementation="sdpa")


def test_softcapping_and_two_sided_windows_are_refused_with_the_fix():
    ids = torch.randint(0, 128, (1, 20))
    with pytest.raises(ValueError, match="softcapping.*attn_logit_softcapping=None"):
        lmm.MultimodalModel({}, tiny_language_model("gemma2", attn_logit_softcapping=50.0))(input_ids=ids)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True.*set it to False"):  # |q - k| < window
        lmm.MultimodalModel({}, tiny_language_model("gemma3_text", use_bidirectional_attention=True))(input_ids=ids)


def test_layer_windows_of_families_and_of_a_composite():
    import transformers

    assert families.layer_windows(tiny_language_model("llama")) == [None] * 4
    assert families.layer_windows(tiny_language_model("mistral", sliding_window=16)) == [16] * 4
    text = families.LANGUAGE_FAMILIES["gemma3_text"].tiny_config(sliding_window=7)
    config = transformers.Gemma3Config(text_config=text.to_dict(),
                                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=4, image_size=32, patch_size=8))
    with torch.device("meta"):
        composite = transformers.Gemma3ForConditionalGeneration(config)
    assert families.layer_windows(composite) == [7, 7, None, 7]
    assert families.layer_windows(torch.nn.Linear(2, 2)) == []


def test_gemma3_greedy_generation_past_the_window_equals_hf():
    torch.manual_seed(0)
    lm = tiny_language_model("gemma3_text", sliding_window=4)
    ref = copy.deepcopy(lm)
    ref.set_attn_implementation("eager")
    ids = torch.randint(0, 128, (1, 12))
    ours = lmm.MultimodalModel({}, lm).eval().generate(ids, max_new_tokens=8, do_sample=False)
    theirs = ref.generate(ids, max_new_tokens=8, do_sample=False)
    assert ours.tolist() == theirs[:, ids.shape[1]:].tolist()


# ---------------------------------------------------------------------------------------------- the composite
def _gemma3_composite(tmp_path):
    from tests.test_hf_composites import load_hf, save_composite

    folder = save_composite("gemma3", tmp_path / "src")
    return folder, lmm.MultimodalModel.from_pretrained(folder), load_hf("gemma3", folder)


def test_gemma3_composite_images_are_bidirectional_blocks_as_in_hf(tmp_path):
    """``Gemma3ForConditionalGeneration``: each image's tokens see each other (HF's ``token_type_ids`` blocks) and
    everything before them, text stays causal, local layers cut both by their window; without the image blocks the
    logits differ (the equality to HF's loss, logits and gradients is in tests/test_hf_composites.py)."""
    from lightning_mm.attention import mask as masks
    from tests.test_hf_composites import IMG, batch_for

    _, model, ref = _gemma3_composite(tmp_path)
    assert model.bidirectional_items and model.causal_modalities
    assert model.encoders["vision"].num_tokens({"pixel_values": torch.zeros(3, 3, 16, 16)}) == [4, 4, 4]
    batch, hf_inputs = batch_for("gemma3", ref.config)
    bam = model.build_bam(batch["input_ids"], batch["attention_mask"])
    dense = masks.to_dense(bam)[0]
    first = (batch["input_ids"][0] == IMG).nonzero().flatten()[:4].tolist()  # the first image's tokens
    assert dense[first[0], first[-1]] and not dense[first[0] - 1, first[0]]
    ours = {k: v for k, v in batch.items() if k != "item_counts"}
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = ref.eval()(**hf_inputs).logits[keep]
        torch.testing.assert_close(model.eval()(**ours).logits[keep], expected, atol=1e-5, rtol=1e-5)
        model.bidirectional_items = False
        assert not torch.allclose(model(**ours).logits[keep], expected, atol=1e-3)


def test_gemma3_composite_generate_equals_hf_generate(tmp_path):
    """Greedy tokens and every step's logits of one-process ``generate`` equal HF's composite ``generate`` on the
    left-padded batch (image blocks at prefill, decoding past the local layers' window)."""
    from tests.test_hf_composites import IMG, PAD, batch_for

    _, model, ref = _gemma3_composite(tmp_path)
    model, ref = model.eval(), ref.eval()
    batch, _ = batch_for("gemma3", ref.config)
    batch = {k: v for k, v in batch.items() if k not in ("item_counts", "labels")}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    left_ids, left_mask = left_padded(ids, mask, PAD)
    with torch.no_grad():
        theirs = ref.generate(**batch["vision"], input_ids=left_ids, attention_mask=left_mask,
                              token_type_ids=(left_ids == IMG).long(), max_new_tokens=8, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=PAD)
        ours = model.generate(**batch, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                              output_logits=True)
    assert torch.equal(ours.sequences, theirs.sequences[:, left_ids.shape[1]:]), (ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"step {step}")


@pytest.mark.slow
def test_gemma3_composite_under_the_strategy_trains_like_one_process(tmp_path):
    """Vision pp 1 + LLM pp 2 with dp 2, LLM cp 2 (image blocks split between CP ranks, local layers' windows),
    and vision cp 2 (a microbatch's images split over two tower ranks): the losses and every trained parameter of
    one process."""
    from tests.helpers.composite_case import run_case

    folder, _, _ = _gemma3_composite(tmp_path)
    base = {"folder": folder, "image_size": 16}
    ref_losses, ref_params = run_case("composite_case.py", base, tmp_path, "single")
    cases = {"pp2_dp2": {"llm_pp": 2, "dp": 2}, "cp2": {"llm_cp": 2}, "vision_cp2": {"vision_cp": 2}}
    for name, case in cases.items():
        losses, params = run_case("composite_case.py", {**base, **case}, tmp_path, name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=name)
        assert set(params) == set(ref_params), name
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


def test_gemma3_synthetic_data_planner_and_header_metadata(tmp_path):
    """Synthetic data runs through the composite and the planner's part runners; the tower's cost counts the
    patches it sees (16 per image, pooled to 4 tokens); Gemma 3's image processor's token count comes from an
    image's header (fixed 896-pixel resize), and not with pan-and-scan crops."""
    import transformers

    from lightning_mm.data.media_meta import image_inputs
    from lightning_mm.planner.model_costs import part_runners

    _, model, _ = _gemma3_composite(tmp_path)
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=4, items_per_sample=(1, 2))
    batch = lmm.data.MultimodalCollator(model)([data[i] for i in range(4)])
    with torch.no_grad():
        assert torch.isfinite(model(**{k: v for k, v in batch.items() if k != "item_counts"}).loss)
    runners = part_runners(model, batch)
    assert runners["vision"] and runners["language_model"]
    family = model.encoders["vision"].family
    vision = batch["vision"]
    n = vision["pixel_values"].shape[0]
    assert family.encoder_positions(model.encoders["vision"].config, vision) == [16] * n
    assert family.num_tokens(model.encoders["vision"].config, vision) == [4] * n and family.positions_per_token == 4
    from PIL import Image

    proc = transformers.Gemma3ImageProcessor(size={"height": 896, "width": 896})
    sizes = [(640, 480), (20, 900)]
    got = image_inputs(proc, sizes)
    real = proc(images=[Image.new("RGB", s) for s in sizes], return_tensors="pt")["pixel_values"]
    assert got["pixel_values"].shape == real.shape == (2, 3, 896, 896)
    assert image_inputs(transformers.Gemma3ImageProcessor(do_pan_and_scan=True), [(640, 480)]) is None
