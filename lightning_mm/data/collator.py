"""Samples -> batches: placeholder expansion, labels, attention-mask words, padding or packing.

A *sample* holds ``input_ids`` (1-D) with ONE placeholder token per modality item, optional ``labels`` (same
length; default: the text ids, -100 at placeholders), per modality a dict of the items' processed encoder
inputs (``{"pixel_values": [n_items, ...]}``), and optionally ``item_ids`` (``{modality: [ids per item]}``:
an item's whole expansion, the special tokens its HF processor writes around it included;
``lightning_mm.data.item_text``).
The collator expands every placeholder to the number of tokens its item's encoder emits (or to its ``item_ids``),
so the LLM sequence layout is known before any encoder runs, then pads (one sample per
row) or packs (several samples per row with ``segment_ids``).

A *batch* is a dict: ``input_ids``, ``labels``, ``bam``, ``attention_mask``, ``position_ids``,
``segment_ids`` when packing, one dict of concatenated encoder inputs per modality, and ``item_counts``
(items of each modality per row, used to cut microbatches).
"""

from __future__ import annotations

import math

import torch

from lightning_mm.attention import mask as masks
from lightning_mm.loss import IGNORE_INDEX


def concat_inputs(dicts: list[dict]) -> dict:
    """Concatenate per-item encoder inputs along dim 0 (works for images, audio and Qwen2-VL patch lists). Tensors
    whose other dims differ between samples (AnyRes tiles, padded per sample by the image processor to its
    longest image) are zero-padded to the largest, as the processor pads a batch."""
    keys = dicts[0].keys()
    return {k: _cat_padded([torch.as_tensor(d[k]) for d in dicts]) for k in keys}


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        if list(t.shape[1:]) != shape:
            pad = [p for d in reversed(range(1, t.dim())) for p in (0, shape[d - 1] - t.shape[d])]
            t = torch.nn.functional.pad(t, pad)
        padded.append(t)
    return torch.cat(padded)


class MultimodalCollator:
    """Turn samples into a batch for ``model`` (a MultimodalModel: its placeholder ids and token counts).

    ``pack=True`` packs samples first-fit into rows of ``seq_len`` tokens (multimodal packing, MP) with
    ``segment_ids`` of ``masks.segment_dtype`` (int16 unless a row holds more samples: what context-parallel
    planning reads per token); position ids restart in every segment and no position predicts the next
    segment's first token. Otherwise rows are padded to the longest sample, rounded up to ``pad_to_multiple_of``.
    ``causal_modalities`` gives modality tokens the text word (plain causal, LLaVA style); default: the model's
    (``model.causal_modalities``, True for composite checkpoints). A model with its own positions
    (``model.position_ids_fn``, Qwen2-VL's M-RoPE) gets them per sample: ``position_ids`` ``[B, S, 3]``.
    """

    def __init__(self, model, seq_len: int | None = None, pack: bool = False, pad_to_multiple_of: int = 1,
                 pad_token_id: int = 0, causal_modalities: bool | None = None):
        if pack and not seq_len:
            raise ValueError("packing needs seq_len (the length of a packed row)")
        self.model, self.seq_len, self.pack = model, seq_len, pack
        self.pad_to_multiple_of, self.pad_token_id, self.causal_modalities = (
            pad_to_multiple_of, pad_token_id, causal_modalities)

    # -------------------------------------------------------------- one sample
    def expand(self, sample: dict) -> dict:
        """Expand placeholders; returns 1-D ``input_ids``/``labels`` and the sample's modality inputs."""
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        labels = sample.get("labels")
        labels = ids.clone() if labels is None else torch.as_tensor(labels, dtype=torch.long)
        pids = self.model.placeholder_ids
        tokens = {}
        for name, enc in self.model.encoders.items():
            n_items = int((ids == pids[name]).sum())
            inputs = sample.get(name)
            have = 0 if inputs is None else enc.family.num_items(inputs)
            if n_items != have:
                raise ValueError(f"modality {name!r}: the sample has {n_items} placeholder tokens (id {pids[name]}) "
                                 f"but {have} items of encoder inputs; put one placeholder per image/clip")
            counts = enc.num_tokens(inputs) if have else []
            given = (sample.get("item_ids") or {}).get(name)
            if given is None:
                tokens[name] = iter([[pids[name]] * n for n in counts])
                continue
            given = [torch.as_tensor(g, dtype=torch.long).tolist() for g in given]
            if [g.count(pids[name]) for g in given] != counts:
                raise ValueError(f"modality {name!r}: item_ids hold {[g.count(pids[name]) for g in given]} "
                                 f"placeholder tokens per item but the encoder emits {counts}; build item_ids from "
                                 "the same encoder inputs (MultimodalProcessor.item_ids)")
            tokens[name] = iter(given)
        by_id = {pid: name for name, pid in pids.items()}
        out_ids, out_labels = [], []
        for t, lab in zip(ids.tolist(), labels.tolist()):
            name = by_id.get(t)
            if name is None:
                out_ids.append(t)
                out_labels.append(lab)
            else:  # the item's tokens (and the text its family writes around them) carry no loss
                item = next(tokens[name])
                out_ids += item
                out_labels += [IGNORE_INDEX] * len(item)
        return {"input_ids": torch.tensor(out_ids), "labels": torch.tensor(out_labels),
                "inputs": {name: sample[name] for name in self.model.encoders if name in sample}}

    def _expand_named(self, index: int, sample: dict) -> dict:
        """``expand``, its errors naming the sample (its index in the batch, and ``sample["index"]`` if given)."""
        try:
            return self.expand(sample)
        except ValueError as err:
            name = f"sample {index} of the batch" + (f" (index {sample['index']})" if "index" in sample else "")
            raise ValueError(f"{name}: {err}") from err

    # -------------------------------------------------------------- rows
    def _rows(self, expanded: list[dict]) -> list[list[dict]]:
        if not self.pack:
            return [[e] for e in expanded]
        rows, fill = [], []
        for e in expanded:
            n = len(e["input_ids"])
            if n > self.seq_len:
                raise ValueError(f"a sample has {n} tokens after placeholder expansion, more than seq_len="
                                 f"{self.seq_len}; raise seq_len or shorten the sample")
            for i, used in enumerate(fill):
                if used + n <= self.seq_len:
                    rows[i].append(e)
                    fill[i] += n
                    break
            else:
                rows.append([e])
                fill.append(n)
        return rows

    def __call__(self, samples: list[dict]) -> dict:
        if not samples:
            raise ValueError("empty batch: the data loader produced no samples")
        rows = self._rows([self._expand_named(i, s) for i, s in enumerate(samples)])
        longest = max(sum(len(e["input_ids"]) for e in row) for row in rows)
        length = self.seq_len if self.pack else longest
        if self.seq_len and not self.pack and longest > self.seq_len:
            raise ValueError(f"a sample has {longest} tokens after placeholder expansion, more than seq_len="
                             f"{self.seq_len}")
        length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        b = len(rows)
        positions = getattr(self.model, "position_ids_fn", None)
        batch = {"input_ids": torch.full((b, length), self.pad_token_id, dtype=torch.long),
                 "labels": torch.full((b, length), IGNORE_INDEX, dtype=torch.long),
                 "attention_mask": torch.zeros(b, length, dtype=torch.long),
                 "position_ids": torch.zeros((b, length) if positions is None else (b, length, 3), dtype=torch.long)}
        segs = torch.full((b, length), -1, dtype=masks.segment_dtype(max(map(len, rows))))
        counts = {name: torch.zeros(b, dtype=torch.long) for name in self.model.encoders}
        items = {name: [] for name in self.model.encoders}
        for r, row in enumerate(rows):
            at = 0
            for s, e in enumerate(row):
                n = len(e["input_ids"])
                batch["input_ids"][r, at:at + n] = e["input_ids"]
                labels = e["labels"].clone()
                labels[0] = IGNORE_INDEX  # never predicted from the previous segment
                batch["labels"][r, at:at + n] = labels
                batch["attention_mask"][r, at:at + n] = 1
                batch["position_ids"][r, at:at + n] = torch.arange(n) if positions is None else \
                    positions(e["input_ids"][None], e["inputs"])[0]
                segs[r, at:at + n] = s
                for name, inputs in e["inputs"].items():
                    items[name].append(inputs)
                    counts[name][r] += self.model.encoders[name].family.num_items(inputs)
                at += n
            segs[r, at:] = len(row)  # padding gets its own segment (its words are 0 anyway)
        batch["bam"] = self.model.build_bam(batch["input_ids"], batch["attention_mask"], self.causal_modalities)
        if self.pack:
            batch["segment_ids"] = segs
        for name, lst in items.items():
            if lst:
                batch[name] = concat_inputs(lst)
        batch["item_counts"] = {name: c for name, c in counts.items() if items[name]}
        return batch
