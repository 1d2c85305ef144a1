"""Real inputs (tokenizer + image processor + feature extractor) become batches with expanded placeholders."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CLIPImageProcessor, PreTrainedTokenizerFast, WhisperFeatureExtractor

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model


def word_tokenizer():
    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "photo", "of", "cat", "and", "sound", "describe"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_processor_and_collator_on_real_inputs():
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("clip")),
                                 "audio": lmm.ModalityEncoder(tiny_encoder("whisper"), projector="linear")},
                                tiny_language_model())
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    audio = WhisperFeatureExtractor(feature_size=16)
    audio.n_samples, audio.nb_max_frames = 16 * audio.hop_length, 16  # the tiny encoder's 16 frames
    proc = lmm.data.MultimodalProcessor(model, word_tokenizer(), {"vision": images, "audio": audio},
                                        {"vision": "<image>", "audio": "<audio>"},
                                        {"audio": {"sampling_rate": 16000}})
    rng = np.random.default_rng(0)
    sample = proc("a photo <image> of cat and sound <audio> describe", vision=[rng.random((40, 48, 3))],
                  audio=[rng.standard_normal(3000)])
    vis, aud = model.placeholder_ids["vision"], model.placeholder_ids["audio"]
    assert sample["input_ids"].tolist() == [1, 2, vis, 3, 4, 5, 6, aud, 7]
    assert sample["vision"]["pixel_values"].shape == (1, 3, 32, 32)
    assert sample["audio"]["input_features"].shape == (1, 16, 16)
    batch = lmm.data.MultimodalCollator(model)([sample])
    assert batch["input_ids"].shape == (1, 7 + 17 + 8)  # CLIP: 16 patches + class token; Whisper: 8 positions
    assert int((batch["labels"] != -100).sum()) == 6  # 7 text tokens; the first is never a target
    assert torch.isfinite(model(**batch).loss)
    with pytest.raises(ValueError, match="modality 'vision': the text has 2 '<image>' markers but 1 items"):
        proc("<image> <image>", vision=[rng.random((32, 32, 3))])


def test_qwen2_audio_clip_tokens_follow_the_frame_mask_its_config_asks_for():
    """A feature extractor whose config says return_attention_mask=True gives the frame-level mask (one entry per
    feature frame) without being asked in the call, so a clip's token count follows its real length (called
    without it, Whisper's extractor returns the padding's sample-level mask: 16000 entries for a 1 s window)."""
    model = lmm.MultimodalModel({"audio": lmm.ModalityEncoder(tiny_encoder("qwen2_audio"), projector="linear")},
                                tiny_language_model())
    audio = WhisperFeatureExtractor(feature_size=16, chunk_length=1, return_attention_mask=True)
    proc = lmm.data.MultimodalProcessor(model, word_tokenizer(), {"audio": audio}, {"audio": "<audio>"},
                                        {"audio": {"sampling_rate": 16000}})
    out = proc.encode_items("audio", [np.zeros(8000, dtype=np.float32), np.zeros(16000, dtype=np.float32)])
    frames = out["input_features"].shape[-1]
    assert out["feature_attention_mask"].shape == (2, frames)
    assert out["feature_attention_mask"].sum(1).tolist() == [frames // 2, frames]
    short, full = model.encoders["audio"].num_tokens(out)
    assert 0 < short < full <= frames
