"""LLaVA-format conversation data: chat template, assistant-only labels, media, truncation, packing, bad records,
data-parallel shards, resume, and a tiny model's loss on the batches."""

import json
import runpy
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (CLIPImageProcessor, PreTrainedTokenizerFast, Qwen2VLImageProcessor, SiglipImageProcessor,
                          WhisperFeatureExtractor)

soundfile = pytest.importorskip("soundfile")

import lightning_mm as lmm
from lightning_mm.data import BadRecordError, ConversationDataModule
from lightning_mm.loss import IGNORE_INDEX
from lightning_mm.model import tiny_encoder, tiny_language_model

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = ["what", "is", "this", "a", "red", "blue", "square", "circle", "and", "then", "say", "more", "sound",
         "hello", "be", "brief", "no", "picture", "here"]
VOCAB = {w: i for i, w in enumerate(SPECIAL + WORDS)}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
            "{% if m['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
IMAGE_TOKENS = 16  # tiny SigLIP: 32x32 pixels, 8x8 patches
AUDIO_TOKENS = 50  # tiny Whisper with max_source_positions=50 (100 mel frames = 1 s at 16 kHz)


def ids(*words):
    return [VOCAB[w] for w in words]


def make_processor(folder: Path, audio: bool = False) -> Path:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    images = SiglipImageProcessor(size={"height": 32, "width": 32})
    if audio:  # two preprocessor configs: one subfolder per encoder name
        images.save_pretrained(folder / "vision")
        WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(folder / "audio")
    else:
        images.save_pretrained(folder)
    return folder


def make_model(audio: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    encoders = {"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")}
    if audio:
        encoders["audio"] = lmm.ModalityEncoder(tiny_encoder("whisper", max_source_positions=50), projector="linear")
    return lmm.MultimodalModel(encoders, tiny_language_model("llama", vocab_size=64))


def conv(*turns):
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": v} for i, v in enumerate(turns)]


def write_data(root: Path, records: list[dict], name: str = "train.json", jsonl: bool = False) -> Path:
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    for colour, fname in (((255, 0, 0), "red.png"), ((0, 0, 255), "blue.png")):
        Image.new("RGB", (40, 48), colour).save(media / fname)
    t = np.arange(16000) / 16000
    soundfile.write(media / "tone.wav", (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
    soundfile.write(media / "tone8k.wav", np.zeros(8000, dtype=np.float32), 8000)
    path = root / name
    with open(path, "w") as f:
        if jsonl:
            f.write("\n".join(json.dumps(r) for r in records) + "\n")
        else:
            json.dump(records, f)
    return path


BASIC = [
    {"id": "one", "image": "red.png", "conversations": conv("<image> what is this", "a red square")},
    {"id": "two", "image": ["red.png", "blue.png"],
     "conversations": conv("<image> and <image> what is this", "a red square and a blue circle", "say more",
                           "no more")},
    {"id": "text", "conversations": conv("hello", "hello")},
]


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory):
    return make_processor(tmp_path_factory.mktemp("processor"))


def datamodule(tmp_path, records, proc_dir, model=None, jsonl=False, **kw):
    root = tmp_path / f"data{len(list(tmp_path.glob('data*')))}"  # a fresh file per call
    path = write_data(root, records, jsonl=jsonl)
    kw.setdefault("shuffle", False)
    kw.setdefault("batch_size", len(records))
    dm = ConversationDataModule(str(path), str(root / "media"), str(proc_dir), model=model or make_model(),
                                cache_dir=str(tmp_path / "cache"), **kw)
    dm.setup("fit")
    return dm


def test_assistant_only_labels_multi_image_multi_turn_and_text_only(tmp_path, proc_dir):
    dm = datamodule(tmp_path, BASIC, proc_dir, jsonl=True)
    ds, model = dm.train_dataset, dm.model
    img = model.placeholder_ids["vision"]
    s = ds[0]
    prompt = ids("<s>", "<|user|>")[:2] + [img] + ids("what", "is", "this", "<|assistant|>")
    answer = ids("a", "red", "square", "</s>")
    assert s["input_ids"].tolist() == prompt + answer
    assert s["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + answer
    assert s["vision"]["pixel_values"].shape == (1, 3, 32, 32)
    s = ds[1]  # two images, two turns: both answers supervised, the second question not
    q1 = ids("<s>", "<|user|>") + [img] + ids("and") + [img] + ids("what", "is", "this", "<|assistant|>")
    a1 = ids("a", "red", "square", "and", "a", "blue", "circle", "</s>")
    q2, a2 = ids("<|user|>", "say", "more", "<|assistant|>"), ids("no", "more", "</s>")
    assert s["input_ids"].tolist() == q1 + a1 + q2 + a2
    assert s["labels"].tolist() == [IGNORE_INDEX] * len(q1) + a1 + [IGNORE_INDEX] * len(q2) + a2
    assert s["vision"]["pixel_values"].shape == (2, 3, 32, 32)
    assert s["vision"]["pixel_values"][0, 0].mean() > s["vision"]["pixel_values"][1, 0].mean()  # red, then blue
    assert "vision" not in ds[2]

    batch = next(iter(dm.train_dataloader()))  # the three records, text-only mixed in, padded
    lengths = [len(prompt) + len(answer) + IMAGE_TOKENS - 1, len(q1 + a1 + q2 + a2) + 2 * (IMAGE_TOKENS - 1), 6]
    assert lengths == [26, 54, 6]
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["vision"]["pixel_values"].shape == (3, 3, 32, 32)
    assert batch["item_counts"]["vision"].tolist() == [1, 2, 0]
    is_img = batch["input_ids"] == img
    assert is_img.sum(1).tolist() == [IMAGE_TOKENS, 2 * IMAGE_TOKENS, 0]
    assert (batch["labels"][is_img] == IGNORE_INDEX).all()  # image tokens never supervised
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    row0 = batch["labels"][0, : lengths[0]].tolist()
    assert row0 == [IGNORE_INDEX] * (len(prompt) + IMAGE_TOKENS - 1) + answer  # exact positions after expansion
    assert (batch["input_ids"][2, 6:] == VOCAB["<pad>"]).all()
    assert batch["labels"][2, :6].tolist() == [IGNORE_INDEX] * 4 + ids("hello", "</s>")
    lmm.data.validate.validate_batch(batch, model)


def test_train_on_prompt_and_system_prompt(tmp_path, proc_dir):
    dm = datamodule(tmp_path, BASIC[:1], proc_dir, train_on_prompt=True, system_prompt="be brief")
    s = dm.train_dataset[0]
    img = dm.model.placeholder_ids["vision"]
    expected = ids("<s>", "<|system|>", "be", "brief", "<|user|>") + [img] + \
        ids("what", "is", "this", "<|assistant|>", "a", "red", "square", "</s>")
    assert s["input_ids"].tolist() == expected
    assert s["labels"].tolist() == [IGNORE_INDEX if t == img else t for t in expected]


def test_text_only_sample_labels(tmp_path, proc_dir):
    dm = datamodule(tmp_path, BASIC[2:], proc_dir)
    s = dm.train_dataset[0]
    assert s["input_ids"].tolist() == ids("<s>", "<|user|>", "hello", "<|assistant|>", "hello", "</s>")
    assert s["labels"].tolist() == [IGNORE_INDEX] * 4 + ids("hello", "</s>")


def test_audio_records_and_resampling(tmp_path):
    proc = make_processor(tmp_path / "proc", audio=True)
    records = [{"image": "red.png", "audio": "tone.wav",
                "conversations": conv("<image> <audio> what is this", "a red square and a sound")},
               {"audio": "tone8k.wav", "conversations": conv("<audio>", "no sound")}]
    dm = datamodule(tmp_path, records, proc, model=make_model(audio=True))
    aud = dm.model.placeholder_ids["audio"]
    s0, s1 = dm.train_dataset[0], dm.train_dataset[1]
    assert s0["audio"]["input_features"].shape == (1, 16, 100)
    assert s1["audio"]["input_features"].shape == (1, 16, 100)  # 8 kHz file resampled to 16 kHz
    assert s1["input_ids"].tolist() == ids("<s>", "<|user|>") + [aud] + ids("<|assistant|>", "no", "sound", "</s>")
    batch = next(iter(dm.train_dataloader()))
    assert (batch["input_ids"] == aud).sum(1).tolist() == [AUDIO_TOKENS, AUDIO_TOKENS]
    assert torch.isfinite(dm.model(**batch).loss)


def test_truncation_drops_whole_trailing_turns(tmp_path, proc_dir):
    two_turns = BASIC[1]  # q1 (2 images) + a1 = 17 + 2*15 = 47 tokens expanded; + q2 + a2 = 54
    dm = datamodule(tmp_path, [two_turns], proc_dir, max_length=53)
    s = dm.train_dataset[0]
    assert s["input_ids"].tolist()[-1] == VOCAB["</s>"] and len(s["input_ids"]) == 17  # the second turn dropped
    assert s["vision"]["pixel_values"].shape[0] == 2
    batch = dm.collator()([s])
    assert batch["input_ids"].shape[1] == 47 and (batch["input_ids"] == dm.model.placeholder_ids["vision"]).sum() == 32
    dm = datamodule(tmp_path, [two_turns], proc_dir, max_length=54)
    assert len(dm.train_dataset[0]["input_ids"]) == 24  # fits whole
    # an image in the dropped turn goes with it
    rec = {"image": ["red.png", "blue.png"], "conversations": conv("<image> what is this", "a red square",
                                                                   "<image> and this", "a blue circle")}
    dm = datamodule(tmp_path, [rec], proc_dir, max_length=30)
    s = dm.train_dataset[0]
    assert s["vision"]["pixel_values"].shape[0] == 1
    assert (s["input_ids"] == dm.model.placeholder_ids["vision"]).sum() == 1
    # the first turn alone too long: a bad record, never a cut image
    dm = datamodule(tmp_path, [two_turns], proc_dir, max_length=40)
    with pytest.raises(BadRecordError, match=r"record 0 of .*train.json: its first turn alone is 47 tokens.*=40"):
        dm.train_dataset[0]


def test_packing_segment_ids(tmp_path, proc_dir):
    dm = datamodule(tmp_path, BASIC, proc_dir, max_length=64, pack=True)
    batch = next(iter(dm.train_dataloader()))
    lengths = [26, 54, 6]  # expanded: one image + 10 text; two images + 22 text; text only
    assert batch["input_ids"].shape == (2, 64)  # first fit: [26, 6] and [59]
    seg = batch["segment_ids"]
    assert seg.dtype == torch.int16  # masks.segment_dtype: what CP planning reads per token
    assert seg[0, :26].eq(0).all() and seg[0, 26:32].eq(1).all() and seg[0, 32:].eq(2).all()
    assert seg[1, :54].eq(0).all() and seg[1, 54:].eq(1).all()
    assert batch["position_ids"][0, 26:32].tolist() == list(range(6))
    assert batch["labels"][0, 26] == IGNORE_INDEX  # a segment's first token is never a target
    assert batch["attention_mask"].sum().item() == sum(lengths)
    assert torch.isfinite(dm.model(**batch).loss)


@pytest.mark.parametrize("record,match", [
    ({"image": "missing.png", "conversations": conv("<image> what", "a")},
     r"record 1 of .*train.json: media file .*missing.png not found"),
    ({"image": "red.png", "conversations": conv("<image> <image> what", "a")},
     r"record 1 of .*train.json: 2 <image> marker\(s\) .* but 1 image file"),
    ({"conversations": []}, r"record 1 of .*train.json: empty conversation"),
    ({"conversations": conv("what")}, r"record 1 of .*train.json: empty conversation \(no assistant turn"),
    ({"conversations": [{"from": "robot", "value": "a"}]}, r"record 1 of .*train.json: turn 0 has role 'robot'"),
])
def test_bad_records_raise_naming_record_and_file(tmp_path, proc_dir, record, match):
    with pytest.raises(BadRecordError, match=match):
        datamodule(tmp_path, [BASIC[0], record, BASIC[2]], proc_dir)


def _cut_inside_record(text: str, records: list[dict], k: int, jsonl: bool) -> str:
    """``text`` cut in the middle of record ``k`` (found by its own serialisation, not by the parser under test)."""
    start = text.index(json.dumps(records[k]) if jsonl else json.dumps(records[k])[:20])
    return text[:start + len(json.dumps(records[k])) // 2]


@pytest.mark.parametrize("jsonl", [False, True], ids=["json", "jsonl"])
def test_a_file_cut_short_names_the_file_the_record_and_the_line(tmp_path, proc_dir, jsonl):
    """A data file cut inside its record 2: datasets' own error names neither the file nor the record; the data
    module's names both, the line, and the fix."""
    from lightning_mm.data import DataFileError

    records = [BASIC[0], BASIC[1], BASIC[2], BASIC[0]]
    path = write_data(tmp_path, records, name="cut.jsonl" if jsonl else "cut.json", jsonl=jsonl)
    if not jsonl:  # one record per line, so the record's line is its index + 1 as in JSON lines
        path.write_text("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")
    text = path.read_text()
    path.write_text(_cut_inside_record(text, records, 2, jsonl))
    line = 3 if jsonl else 4  # JSON lines: record 2 on line 3; the list: "[" first, then one record a line
    dm = ConversationDataModule(str(path), str(tmp_path / "media"), str(proc_dir), model=make_model(),
                                cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataFileError) as caught:
        dm.prepare_data()
    message = str(caught.value)
    assert message.startswith(f"data file {path}: ") and caught.value.path == path
    assert "record 2" in message and f"line {line}" in message and "the file ends inside it" in message, message
    assert "write or copy it again" in message


def test_a_malformed_record_mid_file_is_named_and_a_missing_file_too(tmp_path, proc_dir):
    from lightning_mm.data import DataFileError

    path = write_data(tmp_path, BASIC, name="bad.jsonl", jsonl=True)
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"conversations":', '"conversations"')  # record 1: a key without its colon
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFileError, match=r"data file .*bad.jsonl: line 2 \(record 1\) is not valid JSON: "
                                            r"Expecting ':' delimiter at column \d+; correct or remove that record"):
        ConversationDataModule(str(path), str(tmp_path / "media"), str(proc_dir), model=make_model(),
                               cache_dir=str(tmp_path / "cache")).setup("fit")
    with pytest.raises(FileNotFoundError, match=r"data file .*nothing.json: no such file"):
        ConversationDataModule(str(tmp_path / "nothing.json"), None, str(proc_dir), model=make_model()).prepare_data()


def test_bad_records_skipped_and_counted(tmp_path, proc_dir):
    bad = [{"image": "missing.png", "conversations": conv("<image> what", "a")},
           {"image": "red.png", "conversations": conv("<image> <image> what", "a")},
           {"conversations": []}]
    (tmp_path / "broken.png").write_bytes(b"not a png")  # an absolute path; found bad only when loaded
    broken = {"image": str(tmp_path / "broken.png"), "conversations": conv("<image> what", "a")}
    with pytest.warns(UserWarning, match="skipped 3 bad record"):
        dm = datamodule(tmp_path, [BASIC[0], *bad, broken, BASIC[2]], proc_dir, on_bad_record="skip", batch_size=3)
    ds = dm.train_dataset
    assert ds.indices.tolist() == [0, 4, 5] and dm.num_bad_records == 3
    assert [i for i, _ in ds.bad_records] == [1, 2, 3]
    batch = next(iter(dm.train_dataloader()))  # the broken image is replaced by the next good record
    assert batch["input_ids"].shape[0] == 3 and dm.num_bad_records == 4
    assert ds.bad_records[-1][0] == 4 and "cannot read image file" in ds.bad_records[-1][1]
    with pytest.raises(BadRecordError, match=r"record 1 of .*train.json: cannot read image file .*broken.png"):
        datamodule(tmp_path, [BASIC[0], broken], proc_dir, on_bad_record="raise", scan=False).train_dataset[1]


def test_variable_resolution_images_from_a_processor_subfolder(tmp_path):
    proc = make_processor(tmp_path / "proc")
    Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                          max_pixels=32 * 32).save_pretrained(tmp_path / "proc" / "vision")  # the subfolder wins
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("qwen2_vl"))},
                                tiny_language_model("llama", vocab_size=64))
    dm = datamodule(tmp_path, BASIC, proc, model=model)
    batch = next(iter(dm.train_dataloader()))
    assert batch["vision"]["image_grid_thw"].tolist() == [[1, 8, 6]] * 3  # 40x48 pixels in 4x4 patches
    assert (batch["input_ids"] == model.placeholder_ids["vision"]).sum(1).tolist() == [12, 24, 0]  # 8*6/2^2 each
    assert torch.isfinite(model(**batch).loss)


def test_media_for_a_modality_the_model_lacks_is_a_bad_record(tmp_path, proc_dir):
    records = [BASIC[2], {"audio": "tone.wav", "conversations": conv("<audio>", "a sound")}]
    with pytest.raises(BadRecordError, match=r"record 1 of .*: it has audio files but the model has no encoder"):
        datamodule(tmp_path, records, proc_dir)


def test_chat_template_errors(tmp_path):
    proc = make_processor(tmp_path / "proc")
    tok = PreTrainedTokenizerFast.from_pretrained(proc)
    tok.chat_template = "{% for m in messages | reverse %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(proc)  # earlier turns move when a turn is added: assistant turns cannot be located
    with pytest.raises(ValueError, match="record 0 of .*: the chat template does not render a conversation's prefix"):
        datamodule(tmp_path, BASIC[2:], proc).train_dataset[0]
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                         "{% endif %}{{ m['content'] }} {% endfor %}")
    tok.save_pretrained(proc)
    with pytest.raises(BadRecordError, match="record 0 of .*: the chat template failed on it .*no system"):
        datamodule(tmp_path, BASIC[2:], proc, system_prompt="be brief").train_dataset[0]


def test_missing_marker_prepends_images_llava_style(tmp_path, proc_dir):
    rec = {"image": "red.png", "conversations": conv("what is this", "a red square")}
    s = datamodule(tmp_path, [rec], proc_dir).train_dataset[0]
    assert s["input_ids"].tolist()[2] == make_model().placeholder_ids["vision"]


def test_data_parallel_shards_are_disjoint(tmp_path, proc_dir):
    records = [BASIC[i % 3] for i in range(20)]
    dm = datamodule(tmp_path, records, proc_dir, shuffle=True, batch_size=2)
    shards = []
    for rank in range(4):
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": rank})
        loader = dm.train_dataloader()
        shards.append(list(loader.sampler))
        assert len(loader) == 2  # 5 records per replica, batches of 2, the rest dropped
    assert all(len(s) == 5 for s in shards)
    assert sorted(i for s in shards for i in s) == list(range(20))  # disjoint and complete
    dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 1})
    assert list(dm.train_dataloader().sampler) == shards[1]  # every rank of a replica sees the same shard


def test_loader_resumes_where_it_stopped(tmp_path, proc_dir):
    records = [BASIC[i % 3] for i in range(12)]
    dm = datamodule(tmp_path, records, proc_dir, shuffle=True, batch_size=2, seed=3)

    def epoch(loader, e, stop=None, state=None):
        loader.sampler.set_epoch(e)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for b in loader:
            out.append(b["input_ids"])
            if stop is not None and len(out) == stop:
                return out, loader.state_dict()
        return out, loader.state_dict()

    full, _ = epoch(dm.train_dataloader(), 1)
    first, state = epoch(dm.train_dataloader(), 1, stop=2)
    assert state == {"batches": 2}
    rest, end = epoch(dm.train_dataloader(), 1, state=state)
    assert len(full) == 6 and len(rest) == 4 and end == {"batches": 6}
    assert all(torch.equal(a, b) for a, b in zip(full, first + rest))


class Recorder(pl.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())


def test_fit_resumes_mid_epoch_from_a_checkpoint(tmp_path, proc_dir):
    records = [BASIC[i % 3] for i in range(16)]
    path = write_data(tmp_path, records)

    def fit(steps, ckpt=None):
        rec = Recorder()
        every2 = pl.callbacks.ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=2, save_top_k=-1)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=[rec, every2],
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        dm = ConversationDataModule(str(path), str(tmp_path / "media"), str(proc_dir), batch_size=2, seed=1,
                                    cache_dir=str(tmp_path / "cache"))
        trainer.fit(lmm.MultimodalLightningModule(make_model(), lr=1e-3), datamodule=dm, ckpt_path=ckpt)
        return trainer, rec.seen

    _, whole = fit(5)  # one epoch is 8 batches; checkpoints after steps 2 and 4
    _, rest = fit(5, str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert len(whole) == 5 and len(rest) == 3
    assert all(torch.equal(a, b) for a, b in zip(whole[2:], rest))


def test_model_loss_on_a_batch_equals_the_hand_computed_one(tmp_path, proc_dir):
    dm = datamodule(tmp_path, BASIC, proc_dir, causal_modalities=True)
    model = dm.model.eval()
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        loss = model(**batch).loss
        assert torch.isfinite(loss)
        # by hand: features at the placeholders, the plain HF causal LM (LLaVA-style causal image tokens)
        lm = model.language_model
        img = batch["input_ids"] == model.placeholder_ids["vision"]
        vision = model.encoders["vision"]
        feats = vision.projector(vision.module(**batch["vision"]).last_hidden_state.flatten(0, 1))
        embeds = lm.model.embed_tokens(batch["input_ids"].masked_fill(img, 0))
        embeds[img] = feats
        lm.set_attn_implementation("eager")
        ref = lm(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_example_script_and_cli_fit(tmp_path):
    exe = shutil.which("lightning-mm")
    assert exe, "the console script is not installed: pip install -e ."
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "data"
    runpy.run_path(str(root / "examples/make_conversation_data.py"))["main"]([str(out), "--records", "40"])
    assert len(json.loads((out / "train.json").read_text())) == 40
    assert (out / "processor" / "tokenizer.json").is_file() and (out / "images" / "red_circle.png").is_file()
    proc = subprocess.run([exe, "fit", "--config", str(root / "examples/conversation.yaml"), "--trainer.max_steps=4",
                           f"--trainer.default_root_dir={tmp_path}", f"--data.init_args.data_path={out}/train.json",
                           f"--data.init_args.media_root={out}/images", f"--data.init_args.processor={out}/processor",
                           f"--data.init_args.cache_dir={tmp_path}/cache"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_steps=4" in proc.stderr + proc.stdout


# ------------------------------------------------------------------------------------------ metadata without tensors
SIZES = [(13, 200), (300, 40), (64, 64), (7, 9)]  # (width, height)
CLIPS = [(3000, 16000), (40000, 16000), (11025, 22050), (5, 8000)]  # (frames, rate): short, cut, resampled, tiny


def metadata_processor(kind: str, folder: Path):
    """(processor folder, model, extra kwargs of the audio extractor's call) for each processor rule."""
    audio = kind.startswith("audio")
    proc = make_processor(folder, audio=audio)
    torch.manual_seed(0)
    llm = tiny_language_model("llama", vocab_size=64)
    if kind == "qwen2_vl":
        Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                              max_pixels=32 * 32).save_pretrained(proc)
        return proc, lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("qwen2_vl"))}, llm), {}
    if kind in ("clip", "clip_no_crop"):
        crop = {} if kind == "clip" else {"do_center_crop": False}
        CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                           **crop).save_pretrained(proc)
        return proc, lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("clip"))}, llm), {}
    if kind == "siglip":
        return proc, make_model(), {}
    if kind == "audio_whisper":
        return proc, make_model(audio=True), {}
    # Qwen2-Audio: tokens follow the frame-level feature mask, asked for in the call or by the config
    WhisperFeatureExtractor(feature_size=16, chunk_length=1, return_attention_mask=True).save_pretrained(proc / "audio")
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip")),
                                 "audio": lmm.ModalityEncoder(tiny_encoder("qwen2_audio"), projector="linear")}, llm)
    return proc, model, {"return_attention_mask": True} if kind == "audio_qwen2_frame_mask" else {}


@pytest.mark.parametrize("kind", ["siglip", "clip", "clip_no_crop", "qwen2_vl", "audio_whisper",
                                  "audio_qwen2_frame_mask", "audio_qwen2_config_mask"])
def test_sample_metadata_counts_what_the_encoded_sample_holds_without_decoding(tmp_path, kind, monkeypatch):
    from lightning_mm.data import conversation
    from lightning_mm.data.metadata import metadata_of

    proc_dir, model, call = metadata_processor(kind, tmp_path / "proc")
    images = [f"im{w}x{h}.png" for w, h in SIZES]
    clips = [f"a{n}_{r}.wav" for n, r in CLIPS]
    if kind.startswith("audio"):
        records = [{"audio": c, "conversations": conv("<audio> what", "a sound")} for c in clips]
        records.append({"image": "red.png", "audio": clips[:2], "conversations": conv("<image> <audio> <audio>", "a")})
    else:
        one_size = kind == "clip_no_crop"  # its outputs follow the input size: one image size per record
        records = BASIC + [{"image": images[1] if one_size else images,
                            "conversations": conv("<image> what" if one_size else "<image> <image> what", "a",
                                                  "and this" if one_size else "<image> and <image>", "more")}]
    path = write_data(tmp_path / "data", records)
    media = tmp_path / "data" / "media"
    for w, h in SIZES:
        Image.new("RGB", (w, h), (1, 2, 3)).save(media / f"im{w}x{h}.png")
    for n, r in CLIPS:
        soundfile.write(media / f"a{n}_{r}.wav", np.zeros(n, dtype=np.float32), r)
    processor = lmm.data.load_processor(proc_dir, model)
    if call:
        processor.kwargs["audio"].update(call)
    max_length = None
    for _ in range(2):  # whole, then cut at the median length (trailing turns dropped, too long records skipped)
        ds = lmm.data.ConversationDataset(path, processor, media, max_length=max_length, on_bad_record="skip",
                                          cache_dir=str(tmp_path / "cache"))

        def no_decoding(*args):
            raise AssertionError("sample_metadata decoded a media file")

        with monkeypatch.context() as m:
            m.setattr(conversation, "_load_image", no_decoding)
            m.setattr(conversation, "_load_audio", no_decoding)
            metas = [ds.sample_metadata(i) for i in range(len(ds))]
        assert metas == [metadata_of(ds[i], model) for i in range(len(ds))], (kind, max_length)
        assert any(meta.items for meta in metas)
        max_length = sorted(meta.llm_tokens for meta in metas)[len(metas) // 2]


def test_sample_metadata_of_an_unreadable_file_is_a_bad_record(tmp_path, proc_dir, monkeypatch):
    from lightning_mm.data import conversation

    (tmp_path / "broken.png").write_bytes(b"not a png")
    broken = {"image": str(tmp_path / "broken.png"), "conversations": conv("<image> what", "a")}
    dm = datamodule(tmp_path, [BASIC[0], broken, BASIC[2]], proc_dir, scan=False)
    with pytest.raises(BadRecordError, match=r"record 1 of .*train.json: cannot read the image header of .*broken.png"):
        dm.train_dataset.sample_metadata(1)
    dm = datamodule(tmp_path, [BASIC[0], broken, BASIC[2]], proc_dir, on_bad_record="skip")
    ds = dm.train_dataset
    assert ds.sample_metadata(1) == ds.sample_metadata(2) == lmm.data.SampleMeta(6)  # the next good record, as ds[1]
    assert ds[1]["input_ids"].tolist() == ds[2]["input_ids"].tolist()
    first = ds.sample_metadata(0)
    monkeypatch.setattr(conversation, "image_size", lambda file: pytest.fail("read again"))
    assert ds.sample_metadata(0) is first  # cached per record


def test_the_cli_prints_a_cut_data_file_as_one_message(tmp_path, proc_dir, monkeypatch, capsys):
    """``lightning-mm fit`` of examples/conversation.yaml on a data file cut short: the data file's message alone
    (file, record, line, fix), no traceback, exit status 1."""
    from lightning_mm.trainer.cli import main

    path = write_data(tmp_path, BASIC, name="cut.jsonl", jsonl=True)
    path.write_text(_cut_inside_record(path.read_text(), BASIC, 1, jsonl=True))
    monkeypatch.setattr("sys.argv", ["lightning-mm", "fit", "--config", "examples/conversation.yaml",
                                     f"--data.init_args.data_path={path}", f"--data.init_args.processor={proc_dir}",
                                     f"--data.init_args.media_root={tmp_path / 'media'}",
                                     f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                                     f"--trainer.default_root_dir={tmp_path}"])
    with pytest.raises(SystemExit) as caught:
        main()
    err = capsys.readouterr().err
    assert caught.value.code == 1 and "Traceback" not in err, err
    assert (f"lightning-mm fit: error: data file {path}: line 2 (record 1) is not valid JSON: Unterminated string "
            "starting at column") in err, err
    assert "(the file ends inside it); a file cut short" in err


@pytest.mark.parametrize("text, where", [
    ('[{"a": 1}, {"a": 2}]', None),                                     # a valid list
    ('{"a": 1}\n\n{"a": 2}\n', None),                                   # valid JSON lines, a blank line between
    ('{\n  "records": [1, 2]\n}\n', None),                              # one object over several lines
    ('[{"a": 1}, {"a": 2}', "the list ends after record 1 without its closing ']' (the file ends inside it)"),
    ('[{"a": 1},\n {"a": 2,}]', "record 1 (from line 2, column 2) is not valid JSON: Expecting property name "
                                "enclosed in double quotes at line 2, column 10"),
    ('[{"a": 1} {"a": 2}]', "record 0 is not followed by ',' or ']' (line 1, column 11)"),
    ('[{"a": 1}] x', "text after the list's closing ']' (line 1, column 12)"),
    ('{"a": 1}\n{"a": "tw', "line 2 (record 1) is not valid JSON: Unterminated string starting at column 7 "
                            "(the file ends inside it)"),
])
def test_json_error_names_where_a_file_stops_being_json(tmp_path, text, where):
    from lightning_mm.data.records import json_error

    path = tmp_path / "data.json"
    path.write_text(text)
    assert json_error(path) == where
    path.write_bytes(b'[{"a": "\xff"}]')
    assert json_error(path) == "byte 8 is not UTF-8 (invalid start byte)"
