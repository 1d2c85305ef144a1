"""Bytes each context-parallel mode moves per rank per attention layer, and what a Gated DeltaNet layer's headwise
exchange moves: pure arithmetic shared by the runtime (``lightning_mm.parallel.context`` re-exports it), the
planner's time model and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["cp_communication_bytes", "gdn_communication_bytes", "rank_token_counts"]


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


def gdn_communication_bytes(seq_len: int, cp: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                            dtype_bytes: int = 2, rank_tokens: Sequence[int] | None = None) -> dict[str, float]:
    """Bytes one CP rank receives per Gated DeltaNet layer (forward, backward) for a microbatch of ``seq_len``
    tokens (all rows). Every ``cp_mode`` splits a GDN layer by value heads over the whole CP group
    (``headwise_gated_delta_net``): forward one all-to-all of the projected q, k, v channels and the ``b``, ``a``
    gate inputs (one each per value head; query / key heads repeated to one per value head where ``cp`` does not
    divide ``key_heads``), then one of the delta rule's output (``value_heads x value_dim``); backward the two
    reversed.

    ``rank_tokens``: each CP rank's token count (``rank_token_counts`` of the plan the CP planner made: packed rows
    and LPT blocks split unevenly); None spreads ``seq_len`` evenly. The all-to-alls send equal parts, each rank's
    tokens padded to the largest count, so every rank receives ``cp - 1`` parts of ``max(rank_tokens)`` tokens'
    channels (``(cp-1)/cp`` of the local tokens' channels when even, like Ulysses); ``padded_tokens`` counts the
    padding slots the exchange carries (0 when even)."""
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0, "all_to_all": 0.0, "all_gather": 0.0, "collectives_per_layer": 0,
                "padded_tokens": 0}
    largest, padded = seq_len / cp, 0
    if rank_tokens is not None:
        counts = [int(n) for n in rank_tokens]
        if len(counts) != cp or min(counts) < 0 or sum(counts) != seq_len:
            raise ValueError(f"rank_tokens {counts} must hold one non-negative token count per CP rank (cp={cp}) "
                             f"summing to the microbatch's seq_len={seq_len}; take them from rank_token_counts of "
                             "the microbatch's CP plan")
        largest, padded = max(counts), cp * max(counts) - seq_len
    sent_key_heads = key_heads if key_heads % cp == 0 else value_heads
    per_channel = (cp - 1) * largest * dtype_bytes / cp  # a rank's channels: 1 / cp of every head kind's
    a2a_in = per_channel * (2 * sent_key_heads * key_dim + value_heads * value_dim + 2 * value_heads)
    a2a_out = per_channel * value_heads * value_dim
    fwd = a2a_in + a2a_out
    return {"forward": fwd, "backward": fwd, "all_to_all": fwd, "all_gather": 0.0, "collectives_per_layer": 4,
            "padded_tokens": padded}


def rank_token_counts(plan: Sequence[Sequence[int]], block_size: int, seq_len: int, rows: int = 1) -> list[int]:
    """Each CP rank's tokens in a microbatch of ``rows`` rows of ``seq_len`` tokens, from its CP plan (each rank's
    block indices, as ``parallel.context.distribute`` gives them; the last block may be short)."""
    return [rows * sum(min(block_size, seq_len - int(b) * block_size) for b in blocks) for blocks in plan]
