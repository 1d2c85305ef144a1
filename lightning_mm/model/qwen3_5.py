"""Qwen3.5 (dense and MoE): the text decoders, whose layers alternate Gated DeltaNet (linear attention) and gated
full attention (``config.layer_types``), with interleaved M-RoPE on part of each head, and the vision tower
(Qwen3-VL's without DeepStack).

The decoder families run HF's layers unchanged; their Gated DeltaNet modules are made segment-aware
(``lightning_mm.model.linear_attention``) so packed samples stay apart, and ``layer_types`` tells the planner
and the layout which layers are linear. Importing this module registers the families (``lightning_mm.model``
does).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_mm.model.families import ENCODER_FAMILIES, MROPE_FAMILIES, MRopeDecoderFamily, Qwen2VisionFamily, \
    Qwen3VisionFamily
from lightning_mm.model.linear_attention import LINEAR, has_linear_attention, layer_types, segment_aware
from lightning_mm.model.moe import MoeDecoderFamily


@dataclass(frozen=True)
class LinearAttentionDecoderFamily(MRopeDecoderFamily):
    """Qwen3.5's text decoder (the LLM of ``Qwen3_5ForConditionalGeneration``): M-RoPE positions; three Gated
    DeltaNet layers to one gated full-attention layer. ``prepare`` makes the GDN modules segment-aware (also
    done by ``run_layer``, for a model prepared elsewhere)."""

    def prepare(self, lm: nn.Module) -> None:
        for layer in self.layers(lm):
            if hasattr(layer, "linear_attn"):
                segment_aware(layer.linear_attn)

    def layer_types(self, lm: nn.Module) -> list[str]:
        return layer_types(lm.config)

    def run_layer(self, layer, hidden, position_embeddings, position_ids, attn_kwargs):
        if hasattr(layer, "linear_attn"):
            segment_aware(layer.linear_attn)
        return super().run_layer(layer, hidden, position_embeddings, position_ids, attn_kwargs)

    def tiny_config(self, **overrides):
        kw = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                   "mrope_interleaved": True, "partial_rotary_factor": 0.5})
        kw.update(overrides)
        return MRopeDecoderFamily.tiny_config(self, **kw)


@dataclass(frozen=True)
class LinearAttentionMoeDecoderFamily(MoeDecoderFamily, LinearAttentionDecoderFamily):
    """Qwen3.5-MoE's text decoder: Qwen3.5's layers with routed experts beside a gated shared expert."""

    def tiny_config(self, **overrides):
        kw = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
                  num_experts_per_tok=2, router_aux_loss_coef=0.01, output_router_logits=False)
        kw.update(overrides)
        return LinearAttentionDecoderFamily.tiny_config(self, **kw)


MROPE_FAMILIES["qwen3_5_text"] = LinearAttentionDecoderFamily(
    "Qwen3.5 text", "qwen3_5_text", "Qwen3_5TextForCausalLM", "Qwen3_5TextConfig")
MROPE_FAMILIES["qwen3_5_moe_text"] = LinearAttentionMoeDecoderFamily(
    "Qwen3.5-MoE text", "qwen3_5_moe_text", "Qwen3_5MoeTextForCausalLM", "Qwen3_5MoeTextConfig",
    router_class="Qwen3_5MoeTopKRouter")


class Qwen35VisionFamily(Qwen3VisionFamily):
    """Qwen3.5's vision tower: Qwen3-VL's (learned positions resampled to each grid, packed images) without
    DeepStack: the merger alone projects."""

    name, class_names = "Qwen3.5 vision", ("Qwen3_5VisionModel",)
    hf_module = "transformers.models.qwen3_5.modeling_qwen3_5"
    folder_model_types = {"qwen3_5_vision": None, "qwen3_5": "vision_config"}

    def deepstack_layers(self, config) -> int:
        return 0

    def project(self, projector, feats, ctx):
        return projector(feats)

    def run_layer(self, enc, layer, hidden, ctx):
        return Qwen2VisionFamily.run_layer(self, enc, layer, hidden, ctx)

    def stage_output(self, enc, hidden, ctx):
        return hidden

    def stage_input(self, enc, received, ctx):
        return received

    def final(self, enc, hidden, ctx):
        return enc.merger(hidden)

    def reference(self, enc, inputs):
        return enc(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output

    def tiny(self, **overrides):
        import importlib

        module = importlib.import_module(self.hf_module)
        config_module = importlib.import_module(self.hf_module.replace(".modeling_", ".configuration_"))
        kw = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16)
        kw.update(overrides)
        config = getattr(config_module, self.class_names[0].replace("Model", "Config"))(**kw)
        return getattr(module, self.class_names[0])(config)


class Qwen35MoeVisionFamily(Qwen35VisionFamily):
    """Qwen3.5-MoE's vision tower: Qwen3.5's, under its own class."""

    name, class_names = "Qwen3.5-MoE vision", ("Qwen3_5MoeVisionModel",)
    hf_module = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
    folder_model_types = {"qwen3_5_moe_vision": None, "qwen3_5_moe": "vision_config"}


for _family in (Qwen35VisionFamily(), Qwen35MoeVisionFamily()):
    ENCODER_FAMILIES[_family.class_names[0]] = _family


def check_context_parallel_heads(lm: nn.Module, cp: int, where: str = "ParallelSpec") -> None:
    """Raise, with the fix, when ``cp`` ranks cannot split the Gated DeltaNet layers of a language model by heads
    (``cp`` must divide ``linear_num_value_heads``); pure: before any group exists."""
    from lightning_mm.model.linear_attention import check_gdn_heads

    if cp > 1 and has_linear_attention(lm):
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        check_gdn_heads(cfg.linear_num_value_heads, cp, f"{where}: language_model cp={cp}")


__all__ = ["LINEAR", "LinearAttentionDecoderFamily", "LinearAttentionMoeDecoderFamily", "Qwen35VisionFamily",
           "Qwen35MoeVisionFamily", "check_context_parallel_heads", "has_linear_attention", "layer_types"]
