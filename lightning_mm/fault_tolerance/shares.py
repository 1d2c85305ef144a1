"""One rank's share of each step under fault tolerance: the slice of the global batch (or of each of its
micro-batches under gradient accumulation) this rank loads after the quorum, placed over the group's replicas and
microbatches (contiguously, by ``batch_balancing``, or over a per-module data-parallel group), and each
micro-batch's loss weight. A mixin of ``FaultTolerantTraining`` (``training.py``), whose state it reads."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mm.data.microbatch import PLAN_KEY
from lightning_mm.fault_tolerance import layerwise
from lightning_mm.fault_tolerance.config import FaultToleranceError
from lightning_mm.fault_tolerance.sampler import global_batch_indices, group_shares, microbatch_plan, placed_rows


class StepShares:
    """This rank's share of a step: ``share_of_batch`` (the slice), ``plan_microbatches`` (its microbatch plan)
    and, with ``accumulate_grad_batches=k``, the step's k micro-batches and their loss weights."""

    accumulate = 1  # Lightning's accumulate_grad_batches: global micro-batches per optimiser step

    def share_templates(self) -> list:
        """The groups' templates the global batch is split by ([None]: evenly by ``participants``)."""
        return self.state.sync.templates if self.layerwise else [None]

    def reset_shares(self) -> None:
        self._batches: list[dict] = []  # this rank's share of each micro-batch of the step, on the host
        self._micro = 0  # the next micro-batch of the step to run
        self._weights = [1.0]  # each micro-batch's loss weight (accumulation: exact across groups)
        self._running = 0  # the micro-batch being run
        self._replay = False  # a redone step with accumulation runs its earlier micro-batches itself

    def load_step(self, step: int, position: int) -> None:
        """Every micro-batch share of the step, and the group's weight across groups (its label tokens; with
        accumulation, equal weights and per-micro-batch loss weights); a redone step's earlier micro-batches."""
        self._batches = [self.share_of_batch(step, position, j) for j in range(self.accumulate)]
        self.state.label_tokens = (self._label_tokens(self._batches[0]) if self.accumulate == 1
                                   else self._weigh_micro_batches(self._batches))
        if self._replay:
            self._replay = False
            self._rerun_earlier_micro_batches()

    # ------------------------------------------------------------------ the share of the batch and its plan
    def share_of_batch(self, step: int, position: int, micro: int = 0) -> dict:
        """This rank's samples of the step's global batch (with accumulation: of its micro-batch ``micro``, global
        batch ``step * k + micro`` of the sampler), collated: the group's slice (even, or by the templates'
        planned step times, Eq. 2.6), then this data-parallel replica's even slice of it."""
        s, d, st = self.strategy, self.data, self.state
        indices = global_batch_indices(step * self.accumulate + micro, d["num_samples"], d["global_batch"],
                                       d["shuffle"], d["seed"])
        templates = self.share_templates()
        if self.layerwise and None not in templates:
            shares = layerwise.template_shares(templates, len(indices), self._rows_per_microbatch())
        else:
            shares = group_shares(len(indices), [1.0] * st.participants)
        lo, hi = shares[position]
        self.shares[step] = self.shares.get(step, 0) * (micro > 0) + hi - lo
        dp, replica = s.layout.dp, s.layout.coordinate(s.global_rank).dp
        if (b := d["balance"]) or s.layout.per_module_dp:
            rows = placed_rows(indices[lo:hi], dp, self._members(), self._rows_per_microbatch(),
                               *((b["method"], b["work"], b["stages"]) if b else ()))
            if rows:
                return d["placed"]([(d["dataset"][i], *mbs) for i, *mbs in rows])
            if s.layout.per_module_dp:
                raise FaultToleranceError(
                    f"step {step}: a share of {hi - lo} samples does not split over {dp} language-model replicas; "
                    "per-module data parallelism needs a global batch that splits over every quorum's replicas: "
                    "make the global batch a multiple of the groups' replicas times every group count it can have")
        rlo, rhi = group_shares(hi - lo, [1.0] * dp)[replica]
        mine = indices[lo:hi][rlo:rhi]
        if not mine:
            raise FaultToleranceError(
                f"step {step}: {st.participants} replica groups of {dp} data-parallel replicas share a global batch "
                f"of {len(indices)} samples, so a replica gets none; raise the batch size or lower num_replica_groups")
        return d["collate"]([d["dataset"][i] for i in mine])

    def plan_microbatches(self, batch: dict) -> dict:
        """Microbatches of about the usual row count (more of them for a larger share), as a microbatch plan (a
        balanced share comes planned)."""
        if PLAN_KEY in batch:
            self.use_microbatches(max(batch[PLAN_KEY]["encoder"]) + 1)
            return batch
        rows = batch["input_ids"].shape[0]
        plan = microbatch_plan(rows, self._rows_per_microbatch())
        self.use_microbatches(plan[-1] + 1)
        ids = batch["input_ids"]
        placeholders = self.strategy.multimodal_model().placeholder_ids
        tokens = {name: (ids == pid).sum(1).tolist() for name, pid in placeholders.items()}
        batch[PLAN_KEY] = {"encoder": list(plan), "llm": list(plan), "tokens": tokens}
        return batch

    def _members(self) -> list[int]:
        """The language-model replicas whose rows this rank loads: its own, or its per-module group's."""
        from lightning_mm.plan.placement import LANGUAGE_MODEL

        lay, rank = self.strategy.layout, self.strategy.global_rank
        if not lay.per_module_dp:
            return [lay.coordinate(rank).dp]
        first = lay.group_of(rank) * lay.per_group(LANGUAGE_MODEL)
        return list(range(first, first + lay.per_group(LANGUAGE_MODEL)))

    def _rows_per_microbatch(self) -> int:
        """The usual microbatch: the loader's batch over the strategy's microbatches."""
        return max(1, self.data["batch_size"] // self._nominal_microbatches)

    def use_microbatches(self, count: int) -> None:
        """The runner's schedule for ``count`` microbatches; the strategy's count follows (the module checks each
        batch's plan against it)."""
        s = self.strategy
        s.engine.set_num_microbatches(count)
        s.num_microbatches = count

    def _label_tokens(self, batch: dict) -> torch.Tensor:
        """The step's label tokens over the group's data-parallel replicas: the group's weight across groups."""
        return self.strategy.engine.label_count(batch)

    # ------------------------------------------------------------------ placement and accumulation
    def _placed_collate(self, dataloader):
        """The collate of shares placed by ``placed_rows`` (balanced, or per-module data parallelism): the loader's,
        plus each row's microbatches (and replica and routing between modules' replicas, per-module)."""
        from lightning_mm.data.balanced import BalancedCollate

        s = self.strategy
        router = s.engine.exchange.router if s.layout.per_module_dp else None
        return BalancedCollate(dataloader.collate_fn, s.multimodal_model().placeholder_ids, router=router)

    def _balancing(self, dataloader, dataset):
        """A named ``batch_balancing``: (method, its per-sample work, the pipeline depth), or None. The group's
        share of each step is placed over its replicas and microbatches (``placed_rows``)."""
        from lightning_mm.data.balanced import balancing_obstacle, metadata_works
        from lightning_mm.planner.heterogeneity import num_pipeline_stages

        s = self.strategy
        method = s.batch_balancing
        if method in (None, "none"):
            return None
        if obstacle := balancing_obstacle(dataloader):
            raise FaultToleranceError(f"batch_balancing={method!r} cannot serve this training loader: {obstacle}; "
                                      "give a map-style data set with sample_metadata(i), or batch_balancing='none'")
        model = s.multimodal_model()
        return dict(method=method, work=metadata_works(dataset, s.workload, model),
                    stages=num_pipeline_stages(s.engine.graph))

    def _next_micro_batch(self) -> dict:
        """The step's next micro-batch share, planned in microbatches, on the device."""
        self._running, self._micro = self._micro, (self._micro + 1) % self.accumulate
        return self.strategy.batch_to_device(self.plan_microbatches(self._batches[self._running]))

    def _weigh_micro_batches(self, batches: list[dict]) -> torch.Tensor:
        """With accumulation, micro-batch j's loss (normalised by the group's C_gj label tokens) is weighted by
        N * C_gj / C_j, C_j the label tokens of the whole global micro-batch (one all-reduce across the N groups):
        the plain mean across groups is then one process's gradient, each micro-batch's mean loss over k. Returns
        the group's weight across groups (equal for all)."""
        s = self.strategy
        counts = torch.cat([s.engine.label_count(b) for b in batches])
        totals = counts.clone()
        self.manager.allreduce(totals, reduce_op=dist.ReduceOp.SUM).wait()  # a failure fails the commit vote
        self._weights = (self.state.participants * counts / torch.clamp(totals, min=1.0)).tolist()
        return torch.ones(1, device=s.root_device)

    def _rerun_earlier_micro_batches(self) -> None:
        """A redone step with accumulation: Lightning's closure reruns only the last micro-batch, so the earlier
        ones of the new quorum's shares run here first (their gradients accumulate; Lightning's backward hooks
        see only the last one)."""
        s = self.strategy
        for j in range(self.accumulate - 1):
            with s.block_backward_sync():
                s.lightning_module.training_step(self._next_micro_batch(), j)

    def loss_weight(self) -> float:
        """The running micro-batch's loss weight (1 without accumulation)."""
        return self._weights[self._running] if self.accumulate > 1 else 1.0
