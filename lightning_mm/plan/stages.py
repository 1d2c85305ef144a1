"""Stage slices: which layers of which module each pipeline stage runs (from the placement table).

An encoder stage holds a contiguous slice of that encoder's layers; its first stage also the embedding modules,
its last stage the final modules and the projector. The LLM's first stage holds the token embedding, its last
stage the norm and head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_mm.plan.placement import LANGUAGE_MODEL, placement_table


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


def uniform_partition(num_layers: int, num_stages: int) -> list[int]:
    """Equal layer counts, earlier stages one layer lighter when it does not divide (the 'uniform' option)."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages (every stage needs a layer); "
                         f"use pp <= {num_layers} for this module")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]


def _slices(sizes: list[int]) -> list[Slice]:
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append(Slice(at, at + n, i == 0, i == len(sizes) - 1))
        at += n
    return out


def stage_plans(layer_counts: dict[str, list[int]], placement: str, encoder_names: list[str],
                shared: dict[str, str] | None = None) -> dict[str, StagePlan]:
    """Every stage's plan, keyed by the stage names of the placement table (and the stage DAG). ``shared``
    (encoder -> the encoder whose tower it runs) puts each shared encoder's slice beside its owner's, on the owner's
    stages: the same layers of the same parameters."""
    slices = {m: _slices(layer_counts[m]) for m in [*encoder_names, LANGUAGE_MODEL]}
    table = placement_table({e: len(layer_counts[e]) for e in encoder_names}, len(layer_counts[LANGUAGE_MODEL]),
                            placement)
    plans = {}
    for stage, parts in table.items():
        plan = StagePlan(stage)
        for module, i in parts:
            if module == LANGUAGE_MODEL:
                plan.language_model = slices[module][i]
            else:
                plan.encoders[module] = slices[module][i]
                plan.encoders.update({alias: slices[module][i] for alias, owner in (shared or {}).items()
                                      if owner == module})
        plans[stage] = plan
    return plans
