"""Per-sample work from metadata: the cost model the batch balancer plans with.

Each module's work for a sequence of ``x`` tokens is ``a x^2 + b x + c`` (Entrain's per-layer fit, summed over
layers), applied per item for encoders (items attend only within themselves) and per sample for the LLM.
By default the coefficients are forward FLOPs from the modules' shapes (``b``: 2 FLOPs per weight per token,
projector included for encoders and the head for the LLM; a mixture-of-experts layer's routed experts count at
top_k / E of their weights, the active parameters a token runs (``planner.moe_costs``), its router and attention whole;
``a``: 4 x attention width per attention layer for the score and value products; a Gated DeltaNet layer adds to
``b`` only, its recurrent state making it linear in length: ``linear_attention_token_flops``), scaled by the
frozen-aware factor (F + B) / F: 3 for a trainable module, 2 for a frozen one with a trainable module upstream
(input gradients only), 1 for a frozen module with nothing trainable before it.
``WorkloadModel.fit`` takes measured times at several token counts instead (Entrain's profile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_mm.data.metadata import SampleMeta


@dataclass(frozen=True)
class Quadratic:
    """``a x^2 + b x + c`` work units for ``x`` tokens."""

    a: float
    b: float
    c: float = 0.0

    def __call__(self, x: float) -> float:
        return (self.a * x + self.b) * x + self.c if x else 0.0


def _layer_weights(layer: torch.nn.Module, experts: set[int] = frozenset(), active: float = 1.0) -> float:
    """Matrix weights of a layer a token runs: all of them, the routed experts' (``experts``: parameter ids) at
    ``active`` = top_k / E."""
    return sum(p.numel() * (active if id(p) in experts else 1.0) for p in layer.parameters() if p.dim() >= 2)


def _attention_width(config, layer: torch.nn.Module | None = None) -> int:
    """Query heads x head size; a layer's attention module's own head size where it has one (Gemma 4's global
    layers have their own, and its config refuses a global ``head_dim``)."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None) or 1
    head_dim = getattr(getattr(layer, "self_attn", None), "head_dim", None)
    return heads * (head_dim or getattr(config, "head_dim", None) or config.hidden_size // heads)


def linear_attention_token_flops(config, chunk: int = 64) -> float:
    """Forward FLOPs per token of one Gated DeltaNet layer beyond its weights (the chunked delta rule over chunks
    of ``chunk`` tokens, and the short convolution), independent of the sequence's length: per value head, the
    within-chunk key-key and query-key products and the triangular solves for values and keys (``chunk`` x
    (5 key + 3 value dims)), the three state products (6 key x value dims); 2 x kernel per channel for the
    convolution."""
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    heads = config.linear_num_value_heads
    channels = 2 * config.linear_num_key_heads * dk + heads * dv
    return float(heads * (chunk * (5 * dk + 3 * dv) + 6 * dk * dv) + 2 * config.linear_conv_kernel_dim * channels)


def _factor(trainable: bool, upstream: bool) -> float:
    return 3.0 if trainable else (2.0 if upstream else 1.0)


def _trainable(module: torch.nn.Module | None) -> bool:
    return module is not None and any(p.requires_grad for p in module.parameters())


@dataclass(frozen=True)
class WorkloadModel:
    """Encoder work per item and LLM work per sample. ``encoders[name]`` is applied to each item's encoder
    tokens; ``language_model`` to the sample's LLM tokens."""

    encoders: dict[str, Quadratic]
    language_model: Quadratic

    @classmethod
    def from_model(cls, model) -> "WorkloadModel":
        """FLOP coefficients from the shapes of ``model`` (a MultimodalModel; meta tensors are fine)."""
        encoders, upstream = {}, False
        for name, enc in model.encoders.items():
            layers = list(enc.layers)
            width = _attention_width(enc.config) if hasattr(enc.config, "hidden_size") else 0
            b = 2.0 * sum(_layer_weights(layer) for layer in layers)
            if enc.projector is not None:  # projector tokens ~ encoder tokens (merged towers: a small overcount)
                b += 2.0 * _layer_weights(enc.projector)
            trainable = _trainable(enc)
            f = _factor(trainable, False)
            encoders[name] = Quadratic(f * 4.0 * width * len(layers), f * b)
            upstream |= trainable
        from lightning_mm.planner.moe_costs import active_weight_fraction

        lm = model.language_model
        layers = list(model.llm_layers)
        experts, active = active_weight_fraction(model)
        b = 2.0 * sum(_layer_weights(layer, experts.get(i, frozenset()), active) for i, layer in enumerate(layers))
        head = getattr(lm, "lm_head", None)
        if isinstance(head, torch.nn.Linear):
            b += 2.0 * head.weight.numel()
        f = _factor(_trainable(lm), upstream)
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        from lightning_mm.model.linear_attention import LINEAR, layer_types

        types = layer_types(cfg)
        linear = types.count(LINEAR)  # Gated DeltaNet layers: linear in length
        if linear:
            b += linear * linear_attention_token_flops(cfg)
        width = sum(_attention_width(cfg, layer) for i, layer in enumerate(layers)
                    if i >= len(types) or types[i] != LINEAR)
        return cls(encoders, Quadratic(f * 4.0 * width, f * b))

    @classmethod
    def fit(cls, tokens: dict[str, list[float]], times: dict[str, list[float]]) -> "WorkloadModel":
        """Least-squares ``a x^2 + b x + c`` per module from measured times (``"language_model"`` is the LLM)."""
        fitted = {}
        for name, xs in tokens.items():
            x = torch.tensor(xs, dtype=torch.float64)
            design = torch.stack([x * x, x, torch.ones_like(x)], 1)
            coef = torch.linalg.lstsq(design, torch.tensor(times[name], dtype=torch.float64).unsqueeze(1)).solution
            fitted[name] = Quadratic(*(float(v) for v in coef.flatten()))
        llm = fitted.pop("language_model")
        return cls(fitted, llm)

    def encoder_work(self, meta: SampleMeta) -> float:
        return sum(self.encoders[name](tokens) for name, items in meta.items.items() if name in self.encoders
                   for tokens, _ in items)

    def llm_work(self, meta: SampleMeta) -> float:
        return self.language_model(meta.llm_tokens)

    def works(self, metas: list[SampleMeta]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder and LLM work of each sample, as the balancer takes them (1-D float64 tensors)."""
        return (torch.tensor([self.encoder_work(m) for m in metas], dtype=torch.float64),
                torch.tensor([self.llm_work(m) for m in metas], dtype=torch.float64))
