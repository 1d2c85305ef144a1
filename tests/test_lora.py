"""LoRA through peft: the same loss and gradients as a peft model built directly, only adapters (and chosen parts)
train, the planner costs adapters as small trainable weights, and exports load back in transformers / peft."""

import copy
import os

import peft
import pytest
import torch
from transformers import LlamaForCausalLM

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.model.lora import merge_lora, save_lora
from lightning_mm.planner.costs import CostModel, LayerProfile
from lightning_mm.planner.model_costs import flop_times, model_layer_costs, part_parameters, part_tokens, \
    profile_times, sample_batch
from tests.helpers.launch import run_trainer_case

MODULES = ["q_proj", "v_proj"]
LORA = dict(r=4, alpha=8, init_lora_weights=False)  # random A and B, so every adapter gets a gradient


def _model(seed=0):
    """(a VLM with a frozen encoder and a trainable projector, a copy of its LLM as built)."""
    torch.manual_seed(seed)
    lm = tiny_language_model("llama")
    original = copy.deepcopy(lm)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")}, lm)
    model.freeze(encoders=True, projectors=False)
    return model, original


def _batch(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    enc, pid = model.encoders["vision"], model.placeholder_ids["vision"]
    samples = [{"input_ids": [5, pid, 7, 9, 11, 30, 31],
                "vision": enc.family.random_inputs(enc.module.config, 1, generator=g)},
               {"input_ids": [3, 4, pid, 8, 12, 13, 14, 20, 21, 40],
                "vision": enc.family.random_inputs(enc.module.config, 1, generator=g)}]
    return lmm.data.MultimodalCollator(model, causal_modalities=True)(samples)  # plain causal: HF's own mask


def _adapters(module):
    return {n: p for n, p in module.named_parameters() if ".lora_" in n}


def test_lora_loss_and_gradients_equal_a_peft_model_built_directly():
    model, original = _model()
    ref_encoder = copy.deepcopy(model.encoders["vision"])
    model.add_lora(MODULES, **LORA)
    ref_lm = copy.deepcopy(original)
    ref_lm.set_attn_implementation("eager")
    ref = peft.get_peft_model(ref_lm, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=MODULES,
                                                      task_type="CAUSAL_LM", init_lora_weights=False))
    ours = _adapters(model.language_model)
    theirs = {n.removeprefix("base_model.model."): p for n, p in _adapters(ref).items()}
    assert set(ours) == set(theirs) and len(ours) == 4 * 4  # 4 layers x 2 modules x (A, B)
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(ours[n])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"language_model.{n}" for n in ours} | {
        f"encoders.vision.projector.{n}" for n, _ in model.encoders["vision"].projector.named_parameters()}

    batch = _batch(model)
    out = model(**batch)
    out.loss.backward()
    # the reference merges the projected features into the embeddings by hand and runs peft's model
    ids, is_image = batch["input_ids"], batch["input_ids"] == model.placeholder_ids["vision"]
    feats = ref_encoder(batch["vision"])
    embeds = ref.get_input_embeddings()(ids.masked_fill(is_image, 0))
    embeds = embeds.masked_scatter(is_image[..., None], feats)
    expected = ref(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"])
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-6, rtol=1e-6)
    for n, p in ours.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
        torch.testing.assert_close(p.grad, theirs[n].grad, atol=1e-6, rtol=1e-4, msg=n)
    # the frozen base ran backward for input gradients only: the projector below it got the same gradients
    for (n, p), q in zip(model.encoders["vision"].projector.named_parameters(), ref_encoder.projector.parameters()):
        assert p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=n)
    assert all(p.grad is None for n, p in model.language_model.named_parameters() if ".lora_" not in n)


def test_one_optimiser_step_changes_only_adapters_and_the_projector():
    model, _ = _model(seed=2)
    module = lmm.MultimodalLightningModule(model, lr=1e-2, lora={"modules": MODULES, **LORA})
    assert model.peft_model is not None
    opt = module.configure_optimizers()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module.compute_loss(_batch(model)).backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    expected = {n for n in before if ".lora_" in n or n.startswith("encoders.vision.projector.")}
    assert changed == expected
    assert any("base_layer" in n for n in before)  # the adapted weights themselves stayed


def test_merged_export_is_a_plain_folder_transformers_loads_with_the_adapted_logits(tmp_path):
    model, original = _model(seed=3)
    model.add_lora(MODULES, **LORA)
    model.eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    save_lora(model, tmp_path / "merged", merge=True)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n or "base_layer" in n for n in loaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)
    # the whole model's export (one folder per part) holds the merged language model too
    from lightning_mm.checkpoint import export_hf, load_hf

    export_hf(None, model, tmp_path / "parts")
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "parts")(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)
    # the adapters alone, as peft saves them, on the original base
    save_lora(model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(original), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)
        # the model kept training form; merging in place leaves a plain model with the same logits
        assert model.peft_model is not None and _adapters(model)
        merge_lora(model)
        assert model.peft_model is None and not _adapters(model)
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)


def test_a_peft_wrapped_language_model_is_accepted():
    torch.manual_seed(4)
    lm = tiny_language_model("qwen2")
    wrapped = peft.get_peft_model(lm, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"],
                                                      task_type="CAUSAL_LM", init_lora_weights=False))
    model = lmm.MultimodalModel({}, wrapped)
    assert model.peft_model is wrapped and model.language_model is lm
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"language_model.{n}" for n in _adapters(lm)}
    ids = torch.randint(0, 128, (2, 10))
    # the multimodal forward (bitfield attention) and peft's own forward of the wrapper (its sdpa) agree
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, wrapped(input_ids=ids, labels=ids).loss,
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        model.add_lora(["q_proj"])
    prefix = peft.get_peft_model(tiny_language_model("qwen2"), peft.PrefixTuningConfig(num_virtual_tokens=2,
                                                                                       task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="other than LoRA are not supported.*PREFIX_TUNING"):
        lmm.MultimodalModel({}, prefix)


@pytest.mark.slow
def test_planner_costs_adapters_as_small_trainable_weights():
    """FLOP costs: every LLM layer with adapters is trainable and its weight-gradient work is exactly the
    adapters' (2 x tokens x r x (in + out) per adapted linear map); a profile's is scaled to the trainable share."""
    model, _ = _model(seed=5)
    model.freeze(language_model=True)
    batch = sample_batch(model, rows=1, text_tokens=16)
    frozen = flop_times(model, batch)["language_model"]
    model.add_lora(MODULES, r=4, alpha=8)
    times = flop_times(model, batch)["language_model"]
    costs = model_layer_costs(model, batch=batch)["language_model"]
    tokens = part_tokens(model, batch)["language_model"]
    cfg = model.language_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q_out, v_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = 2 * tokens * 4 * ((cfg.hidden_size + q_out) + (cfg.hidden_size + v_out))
    assert frozen.weight_grad[1:-1] == [0.0] * 4
    assert times.weight_grad[1:-1] == [float(per_layer)] * 4
    assert all(c.trainable and c.in_backward for c in costs)
    # vs the whole layer trainable
    model.freeze(language_model=False)
    full = flop_times(model, batch)["language_model"]
    assert all(0 < a < 0.15 * f for a, f in zip(times.weight_grad[1:-1], full.weight_grad[1:-1]))
    model.freeze(language_model=True)
    for p in _adapters(model.language_model).values():
        p.requires_grad_(True)
    # a measured profile (weight gradients of all of a part's weights) is scaled to the trainable share
    const = CostModel(0.0, 0.0, 1.0)
    ten = CostModel(0.0, 0.0, 10.0)
    profile = {m: [LayerProfile(const, const, ten) for _ in parts] for m, parts in part_parameters(model).items()}
    got = profile_times(model, profile, batch)["language_model"]
    for w, params in zip(got.weight_grad[1:-1], part_parameters(model)["language_model"][1:-1]):
        share = sum(p.numel() for p in params if p.requires_grad) / sum(p.numel() for p in params)
        assert 0 < share < 0.1
        assert w == pytest.approx(10.0 * share)


CASE = os.path.join(os.path.dirname(__file__), "helpers", "lora_generation_case.py")


def _run(case: dict, tmp_path, name: str):
    return run_trainer_case(CASE, case, tmp_path, name)


@pytest.mark.slow
@pytest.mark.combines("lora", "pipeline", "generation")
@pytest.mark.combines("lora", "placement", "generation")
def test_lora_trains_under_the_strategy_like_one_process_and_predict_generates(tmp_path):
    """LoRA + a trainable projector, 2 SGD steps: LLM in 2 pipeline stages (3 processes) and 2 data-parallel
    replicas of the whole model (encoders replicated) train exactly like one process. trainer.predict with
    generation= decodes on each replica of the whole model, and greedily across pipeline stages."""
    ref, ref_params = _run({"devices": 1}, tmp_path, "single")
    assert all(".lora_" in n or ".projector." in n for n in ref_params) and len(ref_params) > 16
    for case, name in (({"devices": 3, "llm_pp": 2}, "pp2"), ({"devices": 2, "placement": "replicated"}, "dp2")):
        got, params = _run(case, tmp_path, name)
        torch.testing.assert_close(torch.tensor(got["train"]), torch.tensor(ref["train"]), rtol=1e-5, atol=1e-6)
        assert set(params) == set(ref_params)
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)
        if name == "pp2":  # greedy stage to stage (lightning_mm.parallel.pipeline_generation): one process's tokens
            assert all(g == ref["expected"][0] for g in got["generated"]), (got, ref["expected"])
        else:
            assert got["generated"] == got["expected"] and got["generated"] == ref["expected"], got


@pytest.mark.slow
@pytest.mark.combines("lora", "tp", "placement")
@pytest.mark.combines("lora", "fsdp", "placement")
def test_lora_under_tensor_parallelism_and_fsdp_trains_like_one_process(tmp_path):
    """LoRA on column-wise (q, v, up) and row-wise (o, down) maps of the LLM: under tp 2 the base layer takes the
    plan's style, lora_B splits like a column-wise base and lora_A like a row-wise one; under FULL_SHARD dp 2 the
    adapters are sharded like every parameter. 2 SGD steps equal one process."""
    modules = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    ref, ref_params = _run({"devices": 1, "predict": False, "lora_modules": modules}, tmp_path, "single")
    for case, name in (({"llm_tp": 2}, "tp2"), ({"sharding": "FULL_SHARD"}, "fsdp2")):
        got, params = _run({"devices": 2, "placement": "replicated", "predict": False, "lora_modules": modules,
                            **case}, tmp_path, name)
        torch.testing.assert_close(torch.tensor(got["train"]), torch.tensor(ref["train"]), rtol=1e-5, atol=1e-6)
        assert set(params) == set(ref_params)
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


@pytest.mark.refuses("lora", "tp", message="LoRA dropout on 'self_attn.q_proj' under tensor parallelism")
def test_lora_dropout_under_tensor_parallelism_is_refused():
    from lightning_mm.parallel.tensor_parallel import _styles

    model = lmm.MultimodalModel({}, tiny_language_model())
    model.add_lora(["q_proj", "o_proj"], r=2, dropout=0.1)
    layer = model.lm_family.layers(model.language_model)[0]
    with pytest.raises(ValueError, match="LoRA dropout on 'self_attn.q_proj' under tensor parallelism"):
        _styles(layer, "self_attn.q_proj", "colwise")
    model = lmm.MultimodalModel({}, tiny_language_model())
    model.add_lora(["q_proj", "o_proj"], r=2)
    layer = model.lm_family.layers(model.language_model)[0]
    assert set(_styles(layer, "self_attn.q_proj", "colwise")) == {"self_attn.q_proj.base_layer",
                                                                  "self_attn.q_proj.lora_B.default"}
    assert set(_styles(layer, "self_attn.o_proj", "rowwise")) == {"self_attn.o_proj.base_layer",
                                                                  "self_attn.o_proj.lora_A.default"}
    assert set(_styles(layer, "mlp.up_proj", "colwise")) == {"mlp.up_proj"}
