"""Point-to-point messages between pipeline stages: batched, shape-carrying, and deadlock-free under NCCL.

A message is a dict of tensors of any shape (microbatches differ in images per sample and sequence length).
The engine posts every run of consecutive send/receive actions of its schedule as one exchange (as Megatron
pairs "send forward, receive backward"):

1. Headers (ndim, dtype, shape of each tensor) go over a host-side gloo group: sends are posted and not waited
   for, receives are waited for. Host progress therefore follows the buffered-send model that
   ``plan.schedule.check_schedule`` proves, and reading a header never synchronises the device.
2. On a backend that fuses groups (NCCL), the tensors go in one ``batch_isend_irecv`` per exchange, executed in
   order on the communicator's stream; ``plan.schedule.check_rendezvous`` proves these groups complete even
   though a transfer only completes when both sides' groups run. Waiting on them orders the compute stream, the
   host goes on. On gloo, sends are posted before any wait and only receives are waited for (buffered model).

Receive buffers are allocated on the stage's device from the headers. Sends stay referenced until their work
completes (checked at every exchange, all waited for by ``wait_all`` at the end of a step). gloo's send/recv move
host memory only: a gloo group carrying the tensors of CUDA stages (several ranks sharing one GPU, which NCCL
refuses) stages them through host copies (``carries_device_tensors``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mm.fault_tolerance.watchdog import waiting

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
MAX_DIMS = 6
FIELDS = 2 + MAX_DIMS  # per tensor: ndim, dtype index, shape


def header(message: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    """The int64 description of ``message[k]`` for k in ``keys``: FIELDS numbers per tensor (host memory)."""
    out = []
    for k in keys:
        t = message[k]
        if t.dim() > MAX_DIMS:
            raise ValueError(f"cannot send a {t.dim()}-d tensor {k!r} between stages (at most {MAX_DIMS} dims)")
        if t.dtype not in DTYPES:
            raise ValueError(f"cannot send {k!r} of dtype {t.dtype} between stages; supported: {DTYPES}")
        out += [t.dim(), DTYPES.index(t.dtype), *t.shape, *[0] * (MAX_DIMS - t.dim())]
    return torch.tensor(out, dtype=torch.int64)


def empty_from_header(values: list[int], keys: list[str], device) -> dict[str, torch.Tensor]:
    out = {}
    for i, k in enumerate(keys):
        row = values[i * FIELDS:(i + 1) * FIELDS]
        out[k] = torch.empty(row[2:2 + row[0]], dtype=DTYPES[row[1]], device=device)
    return out


def device_backend(backend: str, device_type: str) -> str:
    """The backend that moves ``device_type`` tensors under a process-group backend string: "nccl", "gloo", or a
    per-device map such as "cpu:gloo,cuda:nccl" ("" when the map names no backend for that device)."""
    if ":" not in backend:
        return backend
    return dict(item.split(":", 1) for item in backend.split(",")).get(device_type, "")


def carries_device_tensors(backend: str, device_type: str) -> bool:
    """Whether ``backend``'s send/recv take tensors on ``device_type`` directly (gloo's take host memory only)."""
    return device_type == "cpu" or device_backend(backend, device_type) != "gloo"


def check_backend(backend: str, devices: list[torch.device], tensor_parallel: bool, context_parallel: bool,
                  sharded: bool, expert_parallel: bool = False) -> None:
    """Refuse, before any process group exists, a layout the process-group backend cannot run: NCCL with two local
    ranks on one GPU (NCCL refuses a device twice in one communicator), and gloo between CUDA stages with tensor,
    context, sharded data or expert parallelism (gloo all-gathers, reduce-scatters and all-to-alls host tensors only;
    its send/recv are staged through host copies, its all-reduce and broadcast take CUDA tensors)."""
    devices = [torch.device(d) for d in devices]
    cuda, backend = [d for d in devices if d.type == "cuda"], device_backend(backend, "cuda")
    if backend == "nccl" and len(set(cuda)) < len(cuda):
        shared = next(d for d in cuda if cuda.count(d) > 1)
        ranks = [i for i, d in enumerate(devices) if d == shared]
        raise ValueError(f"local ranks {ranks} all run on {shared}, and NCCL refuses a GPU shared by ranks of one "
                         "communicator; give each rank its own GPU, or pass process_group_backend='gloo' to "
                         "MultimodalParallelStrategy (pipeline and data parallelism only)")
    if backend == "gloo" and cuda:
        needs = [name for name, on in (("tensor parallelism", tensor_parallel), ("context parallelism",
                 context_parallel), ("sharded data parallelism", sharded), ("expert parallelism", expert_parallel))
                 if on]
        if needs:
            raise ValueError(f"{', '.join(needs)} on CUDA devices needs NCCL: gloo cannot all-gather, "
                             "reduce-scatter or all-to-all CUDA tensors; use process_group_backend='nccl' (one GPU "
                             "per rank)")


class StageComm:
    """Batched P2P for one rank. ``header_group``: a gloo group over every rank (host-side headers);
    ``group``: the group the tensors travel on (default: the world group). Peers are global ranks."""

    def __init__(self, device: torch.device | str, header_group, group=None):
        self.device, self.header_group, self.group = torch.device(device), header_group, group
        backend = dist.get_backend(group or dist.group.WORLD)
        self.wire = self.device if carries_device_tensors(backend, self.device.type) else torch.device("cpu")
        self.in_flight: list[tuple] = []  # (work, tensor) of sends posted but not known complete

    def exchange(self, sends: list[tuple[dict[str, torch.Tensor], list[str], int]],
                 recvs: list[tuple[list[str], int]]) -> list[dict[str, torch.Tensor]]:
        """Send ``(message, keys, dst)`` and receive ``(keys, src)`` as one group; returns the received messages
        in ``recvs`` order."""
        if not sends and not recvs:
            return []
        self.in_flight = [(w, t) for w, t in self.in_flight if not w.is_completed()]
        for msg, keys, dst in sends:
            h = header(msg, keys)
            self.in_flight.append((dist.isend(h, dst, group=self.header_group), h))
        out_tensors = [(t, dst) for msg, keys, dst in sends
                       for t in (msg[k].detach().to(self.wire).contiguous() for k in keys) if t.numel()]
        fused = self._fused()
        if not fused:  # one operation at a time (gloo): post the sends before waiting for anything
            self.in_flight += [(dist.isend(t, dst, group=self.group), t) for t, dst in out_tensors]
        heads = [torch.empty(len(keys) * FIELDS, dtype=torch.int64) for keys, _ in recvs]
        for w, (_, src) in zip([dist.irecv(h, src, group=self.header_group) for h, (_, src) in zip(heads, recvs)],
                               recvs):
            with waiting("receive a message header", peer=src):
                w.wait()
        received = [empty_from_header(h.tolist(), keys, self.wire) for h, (keys, _) in zip(heads, recvs)]
        in_tensors = [(msg[k], src) for msg, (keys, src) in zip(received, recvs) for k in keys if msg[k].numel()]
        ops = [dist.P2POp(dist.irecv, t, src, group=self.group) for t, src in in_tensors]
        if fused:  # one fused group (NCCL): waiting orders the current stream after it, the host goes on
            ops = [dist.P2POp(dist.isend, t, dst, group=self.group) for t, dst in out_tensors] + ops
        if ops:
            peers = sorted({src for _, src in in_tensors} | ({dst for _, dst in out_tensors} if fused else set()))
            with waiting(f"exchange tensors with ranks {peers}", peer=peers[0] if len(peers) == 1 else None,
                         group=peers if len(peers) > 1 else None):
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        if self.wire != self.device:
            received = [{k: t.to(self.device) for k, t in msg.items()} for msg in received]
        return received

    def _fused(self) -> bool:
        group = self.group or dist.group.WORLD
        return group._get_backend(self.device).supports_coalescing

    def wait_all(self) -> None:
        """Wait for every send still in flight and release its buffers."""
        with waiting("finish sends"):
            for w, _ in self.in_flight:
                w.wait()
        self.in_flight.clear()
