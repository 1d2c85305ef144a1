"""The whole model's summary under MultimodalParallelStrategy, printed once on rank 0.

Lightning's ModelSummary describes the module of the rank that prints it; under the strategy that is rank 0's
pipeline stage only. :class:`WholeModelSummary` replaces it: at ``on_fit_start`` every rank describes what it
holds after the model was cut into stages (per part: encoder, projector, LLM; the layers held; trainable and frozen
parameter counts), one ``all_gather_object`` brings the descriptions to rank 0, and rank 0 prints one table: every
stage, the ranks that hold it, and its parts. Without the strategy it is Lightning's summary unchanged.
"""

from __future__ import annotations

from torch import nn

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def _count(params) -> tuple[int, int]:
    trainable = frozen = 0
    for p in params:
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def _held_layers(layers) -> list[int]:
    return [i for i, layer in enumerate(layers) if any(True for _ in layer.parameters())]


def _span(indices: list[int]) -> str:
    if not indices:
        return ""
    runs, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return "layers " + ",".join(runs)


def _part(name: str, module: nn.Module, layers, embed: list[nn.Module]) -> dict | None:
    """One part of a stage: its layers held, whether it holds the embedding / anything after the layers."""
    params = list(module.parameters())
    if not params:
        return None
    held = _held_layers(layers) if layers is not None else []
    in_layers = {id(p) for i in held for p in layers[i].parameters()} if layers is not None else set()
    in_embed = {id(p) for m in embed for p in m.parameters()}
    extras = []
    if any(id(p) in in_embed for p in params):
        extras.append("embeddings")
    if any(id(p) not in in_layers and id(p) not in in_embed for p in params):
        extras.append("norm/head" if layers is not None else "all")
    trainable, frozen = _count(params)
    return {"part": name, "holds": ", ".join(([_span(held)] if held else []) + extras), "trainable": trainable,
            "frozen": frozen}


def stage_parts(model) -> list[dict]:
    """What this rank's (pruned) MultimodalModel holds, part by part."""
    rows = []
    for name, enc in model.encoders.items():
        if name in model.shared_encoders:  # its owner's row holds the one copy of the tower and projector
            continue
        body = enc.module
        if any(True for _ in body.parameters()):
            embed = [getattr(body, m) for m in enc.family.embed_modules if hasattr(body, m)]
            rows.append(_part(f"encoders.{name}", body, enc.layers, embed))
        rows.append(_part(f"encoders.{name}.projector", enc.projector, None, []))
    lm = model.language_model
    if any(True for _ in lm.parameters()):
        embed = model.lm_family.embed_tokens(lm)
        rows.append(_part("language_model", lm, model.llm_layers, [embed] if isinstance(embed, nn.Module) else []))
    return [r for r in rows if r is not None]


def whole_model_table(records: list[dict], dp: int | str) -> str:
    """The table from every rank's ``{"rank", "stage", "dp", "cp", "parts"}`` (stages in rank order)."""
    stages: dict[str, dict] = {}
    for rec in sorted(records, key=lambda r: r["rank"]):
        entry = stages.setdefault(rec["stage"], {"ranks": [], "parts": None})
        entry["ranks"].append(rec["rank"])
        if rec["dp"] == 0 and rec["cp"] == 0:
            entry["parts"] = rec["parts"]
    fmt = get_human_readable_count
    header = ("stage", "ranks", "part", "holds", "trainable", "frozen")
    rows, total_t, total_f = [], 0, 0
    for stage, entry in stages.items():
        ranks = ",".join(str(r) for r in entry["ranks"])
        for i, part in enumerate(entry["parts"] or []):
            rows.append((stage if i == 0 else "", ranks if i == 0 else "", part["part"], part["holds"],
                         fmt(part["trainable"]), fmt(part["frozen"])))
            total_t, total_f = total_t + part["trainable"], total_f + part["frozen"]
    widths = [max(len(str(r[k])) for r in [header, *rows]) for k in range(len(header))]
    line = lambda r: "  ".join(str(v).rjust(w) if k >= 4 else str(v).ljust(w)  # noqa: E731
                               for k, (v, w) in enumerate(zip(r, widths))).rstrip()
    out = [f"Whole model across {len(records)} ranks ({len(stages)} pipeline stages, data-parallel size {dp}):",
           line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    out.append(f"Trainable params: {fmt(total_t)}")
    out.append(f"Frozen params: {fmt(total_f)}")
    out.append(f"Total params: {fmt(total_t + total_f)} (each stage counted once; data-parallel replicas and "
               "context-parallel ranks hold copies)")
    return "\n".join(out)


class WholeModelSummary(ModelSummary):
    """Lightning's ModelSummary, except under MultimodalParallelStrategy: one table of the whole model (every
    stage, the ranks holding it, trainable and frozen parameters per part), printed once by rank 0."""

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        if engine is None or not hasattr(strategy, "layout"):
            return super().on_fit_start(trainer, pl_module)
        if not self._max_depth:
            return None
        import torch.distributed as dist

        coord = strategy.layout.coordinate(trainer.global_rank)
        mine = {"rank": trainer.global_rank, "stage": coord.stage, "dp": coord.dp, "cp": coord.cp,
                "parts": stage_parts(pl_module.model) if coord.dp == 0 and coord.cp == 0 else None}
        records = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, mine)
        if trainer.is_global_zero:
            layout = strategy.layout
            dp = ", ".join(f"{c} {layout.replicas(c)}" for c in layout.chains()) if layout.per_module_dp else layout.dp
            rank_zero_info(whole_model_table(records, dp))
        return None


def use_whole_model_summary(trainer) -> None:
    """Under MultimodalParallelStrategy, swap the trainer's ModelSummary (or RichModelSummary) for
    :class:`WholeModelSummary` with the same depth; call on every rank before ``on_fit_start``."""
    if trainer is None or not hasattr(trainer.strategy, "run_pipeline"):
        return
    callbacks = trainer.callbacks
    for i, cb in enumerate(callbacks):
        if isinstance(cb, ModelSummary) and not isinstance(cb, WholeModelSummary):
            callbacks[i] = WholeModelSummary(max_depth=cb._max_depth)
