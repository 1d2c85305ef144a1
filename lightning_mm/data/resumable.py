"""Data order that resumes mid-epoch: a DataLoader whose position in the epoch is part of the checkpoint.

Lightning saves ``state_dict()`` of a train loader that has one and calls ``load_state_dict`` on restart. The
state is ``{"batches": n}``: batches handed out in the current epoch. On resume the batch sampler skips ``n``
batches of index lists (no sample is loaded or collated for them) after the sampler's epoch was set, so the
continued run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import itertools

from torch.utils.data import DataLoader, DistributedSampler


class SkippingBatchSampler:
    """Wraps a batch sampler; the next iteration starts ``skip`` batches in (then skips none)."""

    def __init__(self, batch_sampler):
        self.inner, self.skip = batch_sampler, 0

    @property
    def sampler(self):  # Lightning calls sampler.set_epoch through this
        return getattr(self.inner, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.inner), skip, None)


class _ResumablePosition:
    """``state_dict`` / ``load_state_dict`` of a loader's position in the epoch (``{"batches": n}``); subclasses
    say how many batches their sampler will skip and how to make it skip ``n``."""

    def _skipping(self) -> int:
        raise NotImplementedError

    def _skip(self, n: int) -> None:
        raise NotImplementedError

    def __iter__(self):
        self.batches_done = self._skipping()
        for batch in super().__iter__():
            self.batches_done += 1
            yield batch

    def state_dict(self) -> dict:
        return {"batches": int(getattr(self, "batches_done", 0))}

    def load_state_dict(self, state: dict) -> None:
        n = int(state.get("batches", 0))
        n = n if 0 < n < len(self) else 0  # a finished epoch restarts at 0
        self._skip(n)
        self.batches_done = n


class ResumableDataLoader(_ResumablePosition, DataLoader):
    """A DataLoader with ``state_dict`` / ``load_state_dict`` of its position in the epoch."""

    def _skipping(self) -> int:
        return self.batch_sampler.skip

    def _skip(self, n: int) -> None:
        self.batch_sampler.skip = n


def loader_options(loader: DataLoader) -> dict:
    """The keyword arguments that rebuild ``loader``'s workers, collation and memory pinning."""
    kw = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
              timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
              multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
              persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device)
    if loader.num_workers:
        kw["prefetch_factor"] = loader.prefetch_factor
    return kw


def resumable(loader):
    """``loader`` rebuilt as a ResumableDataLoader (map-style datasets); anything else is returned as is."""
    if type(loader) is not DataLoader or loader.batch_sampler is None or isinstance(loader, ResumableDataLoader):
        return loader
    return ResumableDataLoader(loader.dataset, batch_sampler=SkippingBatchSampler(loader.batch_sampler),
                               **loader_options(loader))


class SkippingDistributedSampler(DistributedSampler):
    """A DistributedSampler whose next iteration starts ``skip`` samples in (then skips none).

    Being a DistributedSampler, Lightning leaves it in place (no sampler is injected), so a data module can
    build its data-parallel shard itself from ``trainer.distributed_sampler_kwargs``.
    """

    skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class ShardedResumableDataLoader(_ResumablePosition, DataLoader):
    """``DataLoader(dataset, sampler=SkippingDistributedSampler(...), batch_size=..., drop_last=...)`` with the
    same ``state_dict`` as ResumableDataLoader (``{"batches": n}``); resuming skips ``n * batch_size`` indices."""

    def _skipping(self) -> int:
        return self.sampler.skip // self.batch_size

    def _skip(self, n: int) -> None:
        self.sampler.skip = n * self.batch_size
