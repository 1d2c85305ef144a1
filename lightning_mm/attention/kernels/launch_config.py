"""Tile sizes and launch settings of the kernels: a table keyed by dtype and head dim; no global state.

``TABLE`` holds one :class:`KernelConfig` per (dtype, largest head dim of the row); each says where it came from
(``source``). The entries are FlashAttention-2-style starting points sized to the shared memory of an sm_90 GPU
and checked to compile (``compile_check``); the half-precision head-dim-128 row's backward tiles come from a sweep on
an H200 (``benchmarks/kernel_sweep.py``), the rest is not tuned by measurement yet. A JSON file of the same rows
(``load_table``, e.g. from a tuning sweep on a GPU) named by ``LIGHTNING_MM_KERNEL_TABLE`` replaces them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

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
    dq_atomic: bool = False  # dq added by the dk/dv pass with atomic adds, no dq pass (backward.py)
    source: str = field(default="default", compare=False)  # where the choice came from (recorded, not a key)

    def __post_init__(self):
        for name in ("fwd_m", "fwd_n", "dkdv_m", "dkdv_n", "dq_m", "dq_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name}={v}: tile sizes must be powers of two >= 16 (tl.dot needs it)")


INTERPRETER_CONFIG = KernelConfig(16, 16, 16, 16, 16, 16, 1, 1, 1, min_split_tiles=1, source="interpreter")
_UNTUNED = "table: FlashAttention-2 starting point, compiles for sm_90, not tuned by measurement"
# dk/dv 32x128 -> 64x64 cut the backward 2.2x (EE) and forward+backward 1.6x (MP) at S=16k; the forward kept
# its tiles (that sweep could not rank them); benchmarks/kernel_sweep.py, results/gpu/kernel_sweep_nvidia_h200_d128
_SWEPT_H200 = "sweep on one H200 (bf16, d 128, S 16k, EE/MP masks): dk/dv and dq tiles 64x64"
_HALF = {64: KernelConfig(fwd_warps=4, source=_UNTUNED),
         128: KernelConfig(dkdv_m=64, dkdv_n=64, dq_m=64, dq_n=64, fwd_warps=8, source=_SWEPT_H200),
         256: KernelConfig(64, 32, 16, 64, 64, 16, 4, 4, 2, source=_UNTUNED)}  # register/shared-memory pressure
TABLE: dict[tuple[torch.dtype, int], KernelConfig] = {
    **{(torch.bfloat16, d): c for d, c in _HALF.items()}, **{(torch.float16, d): c for d, c in _HALF.items()},
    # 4-byte tiles: the half-precision shapes would need ~225 KiB of shared memory
    (torch.float32, 128): KernelConfig(64, 32, 32, 64, 64, 32, 4, 4, 2, source=_UNTUNED),
    (torch.float32, 256): KernelConfig(64, 32, 16, 64, 64, 16, 4, 4, 2, source=_UNTUNED),
}
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_table(path: str) -> dict[tuple[torch.dtype, int], KernelConfig]:
    """Rows ``{"dtype": "bf16", "head_dim": 128, <KernelConfig fields>}`` of a JSON list as a table."""
    table = {}
    for row in json.loads(open(path).read()):
        row = dict(row)
        dtype, d = DTYPE_NAMES[row.pop("dtype")], int(row.pop("head_dim"))
        row.setdefault("source", f"table file {path}")
        table[(dtype, d)] = KernelConfig(**row)
    return table


def table_rows(table: dict) -> list[dict]:
    """The JSON rows of a table (what ``load_table`` reads)."""
    names = {v: k for k, v in DTYPE_NAMES.items()}
    return [dict(dtype=names[dt], head_dim=d, **asdict(c)) for (dt, d), c in sorted(table.items(), key=str)]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def default_config(q: torch.Tensor) -> KernelConfig:
    """Small tiles under the interpreter (tests), the table's entry on the GPU."""
    return config_for(q.dtype, q.shape[-1], q.is_cuda)


def config_for(dtype: torch.dtype, d: int, cuda: bool = True, table: dict | None = None) -> KernelConfig:
    """The table entry of the smallest head-dim row >= ``d`` for ``dtype`` (the interpreter config when not on
    CUDA). ``table``: default ``LIGHTNING_MM_KERNEL_TABLE``'s file over ``TABLE``."""
    if not cuda:
        return INTERPRETER_CONFIG
    if table is None:
        path = os.environ.get("LIGHTNING_MM_KERNEL_TABLE")
        table = {**TABLE, **load_table(path)} if path else TABLE
    rows = sorted(k for dt, k in table if dt == dtype and k >= d)
    if not rows:
        raise ValueError(f"no kernel launch configuration for {dtype} at head dim {d}; the table has "
                         f"{sorted((str(dt), k) for dt, k in table)}: add a row (LIGHTNING_MM_KERNEL_TABLE)")
    return table[(dtype, rows[0])]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (the interpreter counts as 4)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
