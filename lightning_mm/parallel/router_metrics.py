"""The router's load-balancing loss and expert load of a mixture-of-experts LLM over one pipeline step.

Each microbatch's router statistics travel down the LLM's stages with the hidden states
(``lightning_mm.model.moe.RouterStats``, message key ``ROUTER_KEY``); the stage holding the head turns them into
the microbatch's aux loss. A step's aux loss is the mean over the ``M`` microbatches of every one of the ``dp``
replicas, so each microbatch adds ``coef * aux / (M * dp)`` to the loss it runs backward on (``coef``: the config's
``router_aux_loss_coef`` when ``output_router_logits`` is on, else 0). The expert load (tokens routed to each
expert, per layer) is summed over every rank that routes tokens, counted once over tensor-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mm.model.moe import RouterStats, is_moe

ROUTER_KEY = "router_stats"


class StepRouterMetrics:
    """One rank's share of a step's router metrics; ``finish`` makes them global (a collective on every rank).

    ``metrics`` after ``finish``: ``aux_loss`` (the step's mean per-microbatch aux loss), ``expert_load``
    ``[routed layers, num_experts]`` (tokens routed to each expert) and ``layers``, the routed layers' indices."""

    def __init__(self, model, num_microbatches: int, replicas: int, cp_group, counted: bool):
        fam, lm = model.lm_family, model.language_model
        self.coef = fam.aux_loss_coef(lm)
        self.num_experts = fam.num_experts(lm)
        self.num_layers = len(fam.layers(lm))
        self.routed = sorted(fam.routers(lm))  # before pruning: every routed layer of the model
        self.divisor = num_microbatches * replicas
        self.cp_group, self.counted = cp_group, counted  # counted: False on all but one tensor-parallel rank
        self.metrics: dict | None = None

    @staticmethod
    def of(model, num_microbatches: int, replicas: int, cp_group, counted: bool) -> "StepRouterMetrics | None":
        return StepRouterMetrics(model, num_microbatches, replicas, cp_group, counted) \
            if is_moe(model.lm_family) else None

    def begin(self, device) -> None:
        self.aux_sum = torch.zeros((), device=device)
        self.load = torch.zeros(self.num_layers, self.num_experts, device=device)

    def add(self, stats: RouterStats, head: bool) -> torch.Tensor | None:
        """File one microbatch's statistics of this stage; at the head, the term to add to its loss."""
        for layer, counts in stats.load.items():
            self.load[layer] += counts
        if not head:
            return None
        aux = stats.aux_loss(self.cp_group)
        self.aux_sum = self.aux_sum + aux.detach()
        return self.coef * aux / self.divisor

    def finish(self) -> torch.Tensor:
        """The step's aux loss times its coefficient (what it adds to the step's loss), on every rank."""
        both = torch.cat([self.aux_sum.reshape(1), self.load.flatten()])
        if not self.counted:
            both.zero_()
        dist.all_reduce(both)
        aux = both[0] / self.divisor
        self.metrics = {"aux_loss": aux, "layers": self.routed,
                        "expert_load": both[1:].view(self.num_layers, -1)[self.routed]}
        return self.coef * aux
