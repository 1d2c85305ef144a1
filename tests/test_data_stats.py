"""Entrain's profiling batch (Bernoulli test) and the workload-ratio statistics of a data set (pure, fast)."""

import math

import numpy as np
import pytest

from lightning_mm.planner.data_stats import allocate, bernoulli_trials, data_stats, profiling_batch_size


def bimodal(n=4000, seed=0):
    """Encoder:LLM work 0.5 or 1.5 per sample, equally likely: 8 GPUs split 4:4 on average, 3:5 or 5:3 alone."""
    rng = np.random.default_rng(seed)
    llm = rng.uniform(1.0, 2.0, n)
    return np.stack([np.where(rng.random(n) < 0.5, 0.5, 1.5) * llm, llm], 1)


def test_k_is_59_for_the_defaults():
    assert bernoulli_trials() == 59
    assert bernoulli_trials(0.01, 0.05) == math.ceil(math.log(0.01) / math.log(0.95)) == 90
    with pytest.raises(ValueError, match="alpha and p_err"):
        bernoulli_trials(0.0, 0.05)


def test_allocation_rounds_in_units_with_one_unit_minimum():
    assert allocate([1.27, 1.0], 16) == (9, 7)  # the brief's 1.27:1 on 16 GPUs
    assert allocate([1.27, 1.0], 16, unit=2) == (8, 8)  # in tp = 2 units: 4.47 of 8 units -> 4
    assert allocate([1.0, 1000.0], 8) == (1, 7)  # never zero
    assert allocate([1.0, 1.0], 4, unit=2) == (2, 2)
    assert allocate([1.0, 3.0, 4.0], 8) == (1, 3, 4)
    assert allocate([0.0, 0.0], 4) == (2, 2)
    with pytest.raises(ValueError, match="fewer than the 2 components"):
        allocate([1.0, 1.0], 2, unit=2)


def test_constant_ratio_passes_at_n0():
    n = np.arange(1, 301, dtype=float)
    works = np.stack([3 * n, n], 1)  # every sample 3:1, whatever its size
    result = profiling_batch_size(works, gpus=8, n0=1)
    assert (result.batch_size, result.allocation, result.rounds) == (1, (6, 2), ((1, True),))
    assert result.converged and not result.exhaustive and result.trials == 59
    assert profiling_batch_size(works, gpus=8, n0=4).batch_size == 4


def test_bimodal_data_needs_a_larger_batch_and_is_deterministic():
    works = bimodal()
    result = profiling_batch_size(works, gpus=8, seed=0)
    assert result.converged and not result.exhaustive
    assert result.batch_size >= 8 and result.allocation == (4, 4)
    assert [n for n, _ in result.rounds] == [2 ** i for i in range(len(result.rounds))]  # doubling from n0
    assert all(not ok for _, ok in result.rounds[:-1]) and result.rounds[-1][1]
    assert profiling_batch_size(works, gpus=8, seed=0) == result  # a seed fixes every draw
    capped = profiling_batch_size(works, gpus=8, seed=0, max_batch=4)
    assert not capped.converged and capped.batch_size == 4


def test_a_sampler_works_like_a_data_set():
    def sampler(n, rng):
        return np.stack([rng.choice([0.5, 1.5], n), np.ones(n)], 1)

    result = profiling_batch_size(sampler, gpus=8, seed=3)
    assert result.converged and result.batch_size > 1 and result.allocation == (4, 4)
    assert profiling_batch_size(sampler, gpus=8, seed=3) == result


def test_a_small_data_set_stops_at_its_whole_set():
    works = bimodal(n=6)
    result = profiling_batch_size(works, gpus=8)
    assert result.exhaustive and result.batch_size == 6
    assert result.allocation == allocate(works.sum(0), 8)


def test_ratio_statistics():
    works = np.array([[1.0, 1.0], [3.0, 1.0], [2.0, 2.0], [8.0, 4.0]])
    stats = data_stats(works, gpus=8, names=["vision", "language_model"])
    per = np.array([1.0, 3.0, 1.0, 2.0])
    assert stats.ratio == pytest.approx(14 / 8)  # ratio of sums, not the mean of ratios
    assert stats.ratio_mean == pytest.approx(per.mean()) and stats.ratio_std == pytest.approx(per.std())
    assert stats.ratio_percentiles[50] == pytest.approx(np.percentile(per, 50))
    assert stats.mean_work == (3.5, 2.0) and stats.allocation == allocate([14, 8], 8) == (5, 3)
    text = stats.summary()
    assert "vision:language_model workload ratio 1.75 (ratio of sums)" in text and "b_min = " in text
    multi = data_stats(np.array([[1.0, 1.0, 2.0], [1.0, 3.0, 4.0]]), gpus=8, names=["vision", "audio", "lm"])
    assert multi.ratio == pytest.approx(1.0) and len(multi.allocation) == 3
    with pytest.raises(ValueError, match=r"\[samples, components\]"):
        data_stats(np.ones(5), gpus=8)
