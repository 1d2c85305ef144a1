"""Point-to-point messages between pipeline stages: dicts of tensors of any shape, described by a header.

Each tensor is preceded by a fixed-size int64 header (ndim, dtype, shape), so microbatches may differ in size
(images per sample, sequence length). Sends are non-blocking; the caller waits on the returned works before the
buffers are reused. Between two ranks messages of one direction carry one kind only (activations forward,
gradients backward) and arrive in schedule order, so no tags are needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
MAX_DIMS = 6
HEADER = 2 + MAX_DIMS


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_DIMS:
        raise ValueError(f"cannot send a {t.dim()}-d tensor between stages (at most {MAX_DIMS} dims)")
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0], h[1] = t.dim(), DTYPES.index(t.dtype)
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def send(message: dict[str, torch.Tensor], keys: list[str], dst: int, group=None) -> list:
    """Send ``message[k]`` for k in ``keys`` to ``dst``; returns (work, buffer) pairs to wait on (the buffers
    must outlive the sends)."""
    pending = []
    for k in keys:
        t = message[k].detach().contiguous()
        h = _header(t)
        pending.append((dist.isend(h, dst, group=group), h))
        if t.numel():
            pending.append((dist.isend(t, dst, group=group), t))
    return pending


def recv(keys: list[str], src: int, device: torch.device | str = "cpu", group=None) -> dict[str, torch.Tensor]:
    """Receive the tensors a matching ``send`` sent (blocking)."""
    out = {}
    for k in keys:
        h = torch.empty(HEADER, dtype=torch.int64)
        dist.recv(h, src, group=group)
        ndim, dtype = int(h[0]), DTYPES[int(h[1])]
        t = torch.empty(h[2:2 + ndim].tolist(), dtype=dtype, device=device)
        if t.numel():
            dist.recv(t, src, group=group)
        out[k] = t
    return out
