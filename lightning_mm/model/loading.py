"""Building on the meta device, materialising, deterministic initialisation by name, and local HF folders.

A model built under ``with torch.device("meta"):`` costs no memory. ``materialise(model, device, seed)`` then
creates every tensor still on meta on ``device`` and fills it: from the folder it was built from (memory-mapped,
one tensor at a time, only the tensors still on meta, so a pruned pipeline stage reads only its own), or by a
random initialisation whose generator is seeded from ``(seed, the module's full name)``. The random numbers are
drawn on the CPU and then moved, so every layout, process and device starts from the same values.

Pretrained parts: ``load_language_model(path)`` / ``load_encoder(path)`` (what ``MultimodalModel`` and
``ModalityEncoder`` call for a string) build the HF class a ``save_pretrained`` folder describes. Eagerly they load
the weights at once; under meta they only record where each tensor lives (``module.pretrained_source``, a
``PretrainedSource``) after checking every tensor's presence and shape from the safetensors headers, so every
error (missing folder, config or tensor, wrong shape, unknown architecture) is raised while the model is built.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import struct
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class ModelFolderError(ValueError):
    """A local model folder that cannot be loaded (missing, incomplete, another architecture or other shapes)."""


@dataclass
class FusedTensor:
    """A parameter stored as per-expert pieces, combined as transformers' ``WeightConverter`` does on load
    (``MergeModulelist(stack_dim)`` then, for several pieces per expert, ``Concatenate(concat_dim)``).

    ``parts[j][e]`` is ``(file, key)`` of piece ``j`` (``gate_proj``, ``up_proj`` ...) of expert ``e``; the value
    is ``cat([stack(parts[j] over e, stack_dim) for j], concat_dim)``, so a rank that holds only some experts (a
    block of ``stack_dim``) reads only their pieces."""

    parts: list[list[tuple[str, str]]]
    stack_dim: int = 0
    concat_dim: int | None = None


@dataclass
class PretrainedSource:
    """Where the tensors of a module built from a local HF folder live.

    ``tensors`` maps a parameter or persistent buffer name inside the module (as in its ``state_dict``) to
    ``(file, key)``: the safetensors file (relative to ``folder``) and the tensor's key in it. ``prefix`` is the
    part of the keys that was dropped when the folder holds a larger model (``"model.encoder."`` for the Whisper
    encoder of a ``WhisperForConditionalGeneration`` folder). ``fused`` maps a parameter that the folder stores
    in pieces (mixture-of-experts weights kept one expert at a time) to how the pieces combine (``FusedTensor``).
    """

    folder: str
    model_class: str
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)
    prefix: str = ""
    fused: dict[str, FusedTensor] = field(default_factory=dict)

    def path(self, file: str) -> str:
        return os.path.join(self.folder, file)


# ---------------------------------------------------------------------------------------------- small helpers
def init_seed(seed: int, name: str) -> int:
    """The generator seed of the tensors of module ``name``: stable across processes, machines and Python runs."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is still on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def building_on_meta() -> bool:
    """Whether tensors created now land on the meta device (``with torch.device("meta")``, ``empty_init``)."""
    return torch.get_default_device().type == "meta"


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@contextmanager
def _seeded(seed: int, name: str):
    """The CPU generator seeded from ``(seed, name)``; the global random state is restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(init_seed(seed, name))
        yield


class _Group:
    """One tensor object and every (module, kind, attribute) slot holding it (tied weights share a group)."""

    __slots__ = ("tensor", "names", "slots", "persistent")

    def __init__(self, tensor):
        self.tensor, self.names, self.slots, self.persistent = tensor, [], [], False

    def assign(self, value) -> None:
        for mod, kind, attr in self.slots:
            getattr(mod, kind)[attr] = value


def _groups(root: nn.Module, prefix: str = "") -> dict[int, _Group]:
    groups: dict[int, _Group] = {}
    seen = set()
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(mod, kind).items():
                if t is None:
                    continue
                g = groups.get(id(t))
                if g is None:
                    g = groups[id(t)] = _Group(t)
                g.names.append(_join(prefix, _join(mod_name, attr)))
                if (id(mod), kind, attr) not in seen:
                    seen.add((id(mod), kind, attr))
                    g.slots.append((mod, kind, attr))
                if kind == "_parameters" or attr not in mod._non_persistent_buffers_set:
                    g.persistent = True
    return groups


def _as_slot_value(old: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if isinstance(old, nn.Parameter):
        return nn.Parameter(value, requires_grad=old.requires_grad)
    return value


def _swap_in(group: _Group, value: torch.Tensor) -> None:
    """Give the group's tensor object ``value``'s data (keeping the object, so ties and references hold)."""
    old = group.tensor
    new = _as_slot_value(old, value)
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k != "_is_hf_initialized"})
    try:
        torch.utils.swap_tensors(old, new)
    except RuntimeError:  # e.g. a weak reference to the old object: put the new one in every slot instead
        group.tensor = new
        group.assign(new)


# ---------------------------------------------------------------------------------------------- sharded tensors
def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed support
        return False
    return isinstance(t, DTensor)


def _local_slices(t) -> tuple[slice, ...] | None:
    """The region of the global tensor a DTensor holds on this rank, when it is one block (plain ``Shard`` and
    ``Replicate`` placements: FSDP2 and TP); None for layouts that interleave (strided sharding)."""
    from torch.distributed.tensor import Replicate, Shard

    if not all(type(p) in (Shard, Replicate) for p in t.placements):
        return None
    (chunk,) = t.__create_chunk_list__()  # DTensor's checkpoint protocol: this rank's block of the global tensor
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))


def _from_local(old, local: torch.Tensor):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                              stride=old.stride())


def _shard_like(old, full: torch.Tensor, device):
    """``full`` (the global tensor, any device) as a DTensor laid out like the DTensor ``old``, on ``device``."""
    from torch.distributed.tensor import distribute_tensor

    region = _local_slices(old)
    if region is None:  # every rank holds the global tensor already: no communication needed
        return distribute_tensor(full.to(device=device, dtype=old.dtype), old.device_mesh, old.placements,
                                 src_data_rank=None)
    return _from_local(old, full[region].to(device=device, dtype=old.dtype, copy=True).contiguous())


# ---------------------------------------------------------------------------------------------- initialisation
def _hf_pretrained_class():
    from transformers import PreTrainedModel

    return PreTrainedModel


def _sentinel_fill(t: torch.Tensor) -> None:
    """Mark a fresh working tensor as not yet initialised: NaN (or the smallest integer) at its first and last
    element. Every init writes the whole tensor, so checking those two elements finds one that none wrote."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return
    flat = t.view(-1)
    value = float("nan") if t.is_floating_point() or t.is_complex() else torch.iinfo(t.dtype).min
    flat[0] = flat[-1] = value


def _still_sentinel(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    ends = t.detach().reshape(-1)[[0, -1]]
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(ends).all())
    return bool((ends == torch.iinfo(t.dtype).min).all())


def _initialise(root: nn.Module, work: dict[int, _Group], groups: dict[int, _Group], seed: int,
                prefix: str) -> None:
    """Fill the tensors of ``work`` (already replaced by CPU working tensors) with the deterministic init.

    Modules are visited children first, as transformers' ``initialize_weights`` does; a module whose subtree holds
    a working tensor is initialised under a generator seeded from ``(seed, its full name)``: by the
    ``_init_weights`` of the nearest enclosing HF ``PreTrainedModel`` (the values ``from_pretrained`` gives
    missing weights, including computed buffers such as rotary frequencies and position ids), else by its own
    ``reset_parameters``. Every other tensor carries transformers' ``_is_hf_initialized`` flag meanwhile, which
    its init functions respect, so loaded weights are never touched."""
    from transformers import initialization as hf_init

    pretrained = _hf_pretrained_class()
    work_ids = {id(g.tensor) for g in work.values()}
    flagged = []
    for gid, g in groups.items():
        if gid not in work and not hasattr(g.tensor, "_is_hf_initialized"):
            g.tensor._is_hf_initialized = True
            flagged.append(g.tensor)
    visited: set[int] = set()

    def direct(mod):
        return [(kind, attr, t) for kind in ("_parameters", "_buffers") for attr, t in getattr(mod, kind).items()
                if t is not None]

    def reset(mod, name) -> None:
        fn = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
        if fn is None:
            return
        keep = {(kind, attr): t.detach().clone() for kind, attr, t in direct(mod) if id(t) not in work_ids}
        with _seeded(seed, name):
            fn()
        for (kind, attr), saved in keep.items():
            getattr(mod, kind)[attr].copy_(saved)

    def visit(mod: nn.Module, name: str, owner) -> bool:
        if id(mod) in visited:
            return False
        visited.add(id(mod))
        owner = mod if isinstance(mod, pretrained) else owner
        needs = False
        for child_name, child in mod.named_children():
            needs |= visit(child, _join(name, child_name), owner)
        mine = [t for _, _, t in direct(mod) if id(t) in work_ids]
        if not (needs or mine):
            return False
        if owner is not None:
            with _seeded(seed, name):
                owner._init_weights(mod)
            if any(_still_sentinel(t) for t in mine):  # a module the family's _init_weights does not cover
                reset(mod, name)
        elif mine:
            reset(mod, name)
        return True

    try:
        with torch.no_grad(), hf_init.guard_torch_init_functions():
            visit(root, prefix, None)
    finally:
        for t in flagged:
            del t._is_hf_initialized
    for g in work.values():
        if _still_sentinel(g.tensor):
            raise ValueError(f"cannot initialise {g.names[0]!r} ({tuple(g.tensor.shape)}): no initialiser covers it "
                             "(neither the HF model's _init_weights nor a reset_parameters of its module); build this "
                             "part outside the meta device or load it from a folder")


def _working_copies(groups: dict[int, _Group], selected: list[int]) -> dict[int, _Group]:
    """Replace the selected tensors by CPU working tensors (filled with a sentinel) in their slots."""
    work = {}
    for gid in selected:
        g = groups[gid]
        t = torch.empty(g.tensor.shape, dtype=g.tensor.dtype, device="cpu")
        _sentinel_fill(t)
        w = _Group(_as_slot_value(g.tensor, t))
        w.names, w.slots = g.names, g.slots
        w.assign(w.tensor)
        work[gid] = w
    return work


def _init_work(root: nn.Module, groups: dict[int, _Group], selected: list[int], seed: int, prefix: str,
               device) -> None:
    """Initialise the selected tensors on CPU working copies, then give the original tensor objects those values
    (on ``device`` for tensors on meta, in place for the others). On an error the originals are left untouched."""
    work = _working_copies(groups, selected)
    try:
        _initialise(root, work, groups, seed, prefix)
    except BaseException:
        for gid in work:
            groups[gid].assign(groups[gid].tensor)
        raise
    for gid, w in work.items():
        g = groups[gid]
        g.assign(g.tensor)
        with torch.no_grad():
            value = w.tensor.detach()
            if _is_dtensor(g.tensor):
                value = _shard_like(g.tensor, value, device if g.tensor.is_meta else g.tensor.device)
                if g.tensor.is_meta:
                    _swap_in(g, value)
                else:
                    g.tensor.to_local().copy_(value.to_local())
            elif g.tensor.is_meta:
                _swap_in(g, value.to(device))
            else:
                g.tensor.copy_(value)


def init_parameters(module: nn.Module, seed: int | None = None, prefix: str = "") -> None:
    """(Re)initialise every parameter and buffer of ``module`` deterministically from ``seed`` and the names.

    ``prefix`` is the module's full name inside the model (``"encoders.vision.projector"``), so the values are the
    ones ``materialise`` gives the same module inside that model. ``seed`` defaults to ``torch.initial_seed()``.
    Tensors on meta are created on the CPU; the others keep their device and are overwritten in place."""
    seed = torch.initial_seed() if seed is None else seed
    groups = _groups(module, prefix)
    _init_work(module, groups, list(groups), seed, prefix, "cpu")


# ---------------------------------------------------------------------------------------------- materialise
def _sources(model: nn.Module) -> dict[str, tuple[PretrainedSource, str, str]]:
    """Full tensor name -> (source, file, key) for every module of ``model`` built from a folder."""
    out = {}
    for prefix, mod in model.named_modules():
        src = source_of(mod)
        if src is not None:
            for name, (file, key) in src.tensors.items():
                out[_join(prefix, name)] = (src, file, key)
            for name, fused in src.fused.items():
                out[_join(prefix, name)] = (src, fused, None)
    return out


def _raw_header(path: str) -> tuple[int, dict]:
    """(offset of the data buffer, the JSON header without ``__metadata__``) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise ModelFolderError(f"{path} is missing") from None
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path} is not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return 8 + size, header


def _read_into(f, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the file's bytes from ``offset`` (a plain read: no mapping, nothing cached in the process)."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(f.fileno(), [view[done:]], offset + done)
        else:
            f.seek(offset + done)
            n = f.readinto(view[done:])
        if not n:
            raise ModelFolderError(f"{f.name} ends early (truncated at byte {offset + done})")
        done += n


def _read_block(f, offset: int, dtype: torch.dtype, shape: list[int], region: tuple[slice, ...] | None):
    """The stored tensor at ``offset`` (``dtype``, ``shape``), or its block ``region``, read into a new CPU tensor
    of exactly that size: one read for a contiguous block, one per row of the last cut dimension otherwise."""
    region = region if region is not None else tuple(slice(0, n) for n in shape)
    out = torch.empty([r.stop - r.start for r in region], dtype=dtype)
    if out.numel() == 0:
        return out
    size = out.element_size()
    buf = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
    cut = [i for i, (r, n) in enumerate(zip(region, shape)) if (r.start, r.stop) != (0, n)]
    if not cut:
        _read_into(f, buf, offset)
        return out
    last = cut[-1]
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    run = (region[last].stop - region[last].start) * strides[last] * size  # contiguous bytes per row
    pos = 0
    for index in itertools.product(*(range(r.start, r.stop) for r in region[:last])):
        element = sum(i * s for i, s in zip(index, strides)) + region[last].start * strides[last]
        _read_into(f, buf[pos:pos + run], offset + element * size)
        pos += run
    return out


def _read_tensors(loads: list[tuple[_Group, PretrainedSource, str, str]], device) -> None:
    """Read each tensor of ``loads`` from its safetensors file straight into a new buffer of its final size (this
    rank's block of a sharded parameter) and give that buffer to the parameter: nothing is mapped and no second copy
    is made, so a rank holds its stage and nothing more (plus one tensor in transit when the target device or dtype
    differs from the file's)."""
    by_file: dict[str, list] = {}
    for g, src, file, key in loads:
        if isinstance(file, FusedTensor):
            _read_fused(g, src, file, device)
        else:
            by_file.setdefault(src.path(file), []).append((g, key))
    for path, items in by_file.items():
        if not os.path.isfile(path):
            raise ModelFolderError(f"{path} is missing (it holds {items[0][1]!r}); the folder changed after the model "
                                   "was built")
        start, header = _raw_header(path)
        shapes = {k: (v["dtype"], v["shape"]) for k, v in header.items()}
        for g, key in items:
            _check_tensor(path, key, shapes, g.names[0], tuple(g.tensor.shape))
        with open(path, "rb", buffering=0) as f:
            for g, key in items:
                value = _load_tensor(f, start, header, key, g.tensor, device)
                with torch.no_grad():
                    _swap_in(g, value)


def _read_fused(g: _Group, src: PretrainedSource, fused: FusedTensor, device) -> None:
    """Read the stored pieces of the experts this rank holds (all, or the block of ``stack_dim`` of its DTensor
    shard) and combine them as transformers does on load (stack the experts, then concatenate the pieces)."""
    target = g.tensor
    region = _local_slices(target) if _is_dtensor(target) else None
    experts = range(target.shape[fused.stack_dim])
    if region is not None and fused.stack_dim != fused.concat_dim:
        experts = range(region[fused.stack_dim].start, region[fused.stack_dim].stop)
    headers: dict[str, tuple[int, dict]] = {}
    stacks = []
    for part in fused.parts:
        pieces = []
        for file, key in (part[e] for e in experts):
            path = src.path(file)
            if path not in headers:
                if not os.path.isfile(path):
                    raise ModelFolderError(f"{path} is missing (it holds {key!r}); the folder changed after the "
                                           "model was built")
                headers[path] = _raw_header(path)
            start, header = headers[path]
            if key not in header:
                raise ModelFolderError(f"{path} has no tensor {key!r} (needed for {g.names[0]!r})")
            with open(path, "rb", buffering=0) as f:  # the file's dtype, cast to the parameter's like transformers
                piece = torch.empty(header[key]["shape"], dtype=target.dtype, device="meta")
                pieces.append(_load_tensor(f, start, header, key, piece, "cpu"))
        stacks.append(torch.stack(pieces, dim=fused.stack_dim))
    value = stacks[0] if fused.concat_dim is None else torch.cat(stacks, dim=fused.concat_dim)
    with torch.no_grad():
        if region is None:
            _swap_in(g, _shard_like(target, value, device) if _is_dtensor(target) else value.to(device))
            return
        block = tuple(slice(0, n) if d == fused.stack_dim and fused.stack_dim != fused.concat_dim else r
                      for d, (r, n) in enumerate(zip(region, value.shape)))
        _swap_in(g, _from_local(target, value[block].to(device=device, copy=True).contiguous()))


def _load_tensor(f, start: int, header: dict, key: str, target: torch.Tensor, device) -> torch.Tensor:
    """Stored tensor ``key`` of the open safetensors file ``f`` as the value of ``target`` (its dtype, on ``device``;
    for a DTensor, a DTensor laid out like it holding only this rank's block)."""
    entry = header[key]
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"]) if sys.byteorder == "little" else None  # files are little-endian
    if dtype is None:  # a dtype torch reads only through safetensors (float8, ...)
        return _load_with_safetensors(f.name, key, target, device)
    shape, offset = entry["shape"], start + entry["data_offsets"][0]
    if not _is_dtensor(target):
        return _read_block(f, offset, dtype, shape, None).to(device=device, dtype=target.dtype)
    region = _local_slices(target)
    if region is None:  # an interleaved layout: every rank reads the whole tensor and keeps its part
        return _shard_like(target, _read_block(f, offset, dtype, shape, None), device)
    return _from_local(target, _read_block(f, offset, dtype, shape, region).to(device=device, dtype=target.dtype))


def _load_with_safetensors(path: str, key: str, target: torch.Tensor, device) -> torch.Tensor:
    from safetensors import safe_open

    region = _local_slices(target) if _is_dtensor(target) else None
    with safe_open(path, framework="pt", device="cpu") as f:
        if region is not None:
            return _from_local(target, f.get_slice(key)[region].to(device=device, dtype=target.dtype))
        value = f.get_tensor(key)
        return _shard_like(target, value, device) if _is_dtensor(target) else \
            value.to(device=device, dtype=target.dtype, copy=True)


def materialise(model: nn.Module, device: torch.device | str, seed: int | None = None) -> None:
    """Create every parameter and buffer of ``model`` still on the meta device on ``device`` and fill it.

    A tensor of a part built from a folder (``load_encoder`` / ``load_language_model`` under meta) is read from its
    safetensors file, memory-mapped, one tensor at a time; every other one gets the deterministic initialisation of
    ``init_parameters`` with ``seed`` (default ``torch.initial_seed()``), drawn on the CPU. Tensors already off
    meta are left alone, tied weights stay tied, and parameter objects (with their ``requires_grad``) are kept.
    Works on a pipeline stage whose other modules ``prune`` replaced: only what is left is created and read. A
    parameter already sharded as a DTensor (FSDP2 ``fully_shard``, TP) gets only this rank's block: read with
    ``get_slice``, or cut from the CPU-drawn initial values, which therefore equal one process's."""
    seed = torch.initial_seed() if seed is None else seed
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("materialise needs a real device, got meta")
    groups = _groups(model)
    sources = _sources(model)
    loads, rest = [], []
    for gid, g in groups.items():
        if not g.tensor.is_meta:
            continue
        hit = next((sources[n] for n in g.names if n in sources), None)
        if hit is not None:
            loads.append((g, *hit))
        else:
            rest.append(gid)
    _read_tensors(loads, device)
    if rest:
        _init_work(model, groups, rest, seed, "", device)


# ---------------------------------------------------------------------------------------------- local folders
def read_safetensors_header(path: str) -> dict[str, tuple[str, list[int]]]:
    """``{key: (dtype, shape)}`` of a safetensors file, from its JSON header alone (no tensor is read)."""
    return {k: (v["dtype"], list(v["shape"])) for k, v in _raw_header(path)[1].items()}


def _check_tensor(path: str, key: str, header: dict, name: str, shape: tuple[int, ...]) -> None:
    if key not in header:
        raise ModelFolderError(f"{path} has no tensor {key!r} (needed for {name!r})")
    saved = tuple(header[key][1])
    if saved != tuple(shape):
        raise ModelFolderError(f"tensor {key!r} in {path} has shape {list(saved)} but {name!r} of the model built "
                               f"from the folder's {CONFIG_FILE} has shape {list(shape)}")


@dataclass
class _Folder:
    path: str
    config: object
    files: dict[str, str]                      # tensor key -> safetensors file name (relative)
    headers: dict[str, dict]                   # file name -> header


def _open_folder(path) -> _Folder:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"expected a folder path, got {type(path).__name__}")
    folder = os.path.abspath(os.fspath(path))
    if not os.path.isdir(folder):
        raise ModelFolderError(f"model folder {folder} does not exist (pass a folder written by save_pretrained; "
                               "nothing is downloaded)")
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ModelFolderError(f"{folder} has no {CONFIG_FILE}; pass a folder written by save_pretrained")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelFolderError(f"{config_path} cannot be read as a transformers config: {e}") from None
    index = os.path.join(folder, SAFETENSORS_INDEX)
    single = os.path.join(folder, SAFETENSORS_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = dict(json.load(f)["weight_map"])
        except (ValueError, KeyError) as e:
            raise ModelFolderError(f"{index} is not a safetensors index ({e})") from None
        for name in sorted(set(files.values())):
            if not os.path.isfile(os.path.join(folder, name)):
                key = next(k for k, v in files.items() if v == name)
                raise ModelFolderError(f"{os.path.join(folder, name)} is missing (listed in {index} for {key!r})")
    elif os.path.isfile(single):
        files = None
    else:
        other = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = (f" (it has {other[0]}: only safetensors weights are read; re-save the model with save_pretrained)"
                if other else "")
        raise ModelFolderError(f"{folder} has no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}{hint}")
    if files is None:
        header = read_safetensors_header(single)
        return _Folder(folder, config, {k: SAFETENSORS_FILE for k in header}, {SAFETENSORS_FILE: header})
    headers = {name: read_safetensors_header(os.path.join(folder, name)) for name in sorted(set(files.values()))}
    return _Folder(folder, config, files, headers)


def _describe(config) -> str:
    return f"model_type={getattr(config, 'model_type', None)!r}, architectures={getattr(config, 'architectures', None)}"


def _language_class(folder: _Folder):
    from lightning_mm.model.families import LANGUAGE_FAMILIES

    by_class = {f.class_name: f for f in LANGUAGE_FAMILIES.values()}
    archs = list(getattr(folder.config, "architectures", None) or [])
    fam = next((by_class[a] for a in archs if a in by_class), None) or \
        LANGUAGE_FAMILIES.get(getattr(folder.config, "model_type", None))
    if fam is None:
        raise ModelFolderError(
            f"{os.path.join(folder.path, CONFIG_FILE)} describes {_describe(folder.config)}, not a supported language "
            f"model; supported: {', '.join(by_class)} (model types {', '.join(LANGUAGE_FAMILIES)})")
    return fam.hf_class(), folder.config


def _encoder_class(folder: _Folder):
    from lightning_mm.model.families import ENCODER_FAMILIES

    config = folder.config
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    for fam in ENCODER_FAMILIES.values():
        if any(a in fam.class_names for a in archs) or model_type in fam.folder_model_types:
            sub = fam.folder_model_types.get(model_type)
            if any(a in fam.class_names for a in archs) or sub is None:
                return fam.hf_class(), config
            sub_config = getattr(config, sub, None)
            if sub_config is None:
                break
            return fam.hf_class(), sub_config
    supported = ", ".join(f"{f.class_names[0]} ({'/'.join(f.folder_model_types)})" for f in ENCODER_FAMILIES.values())
    raise ModelFolderError(f"{os.path.join(folder.path, CONFIG_FILE)} describes {_describe(config)}, not a supported "
                           f"encoder; supported: {supported} (a whole CLIP/SigLIP/Qwen2-VL/Qwen2-Audio/Whisper folder "
                           "gives its vision or audio tower)")


def _hf_renamer(module: nn.Module):
    """transformers' own checkpoint-key renaming for this class (what ``from_pretrained`` applies): ``key ->
    (our name, piece)``, where ``piece`` is None for a plain rename and ``(converter, j, expert)`` for piece ``j``
    (of the converter's source patterns) of ``expert`` of a tensor that a ``WeightConverter`` fuses."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key

    try:
        transforms = get_model_conversion_mapping(module)
    except Exception:  # noqa: BLE001  (no mapping for this class: keys are the module's names)
        transforms = []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = dict.fromkeys(module.state_dict())
    base = getattr(module, "base_model_prefix", None) or None

    def piece(key: str, pattern: str):
        conv = next(c for c in converters if pattern in c.source_patterns)
        found = re.search(pattern.replace("*.", r"(\d+)\."), apply_renamings(key, renamings))
        return conv, conv.source_patterns.index(pattern), int(found.group(1)) if found and found.groups() else None

    def rename(key: str):
        renamed, pattern = rename_source_key(key, renamings, converters, base, expected)
        if renamed not in expected and key in expected:
            return key, None
        return renamed, None if pattern is None else piece(key, pattern)

    return rename


def _tensor_map(module: nn.Module, folder: _Folder) -> tuple[dict[str, tuple[str, str]], str, dict[str, dict]]:
    """Our name -> (file, key) for every persistent tensor of ``module``, the key prefix dropped, and for each
    name that transformers builds from several stored tensors (experts), ``{"converter": ..., (j, expert): (file,
    key)}``."""
    groups = _groups(module)
    expected = [n for g in groups.values() if g.persistent for n in g.names]
    expected_set = set(expected)
    keys = list(folder.files)
    candidates = {""}
    for name in expected:
        for key in keys:
            if key.endswith("." + name):
                candidates.add(key[: len(key) - len(name)])
    rename = _hf_renamer(module)
    best = None
    for prefix in sorted(candidates, key=len):
        found, converted = {}, {}
        for key in keys:
            if not key.startswith(prefix):
                continue
            renamed, piece = rename(key[len(prefix):])
            if renamed in expected_set:
                if piece is not None:
                    conv, j, expert = piece
                    converted.setdefault(renamed, {"converter": conv})[(j, expert)] = (folder.files[key], key)
                else:
                    found[renamed] = (folder.files[key], key)
        if best is None or len(found) + len(converted) > len(best[0]) + len(best[2]):
            best = (found, prefix, converted)
    return best


def _fused_tensor(name: str, pieces: dict, shape: tuple[int, ...], folder: _Folder, where: str) -> FusedTensor:
    """The ``FusedTensor`` of parameter ``name`` (``shape``) from its stored pieces, after checking that the
    converter is one we reproduce (``MergeModulelist``, optionally then ``Concatenate``), that every expert's
    every piece is stored, and that the pieces combine to ``shape``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    conv = pieces.pop("converter")
    ops = list(conv.operations)
    if not (ops and type(ops[0]) is MergeModulelist and all(type(o) is Concatenate for o in ops[1:2])
            and len(ops) <= 2 and None not in {e for _, e in pieces}):
        raise ModelFolderError(
            f"{where}: {name!r} is stored in pieces combined by {ops} on load, which lazy (meta) loading does not "
            "reproduce (only stacking experts and concatenating their pieces); build this part eagerly")
    stack_dim, concat_dim = ops[0].dim, (ops[1].dim if len(ops) == 2 else None)
    experts = shape[stack_dim] if stack_dim < len(shape) else 0
    parts = [[pieces.get((j, e)) for e in range(experts)] for j in range(len(conv.source_patterns))]
    absent = next(((j, e) for j, part in enumerate(parts) for e, h in enumerate(part) if h is None), None)
    if absent is not None or len(pieces) != experts * len(parts):
        what = (f"expert {absent[1]} of {conv.source_patterns[absent[0]]!r} is missing" if absent else
                f"experts beyond {experts - 1} are stored")
        raise ModelFolderError(
            f"{where}: {name!r} of shape {list(shape)} needs pieces {conv.source_patterns} of experts 0..{experts - 1}"
            f" and the folder holds {len(pieces)} of them ({what}); the folder's weights do not match its "
            f"{CONFIG_FILE}")
    pieces_shape = [torch.Size(folder.headers[f][k][1]) for part in parts for f, k in part]
    stacked = [list(pieces_shape[0]) for _ in parts]
    for st in stacked:
        st.insert(stack_dim, experts)
    if concat_dim is not None:
        stacked[0][concat_dim] = sum(st[concat_dim] for st in stacked)
    if len(set(pieces_shape)) != 1 or tuple(stacked[0]) != tuple(shape) or (concat_dim is None and len(parts) > 1):
        raise ModelFolderError(f"{where}: the stored pieces of {name!r} (shapes {sorted(set(map(list, pieces_shape)))}"
                               f") do not combine to its shape {list(shape)} in the model built from the folder's "
                               f"{CONFIG_FILE}")
    return FusedTensor(parts, stack_dim, concat_dim)


def _ignorable(module: nn.Module, name: str) -> bool:
    patterns = getattr(module, "_keys_to_ignore_on_load_missing", None) or ()
    return any(re.search(p, name) for p in patterns)


def _build_from_folder(path, kind: str) -> nn.Module:
    folder = _open_folder(path)
    cls, config = _language_class(folder) if kind == "language model" else _encoder_class(folder)
    dtype = torch.get_default_dtype()
    with torch.device("meta"):
        module = cls(config)
    mapping, prefix, converted = _tensor_map(module, folder)
    on_meta = building_on_meta()
    missing = []
    groups = _groups(module)
    for g in groups.values():
        hit = next((mapping[n] for n in g.names if n in mapping), None)
        if hit is not None:  # tied weights: every name of the tensor reads the stored one (a stage may keep either)
            mapping.update(dict.fromkeys(g.names, hit))
        elif g.names[0] not in converted and g.persistent and not all(_ignorable(module, n) for n in g.names):
            missing.append(g.names[0])
    where = os.path.join(folder.path, SAFETENSORS_INDEX if len(folder.headers) > 1 or
                         SAFETENSORS_FILE not in folder.headers else SAFETENSORS_FILE)
    if converted and not missing and not on_meta and not prefix:
        # checkpoint tensors that transformers fuses on load: let it load them when loading eagerly
        return cls.from_pretrained(folder.path, config=config, dtype=dtype, local_files_only=True)
    if missing:
        expected_key = prefix + missing[0]
        raise ModelFolderError(
            f"{where} has no tensor {expected_key!r} for {cls.__name__} parameter {missing[0]!r} ({len(missing)} "
            f"missing in all); the folder's weights do not match its {CONFIG_FILE}")
    shapes = {n: tuple(g.tensor.shape) for g in groups.values() for n in g.names}
    fused = {n: _fused_tensor(n, pieces, shapes[n], folder, where) for n, pieces in converted.items()}
    for name, (file, key) in mapping.items():
        _check_tensor(os.path.join(folder.path, file), key, folder.headers[file], name, shapes[name])
    module.pretrained_source = PretrainedSource(folder.path, cls.__name__, mapping, prefix, fused)
    if not on_meta:
        materialise(module, torch.get_default_device())
    return module


def load_language_model(path) -> nn.Module:
    """The ``*ForCausalLM`` of a local folder written by ``save_pretrained`` (safetensors, single or sharded).

    The class comes from the config's ``architectures`` / ``model_type`` (Llama, Qwen2, Qwen3, Mistral, Gemma2,
    Phi3). Parameters take the default dtype (``torch.get_default_dtype()``, which Lightning's precision
    settings set inside ``init_module``). Under the meta device nothing is read (see the module docstring)."""
    return _build_from_folder(path, "language model")


def load_encoder(path) -> nn.Module:
    """The vision/audio tower of a local folder: a saved tower (``SiglipVisionModel``, ``WhisperEncoder`` ...) or
    the whole model it belongs to (``CLIPModel``, ``SiglipModel``, ``WhisperModel`` /
    ``WhisperForConditionalGeneration``, ``Qwen2VLForConditionalGeneration``, ``Qwen2AudioForConditionalGeneration``),
    whose other parts are not read."""
    return _build_from_folder(path, "encoder")


def source_of(module: nn.Module) -> PretrainedSource | None:
    """The ``PretrainedSource`` of a module built from a folder (None otherwise)."""
    src = module.__dict__.get("pretrained_source")
    return src if isinstance(src, PretrainedSource) else None


__all__ = ["ModelFolderError", "PretrainedSource", "init_seed", "init_parameters", "is_meta", "materialise",
           "load_language_model", "load_encoder", "read_safetensors_header", "building_on_meta", "source_of"]
