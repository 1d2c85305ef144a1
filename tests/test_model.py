"""Model composition against the plain HF models it is built from."""

import copy

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import families, tiny_encoder, tiny_language_model
from lightning_mm.trainer.module import MultimodalLightningModule


@pytest.mark.parametrize("kind", sorted(families.LANGUAGE_FAMILIES))
def test_text_only_loss_and_gradients_equal_hf(kind):
    torch.manual_seed(0)
    lm = tiny_language_model(kind)
    ref = copy.deepcopy(lm)
    ref.set_attn_implementation("eager")
    model = lmm.MultimodalModel({}, lm)
    ids = torch.randint(0, 128, (2, 19))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(input_ids=ids, labels=labels)
    expected = ref(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", sorted(families.TINY_ENCODERS))
def test_encoder_split_equals_hf_forward_and_features_land_at_placeholders(kind):
    torch.manual_seed(0)
    enc = lmm.ModalityEncoder(tiny_encoder(kind), projector="linear")
    model = lmm.MultimodalModel({"m": enc}, tiny_language_model("llama")).eval()
    inputs = enc.family.random_inputs(enc.module.config, 2)
    # the staged forward (embed / layers / final) reproduces the family's own HF forward
    h, ctx = enc.embed(inputs)
    torch.testing.assert_close(enc.family.final(enc.module, enc.run_layers(h, ctx), ctx),
                               enc.family.reference(enc.module, inputs))
    n = sum(enc.num_tokens(inputs))
    pid = model.placeholder_ids["m"]
    assert pid == 128  # first id past the vocabulary
    ids = torch.randint(0, 128, (1, n + 9))
    where = torch.randperm(n + 9)[:n].sort().values
    ids[0, where] = pid
    feats = enc(inputs)
    blocks = 1 + enc.family.deepstack_layers(enc.config)  # Qwen3-VL: DeepStack features packed beside them
    assert feats.shape == (n, 32 * blocks)
    embeds = model.embed(ids, {"m": feats})
    torch.testing.assert_close(embeds[0, where], feats[:, :32])
    text = torch.ones(n + 9, dtype=torch.bool)
    text[where] = False
    torch.testing.assert_close(embeds[0, text], model.language_model.model.embed_tokens(ids[0, text]))
    model(input_ids=ids, m=inputs)  # the whole forward accepts it


def test_placeholder_count_mismatch_names_modality_and_counts():
    enc = lmm.ModalityEncoder(tiny_encoder("siglip"))
    model = lmm.MultimodalModel({"vision": enc}, tiny_language_model("llama"))
    inputs = enc.family.random_inputs(enc.module.config, 1)  # 16 tokens
    ids = torch.full((1, 20), 5)
    ids[0, :15] = model.placeholder_ids["vision"]
    with pytest.raises(ValueError, match=r"modality 'vision': input_ids hold 15 placeholder tokens .* emits 16"):
        model(input_ids=ids, vision=inputs)
    with pytest.raises(ValueError, match="unknown modalities"):
        model(input_ids=torch.full((1, 4), 5), audio=inputs)


def test_unknown_families_are_named():
    with pytest.raises(ValueError, match="supported families: LlamaForCausalLM"):
        lmm.MultimodalModel({}, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unsupported encoder Linear; supported: CLIPVisionModel"):
        lmm.ModalityEncoder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown projector"):
        lmm.ModalityEncoder(tiny_encoder("clip"), projector="conv")


def test_freezing_gives_no_gradient_and_no_optimizer_slot():
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("clip")),
                                 "audio": lmm.ModalityEncoder(tiny_encoder("whisper"), projector="linear")},
                                tiny_language_model("qwen2"))
    model.freeze(encoders=True, projectors=False, language_model=True, audio_projector=True)
    dm = lmm.data.SyntheticMultimodalDataModule(model=model, batch_size=2)
    batch = next(iter(dm.train_dataloader()))
    model(**batch).loss.backward()
    for name, p in model.named_parameters():
        trainable = name.startswith("encoders.vision.projector")
        assert p.requires_grad == trainable, name
        assert (p.grad is not None and p.grad.abs().sum() > 0) == trainable, name
    opt = MultimodalLightningModule(model).configure_optimizers()
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in model.encoders["vision"].projector.parameters()}
    with pytest.raises(ValueError, match="no encoder named 'video'"):
        model.freeze(video=True)


def test_packing_equals_padding():
    """MP rows (segments, restarted positions) give the same loss sum as one sample per row."""
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("qwen2_vl"))}, tiny_language_model())
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=4)
    samples = [data[i] for i in range(4)]
    padded = lmm.data.MultimodalCollator(model)(samples)
    packed = lmm.data.MultimodalCollator(model, seq_len=128, pack=True)(samples)
    assert packed["input_ids"].shape[0] < 4 and "segment_ids" in packed
    a, b = model(**padded), model(**packed)
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-5, atol=1e-5)


def test_attention_features_bitfield_lacks_are_rejected_with_the_fix():
    ids = torch.randint(0, 128, (1, 20))
    with pytest.raises(ValueError, match="softcapping.*attn_logit_softcapping=None"):
        lmm.MultimodalModel({}, tiny_language_model("gemma2", attn_logit_softcapping=50.0))(input_ids=ids)
