"""Video through the image tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a "video" modality whose encoder shares the vision
encoder's tower and projector, against HF's composite on a batch mixing an image sample, a video sample and a
sample with both; and under pipeline stages, where the video runs on the tower's own stages."""

from __future__ import annotations

import pytest
import torch

import lightning_mm as lmm
from tests.test_hf_composites import IMG, PAD, VEND, VSTART, assert_like_hf, load_hf, save_composite

VID = 101
DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def _row(items: list[tuple[int, int]], seed: int, frames: dict[int, int] | None = None) -> list[int]:
    """Text, then each (placeholder id, tokens) item between vision start/end tokens, then text. ``frames``: item
    index -> temporal steps of a video laid out frame by frame, each after two timestamp tokens (Qwen3-VL's
    processor writes ``<t seconds>`` there) and between its own start/end tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 90, (4,), generator=g).tolist()
    for i, (pid, n) in enumerate(items):
        t = (frames or {}).get(i)
        if t:
            for _ in range(t):
                ids += torch.randint(1, 90, (2,), generator=g).tolist() + [VSTART] + [pid] * (n // t) + [VEND]
        else:
            ids += [VSTART] + [pid] * n + [VEND]
        ids += torch.randint(1, 90, (3,), generator=g).tolist()
    return ids + torch.randint(1, 90, (2,), generator=g).tolist()


def mixed_batch(kind: str):
    """(our batch, HF's keyword arguments): an image and a video in row 0, a video in row 1, an image in row 2,
    right padding. Videos of 2 and 3 temporal patches, images of different grids."""
    g = torch.Generator().manual_seed(2)
    image_grids, video_grids = [[1, 8, 4], [1, 4, 4]], [[2, 4, 4], [3, 4, 8]]
    tokens = lambda grid: grid[0] * grid[1] * grid[2] // 4  # noqa: E731  (merge 2 x 2)
    per_frame = kind in ("qwen3_vl", "qwen3_vl_moe")  # Qwen3-VL: frames apart, each after its timestamp
    rows = [_row([(IMG, tokens(image_grids[0])), (VID, tokens(video_grids[0]))], 0,
                 {1: video_grids[0][0]} if per_frame else None),
            _row([(VID, tokens(video_grids[1]))], 1, {0: video_grids[1][0]} if per_frame else None),
            _row([(IMG, tokens(image_grids[1]))], 2)]
    length = max(map(len, rows))
    ids, attention = torch.full((3, length), PAD), torch.zeros(3, length, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)], attention[r, :len(row)] = torch.tensor(row), 1
    patches = lambda grids: sum(t * h * w for t, h, w in grids)  # noqa: E731
    vision = {"pixel_values": torch.randn(patches(image_grids), DIM, generator=g),
              "image_grid_thw": torch.tensor(image_grids)}
    video = {"pixel_values_videos": torch.randn(patches(video_grids), DIM, generator=g),
             "video_grid_thw": torch.tensor(video_grids)}
    if kind == "qwen2_5_vl":
        video["second_per_grid_ts"] = torch.tensor([0.5, 1.5])
    labels = ids.masked_fill((ids == IMG) | (ids == VID) | (attention == 0), -100)
    ours = {"input_ids": ids, "attention_mask": attention, "labels": labels, "vision": vision, "video": video,
            "item_counts": {"vision": torch.tensor([1, 0, 1]), "video": torch.tensor([1, 1, 0])}}
    hf = {**vision, **video, "input_ids": ids, "attention_mask": attention, "labels": labels,
          "mm_token_type_ids": (ids == IMG).int() + 2 * (ids == VID).int()}
    return ours, hf


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_images_and_videos_equal_hf_and_share_one_tower(kind, tmp_path):
    folder = save_composite(kind, tmp_path / "src")
    ref = load_hf(kind, folder).train()
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    assert model.shared_encoders == {"video": "vision"}
    assert model.encoders["video"].module is model.encoders["vision"].module  # one copy in memory
    assert not any(n.startswith("encoders.video.") for n, _ in model.named_parameters())
    batch, hf_inputs = mixed_batch(kind)
    assert model.encoders["video"].num_tokens(batch["video"]) == [8, 24]
    theirs, _ = ref.model.get_rope_index(hf_inputs["input_ids"], hf_inputs["mm_token_type_ids"],
                                         image_grid_thw=hf_inputs["image_grid_thw"],
                                         video_grid_thw=hf_inputs["video_grid_thw"],
                                         attention_mask=hf_inputs["attention_mask"],
                                         **({"second_per_grid_ts": hf_inputs["second_per_grid_ts"]}
                                            if kind == "qwen2_5_vl" else {}))
    ours = model.position_ids_fn(batch["input_ids"], batch, batch["attention_mask"])
    assert torch.equal(ours.permute(2, 0, 1), theirs)
    assert_like_hf(model, ref, model.composite.spec, batch, hf_inputs, logits_atol=1e-5)
    out = tmp_path / "out"  # one copy in the HF folder too: the class loads exactly the source's tensors
    model.save_pretrained(out)
    saved, source = load_hf(kind, out).state_dict(), load_hf(kind, folder).state_dict()
    assert saved.keys() == source.keys() and all(torch.equal(saved[k], v) for k, v in source.items())


def test_collated_videos_equal_hf(tmp_path):
    """Samples with images, videos or both, one placeholder per item, collated (placeholders expanded, M-RoPE
    positions per sample): the model's loss equals HF's on the same rows."""
    from tests.helpers.composite_case import sample

    folder = save_composite("qwen2_vl", tmp_path / "src")
    ref = load_hf("qwen2_vl", folder)
    model = lmm.MultimodalModel.from_pretrained(folder)
    samples = [sample(i, videos=True) for i in range(3)]
    assert {k for s in samples for k in s} == {"input_ids", "vision", "video"}
    batch = lmm.data.MultimodalCollator(model)(samples)
    ids = batch["input_ids"]
    hf = {"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": batch["labels"],
          "mm_token_type_ids": (ids == IMG).int() + 2 * (ids == VID).int(), **batch["vision"], **batch["video"]}
    with torch.no_grad():
        ours = model(**{k: v for k, v in batch.items() if k != "item_counts"})
        theirs = ref(**hf)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.combines("encoder_cp", "llm_cp")  # the "vcp2_cp2" run
def test_videos_under_pipeline_stages_train_like_one_process(tmp_path):
    """Images and videos through one tower: vision pp 2 + LLM pp 2 (the video runs on the tower's stages, whose
    one copy of the parameters gets both modalities' gradients), LLM cp 2, and vision cp 2 + LLM cp 2 (a video's
    temporal patches spread over the tower's CP ranks, so a microbatch holding one video alone splits it) train
    like one process."""
    from tests.helpers.composite_case import run_case

    folder = save_composite("qwen2_5_vl", tmp_path / "src")
    ref_losses, ref_params = run_case("composite_case.py", {"folder": folder, "videos": True}, tmp_path, "single")
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    for name, case in (("vpp2_pp2", {"vision_pp": 2, "llm_pp": 2}), ("cp2", {"llm_cp": 2}),
                       ("vcp2_cp2", {"vision_cp": 2, "llm_cp": 2})):
        losses, params = run_case("composite_case.py", {"folder": folder, "videos": True, **case}, tmp_path, name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=name)
        assert set(params) == set(ref_params), name
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


def test_a_videos_temporal_patches_as_cp_pieces_give_its_features():
    """Encoder CP spreads a video's temporal patches: encoding the pieces one by one and concatenating gives the
    video's own features (Qwen2-VL and Qwen2.5-VL towers, whose attention and windows stay inside a patch)."""
    from lightning_mm.data.cp_plans import EncoderItems
    from lightning_mm.model.families import VideoInputs, encoder_family, tiny_encoder

    for kind in ("qwen2_vl", "qwen2_5_vl"):
        torch.manual_seed(0)
        tower = tiny_encoder(kind)
        fam = VideoInputs(encoder_family(tower))
        videos = fam.random_inputs(tower.config, 2, torch.Generator().manual_seed(1), grids=[(3, 8, 8), (2, 8, 4)])
        whole = fam.reference(tower, videos)
        pieces = fam.cp_pieces(videos)
        assert pieces["video_grid_thw"].tolist() == [[1, 8, 8]] * 3 + [[1, 8, 4]] * 2
        parts = [fam.reference(tower, fam.select_items(pieces, torch.tensor([i]))) for i in range(5)]
        torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
        shards, tokens = EncoderItems(fam, tower.config, 2).plan(videos)
        assert tokens == [16, 16, 16, 8, 8] and sorted(i for s in shards for i in s) == list(range(5))


@pytest.mark.slow
def test_generation_with_videos_equals_hf_generate(tmp_path):
    """One process and ``trainer.predict`` across vision pp 1 + LLM pp 2, LLM pp 3, and LLM pp 2 with dp 2 on
    prompts mixing images and videos: the greedy tokens of HF's own composite ``generate`` (videos' M-RoPE
    positions included; each replica decodes its own prompts)."""
    from tests.helpers.pipeline_generation_case import qwen_prompts
    from tests.test_mrope_generate import _assert_like_hf
    from tests.test_pipeline_generation import _check, _run

    folder = save_composite("qwen2_5_vl", tmp_path / "src", text={"num_hidden_layers": 3})
    model, ref = lmm.MultimodalModel.from_pretrained(folder).eval(), load_hf("qwen2_5_vl", folder).eval()
    ours, _ = qwen_prompts("qwen2_5_vl", 0, videos=True)
    _assert_like_hf(model, ref, ours)
    _check(_run({"kind": "qwen2_5_vl", "folder": folder, "llm_pp": 2, "videos": True}, tmp_path, "pp2"), 3)
    _check(_run({"kind": "qwen2_5_vl", "folder": folder, "llm_pp": 3, "videos": True}, tmp_path, "pp3"), 4)
    _check(_run({"kind": "qwen2_5_vl", "folder": folder, "llm_pp": 2, "dp": 2, "videos": True}, tmp_path,
                "pp2_dp2"), 3)


@pytest.mark.slow
def test_the_planner_costs_a_shared_tower_once_with_both_modalities_work(tmp_path):
    """The planner sees one vision module (the layout's), whose layer costs hold the images' and the videos' work;
    synthetic batches never put a composite's in-vocabulary placeholder ids in their text."""
    from lightning_mm.planner import model_costs

    model = lmm.MultimodalModel.from_pretrained(save_composite("qwen2_vl", tmp_path / "src"))
    times = model_costs.flop_times(model)
    assert sorted(times) == ["language_model", "vision"]
    alone = lmm.MultimodalModel({"vision": model.encoders["vision"]}, model.language_model,
                                placeholder_ids={"vision": IMG})
    images_only = model_costs.flop_times(alone)["vision"]
    assert all(b > a > 0 for a, b in zip(images_only.forward[1:-1], times["vision"].forward[1:-1]))
    assert model_costs.planned_partition(model, {"vision": 2, "language_model": 2}) == \
        {"vision": [1, 1], "language_model": [1, 1]}


def test_qwen3_vl_generate_with_videos_frame_by_frame_equals_hf_generate(tmp_path):
    """Qwen3-VL: videos laid out frame by frame between timestamp tokens (each frame its own M-RoPE item, as HF's
    ``get_rope_index`` splits them), DeepStack features of images and videos at prefill: one-process greedy tokens
    and every step's logits equal HF's composite ``generate`` on the left-padded batch."""
    from tests.test_mrope_generate import _assert_like_hf

    folder = save_composite("qwen3_vl", tmp_path / "src")
    model, ref = lmm.MultimodalModel.from_pretrained(folder).eval(), load_hf("qwen3_vl", folder).eval()
    batch, _ = mixed_batch("qwen3_vl")
    _assert_like_hf(model, ref, {k: v for k, v in batch.items() if k not in ("labels", "item_counts")})


@pytest.mark.slow
def test_videos_under_per_module_data_parallelism_train_like_one_process(tmp_path):
    """Per-module data parallelism with a shared tower: vision dp 2 + LLM dp 1, samples of 0 to 2 images and 0 or 1
    video (some text only, some video only). A row's images and video route together to one vision replica, which
    encodes both through the one tower; losses and every parameter equal one process."""
    from tests.helpers.composite_case import run_case

    folder = save_composite("qwen2_vl", tmp_path / "src")
    case = {"folder": folder, "videos": True, "mixed": True}
    ref_losses, ref_params = run_case("composite_case.py", case, tmp_path, "single")
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    losses, params = run_case("composite_case.py", {**case, "vision_dp": 2, "llm_dp": 1}, tmp_path, "vdp2_dp1")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)


def test_a_shared_towers_items_route_with_its_owners(tmp_path):
    """The router folds a video's work into its tower's: a row holding only a video goes to a vision replica, and
    each row's image and video go to the same one."""
    from lightning_mm.data.cp_plans import EncoderItems, GroupRouter

    model = lmm.MultimodalModel.from_pretrained(save_composite("qwen2_vl", tmp_path / "src"))
    batch, _ = mixed_batch("qwen2_vl")
    router = GroupRouter({e: EncoderItems.of(enc, 1) for e, enc in model.encoders.items()}, {"vision": 2}, 1, 1,
                         model.shared_encoders)
    routing = router(batch)
    assert set(routing.encoder_rows) == {"vision"}
    rows = sorted(r for replica in routing.encoder_rows["vision"] for r in replica[0])
    assert rows == [0, 1, 2]  # row 1 holds only a video
