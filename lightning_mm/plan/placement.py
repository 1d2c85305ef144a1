"""The placement table: which module stages each pipeline stage holds, for every encoder placement.

The one source of this fact for the rank layout, the stage DAG, the runtime's stage slices and the planner's
stage costs. A module stage is ``(module, index)``: layers ``index`` of that module's pipeline split.

- "parallel": every encoder stage is its own pipeline stage (modality parallelism), then the LLM stages.
- "colocated": encoder stage i of every encoder fused into one pipeline stage "encoders.i" (Megatron-style).
- "replicated": every encoder runs whole inside the LLM's first stage (no encoder stages).
"""

from __future__ import annotations

COLOCATED_ENCODERS = "encoders"
LANGUAGE_MODEL = "language_model"
PLACEMENTS = ("parallel", "colocated", "replicated")


def stage_name(module: str, index: int) -> str:
    """The canonical stage name, e.g. stage_name("vision", 0) == "vision.0"."""
    return f"{module}.{index}"


def placement_table(encoder_stages: dict[str, int], llm_stages: int,
                    placement: str) -> dict[str, list[tuple[str, int]]]:
    """``{pipeline stage: [(module, module stage index), ...]}`` in DAG order (encoder chains, then the LLM)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown encoder placement {placement!r}; use one of {PLACEMENTS}")
    table: dict[str, list[tuple[str, int]]] = {}
    if placement == "parallel":
        for enc, count in encoder_stages.items():
            for i in range(count):
                table[stage_name(enc, i)] = [(enc, i)]
    elif placement == "colocated" and encoder_stages:
        counts = set(encoder_stages.values())
        if len(counts) > 1:
            raise ValueError(f"colocated placement fuses encoders stage by stage: give every encoder the same pp, "
                             f"got {encoder_stages}, or use placement='parallel'")
        for i in range(counts.pop()):
            table[stage_name(COLOCATED_ENCODERS, i)] = [(enc, i) for enc in encoder_stages]
    for i in range(llm_stages):
        table[stage_name(LANGUAGE_MODEL, i)] = [(LANGUAGE_MODEL, i)]
    if placement == "replicated":  # every encoder stage inside the LLM's first stage (the layout asks for pp=1)
        table[stage_name(LANGUAGE_MODEL, 0)] += [(enc, i) for enc, count in encoder_stages.items()
                                                 for i in range(count)]
    return table
