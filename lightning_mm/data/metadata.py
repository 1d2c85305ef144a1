"""Per-sample metadata: what a sample will cost, known without building its tensors.

``SampleMeta`` counts the tokens each modality item feeds its encoder and the LLM, and the sample's text tokens.
Data sets give it through ``sample_metadata(i)`` (the balanced batch sampler and ``lightning-mm plan
--data-stats`` read it; ``WithSampleMetadata`` adds one to a data set, and ``metadata_of`` reads it from a
sample); the planner's cost model turns it into encoder and LLM work
(``lightning_mm.planner.workload``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class SampleMeta:
    """``text_tokens``: tokens that are not modality features; ``items[modality]``: per item, (tokens entering the
    encoder's layers, tokens it emits into the LLM sequence)."""

    text_tokens: int
    items: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    @property
    def llm_tokens(self) -> int:
        return self.text_tokens + sum(out for its in self.items.values() for _, out in its)


def encoder_input_tokens(encoder, emitted: int) -> int:
    """Tokens an encoder's layers see for an item that emits ``emitted`` LLM tokens, where that count tells them:
    Qwen-VL towers merge ``spatial_merge_size``^2 patches into one token; a family may say how many positions it
    folds into one (``positions_per_token``: InternVL's pixel shuffle); the other families emit one token per
    position. Where the item's inputs are at hand, :func:`encoder_positions` counts tiles too."""
    folded = getattr(encoder.family, "positions_per_token", None)
    if folded is not None:
        return emitted * folded
    merged = encoder.family.input_key in ("image_grid_thw", "video_grid_thw")
    merge = getattr(encoder.config, "spatial_merge_size", 1) if merged else 1
    return emitted * merge * merge


def encoder_positions(encoder, inputs: dict, emitted: list[int] | None = None) -> list[int]:
    """Positions an encoder's layers see for each item of ``inputs`` (its cost): the family's count from the inputs
    (``family.encoder_positions``: an AnyRes or InternVL image's tiles x a tile's positions, a Qwen-VL image's or
    video's t*h*w patches), else :func:`encoder_input_tokens` of each item's LLM tokens (``emitted``, or
    ``encoder.num_tokens(inputs)``). ``encoder``: a ``ModalityEncoder`` or a view with its ``family``, ``config``
    and ``preprocess``."""
    hook, preprocess = getattr(encoder.family, "encoder_positions", None), getattr(encoder, "preprocess", None)
    own = None if hook is None else hook(encoder.config, preprocess(inputs) if preprocess else inputs)
    if own is not None:
        return [int(n) for n in own]
    emitted = encoder.num_tokens(inputs) if emitted is None else emitted
    return [encoder_input_tokens(encoder, n) for n in emitted]


def item_sizes(encoder, inputs: dict) -> tuple[tuple[int, int], ...]:
    """``SampleMeta`` items of ``inputs``: (positions the encoder's layers see, LLM tokens emitted) per item."""
    emitted = [int(n) for n in encoder.num_tokens(inputs)]
    return tuple(zip(encoder_positions(encoder, inputs, emitted), emitted))


def metadata_of(sample: dict, model) -> SampleMeta:
    """The metadata of an unexpanded sample (one placeholder per item, the items' encoder inputs)."""
    items, ids = {}, sample["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    for name, enc in model.encoders.items():
        if sample.get(name) is not None:
            items[name] = item_sizes(enc, sample[name])
    placeholders = set(model.placeholder_ids.values())
    return SampleMeta(sum(1 for t in ids if t not in placeholders) + framing_tokens(sample, model), items)


def framing_tokens(sample: dict, model) -> int:
    """Text tokens the items' expansions (``item_ids``) add around their feature tokens."""
    pids = model.placeholder_ids
    return sum(len(ids) - int((torch.as_tensor(ids) == pids[name]).sum())
               for name, per_item in (sample.get("item_ids") or {}).items() for ids in per_item)


class WithSampleMetadata(Dataset):
    """``dataset`` with ``sample_metadata(i)`` given as a callable (``sample_metadata(i) -> SampleMeta``), for a
    data set that cannot be subclassed: batch balancing then reads no sample to plan."""

    def __init__(self, dataset, sample_metadata: Callable[[int], SampleMeta]):
        self.dataset, self._sample_metadata = dataset, sample_metadata

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def sample_metadata(self, i: int) -> SampleMeta:
        return self._sample_metadata(i)
