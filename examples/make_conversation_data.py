"""A small local LLaVA-format conversation dataset and its processor folder, for examples/conversation.yaml.

    python examples/make_conversation_data.py conversation_data
    lightning-mm fit --config examples/conversation.yaml

Writes under the output folder:
  images/       coloured shapes drawn with PIL
  train.json    LLaVA-format records: one image, two images, multi-turn, and text-only conversations
  processor/    a word-level tokenizer trained with `tokenizers` (with a chat template) and a SigLIP image
                processor, both saved with save_pretrained (what ConversationDataModule(processor=...) loads)
The model itself is built from configs by the YAML (a tiny SigLIP + Llama); its vocabulary (128) holds the
tokenizer's.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
SHAPES = ("square", "circle", "triangle")
NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# ChatML-style: every turn is "<|im_start|> role ... <|im_end|>"; the answer's <|im_end|> is supervised too.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
LLM_VOCAB = 128  # examples/conversation.yaml: LlamaConfig(vocab_size=128)


def draw(colour: str, shape: str, size: int = 64):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (245, 245, 245))
    d, m, c = ImageDraw.Draw(img), size // 6, COLOURS[colour]
    if shape == "square":
        d.rectangle([m, m, size - m, size - m], fill=c)
    elif shape == "circle":
        d.ellipse([m, m, size - m, size - m], fill=c)
    else:
        d.polygon([(size // 2, m), (size - m, size - m), (m, size - m)], fill=c)
    return img


def records(n: int, rng: random.Random) -> list[dict]:
    out = []
    kinds = ("colour", "shape", "two", "turns", "text")
    for i in range(n):
        kind = kinds[i % len(kinds)]
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        image = f"{colour}_{shape}.png"
        if kind == "colour":
            conv = [("human", "<image>\nwhat colour is the shape ?"), ("gpt", f"it is {colour} .")]
        elif kind == "shape":
            conv = [("human", "what shape is in the picture ?\n<image>"), ("gpt", f"a {shape} .")]
        elif kind == "two":
            colour2, shape2 = rng.choice(list(COLOURS)), rng.choice(SHAPES)
            image = [image, f"{colour2}_{shape2}.png"]
            same = "yes" if colour == colour2 else "no"
            conv = [("human", "<image> and <image>\nare they the same colour ?"),
                    ("gpt", f"{same} , the first is {colour} and the second is {colour2} .")]
        elif kind == "turns":
            conv = [("human", "<image>\nwhat colour is the shape ?"), ("gpt", f"it is {colour} ."),
                    ("human", "and what shape is it ?"), ("gpt", f"a {shape} .")]
        else:
            k = rng.randrange(len(NUMBERS) - 2)
            image = None
            conv = [("human", f"what comes after {NUMBERS[k]} {NUMBERS[k + 1]} ?"), ("gpt", f"{NUMBERS[k + 2]} .")]
        rec = {"id": f"{kind}-{i}", "conversations": [{"from": f, "value": v} for f, v in conv]}
        if image is not None:
            rec["image"] = image
        out.append(rec)
    return out


def make_processor(folder: Path, texts: list[str]) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, SiglipImageProcessor

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts + ["user assistant system"], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)  # the tiny SigLIP's 32x32
    return len(fast)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="conversation_data", help="output folder (default: conversation_data)")
    ap.add_argument("--records", type=int, default=200, help="number of records (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for colour in COLOURS:
        for shape in SHAPES:
            draw(colour, shape).save(out / "images" / f"{colour}_{shape}.png")
    recs = records(args.records, random.Random(args.seed))
    (out / "train.json").write_text(json.dumps(recs, indent=1))
    texts = [t["value"].replace("<image>", " ") for r in recs for t in r["conversations"]]
    texts += [" ".join(COLOURS), " ".join(SHAPES), " ".join(NUMBERS)]
    vocab = make_processor(out / "processor", texts)
    if vocab > LLM_VOCAB:
        raise SystemExit(f"the tokenizer has {vocab} tokens, more than the example model's vocabulary {LLM_VOCAB}")
    print(f"wrote {len(recs)} records to {out / 'train.json'}, {len(COLOURS) * len(SHAPES)} images to "
          f"{out / 'images'}, the processor (vocabulary {vocab}) to {out / 'processor'}")


if __name__ == "__main__":
    main()
