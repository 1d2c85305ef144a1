"""Tiled images: LLaVA-NeXT and LLaVA-OneVision (AnyRes) and InternVL, as their composite classes compute them;
LLaVA-OneVision's videos (``OneVisionVideoFamily``) through the same tower and projector.

Each composite is one adapter (``AnyResAdapter`` / ``ViewAdapter``: what ``lightning_mm.model.composites``
needs to load and save it) and one encoder view over its tower's family (what the encoder computes per item). The input contract is the image
processor's own output for a sample's images:

- AnyRes (``LlavaNextImageProcessor``, ``LlavaOnevisionImageProcessor``): ``pixel_values [N, P, C, S, S]`` (every
  image's tiles, the base image first, zero-padded to the longest image), ``image_sizes [N, 2]`` (height, width
  before resizing) and, for OneVision, ``batch_num_images`` (images per sample: only single-image samples are
  tiled, the others use their base image alone). The tower runs on the real tiles; after the projector, HF's
  ``pack_image_features`` unpads the tile grid to the image's aspect ratio and appends ``image_newline`` per row,
  so an image's token count depends on its size. ``num_tokens`` counts by running that same function on zeros of
  width one (exact by construction, and what the processor's ``_get_number_of_features`` computes).
- InternVL (``GotOcr2ImageProcessor`` with ``crop_to_patches``): ``pixel_values [T, C, S, S]`` (every image's
  tiles in order) and ``num_patches [N]`` (tiles per image); each tile gives ``(S/p)^2 * downsample_ratio^2``
  tokens after HF's ``pixel_shuffle``.

Nothing of the composites' forward is copied: the tile count (``image_size_to_num_patches``), the packing
(``pack_image_features``, with ``get_anyres_image_grid_shape`` / ``unpad_image`` inside) and the pixel shuffle are
called from the HF modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

NEWLINE = "image_newline"
BATCH_NUM_IMAGES = "batch_num_images"
# a per-item form of ``batch_num_images`` (1: the item is tiled), written when items are selected (microbatches,
# encoder CP shards), since a per-sample count does not survive an arbitrary subset of items
TILED = "anyres_tiled"


def _probe(pixel_values: torch.Tensor) -> dict:
    """One tile of ``pixel_values``' shape on the meta device (what a ViT family counts positions from)."""
    return {"pixel_values": torch.empty(1, *pixel_values.shape[-3:], device="meta")}


class TowerView:
    """An encoder family as a composite reads its tower: everything not overridden is the base family's."""

    def __init__(self, base, config, drop_first: bool):
        self.base, self.config, self.drop_first = base, config, drop_first

    def __getattr__(self, name):
        if name.startswith("__") or name in ("base", "config", "drop_first"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def _select(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, 1:] if self.drop_first else hidden

    def pieces_per_item(self, inputs) -> list[int]:
        """One encoder CP piece per image, its tiles together (the base family would count tiles)."""
        return [1] * self.num_items(inputs)


# ---------------------------------------------------------------------------------------------- AnyRes
class AnyResFamily(TowerView):
    """LLaVA-NeXT / LLaVA-OneVision: tiles through the tower, then projector and HF's packing (``project``)."""

    def __init__(self, base, config, drop_first: bool, adapter: "AnyResAdapter"):
        super().__init__(base, config, drop_first)
        self.adapter = adapter

    input_key = "pixel_values"

    def num_items(self, inputs) -> int:
        return int(inputs["image_sizes"].shape[0])

    def _check(self, inputs) -> None:
        n, pv = self.num_items(inputs), inputs["pixel_values"]
        if pv.dim() != 5 or pv.shape[0] != n:
            raise ValueError(f"{self.adapter.name}: pixel_values {tuple(pv.shape)} do not match image_sizes of {n} "
                             "images; pass the image processor's output ([images, tiles, C, H, W] and [images, 2])")

    def tiled(self, inputs) -> list[bool]:
        """Per item: whether it is cut into tiles (OneVision tiles the images of single-image samples only)."""
        n = self.num_items(inputs)
        if TILED in inputs:
            return [bool(t) for t in inputs[TILED].tolist()]
        if not self.adapter.per_sample_tiling or inputs.get(BATCH_NUM_IMAGES) is None:
            return [True] * n
        counts = [int(c) for c in torch.as_tensor(inputs[BATCH_NUM_IMAGES]).reshape(-1).tolist()]
        if sum(counts) != n:
            raise ValueError(f"{self.adapter.name}: batch_num_images {counts} add up to {sum(counts)} images but "
                             f"image_sizes holds {n}")
        return [c == 1 for c in counts for _ in range(c)]

    def tiles(self, inputs) -> list[int]:
        """Tiles of each item the tower runs on (the base image included), as HF's ``get_image_features``."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        cfg = self.config
        return [image_size_to_num_patches(size, cfg.image_grid_pinpoints, cfg.vision_config.image_size) if tiled
                else 1 for size, tiled in zip(inputs["image_sizes"].tolist(), self.tiled(inputs))]

    def tile_tokens(self) -> int:
        """Tokens one tile leaves the tower with (the class token dropped by the "default" strategy)."""
        size = self.config.vision_config.image_size
        probe = {"pixel_values": torch.empty(1, self.config.vision_config.num_channels, size, size, device="meta")}
        return self.base.num_tokens(self.config.vision_config, probe)[0] - int(self.drop_first)

    def encoder_positions(self, config, inputs) -> list[int]:
        """Positions the tower's layers see per item: its tiles (the base image included) times a tile's positions
        (the class token included). The packing after the projector unpads the tile grid and adds newlines, so the
        emitted tokens do not tell them."""
        self._check(inputs)
        per = self.base.num_tokens(self.config.vision_config, _probe(inputs["pixel_values"]))[0]
        return [t * per for t in self.tiles(inputs)]

    def num_tokens(self, config, inputs) -> list[int]:
        self._check(inputs)
        tiles, per = self.tiles(inputs), self.tile_tokens()
        zeros = [torch.zeros(t, per, 1) for t in tiles]
        packed = self.adapter.pack(self.config, zeros, inputs["image_sizes"], torch.zeros(1))
        return [int(p.shape[0]) for p in packed]

    def context(self, enc, inputs) -> dict:
        return {"tiles": self.tiles(inputs), "image_sizes": inputs["image_sizes"]}

    def embed(self, enc, inputs):
        self._check(inputs)
        ctx = self.context(enc, inputs)
        pv = inputs["pixel_values"]
        real = torch.cat([pv[i, :t] for i, t in enumerate(ctx["tiles"])])
        hidden, base_ctx = self.base.embed(enc, {"pixel_values": real})
        return hidden, {**base_ctx, **ctx}

    def final(self, enc, hidden, ctx) -> torch.Tensor:
        hidden = self._select(hidden)
        return hidden.reshape(-1, hidden.shape[-1])

    def project(self, projector, feats, ctx) -> torch.Tensor:
        """The projector, then HF's ``pack_image_features`` with the projector's ``image_newline``."""
        feats = projector(feats)
        tiles = ctx["tiles"]
        per_tile = feats.view(sum(tiles), -1, feats.shape[-1]).split(tiles)
        packed = self.adapter.pack(self.config, per_tile, ctx["image_sizes"], getattr(projector, NEWLINE))
        return torch.cat(packed)

    def random_inputs(self, config, num_items, generator=None, **_):
        """Random images of random sizes (a half to three tile sides a side), as the processor lays them out."""
        vc = self.config.vision_config
        side = vc.image_size
        sizes = torch.randint(side // 2, 3 * side + 1, (num_items, 2), generator=generator)
        tiles = self.tiles({"image_sizes": sizes})
        return {"pixel_values": torch.randn(num_items, max(tiles), vc.num_channels, side, side, generator=generator),
                "image_sizes": sizes}

    def select_items(self, inputs, items):
        tiled = torch.tensor(self.tiled(inputs), dtype=torch.long, device=items.device)
        out = {k: v for k, v in inputs.items() if k != BATCH_NUM_IMAGES}
        out.update(pixel_values=inputs["pixel_values"][items], image_sizes=inputs["image_sizes"][items])
        out[TILED] = tiled[items]
        return out


@dataclass(frozen=True)
class AnyResAdapter:
    """A LLaVA-NeXT-like composite: its HF model class (for ``pack_image_features``) and tiling rule."""

    name: str
    hf_module: str
    model_class: str
    per_sample_tiling: bool = False  # OneVision: only images of single-image samples are tiled
    extra_prefixes: tuple = (("model.image_newline", "projector." + NEWLINE),)

    def _model_class(self):
        import importlib

        return getattr(importlib.import_module(self.hf_module), self.model_class)

    def pack(self, config, features, image_sizes, newline) -> list[torch.Tensor]:
        holder = SimpleNamespace(config=config)
        fn = self._model_class().pack_image_features
        if self.per_sample_tiling:
            packed, _ = fn(holder, features, image_sizes, image_newline=newline,
                           vision_aspect_ratio=config.vision_aspect_ratio)
        else:
            packed, _ = fn(holder, features, image_sizes, config.vision_feature_select_strategy,
                           image_newline=newline)
        return packed

    def build_projector(self, projector: nn.Module, config) -> nn.Module:
        """HF's projector with the composite's ``image_newline`` as one more parameter (saved back under its
        composite name ``model.image_newline``)."""
        projector.register_parameter(NEWLINE, nn.Parameter(torch.empty(config.text_config.hidden_size)))
        return projector

    def family(self, base, config, drop_first: bool):
        return AnyResFamily(base, config, drop_first, self)


class OneVisionVideoFamily(TowerView):
    """LLaVA-OneVision's videos through the image tower: ``pixel_values_videos [videos, frames, C, H, W]`` (the
    video processor's output), every frame through the tower as one image (feature layer, no final norm, the class
    token dropped by the "default" strategy), the projector, HF's ``apply_pooling`` (each frame's grid halved,
    bilinear), the frames in order and one ``image_newline`` after each video, as HF's ``get_video_features``."""

    input_key = "pixel_values_videos"

    def num_items(self, inputs) -> int:
        return int(inputs["pixel_values_videos"].shape[0])

    def _frames(self, inputs) -> int:
        pv = inputs["pixel_values_videos"]
        if pv.dim() != 5:
            raise ValueError(f"{self.config.model_type}: pixel_values_videos {tuple(pv.shape)} is not [videos, frames, "
                             "C, H, W]; pass the video processor's output")
        return int(pv.shape[1])

    def pooled_tokens(self) -> int:
        side = self.config.vision_config.image_size // self.config.vision_config.patch_size
        return math.ceil(side / 2) ** 2

    def num_tokens(self, config, inputs) -> list[int]:
        return [self._frames(inputs) * self.pooled_tokens() + 1] * self.num_items(inputs)

    def encoder_positions(self, config, inputs) -> list[int]:
        """Positions the tower's layers see per video: its frames times a frame's positions."""
        per = self.base.num_tokens(self.config.vision_config, _probe(inputs["pixel_values_videos"]))[0]
        return [self._frames(inputs) * per] * self.num_items(inputs)

    def embed(self, enc, inputs):
        frames = self._frames(inputs)
        hidden, ctx = self.base.embed(enc, {"pixel_values": inputs["pixel_values_videos"].flatten(0, 1)})
        return hidden, {**ctx, "frames": frames}

    def final(self, enc, hidden, ctx) -> torch.Tensor:
        hidden = self._select(hidden)
        return hidden.reshape(-1, hidden.shape[-1])

    def random_inputs(self, config, num_items, generator=None, frames: int = 2, **_) -> dict:
        """Random videos of ``frames`` frames of the tower's size."""
        vc = self.config.vision_config
        return {"pixel_values_videos": torch.randn(num_items, frames, vc.num_channels, vc.image_size, vc.image_size,
                                                   generator=generator)}

    def project(self, projector, feats, ctx) -> torch.Tensor:
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        side = self.config.vision_config.image_size // self.config.vision_config.patch_size
        projected = projector(feats)
        projected = projected.view(-1, side * side, projected.shape[-1])
        pooled = LlavaOnevisionModel.apply_pooling(SimpleNamespace(config=self.config), projected)
        videos = pooled.reshape(-1, ctx["frames"] * pooled.shape[1], pooled.shape[-1])
        newline = getattr(projector, NEWLINE).to(videos.dtype)[None, None, :].expand(videos.shape[0], 1, -1)
        return torch.cat([videos, newline], dim=1).flatten(0, 1)


# ---------------------------------------------------------------------------------------------- InternVL
class InternVLTilesFamily(TowerView):
    """InternVL: every tile through the tower (its final norm only for ``vision_feature_layer=-1``, as HF takes
    ``last_hidden_state`` then), the class token dropped ("default"), HF's ``pixel_shuffle`` by
    ``downsample_ratio``; then the projector. ``num_patches`` gives the tiles of each image."""

    input_key = "pixel_values"

    def tile_count(self, inputs) -> list[int]:
        tiles = inputs["pixel_values"].shape[0]
        if inputs.get("num_patches") is None:
            return [1] * tiles
        counts = [int(c) for c in torch.as_tensor(inputs["num_patches"]).reshape(-1).tolist()]
        if sum(counts) != tiles:
            raise ValueError(f"InternVL: num_patches {counts} add up to {sum(counts)} tiles but pixel_values holds "
                             f"{tiles}; pass the image processor's output for the sample's images")
        return counts

    def num_items(self, inputs) -> int:
        return len(self.tile_count(inputs))

    @property
    def positions_per_token(self) -> int:
        """Tower positions the pixel shuffle folds into one LLM token (``1/downsample_ratio``^2; the encoder's cost
        per emitted token, ``lightning_mm.data.metadata.encoder_input_tokens``)."""
        return int(1 / self.config.downsample_ratio) ** 2

    def output_dim(self, enc) -> int:
        """The width ``final`` gives the projector: the pixel shuffle folds ``positions_per_token`` positions."""
        return self.base.output_dim(enc) * self.positions_per_token

    def tile_tokens(self) -> int:
        vc = self.config.vision_config
        size = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
        patch = vc.patch_size[0] if isinstance(vc.patch_size, (list, tuple)) else vc.patch_size
        side = size // patch
        return int(side * self.config.downsample_ratio) ** 2

    def num_tokens(self, config, inputs) -> list[int]:
        per = self.tile_tokens()
        return [n * per for n in self.tile_count(inputs)]

    def encoder_positions(self, config, inputs) -> list[int]:
        """Positions the tower's layers see per image: its tiles times a tile's positions (the class token
        included; the pixel shuffle then folds ``positions_per_token`` of the others into one token)."""
        per = self.base.num_tokens(self.config.vision_config, _probe(inputs["pixel_values"]))[0]
        return [n * per for n in self.tile_count(inputs)]

    def final(self, enc, hidden, ctx) -> torch.Tensor:
        from transformers.models.internvl.modeling_internvl import InternVLModel

        if self.config.vision_feature_layer == -1:
            hidden = enc.layernorm(hidden)
        if self.config.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        side = int(math.isqrt(hidden.shape[1]))
        grid = hidden.reshape(hidden.shape[0], side, side, -1)
        # pixel_shuffle reads nothing of its model
        shuffled = InternVLModel.pixel_shuffle(None, grid, scale_factor=self.config.downsample_ratio)
        return shuffled.reshape(-1, shuffled.shape[-1])

    def random_inputs(self, config, num_items, generator=None, **_):
        """Random images of one to three tiles each."""
        vc = self.config.vision_config
        size = vc.image_size if isinstance(vc.image_size, (list, tuple)) else (vc.image_size, vc.image_size)
        counts = torch.randint(1, 4, (num_items,), generator=generator)
        return {"pixel_values": torch.randn(int(counts.sum()), vc.num_channels, *size, generator=generator),
                "num_patches": counts}

    def select_items(self, inputs, items):
        counts = torch.tensor(self.tile_count(inputs), dtype=torch.long)
        starts = torch.cumsum(counts, 0) - counts
        rows = [torch.arange(int(starts[i]), int(starts[i] + counts[i])) for i in items.tolist()]
        rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        out = dict(inputs)
        out.update(pixel_values=inputs["pixel_values"][rows.to(inputs["pixel_values"].device)],
                   num_patches=counts[items.cpu()].to(items.device))
        return out


@dataclass(frozen=True)
class ViewAdapter:
    """A composite whose projector is HF's own module and whose tower is read through ``view`` (a ``TowerView``
    class; the class token is kept: InternVL drops it in its view, Gemma 3's SigLIP has none)."""

    name: str
    view: type
    extra_prefixes: tuple = ()

    def build_projector(self, projector: nn.Module, config) -> nn.Module:
        return projector

    def family(self, base, config, drop_first: bool):
        return self.view(base, config, drop_first=False)


# ---------------------------------------------------------------------------------------------- media headers
ANYRES_IMAGE_PROCESSORS = ("LlavaNextImageProcessor", "LlavaOnevisionImageProcessor")
TILING_IMAGE_PROCESSORS = ("GotOcr2ImageProcessor",)


def _get(size, key):
    return None if size is None else (size.get(key) if isinstance(size, dict) else getattr(size, key, None))


TILING_CALL_KEYS = {"crop_to_patches", "min_patches", "max_patches"}


def header_inputs(name: str, proc, sizes: list[tuple[int, int]], kwargs: dict | None = None) -> dict | None:
    """What a tiling image processor (class ``name``, backend suffix dropped) returns for images of ``sizes``
    ((width, height) each, as the headers give them), pixel tensors on the meta device; None when it is not one.

    AnyRes: every image's tile count is HF's ``image_size_to_num_patches`` (the best of ``image_grid_pinpoints``
    cut into tiles of the crop size, plus the base image), ``image_sizes`` the original (height, width) and, as the
    processor gives it for a flat list of images, ``batch_num_images`` one per image. InternVL's
    ``GotOcr2ImageProcessor``: the processor's own ``get_number_of_image_patches`` (with the call's
    ``crop_to_patches`` / ``min_patches`` / ``max_patches``). Other call arguments: None."""
    kwargs = {k: v for k, v in (kwargs or {}).items() if k != "return_tensors"}
    if name in ANYRES_IMAGE_PROCESSORS and not kwargs:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        size, crop = getattr(proc, "size", None), getattr(proc, "crop_size", None)
        tile = _get(crop, "height") or _get(size, "height") or _get(size, "shortest_edge")
        if getattr(proc, "do_center_crop", False) and _get(crop, "height"):
            side = (_get(crop, "height"), _get(crop, "width"))
        elif _get(size, "height") and _get(size, "width"):
            side = (_get(size, "height"), _get(size, "width"))
        else:
            side = (_get(size, "shortest_edge"),) * 2
        if not tile or None in side:
            return None
        hw = [(h, w) for w, h in sizes]
        tiles = max(image_size_to_num_patches(s, [list(p) for p in proc.image_grid_pinpoints], tile) for s in hw)
        out = {"pixel_values": torch.empty(len(hw), tiles, 3, *side, device="meta"),
               "image_sizes": torch.tensor(hw, dtype=torch.long)}
        if name == "LlavaOnevisionImageProcessor":
            out[BATCH_NUM_IMAGES] = torch.ones(len(hw), dtype=torch.long)
        return out
    if name in TILING_IMAGE_PROCESSORS and not set(kwargs) - TILING_CALL_KEYS:
        size = getattr(proc, "size", None)
        if not (_get(size, "height") and _get(size, "width")):
            return None
        counts = [proc.get_number_of_image_patches(h, w, kwargs) for w, h in sizes]
        return {"pixel_values": torch.empty(sum(counts), 3, _get(size, "height"), _get(size, "width"), device="meta"),
                "num_patches": torch.tensor(counts, dtype=torch.long)}
    return None


LLAVA_NEXT = AnyResAdapter("LLaVA-NeXT", "transformers.models.llava_next.modeling_llava_next", "LlavaNextModel")
LLAVA_ONEVISION = AnyResAdapter("LLaVA-OneVision", "transformers.models.llava_onevision.modeling_llava_onevision",
                                "LlavaOnevisionModel", per_sample_tiling=True)
INTERNVL = ViewAdapter("InternVL", InternVLTilesFamily)

__all__ = ["AnyResAdapter", "AnyResFamily", "ViewAdapter", "InternVLTilesFamily", "LLAVA_NEXT",
           "LLAVA_ONEVISION", "INTERNVL", "TILED", "header_inputs"]
