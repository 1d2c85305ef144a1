"""Context-parallel bitfield attention: local queries against the keys and values of the whole CP group.

Llama-3-style all-gather CP (the seeds' M7): every rank keeps its query tokens, all-gathers keys and values
(plus the key tokens' words, segments and global indices) and runs ``bitfield_attention`` with global
positions, so the mask, the causal rule included, is exact for any token-to-rank plan. Backward sends the
gradients of the gathered keys and values back to their owners with a reduce-scatter. Ranks may hold
different token counts (LPT plans): everything is padded to the largest rank with word 0 (padding), which
the mask never lets anyone attend.

Key/value heads are processed in ``head_groups`` groups; the all-gather of group g+1 is launched
(``async_op``) before group g is computed, and the reduce-scatter of group g's gradients runs while group
g+1's backward computes, which overlaps communication and compute on GPU (NCCL streams).

What backward needs: by default the gathered keys and values and their attention graph (cp times a layer's own
keys and values, kept until backward, but nothing computed twice). Under ``gathered_kv_recomputed()`` (the
engine's activation checkpointing) only the local q, k, v are saved, as ordinary saved tensors that
checkpointing frees, and backward gathers the keys and values again and recomputes the attention's forward.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

_REDUCE_SCATTER_OK: dict[str, bool] = {}
_RECOMPUTE_GATHERED_KV = contextvars.ContextVar("lightning_mm_recompute_gathered_kv", default=False)


@contextlib.contextmanager
def gathered_kv_recomputed(on: bool = True):
    """Inside (``on``), all-gather CP attention saves only its local q, k, v and gathers again in backward."""
    token = _RECOMPUTE_GATHERED_KV.set(on)
    try:
        yield
    finally:
        _RECOMPUTE_GATHERED_KV.reset(token)


def _default_head_groups(q: torch.Tensor, kv_heads: int) -> int:
    """One group on CPU (nothing to overlap with); on GPU up to 4 groups, a divisor of the KV heads."""
    if not q.is_cuda:
        return 1
    return max(g for g in (1, 2, 4) if kv_heads % g == 0)


def _check_inputs(q, k, v, bam, segment_ids, token_index, head_groups):
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected [B,H,S_local,D] "
                         "with k and v of one shape")
    b, hq, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must share batch, local length and head "
                         "dim, and query heads must be a multiple of key/value heads")
    if token_index is None:
        raise ValueError("context-parallel attention needs token_index: the global indices [B,S_local] of the "
                         "local tokens (lightning_mm.parallel.context.shard_batch provides them)")
    for name, t in (("bam", bam), ("token_index", token_index), ("segment_ids", segment_ids)):
        if t is not None and tuple(t.shape) != (b, s):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [B,S_local]=({b},{s}) like q")
    if head_groups < 1 or k.shape[1] % head_groups:
        raise ValueError(f"head_groups={head_groups} must divide the {k.shape[1]} key/value heads; choose a divisor "
                         "(1 disables the gather/compute overlap)")


def _pad_seq(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` to ``length``."""
    if x.shape[dim] == length:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim).contiguous()


def _gather_metadata(bam, segment_ids, token_index, group):
    """Every rank's local length, and the key-side words/segments/indices of the group, padded: [B, W*Smax]."""
    world = dist.get_world_size(group)
    b, s = bam.shape
    sizes = [torch.zeros(1, dtype=torch.int64, device=bam.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([s], dtype=torch.int64, device=bam.device), group=group)
    sizes = [int(x) for x in sizes]
    smax = max(sizes)
    seg = torch.zeros_like(bam) if segment_ids is None else segment_ids.to(torch.int64)
    meta = _pad_seq(torch.stack([bam, seg, token_index.to(torch.int64)]), smax, 2)  # pad words = 0
    parts = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(parts, meta, group=group)
    k_bam, k_seg, k_pos = torch.cat(parts, 2).unbind(0)
    return sizes, smax, k_bam, (None if segment_ids is None else k_seg), k_pos


def _launch_kv_gather(k, v, heads: slice, smax: int, group):
    """Async all-gather of one head group's K and V, padded to ``smax`` tokens."""
    kv = _pad_seq(torch.stack([k[:, heads], v[:, heads]]), smax, 3)  # [2,B,h,Smax,D]
    bufs = [torch.empty_like(kv) for _ in range(dist.get_world_size(group))]
    return bufs, dist.all_gather(bufs, kv, group=group, async_op=True)


def _assemble_kv(bufs):
    """[W] x [2,B,h,Smax,D] -> K, V [B,h,W*Smax,D] (rank-major along the sequence, like the metadata)."""
    kv = torch.stack(bufs, 3)  # [2,B,h,W,Smax,D]
    two, b, h, w, smax, d = kv.shape
    kv = kv.reshape(two, b, h, w * smax, d)
    return kv[0], kv[1]


def _launch_grad_scatter(dk_all, dv_all, smax: int, group):
    """Start sending the gathered-KV gradients to their owners: each rank receives the sum of its slice."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, h, _, d = dk_all.shape
    grads = torch.stack([dk_all, dv_all]).reshape(2, b, h, world, smax, d).movedim(3, 0).contiguous()
    backend = str(dist.get_backend(group))
    if _REDUCE_SCATTER_OK.get(backend, True):
        out = torch.empty_like(grads[0])
        try:
            return out, dist.reduce_scatter(out, list(grads.unbind(0)), group=group, async_op=True)
        except (RuntimeError, NotImplementedError, ValueError):
            _REDUCE_SCATTER_OK[backend] = False  # every rank fails the same way, before any traffic
    handle = dist.all_reduce(grads, group=group, async_op=True)
    return grads[rank], handle


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _attend_groups(q, k, v, words: tuple, head_groups: int, track: bool):
    """Per head group: gather its keys and values (the next group's gather in flight meanwhile) and attend; yields
    (leaves, out) with ``out`` differentiable in the leaves (q's group, gathered k, v) when ``track``."""
    from lightning_mm.attention.dispatch import bitfield_attention

    bam, segment_ids, token_index, k_bam, k_seg, k_pos, smax, group, scale, backend, cache, window = words
    per, rep = k.shape[1] // head_groups, q.shape[1] // k.shape[1]
    pending = _launch_kv_gather(k, v, slice(0, per), smax, group)
    for g in range(head_groups):
        bufs, handle = pending
        handle.wait()
        if g + 1 < head_groups:
            pending = _launch_kv_gather(k, v, slice((g + 1) * per, (g + 2) * per), smax, group)
        k_all, v_all = _assemble_kv(bufs)
        q_g = q[:, g * per * rep:(g + 1) * per * rep]
        # The inner graph is differentiated by a nested autograd.grad in backward. Outer saved-tensor hooks
        # (activation checkpointing) would make that nested call recompute the whole layer once more; the
        # leaves are held by the caller, so the inner graph keeps its tensors.
        with torch.set_grad_enabled(track), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            leaves = [t.detach().requires_grad_(track) for t in (q_g, k_all, v_all)]
            out = bitfield_attention(*leaves, bam, k_bam, q_segments=segment_ids, k_segments=k_seg,
                                     q_positions=token_index, k_positions=k_pos, scale=scale, backend=backend,
                                     cache=cache, window=window)
        yield leaves, out


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bam, segment_ids, token_index, group, scale, head_groups, backend, cache, window):
        if cache is None or "metadata" not in cache:  # the same for every layer of a microbatch: gathered once
            metadata = _gather_metadata(bam, segment_ids, token_index, group)
            if cache is not None:
                cache["metadata"] = metadata
        sizes, smax, k_bam, k_seg, k_pos = metadata if cache is None else cache["metadata"]
        track = any(ctx.needs_input_grad[:3])
        recompute = track and _RECOMPUTE_GATHERED_KV.get()
        words = (bam, segment_ids, token_index, k_bam, k_seg, k_pos, smax, group, scale, backend, cache, window)
        steps = list(_attend_groups(q, k, v, words, head_groups, track and not recompute))
        if recompute:
            ctx.save_for_backward(q, k, v)
        ctx.graphs = None if recompute or not track else steps
        ctx.words, ctx.head_groups, ctx.local, ctx.smax, ctx.group = words, head_groups, q.shape[2], smax, group
        return torch.cat([out.detach() for _, out in steps], 1)

    @staticmethod
    def backward(ctx, dout):
        steps, ctx.graphs = ctx.graphs, None
        if steps is None:  # recompute: gather the keys and values again and attend once more, with a graph
            steps = _attend_groups(*ctx.saved_tensors, ctx.words, ctx.head_groups, True)
        dq, dk, dv, in_flight, at = [], [], [], [], 0
        for leaves, out in steps:  # each group's gradients leave while the next group is gathered and computed
            width = out.shape[1]
            grads = torch.autograd.grad(out, leaves, dout[:, at:at + width])
            at += width
            dq.append(grads[0])
            in_flight.append(_launch_grad_scatter(grads[1], grads[2], ctx.smax, ctx.group))
        for mine, handle in in_flight:
            handle.wait()
            dk.append(mine[0, :, :, :ctx.local])
            dv.append(mine[1, :, :, :ctx.local])
        return (torch.cat(dq, 1), torch.cat(dk, 1), torch.cat(dv, 1)) + (None,) * 9


def context_parallel_attention(q, k, v, bam, segment_ids, token_index, cp_group, scale=None, *,
                               head_groups: int | None = None, backend: str = "auto",
                               cache: dict | None = None, window: int | None = None) -> torch.Tensor:
    """Bitfield attention of the local queries ``[B,Hq,S_local,D]`` over the keys/values of the whole CP group.

    ``bam``, ``segment_ids`` (or None) and ``token_index`` are the local tokens' words, segments and global
    indices ``[B,S_local]``; ``cp_group`` is the process group of the CP ranks (any plan, any local lengths).
    Returns ``[B,Hq,S_local,D]``, differentiable in q, k and v. ``head_groups`` (a divisor of the KV heads)
    sets how many gather/compute steps overlap; default 1 on CPU, up to 4 on GPU. ``cache``: a dict shared by
    the layers of one microbatch, so the mask metadata is gathered (and its sizes read on the host) once.
    ``window``: a sliding window in tokens (None = none); the positions are global, so it is that of one process.
    """
    if head_groups is None:
        head_groups = _default_head_groups(q, k.shape[1])
    _check_inputs(q, k, v, bam, segment_ids, token_index, head_groups)
    if token_index.dtype != torch.int64:
        token_index = token_index.to(torch.int64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ContextParallelAttention.apply(q, k, v, bam, segment_ids, token_index, cp_group, scale, head_groups,
                                           backend, cache, window)
