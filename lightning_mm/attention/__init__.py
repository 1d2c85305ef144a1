"""Bitfield attention: one entry point, several backends, registered with transformers' AttentionInterface."""

from __future__ import annotations

from lightning_mm.attention.dispatch import BACKENDS, bitfield_attention
from lightning_mm.attention.hf import ATTENTION_NAME, attach, register
from lightning_mm.attention.reference import reference_attention
from lightning_mm.attention.bitfield_hf import use_bitfield_attention
from lightning_mm.attention.mask import check_attention_inputs  # noqa: F401  (shared by every backend)

register()

__all__ = ["bitfield_attention", "reference_attention", "ATTENTION_NAME", "attach", "register", "BACKENDS",
           "use_bitfield_attention"]
