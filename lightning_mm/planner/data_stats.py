"""Data statistics for planning: a data set's vision:text workload ratio and Entrain's profiling batch size.

Entrain (003 ch. 4, Alg. 2, sec. 4.4.2) sizes the batch it profiles a data set on with a Bernoulli test: the
proportional GPU allocation of a random n-sample batch is its reference; if any of k fresh n-batches gives
another allocation, n doubles; else b_min = n. k = ceil(ln alpha / ln(1 - p_err)) batches all agreeing bound the
chance that one in p_err batches would disagree by alpha (59 for alpha = p_err = 0.05). The work of a batch is
the sum over its samples per component ("the ratio of sums", not the mean of per-sample ratios), and
allocations are rounded in whole units of tp x cp GPUs (a component is never given less than one unit), since
a layout cannot place fractions of a tensor- / context-parallel group. Everything above ``# --- planner glue``
is pure (arrays in, numbers out) and needs no model.

Work per sample comes from metadata (``SampleMeta``, no tensors) and the planner's ``WorkloadModel``.
``plan_data_stats`` is ``lightning-mm plan --data-stats``: it reads ``sample_metadata`` of (a seeded subset of) the
YAML's training data, prints the ratio and b_min, and scales the planner's per-module costs to the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

PERCENTILES = (5, 25, 50, 75, 95)


def bernoulli_trials(alpha: float = 0.05, p_err: float = 0.05) -> int:
    """k = ceil(ln alpha / ln(1 - p_err)): batches that must all agree with the reference (59 for 0.05 / 0.05)."""
    if not (0 < alpha < 1 and 0 < p_err < 1):
        raise ValueError(f"alpha and p_err must be in (0, 1), got alpha={alpha}, p_err={p_err}")
    return math.ceil(math.log(alpha) / math.log(1 - p_err))


def allocate(loads: Sequence[float], gpus: int, unit: int = 1) -> tuple[int, ...]:
    """GPUs per component in proportion to ``loads``, in whole units of ``unit`` GPUs: each component gets at least
    one unit, the rest by largest remainder (ties to the earlier component). For two components this is
    rounding the first one's share of the units to the nearest integer."""
    units, count = gpus // unit, len(loads)
    if unit < 1 or units < count:
        raise ValueError(f"{gpus} GPUs in units of {unit} give {units} unit(s), fewer than the {count} components; "
                         "every component needs at least one unit")
    loads = [max(float(v), 0.0) for v in loads]
    total = sum(loads)
    quotas = [units * v / total for v in loads] if total > 0 else [units / count] * count
    given = [max(1, math.floor(q)) for q in quotas]
    while sum(given) < units:
        i = max(range(count), key=lambda j: (quotas[j] - given[j], -j))
        given[i] += 1
    while sum(given) > units:  # the one-unit minimum overshot: take from the most over-served
        i = min((j for j in range(count) if given[j] > 1), key=lambda j: (quotas[j] - given[j], j))
        given[i] -= 1
    return tuple(g * unit for g in given)


Sampler = Callable[[int, np.random.Generator], np.ndarray]


def _as_works(works) -> np.ndarray:
    arr = np.asarray(works.numpy() if hasattr(works, "numpy") else works, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] < 2 or arr.shape[0] < 1:
        raise ValueError(f"works must be [samples, components] with at least 2 components (encoders..., LLM), "
                         f"got shape {arr.shape}")
    return arr


@dataclass(frozen=True)
class ProfilingBatch:
    """Entrain's Bernoulli test result: ``batch_size`` (b_min), the reference ``allocation`` at it (GPUs per
    component), ``trials`` (k) and each round's (n, passed). ``converged`` is False when ``max_batch`` stopped the
    doubling first; ``exhaustive`` when n reached the data set's size (every batch was the whole set)."""

    batch_size: int
    allocation: tuple[int, ...]
    trials: int
    rounds: tuple[tuple[int, bool], ...]
    converged: bool = True
    exhaustive: bool = False


def profiling_batch_size(works: np.ndarray | Sampler, gpus: int, unit: int = 1, n0: int = 1, alpha: float = 0.05,
                         p_err: float = 0.05, seed: int = 0, max_batch: int | None = None) -> ProfilingBatch:
    """Entrain's Alg. 2 on per-sample ``works`` ([samples, components]: a data set, batches drawn without
    replacement) or a ``sampler(n, rng) -> [n, components]``, for ``gpus`` GPUs per data-parallel replica
    (N_total / DP) in units of ``unit`` (tp x cp). Deterministic for a given ``seed``."""
    if n0 < 1:
        raise ValueError(f"n0 must be >= 1, got {n0}")
    k = bernoulli_trials(alpha, p_err)
    rng = np.random.default_rng(seed)
    if callable(works):
        size, draw = None, (lambda n: _as_works(works(n, rng)))
    else:
        data = _as_works(works)
        size = len(data)
        draw = (lambda n: data if n >= size else data[rng.choice(size, n, replace=False)])
    rounds, n = [], n0
    while True:
        n = min(n, size) if size is not None else n
        ref = allocate(draw(n).sum(0), gpus, unit)
        passed = all(allocate(draw(n).sum(0), gpus, unit) == ref for _ in range(k))
        rounds.append((n, passed))
        exhaustive = size is not None and n >= size
        if passed or exhaustive:
            return ProfilingBatch(n, ref, k, tuple(rounds), passed, exhaustive)
        if max_batch is not None and 2 * n > max_batch:
            return ProfilingBatch(n, ref, k, tuple(rounds), False, False)
        n *= 2


@dataclass(frozen=True)
class DataStats:
    """A data set's workload statistics. ``names``: the components (encoders..., then the LLM); ``mean_work``: work
    per sample of each; ``ratio``: encoder:LLM work of the whole set (ratio of sums); ``ratio_mean``,
    ``ratio_std`` and ``ratio_percentiles`` of the per-sample ratios (samples with no LLM work left out);
    ``allocation``: the whole set's GPUs per component; ``profiling``: the Bernoulli test; ``population``: the data
    set's size when the statistics are of a subset of it. ``microbatches`` (``plan_data_stats``): per encoder, the
    items of random microbatches drawn from the data (``draw_microbatch_items``), what the planner's encoder
    context parallelism is split on."""

    names: tuple[str, ...]
    num_samples: int
    mean_work: tuple[float, ...]
    ratio: float
    ratio_mean: float
    ratio_std: float
    ratio_percentiles: dict[int, float]
    gpus: int
    unit: int
    allocation: tuple[int, ...]
    profiling: ProfilingBatch
    population: int | None = None
    note: str = ""
    microbatches: dict[str, tuple] = field(default_factory=dict, repr=False)  # encoder CP's item split, see below

    def summary(self) -> str:
        """What ``lightning-mm plan --data-stats`` prints."""
        p, enc = self.profiling, "+".join(self.names[:-1])
        pct = ", ".join(f"p{q} {v:.3g}" for q, v in self.ratio_percentiles.items())
        share = lambda alloc: ":".join(str(a) for a in alloc)  # noqa: E731
        head = ":".join(self.names)
        subset = self.population and self.population > self.num_samples
        of = f" (a seeded subset of {self.population})" if subset else ""
        lines = [f"{self.num_samples} samples{of}; work per sample: " + ", ".join(
                     f"{n} {w:.4g}" for n, w in zip(self.names, self.mean_work)),
                 f"{enc}:{self.names[-1]} workload ratio {self.ratio:.3g} (ratio of sums); per sample mean "
                 f"{self.ratio_mean:.3g}, std {self.ratio_std:.3g}, {pct}",
                 f"whole set: {head} = {share(self.allocation)} of {self.gpus} GPUs per replica (units of {self.unit})"]
        tried = ", ".join(f"{n}{'' if ok else ' x'}" for n, ok in p.rounds)
        verdict = (f"b_min = {p.batch_size}" + (" (the whole set)" if p.exhaustive else "") if p.converged or
                   p.exhaustive else f"no b_min up to {p.batch_size}")
        lines.append(f"profiling batch (Bernoulli test, k = {p.trials} batches): {verdict} -> {head} = "
                     f"{share(p.allocation)} GPUs (batch sizes tried: {tried}; x = an allocation differed)")
        return "\n".join(lines + ([f"note: {self.note}"] if self.note else []))


def data_stats(works, gpus: int, unit: int = 1, names: Sequence[str] | None = None, n0: int = 1,
               alpha: float = 0.05, p_err: float = 0.05, seed: int = 0, max_batch: int | None = None,
               percentiles: Sequence[int] = PERCENTILES) -> DataStats:
    """Workload statistics and b_min of per-sample ``works`` ([samples, components], the LLM last)."""
    data = _as_works(works)
    names = tuple(names) if names is not None else tuple(
        [f"encoder{i}" for i in range(data.shape[1] - 1)] + ["language_model"])
    if len(names) != data.shape[1]:
        raise ValueError(f"{len(names)} names for {data.shape[1]} components")
    enc, llm = data[:, :-1].sum(1), data[:, -1]
    per = enc[llm > 0] / llm[llm > 0]
    ratios = per if len(per) else np.array([math.nan])
    total_llm = llm.sum()
    return DataStats(names, len(data), tuple(float(v) for v in data.mean(0)),
                     float(enc.sum() / total_llm) if total_llm > 0 else math.inf,
                     float(ratios.mean()), float(ratios.std()),
                     {int(q): float(np.percentile(ratios, q)) for q in percentiles}, gpus, unit,
                     allocate(data.sum(0), gpus, unit),
                     profiling_batch_size(data, gpus, unit, n0, alpha, p_err, seed, max_batch))


# --- planner glue: metadata of a data module's data set, and the planner's costs scaled to it
def metadata_dataset(datamodule):
    """The data set behind the data module's training loader that has ``sample_metadata`` (wrappers unwrapped)."""
    dataset = datamodule.train_dataloader().dataset
    while not callable(getattr(dataset, "sample_metadata", None)) and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    if not callable(getattr(dataset, "sample_metadata", None)):
        raise TypeError(f"--data-stats needs each sample's metadata, but {type(dataset).__name__} has no "
                        "sample_metadata(i); use ConversationDataModule / SyntheticMultimodalDataModule or implement "
                        "sample_metadata(i) -> lightning_mm.data.SampleMeta")
    return dataset


def sample_indices(size: int, max_samples: int | None, seed: int = 0) -> list[int]:
    """All of ``range(size)``, or a seeded sorted subset of ``max_samples`` of them."""
    if max_samples is None or size <= max_samples:
        return list(range(size))
    return sorted(np.random.default_rng(seed).choice(size, max_samples, replace=False).tolist())


def module_works(metas, workload, encoders: Sequence[str]) -> np.ndarray:
    """[samples, encoders + 1]: each encoder's work (its items) and the LLM's, per sample's ``SampleMeta``."""
    rows = []
    for m in metas:
        rows.append([sum(workload.encoders[e](t) for t, _ in m.items.get(e, ())) for e in encoders]
                    + [workload.llm_work(m)])
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(encoders) + 1)


Item = tuple[int, float, int]  # one image / clip: (tokens through the encoder's layers, work, LLM tokens emitted)


def microbatch_items(model, workload, batch: dict) -> dict[str, list[Item]]:
    """Per encoder, the items of a collated microbatch: (encoder tokens, work by ``workload``, emitted tokens)."""
    from lightning_mm.data.metadata import encoder_positions

    out = {}
    for name, enc in model.encoders.items():
        emitted = enc.num_tokens(batch[name]) if batch.get(name) is not None else []
        tokens = encoder_positions(enc, batch[name], emitted) if emitted else []
        out[name] = [(t, workload.encoders[name](t), n) for t, n in zip(tokens, emitted)]
    return out


def draw_microbatch_items(metas, workload, encoders: Sequence[str], samples: int, draws: int = 64,
                          seed: int = 0) -> dict[str, tuple[tuple[Item, ...], ...]]:
    """Per encoder, the items of ``draws`` seeded random microbatches of ``samples`` samples each (without
    replacement within a microbatch), from per-sample ``SampleMeta``: how the data's items fall into microbatches."""
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(metas), min(samples, len(metas)), replace=False) for _ in range(draws)] if metas else []
    return {e: tuple(tuple((t, workload.encoders[e](t), n) for i in pick for t, n in metas[i].items.get(e, ()))
                     for pick in picks) for e in encoders}


def microbatch_work(model, workload, batch: dict) -> tuple[np.ndarray, int]:
    """(work per module, samples) of a collated microbatch as the planner's costs counted it: each encoder on its
    items, the LLM on every row at its padded length; samples = rows, or packed segments."""
    work = [sum(w for _, w, _ in items) for items in microbatch_items(model, workload, batch).values()]
    rows, length = batch["input_ids"].shape
    work.append(rows * workload.language_model(length))
    samples = rows
    if batch.get("segment_ids") is not None and batch.get("bam") is not None:
        real = batch["bam"] != 0
        samples = sum(len(set(batch["segment_ids"][r][real[r]].tolist())) for r in range(rows))
    return np.asarray(work, dtype=np.float64), max(1, samples)


def plan_data_stats(model, datamodule, trainer, batch: dict, costs: dict, devices: int | None = None,
                    max_samples: int | None = 2000, seed: int = 0) -> tuple[DataStats, dict, dict]:
    """``lightning-mm plan --data-stats``: statistics of the YAML's training data, and ``costs`` (per module, per
    layer, counted on the microbatch ``batch``) scaled to the data.

    Decision: the search keeps its input (per-module layer costs of one microbatch) and each module's costs are
    multiplied by (the data's mean work per sample x the samples in ``batch``) / (the work of ``batch`` as it was
    counted: encoders per item, the LLM per row at its padded length), both by the planner's ``WorkloadModel``.
    The layout is then searched on a microbatch of the data's mean encoder and LLM work instead of on the first
    batch (whose vision:text ratio can be far from the data's); the quadratic attention terms are averaged per
    sample, as the balancer plans. Memory estimates (activation bytes) stay those of ``batch``.

    ``gpus`` for the allocation = ``devices`` (default: the Trainer's) / the configured layout's data-parallel size,
    in units of the language model's tp x cp. Returns (statistics, scaled costs, the factor per module); the
    statistics' ``microbatches`` hold 64 seeded random microbatches of ``batch``'s sample count per encoder, for
    the encoder CP split."""
    from lightning_mm.plan.layout import ParallelSpec, build_layout
    from lightning_mm.plan.placement import LANGUAGE_MODEL
    from lightning_mm.planner.costs import LayerCost
    from lightning_mm.planner.workload import WorkloadModel

    strategy, encoders = trainer.strategy, list(model.encoders)
    if not encoders:
        raise SystemExit("--data-stats compares encoder and LLM work, but the model has no encoder")
    dataset = metadata_dataset(datamodule)
    indices = sample_indices(len(dataset), max_samples, seed)
    workload = WorkloadModel.from_model(model)
    metas = [dataset.sample_metadata(i) for i in indices]
    works = module_works(metas, workload, encoders)
    enc_specs = strategy.encoder_specs if strategy.encoder_specs is not None else {
        e: ParallelSpec() for e in encoders}
    llm_spec = strategy.language_model_spec
    world = trainer.num_devices * trainer.num_nodes
    try:
        dp = build_layout(enc_specs, llm_spec, world, strategy.encoder_placement, encoders).dp
    except ValueError:  # the configured specs do not lay out on the Trainer's devices (e.g. devices=1): one replica
        dp = 1
    gpus, unit = max(1, (devices or world) // dp), llm_spec.tp * llm_spec.cp
    note = ""
    if gpus // unit < len(encoders) + 1:  # too few to split: the allocation of one unit more per module
        note = (f"{gpus} GPU(s) per replica in units of {unit} cannot give every module one unit; allocations "
                f"below are for {len(encoders) + 1} GPUs in units of 1 (pass --devices)")
        gpus, unit = len(encoders) + 1, 1
    counted, samples = microbatch_work(model, workload, batch)
    stats = replace(data_stats(works, gpus, unit, names=[*encoders, LANGUAGE_MODEL], seed=seed), note=note,
                    population=len(dataset),
                    microbatches=draw_microbatch_items(metas, workload, encoders, samples, seed=seed))
    wanted = works.mean(0) * samples
    factors = {name: (float(w / c) if c > 0 else 1.0)
               for name, w, c in zip([*encoders, LANGUAGE_MODEL], wanted, counted)}
    scaled = {m: [LayerCost(c.forward * factors.get(m, 1.0), c.backward * factors.get(m, 1.0), c.trainable,
                            c.in_backward) for c in layer_costs] for m, layer_costs in costs.items()}
    return stats, scaled, factors
