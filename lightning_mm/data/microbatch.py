"""Cut a batch into microbatches: rows evenly, and each modality's items with the rows they belong to."""

from __future__ import annotations

import torch

ROW_KEYS = ("input_ids", "labels", "bam", "segment_ids", "position_ids", "attention_mask")


def item_counts(batch: dict, model) -> dict[str, torch.Tensor]:
    """Items of each modality per row: the collator's ``item_counts``, else one item per row."""
    counts = dict(batch.get("item_counts") or {})
    rows = batch["input_ids"].shape[0]
    for name, enc in model.encoders.items():
        if name in batch and name not in counts:
            n = enc.family.num_items(batch[name])
            if n != rows:
                raise ValueError(f"batch[{name!r}] has {n} items for {rows} rows and no item_counts; give "
                                 "batch['item_counts'][name] (items per row), as MultimodalCollator does")
            counts[name] = torch.ones(rows, dtype=torch.long, device=batch["input_ids"].device)
    return counts


def split_microbatches(batch: dict, num_microbatches: int, model) -> list[dict]:
    """``num_microbatches`` batches of equal row counts, each with its own rows' encoder inputs."""
    rows = batch["input_ids"].shape[0]
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(f"a batch of {rows} rows cannot be cut into num_microbatches={num_microbatches} equal "
                         f"microbatches; make the per-rank batch size a multiple of num_microbatches")
    counts = item_counts(batch, model)
    size = rows // num_microbatches
    out = []
    for m in range(num_microbatches):
        rs = slice(m * size, (m + 1) * size)
        mb = {k: batch[k][rs] for k in ROW_KEYS if k in batch}
        mb["item_counts"] = {}
        for name, c in counts.items():
            first = int(c[: rs.start].sum())
            items = torch.arange(first, first + int(c[rs].sum()), device=c.device)
            mb["item_counts"][name] = c[rs]
            if len(items):
                mb[name] = model.encoders[name].family.select_items(batch[name], items)
        out.append(mb)
    return out
