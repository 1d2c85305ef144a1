"""Per-layer profiler: forward, input-gradient and weight-gradient time at several token counts.

Backward is split the way frozen-aware costs need it: `torch.autograd.grad` w.r.t. the layer input only
(B_d) and w.r.t. the layer's parameters only (B_w), each on a fresh forward graph. It takes plain modules or
callables, so it does not depend on how a model is split into layers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from lightning_mm.planner.costs import LayerProfile, fit_cost_model

MakeInput = Callable[[str, int, int], torch.Tensor]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_tensor(output) -> torch.Tensor:
    """HF layers return tuples; the hidden states are the first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    raise TypeError(f"a profiled layer must return a tensor or a tuple starting with one, got {type(output).__name__}")


def _params(layer) -> list[torch.nn.Parameter]:
    return list(layer.parameters()) if isinstance(layer, torch.nn.Module) else []


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _measure_once(layer, x: torch.Tensor, params: list[torch.nn.Parameter]) -> tuple[float, float, float]:
    """One (forward, input-grad, weight-grad) measurement in seconds."""
    device = x.device
    leaf = x.detach().requires_grad_(True)
    box = {}
    forward = _timed(lambda: box.setdefault("y", _first_tensor(layer(leaf))), device)
    grad_out = torch.ones_like(box["y"])
    input_grad = _timed(lambda: torch.autograd.grad(box["y"], leaf, grad_out), device)
    weight_grad = 0.0
    if params:
        y = _first_tensor(layer(x.detach()))
        weight_grad = _timed(lambda: torch.autograd.grad(y, params, torch.ones_like(y)), device)
    return forward, input_grad, weight_grad


def profile_layer(layer, make_x: Callable[[], torch.Tensor], warmup: int, repeats: int) -> tuple[float, float, float]:
    """Medians over `repeats` runs after `warmup` runs. Frozen parameters are made to require grad for the
    measurement (B_w is a property of the layer, not of the current freezing) and restored afterwards."""
    params = _params(layer)
    saved = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        for _ in range(warmup):
            _measure_once(layer, make_x(), params)
        runs = [_measure_once(layer, make_x(), params) for _ in range(repeats)]
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)
    return tuple(statistics.median(r[k] for r in runs) for k in range(3))


def profile_layers(
    module_layers: dict[str, Sequence],
    make_input: MakeInput,
    token_counts: Sequence[int],
    warmup: int = 2,
    repeats: int = 5,
) -> dict[str, list[LayerProfile]]:
    """Profile every layer of every module at each token count and fit a x^2 + b x + c per layer and per
    cost kind. `make_input(module, layer_index, tokens)` returns the layer's input on the target device."""
    if not token_counts:
        raise ValueError("token_counts is empty; give the token counts to profile at, e.g. [64, 256, 1024]")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    out = {}
    for module, layers in module_layers.items():
        fitted = []
        for index, layer in enumerate(layers):
            samples = {
                int(t): profile_layer(layer, lambda t=t: make_input(module, index, int(t)), warmup, repeats)
                for t in token_counts
            }
            xs = list(samples)
            models = [fit_cost_model(xs, [samples[t][k] for t in xs]) for k in range(3)]
            fitted.append(LayerProfile(*models, samples={t: list(v) for t, v in samples.items()}))
        out[module] = fitted
    return out
