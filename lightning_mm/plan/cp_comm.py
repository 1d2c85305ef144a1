"""Bytes each context-parallel mode moves per rank per attention layer: pure arithmetic shared by the runtime
(``lightning_mm.parallel.context`` re-exports it), the planner's time model and the benchmark."""

from __future__ import annotations

__all__ = ["cp_communication_bytes"]


def cp_communication_bytes(mode: str, seq_len: int, cp: int, heads: int, kv_heads: int, head_dim: int,
                           ulysses: int | None = None, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes one CP rank receives per attention layer (forward, backward) in each CP mode, for a sequence of
    ``seq_len`` tokens evenly spread over ``cp`` ranks and ``heads`` / ``kv_heads`` heads of ``head_dim`` (per
    tensor-parallel rank). Pure arithmetic, what the planner and the benchmark compare:

    - ``"allgather"``: forward all-gathers K and V (``(cp-1)/cp`` of the sequence, ``2 kv_heads``), backward
      reduce-scatters their gradients (the same volume).
    - ``"ulysses"``: forward one all-to-all of q, k, v (heads scattered, sequence gathered) and one of the output;
      backward the same two reversed: 4 all-to-alls, each moving ``(U-1)/U`` of the local tokens' heads. KV heads
      fewer than ``U`` are repeated to ``U``.
    - ``"hybrid"``: those all-to-alls inside groups of ``ulysses`` ranks, plus the all-gather (and
      reduce-scatter) of the group's K/V head subset across the ``cp / ulysses`` groups.
    """
    local = seq_len / cp
    u = {"allgather": 1, "ulysses": cp, "hybrid": ulysses or 1}[mode]
    groups = cp // u
    kv = max(kv_heads, u) if u > 1 else kv_heads  # repeated KV heads travel too
    a2a_in = (u - 1) / u * local * (heads + 2 * kv) * head_dim * dtype_bytes
    a2a_out = (u - 1) / u * local * heads * head_dim * dtype_bytes
    gather = (groups - 1) * (seq_len / groups) * 2 * (kv / u) * head_dim * dtype_bytes
    fwd = a2a_in + a2a_out + gather
    return {"forward": fwd, "backward": fwd, "all_to_all": a2a_in + a2a_out, "all_gather": gather,
            "collectives_per_layer": (4 if u > 1 else 0) + (2 if groups > 1 else 0)}
