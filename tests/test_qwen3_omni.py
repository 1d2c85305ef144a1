"""Qwen3-Omni's thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``): audio clips, images and videos in one
sample, against HF's own thinker (fp32, tiny configs, nothing downloaded): the encoders split as pipeline stages
would run them, loss, logits and every gradient, the M-RoPE positions (temporal steps in
``position_id_per_seconds``, audio counted like text), ``save_pretrained`` back, greedy ``generate``, and a sample
made by HF's own processor (built locally from its parts).
"""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import loading
from lightning_mm.model.families import ENCODER_FAMILIES
from lightning_mm.model.qwen3_omni import TINY_AUDIO
from tests.test_hf_composites import assert_like_hf, assert_saved_exactly, save_hf

IMG, VID, VSTART, VEND, AUD, ASTART, AEND, PAD = 100, 101, 102, 103, 104, 105, 106, 0
PER_SECOND = 13  # position_id_per_seconds: a video of 2 s per temporal patch steps 26 positions a patch
PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=512, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, router_aux_loss_coef=0.05, output_router_logits=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                             "interleaved": True})
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 2])


def tiny_thinker(text: dict | None = None, **extra):
    """A tiny random thinker: three MoE text layers (aux loss in the loss), DeepStack from tower layers 0 and 2."""
    import transformers as tf

    cfg = tf.Qwen3OmniMoeThinkerConfig(
        text_config={**TEXT, **(text or {})}, vision_config=VISION, audio_config=TINY_AUDIO, image_token_id=IMG,
        video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND, audio_token_id=AUD,
        audio_start_token_id=ASTART, audio_end_token_id=AEND, position_id_per_seconds=PER_SECOND, **extra)
    return tf.Qwen3OmniMoeThinkerForConditionalGeneration(cfg)


def save_thinker(path, text: dict | None = None, **extra) -> str:
    torch.manual_seed(0)
    return save_hf(tiny_thinker(text, **extra), "qwen3_omni", path)


def load_hf(path):
    import transformers

    return transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(path,
                                                                                    attn_implementation="eager")


def _text(g, n: int) -> list[int]:
    return torch.randint(1, 90, (n,), generator=g).tolist()


def omni_batch(seed: int = 1):
    """(our batch, HF's keyword arguments): row 0 holds a clip, an image and a video (in that order), row 1 a
    video, a clip and an image; right padding. Clips of 230, 130 and 60 real mel frames (30, 17 and 8 tokens),
    images of 8 x 8 and 4 x 8 patches, videos of two and three temporal patches."""
    g = torch.Generator().manual_seed(seed)
    fam = ENCODER_FAMILIES["Qwen3OmniMoeAudioEncoder"]
    audio = fam.random_inputs(fam.tiny().config, 2, g, frames=[230, 130])
    images, videos = [[1, 8, 8], [1, 4, 8]], [[2, 4, 4], [3, 4, 8]]
    tokens = lambda grid: grid[0] * grid[1] * grid[2] // 4  # noqa: E731
    clip = fam.num_tokens(type("C", (), TINY_AUDIO), audio)
    spans = {"a": lambda i: [ASTART] + [AUD] * clip[i] + [AEND],
             "i": lambda i: [VSTART] + [IMG] * tokens(images[i]) + [VEND],
             "v": lambda i: [VSTART] + [VID] * tokens(videos[i]) + [VEND]}
    rows = []
    for r, order in enumerate(("aiv", "vai")):
        ids = _text(g, 4 + r)
        for kind in order:
            ids += spans[kind](r) + _text(g, 3)
        rows.append(ids + _text(g, 2))
    length = max(map(len, rows))
    ids, attention = torch.full((2, length), PAD), torch.zeros(2, length, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)], attention[r, :len(row)] = torch.tensor(row), 1
    labels = ids.masked_fill((ids == IMG) | (ids == VID) | (ids == AUD) | (attention == 0), -100)
    vision = {"pixel_values": torch.randn(sum(t * h * w for t, h, w in images), PATCH_DIM, generator=g),
              "image_grid_thw": torch.tensor(images)}
    video = {"pixel_values_videos": torch.randn(sum(t * h * w for t, h, w in videos), PATCH_DIM, generator=g),
             "video_grid_thw": torch.tensor(videos), "video_second_per_grid": torch.tensor([2.0, 1.0])}
    ours = {"input_ids": ids, "attention_mask": attention, "labels": labels, "vision": vision, "video": video,
            "audio": audio, "item_counts": {m: torch.tensor([1, 1]) for m in ("vision", "video", "audio")}}
    hf = {"input_ids": ids, "attention_mask": attention, "labels": labels, **vision, **video, **audio}
    return ours, hf


def test_encoders_split_into_stages_equal_hf_encoders():
    """The audio encoder (clips longer than an attention window and than a chunk, and shorter) and the vision
    encoder (DeepStack blocks packed beside the features) run layer by layer as two pipeline stages give HF's
    encoders' outputs; a subset of clips (a microbatch) gives those clips' tokens."""
    torch.manual_seed(0)
    for cls, kw in (("Qwen3OmniMoeAudioEncoder", dict(frames=[230, 130, 60])),
                    ("Qwen3OmniMoeVisionEncoder", dict(grids=[(1, 8, 4), (2, 4, 4)]))):
        fam = ENCODER_FAMILIES[cls]
        enc = fam.tiny()
        inputs = fam.random_inputs(enc.config, 3 if "frames" in kw else 2, torch.Generator().manual_seed(0), **kw)
        expected = fam.reference(enc, inputs)
        assert expected.shape[0] == sum(fam.num_tokens(enc.config, inputs))
        layers = fam.layers(enc)
        hidden, ctx = fam.embed(enc, inputs)
        for layer in layers[:1]:
            hidden = fam.run_layer(enc, layer, hidden, ctx)
        sent = fam.stage_output(enc, hidden, ctx)
        ctx = fam.context(enc, inputs)  # the next stage computes its own context
        hidden = fam.stage_input(enc, sent, ctx)
        for layer in layers[1:]:
            hidden = fam.run_layer(enc, layer, hidden, ctx)
        torch.testing.assert_close(fam.final(enc, hidden, ctx), expected, rtol=0, atol=0)
    fam = ENCODER_FAMILIES["Qwen3OmniMoeAudioEncoder"]
    enc = fam.tiny()
    inputs = fam.random_inputs(enc.config, 3, torch.Generator().manual_seed(0), frames=[230, 130, 60])
    assert fam.num_tokens(enc.config, inputs) == [30, 17, 8]
    whole = fam.reference(enc, inputs)
    part = fam.reference(enc, fam.select_items(inputs, torch.tensor([2, 0])))
    torch.testing.assert_close(part, torch.cat([whole[47:], whole[:30]]), rtol=1e-5, atol=1e-6)


def test_audio_image_video_sample_equals_hf_thinker_and_saves_back(tmp_path):
    """A batch whose rows each hold an audio clip, an image and a video: the placeholder counts, the M-RoPE
    positions (HF's ``get_rope_index``), loss (the experts' aux loss in it), logits and every gradient equal HF's
    thinker; ``save_pretrained`` writes the tensors the HF class loads back exactly."""
    folder = save_thinker(tmp_path / "src")
    ref, model = load_hf(folder).train(), lmm.MultimodalModel.from_pretrained(folder).train()
    assert list(model.encoders) == ["vision", "video", "audio"]
    assert model.placeholder_ids == {"vision": IMG, "video": VID, "audio": AUD}
    assert model.shared_encoders == {"video": "vision"} and model.pipeline_encoders == ["vision", "audio"]
    assert model.deepstack == {"vision": 2, "video": 2}
    batch, hf_inputs = omni_batch()
    assert model.encoders["audio"].num_tokens(batch["audio"]) == [30, 17]
    assert model.encoders["video"].num_tokens(batch["video"]) == [8, 24]
    theirs, _ = ref.model.get_rope_index(hf_inputs["input_ids"], hf_inputs["image_grid_thw"],
                                         hf_inputs["video_grid_thw"], hf_inputs["attention_mask"], False,
                                         hf_inputs["feature_attention_mask"].sum(-1),
                                         hf_inputs["video_second_per_grid"])
    ours = model.position_ids_fn(batch["input_ids"], batch, batch["attention_mask"])
    assert torch.equal(ours.permute(2, 0, 1).float(), theirs)
    video = (batch["input_ids"][0] == VID).nonzero().flatten()  # two temporal patches, 2 s each: 26 apart
    assert int(ours[0, video[-1] + 1, 0]) == int(ours[0, video[0], 0]) + 2 * PER_SECOND * 1 + 1
    assert_like_hf(model, ref, model.composite.spec, batch, hf_inputs, logits_atol=1e-4)

    out_dir = tmp_path / "out"
    model.save_pretrained(out_dir)
    assert (out_dir / "preprocessor_config.json").read_text() == json.dumps({"kind": "qwen3_omni"})
    assert_saved_exactly(model, out_dir, load_hf(folder).state_dict(), load_hf(out_dir).state_dict())


def test_generate_equals_hf_thinker_generate(tmp_path):
    """Greedy ``generate`` of the audio + image + video batch: the prompt's DeepStack features at prefill, every
    generated token one position after the prompt's last on each axis; the tokens equal HF's thinker ``generate``
    on the left-padded batch and every step's logits agree within 1e-4."""
    from tests.helpers.text_lm_case import left_padded

    # HF's MoE thinker adds its aux loss in every decoding step and fails without this
    folder = save_thinker(tmp_path / "src", text={"output_router_logits": False})
    model, ref = lmm.MultimodalModel.from_pretrained(folder).eval(), load_hf(folder).eval()
    batch, hf_inputs = omni_batch(seed=2)
    ids, mask = left_padded(batch["input_ids"], batch["attention_mask"], PAD)
    hf_inputs = {**hf_inputs, "input_ids": ids, "attention_mask": mask}
    hf_inputs.pop("labels")
    steps = 6
    with torch.no_grad():
        theirs = ref.generate(**hf_inputs, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                              output_logits=True)
        ours = model.generate(**batch, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                              output_logits=True)
    assert torch.equal(ours.sequences, theirs.sequences[:, ids.shape[1]:]), (ours.sequences, theirs.sequences)
    assert len(ours.logits) == len(theirs.logits) == steps
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"step {step}")


def test_what_is_not_served_is_refused_by_name(tmp_path):
    """Audio interleaved inside a video (the processor's ``load_audio_from_video``) and temporal positions that
    are not whole numbers are refused before anything runs, naming the fix; so is the whole Qwen3-Omni folder
    (thinker, talker and code2wav), pointing at the thinker."""
    folder = save_thinker(tmp_path / "src")
    model = lmm.MultimodalModel.from_pretrained(folder)
    batch, _ = omni_batch()
    ids = batch["input_ids"].clone()
    at = int((ids[0] == VSTART).nonzero()[-1])  # the video's start token in row 0
    ids[0, at + 1] = ASTART
    with pytest.raises(ValueError, match="audio interleaved in it"):
        model.position_ids_fn(ids, batch, batch["attention_mask"])
    video = {**batch["video"], "video_second_per_grid": torch.tensor([2.0, 1.0 / 3])}
    with pytest.raises(ValueError, match="4.33333 apart, not a whole number"):
        model.position_ids_fn(batch["input_ids"], {**batch, "video": video}, batch["attention_mask"])

    import transformers
    from safetensors.torch import save_file

    whole = tmp_path / "omni"
    transformers.Qwen3OmniMoeConfig().save_pretrained(whole)  # thinker, talker and code2wav: a config suffices
    save_file({"thinker.lm_head.weight": torch.zeros(1)}, whole / "model.safetensors")
    with pytest.raises(loading.ModelFolderError, match="only its thinker is supported.*save the thinker"):
        lmm.MultimodalModel.from_pretrained(whole)


def omni_processor():
    """HF's ``Qwen3OmniMoeProcessor`` built from local parts: a word-level tokenizer holding the thinker's special
    tokens at the tiny config's ids, Whisper's feature extractor (16 mel bins), Qwen2-VL's image and video
    processors (patches of 4, merge 2, temporal patches of 2; their PIL backends: torchvision is not installed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from lightning_mm.data.video import Qwen2VLVideoProcessorPil

    named = {"<|image_pad|>": IMG, "<|video_pad|>": VID, "<|vision_start|>": VSTART, "<|vision_end|>": VEND,
             "<|audio_pad|>": AUD, "<|audio_start|>": ASTART, "<|audio_end|>": AEND}
    words = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(60)]
    vocab = {**{w: i for i, w in enumerate(words)}, **named}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(named))
    extra = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
             "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
             "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   extra_special_tokens=extra)
    patches = dict(patch_size=4, merge_size=2, temporal_patch_size=2, size=SIZE)
    # transformers' video processors need torchvision (not installed): ours does the same to the frames, and the
    # processor's class check, which cannot look it up, is skipped
    with mock.patch.object(Qwen3OmniMoeProcessor, "check_argument_for_proper_class", lambda *a: None):
        return Qwen3OmniMoeProcessor(image_processor=Qwen2VLImageProcessorPil(**patches),
                                     video_processor=Qwen2VLVideoProcessorPil(patches),
                                     feature_extractor=WhisperFeatureExtractor(feature_size=16), tokenizer=fast)


SIZE = {"shortest_edge": 8 * 8, "longest_edge": 32 * 32}


def test_a_sample_from_hf_processor_equals_hf_thinker(tmp_path):
    """HF's processor writes one sample with a 2.3 s clip, an image and a four-frame video at 2 frames a second
    (one second per temporal patch: 13 positions apart) into ids and inputs: our model on them, the modalities'
    inputs as the processor names them, gives HF's loss, logits and gradients; the item text around each item is
    the chat template's (``item_text``)."""
    import numpy as np

    from lightning_mm.data.item_text import item_text

    proc = omni_processor()
    rng = np.random.default_rng(0)
    text = ("w1 w2 <|audio_start|><|audio_pad|><|audio_end|> w3 <|vision_start|><|image_pad|><|vision_end|> w4 "
            "<|vision_start|><|video_pad|><|vision_end|> w5 w6")
    inputs = proc(text=[text], audio=[rng.standard_normal(36800).astype(np.float32) * 0.1],
                  images=[(rng.random((16, 32, 3)) * 255).astype(np.uint8)],
                  videos=[(rng.random((4, 16, 16, 3)) * 255).astype(np.uint8)],
                  videos_kwargs={"fps": 2.0, "size": SIZE},
                  return_tensors="pt")
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]] and inputs["image_grid_thw"].tolist() == [[1, 4, 8]]
    assert inputs["video_second_per_grid"].tolist() == [1.0] and int(inputs["feature_attention_mask"].sum()) == 230
    ids = inputs["input_ids"]
    labels = ids.masked_fill((ids == IMG) | (ids == VID) | (ids == AUD), -100)
    folder = save_thinker(tmp_path / "src")
    ref, model = load_hf(folder).train(), lmm.MultimodalModel.from_pretrained(folder).train()
    for name, start, end in (("audio", ASTART, AEND), ("vision", VSTART, VEND), ("video", VSTART, VEND)):
        assert item_text(model, proc.tokenizer, name).ids(model.placeholder_ids[name], 2) == \
            [start, model.placeholder_ids[name], model.placeholder_ids[name], end]
    batch = {"input_ids": ids, "attention_mask": inputs["attention_mask"], "labels": labels,
             "audio": {k: inputs[k] for k in ("input_features", "feature_attention_mask")},
             "vision": {k: inputs[k] for k in ("pixel_values", "image_grid_thw")},
             "video": {k: inputs[k] for k in ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")}}
    hf_inputs = {k: v for k, v in inputs.items() if k != "num_audio_tokens"}
    assert_like_hf(model, ref, model.composite.spec, batch, {**hf_inputs, "labels": labels}, logits_atol=1e-4)


@pytest.mark.slow
def test_audio_image_video_under_the_strategy_trains_like_one_process(tmp_path):
    """The thinker under MultimodalParallelStrategy: the vision encoder (images and videos, one copy) and the audio
    encoder on ranks of their own, the LLM in 2 pipeline stages, 2 microbatches; samples of a clip, an image and a
    video (collated: frames padded, items expanded, M-RoPE positions per sample) give one process's losses and
    trained parameters. The aux loss stays out of the loss here: it is a mean over microbatches, which one process
    running the batch whole does not compute (its microbatch rule is tested in tests/test_moe.py)."""
    from tests.helpers.composite_case import run_case

    folder = save_thinker(tmp_path / "src", text={"output_router_logits": False})
    ref_losses, ref_params = run_case("omni_case.py", {"folder": folder}, tmp_path, "single")
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    assert any(n.startswith("encoders.audio.module.layers.1.") for n in ref_params)
    losses, params = run_case("omni_case.py", {"folder": folder, "llm_pp": 2}, tmp_path, "pp2")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)
