"""Context-parallel plans made in the data loader: host-side planning, so the training step only executes plans.

For every microbatch the step will run (``microbatch_rows``: equal slices or a balanced batch's row lists):

- per encoder with CP (``ParallelSpec(cp=N)`` on an encoder), each encoder microbatch's item shards (the items each
  CP rank encodes, ``plan/items.py``) and its items' LLM tokens;
- for the LLM with CP, each LLM microbatch's block owners (the CP rank of every block of ``cp_block_size`` tokens,
  ``parallel.context.distribute``), for the sequence padded as the step pads it (``pad_for_context_parallel``).

``CPPlanCollate`` wraps the loader's collate function (the strategy does this in ``process_dataloader``) and puts
the plans, a ``CPPlans``, at ``batch["microbatches"]["cp"]``. ``CPPlans`` is no collection, so Lightning's
``transfer_batch_to_device`` leaves it on the host, and ``pin_memory`` pins its owner tensors. The step
(``PipelineEngine``) uses it when the batch carries it and otherwise plans with the same planners it hands the
loader, ``EncoderItems`` (here) and ``BlockOwners`` (``parallel/context.py``, next to ``distribute``, which data/ may
not import): a batch from elsewhere costs one host read per microbatch, as before. Each rank plans what its own
stage needs; everything here is picklable (loader workers, spawn or fork) as long as the encoders' ``preprocess`` /
``num_tokens`` callbacks are.
"""

from __future__ import annotations

import torch

from lightning_mm.data.metadata import encoder_input_tokens, encoder_positions
from lightning_mm.data.microbatch import (CP_PLAN_KEY, PLAN_KEY, ROUTE_KEY, group_items, item_counts,
                                          microbatch_rows, replica_microbatch_rows, row_index)
from lightning_mm.plan.items import encoder_width, item_work, shard_items
from lightning_mm.plan.routing import Routing, route

ItemPlan = tuple[list[list[int]], list[int]]  # (item indices per CP rank, LLM tokens per item)


class EncoderItems:
    """What encoder CP plans with, of one encoder: its family, config and token callbacks (no weights).

    ``plan(inputs)`` gives the item shards over ``ranks`` CP ranks (LPT on ``item_work`` of the positions each item
    runs through the encoder's layers, ``metadata.encoder_positions``) and each item's LLM tokens. The token count
    is ``ModalityEncoder.num_tokens`` itself, run on this view (it reads only ``preprocess``, ``_num_tokens``,
    ``family`` and ``config``)."""

    def __init__(self, family, config, ranks: int, preprocess=None, num_tokens=None):
        self.family, self.config, self.ranks = family, config, ranks
        self.preprocess, self._num_tokens = preprocess, num_tokens

    @classmethod
    def of(cls, encoder, ranks: int) -> "EncoderItems":
        """The view of a ``ModalityEncoder`` (whole, pruned to a stage or on the meta device alike)."""
        return cls(encoder.family, encoder.config, ranks, encoder.preprocess, encoder._num_tokens)

    @property
    def width(self) -> int:
        return encoder_width(self.config)

    def num_tokens(self, inputs: dict) -> list[int]:
        from lightning_mm.model.encoder import ModalityEncoder

        return ModalityEncoder.num_tokens(self, inputs)

    def work(self, tokens: list[int], positions: list[int] | None = None) -> list[int]:
        """``item_work`` of items running ``positions`` through the encoder's layers (default: counted from the
        ``tokens`` they emit, ``encoder_input_tokens``)."""
        if positions is None:
            positions = [encoder_input_tokens(self, n) for n in tokens]
        return item_work(positions, self.width)

    def shards(self, tokens: list[int], positions: list[int] | None = None) -> list[list[int]]:
        """Item indices per CP rank for items emitting ``tokens`` LLM tokens (running ``positions``) each."""
        return shard_items(self.work(tokens, positions), self.ranks)

    def piece_sizes(self, inputs: dict) -> list[list[tuple[int, int]]]:
        """Per item, (LLM tokens, positions through the encoder's layers) of each piece CP spreads
        (``family.cp_pieces``: the item itself, or a video's temporal patches)."""
        pieces = self.family.cp_pieces(inputs)
        tokens = self.num_tokens(pieces)
        sizes = iter(zip(tokens, encoder_positions(self, pieces, tokens)))
        return [[next(sizes) for _ in range(n)] for n in self.family.pieces_per_item(inputs)]

    def plan(self, inputs: dict) -> ItemPlan:
        """The plan of one microbatch's pieces (reads the items' sizes: a host read where they are on a device)."""
        sizes = [s for item in self.piece_sizes(inputs) for s in item]
        tokens = [t for t, _ in sizes]
        return self.shards(tokens, [p for _, p in sizes]), tokens


class CPPlans:
    """One batch's CP plans: ``items[encoder]`` holds, per encoder microbatch, an ``ItemPlan`` (None where the
    microbatch has no item of that encoder); ``owners`` holds, per LLM microbatch, the block owners (or is None).
    Not a collection, so Lightning moves no part of it to the device."""

    def __init__(self, items: dict[str, list[ItemPlan | None]], owners: list[torch.Tensor] | None):
        self.items, self.owners = items, owners

    def pin_memory(self, device=None) -> "CPPlans":
        """Called by the DataLoader's ``pin_memory=True``: the owners then go to the device without blocking."""
        owners = None if self.owners is None else [o.pin_memory() for o in self.owners]
        return CPPlans(self.items, owners)

    def __repr__(self) -> str:
        return f"CPPlans(items={sorted(self.items)}, owners={None if self.owners is None else len(self.owners)})"


def make_cp_plans(batch: dict, num_microbatches: int, encoders: dict[str, EncoderItems], blocks=None) -> CPPlans:
    """The CP plans of every microbatch of a host batch, as the step would make them: encoder plans over the
    encoder microbatches, LLM owners over the LLM microbatches (``microbatch_rows``), from the same rows and items
    ``split_microbatches`` selects. ``blocks``: the LLM's planner (``parallel.context.BlockOwners``: ``owner(mb)``),
    or None. Raises ``ValueError`` for a batch the step would refuse."""
    encoder_rows, llm_rows = microbatch_rows(batch, num_microbatches)
    items = {}
    counts = item_counts(batch, encoders)
    for name, encoder in encoders.items():
        if name not in batch or name not in counts:
            items[name] = [None] * len(encoder_rows)
            continue
        per_row = counts[name].tolist()
        sizes = encoder.piece_sizes(batch[name])
        if len(sizes) != sum(per_row):
            raise ValueError(f"batch[{name!r}] has {len(sizes)} items but item_counts sums to {sum(per_row)}; give "
                             "each row's item count (MultimodalCollator does)")
        picked = [[s for i in group_items(per_row, group) for s in sizes[i]] for group in encoder_rows]
        items[name] = [None if not p else (encoder.shards([t for t, _ in p], [n for _, n in p]), [t for t, _ in p])
                       for p in picked]
    owners = None
    if blocks is not None:
        if batch.get("bam") is None:
            raise ValueError("LLM context parallelism plans from the batch's mask words, but it has no 'bam'; "
                             "collate with MultimodalCollator, which builds them")
        keys = [k for k in ("input_ids", "bam", "segment_ids") if batch.get(k) is not None]
        owners = [blocks.owner({k: batch[k][row_index(batch, group)] for k in keys}) for group in llm_rows]
    return CPPlans(items, owners)


def row_work(batch: dict, encoders: dict[str, EncoderItems]) -> dict[str, list[int]]:
    """Each encoder's work per row of a batch: the ``item_work`` of the row's items (0 for a row without any),
    what per-module data parallelism balances encoder replicas on (reads the items' sizes: a host read where they
    are on a device)."""
    rows = batch["input_ids"].shape[0]
    counts = item_counts(batch, encoders)
    out = {}
    for name, encoder in encoders.items():
        if name not in batch or name not in counts:
            out[name] = [0] * rows
            continue
        per_row = counts[name].tolist()
        tokens = encoder.num_tokens(batch[name])
        work = encoder.work(tokens, encoder_positions(encoder, batch[name], tokens))
        if len(work) != sum(per_row):
            raise ValueError(f"batch[{name!r}] has {len(work)} items but item_counts sums to {sum(per_row)}; give "
                             "each row's item count (MultimodalCollator does)")
        out[name] = [sum(work[i] for i in group_items(per_row, [r])) for r in range(rows)]
    return out


class GroupRouter:
    """Per-module data parallelism's routing of a group's batch (``plan/routing.py``), made in the data loader
    and, for a batch that carries none, in the step: which encoder replica encodes which rows of each microbatch.
    ``encoder_replicas``: replicas of each encoder in a group; ``llm_replicas``: language-model replicas in a group;
    ``shared``: encoder -> the encoder whose tower it runs (``MultimodalModel.shared_encoders``): its items route
    with its owner's, whose replicas encode both, so a row's work is the sum of both modalities'. Picklable."""

    def __init__(self, encoders: dict[str, EncoderItems], encoder_replicas: dict[str, int], llm_replicas: int,
                 num_microbatches: int, shared: dict[str, str] | None = None):
        self.encoders, self.encoder_replicas = encoders, encoder_replicas
        self.llm_replicas, self.num_microbatches = llm_replicas, num_microbatches
        self.shared = dict(shared or {})

    def rows(self, batch: dict) -> list[tuple[list[list[int]], list[list[int]]]]:
        """Encoder and LLM microbatch rows of each language-model replica (``replica_microbatch_rows``)."""
        return replica_microbatch_rows(batch, self.num_microbatches, self.llm_replicas)

    def __call__(self, batch: dict) -> Routing:
        plan = batch.get(PLAN_KEY)
        if isinstance(plan, dict) and isinstance(plan.get(ROUTE_KEY), Routing):
            return plan[ROUTE_KEY]
        work = row_work(batch, self.encoders)
        for alias, owner in self.shared.items():  # one tower: a row's items of both modalities go to one replica
            work[owner] = [a + b for a, b in zip(work[owner], work.pop(alias))]
        return route([enc for enc, _ in self.rows(batch)], work, self.encoder_replicas)


def batch_plans(batch: dict) -> CPPlans | None:
    """The loader's CP plans a batch carries (None when it carries none)."""
    plan = batch.get(PLAN_KEY)
    return plan.get(CP_PLAN_KEY) if isinstance(plan, dict) else None


class CPPlanCollate:
    """``collate`` (the loader's collate function), then this rank's CP plans at ``batch["microbatches"]["cp"]``
    (``make_cp_plans``). A batch that cannot be planned (its rows do not divide into the microbatches, its items do
    not match its placeholders, ...) is returned without plans: the step validates it and raises the same error on
    every rank before any collective, which an error in some ranks' loaders would not do."""

    def __init__(self, collate, num_microbatches: int, encoders: dict[str, EncoderItems], blocks=None):
        self.collate, self.num_microbatches, self.encoders, self.blocks = collate, num_microbatches, encoders, blocks

    def __call__(self, samples):
        batch = self.collate(samples)
        if not isinstance(batch, dict) or "input_ids" not in batch:
            return batch
        try:
            plans = make_cp_plans(batch, self.num_microbatches, self.encoders, self.blocks)
        except Exception:  # noqa: BLE001  (left to the step, which raises it on every rank alike; see above)
            return batch
        batch[PLAN_KEY] = {**(batch.get(PLAN_KEY) or {}), CP_PLAN_KEY: plans}
        return batch
