"""Planner inputs from a real MultimodalModel: per-part costs, frozen flags, and the strategy's partition modes.

A module is split into *parts*: ``[embed, layer_0, ..., layer_{N-1}, head]`` (encoder head = final norm +
projector; LLM head = norm + lm_head + loss). Eq. 3.1-3.3 run over the parts (so a trainable projector behind
frozen layers, or a trainable LLM head, is costed right, and the upstream flag crosses from encoders into the
LLM); then the embed part is folded into layer 0 and the head into the last layer, because a stage always runs
them with those layers. The result has one `LayerCost` per layer, which is what the partitioner and the
search cut.

Costs are deterministic so that every rank computes the same partition: either FLOP counts of one forward on a
fixed synthetic sample (`flop_times`, torch's FlopCounterMode over the real layers) or a JSON profile written
by `profile_model` / `save_profile` (seconds measured on some machine, evaluated at the sample's token counts).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from operator import add
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from lightning_mm.planner.costs import LayerCost, LayerProfile, ModuleTimes, fit_cost_model, load_profile, \
    mllm_layer_costs, module_times
from lightning_mm.plan.placement import LANGUAGE_MODEL
from lightning_mm.plan.stages import uniform_partition
from lightning_mm.planner.partition import partition_module

PLANNER_MODES = ("frozen-aware", "forward-only", "auto")


@dataclass(frozen=True)
class PlannedPartition:
    """A planner partition request: ``mode`` ("frozen-aware" | "forward-only" | "auto") and an optional JSON
    profile path (`save_profile` format, parts per module as in this file's docstring)."""

    mode: str = "frozen-aware"
    profile: str | None = None


def planner_request(partition, profile: str | None) -> PlannedPartition:
    """The strategy's ``partition`` + ``profile=`` arguments as one request; checked before any process group."""
    if not (isinstance(partition, str) and partition in PLANNER_MODES):
        raise ValueError(f"profile={profile!r} only applies to a planner partition {PLANNER_MODES}, got "
                         f"partition={partition!r}; set partition='frozen-aware' or drop profile")
    load_profile(profile)  # fail now on a missing or outdated file, not inside the launched processes
    return PlannedPartition(partition, str(profile))


# ------------------------------------------------------------------------------------------ the model's parts
def sample_batch(model, rows: int = 2, text_tokens: int = 64, seed: int = 0) -> dict:
    """A fixed synthetic batch (the same on every rank) to count or time each part on."""
    from lightning_mm.data import MultimodalCollator, SyntheticMultimodalDataset

    with torch.random.fork_rng(devices=[]):
        data = SyntheticMultimodalDataset(model, num_samples=rows, text_tokens=(text_tokens, text_tokens), seed=seed,
                                          items_per_sample=(1, 1), variable_size=False)
        return MultimodalCollator(model)([data[i] for i in range(rows)])


def _tokens(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 1


def _split(embed: list, layers, rest) -> list[list[torch.nn.Parameter]]:
    taken = {id(p) for p in embed} | {id(p) for layer in layers for p in layer.parameters()}
    return [embed] + [list(layer.parameters()) for layer in layers] + [[p for p in rest if id(p) not in taken]]


def part_parameters(model) -> dict[str, list[list[torch.nn.Parameter]]]:
    """Per module, the parameters of each part: [embed, layer_0 .. layer_{N-1}, head]."""
    out = {}
    for name, enc in model.encoders.items():
        mod = enc.module
        embed = [p for m in enc.family.embed_modules if hasattr(mod, m) for p in getattr(mod, m).parameters()]
        out[name] = _split(embed, enc.layers, [*mod.parameters(), *enc.projector.parameters()])
    lm = model.language_model
    out[LANGUAGE_MODEL] = _split(list(model.lm_family.embed_tokens(lm).parameters()), model.llm_layers,
                                 list(lm.parameters()))
    return out


def part_runners(model, batch: dict) -> dict[str, list[tuple[Callable, object, list[torch.nn.Parameter], int]]]:
    """Per module, its parts in order as (run(x) -> y, input x, parameters, input tokens). The inputs are
    produced by running the parts in order on ``batch`` (no_grad), as the pipeline's stages do. An encoder sharing
    another's tower (``model.shared_encoders``: videos) without items in ``batch`` is left out."""
    from lightning_mm import loss as losses

    params = part_parameters(model)
    out, features = {}, {}
    with torch.no_grad():
        for name, enc in model.encoders.items():
            if name in model.shared_encoders and name not in batch:
                continue
            inputs = batch[name]
            hidden, ctx = enc.embed(inputs)
            runs = [(lambda x, enc=enc: enc.embed(x)[0], inputs, 0)]
            for layer in enc.layers:
                runs.append((lambda h, enc=enc, layer=layer, ctx=ctx: enc.family.run_layer(enc.module, layer, h, ctx),
                             hidden, _tokens(hidden)))
                hidden = enc.family.run_layer(enc.module, layer, hidden, ctx)
            runs.append((lambda h, enc=enc, ctx=ctx, inputs=inputs: enc.head(h, ctx, inputs), hidden, _tokens(hidden)))
            features[name] = enc.head(hidden, ctx, inputs)
            out[name] = [(run, x, ps, t) for (run, x, t), ps in zip(runs, params[name])]
        ids = batch["input_ids"]
        ctx = model.attention_context(ids, batch.get("bam"), batch.get("segment_ids"), batch.get("position_ids"),
                                      batch.get("attention_mask"))
        hidden = model.embed(ids, features)
        runs = [(lambda f: model.embed(ids, f), features, ids.numel())]
        for i in range(len(model.llm_layers)):
            runs.append((lambda h, i=i: model.run_llm_layers(h, ctx, i, i + 1), hidden, _tokens(hidden)))
            hidden = model.run_llm_layers(hidden, ctx, i, i + 1)
        targets = losses.shift_labels(batch["labels"])
        runs.append((lambda h: losses.token_loss_sum(model.logits(h), targets), hidden, _tokens(hidden)))
        out[LANGUAGE_MODEL] = [(run, x, ps, t) for (run, x, t), ps in zip(runs, params[LANGUAGE_MODEL])]
    return out


def _frozen(params: list[torch.nn.Parameter]) -> bool:
    return not any(p.requires_grad for p in params)


def _cpu_sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten._grouped_mm`` (transformers' mixture-of-experts experts: each expert's weights on the tokens routed to
    it): 2 x the output's elements x the reduced dimension, the ragged one summed over the groups. 2-D x 2-D (ragged
    K, one output per group): 2 M N K_total; 2-D x 3-D (ragged M), 3-D x 2-D (ragged N), 3-D x 3-D: 2 x out x K."""
    k = a_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[-2] * out_shape[-1] * k
    elements = 1
    for n in out_shape:
        elements *= n
    return 2 * elements * k


# torch counts the CUDA SDPA kernels but not the CPU one (HF encoders use it on CPU), nor the grouped GEMM
# transformers runs a mixture-of-experts layer's experts with (they would count 0 FLOPs)
_CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_forward,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _CPU_SDPA[torch.ops.aten._grouped_mm] = _grouped_mm_flops


def _flops(fn: Callable[[], object]) -> float:
    with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as counter:
        fn()
    return float(counter.get_total_flops())


def part_flops(run: Callable, x, params: list[torch.nn.Parameter]) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) FLOPs of one part, counted by torch's FlopCounterMode on the
    real ops: B_d = the gradient w.r.t. the part's floating inputs only; B_w = what computing the trainable
    parameters' gradients as well adds (0 for a frozen part, as Eq. 3.3 wants; a partly trainable part counts
    its trainable share)."""
    leaf = _leaf(x)
    box = {}
    with torch.enable_grad():
        forward = _flops(lambda: box.setdefault("y", run(leaf)))
    y, ins, train = box["y"], _grad_inputs(leaf), [p for p in params if p.requires_grad]
    if not y.requires_grad:
        return forward, 0.0, 0.0
    ones = torch.ones_like(y)
    bd = _flops(lambda: torch.autograd.grad(y, ins, ones, retain_graph=True, allow_unused=True)) if ins else 0.0
    if not train:
        return forward, bd, 0.0
    both = _flops(lambda: torch.autograd.grad(y, ins + train, ones, allow_unused=True))
    return forward, bd, both - bd  # B_d + B_w = one backward computing both (shared internal input grads once)


def flop_times(model, batch: dict | None = None) -> dict[str, ModuleTimes]:
    """Per module and part: forward, input-gradient and weight-gradient FLOPs counted on the real layers
    (`part_flops`) and frozen flags from ``requires_grad``. Deterministic for a given model and batch."""
    batch = sample_batch(model) if batch is None else batch
    out = {}
    for module, parts in part_runners(model, batch).items():
        counted = [part_flops(run, x, params) for run, x, params, _ in parts]
        out[module] = ModuleTimes([c[0] for c in counted], [c[1] for c in counted], [c[2] for c in counted],
                                  [_frozen(params) for _, _, params, _ in parts])
    for alias, owner in model.shared_encoders.items():  # a shared tower's layers run both modalities' items
        if alias not in out:
            continue
        a, o = out.pop(alias), out[owner]
        out[owner] = ModuleTimes(*([x + y for x, y in zip(getattr(o, f), getattr(a, f))]
                                   for f in ("forward", "input_grad", "weight_grad")), o.frozen)
    return out


def part_tokens(model, batch: dict | None = None) -> dict[str, int]:
    """Tokens entering each module's layers in ``batch`` (what a profile is evaluated at)."""
    batch = sample_batch(model) if batch is None else batch
    return {m: parts[1][3] for m, parts in part_runners(model, batch).items()}


def frozen_parts(model) -> dict[str, list[bool]]:
    """Frozen flag of every part (no parameter requires grad), from ``requires_grad``."""
    return {m: [_frozen(ps) for ps in parts] for m, parts in part_parameters(model).items()}


def trainable_fractions(model) -> dict[str, list[float]]:
    """Per module and part: the share of its parameter elements that are trainable (0 frozen, 1 fully trainable;
    a layer trained through LoRA adapters only a few percent)."""
    return {m: [sum(p.numel() for p in ps if p.requires_grad) / max(1, sum(p.numel() for p in ps)) for ps in parts]
            for m, parts in part_parameters(model).items()}


def profile_times(model, profile: dict[str, list[LayerProfile]], batch: dict | None = None) -> dict[str, ModuleTimes]:
    """Module times from a loaded profile, evaluated at ``batch``'s token counts, frozen flags from the model.

    A profile measures the weight gradients of all of a part's weights; a part whose weights are only partly
    trainable (LoRA adapters beside a frozen base, a trainable projector beside a frozen norm) gets that share of
    them (weight-gradient work is proportional to the weights it covers: 2 x tokens x weights for a linear map)."""
    frozen = frozen_parts(model)
    fractions = trainable_fractions(model)
    tokens = part_tokens(model, batch)
    out = {}
    for module, flags in frozen.items():
        if module not in profile:
            raise ValueError(f"the profile has no module {module!r} (it has {sorted(profile)}); profile this model "
                             "with `lightning-mm plan --config ... --write-profile costs.json`")
        if len(profile[module]) != len(flags):
            raise ValueError(f"profile module {module!r} has {len(profile[module])} parts but the model has "
                             f"{len(flags)} (embed + {len(flags) - 2} layers + head); re-profile this model")
        t = module_times(profile[module], tokens[module], flags)
        out[module] = ModuleTimes(t.forward, t.input_grad, [w * f for w, f in zip(t.weight_grad, fractions[module])],
                                  t.frozen)
    return out


# ------------------------------------------------------------------------------------------ measured profile
def _timed(fn: Callable[[], object]) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _grad_inputs(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _grad_inputs(v)]
    return []


def _leaf(x, requires_grad: bool = True):
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(requires_grad) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _leaf(v, requires_grad) for k, v in x.items()}
    return x


def _measure_part(run: Callable, x, params: list[torch.nn.Parameter], warmup: int, repeats: int):
    """Medians of (forward, input-grad, weight-grad) seconds; frozen weights require grad while measured."""
    saved = [p.requires_grad for p in params]

    def once():
        leaf = _leaf(x)
        box = {}
        forward = _timed(lambda: box.setdefault("y", run(leaf)))
        y, ins = box["y"], _grad_inputs(leaf)
        if not y.requires_grad:
            return forward, 0.0, 0.0
        ones = torch.ones_like(y)
        bd = _timed(lambda: torch.autograd.grad(y, ins, ones, retain_graph=True, allow_unused=True)) if ins else 0.0
        bw = _timed(lambda: torch.autograd.grad(y, params, ones, allow_unused=True)) if params else 0.0
        return forward, bd, bw

    try:
        for p in params:
            p.requires_grad_(True)
        for _ in range(warmup):
            once()
        runs = [once() for _ in range(repeats)]
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)
    return [statistics.median(r[k] for r in runs) for k in range(3)]


def profile_model(model, rows: tuple[int, ...] = (1, 2, 4), warmup: int = 2, repeats: int = 5,
                  text_tokens: int = 64, forward_context: Callable | None = None) -> dict[str, list[LayerProfile]]:
    """Measure every part of every module where the model's parameters are, at the token counts of synthetic
    batches of ``rows`` samples, and fit a x^2 + b x + c per part (Entrain's model). ``forward_context``: entered
    around every run (the precision plugin's autocast, as training runs them). Save it with `save_profile`."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    device = next(model.parameters()).device
    context = forward_context or contextlib.nullcontext
    samples: dict[str, list[dict[int, list[float]]]] = {}
    for r in rows:
        batch = move_data_to_device(sample_batch(model, rows=r, text_tokens=text_tokens), device)
        with context():
            runners = part_runners(model, batch)
        for module, parts in runners.items():
            slots = samples.setdefault(module, [{} for _ in parts])
            tokens = parts[1][3]
            for slot, (run, x, params, _) in zip(slots, parts):
                with context():
                    slot[tokens] = _measure_part(run, x, params, warmup, repeats)
    out = {}
    for module, slots in samples.items():
        out[module] = []
        for slot in slots:
            xs = sorted(slot)
            models = [fit_cost_model(xs, [slot[t][k] for t in xs]) for k in range(3)]
            out[module].append(LayerProfile(*models, samples={t: slot[t] for t in xs}))
    return out


# ------------------------------------------------------------------------------------------ memory per part
def part_activation_bytes(run: Callable, x, exclude: set[int], input_grad: bool = True) -> float:
    """Bytes one part keeps for its backward, measured on one forward: the storages of autograd's saved
    tensors, each counted once, without the parameters' (`exclude`: storage pointers). This is what a stage
    holds per in-flight microbatch; a frozen layer saves only what its input gradient needs, and a part with
    no gradient path saves nothing. `input_grad`: whether the part's input carries a gradient."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(_leaf(x, input_grad))
    return float(sum(kept.values()))


def _state_bytes(params: list[torch.nn.Parameter]) -> float:
    """Weights, plus gradient and two Adam moments where trainable (fp32)."""
    return float(sum(p.numel() * (16 if p.requires_grad else 4) for p in params))


def model_memory(model, batch: dict | None = None, recompute: bool = False
                 ) -> dict[str, tuple[list[float], list[float], list[float], list[float]]]:
    """Per module and layer (parts folded as the costs are): (model-state bytes, activation bytes kept per
    in-flight microbatch of ``batch``, gradient bytes, hidden-state bytes), the `ModuleSpec` memory and traffic
    fields. The search multiplies the second by each stage's peak in-flight count, all-reduces the third over
    data-parallel replicas and the fourth (a layer's floating inputs, the size of its output for a transformer
    layer) over tensor-parallel ranks. ``recompute``: under activation checkpointing a layer keeps only its
    input."""
    batch = sample_batch(model) if batch is None else batch
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {}
    for module, parts in part_runners(model, batch).items():
        acts = [float(sum(t.nbytes for t in _grad_inputs(x))) if recompute and 0 < i < len(parts) - 1
                else part_activation_bytes(run, x, params, input_grad=module == LANGUAGE_MODEL or i > 0)
                for i, (run, x, _, _) in enumerate(parts)]
        states = [_state_bytes(ps) for _, _, ps, _ in parts]
        grads = [float(sum(p.numel() * p.element_size() for p in ps if p.requires_grad)) for _, _, ps, _ in parts]
        hidden = [float(sum(t.nbytes for t in _grad_inputs(x))) for _, x, _, _ in parts]
        out[module] = (fold_parts(states, add), fold_parts(acts, add), fold_parts(grads, add),
                       fold_parts(hidden, add))
    return out


# ------------------------------------------------------------------------------------------ per-layer costs
def _merge(a: LayerCost, b: LayerCost) -> LayerCost:
    return LayerCost(a.forward + b.forward, a.backward + b.backward, a.trainable or b.trainable,
                     a.in_backward or b.in_backward)


def fold_parts(parts: list, merge: Callable = _merge) -> list:
    """[embed, layers..., head] -> one entry per layer (embed into the first layer, head into the last), for
    costs (`_merge`) or byte counts (`operator.add`)."""
    if len(parts) < 3:
        raise ValueError(f"need embed + at least one layer + head, got {len(parts)} parts")
    layers = list(parts[1:-1])
    layers[0] = merge(parts[0], layers[0])
    layers[-1] = merge(layers[-1], parts[-1])
    return layers


def model_layer_costs(model, profile: str | dict | None = None, batch: dict | None = None,
                      recompute: bool = False) -> dict[str, list[LayerCost]]:
    """Frozen-aware costs per layer of every module (Eq. 3.1-3.3 over parts, then folded): FLOPs by default,
    seconds from a profile (a path or a loaded `load_profile` dict). ``recompute``: the layers run under
    activation checkpointing, so each layer that takes part in backward runs its forward twice."""
    if profile is None:
        times = flop_times(model, batch)
    else:
        loaded = load_profile(profile) if isinstance(profile, str) else profile
        times = profile_times(model, loaded, batch)
    encoders = {m: t for m, t in times.items() if m != LANGUAGE_MODEL}
    # the runtime checkpoints the layers, not the embed and head parts
    again = {m: [False] + [recompute] * (len(t.forward) - 2) + [False] for m, t in times.items()}
    costs = mllm_layer_costs(encoders, times[LANGUAGE_MODEL], again)
    return {m: fold_parts(c) for m, c in costs.items()}


def planned_partition(model, module_stages: dict[str, int], mode: str = "frozen-aware",
                      profile: str | dict | None = None, recompute: bool = False) -> dict[str, list[int]]:
    """Layers per stage of every module chosen by the planner. "auto" is "frozen-aware" here: within a fixed
    device layout the stage counts are given by the ParallelSpecs (the stage-count search is `lightning-mm plan`)."""
    if mode not in PLANNER_MODES:
        raise ValueError(f"unknown planner partition mode {mode!r}; use one of {PLANNER_MODES}")
    costs = model_layer_costs(model, profile, recompute=recompute)
    part_mode = "frozen-aware" if mode == "auto" else mode
    return {m: partition_module(costs[m], s, part_mode) for m, s in module_stages.items()}


def module_sizes(model) -> dict[str, int]:
    sizes = {name: len(enc.layers) for name, enc in model.encoders.items()}
    sizes[LANGUAGE_MODEL] = len(model.llm_layers)
    return sizes


def resolve_partition(model, module_stages: dict[str, int], partition, recompute: bool = False) -> dict[str, list[int]]:
    """Layers per stage for every module: "uniform", explicit ``{module: [layers per stage]}``, or a planner mode.

    "frozen-aware" balances F + B of Eq. 3.1-3.3 (frozen flags from ``requires_grad``), "forward-only" balances
    3F (the seeds' baseline), "auto" = "frozen-aware" (stage counts are fixed by the ParallelSpecs here; the
    stage-count search is ``lightning-mm plan``). Planner costs are FLOP counts of the real layers on a fixed
    synthetic sample, or a JSON profile (``PlannedPartition(mode, profile=path)``), so every rank computes the
    same partition. ``recompute``: layers run under activation checkpointing (their backward includes a forward).
    """
    sizes = module_sizes(model)
    for module, stages in module_stages.items():
        if stages > sizes[module]:
            raise ValueError(f"{module!r} has {sizes[module]} layers but pp={stages} stages; use pp <= {sizes[module]}")
    if isinstance(partition, str) and partition in PLANNER_MODES:
        partition = PlannedPartition(partition)
    if isinstance(partition, PlannedPartition):
        if partition.profile is None and any(p.is_meta for p in model.parameters()):
            raise ValueError(f"partition={partition.mode!r} counts FLOPs by running the layers, which a model built "
                             "on the meta device (init_module(empty_init=True)) cannot do; give the strategy a "
                             "profile= (lightning-mm plan --write-profile), an explicit partition {module: [layers "
                             "per stage]}, or build the model eagerly")
        return planned_partition(model, module_stages, partition.mode, partition.profile, recompute)
    out = {}
    for module, stages in module_stages.items():
        n = sizes[module]
        given = partition.get(module) if isinstance(partition, dict) else None
        if given is not None:
            given = list(given)
            if len(given) != stages or sum(given) != n or min(given) < 1:
                raise ValueError(f"partition[{module!r}] = {given} must give {stages} positive layer counts summing "
                                 f"to {n}")
            out[module] = given
        elif isinstance(partition, dict) or partition == "uniform":
            out[module] = uniform_partition(n, stages)
        else:
            raise ValueError(f"unknown partition {partition!r}: use 'uniform', one of {PLANNER_MODES} or "
                             "{module: [layers per stage]}")
    return out
