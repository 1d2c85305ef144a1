"""ModalityEncoder: a HF encoder, its projector into the LLM's width, and the seed's callback interface."""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from lightning_mm.model.families import encoder_family

PROJECTORS = ("linear", "mlp")


def build_projector(kind: str, in_dim: int, out_dim: int) -> nn.Module:
    """``"linear"``: one Linear; ``"mlp"``: Linear-GELU-Linear (LLaVA-1.5)."""
    if kind == "linear":
        return nn.Linear(in_dim, out_dim)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(in_dim, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim))
    raise ValueError(f"unknown projector {kind!r}; choose one of {PROJECTORS} or pass an nn.Module")


class ModalityEncoder(nn.Module):
    """One modality: ``preprocess -> encoder -> postprocess_encoder -> projector -> postprocess_projector``.

    ``preprocess(inputs) -> inputs``; ``postprocess_encoder(inputs, features) -> features`` and
    ``postprocess_projector(inputs, features) -> features`` see features as ``[total_tokens, dim]`` (every item of
    the batch in order). A string projector is built when the encoder joins a ``MultimodalModel`` (which knows the
    LLM's width); until then ``projector`` is None. Callbacks that change the number of tokens must come with a
    ``num_tokens`` override, since the LLM sequence is laid out before the encoder runs.

    ``encoder`` may be a local folder written by ``save_pretrained`` (the tower itself or the whole CLIP / SigLIP /
    Whisper / Qwen2-VL / Qwen2-Audio model it belongs to): see ``lightning_mm.model.loading.load_encoder``; under
    the meta device only its shapes are built and ``materialise`` reads the weights later.
    """

    def __init__(self, encoder: nn.Module | str, projector: str | nn.Module = "mlp",
                 preprocess: Callable | None = None, postprocess_encoder: Callable | None = None,
                 postprocess_projector: Callable | None = None, placeholder_id: int | None = None,
                 num_tokens: Callable | None = None):
        super().__init__()
        if isinstance(encoder, (str, os.PathLike)):
            from lightning_mm.model.loading import load_encoder

            encoder = load_encoder(encoder)
        self.family = encoder_family(encoder)
        self.module = encoder
        self.config = encoder.config  # kept when a pipeline stage drops the module itself
        self.projector_kind = projector if isinstance(projector, str) else None
        if isinstance(projector, str) and projector not in PROJECTORS:
            raise ValueError(f"unknown projector {projector!r}; choose one of {PROJECTORS} or pass an nn.Module")
        self.projector = projector if isinstance(projector, nn.Module) else None
        self.preprocess, self.postprocess_encoder, self.postprocess_projector = (
            preprocess, postprocess_encoder, postprocess_projector)
        self.placeholder_id = placeholder_id
        self._num_tokens = num_tokens

    @property
    def output_dim(self) -> int:
        return self.family.output_dim(self.module)

    def attach(self, llm_hidden_size: int) -> bool:
        """Build a string projector for the LLM's width (called by MultimodalModel); True if it was built now.

        Its values come from ``MultimodalModel``, which knows its full name (``init_parameters``)."""
        if self.projector is None:
            self.projector = build_projector(self.projector_kind, self.output_dim, llm_hidden_size)
            return True
        return False

    @property
    def layers(self) -> nn.ModuleList:
        return self.family.layers(self.module)

    def num_tokens(self, inputs: dict) -> list[int]:
        """LLM tokens each item (image, clip) will produce, known before the encoder runs."""
        inputs = self.preprocess(inputs) if self.preprocess else inputs
        if self._num_tokens is not None:
            return list(self._num_tokens(inputs))
        return self.family.num_tokens(self.config, inputs)

    # The three steps a pipeline stage composes; ``forward`` runs them all.
    def embed(self, inputs: dict) -> tuple[torch.Tensor, dict]:
        inputs = self.preprocess(inputs) if self.preprocess else inputs
        return self.family.embed(self.module, inputs)

    def run_layers(self, hidden: torch.Tensor, ctx: dict, start: int = 0, end: int | None = None) -> torch.Tensor:
        for layer in list(self.layers)[start:end]:
            hidden = self.family.run_layer(self.module, layer, hidden, ctx)
        return hidden

    def head(self, hidden: torch.Tensor, ctx: dict, inputs: dict) -> torch.Tensor:
        """Final norm of the encoder, callbacks and projector: ``[total_tokens, llm_hidden]``."""
        feats = self.family.final(self.module, hidden, ctx)
        if self.postprocess_encoder:
            feats = self.postprocess_encoder(inputs, feats)
        if self.projector is None:
            raise RuntimeError("the projector is not built yet: put the encoder in a MultimodalModel first")
        feats = self.family.project(self.projector, feats, ctx)  # AnyRes packs its items after projecting
        if self.postprocess_projector:
            feats = self.postprocess_projector(inputs, feats)
        return feats

    def forward(self, inputs: dict) -> torch.Tensor:
        hidden, ctx = self.embed(inputs)
        return self.head(self.run_layers(hidden, ctx), ctx, inputs)
