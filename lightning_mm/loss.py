"""The loss normalisation, in one place: token cross-entropy summed, divided by the global label-token count.

Labels follow the HF convention (aligned with ``input_ids``); ``shift_labels`` turns them into per-position
targets once, globally, before any sharding. Every layout (microbatches, context-parallel shards, data-parallel
replicas) sums ``token_loss_sum`` over its pieces and divides by ``count_label_tokens`` of the whole global
batch, so all layouts compute the same number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Target of position t = label of token t+1; the last position gets IGNORE_INDEX."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    return targets


def count_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that carry a loss (of HF-aligned labels)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy over positions whose target is not IGNORE_INDEX (computed in fp32)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def normalise(loss_sum: torch.Tensor, num_label_tokens: torch.Tensor | int) -> torch.Tensor:
    """The reported loss: a sum over pieces divided by the global label count (at least 1: no NaN on empty)."""
    return loss_sum / torch.clamp(torch.as_tensor(num_label_tokens, device=loss_sum.device), min=1)
