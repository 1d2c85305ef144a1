"""Composite HF checkpoints (LLaVA, Qwen-VL, Gemma 3, Qwen2-Audio): ``MultimodalModel.from_pretrained`` against
the HF composite class itself, and ``save_pretrained`` back.

Each folder is written by ``save_pretrained`` from a tiny random composite built from a config (nothing is
downloaded). A batch holds two rows with different numbers of images / clips, right padding, and (audio) clips of
different lengths; loss, logits and every gradient must equal HF's own model on the same inputs (fp32).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import composites, loading
from lightning_mm.model.loading import is_meta, materialise
from tests.helpers.composite_case import run_case

IMG, VSTART, VEND, PAD = 100, 102, 103, 0
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
MROPE_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
VIDEO_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Qwen3.5: Gated DeltaNet layers 0-2 and 4-6, gated full attention 3 and 7 (HF's 3 : 1), interleaved M-RoPE on half
# of each 16-dim head
QWEN3_5_TEXT = dict(num_hidden_layers=8, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.5})


def tiny_composite(kind: str, **extra):
    import transformers as tf

    if kind == "llava":
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, image_size=16, patch_size=8)
        cfg = tf.LlavaConfig(vision_config=vision, text_config=dict(model_type="llama", **TEXT), image_token_id=IMG,
                             **extra)
        return tf.LlavaForConditionalGeneration(cfg)
    if kind == "gemma3":  # local layers with a 7-token window (shorter than the rows), 4 tokens per image
        from lightning_mm.model.families import LANGUAGE_FAMILIES

        text = LANGUAGE_FAMILIES["gemma3_text"].tiny_config(sliding_window=7).to_dict()
        text.update(extra.pop("text", {}))
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, image_size=16, patch_size=4)
        cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_id=IMG,
                              boi_token_id=VSTART, eoi_token_id=VEND, **extra)
        return tf.Gemma3ForConditionalGeneration(cfg)
    if kind in MROPE_KINDS:
        text = dict(TEXT, rope_parameters=MROPE)
        given = extra.pop("text", {})
        if kind == "qwen3_vl_moe":  # routed experts, the load-balancing loss in the loss
            text.update(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                        router_aux_loss_coef=0.05, output_router_logits=True)
        if kind in ("qwen3_5", "qwen3_5_moe"):
            text.update(QWEN3_5_TEXT)
            if kind == "qwen3_5_moe":  # routed experts beside a gated shared expert, the aux loss in the loss
                text.update(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
                            num_experts_per_tok=2, router_aux_loss_coef=0.05, output_router_logits=True)
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                          patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                          num_position_embeddings=16)
            vision.update(extra.pop("vision", {}))
            cls, cfg_cls = (tf.Qwen3_5ForConditionalGeneration, tf.Qwen3_5Config) if kind == "qwen3_5" else \
                (tf.Qwen3_5MoeForConditionalGeneration, tf.Qwen3_5MoeConfig)
        elif kind in ("qwen3_vl", "qwen3_vl_moe"):  # DeepStack from tower layers 0 and 2 into LLM layers 0 and 1
            text.update(head_dim=8)
            vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                          patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                          num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
            vision.update(extra.pop("vision", {}))
            cls, cfg_cls = (tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLConfig) if kind == "qwen3_vl" else \
                (tf.Qwen3VLMoeForConditionalGeneration, tf.Qwen3VLMoeConfig)
        elif kind == "qwen2_vl":
            vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2,
                          temporal_patch_size=2, in_channels=3)
            cls, cfg_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLConfig
        else:
            vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                          patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16,
                          fullatt_block_indexes=[1, 3])
            cls, cfg_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig
        text.update(given)
        cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=101,
                      vision_start_token_id=VSTART, vision_end_token_id=VEND, **extra)
        return cls(cfg)
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
                 max_source_positions=8)
    cfg = tf.Qwen2AudioConfig(audio_config=audio, text_config=dict(model_type="qwen2", **TEXT), audio_token_id=IMG,
                              **extra)
    return tf.Qwen2AudioForConditionalGeneration(cfg)


def save_composite(kind: str, path, **extra) -> str:
    torch.manual_seed(0)
    return save_hf(tiny_composite(kind, **extra), kind, path)


def save_hf(hf, kind: str, path) -> str:
    """Write a tiny HF composite with every tensor distinct, and a processor file naming its kind."""
    with torch.no_grad():  # HF initialises some parts to constants (zero biases): make every tensor distinct
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"kind": kind}))  # a processor file to carry along
    return str(path)


def _row(items: list[int], text=(5, 4, 3)) -> list[int]:
    """Text, then each item's placeholders between vision start/end tokens, then text."""
    g = torch.Generator().manual_seed(len(items) * 7 + sum(items))
    ids = torch.randint(1, 90, (text[0],), generator=g).tolist()
    for n in items:
        ids += [VSTART] + [IMG] * n + [VEND] + torch.randint(1, 90, (text[1],), generator=g).tolist()
    return ids + torch.randint(1, 90, (text[2],), generator=g).tolist()


def batch_for(kind: str, config):
    """(our batch, HF's keyword arguments): row 0 with two items, row 1 with one and right padding."""
    g = torch.Generator().manual_seed(1)
    if kind == "llava":
        per = (config.vision_config.image_size // config.vision_config.patch_size) ** 2  # CLS dropped
        counts = [[per, per], [per]]
        inputs = {"pixel_values": torch.randn(3, 3, 16, 16, generator=g)}
        hf_inputs = dict(inputs)
    elif kind == "gemma3":  # 16 patches pooled to 4 tokens per image
        counts = [[4, 4], [4]]
        inputs = {"pixel_values": torch.randn(3, 3, 16, 16, generator=g)}
        hf_inputs = dict(inputs)
    elif kind in MROPE_KINDS:
        grids = [[1, 8, 8], [1, 4, 8], [1, 8, 4]]
        counts = [[16, 8], [8]]
        dim = 3 * 2 * 4 * 4
        inputs = {"pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), dim, generator=g),
                  "image_grid_thw": torch.tensor(grids)}
        hf_inputs = dict(inputs)
    else:
        frames = [16, 10, 13]  # real mel frames per clip (of 16): 4, 2 and 3 tokens
        counts = [[4, 2], [3]]
        mask = (torch.arange(16)[None, :] < torch.tensor(frames)[:, None]).long()
        inputs = {"input_features": torch.randn(3, 16, 16, generator=g) * mask[:, None, :],
                  "feature_attention_mask": mask}
        hf_inputs = dict(inputs)
    rows = [_row(c) for c in counts]
    length = max(map(len, rows))
    ids = torch.full((2, length), PAD)
    attention = torch.zeros(2, length, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        attention[r, :len(row)] = 1
    labels = ids.masked_fill((ids == IMG) | (attention == 0), -100)
    hf_inputs.update(input_ids=ids, attention_mask=attention, labels=labels)
    if kind in MROPE_KINDS:
        hf_inputs["mm_token_type_ids"] = (ids == IMG).int()
    if kind == "gemma3":  # HF's image blocks (bidirectional within each image)
        hf_inputs["token_type_ids"] = (ids == IMG).long()
    modality = "audio" if kind == "qwen2_audio" else "vision"
    ours = {"input_ids": ids, "attention_mask": attention, "labels": labels, modality: inputs,
            "item_counts": {modality: torch.tensor([len(c) for c in counts])}}
    return ours, hf_inputs


KINDS = ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen2_audio",
         "gemma3"]
CLASSES = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
           "gemma3": "Gemma3ForConditionalGeneration",
           "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
           "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
           "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
           "qwen2_audio": "Qwen2AudioForConditionalGeneration"}


def load_hf(kind, path):
    import transformers

    return getattr(transformers, CLASSES[kind]).from_pretrained(path, attn_implementation="eager")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "qwen3_5_moe" else k for k in KINDS])
def test_loss_logits_gradients_and_round_trip_equal_hf(kind, tmp_path):
    tied = kind in ("qwen2_vl", "gemma3")  # the composite config ties the head to the embedding (its text config
    # does not)
    folder = save_composite(kind, tmp_path / "src", **({"tie_word_embeddings": True} if tied else {}))
    ref = load_hf(kind, folder).train()
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    lm = model.language_model
    assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tied
    spec = model.composite.spec
    modality = spec.modality
    videos = {"video": 101} if kind in VIDEO_KINDS else {}  # videos through the same tower (one copy)
    assert model.placeholder_ids == {modality: IMG, **videos} and model.causal_modalities
    assert model.shared_encoders == dict.fromkeys(videos, "vision") and model.pipeline_encoders == [modality]
    batch, hf_inputs = batch_for(kind, ref.config)
    # the placeholder counts are known before any encoder runs (grids, per-clip lengths, CLS dropped)
    counts = {"llava": [4, 4, 4], "qwen2_vl": [16, 8, 8], "qwen2_5_vl": [16, 8, 8], "qwen3_vl": [16, 8, 8],
              "qwen3_vl_moe": [16, 8, 8], "qwen3_5": [16, 8, 8], "qwen3_5_moe": [16, 8, 8], "qwen2_audio": [4, 2, 3],
              "gemma3": [4, 4, 4]}
    assert model.encoders[modality].num_tokens(batch[modality]) == counts[kind]
    assert_like_hf(model, ref, spec, batch, hf_inputs, logits_atol=1e-5)

    # save_pretrained -> the HF class loads exactly the tensors it was built from, and the processor file
    out_dir = tmp_path / "out"
    model.save_pretrained(out_dir)
    assert (out_dir / "preprocessor_config.json").read_text() == json.dumps({"kind": kind})
    assert_saved_exactly(model, out_dir, load_hf(kind, folder).state_dict(), load_hf(kind, out_dir).state_dict())


def assert_saved_exactly(model, out_dir, original: dict, saved: dict) -> None:
    """The HF class reads back from ``out_dir`` exactly the tensors (``saved``) it was built from (``original``), and
    our model of the written folder is ``model``."""
    assert saved.keys() == original.keys()
    for name, value in original.items():
        assert saved[name].dtype == value.dtype and torch.equal(saved[name], value), name
    again = lmm.MultimodalModel.from_pretrained(out_dir)
    for (n, a), (m, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n == m and torch.equal(a, b), n


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_mrope_positions_equal_hf_rope_index(kind, tmp_path):
    """Our M-RoPE positions are HF's get_rope_index (padding 0), with grids of different shapes per row."""
    folder = save_composite(kind, tmp_path / "src")
    ref = load_hf(kind, folder)
    model = lmm.MultimodalModel.from_pretrained(folder)
    batch, hf_inputs = batch_for(kind, ref.config)
    theirs, _ = ref.model.get_rope_index(hf_inputs["input_ids"], hf_inputs["mm_token_type_ids"],
                                         image_grid_thw=hf_inputs["image_grid_thw"],
                                         attention_mask=hf_inputs["attention_mask"])
    ours = model.position_ids_fn(batch["input_ids"], {"vision": batch["vision"]}, batch["attention_mask"])
    assert ours.shape == (*batch["input_ids"].shape, 3)
    assert torch.equal(ours.permute(2, 0, 1), theirs)
    assert int(ours.max()) < batch["input_ids"].shape[1]  # 2-D images compress positions


def test_lazy_build_reads_only_a_stages_tensors_and_equals_eager(tmp_path, monkeypatch):
    folder = save_composite("llava", tmp_path / "src")
    eager = lmm.MultimodalModel.from_pretrained(folder)
    with torch.device("meta"):
        lazy = lmm.MultimodalModel.from_pretrained(folder)
    assert is_meta(lazy) and all(t.is_meta for t in lazy.state_dict().values())
    src = lazy.language_model.pretrained_source
    file, key = src.tensors["model.embed_tokens.weight"]  # the composite's own key, as HF saved it
    assert src.folder == folder and key in loading.read_safetensors_header(os.path.join(folder, file))
    assert key in ("language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    # LLaVA keeps only the layers up to the feature layer (-2 of 3): the third is never built or read
    assert len(lazy.encoders["vision"].layers) == 2
    assert set(lazy.composite.passthrough) == {k for k in eager.composite.passthrough} and all(
        ".encoder.layers.2." in k for k in lazy.composite.passthrough)
    stage = copy.deepcopy(lazy)
    from lightning_mm.parallel.pruning import prune

    prune(stage, {n for n, _ in stage.named_parameters() if n.startswith("language_model.model.layers.1")
                  or n.startswith("language_model.lm_head")})
    read = []
    real = loading._read_tensors
    monkeypatch.setattr(loading, "_read_tensors", lambda loads, device: (read.extend(k for *_, k in loads),
                                                                         real(loads, device)))
    materialise(stage, "cpu", seed=0)
    assert read and all(("language_model" in k and ".layers.1." in k) or k.endswith("lm_head.weight")
                        for k in read), read
    assert len(read) == sum(1 for n, t in stage.state_dict().items() if not n.startswith("encoders"))
    monkeypatch.setattr(loading, "_read_tensors", real)
    materialise(lazy, "cpu", seed=0)
    for (n, a), (m, b) in zip(lazy.state_dict().items(), eager.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    for (n, a), (m, b) in zip(lazy.named_buffers(), eager.named_buffers()):  # rotary frequencies etc.
        assert n == m and torch.equal(a, b), n


def test_bidirectional_option_and_collator_positions(tmp_path):
    folder = save_composite("qwen2_vl", tmp_path / "src")
    model = lmm.MultimodalModel.from_pretrained(folder, causal_modalities=False)
    assert not model.causal_modalities
    batch, _ = batch_for("qwen2_vl", model.composite.config)
    bam = model.build_bam(batch["input_ids"], batch["attention_mask"])
    from lightning_mm.attention import mask as masks

    image = batch["input_ids"] == IMG
    assert not (bam[image] & masks.CAUSAL).any() and (bam[~image & batch["attention_mask"].bool()] & masks.CAUSAL).all()
    # the collator lays out M-RoPE positions per sample, equal to the model's over the padded batch
    samples = []
    for r in range(2):
        ids = batch["input_ids"][r][batch["attention_mask"][r].bool()]
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[1:] = ~((ids[1:] == IMG) & (ids[:-1] == IMG))  # one placeholder per image
        items = slice(0, 2) if r == 0 else slice(2, 3)
        grids = batch["vision"]["image_grid_thw"][items]
        sizes = grids.prod(-1).tolist()
        first = sum(batch["vision"]["image_grid_thw"][:items.start].prod(-1).tolist())
        samples.append({"input_ids": ids[keep], "vision": {
            "pixel_values": batch["vision"]["pixel_values"][first:first + sum(sizes)], "image_grid_thw": grids}})
    collated = lmm.data.MultimodalCollator(model)(samples)
    assert torch.equal(collated["input_ids"], batch["input_ids"])
    assert torch.equal(collated["position_ids"],
                       model.position_ids_fn(batch["input_ids"], {"vision": batch["vision"]}, batch["attention_mask"]))
    from lightning_mm.data.validate import validate_batch

    validate_batch(collated, model)
    assert collated["bam"].equal(bam)


def test_unsupported_folders_are_named(tmp_path):
    from lightning_mm.model.families import tiny_language_model

    path = tmp_path / "llama"
    tiny_language_model("llama").save_pretrained(path)
    with pytest.raises(loading.ModelFolderError, match="not a supported composite; supported: "
                                                       "LlavaForConditionalGeneration"):
        lmm.MultimodalModel.from_pretrained(path)
    folder = save_composite("llava", tmp_path / "multi", vision_feature_layer=[-2, -1])
    with pytest.raises(loading.ModelFolderError, match="several layers concatenated"):
        lmm.MultimodalModel.from_pretrained(folder)


def test_module_takes_a_folder_and_unimodal_save_writes_parts(tmp_path):
    folder = save_composite("qwen2_audio", tmp_path / "src")
    module = lmm.MultimodalLightningModule(model=folder)
    assert module.model.composite.spec.class_name == "Qwen2AudioForConditionalGeneration"
    from lightning_mm.model import tiny_encoder, tiny_language_model

    parts = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model())
    manifest = parts.save_pretrained(tmp_path / "parts")
    assert set(manifest["encoders"]) == {"vision"}
    assert os.path.isfile(tmp_path / "parts" / "language_model" / "config.json")
    back = lmm.MultimodalModel.from_pretrained(tmp_path / "parts")  # reads the parts folder it wrote
    assert back.placeholder_ids == parts.placeholder_ids
    mine = dict(parts.named_parameters())
    for name, p in back.named_parameters():
        torch.testing.assert_close(p, mine[name], rtol=0, atol=0, msg=name)


def assert_like_hf(model, ref, spec, batch: dict, hf_inputs: dict, logits_atol: float) -> None:
    """Our model of a composite against HF's on one batch: logits at the real tokens, the loss, and every
    gradient HF computes (parameters HF's forward does not use get none here either)."""
    out = model(**{k: v for k, v in batch.items() if k != "item_counts"})
    expected = ref(**hf_inputs)
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(out.logits[keep], expected.logits[keep], atol=logits_atol, rtol=logits_atol)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    expected.loss.backward()
    ours = dict(model.named_parameters())
    compared = 0
    for name, p in ref.named_parameters():
        mine = ours.get(composites.to_ours(spec, name))
        if p.grad is None:  # unused by HF's forward (layers past the feature layer, post-norms, SigLIP's head)
            assert mine is None or mine.grad is None or not mine.grad.any(), name
            continue
        if mine is not None and not mine.requires_grad:  # frozen by the class's constructor (Qwen2-Audio's
            continue                                     # positions), which HF's from_pretrained unfreezes
        assert mine is not None and mine.grad is not None, name
        torch.testing.assert_close(mine.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
        compared += 1
    assert compared > 20


def _run_case(case: dict, tmp_path, name: str):
    return run_case("composite_case.py", case, tmp_path, name)


@pytest.mark.slow
def test_qwen2_vl_composite_under_the_strategy_trains_like_one_process(tmp_path):
    """Qwen2-VL from its composite folder, M-RoPE positions from the collator: LLM pp 2 (built lazily, each rank
    reading its stage) and LLM cp 2 give one process's losses and trained parameters."""
    folder = save_composite("qwen2_vl", tmp_path / "src")
    ref_losses, ref_params = _run_case({"folder": folder}, tmp_path, "single")
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    for name, case in (("pp2", {"llm_pp": 2, "lazy": True}), ("cp2", {"llm_cp": 2})):
        losses, params = _run_case({"folder": folder, **case}, tmp_path, name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert set(params) == set(ref_params), name
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


def test_yaml_names_a_composite_folder_and_export_writes_the_composite(tmp_path, capsys):
    """A fit YAML whose model is a composite folder; ``lightning-mm export`` of a checkpoint of it writes one folder
    the HF class loads with the checkpoint's tensors (frozen ones as the folder has them)."""
    import yaml

    from lightning_mm import checkpoint as ckpt
    from lightning_mm.trainer.cli import MultimodalCLI, main

    folder = save_composite("llava", tmp_path / "src")
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({"seed_everything": 0, "model": {"model": folder,
                                                                      "freeze": {"language_model": True}}}))
    cli = MultimodalCLI(run=False, args=["--config", str(config), "--trainer.logger=false"],
                        save_config_callback=None)
    model = cli.model.model
    assert model.composite.spec.class_name == "LlavaForConditionalGeneration"
    trained = {n: p.detach() + 1.0 for n, p in model.named_parameters() if p.requires_grad}
    layout = {"parameters": ckpt.model_fingerprint(model), "trainable": sorted(trained), "frozen_saved": False,
              "world_size": 1, "stages": []}
    path = str(tmp_path / "step=1.ckpt")
    ckpt.save_sharded(path, {f"model/{n}": v for n, v in trained.items()}, {}, layout, rank=0)
    main(["export", "--config", str(config), "--ckpt_path", path, "--out_dir", str(tmp_path / "hf")])
    assert "as LlavaForConditionalGeneration" in capsys.readouterr().out
    exported = load_hf("llava", tmp_path / "hf").state_dict()
    source = load_hf("llava", folder).state_dict()
    spec = model.composite.spec
    for name, value in exported.items():
        ours = composites.to_ours(spec, name)
        expected = trained[ours] if ours in trained else source[name]
        assert torch.equal(value, expected), name
    assert any(composites.to_ours(spec, n) in trained for n in exported)
    assert any(composites.to_ours(spec, n) not in trained for n in exported)
