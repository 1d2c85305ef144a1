"""Replica groups of different layouts in one fault-tolerant job: per quorum, the groups publish which stage holds
each trainable parameter, and every holder reduces its buckets with the holders of the other groups.

torchft's Manager keeps the control plane (lighthouse, quorum, ``should_commit``, error reports). Its cross-group
process group pairs rank r of every group, which groups of different sizes cannot do, so the Manager gets a
process group that only records where each quorum's store is (``training.quorum_recorder`` over torchft's
``ProcessGroupDummy``), and the gradients travel over one torchft process group per bucket (``plan/layer_sync.py``,
``parallel/layerwise_reduce.py``) configured under that store.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_mm.fault_tolerance.config import FaultToleranceError
from lightning_mm.plan.layer_sync import GroupHoldings, LayerBucket, buckets_of, layer_buckets


def group_view(recorded: dict, group_world_size: int) -> dict:
    """Group rank 0's record of the quorum, on every rank of the group. torchft gives each group rank r the store of
    the quorum's participant r mod n (spreading the load); the group ranks 0 of all groups get the same one."""
    if group_world_size == 1:
        return recorded
    box = [recorded]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class QuorumSync:
    """One quorum's layer-wise sync on one rank: its buckets and their process groups."""

    quorum_id: int
    index: int  # this group's position in the quorum
    group_ids: list[int]  # the replica-group ids of the quorum, by position
    steps: list[int]  # each group's committed step when the quorum formed, by position
    templates: list[dict | None]  # each group's template (PipelineTemplate.to_dict), None without templates
    buckets: list[LayerBucket]
    process_groups: dict
    store: object  # the quorum's store (a PrefixStore of torchft's client)

    @property
    def behind(self) -> bool:
        return self.steps[self.index] < max(self.steps)


def holdings_doc(strategy, fingerprint: int) -> dict:
    """This group's holdings as plain data (gathered from every rank of the group): the trainable parameter names
    each stage's tp-0 holder owns, in the model's order, and each stage's holder ranks."""
    layout = strategy.layout
    module = strategy.lightning_module
    mine = [n for n, p in module.model.named_parameters() if p.requires_grad and n in strategy.engine.owned]
    everyone = [None] * strategy.world_size
    if strategy.world_size > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    stage_params = {s: everyone[layout.rank(s)] for s in layout.stages}
    holders = {s: [layout.rank(s, 0, 0, t) for t in range(layout.tp[s])] for s in layout.stages}
    ft = strategy.fault_tolerance
    template = ft.template(strategy.world_size).to_dict() if ft.templates else None
    return {"stage_params": stage_params, "holders": holders, "fingerprint": fingerprint, "template": template}


def group_holdings(doc: dict) -> tuple[GroupHoldings, list[str]]:
    """A published doc as :class:`GroupHoldings`, and its names in stage order (the model's order)."""
    stage_of, order = {}, []
    for stage, names in doc["stage_params"].items():
        for n in names:
            if n in stage_of:
                raise FaultToleranceError(
                    f"{n} is held by stages {stage_of[n]} and {stage} (input and output embeddings tied across "
                    "pipeline stages): layer-wise sync across layouts does not serve tied weights across stages yet; "
                    "untie them (tie_word_embeddings=False) or keep the embedding and the head on one stage")
            stage_of[n] = stage
            order.append(n)
    return GroupHoldings(stage_of, {s: tuple(r) for s, r in doc["holders"].items()}), order


def setup_quorum(recorded: dict, group_id: int, group_rank: int, doc: dict, step: int, timeout: timedelta,
                 make_process_group) -> QuorumSync:
    """Publish this group's doc (its rank 0), read every group's, check they train the same job, and configure
    the process groups of this rank's buckets. Every rank of every group of the quorum calls it alike."""
    from torchft.process_group import create_store_client

    qid, index, groups = recorded["quorum_id"], recorded["index"], recorded["groups"]
    store = create_store_client(f"{recorded['store']}/lmm/{qid}", timeout)
    if group_rank == 0:
        store.set(f"holdings/{index}", json.dumps({**doc, "group": group_id, "step": step}))
    docs = [json.loads(store.get(f"holdings/{i}")) for i in range(groups)]
    prints = {d["group"]: d["fingerprint"] for d in docs}
    if len(set(prints.values())) > 1:
        raise FaultToleranceError(
            f"replica group {group_id}: the replica groups of quorum {qid} differ in their model, frozen parts, "
            f"tensor parallelism, sharding, global batch or data order (fingerprints by group: {prints}); groups may "
            "differ only in pipeline stages, context and data parallelism and encoder placement")
    holdings = [group_holdings(d) for d in docs]
    buckets = layer_buckets([h for h, _ in holdings], holdings[0][1])
    from lightning_mm.parallel.layerwise_reduce import bucket_process_groups

    pgs = bucket_process_groups(buckets, index, group_rank,
                                lambda i, t, pos, size: make_process_group(
                                    f"{recorded['store']}/lmm/{qid}/h{i}_{t}", recorded["replica_id"], pos, size))
    return QuorumSync(qid, index, [d["group"] for d in docs], [d["step"] for d in docs],
                      [d["template"] for d in docs], buckets, pgs, store)


def template_shares(templates: list[dict], num_samples: int, rows_per_microbatch: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` sample slices of a step's global batch, one per group in quorum order, by
    Oobleck's Eq. 2.6 as ``plan.templates.split_batch`` solves it: whole microbatches, every group at least one,
    the slowest group's planned step time as short as it can be. Samples past the last whole microbatch go one
    each to the groups in order (the global batch never changes)."""
    from lightning_mm.plan.templates import PipelineTemplate, split_batch

    groups = [PipelineTemplate.from_dict(t) for t in templates]
    try:
        counts = split_batch(groups, num_samples // rows_per_microbatch)
    except ValueError as e:
        raise FaultToleranceError(f"a step's global batch of {num_samples} samples in microbatches of "
                                  f"{rows_per_microbatch}: {e}") from None
    sizes = [c * rows_per_microbatch for c in counts]
    for i in range(num_samples - sum(sizes)):
        sizes[i % len(sizes)] += 1
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


def release(sync: QuorumSync) -> None:
    """Drop a past quorum's process groups (their peers may be gone: aborted, not waited on)."""
    for pg in sync.process_groups.values():
        try:
            pg.abort(errored=False)
        except Exception:  # noqa: BLE001  (a group whose peer died may fail to abort; it is dropped either way)
            pass
    sync.process_groups.clear()


def _state_manifest(optimizer, params: list[torch.nn.Parameter]) -> list[list]:
    """Per parameter, its optimiser state as ``[key, shape, dtype]`` (tensors) or ``[key, value]`` (plain values)."""
    out = []
    for p in params:
        entries = []
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                entries.append([key, list(value.shape), str(value.dtype).removeprefix("torch.")])
            else:
                entries.append([key, value])
        out.append(entries)
    return out


def _pack_state(params, optimizer, manifest, sending: bool, device) -> torch.Tensor:
    """Parameters and their optimiser state as one float64 vector on the parameters' device (zeros of the
    manifest's sizes when receiving); state the optimiser keeps on the host (AdamW's ``step``) is copied over."""
    pieces = []
    for p, entries in zip(params, manifest):
        pieces.append(p.detach().reshape(-1).to(torch.float64))
        state = optimizer.state.get(p, {})
        for entry in entries:
            if len(entry) == 3:
                pieces.append(state[entry[0]].reshape(-1).to(p.device, torch.float64) if sending else
                              torch.zeros(math.prod(entry[1]), dtype=torch.float64, device=p.device))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64, device=device)


def _state_device(optimizer, p: torch.nn.Parameter, key: str) -> torch.device:
    """Where ``optimizer`` keeps ``p``'s state ``key``: as ``Optimizer.load_state_dict`` places it, a ``step`` on
    the host unless the group is fused or capturable (a device ``step`` costs a host read per parameter and step)."""
    if key != "step":
        return p.device
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
    return p.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def _unpack_state(flat: torch.Tensor, params, optimizer, manifest) -> None:
    at = 0
    with torch.no_grad():
        for p, entries in zip(params, manifest):
            n = p.numel()
            p.copy_(flat[at:at + n].view_as(p))
            at += n
            state = {}
            for entry in entries:
                if len(entry) == 3:
                    k = math.prod(entry[1])
                    state[entry[0]] = flat[at:at + k].view(entry[1]).to(_state_device(optimizer, p, entry[0]),
                                                                         getattr(torch, entry[2]))
                    at += k
                else:
                    state[entry[0]] = entry[1]
            if state:
                optimizer.state[p] = state


def copy_to_stage_copies(params: dict[str, torch.nn.Parameter], holder: int, group, *, optimizer=None,
                         device=None) -> None:
    """From a stage's holder rank to its data- and context-parallel copies inside the group (``group``: the stage's
    gradient group): the synced gradients (``optimizer=None``) or, after healing, the parameters and their
    optimiser state."""
    ps = [params[n] for n in sorted(params)]
    if optimizer is None:
        device = ps[0].device if ps else device  # a stage with nothing trainable still joins its group's broadcast
        flat = torch.cat([p.grad.reshape(-1).float() if p.grad is not None else torch.zeros(p.numel(), device=device)
                          for p in ps] + [torch.tensor([float(p.grad is not None) for p in ps], device=device)])
        dist.broadcast(flat, src=holder, group=group)
        used, at = flat[-len(ps):].tolist() if ps else [], 0  # one host read
        for p, u in zip(ps, used):
            n = p.numel()
            if u:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[at:at + n].view_as(p))
            else:
                p.grad = None
            at += n
        return
    box = [_state_manifest(optimizer, ps) if dist.get_rank() == holder else None]
    dist.broadcast_object_list(box, src=holder, group=group)
    flat = _pack_state(ps, optimizer, box[0], dist.get_rank() == holder, device)
    dist.broadcast(flat, src=holder, group=group)
    if dist.get_rank() != holder:
        _unpack_state(flat, ps, optimizer, box[0])


def heal_by_name(sync: QuorumSync, group_rank: int, params: dict[str, torch.nn.Parameter], optimizer,
                 schedulers: list, device: torch.device) -> int | None:
    """Bring the groups behind the quorum's newest step up to it, layer by layer, by name.

    For every bucket, one up-to-date group (round-robin over the buckets) broadcasts the parameters and their
    optimiser state over the bucket's process group; a manifest of the state's keys and shapes travels on the
    quorum's store, so a restarted group without any optimiser state can receive it. The optimiser's
    hyperparameters, the schedulers and the step come from an up-to-date group's rank 0 as JSON. Frozen
    parameters are never sent (a restarted group rebuilds them as every group does). Every member of the quorum
    calls it when any group is behind. Returns the step healed to on a group that was behind, else None.
    """
    newest = max(sync.steps)
    sources = [g for g, s in enumerate(sync.steps) if s == newest]
    prefix = f"heal/{newest}"
    if sync.steps[sync.index] == newest and sync.index == sources[0] and group_rank == 0:
        meta = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                "schedulers": [sch.state_dict() for sch in schedulers]}
        sync.store.set(f"{prefix}/meta", json.dumps(meta))
    for i, bucket, t, pos in buckets_of(sync.buckets, sync.index, group_rank):
        src = sources[i % len(sources)]  # members are in group order: the source's position is its group index
        ps = [params[n] for n in bucket.names]
        key = f"{prefix}/b{i}_{t}"
        if sync.index == src:
            sync.store.set(key, json.dumps(_state_manifest(optimizer, ps)))
        manifest = json.loads(sync.store.get(key))
        flat = _pack_state(ps, optimizer, manifest, sync.index == src, device)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        sync.process_groups[i].broadcast([flat], opts).wait()
        if sync.behind:
            _unpack_state(flat, ps, optimizer, manifest)
    if not sync.behind:
        return None
    meta = json.loads(sync.store.get(f"{prefix}/meta"))
    for group, values in zip(optimizer.param_groups, meta["param_groups"]):
        group.update(values)
    for sch, state in zip(schedulers, meta["schedulers"]):
        sch.load_state_dict(state)
    return newest


def check_servable(strategy) -> None:
    """What layer-wise sync across different layouts does not serve yet, named before training."""
    layout, reasons = strategy.layout, []
    if any(t > 1 for t in layout.tp.values()):
        reasons.append(f"tensor parallelism inside a group ({layout.tp}): layer-wise sync and healing by name are "
                       "tested on whole parameters only; use tp 1")
    if strategy.sharding_strategy not in (None, "NO_SHARD"):
        reasons.append(f"sharding_strategy={strategy.sharding_strategy!r} (sharded parameters are not keyed by name "
                       "across layouts; use NO_SHARD)")
    if reasons:
        raise FaultToleranceError("fault_tolerance with global_batch (replica groups of different layouts) cannot "
                                  "serve this run: " + "; ".join(reasons))


def weighted_params(strategy) -> dict[str, torch.nn.Parameter]:
    module = strategy.lightning_module
    return {n: p for n, p in module.model.named_parameters() if p.requires_grad and n in strategy.engine.owned}


__all__ = ["QuorumSync", "check_servable", "copy_to_stage_copies", "group_holdings", "group_view", "heal_by_name",
           "holdings_doc", "release", "setup_quorum", "template_shares", "weighted_params"]
