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
with FSDP2 (``sharding.py``, which then reduces its gradients: after every microbatch's backward, or with
``fsdp_reduce="step"`` in the step's last). Every tensor the engine makes lives on ``device``.

The stage itself is built by ``build.py`` (what the rank holds, then TP, EP, FSDP over ``meshes.py``'s groups); a
rank with nothing to encode under FSDP still runs every collective (``encoder_part``). ``run`` returns a
``StepResult``.

Context-parallel plans (encoder item shards, LLM block owners) are host data made by the data loader
(``data/cp_plans.py``); the step only executes them, and plans with the same functions itself (reading the sizes
and mask words to the host) only for a batch that carries none.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from lightning_mm import loss as losses
from lightning_mm.attention.context_parallel import gathered_kv_recomputed
from lightning_mm.data.cp_plans import EncoderItems, GroupRouter, batch_plans
from lightning_mm.data.microbatch import deferrals, feature_tokens, microbatch_rows, split_microbatches
from lightning_mm.model import moe
from lightning_mm.parallel.build import BuiltStage, StageHolding, build_stage, describe_stage
from lightning_mm.parallel.comm import StageComm
from lightning_mm.parallel.context import (BlockOwners, block_owner_plans, llm_windows, pad_for_context_parallel,
                                          token_index)
from lightning_mm.parallel.encoder_cp import ITEMS_KEY, gather_item_features, item_shards, no_item_features
from lightning_mm.parallel.expert_parallel import check_expert_parallel
from lightning_mm.parallel.grads import GradientReducer, all_reduce_grads, clip_, global_grad_norm
from lightning_mm.parallel.routed import RoutedExchange
from lightning_mm.parallel.router_metrics import ROUTER_KEY, StepRouterMetrics
from lightning_mm.parallel.sharding import gradient_sync
from lightning_mm.parallel.tensor_parallel import keep_grads_like_parameters
from lightning_mm.plan.layout import RankLayout
from lightning_mm.plan.routing import expand_replicas
from lightning_mm.plan.schedule import LANGUAGE_MODEL, check_rendezvous, check_schedule, communication_groups, one_f_one_b


DEEPSTACK_KEY = "deepstack."  # + modality: DeepStack features an LLM stage passes to the next (Qwen3-VL)


@dataclass
class StepResult:
    """What one step returns: the global normalised ``loss`` (router loss included), ``timings`` of every action
    (kind, microbatch, start, end), the LLM microbatch ``rows`` of the batch this rank ran, and with ``keep_logits``
    the last stage's (logits, global token indices or None) per microbatch."""

    loss: torch.Tensor
    timings: list[tuple[str, int, float, float]]
    rows: list[list[int]]
    logits: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)


class PipelineEngine:
    """One rank's stage of ``model`` (pruned to it, ``build.py``) and the schedule that drives it.

    ``partition``: layers per stage of every module (``{module: [counts]}``, resolved by the strategy), or None
    for equal splits. ``device``: where the stage runs (default: where the model's parameters are).
    ``forward_context``: a context manager factory entered around each stage forward (the precision plugin's
    autocast). ``loss_backward(loss)``: runs backward of the last stage's loss (default ``loss.backward()``;
    the strategy routes it through Lightning's precision plugin and hooks). ``materialise(model)`` runs right
    after the model is pruned and sharded (a meta-built model gets real tensors for this stage only).
    ``fsdp_reduce``: when a sharded stage reduce-scatters its gradients ("microbatch" or "step", ``sharding.py``)."""

    def __init__(self, model, layout: RankLayout, rank: int, num_microbatches: int,
                 partition: dict[str, list[int]] | None = None, cp_distribution: str = "lpt", cp_block_size: int = 128,
                 activation_checkpointing: bool = False, device=None, *, bucket_mb: float = 25.0, timeout=None,
                 forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                 loss_backward: Callable | None = None, precision: str = "32-true", fsdp_reduce: str = "microbatch",
                 materialise: Callable[[torch.nn.Module], None] | None = None, sharding_strategy: str = "NO_SHARD"):
        self.model, self.layout, self.rank, self.num_microbatches = model, layout, rank, num_microbatches
        self.cp_distribution, self.cp_block_size = cp_distribution, cp_block_size
        self.sharding_strategy, self.activation_checkpointing = sharding_strategy, activation_checkpointing
        self.forward_context, self.loss_backward = forward_context or contextlib.nullcontext, \
            loss_backward or torch.autograd.backward
        self.coord, self.holding = layout.coordinate(rank), describe_stage(model, layout, rank, partition)
        self.plans, self.stage, self.graph = self.holding.plans, self.holding.stage, self.holding.graph
        self.plan, self.owned, self.tie_stages = self.holding.plan, set(self.holding.owned), self.holding.tie_stages
        self.schedules: dict[tuple, dict] = {}
        self.schedule(True), self.schedule(False)  # checked deadlock-free before any group exists
        router = check_stage(model, layout, num_microbatches)
        self.router_metrics = StepRouterMetrics.of(model, num_microbatches, layout.dp, None, not self.coord.tp)
        built = build_stage(model, self.holding, layout=layout, rank=rank, forward=self.forward_stage, device=device,
                            sharding_strategy=sharding_strategy, precision=precision, materialise=materialise,
                            timeout=timeout, fsdp_reduce=fsdp_reduce)
        self.device, self.groups, self.run_stage = built.device, built.meshes, built.run_stage
        self.tp_allreduce, self.expert_params, self.fsdp_params = built.tp_allreduce, built.expert_params, built.fsdp_params
        self.exchange = RoutedExchange(router, layout, rank, self.device, self.groups.replica) if router else None
        self.cp_size, self.encoder_cp, self.item_planners, self.block_owners = context_planners(
            model, layout, self.holding, cp_distribution, cp_block_size)
        if self.router_metrics is not None:
            self.router_metrics.cp_group = self.groups.cp
        self.comm = StageComm(self.device, self.groups.headers)
        self.reducer = replica_reducer(self.trainable_parameters(), built, bucket_mb)

    @property
    def frozen_graph(self):
        return self.holding.frozen_graph

    @property
    def node(self):
        return self.graph.node(self.stage)

    @property
    def feeds_on_encoders(self) -> bool:
        """Whether this is the LLM's first stage with encoder stages before it."""
        return self.stage == f"{LANGUAGE_MODEL}.0" and bool(self.graph.predecessors(self.stage))

    @property
    def sharded_encoder_stage(self) -> bool:
        """Whether this is an encoder stage under FSDP (its output is the root unit's: ``head_output``)."""
        return bool(self.fsdp_params) and self.plan.language_model is None

    @property
    def vocab_parallel(self) -> bool:
        return self.groups.tp_mesh is not None and self.plan.language_model is not None

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
            if self.layout.per_module_dp:  # the many-to-many exchanges of per-module data parallelism too
                check_rendezvous(expand_replicas(actions, {s: self.layout.per_group(self.layout.chain_of(s))
                                                           for s in actions}, self.layout.peer_replicas))
            self.schedules[key] = actions
        return self.schedules[key]

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

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if n in self.owned and p.requires_grad]

    # ------------------------------------------------------------------ stage compute
    def encoder_part(self, name, sl, mb, received):
        """Encoder ``name``'s slice ``sl`` on microbatch ``mb``: features (head) or hidden states. A rank with no item
        here (none in the microbatch or its CP shard) skips the encoder, but under FSDP, where every rank of a shard
        group runs each unit's collectives, runs it on a stand-in item and adds zero times the result."""
        enc, items, shards, tokens = self.model.encoders[name], mb.get(name), None, None
        if items is not None and self.encoder_cp > 1:  # this CP rank's items; the last stage gathers every rank's
            shards, tokens = mb[ITEMS_KEY][name]
            mine = shards[self.coord.cp]
            items = enc.family.select_items(enc.family.cp_pieces(items),
                                            torch.tensor(mine, dtype=torch.long, device=self.device)) if mine else None
        if items is not None:
            out = encode(enc, name, sl, items, received, self.activation_checkpointing)
            return gather_item_features(out, shards, tokens, self.groups.cp) if shards and sl.head else \
                head_output(out, sl.head and self.sharded_encoder_stage)
        if not self.fsdp_params:  # nothing to run; the gather of encoder CP still counts this rank
            if shards is not None and sl.head:
                return gather_item_features(no_item_features(enc, self.device), shards, tokens, self.groups.cp)
            return torch.zeros(0, self.model.hidden_size if sl.head else 0, device=self.device)
        out = encode(enc, name, sl, stand_in_items(enc, self.device), received, self.activation_checkpointing, False)
        if not sl.head:
            return out
        # the projector on no rows, zero times the stand-in's features: gradients 0, the units in their usual order
        out = no_item_features(enc, self.device, out[:0] + 0.0 * out.sum())
        return gather_item_features(out, shards, tokens, self.groups.cp) if shards is not None else \
            head_output(out, self.sharded_encoder_stage)

    def _language_part(self, mb, received, num_label_tokens, owner):
        sl, model = self.plan.language_model, self.model
        if owner is None and self.cp_size > 1:  # a later stage without the loader's plan: the first stage's
            owner = received[self.graph.predecessors(self.stage)[0]]["cp_owner"]
        ctx = model.attention_context(mb["input_ids"], mb.get("bam"), mb.get("segment_ids"), mb.get("position_ids"),
                                      mb.get("attention_mask"), checked=True)  # the step's or the prompts' words
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
            features.update({e: self.encoder_part(e, s, mb, {}) for e, s in self.plan.encoders.items()})
            stand_ins = [v for v in features.values() if not v.numel() and v.requires_grad]  # see encoder_part
            features = {k: v for k, v in features.items() if v.numel()}
            hidden = local(model.embed(mb["input_ids"], features))
            for empty in stand_ins:  # an empty tensor's sum is 0; it carries the stand-in's backward
                hidden = hidden + empty.sum()
            stacks = model.split_features(features)[1] if model.deepstack else {}
        else:
            msg = received[self.graph.predecessors(self.stage)[0]]
            hidden, stacks = msg["hidden"], received_deepstack(model, msg)
        if model.deepstack:
            ctx.deepstack = model.deepstack_context(mb["input_ids"], stacks, sl.start, local)
        routed = None if sl.embed else received[self.graph.predecessors(self.stage)[0]].get(ROUTER_KEY)
        with moe.recording(model.lm_family, model.language_model, ctx.bam, routed) as router:
            hidden = run_layers(lambda h, a, b: model.run_llm_layers(h, ctx, a, b), hidden, sl,
                                self.activation_checkpointing)
        aux = None if router is None else self.router_metrics.add(router, sl.head)
        if not sl.head:
            out = {"hidden": hidden} if router is None else {"hidden": hidden, ROUTER_KEY: router.vector}
            out.update(deepstack_message(model, ctx.deepstack, sl, self.device))  # of layers on later stages
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
            return {e: self.encoder_part(e, sl, mb, msg) for e, sl in self.plan.encoders.items()}

    # ------------------------------------------------------------------ the schedule
    def run(self, batch: dict, train: bool = True, loss_scale: float = 1.0, sync: bool = True,
            keep_logits: bool = False) -> StepResult:
        """Forward (and backward when ``train``) of every microbatch; the result holds the global normalised loss.

        Gradients are those of ``loss_scale * loss`` (Lightning divides by the gradient-accumulation steps).
        ``sync``: this step's gradients are reduced over replicas during its last backward (False while
        Lightning accumulates). ``keep_logits``: the last stage keeps each microbatch's (logits, global token
        indices or None) in the result (predict)."""
        self.model.check_batch(batch)
        if self.exchange is not None:
            encoder_rows, llm_rows, deferred = self.exchange.rows(batch, feature_tokens(batch, self.model),
                                                                  self.plan.language_model is not None)
        else:
            encoder_rows, llm_rows = microbatch_rows(batch, self.num_microbatches)
            deferred = deferrals(encoder_rows, llm_rows)
        held = deferred if self.feeds_on_encoders else ()  # encoder features kept for the next microbatch
        rows = (encoder_rows, llm_rows, feature_tokens(batch, self.model)) if held else None
        mbs = split_microbatches(batch, llm_rows if self.plan.language_model is not None else encoder_rows,
                                 self.model)
        if self.plan.language_model is not None:  # short CP sequences pad to whole blocks
            mbs = [pad_for_context_parallel(mb, self.cp_size, self.cp_block_size) for mb in mbs]
        plans = batch_plans(batch)  # the data loader's CP plans (host data), if the batch carries them
        owners = block_owner_plans(self.block_owners, mbs, plans, self.plan.language_model is not None
                                   and self.plan.language_model.embed)
        item_shards(self.item_planners, mbs, plans)
        count = self.label_count(batch)
        actions = self.schedule(train, deferred)[self.stage]
        needs_grad = train and self.node.needs_backward
        last_backward = max((i for i, a in enumerate(actions) if a.kind == "backward"), default=None)
        received, outputs, input_grads = {}, {}, {}
        loss_sum = torch.zeros((), device=self.device)
        timings, kept = [], []
        if self.router_metrics is not None:
            self.router_metrics.begin(self.device)
        at = 0
        for group in communication_groups(actions):
            t0 = time.perf_counter()
            act = group[0]
            m = act.microbatch
            if act.kind == "forward":
                with torch.set_grad_enabled(needs_grad):
                    out = self.run_stage(mbs[m], stage_inputs(m, received, rows), count[0],
                                         owners and owners[m])
                if "loss_sum" in out:
                    loss_sum = loss_sum + out["loss_sum"].detach()
                    logits, index = out.pop("logits")
                    if keep_logits:
                        logits = logits.detach()
                        kept.append((logits.full_tensor() if isinstance(logits, DTensor) else logits, index))
                outputs[m] = out
                if not needs_grad:  # features of a deferring microbatch serve the next one too
                    for done in ([m - 1] if m - 1 in held else []) + ([] if m in held else [m]):
                        for peer in received.pop(done, {}):
                            if self.exchange is not None:
                                self.exchange.chunks.pop((done, peer), None)
            elif act.kind == "backward":
                if sync and at == last_backward:
                    self.reducer.arm()
                gradient_sync(self.run_stage, sync and at == last_backward)  # fsdp_reduce="step": FSDP reduces here
                self._backward(outputs.pop(m), input_grads.pop(("out", m), None), loss_scale)
                # a deferring microbatch's inputs get the rest of their gradients in the next one's backward
                for done in ([m - 1] if m - 1 in held else []) + ([] if m in held else [m]):
                    for peer, msg in received.pop(done, {}).items():
                        if self.graph.node(peer).needs_backward:
                            grads = input_gradients(msg)
                            input_grads[(peer, done)] = self.exchange.split_gradients(done, peer, grads) \
                                if self.routed(peer) else grads
            else:
                self._communicate(group, outputs, received, input_grads, needs_grad)
            t1 = time.perf_counter()
            timings += [(a.kind, a.microbatch, t0, t1 if i == 0 else t0) for i, a in enumerate(group)]
            at += len(group)
        self.comm.wait_all()
        if self.coord.tp:  # tensor-parallel ranks of the head hold the same loss: count it once
            loss_sum.zero_()
        dist.all_reduce(loss_sum)
        loss = losses.normalise(loss_sum, count[0])
        if self.router_metrics is not None:
            loss = loss + self.router_metrics.finish()
        return StepResult(loss, timings, llm_rows, kept)

    def predict(self, batch: dict) -> dict:
        """Forward only; the logits and greedy next-token ids (``predict_step``)."""
        return predict_step(self, batch)

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
                        msg = {k: t.index_select(0, self.exchange.feature_index(m, j, k)) for k, t in msg.items()}
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
                    self.exchange.receive(m, a.peer, peer_replica, msg)
                    continue
                if needs_grad and self.graph.node(a.peer).needs_backward:
                    for t in msg.values():
                        if t.is_floating_point():
                            t.requires_grad_(True)
                received.setdefault(m, {})[a.peer] = msg
            else:
                if self.routed(a.peer):  # this replica's share of the features sent there
                    msg = {k: torch.zeros_like(outputs[m][k]).index_add_(
                        0, self.exchange.feature_index(m, peer_replica, k), g) for k, g in msg.items()}
                prev = input_grads.get(("out", m))
                input_grads[("out", m)] = msg if prev is None else {k: prev[k] + msg[k] for k in msg}
        for a in group:  # the features of every sender replica, in this replica's row order
            if a.kind == "recv_fwd" and self.routed(a.peer) and (a.microbatch, a.peer) in self.exchange.chunks:
                msg = self.exchange.assemble(a.microbatch, a.peer)
                if needs_grad and self.graph.node(a.peer).needs_backward:
                    for t in msg.values():
                        if t.is_floating_point():
                            t.requires_grad_(True)
                received.setdefault(a.microbatch, {})[a.peer] = msg

    def label_count(self, batch: dict) -> torch.Tensor:
        """``[1]``: the label tokens of the whole step over every replica (the loss's normaliser)."""
        count = losses.count_label_tokens(batch["labels"]).reshape(1).to(self.device, torch.float32)
        if self.exchange is not None:  # every rank of a group counts the group's batch: one rank per group adds it
            if self.rank != self.layout.group_ranks(self.layout.group_of(self.rank))[0]:
                count.zero_()
            dist.all_reduce(count)
        elif self.groups.dp is not None:
            dist.all_reduce(count, group=self.groups.dp)
        return count

    def routed(self, peer: str) -> bool:
        """Whether messages with ``peer`` follow per-module data parallelism's routing (``routed.py``)."""
        return self.exchange is not None and self.exchange.routed(peer)

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
        if self.groups.experts is not None:  # over the ranks holding the same experts only
            all_reduce_grads([p for p in self.expert_params if p.requires_grad], self.groups.experts.grad)

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


def stage_inputs(m: int, received: dict, rows: tuple | None) -> dict:
    """What microbatch ``m``'s forward takes from the stages before it. Where LLM work was deferred (``rows``:
    encoder rows, LLM rows, features per row), the LLM's first stage takes the features of its own rows from
    encoder microbatch ``m`` and those of the rows deferred into it from microbatch ``m - 1``; ``rows`` is None
    where nothing was deferred or the stage takes no features."""
    if rows is None:
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


def predict_step(engine: PipelineEngine, batch: dict) -> dict:
    """Forward only. ``logits`` [B, S, V] on the ranks holding the LLM head without CP (None elsewhere) and
    the greedy next-token ids [B, S] on every rank of the replica (broadcast from the head). Under per-module
    data parallelism ``logits`` holds the head's own replica's rows (in its microbatch order) and the ids
    every row of the group's batch."""
    batch = dict(batch)
    if "labels" not in batch:
        batch["labels"] = torch.full_like(batch["input_ids"], losses.IGNORE_INDEX)
    step = engine.run(batch, train=False, keep_logits=True)
    rows, seq = batch["input_ids"].shape
    ids, logits = torch.zeros(rows, seq, dtype=torch.long, device=engine.device), None
    head = engine.plan.language_model is not None and engine.plan.language_model.head
    if head:
        parts = []
        for mb_logits, index in step.logits:
            local = mb_logits.argmax(-1)
            if index is not None:  # each CP rank fills its tokens; the maximum over ranks is the whole row
                length = index.max().reshape(1) + 1 if index.numel() else index.new_zeros(1)
                dist.all_reduce(length, op=dist.ReduceOp.MAX, group=engine.groups.cp)
                full = torch.full((local.shape[0], int(length)), -1, dtype=torch.long, device=engine.device)
                full[:, index] = local
                dist.all_reduce(full, op=dist.ReduceOp.MAX, group=engine.groups.cp)
                local = full
            parts.append(local[:, :seq])
        ids = torch.cat(parts)
        if engine.cp_size == 1:
            logits = torch.cat([mb_logits for mb_logits, _ in step.logits])[:, :seq]
    if engine.exchange is not None:  # each language-model replica's head fills its own rows of the group's batch
        full = torch.zeros(rows, seq, dtype=torch.long, device=engine.device)
        if head and engine.coord.cp == 0 and engine.coord.tp == 0:
            mine = [r for mb in step.rows for r in mb]
            full[torch.tensor(mine, device=engine.device)] = ids
        if engine.groups.replica is not None:
            dist.all_reduce(full, group=engine.groups.replica)
        return {"logits": logits, "predicted_ids": full}
    if engine.groups.replica is not None:
        last = engine.layout.stages[-1]
        dist.broadcast(ids, engine.layout.rank(last, engine.coord.dp), group=engine.groups.replica)
    return {"logits": logits, "predicted_ids": ids}


def run_layers(run, hidden: torch.Tensor, sl, checkpointing: bool) -> torch.Tensor:
    """``run(hidden, start, end)`` over slice ``sl``, layer by layer under activation checkpointing when it is on
    and autograd records (a no_grad stage has nothing to recompute); all-gather CP attention then keeps only its
    local keys and values for backward (``gathered_kv_recomputed``), in the forward and in its recomputation."""
    if not (checkpointing and torch.is_grad_enabled()):
        return run(hidden, sl.start, sl.end)

    def recomputable(h, start, end):
        with gathered_kv_recomputed():
            return run(h, start, end)

    for i in range(sl.start, sl.end):
        hidden = checkpoint(recomputable, hidden, i, i + 1, use_reentrant=False)
    return hidden


def encode(enc, name, sl, items, received, checkpointing: bool, project: bool = True):
    """Run a stage's slice ``sl`` of encoder ``enc`` on ``items`` (from its embedding or ``received`` hidden states);
    at the head, the projected features (``project``) or the tower's."""
    inputs = enc.preprocess(items) if enc.preprocess and not sl.embed else items
    if sl.embed:
        hidden, ctx = enc.embed(items)
    else:
        ctx = enc.family.context(enc.module, inputs)
        hidden = enc.family.stage_input(enc.module, received[name], ctx)
    hidden = run_layers(lambda h, a, b: enc.run_layers(h, ctx, a, b), hidden, sl, checkpointing)
    if not sl.head:
        return enc.family.stage_output(enc.module, hidden, ctx)
    return enc.head(hidden, ctx, items) if project else enc.family.final(enc.module, hidden, ctx)


def head_output(features: torch.Tensor, sharded_head: bool) -> torch.Tensor:
    """The features an encoder stage's head returns: under FSDP (``sharded_head``) a copy, where not the encoder CP
    gather's output.

    The root unit's pre-backward hook is on the stage's output. When that tensor is the projector's own output, the
    projector's hook (registered first) fires before the root's; when it is made outside every unit (the gather's, a
    family head that packs or reshapes after projecting), the root's fires first. Backward then all-gathers the
    units in a different order, so every rank of a shard group must take the same side whatever its data (a replica
    without an item beside one gathering its CP ranks' items: "Received data size doesn't match"). A copy puts every
    rank on the gather's side: the root first, then the projector."""
    return features.clone() if sharded_head and features.requires_grad else features


@functools.lru_cache(maxsize=8)
def stand_in_items(enc, device) -> dict:
    """The one item a rank with nothing to encode runs under FSDP: the same on every stage of the encoder (made and
    moved to ``device`` once per encoder, not per microbatch)."""
    items = enc.family.random_inputs(enc.config, 1, generator=torch.Generator().manual_seed(0))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in items.items()}


def replica_reducer(params: list[torch.nn.Parameter], built: BuiltStage, bucket_mb: float) -> GradientReducer:
    """The bucketed all-reduce over a stage's replicas and CP ranks of its trainable parameters, but those FSDP
    reduces and the experts (summed over their own group in ``sync_gradients``)."""
    keep_grads_like_parameters(p for p in params if id(p) not in built.fsdp_params)
    separate = built.fsdp_params | {id(p) for p in built.expert_params}
    return GradientReducer([p for p in params if id(p) not in separate], built.meshes.grad, bucket_mb)


def context_planners(model, layout: RankLayout, holding: StageHolding, method: str, block_size: int):
    """What a stage plans CP with (the data loader gets the same planners: ``CPPlanCollate``): its cp size, the
    encoder cp (items split over CP ranks on an encoder stage), the encoders' item planners and the LLM's block
    owners (None without LLM CP)."""
    cp, plan = layout.cp[holding.stage], holding.plan
    encoder_cp = cp if plan.language_model is None else 1
    items = {e: EncoderItems.of(model.encoders[e], encoder_cp) for e in plan.encoders} if encoder_cp > 1 else {}
    blocks = (BlockOwners(cp, method, block_size, layout.ulysses, llm_windows(model))
              if plan.language_model is not None and cp > 1 else None)
    return cp, encoder_cp, items, blocks


def deepstack_message(model, stacks: dict, sl, device) -> dict[str, torch.Tensor]:
    """The DeepStack features an LLM stage's slice ``sl`` passes on (those of layers on later stages, the keys
    ``deepstack_keys`` names), from its ``AttentionContext.deepstack``."""
    out = {}
    for name, k in model.deepstack.items():
        if k > sl.end:
            stack = stacks.get(name)
            out[DEEPSTACK_KEY + name] = stack.features[:, sl.end - stack.first:] if stack is not None else \
                torch.zeros(0, k - sl.end, model.hidden_size, device=device)
    return out


def received_deepstack(model, message: dict) -> dict[str, torch.Tensor]:
    """The DeepStack features a message from the previous LLM stage carries, by modality."""
    return {n: message[DEEPSTACK_KEY + n] for n in model.deepstack if DEEPSTACK_KEY + n in message}


def check_stage(model, layout: RankLayout, num_microbatches: int) -> GroupRouter | None:
    """Refuse, before any group exists, what the layout cannot run; return per-module data parallelism's router of
    a group's rows between modules (None without it)."""
    router = None
    if layout.per_module_dp:
        encoders = model.pipeline_encoders  # a shared encoder's items route with its owner's (one tower)
        router = GroupRouter({e: EncoderItems.of(enc, 1) for e, enc in model.encoders.items()},
                             {e: layout.per_group(e) for e in encoders}, layout.per_group(LANGUAGE_MODEL),
                             num_microbatches, model.shared_encoders)
    check_expert_parallel(model, layout)
    return router


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
