"""Sharded data parallelism with FSDP2: the data-parallel (and CP) ranks of a stage shard its state.

``fully_shard`` over the stage's "dp_cp" mesh dim (the ranks that hold the same parameters): one unit per encoder
and LLM layer, the LLM's embedding, its final norm and head, and each projector, so FSDP gathers a unit's
parameters right before it runs and reduce-scatters its gradients right after its backward; and the stage itself
(``StageModule``, whose forward runs one microbatch) as the root unit, which holds what is left (patch and
position embeddings, encoder final norms: parameters some adapters read directly). Under tensor parallelism the
units shard the already tp-split DTensors again over dp_cp (2-D), as torchtitan composes them. Gradients are
summed, not averaged: each replica's loss is already divided by the global label count. Under expert parallelism
the routed experts stay out of FSDP (``ignored``): they are already split over the ep ranks and their gradients are
summed over the ranks holding the same experts; FSDP shards everything else of the stage over dp_cp.

When the reduce-scatter runs (``fsdp_reduce``): "microbatch" after every microbatch's backward (each unit's
gradients sharded at once: least memory, the traffic of one reduction per microbatch), or "step" once per optimiser
step, in its last backward (the units accumulate unsharded gradients until then, as ``torch.distributed.pipelining``
and torchtitan do under a pipeline, and as Lightning's ``ModelParallelStrategy`` does while accumulating batches:
one reduction's traffic per step, a whole stage's gradients held unsharded through it).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_mm.plan.layout import RankLayout
from lightning_mm.plan.stages import StagePlan

SHARDING_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
FSDP_REDUCE = ("microbatch", "step")


def check_sharding(sharding_strategy: str, fsdp_reduce: str) -> None:
    """Raise (with the choices) for an unknown sharding strategy or reduce-scatter timing."""
    if sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"unknown sharding_strategy {sharding_strategy!r}; use one of {SHARDING_STRATEGIES} "
                         "(the names of Lightning's FSDPStrategy)")
    if fsdp_reduce not in FSDP_REDUCE:
        raise ValueError(f"unknown fsdp_reduce {fsdp_reduce!r}; use 'microbatch' (FSDP reduce-scatters after every "
                         "microbatch's backward) or 'step' (once per optimiser step)")


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for Lightning's precision setting: "bf16-mixed" / "16-mixed" gather parameters in half
    precision and reduce gradients in fp32; everything else keeps the parameters' dtype."""
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32 if half else None)


def nothing_to_shard(layout: RankLayout, sharding_strategy: str) -> str | None:
    """Why ``sharding_strategy`` shards no stage of ``layout`` (every stage's parameters have one holder), or None
    when it shards some stage or is NO_SHARD."""
    if sharding_strategy == "NO_SHARD" or any(layout.fsdp_ranks(s) > 1 for s in layout.stages):
        return None
    return (f"sharding_strategy={sharding_strategy!r} shards nothing in this layout: FSDP shards a stage over the "
            "ranks that hold the same parameters (its replicas x CP ranks), and no stage has more than one; every "
            "rank holds its whole stage. Give a module dp or cp > 1 to shard it, or use sharding_strategy='NO_SHARD'")


def sharding_units(model, plan: StagePlan) -> list[nn.Module | list[nn.Module]]:
    """The modules of this stage that become FSDP units (a tied embedding and head form one unit; a unit without
    parameters is skipped). An encoder sharing another's tower and projector (a composite's video modality) adds
    none of its own: they are one unit each, run by both."""
    units: list = []
    seen: set[int] = set()
    for name, sl in plan.encoders.items():
        enc = model.encoders[name]
        for m in [*(enc.layers[i] for i in range(sl.start, sl.end)), *([enc.projector] if sl.head else [])]:
            if id(m) not in seen:
                seen.add(id(m))
                units.append(m)
    if plan.language_model is not None:
        sl, lm, fam = plan.language_model, model.language_model, model.lm_family
        units += [fam.layers(lm)[i] for i in range(sl.start, sl.end)]
        embed = fam.embed_tokens(lm)
        tied = sl.head and isinstance(lm.lm_head, nn.Linear) and lm.lm_head.weight is getattr(embed, "weight", None)
        if sl.head:
            units.append(fam.final_modules(lm)["norm"])
            units.append([embed, lm.lm_head] if tied else lm.lm_head)
        if sl.embed and not tied:
            units.append(embed)
    return units


class StageModule(nn.Module):
    """A pipeline stage as one module: ``forward`` runs ``run`` (one microbatch of the stage) over ``model``;
    ``fsdp_reduce``: when its units reduce-scatter their gradients (``gradient_sync``)."""

    def __init__(self, model: nn.Module, run, fsdp_reduce: str = "microbatch"):
        super().__init__()
        self.model, self.run, self.fsdp_reduce = model, run, fsdp_reduce

    def forward(self, *args):
        return self.run(*args)


def gradient_sync(run_stage, last: bool) -> None:
    """Before a backward: under ``fsdp_reduce="step"`` the sharded stage reduce-scatters in it only when it is the
    ``last`` of the optimiser step (every rank of a shard group runs the same schedule, so all agree)."""
    if isinstance(run_stage, StageModule) and run_stage.fsdp_reduce == "step":
        run_stage.set_requires_gradient_sync(last)


def _sum_gradients(module) -> None:
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # plain sums (no PREMUL_SUM, which gloo lacks)


def apply_fsdp(model, plan: StagePlan, mesh, sharding_strategy: str, run, precision: str = "32-true",
               ignored: list[nn.Parameter] = (), fsdp_reduce: str = "microbatch") -> StageModule:
    """Shard this stage over ``mesh`` (1-D, the stage's dp_cp ranks), leaving the ``ignored`` parameters (the
    expert-parallel experts) as they are; returns the root ``StageModule`` whose forward runs ``run``.
    ``SHARD_GRAD_OP`` keeps gathered parameters from forward to backward."""
    policy = mixed_precision_policy(precision)
    ignored_ids = {id(p) for p in ignored}
    for unit in sharding_units(model, plan):
        modules = unit if isinstance(unit, list) else [unit]
        if not any(p.numel() for m in modules for p in m.parameters() if id(p) not in ignored_ids):
            continue
        fully_shard(unit, mesh=mesh, reshard_after_forward=sharding_strategy == "FULL_SHARD", mp_policy=policy,
                    ignored_params=set(ignored) or None)
        for m in modules:
            _sum_gradients(m)
    root = StageModule(model, run, fsdp_reduce)  # inputs keep their dtype: label counts and positions must stay exact
    fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=set(ignored) or None,
                mp_policy=MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, cast_forward_inputs=False))
    _sum_gradients(root)
    return root
