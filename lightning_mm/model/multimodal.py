"""MultimodalModel: modality encoders + projectors + a HF causal LM, merged at placeholder tokens."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from lightning_mm import loss as losses
from lightning_mm.attention import mask as masks
from lightning_mm.model import moe, qwen3_5, qwen3_omni  # noqa: F401  (registers the MoE, Qwen3.5, Omni families)
from lightning_mm.attention import ATTENTION_NAME
from lightning_mm.attention import hf as hf_attention
from lightning_mm.model.encoder import ModalityEncoder
from lightning_mm.model.families import language_family
from lightning_mm.model.loading import init_parameters, is_meta, load_language_model

SEQUENCE_KEYS = ("input_ids", "labels", "bam", "segment_ids", "position_ids", "attention_mask", "item_counts")


@dataclass
class MultimodalOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor
    loss_sum: torch.Tensor | None = None
    router: object = None  # a mixture-of-experts LLM's router statistics (lightning_mm.model.moe.RouterStats)
    aux_loss: torch.Tensor | None = None  # its load-balancing loss (in ``loss`` times the family's coefficient)


@dataclass
class DeepStack:
    """One modality's DeepStack features (Qwen3-VL): ``features[:, j]`` is added to the hidden states after LLM
    layer ``first + j`` at that modality's tokens. ``index`` gives each local token's row of ``features`` and
    ``valid`` whether it is such a token (``[B, S]``, or this context-parallel rank's tokens)."""

    features: torch.Tensor  # [N, k, H]: every token of the modality in the microbatch, row-major
    index: torch.Tensor
    valid: torch.Tensor
    first: int = 0

    @classmethod
    def at(cls, input_ids: torch.Tensor, placeholder_id: int, features: torch.Tensor, first: int = 0,
           local: Callable = lambda t: t) -> "DeepStack":
        """The features of the placeholders of ``input_ids`` (the whole sequence; ``local`` keeps a CP rank's
        tokens)."""
        valid = input_ids == placeholder_id
        index = (valid.flatten().long().cumsum(0) - 1).clamp(min=0).view_as(valid)
        return cls(features, local(index), local(valid), first)

    def add(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """``hidden`` after LLM layer ``layer`` with its features added (``hidden`` itself if none belong there)."""
        j = layer - self.first
        if not 0 <= j < self.features.shape[1] or not self.features.shape[0]:
            return hidden
        feats = self.features[:, j].index_select(0, self.index.flatten()).view_as(hidden).to(hidden.dtype)
        return hidden + torch.where(self.valid.unsqueeze(-1), feats, 0)


@dataclass
class AttentionContext:
    """What every LLM layer needs besides the hidden states (travels with them between pipeline stages)."""

    position_ids: torch.Tensor
    bam: torch.Tensor
    segment_ids: torch.Tensor | None = None
    token_index: torch.Tensor | None = None  # global token indices of the local tokens (context parallelism)
    cp_group: object = None
    # what every layer's attention of one microbatch shares: the kernels' tile maps, CP's gathered mask metadata
    attn_cache: dict = field(default_factory=dict)
    deepstack: dict = field(default_factory=dict)  # modality -> DeepStack (features added after the first layers)

    def attn_kwargs(self) -> dict:
        kw = {"bam": self.bam, "segment_ids": self.segment_ids, "token_index": self.token_index,
              "attn_cache": self.attn_cache}
        if self.cp_group is not None:
            kw["cp_group"] = self.cp_group
        return kw


def scatter_features(embeds: torch.Tensor, input_ids: torch.Tensor, placeholder_id: int,
                     features: torch.Tensor) -> torch.Tensor:
    """Put ``features [N, H]`` at the positions of ``placeholder_id`` in row-major order (EE; EP if first)."""
    where = (input_ids == placeholder_id).unsqueeze(-1).expand_as(embeds)
    return embeds.masked_scatter(where, features.to(embeds.dtype))


class MultimodalModel(nn.Module):
    """Encoders feeding a causal LM (the seeds' MultimodalModule).

    ``input_ids`` hold, for every item of modality ``name``, as many ``placeholder_ids[name]`` tokens as its
    encoder emits (``ModalityEncoder.num_tokens``); placeholders default to ids at and above the LLM vocabulary so
    they never collide with text. ``merge(embeds, input_ids, features: dict) -> embeds`` replaces the default
    placement. Bit k of the attention mask belongs to the k-th encoder of ``encoders``.

    ``language_model`` may be a local folder written by ``save_pretrained`` (``load_language_model``). The whole
    model can be built under ``torch.device("meta")`` (or Lightning's ``init_module(empty_init=True)``) and filled by
    ``lightning_mm.model.materialise``. Projectors built from a string are initialised from
    ``torch.initial_seed()`` and their full names (``encoders.<name>.projector``), eagerly or when materialised, so
    both give the same values.

    The language model stays itself: it gets a private copy of its config (the caller's config object and other
    models built from it are untouched), and the bitfield mask travels with each call; a call without mask words
    (the language model used alone) runs its own attention implementation as before. ``attn_implementation``
    must be ``"bitfield"``: an implementation that ignores the mask words is refused. ``language_model`` may be a
    ``peft`` LoRA model (``model.peft_model`` keeps it); ``add_lora`` adds adapters; ``generate`` decodes.
    """

    # set by ``from_pretrained`` for composite checkpoints (lightning_mm.model.composites): modality tokens get the
    # text word by default (HF's causal pattern), ``position_ids_fn(input_ids, modality_inputs, attention_mask)``
    # gives the LLM's own positions (M-RoPE) when a batch has none, ``composite`` is what save_pretrained writes back
    causal_modalities: bool = False
    # each item's tokens causal and bidirectional among themselves (Gemma 3's images: masks.span_word)
    bidirectional_items: bool = False
    position_ids_fn = None
    composite = None

    def __init__(self, encoders: dict[str, ModalityEncoder], language_model: nn.Module | str,
                 merge: Callable | None = None, placeholder_ids: dict[str, int] | None = None,
                 attn_implementation: str = ATTENTION_NAME):
        super().__init__()
        masks.check_num_encoders(len(encoders))
        if attn_implementation != ATTENTION_NAME:
            raise ValueError(f"attn_implementation={attn_implementation!r} cannot honour the bitfield attention mask "
                             "(modality bits, packed segments, padding words) that MultimodalModel passes on every "
                             f"call; use attn_implementation={ATTENTION_NAME!r} (the default). The language model "
                             "keeps its own implementation for calls without mask words (used alone)")
        if isinstance(language_model, (str, os.PathLike)):
            language_model = load_language_model(language_model)
        from lightning_mm.model.lora import unwrap

        outer = language_model
        language_model, peft_model = unwrap(language_model)
        self.lm_family = language_family(language_model)
        if hasattr(self.lm_family, "prepare"):  # Gated DeltaNet layers keep packed samples apart
            self.lm_family.prepare(language_model)
        for name, enc in encoders.items():
            if not isinstance(enc, ModalityEncoder):
                raise TypeError(f"encoder {name!r} is a {type(enc).__name__}; wrap it: lmm.ModalityEncoder(model, "
                                "projector='mlp')")
            if name in SEQUENCE_KEYS:
                raise ValueError(f"encoder name {name!r} clashes with a batch key; rename it")
            if enc.attach(self.lm_family.hidden_size(language_model)) and not is_meta(enc.projector):
                init_parameters(enc.projector, prefix=f"encoders.{name}.projector")
        self.encoders = nn.ModuleDict(encoders)
        self.language_model = language_model
        # kept as plain numbers: a pipeline stage may drop the language model itself
        self.vocab_size = self.lm_family.vocab_size(language_model)
        self.hidden_size = self.lm_family.hidden_size(language_model)
        self.max_positions = getattr(language_model.config, "max_position_embeddings", None)
        hf_attention.attach(language_model, root=outer)  # a private config; the mask words come per call
        self.__dict__["peft_model"] = peft_model  # unregistered: its parameters are the language model's
        ids = {name: self.vocab_size + i for i, name in enumerate(encoders)}
        ids.update({n: e.placeholder_id for n, e in encoders.items() if e.placeholder_id is not None})
        ids.update(placeholder_ids or {})
        unknown = set(ids) - set(encoders)
        if unknown:
            raise ValueError(f"placeholder_ids name unknown modalities {sorted(unknown)}; encoders: {list(encoders)}")
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"placeholder ids must differ between modalities, got {ids}")
        self.placeholder_ids = ids
        self.merge = merge
        owners: dict[int, str] = {}  # names, not modules: a pipeline stage replaces the modules it does not run
        for n, e in encoders.items():
            owners.setdefault(id(e.module), n)
        self.shared_encoders = {n: owners[id(e.module)] for n, e in encoders.items() if owners[id(e.module)] != n}

    # ------------------------------------------------------------------ HF folders
    @classmethod
    def from_pretrained(cls, path, causal_modalities: bool = True) -> "MultimodalModel":
        """The model of a composite HF folder (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen2-Audio), computing what the
        composite class computes, lazy under the meta device (``lightning_mm.model.composites``); or of a folder
        of parts ``save_pretrained`` wrote (``lightning_mm.model.hf_parts``; ``causal_modalities`` applies to
        composites only)."""
        from lightning_mm.model import composites, hf_parts

        if hf_parts.is_parts_folder(path):
            return hf_parts.load_parts(cls, path)
        return composites.from_pretrained(cls, path, causal_modalities=causal_modalities)

    def save_pretrained(self, folder) -> dict:
        """A composite folder its HF class loads (a model from ``from_pretrained`` of one), else one folder per
        part (``lightning_mm.model.hf_parts``); ``from_pretrained`` reads either back. Returns what was written."""
        from lightning_mm.model import composites, hf_parts

        if self.composite is not None:
            return composites.save_pretrained(self, folder)
        return hf_parts.save_parts(self, folder)

    # ------------------------------------------------------------------ structure
    @property
    def modality_index(self) -> dict[str, int]:
        """Mask bit of each encoder (1-based, in ``encoders`` order)."""
        return {name: i + 1 for i, name in enumerate(self.encoders)}

    @property
    def pipeline_encoders(self) -> list[str]:
        """The encoders that own their tower: each gets pipeline stages (``ParallelSpec``) of its own; a shared one
        (``shared_encoders``: a "video" modality through the image tower, name -> owner) runs on its owner's stages,
        with its owner's one copy of the parameters."""
        return [n for n in self.encoders if n not in self.shared_encoders]

    @property
    def llm_layers(self) -> nn.ModuleList:
        return self.lm_family.layers(self.language_model)

    def freeze(self, encoders: bool | None = None, projectors: bool | None = None,
               language_model: bool | None = None, **by_name: bool) -> "MultimodalModel":
        """Set ``requires_grad`` per part; ``None`` leaves a part as it is. ``vision=True`` freezes that encoder
        (not its projector); ``vision_projector=False`` unfreezes that projector."""
        def set_(module, frozen):
            if frozen is not None:
                module.requires_grad_(not frozen)

        for enc in self.encoders.values():
            set_(enc.module, encoders)
            set_(enc.projector, projectors)
        set_(self.language_model, language_model)
        for key, frozen in by_name.items():
            name, part = (key[: -len("_projector")], "projector") if key.endswith("_projector") else (key, "module")
            if name not in self.encoders:
                raise ValueError(f"freeze({key}=...): no encoder named {name!r}; encoders: {list(self.encoders)}")
            set_(getattr(self.encoders[name], part), frozen)
        return self

    # ------------------------------------------------------------------ data checks and masks
    def modality_of_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per token: -1 padding, 0 text, k for a placeholder of the k-th encoder."""
        mods = torch.zeros_like(input_ids)
        for name, k in self.modality_index.items():
            mods = torch.where(input_ids == self.placeholder_ids[name], k, mods)
        if attention_mask is not None:
            mods = torch.where(attention_mask.bool(), mods, -1)
        return mods

    def build_bam(self, input_ids, attention_mask=None,
                  causal_modalities: bool | set[int] | None = None) -> torch.Tensor:
        """Default words: text causal over everything, each modality bidirectional among its own tokens (or, with
        ``causal_modalities``, default ``self.causal_modalities``, the text word: plain causal); with
        ``self.bidirectional_items`` each item's tokens are causal and also see the later tokens of their own item
        (Gemma 3's images)."""
        causal = self.causal_modalities if causal_modalities is None else causal_modalities
        return masks.words_from_modalities(self.modality_of_tokens(input_ids, attention_mask), len(self.encoders),
                                           causal, spans=self.bidirectional_items)

    def check_batch(self, batch: dict) -> None:
        """A whole batch's placeholders (``check_placeholders``) and words (``masks.validate``), once: the pipeline
        then takes its microbatches' words as checked (one host read per step, not one per microbatch)."""
        self.check_placeholders(batch["input_ids"], {e: batch[e] for e in self.encoders if e in batch})
        if batch.get("bam") is not None:
            masks.validate(batch["bam"], batch.get("segment_ids"))

    def check_placeholders(self, input_ids: torch.Tensor, modality_inputs: dict[str, dict]) -> None:
        """Raise if a modality's placeholder count differs from what its encoder will emit (before it runs)."""
        for name, enc in self.encoders.items():
            found = int((input_ids == self.placeholder_ids[name]).sum())
            expected = sum(enc.num_tokens(modality_inputs[name])) if name in modality_inputs else 0
            if found != expected:
                raise ValueError(f"modality {name!r}: input_ids hold {found} placeholder tokens (id "
                                 f"{self.placeholder_ids[name]}) but its encoder emits {expected} features for the "
                                 f"given inputs; expand each item's placeholder to its encoder's token count "
                                 "(ModalityEncoder.num_tokens)")
        unknown = set(modality_inputs) - set(self.encoders)
        if unknown:
            raise ValueError(f"batch has inputs for unknown modalities {sorted(unknown)}; encoders: "
                             f"{list(self.encoders)}")

    # ------------------------------------------------------------------ the steps pipeline stages compose
    @property
    def deepstack(self) -> dict[str, int]:
        """Modalities whose encoder emits DeepStack features (Qwen3-VL) -> the LLM layers they are added after.

        Such an encoder's features are ``[tokens, H * (1 + k)]``: the token features, then one ``H`` block per
        layer (``split_features``); they travel between stages as one tensor."""
        return {n: k for n, e in self.encoders.items() if (k := e.family.deepstack_layers(e.config))}

    def split_features(self, features: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """(the token features of every modality, the DeepStack features ``[N, k, H]`` of those that have them and
        are present)."""
        main, stacks, h = dict(features), {}, self.hidden_size
        for name, k in self.deepstack.items():
            feats = features.get(name)
            if feats is None or not feats.shape[0]:
                main.pop(name, None)
                continue
            if feats.shape[-1] != h * (1 + k):
                raise ValueError(f"modality {name!r}: features of width {feats.shape[-1]}, but its encoder emits "
                                 f"DeepStack features for {k} layers: width {h} x {1 + k} expected")
            main[name], stacks[name] = feats[:, :h], feats[:, h:].unflatten(-1, (k, h))
        return main, stacks

    def deepstack_context(self, input_ids: torch.Tensor, stacks: dict[str, torch.Tensor], first: int = 0,
                          local: Callable = lambda t: t) -> dict[str, DeepStack]:
        """``AttentionContext.deepstack`` of a microbatch: ``stacks[name][:, j]`` added after layer ``first + j``."""
        return {name: DeepStack.at(input_ids, self.placeholder_ids[name], feats, first, local)
                for name, feats in stacks.items()}

    def embed(self, input_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Text embeddings with each modality's features placed at its placeholders (DeepStack blocks left out)."""
        features = self.split_features(features)[0] if self.deepstack else features
        is_placeholder = torch.zeros_like(input_ids, dtype=torch.bool)
        for pid in self.placeholder_ids.values():
            is_placeholder |= input_ids == pid
        embeds = self.lm_family.embed_tokens(self.language_model)(input_ids.masked_fill(is_placeholder, 0))
        if self.merge is not None:
            return self.merge(embeds, input_ids, features)
        for name, feats in features.items():
            embeds = scatter_features(embeds, input_ids, self.placeholder_ids[name], feats)
        return embeds

    def run_llm_layers(self, hidden: torch.Tensor, ctx: AttentionContext, start: int = 0,
                       end: int | None = None) -> torch.Tensor:
        fam, lm = self.lm_family, self.language_model
        hf_attention.check_honours_mask(lm)
        pos_emb = fam.position_embeddings(lm, hidden, ctx.position_ids)
        for i, layer in enumerate(list(self.llm_layers)[start:end], start):
            hidden = fam.run_layer(layer, hidden, pos_emb, ctx.position_ids, ctx.attn_kwargs())
            for stack in ctx.deepstack.values():
                hidden = stack.add(hidden, i)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_family.logits(self.language_model, hidden)

    def attention_context(self, input_ids, bam=None, segment_ids=None, position_ids=None,
                          attention_mask=None, checked: bool = False) -> AttentionContext:
        """The attention layers' inputs; ``checked``: the caller validated the words (``check_batch``)."""
        if bam is None:
            bam = self.build_bam(input_ids, attention_mask)
        if not checked:
            masks.validate(bam, segment_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if segment_ids is not None:  # the collator's are narrow (masks.segment_dtype); kernels take int64
            segment_ids = segment_ids.to(torch.int64)
        # the words were just validated: the attention layers sharing this cache need not read them again
        return AttentionContext(position_ids=position_ids, bam=bam, segment_ids=segment_ids,
                                attn_cache={"checked_words": [bam]})

    # ------------------------------------------------------------------ the whole model
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, bam: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, num_label_tokens: int | torch.Tensor | None = None,
                item_counts: dict | None = None, **modality_inputs: dict) -> MultimodalOutput:
        """Loss (token cross-entropy / label tokens; ``num_label_tokens`` overrides the divisor) and logits.

        ``item_counts`` (items per row, from the collator) only matters for cutting microbatches."""
        self.check_placeholders(input_ids, modality_inputs)
        if position_ids is None and self.position_ids_fn is not None:
            position_ids = self.position_ids_fn(input_ids, modality_inputs, attention_mask)
        features = {name: self.encoders[name](inputs) for name, inputs in modality_inputs.items()}
        ctx = self.attention_context(input_ids, bam, segment_ids, position_ids, attention_mask)
        if self.deepstack:
            ctx.deepstack = self.deepstack_context(input_ids, self.split_features(features)[1])
        with moe.recording(self.lm_family, self.language_model, ctx.bam) as router:
            hidden = self.run_llm_layers(self.embed(input_ids, features), ctx)
        logits = self.logits(hidden)
        aux = None if router is None else router.aux_loss()
        if labels is None:
            return MultimodalOutput(None, logits, router=router, aux_loss=aux)
        loss_sum = losses.token_loss_sum(logits, losses.shift_labels(labels))
        count = losses.count_label_tokens(labels) if num_label_tokens is None else num_label_tokens
        loss = losses.normalise(loss_sum, count)
        if aux is not None:  # as the family's own forward: coef * aux when config.output_router_logits
            loss = loss + self.lm_family.aux_loss_coef(self.language_model) * aux
        return MultimodalOutput(loss, logits, loss_sum, router, aux)

    # ------------------------------------------------------------------ generation and LoRA (generation.py, lora.py)
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Decode with a KV cache through the language model's own transformers ``generate``: the encoders run
        once, their features are merged into the prompt's embeddings, then the LLM decodes (``max_new_tokens``,
        ``do_sample``, ``num_beams``, ... are transformers' own). Takes a batch as the collator makes it (labels
        and item counts are ignored; rows padded on the right are moved left). The prompt attends under its
        bitfield words (``bam``, default ``build_bam``); generated tokens are text. Positions count each row's real
        tokens, or, for a model with its own (``position_ids_fn``: Qwen2-VL / Qwen2.5-VL M-RoPE), the prompt takes
        those (``position_ids``, default computed) and each generated token the next on every axis, so greedy
        tokens equal HF's composite ``generate``. Returns what transformers' ``generate`` returns for
        ``inputs_embeds``: the new token ids ``[B, N]`` (or its output object with
        ``return_dict_in_generate=True``)."""
        from lightning_mm.model.generation import generate

        return generate(self, input_ids, attention_mask, **kwargs)

    def add_lora(self, modules, r: int = 8, alpha: float = 16, dropout: float = 0.0, **config):
        """LoRA adapters (``peft.LoraConfig(r, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules,
        **config)``) on the language model's ``modules`` (e.g. ``["q_proj", "v_proj"]``); the language model's
        other weights are frozen, the rest of the model keeps its ``requires_grad``. Returns the ``PeftModel``
        (also ``model.peft_model``); ``lightning_mm.model.lora.save_lora`` / ``merge_lora`` export."""
        from lightning_mm.model.lora import add_lora

        return add_lora(self, modules, r=r, alpha=alpha, dropout=dropout, **config)
