"""Triton bitfield attention kernels (installed as ``lightning_mm.kernels``)."""
