"""HF composite multimodal checkpoints in and out: LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3 and
Qwen2-Audio (and the MoE variants of Qwen3-VL and Qwen3.5);
LLaVA-NeXT, LLaVA-OneVision and InternVL through their tile adapters (``lightning_mm.model.tiled_images``).

``from_pretrained(MultimodalModel, folder)`` (what ``MultimodalModel.from_pretrained`` calls) builds a model whose
forward is the composite class's own: its vision or audio tower (LLaVA's cut after ``vision_feature_layer``, the
first token dropped by the "default" select strategy; Qwen2-Audio's run with the clips' padding mask, each clip
emitting its real length), its projector module, its language model, its placeholder ids (``image_token_id`` /
``audio_token_id``), its attention pattern (causal over every token) and, for the Qwen-VL families, its M-RoPE
positions (and Qwen3-VL's DeepStack: ``MultimodalModel.deepstack``). Every part records where its tensors live
in the composite's safetensors (``PretrainedSource``), so under the meta device nothing is read and
``materialise`` reads a pipeline stage's own tensors only, as for folders of separate parts.

``save_pretrained`` writes the folder back for the composite class: every tensor under the composite's names
(tensors no part uses, such as LLaVA's layers past the feature layer, copied from the source folder), its config,
and the source folder's processor and tokenizer files.
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_mm.model import loading, qwen3_omni, tiled_images as tiles
from lightning_mm.model.encoder import ModalityEncoder
from lightning_mm.model.families import (ENCODER_FAMILIES, LANGUAGE_FAMILIES, MROPE_FAMILIES, VideoInputs,
                                         encoder_family)
from lightning_mm.model.loading import ModelFolderError, PretrainedSource
from lightning_mm.model.mrope_lm import Qwen2_5_VLTextForCausalLM, Qwen2VLTextForCausalLM  # noqa: F401  (re-export)


# ---------------------------------------------------------------------------------------------- encoder views
class PooledImagesFamily(tiles.TowerView):
    """Gemma 3's tower as its composite reads it: SigLIP's ``last_hidden_state`` (final norm included) of each
    image, then the projector (``Gemma3MultiModalProjector``), which average-pools the patch grid to
    ``mm_tokens_per_image`` tokens, normalises and projects them. Everything else is the base family's."""

    @property
    def tokens_per_image(self) -> int:
        return int(self.config.mm_tokens_per_image)

    @property
    def patches_per_image(self) -> int:
        vc = self.config.vision_config
        return (vc.image_size // vc.patch_size) ** 2

    def num_tokens(self, config, inputs) -> list[int]:
        return [self.tokens_per_image] * len(self.base.num_tokens(config, inputs))

    def encoder_positions(self, config, inputs) -> list[int]:
        """The patches the tower's layers see per image (the projector then pools them)."""
        return self.base.num_tokens(config, inputs)

    @property
    def positions_per_token(self) -> int:
        """Tower positions pooled into one LLM token (the encoder's cost per emitted token)."""
        return self.patches_per_image // self.tokens_per_image

    def project(self, projector, feats, ctx) -> torch.Tensor:
        """The projector on each image's patches ``[images, patches, H]`` (it pools over the patch grid)."""
        return projector(feats.view(-1, self.patches_per_image, feats.shape[-1])).flatten(0, 1)


POOLED_IMAGES = tiles.ViewAdapter("Gemma 3", PooledImagesFamily)


# ---------------------------------------------------------------------------------------------- the composites
@dataclass(frozen=True)
class TowerSpec:
    """A further tower of a composite, with its own modality, config attribute, placeholder id attribute and key
    prefix; its own layers project to the LLM's width (no projector module)."""

    modality: str
    tower_config: str
    token_id: str
    tower: str


@dataclass(frozen=True)
class CompositeSpec:
    """Where a composite class keeps its parts (transformers 5 names; older checkpoints are renamed on load)."""

    class_name: str
    model_type: str
    modality: str                # the encoder's name in the MultimodalModel
    tower_config: str            # config attribute holding the encoder's config
    token_id: str                # config attribute holding the placeholder id
    tower: str                   # key prefix of the encoder
    projector: str | None        # key prefix of the projector (None: the tower's own merger projects)
    mrope: bool = False
    feature_layer: bool = False  # the tower is cut after ``vision_feature_layer`` (LLaVA and its successors)
    adapter: object = None       # tiled images (lightning_mm.model.tiled_images): the encoder view and projector extras
    # how the tower reads videos ("qwen2": Qwen2-VL's grids; "qwen2_5": seconds per grid; "qwen3": frame by frame,
    # timestamps as text between the frames; "onevision": frames as images, pooled, a newline after each video)
    video: str | None = None
    bidirectional_items: bool = False  # each image's tokens also see each other (Gemma 3), causal otherwise
    projector_configs: tuple[str, ...] = ()  # config attributes the projector class takes (empty: the whole config)
    more_towers: tuple[TowerSpec, ...] = ()  # towers of other modalities beside the main one (Qwen3-Omni's audio)
    omni_positions: bool = False  # Qwen3-Omni's M-RoPE: temporal steps in position_id_per_seconds, text after max

    def hf_class(self):
        import transformers

        return getattr(transformers, self.class_name)


SPECS = {s.class_name: s for s in (
    CompositeSpec("LlavaForConditionalGeneration", "llava", "vision", "vision_config", "image_token_id",
                  "model.vision_tower.", "model.multi_modal_projector.", feature_layer=True),
    CompositeSpec("LlavaNextForConditionalGeneration", "llava_next", "vision", "vision_config", "image_token_id",
                  "model.vision_tower.", "model.multi_modal_projector.", feature_layer=True, adapter=tiles.LLAVA_NEXT),
    CompositeSpec("LlavaOnevisionForConditionalGeneration", "llava_onevision", "vision", "vision_config",
                  "image_token_id", "model.vision_tower.", "model.multi_modal_projector.", feature_layer=True,
                  adapter=tiles.LLAVA_ONEVISION, video="onevision"),
    CompositeSpec("InternVLForConditionalGeneration", "internvl", "vision", "vision_config", "image_token_id",
                  "model.vision_tower.", "model.multi_modal_projector.", feature_layer=True, adapter=tiles.INTERNVL),
    CompositeSpec("Qwen2VLForConditionalGeneration", "qwen2_vl", "vision", "vision_config", "image_token_id",
                  "model.visual.", None, mrope=True, video="qwen2"),
    CompositeSpec("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "vision", "vision_config", "image_token_id",
                  "model.visual.", None, mrope=True, video="qwen2_5"),
    CompositeSpec("Qwen3VLForConditionalGeneration", "qwen3_vl", "vision", "vision_config", "image_token_id",
                  "model.visual.", None, mrope=True, video="qwen3"),
    CompositeSpec("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", "vision", "vision_config", "image_token_id",
                  "model.visual.", None, mrope=True, video="qwen3"),
    CompositeSpec("Qwen3_5ForConditionalGeneration", "qwen3_5", "vision", "vision_config", "image_token_id",
                  "model.visual.", None, mrope=True, video="qwen3"),
    CompositeSpec("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "vision", "vision_config", "image_token_id",
                  "model.visual.", None, mrope=True, video="qwen3"),
    CompositeSpec("Qwen2AudioForConditionalGeneration", "qwen2_audio", "audio", "audio_config", "audio_token_id",
                  "model.audio_tower.", "model.multi_modal_projector."),
    CompositeSpec("Gemma3ForConditionalGeneration", "gemma3", "vision", "vision_config", "image_token_id",
                  "model.vision_tower.", "model.multi_modal_projector.", adapter=POOLED_IMAGES,
                  bidirectional_items=True),
    CompositeSpec("Gemma4ForConditionalGeneration", "gemma4", "vision", "vision_config", "image_token_id",
                  "model.vision_tower.", "model.embed_vision.", projector_configs=("vision_config", "text_config")),
    CompositeSpec("Qwen3OmniMoeThinkerForConditionalGeneration", "qwen3_omni_moe_thinker", "vision", "vision_config",
                  "image_token_id", "model.visual.", None, mrope=True, video="omni", omni_positions=True,
                  more_towers=(TowerSpec("audio", "audio_config", "audio_token_id", "model.audio_tower."),)),
)}
LM_PREFIXES = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


def composite_spec(config) -> CompositeSpec | None:
    """The composite a config describes (``architectures`` first, then ``model_type``), or None."""
    for arch in getattr(config, "architectures", None) or ():
        if arch in SPECS:
            return SPECS[arch]
    return next((s for s in SPECS.values() if s.model_type == getattr(config, "model_type", None)), None)


def _prefix_table(spec: CompositeSpec) -> list[tuple[str, str]]:
    """(composite key prefix, our full-name prefix) pairs."""
    extra = [(theirs, f"encoders.{spec.modality}.{ours}") for theirs, ours in
             (spec.adapter.extra_prefixes if spec.adapter else ())]  # first: they may sit inside another prefix
    table = extra + list(LM_PREFIXES) + [(spec.tower, f"encoders.{spec.modality}.module.")]
    table += [(t.tower, f"encoders.{t.modality}.module.") for t in spec.more_towers]
    if spec.projector:
        table.append((spec.projector, f"encoders.{spec.modality}.projector."))
    return table


def to_ours(spec: CompositeSpec, name: str) -> str | None:
    for theirs, ours in _prefix_table(spec):
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return None


def to_theirs(spec: CompositeSpec, name: str) -> str | None:
    for theirs, ours in _prefix_table(spec):
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return None


@dataclass
class CompositeSource:
    """What ``save_pretrained`` needs to write a composite folder back: its config, the source folder, and the
    tensors of the source no part of the model holds (composite key -> (file, key in the file))."""

    spec: CompositeSpec
    config: object
    folder: str
    passthrough: dict[str, tuple[str, str]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- encoder views
class FeatureSelectFamily:
    """A ViT family as LLaVA reads its tower: the hidden state after the tower's layers (the tower is built with
    only the layers up to ``vision_feature_layer``), without the final norm, the first token dropped by the
    "default" select strategy. Everything else is the base family's."""

    def __init__(self, base, drop_first: bool):
        self.base, self.drop_first = base, drop_first

    def __getattr__(self, name):
        if name.startswith("__") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def num_tokens(self, config, inputs) -> list[int]:
        return [n - int(self.drop_first) for n in self.base.num_tokens(config, inputs)]

    def final(self, enc, hidden, ctx) -> torch.Tensor:
        hidden = hidden[:, 1:] if self.drop_first else hidden
        return hidden.reshape(-1, hidden.shape[-1])


@dataclass(frozen=True)
class MRopeItems:
    """One kind of item with M-RoPE positions: its modality, placeholder id and grid key; ``seconds_key`` (videos of
    Qwen2.5-VL: ``second_per_grid_ts``) spaces temporal positions by ``tokens_per_second`` per second of each grid
    step, as HF's ``get_rope_index`` does (images and Qwen2-VL's videos: one per step). ``per_frame`` (Qwen3-VL's
    videos, whose frames are apart in the text, each after its timestamp): every temporal step of a grid is an item
    of its own, ``(1, h, w)``, as HF's ``get_rope_index`` splits them. Qwen3-Omni spaces a video's temporal steps
    by ``video_second_per_grid x position_id_per_seconds`` (``seconds_key``), an image's by ``step``."""

    modality: str
    placeholder_id: int
    grid_key: str = "image_grid_thw"
    seconds_key: str | None = None
    tokens_per_second: float = 1.0
    per_frame: bool = False
    step: float = 1.0  # temporal positions per grid step without seconds (Qwen3-Omni: position_id_per_seconds x s)
    whole: bool = False  # refuse temporal positions that are not whole numbers (Qwen3-Omni's are floats in HF)


@dataclass(frozen=True)
class MRopePositions:
    """Qwen2-VL's 3-D positions (``get_rope_index``) from the token ids and the items' grids: text counts on from
    the position after the previous item; an item's tokens get (start + t * interval, start + h, start + w) over its
    merged grid and the next text starts ``max(h, w)`` after it (``after_max``: one past the item's largest
    position on any axis, as Qwen3-Omni's ``get_rope_index``). Consecutive runs of placeholders are split into
    items by their token counts; each kind (``MRopeItems``: images, videos) takes its items in order; tokens of no
    kind (text, Qwen3-Omni's audio) count on by one. Padding (``attention_mask`` 0) is skipped and gets 0. Returns
    ``[B, S, 3]``."""

    kinds: tuple[MRopeItems, ...]
    spatial_merge_size: int
    after_max: bool = False  # the next text starts after the item's largest position on any axis (Qwen3-Omni)
    check: object = None  # ``check(input_ids)``: refuses a layout these positions do not compute (Qwen3-Omni's)

    def __call__(self, input_ids: torch.Tensor, modality_inputs: dict, attention_mask: torch.Tensor | None = None):
        m = self.spatial_merge_size
        grids, intervals, taken = {}, {}, {}
        for kind in self.kinds:
            inputs = modality_inputs.get(kind.modality) or {}
            grids[kind.placeholder_id] = inputs[kind.grid_key].tolist() if kind.grid_key in inputs else []
            if kind.per_frame:
                grids[kind.placeholder_id] = [[1, h, w] for t, h, w in grids[kind.placeholder_id] for _ in range(t)]
            seconds = inputs.get(kind.seconds_key) if kind.seconds_key else None
            intervals[kind.placeholder_id] = [kind.tokens_per_second * float(s) for s in seconds.tolist()] \
                if seconds is not None else [kind.step] * len(grids[kind.placeholder_id])
            if kind.whole:
                _check_whole(kind, grids[kind.placeholder_id], intervals[kind.placeholder_id])
            taken[kind.placeholder_id] = 0
        if self.check is not None:
            self.check(input_ids)
        names = {k.placeholder_id: k for k in self.kinds}
        out = torch.zeros(*input_ids.shape, 3, dtype=torch.long)
        for row in range(input_ids.shape[0]):
            keep = torch.ones(input_ids.shape[1], dtype=torch.bool) if attention_mask is None else \
                attention_mask[row].bool().cpu()
            ids = input_ids[row].cpu()[keep]
            kind_of = torch.zeros_like(ids)
            for pid in names:
                kind_of = torch.where(ids == pid, pid + 1, kind_of)  # 0: text
            values, counts = torch.unique_consecutive(kind_of, return_counts=True)
            pos, parts = 0, []
            for value, count in zip(values.tolist(), counts.tolist()):
                if not value:
                    parts.append(torch.arange(pos, pos + count).unsqueeze(1).expand(-1, 3))
                    pos += count
                    continue
                pid = value - 1
                while count > 0:
                    item = taken[pid]
                    if item >= len(grids[pid]):
                        kind = names[pid]
                        raise ValueError(f"{kind.modality}: input_ids hold more placeholder tokens than the "
                                         f"{len(grids[pid])} items of {kind.grid_key} give")
                    t, h, w = grids[pid][item]
                    gh, gw = h // m, w // m
                    tt = (torch.arange(t) * intervals[pid][item]).long()
                    tt, hh, ww = torch.meshgrid(tt, torch.arange(gh), torch.arange(gw), indexing="ij")
                    parts.append(torch.stack([tt, hh, ww], -1).reshape(-1, 3) + pos)
                    count -= t * gh * gw
                    pos = int(parts[-1].max()) + 1 if self.after_max else pos + max(gh, gw)
                    taken[pid] = item + 1
                if count < 0:
                    raise ValueError(f"{names[pid].modality}: a run of placeholder tokens ends inside an item; "
                                     "expand each item's placeholder to its token count")
            if parts:
                out[row, keep] = torch.cat(parts)
        return out.to(input_ids.device)


def _check_whole(kind: MRopeItems, grids: list, intervals: list[float]) -> None:
    """Refuse temporal positions that are not whole numbers (our positions are integers; HF's Qwen3-Omni keeps
    ``t x seconds per grid x position_id_per_seconds`` as a float)."""
    for i, ((t, _, _), step) in enumerate(zip(grids, intervals)):
        if t > 1 and abs(step - round(step)) > 1e-6:
            raise ValueError(f"{kind.modality} item {i}: its temporal positions are {step:g} apart, not a whole "
                             f"number ({kind.seconds_key or 'seconds per grid'} x position_id_per_seconds); sample "
                             "videos at a frame rate that makes it whole (e.g. fps 1 or 2 with 25 positions a "
                             "second and temporal_patch_size 2)")


def fill_positions(model, batch: dict) -> dict:
    """The batch with the model's own ``position_ids`` (Qwen2-VL's M-RoPE) when it has none, computed from its
    tokens and grids (so every rank of a replica computes the same)."""
    fn = getattr(model, "position_ids_fn", None)
    if fn is None or batch.get("position_ids") is not None or "input_ids" not in batch:
        return batch
    inputs = {name: batch[name] for name in model.encoders if isinstance(batch.get(name), dict)}
    return {**batch, "position_ids": fn(batch["input_ids"], inputs, batch.get("attention_mask"))}


# ---------------------------------------------------------------------------------------------- loading
def _language_class(config):
    model_type = getattr(config, "model_type", None)
    fam = LANGUAGE_FAMILIES.get(model_type) or MROPE_FAMILIES.get(model_type)
    if fam is None:
        supported = ", ".join(list(LANGUAGE_FAMILIES) + list(MROPE_FAMILIES))
        raise ModelFolderError(f"the composite's language model has model_type={model_type!r}, not a supported "
                               f"family ({supported})")
    return fam.hf_class()


def _encoder_class(config):
    model_type = getattr(config, "model_type", None)
    for fam in ENCODER_FAMILIES.values():
        if fam.folder_model_types.get(model_type, "missing") is None:
            return fam.hf_class()
    supported = ", ".join(m for f in ENCODER_FAMILIES.values() for m, sub in f.folder_model_types.items()
                          if sub is None)
    raise ModelFolderError(f"the composite's encoder has model_type={model_type!r}, not a supported tower "
                           f"({supported})")


def _record_sources(part: nn.Module, prefix: str, spec: CompositeSpec, stored: dict, folder, used: set,
                    converted: dict) -> None:
    """Give ``part`` (full name ``prefix``) a ``PretrainedSource`` for every persistent tensor, after checking its
    presence and shape in the folder (tensors in ``converted``, which transformers converted on load, excepted)."""
    mapping, missing = {}, []
    groups = loading._groups(part)
    for g in groups.values():
        theirs = [to_theirs(spec, loading._join(prefix, n)) for n in g.names]
        hit = next((stored[t] for t in theirs if t in stored), None)
        if hit is not None:  # tied weights: every name of the tensor reads the stored one
            used.update(t for t in theirs if t in stored)
            mapping.update(dict.fromkeys(g.names, hit))
        elif any(t in converted for t in theirs):
            continue
        elif g.persistent and not all(loading._ignorable(part, n) for n in g.names):
            missing.append(theirs[0])
    if missing:
        raise ModelFolderError(f"{folder.path} has no tensor {missing[0]!r} ({len(missing)} missing in all); the "
                               f"folder's weights do not match its {loading.CONFIG_FILE}")
    shapes = {n: tuple(g.tensor.shape) for g in groups.values() for n in g.names}
    for name, (file, key) in mapping.items():
        loading._check_tensor(os.path.join(folder.path, file), key, folder.headers[file], name, shapes[name])
    part.pretrained_source = PretrainedSource(folder.path, type(part).__name__, mapping)


def from_pretrained(model_class, path, causal_modalities: bool = True):
    """The ``model_class`` (``MultimodalModel``) of a composite HF folder (see the module docstring).

    ``causal_modalities=False`` makes each image's / clip's tokens attend bidirectionally among themselves
    instead of HF's causal pattern. Parameters take the default dtype; under the meta device nothing is read."""
    folder = loading._open_folder(path)
    config = folder.config
    spec = _supported_spec(folder)
    with torch.device("meta"):
        hf = spec.hf_class()(copy.deepcopy(config))
    stored, converted = _folder_tensors(spec, folder, hf)
    tied = hf.lm_head.weight is hf.model.language_model.embed_tokens.weight

    # the parts, built on meta, then materialised from the folder unless the caller builds on meta
    text_config = copy.deepcopy(config.get_text_config())
    text_config.tie_word_embeddings = tied
    tower_config, drop_first = _tower_config(spec, folder)
    more_configs = {t.modality: copy.deepcopy(getattr(config, t.tower_config)) for t in spec.more_towers}
    with torch.device("meta"):
        lm = _language_class(text_config)(text_config)
        tower = _encoder_class(tower_config)(tower_config)
        more = {m: _encoder_class(c)(c) for m, c in more_configs.items()}
        args = [copy.deepcopy(getattr(config, a)) for a in spec.projector_configs] or [copy.deepcopy(config)]
        projector = type(hf.get_submodule(spec.projector[:-1]))(*args) if spec.projector else nn.Identity()
        if spec.adapter is not None:
            projector = spec.adapter.build_projector(projector, config)
    parts = {"language_model": lm, f"encoders.{spec.modality}.module": tower}
    if spec.projector:
        parts[f"encoders.{spec.modality}.projector"] = projector
    parts.update({f"encoders.{m}.module": t for m, t in more.items()})
    used = _load_parts(parts, spec, stored, folder, converted)

    enc = ModalityEncoder(tower, projector=projector)
    if spec.adapter is not None:
        enc.family = spec.adapter.family(encoder_family(tower), copy.deepcopy(config), drop_first)
    elif drop_first is not None:
        enc.family = FeatureSelectFamily(encoder_family(tower), drop_first)
    encoders, placeholders, kinds = _media_encoders(spec, config, tower_config, enc, drop_first)
    for t in spec.more_towers:
        encoders[t.modality] = ModalityEncoder(more[t.modality], projector=nn.Identity())
        placeholders[t.modality] = getattr(config, t.token_id)
    model = model_class(encoders, lm, placeholder_ids=placeholders)
    model.causal_modalities = causal_modalities
    model.bidirectional_items = spec.bidirectional_items and causal_modalities
    if spec.model_type == "gemma4":  # image blocks (on local layers only) with use_bidirectional_attention="vision"
        model.bidirectional_items = causal_modalities and \
            config.get_text_config().use_bidirectional_attention == "vision"
    if spec.mrope:
        check = None if not spec.omni_positions else qwen3_omni.AudioInVideo(
            getattr(config, "vision_start_token_id", None), getattr(config, "audio_start_token_id", None))
        model.position_ids_fn = MRopePositions(tuple(kinds), tower_config.spatial_merge_size,
                                               after_max=spec.omni_positions, check=check)
    model.composite = CompositeSource(spec, copy.deepcopy(config), folder.path,
                                      {k: v for k, v in stored.items() if k not in used})
    return model


def _media_encoders(spec: CompositeSpec, config, tower_config, enc: ModalityEncoder, drop_first):
    """(encoders, placeholder ids, M-RoPE item kinds) of the main tower's modality and of its videos (the same tower
    and projector, when the composite reads videos)."""
    placeholder = getattr(config, spec.token_id)
    encoders, placeholders = {spec.modality: enc}, {spec.modality: placeholder}
    per_second = getattr(config, "position_id_per_seconds", None) if spec.omni_positions else None
    kinds = [MRopeItems(spec.modality, placeholder, step=per_second or 1.0, whole=per_second is not None)]
    if spec.video is not None and getattr(config, "video_token_id", None) is not None:
        encoders["video"] = _video_encoder(spec, config, enc.module, enc.projector, enc.family, drop_first)
        placeholders["video"] = config.video_token_id
        if per_second is not None:  # without seconds per grid: the processor's, at 1 frame a second
            kinds.append(MRopeItems("video", config.video_token_id, "video_grid_thw", "video_second_per_grid",
                                    per_second, step=per_second * tower_config.temporal_patch_size, whole=True))
        else:
            seconds = spec.video == "qwen2_5"
            kinds.append(MRopeItems("video", config.video_token_id, "video_grid_thw",
                                    "second_per_grid_ts" if seconds else None,
                                    getattr(tower_config, "tokens_per_second", 1.0) if seconds else 1.0,
                                    per_frame=spec.video == "qwen3"))
    return encoders, placeholders, kinds


def _supported_spec(folder) -> CompositeSpec:
    """The composite ``folder``'s config describes, or the error listing the supported ones."""
    spec = composite_spec(folder.config)
    if spec is None and getattr(folder.config, "model_type", None) == "qwen3_omni_moe":
        raise ModelFolderError(f"{folder.path} holds the whole Qwen3-Omni model (thinker, talker, code2wav); only its "
                               "thinker is supported (the talker's speech output is out of scope): save the thinker "
                               "alone with Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).thinker"
                               ".save_pretrained(thinker_folder) and load that folder")
    if spec is None:
        supported = ", ".join(f"{s.class_name} ({s.model_type})" for s in SPECS.values())
        raise ModelFolderError(f"{os.path.join(folder.path, loading.CONFIG_FILE)} describes "
                               f"{loading._describe(folder.config)}, not a supported composite; supported: "
                               f"{supported}. Folders of separate parts load with ModalityEncoder(folder) and "
                               "MultimodalModel(language_model=folder)")
    if spec.model_type == "gemma4":
        _refuse_gemma4_parts(folder)
    return spec


def _refuse_gemma4_parts(folder) -> None:
    """What of a Gemma 4 composite is not served, refused before anything is built: its audio tower (a Conformer
    with chunked local attention, no encoder family)."""
    config, where = folder.config, os.path.join(folder.path, loading.CONFIG_FILE)
    if getattr(config, "audio_config", None) is not None:
        raise ModelFolderError(f"{where}: Gemma 4's audio tower (audio_config) is not supported (no encoder family "
                               "for Gemma4AudioModel); use a checkpoint without audio, or set audio_config to null")


def _folder_tensors(spec: CompositeSpec, folder, hf: nn.Module) -> tuple[dict, dict]:
    """The folder's tensors by the composite class's names (``hf``: the class on meta): (stored: name -> (file, key
    in the file), converted: name -> tensor, for those transformers converts on load, read eagerly through it)."""
    rename = loading._hf_renamer(hf)
    expected = set(hf.state_dict())
    stored, converted = {}, {}
    for key, file in folder.files.items():
        name, fused = rename(key)
        if name in expected:
            (converted if fused else stored)[name] = (file, key)
    if converted:  # experts stored in another layout: transformers converts them on load (eagerly only)
        if loading.building_on_meta():
            raise ModelFolderError(f"{folder.path}: {len(converted)} tensors (e.g. {next(iter(converted))!r}) are "
                                   "stored in a form transformers converts on load (experts fused or split), which "
                                   "lazy (meta) loading does not do; build this model eagerly")
        state = spec.hf_class().from_pretrained(folder.path, dtype=torch.get_default_dtype(),
                                                local_files_only=True).state_dict()
        converted = {name: state[name] for name in converted}
    return stored, converted


def _tower_config(spec: CompositeSpec, folder):
    """(the encoder tower's config, whether its first token is dropped): LLaVA and its successors cut the tower after
    ``vision_feature_layer`` and drop the first token with the "default" select strategy (None: no cut)."""
    config = folder.config
    tower_config = copy.deepcopy(getattr(config, spec.tower_config))
    if not spec.feature_layer:
        return tower_config, None
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ModelFolderError(f"{folder.path}: vision_feature_layer={layer!r} (several layers concatenated) is "
                               "not supported; only one feature layer is")
    total = tower_config.num_hidden_layers
    keep = layer if layer >= 0 else total + 1 + layer
    if not 0 <= keep <= total:
        raise ModelFolderError(f"{folder.path}: vision_feature_layer={layer} is outside the tower's {total} "
                               "layers")
    tower_config.num_hidden_layers = keep
    return tower_config, config.vision_feature_select_strategy == "default"


def _load_parts(parts: dict[str, nn.Module], spec: CompositeSpec, stored: dict, folder, converted: dict) -> set[str]:
    """Record where each part's tensors live (``_record_sources``) and, unless building on meta, read them (what
    transformers converted on load copied in). Returns the composite names the parts use."""
    used: set[str] = set()
    for prefix, part in parts.items():
        _record_sources(part, prefix, spec, stored, folder, used, converted)
    if not loading.building_on_meta():
        for prefix, part in parts.items():
            loading.materialise(part, torch.get_default_device())
            with torch.no_grad():  # what transformers converted on load
                for name, tensor in part.state_dict(keep_vars=True).items():
                    theirs = to_theirs(spec, f"{prefix}.{name}")
                    if theirs in converted:
                        tensor.copy_(converted[theirs])
    return used


def _video_encoder(spec: CompositeSpec, config, tower: nn.Module, projector: nn.Module, image_family,
                   drop_first: bool | None) -> ModalityEncoder:
    """The videos' encoder: the same tower and projector as the images (one copy of the parameters,
    shared_encoders), reading frames as LLaVA-OneVision does or through the image family (``VideoInputs``)."""
    video = ModalityEncoder(tower, projector=projector)
    video.family = tiles.OneVisionVideoFamily(encoder_family(tower), copy.deepcopy(config), drop_first) \
        if spec.video == "onevision" else VideoInputs(image_family)
    return video


# ---------------------------------------------------------------------------------------------- saving
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")


def _passthrough_tensor(src: CompositeSource, name: str) -> torch.Tensor:
    from safetensors import safe_open

    file, key = src.passthrough[name]
    with safe_open(os.path.join(src.folder, file), framework="pt", device="cpu") as f:
        return f.get_tensor(key)


def save_pretrained(model, folder) -> dict:
    """Write ``model``, built by ``from_pretrained`` from a composite folder, as one folder the composite class
    loads, with these tensors, plus the source folder's processor and tokenizer files. Returns what was written."""
    src = model.composite
    spec = src.spec
    ours = model.state_dict()
    with torch.device("meta"):
        hf = spec.hf_class()(copy.deepcopy(src.config))
    state = {}
    for name in hf.state_dict():
        mine = to_ours(spec, name)
        if mine in ours:
            value = ours[mine]
        elif name in src.passthrough:
            value = _passthrough_tensor(src, name)
        else:
            raise ValueError(f"cannot save {spec.class_name}: no tensor for {name!r} (expected {mine!r} in the "
                             "model); save_pretrained needs the whole model, not a pipeline stage")
        if value.is_meta:
            raise ValueError(f"{mine or name} is still on the meta device; materialise the model before saving")
        if hasattr(value, "full_tensor"):  # a DTensor: the whole tensor
            value = value.full_tensor()
        state[name] = value.detach()
    hf.load_state_dict(state, strict=True, assign=True)
    os.makedirs(folder, exist_ok=True)
    hf.save_pretrained(folder)
    written = set(os.listdir(folder))
    copied = []
    if os.path.isdir(src.folder):
        for f in sorted(os.listdir(src.folder)):
            path = os.path.join(src.folder, f)
            if (os.path.isfile(path) and f not in written and not f.endswith(WEIGHT_SUFFIXES)
                    and f not in (loading.CONFIG_FILE, loading.SAFETENSORS_INDEX)):
                shutil.copy2(path, os.path.join(folder, f))
                copied.append(f)
    return {"composite": spec.class_name, "folder": os.fspath(folder), "copied": copied}


__all__ = ["SPECS", "CompositeSpec", "CompositeSource", "FeatureSelectFamily", "MRopeItems", "MRopePositions",
           "composite_spec",
           "fill_positions", "from_pretrained", "save_pretrained", "Qwen2VLTextForCausalLM",
           "Qwen2_5_VLTextForCausalLM"]
