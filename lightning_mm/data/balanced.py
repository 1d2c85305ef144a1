"""Balanced global batches: the samples of each global batch placed over replicas and microbatches by work.

Each global batch holds exactly the samples Lightning's ``DistributedSampler`` (the loader's shuffle, seed and
drop_last) gives all replicas for that step; ``plan(encoder_work, llm_work)`` (``lightning_mm.plan.balance``)
only changes which replica and microbatch each sample goes to. Every rank plans the same global batch with the
same deterministic planner, so ranks agree without communication, and each rank loads its replica's samples
only. The per-sample work comes from the data set's ``sample_metadata(i)`` (no tensors), cached.

Samples travel through the loader as ``(index, encoder microbatch, LLM microbatch)``; ``BalancedCollate`` adds
the plan to the batch as host lists (``batch["microbatches"]``, see ``data/microbatch.py``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Callable

import torch
from torch.utils.data import Dataset, DistributedSampler

from lightning_mm.data.metadata import metadata_of
from lightning_mm.data.microbatch import PLAN_KEY, ROUTE_KEY


class MetadataError(ValueError):
    """A sample whose metadata cannot be read (names the sample and, where there is one, the file)."""


class BalancedBatchSampler:
    """Yields this replica's part of every global batch as ``[(index, encoder mb, LLM mb), ...]``, ordered by
    encoder microbatch. ``work(indices) -> (encoder_work, llm_work)``; ``plan(enc, llm, replicas, microbatches)``
    returns a ``BatchPlan``. Resumes mid-epoch by skipping ``skip`` batches without loading them.

    ``replica`` may list several replicas (a group of per-module data parallelism): their parts come one after the
    other, each sample as ``(index, encoder mb, LLM mb, position of its replica in the list)``."""

    def __init__(self, dataset, batch_size: int, num_replicas: int, replica: int | list[int], num_microbatches: int,
                 plan: Callable, work: Callable, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if batch_size < num_microbatches:
            raise ValueError(f"batch_size={batch_size} per replica is smaller than num_microbatches="
                             f"{num_microbatches}: every microbatch needs a sample; raise the batch size")
        self.samplers = [DistributedSampler(dataset, num_replicas=num_replicas, rank=r, shuffle=shuffle, seed=seed,
                                            drop_last=drop_last) for r in range(num_replicas)]
        self.batch_size, self.replica, self.num_microbatches = batch_size, replica, num_microbatches
        self.plan, self.work, self.skip = plan, work, 0
        self.deferred_samples = 0  # over every replica, since this sampler was made
        self.planned = deque(maxlen=1024)  # each yielded batch's balance_stats, in order (the module logs them)

    @property
    def num_replicas(self) -> int:
        return len(self.samplers)

    @property
    def sampler(self):  # Lightning sets the epoch through ``loader.batch_sampler.sampler.set_epoch``
        return _EpochSetter(self)

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.samplers[0]) // self.batch_size  # whole global batches only

    def global_batches(self):
        """Each step's global batch: replica 0's DistributedSampler batch, then replica 1's, ..."""
        per_replica = [iter(s) for s in self.samplers]
        for _ in range(len(self)):
            yield [i for it in per_replica for i in itertools.islice(it, self.batch_size)]

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for indices in itertools.islice(self.global_batches(), skip, None):
            encoder_work, llm_work = self.work(indices)
            plan = self.plan(encoder_work, llm_work, self.num_replicas, self.num_microbatches)
            self.deferred_samples += sum(len(d.samples) for d in plan.deferred)
            self.planned.append(balance_stats(plan, encoder_work, llm_work))
            later = {s for d in plan.deferred for s in d.samples}
            if isinstance(self.replica, int):
                yield [(indices[s], m, m + 1 if s in later else m)
                       for m, samples in enumerate(plan.assignment[self.replica]) for s in samples]
            else:
                yield [(indices[s], m, m + 1 if s in later else m, j) for j, r in enumerate(self.replica)
                       for m, samples in enumerate(plan.assignment[r]) for s in samples]


def balance_stats(plan, encoder_work: torch.Tensor, llm_work: torch.Tensor) -> dict[str, float]:
    """One global batch's replica imbalance (the most loaded replica's encoder + LLM work over the mean) before
    balancing (each replica its contiguous slice, as the DistributedSampler gives it) and after ``plan``, and the
    samples whose LLM work the plan deferred."""
    enc, llm = torch.as_tensor(encoder_work, dtype=torch.float64), torch.as_tensor(llm_work, dtype=torch.float64)
    before = (enc + llm).view(plan.num_replicas, -1).sum(1)
    after = (plan.encoder_loads(enc) + plan.llm_loads(llm)).sum(1)
    ratio = lambda loads: float(loads.max() / loads.mean()) if float(loads.mean()) > 0 else 1.0  # noqa: E731
    return {"imbalance_before": ratio(before), "imbalance_after": ratio(after),
            "deferred_samples": float(sum(len(d.samples) for d in plan.deferred))}


class _EpochSetter:
    def __init__(self, batches: BalancedBatchSampler):
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)


class BalancedDataset(Dataset):
    """``dataset`` indexed by ``(index, encoder mb, LLM mb)``: returns the sample with its two microbatches."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        index, *microbatches = key
        return (self.dataset[index], *microbatches)


class BalancedCollate:
    """The loader's collate function over the samples, plus the plan as host lists: each row's encoder and LLM
    microbatch (and replica, for a group's batch) and its feature tokens per modality. A packing collator packs
    each microbatch on its own (rows then hold several samples of one microbatch) and runs no deferral.
    ``router(batch)``: per-module data parallelism's routing (``data.cp_plans.GroupRouter``), added as the plan's
    ``"route"``."""

    def __init__(self, collate, placeholder_ids: dict[str, int], router: Callable | None = None):
        self.collate, self.placeholder_ids, self.router = collate, dict(placeholder_ids), router

    def __call__(self, items):
        samples, encoder_mb, llm_mb, *replica = (list(x) for x in zip(*items))
        replica = replica[0] if replica else [0] * len(samples)
        if getattr(self.collate, "pack", False):
            keys = sorted(set(zip(replica, encoder_mb)))
            parts = [self.collate([s for s, e, j in zip(samples, encoder_mb, replica) if (j, e) == key])
                     for key in keys]
            rows = [key for key, p in zip(keys, parts) for _ in range(len(p["input_ids"]))]
            batch = concat_batches(parts)
            replica, encoder_mb, llm_mb = [j for j, _ in rows], [m for _, m in rows], [m for _, m in rows]
        else:
            batch = self.collate(samples)
        ids = batch["input_ids"]
        batch[PLAN_KEY] = {"encoder": encoder_mb, "llm": llm_mb,
                           "tokens": {name: (ids == pid).sum(1).tolist() for name, pid in self.placeholder_ids.items()}}
        if self.router is not None:
            batch[PLAN_KEY]["replica"] = replica
            try:
                batch[PLAN_KEY][ROUTE_KEY] = self.router(batch)
            except Exception:  # noqa: BLE001  (left to the step, which raises it on every rank alike)
                pass
        return batch


def concat_batches(parts: list[dict]) -> dict:
    """Row-wise concatenation of collated batches of equal row length (packed rows of ``seq_len``)."""
    out = {}
    for key, value in parts[0].items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.cat([p[key] for p in parts])
        elif isinstance(value, dict):
            present = [p[key] for p in parts if key in p]
            out[key] = {k: torch.cat([d[k] for d in present if k in d]) for k in value}
    for key in {k for p in parts for k, v in p.items() if isinstance(v, dict)} - set(out):
        out[key] = concat_batches([p[key] for p in parts if key in p])
    return out


def balancing_obstacle(loader) -> str:
    """Why the balanced sampler cannot rebuild ``loader`` ("" when it can)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        return f"its sampler is a {type(sampler).__name__}, not a DistributedSampler"
    if getattr(loader, "batch_size", None) is None:
        return "it has no batch_size (a custom batch_sampler)"
    dataset = sampler.dataset
    if callable(getattr(dataset, "sample_metadata", None)):
        return ""
    if not len(dataset):
        return f"its data set {type(dataset).__name__} is empty"
    first = dataset[0]
    if not isinstance(first, dict) or "input_ids" not in first:
        return (f"its data set {type(dataset).__name__} has no sample_metadata(i) and its samples are not in the "
                f"collator's format (a dict with input_ids; got {type(first).__name__})")
    return ""


def no_work(indices) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero work for every sample: what ``batch_balancing="none"`` plans with (it reads no metadata)."""
    zeros = torch.zeros(len(indices), dtype=torch.float64)
    return zeros, zeros


def metadata_works(dataset, workload, model=None) -> Callable:
    """``work(indices)`` from per-sample metadata and a ``WorkloadModel``, cached per sample. The metadata comes
    from ``dataset.sample_metadata(i)``; without it (and with ``model``), from the samples themselves, read once
    (``read_metadata``)."""
    if not callable(getattr(dataset, "sample_metadata", None)):
        if model is None:
            raise TypeError(f"batch balancing needs each sample's metadata before loading it, but "
                            f"{type(dataset).__name__} has no sample_metadata(i); use ConversationDataset / "
                            "SyntheticMultimodalDataset, implement sample_metadata(i) -> lightning_mm.data.SampleMeta, "
                            "or set batch_balancing='none'")
        metas = read_metadata(dataset, model)
        return lambda indices: workload.works([metas[i] for i in indices])
    cache: dict[int, tuple[float, float]] = {}

    def work(indices):
        for i in indices:
            if i not in cache:
                meta = dataset.sample_metadata(i)
                cache[i] = (workload.encoder_work(meta), workload.llm_work(meta))
        return (torch.tensor([cache[i][0] for i in indices], dtype=torch.float64),
                torch.tensor([cache[i][1] for i in indices], dtype=torch.float64))

    return work


def read_metadata(dataset, model) -> list:
    """Every sample's ``SampleMeta`` read from the sample itself (``metadata_of``: one placeholder per item, the
    items' encoder inputs), with a progress bar and one info line naming the cost (rank 0)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
    from tqdm.auto import tqdm

    start, name = time.perf_counter(), type(dataset).__name__
    samples = tqdm(range(len(dataset)), desc=f"batch balancing: metadata of {name}", unit="sample",
                   disable=rank_zero_only.rank != 0, leave=False)
    metas = []
    for i in samples:
        try:
            metas.append(metadata_of(dataset[i], model))
        except Exception as e:  # noqa: BLE001  (named with its sample below)
            raise MetadataError(f"batch balancing reads the metadata of {name}'s sample {i} from the sample itself, "
                                f"which failed ({type(e).__name__}: {e}); samples must be in the collator's format "
                                "(input_ids with one placeholder per item, one dict of encoder inputs per modality), "
                                "or give the data set a sample_metadata(i) -> SampleMeta method, or set "
                                "batch_balancing='none'") from e
    rank_zero_info(f"batch balancing: {name} has no sample_metadata(i), so the metadata of its {len(metas)} samples "
                   f"was read from the samples themselves ({time.perf_counter() - start:.1f} s, once per run and "
                   "rank, each sample loaded once); a sample_metadata(i) method returning "
                   "lightning_mm.data.SampleMeta (or lightning_mm.data.WithSampleMetadata(dataset, sample_metadata=fn) "
                   "for a data set you cannot change) skips this pass")
    return metas
