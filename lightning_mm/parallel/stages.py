"""Pipeline stages: which layers each stage holds, which parameters it owns, and dropping the rest.

A stage keeps the unparallelised model's module tree and names; modules it does not own are replaced by
``nn.Identity`` (their memory is freed), so a stage's state dict is a slice of the full model's, keyed by the
same names. An encoder stage holds a contiguous slice of that encoder's layers; its first stage also the
embedding modules, its last stage the final modules and the projector. The LLM's first stage holds the token
embedding, its last stage the norm and head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_mm.parallel.schedule import COLOCATED_ENCODERS, LANGUAGE_MODEL
from lightning_mm.planner.partition import uniform_partition


@dataclass(frozen=True)
class Slice:
    """Layers [start, end) of one module, and whether the stage also runs its embedding / final part."""

    start: int
    end: int
    embed: bool
    head: bool


@dataclass
class StagePlan:
    name: str
    encoders: dict[str, Slice] = field(default_factory=dict)
    language_model: Slice | None = None

    @property
    def output_keys(self) -> list[str]:
        """Keys of the message this stage sends downstream (encoder names, or "hidden" for the LLM)."""
        return ["hidden"] if self.language_model is not None else list(self.encoders)


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
    from lightning_mm.planner.model_costs import PLANNER_MODES, PlannedPartition, planned_partition

    sizes = module_sizes(model)
    for module, stages in module_stages.items():
        if stages > sizes[module]:
            raise ValueError(f"{module!r} has {sizes[module]} layers but pp={stages} stages; use pp <= {sizes[module]}")
    if isinstance(partition, str) and partition in PLANNER_MODES:
        partition = PlannedPartition(partition)
    if isinstance(partition, PlannedPartition):
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


def _slices(sizes: list[int]) -> list[Slice]:
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append(Slice(at, at + n, i == 0, i == len(sizes) - 1))
        at += n
    return out


def stage_plans(layer_counts: dict[str, list[int]], placement: str, encoder_names: list[str]) -> dict[str, StagePlan]:
    """Every stage's plan, keyed by the stage names of ``schedule.build_stage_graph``."""
    plans: dict[str, StagePlan] = {}
    enc_slices = {e: _slices(layer_counts[e]) for e in encoder_names}
    if placement == "parallel":
        for e in encoder_names:
            for i, s in enumerate(enc_slices[e]):
                plans[f"{e}.{i}"] = StagePlan(f"{e}.{i}", {e: s})
    elif placement == "colocated" and encoder_names:
        for i in range(len(enc_slices[encoder_names[0]])):
            name = f"{COLOCATED_ENCODERS}.{i}"
            plans[name] = StagePlan(name, {e: enc_slices[e][i] for e in encoder_names})
    for i, s in enumerate(_slices(layer_counts[LANGUAGE_MODEL])):
        name = f"{LANGUAGE_MODEL}.{i}"
        plans[name] = StagePlan(name, {}, s)
    if placement == "replicated":
        plans[f"{LANGUAGE_MODEL}.0"].encoders = {e: enc_slices[e][0] for e in encoder_names}
    return plans


def _module_path(root: nn.Module, target: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is target:
            return name
    raise AssertionError("module not found")


def _slice_owned(root: nn.Module, owner_prefix: str, layers: nn.ModuleList, embed_names: list[str],
                 sl: Slice) -> set[str]:
    """Parameter names (from ``root``) that a slice of one module owns."""
    owner = root.get_submodule(owner_prefix) if owner_prefix else root
    layer_path = _module_path(owner, layers)
    owned = set()
    for name, _ in owner.named_parameters():
        full = f"{owner_prefix}.{name}" if owner_prefix else name
        if name.startswith(layer_path + "."):
            idx = int(name[len(layer_path) + 1:].split(".")[0])
            if sl.start <= idx < sl.end:
                owned.add(full)
        elif any(name == e or name.startswith(e + ".") for e in embed_names):
            if sl.embed:
                owned.add(full)
        elif sl.head:
            owned.add(full)
    return owned


def owned_parameters(model, plan: StagePlan) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters a stage owns."""
    owned = set()
    for e, sl in plan.encoders.items():
        enc = model.encoders[e]
        owned |= _slice_owned(model, f"encoders.{e}.module", enc.layers, list(enc.family.embed_modules), sl)
        if sl.head:
            owned |= {f"encoders.{e}.projector.{n}" for n, _ in enc.projector.named_parameters()}
    if plan.language_model is not None:
        lm = model.language_model
        embed = _module_path(lm, model.lm_family.embed_tokens(lm))
        owned |= _slice_owned(model, "language_model", model.llm_layers, [embed], plan.language_model)
    return owned


def check_untied(model, num_llm_stages: int) -> None:
    lm = model.language_model
    if num_llm_stages > 1 and getattr(lm.config, "tie_word_embeddings", False) and lm.lm_head.weight is \
            model.lm_family.embed_tokens(lm).weight:
        raise ValueError("the language model ties its input and output embeddings, which would live on different "
                         "pipeline stages; build it with tie_word_embeddings=False or use language_model pp=1")


def prune(root: nn.Module, owned: set[str]) -> None:
    """Replace every submodule holding parameters but none owned by ``nn.Identity``; freeze stray ones.

    Containers and ModalityEncoder wrappers stay (their family, config and callbacks cut microbatches)."""
    from lightning_mm.model.encoder import ModalityEncoder

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = prefix + name
            params = [f"{path}.{n}" for n, _ in child.named_parameters()]
            if not params:
                continue
            keep = isinstance(child, (ModalityEncoder, nn.ModuleDict, nn.ModuleList))
            if not keep and not any(p in owned for p in params):
                setattr(module, name, nn.Identity())
            else:
                visit(child, path + ".")

    visit(root, "")
    for name, p in root.named_parameters():
        if name not in owned:
            p.requires_grad_(False)
