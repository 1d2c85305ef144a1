"""The language model stays itself inside a MultimodalModel, and generation with a KV cache equals independent
greedy references (an uncached loop of the full forward; transformers' own generate on the same embeddings)."""

import copy
from types import SimpleNamespace

import lightning as L
import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.model.families import LANGUAGE_FAMILIES
from lightning_mm.model.generation import predict_generate, whole_model_on_rank
from lightning_mm.plan.stages import stage_plans


def _vlm(kind="llama", seed=0, **lm_kw):
    torch.manual_seed(seed)
    enc = lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")
    return lmm.MultimodalModel({"vision": enc}, tiny_language_model(kind, **lm_kw)).eval()


def _prompts(model, causal_modalities=False, seed=1):
    """Two prompts of different lengths with one image each (16 tokens), collated (right padding)."""
    g = torch.Generator().manual_seed(seed)
    enc, pid = model.encoders["vision"], model.placeholder_ids["vision"]
    image = lambda: enc.family.random_inputs(enc.module.config, 1, generator=g)  # noqa: E731
    samples = [{"input_ids": [5, pid, 7, 9, 11], "vision": image()},
               {"input_ids": [3, 4, pid, 8, 12, 13, 14, 20, 21], "vision": image()}]
    return lmm.data.MultimodalCollator(model, causal_modalities=causal_modalities)(samples)


def _left_padded(batch):
    """The batch's rows with their padding moved to the front, built by hand (independent of generate's)."""
    mask = batch["attention_mask"]
    out = {k: torch.zeros_like(batch[k]) for k in ("input_ids", "attention_mask", "bam")}
    for r in range(mask.shape[0]):
        n = int(mask[r].sum())
        for k in out:
            out[k][r, -n:] = batch[k][r, :n]
    return out


def _greedy_without_cache(model, batch, steps, eos, pad):
    """Greedy decoding by re-running the whole multimodal forward (encoders included) on the growing sequence."""
    left = _left_padded(batch)
    ids, mask = left["input_ids"], left["attention_mask"]
    text_word = lmm.masks.text_word(len(model.encoders))
    bam = left["bam"]
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    new = []
    with torch.no_grad():
        for _ in range(steps):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, bam=bam, position_ids=positions,
                           vision=batch["vision"]).logits
            token = logits[:, -1].argmax(-1)
            token = torch.where(done, torch.full_like(token, pad), token)
            done |= token == eos
            new.append(token)
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(token[:, None])], 1)
            bam = torch.cat([bam, torch.full_like(token[:, None], text_word)], 1)
    return torch.stack(new, 1)


def test_generate_with_cache_equals_greedy_loop_of_the_full_forward():
    """Bidirectional image tokens (the training words), two prompts, right padding moved left by generate."""
    model = _vlm("llama")
    batch = _prompts(model)
    assert batch["attention_mask"][0, -1] == 0  # the shorter row is padded
    gen = model.language_model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, int) else -1
    pad = gen.pad_token_id if gen.pad_token_id is not None else eos
    got = model.generate(**batch, max_new_tokens=6, do_sample=False)
    expected = _greedy_without_cache(model, batch, 6, eos, pad)
    assert got.shape == (2, 6)
    assert torch.equal(got, expected), (got, expected)


def test_generate_equals_transformers_generate_on_the_same_embeddings():
    """Causal modality words (LLaVA style) are plain causal attention, so transformers' own generate of a copy of
    the language model, on embeddings merged by hand, must pick the same tokens with the same scores."""
    model = _vlm("qwen2", seed=3)
    ref_lm = copy.deepcopy(model.language_model)
    ref_lm.set_attn_implementation("eager")
    batch = _prompts(model, causal_modalities=True, seed=4)
    left = _left_padded(batch)
    with torch.no_grad():
        feats = model.encoders["vision"](batch["vision"])
        is_image = left["input_ids"] == model.placeholder_ids["vision"]
        embeds = ref_lm.get_input_embeddings()(left["input_ids"].masked_fill(is_image, 0))
        embeds[is_image] = feats
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    ref = ref_lm.generate(inputs_embeds=embeds, attention_mask=left["attention_mask"], **kw)
    got = model.generate(**batch, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # beam search reorders the cache and repeats each prompt's words per beam
    beams = dict(max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    ref = ref_lm.generate(inputs_embeds=embeds, attention_mask=left["attention_mask"], **beams)
    assert torch.equal(model.generate(**batch, **beams), ref)


def test_language_model_alone_is_unchanged_by_wrapping():
    """The caller's config object is not touched, a model built from it later is as before, and the language
    model called alone gives bit-identical logits (its own attention, its own mask) after being wrapped."""
    torch.manual_seed(0)
    fam = LANGUAGE_FAMILIES["llama"]
    cfg = fam.tiny_config()
    lm = fam.hf_class()(cfg)
    ids = torch.randint(0, 128, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: transformers' own padding mask must still apply
    before_cfg = (cfg._attn_implementation, cfg.to_dict())
    before = lm(input_ids=ids, attention_mask=mask).logits
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, lm)
    assert (cfg._attn_implementation, cfg.to_dict()) == before_cfg
    assert lm.config is not cfg and all(m.config is lm.config for m in lm.modules() if "config" in m.__dict__)
    assert torch.equal(lm(input_ids=ids, attention_mask=mask).logits, before)
    # the multimodal forward still runs bitfield attention (padding words zero the padded rows' attention)
    model(input_ids=ids, attention_mask=mask)
    assert torch.equal(lm(input_ids=ids, attention_mask=mask).logits, before)
    # another model built from the original config, with the same weights, computes what the first did
    other = fam.hf_class()(cfg)
    other.load_state_dict(lm.state_dict())
    assert other.config._attn_implementation == before_cfg[0]
    assert torch.equal(other(input_ids=ids, attention_mask=mask).logits, before)
    # eager models keep their own eager attention (and its mask) too
    eager = fam.hf_class()(fam.tiny_config(attn_implementation="eager"))
    ref = eager(input_ids=ids, attention_mask=mask).logits
    lmm.MultimodalModel({}, eager)
    assert eager.config._attn_implementation == "bitfield|eager"
    assert torch.equal(eager(input_ids=ids, attention_mask=mask).logits, ref)


def test_attention_that_cannot_honour_the_mask_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="attn_implementation='sdpa' cannot honour the bitfield.*"
                                         "attn_implementation='bitfield'"):
        lmm.MultimodalModel({}, tiny_language_model("llama"), attn_implementation="sdpa")
    model = _vlm()
    batch = _prompts(model)
    model.language_model.set_attn_implementation("sdpa")  # switched behind the model's back
    fix = r"lightning_mm\.attention\.attach\(model\.language_model\)"
    with pytest.raises(ValueError, match=r"'sdpa', which cannot honour the bitfield mask.*" + fix):
        model(**batch)
    with pytest.raises(ValueError, match="'sdpa', which cannot honour the bitfield mask"):
        model.generate(**batch, max_new_tokens=2)
    lmm.attention.attach(model.language_model)  # the fix the message names
    assert model.language_model.config._attn_implementation == "bitfield|sdpa"
    model(**batch)


def test_generate_rejects_caches_it_cannot_index():
    from transformers import StaticCache

    model = _vlm()
    batch = _prompts(model)
    with pytest.raises(ValueError, match="DynamicCache"):
        model.generate(**batch, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(ValueError, match="DynamicCache"):
        model.generate(**batch, max_new_tokens=2,
                       past_key_values=StaticCache(config=model.language_model.config, max_cache_len=64))


def packable_samples(model, seed: int = 2) -> list[dict]:
    """Three prompts (20, 41 and 23 tokens with 1, 2 and 1 images) that pack first-fit into rows of 64 tokens as
    [0, 1] and [2], keeping their order."""
    g = torch.Generator().manual_seed(seed)
    enc, pid = model.encoders["vision"], model.placeholder_ids["vision"]
    images = lambda n: enc.family.random_inputs(enc.module.config, n, generator=g)  # noqa: E731
    return [{"input_ids": [5, pid, 7, 9, 11], "vision": images(1)},
            {"input_ids": [3, 4, pid, 8, 12, pid, 13, 14, 20, 21, 22], "vision": images(2)},
            {"input_ids": [6, 7, 8, pid, 30, 31, 32, 33], "vision": images(1)}]


@pytest.mark.combines("generation", "packing")
def test_packed_prompts_generate_one_row_per_sample():
    """Rows packed with two samples (segment ids, positions restarting at 0) decode as one prompt per sample, in
    order: the tokens of ``generate`` on the same samples collated one per row."""
    model = _vlm(seed=3)
    samples = packable_samples(model)
    packed = lmm.data.MultimodalCollator(model, seq_len=64, pack=True)(samples)
    assert packed["input_ids"].shape[0] == 2 and int(packed["segment_ids"][0].max()) >= 1
    expected = model.generate(**lmm.data.MultimodalCollator(model)(samples), max_new_tokens=6, do_sample=False)
    got = model.generate(**packed, max_new_tokens=6, do_sample=False)
    assert got.shape[0] == 3 and torch.equal(got, expected)


def test_trainer_predict_generates_in_one_process_and_under_the_strategy():
    """Plain Lightning and the strategy with devices=1 (the whole model on the rank) return generate's tokens."""
    model = _vlm(seed=5)
    batch = _prompts(model, seed=6)
    expected = model.generate(**batch, max_new_tokens=5, do_sample=False)
    loader = torch.utils.data.DataLoader([batch], batch_size=None)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = lmm.MultimodalLightningModule(model, generation={"max_new_tokens": 5, "do_sample": False})
    out = L.Trainer(**kw).predict(module, loader)
    assert torch.equal(out[0]["generated_ids"], expected)
    module = lmm.MultimodalLightningModule(model, generation={"max_new_tokens": 5, "do_sample": False})
    out = L.Trainer(strategy=lmm.MultimodalParallelStrategy(), **kw).predict(module, loader)
    assert torch.equal(out[0]["generated_ids"], expected)


def test_generation_under_pipeline_stages_is_a_clear_error():
    """Only a rank holding every layer of every module (no CP) can decode token by token."""
    model = _vlm()
    layers = {"vision": [4], "language_model": [4]}
    whole = stage_plans(layers, "replicated", ["vision"])
    (only,) = whole.values()
    assert whole_model_on_rank(SimpleNamespace(plan=only, plans=whole, cp_size=1), model)
    assert not whole_model_on_rank(SimpleNamespace(plan=only, plans=whole, cp_size=2), model)
    split = stage_plans({"vision": [4], "language_model": [2, 2]}, "parallel", ["vision"])
    for plan in split.values():
        engine = SimpleNamespace(plan=plan, plans=split, cp_size=1)
        assert not whole_model_on_rank(engine, model)
        module = SimpleNamespace(model=model, pipeline=SimpleNamespace(engine=engine))
        with pytest.raises(RuntimeError, match="needs the whole model on every rank.*devices=1.*pp=1.*replicated"):
            predict_generate(module, _prompts(model), {"max_new_tokens": 2})
