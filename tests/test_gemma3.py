"""Gemma 3 (local sliding-window and global layers) and other sliding-window LLMs inside MultimodalModel train
exactly like transformers' own model (fp32, tiny random models, sequences longer than the window)."""

import copy

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import families, tiny_language_model


def _compare(lm, ids, labels, attention_mask=None, implementation="eager"):
    ref = copy.deepcopy(lm)
    ref.set_attn_implementation(implementation)
    model = lmm.MultimodalModel({}, lm)
    out = model(input_ids=ids, labels=labels, attention_mask=attention_mask)
    expected = ref(input_ids=ids, labels=labels, attention_mask=attention_mask)
    live = (attention_mask if attention_mask is not None else torch.ones_like(ids)).bool()
    torch.testing.assert_close(out.logits[live], expected.logits[live], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=0)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    return out


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_gemma3_text_with_window_shorter_than_sequence_equals_hf(implementation):
    torch.manual_seed(0)
    lm = tiny_language_model("gemma3_text", sliding_window=5)
    assert families.layer_windows(lm) == [5, 5, None, 5]
    assert lm.config.query_pre_attn_scalar ** -0.5 != lm.config.head_dim ** -0.5  # the layer's scaling must be used
    ids = torch.randint(0, 128, (2, 29))
    labels = ids.clone()
    labels[0, :4] = -100
    out = _compare(lm, ids, labels, implementation=implementation)
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
    _compare(lm, ids, labels, attention_mask=mask)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_other_sliding_window_families_equal_hf(kind):
    torch.manual_seed(2)
    extra = dict(use_sliding_window=True, max_window_layers=2) if kind == "qwen2" else {}
    lm = tiny_language_model(kind, sliding_window=6, **extra)
    assert any(w == 6 for w in families.layer_windows(lm))
    ids = torch.randint(0, 128, (2, 23))
    _compare(lm, ids, ids.clone(), implementation="sdpa")


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
