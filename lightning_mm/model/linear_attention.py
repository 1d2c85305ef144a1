"""Gated DeltaNet layers (Qwen3.5's linear attention) under packing: each sample's recurrent state and short
causal convolution start afresh at its first token, as if it were run alone.

A GDN layer is not attention: it never sees the bitfield mask, so packed samples would otherwise leak into each
other through its recurrent state and its convolution window. transformers keeps samples apart only through
``cu_seqlens`` / ``seq_idx`` with the flash-linear-attention and causal-conv1d kernels; its torch fallback refuses
them. The route here needs neither:

* ``SegmentedGatedDeltaNet`` is mixed into the HF GDN module's class (``segment_aware``), so a call that carries
  the mask words (``bam=``, as ``MultimodalModel`` passes them to every layer) runs :func:`gated_delta_net` and a
  call without them (the model used alone, ``generate``'s decoding with its cache) runs transformers' own forward.
  Parameter names, ``isinstance`` and FSDP's per-layer hooks are untouched.
* Rows holding one sample each run transformers' own forward, padding zeroed through its ``attention_mask``.
* Packed rows (``segment_ids``) run :func:`gated_delta_net`: the convolution masks every tap that reaches into an
  earlier sample, and the chunked delta rule (the math of transformers' ``torch_chunk_gated_delta_rule``) lays
  each sample out on chunks of its own, the state zeroed at each sample's first chunk; each sample costs at most
  ``chunk_size - 1`` padded positions.

The layout of a microbatch's samples is computed once (``SegmentLayout``, kept in the layers' shared
``attn_cache``) and lives on the hidden states' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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


def context_parallel_refusal(where: str) -> str:
    """The error for context parallelism over Gated DeltaNet layers (one message for every place that checks)."""
    return (f"{where}: the language model has Gated DeltaNet (linear attention) layers, whose recurrent state "
            "runs through the whole sequence, and context parallelism does not split them; use "
            "language_model=ParallelSpec(cp=1) and spread long sequences with pipeline or data parallelism")


@dataclass(frozen=True)
class SegmentLayout:
    """Where a microbatch's samples lie: ``valid`` ``[B, S]`` (non-padding, or None when every token is real),
    ``run`` ``[B, S]`` (the sample each token belongs to, numbered per row: boundaries where the segment id
    changes), and the chunked layout of the delta rule: ``slot`` ``[B, N * chunk]`` (the row position each slot
    reads, ``S`` for an empty slot), ``inverse`` ``[B, S]`` (each token's slot) and ``first`` ``[B, N]`` (1 where a
    chunk starts a sample). ``packed`` is False when every row is one sample."""

    valid: torch.Tensor | None
    run: torch.Tensor
    slot: torch.Tensor
    inverse: torch.Tensor
    first: torch.Tensor
    packed: bool
    chunk: int


def segment_layout(bam: torch.Tensor, segment_ids: torch.Tensor | None, chunk: int = CHUNK) -> SegmentLayout:
    """The ``SegmentLayout`` of mask words ``bam`` and ``segment_ids`` (``[B, S]``; None: one sample per row)."""
    b, s = bam.shape
    valid = bam.ne(0)
    device = bam.device
    if segment_ids is None:
        starts = torch.zeros(b, s, dtype=torch.bool, device=device)
    else:
        starts = torch.cat([torch.zeros(b, 1, dtype=torch.bool, device=device),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    starts[:, 0] = True
    run = starts.long().cumsum(1) - 1
    rows = []  # per row: (slots, inverse, first)
    for row in starts.cpu().tolist():
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
    inverse = torch.tensor([r[1] for r in rows], dtype=torch.long)
    return SegmentLayout(None if bool(valid.all()) else valid, run, slot.to(device), inverse.to(device),
                         first.to(device), bool(run[:, -1].gt(0).any()), chunk)


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


def gated_delta_net(gdn: nn.Module, hidden: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Qwen3.5's ``GatedDeltaNet.forward`` (no cache) over packed rows: projections, the segmented convolution,
    the segmented chunked delta rule, the gated norm and the output projection, with ``gdn``'s own parameters."""
    from transformers.activations import ACT2FN

    if layout.valid is not None:  # padding is zeroed, as transformers' attention_mask does
        hidden = hidden * layout.valid.unsqueeze(-1).to(hidden.dtype)
    b, s, _ = hidden.shape
    conv = gdn.conv1d
    mixed = segmented_causal_conv(gdn.in_proj_qkv(hidden).transpose(1, 2), conv.weight.squeeze(1), conv.bias,
                                  layout.run)
    mixed = ACT2FN[gdn.activation](mixed).to(hidden.dtype).transpose(1, 2)
    query, key, value = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    query = query.reshape(b, s, -1, gdn.head_k_dim)
    key = key.reshape(b, s, -1, gdn.head_k_dim)
    value = value.reshape(b, s, -1, gdn.head_v_dim)
    beta = gdn.in_proj_b(hidden).sigmoid()
    g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(hidden).float() + gdn.dt_bias)
    core = chunked_delta_rule(query, key, value, g, beta, layout)
    z = gdn.in_proj_z(hidden).reshape(-1, gdn.head_v_dim)
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z).reshape(b, s, -1)
    return gdn.out_proj(core)


class SegmentedGatedDeltaNet:
    """Mixed into a HF Gated DeltaNet class (``segment_aware``): a call carrying the mask words keeps packed
    samples apart (see the module docstring); a call without them is transformers' own."""

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        own = {k: kwargs.pop(k, None) for k in _OWN_KWARGS}
        if own["bam"] is None:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if own["cp_group"] is not None or own["token_index"] is not None:
            raise ValueError(context_parallel_refusal(f"layer {self.layer_idx}"))
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


__all__ = ["LINEAR", "SegmentLayout", "SegmentedGatedDeltaNet", "cached_layout", "chunked_delta_rule",
           "context_parallel_refusal", "gated_delta_net", "has_linear_attention", "layer_types", "segment_aware",
           "segment_layout", "segmented_causal_conv"]
