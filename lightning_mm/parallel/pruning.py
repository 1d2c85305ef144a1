"""Pipeline stages on a model: which parameters a stage owns, and dropping the rest.

Which layers each stage runs is planned in ``lightning_mm.plan.stages``. A stage keeps the unparallelised
model's module tree and names; modules it does not own are replaced by ``nn.Identity`` (their memory is freed),
so a stage's state dict is a slice of the full model's, keyed by the same names.
"""

from __future__ import annotations

from torch import nn

from lightning_mm.plan.stages import Slice, StagePlan


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
    for name, _ in owner.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
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


def tied_embedding_stages(model, num_llm_stages: int) -> tuple[str, str] | None:
    """The LLM's first and last stage when they share a tied input/output embedding (HF ``tie_word_embeddings``)
    across a pipeline; each then holds its own copy, kept equal by summing their gradients (as Megatron does)."""
    from lightning_mm.plan.placement import LANGUAGE_MODEL, stage_name

    lm = model.language_model
    head = getattr(lm, "lm_head", None)
    if num_llm_stages > 1 and head is not None and head.weight is model.lm_family.embed_tokens(lm).weight:
        return stage_name(LANGUAGE_MODEL, 0), stage_name(LANGUAGE_MODEL, num_llm_stages - 1)
    return None


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
