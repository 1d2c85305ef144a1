"""``trainer.predict`` with ``generation=`` under pipeline layouts, against one-process references.

``python pipeline_generation_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0): ``generated``
(every rank's ids, in rank order), ``expected`` (per data-parallel replica: one-process ``model.generate``, or for
the composite folders HF's own composite ``generate`` of the folder), ``eos`` (the stop tokens used), or ``error``.
JSON keys: ``kind`` ("llava": a SigLIP tower + llama built from configs; "moe": the same tower + a Qwen3-MoE LLM
and a fourth prompt, text-only; "qwen2_vl" / "qwen3_vl": ``folder``, a composite written by
``tests.test_hf_composites.save_composite``; a kind of ``FAMILIES``: ``folder``, its composite, and
``family_prompts``), ``five`` (LLaVA: a prompt of 5 images besides), ``llm_pp``, ``dp`` (replicas, default 1),
``max_new_tokens``, ``early_stop`` (stop tokens picked from the reference so rows finish at different steps and
all before ``max_new_tokens``), ``generation`` (extra options, e.g. to see a refusal), ``llm_tp``, ``vision_pp``,
``placement`` (``encoder_placement``), ``videos`` (Qwen prompts mixing images and videos), ``vision_cp`` (encoder
context parallelism), ``llm_cp``, ``sharding`` (``sharding_strategy``), ``packed`` (LLaVA prompts packed two to a
row; the reference decodes them one per row), ``llm_ep`` (expert parallelism over the replicas), ``vision_dp``
(per-module data parallelism: the tower's replicas for one LLM replica, four prompts with 1, 2, 1 and 0 images).
``experts_held``: per rank, (expert weight elements held after generating, those of its stage's layers).
"""

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.expert_parallel import local_expert_count


def build(case: dict):
    torch.manual_seed(0)
    if case["kind"] in ("llava", "moe"):
        enc = lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")
        lm = tiny_language_model("llama" if case["kind"] == "llava" else "qwen3_moe")
        return lmm.MultimodalModel({"vision": enc}, lm).eval()
    return lmm.MultimodalModel.from_pretrained(case["folder"]).eval()


def llava_samples(model, seed: int, text_only: bool = False, five: bool = False) -> list[dict]:
    """Three prompts of different lengths with 1, 2 and 1 images (and a fourth, text-only, with ``text_only``; with
    ``five`` one of 5 images, two of them adjacent, last); an odd ``seed`` drops the first (and draws other
    images)."""
    g = torch.Generator().manual_seed(seed)
    enc, pid = model.encoders["vision"], model.placeholder_ids["vision"]
    images = lambda n: enc.family.random_inputs(enc.module.config, n, generator=g)  # noqa: E731
    samples = [{"input_ids": [5, pid, 7, 9, 11], "vision": images(1)},
               {"input_ids": [3, 4, pid, 8, 12, pid, 13, 14, 20, 21, 22], "vision": images(2)},
               {"input_ids": [6, 7, 8, pid, 30, 31, 32, 33], "vision": images(1)}]
    if text_only:
        samples.append({"input_ids": [5, 6, 7, 9, 11, 15]})
    if five:
        samples.append({"input_ids": [9, pid, 4, pid, pid, 6, 7, pid, 8, pid, 10], "vision": images(5)})
    return samples[seed % 2:] if seed % 2 else samples


def llava_prompts(model, seed: int, packed: bool = False, text_only: bool = False,
                  five: bool = False) -> tuple[dict, dict]:
    """(ours, the one-process reference's): ``llava_samples`` collated with right padding; with ``packed`` ours
    packs them first-fit into rows of 64 tokens ([0, 1] and [2], in order) and the reference has one prompt per
    row."""
    samples = llava_samples(model, seed, text_only, five)
    plain = lmm.data.MultimodalCollator(model)(samples)
    return (lmm.data.MultimodalCollator(model, seq_len=64, pack=True)(samples) if packed else plain), plain


def qwen_prompts(kind: str, seed: int, videos: bool = False) -> tuple[dict, dict]:
    """(ours, HF's left-padded keyword arguments): two rows with 2 and 1 images of different grids; with ``videos``,
    three rows: an image and a video, a video, an image (``tests.test_video_models.mixed_batch``)."""
    from tests.test_hf_composites import IMG, PAD, batch_for
    from tests.test_video_models import VID, mixed_batch

    ours, hf = mixed_batch(kind) if videos else batch_for(kind, None)
    ids, mask = hf["input_ids"], hf["attention_mask"]
    left_ids, left_mask = torch.full_like(ids, PAD), torch.zeros_like(mask)
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        left_ids[r, -n:], left_mask[r, -n:] = ids[r, :n], 1
    hf = {k: v for k, v in hf.items() if k not in ("labels", "input_ids", "attention_mask", "mm_token_type_ids")}
    hf.update(input_ids=left_ids, attention_mask=left_mask,
              mm_token_type_ids=(left_ids == IMG).int() + 2 * (left_ids == VID).int())
    return ours, hf


# composite families decoded against HF's own composite ``generate`` of their folder: kind -> the modality
FAMILIES = {"qwen3_vl_moe": "vision", "gemma3": "vision", "qwen2_audio": "audio", "llava_next": "vision",
            "llava_onevision": "vision", "internvl": "vision"}
TILED = ("llava_next", "llava_onevision", "internvl")
ITEMS = [[0, 5, 1, 2], [3, 0, 1]]  # items per prompt, by seed (replica)
GRIDS = [(1, 4, 4), (1, 4, 8), (1, 8, 4)]  # Qwen3-VL-MoE: 4, 8 and 8 tokens
SIZES = [(16, 16), (40, 20), (20, 50), (17, 33), (30, 30)]  # tiled families' images (width, height)


def raw_items(kind: str, n: int, g: torch.Generator):
    """``n`` items of ``kind``'s modality: PIL images (tiled families) or the encoder's tensors, first dim per item
    (Qwen3-VL-MoE: patches of several grids; Gemma 3: 16 x 16 images; Qwen2-Audio: clips of 10 to 16 real mel
    frames of 16)."""
    if kind in TILED:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g)))
        return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
                for w, h in (SIZES[k % len(SIZES)] for k in range(n))]
    if kind == "qwen3_vl_moe":
        grids = [GRIDS[k % len(GRIDS)] for k in range(n)]
        return {"pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4, generator=g),
                "image_grid_thw": torch.tensor(grids, dtype=torch.long).view(n, 3)}
    if kind == "gemma3":
        return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g)}
    mask = (torch.arange(16)[None, :] < torch.tensor([16 - 3 * (k % 3) for k in range(n)])[:, None]).long()
    return {"input_features": torch.randn(n, 16, 16, generator=g) * mask[:, None, :], "feature_attention_mask": mask}


def family_prompts(kind: str, model, seed: int) -> tuple[dict, dict]:
    """(ours, HF's left-padded keyword arguments): prompts of ``ITEMS[seed % 2]`` items of the family (one placeholder
    per item, between start / end tokens where the family's prompts frame them), collated by ``MultimodalCollator``
    (which expands the placeholders); HF takes the same token rows padded on the left and the items' inputs as the
    family's HF processor (tiled families) or its encoder (the others) takes them, the whole batch at once."""
    from tests.helpers.text_lm_case import left_padded
    from tests.test_hf_composites import IMG, PAD, VEND, VSTART
    from tests.test_tile_composites import encode, image_processor

    modality, g = FAMILIES[kind], torch.Generator().manual_seed(seed)
    proc = image_processor(kind) if kind in TILED else None
    text = lambda k: torch.randint(1, 90, (k,), generator=g).tolist()  # noqa: E731
    samples, raw = [], []
    for i, n in enumerate(ITEMS[seed % 2]):
        ids = text(3 + i % 3)
        for _ in range(n):
            ids += ([IMG] if kind in TILED else [VSTART, IMG, VEND]) + text(2)
        samples.append({"input_ids": torch.tensor(ids + text(3))})
        if n:
            raw.append(raw_items(kind, n, g))
            samples[-1][modality] = encode(kind, proc, raw[-1]) if kind in TILED else raw[-1]
    ours = lmm.data.MultimodalCollator(model)(samples)
    if kind in TILED:  # the processor on the batch's images (OneVision: one list per prompt with images)
        out = proc(images=raw if kind == "llava_onevision" else [im for row in raw for im in row],
                   return_tensors="pt")
        hf = {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images") if k in out}
    else:
        hf = {k: torch.cat([r[k] for r in raw]) for k in raw[0]}
    ids, mask = left_padded(ours["input_ids"], ours["attention_mask"], PAD)
    hf.update(input_ids=ids, attention_mask=mask)
    if kind == "qwen3_vl_moe":
        hf["mm_token_type_ids"] = (ids == IMG).int()
    if kind == "gemma3":  # HF's image blocks (bidirectional within each image)
        hf["token_type_ids"] = (ids == IMG).long()
    return ours, hf


def load_reference(kind: str, folder: str):
    """HF's own composite class of ``folder``."""
    from tests import test_hf_composites, test_tile_composites

    return (test_tile_composites if kind in TILED else test_hf_composites).load_hf(kind, folder).eval()


def reference(case: dict, model, batch: dict, hf_kwargs: dict | None, generation: dict) -> list:
    if case["kind"] in ("llava", "moe"):
        return model.generate(**hf_kwargs, **generation).tolist()
    hf = load_reference(case["kind"], case["folder"])
    with torch.no_grad():
        out = hf.generate(**hf_kwargs, **generation)
    return out[:, hf_kwargs["input_ids"].shape[1]:].tolist()


def loader(case: dict, model, batch: dict) -> DataLoader:
    """The replica's batch; under per-module data parallelism (``vision_dp``, the LLM's dp 1) the samples through
    a DistributedSampler, which the strategy's group loader rebuilds (it routes the rows between the replicas)."""
    if not case.get("vision_dp"):
        return DataLoader([batch], batch_size=None)
    samples = llava_samples(model, 0, text_only=True, five=case.get("five", False))
    sampler = DistributedSampler(samples, num_replicas=1, rank=0, shuffle=False)
    return DataLoader(samples, batch_size=len(samples), sampler=sampler, collate_fn=lmm.data.MultimodalCollator(model))


def main(spec: str, out: str):
    case = json.loads(spec)
    torch.set_num_threads(1)
    pp, dp, tp, cp = case.get("llm_pp", 2), case.get("dp", 1), case.get("llm_tp", 1), case.get("llm_cp", 1)
    ep = case.get("llm_ep", 1)
    vision_pp, vision_cp = case.get("vision_pp", 1), case.get("vision_cp", 1)
    placement, vision_dp = case.get("placement", "parallel"), case.get("vision_dp")  # vision_dp: per-module dp
    modality = FAMILIES.get(case["kind"], "vision")
    strategy = lmm.MultimodalParallelStrategy(encoders={modality: lmm.ParallelSpec(pp=vision_pp, cp=vision_cp,
                                                                                   dp=vision_dp)},
                                              language_model=lmm.ParallelSpec(pp=pp, tp=tp, cp=cp, ep=ep,
                                                                              dp=dp if vision_dp else None),
                                              num_microbatches=2, encoder_placement=placement, fault_timeout=120,
                                              sharding_strategy=case.get("sharding", "NO_SHARD"), cp_block_size=8)
    per_replica = pp * tp * cp + (0 if placement == "replicated" else vision_pp * vision_cp * (vision_dp or 1))
    trainer = L.Trainer(accelerator="cpu", devices=dp * per_replica, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    model = build(case)
    generation = {"max_new_tokens": case.get("max_new_tokens", 8), "do_sample": False}
    if case["kind"] in ("llava", "moe"):
        text_only = case["kind"] == "moe" or bool(vision_dp)
        batches = [llava_prompts(model, seed, case.get("packed", False), text_only, case.get("five", False))
                   for seed in range(dp)]
    elif case["kind"] in FAMILIES:
        generation["pad_token_id"] = 0  # the folders' PAD, for HF and ours alike
        batches = [family_prompts(case["kind"], model, seed) for seed in range(dp)]
    else:
        batches = [qwen_prompts(case["kind"], seed, case.get("videos", False)) for seed in range(dp)]
    expected = None
    if case.get("early_stop"):
        # stop tokens from a first reference: row r stops at its token r + 1 (so rows finish at different steps)
        first = reference(case, model, *batches[0], generation)
        generation["eos_token_id"] = sorted({row[min(r + 1, len(row) - 1)] for r, row in enumerate(first)})
    if trainer.global_rank == 0 or case["kind"] in ("llava", "moe"):  # before the strategy cuts the model into stages
        expected = [reference(case, model, b, hf, generation) for b, hf in batches]
    generation.update(case.get("generation", {}))
    module = lmm.MultimodalLightningModule(model, generation=generation)
    result = {"eos": generation.get("eos_token_id"), "expected": expected}
    replica = trainer.global_rank // per_replica  # ranks are numbered replica by replica
    try:
        got = trainer.predict(module, loader(case, model, batches[replica][0]))[0]["generated_ids"]
        gathered = [None] * trainer.world_size
        dist.all_gather_object(gathered, got.tolist())
        result["generated"] = gathered
        result["replicas"] = [trainer.strategy.layout.coordinate(r).dp for r in range(trainer.world_size)]
        sharded = [None] * trainer.world_size  # how many parameters FSDP manages on each rank
        dist.all_gather_object(sharded, len(trainer.strategy.engine.fsdp_params))
        result["sharded"] = sharded
        held = [None] * trainer.world_size  # expert weight elements each rank holds after generating (its ep shard)
        experts = trainer.strategy.engine.expert_params
        dist.all_gather_object(held, (local_expert_count(experts), sum(p.numel() for p in experts)))
        result["experts_held"] = held
    except RuntimeError as e:
        result["error"] = str(e)
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
