"""Train a composite checkpoint (``MultimodalModel.from_pretrained``) with Lightning, in one process or under
MultimodalParallelStrategy, described by a JSON argument.

``python composite_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0: per-step losses),
``<out_dir>/params_<rank>.pt`` (the trainable parameters this rank owns, full names) and
``<out_dir>/experts_<rank>.json`` (the elements of the routed experts' weights this rank holds, and of all of
them). Keys of the JSON:

- ``folder``: the composite folder (required); ``steps``
- ``llm_pp`` / ``llm_cp`` / ``llm_tp`` / ``vision_pp`` / ``vision_cp`` / ``vision_tp`` / ``dp``: the LLM's
  pipeline stages, context-parallel and tensor-parallel ranks, the vision tower's stages, context-parallel and
  tensor-parallel ranks, and the replicas under the strategy; without any, plain single-device Lightning. Under
  ``dp`` replica r takes rows r, r + dp, ... of every batch of 4 (an unshuffled DistributedSampler), so each step
  sees the rows one process sees
- ``sharding``: the strategy's ``sharding_strategy`` (FSDP2 over each stage's data-parallel ranks)
- ``lazy``: build under ``trainer.init_module(empty_init=True)`` (meta; each rank reads its stage in setup)
- ``videos``: samples also hold videos (the "video" modality of Qwen2-VL / Qwen2.5-VL composites)
- ``image_size``: images of that fixed size (``pixel_values [n, 3, S, S]``: SigLIP towers, Gemma 3) instead of
  Qwen-VL grids
- ``partition``: the strategy's explicit ``{module: [layers per stage]}``
- ``pack``: rows of ``pack`` tokens, samples packed into them (``segment_ids``)
- ``images``: sample ``i`` holds ``i % (images + 1)`` images (0 to ``images``) instead of one or two
- ``ep``: the LLM's expert-parallel degree (a mixture-of-experts LLM; over ``dp`` replicas)
- ``microbatches``: the strategy's ``num_microbatches`` (2 unless given; 1 for packed rows, whose count varies, and
  for an MoE's load-balancing loss, a mean over microbatches, to equal one process)
- ``balancing``: the strategy's ``batch_balancing`` (its default unless given; "none" keeps the sampler's rows)
- ``replicas``: in one process, each batch runs as this many microbatches, microbatch r the rows replica r takes
  under ``dp`` (the token loss over the whole batch's labels, an MoE's load-balancing loss the mean of theirs):
  the reference for an MoE under ``dp`` replicas with ``balancing`` "none", whose load-balancing loss is a mean
  over the replicas' microbatches, not the loss of the whole batch in one forward
- ``vision_dp`` / ``llm_dp``: per-module data parallelism (each module's ``ParallelSpec.dp``): one loader of
  ``4 // llm_dp`` rows per language-model replica (the strategy's sampler arguments)
- ``mixed``: sample ``i`` holds ``i % 3`` images and, when ``i % 4 >= 2``, a video (some samples text only)
- ``encoder``: the encoder the ``vision_*`` keys lay out ("vision" unless given); "audio" makes Qwen2-Audio samples
  (``audio_sample``) instead of images
- ``patches``: Gemma 4 images (``patch_sample``: each image's patches flattened with their grid positions, some
  with padding patches) instead of Qwen-VL grids

Batches come from ``MultimodalCollator``: samples with one or two images of different grids, so rows differ in
length (padding) and the M-RoPE ``position_ids`` ``[B, S, 3]`` travel with the tokens.
"""

import json
import math
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

import lightning_mm as lmm

IMG, VID, VSTART, VEND = 100, 101, 102, 103
GRIDS = [(1, 8, 8), (1, 4, 8), (1, 8, 4), (1, 4, 4)]
VIDEO_GRIDS = [(2, 4, 4), (4, 4, 8), (3, 8, 4)]


def audio_sample(i: int) -> dict:
    """Every third sample text only, the others one or two clips of 16 mel bins with 10 to 16 real frames of 16."""
    g = torch.Generator().manual_seed(i)
    frames = [16 - (i + k) % 7 for k in range(0 if i % 3 == 0 else 1 + i % 2)]
    ids = torch.randint(1, 90, (3 + i % 3,), generator=g).tolist()
    for _ in frames:
        ids += [VSTART, IMG, VEND] + torch.randint(1, 90, (2,), generator=g).tolist()
    out = {"input_ids": torch.tensor(ids + torch.randint(1, 90, (4,), generator=g).tolist())}
    if frames:
        mask = (torch.arange(16)[None, :] < torch.tensor(frames)[:, None]).long()
        out["audio"] = {"input_features": torch.randn(len(frames), 16, 16, generator=g) * mask[:, None, :],
                        "feature_attention_mask": mask}
    return out


def patch_sample(i: int, images: int = 5, patch_dim: int = 48) -> dict:
    """Gemma 4's image processor's layout: ``i % (images + 1)`` images (0 to ``images``; sample 0 text only), each
    16 patches of ``patch_dim`` values with their ``(x, y)`` grid positions ``[n, 16, 2]``: a 4 x 4 grid (4 pooled
    tokens), or every other image a 4 x 2 grid whose last 8 patches are padding (position ``(-1, -1)``, pixels 0:
    2 tokens)."""
    g = torch.Generator().manual_seed(i)
    n = i % (images + 1)
    ids = torch.randint(1, 90, (3 + i % 3,), generator=g).tolist()
    for _ in range(n):
        ids += [VSTART, IMG, VEND] + torch.randint(1, 90, (2,), generator=g).tolist()
    out = {"input_ids": torch.tensor(ids + torch.randint(1, 90, (4,), generator=g).tolist())}
    if n:
        ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
        pos = torch.stack([xs.flatten(), ys.flatten()], -1).expand(n, -1, -1).clone()
        pixels = torch.rand(n, 16, patch_dim, generator=g)
        padded = (torch.arange(n) + i) % 2 == 1
        pos[padded, 8:] = -1
        pixels[padded, 8:] = 0
        out["vision"] = {"pixel_values": pixels, "image_position_ids": pos}
    return out


def sample(i: int, videos: bool = False, image_size: int | None = None, images: int | None = None,
           mixed: bool = False) -> dict:
    """One or two images of different grids (or of ``image_size`` pixels; ``images``: ``i % (images + 1)`` of
    them); with ``videos``, every sample but every third also holds a video of 2 to 4 temporal patches (before or
    after its images), and every third sample no image; ``mixed``: ``i % 3`` images, a video when ``i % 4 >= 2``."""
    g = torch.Generator().manual_seed(i)
    n_images = 0 if videos and i % 3 == 0 else 1 + i % 2
    if images is not None or mixed:
        n_images = i % ((images or 2) + 1)
    grids = [GRIDS[(i + k) % len(GRIDS)] for k in range(n_images)]
    video = VIDEO_GRIDS[i % len(VIDEO_GRIDS)] if videos and i % 3 != 1 else None
    if mixed:
        video = VIDEO_GRIDS[i % len(VIDEO_GRIDS)] if i % 4 >= 2 else None
    ids = torch.randint(1, 90, (3 + i % 3,), generator=g).tolist()
    items = [IMG] * len(grids)
    if video is not None:
        items.insert(i % 2 * len(items), VID)
    for pid in items:
        ids += [VSTART, pid, VEND] + torch.randint(1, 90, (2,), generator=g).tolist()
    ids += torch.randint(1, 90, (4,), generator=g).tolist()
    out = {"input_ids": torch.tensor(ids)}
    if grids and image_size:
        out["vision"] = {"pixel_values": torch.randn(len(grids), 3, image_size, image_size, generator=g)}
    elif grids:
        out["vision"] = {"pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4, generator=g),
                         "image_grid_thw": torch.tensor(grids)}
    if video is not None:
        t, h, w = video
        out["video"] = {"pixel_values_videos": torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=g),
                        "video_grid_thw": torch.tensor([video])}
    return out


def run_case(script: str, case: dict, tmp_path, name: str):
    """Run ``tests/helpers/<script>`` on ``case`` in a fresh process: rank 0's losses and every rank's parameters
    (ranks holding the same parameter, replicas of one stage, must hold identical values)."""
    import subprocess

    out = tmp_path / name
    out.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", script), json.dumps(case),
                           str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    params = {}
    for f in out.glob("params_*.pt"):
        for n, p in torch.load(f, weights_only=True).items():
            if n in params:
                torch.testing.assert_close(p, params[n], rtol=0, atol=0, msg=n)
            params[n] = p
    return json.loads((out / "result.json").read_text())["train"], params


def replicas_loss(model, batches: list[dict]) -> torch.Tensor:
    """One process running ``batches`` (the replicas' rows) one after the other: the token loss over all their
    labels plus the family's coefficient times the mean of their load-balancing losses (what the strategy's
    replicas compute, docs/moe.md)."""
    from lightning_mm import loss as losses
    from lightning_mm.model.composites import fill_positions

    count = sum(losses.count_label_tokens(b["labels"]) for b in batches)
    coef = model.lm_family.aux_loss_coef(model.language_model)
    total = 0
    for b in batches:
        out = model(**fill_positions(model, b))
        total = total + losses.normalise(out.loss_sum, count)
        if out.aux_loss is not None:
            total = total + coef * out.aux_loss / len(batches)
    return total


def train(case: dict, out: str, strategy, devices: int, samples) -> None:
    """Fit the composite of ``case["folder"]`` (lazily with ``case["lazy"]``) on ``samples(model)`` under
    ``strategy``; write rank 0's losses and each rank's trainable parameters (full tensors) to ``out``."""
    dp = case.get("dp", 1)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=case.get("steps", 3),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    torch.manual_seed(0)
    if case.get("lazy"):
        with trainer.init_module(empty_init=True):
            model = lmm.MultimodalModel.from_pretrained(case["folder"])
    else:
        model = lmm.MultimodalModel.from_pretrained(case["folder"])
    model.freeze(encoders=False, projectors=False, language_model=False)
    losses = []

    class Module(lmm.MultimodalLightningModule):
        def training_step(self, batch, batch_idx):
            return replicas_loss(self.model, batch) if isinstance(batch, list) else super().training_step(batch,
                                                                                                          batch_idx)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if not isinstance(batch, list):  # the throughput metrics read one batch's labels
                super().on_train_batch_end(outputs, batch, batch_idx)
            losses.append(float(outputs["loss"]))

    module = Module(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    rows = samples(model)
    replica = trainer.global_rank // (devices // dp)  # ranks are numbered replica by replica
    sampler = DistributedSampler(rows, num_replicas=dp, rank=replica, shuffle=False) if dp > 1 else None
    if case.get("llm_dp"):  # per-module: ranks group by group; a rank loads its group's first LLM replica's share
        dp, groups = case["llm_dp"], math.gcd(case["llm_dp"], case["vision_dp"])
        first = trainer.global_rank // (devices // groups) * (dp // groups)
        sampler = DistributedSampler(rows, num_replicas=dp, rank=first, shuffle=False)
    collate = lmm.data.MultimodalCollator(model, seq_len=case.get("pack"), pack=bool(case.get("pack")))
    if case.get("replicas"):  # one process, a batch of 4 as the replicas' microbatches (rows r, r + n, ...)
        n, whole = case["replicas"], collate
        collate = lambda samples: [whole(samples[r::n]) for r in range(n)]  # noqa: E731
    data = DataLoader(rows, batch_size=4 // dp, sampler=sampler, collate_fn=collate)
    trainer.fit(module, data)
    engine = getattr(trainer.strategy, "engine", None)
    from torch.distributed.tensor import DTensor

    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731  (collective over its mesh)
    torch.save({n: full(p).detach().cpu() for n, p in module.model.named_parameters()
                if p.requires_grad and (engine is None or n in engine.owned)},
               os.path.join(out, f"params_{trainer.global_rank}.pt"))
    experts = [p for n, p in module.model.named_parameters() if ".experts." in n]  # routed experts' weights
    with open(os.path.join(out, f"experts_{trainer.global_rank}.json"), "w") as f:  # held here, of all (1 / ep)
        json.dump([sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in experts),
                   sum(p.numel() for p in experts)], f)
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"train": losses}, f)


def main(spec: str, out: str):
    case = json.loads(spec)
    torch.set_num_threads(1)
    if {"llm_pp", "llm_cp", "llm_tp", "vision_pp", "vision_cp", "vision_tp", "dp", "ep", "llm_dp"} & set(case):
        pp, cp, vision_pp = case.get("llm_pp", 1), case.get("llm_cp", 1), case.get("vision_pp", 1)
        vision_cp, vision_tp = case.get("vision_cp", 1), case.get("vision_tp", 1)
        vision_dp, llm_dp, llm_tp = case.get("vision_dp"), case.get("llm_dp"), case.get("llm_tp", 1)
        strategy = lmm.MultimodalParallelStrategy(
            encoders={case.get("encoder", "vision"): lmm.ParallelSpec(pp=vision_pp, cp=vision_cp, tp=vision_tp,
                                                                      dp=vision_dp)},
            language_model=lmm.ParallelSpec(pp=pp, cp=cp, tp=llm_tp, ep=case.get("ep", 1), dp=llm_dp),
            num_microbatches=case.get("microbatches", 2), cp_block_size=8, fault_timeout=120,
            sharding_strategy=case.get("sharding", "NO_SHARD"), partition=case.get("partition", "uniform"),
            batch_balancing=case.get("balancing"))
        devices = (vision_pp * vision_cp * vision_tp + pp * cp * llm_tp) * case.get("dp", 1)
        if llm_dp:  # per-module data parallelism: each module's replicas
            devices = vision_pp * vision_cp * vision_tp * vision_dp + pp * cp * llm_tp * llm_dp
    else:
        strategy, devices = "auto", 1
    train(case, out, strategy, devices,
          lambda model: [audio_sample(i) if case.get("encoder") == "audio" else
                         patch_sample(i, case.get("images") or 5) if case.get("patches") else
                         sample(i, case.get("videos", False), case.get("image_size"), case.get("images"),
                                case.get("mixed", False))
                         for i in range(12)])


if __name__ == "__main__":
    main(*sys.argv[1:])
