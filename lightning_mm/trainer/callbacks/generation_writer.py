"""GenerationWriter: ``trainer.predict`` of ``MultimodalLightningModule(generation=...)`` written as text, one JSON
line per sample, so ``lightning-mm predict`` leaves the answers in a file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper


class GenerationWriter(BasePredictionWriter):
    """Decodes each predict batch's ``generated_ids`` and appends ``{"index": i, "text": ..., "token_ids": [...]}``
    per sample to ``path`` (a JSON Lines file, written anew by every predict run).

    ``tokenizer``: a folder (``AutoTokenizer.from_pretrained``) or a tokenizer; default the data module's
    (``datamodule.tokenizer``, or ``datamodule.processor.tokenizer`` as ``ConversationDataModule`` holds it).
    ``text`` is decoded with ``skip_special_tokens=True``; ``token_ids`` stop at the first end-of-sequence token
    (kept), dropping the padding of rows that finished early. The stop tokens are the module's
    ``generation["eos_token_id"]``, else its language model's ``generation_config.eos_token_id``.

    ``index`` is the sample's position in the predict dataset (Lightning's batch indices), so files of several
    replicas merge by it; where the loader records none (not a map-style ``DataLoader``), the running count of the
    samples this file holds.

    Who writes: every rank of a ``MultimodalParallelStrategy`` replica holds the same ids, so only the replica's
    first rank writes. With one replica it writes ``path``; with several, each replica's first rank ``R`` writes
    ``<stem>.rank<R><suffix>`` beside it (``generated.rank3.jsonl``): no gather, no collective, nothing held back.
    Other strategies count each rank as a replica.
    """

    def __init__(self, path: str | os.PathLike = "generated.jsonl", tokenizer=None):
        super().__init__(write_interval="batch")
        self.path, self.tokenizer = Path(path), tokenizer
        self.file: Path | None = None  # what this rank writes; None on a rank that does not
        self._stream = None
        self._written = 0

    # ------------------------------------------------------------------ who writes, where
    @staticmethod
    def replica_writer(trainer) -> tuple[bool, bool]:
        """(whether this rank writes, whether there are several replicas)."""
        layout, rank = getattr(trainer.strategy, "layout", None), trainer.global_rank
        if layout is None:  # plain Lightning: each rank is a data-parallel replica
            return True, trainer.world_size > 1
        dp = layout.coordinate(rank).dp
        first = min(r for r in range(trainer.world_size) if layout.coordinate(r).dp == dp)
        return rank == first, layout.dp > 1

    def on_predict_start(self, trainer, pl_module) -> None:
        writes, several = self.replica_writer(trainer)
        if not writes:
            self.file = None
            return
        if isinstance(self.tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        elif self.tokenizer is None:
            self.tokenizer = self._datamodule_tokenizer(trainer)
        path = self.path
        self.file = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}") if several else path
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self._stream, self._written = open(self.file, "w"), 0

    @staticmethod
    def _datamodule_tokenizer(trainer):
        dm = trainer.datamodule
        tok = getattr(dm, "tokenizer", None) or getattr(getattr(dm, "processor", None), "tokenizer", None)
        if tok is None:
            raise ValueError("GenerationWriter needs a tokenizer: pass tokenizer= (a folder or a tokenizer), or use a "
                             "data module with a tokenizer (ConversationDataModule's processor)")
        return tok

    # ------------------------------------------------------------------ writing
    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx: int,
                           dataloader_idx: int) -> None:
        if self._stream is None or prediction is None:
            return
        if "generated_ids" not in prediction:
            raise ValueError("GenerationWriter writes generated text: build the module with generation=... "
                             "(e.g. MultimodalLightningModule(model, generation={'max_new_tokens': 32}))")
        ids = prediction["generated_ids"].tolist()
        indices = list(batch_indices or self._loader_indices(trainer, batch_idx, dataloader_idx) or
                       range(self._written, self._written + len(ids)))
        eos = stop_tokens(pl_module)
        for index, row in zip(indices, ids):
            row = until_eos(row, eos)
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            self._stream.write(json.dumps({"index": int(index), "text": text, "token_ids": row}) + "\n")
        self._written += len(ids)
        self._stream.flush()

    @staticmethod
    def _loader_indices(trainer, batch_idx: int, dataloader_idx: int) -> list[int] | None:
        """The batch's dataset indices from Lightning's index-recording batch sampler where a wrapper around it (the
        strategy's resumable loader) hid it from the predict loop."""
        loaders = trainer.predict_dataloaders
        loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
        sampler = getattr(loader, "batch_sampler", None)
        while sampler is not None and not isinstance(sampler, _IndexBatchSamplerWrapper):
            sampler = getattr(sampler, "inner", None)
        seen = sampler.seen_batch_indices if sampler is not None else []
        return seen[batch_idx] if batch_idx < len(seen) else None

    def on_predict_end(self, trainer, pl_module) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def stop_tokens(pl_module) -> set[int]:
    """The end-of-sequence ids generation stopped at: the module's ``generation`` ones, else the LLM's config's."""
    eos = (getattr(pl_module, "generation", None) or {}).get("eos_token_id")
    if eos is None:
        lm = getattr(getattr(pl_module, "model", None), "language_model", None)
        eos = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
    return set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """``ids`` up to and including the first of ``eos`` (what follows is padding)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


__all__ = ["GenerationWriter"]
