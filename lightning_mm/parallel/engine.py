"""The pipeline runtime: executes this rank's action list of the multimodal 1F1B schedule.

Every rank of a replica sees the same batch (the sampler runs over replicas), so anything derivable from the
batch (encoder contexts, mask words, positions, labels) is recomputed where it is needed and only hidden
states and features travel between stages. Under per-module data parallelism every rank of a group of replicas
sees the group's batch, and features and their gradients travel between replicas of different modules as the
batch's routing says (``plan/routing.py``). Frozen-aware: a stage with nothing trainable in or upstream of it
runs forward under ``no_grad`` and takes no part in backward; a frozen stage with trainable parameters upstream
computes input gradients only (autograd builds no weight-gradient graph for frozen parameters). With
``activation_checkpointing`` every encoder and LLM layer that records autograd keeps only its input and runs its
forward again in backward (the planner costs this as B += F, memory as the layer inputs only).

Communication (``comm.py``) is grouped per run of consecutive send/receive actions; gradient reduction over
replicas (``grads.py``) overlaps the step's last backward. A stage with tp > 1 is split with DTensor
(``tensor_parallel.py``), one with ``sharding_strategy`` other than NO_SHARD is sharded over its dp x cp ranks
with FSDP2 (``sharding.py``, which then reduces its gradients). Every tensor the engine makes lives on ``device``.

Context-parallel plans (encoder item shards, LLM block owners) are host data made by the data loader
(``data/cp_plans.py``); the step only executes them, and plans with the same functions itself (reading the sizes
and mask words to the host) only for a batch that carries none.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from lightning_mm import loss as losses
from lightning_mm.data.cp_plans import CPPlans, EncoderItems, GroupRouter, batch_plans
from lightning_mm.data.microbatch import PLAN_KEY, deferrals, microbatch_rows, split_microbatches
from lightning_mm.model import moe
from lightning_mm.parallel.comm import StageComm, carries_device_tensors
from lightning_mm.parallel.context import distribute, pad_for_context_parallel, token_index
from lightning_mm.parallel.encoder_cp import gather_items
from lightning_mm.parallel.expert_parallel import ExpertGroups, apply_ep, check_expert_parallel
from lightning_mm.parallel.grads import GradientReducer, all_reduce_grads, clip_, global_grad_norm
from lightning_mm.parallel.router_metrics import ROUTER_KEY, StepRouterMetrics
from lightning_mm.parallel.sharding import apply_fsdp
from lightning_mm.parallel.pruning import owned_parameters, prune, tied_embedding_stages
from lightning_mm.parallel.tensor_parallel import apply_tp, keep_grads_like_parameters
from lightning_mm.plan.items import gather_order
from lightning_mm.plan.layout import RankLayout
from lightning_mm.plan.routing import Routing, expand_replicas
from lightning_mm.plan.schedule import (LANGUAGE_MODEL, build_stage_graph, check_rendezvous, check_schedule,
                                        communication_groups, one_f_one_b)
from lightning_mm.plan.stages import StagePlan, stage_plans, uniform_partition


MESH_DIMS = ("dp", "pp", "cp", "tp")
ITEMS_KEY = "cp_items"  # in a microbatch: {encoder: (item indices per CP rank, LLM tokens per item)}
DEEPSTACK_KEY = "deepstack."  # + modality: DeepStack features an LLM stage passes to the next (Qwen3-VL)


class BlockOwners:
    """What LLM CP plans with, in the data loader (``data/cp_plans.py``) and in the step alike: ``owner(mb)`` is the
    CP rank of every block of the microbatch, padded to whole blocks first exactly as the step pads it, by
    ``distribute`` with this method, block size and Ulysses degree. Picklable (loader workers). ``windows``: the
    LLM's sliding window per layer (``families.layer_windows``; None when no layer has one), so LPT balances the
    work each layer really does; every stage passes all layers' windows, so every stage plans alike."""

    def __init__(self, cp: int, method: str = "lpt", block_size: int = 128, ulysses: int = 1,
                 windows: tuple | None = None):
        self.cp, self.method, self.block_size, self.ulysses = cp, method, block_size, ulysses
        self.windows = windows

    def num_blocks(self, seq_len: int) -> int:
        """Blocks of a sequence of ``seq_len`` tokens after ``pad_for_context_parallel``."""
        return max(-(-seq_len // self.block_size), self.cp)

    def owner(self, mb: dict) -> torch.Tensor:
        """``[num_blocks]`` int64 on the host (reads ``bam`` and ``segment_ids``: a host read where they are on a
        device)."""
        mb = pad_for_context_parallel(mb, self.cp, self.block_size)  # a no-op on the step's padded microbatches
        plan = distribute(mb["bam"], self.cp, self.method, self.block_size, mb.get("segment_ids"),
                          ulysses=self.ulysses, window=self.windows)
        owner = torch.empty(sum(len(p) for p in plan), dtype=torch.long)
        for r, blocks in enumerate(plan):
            owner[blocks] = r
        return owner


def _llm_windows(model) -> tuple | None:
    """The sliding window of every LLM layer (from the config: the same on every stage), None without any."""
    from lightning_mm.model.families import layer_windows

    windows = tuple(layer_windows(model.language_model))
    return windows if any(w is not None for w in windows) else None


def module_meshes(layout: RankLayout, device_type: str) -> dict[str, DeviceMesh]:
    """One ``DeviceMesh`` per module chain with named dims ("dp", "pp", "cp", "tp"), created in the same order on
    every rank (the meshes TP and FSDP take)."""
    return {chain: DeviceMesh(device_type, torch.tensor(layout.mesh_ranks(chain)), mesh_dim_names=MESH_DIMS)
            for chain in layout.chains()}


class ProcessGroups:
    """The groups a rank needs, created in the same order on every rank (as ``new_group`` requires).

    ``mesh``: the DeviceMesh of this rank's module chain; ``dp`` / ``cp`` / ``tp`` are its dims' groups (None when
    of size 1), ``tp_mesh`` the 1-D tp mesh DTensor takes. ``grad``: every rank holding this rank's parameter shards
    (replicas x CP ranks of the same tp rank); ``replica``: every rank that sees this rank's batch (its replica;
    under per-module data parallelism its group of replicas); ``headers``: a gloo group
    over every rank for message headers; ``tie``: the LLM's first and last stage of this replica (same cp and tp
    rank) when they share tied embeddings."""

    def __init__(self, layout: RankLayout, rank: int, tie_stages: tuple[str, str] | None = None,
                 device_type: str = "cpu", sharded: bool = False):
        coord = layout.coordinate(rank)
        chain = coord.stage.rsplit(".", 1)[0]
        self.meshes = module_meshes(layout, device_type)
        self.mesh = self.meshes[chain]
        replicas = layout.replicas(chain)
        self.dp = self.mesh["dp"].get_group() if replicas > 1 else None
        self.cp = self.mesh["cp"].get_group() if layout.cp[coord.stage] > 1 else None
        from lightning_mm.parallel.context import context_parallel_groups  # hybrid CP: sub-groups, on every rank
        self.cp_attention = context_parallel_groups(layout, rank, self.cp)  # what the CP attention takes
        tp_source, self.shard_mesh = self.mesh, None
        if sharded:  # FSDP and TP meshes must share a root: one (pp, dp_cp, tp) mesh per chain
            shard_meshes = {c: DeviceMesh(device_type, torch.tensor(layout.shard_mesh_ranks(c)),
                                          mesh_dim_names=("pp", "dp_cp", "tp")) for c in layout.chains()}
            tp_source = shard_meshes[chain]
            self.shard_mesh = tp_source["dp_cp"] if replicas * layout.cp[coord.stage] > 1 else None
        self.tp_mesh = tp_source["tp"] if layout.tp[coord.stage] > 1 else None
        self.tp = self.tp_mesh.get_group() if self.tp_mesh is not None else None
        self.grad, self.grad_size = None, 1
        for stage in layout.stages:
            for t in range(layout.tp[stage]):
                ranks = layout.grad_group_ranks(stage, t)
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if stage == coord.stage and t == coord.tp:
                    self.grad, self.grad_size = group, len(ranks)
        self.headers = dist.new_group(backend="gloo")  # host-side message headers (comm.py)
        self.replica = None  # every rank that sees this rank's batch: its replica, or its group of replicas
        for g in range(layout.num_groups):
            group = dist.new_group(layout.group_ranks(g)) if layout.group_size > 1 else None
            if g == layout.group_of(rank):
                self.replica = group
        self.tie = None
        if tie_stages is not None:
            first, last = tie_stages
            for d in range(layout.dp):
                for c in range(layout.cp[first]):
                    for t in range(layout.tp[first]):
                        group = dist.new_group([layout.rank(first, d, c, t), layout.rank(last, d, c, t)])
                        if coord.stage in tie_stages and (coord.dp, coord.cp, coord.tp) == (d, c, t):
                            self.tie = group


class PipelineEngine:
    """One rank's stage of ``model`` (pruned to it) and the schedule that drives it.

    ``partition``: layers per stage of every module (``{module: [counts]}``, resolved by the strategy), or None
    for equal splits. ``device``: where the stage runs (default: where the model's parameters are).
    ``forward_context``: a context manager factory entered around each stage forward (the precision plugin's
    autocast). ``loss_backward(loss)``: runs backward of the last stage's loss (default ``loss.backward()``;
    the strategy routes it through Lightning's precision plugin and hooks). ``materialise(model)`` runs right
    after the model is pruned to this stage (a meta-built model gets real tensors for this stage only)."""

    def __init__(self, model, layout: RankLayout, rank: int, num_microbatches: int,
                 partition: dict[str, list[int]] | None = None, cp_distribution: str = "lpt",
                 cp_block_size: int = 128, activation_checkpointing: bool = False, device=None,
                 forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                 loss_backward: Callable[[torch.Tensor], None] | None = None, bucket_mb: float = 25.0,
                 materialise: Callable[[torch.nn.Module], None] | None = None, sharding_strategy: str = "NO_SHARD",
                 precision: str = "32-true"):
        self.model, self.layout, self.rank, self.num_microbatches = model, layout, rank, num_microbatches
        self.cp_distribution, self.cp_block_size = cp_distribution, cp_block_size
        self.activation_checkpointing = activation_checkpointing
        self.forward_context = forward_context or contextlib.nullcontext
        self.loss_backward = loss_backward or torch.autograd.backward
        self.coord = layout.coordinate(rank)
        encoder_names = model.pipeline_encoders  # a shared encoder runs on its owner's stages
        sizes = {e: len(model.encoders[e].layers) for e in encoder_names}
        sizes[LANGUAGE_MODEL] = len(model.llm_layers)
        layer_counts = {m: list((partition or {}).get(m) or uniform_partition(sizes[m], s))
                        for m, s in layout.module_stages.items()}
        self.plans: dict[str, StagePlan] = stage_plans(layer_counts, layout.placement, encoder_names,
                                                       model.shared_encoders)
        params = dict(model.named_parameters(remove_duplicate=False))
        owned = {s: owned_parameters(model, p) for s, p in self.plans.items()}
        trainable = {s: any(params[n].requires_grad for n in names) for s, names in owned.items()}
        if not any(trainable.values()):
            raise ValueError("the model has no trainable parameter: unfreeze something (model.freeze(projectors=False))")
        module_stages = {e: layout.module_stages[e] for e in encoder_names}
        self.graph = build_stage_graph(module_stages, layout.module_stages[LANGUAGE_MODEL], layout.placement, trainable)
        self.frozen_graph = build_stage_graph(module_stages, layout.module_stages[LANGUAGE_MODEL], layout.placement,
                                              {s: False for s in trainable})
        self.schedules: dict[tuple[bool, tuple[int, ...]], dict] = {}
        self.train_actions, self.eval_actions = self.schedule(True), self.schedule(False)
        self.stage = self.coord.stage
        self.plan = self.plans[self.stage]
        self.node = self.graph.node(self.stage)
        self.feeds_on_encoders = self.stage == f"{LANGUAGE_MODEL}.0" and bool(self.graph.predecessors(self.stage))
        self.llm_hidden = model.hidden_size
        self.tie_stages = tied_embedding_stages(model, layout.module_stages[LANGUAGE_MODEL])
        self.owned = owned[self.stage]
        if self.tie_stages and self.stage == self.tie_stages[1]:  # the head keeps the tied weight, by its name
            embed = model.lm_family.embed_tokens(model.language_model).weight
            self.owned |= {n for n, p in model.named_parameters(remove_duplicate=False) if p is embed}
        self.disaggregated, self.router = layout.disaggregated, None
        if self.disaggregated and model.shared_encoders:
            raise ValueError(f"per-module data parallelism routes each encoder's rows on its own; the encoders "
                             f"{sorted(model.shared_encoders)} share their owners' towers "
                             f"({model.shared_encoders}): give every module the same dp (or none)")
        if self.disaggregated:  # per-module data parallelism: the routing of a group's rows between modules
            self.router = GroupRouter({e: EncoderItems.of(model.encoders[e], 1) for e in encoder_names},
                                      {e: layout.per_group(e) for e in encoder_names},
                                      layout.per_group(LANGUAGE_MODEL), num_microbatches)
        check_expert_parallel(model, layout)
        self.router_metrics = StepRouterMetrics.of(model, num_microbatches, layout.dp, None, not self.coord.tp)
        prune(model, self.owned)
        first = next(model.parameters(), None)
        self.device = torch.device(device) if device is not None else (
            torch.device("cpu") if first is None or first.is_meta else first.device)
        self.cp_size = layout.cp[self.stage]
        self.encoder_cp = self.cp_size if self.plan.language_model is None else 1  # items split over CP ranks
        # what this stage plans with: the data loader gets the same planners (CPPlanCollate)
        self.item_planners = ({e: EncoderItems.of(model.encoders[e], self.encoder_cp) for e in self.plan.encoders}
                              if self.encoder_cp > 1 else {})
        self.block_owners = (BlockOwners(self.cp_size, cp_distribution, cp_block_size, layout.ulysses,
                                         _llm_windows(model))
                             if self.plan.language_model is not None and self.cp_size > 1 else None)
        mesh_device = self.device.type if carries_device_tensors(dist.get_backend(), self.device.type) else "cpu"
        self.groups = ProcessGroups(layout, rank, self.tie_stages, mesh_device, sharding_strategy != "NO_SHARD")
        if self.router_metrics is not None:
            self.router_metrics.cp_group = self.groups.cp
        tp_allreduce = apply_tp(model, self.plan, self.tp_meshes())
        names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        tp_allreduce = [names[id(p)] for p in tp_allreduce]
        self.expert_groups = ExpertGroups(layout, rank, mesh_device) if layout.ep > 1 else None
        self.expert_params = apply_ep(model, self.plan, self.expert_groups) if self.expert_groups else []
        self.vocab_parallel = self.groups.tp_mesh is not None and self.plan.language_model is not None
        self.run_stage, self.fsdp_params = self.forward_stage, set()  # under FSDP: its root unit around it
        if self.groups.shard_mesh is not None and not (self.disaggregated and self.plan.language_model is None):
            # per-module data parallelism shards the language model only: an encoder replica may have no rows in
            # a microbatch, and FSDP needs every rank of a shard group to run every unit
            self.run_stage = apply_fsdp(model, self.plan, self.groups.shard_mesh, sharding_strategy,
                                        self.forward_stage, precision, self.expert_params)
            self.fsdp_params = {id(p) for p in model.parameters()} - {id(p) for p in self.expert_params}
        if materialise is not None:
            materialise(model)
        # by name: FSDP (and materialising a lazy build) put new parameter objects in the modules
        self.tp_allreduce = [model.get_parameter(n) for n in tp_allreduce]
        self.comm = StageComm(self.device, self.groups.headers)
        keep_grads_like_parameters(p for p in self.trainable_parameters() if id(p) not in self.fsdp_params)
        separate = self.fsdp_params | {id(p) for p in self.expert_params}  # experts: summed in sync_gradients
        self.reducer = GradientReducer([p for p in self.trainable_parameters() if id(p) not in separate],
                                       self.groups.grad, bucket_mb)
        self.timings: list[tuple[str, int, float, float]] = []  # (kind, microbatch, start, end) of the last step

    # ------------------------------------------------------------------ helpers
    def set_num_microbatches(self, count: int) -> None:
        """Run the next steps in ``count`` microbatches (a fault-tolerant group that takes a lost group's share runs
        more microbatches of the usual size); schedules stay cached per count."""
        self.num_microbatches = count

    def schedule(self, train: bool, deferred: tuple[int, ...] = ()) -> dict:
        """The action lists of every stage (checked deadlock-free once per microbatch count and deferral pattern,
        then cached)."""
        key = (train, self.num_microbatches, deferred)
        if key not in self.schedules:
            graph = self.graph if train else self.frozen_graph
            actions = one_f_one_b(graph, self.num_microbatches, deferred)
            check_schedule(graph, actions, self.num_microbatches)
            check_rendezvous(actions)
            if self.layout.disaggregated:  # the many-to-many exchanges of per-module data parallelism too
                check_rendezvous(expand_replicas(actions, {s: self.layout.per_group(self.layout.chain_of(s))
                                                           for s in actions}, self.layout.peer_replicas))
            self.schedules[key] = actions
        return self.schedules[key]

    def stage_inputs(self, m: int, received: dict, rows: tuple | None) -> dict:
        """What microbatch ``m``'s forward takes from the stages before it. Where LLM work was deferred (``rows``:
        encoder rows, LLM rows, features per row), the LLM's first stage takes the features of its own rows from
        encoder microbatch ``m`` and those of the rows deferred into it from microbatch ``m - 1``."""
        if rows is None or not self.feeds_on_encoders:
            return received.get(m, {})
        encoder_rows, llm_rows, tokens = rows
        sources = [(m, [r for r in llm_rows[m] if r in encoder_rows[m]])]
        if m:
            sources.append((m - 1, [r for r in llm_rows[m] if r in encoder_rows[m - 1]]))
        out = {}
        for peer, msg in received[m].items():
            out[peer] = {}
            for key, feats in msg.items():
                parts = []
                for src, keep in sources:
                    if not keep:
                        continue
                    own = encoder_rows[src]
                    first = dict(zip(own, [sum(tokens[key][r] for r in own[:i]) for i in range(len(own))]))
                    index = [first[r] + t for r in keep for t in range(tokens[key][r])]
                    parts.append(received[src][peer][key].index_select(
                        0, torch.tensor(index, dtype=torch.long, device=feats.device)))
                out[peer][key] = torch.cat(parts) if parts else feats[:0]
        return out

    def feature_tokens(self, batch: dict) -> dict[str, list[int]]:
        """Feature tokens of each modality per row (the data loader counts them; else read here once)."""
        plan = batch.get(PLAN_KEY) or {}
        if "tokens" in plan:
            return plan["tokens"]
        ids = batch["input_ids"]
        return {e: (ids == pid).sum(1).tolist() for e, pid in self.model.placeholder_ids.items()}

    def tp_meshes(self) -> dict[str, object]:
        """The tp mesh of each module this stage runs with tensor parallelism (an encoder inside an LLM stage
        with tp 1 runs whole on every tp rank)."""
        mesh = self.groups.tp_mesh
        if mesh is None:
            return {}
        modules = ([LANGUAGE_MODEL] if self.plan.language_model is not None else []) + list(self.plan.encoders)
        return {m: mesh for m in modules if self.layout.module_tp.get(m, 1) > 1}

    def cp_owners(self, mbs: list[dict], plans: CPPlans | None = None) -> list[torch.Tensor] | None:
        """Each LLM microbatch's CP distribution as the owning rank of every block, on the host: the data loader's
        (``plans``), else made here at the LLM's first stage (a host read of ``bam`` and ``segment_ids`` per
        microbatch). The first stage sends it down the LLM pipeline with the hidden states (``"cp_owner"``); a later
        stage without the loader's plan uses that one (None here)."""
        if self.block_owners is None:
            return None
        if plans is not None and plans.owners is not None:
            got = [int(o.numel()) for o in plans.owners]
            want = [self.block_owners.num_blocks(mb["input_ids"].shape[1]) for mb in mbs]
            if got != want:
                raise ValueError(f"the batch's CP plan (batch['{PLAN_KEY}']['cp']) gives block owners for {got} "
                                 f"blocks per microbatch but this step runs {want}: it was made for another batch or "
                                 "layout; let MultimodalParallelStrategy wrap the loader (it plans for its own "
                                 "layout) or drop the plan from the batch")
            return plans.owners
        if not self.plan.language_model.embed:
            return None
        return [self.block_owners.owner(mb) for mb in mbs]

    def item_shards(self, mbs: list[dict], plans: CPPlans | None = None) -> None:
        """Put each microbatch's item plan of every encoder with CP in it (``mb[ITEMS_KEY]``): which CP rank encodes
        which item, and each item's LLM tokens. The data loader's (``plans``) when the batch carries them, else made
        here (``EncoderItems.plan``: a host read of the items' sizes per microbatch)."""
        for name, planner in self.item_planners.items():
            given = None if plans is None else plans.items.get(name)
            for m, mb in enumerate(mbs):
                if name not in mb:
                    continue
                plan = planner.plan(mb[name]) if given is None else given[m] if len(given) == len(mbs) else None
                items = planner.family.num_items(planner.family.cp_pieces(mb[name]))
                if plan is None or len(plan[1]) != items or len(plan[0]) != planner.ranks:
                    raise ValueError(f"the batch's CP plan (batch['{PLAN_KEY}']['cp']) does not fit microbatch {m} "
                                     f"of {len(mbs)} ({items} items of {name!r} over {planner.ranks} CP ranks): it "
                                     "was made for another batch or layout; let MultimodalParallelStrategy wrap the "
                                     "loader (it plans for its own layout) or drop the plan from the batch")
                mb.setdefault(ITEMS_KEY, {})[name] = plan

    def forward_keys(self, stage: str) -> list[str]:
        """Keys of the activation message a stage sends (gradients come back for ``plans[stage].output_keys``)."""
        plan = self.plans[stage]
        cp = plan.language_model is not None and self.layout.cp[stage] > 1
        return self.gradient_keys(stage) + (["cp_owner"] if cp else [])

    def gradient_keys(self, stage: str) -> list[str]:
        """Keys of the activation message that carry gradients back: a mixture-of-experts LLM's stages also send
        their router statistics (``router_metrics.py``), and an LLM stage before the last DeepStack layer (Qwen3-VL)
        the DeepStack features of the later layers."""
        routed = self.router_metrics is not None and self.plans[stage].language_model is not None
        return self.plans[stage].output_keys + ([ROUTER_KEY] if routed else []) + self.deepstack_keys(stage)

    def deepstack_keys(self, stage: str) -> list[str]:
        """The DeepStack features an LLM stage passes on: those of layers on later stages."""
        sl = self.plans[stage].language_model
        return [DEEPSTACK_KEY + n for n, k in self.model.deepstack.items() if sl is not None and k > sl.end]

    def deepstack_message(self, stacks: dict, sl) -> dict[str, torch.Tensor]:
        """What ``deepstack_keys`` names for an LLM stage's slice ``sl``, from its ``AttentionContext.deepstack``."""
        out = {}
        for name, k in self.model.deepstack.items():
            if k > sl.end:
                stack = stacks.get(name)
                out[DEEPSTACK_KEY + name] = stack.features[:, sl.end - stack.first:] if stack is not None else \
                    torch.zeros(0, k - sl.end, self.model.hidden_size, device=self.device)
        return out

    def received_deepstack(self, message: dict) -> dict[str, torch.Tensor]:
        return {n: message[DEEPSTACK_KEY + n] for n in self.model.deepstack if DEEPSTACK_KEY + n in message}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if n in self.owned and p.requires_grad]

    # ------------------------------------------------------------------ stage compute
    def _run_layers(self, run, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """``run(hidden, start, end)``, layer by layer under activation checkpointing when it is on and autograd
        records (a no_grad stage has nothing to recompute)."""
        if not (self.activation_checkpointing and torch.is_grad_enabled()):
            return run(hidden, start, end)
        for i in range(start, end):
            hidden = checkpoint(run, hidden, i, i + 1, use_reentrant=False)
        return hidden

    def _encoder_part(self, name, sl, mb, received):
        enc = self.model.encoders[name]
        if name not in mb:  # no item of this modality in the microbatch
            return torch.zeros(0, self.llm_hidden if sl.head else 0, device=self.device)
        items = mb[name]
        if self.encoder_cp > 1:  # this CP rank's items only; the last stage gathers every rank's features
            shards, tokens = mb[ITEMS_KEY][name]
            mine = shards[self.coord.cp]
            if not mine:  # nothing to encode; the last stage still joins the gather
                return self._gather_items(self._no_items(enc), shards, tokens) if sl.head else \
                    torch.zeros(0, device=self.device)
            items = enc.family.select_items(enc.family.cp_pieces(items),
                                            torch.tensor(mine, dtype=torch.long, device=self.device))
        inputs = enc.preprocess(items) if enc.preprocess and not sl.embed else items
        if sl.embed:
            hidden, ctx = enc.embed(items)
        else:
            ctx = enc.family.context(enc.module, inputs)
            hidden = enc.family.stage_input(enc.module, received[name], ctx)
        hidden = self._run_layers(lambda h, a, b: enc.run_layers(h, ctx, a, b), hidden, sl.start, sl.end)
        if not sl.head:
            return enc.family.stage_output(enc.module, hidden, ctx)
        feats = enc.head(hidden, ctx, items)
        return self._gather_items(feats, shards, tokens) if self.encoder_cp > 1 else feats

    def _no_items(self, enc) -> torch.Tensor:
        """The projected features of no item, in the dtype the projector gives (autocast included); it takes part
        in the gather and its backward like any rank's."""
        weight = next(enc.projector.parameters(), None)
        empty = torch.zeros(0, enc.output_dim, device=self.device,
                            dtype=torch.float32 if weight is None else weight.dtype, requires_grad=torch.is_grad_enabled())
        blocks = 1 + enc.family.deepstack_layers(enc.config)  # DeepStack features packed beside the features
        return enc.projector(empty).repeat(1, blocks)

    def _gather_items(self, local, shards, tokens) -> torch.Tensor:
        counts = [sum(tokens[i] for i in items) for items in shards]
        order = torch.tensor(gather_order(shards, tokens), dtype=torch.long, device=self.device)
        return gather_items(local, counts, order, self.groups.cp)

    def _language_part(self, mb, received, num_label_tokens, owner):
        sl, model = self.plan.language_model, self.model
        if owner is None and self.cp_size > 1:  # a later stage without the loader's plan: the first stage's
            owner = received[self.graph.predecessors(self.stage)[0]]["cp_owner"]
        ctx = model.attention_context(mb["input_ids"], mb.get("bam"), mb.get("segment_ids"), mb.get("position_ids"),
                                      mb.get("attention_mask"))
        targets = losses.shift_labels(mb["labels"])  # shifted on the whole sequence, before any sharding
        index = None if owner is None else self._token_index(owner, mb["input_ids"].shape[1])
        local = (lambda t: t) if index is None else (lambda t: t.index_select(1, index))
        if owner is not None:
            seq = torch.arange(mb["input_ids"].shape[1], device=mb["input_ids"].device).expand_as(mb["input_ids"])
            ctx = type(ctx)(position_ids=local(ctx.position_ids), bam=local(ctx.bam),
                            segment_ids=None if ctx.segment_ids is None else local(ctx.segment_ids),
                            token_index=local(seq), cp_group=self.groups.cp_attention)
        if sl.embed:
            features = {k: v for msg in received.values() for k, v in msg.items()}
            features.update({e: self._encoder_part(e, s, mb, {}) for e, s in self.plan.encoders.items()})
            features = {k: v for k, v in features.items() if v.numel()}
            hidden = local(model.embed(mb["input_ids"], features))
            stacks = model.split_features(features)[1] if model.deepstack else {}
        else:
            msg = received[self.graph.predecessors(self.stage)[0]]
            hidden, stacks = msg["hidden"], self.received_deepstack(msg)
        if model.deepstack:
            ctx.deepstack = model.deepstack_context(mb["input_ids"], stacks, sl.start, local)
        routed = None if sl.embed else received[self.graph.predecessors(self.stage)[0]].get(ROUTER_KEY)
        with moe.recording(model.lm_family, model.language_model, ctx.bam, routed) as router:
            hidden = self._run_layers(lambda h, a, b: model.run_llm_layers(h, ctx, a, b), hidden, sl.start, sl.end)
        aux = None if router is None else self.router_metrics.add(router, sl.head)
        if not sl.head:
            out = {"hidden": hidden} if router is None else {"hidden": hidden, ROUTER_KEY: router.vector}
            out.update(self.deepstack_message(ctx.deepstack, sl))  # DeepStack features of layers on later stages
            if owner is None:
                return out
            sent = owner if owner.device == self.device else owner.to(self.device, non_blocking=owner.is_pinned())
            return {**out, "cp_owner": sent}
        logits = model.logits(hidden)
        with self.loss_context():
            loss_sum = losses.token_loss_sum(logits, local(targets))
        if isinstance(loss_sum, DTensor):  # vocab-parallel: replicated over tp
            loss_sum = loss_sum.to_local()
        loss = losses.normalise(loss_sum, num_label_tokens)
        return {"loss_sum": loss_sum, "loss": loss if aux is None else loss + aux, "logits": (logits, index)}

    def loss_context(self):
        """DTensor's ``loss_parallel`` around the loss and its backward when the head's logits are vocab-sharded."""
        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()

    def _token_index(self, owner: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Global indices of this CP rank's tokens (computed where ``owner`` is: on the host for a plan)."""
        blocks = torch.nonzero(owner == self.coord.cp).flatten()
        return token_index(blocks, self.cp_block_size, seq_len).to(self.device)

    def forward_stage(self, mb, received, num_label_tokens, owner=None):
        with self.forward_context():
            if self.plan.language_model is not None:
                return self._language_part(mb, received, num_label_tokens, owner)
            pred = self.graph.predecessors(self.stage)
            msg = received[pred[0]] if pred else {}
            return {e: self._encoder_part(e, sl, mb, msg) for e, sl in self.plan.encoders.items()}

    # ------------------------------------------------------------------ the schedule
    def run(self, batch: dict, train: bool = True, loss_scale: float = 1.0, sync: bool = True,
            keep_logits: bool = False) -> torch.Tensor:
        """Forward (and backward when ``train``) of every microbatch; returns the global normalised loss.

        Gradients are those of ``loss_scale * loss`` (Lightning divides by the gradient-accumulation steps).
        ``sync``: this step's gradients are reduced over replicas during its last backward (False while
        Lightning accumulates). ``keep_logits``: the last stage keeps each microbatch's (logits, global token
        indices or None) in ``self.logits`` (predict)."""
        self.model.check_placeholders(batch["input_ids"], {e: batch[e] for e in self.model.encoders if e in batch})
        if self.disaggregated:
            encoder_rows, llm_rows, deferred = self.group_rows(batch)
        else:
            encoder_rows, llm_rows = microbatch_rows(batch, self.num_microbatches)
            deferred = deferrals(encoder_rows, llm_rows)
        self.llm_rows = llm_rows
        held = deferred if self.feeds_on_encoders else ()  # encoder features kept for the next microbatch
        rows = (encoder_rows, llm_rows, self.feature_tokens(batch)) if held else None
        mbs = split_microbatches(batch, llm_rows if self.plan.language_model is not None else encoder_rows,
                                 self.model)
        if self.plan.language_model is not None:  # short CP sequences pad to whole blocks
            mbs = [pad_for_context_parallel(mb, self.cp_size, self.cp_block_size) for mb in mbs]
        plans = batch_plans(batch)  # the data loader's CP plans (host data), if the batch carries them
        owners = self.cp_owners(mbs, plans)
        self.item_shards(mbs, plans)
        count = losses.count_label_tokens(batch["labels"]).reshape(1).to(self.device, torch.float32)
        if self.disaggregated:  # every rank of a group counts the group's batch: one rank per group adds it
            if self.rank != self.layout.group_ranks(self.layout.group_of(self.rank))[0]:
                count.zero_()
            dist.all_reduce(count)
        elif self.groups.dp is not None:
            dist.all_reduce(count, group=self.groups.dp)
        actions = self.schedule(train, deferred)[self.stage]
        needs_grad = train and self.node.needs_backward
        last_backward = max((i for i, a in enumerate(actions) if a.kind == "backward"), default=None)
        received, outputs, input_grads = {}, {}, {}
        self.chunks = {}  # (microbatch, peer) -> the features received from each replica, then how they were joined
        loss_sum = torch.zeros((), device=self.device)
        self.timings, self.logits = [], []
        if self.router_metrics is not None:
            self.router_metrics.begin(self.device)
        at = 0
        for group in communication_groups(actions):
            t0 = time.perf_counter()
            act = group[0]
            m = act.microbatch
            if act.kind == "forward":
                with torch.set_grad_enabled(needs_grad):
                    out = self.run_stage(mbs[m], self.stage_inputs(m, received, rows), count[0],
                                         owners and owners[m])
                if "loss_sum" in out:
                    loss_sum = loss_sum + out["loss_sum"].detach()
                    logits, index = out.pop("logits")
                    if keep_logits:
                        logits = logits.detach()
                        self.logits.append((logits.full_tensor() if isinstance(logits, DTensor) else logits, index))
                outputs[m] = out
                if not needs_grad:  # features of a deferring microbatch serve the next one too
                    for done in ([m - 1] if m - 1 in held else []) + ([] if m in held else [m]):
                        for peer in received.pop(done, {}):
                            self.chunks.pop((done, peer), None)
            elif act.kind == "backward":
                if sync and at == last_backward:
                    self.reducer.arm()
                self._backward(outputs.pop(m), input_grads.pop(("out", m), None), loss_scale)
                # a deferring microbatch's inputs get the rest of their gradients in the next one's backward
                for done in ([m - 1] if m - 1 in held else []) + ([] if m in held else [m]):
                    for peer, msg in received.pop(done, {}).items():
                        if self.graph.node(peer).needs_backward:
                            grads = input_gradients(msg)
                            input_grads[(peer, done)] = self.split_gradients(done, peer, grads) \
                                if self.routed(peer) else grads
            else:
                self._communicate(group, outputs, received, input_grads, needs_grad)
            t1 = time.perf_counter()
            self.timings += [(a.kind, a.microbatch, t0, t1 if i == 0 else t0) for i, a in enumerate(group)]
            at += len(group)
        self.comm.wait_all()
        if self.coord.tp:  # tensor-parallel ranks of the head hold the same loss: count it once
            loss_sum.zero_()
        dist.all_reduce(loss_sum)
        loss = losses.normalise(loss_sum, count[0])
        return loss if self.router_metrics is None else loss + self.router_metrics.finish()

    def predict(self, batch: dict) -> dict:
        """Forward only. ``logits`` [B, S, V] on the ranks holding the LLM head without CP (None elsewhere) and
        the greedy next-token ids [B, S] on every rank of the replica (broadcast from the head). Under per-module
        data parallelism ``logits`` holds the head's own replica's rows (in its microbatch order) and the ids
        every row of the group's batch."""
        batch = dict(batch)
        if "labels" not in batch:
            batch["labels"] = torch.full_like(batch["input_ids"], losses.IGNORE_INDEX)
        self.run(batch, train=False, keep_logits=True)
        rows, seq = batch["input_ids"].shape
        ids, logits = torch.zeros(rows, seq, dtype=torch.long, device=self.device), None
        head = self.plan.language_model is not None and self.plan.language_model.head
        if head:
            parts = []
            for mb_logits, index in self.logits:
                local = mb_logits.argmax(-1)
                if index is not None:  # each CP rank fills its tokens; the maximum over ranks is the whole row
                    length = index.max().reshape(1) + 1 if index.numel() else index.new_zeros(1)
                    dist.all_reduce(length, op=dist.ReduceOp.MAX, group=self.groups.cp)
                    full = torch.full((local.shape[0], int(length)), -1, dtype=torch.long, device=self.device)
                    full[:, index] = local
                    dist.all_reduce(full, op=dist.ReduceOp.MAX, group=self.groups.cp)
                    local = full
                parts.append(local[:, :seq])
            ids = torch.cat(parts)
            if self.cp_size == 1:
                logits = torch.cat([mb_logits for mb_logits, _ in self.logits])[:, :seq]
        self.logits = []
        if self.disaggregated:  # each language-model replica's head fills its own rows of the group's batch
            full = torch.zeros(rows, seq, dtype=torch.long, device=self.device)
            if head and self.coord.cp == 0 and self.coord.tp == 0:
                mine = [r for mb in self.llm_rows for r in mb]
                full[torch.tensor(mine, device=self.device)] = ids
            if self.groups.replica is not None:
                dist.all_reduce(full, group=self.groups.replica)
            return {"logits": logits, "predicted_ids": full}
        if self.groups.replica is not None:
            last = self.layout.stages[-1]
            dist.broadcast(ids, self.layout.rank(last, self.coord.dp), group=self.groups.replica)
        return {"logits": logits, "predicted_ids": ids}

    def _communicate(self, group, outputs, received, input_grads, needs_grad) -> None:
        """Post one group of sends and receives together (``comm.StageComm.exchange``) and file the results.

        Under per-module data parallelism an encoder's last stage and the LLM's first stage exchange one message
        with every replica of the other in their group each microbatch (``routed``): the features of the rows the
        routing sends there, and back their gradients."""
        sends, recvs, targets = [], [], []
        me, d, layout = self.rank, self.coord.dp, self.layout
        for a in group:
            m = a.microbatch
            routed = self.routed(a.peer)
            if a.kind == "send_fwd":
                for j in layout.peer_replicas(self.stage, a.peer, d):
                    msg = outputs[m]
                    if routed:
                        index = self.feature_index(m, j)
                        msg = {k: t.index_select(0, index) for k, t in msg.items()}
                    sends += [(msg, self.forward_keys(self.stage), dst) for dst, src in
                              layout.activation_sources(self.stage, a.peer, j, sender_dp=d).items() if src == me]
                if not needs_grad:
                    outputs.pop(m)
            elif a.kind == "send_bwd":
                grads = input_grads.pop((a.peer, m))
                for i, part in (grads if routed else [(d, grads)]):
                    sends += [(part, self.gradient_keys(a.peer), dst) for dst, srcs in
                              layout.gradient_sources(a.peer, self.stage, i, receiver_dp=d).items() if me in srcs]
            elif a.kind == "recv_fwd":
                for i in layout.peer_replicas(self.stage, a.peer, d):
                    recvs.append((self.forward_keys(a.peer), layout.activation_sources(a.peer, self.stage, d,
                                                                                       sender_dp=i)[me]))
                    targets.append((a, i))
            else:  # recv_bwd: one gradient per CP shard of the peer (every CP rank of the LLM's first stage), summed
                for j in layout.peer_replicas(self.stage, a.peer, d):
                    peers = layout.gradient_sources(self.stage, a.peer, d, receiver_dp=j)[me]
                    recvs += [(self.gradient_keys(self.stage), src) for src in peers]
                    targets += [(a, j)] * len(peers)
        got = self.comm.exchange(sends, recvs)
        for (a, peer_replica), msg in zip(targets, got):
            m = a.microbatch
            if a.kind == "recv_fwd":
                if self.routed(a.peer):
                    self.chunks.setdefault((m, a.peer), []).append((peer_replica, msg))
                    continue
                if needs_grad and self.graph.node(a.peer).needs_backward:
                    for t in msg.values():
                        if t.is_floating_point():
                            t.requires_grad_(True)
                received.setdefault(m, {})[a.peer] = msg
            else:
                if self.routed(a.peer):  # this replica's share of the features sent there
                    index = self.feature_index(m, peer_replica)
                    msg = {k: torch.zeros_like(outputs[m][k]).index_add_(0, index, g) for k, g in msg.items()}
                prev = input_grads.get(("out", m))
                input_grads[("out", m)] = msg if prev is None else {k: prev[k] + msg[k] for k in msg}
        for a in group:  # the features of every sender replica, in this replica's row order
            if a.kind == "recv_fwd" and self.routed(a.peer) and (a.microbatch, a.peer) in self.chunks:
                msg = self.assemble(a.microbatch, a.peer)
                if needs_grad and self.graph.node(a.peer).needs_backward:
                    for t in msg.values():
                        if t.is_floating_point():
                            t.requires_grad_(True)
                received.setdefault(a.microbatch, {})[a.peer] = msg

    # ------------------------------------------------------------------ per-module data parallelism
    def routed(self, peer: str) -> bool:
        """Whether messages with ``peer`` follow the routing (an edge between chains of different degrees)."""
        return self.disaggregated and self.layout.chain_of(peer) != self.layout.chain_of(self.stage)

    def group_rows(self, batch: dict) -> tuple[list[list[int]], list[list[int]], tuple[int, ...]]:
        """This stage's encoder and LLM microbatch rows in its group's batch, and the deferrals every stage of the
        group schedules with (those of any of its language-model replicas), from the batch's routing; checks that
        every rank of the group routes alike."""
        per_replica = self.router.rows(batch)
        self.routing: Routing = self.router(batch)
        self.row_tokens = self.feature_tokens(batch)
        check_same_routing(self.routing, self.groups.replica, self.device)
        deferred = tuple(sorted({m for enc, llm in per_replica for m in deferrals(enc, llm)}))
        chain = self.layout.chain_of(self.stage)
        j = self.coord.dp % self.layout.per_group(chain)
        if self.plan.language_model is not None:
            return (*per_replica[j], deferred)
        rows = self.routing.encoder_rows[chain][j]
        return rows, rows, deferred

    def feature_index(self, m: int, llm_replica: int) -> torch.Tensor:
        """Rows (feature tokens) of this encoder replica's microbatch ``m`` output that go to ``llm_replica``."""
        name = self.layout.chain_of(self.stage)
        per_group = self.layout.per_group
        i, j = self.coord.dp % per_group(name), llm_replica % per_group(LANGUAGE_MODEL)
        tokens = self.row_tokens[name]
        start, at = {}, 0
        for r in self.routing.encoder_rows[name][i][m]:
            start[r] = at
            at += tokens[r]
        index = [start[r] + t for r in self.routing.sent_rows(name, i, j, m) for t in range(tokens[r])]
        return torch.tensor(index, dtype=torch.long, device=self.device)

    def assemble(self, m: int, peer: str) -> dict:
        """Microbatch ``m``'s features from every replica of ``peer``'s encoder, in this replica's row order (new
        tensors: a deferring microbatch's features serve two backwards, so they are leaves like any message;
        ``split_gradients`` takes their gradients back apart)."""
        name = self.layout.chain_of(peer)
        per_group = self.layout.per_group
        j = self.coord.dp % per_group(LANGUAGE_MODEL)
        tokens = self.row_tokens[name]
        parts = self.chunks[(m, peer)]
        start, at = {}, 0
        for i, _ in parts:
            for r in self.routing.sent_rows(name, i % per_group(name), j, m):
                start[r] = at
                at += tokens[r]
        order = torch.tensor([start[r] + t for r in self.routing.llm_rows[j][m] if r in start
                              for t in range(tokens[r])], dtype=torch.long, device=self.device)
        self.chunks[(m, peer)] = (order, [(i, {k: t.shape[0] for k, t in part.items()}) for i, part in parts])
        return {k: torch.cat([part[k] for _, part in parts]).index_select(0, order) for k in parts[0][1]}

    def split_gradients(self, m: int, peer: str, grads: dict) -> list[tuple[int, dict]]:
        """The gradients of ``assemble``'s features as one message per sender replica."""
        order, parts = self.chunks.pop((m, peer))
        out = [(i, {}) for i, _ in parts]
        for k, g in grads.items():
            pieces = torch.zeros_like(g).index_copy_(0, order, g).split([sizes[k] for _, sizes in parts])
            for (_, msg), piece in zip(out, pieces):
                msg[k] = piece
        return out

    def _backward(self, out: dict, grads: dict | None, loss_scale: float) -> None:
        if "loss" in out:
            if out["loss"].requires_grad:
                with self.loss_context():
                    self.loss_backward(out["loss"] * loss_scale)
            return
        if grads is None:  # an encoder CP rank no LLM rank reads from: its share of the gradient is zero
            grads = {k: torch.zeros_like(t) for k, t in out.items()}
        pairs = [(t, grads[k]) for k, t in out.items() if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    # ------------------------------------------------------------------ gradients
    def sync_gradients(self) -> None:
        """Finish summing gradients over every rank holding the same parameters (replicas, CP ranks), over the
        LLM's first and last stage for tied embeddings across a pipeline, and over tp for the parameters a
        tensor-parallel plan keeps whole but feeds per-head inputs (``replicated_with_grad_allreduce``)."""
        self.reducer.finish()
        weight = tied_weight(self.model) if self.groups.tie is not None else None
        if weight is not None and weight.requires_grad:  # both ends hold it under the embedding's name
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            all_reduce_grads([weight], self.groups.tie)
        all_reduce_grads([p for p in self.tp_allreduce if p.requires_grad], self.groups.tp)
        if self.expert_groups is not None:  # over the ranks holding the same experts only
            all_reduce_grads([p for p in self.expert_params if p.requires_grad], self.expert_groups.grad)

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of all trainable gradients of the whole model (every stage, counted once)."""
        params = self.trainable_parameters()
        if self.tie_stages and self.stage == self.tie_stages[1]:  # the tied weight counts at the first stage
            params = [p for p in params if p is not self.model.language_model.lm_head.weight]
        return global_grad_norm(params, self.groups.grad_size * self.layout.tp[self.stage], self.device)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        norm = self.global_grad_norm()
        clip_(self.trainable_parameters(), max_norm, norm)
        return norm


def check_same_routing(routing: Routing, group, device) -> None:
    """Raise on every rank of ``group`` unless all of them route the batch alike (``Routing.fingerprint``)."""
    if group is None:
        return
    mine = routing.fingerprint()
    both = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if both.tolist() != [mine, -mine]:
        raise RuntimeError(f"the ranks {dist.get_process_group_ranks(group)} that share a batch routed it differently "
                           "between the modules' replicas (per-module data parallelism); every rank of a group must "
                           "see the same batch and the same routing: let MultimodalParallelStrategy build the "
                           "training loader, with the same seed on every rank")


def input_gradients(message: dict) -> dict:
    """The gradients of a received message's floating-point tensors (zeros where autograd left none)."""
    return {k: (t.grad if t.grad is not None else torch.zeros_like(t)) for k, t in message.items()
            if t.is_floating_point()}


def batch_fingerprint(batch: dict) -> list[int]:
    """Shapes and a few ids of a batch (host numbers only, no device read)."""
    out = []
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            out += [len(value.shape), *value.shape]
        elif isinstance(value, dict):
            out += batch_fingerprint(value)
    return out


def check_same_batch(batch: dict, group) -> None:
    """Every rank of a replica must see the same batch (one sampler per replica). Compares shapes and a
    position-weighted sum of the token ids over the replica's ranks; raises the same error on every rank."""
    if group is None:
        return
    ids = batch["input_ids"]
    weights = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.float64).view_as(ids)
    shape = batch_fingerprint(batch)
    mine = torch.cat([torch.tensor([len(shape), *shape[:64]], dtype=torch.float64, device=ids.device),
                      (ids.double() * weights).sum().reshape(1)])
    both = torch.cat([mine, -mine])
    sizes = torch.tensor([both.numel(), -both.numel()], dtype=torch.float64, device=ids.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) == both.numel() == -int(sizes[1]):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        same = bool(torch.equal(both[:mine.numel()], mine) and torch.equal(-both[mine.numel():], mine))
    else:
        same = False
    if not same:
        raise RuntimeError(f"the ranks of one data-parallel replica got different batches (ranks "
                           f"{dist.get_process_group_ranks(group)}); every rank of a replica must see the same "
                           "batch: use the strategy's distributed_sampler_kwargs (num_replicas=dp, rank=replica "
                           "index), as Lightning's default sampler does, and the same seed on every rank")


def tied_weight(model) -> torch.nn.Parameter:
    """The input/output embedding a tied LLM's first and last pipeline stage both hold."""
    lm = model.language_model
    return lm.lm_head.weight if not isinstance(lm.lm_head, torch.nn.Identity) else \
        model.lm_family.embed_tokens(lm).weight
