"""Mixture-of-experts LLMs (Qwen3-MoE, Mixtral) inside MultimodalModel: the family's own forward and
load-balancing loss, and pipeline training exactly like one process."""

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.model.moe import MOE_FAMILIES, load_imbalance

KINDS = sorted(MOE_FAMILIES)


def _model(kind, **overrides):
    torch.manual_seed(0)
    lm = tiny_language_model(kind, **overrides)
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")}, lm), lm


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("aux", [False, True])
def test_text_part_equals_the_family_forward(kind, aux):
    """Logits, loss (with ``coef * aux`` when ``output_router_logits``) and aux loss equal HF's own LLM."""
    model, lm = _model(kind, output_router_logits=aux)
    assert lm.config.num_experts_per_tok == 2 and MOE_FAMILIES[kind].num_experts(lm) == 8
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    ref = lm(input_ids=ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-6)
    expected = ref.loss if aux else ref.loss - lm.config.router_aux_loss_coef * ref.aux_loss
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_is_left_out_as_hf_attention_mask_does(kind):
    """Padding (mask word 0) counts in no router statistic, as HF's ``attention_mask`` in the aux loss."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model, lm = _model(kind)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    out = model(input_ids=ids, attention_mask=mask)
    ref = lm(input_ids=ids, attention_mask=mask, output_router_logits=True)
    expected = load_balancing_loss_func(ref.router_logits, 8, 2, mask)
    torch.testing.assert_close(out.aux_loss, expected, rtol=1e-5, atol=1e-6)


def test_aux_loss_is_not_a_mean_of_per_layer_losses():
    """HF sums counts and probabilities over layers before the product (the reason stages pass their sums on)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, lm = _model("qwen3_moe")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = lm(input_ids=ids, output_router_logits=True).router_logits
    whole = load_balancing_loss_func(logits, 8, 2)
    per_layer = torch.stack([load_balancing_loss_func((g,), 8, 2) for g in logits])
    assert not torch.allclose(whole, per_layer.mean())


def test_load_imbalance_is_max_over_mean():
    load = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(load_imbalance(load), torch.tensor([1.0, 4.0]))


# (kind, aux, LLM ParallelSpec, dp, microbatches, activation checkpointing, sharding)
PIPELINE_CASES = [
    ("qwen3_moe", False, {"pp": 2}, 1, 2, False, "NO_SHARD"),
    pytest.param(("qwen3_moe", True, {"pp": 2}, 1, 2, False, "NO_SHARD"), marks=pytest.mark.ci),
    ("mixtral", False, {"pp": 2}, 1, 2, False, "NO_SHARD"),
    ("mixtral", True, {"pp": 2}, 1, 2, False, "NO_SHARD"),
    pytest.param(("qwen3_moe", True, {"pp": 2}, 1, 2, True, "NO_SHARD"),
                 marks=pytest.mark.combines("pipeline", "activation_checkpointing")),
    ("qwen3_moe", True, {"tp": 2}, 1, 2, False, "NO_SHARD"),
    ("mixtral", True, {"cp": 2}, 1, 2, False, "NO_SHARD"),
    ("qwen3_moe", True, {"pp": 1}, 2, 2, False, "FULL_SHARD"),
    ("qwen3_moe", True, {"ep": 2}, 2, 2, False, "NO_SHARD"),
    pytest.param(("mixtral", True, {"pp": 2, "ep": 2}, 2, 2, False, "NO_SHARD"),
                 marks=pytest.mark.combines("ep", "pipeline")),
    pytest.param(("qwen3_moe", True, {"cp": 2, "ep": 2}, 2, 2, False, "NO_SHARD"),
                 marks=pytest.mark.combines("ep", "llm_cp")),
    pytest.param(("qwen3_moe", True, {"tp": 2, "ep": 2}, 2, 2, False, "NO_SHARD"),
                 marks=pytest.mark.combines("ep", "tp")),
    ("mixtral", False, {"ep": 2}, 2, 2, False, "NO_SHARD"),
    ("qwen3_moe", False, {"pp": 2, "ep": 2}, 2, 2, False, "NO_SHARD"),
    ("mixtral", True, {"cp": 2, "ep": 2}, 2, 2, False, "NO_SHARD"),
    pytest.param(("qwen3_moe", True, {"ep": 2}, 2, 2, False, "FULL_SHARD"), marks=pytest.mark.combines("ep", "fsdp")),
    pytest.param(("mixtral", True, {"pp": 2, "ep": 2}, 2, 2, True, "SHARD_GRAD_OP"),
                 marks=pytest.mark.combines("ep", "pipeline", "activation_checkpointing", "fsdp")),
]


def _case_id(c):
    kind, aux, llm, dp, mbs, recompute, sharding = c
    spec = "-".join(f"{k}{v}" for k, v in llm.items())
    return f"{kind}-aux{int(aux)}-llm_{spec}-dp{dp}" + ("-recompute" if recompute else "") + \
        ("" if sharding == "NO_SHARD" else f"-{sharding}")


@pytest.mark.slow
@pytest.mark.parametrize("case", PIPELINE_CASES, ids=_case_id)
def test_layout_trains_like_one_process(case):
    """Vision pp 1 + a MoE LLM (pp 2 on 3 gloo ranks; tp 2; cp 2; FSDP2 over dp 2; activation checkpointing): the
    losses (aux included), the aux losses, the global gradient norms and every parameter after three SGD steps equal
    one process running the same microbatches."""
    check_layout_like_one_process(case)


@pytest.mark.slow
def test_an_expert_parallel_rank_that_receives_no_token_under_fsdp():
    """Qwen3-MoE ep 2 over dp 2 under FULL_SHARD, the router never choosing experts 4-7 (ep rank 1's): that rank
    receives no token for any of its experts in any microbatch, yet runs every collective, and training equals one
    process (its experts get no gradient, as in one process)."""
    load = check_layout_like_one_process(("qwen3_moe", True, {"ep": 2}, 2, 2, False, "FULL_SHARD"), (4, 5, 6, 7))
    assert float(load[:, 4:].sum()) == 0 and float(load[:, :4].sum()) > 0


def check_layout_like_one_process(case, silent_experts=()):
    """Runs ``case`` on every rank and in one process and compares them; returns the last step's expert load."""
    from helpers.distributed import run_distributed
    from helpers.moe_case import build_moe_model, run_rank, train_reference, world_of
    from helpers.pipeline_case import global_batches

    kind, aux, llm, dp, microbatches, recompute, sharding = case
    steps, rows = 3, 4 * dp
    model = build_moe_model(kind, aux, silent_experts)
    batches = global_batches(model, steps, rows)
    ref_losses, ref_aux, ref_params, ref_norms = train_reference(model, batches, microbatches, dp)
    results = run_distributed(run_rank, world_of(llm, dp), kind, aux, llm, dp, microbatches, steps, rows, recompute,
                              sharding, silent_experts)
    merged = {}
    ep = llm.get("ep", 1)
    for losses, auxes, params, load, (held, whole), norms in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(auxes), torch.tensor(ref_aux), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            if name in merged:
                torch.testing.assert_close(p, merged[name], rtol=0, atol=0)
            merged[name] = p
        assert load.shape == (4, 8)  # every routed layer, on every rank
        assert float(load.sum()) > 0
        # an LLM rank holds 1/ep of its stage's expert weights (FSDP without ep: 1/dp; encoder ranks: none)
        assert held * (ep if ep > 1 else dp if sharding != "NO_SHARD" else 1) == whole
    assert set(merged) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(merged[name], p, rtol=1e-4, atol=1e-5, msg=name)
    assert ref_losses[0] != ref_losses[-1]
    return load


class _Metrics:
    """Collects what the module logged at each training step."""

    def __init__(self):
        self.steps = []

    def callback(self):
        import lightning as L

        steps = self.steps

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})

        return Record()


@pytest.mark.parametrize("strategy", ["auto", "multimodal"])
def test_lightning_logs_aux_loss_and_expert_load(strategy):
    """``train/aux_loss`` on every step, and on the steps Lightning writes logs each routed layer's expert shares
    (summing to 1) and imbalance (max/mean >= 1), in one process and through the pipeline engine alike."""
    import lightning as L

    model, lm = _model("qwen3_moe", output_router_logits=True)
    metrics = _Metrics()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[metrics.callback()], log_every_n_steps=2)
    trainer.fit(lmm.MultimodalLightningModule(model, lr=1e-3),
                datamodule=lmm.data.SyntheticMultimodalDataModule(num_samples=8, batch_size=4, model=model))
    assert len(metrics.steps) == 4
    assert not any(k.startswith("train/expert_") for k in metrics.steps[0]), "not a logging step"
    for step in metrics.steps:
        assert step["train/aux_loss"] > 0
    for step in metrics.steps[1::2]:
        for i in range(lm.config.num_hidden_layers):
            assert step[f"train/expert_imbalance/layer_{i}"] >= 1.0
            shares = [step[f"train/expert_load/layer_{i}/expert_{e}"] for e in range(8)]
            assert sum(shares) == pytest.approx(1.0, abs=1e-5)


def test_expert_parallel_refusals_before_any_process_group():
    """ep on an encoder, on a dense LLM, not dividing the experts or the replicas: a clear error from the pure
    checks."""
    from lightning_mm.model import tiny_language_model
    from lightning_mm.parallel.expert_parallel import check_expert_parallel
    from lightning_mm.parallel.meshes import expert_grad_ranks
    from lightning_mm.plan.layout import ParallelSpec, build_layout

    vision = {"vision": ParallelSpec()}
    with pytest.raises(ValueError, match="ep=2 splits experts over data-parallel ranks"):
        build_layout(vision, ParallelSpec(ep=2), 6, "parallel", ["vision"])  # dp 3
    with pytest.raises(ValueError, match="expert parallelism applies to a mixture-of-experts language model only"):
        build_layout({"vision": ParallelSpec(ep=2)}, ParallelSpec(), 4, "parallel", ["vision"])
    layout = build_layout(vision, ParallelSpec(pp=2, ep=2), 12, "parallel", ["vision"])  # dp 4
    assert layout.ep == 2
    assert expert_grad_ranks(layout) == [[1, 7], [4, 10], [2, 8], [5, 11]]  # per (stage, ep index): its 2 groups
    model, _ = _model("qwen3_moe")
    check_expert_parallel(model, layout)
    dense = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model())
    with pytest.raises(ValueError, match="has no routed experts"):
        check_expert_parallel(dense, layout)
    with pytest.raises(ValueError, match="does not divide the 8 experts"):
        check_expert_parallel(model, build_layout(vision, ParallelSpec(ep=3), 6, "parallel", ["vision"]))


TRAINER_CASE = str(__import__("pathlib").Path(__file__).parent / "helpers" / "trainer_case.py")


@pytest.mark.slow
@pytest.mark.combines("pipeline", "accumulation")
def test_strategy_trains_a_moe_llm_like_one_process(tmp_path):
    """Through Lightning and MultimodalParallelStrategy: Qwen3-MoE with the aux loss on, LLM pp 2 (4 processes),
    clipping and accumulation: every step's loss, the aux loss it logged and every parameter as one process (one
    microbatch per step: one process's forward is one microbatch). Then ep 2 over dp 2 with the aux loss off (one
    process sees both replicas' rows as one microbatch, so only the reported aux values differ)."""
    from tests.helpers.launch import run_trainer_case

    def same(got, ref, aux=True):
        (res, params), (ref_res, ref_params) = got, ref
        torch.testing.assert_close(torch.tensor(res["train"]), torch.tensor(ref_res["train"]), rtol=1e-5, atol=1e-6)
        assert len(res["aux_loss"]) == len(res["train"])
        if aux:
            torch.testing.assert_close(torch.tensor(res["aux_loss"]), torch.tensor(ref_res["aux_loss"]), rtol=1e-5,
                                       atol=1e-6)
        assert set(params) == set(ref_params)
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)

    base = dict(llm="qwen3_moe", llm_config={"output_router_logits": True, "router_aux_loss_coef": 0.5},
                modalities=["vision"], freeze="all", optimizer="sgd", lr=0.5, steps=2, accumulate=2, clip=0.5)
    same(run_trainer_case(TRAINER_CASE, {**base, "llm_pp": 2}, tmp_path, "pp2"),
         run_trainer_case(TRAINER_CASE, base, tmp_path, "single"))
    base = dict(base, llm_config={"output_router_logits": False}, dp=2, accumulate=1)
    got = run_trainer_case(TRAINER_CASE, {**base, "llm_pp": 1, "llm_ep": 2, "consolidate": True}, tmp_path, "ep2")
    ref = run_trainer_case(TRAINER_CASE, base, tmp_path, "single_dp2")
    same(got, ref, aux=False)
    assert got[0]["consolidated"] == sorted(ref[1])  # a sharded checkpoint of the split experts consolidates


@pytest.mark.slow
@pytest.mark.combines("ep", "per_module_dp")
def test_expert_parallelism_under_per_module_dp_trains_like_one_process():
    """The vision tower on 1 replica beside a Qwen3-MoE LLM (trained, with the projector) on 2 replicas whose experts
    are split over them (ep 2; 3 processes, each microbatch's features routed from the one vision replica to both
    LLM replicas), samples of 0-5 images of different sizes: every loss and every parameter as one process."""
    from helpers.distributed import run_distributed
    from helpers.per_module_dp_case import run_rank, run_reference
    from helpers.pipeline_case import check_like_reference

    ref_losses, ref_params = run_reference(("vision",), "llm", 3, 8, llm="qwen3_moe")
    assert any(".mlp.experts." in n for n in ref_params)
    results = run_distributed(run_rank, 3, ("vision",), "llm", {"vision": dict(dp=1)}, dict(dp=2, ep=2), 2, 3,
                              8, 0.5, False, "NO_SHARD", "qwen3_moe")
    check_like_reference(results, ref_losses, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", pytest.param("entrain", marks=pytest.mark.combines("ep", "pipeline",
                                                                                           "balancing"))])
@pytest.mark.combines("ep", "pipeline")
def test_expert_parallel_pipeline_with_batch_balancing_trains_like_one_process(method, tmp_path):
    """dp 2 x (vision pp 1 + Qwen3-MoE LLM pp 2 x ep 2), 6 processes, samples of 0-5 images of different sizes (some
    text-only), with and without entrain balancing: every step's loss and every parameter as one process on the same
    global batches (aux loss off: balancing regroups rows into other microbatches, whose per-microbatch aux loss
    differs by design)."""
    from tests.helpers.launch import run_trainer_case
    from tests.test_lightning_contracts import assert_same_training

    base = dict(llm="qwen3_moe", llm_config={"output_router_logits": False}, modalities=["vision"],
                vision="qwen2_vl", items=[0, 5], freeze="all", optimizer="sgd", lr=0.5, steps=2, batch_size=6,
                dp=2, plans=True)
    got = run_trainer_case(TRAINER_CASE, {**base, "llm_pp": 2, "llm_ep": 2, "microbatches": 2, "balancing": method},
                           tmp_path, method)
    assert_same_training(got, run_trainer_case(TRAINER_CASE, base, tmp_path, "single"))
    assert len(got[0]["plans"]) == (0 if method == "none" else 2)
    if method == "entrain":
        assert got[0]["deferred_samples"] > 0, "nothing was deferred"
