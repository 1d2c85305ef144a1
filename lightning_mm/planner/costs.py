"""Frozen-aware per-layer costs (003 Eq. 3.1-3.3) and Entrain's per-layer cost model a x^2 + b x + c.

A layer's pipeline cost is T = F + B with B = (B_w if the layer is trainable) + (B_d if some trainable
parameter lies at or upstream of it). "Backward = 2 x forward" ignores both terms and mis-balances stages
when most of an MLLM is frozen; these functions give the partitioner the real B.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROFILE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer in one training step of one microbatch. `trainable`: the layer owns a trainable
    parameter; `in_backward`: it takes part in backward (p(L) of Eq. 3.3)."""

    forward: float
    backward: float
    trainable: bool
    in_backward: bool

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _as_list(value, n: int, what: str) -> list:
    if isinstance(value, (bool, int, float, np.floating, np.bool_)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} entries but forward has {n}; give one per layer (or one scalar)")
    return values


def layer_costs(
    forward: Sequence[float],
    input_grad: Sequence[float] | float,
    weight_grad: Sequence[float] | float,
    frozen: Sequence[bool] | bool,
    upstream_trainable: bool = False,
    recompute: Sequence[bool] | bool = False,
) -> list[LayerCost]:
    """Frozen-aware costs of one module's layers, in order (Eq. 3.1-3.3).

    p(L_0) = upstream_trainable or not f(L_0); p(L_l) = p(L_{l-1}) or not f(L_l);
    B_l = (B_w,l if not f(L_l)) + (B_d,l if p(L_l)). With `recompute` (activation checkpointing) every layer
    that takes part in backward runs its forward again in backward, so B_l += F_l for those layers (per layer
    when `recompute` is a sequence: a runtime checkpoints transformer layers, not embeddings or heads).
    """
    n = len(forward)
    bd, bw, fz = _as_list(input_grad, n, "input_grad"), _as_list(weight_grad, n, "weight_grad"), _as_list(frozen, n, "frozen")
    rc = _as_list(recompute, n, "recompute")
    for name, values in (("forward", forward), ("input_grad", bd), ("weight_grad", bw)):
        if any(v < 0 for v in values):
            raise ValueError(f"{name} times must be >= 0, got {list(values)}")
    costs, upstream = [], bool(upstream_trainable)
    for f, d, w, is_frozen, again in zip(forward, bd, bw, fz, rc):
        upstream = upstream or not is_frozen
        backward = (0.0 if is_frozen else w) + (d if upstream else 0.0)
        if again and upstream:
            backward += f
        costs.append(LayerCost(float(f), float(backward), not is_frozen, upstream))
    return costs


@dataclass(frozen=True)
class ModuleTimes:
    """Profiled (or FLOP-derived) times of one module's layers and which of them are frozen."""

    forward: Sequence[float]
    input_grad: Sequence[float]
    weight_grad: Sequence[float]
    frozen: Sequence[bool] | bool


def mllm_layer_costs(
    encoders: dict[str, ModuleTimes], language_model: ModuleTimes,
    recompute: bool | dict[str, Sequence[bool] | bool] = False,
) -> dict[str, list[LayerCost]]:
    """Frozen-aware costs of a whole MLLM: each encoder (its projector as its last layer) on its own, then the
    LLM with upstream_trainable set iff any encoder layer is trainable (the flag crosses modalities: a
    trainable vision projector makes every LLM layer need B_d, also for the audio path's benefit).
    `recompute`: for every module, or per module name (a flag or one per layer)."""
    def again(name):
        return recompute.get(name, False) if isinstance(recompute, dict) else recompute

    out = {}
    for name, times in encoders.items():
        out[name] = layer_costs(times.forward, times.input_grad, times.weight_grad, times.frozen, False, again(name))
    upstream = any(c.trainable for costs in out.values() for c in costs)
    lm = language_model
    out["language_model"] = layer_costs(lm.forward, lm.input_grad, lm.weight_grad, lm.frozen, upstream,
                                        again("language_model"))
    return out


def forward_only_costs(forward: Sequence[float]) -> list[float]:
    """The frozen-unaware baseline's per-layer cost: F + 2F, whatever is frozen."""
    return [3.0 * float(f) for f in forward]


@dataclass(frozen=True)
class CostModel:
    """Entrain's per-layer time model t(x) = a x^2 + b x + c in tokens x (clamped at 0)."""

    a: float
    b: float
    c: float

    def __call__(self, tokens: float) -> float:
        return max(0.0, self.a * tokens * tokens + self.b * tokens + self.c)


def fit_cost_model(tokens: Sequence[float], times: Sequence[float]) -> CostModel:
    """Least-squares fit of a x^2 + b x + c. With fewer than 3 distinct token counts the degree drops
    (2 counts: linear, 1 count: constant) rather than fitting noise exactly."""
    x, y = np.asarray(tokens, dtype=float), np.asarray(times, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"tokens and times must be equal-length, non-empty 1-D sequences, got {x.shape} and {y.shape}")
    degree = min(2, len(np.unique(x)) - 1)
    design = np.stack([x**2, x, np.ones_like(x)], axis=1)[:, 2 - degree :]
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    coef = np.concatenate([np.zeros(2 - degree), coef])
    return CostModel(float(coef[0]), float(coef[1]), float(coef[2]))


@dataclass(frozen=True)
class LayerProfile:
    """Fitted cost models of one layer, plus the medians they were fitted on ({tokens: seconds})."""

    forward: CostModel
    input_grad: CostModel
    weight_grad: CostModel
    samples: dict = field(default_factory=dict)


def module_times(profile: Sequence[LayerProfile], tokens: float, frozen: Sequence[bool] | bool) -> ModuleTimes:
    """Evaluate a module's fitted layer models at a token count."""
    return ModuleTimes(
        [p.forward(tokens) for p in profile],
        [p.input_grad(tokens) for p in profile],
        [p.weight_grad(tokens) for p in profile],
        frozen,
    )


def save_profile(profile: dict[str, list[LayerProfile]], path: str | Path, meta: dict | None = None) -> None:
    """Write a profile as JSON so a plan can be made on another machine."""
    doc = {
        "format_version": PROFILE_FORMAT_VERSION,
        "meta": meta or {},
        "modules": {name: [asdict(layer) for layer in layers] for name, layers in profile.items()},
    }
    for layers in doc["modules"].values():
        for layer in layers:
            layer["samples"] = {str(k): v for k, v in layer["samples"].items()}
    Path(path).write_text(json.dumps(doc, indent=1))


def load_profile(path: str | Path) -> dict[str, list[LayerProfile]]:
    """Read a profile written by `save_profile`."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format_version") != PROFILE_FORMAT_VERSION:
        raise ValueError(
            f"{path}: profile format {doc.get('format_version')!r} is not {PROFILE_FORMAT_VERSION}; re-run the profiler"
        )
    out = {}
    for name, layers in doc["modules"].items():
        out[name] = [
            LayerProfile(
                CostModel(**layer["forward"]),
                CostModel(**layer["input_grad"]),
                CostModel(**layer["weight_grad"]),
                {float(k) if "." in k else int(k): v for k, v in layer.get("samples", {}).items()},
            )
            for layer in layers
        ]
    return out
