"""What the planner knows of a mixture-of-experts LLM: which weights are routed experts, and what expert
parallelism (``ParallelSpec(ep=N)``) changes in a stage's work, memory and communication.

- Work (``workload.WorkloadModel``): a token runs ``top_k`` of the ``E`` experts, so an MoE layer costs its
  non-expert weights (attention, norms, the router) plus ``top_k / E`` of its expert weights per token (active
  parameters), not every expert. ``flop_times`` needs no correction: torch's FlopCounterMode counts the ops the
  layer runs, and transformers' experts run each expert on the tokens routed to it only.
- Memory: with ``ep`` > 1 a rank holds ``1 / ep`` of every routed layer's expert weights, their gradients and
  optimiser state (the per-layer expert bytes of ``expert_layer_bytes``); the rest as today.
- Communication: each routed layer dispatches every (token, expert) pair to the rank holding the expert and brings
  the outputs back, in forward and again (their gradients) in backward: ``all_to_all_bytes``.
- Compute per rank is unchanged by ep (dropless, load assumed balanced): a rank runs ``1 / ep`` of the experts on
  ``ep`` ranks' tokens routed to them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of an LLM as expert parallelism's traffic depends on them: ``num_experts`` (``E``),
    ``top_k``, the hidden size, the tokens of one microbatch (rows x sequence) and bytes per element."""

    num_experts: int
    top_k: int
    hidden: int
    tokens: int
    dtype_bytes: int = 2


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, dtype_bytes: int, ep: int) -> dict[str, float]:
    """Bytes one rank sends per routed layer and microbatch: the dispatch and the combine all-to-all each move its
    ``tokens x top_k`` (token, expert) pairs of ``hidden`` elements, of which ``(ep - 1) / ep`` leave the rank (routing
    assumed uniform); backward moves their gradients the same way. ``{"forward": 2 x .., "backward": 2 x ..}``: in
    all 4 x tokens x top_k x hidden x bytes x (ep - 1) / ep; 0 at ep 1."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    one = tokens * top_k * hidden * dtype_bytes * (ep - 1) / ep
    return {"forward": 2.0 * one, "backward": 2.0 * one}


def expert_parameter_names(model) -> dict[int, list[str]]:
    """Per LLM layer index, the names (inside the layer) of its routed expert weights: the ``grouped_gemm`` entries of
    the family's HF expert-parallel plan (``config.base_model_ep_plan``, what ``apply_ep`` splits), present in the
    layer (dense layers of a mixed model have none). Empty for a dense LLM."""
    if not model.lm_family.has_routed_experts(model.language_model):
        return {}
    from lightning_mm.model.moe import expert_layer_plan

    plan = [k for k, v in expert_layer_plan(model.language_model).items() if v == "grouped_gemm"]
    out = {}
    for i, layer in enumerate(model.llm_layers):
        names = dict(layer.named_parameters())
        present = [k for k in plan if k in names]
        if present:
            out[i] = present
    return out


def expert_layer_bytes(model) -> tuple[list[float], list[float]]:
    """Per LLM layer: (model-state bytes of its routed experts, as ``model_costs._state_bytes`` counts them:
    weights, plus gradient and two Adam moments where trainable; gradient bytes of its trainable experts). Zeros for
    dense layers and LLMs."""
    n = len(model.llm_layers)
    state, grad = [0.0] * n, [0.0] * n
    for i, names in expert_parameter_names(model).items():
        layer = model.llm_layers[i]
        for name in names:
            p = layer.get_parameter(name)
            state[i] += float(p.numel() * (16 if p.requires_grad else 4))
            grad[i] += float(p.numel() * p.element_size()) if p.requires_grad else 0.0
    return state, grad


def expert_shape(model, batch: dict) -> ExpertShape | None:
    """The LLM's ``ExpertShape`` for ``batch`` (None for a dense LLM)."""
    fam, lm = model.lm_family, model.language_model
    if not fam.has_routed_experts(lm):
        return None
    seq = batch.get("bam") if batch.get("bam") is not None else batch["input_ids"]
    return ExpertShape(fam.num_experts(lm), fam.top_k(lm), fam.hidden_size(lm), int(seq.numel()),
                       next(lm.parameters()).element_size())


def active_weight_fraction(model) -> tuple[dict[int, set[int]], float]:
    """(per LLM layer index, the ids of its expert weights; top_k / E): what ``WorkloadModel`` scales the expert
    weights of a routed layer by. ({}, 1.0) for a dense LLM."""
    names = expert_parameter_names(model)
    if not names:
        return {}, 1.0
    fam, lm = model.lm_family, model.language_model
    ids = {i: {id(model.llm_layers[i].get_parameter(n)) for n in ns} for i, ns in names.items()}
    return ids, fam.top_k(lm) / fam.num_experts(lm)
