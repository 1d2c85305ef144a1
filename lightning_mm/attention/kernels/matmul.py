"""``tile_dot``: ``tl.dot`` with the precision the launcher picked.

``UPCAST`` exists for Triton's CPU interpreter, whose ``tl.dot`` returns garbage for bfloat16 operands (measured
with triton 3.9: errors of 1e10 on a 16x16 product). Upcasting bf16 to fp32 gives the same result as the GPU's
bf16 tensor-core product with fp32 accumulation, since products of bf16 values are exact in fp32. It is a
constexpr, so native launches never carry the branch.
"""

import triton
import triton.language as tl


@triton.jit
def tile_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out
