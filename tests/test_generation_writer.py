"""``GenerationWriter`` and ``ConversationDataModule``'s predict prompts: ``trainer.predict`` with ``generation=``
writes each prompt's answer as a JSON line whose text is the tokenizer's decoding of one-process ``generate``, in one
process and under ``lightning-mm predict`` on 3 CPU ranks (vision pp 1 + LLM pp 2) from a checkpoint."""

import json
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_mm as lmm
from lightning_mm.trainer.callbacks import GenerationWriter
from lightning_mm.data import ConversationDataModule
from lightning_mm.model import tiny_encoder, tiny_language_model
from tests.helpers.launch import run_cli
from tests.test_conversation_data import BASIC, VOCAB, conv, ids, make_processor, write_data

TIMEOUT = 540  # s: three ranks on a loaded 2-core machine
# the BASIC conversations (one image; two images and two turns; text only) and a question without an answer
PROMPTS = BASIC + [{"id": "open", "image": "blue.png", "conversations": conv("<image> what is this")}]


def _model(seed: int = 0):
    torch.manual_seed(seed)
    lm = tiny_language_model("llama", vocab_size=len(VOCAB), pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")}, lm)


def _reference(model, dm, generation: dict) -> list[list[int]]:
    """One-process ``generate`` over the data module's predict batches, rows as they come."""
    rows = []
    for batch in dm.predict_dataloader():
        rows += model.eval().generate(**batch, **generation).tolist()
    return rows


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predict_prompts_are_the_conversation_up_to_its_last_answer(tmp_path):
    proc = make_processor(tmp_path / "processor")
    data = write_data(tmp_path / "data", PROMPTS, name="prompts.json")
    dm = ConversationDataModule(str(tmp_path / "data" / "train.json"), str(data.parent / "media"), str(proc),
                                predict_data_path=str(data), model=_model(), cache_dir=str(tmp_path / "cache"))
    dm.setup("predict")
    img = dm.model.placeholder_ids["vision"]
    samples = [dm.predict_dataset[i]["input_ids"].tolist() for i in range(len(PROMPTS))]
    assert samples[0] == ids("<s>", "<|user|>") + [img] + ids("what", "is", "this", "<|assistant|>")
    q1 = ids("<s>", "<|user|>") + [img] + ids("and") + [img] + ids("what", "is", "this", "<|assistant|>")
    a1 = ids("a", "red", "square", "and", "a", "blue", "circle", "</s>")
    assert samples[1] == q1 + a1 + ids("<|user|>", "say", "more", "<|assistant|>")  # the last answer dropped
    assert samples[2] == ids("<s>", "<|user|>", "hello", "<|assistant|>")
    assert samples[3] == samples[0]  # no answer to drop


def test_writer_writes_the_decoded_generate_of_each_prompt(tmp_path):
    """One process: each line's text is ``batch_decode(generate(...), skip_special_tokens=True)`` of its prompt, its
    token ids stop at the end-of-sequence token (a row that ends early loses its padding), indices are the samples'
    positions; the tokenizer comes from the data module or from a folder."""
    proc = make_processor(tmp_path / "processor")
    data = write_data(tmp_path / "data", PROMPTS, name="prompts.json")
    model = _model(seed=5)  # the third prompt's answer ends with </s> after 3 tokens, the others run all 8
    dm = ConversationDataModule(str(data), str(data.parent / "media"), str(proc), predict_data_path=str(data),
                                batch_size=3, model=model, cache_dir=str(tmp_path / "cache"))
    dm.setup("predict")
    generation = {"max_new_tokens": 8, "do_sample": False}
    expected = _reference(model, dm, generation)
    eos = VOCAB["</s>"]
    assert expected[2][2:] == [eos] + [VOCAB["<pad>"]] * 5 and all(len(row) == 8 for row in expected)
    texts = dm.processor.tokenizer.batch_decode(expected, skip_special_tokens=True)

    writers = [GenerationWriter(tmp_path / "out" / "generated.jsonl"),
               GenerationWriter(tmp_path / "out" / "from_folder.jsonl", tokenizer=str(proc))]
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=writers)
    out = trainer.predict(lmm.MultimodalLightningModule(model, generation=generation), datamodule=dm)
    assert len(out) == 2  # batches of 3 and 1
    for name in ("generated.jsonl", "from_folder.jsonl"):
        lines = _lines(tmp_path / "out" / name)
        assert [line["index"] for line in lines] == list(range(len(PROMPTS)))
        assert [line["text"] for line in lines] == texts and all(texts)
        assert [line["token_ids"] for line in lines] == [expected[0], expected[1], expected[2][:3], expected[3]]


YAML = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: {devices}
  strategy: {strategy}
  max_steps: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_mm.callbacks.GenerationWriter
      init_args: {{path: out/generated.jsonl}}
model:
  class_path: lightning_mm.MultimodalLightningModule
  init_args:
    lr: 0.01
    generation: {{max_new_tokens: 16, do_sample: false}}
    model:
      class_path: lightning_mm.MultimodalModel
      init_args:
        encoders:
          vision:
            class_path: lightning_mm.ModalityEncoder
            init_args:
              projector: mlp
              encoder:
                class_path: transformers.SiglipVisionModel
                init_args:
                  config:
                    class_path: transformers.SiglipVisionConfig
                    init_args: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
                                image_size: 32, patch_size: 8}}
        language_model:
          class_path: transformers.LlamaForCausalLM
          init_args:
            config:
              class_path: transformers.LlamaConfig
              init_args: {{vocab_size: {vocab}, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4,
                          num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256,
                          pad_token_id: 0, bos_token_id: 2, eos_token_id: 3}}
data:
  class_path: lightning_mm.data.ConversationDataModule
  init_args:
    data_path: {train}
    predict_data_path: {data}
    media_root: {media}
    processor: {processor}
    batch_size: 2
    shuffle: false
    cache_dir: {cache}
"""
PIPELINE = """
    class_path: lightning_mm.MultimodalParallelStrategy
    init_args:
      encoders:
        vision: {class_path: lightning_mm.ParallelSpec, init_args: {pp: 1}}
      language_model: {class_path: lightning_mm.ParallelSpec, init_args: {pp: 2}}"""


def _predict(config: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``lightning-mm predict --config <config> ...`` as a user runs it."""
    return run_cli("predict", config, *args, cwd=cwd, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.combines("generation", "checkpoint", "pipeline")  # saved by one process, decoded over 2 LLM stages
def test_lightning_mm_predict_writes_the_text_under_vision_pp1_llm_pp2(tmp_path):
    """A one-step fit in one process writes the checkpoint; ``lightning-mm predict --config x.yaml --ckpt_path`` on
    3 ranks (vision pp 1 + LLM pp 2) writes one line per prompt whose token ids are one-process ``generate``'s of
    the checkpoint's model, and whose text is their decoding."""
    from lightning_mm.checkpoint import load_weights
    from lightning_mm.trainer.cli import load_fit_config

    proc = make_processor(tmp_path / "processor")
    train = write_data(tmp_path / "data", BASIC)
    data = write_data(tmp_path / "data", PROMPTS, name="prompts.json")
    fields = dict(vocab=len(VOCAB), train=train, data=data, media=data.parent / "media", processor=proc, cache=tmp_path / "cache")
    fit_yaml, predict_yaml = tmp_path / "fit.yaml", tmp_path / "predict.yaml"
    fit_yaml.write_text(YAML.format(devices=1, strategy="multimodal", **fields))
    predict_yaml.write_text(YAML.format(devices=3, strategy=PIPELINE, **fields))

    module, dm, trainer = load_fit_config([str(fit_yaml)])
    trainer.fit(module, dm)
    ckpt = tmp_path / "ckpt"
    trainer.save_checkpoint(str(ckpt))

    module, _, _ = load_fit_config([str(fit_yaml)], ["--trainer.callbacks=[]"])
    model = module.model
    load_weights(str(ckpt), model)
    ref = ConversationDataModule(str(data), str(data.parent / "media"), str(proc), predict_data_path=str(data),
                                 batch_size=2, model=model, cache_dir=str(tmp_path / "cache"))
    expected = _reference(model, ref, {"max_new_tokens": 16, "do_sample": False})
    texts = ref.processor.tokenizer.batch_decode(expected, skip_special_tokens=True)
    untrained, _, _ = load_fit_config([str(fit_yaml)], ["--trainer.callbacks=[]"])
    assert _reference(untrained.model, ref, {"max_new_tokens": 16, "do_sample": False}) != expected  # the step counts

    run = _predict(predict_yaml, tmp_path, f"--ckpt_path={ckpt}")
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    lines = _lines(tmp_path / "out" / "generated.jsonl")
    assert [line["index"] for line in lines] == list(range(len(PROMPTS)))
    for line, row, text in zip(lines, expected, texts):
        n = row.index(3) + 1 if 3 in row else len(row)
        assert line["token_ids"] == row[:n] and line["text"] == text, (line, row)
    assert not list((tmp_path / "out").glob("*.rank*"))  # one replica: one file
