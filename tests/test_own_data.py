"""One's own data set: a plain map-style data set of collator-format samples is balanced without
``sample_metadata(i)`` (its metadata read once from the samples, with an info line), balancing reports what it
did, and token ids outside the language model's vocabulary are an error naming the fix."""

import logging
import os

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.data.balanced import balance_stats, metadata_works
from lightning_mm.data.validate import validate_batch
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.plan.balance import BatchPlan, Deferral, plan_batch
from lightning_mm.planner.workload import WorkloadModel
from tests.helpers.launch import run_trainer_case
from tests.helpers.plain_dataset import PlainDataset
from tests.test_balancing import BALANCED, balanced_case
from tests.test_lightning_contracts import assert_same_training, run

CASE = os.path.join(os.path.dirname(__file__), "helpers", "plain_data_case.py")


def tiny_model():
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("qwen2_vl"))},
                               tiny_language_model("llama", num_hidden_layers=2))


def test_metadata_read_from_samples_equals_sample_metadata(caplog):
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 12, items_per_sample=(0, 5))
    workload = WorkloadModel.from_model(model)
    indices = list(range(12))
    with caplog.at_level(logging.INFO):
        from_samples = metadata_works(PlainDataset([data[i] for i in indices]), workload, model)(indices)
    expected = workload.works([data.sample_metadata(i) for i in indices])
    torch.testing.assert_close(from_samples, expected, rtol=0, atol=0)
    assert "has no sample_metadata(i), so the metadata of its 12 samples was read" in caplog.text
    given = lmm.data.WithSampleMetadata(PlainDataset([data[i] for i in indices]), sample_metadata=data.sample_metadata)
    torch.testing.assert_close(metadata_works(given, workload)(indices), expected, rtol=0, atol=0)


def test_a_sample_not_in_the_collator_format_is_named():
    with pytest.raises(ValueError, match="sample 0 from the sample itself"):
        metadata_works(PlainDataset([{"input_ids": "abc", "vision": 3}]), WorkloadModel.from_model(tiny_model()),
                       tiny_model())([0])


def test_balance_stats_before_and_after():
    enc, llm = torch.tensor([4.0, 0.0, 0.0, 0.0]), torch.tensor([4.0, 4.0, 4.0, 4.0])
    plan = BatchPlan([[[0], [1]], [[2], [3]]], (Deferral(replica=1, source=0, target=1, samples=(2,)),))
    stats = balance_stats(plan, enc, llm)
    # contiguous replicas: [0, 1] = 12, [2, 3] = 8 -> 12 / 10; the plan holds the same split
    assert stats == {"imbalance_before": 1.2, "imbalance_after": 1.2, "deferred_samples": 1.0}
    balanced = plan_batch(torch.tensor([8.0, 8.0, 0.0, 0.0]), torch.ones(4), 2, 1, "entrain")
    assert balance_stats(balanced, torch.tensor([8.0, 8.0, 0.0, 0.0]), torch.ones(4))["imbalance_after"] == 1.0


def test_token_ids_outside_the_vocabulary_are_named():
    model = tiny_model()
    ids = torch.tensor([[1, 2, model.vocab_size + 7]])
    with pytest.raises(ValueError, match=f"token id {model.vocab_size + 7}, outside the language model's vocabulary "
                                         f"of {model.vocab_size} ids"):
        validate_batch({"input_ids": ids, "labels": torch.full_like(ids, -100)}, model)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="labels holds token id"):
        validate_batch({"input_ids": ids, "labels": torch.tensor([[-100, 2, model.vocab_size]])}, model)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run({**BALANCED, "dp": 2}, tmp_path_factory.mktemp("single"), "single")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["entrain", "disttrain"])
def test_plain_dataset_balanced_training_equals_one_process(method, single, tmp_path):
    """dp 2 x (vision pp 1 + LLM pp 2), 0-5 images per sample, a plain Dataset without sample_metadata: the same
    parameters as one process on the same global batches; the metadata pass and balancing are announced."""
    got = run_trainer_case(CASE, balanced_case(method), tmp_path, method)
    assert_same_training(got, single)
    assert len(got[0]["plans"]) == 2
    info = (tmp_path / method / "info.txt").read_text()
    assert "PlainDataset has no sample_metadata(i), so the metadata of its 64 samples was read" in info, info
    assert f"batch balancing: '{method}' places each global batch over 2 replicas x 2 microbatches" in info, info
