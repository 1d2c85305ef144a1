"""Expert parallelism: each LLM stage's routed experts split over ``ep`` of its data-parallel ranks.

transformers ships the plan (``config.base_model_ep_plan``: the experts' 3-D weights ``grouped_gemm``, i.e.
``Shard(0)`` over the expert dim, and the experts module ``ep_dispatch_experts``) and its runtime
(``transformers.distributed.expert_parallel``): ``AllToAllEP`` sends every (token, expert) pair to the rank holding
the expert with one all-to-all (dropless: every pair goes, the split sizes follow the routing), runs the local
experts, brings the outputs back with a second all-to-all and weights them on the sender; both all-to-alls are
differentiable. It runs under gloo on CPU as well as NCCL, so it is applied here as shipped (``apply_ep``).

Ranks: the replicas of the LLM chain, in order, form ``dp / ep`` groups of ``ep`` consecutive replicas; the ranks of
one group with the same pipeline stage, CP rank and tp rank are an "ep" group (they exchange tokens and each holds
``1 / ep`` of the experts). Tensor-parallel ranks hold the same hidden states: the dispatch sends each tp rank's
slice of the tokens (transformers' TP slicing), so no token is computed twice. Gradients of expert weights are
summed over the ranks holding the same experts (``meshes.expert_grad_ranks``: the same ep index, every group, CP rank and
tp rank); every other parameter keeps its usual reduction, FSDP2's included (the experts stay out of FSDP).
"""

from __future__ import annotations

import contextlib

from torch import nn

from lightning_mm.model.moe import expert_layer_plan
from lightning_mm.parallel.meshes import ExpertMeshes
from lightning_mm.plan.layout import RankLayout
from lightning_mm.plan.stages import StagePlan



def check_expert_parallel(model, layout: RankLayout) -> None:
    """ep > 1 needs a mixture-of-experts LLM with a plan and an ep dividing its expert count (and the LLM's dp:
    ``build_layout``). Pure: runs before any process group exists."""
    if layout.ep == 1:
        return
    lm = model.language_model
    if not model.lm_family.has_routed_experts(lm):
        raise ValueError(f"language_model ep={layout.ep}, but {type(lm).__name__} has no routed experts; use ep=1")
    expert_layer_plan(lm)
    experts = model.lm_family.num_experts(lm)
    if experts % layout.ep:
        raise ValueError(f"ep={layout.ep} does not divide the {experts} experts; choose an ep dividing {experts}")


def apply_ep(model, plan: StagePlan, meshes: ExpertMeshes) -> list[nn.Parameter]:
    """Split the routed experts of this stage's LLM layers over the ep mesh (transformers' plan and runtime);
    returns the expert parameters (their gradients are summed over ``meshes.grad`` only)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    sl, lm = plan.language_model, model.language_model
    if sl is None or meshes.ep is None:
        return []
    layer_plan = expert_layer_plan(lm)
    params: list[nn.Parameter] = []
    for i in range(sl.start, sl.end):
        layer = model.lm_family.layers(lm)[i]
        here = {k: v for k, v in layer_plan.items() if _has(layer, k)}  # dense layers (mlp_only_layers) have none
        if not here:
            continue
        apply_expert_parallelism(layer, meshes.ep, meshes.tp, here, ep_implementation="all_to_all")
        params += [layer.get_parameter(k) for k, v in here.items() if v == "grouped_gemm"]
    return params


@contextlib.contextmanager
def gathered_experts(model, plan: StagePlan):
    """Inside, the routed experts of this stage's LLM layers are whole on every rank of their ep group and run
    locally (the experts' own forward over all of them, no token all-to-all); after, the ep shards and transformers'
    dispatch are back. One all-gather per expert weight on entry, over the ep group (every rank of it enters
    together); then no collective runs per forward, so replicas may decode different numbers of steps. Costs the
    stage's whole expert weights on each rank (ep times its shard) while inside. No-op without expert parallelism."""
    from torch.distributed.tensor import DTensor

    sl, lm = plan.language_model, model.language_model
    saved: list[tuple] = []
    if sl is not None and model.lm_family.has_routed_experts(lm):
        layer_plan = expert_layer_plan(lm)
        for i in range(sl.start, sl.end):
            layer = model.lm_family.layers(lm)[i]
            for path, style in layer_plan.items():
                if style == "grouped_gemm" and _has(layer, path) and isinstance(layer.get_parameter(path), DTensor):
                    owner_path, _, name = path.rpartition(".")
                    owner, shard = layer.get_submodule(owner_path), layer.get_parameter(path)
                    saved.append((owner, name, shard, owner.__dict__.get("num_experts"),
                                  owner.__dict__.get("_is_expert_parallel")))
                    owner._parameters[name] = nn.Parameter(shard.full_tensor(), requires_grad=False)
                    owner.num_experts, owner._is_expert_parallel = shard.shape[0], False
                elif style == "ep_dispatch_experts" and _has(layer, path):
                    module = layer.get_submodule(path)
                    if "forward" in module.__dict__:  # transformers' dispatch, installed on the instance
                        saved.append((module, None, module.__dict__.pop("forward"), None, None))
    try:
        yield
    finally:
        for owner, name, kept, count, flag in reversed(saved):
            if name is None:
                owner.forward = kept
            else:
                owner._parameters[name] = kept
                owner.num_experts, owner._is_expert_parallel = count, flag


def local_expert_count(params: list[nn.Parameter]) -> int:
    """Elements of the expert weights this rank holds (its shard of each)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        try:
            module.get_parameter(path)
        except AttributeError:
            return False
    return True
