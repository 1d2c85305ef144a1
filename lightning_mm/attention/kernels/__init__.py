"""Triton bitfield attention kernels (installed as ``lightning_mm.attention.kernels``).

``bitfield_attention`` is the ``backend="triton"`` of :func:`lightning_mm.attention.bitfield_attention`:
FlashAttention-2 style forward and backward over tiles classified skip / full / partial from the mask words,
with split-KV pieces and a merge kernel for heavy query tiles. See ``docs/kernels.md``.
"""

if __name__ == "kernels":
    # Imported as a top-level package because the checkout's root is on sys.path (``python -m``/``-c`` there).
    # transformers probes for the unrelated HF ``kernels`` package by importing it: look absent to it.
    del __file__
else:
    from lightning_mm.attention.kernels.attention import bitfield_attention
    from lightning_mm.attention.kernels.launch_config import KernelConfig, default_config
    from lightning_mm.attention.kernels.tiles import FULL, PARTIAL, SKIP, tile_classes

__all__ = ["bitfield_attention", "KernelConfig", "default_config", "tile_classes", "SKIP", "FULL", "PARTIAL"]
