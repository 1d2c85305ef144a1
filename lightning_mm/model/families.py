"""How each supported HF model family splits into embedding / layers / final parts.

Every adapter exposes the same three steps, so a pipeline stage can run any contiguous slice of layers:
``embed`` (inputs -> hidden + a context of tensors the layers need), ``run_layer`` and ``final``. Running them
back to back reproduces the family's own HF forward (tested against it). Each adapter also builds a tiny
config for tests, since nothing here may download weights.

Encoder outputs are flattened to ``[total_tokens, dim]`` (all items of the batch in order), the form in which
they are scattered into the LLM sequence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------------------
# Language models
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderFamily:
    """A decoder-only causal LM with ``model.{embed_tokens, layers, norm, rotary_emb}`` and ``lm_head``."""

    name: str
    model_type: str
    class_name: str
    config_name: str

    def hf_class(self):
        import transformers

        return getattr(transformers, self.class_name)

    def embed_tokens(self, lm):
        return lm.model.embed_tokens

    def layers(self, lm) -> nn.ModuleList:
        return lm.model.layers

    def hidden_size(self, lm) -> int:
        return lm.config.hidden_size

    def vocab_size(self, lm) -> int:
        return lm.config.vocab_size

    def position_embeddings(self, lm, hidden, position_ids):
        return lm.model.rotary_emb(hidden, position_ids)

    def run_layer(self, layer, hidden, position_embeddings, position_ids, attn_kwargs):
        return layer(hidden, attention_mask=None, position_embeddings=position_embeddings, position_ids=position_ids,
                     **attn_kwargs)

    def final_modules(self, lm) -> dict[str, nn.Module]:
        return {"norm": lm.model.norm, "lm_head": lm.lm_head}

    def has_routed_experts(self, lm) -> bool:
        """Whether ``lm``'s layers hold routed experts expert parallelism can split (``is_moe`` families: always;
        a family whose experts are a config option says so itself)."""
        return bool(getattr(self, "is_moe", False))

    def logits(self, lm, hidden):
        logits = lm.lm_head(lm.model.norm(hidden))
        cap = getattr(lm.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def tiny_config(self, **overrides):
        import transformers

        kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
        if self.model_type == "gemma2":
            kw.update(head_dim=8, attn_logit_softcapping=None, final_logit_softcapping=30.0, sliding_window=4096,
                      query_pre_attn_scalar=8)
        if self.model_type == "qwen3":
            kw.update(head_dim=8)
        if self.model_type in ("mistral", "qwen2", "qwen3", "phi3"):
            kw.update(sliding_window=None)
        if self.model_type == "phi3":
            kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kw.update(overrides)
        return getattr(transformers, self.config_name)(**kw)

    def tiny(self, **overrides):
        import transformers

        return getattr(transformers, self.class_name)(self.tiny_config(**overrides))


LANGUAGE_FAMILIES = {f.model_type: f for f in (
    DecoderFamily("Llama", "llama", "LlamaForCausalLM", "LlamaConfig"),
    DecoderFamily("Qwen2", "qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
    DecoderFamily("Qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen3Config"),
    DecoderFamily("Mistral", "mistral", "MistralForCausalLM", "MistralConfig"),
    DecoderFamily("Gemma2", "gemma2", "Gemma2ForCausalLM", "Gemma2Config"),
    DecoderFamily("Phi3", "phi3", "Phi3ForCausalLM", "Phi3Config"),
)}


@dataclass(frozen=True)
class MRopeDecoderFamily(DecoderFamily):
    """The text decoder of Qwen2-VL / Qwen2.5-VL / Qwen3-VL (the LLM of those composites, wrapped with its
    ``lm_head`` by ``lightning_mm.model.mrope_lm``): multimodal RoPE over (temporal, height, width) positions.

    ``position_ids`` are ``[B, S, 3]`` (batch-first, so microbatches and context-parallel shards cut them like
    every other sequence tensor), or ``[B, S]``: the same position on all three axes, as HF reads 2-D positions."""

    position_dims: int = 3

    def hf_class(self):
        from lightning_mm.model import mrope_lm

        return getattr(mrope_lm, self.class_name)

    def position_embeddings(self, lm, hidden, position_ids):
        pos = position_ids.permute(2, 0, 1) if position_ids.dim() == 3 else position_ids[None].expand(3, -1, -1)
        return lm.model.rotary_emb(hidden, pos)

    def run_layer(self, layer, hidden, position_embeddings, position_ids, attn_kwargs):
        return layer(hidden, attention_mask=None, position_embeddings=position_embeddings, position_ids=None,
                     **attn_kwargs)

    def tiny_config(self, **overrides):
        import transformers

        kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
        if self.model_type == "qwen3_vl_text":
            kw.update(head_dim=8)
        kw.update(overrides)
        return getattr(transformers, self.config_name)(**kw)

    def tiny(self, **overrides):
        return self.hf_class()(self.tiny_config(**overrides))


@dataclass(frozen=True)
class Gemma3DecoderFamily(DecoderFamily):
    """Gemma 3's text decoder (``Gemma3ForCausalLM``, and the LLM of ``Gemma3ForConditionalGeneration``): local
    (sliding-window) and global layers (``config.layer_types``), each kind with its own rotary embedding. The
    window reaches the attention per layer, as transformers passes it (``sliding_window=`` on local layers,
    ``None`` on global ones); the scaling is ``query_pre_attn_scalar ** -0.5``, passed by the layer as
    ``scaling``. Embeddings are scaled by ``sqrt(hidden_size)`` inside ``embed_tokens``, as in HF."""

    def position_embeddings(self, lm, hidden, position_ids):
        return {kind: lm.model.rotary_emb(hidden, position_ids, kind) for kind in set(lm.config.layer_types)}

    def has_routed_experts(self, lm) -> bool:
        return bool(getattr(lm.config, "enable_moe_block", False))  # no router statistics: no aux loss

    def num_experts(self, lm) -> int:
        return lm.config.num_experts

    def top_k(self, lm) -> int:
        return lm.config.top_k_experts

    def run_layer(self, layer, hidden, position_embeddings, position_ids, attn_kwargs):
        kind = layer.self_attn.layer_type  # "sliding_attention" or "full_attention"
        return layer(hidden, attention_mask=None, position_embeddings=position_embeddings[kind],
                     position_ids=position_ids, **attn_kwargs)

    def tiny_config(self, **overrides):
        import transformers

        kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
                  sliding_window=8, query_pre_attn_scalar=16,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
        kw.update(overrides)
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:  # HF's 5 local : 1 global pattern
            kw["layer_types"] = None
        return getattr(transformers, self.config_name)(**kw)


@dataclass(frozen=True)
class Gemma4DecoderFamily(Gemma3DecoderFamily):
    """Gemma 4's text decoder (``Gemma4ForCausalLM``): local (sliding-window) and global layers as Gemma 3's (global
    layers with their own head size, proportional RoPE and, with ``attention_k_eq_v``, values from the key
    projection), attention scaling 1 (queries and keys are RMS-normed), and with ``enable_moe_block`` routed experts
    beside each layer's MLP, run inside the HF layer (Gemma 4 adds no load-balancing loss).

    Refused (``check``): per-layer embeddings (``hidden_size_per_layer_input``, a second embedding of the token
    ids that every layer reads, which our stages do not carry), KV sharing (``num_kv_shared_layers``: later layers
    read earlier layers' keys and values, across pipeline stages) and ``use_bidirectional_attention="all"``."""

    def check(self, lm) -> None:
        c = lm.config
        fixes = [(c.hidden_size_per_layer_input, "per-layer embeddings (hidden_size_per_layer_input="
                  f"{c.hidden_size_per_layer_input}), whose second token embedding every layer reads",
                  "hidden_size_per_layer_input=0"),
                 (c.num_kv_shared_layers, f"KV sharing (num_kv_shared_layers={c.num_kv_shared_layers}), where later "
                  "layers reuse earlier layers' keys and values", "num_kv_shared_layers=0"),
                 (c.use_bidirectional_attention == "all", "bidirectional attention over all tokens "
                  "(use_bidirectional_attention='all')", "use_bidirectional_attention=None")]
        for on, what, fix in fixes:
            if on:
                raise ValueError(f"Gemma 4 text model with {what} is not supported: pipeline stages, context "
                                 f"parallelism and the bitfield mask do not carry it. Use a checkpoint with {fix} "
                                 "(Gemma 4 31B and 26B-A4B have none of these)")

    def run_layer(self, layer, hidden, position_embeddings, position_ids, attn_kwargs):
        kind = layer.self_attn.layer_type
        # shared_kv_states: the layer stores its keys and values there for KV-sharing layers (refused); a throwaway
        return layer(hidden, None, shared_kv_states={}, attention_mask=None,
                     position_embeddings=position_embeddings[kind], position_ids=position_ids, **attn_kwargs)

    def tiny_config(self, **overrides):
        import transformers

        kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, global_head_dim=16, max_position_embeddings=512,
                  tie_word_embeddings=False, sliding_window=8, hidden_size_per_layer_input=0,
                  vocab_size_per_layer_input=128, final_logit_softcapping=30.0,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"])
        if overrides.pop("moe", False):  # routed experts beside every layer's MLP
            kw.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
        kw.update(overrides)
        return transformers.Gemma4TextConfig(**kw)


def layer_windows(lm: nn.Module) -> list[int | None]:
    """The sliding window of each decoder layer of a HF causal LM (``None`` = full attention), as its attention
    receives it: ``config.layer_types`` (Gemma 2/3, Qwen2/3) picks ``config.sliding_window`` per layer; without
    layer types (Mistral, Phi-3) every layer has the config's window. For ``masks.block_workload(window=...)``.
    A composite (``Gemma3ForConditionalGeneration``) gives its text model's."""
    config = getattr(lm, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        return []
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types[:n]]


MROPE_FAMILIES = {f.model_type: f for f in (
    MRopeDecoderFamily("Qwen2-VL text", "qwen2_vl_text", "Qwen2VLTextForCausalLM", "Qwen2VLTextConfig"),
    MRopeDecoderFamily("Qwen2.5-VL text", "qwen2_5_vl_text", "Qwen2_5_VLTextForCausalLM", "Qwen2_5_VLTextConfig"),
    MRopeDecoderFamily("Qwen3-VL text", "qwen3_vl_text", "Qwen3VLTextForCausalLM", "Qwen3VLTextConfig"),
)}
LANGUAGE_FAMILIES["gemma3_text"] = Gemma3DecoderFamily("Gemma3", "gemma3_text", "Gemma3ForCausalLM",
                                                       "Gemma3TextConfig")
LANGUAGE_FAMILIES["gemma4_text"] = Gemma4DecoderFamily("Gemma4", "gemma4_text", "Gemma4ForCausalLM",
                                                       "Gemma4TextConfig")


def language_family(lm: nn.Module) -> DecoderFamily:
    """The adapter of a HF causal LM, or a clear error naming the supported families."""
    model_type = getattr(getattr(lm, "config", None), "model_type", None)
    fam = LANGUAGE_FAMILIES.get(model_type) or MROPE_FAMILIES.get(model_type)
    if fam is None or not hasattr(lm, "lm_head"):
        supported = ", ".join(f.class_name for f in LANGUAGE_FAMILIES.values())
        raise ValueError(f"unsupported language model {type(lm).__name__} (model_type={model_type!r}); supported "
                         f"families: {supported}. Pass the *ForCausalLM class of one of them")
    if hasattr(fam, "check"):  # what a family refuses (Gemma 4's per-layer embeddings, KV sharing)
        fam.check(lm)
    return fam


# ----------------------------------------------------------------------------------------------------------
# Encoders
# ----------------------------------------------------------------------------------------------------------


class EncoderFamily:
    """Base of the encoder adapters. ``inputs`` is the modality's dict of tensors (HF processor names)."""

    name = ""
    class_names: tuple[str, ...] = ()
    hf_module = "transformers"  # where the class named class_names[0] lives
    # config ``model_type`` of a saved folder -> the attribute of that config holding the encoder's own config
    # (None: the config is the encoder's), e.g. a whole CLIPModel folder -> ``vision_config``
    folder_model_types: dict[str, str | None] = {}
    input_key = "pixel_values"
    embed_modules: tuple[str, ...] = ("embeddings",)  # run by ``embed``; every other non-layer part by ``final``
    # tensor parallelism (``lightning_mm.parallel.tensor_parallel``): HF plan names per module path inside one
    # layer (empty: no plan, tp must be 1), and attributes holding a head count the layer reshapes by
    tp_plan: dict[str, str] = {}
    tp_head_attrs: tuple[str, ...] = ()

    def tensor_parallel_plan(self, enc) -> dict[str, str]:
        """The plan for this encoder instance (a family may have variants it cannot split)."""
        return self.tp_plan

    def hf_class(self):
        import importlib

        return getattr(importlib.import_module(self.hf_module), self.class_names[0])

    def layers(self, enc) -> nn.ModuleList:
        return enc.encoder.layers

    def output_dim(self, enc) -> int:
        return enc.config.hidden_size

    def num_items(self, inputs) -> int:
        return inputs[self.input_key].shape[0]

    def num_tokens(self, config, inputs) -> list[int]:
        raise NotImplementedError

    def encoder_positions(self, config, inputs) -> list[int] | None:
        """Positions the tower's layers see per item, where the emitted tokens do not tell them (tiles, grids);
        None: ``lightning_mm.data.metadata.encoder_input_tokens`` counts them from the emitted tokens."""
        return None

    def embed(self, enc, inputs) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def context(self, enc, inputs) -> dict:
        """What the layers need besides hidden states, computed from the inputs alone (any stage can)."""
        return {}

    def run_layer(self, enc, layer, hidden, ctx):
        return layer(hidden, None)

    def deepstack_layers(self, config) -> int:
        """LLM layers after which this tower's DeepStack features are added (0: it has none)."""
        return 0

    def cp_pieces(self, inputs) -> dict:
        """The inputs as the pieces encoder context parallelism spreads over its ranks: the items themselves, or
        finer pieces whose features, concatenated in order, are the items' (a video's frames)."""
        return inputs

    def pieces_per_item(self, inputs) -> list[int]:
        """How many of ``cp_pieces`` each item is."""
        return [1] * self.num_items(inputs)

    def stage_output(self, enc, hidden, ctx) -> torch.Tensor:
        """What a pipeline stage of the tower sends on: its hidden state (and what ``ctx`` collected for later)."""
        return hidden

    def stage_input(self, enc, received, ctx) -> torch.Tensor:
        """The hidden state of a received ``stage_output`` (filling ``ctx`` with the rest)."""
        return received

    def final(self, enc, hidden, ctx) -> torch.Tensor:
        return hidden.reshape(-1, hidden.shape[-1])

    def project(self, projector, feats, ctx) -> torch.Tensor:
        """The projector on ``final``'s features (a family that packs items after projecting overrides it)."""
        return projector(feats)

    def select_items(self, inputs, items: torch.Tensor) -> dict:
        """The inputs of a subset of items (for microbatching): every tensor indexed on its first dim."""
        n = self.num_items(inputs)
        return {k: (v[items] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v) for k, v in inputs.items()}

    def reference(self, enc, inputs) -> torch.Tensor:
        """The family's own HF forward, flattened like ``final`` (the test oracle for the split)."""
        return enc(**{k: v for k, v in inputs.items() if k != "item_counts"}).last_hidden_state.flatten(0, 1)

    def tiny(self, **overrides):
        import transformers

        cfg_name, cls_name, kw = self.tiny_spec()
        kw.update(overrides)
        return getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**kw))

    def tiny_spec(self):
        raise NotImplementedError

    def random_inputs(self, config, num_items, generator=None, **size) -> dict:
        raise NotImplementedError


ATTENTION_MLP_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                         "self_attn.out_proj": "rowwise"}


class _ViTFamily(EncoderFamily):
    """Square-patch ViTs (CLIP, SigLIP, Dinov2): tokens = (H/p)(W/p) (+1 class token)."""

    class_token = 0

    def num_tokens(self, config, inputs):
        pv = inputs["pixel_values"]
        per = (pv.shape[-2] // config.patch_size) * (pv.shape[-1] // config.patch_size) + self.class_token
        return [per] * pv.shape[0]

    def random_inputs(self, config, num_items, generator=None, image_size=None, **_):
        s = image_size or config.image_size
        return {"pixel_values": torch.randn(num_items, config.num_channels, s, s, generator=generator)}


class ClipFamily(_ViTFamily):
    name, class_names, class_token = "CLIP", ("CLIPVisionModel",), 1
    tp_plan = {**ATTENTION_MLP_TP_PLAN, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    folder_model_types = {"clip_vision_model": None, "clip": "vision_config"}
    embed_modules = ("embeddings", "pre_layrnorm")

    def embed(self, enc, inputs):
        pv = inputs["pixel_values"]
        interp = pv.shape[-1] != enc.config.image_size
        return enc.pre_layrnorm(enc.embeddings(pv, interpolate_pos_encoding=interp)), {}

    def reference(self, enc, inputs):
        interp = inputs["pixel_values"].shape[-1] != enc.config.image_size
        return enc(pixel_values=inputs["pixel_values"], interpolate_pos_encoding=interp).last_hidden_state.flatten(0, 1)

    def tiny_spec(self):
        return "CLIPVisionConfig", "CLIPVisionModel", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                           num_attention_heads=4, image_size=32, patch_size=8)


class SiglipFamily(_ViTFamily):
    name, class_names = "SigLIP", ("SiglipVisionModel",)
    tp_plan = {**ATTENTION_MLP_TP_PLAN, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    folder_model_types = {"siglip_vision_model": None, "siglip": "vision_config"}

    def embed(self, enc, inputs):
        pv = inputs["pixel_values"]
        return enc.embeddings(pv, interpolate_pos_encoding=pv.shape[-1] != enc.config.image_size), {}

    def final(self, enc, hidden, ctx):
        return enc.post_layernorm(hidden).flatten(0, 1)

    def reference(self, enc, inputs):
        interp = inputs["pixel_values"].shape[-1] != enc.config.image_size
        return enc(pixel_values=inputs["pixel_values"], interpolate_pos_encoding=interp).last_hidden_state.flatten(0, 1)

    def tiny_spec(self):
        return "SiglipVisionConfig", "SiglipVisionModel", dict(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=4, num_attention_heads=4,
                                                               image_size=32, patch_size=8)


class Dinov2Family(_ViTFamily):
    name, class_names, class_token = "Dinov2", ("Dinov2Model",), 1
    folder_model_types = {"dinov2": None}
    tp_plan = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
               "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}

    def tensor_parallel_plan(self, enc) -> dict[str, str]:
        """None for the SwiGLU variant (giant): its fused input projection is chunked in two after the matmul."""
        return {} if getattr(enc.config, "use_swiglu_ffn", False) else self.tp_plan

    def layers(self, enc):
        return enc.encoder.layer

    def embed(self, enc, inputs):
        return enc.embeddings(inputs["pixel_values"]), {}

    def final(self, enc, hidden, ctx):
        return enc.layernorm(hidden).flatten(0, 1)

    def tiny_spec(self):
        return "Dinov2Config", "Dinov2Model", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                   num_attention_heads=4, image_size=32, patch_size=8)


class Qwen2VisionFamily(EncoderFamily):
    """Qwen2-VL's vision tower: variable resolution, all images in one sequence separated by cu_seqlens.

    ``inputs = {"pixel_values": [total_patches, C*T*p*p], "image_grid_thw": [N, 3]}``; an image emits
    t*h*w / merge^2 tokens of the merger's width (the tower's ``hidden_size``).
    """

    name, class_names, input_key = "Qwen2-VL vision", ("Qwen2VisionTransformerPretrainedModel",), "image_grid_thw"
    hf_module = "transformers.models.qwen2_vl.modeling_qwen2_vl"
    folder_model_types = {"qwen2_vl_vision": None, "qwen2_vl": "vision_config"}
    embed_modules = ("patch_embed",)
    # the fused q/k/v stays whole, each tp rank keeping its heads (tensor_parallel.FUSED_QKV_HEADS); the output
    # projection and the MLP are split as usual
    tp_plan = {"attn.qkv": "fused_qkv_heads", "attn.proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    tp_head_attrs = ("attn.num_heads",)

    def layers(self, enc):
        return enc.blocks

    def num_tokens(self, config, inputs):
        m = config.spatial_merge_size ** 2
        return [int(t * h * w) // m for t, h, w in inputs["image_grid_thw"].tolist()]

    def encoder_positions(self, config, inputs):
        """t*h*w patches per image (or video, ``VideoInputs``): the tower merges them after its layers."""
        return [int(t * h * w) for t, h, w in inputs["image_grid_thw"].tolist()]

    def context(self, enc, inputs):
        from transformers.models.qwen2_vl.modeling_qwen2_vl import get_vision_attention_seqlens, get_vision_position_ids

        grid = inputs["image_grid_thw"]
        position_ids = get_vision_position_ids(grid, enc.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, enc.config)
        dtype = next(p.dtype for p in enc.parameters())
        cos, sin = enc.rotary_pos_emb(torch.empty(0, dtype=dtype, device=grid.device), position_ids)
        return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "cos": cos, "sin": sin}

    def embed(self, enc, inputs):
        return enc.patch_embed(inputs["pixel_values"]), self.context(enc, inputs)

    def run_layer(self, enc, layer, hidden, ctx):
        return layer(hidden, cu_seqlens=ctx["cu_seqlens"], max_seqlen=ctx["max_seqlen"],
                     position_embeddings=(ctx["cos"], ctx["sin"]))

    def final(self, enc, hidden, ctx):
        return enc.merger(hidden)

    def select_items(self, inputs, items):
        grid, pixels = inputs["image_grid_thw"], inputs["pixel_values"]
        sizes = grid.prod(-1).tolist()  # one host read for every item's rows
        starts = [0, *itertools.accumulate(sizes)]
        rows = torch.cat([torch.zeros(0, dtype=torch.long, device=pixels.device), *[
            torch.arange(starts[i], starts[i] + sizes[i], device=pixels.device) for i in items.tolist()]])
        return {**inputs, "pixel_values": pixels[rows], "image_grid_thw": grid[items]}

    def reference(self, enc, inputs):
        return enc(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output

    def tiny(self, **overrides):
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        kw = dict(depth=4, embed_dim=32, hidden_size=48, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
        kw.update(overrides)
        return Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**kw))

    def output_dim(self, enc):
        return enc.config.hidden_size

    def random_inputs(self, config, num_items, generator=None, grids=None, **_):
        """Random patches; ``grids`` (list of (t, h, w) in patches) defaults to 1x4x4 per image."""
        grids = grids or [(1, 4, 4)] * num_items
        dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        total = sum(t * h * w for t, h, w in grids)
        return {"pixel_values": torch.randn(total, dim, generator=generator),
                "image_grid_thw": torch.tensor(grids, dtype=torch.long).view(-1, 3)}


class _WhisperLikeFamily(EncoderFamily):
    """Whisper-style audio encoders: log-mel ``input_features [N, mel, 2 * max_source_positions]``."""

    input_key = "input_features"
    embed_modules = ("conv1", "conv2", "embed_positions")
    tp_plan = {**ATTENTION_MLP_TP_PLAN, "fc1": "colwise", "fc2": "rowwise"}
    tp_head_attrs = ("self_attn.num_heads",)  # keys and values are reshaped by it

    def output_dim(self, enc):
        return enc.config.d_model

    def layers(self, enc):
        return enc.layers

    def _expected_frames(self, config):
        return config.max_source_positions * 2

    def _check_frames(self, enc, feats):
        if feats.shape[-1] != self._expected_frames(enc.config):
            raise ValueError(f"{self.name} expects input_features with {self._expected_frames(enc.config)} frames "
                             f"(2 x max_source_positions), got {feats.shape[-1]}; pad or trim the mel features")

    def _conv(self, enc, feats):
        self._check_frames(enc, feats)
        feats = feats.to(enc.conv1.weight.dtype)
        x = nn.functional.gelu(enc.conv1(feats))
        return nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)

    def random_inputs(self, config, num_items, generator=None, **_):
        return {"input_features": torch.randn(num_items, config.num_mel_bins, self._expected_frames(config),
                                              generator=generator)}


class WhisperFamily(_WhisperLikeFamily):
    name, class_names = "Whisper encoder", ("WhisperEncoder",)
    hf_module = "transformers.models.whisper.modeling_whisper"
    folder_model_types = {"whisper": None}

    def num_tokens(self, config, inputs):
        return [config.max_source_positions] * inputs["input_features"].shape[0]

    def embed(self, enc, inputs):
        x = self._conv(enc, inputs["input_features"])
        return x + enc.embed_positions.weight[: x.shape[1]], {}

    def final(self, enc, hidden, ctx):
        return enc.layer_norm(hidden).flatten(0, 1)

    def tiny(self, **overrides):
        from transformers import WhisperConfig
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        kw = dict(d_model=32, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
                  max_source_positions=8, decoder_layers=1, decoder_attention_heads=4, vocab_size=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        kw.update(overrides)
        return WhisperEncoder(WhisperConfig(**kw))


class Qwen2AudioFamily(_WhisperLikeFamily):
    name, class_names = "Qwen2-Audio encoder", ("Qwen2AudioEncoder",)
    folder_model_types = {"qwen2_audio_encoder": None, "qwen2_audio": "audio_config"}

    # With ``inputs["feature_attention_mask"]`` ([N, frames], 1 on a clip's real frames, as the processor gives
    # it), the encoder runs as Qwen2AudioForConditionalGeneration runs it: its layers see the padding mask and each
    # clip emits only the tokens of its real length. Without it every clip is 30 s long.

    @staticmethod
    def _lengths(inputs):
        """(lengths after the convolutions, tokens) per clip, as Qwen2AudioEncoder._get_feat_extract_output_lengths."""
        mask = inputs.get("feature_attention_mask")
        if mask is None:
            return None
        frames = (mask.sum(-1) - 1) // 2 + 1
        return frames, (frames - 2) // 2 + 1

    def num_tokens(self, config, inputs):
        lengths = self._lengths(inputs)
        if lengths is None:
            return [config.max_source_positions // 2] * inputs["input_features"].shape[0]
        return [int(n) for n in lengths[1].tolist()]

    def context(self, enc, inputs):
        lengths = self._lengths(inputs)
        if lengths is None:
            return {}
        from transformers.masking_utils import create_bidirectional_mask

        frames, tokens = lengths
        n, positions = inputs["input_features"].shape[0], enc.config.max_source_positions
        valid = torch.arange(positions, device=frames.device)[None, :] < frames[:, None]
        dummy = torch.zeros(n, positions, 1, dtype=enc.conv1.weight.dtype, device=frames.device)
        mask = create_bidirectional_mask(config=enc.config, inputs_embeds=dummy, attention_mask=valid.long())
        return {"attention_mask": mask, "tokens": tokens}

    def embed(self, enc, inputs):
        x = self._conv(enc, inputs["input_features"])
        return x + enc.embed_positions.weight, self.context(enc, inputs)

    def run_layer(self, enc, layer, hidden, ctx):
        return layer(hidden, ctx.get("attention_mask"))

    def final(self, enc, hidden, ctx):
        pooled = enc.layer_norm(enc.avg_pooler(hidden.permute(0, 2, 1)).permute(0, 2, 1))
        if "tokens" not in ctx:
            return pooled.flatten(0, 1)
        keep = torch.arange(pooled.shape[1], device=pooled.device)[None, :] < ctx["tokens"].to(pooled.device)[:, None]
        return pooled[keep]

    def reference(self, enc, inputs):
        ctx = self.context(enc, inputs)
        out = enc(inputs["input_features"], attention_mask=ctx.get("attention_mask")).last_hidden_state
        if "tokens" not in ctx:
            return out.flatten(0, 1)
        return out[torch.arange(out.shape[1])[None, :] < ctx["tokens"][:, None]]

    def tiny(self, **overrides):
        from transformers import Qwen2AudioEncoder, Qwen2AudioEncoderConfig

        kw = dict(d_model=32, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
                  max_source_positions=8)
        kw.update(overrides)
        return Qwen2AudioEncoder(Qwen2AudioEncoderConfig(**kw))


class Qwen25VisionFamily(Qwen2VisionFamily):
    """Qwen2.5-VL's vision tower: Qwen2-VL's with window attention. After the patch embedding the tokens are
    reordered into windows of ``window_size`` pixels; the blocks listed in ``fullatt_block_indexes`` attend within
    whole images, the others within windows; the merger (RMSNorm + MLP, out to ``out_hidden_size``) runs in window
    order and ``final`` restores image order. Hidden states between pipeline stages are in window order."""

    name, class_names = "Qwen2.5-VL vision", ("Qwen2_5_VisionTransformerPretrainedModel",)
    hf_module = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
    folder_model_types = {"qwen2_5_vl_vision": None, "qwen2_5_vl": "vision_config"}
    tp_plan = {"attn.qkv": "fused_qkv_heads", "attn.proj": "rowwise", "mlp.gate_proj": "colwise",
               "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}

    def output_dim(self, enc):
        return enc.config.out_hidden_size

    @staticmethod
    def _window_order(t, window_index, unit):
        return t.reshape(t.shape[0] // unit, unit, -1)[window_index].reshape(t.shape[0], -1)

    def context(self, enc, inputs):
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import (get_vision_attention_seqlens, get_vision_position_ids,
                                               get_vision_window_index)

        cfg, grid = enc.config, inputs["image_grid_thw"]
        position_ids = get_vision_position_ids(grid, cfg.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, cfg)
        window_index, cu_window = get_vision_window_index(grid, spatial_merge_size=cfg.spatial_merge_size,
                                                          window_size=cfg.window_size, patch_size=cfg.patch_size)
        unit = cfg.spatial_merge_size ** 2
        cos, sin = enc.rotary_pos_emb(torch.empty(0, device=grid.device), position_ids)
        cos, sin = (self._window_order(t, window_index, unit) for t in (cos, sin))
        return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "cu_window_seqlens": cu_window,
                "max_window_seqlen": get_max_seqlen(cu_window, cfg), "window_index": window_index, "unit": unit,
                "cos": cos, "sin": sin}

    def embed(self, enc, inputs):
        ctx = self.context(enc, inputs)
        hidden = enc.patch_embed(inputs["pixel_values"])
        return self._window_order(hidden, ctx["window_index"], ctx["unit"]), ctx

    def run_layer(self, enc, layer, hidden, ctx):
        index = next(i for i, block in enumerate(enc.blocks) if block is layer)
        full = index in enc.config.fullatt_block_indexes
        return layer(hidden, cu_seqlens=ctx["cu_seqlens" if full else "cu_window_seqlens"],
                     max_seqlen=ctx["max_seqlen" if full else "max_window_seqlen"],
                     position_embeddings=(ctx["cos"], ctx["sin"]))

    def final(self, enc, hidden, ctx):
        return enc.merger(hidden)[torch.argsort(ctx["window_index"])]

    def tiny(self, **overrides):
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        kw = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16,
                  fullatt_block_indexes=[1, 3])
        kw.update(overrides)
        return Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**kw))

    def random_inputs(self, config, num_items, generator=None, grids=None, **_):
        """Random patches; ``grids`` defaults to 1x8x8 per image (four attention windows each)."""
        return super().random_inputs(config, num_items, generator, grids=grids or [(1, 8, 8)] * num_items)


class Qwen3VisionFamily(Qwen2VisionFamily):
    """Qwen3-VL's vision tower: Qwen2-VL's packed images with a learned position table resampled to each grid, and
    DeepStack: the hidden states after the layers listed in ``deepstack_visual_indexes`` go through their own
    mergers and are added to the LLM's hidden states after its first layers (``MultimodalModel.deepstack``).

    ``final`` packs them beside the main features, ``[tokens, out_hidden_size * (1 + k)]``, so they travel, are
    split between context-parallel ranks and routed between replicas exactly like the features; between pipeline
    stages of the tower the hidden states collected so far ride beside the hidden state the same way
    (``stage_output`` / ``stage_input``). A projector (the composite's is the identity: the mergers project)
    applies to each block alike."""

    name, class_names = "Qwen3-VL vision", ("Qwen3VLVisionModel",)
    hf_module = "transformers.models.qwen3_vl.modeling_qwen3_vl"
    folder_model_types = {"qwen3_vl_vision": None, "qwen3_vl": "vision_config"}
    embed_modules = ("patch_embed", "pos_embed")
    tp_plan = {"attn.qkv": "fused_qkv_heads", "attn.proj": "rowwise", "mlp.linear_fc1": "colwise",
               "mlp.linear_fc2": "rowwise"}

    def deepstack_layers(self, config) -> int:
        return len(config.deepstack_visual_indexes)

    def output_dim(self, enc):
        return enc.config.out_hidden_size  # of each block: the features and every DeepStack layer's

    def project(self, projector, feats, ctx):
        blocks = feats.unflatten(-1, (-1, feats.shape[-1] // (1 + len(ctx["deepstack"]))))
        return projector(blocks).flatten(-2)

    def context(self, enc, inputs):
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        grid = inputs["image_grid_thw"]
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, enc.config)
        cos, sin = enc.rotary_pos_emb(torch.empty(0, device=grid.device),
                                      get_vision_position_ids(grid, enc.config.spatial_merge_size))
        return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "cos": cos, "sin": sin, "deepstack": {}}

    def embed(self, enc, inputs):
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        grid = inputs["image_grid_thw"]
        index, weight = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=enc.num_grid_per_side, mode=enc.interpolation_mode,
            align_corners=enc.interpolation_align_corners, spatial_merge_size=enc.config.spatial_merge_size)
        hidden = enc.patch_embed(inputs["pixel_values"])
        return hidden + (enc.pos_embed(index) * weight[:, :, None]).sum(1).to(hidden.dtype), self.context(enc, inputs)

    def run_layer(self, enc, layer, hidden, ctx):
        hidden = super().run_layer(enc, layer, hidden, ctx)
        index = next(i for i, block in enumerate(enc.blocks) if block is layer)
        if index in enc.config.deepstack_visual_indexes:  # by index: a recomputed layer overwrites its own
            ctx["deepstack"][index] = hidden
        return hidden

    def stage_output(self, enc, hidden, ctx):
        return torch.cat([hidden, *(ctx["deepstack"][i] for i in sorted(ctx["deepstack"]))], -1)

    def stage_input(self, enc, received, ctx):
        hidden, *collected = (t.contiguous() for t in received.split(enc.config.hidden_size, -1))  # HF views them
        ctx["deepstack"] = dict(zip(sorted(enc.config.deepstack_visual_indexes), collected))
        return hidden

    def final(self, enc, hidden, ctx):
        indexes = enc.config.deepstack_visual_indexes
        missing = [i for i in indexes if i not in ctx["deepstack"]]
        if missing:
            raise RuntimeError(f"Qwen3-VL vision: no hidden state of DeepStack layers {missing}; run every layer "
                               "of the tower before its mergers")
        return torch.cat([enc.merger(hidden), *(enc.deepstack_merger_list[j](ctx["deepstack"][i])
                                                for j, i in enumerate(indexes))], -1)

    def reference(self, enc, inputs):
        out = enc(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        return torch.cat([out.pooler_output, *out.deepstack_features], -1)

    def tiny(self, **overrides):
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        kw = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
        kw.update(overrides)
        return Qwen3VLVisionModel(Qwen3VLVisionConfig(**kw))


class InternVLVisionFamily(_ViTFamily):
    """InternVL's InternViT tower: a class token, layers with layer scale, a final LayerNorm (Identity with mean
    pooling)."""

    name, class_names, class_token = "InternVL vision", ("InternVLVisionModel",), 1
    folder_model_types = {"internvl_vision": None, "internvl": "vision_config"}
    tp_plan = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
               "attention.projection_layer": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    tp_head_attrs = ("attention.num_heads", "attention.embed_dim")  # the output is reshaped by embed_dim

    def tensor_parallel_plan(self, enc) -> dict[str, str]:
        """None with ``use_qk_norm``: its query / key norms span every head."""
        return {} if getattr(enc.config, "use_qk_norm", False) else self.tp_plan

    def num_tokens(self, config, inputs):
        pv, patch = inputs["pixel_values"], config.patch_size
        ph, pw = patch if isinstance(patch, (list, tuple)) else (patch, patch)
        return [(pv.shape[-2] // ph) * (pv.shape[-1] // pw) + 1] * pv.shape[0]

    def layers(self, enc):
        return enc.encoder.layer

    def embed(self, enc, inputs):
        return enc.embeddings(inputs["pixel_values"]), {}

    def run_layer(self, enc, layer, hidden, ctx):
        return layer(hidden)

    def final(self, enc, hidden, ctx):
        return enc.layernorm(hidden).flatten(0, 1)

    def tiny_spec(self):
        return "InternVLVisionConfig", "InternVLVisionModel", dict(hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=4, num_attention_heads=4,
                                                                   image_size=[32, 32], patch_size=[8, 8])


class Qwen3MoeVisionFamily(Qwen3VisionFamily):
    """Qwen3-VL-MoE's vision tower: Qwen3-VL's (DeepStack included), under its own class."""

    name, class_names = "Qwen3-VL-MoE vision", ("Qwen3VLMoeVisionModel",)
    hf_module = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
    folder_model_types = {"qwen3_vl_moe_vision": None, "qwen3_vl_moe": "vision_config"}


class VideoInputs:
    """An image family's view for videos through the same tower: HF's processors give videos under their own
    keys (``pixel_values_videos``, ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``, Qwen3-Omni's
    ``video_second_per_grid``), the tower reads them as images with ``t`` frames (``pixel_values``,
    ``image_grid_thw``); every method that takes the modality's inputs renames them first. The encoder of a "video" modality shares the image encoder's tower and projector
    (``MultimodalModel.shared_encoders``)."""

    RENAMES = {"pixel_values_videos": "pixel_values", "video_grid_thw": "image_grid_thw"}
    PER_ITEM = ("second_per_grid_ts", "video_second_per_grid")  # one entry per video, not read by the tower

    def __init__(self, base):
        self.base = base
        self.input_key = "video_grid_thw"

    def __getattr__(self, name):
        if name.startswith("__") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def _as_images(self, inputs: dict) -> dict:
        return {self.RENAMES.get(k, k): v for k, v in inputs.items() if k not in self.PER_ITEM}

    def num_items(self, inputs) -> int:
        return inputs["video_grid_thw"].shape[0]

    def num_tokens(self, config, inputs) -> list[int]:
        return self.base.num_tokens(config, self._as_images(inputs))

    def encoder_positions(self, config, inputs) -> list[int] | None:
        return self.base.encoder_positions(config, self._as_images(inputs))

    def embed(self, enc, inputs):
        return self.base.embed(enc, self._as_images(inputs))

    def context(self, enc, inputs) -> dict:
        return self.base.context(enc, self._as_images(inputs))

    def select_items(self, inputs, items: torch.Tensor) -> dict:
        back = {v: k for k, v in self.RENAMES.items()}
        out = {back.get(k, k): v for k, v in self.base.select_items(self._as_images(inputs), items).items()}
        out.update({k: inputs[k][items] for k in self.PER_ITEM if k in inputs})
        return out

    def reference(self, enc, inputs) -> torch.Tensor:
        return self.base.reference(enc, self._as_images(inputs))

    def cp_pieces(self, inputs) -> dict:
        """Each video as its temporal patches, one item of grid ``(1, h, w)`` each: the Qwen-VL towers attend within
        a temporal patch only (``cu_seqlens`` per patch; windows and merges inside it), so a long video's patches
        spread over the encoder's CP ranks and their features, gathered in order, are the video's. The patches' rows
        are the video's rows in order, so only the grids change."""
        grid = inputs["video_grid_thw"]
        frames = grid[:, 0]
        pieces = grid.repeat_interleave(frames, 0)
        pieces[:, 0] = 1
        out = {**inputs, "video_grid_thw": pieces}
        out.update({k: inputs[k].repeat_interleave(frames.to(inputs[k].device), 0) for k in self.PER_ITEM
                    if k in inputs})
        return out

    def pieces_per_item(self, inputs) -> list[int]:
        return inputs["video_grid_thw"][:, 0].tolist()

    def random_inputs(self, config, num_items, generator=None, grids=None, **size) -> dict:
        """Random videos: ``grids`` default to 2 x 4 x 4 patches (two temporal patches) per video."""
        images = self.base.random_inputs(config, num_items, generator, grids=grids or [(2, 4, 4)] * num_items,
                                         **size)
        return {k2: images[k1] for k2, k1 in self.RENAMES.items()}


ENCODER_FAMILIES: dict[str, EncoderFamily] = {f.class_names[0]: f for f in (
    ClipFamily(), SiglipFamily(), Dinov2Family(), Qwen2VisionFamily(), Qwen25VisionFamily(), Qwen3VisionFamily(),
    Qwen3MoeVisionFamily(), WhisperFamily(), Qwen2AudioFamily(), InternVLVisionFamily())}
class Gemma4VisionFamily(EncoderFamily):
    """Gemma 4's vision tower (``Gemma4VisionModel``): each image comes as its patches, flattened
    (``pixel_values [images, patches, 3 * p * p]``) with their ``(x, y)`` grid positions (``image_position_ids
    [images, patches, 2]``, ``(-1, -1)`` for padding), as its image processor gives them. The patch embedder adds
    2-D position embeddings, the layers attend over an image's real patches with 2-D RoPE, and ``final`` is the
    tower's pooler: average over ``pooling_kernel_size``-square cells of the grid, scaled by ``sqrt(hidden)``
    (standardised when the config says so), padding dropped: ``real patches / k^2`` tokens per image."""

    name, class_names = "Gemma 4 vision", ("Gemma4VisionModel",)
    folder_model_types = {"gemma4_vision": None}
    embed_modules = ("patch_embedder",)

    def layers(self, enc):
        return enc.encoder.layers

    def num_tokens(self, config, inputs):
        real = (inputs["image_position_ids"] != -1).all(-1).sum(-1)
        return (real // config.pooling_kernel_size ** 2).tolist()

    def encoder_positions(self, config, inputs):
        return (inputs["image_position_ids"] != -1).all(-1).sum(-1).tolist()

    def context(self, enc, inputs):
        from transformers.masking_utils import create_bidirectional_mask

        pos = inputs["image_position_ids"]
        padding = (pos == -1).all(-1)
        shape = torch.empty(*pos.shape[:2], 1, dtype=enc.patch_embedder.input_proj.weight.dtype, device=pos.device)
        mask = create_bidirectional_mask(config=enc.config, inputs_embeds=shape, attention_mask=~padding)
        return {"pos": pos, "padding": padding, "mask": mask,
                "rope": enc.encoder.rotary_emb(shape, pos)}

    def embed(self, enc, inputs):
        ctx = self.context(enc, inputs)
        return enc.patch_embedder(inputs["pixel_values"], ctx["pos"], ctx["padding"]), ctx

    def run_layer(self, enc, layer, hidden, ctx):
        return layer(hidden, position_embeddings=ctx["rope"], attention_mask=ctx["mask"], position_ids=ctx["pos"])

    def final(self, enc, hidden, ctx):
        length = hidden.shape[1] // enc.config.pooling_kernel_size ** 2
        pooled, keep = enc.pooler(hidden, ctx["pos"], ctx["padding"], output_length=length)
        pooled = pooled[keep]
        if enc.config.standardize:
            pooled = (pooled - enc.std_bias.float()) * enc.std_scale.float()
        return pooled.to(hidden.dtype)

    def reference(self, enc, inputs):
        return enc(pixel_values=inputs["pixel_values"], pixel_position_ids=inputs["image_position_ids"]
                   ).last_hidden_state

    def tiny_spec(self):
        return "Gemma4VisionConfig", "Gemma4VisionModel", dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)

    def random_inputs(self, config, num_items, generator=None, grid=None, **_):
        """Square images of ``grid`` x ``grid`` patches (default: two pooling cells a side), no padding."""
        g = grid or 2 * config.pooling_kernel_size
        ys, xs = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
        pos = torch.stack([xs.flatten(), ys.flatten()], -1)
        return {"pixel_values": torch.rand(num_items, g * g, 3 * config.patch_size ** 2, generator=generator),
                "image_position_ids": pos.expand(num_items, -1, -1).clone()}


ENCODER_FAMILIES["Gemma4VisionModel"] = Gemma4VisionFamily()
TINY_ENCODERS = {"clip": "CLIPVisionModel", "siglip": "SiglipVisionModel", "dinov2": "Dinov2Model",
                 "qwen2_vl": "Qwen2VisionTransformerPretrainedModel",
                 "qwen2_5_vl": "Qwen2_5_VisionTransformerPretrainedModel", "qwen3_vl": "Qwen3VLVisionModel",
                 "whisper": "WhisperEncoder",
                 "qwen2_audio": "Qwen2AudioEncoder"}


def encoder_family(enc: nn.Module) -> EncoderFamily:
    """The adapter of a HF encoder, or a clear error naming the supported ones."""
    for cls in type(enc).__mro__:
        if cls.__name__ in ENCODER_FAMILIES:
            return ENCODER_FAMILIES[cls.__name__]
    raise ValueError(f"unsupported encoder {type(enc).__name__}; supported: {', '.join(ENCODER_FAMILIES)}. "
                     "Pass the bare vision/audio tower (e.g. SiglipVisionModel, WhisperEncoder)")


def tiny_encoder(kind: str, **overrides) -> nn.Module:
    """A tiny randomly initialised encoder of a family (``clip``, ``siglip``, ``dinov2``, ``qwen2_vl``,
    ``qwen2_5_vl``, ``whisper``, ``qwen2_audio``), for tests and examples."""
    if kind not in TINY_ENCODERS:
        raise ValueError(f"unknown encoder kind {kind!r}; choose one of {sorted(TINY_ENCODERS)}")
    return ENCODER_FAMILIES[TINY_ENCODERS[kind]].tiny(**overrides)


def tiny_language_model(kind: str = "llama", **overrides) -> nn.Module:
    """A tiny randomly initialised causal LM of a family (``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``gemma2``,
    ``gemma3_text`` (local layers with an 8-token window), ``phi3``)."""
    if kind not in LANGUAGE_FAMILIES:
        raise ValueError(f"unknown language model kind {kind!r}; choose one of {sorted(LANGUAGE_FAMILIES)}")
    return LANGUAGE_FAMILIES[kind].tiny(**overrides)
