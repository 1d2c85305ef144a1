"""Compile every kernel ahead of time for a CUDA target, without a GPU: ``python -m lightning_mm.attention.kernels.compile_check``.

The interpreter accepts code the GPU compiler rejects (non-constexpr globals, type mismatches across ``if``
branches, shared memory over the limit), so this lowers each kernel with the launch configuration of
:func:`config_for` through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas) and
reports the shared memory each needs. Must run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SMEM_LIMIT = {80: 166912, 90: 232448, 100: 232448}  # bytes of shared memory per block (A100, H100/H200, B200)
_SCALARS = ("Hq", "GROUPS", "Sq", "Sk", "D", "NQT", "NKT", "window")


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name.startswith("stride") or name in _SCALARS:
            sig[name] = "i32"
        elif name.startswith("scale"):
            sig[name] = "fp32"
        else:
            raise KeyError(f"no signature type for kernel argument {name!r}")
    return sig


def kernel_jobs(dtype_name: str, head_dim: int):
    """(kernel, pointer types, constexprs, num_warps, num_stages) for every launch of one dtype/head dim (dk/dv
    with and without the atomic dq)."""
    import triton

    from lightning_mm.attention.kernels.backward import delta_kernel, dkdv_kernel, dq_kernel
    from lightning_mm.attention.kernels.launch_config import config_for
    from lightning_mm.attention.kernels.forward import forward_kernel, merge_kernel

    cfg = config_for(DTYPE_NAMES[dtype_name], head_dim, cuda=True)
    t, i64, i32, f32 = "*" + dtype_name, "*i64", "*i32", "*fp32"
    words = dict(QW=i64, KW=i64, QP=i64, KP=i64, QS=i64, KS=i64)
    block_d = max(16, triton.next_power_of_2(head_dim))
    prec = "ieee" if dtype_name == "fp32" else "tf32"
    return [
        (forward_kernel, dict(Q=t, K=t, V=t, Out=t, Lse=f32, PartO=f32, PartLse=f32, Items=i32, KvIdx=i32,
                              KvPartial=i32, **words),
         dict(HAS_SEG=True, HAS_WINDOW=True, DOT_PRECISION=prec, UPCAST_DOT=False,
              BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, BLOCK_D=block_d),
         cfg.fwd_warps, cfg.stages),
        (merge_kernel, dict(Out=t, Lse=f32, PartO=f32, PartLse=f32, Merges=i32),
         dict(BLOCK_M=cfg.fwd_m, BLOCK_D=block_d), 4, cfg.stages),
        (delta_kernel, dict(O=t, DO=t, Delta=f32), dict(BLOCK_M=64, BLOCK_D=block_d), 4, 1),
        *[(dkdv_kernel, dict(Q=t, K=t, V=t, DO=t, DK=t, DV=t, DQ32=f32, Lse=f32, Delta=f32, Items=i32,
                             QCount=i32, QPartial=i32, QIdx=i32, **words),
           dict(HAS_SEG=True, HAS_WINDOW=True, DOT_PRECISION=prec, UPCAST_DOT=False,
                BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, BLOCK_D=block_d, ATOMIC_DQ=atomic),
           cfg.bwd_warps, cfg.stages) for atomic in (False, True)],
        (dq_kernel, dict(Q=t, K=t, V=t, DO=t, DQ=t, Lse=f32, Delta=f32, Items=i32, KvCount=i32,
                         KvPartial=i32, KvIdx=i32, **words),
         dict(HAS_SEG=True, HAS_WINDOW=True, DOT_PRECISION=prec, UPCAST_DOT=False,
              BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, BLOCK_D=block_d),
         cfg.bwd_warps, cfg.stages),
    ]


def compile_all(dtype_name: str, head_dim: int, arch: int = 90) -> list[dict]:
    """Compile each kernel to a cubin for ``sm_<arch>``; raises on a compile error or a shared memory overflow."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the compile check needs the real @triton.jit kernels")
    rows = []
    for fn, pointers, constexprs, warps, stages in kernel_jobs(dtype_name, head_dim):
        src = ASTSource(fn, _signature(fn, pointers, constexprs), constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        shared = compiled.metadata.shared
        limit = SMEM_LIMIT.get(arch // 10 * 10, SMEM_LIMIT[80])
        if shared > limit:
            raise RuntimeError(f"{fn.__name__} ({dtype_name}, D={head_dim}) needs {shared} B of shared memory, "
                               f"more than sm_{arch}'s {limit} B; shrink its tiles or stages in config_for")
        rows.append(dict(kernel=fn.__name__, dtype=dtype_name, head_dim=head_dim, arch=arch, shared_bytes=shared,
                         cubin_bytes=len(compiled.asm["cubin"])))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"], choices=list(DTYPE_NAMES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    args = parser.parse_args(argv)
    for dt in args.dtypes:
        for d in args.head_dims:
            for row in compile_all(dt, d, args.arch):
                print(f"{row['kernel']:15s} {dt:5s} D={d:<4d} sm_{args.arch} shared={row['shared_bytes']:7d} B  ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
