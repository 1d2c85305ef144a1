"""Model composition: modality encoders, projectors, the LLM, and per-family adapters."""

from lightning_mm.model.encoder import ModalityEncoder, build_projector
from lightning_mm.model.families import (encoder_family, language_family, tiny_encoder,
                                         tiny_language_model)
from lightning_mm.model.loading import (ModelFolderError, PretrainedSource, init_parameters, init_seed, is_meta,
                                        load_encoder, load_language_model, materialise)
from lightning_mm.model.multimodal import AttentionContext, MultimodalModel, MultimodalOutput

__all__ = ["ModalityEncoder", "MultimodalModel", "MultimodalOutput", "AttentionContext", "build_projector",
           "encoder_family", "language_family", "tiny_encoder", "tiny_language_model", "ModelFolderError",
           "PretrainedSource", "init_parameters", "init_seed", "is_meta", "load_encoder", "load_language_model",
           "materialise"]
