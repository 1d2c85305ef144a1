"""Counts the operations that read a tensor's value on the host (each one waits for a GPU): ``.item()``, ``int(t)``,
``bool(t)``, ``.tolist()``. A dispatch mode sees on CPU the same operations a CUDA run would issue."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))
