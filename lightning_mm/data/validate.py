"""Check a batch against the model before anything runs, so bad input raises a message naming the problem and
the fix on every rank identically, before any collective (a rank stuck in a collective would hang its peers).

Catalogue: missing or misplaced keys, wrong shapes or dtypes, an empty batch, placeholder tokens that do not
match the features the encoders will emit, token ids outside the vocabulary, sequences longer than the
language model's positions, mask words with bit 63, segment ids of the wrong shape, and rows that do not
divide into the microbatches.
"""

from __future__ import annotations

import torch

from lightning_mm.attention import mask as masks
from lightning_mm.data.microbatch import PLAN_KEY, replica_microbatch_rows
from lightning_mm.model.multimodal import SEQUENCE_KEYS

REQUIRED_KEYS = ("input_ids", "labels")
TOKEN_KEYS = ("labels", "bam", "segment_ids", "position_ids", "attention_mask")


def check_keys(batch: dict, model) -> None:
    if not isinstance(batch, dict):
        raise TypeError(f"a batch must be a dict (input_ids, labels, bam, one dict per modality), got "
                        f"{type(batch).__name__}; collate samples with lightning_mm.data.MultimodalCollator")
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise ValueError(f"the batch has no {missing[0]!r} (keys: {sorted(batch)}); batches need input_ids and "
                         "labels [B, S] (MultimodalCollator builds both)")
    allowed = set(SEQUENCE_KEYS) | set(model.encoders) | {PLAN_KEY}
    unknown = sorted(set(batch) - allowed)
    if unknown:
        raise ValueError(f"the batch has unknown keys {unknown}: encoder inputs go under their modality "
                         f"(batch[{next(iter(model.encoders), 'vision')!r}]['pixel_values']); known keys: "
                         f"{sorted(allowed)}")
    for name in model.encoders:
        if name in batch and not isinstance(batch[name], dict):
            raise ValueError(f"batch[{name!r}] must be a dict of encoder inputs (e.g. {{'pixel_values': ...}}), "
                             f"got {type(batch[name]).__name__}")


def check_shapes(batch: dict) -> None:
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, sequence] tensor, got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.numel() == 0:
        raise ValueError(f"the batch is empty (input_ids shape {tuple(ids.shape)}); drop empty batches "
                         "(DataLoader(drop_last=True)) or check the sampler / packing")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got {ids.dtype}")
    for key in TOKEN_KEYS:
        t = batch.get(key)
        if key == "position_ids" and isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[:2] == ids.shape:
            continue  # 3-D positions (M-RoPE), checked against the model by check_position_dims
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != ids.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{key} has shape {shape} but input_ids has {tuple(ids.shape)}; give one {key} entry "
                             "per token")


def check_positions(batch: dict, limit: int | None) -> None:
    if limit is None:
        return
    pos = batch.get("position_ids")
    longest = int(pos.max()) + 1 if pos is not None else batch["input_ids"].shape[1]
    if longest > limit:
        raise ValueError(f"a sequence needs position {longest - 1} but the language model has "
                         f"max_position_embeddings={limit}; shorten or pack sequences (collator seq_len <= {limit}) "
                         "or use a model with more positions")


def check_position_dims(batch: dict, model) -> None:
    pos = batch.get("position_ids")
    dims = getattr(getattr(model, "lm_family", None), "position_dims", 1)
    if pos is None or pos.dim() == 2:
        return
    if pos.shape[2] != dims:
        raise ValueError(f"position_ids have shape {tuple(pos.shape)}: {pos.shape[2]} positions per token, but the "
                         f"language model takes {dims} (give [B, S]"
                         f"{'' if dims == 1 else f' or [B, S, {dims}]'} position ids)")


def check_vocabulary(batch: dict, model) -> None:
    """Token ids (other than placeholders) and labels (other than -100) inside the language model's vocabulary:
    the embedding would raise a bare IndexError, and a label past the head a CUDA assertion."""
    vocab = getattr(model, "vocab_size", None)
    if vocab is None:
        return
    ids = batch["input_ids"]
    text = ids[~torch.isin(ids, torch.tensor(sorted(model.placeholder_ids.values()), dtype=ids.dtype,
                                                  device=ids.device))]
    labels = batch["labels"]
    labels = labels[labels != -100] if isinstance(labels, torch.Tensor) else labels
    for key, values in (("input_ids", text), ("labels", labels)):
        if not isinstance(values, torch.Tensor) or not values.numel():
            continue
        high, low = torch.stack([values.max(), values.min()]).tolist()  # one host sync
        if high >= vocab or low < 0:
            raise ValueError(f"{key} holds token id {high if high >= vocab else low}, outside the language model's "
                             f"vocabulary of {vocab} ids (0..{vocab - 1}); the tokenizer does not match the model: use "
                             "the model's own tokenizer, or grow its embeddings first "
                             "(language_model.resize_token_embeddings(len(tokenizer)))")


def check_microbatches(batch: dict, num_microbatches: int) -> None:
    """Equal slices, or a balanced batch's plan that names every microbatch (``microbatch_rows`` raises), for
    each language-model replica of a batch that holds several (per-module data parallelism)."""
    replica_microbatch_rows(batch, num_microbatches)


def validate_batch(batch: dict, model, num_microbatches: int = 1) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first problem of ``batch`` for ``model``; pure and local."""
    check_keys(batch, model)
    check_shapes(batch)
    check_position_dims(batch, model)
    check_microbatches(batch, num_microbatches)
    check_positions(batch, model.max_positions)
    check_vocabulary(batch, model)
    if batch.get("bam") is not None:
        masks.validate(batch["bam"], batch.get("segment_ids"))
    model.check_placeholders(batch["input_ids"], {e: batch[e] for e in model.encoders if e in batch})
