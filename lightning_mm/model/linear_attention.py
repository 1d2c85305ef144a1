"""Gated DeltaNet layers (Qwen3.5's linear attention) under packing: each sample's recurrent state and short
causal convolution start afresh at its first token, as if it were run alone.

A GDN layer is not attention: it never sees the bitfield mask, so packed samples would otherwise leak into each
other through its recurrent state and its convolution window. transformers keeps samples apart only through
``cu_seqlens`` / ``seq_idx`` with the flash-linear-attention and causal-conv1d kernels; its torch fallback refuses
them. The route here keeps them apart on every device, with fla's kernels where they run (below):

* ``SegmentedGatedDeltaNet`` is mixed into the HF GDN module's class (``segment_aware``), so a call that carries
  the mask words (``bam=``, as ``MultimodalModel`` passes them to every layer) runs :func:`gated_delta_net` and a
  call without them (the model used alone, ``generate``'s decoding with its cache) runs transformers' own forward.
  Parameter names, ``isinstance`` and FSDP's per-layer hooks are untouched.
* Rows holding one sample each run transformers' own forward, padding zeroed through its ``attention_mask``.
* Packed rows (``segment_ids``) run :func:`gated_delta_net`, whose convolution and delta rule restart at each
  sample. Which kernels run them is chosen in one place, :func:`gdn_kernel`: on CUDA with flash-linear-attention
  installed (the ``gpu`` extra), its varlen Triton kernels (``lightning_mm.model.fla_kernels``: every sample in
  one call per kernel, ``cu_seqlens`` from the segment ids); elsewhere the torch implementation here, the
  reference: the convolution masks every tap that reaches into an earlier sample, and the chunked delta rule (the
  math of transformers' ``torch_chunk_gated_delta_rule``) lays each sample out on chunks of its own, the state
  zeroed at each sample's first chunk; each sample costs at most ``chunk_size - 1`` padded positions.

The layout of a microbatch's samples is computed once (``SegmentLayout``, kept in the layers' shared
``attn_cache``; its one host read of the sample starts) and lives on the hidden states' device.

Context parallelism (a call carrying ``cp_group``) runs headwise, as Ulysses splits attention
(``headwise_gated_delta_net``): each rank projects its own tokens; one all-to-all gives every rank the channels of
its head group for the whole sequence, put back in its true order (the CP plan deals blocks out of order); the
rank runs the segmented convolution and chunked delta rule above on the whole sequence for its heads, exactly as
one process does; a second all-to-all returns each rank its tokens for all heads, and the gated norm and
``out_proj`` run on them. Rank ``i`` of ``W`` runs value heads ``i * Hv / W ..`` and the key heads they read
(each key head serves ``Hv / Hk`` consecutive value heads): ``W`` must divide the value heads; where it does not
divide the key heads, query / key channels are sent once per value head (repeated, their gradients summed back,
as Ulysses repeats key/value heads under GQA). A rank uses the convolution rows and ``A_log`` / ``dt_bias`` entries
of its heads only; their gradients are summed over the CP group with every other parameter's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mm.attention.context_parallel import _gather_metadata, _pad_seq
from lightning_mm.attention.ulysses import _all_to_all
from lightning_mm.model import fla_kernels

CHUNK = 64  # transformers' chunk size of the chunked delta rule
_OWN_KWARGS = ("bam", "segment_ids", "token_index", "cp_group", "attn_cache")
LINEAR = "linear_attention"


def layer_types(config) -> list[str]:
    """Each decoder layer's kind (``"linear_attention"`` or ``"full_attention"``) of a (text or composite) config;
    every layer is full attention when the config names none."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    n = getattr(config, "num_hidden_layers", 0) or 0
    types = getattr(config, "layer_types", None)
    return list(types[:n]) if types is not None else ["full_attention"] * n


def has_linear_attention(lm: nn.Module) -> bool:
    """Whether a language model has Gated DeltaNet (linear attention) layers."""
    return LINEAR in layer_types(getattr(lm, "config", None))


def gdn_kernel(device: torch.device) -> str:
    """Which kernels run the GDN layers' packed rows on ``device``: ``"fla"`` (flash-linear-attention's varlen
    Triton kernels) on CUDA when ``fla`` is importable, else ``"torch"`` (the reference here)."""
    return "fla" if torch.device(device).type == "cuda" and fla_kernels.available() else "torch"


@dataclass(frozen=True)
class SegmentLayout:
    """Where a microbatch's samples lie: ``valid`` ``[B, S]`` (non-padding, or None when every token is real),
    ``run`` ``[B, S]`` (the sample each token belongs to, numbered per row: boundaries where the segment id
    changes) and ``packed`` (False when every row is one sample). ``kernel`` (``gdn_kernel``) says which of the
    rest is set. ``"torch"``: the chunked layout of the delta rule, ``slot`` ``[B, N * chunk]`` (the row position
    each slot reads, ``S`` for an empty slot), ``inverse`` ``[B, S]`` (each token's slot) and ``first`` ``[B, N]``
    (1 where a chunk starts a sample). ``"fla"``: ``cu_seqlens`` (each sample's start in the flattened rows
    ``[B * S]``, then ``B * S``; on the device) and ``cu_seqlens_cpu`` (the same, on the host)."""

    valid: torch.Tensor | None
    run: torch.Tensor
    slot: torch.Tensor | None
    inverse: torch.Tensor | None
    first: torch.Tensor | None
    packed: bool
    chunk: int
    kernel: str = "torch"
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None


def segment_layout(bam: torch.Tensor, segment_ids: torch.Tensor | None, chunk: int = CHUNK,
                   kernel: str | None = None) -> SegmentLayout:
    """The ``SegmentLayout`` of mask words ``bam`` and ``segment_ids`` (``[B, S]``; None: one sample per row) for
    ``kernel`` (default: ``gdn_kernel`` of ``bam``'s device). Reads the sample starts to the host once: the one
    host synchronisation of a microbatch's GDN layers (the layout is shared through ``cached_layout``)."""
    b, s = bam.shape
    valid = bam.ne(0)
    device = bam.device
    kernel = kernel or gdn_kernel(device)
    if segment_ids is None:
        starts = torch.zeros(b, s, dtype=torch.bool, device=device)
    else:
        starts = torch.cat([torch.zeros(b, 1, dtype=torch.bool, device=device),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    starts[:, 0] = True
    run = starts.long().cumsum(1) - 1
    host, host_valid = torch.stack([starts, valid]).cpu()  # the sync
    valid = None if bool(host_valid.all()) else valid
    packed = bool(host[:, 1:].any())
    if kernel == "fla":
        cu_cpu = torch.cat([host.flatten().nonzero().flatten(), torch.tensor([b * s])])
        return SegmentLayout(valid, run, None, None, None, packed, chunk, "fla", cu_cpu.to(device), cu_cpu)
    if kernel != "torch":
        raise ValueError(f"unknown Gated DeltaNet kernel {kernel!r}: 'torch' or 'fla'")
    slot, inverse, first = _chunk_slots(host, chunk)
    return SegmentLayout(valid, run, slot.to(device), inverse.to(device), first.to(device), packed, chunk)


def _chunk_slots(starts: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch delta rule's chunked layout (``slot``, ``inverse``, ``first``; see ``SegmentLayout``) of the
    sample starts ``[B, S]`` (host): each sample on chunks of its own."""
    b, s = starts.shape
    rows = []  # per row: (slots, inverse, first)
    for row in starts.tolist():
        begins = [i for i, v in enumerate(row) if v] + [s]
        slots, inverse, first = [], [0] * s, []
        for a, e in zip(begins[:-1], begins[1:]):
            n = math.ceil((e - a) / chunk)
            for t in range(a, e):
                inverse[t] = len(slots) + t - a
            slots += list(range(a, e)) + [s] * (n * chunk - (e - a))
            first += [1] + [0] * (n - 1)
        rows.append((slots, inverse, first))
    width = max(len(r[2]) for r in rows)
    slot = torch.full((b, width * chunk), s, dtype=torch.long)
    first = torch.zeros(b, width)
    for i, (slots, _, f) in enumerate(rows):
        slot[i, :len(slots)] = torch.tensor(slots)
        first[i, :len(f)] = torch.tensor(f, dtype=first.dtype)
    return slot, torch.tensor([r[1] for r in rows], dtype=torch.long), first


def cached_layout(bam, segment_ids, cache: dict | None) -> SegmentLayout:
    """``segment_layout`` once per microbatch: kept in the ``attn_cache`` its layers share."""
    if cache is None:
        return segment_layout(bam, segment_ids)
    if "gdn_layout" not in cache:
        cache["gdn_layout"] = segment_layout(bam, segment_ids)
    return cache["gdn_layout"]


def segmented_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          run: torch.Tensor) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (depthwise, ``x`` ``[B, C, S]``, ``weight`` ``[C, K]``) with every tap
    that reaches into an earlier sample (``run`` differs) dropped, as if each sample were run alone."""
    k, s = weight.shape[-1], x.shape[-1]
    xp = F.pad(x.to(weight.dtype), (k - 1, 0))
    rp = F.pad(run, (k - 1, 0), value=-1)
    out = 0
    for i in range(k):  # tap i reads the token k - 1 - i steps back
        same = (rp[:, i:i + s] == run).unsqueeze(1)
        out = out + weight[:, i, None] * torch.where(same, xp[:, :, i:i + s], 0)
    return out if bias is None else out + bias[:, None]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(query, key, value, g, beta, layout: SegmentLayout) -> torch.Tensor:
    """transformers' ``torch_chunk_gated_delta_rule`` (q/k l2-normalised in the kernel, no initial state) over
    packed rows: inputs ``[B, S, heads, dim]`` (``g``, ``beta``: ``[B, S, heads]``) are laid out on each sample's
    own chunks (``layout.slot``) and the recurrent state is zeroed at each sample's first chunk. Returns the
    output ``[B, S, value heads, value dim]`` in the input's dtype."""
    dtype, c = query.dtype, layout.chunk
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:  # each query / key head serves hv // hk consecutive value heads
        query, key = (t.repeat_interleave(hv // hk, dim=2) for t in (query, key))

    def chunked(t):  # [B, S, ...] -> [B, heads, N, C, ...] float32, empty slots 0
        t = torch.cat([t, t.new_zeros(t.shape[0], 1, *t.shape[2:])], 1).float()
        t = t.gather(1, layout.slot.view(*layout.slot.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))
        t = t.unflatten(1, (-1, c))
        return t.permute(0, 3, 1, 2, 4) if t.dim() == 5 else t.permute(0, 3, 1, 2)

    query, key, value, g, beta = (chunked(t) for t in (query, key, value, g, beta))
    query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    upper = torch.ones(c, c, dtype=torch.bool, device=query.device).triu(1)
    cum = g.cumsum(-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    keep = (1 - layout.first)[:, None, :, None, None]  # 0 at a sample's first chunk: the state starts afresh
    state = query.new_zeros(*query.shape[:2], query.shape[-1], value.shape[-1])
    outs = []
    for i in range(query.shape[2]):
        state = state * keep[:, :, i]
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).flatten(2, 3).transpose(1, 2)  # [B, N * C, heads, dim]
    out = out.gather(1, layout.inverse[:, :, None, None].expand(-1, -1, *out.shape[2:]))
    return out.to(dtype)


def conv_and_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
                        layout: SegmentLayout) -> torch.Tensor:
    """The GDN layer's short causal convolution (``x`` ``[B, S, C]``, ``weight`` ``[C, K]``) restarting at each
    sample, then its activation, by ``layout.kernel``; ``[B, S, C]`` in ``x``'s dtype."""
    from transformers.activations import ACT2FN

    if layout.kernel == "fla":
        fused = activation if activation in ("silu", "swish") else None
        out = fla_kernels.varlen_causal_conv(x.to(weight.dtype), weight, bias, fused, layout.cu_seqlens,
                                             layout.cu_seqlens_cpu)
        return (out if fused else ACT2FN[activation](out)).to(x.dtype)
    out = segmented_causal_conv(x.transpose(1, 2), weight, bias, layout.run)
    return ACT2FN[activation](out).to(x.dtype).transpose(1, 2)


def delta_rule(query, key, value, g, beta, layout: SegmentLayout) -> torch.Tensor:
    """The chunked gated delta rule with the state zeroed at each sample's first token, by ``layout.kernel``
    (arguments and result as ``chunked_delta_rule``'s)."""
    if layout.kernel == "fla":
        return fla_kernels.varlen_delta_rule(query, key, value, g, beta, layout.cu_seqlens, layout.cu_seqlens_cpu)
    return chunked_delta_rule(query, key, value, g, beta, layout)


def gated_delta_net(gdn: nn.Module, hidden: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Qwen3.5's ``GatedDeltaNet.forward`` (no cache) over packed rows: projections, the segmented convolution,
    the segmented chunked delta rule, the gated norm and the output projection, with ``gdn``'s own parameters."""
    if layout.valid is not None:  # padding is zeroed, as transformers' attention_mask does
        hidden = hidden * layout.valid.unsqueeze(-1).to(hidden.dtype)
    b, s, _ = hidden.shape
    conv = gdn.conv1d
    mixed = conv_and_activation(gdn.in_proj_qkv(hidden), conv.weight.squeeze(1), conv.bias, gdn.activation,
                                layout).to(hidden.dtype)
    query, key, value = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    query = query.reshape(b, s, -1, gdn.head_k_dim)
    key = key.reshape(b, s, -1, gdn.head_k_dim)
    value = value.reshape(b, s, -1, gdn.head_v_dim)
    beta = gdn.in_proj_b(hidden).sigmoid()
    g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(hidden).float() + gdn.dt_bias)
    core = delta_rule(query, key, value, g, beta, layout)
    z = gdn.in_proj_z(hidden).reshape(-1, gdn.head_v_dim)
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z).reshape(b, s, -1)
    return gdn.out_proj(core)


def check_gdn_heads(value_heads: int, cp: int, where: str) -> None:
    """Raise, with the fix, unless ``cp`` ranks can split ``value_heads`` GDN value heads (pure: before any group)."""
    if cp > 1 and value_heads % cp:
        divisors = [d for d in range(1, value_heads + 1) if value_heads % d == 0]
        raise ValueError(f"{where}: context parallelism splits each Gated DeltaNet (linear attention) layer by heads "
                         f"over the cp={cp} ranks, and cp does not divide its {value_heads} value heads "
                         f"(linear_num_value_heads); choose cp among {divisors}, or spread long sequences with "
                         "pipeline or data parallelism")


@dataclass(frozen=True)
class HeadwiseLayout:
    """Where a microbatch's tokens are under CP: ``sizes`` (each rank's token count; all padded to ``smax`` in the
    all-to-all), ``order`` ``[S]`` (the all-to-all slot, rank-major, of each global position), ``back``
    ``[W * smax]`` (the global position of each slot, 0 for padding slots) and ``layout``, the ``SegmentLayout`` of
    the whole sequence."""

    sizes: tuple[int, ...]
    smax: int
    order: torch.Tensor
    back: torch.Tensor
    layout: SegmentLayout


def headwise_layout(bam, segment_ids, token_index, group, cache: dict | None) -> HeadwiseLayout:
    """The ``HeadwiseLayout`` of the local tokens' mask words, segments and global indices ``[B, S_local]`` (every
    row holds the same indices: one CP plan per microbatch); gathered once per microbatch (``cache``)."""
    if cache is not None and "gdn_headwise" in cache:
        return cache["gdn_headwise"]
    if token_index is None or tuple(token_index.shape) != tuple(bam.shape):
        raise ValueError("a Gated DeltaNet layer under context parallelism needs token_index: the global indices "
                         f"[B, S_local] of the local tokens, shaped like bam {tuple(bam.shape)}, got "
                         f"{None if token_index is None else tuple(token_index.shape)}")
    sizes, smax, k_bam, k_seg, k_pos = _gather_metadata(bam, segment_ids, token_index, group)
    device, w = bam.device, len(sizes)
    slot = torch.arange(w * smax, device=device)
    real = slot % smax < torch.tensor(sizes, device=device)[slot // smax]
    positions = k_pos[0][real]
    seq_len = sum(sizes)
    if not bool((k_pos == k_pos[:1]).all()) or \
            not torch.equal(positions.sort().values, torch.arange(seq_len, device=device)):
        raise ValueError("the CP ranks' token indices do not partition the sequence 0..S-1 with one plan for every "
                         "row; shard the microbatch with lightning_mm.parallel.context.shard_batch (one plan)")
    order = torch.empty(seq_len, dtype=torch.long, device=device)
    order[positions] = slot[real]
    back = torch.where(real, k_pos[0], 0)
    layout = segment_layout(k_bam.index_select(1, order), None if k_seg is None else k_seg.index_select(1, order))
    out = HeadwiseLayout(tuple(sizes), smax, order, back, layout)
    if cache is not None:
        cache["gdn_headwise"] = out
    return out


@functools.lru_cache(maxsize=64)
def _channels(hk: int, hv: int, dk: int, dv: int, w: int) -> tuple[torch.Tensor, int, int]:
    """The channels of ``cat(in_proj_qkv, in_proj_b, in_proj_a)`` each rank runs ``[W, C]`` (q, k, v of its heads,
    then its b and a), its key heads (after any repetition) and its value heads."""
    key_heads = hk if hk % w == 0 else hv  # repeated: one key head per value head
    nk, nv = key_heads // w, hv // w
    conv_dim = 2 * hk * dk + hv * dv
    rows = []
    for i in range(w):
        src = [e * hk // key_heads for e in range(i * nk, (i + 1) * nk)]
        q = [h * dk + j for h in src for j in range(dk)]
        v = [2 * hk * dk + h * dv + j for h in range(i * nv, (i + 1) * nv) for j in range(dv)]
        heads = list(range(i * nv, (i + 1) * nv))
        rows.append(q + [hk * dk + c for c in q] + v + [conv_dim + h for h in heads]
                    + [conv_dim + hv + h for h in heads])
    return torch.tensor(rows), nk, nv


class _AllToAll(torch.autograd.Function):
    """``[W, ...]``: part ``i`` to rank ``i``; the result's part ``i`` came from rank ``i``. Its own transpose."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return None, _all_to_all(grad, ctx.group)


def headwise_gated_delta_net(gdn, hidden, bam, segment_ids, token_index, group, cache: dict | None = None):
    """Qwen3.5's ``GatedDeltaNet.forward`` (no cache) of a CP rank's tokens ``hidden`` ``[B, S_local, H]`` (see the
    module): equal to one process's output at those tokens. ``group``: the CP process group."""
    w, me = dist.get_world_size(group), dist.get_rank(group)
    check_gdn_heads(gdn.num_v_heads, w, f"layer {gdn.layer_idx}")
    hl = headwise_layout(bam, segment_ids, token_index, group, cache)
    chan, nk, nv = _channels(gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, w)
    chan = chan.to(hidden.device)
    dk, dv = gdn.head_k_dim, gdn.head_v_dim
    hidden = hidden * bam.ne(0).unsqueeze(-1).to(hidden.dtype)  # padding zeroed, as transformers' attention_mask
    b, s, _ = hidden.shape
    x = torch.cat([gdn.in_proj_qkv(hidden), gdn.in_proj_b(hidden), gdn.in_proj_a(hidden)], -1)
    send = _pad_seq(x, hl.smax, 1)[..., chan.flatten()].unflatten(-1, chan.shape).movedim(2, 0)  # [W, B, smax, C]
    x = _AllToAll.apply(group, send.contiguous()).movedim(0, 1).flatten(1, 2).index_select(1, hl.order)  # [B, S, C]
    n_conv = 2 * nk * dk + nv * dv
    conv_rows = chan[me, :n_conv]
    bias = None if gdn.conv1d.bias is None else gdn.conv1d.bias.index_select(0, conv_rows)
    weight = gdn.conv1d.weight.squeeze(1).index_select(0, conv_rows)
    mixed = conv_and_activation(x[..., :n_conv], weight, bias, gdn.activation, hl.layout).to(hidden.dtype)
    query, key, value = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    mine = slice(me * nv, (me + 1) * nv)
    beta = x[..., n_conv:n_conv + nv].sigmoid()
    g = -gdn.A_log[mine].float().exp() * F.softplus(x[..., n_conv + nv:].float() + gdn.dt_bias[mine])
    core = delta_rule(query.unflatten(-1, (nk, dk)), key.unflatten(-1, (nk, dk)), value.unflatten(-1, (nv, dv)), g,
                      beta, hl.layout)  # [B, S, nv, dv]
    send = core.flatten(2).index_select(1, hl.back).unflatten(1, (w, hl.smax)).movedim(1, 0)  # [W, B, smax, nv*dv]
    core = _AllToAll.apply(group, send.contiguous()).movedim(0, 2)[:, :s].reshape(-1, dv)  # my tokens, all heads
    z = gdn.in_proj_z(hidden).reshape(-1, dv)
    return gdn.out_proj(gdn.norm(core, z).reshape(b, s, -1))


class SegmentedGatedDeltaNet:
    """Mixed into a HF Gated DeltaNet class (``segment_aware``): a call carrying the mask words keeps packed
    samples apart (see the module docstring); a call without them is transformers' own."""

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        own = {k: kwargs.pop(k, None) for k in _OWN_KWARGS}
        if own["bam"] is None:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if own["cp_group"] is not None:  # context parallelism: a ContextParallelGroups or the CP group itself
            group = getattr(own["cp_group"], "group", own["cp_group"])
            return headwise_gated_delta_net(self, hidden_states, own["bam"], own["segment_ids"], own["token_index"],
                                            group, own["attn_cache"])
        layout = cached_layout(own["bam"], own["segment_ids"], own["attn_cache"])
        if layout.packed:
            return gated_delta_net(self, hidden_states, layout)
        valid = None if layout.valid is None else layout.valid.to(hidden_states.dtype)
        return super().forward(hidden_states, attention_mask=valid, **kwargs)


_SEGMENTED: dict[type, type] = {}


def segment_aware(module: nn.Module) -> nn.Module:
    """Make a HF Gated DeltaNet module keep packed samples apart (``SegmentedGatedDeltaNet`` mixed into its class,
    in place; its parameters stay as they are). Idempotent."""
    cls = type(module)
    if issubclass(cls, SegmentedGatedDeltaNet):
        return module
    if cls not in _SEGMENTED:
        name = f"Segmented{cls.__name__}"
        _SEGMENTED[cls] = type(name, (SegmentedGatedDeltaNet, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = _SEGMENTED[cls]  # picklable by name
    module.__class__ = _SEGMENTED[cls]
    return module


__all__ = ["LINEAR", "HeadwiseLayout", "SegmentLayout", "SegmentedGatedDeltaNet", "cached_layout",
           "check_gdn_heads", "chunked_delta_rule", "conv_and_activation", "delta_rule", "gated_delta_net",
           "gdn_kernel", "has_linear_attention",
           "headwise_gated_delta_net", "headwise_layout", "layer_types", "segment_aware", "segment_layout",
           "segmented_causal_conv"]
