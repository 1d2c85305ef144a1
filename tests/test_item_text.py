"""The text a family's HF processor writes around and inside each item (Qwen-VL's vision start/end, Qwen3-VL's frame
timestamps, Gemma 3's start/end of image, Qwen2-Audio's start/end of audio), written by the data path: against HF's
own processors' expansion, and a Qwen3-VL conversation with an image and a decoded video whose loss equals HF's
model on the same ids."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor

import lightning_mm as lmm
from lightning_mm.data import ConversationDataModule, MultimodalCollator, MultimodalProcessor
from lightning_mm.data.item_text import item_text, patch_seconds
from lightning_mm.data.metadata import metadata_of
from lightning_mm.data.video import Qwen3VLVideoProcessorPil, VideoProcessor, qwen3_vl_frame_size
from tests.test_conversation_data import SPECIAL, TEMPLATE, WORDS, conv, write_data
from tests.test_hf_composites import IMG, VEND, VSTART, assert_like_hf, load_hf, save_composite
from tests.test_video_models import VID

TIMES = [f"<{t / 10:.1f}" for t in range(60)]  # "<0.0" ... "<5.9": Qwen3-VL's timestamps, split at the space
QWEN_TOKENS = {"<|image_pad|>": IMG, "<|video_pad|>": VID, "<|vision_start|>": VSTART, "<|vision_end|>": VEND}
GEMMA_TOKENS = {"<image_soft_token>": IMG, "<start_of_image>": VSTART, "<end_of_image>": VEND}
VIDEO_CONFIG = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 8 * 8, "longest_edge": 4 * 32 * 48}}


NEWLINES = ["\n" * n for n in range(1, 6)]


def tokenizer(gemma: bool = False, newline_runs: bool = False) -> PreTrainedTokenizerFast:
    """Words, timestamps and a composite's special tokens at the tiny composites' ids (vocabulary of 128); Gemma's
    with its blank line as one token, and the token names its processor reads. ``newline_runs``: a run of
    newlines is one token (as in Gemma's vocabulary), so a newline before an image merges with its blank line."""
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + ["seconds>"] + NEWLINES + TIMES)}
    named = GEMMA_TOKENS if gemma else QWEN_TOKENS
    vocab.update(named)
    assert max(vocab.values()) < 128 and len(set(vocab.values())) == len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    if newline_runs:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                     pre_tokenizers.Split(Regex("\n+"), "isolated")])
    else:
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL + list(named) + (["\n\n"] if gemma and not newline_runs else []))
    extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"} if gemma else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens=extra)
    fast.chat_template = TEMPLATE
    return fast


def hf_video_text(grid, metadata) -> str:
    """HF's Qwen3-VL text for one video: the chat template's start/end around ``replace_video_token``'s frames."""
    from transformers import Qwen3VLProcessor

    self = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                           vision_end_token="<|vision_end|>")
    self._calculate_timestamps = lambda *a, **k: Qwen3VLProcessor._calculate_timestamps(self, *a, **k)
    frames = Qwen3VLProcessor.replace_video_token(self, {"video_grid_thw": grid[None],
                                                         "video_metadata": [metadata]}, 0)
    return f"<|vision_start|>{frames}<|vision_end|>"


def test_timestamps_equal_qwen3_vl_processor():
    from transformers import Qwen3VLProcessor

    for indices, fps in (([0, 2, 5, 7], 5.0), ([0, 3, 6], 2.0), ([4], 24.0)):
        assert patch_seconds(indices, fps, 2) == pytest.approx(Qwen3VLProcessor._calculate_timestamps(
            None, list(indices), fps, 2))


def test_qwen3_frame_size_is_hf_smart_resize():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    proc = Qwen3VLVideoProcessorPil(VIDEO_CONFIG)
    size = VIDEO_CONFIG["size"]
    for t, h, w in ((4, 32, 48), (8, 64, 96), (2, 20, 200)):
        assert proc.frame_size(h, w, t, size) == smart_resize(t, h, w, factor=8, temporal_factor=2,
                                                              min_pixels=size["shortest_edge"],
                                                              max_pixels=size["longest_edge"])
    assert proc.frame_size(32, 48, 1, size) == proc.frame_size(32, 48, 2, size)  # one frame: one temporal patch
    assert qwen3_vl_frame_size is Qwen3VLVideoProcessorPil.frame_size


@pytest.mark.parametrize("newline_runs", [False, True])
def test_gemma3_images_are_framed_as_its_processor_does(tmp_path, newline_runs):
    """Gemma3Processor's ids for a text with images (blank lines, start/end of image around the image's tokens)
    equal the collated sample's; with a tokenizer that merges newline runs, the newline before or after an image
    (Gemma's chat layout, ``"user\n<image>"``) merges with its blank line as in HF's ids."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    model = lmm.MultimodalModel.from_pretrained(save_composite("gemma3", tmp_path / "gemma3"))
    tok = tokenizer(gemma=True, newline_runs=newline_runs)
    images = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    hf = Gemma3Processor(image_processor=images, tokenizer=tok,
                         image_seq_length=model.composite.config.mm_tokens_per_image)
    rng = np.random.default_rng(0)
    pics = [(rng.random((16, 16, 3)) * 255).astype(np.uint8) for _ in range(2)]
    text = "what is\n{} this{}\n\nthat" if newline_runs else "what is {} this {} that"
    expected = hf(text=[text.format("<start_of_image>", "<start_of_image>")], images=[pics])["input_ids"][0]
    ours = MultimodalProcessor(model, tok, {"vision": images}, markers={"vision": "<image>"})
    sample = ours(text.format("<image>", "<image>"), vision=pics)
    batch = MultimodalCollator(model)([sample])
    assert batch["input_ids"][0].tolist() == list(expected)
    if newline_runs:  # the merges happened: "\n" + blank line is one token, blank line + "\n\n" another
        assert tok.convert_tokens_to_ids("\n\n\n") in expected and tok.convert_tokens_to_ids("\n" * 4) in expected
    assert metadata_of(sample, model).text_tokens == int((batch["input_ids"][0] != IMG).sum())
    assert item_text(model, tok, "vision").before == (VSTART,)


def test_qwen2_audio_clips_are_framed_as_its_chat_template_does(tmp_path):
    """Qwen2-Audio's chat template writes ``<|audio_bos|><|AUDIO|><|audio_eos|>`` for a clip, and its processor
    repeats the audio token: the clip's expansion here."""
    from transformers import Qwen2AudioProcessor

    model = lmm.MultimodalModel.from_pretrained(save_composite("qwen2_audio", tmp_path / "audio"))
    tok = tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]})
    template = Qwen2AudioProcessor.default_chat_template.fget(None)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio", "audio_url": "a.wav"},
                                                                  {"type": "text", "text": "what"}]}],
                                   chat_template=template, tokenize=False)
    clip = text[text.index("<|audio_bos|>"):text.index("<|audio_eos|>") + len("<|audio_eos|>")]
    expected = tok(clip.replace("<|AUDIO|>", "<|AUDIO|>" * 3), add_special_tokens=False)["input_ids"]
    audio = tok.convert_tokens_to_ids("<|AUDIO|>")
    rule = item_text(model, tok, "audio")
    assert rule.ids(audio, 3) == expected and expected.count(audio) == 3 and len(expected) == 5


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def qwen3(tmp_path_factory, request):
    """A tiny Qwen3-VL (or Qwen3.5, whose processor is Qwen3-VL's) folder, its processor folder (tokenizer, image
    processor, video processor config) and a conversation with an image and a video; and the kind."""
    from PIL import Image

    from tests.test_video_data import write_video

    root = tmp_path_factory.mktemp("qwen3_item_text")
    folder = save_composite(request.param, root / "model")
    proc_dir = root / "processor"
    tokenizer().save_pretrained(proc_dir)
    Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                          max_pixels=16 * 16).save_pretrained(proc_dir)
    (proc_dir / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    media = root / "data" / "media"
    media.mkdir(parents=True)
    Image.fromarray((np.random.default_rng(1).random((16, 16, 3)) * 255).astype(np.uint8)).save(media / "a.png")
    write_video(media / "clip.mp4")
    records = [{"image": "a.png", "video": "clip.mp4",
                "conversations": conv("<image> and <video> what is this", "a red square")}]
    return folder, proc_dir, write_data(root / "data", records), media, request.param


def test_qwen3_vl_conversation_with_a_video_equals_hf(qwen3, tmp_path):
    """The decoded video's frames laid out one temporal patch at a time after their timestamps, the image between
    vision start/end: the ids HF's processor would write; metadata counts them without decoding; the model's loss
    and logits on the batch equal HF's."""
    folder, proc_dir, data, media, kind = qwen3
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    dm = ConversationDataModule(str(data), str(media), str(proc_dir), model=model, batch_size=1, shuffle=False,
                                cache_dir=str(tmp_path / "cache"), video={"fps": 2})
    dm.setup("fit")
    ds = dm.train_dataset
    sample = ds[0]
    batch = dm.collator()([sample])
    ids = batch["input_ids"][0].tolist()

    video = dm.processor.processors["video"].read(media / "clip.mp4")
    assert video.metadata.frames_indices.tolist() == [0, 2, 5, 7]
    grid = sample["video"]["video_grid_thw"][0]
    assert grid.tolist() == [2, 8, 12]  # 32 x 48 frames, patch 4, two temporal patches
    tok = dm.processor.tokenizer
    image_tokens = int(sample["vision"]["image_grid_thw"][0].prod()) // 4
    text = tok.apply_chat_template([{"role": "user", "content": "<image> and <video> what is this"},
                                    {"role": "assistant", "content": "a red square"}], tokenize=False)
    text = text.replace("<image>", "<|vision_start|>" + " <|image_pad|> " * image_tokens + "<|vision_end|>")
    text = text.replace("<video>", hf_video_text(grid, video.metadata).replace("<|video_pad|>", " <|video_pad|> "))
    expected = tok(text, add_special_tokens=False)["input_ids"]
    assert "<0.2" in text and "<1.2" in text  # frames 0 and 2, then 5 and 7, at 5 fps
    assert ids == expected

    meta = ds.sample_metadata(0)
    assert meta == metadata_of(sample, model)
    assert meta.llm_tokens == len(ids)

    hf = load_hf(kind, folder).train()
    hf_inputs = {**batch["vision"], **batch["video"], "input_ids": batch["input_ids"],
                 "attention_mask": batch["attention_mask"], "labels": batch["labels"],
                 "mm_token_type_ids": (batch["input_ids"] == IMG).int() + 2 * (batch["input_ids"] == VID).int()}
    assert_like_hf(model, hf, model.composite.spec, batch, hf_inputs, logits_atol=1e-5)


def test_item_ids_that_disagree_with_the_encoder_are_named(qwen3):
    folder, proc_dir, *_ = qwen3
    model = lmm.MultimodalModel.from_pretrained(folder)
    proc = MultimodalProcessor(model, tokenizer(), {"video": VideoProcessor(Qwen3VLVideoProcessorPil(VIDEO_CONFIG))},
                               markers={"video": "<video>"})
    frames = (np.random.default_rng(0).random((4, 32, 48, 3)) * 255).astype(np.uint8)
    sample = proc("<video> what is this", video=[frames])
    assert [len(x) for x in sample["item_ids"]["video"]] == [1 + 2 * (2 + 1 + 24 + 1) + 1]  # unknown rate: 24 fps
    sample["item_ids"]["video"] = [sample["item_ids"]["video"][0][:-3]]
    with pytest.raises(ValueError, match="item_ids hold \\[47\\] placeholder tokens per item but the encoder emits "
                                         "\\[48\\]"):
        MultimodalCollator(model)([sample])
