"""Sharded checkpoints (torch.distributed.checkpoint) keyed by the unparallelised model's names.

A checkpoint is a folder::

    .metadata, __<rank>_0.distcp   DCP: tensors only, deduplicated over replicas
        model/<name>                   a parameter of ``MultimodalModel`` (trainable; frozen ones only if asked)
        optim/<i>/<name>/<key>         optimiser ``i``'s state of that parameter (``<key>#int|#float|#bool`` for
                                       Python scalars), so it reshards: any layout finds its parameters by name
        rng/<rank>/<torch|python|numpy...>  every rank's random state
    meta.pt                        Lightning's loop / scheduler / callback state and the optimisers' param-group
                                   hyperparameters: plain data, read with ``weights_only=True``
    layout.json                    format, writing layout, the model's parameter names and shapes, trainable
                                   names, and a size + CRC32 manifest of every file

Nothing pickled runs on load: DCP's ``.metadata`` is read by an unpickler that only builds DCP's own metadata
classes, byte (pickled-object) entries are refused, and ``meta.pt`` is loaded with ``weights_only=True``. A save
is atomic: everything is written to ``<path>.tmp`` and renamed once complete, so a crash mid-save leaves the
previous checkpoint intact.

``MultimodalParallelStrategy`` saves and loads through :func:`save_checkpoint` and :func:`load_checkpoint`.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist

from lightning_mm.plan.layout import RankLayout

FORMAT = "lightning-mm-dcp/1"
LAYOUT_FILE = "layout.json"
META_FILE = "meta.pt"
DCP_METADATA = ".metadata"
SCALAR_TAGS = {"int": int, "float": float, "bool": bool}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupt, or written for another model."""


# ---------------------------------------------------------------------------------------------- safe reading
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in
    ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
     "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "Path"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def read_dcp_metadata(path: str):
    """DCP's ``.metadata`` without executing pickled code (only DCP's metadata classes are built)."""
    file = os.path.join(path, DCP_METADATA)
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {DCP_METADATA}: not a complete lightning-mm checkpoint (an "
                              "interrupted save leaves only <path>.tmp; load the previous checkpoint)") from None
    except Exception as e:  # noqa: BLE001  (any decoding failure means the file is damaged or foreign)
        raise CheckpointError(f"{file} is corrupt or not a DCP metadata file ({type(e).__name__}: {e}); "
                              "load an earlier checkpoint") from None


def _safe_reader_and_planner(path: str):
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_dcp_metadata(path)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class TensorsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; lightning-mm "
                                  "checkpoints hold tensors only and never unpickle objects")

    return SafeReader(path), TensorsOnlyPlanner()


def _crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_manifest(path: str) -> dict[str, list[int]]:
    """``{file: [size, crc32]}`` of every file of a checkpoint folder except layout.json."""
    return {f: [os.path.getsize(os.path.join(path, f)), _crc32(os.path.join(path, f))]
            for f in sorted(os.listdir(path)) if f != LAYOUT_FILE}


# ---------------------------------------------------------------------------------------------- model identity
def model_fingerprint(model) -> dict[str, list[int]]:
    """Every parameter name of the unparallelised model with its shape (taken before pipeline pruning)."""
    return {n: list(p.shape) for n, p in model.named_parameters()}


def check_same_model(saved: dict[str, list[int]], current: dict[str, list[int]], path: str) -> None:
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    shapes = [f"{n}: checkpoint {saved[n]} vs model {current[n]}" for n in sorted(set(saved) & set(current))
              if saved[n] != current[n]]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameters of the model are not in it (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} of its parameters are not in the model (e.g. {unexpected[0]})")
        if shapes:
            parts.append(f"{len(shapes)} shapes differ (e.g. {shapes[0]})")
        raise CheckpointError(f"checkpoint {path} was written for another model: {'; '.join(parts)}. Build the "
                              "model it was trained with (same encoders, language model and configs)")


# ---------------------------------------------------------------------------------------------- state to tensors
def parameter_names(model) -> dict[int, str]:
    """``{id(parameter): name}`` over ``model``: optimiser state is saved and matched by parameter name."""
    return {id(p): n for n, p in model.named_parameters()}


def stage_state_dict(model, *, owned: set[str], frozen: bool) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` that this rank's stage holds (``owned`` names), trainable ones and frozen ones
    if ``frozen``, keyed ``model.<name>`` as in Lightning's ``state_dict``."""
    return {f"model.{n}": p.detach() for n, p in model.named_parameters()
            if n in owned and (p.requires_grad or frozen)}


def optimizer_state_by_name(optimizer, names: dict[int, str]) -> dict:
    """``{"state": {param name: {key: value}}, "param_groups": [hyperparameters]}`` (parameters by NAME)."""
    sd = optimizer.state_dict()
    index_to_name = {}
    for live, saved in zip(optimizer.param_groups, sd["param_groups"]):
        for p, idx in zip(live["params"], saved["params"]):
            index_to_name[idx] = names.get(id(p))
    state = {index_to_name[i]: s for i, s in sd["state"].items() if index_to_name.get(i) is not None}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def optimizer_tensors(index: int, by_name: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, state in by_name["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{index}/{name}/{key}"] = value
            elif isinstance(value, (bool, int, float)):
                tag = type(value).__name__
                out[f"optim/{index}/{name}/{key}#{tag}"] = torch.tensor(value, dtype=torch.float64)
            elif value is not None:
                raise TypeError(f"optimiser state {key!r} of {name} is a {type(value).__name__}; only tensors and "
                                "numbers can be checkpointed")
    return out


def rng_tensors(rank: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This rank's torch / Python / NumPy random state as tensors, and its accelerator's (dropout on a GPU draws
    from the device's generator) when ``device`` is one."""
    import numpy as np

    version, words, gauss = random.getstate()
    out = {f"rng/{rank}/torch": torch.get_rng_state(),
           f"rng/{rank}/python": torch.tensor([version, *words], dtype=torch.int64),
           f"rng/{rank}/python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64)}
    _, keys, pos, has_gauss, cached = np.random.get_state()
    out[f"rng/{rank}/numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64)
    out[f"rng/{rank}/numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    if device is not None and device.type != "cpu":
        out[f"rng/{rank}/{device.type}"] = torch.get_device_module(device.type).get_rng_state(device)
    return out


def set_rng_tensors(rank: int, t: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    import numpy as np

    torch.set_rng_state(t[f"rng/{rank}/torch"])
    if device is not None and f"rng/{rank}/{device.type}" in t:
        torch.get_device_module(device.type).set_rng_state(t[f"rng/{rank}/{device.type}"], device)
    py, (has, gauss) = t[f"rng/{rank}/python"].tolist(), t[f"rng/{rank}/python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), gauss if has else None))
    npy = t[f"rng/{rank}/numpy"].tolist()
    np.random.set_state(("MT19937", np.array(npy[:-2], dtype=np.uint32), npy[-2], npy[-1],
                         float(t[f"rng/{rank}/numpy_gauss"][0])))


def plain(obj, where: str = "checkpoint"):
    """``obj`` as data ``torch.load(weights_only=True)`` reads back: dicts, lists, tuples, numbers, strings, tensors.

    Other objects (e.g. hyperparameters holding a model) become their ``repr``: kept readable, never unpickled."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)):
        return obj
    if isinstance(obj, dict):
        return {k if isinstance(k, (str, int, float, bool)) else repr(k): plain(v, where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [plain(v, where) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return repr(obj)


# ---------------------------------------------------------------------------------------------- save
def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_sharded(path: str, tensors: dict[str, torch.Tensor], meta: dict, layout: dict, rank: int) -> None:
    """Collective: every rank passes its tensors; rank 0 also writes ``meta`` and ``layout``. Atomic."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isfile(path):
            os.remove(path)
    _barrier()
    distributed = dist.is_available() and dist.is_initialized()
    dcp_save(tensors, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
             no_dist=not distributed)
    _barrier()  # every rank's data file is complete before rank 0 seals the folder
    if rank == 0:
        torch.save(meta, os.path.join(tmp, META_FILE))
        layout = {**layout, "format": FORMAT, "files": file_manifest(tmp)}
        with open(os.path.join(tmp, LAYOUT_FILE), "w") as f:
            json.dump(layout, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def save_checkpoint(path: str, checkpoint: dict, *, rank: int, layout: dict,
                    device: torch.device | None = None) -> None:
    """Collective: Lightning's ``checkpoint`` as the folder ``path`` (atomically, ``save_sharded``): its
    ``state_dict`` (popped), ``optimizer_states`` (popped; by parameter name) and this rank's random state as
    tensors, the rest as plain data in meta.pt. ``layout``: the run's record for layout.json (rank layout,
    ``world_size``, the model's ``parameters``, ``trainable`` names, ``frozen_saved``); ``device``: the rank's device
    (an accelerator's random state is saved too)."""
    tensors = {f"model/{k.removeprefix('model.')}": v for k, v in checkpoint.pop("state_dict").items()}
    groups = []
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors.update(optimizer_tensors(i, state))
        groups.append(state["param_groups"])
    tensors.update(rng_tensors(rank, device))
    meta = plain({**checkpoint, "optimizer_param_groups": groups})
    save_sharded(path, tensors, meta, layout, rank)


# ---------------------------------------------------------------------------------------------- load
def load_checkpoint(path: str, *, model, owned: set[str], optimizers, rank: int, layout: dict,
                    device: torch.device | None = None) -> dict:
    """Collective: the parameters of ``model`` that this rank's stage holds (``owned`` names), the
    ``optimizers``' state by parameter name and, when ``path`` was written by the same rank layout, this rank's
    random state; returns the rest of Lightning's checkpoint. ``layout``: this run's record, as
    :func:`save_checkpoint` writes it (its ``parameters`` must be the checkpoint's model).

    Every check (folder, format, sizes, model identity, checksums of the files this rank reads) runs on every rank
    before the collective DCP read, so a bad checkpoint raises everywhere instead of hanging."""
    saved = read_layout(path)
    check_same_model(saved["parameters"], layout["parameters"], path)
    md = read_dcp_metadata(path)
    names = parameter_names(model)
    target, missing = {}, []
    for n, p in model.named_parameters():
        if n not in owned:
            continue
        if f"model/{n}" in md.state_dict_metadata:
            target[f"model/{n}"] = p.detach()
        elif p.requires_grad:
            missing.append(n)
    if missing and rank == 0:
        warnings.warn(f"{len(missing)} trainable parameters (e.g. {missing[0]}) are not in {path}; they keep the "
                      "values the model was built with", stacklevel=2)
    target.update(optimizer_targets(md, optimizers, names))
    same_ranks = saved["world_size"] == layout["world_size"] and \
        RankLayout.from_dict(saved) == RankLayout.from_dict(layout)
    rng = {k: empty_like_entry(md, k) for k in md.state_dict_metadata
           if same_ranks and k.startswith(f"rng/{rank}/")}
    if not same_ranks and rank == 0:
        warnings.warn(f"{path} was written by another rank layout: random states are not restored", stacklevel=2)
    target.update(rng)
    verify_files(path, saved, files_for_keys(md, set(target)))
    meta = load_meta(path)
    load_tensors(path, target)
    groups = meta.pop("optimizer_param_groups", [])
    for i, opt in enumerate(optimizers):
        load_optimizer_by_name(opt, i, names, target, groups[i] if i < len(groups) else None)
    if rng:
        set_rng_tensors(rank, rng, device)
    return meta


def read_layout(path: str) -> dict:
    """``layout.json`` of a checkpoint, checked for format and file sizes (cheap; every rank runs it alike)."""
    if not os.path.isdir(path):
        hint = " (a .tmp folder beside it is an interrupted save)" if os.path.isdir(str(path) + ".tmp") else ""
        raise CheckpointError(f"checkpoint {path} does not exist or is not a lightning-mm checkpoint folder{hint}")
    file = os.path.join(path, LAYOUT_FILE)
    try:
        with open(file) as f:
            layout = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {LAYOUT_FILE}: not a lightning-mm checkpoint (or an incomplete "
                              "one); load an earlier checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is corrupt ({e}); load an earlier checkpoint") from None
    if layout.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {layout.get('format')!r}, expected {FORMAT!r}")
    for name, (size, _) in layout["files"].items():
        full = os.path.join(path, name)
        if not os.path.exists(full) or os.path.getsize(full) != size:
            raise CheckpointError(f"checkpoint file {full} is missing or truncated (expected {size} bytes); the "
                                  "checkpoint is corrupt: load an earlier one")
    return layout


def verify_files(path: str, layout: dict, files: set[str]) -> None:
    """CRC32 of the named files against the manifest (each rank checks the files it will read)."""
    for name in sorted(files):
        size, crc = layout["files"][name]
        if _crc32(os.path.join(path, name)) != crc:
            raise CheckpointError(f"checkpoint file {os.path.join(path, name)} is corrupt (CRC32 mismatch); load an "
                                  "earlier checkpoint")


def files_for_keys(metadata, keys: set[str]) -> set[str]:
    return {info.relative_path for idx, info in metadata.storage_data.items() if idx.fqn in keys}


def empty_like_entry(metadata, key: str) -> torch.Tensor:
    md = metadata.state_dict_metadata[key]
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def load_tensors(path: str, target: dict[str, torch.Tensor], collective: bool = True) -> None:
    """Fill ``target``'s tensors in place: collectively when a process group exists and ``collective``, else in
    this process alone (``consolidate`` on one rank while the others go on)."""
    from torch.distributed.checkpoint import load as dcp_load

    reader, planner = _safe_reader_and_planner(path)
    distributed = collective and dist.is_available() and dist.is_initialized()
    dcp_load(target, storage_reader=reader, planner=planner, no_dist=not distributed)


def load_meta(path: str) -> dict:
    try:
        return torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{os.path.join(path, META_FILE)} is corrupt or holds objects other than plain data "
                              f"({type(e).__name__}: {e}); load an earlier checkpoint") from None


def optimizer_targets(metadata, optimizers, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """Empty tensors for the saved optimiser entries of the parameters these optimisers hold, matched by name
    (``optim/<optimizer index>/<parameter name>/<state key>``), so a stage loads only its own state."""
    by_param: dict[tuple[int, str], list[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith("optim/"):
            i, rest = key[len("optim/"):].split("/", 1)
            by_param.setdefault((int(i), rest.rsplit("/", 1)[0]), []).append(key)
    return {key: _state_target(metadata, key, p)
            for i, opt in enumerate(optimizers) for group in opt.param_groups for p in group["params"]
            for key in by_param.get((i, names.get(id(p))), [])}


def _state_target(metadata, key: str, param: torch.Tensor) -> torch.Tensor:
    """Where one saved optimiser tensor is read to: laid out like its parameter when it has the parameter's shape
    and the parameter is a DTensor (tensor-parallel or FSDP shards: DCP reads just this rank's piece)."""
    from torch.distributed.tensor import DTensor

    md = metadata.state_dict_metadata[key]
    if isinstance(param, DTensor) and tuple(md.size) == tuple(param.shape):
        return torch.empty_like(param.detach(), dtype=md.properties.dtype)
    return empty_like_entry(metadata, key)


def load_optimizer_by_name(optimizer, index: int, names: dict[int, str], loaded: dict[str, torch.Tensor],
                           groups: list[dict] | None) -> None:
    """Load optimiser ``index``'s state from name-keyed entries into this rank's (differently indexed) optimiser."""
    sd = optimizer.state_dict()
    prefix = f"optim/{index}/"
    by_name: dict[str, dict] = {}
    for key, value in loaded.items():
        if not key.startswith(prefix):
            continue
        name, skey = key[len(prefix):].rsplit("/", 1)
        if "#" in skey:
            skey, tag = skey.split("#")
            value = SCALAR_TAGS[tag](value.item())
        by_name.setdefault(name, {})[skey] = value
    state = {}
    for live, saved in zip(optimizer.param_groups, sd["param_groups"]):
        for p, idx in zip(live["params"], saved["params"]):
            name = names.get(id(p))
            if name in by_name:
                state[idx] = by_name[name]
    sd["state"] = state
    for g, hyper in zip(sd["param_groups"], groups or []):
        g.update({k: v for k, v in hyper.items() if k != "params"})
    optimizer.load_state_dict(sd)


# ---------------------------------------------------------------------------------------------- offline use
def consolidate(path: str, trainable_only: bool = True) -> dict[str, torch.Tensor]:
    """The parameters stored in a checkpoint under the unparallelised ``MultimodalModel``'s names (one process).

    ``trainable_only`` keeps the parameters that were trainable when it was written."""
    layout = read_layout(path)
    md = read_dcp_metadata(path)
    keys = {k for k in md.state_dict_metadata if k.startswith("model/")}
    if trainable_only:
        keys &= {f"model/{n}" for n in layout["trainable"]}
    verify_files(path, layout, files_for_keys(md, keys))
    target = {k: empty_like_entry(md, k) for k in keys}
    load_tensors(path, target, collective=False)  # one process: callable on rank 0 with the process group alive
    return {k.removeprefix("model/"): v for k, v in target.items()}


def load_weights(path: str, model) -> list[str]:
    """Copy a checkpoint's parameters into a whole (unpruned) ``model``; returns the names loaded."""
    check_same_model(read_layout(path)["parameters"], model_fingerprint(model), path)
    weights = consolidate(path, trainable_only=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    return sorted(weights)


def export_hf(path: str | None, model, out_dir: str) -> dict:
    """Write ``model`` with a checkpoint's weights (``path``; None: as it is) as HF folders, one per part, that
    ``from_pretrained`` loads (``lightning_mm.model.hf_parts.save_parts``: ``out_dir/encoders/<name>``,
    ``out_dir/projectors/<name>``, ``out_dir/language_model``, ``out_dir/lightning_mm.json``); returns the
    manifest. ``model.save_pretrained`` writes a model from a composite folder as that composite instead."""
    from lightning_mm.model.hf_parts import save_parts

    if path is not None:
        load_weights(path, model)
    return save_parts(model, out_dir)


def load_hf(out_dir: str):
    """The ``MultimodalModel`` of an ``export_hf`` folder (each part through ``from_pretrained``); the same as
    ``MultimodalModel.from_pretrained(out_dir)``."""
    from lightning_mm.model import MultimodalModel
    from lightning_mm.model.hf_parts import load_parts

    return load_parts(MultimodalModel, out_dir)
