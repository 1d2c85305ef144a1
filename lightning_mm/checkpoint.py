"""Sharded checkpoints written by MultimodalParallelStrategy: one file per stage, unparallelised names."""

from __future__ import annotations

import glob
import os

import torch


def consolidate(path: str, trainable_only: bool = True) -> dict[str, torch.Tensor]:
    """The parameters of a sharded checkpoint under the unparallelised ``MultimodalModel``'s names.

    Loads with ``weights_only=True``: no pickled code runs. ``trainable_only`` keeps the trainable parameters.
    """
    files = sorted(glob.glob(os.path.join(path, "stage-*.pt")))
    if not files:
        raise FileNotFoundError(f"{path} holds no stage-*.pt files: not a lightning-mm sharded checkpoint")
    out = {}
    for f in files:
        shard = torch.load(f, map_location="cpu", weights_only=True)
        keep = set(shard["trainable"]) if trainable_only else set(shard["state_dict"])
        for name, value in shard["state_dict"].items():
            if name in keep:
                out[name.removeprefix("model.")] = value
    return out
