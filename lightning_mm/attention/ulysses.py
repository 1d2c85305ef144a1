"""Ulysses and hybrid context-parallel bitfield attention.

Ulysses (DeepSpeed-Ulysses): every rank holds the tokens of its CP blocks for all heads; one all-to-all
scatters the heads and gathers the sequence, so each rank holds the whole sequence for ``heads / K`` heads, runs
``bitfield_attention`` on it exactly as one process would (the reference, the Triton kernel or the CPU path,
whichever ``bitfield_attention`` dispatches to), and a second all-to-all sends the output back (heads gathered,
sequence scattered). Each rank sees every token of its heads, so any mask works and the result does not depend
on how tokens were distributed. Backward is the same two all-to-alls in reverse.

Hybrid: CP rank ``r = g * K + j`` is Ulysses rank ``j`` of group ``g``. Ulysses runs inside each group of ``K``
ranks; across the ``N / K`` groups the keys and values of each head subset are all-gathered (Llama-3 style, as in
``context_parallel.py``), so a group's queries see the keys of the whole sequence; backward reduce-scatters their
gradients. The token plan balances the block work over the groups (LPT), see ``parallel.context.distribute``.

GQA: with fewer key/value heads than Ulysses ranks, each KV head is repeated so every rank gets the one its
query heads use (the usual treatment); the gradient of the copies sums back. Query heads must divide by ``K``,
and KV heads must divide by ``K`` or divide ``K``.

Local lengths may differ between ranks (LPT plans): every rank pads to the longest with mask word 0, which no
query attends and whose queries output zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_mm.attention.context_parallel import _check_inputs, _gather_metadata, _pad_seq

MODES = ("allgather", "ulysses", "hybrid")
_REDUCE_SCATTER_OK: dict[str, bool] = {}


@dataclass(frozen=True)
class ContextParallelGroups:
    """What one rank's CP attention needs: the mode, the whole CP group (mask metadata; the all-gather of
    ``"allgather"``), its Ulysses group (the all-to-alls) and, for ``"hybrid"``, the group of the ranks holding
    the same head subset in the other Ulysses groups (the K/V all-gather). ``None`` is the default group."""

    mode: str
    group: object = None
    ulysses: object = None
    gather: object = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown cp_mode {self.mode!r}; choose one of {MODES}")


def check_ulysses_heads(heads: int, kv_heads: int, degree: int, where: str = "attention") -> None:
    """Raise unless ``heads`` query heads and ``kv_heads`` key/value heads can be split over ``degree`` Ulysses
    ranks (query heads divisible; KV heads divisible or a divisor, then repeated)."""
    if heads % degree:
        raise ValueError(f"{where}: {heads} query heads are not divisible by the Ulysses degree {degree}; choose "
                         f"ulysses (and cp) so that it divides the heads per tensor-parallel rank, or "
                         "cp_mode='allgather' (no head constraint)")
    if kv_heads % degree and degree % kv_heads:
        raise ValueError(f"{where}: {kv_heads} key/value heads cannot be split over {degree} Ulysses ranks (neither "
                         f"divides the other); choose a Ulysses degree that {kv_heads} divides or that divides "
                         f"{kv_heads}, or cp_mode='allgather'")


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x [W, ...]``: send ``x[i]`` to rank ``i``; returns ``[W, ...]`` with ``out[i]`` from rank ``i``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too (empty_like keeps a view's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_sequence(xs, group):
    """Each ``[B, H, S, D]`` (this rank's S tokens, all heads) -> ``[B, H/W, W*S, D]`` (head chunk ``rank`` of
    every rank's tokens, rank-major). One all-to-all for all tensors."""
    w = dist.get_world_size(group)
    b, _, s, d = xs[0].shape
    heads = [x.shape[1] // w for x in xs]
    send = torch.cat([x.reshape(b, w, h, s, d) for x, h in zip(xs, heads)], 2).movedim(1, 0)
    recv = _all_to_all(send, group).movedim(0, 2)  # [B, sum h, W, S, D]
    return tuple(t.reshape(b, h, w * s, d) for t, h in zip(recv.split(heads, 1), heads))


def _sequence_to_heads(ys, group):
    """The inverse of ``_heads_to_sequence``: each ``[B, h, W*S, D]`` -> ``[B, W*h, S, D]``."""
    w = dist.get_world_size(group)
    b, _, ws, d = ys[0].shape
    s, heads = ws // w, [y.shape[1] for y in ys]
    send = torch.cat([y.reshape(b, h, w, s, d) for y, h in zip(ys, heads)], 1).movedim(2, 0)
    recv = _all_to_all(send, group)  # [W, B, sum h, S, D]: rank i's heads of my tokens
    return tuple(t.movedim(0, 1).reshape(b, w * h, s, d) for t, h in zip(recv.split(heads, 2), heads))


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return _heads_to_sequence(xs, group)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_sequence_to_heads(grads, ctx.group))


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *ys):
        ctx.group = group
        return _sequence_to_heads(ys, group)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_heads_to_sequence(grads, ctx.group))


class _GatherSequence(torch.autograd.Function):
    """``[B, h, L, D]`` -> ``[B, h, G*L, D]`` over ``group`` (rank-major); backward sends each slice's gradient,
    summed over the group, to its owner (reduce-scatter, or all-reduce and slice where a backend lacks it)."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        x = torch.stack(xs)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return tuple(torch.cat(parts, 3).unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        w, rank = dist.get_world_size(group), dist.get_rank(group)
        g = torch.stack(grads)  # [n, B, h, W*L, D]
        n, b, h, wl, d = g.shape
        chunks = g.reshape(n, b, h, w, wl // w, d).movedim(3, 0).contiguous()
        backend = str(dist.get_backend(group))
        mine = None
        if _REDUCE_SCATTER_OK.get(backend, True):
            mine = torch.empty_like(chunks[0])
            try:
                dist.reduce_scatter(mine, list(chunks.unbind(0)), group=group)
            except (RuntimeError, NotImplementedError, ValueError):
                _REDUCE_SCATTER_OK[backend] = False  # every rank fails the same way, before any traffic
                mine = None
        if mine is None:
            dist.all_reduce(chunks, group=group)
            mine = chunks[rank]
        return (None, *mine.unbind(0))


def ulysses_attention(q, k, v, bam, segment_ids, token_index, groups: ContextParallelGroups, scale=None, *,
                      backend: str = "auto", cache: dict | None = None, window: int | None = None) -> torch.Tensor:
    """Bitfield attention of the local tokens ``[B,Hq,S_local,D]`` under Ulysses or hybrid CP (see the module).

    ``bam``, ``segment_ids`` (or None) and ``token_index`` are the local tokens' words, segments and global
    indices ``[B,S_local]``. ``groups``: this rank's ``ContextParallelGroups`` (mode ``"ulysses"`` or
    ``"hybrid"``). Returns ``[B,Hq,S_local,D]``, differentiable in q, k and v. ``cache``: a dict shared by the
    layers of one microbatch (the mask metadata is gathered once). ``window``: a sliding window in tokens (None =
    none); positions are global, so the window of one process holds on every layout.
    """
    if groups.mode not in ("ulysses", "hybrid"):
        raise ValueError(f"ulysses_attention runs cp_mode 'ulysses' or 'hybrid', got {groups.mode!r}")
    _check_inputs(q, k, v, bam, segment_ids, token_index, 1)
    degree = dist.get_world_size(groups.ulysses)
    hq, hkv, s = q.shape[1], k.shape[1], q.shape[2]
    check_ulysses_heads(hq, hkv, degree, "Ulysses attention")
    if token_index.dtype != torch.int64:
        token_index = token_index.to(torch.int64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cache is None or "metadata" not in cache:  # the same for every layer of a microbatch: gathered once
        metadata = _gather_metadata(bam, segment_ids, token_index, groups.group)
        if cache is not None:
            cache["metadata"] = metadata
    _, smax, k_bam, k_seg, k_pos = metadata if cache is None else cache["metadata"]
    if hkv < degree:  # GQA with fewer KV heads than ranks: each rank gets a copy of the head its queries use
        k, v = k.repeat_interleave(degree // hkv, 1), v.repeat_interleave(degree // hkv, 1)
    q, k, v = (_pad_seq(t, smax, 2) for t in (q, k, v))
    q, k, v = _HeadsToSequence.apply(groups.ulysses, q, k, v)
    # this Ulysses group's tokens: CP ranks g*K .. g*K+K-1, rank-major like the gathered metadata
    width = degree * smax
    first = dist.get_rank(groups.group) // degree * width
    mine = slice(first, first + width)
    if cache is None or "ulysses_words" not in cache:  # the same tensors for every layer: the kernels reuse tile maps
        q_words = (k_bam[:, mine], None if k_seg is None else k_seg[:, mine], k_pos[:, mine])
        k_words = (k_bam, k_seg, k_pos) if groups.mode == "hybrid" else q_words
        if cache is not None:
            cache["ulysses_words"] = q_words, k_words
    (q_bam, q_seg, q_pos), (k_bam, k_seg, k_pos) = (q_words, k_words) if cache is None else cache["ulysses_words"]
    if groups.mode == "hybrid":
        k, v = _GatherSequence.apply(groups.gather, k, v)  # every group's keys of this head subset
    from lightning_mm.attention.dispatch import bitfield_attention

    out = bitfield_attention(q, k, v, q_bam, k_bam, q_segments=q_seg, k_segments=k_seg, q_positions=q_pos,
                             k_positions=k_pos, scale=scale, backend=backend, cache=cache, window=window)
    (out,) = _SequenceToHeads.apply(groups.ulysses, out)
    return out[:, :, :s]
