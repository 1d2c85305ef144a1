"""Gemma 4's text decoder (local sliding-window and global layers with their own head size, attention scaling 1,
final logit softcapping; dense, and with routed experts beside each MLP) inside MultimodalModel computes exactly
what transformers' ``Gemma4ForCausalLM`` computes (fp32, tiny random models, sequences longer than the window);
what it cannot serve is refused with the fix."""

import copy
import json

import pytest
import torch

import lightning_mm as lmm
from helpers.text_lm_case import compare_with_hf, left_padded
from lightning_mm.model import families, tiny_language_model


def _gemma4(seed=0, **overrides):
    """A tiny ``Gemma4ForCausalLM`` with every tensor distinct (HF initialises norms to constants)."""
    torch.manual_seed(seed)
    lm = tiny_language_model("gemma4_text", **overrides)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return lm


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gemma4_text_with_window_shorter_than_sequence_equals_hf(moe, implementation):
    lm = _gemma4(moe=moe, attention_k_eq_v=moe)  # the MoE case also takes values from the key projection
    assert families.layer_windows(lm) == [8, 8, None, None]
    heads = [layer.self_attn.head_dim for layer in lm.model.layers]
    assert heads == [8, 8, 16, 16] and lm.model.layers[0].self_attn.scaling == 1.0  # global layers' own head size
    assert lm.model.layers[0].enable_moe_block == moe
    if moe:
        assert lm.model.layers[2].self_attn.v_proj is None
    ids = torch.randint(0, 128, (2, 29))
    labels = ids.clone()
    labels[0, :4] = -100
    out = compare_with_hf(lm, ids, labels, implementation=implementation)
    # the window matters: without it the model computes something else
    wide = copy.deepcopy(lm)
    for layer in wide.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 1000
    with torch.no_grad():
        assert not torch.allclose(lmm.MultimodalModel({}, wide)(input_ids=ids).logits, out.logits, atol=1e-3)


def test_gemma4_text_left_padding_equals_hf():
    lm = _gemma4(seed=1, sliding_window=4, moe=True)
    ids = torch.randint(0, 128, (2, 21))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 6] = -100  # HF would score it from the logits of a padding token
    compare_with_hf(lm, ids, labels, attention_mask=mask)


@pytest.mark.parametrize("moe", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "moe"])
def test_gemma4_greedy_generation_past_the_window_equals_hf(moe):
    lm = _gemma4(seed=2, sliding_window=4, moe=moe)
    ref = copy.deepcopy(lm)
    ref.set_attn_implementation("eager")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ours = lmm.MultimodalModel({}, lm).eval().generate(ids, max_new_tokens=8, do_sample=False,
                                                           return_dict_in_generate=True, output_logits=True)
        theirs = ref.eval().generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                                     output_logits=True)
    assert ours.sequences.tolist() == theirs.sequences[:, ids.shape[1]:].tolist()
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"step {step}")


def test_gemma4_text_folder_loads_and_saves_back_exactly(tmp_path):
    """A ``Gemma4ForCausalLM`` folder loads as the language model, computes HF's loss, and ``save_pretrained``
    writes a folder HF's class loads with exactly the same tensors."""
    import transformers

    lm = _gemma4(seed=3, moe=True)
    lm.save_pretrained(tmp_path / "src")
    model = lmm.MultimodalModel({}, language_model=str(tmp_path / "src"))
    ref = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "src", attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss,
                                   atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path / "out")
    written = [d for d in (tmp_path / "out").rglob("config.json")]
    assert len(written) == 1, written
    back = transformers.Gemma4ForCausalLM.from_pretrained(written[0].parent).state_dict()
    original = ref.state_dict()
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize("overrides, match", [
    (dict(hidden_size_per_layer_input=4), "per-layer embeddings.*hidden_size_per_layer_input=0"),
    (dict(num_kv_shared_layers=1), "KV sharing.*num_kv_shared_layers=0"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'.*use_bidirectional_attention=None"),
], ids=["per_layer_embeddings", "kv_sharing", "bidirectional"])
def test_gemma4_text_features_not_served_are_refused_with_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        lmm.MultimodalModel({}, tiny_language_model("gemma4_text", **overrides))


# ---------------------------------------------------------------------------------------------- the composite
def _gemma4_folder(path, text=None, **extra) -> str:
    """A tiny ``Gemma4ForConditionalGeneration`` folder: the text model above (local layers with a 7-token window,
    shorter than the rows), a 2-layer tower of 4-pixel patches pooled 2 x 2."""
    import transformers as tf

    from tests.test_hf_composites import IMG, VEND, VSTART, save_hf

    text_config = families.LANGUAGE_FAMILIES["gemma4_text"].tiny_config(sliding_window=7, **(text or {})).to_dict()
    _, _, vision = families.ENCODER_FAMILIES["Gemma4VisionModel"].tiny_spec()
    cfg = tf.Gemma4Config(text_config=text_config, vision_config=vision, image_token_id=IMG, boi_token_id=VSTART,
                          eoi_token_id=VEND, **extra)
    torch.manual_seed(0)
    return save_hf(tf.Gemma4ForConditionalGeneration(cfg), "gemma4", path)


def _gemma4_batch(config):
    """(our batch, HF's inputs): row 0 with two 4 x 4-patch images (4 tokens each), row 1 with one image whose
    last two patch rows are padding (2 tokens), right padding."""
    from tests.test_hf_composites import IMG, PAD, _row

    fam = families.ENCODER_FAMILIES["Gemma4VisionModel"]
    inputs = fam.random_inputs(config.vision_config, 3, generator=torch.Generator().manual_seed(1))
    inputs["image_position_ids"][2, 8:] = -1
    inputs["pixel_values"][2, 8:] = 0
    counts = [[4, 4], [2]]
    rows = [_row(c) for c in counts]
    ids = torch.full((2, max(map(len, rows))), PAD)
    attention = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        attention[r, :len(row)] = 1
    labels = ids.masked_fill((ids == IMG) | (attention == 0), -100)
    ours = {"input_ids": ids, "attention_mask": attention, "labels": labels, "vision": inputs}
    return ours, dict(inputs, input_ids=ids, attention_mask=attention, labels=labels)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gemma4_composite_equals_hf_and_saves_back_exactly(moe, tmp_path):
    """``Gemma4ForConditionalGeneration`` from its folder: the tower (patches with their grid positions, padding
    patches dropped by the pooler), ``embed_vision`` as the projector and the text model give HF's loss, logits
    and every gradient; ``save_pretrained`` writes a folder HF's class loads with exactly the same tensors."""
    import transformers

    from tests.test_hf_composites import IMG, assert_like_hf

    folder = _gemma4_folder(tmp_path / "src", text=dict(moe=moe))
    ref = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager").train()
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    assert model.placeholder_ids == {"vision": IMG} and not model.bidirectional_items
    assert families.layer_windows(model.language_model) == [7, 7, None, None]
    batch, hf_inputs = _gemma4_batch(ref.config)
    assert model.encoders["vision"].num_tokens(batch["vision"]) == [4, 4, 2]
    assert_like_hf(model, ref, model.composite.spec, batch, hf_inputs, logits_atol=1e-4)

    model.save_pretrained(tmp_path / "out")
    back = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "out").state_dict()
    original = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder).state_dict()
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name


@pytest.mark.parametrize("blocks", [pytest.param(None, marks=pytest.mark.slow), "vision"],
                         ids=["causal", "vision_blocks"])
def test_gemma4_composite_generate_equals_hf_generate(blocks, tmp_path):
    """Greedy tokens and every step's logits of ``generate`` equal HF's composite ``generate`` on the left-padded
    batch (decoding past the local layers' window), causal and with image blocks on the local layers."""
    import transformers

    from tests.test_hf_composites import IMG, PAD

    folder = _gemma4_folder(tmp_path / "src", text=dict(use_bidirectional_attention=blocks))
    ref = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager").eval()
    model = lmm.MultimodalModel.from_pretrained(folder).eval()
    batch, _ = _gemma4_batch(ref.config)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    left_ids, left_mask = left_padded(ids, mask, PAD)
    with torch.no_grad():
        theirs = ref.generate(**batch["vision"], input_ids=left_ids, attention_mask=left_mask,
                              mm_token_type_ids=(left_ids == IMG).long(), max_new_tokens=8, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=PAD)
        ours = model.generate(input_ids=ids, attention_mask=mask, vision=batch["vision"], max_new_tokens=8,
                              do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(ours.sequences, theirs.sequences[:, left_ids.shape[1]:]), (ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"step {step}")


@pytest.mark.parametrize("extra, match", [
    (dict(audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4)), "audio tower"),
], ids=["audio"])
def test_gemma4_composite_parts_not_served_are_refused(extra, match, tmp_path):
    from lightning_mm.model.loading import ModelFolderError

    folder = _gemma4_folder(tmp_path / "src", **extra)
    with pytest.raises(ModelFolderError, match=match):
        lmm.MultimodalModel.from_pretrained(folder)


def test_gemma4_composite_image_blocks_on_local_layers_only_equal_hf(tmp_path, monkeypatch):
    """``use_bidirectional_attention="vision"``: on local layers each image's tokens see each other (within the
    window), global layers stay causal, as HF's ``create_masks_for_vision_model``; loss, logits and every gradient
    equal HF's. Image blocks on every layer (Gemma 3's pattern), or on none, compute something else."""
    import transformers

    from lightning_mm.attention import hf as hf_attention
    from tests.test_hf_composites import IMG, assert_like_hf

    folder = _gemma4_folder(tmp_path / "src", text=dict(use_bidirectional_attention="vision"))
    ref = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager").train()
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    assert model.bidirectional_items
    batch, hf_inputs = _gemma4_batch(ref.config)
    hf_inputs["mm_token_type_ids"] = (hf_inputs["input_ids"] == IMG).long()
    assert_like_hf(model, ref, model.composite.spec, batch, hf_inputs, logits_atol=1e-4)
    ours = {k: v for k, v in batch.items() if k != "labels"}
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = ref.eval()(**{k: v for k, v in hf_inputs.items() if k != "labels"}).logits[keep]
        model.eval()
        monkeypatch.setattr(hf_attention, "_blocks_on_local_layers_only", lambda module: False)
        assert not torch.allclose(model(**ours).logits[keep], expected, atol=1e-3)  # blocks on global layers too
        model.bidirectional_items = False
        assert not torch.allclose(model(**ours).logits[keep], expected, atol=1e-3)  # no blocks


def test_gemma4_experts_take_expert_parallelism_from_their_plan_and_dense_gemma4_is_refused():
    """With ``enable_moe_block`` the layout check passes ep 2 (its 4 experts) and splits only the experts of
    transformers' ep plan (its colwise / rowwise entries for the dense MLP beside them would split that MLP over
    ranks holding different tokens); ep 3 and a dense Gemma 4 are refused with the fix, before any group."""
    from lightning_mm.model.moe import expert_layer_plan
    from lightning_mm.parallel.expert_parallel import check_expert_parallel
    from lightning_mm.plan.layout import build_layout

    vision = {"vision": lmm.ParallelSpec()}
    moe = lmm.MultimodalModel({}, _gemma4(moe=True))
    assert "layers.*.mlp.gate_proj" in moe.language_model.config.base_model_ep_plan
    assert expert_layer_plan(moe.language_model) == {"experts.gate_up_proj": "grouped_gemm",
                                                     "experts.down_proj": "grouped_gemm",
                                                     "experts": "ep_dispatch_experts"}
    check_expert_parallel(moe, build_layout(vision, lmm.ParallelSpec(ep=2), 4, "parallel", ["vision"]))
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 experts; choose an ep dividing 4"):
        check_expert_parallel(moe, build_layout(vision, lmm.ParallelSpec(ep=3), 6, "parallel", ["vision"]))
    dense = lmm.MultimodalModel({}, _gemma4())
    with pytest.raises(ValueError, match="Gemma4ForCausalLM has no routed experts; use ep=1"):
        check_expert_parallel(dense, build_layout(vision, lmm.ParallelSpec(ep=2), 4, "parallel", ["vision"]))


def test_gemma4_costs_read_each_layers_head_size(tmp_path):
    """Gemma 4's config refuses one global ``head_dim`` (local layers 8, global 16): the workload model charges
    each layer's attention its own width (4 heads x 8, 8, 16, 16; trained: 3 x 4 x width per token pair) and the
    planner's CP shape takes the widest layer's, so the strategy's setup and ``plan`` run on it."""
    from lightning_mm.planner.plan_cli import attention_shape
    from lightning_mm.planner.workload import WorkloadModel

    model = lmm.MultimodalModel.from_pretrained(_gemma4_folder(tmp_path / "src"))
    assert WorkloadModel.from_model(model).language_model.a == 3 * 4.0 * 4 * (8 + 8 + 16 + 16)
    shape = attention_shape(model, {"input_ids": torch.zeros(2, 64, dtype=torch.long)})
    assert (shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim) == (128, 4, 2, 16)


# ---------------------------------------------------------------------------------------- across processes
def _trains_like_one_process(case: dict, tmp_path, pack: int | None = None, experts_held: float | None = None):
    """The Gemma 4 composite with experts (local layers 0-1 with a 7-token window, global layers 2-3) trained 3
    steps on samples of 0 to 5 Gemma 4 images (``patch_sample``: patches with grid positions, some padded; sample
    0 text only) in one process and under the strategy with ``case``: equal losses and trained parameters, every
    parameter trained (experts, tower and projector included); ``experts_held``: the share of the experts' weights
    each of the two LLM ranks holds under ``case``."""
    from tests.helpers.composite_case import run_case

    folder = _gemma4_folder(tmp_path / "src", text=dict(moe=True))
    base = {"folder": folder, "patches": True, **({"pack": pack} if pack else {})}
    ref_losses, ref_params = run_case("composite_case.py", base, tmp_path, "single")
    start = dict(lmm.MultimodalModel.from_pretrained(folder).named_parameters())
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    assert set(ref_params) == set(start) and all(not torch.equal(ref_params[n], start[n]) for n in start)
    assert any(".experts." in n for n in start)
    losses, params = run_case("composite_case.py", {**base, **case}, tmp_path, "parallel")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():  # Gemma scales the token embeddings by sqrt(hidden), and their gradients with
        # them: one process on packed rows already ends 6e-6 from itself on unpacked rows there
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=2e-5 if "embed_tokens" in n else 1e-5, msg=n)
    if experts_held is not None:  # the share of the routed experts' weights each rank with LLM layers holds
        counts = [json.loads(f.read_text()) for f in (tmp_path / "parallel").glob("experts_*.json")]
        assert sorted(held / total for held, total in counts if total) == [experts_held] * 2, counts


@pytest.mark.slow
def test_gemma4_with_llm_pipeline_cut_between_local_and_global_layers_trains_like_one_process(tmp_path):
    """Vision tower one rank beside the LLM over 2 pipeline stages cut between local layer 1 and global layer 2
    (each stage builds its layers' masks: the window on stage 0 only), 2 microbatches."""
    config = families.LANGUAGE_FAMILIES["gemma4_text"].tiny_config(sliding_window=7)
    assert config.layer_types[1:3] == ["sliding_attention", "full_attention"]
    _trains_like_one_process({"llm_pp": 2, "partition": {"vision": [2], "language_model": [2, 2]}}, tmp_path)


@pytest.mark.slow
@pytest.mark.combines("llm_cp", "fsdp", "packing")
def test_gemma4_under_llm_cp_with_fsdp_on_packed_rows_trains_like_one_process(tmp_path):
    """LLM cp 2 (all-gather, LPT blocks of 8 tokens) with its parameters sharded over the two cp ranks
    (FULL_SHARD), rows of 64 tokens packing several samples: the local layers' 7-token window reaches the attention
    through the bitfield mask at global positions, so each cp rank's queries see one process's window."""
    _trains_like_one_process({"llm_cp": 2, "sharding": "FULL_SHARD", "microbatches": 1}, tmp_path, pack=64)


@pytest.mark.slow
@pytest.mark.combines("ep", "fsdp", "packing")
def test_gemma4_with_expert_parallelism_and_fsdp_trains_like_one_process(tmp_path):
    """The 4 experts of every layer split over ep 2 (transformers' ep plan, its experts only: the dense MLP beside
    them stays whole) across 2 FULL_SHARD replicas, packed rows of 64 tokens. Gemma 4 adds no load-balancing loss,
    so one process running the whole batch is the reference whatever rows each replica takes."""
    _trains_like_one_process({"ep": 2, "dp": 2, "sharding": "FULL_SHARD", "microbatches": 1}, tmp_path, pack=64,
                             experts_held=0.5)
