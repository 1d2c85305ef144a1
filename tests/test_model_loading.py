"""Building on the meta device, materialising, deterministic init by name and pretrained parts from local folders.

Every folder here is written by ``save_pretrained`` from a tiny model built from a config (nothing is downloaded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import lightning_mm as lmm
from lightning_mm.checkpoint import model_fingerprint
from lightning_mm.model import families, loading, tiny_encoder, tiny_language_model
from lightning_mm.model.loading import (ModelFolderError, init_parameters, init_seed, is_meta, load_encoder,
                                        load_language_model, materialise, source_of)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLMS = sorted(families.LANGUAGE_FAMILIES)
ENCODERS = sorted(families.TINY_ENCODERS)


def _save(module, path, shard: str | None = None) -> str:
    module.save_pretrained(path, max_shard_size=shard) if shard else module.save_pretrained(path)
    return str(path)


def _assert_same_tensors(a: nn.Module, b: nn.Module, buffers: bool = True) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    if buffers:
        ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
        assert ba.keys() == bb.keys()
        for k in ba:
            assert torch.equal(ba[k], bb[k]), k


def _build(kind: str):
    return tiny_encoder(kind) if kind in families.TINY_ENCODERS else tiny_language_model(kind)


def _load(kind: str, path):
    return load_encoder(path) if kind in families.TINY_ENCODERS else load_language_model(path)


# ---------------------------------------------------------------------------------------------- folders
@pytest.mark.parametrize("kind", ENCODERS + LLMS)
def test_eager_folder_load_equals_from_pretrained(kind, tmp_path):
    torch.manual_seed(0)
    path = _save(_build(kind), tmp_path / kind)
    loaded = _load(kind, path)
    if kind in ("mixtral", "qwen3_moe"):
        # experts stored per expert and fused on load: transformers converts them when loading eagerly
        assert source_of(loaded) is None and not is_meta(loaded)
    else:
        assert not is_meta(loaded) and loaded.pretrained_source.folder == path
    reference = type(loaded).from_pretrained(path)
    assert type(reference) is type(loaded)
    _assert_same_tensors(loaded, reference)


def _stored_keys(path) -> set[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    return set(load_file(os.path.join(path, "model.safetensors")))


@pytest.mark.parametrize("shard", [None, "12KB"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_lazy_moe_folder_fuses_the_stored_experts_like_from_pretrained(kind, shard, tmp_path):
    """A saved MoE keeps each expert's projections apart (``experts.3.gate_proj.weight`` / ``w1``); the model fuses
    them (``experts.gate_up_proj``). A lazy build records the pieces and materialising combines them exactly as
    transformers' conversion on load does: every tensor equals ``from_pretrained``'s bit for bit."""
    torch.manual_seed(0)
    path = _save(tiny_language_model(kind), tmp_path / kind, shard)
    stored = _stored_keys(path)
    assert any(".experts.3." in k for k in stored) and not any("gate_up_proj" in k for k in stored)
    with torch.device("meta"):
        lazy = load_language_model(path)
    src = lazy.pretrained_source
    assert is_meta(lazy) and set(src.fused) == {f"model.layers.{i}.mlp.experts.{p}" for i in range(4)
                                                for p in ("gate_up_proj", "down_proj")}
    gate_up = src.fused["model.layers.1.mlp.experts.gate_up_proj"]
    assert [len(part) for part in gate_up.parts] == [8, 8]  # gate and up pieces of 8 experts
    assert gate_up.parts[0][3][1].endswith(("experts.3.gate_proj.weight", "experts.3.w1.weight"))
    read = _spy_reads(lambda: materialise(lazy, "cpu"))
    assert read == stored  # every stored tensor once, nothing else
    reference = type(lazy).from_pretrained(path)
    _assert_same_tensors(lazy, reference)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(lazy(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_lazy_moe_stage_reads_only_its_layers_experts(tmp_path):
    """A pipeline stage holding the last half of a lazily built Qwen3-MoE reads only its layers' stored tensors
    (each of its experts' pieces once) and gets from_pretrained's values."""
    from lightning_mm.parallel.pruning import prune

    torch.manual_seed(0)
    path = _save(tiny_language_model("qwen3_moe"), tmp_path / "moe", "12KB")
    with torch.device("meta"):
        stage = load_language_model(path)
    mine = ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")
    owned = {n for n, _ in stage.named_parameters() if n.startswith(mine)}
    prune(stage, owned)
    read = _spy_reads(lambda: materialise(stage, "cpu"))
    assert read == {k for k in _stored_keys(path) if k.startswith(mine)}
    assert len([k for k in read if ".experts." in k]) == 2 * 8 * 3  # 2 layers x 8 experts x gate, up, down
    reference = dict(type(stage).from_pretrained(path).named_parameters())
    for n, p in stage.named_parameters():
        assert n in owned and torch.equal(p, reference[n]), n


def test_lazy_moe_folder_with_a_missing_expert_is_refused(tmp_path):
    torch.manual_seed(0)
    path = _save(tiny_language_model("mixtral"), tmp_path / "moe")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    (key,) = [k for k in tensors if k.startswith("model.layers.1.") and k.endswith(".experts.5.w3.weight")]
    del tensors[key]  # Mixtral folders keep transformers' old names (block_sparse_moe.experts.5.w3)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"experts\.gate_up_proj.*expert 5 of .*w3.*missing"), \
            torch.device("meta"):
        load_language_model(path)


@pytest.mark.parametrize("shard", [None, "12KB"])
@pytest.mark.parametrize("kind", ["llama", "gemma2", "siglip", "whisper", "qwen2_vl"])
def test_lazy_build_then_materialise_equals_eager_load(kind, shard, tmp_path):
    torch.manual_seed(0)
    path = _save(_build(kind), tmp_path / kind, shard)
    if shard:
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
        assert len({f for f in os.listdir(path) if f.endswith(".safetensors")}) > 2
    eager = _load(kind, path)
    with torch.device("meta"):
        lazy = _load(kind, path)
    assert is_meta(lazy) and all(t.is_meta for t in lazy.state_dict().values())
    src = lazy.pretrained_source
    assert src.folder == path and src.model_class == type(lazy).__name__
    file, key = src.tensors[next(iter(lazy.state_dict()))]
    assert os.path.isfile(src.path(file)) and key
    materialise(lazy, "cpu")
    assert not is_meta(lazy)
    _assert_same_tensors(lazy, eager)


def test_tied_language_model_stays_tied_and_reads_the_stored_embedding(tmp_path):
    torch.manual_seed(0)
    lm = tiny_language_model("llama", tie_word_embeddings=True)
    path = _save(lm, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    with torch.device("meta"):
        lazy = load_language_model(path)
    assert lazy.lm_head.weight is lazy.model.embed_tokens.weight
    assert lazy.pretrained_source.tensors["lm_head.weight"][1] == "model.embed_tokens.weight"
    materialise(lazy, "cpu")
    assert lazy.lm_head.weight is lazy.model.embed_tokens.weight
    _assert_same_tensors(lazy, type(lm).from_pretrained(path))
    with torch.device("meta"):
        random = tiny_language_model("llama", tie_word_embeddings=True)
    materialise(random, "cpu", seed=1)
    assert random.lm_head.weight is random.model.embed_tokens.weight and not is_meta(random)


def _whole_models():
    from transformers import (CLIPConfig, CLIPModel, Qwen2AudioConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2VLConfig, Qwen2VLForConditionalGeneration, SiglipConfig, SiglipModel, WhisperConfig,
                              WhisperForConditionalGeneration, WhisperModel)

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    whisper = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
                   max_source_positions=8, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
                   vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return {
        "clip": (lambda: CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)),
                 lambda m: m.vision_model, "CLIPVisionModel"),
        "siglip": (lambda: SiglipModel(SiglipConfig(text_config=text, vision_config=vision)),
                   lambda m: m.vision_model, "SiglipVisionModel"),
        "whisper": (lambda: WhisperModel(WhisperConfig(**whisper)), lambda m: m.encoder, "WhisperEncoder"),
        "whisper_generation": (lambda: WhisperForConditionalGeneration(WhisperConfig(**whisper)),
                               lambda m: m.model.encoder, "WhisperEncoder"),
        "qwen2_audio": (lambda: Qwen2AudioForConditionalGeneration(Qwen2AudioConfig(
            audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                              num_mel_bins=16, max_source_positions=8),
            text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))),
            lambda m: m.model.audio_tower, "Qwen2AudioEncoder"),
        "qwen2_vl": (lambda: Qwen2VLForConditionalGeneration(Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=4, spatial_merge_size=2,
                               temporal_patch_size=2, in_channels=3),
            text_config=dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2,
                             rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 1], rope_theta=1e4)))),
            lambda m: m.model.visual, "Qwen2VisionTransformerPretrainedModel"),
    }


@pytest.mark.parametrize("name", sorted(_whole_models()))
def test_encoder_tower_of_a_whole_model_folder(name, tmp_path):
    """A folder saved from CLIPModel / WhisperForConditionalGeneration / ... gives its tower; the other parts'
    tensors are not read."""
    build, tower, cls = _whole_models()[name]
    torch.manual_seed(0)
    whole = build()
    path = _save(whole, tmp_path / name)
    eager = load_encoder(path)
    assert type(eager).__name__ == cls
    _assert_same_tensors(eager, tower(whole))
    with torch.device("meta"):
        lazy = lmm.ModalityEncoder(path, projector="linear")
    assert is_meta(lazy.module)
    read = _spy_reads(lambda: materialise(lazy, "cpu"))
    assert read == {key for _, key in lazy.module.pretrained_source.tensors.values()}
    assert all(k.startswith(lazy.module.pretrained_source.prefix) for k in read)
    _assert_same_tensors(lazy.module, tower(whole))


# ---------------------------------------------------------------------------------------------- pruned stages
def _spy_reads(fn) -> set[str]:
    """The tensor keys ``fn`` reads from safetensors files (``loading._load_tensor``: one call per tensor read)."""
    from lightning_mm.model import loading

    real, read = loading._load_tensor, []

    def spy(f, start, header, key, target, device):
        read.append(key)
        return real(f, start, header, key, target, device)

    loading._load_tensor = spy
    try:
        fn()
    finally:
        loading._load_tensor = real
    assert len(read) == len(set(read)), "a tensor was read twice"
    return set(read)


def _folders(tmp_path, shard=None):
    torch.manual_seed(0)
    llm = tiny_language_model("llama")
    enc = tiny_encoder("siglip")
    return _save(enc, tmp_path / "siglip", shard), _save(llm, tmp_path / "llama", shard)


def _multimodal(enc_path, llm_path):
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(enc_path, projector="mlp")}, llm_path)


@pytest.mark.parametrize("shard", [None, "12KB"])
def test_materialising_a_pruned_stage_reads_only_its_tensors(tmp_path, shard):
    from lightning_mm.parallel.pruning import prune

    enc_path, llm_path = _folders(tmp_path, shard)
    torch.manual_seed(1)
    full = _multimodal(enc_path, llm_path)
    torch.manual_seed(1)
    with torch.device("meta"):
        stage = _multimodal(enc_path, llm_path)
    owned = {n for n, _ in stage.named_parameters() if n.startswith("language_model.model.layers.1.")
             or n.startswith("language_model.model.layers.2.")}
    prune(stage, owned)
    assert {n for n, _ in stage.named_parameters()} == owned
    read = _spy_reads(lambda: materialise(stage, "cpu"))
    assert read == {n.removeprefix("language_model.") for n in owned}
    assert not is_meta(stage)
    reference = dict(full.named_parameters())
    for n, p in stage.named_parameters():
        assert torch.equal(p, reference[n]), n
    torch.testing.assert_close(stage.language_model.model.rotary_emb.inv_freq,
                               full.language_model.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_pruned_random_stage_equals_the_whole_model_and_keeps_flags(tmp_path):
    """Layout independence of the random init: a stage's tensors equal the unpruned model's (same seed)."""
    from lightning_mm.parallel.pruning import prune

    def build():
        with torch.device("meta"):
            return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("clip"), projector="mlp")},
                                       tiny_language_model("qwen2"))

    full = build()
    full.freeze(encoders=True)
    materialise(full, "cpu", seed=7)
    stage = build()
    stage.freeze(encoders=True)
    owned = {n for n, _ in stage.named_parameters() if n.startswith("encoders.vision.module.vision_model.encoder.layers.3")
             or n.startswith("encoders.vision.module.vision_model.post_layernorm") or ".projector." in n}
    prune(stage, owned)
    params_before = {n: p for n, p in stage.named_parameters()}
    materialise(stage, "cpu", seed=7)
    reference = dict(full.named_parameters())
    for n, p in stage.named_parameters():
        assert p is params_before[n]  # the same parameter objects, now filled
        assert torch.equal(p, reference[n]), n
        assert p.requires_grad == reference[n].requires_grad == (".projector." in n)


# ---------------------------------------------------------------------------------------------- deterministic init
def test_init_seed_is_stable_and_distinct():
    assert init_seed(0, "a.b") == init_seed(0, "a.b")
    assert init_seed(0, "a.b") != init_seed(1, "a.b") != init_seed(0, "a.c")
    assert init_seed(1234, "encoders.vision.projector.0") == 8520593106280236810  # same in every process


def _lazy_random(seed, kind="llama"):
    with torch.device("meta"):
        model = lmm.MultimodalModel({"audio": lmm.ModalityEncoder(tiny_encoder("whisper"), projector="mlp")},
                                    tiny_language_model(kind))
    materialise(model, "cpu", seed=seed)
    return model


def test_same_seed_same_values_different_seed_different_values():
    a, b, c = _lazy_random(3), _lazy_random(3), _lazy_random(4)
    _assert_same_tensors(a, b)
    sa, sc = a.state_dict(), c.state_dict()
    differ = [k for k in sa if not torch.equal(sa[k], sc[k])]
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in differ
    assert "encoders.audio.projector.0.weight" in differ
    # what the family computes rather than draws is the same under any seed (Whisper's sinusoidal positions)
    assert "encoders.audio.module.embed_positions.weight" not in differ
    assert "language_model.model.norm.weight" not in differ


@pytest.mark.slow
def test_same_seed_same_values_in_another_process(tmp_path):
    out = tmp_path / "values.pt"
    script = textwrap.dedent(f"""
        import torch, sys
        sys.path.insert(0, {ROOT!r})
        from tests.test_model_loading import _lazy_random
        torch.manual_seed(999)  # the global RNG plays no part
        torch.save(_lazy_random(3).state_dict(), {str(out)!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    theirs = torch.load(out, weights_only=True)
    mine = _lazy_random(3).state_dict()
    assert theirs.keys() == mine.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k


def test_init_values_are_hf_like():
    """The deterministic init draws from the distributions the HF family's own init uses."""
    model = _lazy_random(0)
    eager = tiny_language_model("llama")
    for (n, p), (_, q) in zip(model.language_model.named_parameters(), eager.named_parameters()):
        assert abs(p.std().item() - q.std().item()) < 0.25 * max(q.std().item(), 1e-3), n
        assert abs(p.mean().item() - q.mean().item()) < 0.01 + 0.25 * abs(q.mean().item()), n


def test_projectors_eager_equal_lazy():
    torch.manual_seed(42)
    enc, llm = tiny_encoder("siglip"), tiny_language_model("llama")
    eager = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(enc, projector="mlp"),
                                 "audio": lmm.ModalityEncoder(tiny_encoder("whisper"), projector="linear")}, llm)
    torch.manual_seed(42)
    with torch.device("meta"):
        lazy = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp"),
                                    "audio": lmm.ModalityEncoder(tiny_encoder("whisper"), projector="linear")},
                                   tiny_language_model("llama"))
    materialise(lazy, "cpu")  # seed = torch.initial_seed() = 42, as at the eager build
    for name in ("vision", "audio"):
        _assert_same_tensors(lazy.encoders[name].projector, eager.encoders[name].projector)
    # the eager values are the ones init_parameters gives that name
    proj = eager.encoders["vision"].projector
    again = lmm.model.build_projector("mlp", 32, 32)
    init_parameters(again, seed=42, prefix="encoders.vision.projector")
    _assert_same_tensors(again, proj)


def test_init_parameters_reinitialises_in_place_by_name():
    lin = nn.Linear(4, 3)
    weight = lin.weight
    init_parameters(lin, seed=5)
    assert lin.weight is weight
    with torch.device("meta"):
        lazy = nn.Linear(4, 3)
    materialise(lazy, "cpu", seed=5)
    _assert_same_tensors(lazy, lin)
    init_parameters(lin, seed=5, prefix="elsewhere")  # another name, other values
    assert not torch.equal(lazy.weight, lin.weight)


# ---------------------------------------------------------------------------------------------- meta builds
def test_meta_build_of_the_whole_model_costs_nothing_and_has_its_shapes(tmp_path):
    enc_path, llm_path = _folders(tmp_path)
    eager = _multimodal(enc_path, llm_path)
    with torch.device("meta"):
        lazy = _multimodal(enc_path, llm_path)
    assert all(t.is_meta for t in lazy.parameters()) and all(t.is_meta for t in lazy.buffers())
    assert model_fingerprint(lazy) == model_fingerprint(eager)
    assert (lazy.vocab_size, lazy.hidden_size, lazy.placeholder_ids) == \
        (eager.vocab_size, eager.hidden_size, eager.placeholder_ids)
    assert lazy.encoders["vision"].output_dim == 32
    inputs = lazy.encoders["vision"].family.random_inputs(lazy.encoders["vision"].config, 2)
    assert lazy.encoders["vision"].num_tokens(inputs) == [16, 16]


@pytest.mark.parametrize("kind", LLMS)
def test_meta_built_language_model_runs_like_an_eager_one(kind):
    """Rotary frequencies and other computed buffers are right after materialising: logits equal an eagerly built
    model holding the materialised weights."""
    with torch.device("meta"):
        lazy = lmm.MultimodalModel({}, tiny_language_model(kind))
    materialise(lazy, "cpu", seed=11)
    eager = lmm.MultimodalModel({}, tiny_language_model(kind))
    eager.load_state_dict(lazy.state_dict())
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lazy(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ENCODERS)
def test_meta_built_encoder_runs_like_an_eager_one(kind):
    with torch.device("meta"):
        lazy = lmm.ModalityEncoder(tiny_encoder(kind), projector="linear")
        lmm.MultimodalModel({"m": lazy}, tiny_language_model("llama"))
    materialise(lazy, "cpu", seed=2)
    eager = tiny_encoder(kind)
    eager.load_state_dict(lazy.module.state_dict())
    inputs = lazy.family.random_inputs(lazy.config, 2, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lazy.family.reference(lazy.module.eval(), inputs),
                               lazy.family.reference(eager.eval(), inputs), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- errors
def _llm_folder(tmp_path) -> str:
    torch.manual_seed(0)
    return _save(tiny_language_model("llama"), tmp_path / "llm")


@pytest.mark.parametrize("meta", [False, True])
def test_folder_errors_name_the_file_and_tensor(tmp_path, meta):
    """Every error is raised while the model is built (eagerly or on meta), before any collective could run."""
    path = _llm_folder(tmp_path)
    weights, config = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")

    def expect(pattern, build=load_language_model, where=path):
        with torch.device("meta") if meta else torch.device("cpu"):
            with pytest.raises(ModelFolderError, match=pattern):
                build(where)

    expect(r"model folder .*nowhere does not exist", where=str(tmp_path / "nowhere"))
    os.rename(config, config + ".bak")
    expect(r"llm has no config.json", build=lambda p: lmm.MultimodalModel({}, p))
    os.rename(config + ".bak", config)

    tensors = load_file(weights)
    os.rename(weights, os.path.join(path, "pytorch_model.bin"))
    expect(r"no model.safetensors .*pytorch_model.bin: only safetensors")
    os.remove(os.path.join(path, "pytorch_model.bin"))

    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.up_proj.weight"}, weights,
              metadata={"format": "pt"})
    expect(r"llm/model.safetensors has no tensor 'model.layers.2.mlp.up_proj.weight'")

    save_file({**tensors, "model.layers.1.self_attn.o_proj.weight": torch.zeros(32, 16)}, weights,
              metadata={"format": "pt"})
    expect(r"tensor 'model.layers.1.self_attn.o_proj.weight' in .*llm/model.safetensors has shape \[32, 16\] but "
           r".* \[32, 32\]")
    save_file(tensors, weights, metadata={"format": "pt"})

    with open(config) as f:
        cfg = json.load(f)
    with open(config, "w") as f:
        json.dump({**cfg, "model_type": "bert", "architectures": ["BertModel"]}, f)
    expect(r"model_type='bert'.*not a supported language model; supported: LlamaForCausalLM, Qwen2ForCausalLM")
    with open(config, "w") as f:
        json.dump(cfg, f)
    expect(r"model_type='llama'.*not a supported encoder; supported: CLIPVisionModel \(clip_vision_model/clip\)",
           build=lambda p: lmm.ModalityEncoder(p))


def test_sharded_folder_with_a_missing_shard(tmp_path):
    torch.manual_seed(0)
    path = _save(tiny_language_model("llama"), tmp_path / "llm", "12KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    victim = index["weight_map"]["model.norm.weight"]
    os.remove(os.path.join(path, victim))
    with pytest.raises(ModelFolderError, match=rf"{victim} is missing \(listed in .*index.json for"):
        with torch.device("meta"):
            load_language_model(path)


def test_folder_changed_after_a_lazy_build_fails_at_materialise(tmp_path):
    path = _llm_folder(tmp_path)
    with torch.device("meta"):
        lazy = load_language_model(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match=r"model.safetensors has no tensor 'model.norm.weight'"):
        materialise(lazy, "cpu")


def test_uninitialisable_meta_tensor_is_named():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(2, 3), Custom())
    with pytest.raises(ValueError, match=r"cannot initialise '1.scale'"):
        materialise(m, "cpu")


# ---------------------------------------------------------------------------------------------- YAML
def test_folders_as_strings_from_a_config(tmp_path):
    from jsonargparse import ArgumentParser

    enc_path, llm_path = _folders(tmp_path)
    parser = ArgumentParser()
    parser.add_argument("--model", type=lmm.MultimodalModel)
    cfg = parser.parse_object({"model": {
        "class_path": "lightning_mm.MultimodalModel",
        "init_args": {"language_model": llm_path, "encoders": {"vision": {
            "class_path": "lightning_mm.ModalityEncoder", "init_args": {"encoder": enc_path, "projector": "mlp"}}}}}})
    model = parser.instantiate(cfg).model
    assert isinstance(model, lmm.MultimodalModel)
    assert model.language_model.pretrained_source.folder == llm_path
    assert model.encoders["vision"].module.pretrained_source.folder == enc_path
    # a class_path still builds a module from its config
    cfg = parser.parse_object({"model": {"class_path": "lightning_mm.MultimodalModel", "init_args": {
        "encoders": {}, "language_model": {"class_path": "transformers.LlamaForCausalLM", "init_args": {
            "config": {"class_path": "transformers.LlamaConfig", "init_args": {
                "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 2}}}}}}})
    assert type(parser.instantiate(cfg).model.language_model).__name__ == "LlamaForCausalLM"


# ---------------------------------------------------------------------------------------------- memory
MEMORY_SCRIPT = """
import gc, sys, time, torch
sys.path.insert(0, {root!r})
from lightning_mm.model.loading import load_language_model, materialise
from lightning_mm.parallel.pruning import prune
import transformers


def peak():  # this process's peak resident set (VmHWM: unlike ru_maxrss, not inherited from the forking parent)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(mode, path):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # the peak starts again from the current resident set
        f.write("5")
    base, start = peak(), time.perf_counter()
    if mode == "eager":
        model = load_language_model(path)
    else:
        with torch.device("meta"):
            model = load_language_model(path) if mode == "folder" else \\
                transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(path))
        assert peak() - base < 20 * 2**20, peak() - base  # the meta build itself: nothing
        owned = {{n for n, _ in model.named_parameters() if any(n.startswith(f"model.layers.{{i}}.") for i in (3, 4, 5))}}
        prune(model, owned)
        materialise(model, "cpu", seed=0)
    print(mode, peak() - base, time.perf_counter() - start)


torch.ones(1) + 1  # imports and allocator warm-up happen before any measure
for mode in sys.argv[2:]:
    measure(mode, sys.argv[1])
"""


def test_a_quarter_stage_of_a_large_model_costs_a_quarter_of_its_memory(tmp_path):
    """A ~180M-parameter Llama (hidden 1024, 12 layers, vocab 32000): building it on meta and materialising 3 of its
    12 layers (from its folder or at random) grows the peak resident memory by far less than half the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() * 4 for p in model.parameters())
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    path = str(tmp_path / "big")
    model.to_empty(device="cpu").save_pretrained(path)  # the values do not matter here
    del model
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT.format(root=ROOT), path, "folder", "random", "eager"],
                         check=True, capture_output=True, text=True, timeout=300)
    grown = {}
    for line in out.stdout.splitlines()[-3:]:
        mode, size, seconds = line.split()
        grown[mode] = int(size)
        print(f"{mode}: peak resident set +{int(size) / 2**20:.0f} MiB in {float(seconds):.2f} s")
    print(f"model {total / 2**20:.0f} MiB, 3 layers {3 * layer / 2**20:.0f} MiB")
    assert grown["eager"] > 0.9 * total  # the measure sees a whole model
    assert grown["folder"] < total / 2 and grown["random"] < total / 2
    # in fact the stage plus about one tensor (reading) or one layer's CPU copy (random init)
    assert grown["folder"] < 1.5 * 3 * layer and grown["random"] < 1.5 * 3 * layer


def test_reads_go_straight_into_blocks_of_any_layout(tmp_path):
    """The reader fills a tensor of the block's size from the file (one read per contiguous run): whole tensors and
    the blocks a DTensor rank holds (rows, columns, a middle cut) equal slicing the stored tensor, for every dtype."""
    g = torch.Generator().manual_seed(0)
    stored = {"f32": torch.randn(6, 5, 4, generator=g), "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
              "i64": torch.arange(24).reshape(4, 6), "flag": torch.rand(5, 2, generator=g) > 0.5,
              "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3)}
    path = str(tmp_path / "t.safetensors")
    save_file(stored, path)
    start, header = loading._raw_header(path)
    with open(path, "rb", buffering=0) as f:
        for key, value in stored.items():
            entry = header[key]
            dtype, offset = loading._SAFETENSORS_DTYPES[entry["dtype"]], start + entry["data_offsets"][0]
            assert torch.equal(loading._read_block(f, offset, dtype, entry["shape"], None), value), key
            if value.dim() < 2 or not value.numel():
                continue
            n0, n1 = value.shape[:2]
            for region in [(slice(1, n0 - 1),), (slice(0, n0), slice(1, n1)), (slice(2, 3), slice(0, 1)),
                           (slice(0, n0), slice(1, 2))]:
                region = region + tuple(slice(0, n) for n in value.shape[len(region):])
                got = loading._read_block(f, offset, dtype, entry["shape"], region)
                assert got.is_contiguous() and torch.equal(got, value[region]), (key, region)


def test_materialise_converts_the_stored_dtype_to_the_parameters(tmp_path):
    """A bf16 folder read into an fp32 model built on meta: the values are the stored ones, in fp32."""
    lm = tiny_language_model("llama").to(torch.bfloat16)
    path = _save(lm, tmp_path / "bf16")
    with torch.device("meta"):
        lazy = load_language_model(path)  # parameters take the default dtype, fp32
    materialise(lazy, "cpu")
    for (n, a), (_, b) in zip(lazy.named_parameters(), lm.named_parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b.float()), n


# ---------------------------------------------------------------------------------------------- sharded (FSDP2)
def _fsdp_rank(rank, world, path):
    """Build on meta, shard with FSDP2 over every rank, then materialise: each rank holds (and reads) its shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for source in ("random", "folder"):
        with torch.device("meta"):
            lm = tiny_language_model("llama") if source == "random" else load_language_model(path)
        for layer in lm.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(lm, mesh=mesh)
        weight = lm.model.layers[0].mlp.up_proj.weight
        assert isinstance(weight, DTensor) and weight.is_meta
        read = _spy_reads(lambda: materialise(lm, "cpu", seed=5))
        assert lm.model.layers[0].mlp.up_proj.weight is weight and not is_meta(lm)
        assert weight.to_local().shape == (32, 32)  # [64, 32] split over 2 ranks
        if source == "folder":  # every tensor once, each rank only its rows (get_slice)
            assert read == {key for _, key in lm.pretrained_source.tensors.values()}
        params = {n: p.full_tensor() for n, p in lm.named_parameters()}
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
        out[source] = (params, lm(input_ids=ids).logits.detach())  # FSDP2 gathers the materialised shards
    return out


def test_materialise_after_fsdp2_sharding_gives_each_rank_its_shard(tmp_path):
    from tests.helpers.distributed import run_distributed

    torch.manual_seed(0)
    path = _save(tiny_language_model("llama"), tmp_path / "llm")
    results = run_distributed(_fsdp_rank, 2, path)
    with torch.device("meta"):
        whole = tiny_language_model("llama")
    materialise(whole, "cpu", seed=5)
    eager = load_language_model(path)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    for source, reference in (("random", whole), ("folder", eager)):
        for rank_result in results:
            params, logits = rank_result[source]
            for n, p in reference.named_parameters():
                assert torch.equal(params[n], p), (source, n)
            torch.testing.assert_close(logits, reference(input_ids=ids).logits)


def _fsdp_moe_rank(rank, world, path):
    """Build a saved Qwen3-MoE on meta, shard every layer with FSDP2 (dim 0 of the fused expert weights: experts),
    then materialise: each rank reads only the stored pieces of its own experts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        lm = load_language_model(path)
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(lm, mesh=mesh)
    read = _spy_reads(lambda: materialise(lm, "cpu"))
    gate_up = lm.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(gate_up, DTensor) and gate_up.to_local().shape == (4, 32, 32)  # 8 experts over 2 ranks
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k}
    assert experts == set(range(4 * rank, 4 * rank + 4)), experts
    return {n: p.full_tensor() for n, p in lm.named_parameters()}


def _lazy_moe_on_two_ranks(rank_fn, tmp_path):
    """A saved tiny Qwen3-MoE built lazily and materialised by ``rank_fn`` on 2 ranks: (their results, the folder
    loaded eagerly)."""
    from tests.helpers.distributed import run_distributed

    torch.manual_seed(0)
    path = _save(tiny_language_model("qwen3_moe"), tmp_path / "moe")
    return run_distributed(rank_fn, 2, path), load_language_model(path)


@pytest.mark.slow
def test_lazy_moe_folder_under_fsdp2_reads_only_each_ranks_experts(tmp_path):
    results, reference = _lazy_moe_on_two_ranks(_fsdp_moe_rank, tmp_path)
    for params in results:
        for n, p in reference.named_parameters():
            assert torch.equal(params[n], p), n


def _ep_moe_rank(rank, world, path):
    """Build a saved Qwen3-MoE on meta, split its experts over 2 ranks with transformers' expert parallelism (what
    the strategy's ep applies), then materialise: each rank reads only its experts' stored pieces."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from lightning_mm.model.moe import expert_layer_plan

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    with torch.device("meta"):
        lm = load_language_model(path)
    plan = expert_layer_plan(lm)
    for layer in lm.model.layers:
        apply_expert_parallelism(layer, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")
    read = _spy_reads(lambda: materialise(lm, "cpu"))
    assert not is_meta(lm)
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k}
    assert experts == set(range(4 * rank, 4 * rank + 4)), experts
    out = {}
    for n, p in lm.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[n] = local.detach().clone()
    return out


@pytest.mark.slow
def test_lazy_moe_folder_under_expert_parallelism_reads_only_each_ranks_experts(tmp_path):
    results, reference = _lazy_moe_on_two_ranks(_ep_moe_rank, tmp_path)
    for rank, params in enumerate(results):
        for n, p in reference.named_parameters():
            expected = p[4 * rank: 4 * rank + 4] if ".mlp.experts." in n else p
            assert torch.equal(params[n], expected), n
