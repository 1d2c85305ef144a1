"""The pipeline runtime: executes this rank's action list of the multimodal 1F1B schedule.

Every rank of a replica sees the same batch (the sampler runs over replicas), so anything derivable from the
batch (encoder contexts, mask words, positions, labels) is recomputed where it is needed and only hidden
states and features travel between stages. Frozen-aware: a stage with nothing trainable in or upstream of it
runs forward under ``no_grad`` and takes no part in backward; a frozen stage with trainable parameters upstream
computes input gradients only (autograd builds no weight-gradient graph for frozen parameters). With
``activation_checkpointing`` every encoder and LLM layer that records autograd keeps only its input and runs its
forward again in backward (the planner costs this as B += F, memory as the layer inputs only).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from lightning_mm import loss as losses
from lightning_mm.data.microbatch import split_microbatches
from lightning_mm.parallel.context import pad_for_context_parallel
from lightning_mm.parallel import p2p
from lightning_mm.parallel.layout import RankLayout
from lightning_mm.parallel.schedule import LANGUAGE_MODEL, build_stage_graph, check_schedule, one_f_one_b
from lightning_mm.parallel.stages import (StagePlan, check_untied, owned_parameters, prune, resolve_partition,
                                          stage_plans)


class ProcessGroups:
    """The groups a rank needs, created in the same order on every rank (as ``new_group`` requires)."""

    def __init__(self, layout: RankLayout, rank: int):
        coord = layout.coordinate(rank)
        self.grad = None
        for stage in layout.stages:
            ranks = layout.grad_group_ranks(stage)
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if stage == coord.stage:
                self.grad, self.grad_size = group, len(ranks)
        self.dp = None
        for stage in layout.stages:
            for c in range(layout.widths[stage]):
                ranks = layout.dp_group_ranks(stage, c)
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if (stage, c) == (coord.stage, coord.cp):
                    self.dp = group
        self.cp = None
        for stage in layout.stages:
            if layout.widths[stage] > 1:
                for d in range(layout.dp):
                    group = dist.new_group(layout.stage_ranks(stage, d))
                    if (stage, d) == (coord.stage, coord.dp):
                        self.cp = group


class PipelineEngine:
    """One rank's stage of ``model`` (pruned to it) and the schedule that drives it."""

    def __init__(self, model, layout: RankLayout, rank: int, num_microbatches: int, partition="uniform",
                 cp_distribution: str = "lpt", cp_block_size: int = 128, activation_checkpointing: bool = False):
        self.model, self.layout, self.rank, self.num_microbatches = model, layout, rank, num_microbatches
        self.cp_distribution, self.cp_block_size = cp_distribution, cp_block_size
        self.activation_checkpointing = activation_checkpointing
        self.coord = layout.coordinate(rank)
        encoder_names = list(model.encoders)
        layer_counts = resolve_partition(model, layout.module_stages, partition, recompute=activation_checkpointing)
        check_untied(model, layout.module_stages[LANGUAGE_MODEL])
        self.plans: dict[str, StagePlan] = stage_plans(layer_counts, layout.placement, encoder_names)
        params = dict(model.named_parameters())
        owned = {s: owned_parameters(model, p) for s, p in self.plans.items()}
        trainable = {s: any(params[n].requires_grad for n in names) for s, names in owned.items()}
        if not any(trainable.values()):
            raise ValueError("the model has no trainable parameter: unfreeze something (model.freeze(projectors=False))")
        self.graph = build_stage_graph({e: layout.module_stages[e] for e in encoder_names},
                                       layout.module_stages[LANGUAGE_MODEL], layout.placement, trainable)
        self.train_actions = one_f_one_b(self.graph, num_microbatches)
        check_schedule(self.graph, self.train_actions, num_microbatches)
        frozen = build_stage_graph({e: layout.module_stages[e] for e in encoder_names},
                                   layout.module_stages[LANGUAGE_MODEL], layout.placement,
                                   {s: False for s in trainable})
        self.eval_actions = one_f_one_b(frozen, num_microbatches)
        self.stage = self.coord.stage
        self.plan = self.plans[self.stage]
        self.node = self.graph.node(self.stage)
        self.llm_hidden = model.hidden_size
        self.owned = owned[self.stage]
        prune(model, self.owned)
        self.cp_size = layout.widths[self.stage]
        self.groups = ProcessGroups(layout, rank)
        self.timings: list[tuple[str, int, float, float]] = []  # (kind, microbatch, start, end) of the last step

    # ------------------------------------------------------------------ helpers
    def peer_ranks(self, stage: str) -> list[int]:
        """Ranks of a neighbouring stage this rank exchanges with: the same CP rank between LLM stages, every
        CP rank of the LLM's first stage for an encoder, the encoder's one rank for a CP rank."""
        width, own = self.layout.widths[stage], self.cp_size
        if width == own:
            return [self.layout.rank(stage, self.coord.dp, self.coord.cp)]
        return self.layout.stage_ranks(stage, self.coord.dp) if own == 1 else [self.layout.rank(stage, self.coord.dp)]

    def cp_owners(self, mbs: list[dict]) -> list[torch.Tensor] | None:
        """Each microbatch's CP distribution as the owning rank of every block, made once at the LLM's first stage;
        it travels down the LLM pipeline with the hidden states (``"cp_owner"``)."""
        from lightning_mm.parallel.context import distribute

        if self.cp_size == 1 or not self.plan.language_model.embed:
            return None
        owners = []
        for mb in mbs:
            plan = distribute(mb["bam"], self.cp_size, self.cp_distribution, self.cp_block_size, mb.get("segment_ids"))
            owner = torch.empty(sum(len(p) for p in plan), dtype=torch.long)
            for r, blocks in enumerate(plan):
                owner[blocks] = r
            owners.append(owner)
        return owners

    def forward_keys(self, stage: str) -> list[str]:
        """Keys of the activation message a stage sends (gradients come back for ``plans[stage].output_keys``)."""
        plan = self.plans[stage]
        cp = plan.language_model is not None and self.layout.widths[stage] > 1
        return plan.output_keys + (["cp_owner"] if cp else [])

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
            return torch.zeros(0, self.llm_hidden if sl.head else 0)
        inputs = enc.preprocess(mb[name]) if enc.preprocess and not sl.embed else mb[name]
        if sl.embed:
            hidden, ctx = enc.embed(mb[name])
        else:
            hidden, ctx = received[name], enc.family.context(enc.module, inputs)
        hidden = self._run_layers(lambda h, a, b: enc.run_layers(h, ctx, a, b), hidden, sl.start, sl.end)
        return enc.head(hidden, ctx, mb[name]) if sl.head else hidden

    def _language_part(self, mb, received, num_label_tokens, owner):
        sl, model = self.plan.language_model, self.model
        if not sl.embed and self.cp_size > 1:
            owner = received[self.graph.predecessors(self.stage)[0]]["cp_owner"]
        ctx = model.attention_context(mb["input_ids"], mb.get("bam"), mb.get("segment_ids"), mb.get("position_ids"),
                                      mb.get("attention_mask"))
        targets = losses.shift_labels(mb["labels"])  # shifted on the whole sequence, before any sharding
        local = (lambda t: t) if owner is None else self._sharder(owner, mb["input_ids"].shape[1])
        if owner is not None:
            ctx = type(ctx)(position_ids=local(ctx.position_ids), bam=local(ctx.bam),
                            segment_ids=None if ctx.segment_ids is None else local(ctx.segment_ids),
                            token_index=local(torch.arange(mb["input_ids"].shape[1]).expand_as(mb["input_ids"])),
                            cp_group=self.groups.cp)
        if sl.embed:
            features = {k: v for msg in received.values() for k, v in msg.items()}
            features.update({e: self._encoder_part(e, s, mb, {}) for e, s in self.plan.encoders.items()})
            hidden = local(model.embed(mb["input_ids"], {k: v for k, v in features.items() if v.numel()}))
        else:
            hidden = received[self.graph.predecessors(self.stage)[0]]["hidden"]
        hidden = self._run_layers(lambda h, a, b: model.run_llm_layers(h, ctx, a, b), hidden, sl.start, sl.end)
        if not sl.head:
            return {"hidden": hidden} if owner is None else {"hidden": hidden, "cp_owner": owner}
        loss_sum = losses.token_loss_sum(model.logits(hidden), local(targets))
        return {"loss_sum": loss_sum, "loss": losses.normalise(loss_sum, num_label_tokens)}

    def _sharder(self, owner: torch.Tensor, seq_len: int):
        from lightning_mm.parallel.context import token_index

        blocks = torch.nonzero(owner == self.coord.cp).flatten()
        idx = token_index(blocks, self.cp_block_size, seq_len)
        return lambda t: t.index_select(1, idx.to(t.device))

    def forward_stage(self, mb, received, num_label_tokens, owner=None):
        if self.plan.language_model is not None:
            return self._language_part(mb, received, num_label_tokens, owner)
        pred = self.graph.predecessors(self.stage)
        msg = received[pred[0]] if pred else {}
        return {e: self._encoder_part(e, sl, mb, msg) for e, sl in self.plan.encoders.items()}

    # ------------------------------------------------------------------ the schedule
    def run(self, batch: dict, train: bool = True, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward (and backward when ``train``) of every microbatch; returns the global normalised loss.

        Gradients are those of ``loss_scale * loss`` (Lightning divides by the gradient-accumulation steps)."""
        self.model.check_placeholders(batch["input_ids"], {e: batch[e] for e in self.model.encoders if e in batch})
        mbs = split_microbatches(batch, self.num_microbatches, self.model)
        mbs = [pad_for_context_parallel(mb, self.cp_size, self.cp_block_size) for mb in mbs]  # short CP sequences
        owners = self.cp_owners(mbs) if self.plan.language_model is not None else None
        count = losses.count_label_tokens(batch["labels"]).reshape(1).float()
        if self.groups.dp is not None:
            dist.all_reduce(count, group=self.groups.dp)
        actions = (self.train_actions if train else self.eval_actions)[self.stage]
        needs_grad = train and self.node.needs_backward
        received, outputs, input_grads, out_grads = {}, {}, {}, {}
        pending, loss_sum = [], torch.zeros(())
        self.timings = []
        for act in actions:
            m = act.microbatch
            t0 = time.perf_counter()
            if act.kind == "recv_fwd":
                msg = p2p.recv(self.forward_keys(act.peer), self.peer_ranks(act.peer)[0])
                if needs_grad and self.graph.node(act.peer).needs_backward:
                    for t in msg.values():
                        if t.is_floating_point():
                            t.requires_grad_(True)
                received.setdefault(m, {})[act.peer] = msg
            elif act.kind == "forward":
                with torch.set_grad_enabled(needs_grad):
                    out = self.forward_stage(mbs[m], received.get(m, {}), count, owners and owners[m])
                if "loss_sum" in out:
                    loss_sum = loss_sum + out["loss_sum"].detach()
                outputs[m] = out
                if not needs_grad:
                    received.pop(m, None)
            elif act.kind == "send_fwd":
                for dst in self.peer_ranks(act.peer):
                    pending += p2p.send(outputs[m], self.forward_keys(self.stage), dst)
                if not needs_grad:
                    outputs.pop(m)
            elif act.kind == "recv_bwd":
                parts = [p2p.recv(self.plan.output_keys, src) for src in self.peer_ranks(act.peer)]
                out_grads[m] = {k: sum(part[k] for part in parts) for k in self.plan.output_keys}
            elif act.kind == "backward":
                self._backward(outputs.pop(m), out_grads.pop(m, None), loss_scale)
                inputs = received.pop(m, {})
                input_grads[m] = {p: {k: (t.grad if t.grad is not None else torch.zeros_like(t))
                                      for k, t in msg.items() if t.is_floating_point()}
                                  for p, msg in inputs.items()}
            elif act.kind == "send_bwd":
                pending += p2p.send(input_grads[m].pop(act.peer), self.plans[act.peer].output_keys,
                                    self.peer_ranks(act.peer)[0])
            self.timings.append((act.kind, m, t0, time.perf_counter()))
        for work, _ in pending:
            work.wait()
        dist.all_reduce(loss_sum)
        return losses.normalise(loss_sum, count[0])

    @staticmethod
    def _backward(out: dict, grads: dict | None, loss_scale: float) -> None:
        if "loss" in out:
            if out["loss"].requires_grad:
                torch.autograd.backward(out["loss"] * loss_scale)
            return
        pairs = [(t, grads[k]) for k, t in out.items() if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    # ------------------------------------------------------------------ gradients
    def sync_gradients(self) -> None:
        """Sum gradients over every rank holding the same parameters (data-parallel replicas, CP ranks).

        Sums, not averages: each replica's loss is already divided by the global label count. A parameter
        unused on every replica keeps ``grad=None`` (as in one process), so optimisers skip it alike.
        """
        params = self.trainable_parameters()
        if self.groups.grad is None or not params:
            return
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.groups.grad)
        live = [p for p, u in zip(params, used.tolist()) if u]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if live:
            flat = torch.cat([p.grad.reshape(-1) for p in live])
            dist.all_reduce(flat, group=self.groups.grad)
            at = 0
            for p in live:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of all trainable gradients of the whole model (every stage, counted once)."""
        sq = sum((p.grad.float() ** 2).sum() for p in self.trainable_parameters() if p.grad is not None)
        sq = torch.as_tensor(sq, dtype=torch.float64) / self.groups.grad_size
        dist.all_reduce(sq)
        return sq.sqrt()

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        norm = self.global_grad_norm()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1:
            for p in self.trainable_parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm
