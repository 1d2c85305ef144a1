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
