"""lightning-mm inside an existing Lightning project: ``use_bitfield_attention`` and ``pack_multimodal`` on plain HF
models, and the ``ContextParallel`` callback under Lightning's own DDPStrategy / ModelParallelStrategy (FSDP2).

The model is a tiny HF composite built from a config (LLaVA or Qwen2-VL, fp32); nothing downloads.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_mm.attention import mask as masks
from lightning_mm.attention import use_bitfield_attention
from lightning_mm.attention.bitfield_hf import UnsupportedModelError, bitfield_adapter, hf_words
from lightning_mm.data import PackingCollator, pack_multimodal
from tests.helpers.existing_project_case import IMG, VSTART, sample, tiny_model, unpacked_inputs

KINDS = ["llava", "qwen2_vl"]


def _token_sums(logits, labels):
    """Per-row-position cross-entropy (sum reduction per token) of HF-aligned labels: [B, S-1]."""
    lg, tg = logits[:, :-1].float(), labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), ignore_index=-100,
                                           reduction="none")
    return ce.reshape(tg.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_rows_give_per_sample_losses_and_gradients(kind):
    """Samples packed into rows (with bitfield attention) give each sample's own loss, and the gradients of the
    summed token losses equal those of the samples run one by one through the unchanged HF model."""
    ref = tiny_model(kind).eval()
    model = use_bitfield_attention(copy.deepcopy(ref))
    samples = [sample(kind, i) for i in range(6)]
    # one by one, the HF model as it is
    ref_sums = []
    for s in samples:
        out = ref(**unpacked_inputs(kind, s))
        n = int((out.logits.new_tensor(0) + (unpacked_inputs(kind, s)["labels"][:, 1:] != -100).sum()).item())
        ref_sums.append(out.loss * n)
    torch.stack(ref_sums).sum().backward()
    # packed rows
    batch = pack_multimodal(samples, 48, model.config)
    assert batch["input_ids"].shape[0] < len(samples)  # several samples share a row
    out = model(**batch)
    per_token = _token_sums(out.logits, batch["labels"])
    seg = batch["segment_ids"][:, 1:]  # the segment of the predicted token
    got = {}
    for r in range(per_token.shape[0]):
        for s in range(int(batch["segment_ids"][r].max()) + 1):
            here = (batch["segment_ids"][r] == s) & (batch["attention_mask"][r] == 1)
            if bool(here.any()):  # which sample this is (first-fit may reorder them)
                ids = batch["input_ids"][r][here]
                i = next(i for i, x in enumerate(samples) if torch.equal(x["input_ids"][0], ids))
                got[i] = per_token[r][seg[r] == s].sum()
    assert sorted(got) == list(range(len(samples)))
    got = [got[i] for i in range(len(samples))]
    torch.testing.assert_close(torch.stack(got).detach(), torch.stack(ref_sums).detach(), rtol=1e-5, atol=1e-5)
    # HF's own outputs.loss of the packed batch is the mean over its label tokens
    n_labels = int((batch["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(out.loss.detach(), per_token.sum().detach() / n_labels, rtol=1e-5, atol=1e-6)
    per_token.sum().backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        if a.grad is None:  # LLaVA's last vision layer feeds nothing (vision_feature_layer=-2)
            assert b.grad is None, name
            continue
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packing_layout_and_words():
    """Rows, labels (first token of every sample and placeholders ignored), positions restarting per sample,
    media concatenated in placeholder order, bidirectional image spans on request."""
    model = tiny_model("llava")
    samples = [sample("llava", i) for i in range(5)]
    batch = PackingCollator(model.config, 40)(samples)
    rows, length = batch["input_ids"].shape
    assert length == 40 and batch["bam"].dtype == torch.int64
    starts = (batch["position_ids"] == 0) & (batch["attention_mask"] == 1)
    assert bool((batch["labels"][starts] == -100).all())
    assert bool((batch["labels"][batch["input_ids"] == IMG] == -100).all())
    assert bool((batch["bam"][batch["attention_mask"] == 0] == 0).all())
    assert batch["pixel_values"].shape[0] == int((batch["input_ids"] == IMG).sum()) // 4
    order = []  # images appear in the rows in the order the samples were placed
    for r in range(rows):
        for s in range(int(batch["segment_ids"][r].max()) + 1):
            ids = batch["input_ids"][r][(batch["segment_ids"][r] == s) & (batch["attention_mask"][r] == 1)]
            if len(ids):
                order.append(ids)
    assert sum(int((o == VSTART).sum()) for o in order) == batch["pixel_values"].shape[0]
    bi = pack_multimodal(samples, 40, model.config, modality_attention="bidirectional")["bam"]
    assert bool((bi[batch["input_ids"] == IMG] == 2).all())  # the image bit alone
    dense = masks.to_dense(bi, batch["segment_ids"])
    r, j = torch.nonzero(batch["input_ids"] == IMG)[0].tolist()
    assert bool(dense[r, j, j + 1])  # an image token sees the next one
    qwen = tiny_model("qwen2_vl")
    qb = pack_multimodal([sample("qwen2_vl", i) for i in range(4)], 48, qwen.config, num_rows=3)
    assert qb["position_ids"].shape == (3, 3, 48) and qb["input_ids"].shape == (3, 48)
    assert qb["image_grid_thw"].shape[1] == 3 and "mm_token_type_ids" in qb


def test_mrope_positions_of_a_packed_sample_equal_hf_rope_index():
    model = tiny_model("qwen2_vl")
    samples = [sample("qwen2_vl", i, n_images=2) for i in range(3)]
    batch = pack_multimodal(samples, 80, model.config)
    at = 0
    for s in samples:  # all in row 0, in order
        n = s["input_ids"].shape[1]
        theirs, _ = model.model.get_rope_index(s["input_ids"], (s["input_ids"] == IMG).int(),
                                               image_grid_thw=s["image_grid_thw"])
        assert torch.equal(batch["position_ids"][:, 0, at:at + n], theirs[:, 0])
        at += n


def test_words_from_hf_inputs():
    """Segments from position restarts (1-D and M-RoPE), padding from attention_mask, the causal default."""
    model = tiny_model("llava")
    ids = torch.tensor([[5, 6, IMG, IMG, 7, 8, 9, 0]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    am = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    bam, seg = hf_words(model.config, ids, am, pos)
    assert seg.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    assert bam[0, -1] == 0 and len(set(bam[0, :-1].tolist())) == 1
    _, seg3 = hf_words(model.config, ids, am, pos[None].expand(3, -1, -1))
    assert torch.equal(seg3, seg)
    with pytest.raises(ValueError, match="input_ids"):
        hf_words(model.config, None)


def test_use_bitfield_attention_refuses_what_it_cannot_serve():
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        use_bitfield_attention(torch.nn.Linear(2, 2))
    model = tiny_model("llava")
    decoder = model.model.language_model
    cls = type(decoder)
    saved = cls._supports_attention_backend
    cls._supports_attention_backend = False
    try:
        with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
            use_bitfield_attention(model)
    finally:
        cls._supports_attention_backend = saved
    use_bitfield_attention(model)
    assert use_bitfield_attention(model) is model and bitfield_adapter(model) is not None
    with pytest.raises(ValueError, match="remove it first"):
        use_bitfield_attention(model, modality_attention="bidirectional")
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="raise max_length"):
        pack_multimodal([sample("llava", 3)], 8, model.config)
    with pytest.raises(ValueError, match="videos"):
        pack_multimodal([{"input_ids": torch.tensor([1, 2]), "pixel_values_videos": torch.zeros(1)}], 8,
                        model.config)


# ------------------------------------------------------------------------------------------ ContextParallel
def _callback_refusal(fn, match):
    with pytest.raises((ValueError, UnsupportedModelError)) as info:
        fn()
    assert info.match(match), str(info.value)
    return str(info.value)


def test_context_parallel_refuses_strategies_it_cannot_serve():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

    from lightning_mm.trainer.callbacks import ContextParallel

    cb = ContextParallel(2)
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # Lightning's class, without deepspeed installed
    _callback_refusal(lambda: cb.check_strategy(deepspeed), "strategy='ddp'")
    _callback_refusal(lambda: cb.check_strategy(FSDPStrategy()), "switch to ModelParallelStrategy")
    _callback_refusal(lambda: cb.check_strategy(SingleDeviceStrategy("cpu")), "DDPStrategy")
    cb.check_strategy(DDPStrategy())  # served
    _callback_refusal(lambda: ContextParallel(2, mode="hybrid"), r"cp=2 has no such divisor")
    _callback_refusal(lambda: ContextParallel(8, mode="hybrid", ulysses=3), r"choose K in \[2, 4\]")
    _callback_refusal(lambda: ContextParallel(2, mode="ring"), "choose one of")
    assert ContextParallel(4, mode="hybrid", ulysses=2).degree == 2 and ContextParallel(4, mode="ulysses").degree == 4
    heads = "4 query heads are not divisible by the Ulysses degree 8"  # the tiny LLaVA: 4 heads, 2 KV heads
    _callback_refusal(lambda: ContextParallel(8, mode="ulysses").check_heads(tiny_model("llava")), heads)
    ContextParallel(4, mode="ulysses").check_heads(tiny_model("llava"))  # 2 KV heads divide 4: repeated
    _callback_refusal(lambda: ContextParallel(2, distribution="best"), "lpt")
    _callback_refusal(lambda: ContextParallel(0), "positive int")


def _world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # conftest destroys it


def test_context_parallel_refuses_cp_sizes_that_do_not_divide_and_models_it_cannot_replace():
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_mm.trainer.callbacks import ContextParallel

    _world_of_one()
    trainer = SimpleNamespace(strategy=DDPStrategy())

    class Plain(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

    msg = _callback_refusal(lambda: ContextParallel(2).setup(trainer, Plain(tiny_model("llava")), "fit"),
                            "does not divide the 1 data-parallel ranks")
    assert "choose cp_size among [1]" in msg
    _callback_refusal(lambda: ContextParallel(1).setup(trainer, Plain(torch.nn.Linear(2, 2)), "fit"),
                      "self.model = LlavaForConditionalGeneration")
    two = Plain(tiny_model("llava"))
    two.other = tiny_model("qwen2_vl")
    _callback_refusal(lambda: ContextParallel(1).setup(trainer, two, "fit"), "model_attr='model'")
    llava = tiny_model("llava")
    cls = type(llava.model.language_model)
    saved = cls._supports_attention_backend
    cls._supports_attention_backend = False
    try:
        _callback_refusal(lambda: ContextParallel(1).setup(trainer, Plain(llava), "fit"), "AttentionInterface")
    finally:
        cls._supports_attention_backend = saved


def test_context_parallel_refuses_a_call_without_labels():
    from lightning_mm.trainer.callbacks import ContextParallel

    cb = ContextParallel(2, block_size=4)
    model = tiny_model("llava")
    batch = pack_multimodal([sample("llava", i) for i in range(3)], 40, model.config)
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    call = {"bam": batch["bam"], "segment_ids": batch["segment_ids"]}
    _callback_refusal(lambda: cb.top(model, dict(kwargs), call), r"pass labels=\.\.\. to the model")
    cb.top(model, dict(kwargs, labels=batch["labels"]), call)  # with labels: planned
    assert len(call["plan"]) == 2 and sum(cb.last_work) > 0
    ContextParallel(2, gather_logits=True).top(model, dict(kwargs), dict(call))  # its own loss from the logits


def _trains_alike(tmp_path, case: dict, name: str, dp: int = 2, cp: int = 2):
    """dp ranks without the callback vs dp x cp with it, same global batches: same losses and parameters."""
    from tests.helpers.launch import run_trainer_case

    script = __import__("tests.helpers.existing_project_case", fromlist=["x"]).__file__
    ref, ref_params = run_trainer_case(script, dict(case, devices=dp, cp=0), tmp_path, name + "_dp")
    got, params = run_trainer_case(script, dict(case, devices=dp * cp, cp=cp), tmp_path, name + "_cp")
    assert len(got["train"]) == case["steps"]
    assert got["train"] == pytest.approx(ref["train"], rel=1e-5, abs=1e-6)
    assert len(got["work"]) == cp and min(got["work"]) > 0
    assert got["attention_modes"] == ([case["mode"]] if case.get("mode", "allgather") != "allgather" else [])
    initial = tiny_model(case["kind"]).state_dict()
    assert any(not torch.allclose(ref_params[n], initial[n]) for n in ref_params)  # it trained
    assert ref_params.keys() == params.keys()
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=n)
    return got


def _every_image_once(shards, ranks: int):
    """Each step's images were split over ``ranks`` CP ranks, each encoding at least one, every image once."""
    assert shards and all(s is not None and len(s) == ranks and min(map(len, s)) > 0 for s in shards), shards
    for step in shards:
        images = sorted(i for rank in step for i in rank)
        assert images == list(range(len(images)))


@pytest.mark.slow
def test_context_parallel_under_ddp_trains_like_data_parallel(tmp_path):
    """LLaVA in a plain LightningModule (training_step returns outputs.loss), DDPStrategy, packed rows; the
    batch's images are split over the 2 CP ranks."""
    got = _trains_alike(tmp_path, {"kind": "llava", "strategy": "ddp", "steps": 2}, "llava_ddp")
    _every_image_once(got["image_shards"], 2)


@pytest.mark.slow
def test_context_parallel_under_fsdp2_trains_like_data_parallel(tmp_path):
    """Qwen2-VL (M-RoPE positions of packed samples, images of different patch counts) under
    ModelParallelStrategy, FSDP2 over all dp x cp ranks; the images split over the CP ranks."""
    got = _trains_alike(tmp_path, {"kind": "qwen2_vl", "strategy": "fsdp2", "steps": 2, "max_length": 48},
                        "qwen_fsdp2")
    _every_image_once(got["image_shards"], 2)


@pytest.mark.slow
def test_context_parallel_encodes_every_image_on_every_rank_when_images_are_fewer_than_ranks(tmp_path):
    """One image per batch of 4 samples at cp 2: each rank encodes it (no split), still like data parallelism;
    and shard_images=False keeps every image on every rank."""
    one = [1, 0, 0, 0] * 4
    got = _trains_alike(tmp_path, {"kind": "qwen2_vl", "strategy": "fsdp2", "steps": 2, "max_length": 48,
                                   "n_images": one}, "qwen_one_image")
    assert got["image_shards"] == [None, None]
    got = _trains_alike(tmp_path, {"kind": "llava", "strategy": "ddp", "steps": 1, "shard_images": False},
                        "llava_whole")
    assert got["image_shards"] == [None]


@pytest.mark.slow
def test_context_parallel_gathered_logits_for_a_module_computing_its_own_loss(tmp_path):
    """The module computes its cross-entropy from outputs.logits (gather_logits=True), zigzag plan, FSDP2."""
    _trains_alike(tmp_path, {"kind": "llava", "strategy": "fsdp2", "steps": 2, "gather_logits": True,
                             "distribution": "zigzag"}, "llava_gather")


@pytest.mark.slow
def test_context_parallel_ulysses_under_ddp_trains_like_data_parallel(tmp_path):
    """Ulysses over 2 ranks (4 query heads, 2 KV heads) in the callback: the all-to-all attention trains like DDP."""
    _trains_alike(tmp_path, {"kind": "llava", "strategy": "ddp", "steps": 2, "mode": "ulysses"}, "llava_ulysses")


@pytest.mark.slow
def test_context_parallel_hybrid_under_fsdp2_trains_like_one_process(tmp_path):
    """Hybrid 2 x 2 (Ulysses inside pairs, keys and values gathered across them), Qwen2-VL, FSDP2 over 4 ranks."""
    _trains_alike(tmp_path, {"kind": "qwen2_vl", "strategy": "fsdp2", "steps": 2, "max_length": 48,
                             "mode": "hybrid", "ulysses": 2}, "qwen_hybrid", dp=1, cp=4)


@pytest.mark.slow
def test_example_project_runs_with_packing_and_context_parallelism(tmp_path):
    """examples/existing_project/train.py with its two lightning-mm lines on (dp 1 x cp 2)."""
    from tests.helpers.launch import ROOT, run_script

    out = run_script(f"{ROOT}/examples/existing_project/train.py", "--cp", "2", "--devices", "2", "--steps", "1",
                     cwd=tmp_path)
    assert "final train_loss" in out.stdout


def _different_batches(rank, world):
    import torch.distributed as dist

    from lightning_mm.trainer.callbacks import ContextParallel

    cb = ContextParallel(2)
    cb.group, cb.cp_rank, cb._adapter = dist.group.WORLD, rank, object()  # as setup leaves them on 2 ranks
    cb.on_train_batch_start(None, None, {"input_ids": torch.zeros(2, 8, dtype=torch.long)}, 0)  # the same: fine
    try:
        cb.on_train_batch_start(None, None, {"input_ids": torch.full((2, 8), rank)}, 1)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_context_parallel_refuses_peers_with_different_batches():
    from tests.helpers.distributed import run_distributed

    for msg in run_distributed(_different_batches, 2):
        assert msg is not None and "use_distributed_sampler=True" in msg and "callback.dp_rank" in msg
