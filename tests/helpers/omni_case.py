"""Train a tiny Qwen3-Omni thinker folder with Lightning, in one process or under MultimodalParallelStrategy (the
vision encoder, which also runs the videos, and the audio encoder in stages of their own, the LLM in ``llm_pp``
stages), on samples holding an audio clip, an image and a video together. The JSON argument and the outputs are
``composite_case.py``'s (``folder``, ``steps``, ``llm_pp``)."""

import json
import sys

import torch

import lightning_mm as lmm
from composite_case import train

IMG, VID, VSTART, VEND, AUD, ASTART, AEND = 100, 101, 102, 103, 104, 105, 106
PATCH_DIM = 3 * 2 * 4 * 4
IMAGES, VIDEOS, FRAMES = [(1, 8, 8), (1, 4, 8), (1, 8, 4)], [(2, 4, 4), (3, 4, 8)], [230, 130, 60]


def sample(i: int) -> dict:
    """A clip, an image and a video in an order that changes with ``i`` (every third sample no video), one
    placeholder per item between its start and end tokens (the collator expands it)."""
    g = torch.Generator().manual_seed(i)
    frames, grid, video = FRAMES[i % 3], IMAGES[i % 3], VIDEOS[i % 2] if i % 3 != 2 else None
    spans = [[ASTART, AUD, AEND], [VSTART, IMG, VEND]] + ([[VSTART, VID, VEND]] if video else [])
    spans = spans[i % len(spans):] + spans[:i % len(spans)]
    ids = torch.randint(1, 90, (3 + i % 3,), generator=g).tolist()
    for span in spans:
        ids += span + torch.randint(1, 90, (2,), generator=g).tolist()
    out = {"input_ids": torch.tensor(ids + [7, 8, 9]),
           "audio": {"input_features": torch.randn(1, 16, frames, generator=g),
                     "feature_attention_mask": torch.ones(1, frames, dtype=torch.long)},
           "vision": {"pixel_values": torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=g),
                      "image_grid_thw": torch.tensor([grid])}}
    if video:
        out["video"] = {"pixel_values_videos": torch.randn(video[0] * video[1] * video[2], PATCH_DIM, generator=g),
                        "video_grid_thw": torch.tensor([video]), "video_second_per_grid": torch.tensor([2.0])}
    return out


def main(spec: str, out: str):
    case = json.loads(spec)
    torch.set_num_threads(1)
    if "llm_pp" in case:
        strategy = lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec(), "audio": lmm.ParallelSpec()},
            language_model=lmm.ParallelSpec(pp=case["llm_pp"]), num_microbatches=2, fault_timeout=120)
        devices = 2 + case["llm_pp"]
    else:
        strategy, devices = "auto", 1
    train(case, out, strategy, devices, lambda model: [sample(i) for i in range(12)])


if __name__ == "__main__":
    main(*sys.argv[1:])
