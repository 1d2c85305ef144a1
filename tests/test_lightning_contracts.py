"""Lightning's contracts under MultimodalParallelStrategy, each against plain single-process Lightning.

Accumulation with data parallelism and pipelining, bf16-mixed, validate/test/predict, nan_guard="skip" on 3
processes, consolidate on rank 0 right after fit, lazy (meta) builds materialised per stage under pp 1/2/3,
``devices=1`` debug mode, and the errors for unknown arguments and modules the strategy cannot run.
"""

import math
import os

import pytest
import torch

import lightning_mm as lmm
from tests.helpers.launch import run_script, run_trainer_case

CASE = os.path.join(os.path.dirname(__file__), "helpers", "trainer_case.py")


def run(case: dict, tmp_path, name: str):
    return run_trainer_case(CASE, case, tmp_path, name)


def assert_same_training(got, ref, rtol=1e-5, atol=1e-6, param_tol=(1e-4, 1e-5)):
    (res, params), (ref_res, ref_params) = got, ref
    torch.testing.assert_close(torch.tensor(res["train"], dtype=torch.float64),
                               torch.tensor(ref_res["train"], dtype=torch.float64), rtol=rtol, atol=atol)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=param_tol[0], atol=param_tol[1], msg=n)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.combines("accumulation", "pipeline")
def test_accumulation_pipeline_validate_test_predict_consolidate(tmp_path):
    """pp 2 (4 processes), accumulate 2, SGD, clipping: every micro-step loss and every trainable parameter as one
    process; then validate, test and predict give one process's numbers; consolidate runs on rank 0 after fit."""
    base = dict(accumulate=2, steps=2, clip=0.5, validate=True, test=True, predict=True, optimizer="sgd", lr=0.5)
    ref = run(base, tmp_path, "single")
    got = run({**base, "llm_pp": 2, "microbatches": 2, "consolidate": True}, tmp_path, "pp2")
    assert_same_training(got, ref)
    assert len(ref[0]["train"]) == 4
    for key in ("val", "test"):
        assert got[0][key] == pytest.approx(ref[0][key], rel=1e-5)
    assert got[0]["predicted_ids"] == ref[0]["predicted_ids"]
    assert got[0]["consolidated"] == sorted(ref[1])


@pytest.mark.slow
def test_accumulation_with_data_parallel_replicas(tmp_path):
    """dp 2 x (vision, audio, LLM) = 6 processes, accumulate 2: gradients are reduced once per optimiser step.
    SGD: Adam would turn the last-bit differences of summing replicas in another order into lr-sized steps on
    parameters whose gradient is about zero."""
    base = dict(accumulate=2, steps=2, dp=2, freeze="all", optimizer="sgd", lr=0.5)
    assert_same_training(run({**base, "llm_pp": 1}, tmp_path, "dp2"), run(base, tmp_path, "single"))


@pytest.mark.slow
@pytest.mark.combines("mixed_precision", "pipeline")
def test_bf16_mixed_matches_one_process_within_bf16_tolerance(tmp_path):
    base = dict(precision="bf16-mixed", steps=2)
    got, ref = run({**base, "llm_pp": 2, "microbatches": 2}, tmp_path, "pp2"), run(base, tmp_path, "single")
    torch.testing.assert_close(torch.tensor(got[0]["train"]), torch.tensor(ref[0]["train"]), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_nan_guard_skip_on_three_processes(tmp_path):
    """The step whose loss is NaN is dropped on every rank alike; training goes on as in one process."""
    base = dict(nan_at=1, steps=3)
    got, ref = run({**base, "llm_pp": 1}, tmp_path, "pp1"), run(base, tmp_path, "single")
    assert math.isnan(got[0]["train"][1]) and math.isnan(ref[0]["train"][1])
    for res, _ in (got, ref):
        res["train"] = [x for x in res["train"] if not math.isnan(x)]
    assert_same_training(got, ref)


@pytest.mark.slow
def test_lazy_build_trains_like_debug_mode_on_one_device(tmp_path):
    """Built under init_module(empty_init=True) (meta), each rank materialises its stage with the init derived
    from the seed and each parameter's name: pp 1, 2 and 3 (3, 4 and 5 processes) equal the whole model in one
    process under the strategy (devices=1)."""
    base = dict(lazy=True, steps=2, freeze="all", llm_layers=3)
    ref = run({**base, "devices": 1, "llm_pp": 1}, tmp_path, "debug")
    for llm_pp in (1, 2, 3):
        assert_same_training(run({**base, "llm_pp": llm_pp}, tmp_path, f"pp{llm_pp}"), ref)


def test_whole_lightning_module_under_init_module(tmp_path):
    """Lightning's documented pattern, the whole LightningModule under ``trainer.init_module(empty_init=True)``:
    its metrics stay real (CPU) tensors and it trains; a subclass that makes its own tensors there gets an error
    that names the fix instead of "Cannot copy out of meta tensor"."""
    import lightning as L
    import torchmetrics

    from lightning_mm.model import tiny_encoder, tiny_language_model

    def fit(module_class):
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=lmm.MultimodalParallelStrategy(), max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path)
        with trainer.init_module(empty_init=True):
            model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))},
                                        tiny_language_model("llama"))
            module = module_class(model)
        assert lmm.model.is_meta(model) and not module.train_metrics.throughput.tokens.is_meta
        trainer.fit(module, lmm.data.SyntheticMultimodalDataModule(num_samples=8, batch_size=2))
        return trainer, module

    trainer, module = fit(lmm.MultimodalLightningModule)
    assert math.isfinite(float(trainer.callback_metrics["train/loss"])) and not lmm.model.is_meta(module.model)

    class WithMetric(lmm.MultimodalLightningModule):
        def __init__(self, model):
            super().__init__(model)
            self.extra = torchmetrics.MeanMetric()

    with pytest.raises(RuntimeError, match=r"holds tensors on the meta device outside its `model`.*torch.device"):
        fit(WithMetric)


def test_unknown_argument_and_wrong_module_are_errors():
    with pytest.raises(TypeError, match=r"unknown arguments \['find_unused_parameters'\]"):
        lmm.MultimodalParallelStrategy(find_unused_parameters=True)
    import lightning as L

    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(strategy=lmm.MultimodalParallelStrategy(), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False)
    with pytest.raises(Exception, match="lightning_mm.MultimodalModel"):
        trainer.fit(Plain(), torch.utils.data.DataLoader([torch.zeros(2)]))


STALE_LOCAL_RANK_SCRIPT = """
import lightning as L
import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()}, language_model=lmm.ParallelSpec())
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model("llama"))
trainer.fit(lmm.MultimodalLightningModule(model), lmm.data.SyntheticMultimodalDataModule(num_samples=4, batch_size=2))
"""


@pytest.mark.slow
def test_a_stale_local_rank_is_an_error_not_a_wait_for_ranks_nobody_starts(tmp_path):
    """LOCAL_RANK left in the environment (Lightning's launcher writes it into the process that ran a Trainer)
    makes Lightning start no other rank; rank 0 must say so instead of waiting in the rendezvous forever."""
    script = tmp_path / "stale.py"
    script.write_text(STALE_LOCAL_RANK_SCRIPT)
    proc = run_script(str(script), cwd=tmp_path, timeout=180, env={"LOCAL_RANK": "0", "NODE_RANK": "0"}, check=False)
    assert proc.returncode != 0
    assert "LOCAL_RANK=0 is set in the environment but WORLD_SIZE is not" in proc.stderr, proc.stderr[-3000:]
