"""Causal LMs for the Qwen2-VL / Qwen2.5-VL / Qwen3-VL (and -MoE) / Qwen3.5 (and -MoE) / Qwen3-Omni thinker text
decoders (transformers has none that takes a prompt's M-RoPE positions): the language model of those composites
as ``MultimodalModel`` holds it (``lightning_mm.model.composites``), and the HF class of the M-RoPE decoder
families (``lightning_mm.model.families``)."""

from __future__ import annotations

from torch import nn

from transformers import GenerationMixin
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPreTrainedModel, Qwen2_5_VLTextModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLPreTrainedModel, Qwen2VLTextModel
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5PreTrainedModel, Qwen3_5TextModel
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoePreTrainedModel, Qwen3_5MoeTextModel
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (Qwen3OmniMoeThinkerTextModel,
                                                                        Qwen3OmniMoeThinkerTextPreTrainedModel)
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLPreTrainedModel, Qwen3VLTextModel
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoePreTrainedModel, Qwen3VLMoeTextModel


class _TextForCausalLM(GenerationMixin):
    """A ``*ForCausalLM`` for a Qwen-VL text decoder (transformers has none): ``model`` + ``lm_head``, the
    composite's language model and head under the names a causal LM has, and transformers' ``generate``, which
    takes the prompt's M-RoPE positions as ``prompt_positions`` (``MultimodalModel.generate`` passes them)."""

    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    text_model = None

    @classmethod
    def can_generate(cls) -> bool:  # transformers looks for GenerationMixin among a class's direct bases only
        return True

    def __init__(self, config):
        super().__init__(config)
        self.model = self.text_model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def prepare_inputs_for_generation(self, input_ids, *args, inputs_embeds=None, prompt_positions=None,
                                      prompt_deepstack=None, **kwargs):
        """transformers' inputs of one decoding step. With ``prompt_positions`` (``[B, S, 3]``, the positions of a
        left-aligned prompt of ``S`` tokens) the prompt's tokens are at those positions and generated token ``t``
        at ``next_positions(prompt_positions) + t`` (``lightning_mm.model.generation``), as HF's Qwen-VL
        composites decode; the step's tokens are found from the cache's length. ``prompt_deepstack`` (Qwen3-VL:
        ``(visual_pos_masks, deepstack_visual_embeds)`` of the prompt) goes to the text model at prefill only."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)
        cache = inputs.get("cache")
        start = 0 if cache is None else cache.get_seq_length()
        if prompt_positions is not None:
            from lightning_mm.model.generation import positions_after

            fed = inputs["input_ids"] if inputs.get("inputs_embeds") is None else inputs["inputs_embeds"]
            inputs["position_ids"] = positions_after(prompt_positions, start, fed.shape[1]).permute(2, 0, 1)
        if prompt_deepstack is not None and start == 0:
            inputs["visual_pos_masks"], inputs["deepstack_visual_embeds"] = prompt_deepstack
        return inputs

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                cache=None, **kwargs):
        """``position_ids`` as HF's text model takes them: ``[3, B, S]`` or ``[B, S]``."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, cache=cache, **kwargs)
        logits = self.lm_head(out.last_hidden_state)
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)


class Qwen2VLTextForCausalLM(_TextForCausalLM, Qwen2VLPreTrainedModel):
    config: Qwen2VLTextConfig
    text_model = Qwen2VLTextModel


class Qwen2_5_VLTextForCausalLM(_TextForCausalLM, Qwen2_5_VLPreTrainedModel):
    config: Qwen2_5_VLTextConfig
    text_model = Qwen2_5_VLTextModel


class Qwen3VLTextForCausalLM(_TextForCausalLM, Qwen3VLPreTrainedModel):
    config: Qwen3VLTextConfig
    text_model = Qwen3VLTextModel


class Qwen3VLMoeTextForCausalLM(_TextForCausalLM, Qwen3VLMoePreTrainedModel):
    config: Qwen3VLMoeTextConfig
    text_model = Qwen3VLMoeTextModel


class Qwen3_5TextForCausalLM(_TextForCausalLM, Qwen3_5PreTrainedModel):
    config: Qwen3_5TextConfig
    text_model = Qwen3_5TextModel


class Qwen3_5MoeTextForCausalLM(_TextForCausalLM, Qwen3_5MoePreTrainedModel):
    config: Qwen3_5MoeTextConfig
    text_model = Qwen3_5MoeTextModel


class Qwen3OmniMoeThinkerTextForCausalLM(_TextForCausalLM, Qwen3OmniMoeThinkerTextPreTrainedModel):
    config: Qwen3OmniMoeTextConfig
    text_model = Qwen3OmniMoeThinkerTextModel


__all__ = ["Qwen2VLTextForCausalLM", "Qwen2_5_VLTextForCausalLM", "Qwen3VLTextForCausalLM",
           "Qwen3VLMoeTextForCausalLM", "Qwen3_5TextForCausalLM", "Qwen3_5MoeTextForCausalLM",
           "Qwen3OmniMoeThinkerTextForCausalLM"]
