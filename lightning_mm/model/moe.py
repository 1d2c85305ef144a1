"""Mixture-of-experts language models (Qwen3-MoE, Mixtral) and their router's load-balancing loss.

The family adapters run the HF decoder layers unchanged (router, experts and all); what they add is the
auxiliary load-balancing loss, computed per forward call (one microbatch) exactly as the family's
``load_balancing_loss_func`` computes it, also when the microbatch's layers are spread over pipeline stages and
its tokens over context-parallel ranks.

HF's formula, over the ``L`` routed layers of one forward and its ``T`` counted tokens (tokens whose mask word is
not 0, i.e. HF's ``attention_mask``), with ``E`` experts and top-``k`` routing::

    f_e = (1 / LT) * sum_l sum_t [e in topk(softmax(logits_l(t)))]      (a count: no gradient)
    P_e = (1 / LT) * sum_l sum_t softmax(logits_l(t))_e
    aux = E * sum_e f_e * P_e

Both statistics are summed over *all* layers before the product, so ``aux`` is not a mean (nor a sum) of
per-layer losses: the cross terms ``f_e(l) P_e(l')`` of different layers count. A stage therefore adds its
layers' sums to one vector ``[C (E counts), S (E probability sums), rows]`` (``RouterStats``) that travels with the
hidden states to the next stage, where autograd carries the gradient of ``S`` back. The stage holding the head
sums ``C`` and ``rows`` over its context-parallel ranks (no gradient) and computes ``E * sum_e C_e S_e / rows^2``
with its own ``S``: the loss is linear in ``S`` given ``C``, so the context-parallel ranks' terms add up to the
microbatch's loss and each rank's gradient is exact.

Normalisation over a training step: the aux loss of a step is the mean of the per-microbatch aux losses over all
``M`` microbatches of every data-parallel replica (``M * dp`` forward calls, which is what one process running the
same microbatches one by one with gradient accumulation computes), and ``router_aux_loss_coef`` times it is added
to the token loss when the config's ``output_router_logits`` is on. With it off the aux loss is still computed and
reported (``train/aux_loss``) but adds no gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lightning_mm.model.families import LANGUAGE_FAMILIES, MROPE_FAMILIES, DecoderFamily, MRopeDecoderFamily


@dataclass(frozen=True)
class MoeDecoderFamily(DecoderFamily):
    """A decoder whose MLPs are routed experts: ``router_class`` is the HF router module (it returns the router
    logits first); ``num_experts_attr`` the config attribute holding the expert count."""

    router_class: str = ""
    num_experts_attr: str = "num_experts"
    is_moe = True

    def num_experts(self, lm) -> int:
        return getattr(lm.config, self.num_experts_attr)

    def top_k(self, lm) -> int:
        return lm.config.num_experts_per_tok

    def aux_loss_coef(self, lm) -> float:
        """The coefficient the aux loss enters the loss with: 0 unless ``config.output_router_logits``."""
        return float(lm.config.router_aux_loss_coef) if getattr(lm.config, "output_router_logits", False) else 0.0

    def routers(self, lm) -> dict[int, nn.Module]:
        """Layer index -> router module, for the layers present here (a pipeline stage holds some only)."""
        out = {}
        for i, layer in enumerate(self.layers(lm)):
            for m in layer.modules():
                if any(c.__name__ == self.router_class for c in type(m).__mro__):
                    out[i] = m
        return out

    def tiny_config(self, **overrides):
        import transformers

        kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                  num_experts_per_tok=2, router_aux_loss_coef=0.01, output_router_logits=False)
        kw[self.num_experts_attr] = 8
        if self.model_type == "qwen3_moe":
            kw.update(head_dim=8, moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1)
        if self.model_type == "mixtral":
            kw.update(sliding_window=None, router_jitter_noise=0.0)
        kw.update(overrides)
        return getattr(transformers, self.config_name)(**kw)


MOE_FAMILIES = {f.model_type: f for f in (
    MoeDecoderFamily("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                     router_class="Qwen3MoeTopKRouter"),
    MoeDecoderFamily("Mixtral", "mixtral", "MixtralForCausalLM", "MixtralConfig", router_class="MixtralTopKRouter",
                     num_experts_attr="num_local_experts"),
)}
# registered with the dense families (``language_family``, ``tiny_language_model("qwen3_moe")``): this module is
# imported with ``lightning_mm.model`` (by ``multimodal.py``), so the families module needs no import of it
LANGUAGE_FAMILIES.update(MOE_FAMILIES)


@dataclass(frozen=True)
class MRopeMoeDecoderFamily(MoeDecoderFamily, MRopeDecoderFamily):
    """Qwen3-VL-MoE's text decoder (the LLM of ``Qwen3VLMoeForConditionalGeneration``): M-RoPE positions and
    routed experts."""

    def tiny_config(self, **overrides):
        kw = dict(head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                  router_aux_loss_coef=0.01, output_router_logits=False)
        kw.update(overrides)
        return MRopeDecoderFamily.tiny_config(self, **kw)


MROPE_FAMILIES["qwen3_vl_moe_text"] = MRopeMoeDecoderFamily(
    "Qwen3-VL-MoE text", "qwen3_vl_moe_text", "Qwen3VLMoeTextForCausalLM", "Qwen3VLMoeTextConfig",
    router_class="Qwen3VLMoeTextTopKRouter")


EXPERT_PLAN_LAYERS = "layers.*."
EXPERT_STYLES = ("grouped_gemm", "ep_dispatch_experts")  # the entries of an ep plan that split the experts


def expert_layer_plan(lm: nn.Module) -> dict[str, str]:
    """The per-layer part of the LLM's HF expert-parallel plan (``layers.*.X`` -> ``X``), or a clear error."""
    plan = dict(getattr(lm.config, "base_model_ep_plan", None) or {})
    # only the experts: a plan's dense entries (Gemma 4's MLP beside its experts, colwise / rowwise) would
    # tensor-parallelise that MLP over the ep ranks, which hold different tokens
    layer = {k[len(EXPERT_PLAN_LAYERS):]: v for k, v in plan.items()
             if k.startswith(EXPERT_PLAN_LAYERS) and v in EXPERT_STYLES}
    if not layer:
        raise ValueError(f"{type(lm).__name__} ships no expert-parallel plan (config.base_model_ep_plan is empty); "
                         "use language_model=ParallelSpec(ep=1)")
    return layer


def is_moe(family) -> bool:
    return getattr(family, "is_moe", False)


# ----------------------------------------------------------------------------------------------------------
# router statistics of one microbatch
# ----------------------------------------------------------------------------------------------------------


class RouterStats:
    """The router statistics of one microbatch on one rank, accumulated layer by layer.

    ``vector``: ``[C (E), S (E), rows]`` float32 (only ``S`` carries a gradient), the message that travels down the
    pipeline; ``load``: layer index -> the tokens routed to each expert ``[E]`` (for logging, no gradient)."""

    def __init__(self, num_experts: int, device, received: torch.Tensor | None = None):
        self.num_experts = num_experts
        self.vector = received if received is not None else torch.zeros(2 * num_experts + 1, device=device)
        self.load: dict[int, torch.Tensor] = {}
        self.pending: list[tuple[int, torch.Tensor]] = []  # (layer, router logits) recorded, not yet added

    def add(self, layer: int, logits: torch.Tensor, mask: torch.Tensor, top_k: int) -> None:
        """One routed layer: ``logits [T, E]`` of the local tokens, ``mask [T]`` 1 where a token counts."""
        probs = torch.softmax(logits.float(), dim=-1)
        mask = mask.to(probs.dtype)
        with torch.no_grad():
            chosen = torch.topk(probs, top_k, dim=-1).indices
            counts = torch.zeros(self.num_experts, device=probs.device).scatter_add_(
                0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        sums = (probs * mask[:, None]).sum(0)
        self.vector = self.vector + torch.cat([counts, sums, mask.sum().reshape(1)])
        self.load[layer] = counts

    def aux_loss(self, group=None) -> torch.Tensor:
        """This rank's share of the microbatch's aux loss (``E * sum_e C_e S_e / rows^2``); the counts and rows are
        summed over ``group`` (the context-parallel ranks) first, so the shares of the group add up to HF's value."""
        e = self.num_experts
        fixed = torch.cat([self.vector[:e], self.vector[2 * e:]]).detach()
        if group is not None:
            import torch.distributed as dist

            fixed = fixed.clone()
            dist.all_reduce(fixed, group=group)
        counts, rows = fixed[:e], fixed[e].clamp_min(1.0)
        return e * (counts * self.vector[e:2 * e]).sum() / rows ** 2


    def metrics(self) -> dict:
        """``aux_loss``, ``expert_load [routed layers, E]`` and their ``layers`` (indices) of a whole forward in one
        process."""
        return {"aux_loss": self.aux_loss().detach(), "layers": sorted(self.load),
                "expert_load": torch.stack([self.load[i] for i in sorted(self.load)])}


@contextmanager
def recording(family, lm, bam: torch.Tensor, received: torch.Tensor | None = None):
    """Inside, every router of ``lm`` present here adds its layer to the yielded ``RouterStats`` (None for a dense
    family), filled when the block exits; tokens whose mask word (``bam``) is 0 (padding) count nowhere. ``received``:
    the statistics of the stages before this one. Hooks live only inside: a backward recomputation (activation
    checkpointing) records nothing."""
    if not is_moe(family):
        yield None
        return
    stats = RouterStats(family.num_experts(lm), bam.device, received)
    mask, top_k = (bam != 0).reshape(-1), family.top_k(lm)

    def hook(layer):
        return lambda module, args, output: stats.pending.append((layer, output[0]))

    handles = [router.register_forward_hook(hook(i)) for i, router in family.routers(lm).items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
    # the statistics are computed here, outside any checkpointed region: a recomputation must save what the
    # original forward saved, and it records no logits
    for layer, logits in stats.pending:
        stats.add(layer, logits, mask, top_k)
    stats.pending.clear()


def load_imbalance(load: torch.Tensor) -> torch.Tensor:
    """max / mean of the tokens per expert, per layer (``load [L, E]``); 1 is perfect balance."""
    return load.max(-1).values / load.mean(-1).clamp_min(1e-12)


def step_metrics(module, output=None) -> dict | None:
    """The router metrics of the step a ``MultimodalLightningModule`` just ran: from the pipeline engine under
    ``MultimodalParallelStrategy``, else from the forward's output (None for a dense LLM)."""
    if module.pipeline is not None:
        router = module.pipeline.engine.router_metrics
        return None if router is None else router.metrics
    router = getattr(output, "router", None)
    return None if router is None else router.metrics()


def log_router_metrics(module, metrics: dict | None, batch_size: int) -> None:
    """``train/aux_loss`` every step; the per-layer expert load imbalance (max/mean,
    ``train/expert_imbalance/layer_<i>``) and the share of each expert in each layer's routed tokens
    (``train/expert_load/layer_<i>/expert_<e>``) on the steps Lightning writes logs (``log_every_n_steps``): they
    are layers x experts calls (6,144 for 48 layers of 128 experts), host time wasted on steps that log nothing."""
    if not metrics:
        return
    module.log("train/aux_loss", metrics["aux_loss"], batch_size=batch_size)
    if not module.trainer._logger_connector.should_update_logs:
        return
    load = metrics["expert_load"]
    share = load / load.sum(-1, keepdim=True).clamp_min(1.0)
    for i, row, imbalance in zip(metrics["layers"], share, load_imbalance(load)):
        module.log(f"train/expert_imbalance/layer_{i}", imbalance, batch_size=batch_size)
        for e, value in enumerate(row):
            module.log(f"train/expert_load/layer_{i}/expert_{e}", value, batch_size=batch_size)
