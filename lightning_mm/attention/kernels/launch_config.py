"""Tile sizes and launch settings of the kernels, chosen from the inputs (device, head dim); no global state."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes: ``fwd_*`` for the forward (and dq), ``bwd_*`` for the dk/dv kernel (q rows x k rows)."""

    fwd_m: int = 128
    fwd_n: int = 64
    dkdv_m: int = 32
    dkdv_n: int = 128
    dq_m: int = 128
    dq_n: int = 32
    fwd_warps: int = 8
    bwd_warps: int = 4
    stages: int = 3
    min_split_tiles: int = 8  # a split-KV piece walks at least this many key tiles (amortises the merge)

    def __post_init__(self):
        for name in ("fwd_m", "fwd_n", "dkdv_m", "dkdv_n", "dq_m", "dq_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name}={v}: tile sizes must be powers of two >= 16 (tl.dot needs it)")


INTERPRETER_CONFIG = KernelConfig(16, 16, 16, 16, 16, 16, 1, 1, 1, min_split_tiles=1)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def default_config(q: torch.Tensor) -> KernelConfig:
    """Small tiles under the interpreter (tests), FlashAttention-2 style tiles on the GPU."""
    return config_for(q.dtype, q.shape[-1], q.is_cuda)


def config_for(dtype: torch.dtype, d: int, cuda: bool = True) -> KernelConfig:
    """The tile shapes for a dtype and head dim (the interpreter config when not on CUDA)."""
    if not cuda:
        return INTERPRETER_CONFIG
    if d > 128:  # register and shared-memory pressure: smaller tiles for head dim 256
        return KernelConfig(64, 32, 16, 64, 64, 16, 4, 4, 2)
    if dtype == torch.float32:  # 4-byte tiles: the fp16 shapes would need ~225 KiB of shared memory
        return KernelConfig(64, 32, 32, 64, 64, 32, 4, 4, 2)
    return KernelConfig(fwd_warps=8 if d > 64 else 4)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (the interpreter counts as 4)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
