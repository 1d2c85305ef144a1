"""Causal LMs for the Qwen2-VL / Qwen2.5-VL text decoders (transformers has none): the language model of those
composites as ``MultimodalModel`` holds it (``lightning_mm.model.composites``), and the HF class of the M-RoPE
decoder families (``lightning_mm.model.families``)."""

from __future__ import annotations

from torch import nn

from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPreTrainedModel, Qwen2_5_VLTextModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLPreTrainedModel, Qwen2VLTextModel


class _TextForCausalLM:
    """A ``*ForCausalLM`` for a Qwen-VL text decoder (transformers has none): ``model`` + ``lm_head``, the
    composite's language model and head under the names a causal LM has."""

    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    text_model = None

    def __init__(self, config):
        super().__init__(config)
        self.model = self.text_model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                **kwargs):
        """``position_ids`` as HF's text model takes them: ``[3, B, S]`` or ``[B, S]``."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class Qwen2VLTextForCausalLM(_TextForCausalLM, Qwen2VLPreTrainedModel):
    config: Qwen2VLTextConfig
    text_model = Qwen2VLTextModel


class Qwen2_5_VLTextForCausalLM(_TextForCausalLM, Qwen2_5_VLPreTrainedModel):
    config: Qwen2_5_VLTextConfig
    text_model = Qwen2_5_VLTextModel


__all__ = ["Qwen2VLTextForCausalLM", "Qwen2_5_VLTextForCausalLM"]
