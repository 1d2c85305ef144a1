"""Counts the operations that read a tensor's value on the host (each one waits for a GPU): ``.item()``, ``int(t)``,
``bool(t)``, ``.tolist()``. A dispatch mode sees on CPU the same operations a CUDA run would issue."""

import contextlib
import traceback

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


class DeviceToHost(TorchDispatchMode):
    """Records every operation that makes the host wait for a CUDA device, by name: value reads (``.item()``,
    ``int``/``bool`` of a tensor), operations whose output size depends on values (``nonzero``, ``unique``,
    ``masked_select``, boolean indexing, ``repeat_interleave`` without ``output_size``) and copies to the host
    (``.cpu()``, ``.tolist()``, ``.numpy()``). On a CPU run these are the calls a CUDA run would sync on.
    ``paused()`` stops recording (for Triton's CPU interpreter, which copies kernel arguments by design)."""

    SYNCING = HostReads.READS | {
        torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default, torch.ops.aten._unique.default,
        torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default,
        torch.ops.aten.equal.default}
    INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}
    METHODS = ("cpu", "tolist", "numpy")  # .item() is seen as _local_scalar_dense

    def __init__(self):
        super().__init__()
        self.reads, self.where, self._paused, self._saved = [], [], 0, {}

    def _record(self, name: str):
        self.reads.append(name)
        self.where.append([f"{f.filename}:{f.name}" for f in traceback.extract_stack() if "lightning_mm" in f.filename])

    def _syncs(self, func, args, kwargs) -> bool:
        if func in self.SYNCING:
            return True
        if func in self.INDEXING:
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if func is torch.ops.aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused and self._syncs(func, args, kwargs):
            self._record(str(func))
        return func(*args, **kwargs)

    def _method(self, name):
        original = self._saved[name]

        def wrapper(t, *a, **k):
            if not self._paused:
                self._record(f"Tensor.{name}")
            return original(t, *a, **k)
        return wrapper

    def __enter__(self):
        for name in self.METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._method(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def paused(self):
        mode = self

        class _Paused:
            def __enter__(self):
                mode._paused += 1

            def __exit__(self, *exc):
                mode._paused -= 1
        return _Paused()


def pipeline_step_reads(rank, world, microbatches: int) -> tuple[str, list[str]]:
    """(stage, what made the host wait) in one training step of a vision + LLM pp 2 pipeline (3 ranks), after a
    first step; the stage headers' reads are left out: they travel over the gloo header group as host tensors."""
    from helpers.pipeline_case import build_model, global_batches, replica_batch
    from lightning_mm.parallel.engine import PipelineEngine
    from lightning_mm.plan.layout import ParallelSpec, build_layout

    model = build_model(("vision",), "encoder")
    batches = global_batches(model, 2, 8)
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(pp=2), world, "parallel", ["vision"])
    engine = PipelineEngine(model, layout, rank, microbatches)
    mode = DeviceToHost()
    for i, batch in enumerate(batches):
        with mode if i else contextlib.nullcontext():
            engine.run(replica_batch(batch, model, layout.dp, engine.coord.dp))
            engine.sync_gradients()
    return engine.stage, [f"{r} in {w[-1]}" for r, w in zip(mode.reads, mode.where)
                          if not any("parallel/comm.py" in f for f in w)]
