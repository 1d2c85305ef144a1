"""Qwen3-Omni's thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``): its audio encoder, its vision encoder
(Qwen3-VL's, DeepStack included, for images and videos alike) and its MoE text decoder with interleaved M-RoPE.
Importing this module registers the families (``lightning_mm.model`` does).

The audio encoder reads each clip's real mel frames (``feature_attention_mask``) in chunks of ``2 * n_window``
frames, three stride-2 convolutions per chunk, then attends within windows of ``n_window_infer`` frames
(``cu_seqlens``): its ``embed`` runs the convolutions over every clip of a microbatch, flattened to
``[tokens, d_model]`` as HF's encoder flattens them, and its ``final`` the norm and the two projections out to the
LLM's width (the composite has no separate projector). The talker (speech output) is not part of the thinker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_mm.model.families import ENCODER_FAMILIES, MROPE_FAMILIES, EncoderFamily, Qwen3VisionFamily
from lightning_mm.model.moe import MRopeMoeDecoderFamily

OMNI_MODULE = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe"


class Qwen3OmniAudioFamily(EncoderFamily):
    """Qwen3-Omni's audio encoder (``Qwen3OmniMoeAudioEncoder``). ``inputs = {"input_features": [N, mel, frames],
    "feature_attention_mask": [N, frames]}`` as the processor gives them (without the mask every frame is real);
    a clip of ``n`` real frames emits ``_get_feat_extract_output_lengths(n, n_window)`` tokens."""

    name, class_names, input_key = "Qwen3-Omni audio", ("Qwen3OmniMoeAudioEncoder",), "input_features"
    hf_module = OMNI_MODULE
    folder_model_types = {"qwen3_omni_moe_audio_encoder": None}
    embed_modules = ("conv2d1", "conv2d2", "conv2d3", "conv_out", "positional_embedding")

    def output_dim(self, enc):
        return enc.config.output_dim

    def layers(self, enc):
        return enc.layers

    @staticmethod
    def _frames(inputs) -> torch.Tensor:
        """Real mel frames per clip."""
        mask = inputs.get("feature_attention_mask")
        feats = inputs["input_features"]
        if mask is None:
            return torch.full((feats.shape[0],), feats.shape[-1], dtype=torch.long, device=feats.device)
        return mask.sum(-1)

    def num_tokens(self, config, inputs):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

        return [int(n) for n in _get_feat_extract_output_lengths(self._frames(inputs), config.n_window).tolist()]

    def _chunks(self, enc, inputs):
        """(the clips' real frames cut into chunks and padded ``[chunks, mel, 2 * n_window]``, chunk lengths,
        frames per clip), as HF's encoder cuts them."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import chunk_and_pad_features

        feats, frames = inputs["input_features"], self._frames(inputs)
        mask = inputs.get("feature_attention_mask")
        real = feats.permute(0, 2, 1)[mask.bool()] if mask is not None else feats.permute(0, 2, 1).flatten(0, 1)
        padded, lengths = chunk_and_pad_features(real.permute(1, 0), frames, enc.n_window)
        return padded, lengths, frames

    def context(self, enc, inputs):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import get_audio_cu_seqlens
        from transformers.utils.generic import get_max_seqlen

        _, lengths, frames = self._chunks(enc, inputs)
        cu_seqlens = get_audio_cu_seqlens(lengths, frames, enc.n_window_infer, enc.n_window)
        return {"cu_seqlens": cu_seqlens, "max_seqlen": get_max_seqlen(cu_seqlens, enc.config)}

    def embed(self, enc, inputs):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import get_valid_indices

        padded, lengths, _ = self._chunks(enc, inputs)
        valid = get_valid_indices(lengths, enc.n_window)
        x = padded.unsqueeze(1).to(enc.conv2d1.weight.dtype)
        for conv in (enc.conv2d1, enc.conv2d2, enc.conv2d3):
            x = nn.functional.gelu(conv(x))
        b, c, f, t = x.shape
        x = enc.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        x = x + enc.positional_embedding.positional_embedding[:t].unsqueeze(0).to(x.dtype)
        return x.reshape(-1, x.shape[-1]).index_select(0, valid), self.context(enc, inputs)

    def run_layer(self, enc, layer, hidden, ctx):
        return layer(hidden, ctx["cu_seqlens"], max_seqlen=ctx["max_seqlen"])[0]

    def final(self, enc, hidden, ctx):
        return enc.proj2(enc.act(enc.proj1(enc.ln_post(hidden))))

    def reference(self, enc, inputs):
        frames = self._frames(inputs)
        mask = inputs.get("feature_attention_mask")
        feats = inputs["input_features"].permute(0, 2, 1)
        feats = (feats[mask.bool()] if mask is not None else feats.flatten(0, 1)).permute(1, 0)
        return enc(feats, feature_lens=frames).last_hidden_state

    def tiny(self, **overrides):
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

        kw = dict(TINY_AUDIO)
        kw.update(overrides)
        return Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**kw))

    def random_inputs(self, config, num_items, generator=None, frames=None, **_):
        """Random mel clips padded to the longest: ``frames`` real frames each (default 230, 130, 60, ...: longer than
        an attention window, than one chunk of ``2 * n_window`` frames, and shorter)."""
        frames = frames or [max(10, 230 - 100 * i + 30 * (i > 1)) for i in range(num_items)]
        total = max(frames)
        mask = (torch.arange(total)[None, :] < torch.tensor(frames)[:, None]).long()
        feats = torch.randn(num_items, config.num_mel_bins, total, generator=generator) * mask[:, None, :]
        return {"input_features": feats, "feature_attention_mask": mask}


# a tiny audio encoder: HF's chunks of 100 frames (13 tokens each: its token count assumes n_window=50), attention
# windows of 200 frames (two chunks)
TINY_AUDIO = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
                  max_source_positions=64, n_window=50, output_dim=32, n_window_infer=200, downsample_hidden_size=8)


class Qwen3OmniVisionFamily(Qwen3VisionFamily):
    """Qwen3-Omni's vision encoder: Qwen3-VL's tower (learned positions resampled to each grid, DeepStack mergers
    after ``deepstack_visual_indexes``) under its own class."""

    name, class_names = "Qwen3-Omni vision", ("Qwen3OmniMoeVisionEncoder",)
    hf_module = OMNI_MODULE
    folder_model_types = {"qwen3_omni_moe_vision_encoder": None}

    def tiny(self, **overrides):
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

        kw = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
        kw.update(overrides)
        return Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(**kw))


for _family in (Qwen3OmniAudioFamily(), Qwen3OmniVisionFamily()):
    ENCODER_FAMILIES[_family.class_names[0]] = _family

MROPE_FAMILIES["qwen3_omni_moe_text"] = MRopeMoeDecoderFamily(
    "Qwen3-Omni thinker text", "qwen3_omni_moe_text", "Qwen3OmniMoeThinkerTextForCausalLM", "Qwen3OmniMoeTextConfig",
    router_class="Qwen3OmniMoeThinkerTextTopKRouter")


@dataclass(frozen=True)
class AudioInVideo:
    """Refuses what our M-RoPE positions do not compute, before anything runs: a video with its audio interleaved
    inside it (the processor's ``load_audio_from_video``: a vision start token followed by an audio start token),
    whose tokens HF orders by time across both."""

    vision_start_token_id: int | None
    audio_start_token_id: int | None

    def __call__(self, input_ids: torch.Tensor) -> None:
        if self.vision_start_token_id is None or self.audio_start_token_id is None:
            return
        ids = input_ids.reshape(-1)
        if bool(((ids[:-1] == self.vision_start_token_id) & (ids[1:] == self.audio_start_token_id)).any()):
            raise ValueError("Qwen3-Omni: a video with its audio interleaved in it (load_audio_from_video / "
                             "use_audio_in_video) is not supported; give the video's audio as an audio item of "
                             "its own, beside the video")


__all__ = ["Qwen3OmniAudioFamily", "Qwen3OmniVisionFamily", "TINY_AUDIO", "AudioInVideo"]
