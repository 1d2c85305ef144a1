"""``ContextParallel``: LPT context parallelism for an existing Lightning project, as a callback.

The project keeps its LightningModule (a HF model, ``training_step`` returning ``outputs.loss``), its optimiser,
logging and checkpoints, and Lightning's own ``DDPStrategy`` or ``ModelParallelStrategy`` (FSDP2). The callback

* on ``setup`` splits the data-parallel ranks into ``dp x cp``: consecutive ranks of the data-parallel group
  form a CP group (new process groups); Lightning's ``DistributedSampler`` gets ``num_replicas=dp`` and the
  replica index, so every rank of a CP group loads the same batch (checked every step);
* puts bitfield attention on the HF model (:func:`lightning_mm.attention.use_bitfield_attention`: words from
  the HF inputs, packed samples from ``segment_ids`` or ``position_ids`` restarts);
* during each training step, in the model call: derives the words of the whole (replica) batch, plans the
  token blocks with ``distribution`` (LPT by default) and keeps the labels, shifted on the whole sequence;
  the batch's images are split over the CP ranks by LPT on their work, each rank encodes its share (vision
  tower and projector) and the features are all-gathered (``shard_images``; LLaVA- and Qwen2-VL-style inputs
  with at least ``cp_size`` images, else every rank encodes every image); the embedding runs on the whole
  batch; the text decoder's inputs are cut to this rank's blocks (global positions kept) and its attention
  gathers keys and values over the CP group (``mode="allgather"``), or exchanges heads for the sequence with
  all-to-alls (``"ulysses"``; ``"hybrid"``: Ulysses inside groups of ``ulysses`` ranks, keys and values
  gathered across the groups);
* replaces ``outputs.loss`` by the loss of the unsharded batch: its value is HF's (mean over the batch's label
  tokens, or over ``num_items_in_batch`` when given) on every CP rank, and its gradient is ``cp`` times this
  rank's share, which DDP's / FSDP2's average over all ``dp x cp`` ranks turns into exactly the gradient of
  the run without CP. ``gather_logits=True`` also gives ``outputs.logits`` of the whole sequence (for a
  module computing its own cross-entropy), with the same gradient scaling.

Validation, test and prediction run unsharded (every CP rank computes the whole batch; the numbers are the
same). The per-rank attention work of each step's plan (Ulysses: its group's work shared by the group's ranks)
is logged as ``cp/work_imbalance`` (max over mean) and ``cp/work_rank`` (this rank's over mean), and kept in
``last_work``.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_mm.attention import mask as masks
from lightning_mm.attention.bitfield_hf import (BitfieldAdapter, UnsupportedModelError, bitfield_adapter,
                                                ADAPTER_ATTR, _is_hf_model)
from lightning_mm.loss import IGNORE_INDEX, shift_labels
from lightning_mm.parallel.context import METHODS, distribute, gather_sequence, token_index
from lightning_mm.parallel.meshes import hybrid_groups, new_groups
from lightning_mm.parallel.encoder_cp import gather_items
from lightning_mm.plan.items import encoder_width, gather_order, item_work, shard_items
from lightning_mm.plan.layout import CP_MODES, ParallelSpec


class _GatherLogits(torch.autograd.Function):
    """Every CP rank's logits put back in sequence order; backward keeps this rank's tokens' gradient, times
    ``scale`` (every CP rank computes the same loss from the gathered logits)."""

    @staticmethod
    def forward(ctx, local, plan, block_size, seq_len, group, index, scale):
        ctx.index, ctx.scale = index, scale
        return gather_sequence(local.detach(), plan, block_size, seq_len, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(1, ctx.index) * ctx.scale, None, None, None, None, None, None


def _find_hf_model(pl_module, attr: str | None):
    if attr is not None:
        model = pl_module
        for part in attr.split("."):
            model = getattr(model, part, None)
        if model is None or not _is_hf_model(model):
            raise UnsupportedModelError(f"ContextParallel(model_attr={attr!r}): {type(pl_module).__name__}.{attr} is "
                                        "not a transformers PreTrainedModel")
        return model
    found = [(n, m) for n, m in pl_module.named_modules() if _is_hf_model(m)]
    top = [(n, m) for n, m in found if not any(o and n.startswith(o + ".") for o, _ in found if o != n)]
    if not top:
        raise UnsupportedModelError(
            f"ContextParallel found no transformers model in {type(pl_module).__name__}: it replaces the attention of "
            "a HF model held by the LightningModule (e.g. self.model = LlavaForConditionalGeneration(config)). "
            "For a lightning_mm.MultimodalModel use MultimodalParallelStrategy(language_model=ParallelSpec(cp=...))")
    if len(top) > 1:
        names = [n for n, _ in top]
        raise UnsupportedModelError(f"ContextParallel found several HF models in {type(pl_module).__name__} "
                                    f"({names}); name the one the training step calls: "
                                    f"ContextParallel(..., model_attr={names[0]!r})")
    return top[0][1]


def _fingerprint(batch, device: torch.device | None = None) -> torch.Tensor:
    """A cheap summary of a batch (per tensor: sum, sum of index-weighted values, numel) where the batch is (or on
    ``device`` when it holds no tensor): the CP group's collectives take it as it is (NCCL has no CPU backend)."""
    values = []
    items = batch.items() if hasattr(batch, "items") else enumerate(batch if isinstance(batch, (list, tuple)) else [])
    for _, t in sorted(((str(k), v) for k, v in items), key=lambda kv: kv[0]):
        if isinstance(t, torch.Tensor) and t.numel():
            flat = t.detach().reshape(-1).to(torch.float64)
            w = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
            values += [flat.sum(), (flat * w).sum(), torch.tensor(float(flat.numel()), dtype=torch.float64,
                                                                   device=flat.device)]
    if not values:
        return torch.zeros(1, dtype=torch.float64, device=device)
    return torch.stack([v.to(values[0].device) for v in values])


class ContextParallel(pl.Callback):
    """Context parallelism over ``cp_size`` data-parallel ranks for a HF model in a plain LightningModule (see the
    module docstring).

    Args:
        cp_size: ranks per CP group; must divide the data-parallel size (DDP: the world; ModelParallelStrategy:
            ``data_parallel_size``). FSDP2 keeps sharding over the whole ``dp x cp`` group.
        distribution: ``"lpt"`` (balance the attention work of the mask, the default), ``"zigzag"``,
            ``"contiguous"`` or ``"random"``.
        block_size: tokens per block of the plan (shortened for a sequence with fewer than ``cp_size`` blocks).
        mode: ``"allgather"`` (keys and values all-gathered over the CP group, any head count), ``"ulysses"``
            (all-to-alls over the CP group: query heads, and key/value heads or their divisor, must split over
            ``cp_size``) or ``"hybrid"`` (Ulysses inside groups of ``ulysses`` ranks, all-gather across them).
        ulysses: the Ulysses degree of ``"hybrid"`` (a divisor of ``cp_size`` strictly between 1 and it).
        shard_images: split each training batch's images over the CP ranks (LPT on their encoder work), encode
            each share once and all-gather the features, instead of encoding every image on every CP rank.
            Served inputs: one ``pixel_values`` row per image (LLaVA) or patches with ``image_grid_thw``
            (Qwen2-VL); a batch with fewer images than ``cp_size`` is encoded whole on every rank.
        modality_attention: ``"causal"`` (the model's own attention: default) or ``"bidirectional"`` placeholder
            spans (see :func:`lightning_mm.attention.bitfield_hf.hf_words`).
        gather_logits: give ``outputs.logits`` of the whole sequence (the module computes its own loss from
            them); by default they are this rank's tokens only and ``outputs.loss`` is the loss to use.
        model_attr: the attribute path of the HF model in the LightningModule when it holds several.
        check_batches: verify each step that the ranks of a CP group got the same batch.
    """

    def __init__(self, cp_size: int, distribution: str = "lpt", block_size: int = 128, mode: str = "allgather", *,
                 ulysses: int | None = None, shard_images: bool = True, modality_attention: str = "causal",
                 gather_logits: bool = False, model_attr: str | None = None, check_batches: bool = True):
        if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
        if distribution not in METHODS:
            raise ValueError(f"distribution={distribution!r} is not a CP distribution; choose one of {METHODS}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int (tokens per block), got {block_size!r}")
        if mode not in CP_MODES:
            raise ValueError(f"mode={mode!r} is not a CP mode; choose one of {CP_MODES}")
        try:  # the mode and degree rules of ParallelSpec
            self.degree = ParallelSpec(cp=cp_size, cp_mode=mode, ulysses=ulysses).ulysses_degree
        except ValueError as e:
            raise ValueError(f"ContextParallel(cp_size={cp_size}, mode={mode!r}, ulysses={ulysses!r}): {e}") from None
        self.cp_size, self.distribution, self.block_size, self.mode = cp_size, distribution, block_size, mode
        self.modality_attention, self.gather_logits, self.shard_images = modality_attention, gather_logits, shard_images
        self.model_attr, self.check_batches = model_attr, check_batches
        self.windows = None  # the HF model's sliding window per layer, read when it is installed
        self.group = self.attention_group = None
        self.cp_rank, self.dp_rank, self.dp_size, self.tp_size = 0, 0, 1, 1
        self.last_work: list[float] = []
        self.last_image_shards: list[list[int]] | None = None  # images each CP rank encoded in the last step
        self._adapter: BitfieldAdapter | None = None
        self._original_class = None
        self._in_step = False
        self._strategy = None

    # ------------------------------------------------------------------ set-up
    def check_strategy(self, strategy) -> None:
        """Raise, naming the fix, unless ``strategy`` is one the callback serves."""
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

        name = type(strategy).__name__
        if "DeepSpeed" in name:
            raise ValueError(f"ContextParallel does not support {name}: DeepSpeed partitions the model and drives "
                             "the backward itself. Use Trainer(strategy='ddp') or ModelParallelStrategy "
                             "(FSDP2 via fully_shard in configure_model) with the callback")
        if not isinstance(strategy, (DDPStrategy, ModelParallelStrategy)):
            raise ValueError(f"ContextParallel does not support {name}; it needs Lightning's DDPStrategy "
                             "(Trainer(strategy='ddp', devices=N)) or ModelParallelStrategy (FSDP2 + TP: shard with "
                             "fully_shard over device_mesh['data_parallel']). For FSDPStrategy (FSDP1) switch to "
                             "ModelParallelStrategy")

    def _data_parallel_columns(self, strategy) -> list[list[int]]:
        """The global ranks of every data-parallel group (one per tensor-parallel coordinate)."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(strategy, ModelParallelStrategy):
            mesh = strategy.device_mesh
            grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # [data_parallel, tensor_parallel]
            return [grid[:, t].tolist() for t in range(grid.shape[1])]
        return [list(range(dist.get_world_size()))]

    def setup(self, trainer, pl_module, stage: str) -> None:
        strategy = trainer.strategy
        self.check_strategy(strategy)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ContextParallel needs torch.distributed initialised by the strategy")
        columns = self._data_parallel_columns(strategy)
        size = len(columns[0])
        if size % self.cp_size:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            raise ValueError(f"cp_size={self.cp_size} does not divide the {size} data-parallel ranks; choose cp_size "
                             f"among {divisors}, or run on a multiple of {self.cp_size} data-parallel devices")
        rank = dist.get_rank()
        members = [column[start:start + self.cp_size] for column in columns for start in range(0, size, self.cp_size)]
        self.group = new_groups(members, rank, desc="context parallel")  # every rank creates every group, in order
        hybrid = {}
        for ranks in members:
            if self.mode == "hybrid":
                hybrid.update(hybrid_groups(ranks, self.degree, rank))
            if rank in ranks:
                self.cp_rank, self.dp_rank = ranks.index(rank), members.index(ranks) % (size // self.cp_size)
        self.dp_size = size // self.cp_size
        self.tp_size = len(columns)
        self.attention_group = self._attention_group(hybrid)
        self._override_sampler(strategy)
        try:
            self._install(pl_module)
        except UnsupportedModelError:
            if not _has_configure_model(pl_module):
                raise  # no model can appear later; else on_fit_start tries again after configure_model

    def _attention_group(self, hybrid: dict):
        """What the attention takes as ``cp_group``: the CP group (allgather), else a ``ContextParallelGroups``."""
        from lightning_mm.attention.ulysses import ContextParallelGroups

        if self.mode == "allgather" or self.group is None:
            return self.group
        if self.mode == "ulysses":
            return ContextParallelGroups("ulysses", self.group, ulysses=self.group)
        return ContextParallelGroups("hybrid", self.group, ulysses=hybrid["ulysses"], gather=hybrid["gather"])

    def check_heads(self, model) -> None:
        """Raise, naming the fix, when Ulysses cannot split ``model``'s text heads over ``degree`` ranks (with
        tensor parallelism the heads per rank depend on the project's plan: the attention checks them then)."""
        if self.degree == 1 or self.tp_size > 1:
            return
        from lightning_mm.attention.ulysses import check_ulysses_heads

        cfg = getattr(model.config, "text_config", None) or model.config
        heads = cfg.num_attention_heads
        check_ulysses_heads(heads, getattr(cfg, "num_key_value_heads", None) or heads, self.degree,
                            f"ContextParallel(cp_size={self.cp_size}, mode={self.mode!r}) on {type(model).__name__}")

    def _override_sampler(self, strategy) -> None:
        if self._original_class is not None:
            return
        cls, dp, rank = type(strategy), self.dp_size, self.dp_rank
        sub = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__doc__": cls.__doc__,
            "distributed_sampler_kwargs": property(lambda self: {"num_replicas": dp, "rank": rank})})
        self._original_class, self._strategy = cls, strategy
        strategy.__class__ = sub

    def _install(self, pl_module) -> None:
        if self._adapter is not None:
            return
        model = _find_hf_model(pl_module, self.model_attr)
        self.check_heads(model)
        from lightning_mm.model.families import layer_windows

        windows = layer_windows(model)  # LPT balances the work the windowed layers really do
        self.windows = tuple(windows) if any(w is not None for w in windows) else None
        adapter = bitfield_adapter(model)
        if adapter is None:
            adapter = BitfieldAdapter(model, self.modality_attention)
            model.__dict__[ADAPTER_ATTR] = adapter
        adapter.extension = self
        self._adapter = adapter

    def on_fit_start(self, trainer, pl_module) -> None:
        self._install(pl_module)  # a model built in configure_model exists now
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info(f"ContextParallel: each sequence is split over cp_size={self.cp_size} ranks "
                       f"(mode={self.mode!r}), {self.dp_size} data-parallel groups of them")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._original_class is not None and self._strategy is not None:
            self._strategy.__class__ = self._original_class
            self._original_class = self._strategy = None
        if self._adapter is not None:
            self._adapter.extension = None
            self._adapter = None

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._adapter is None:
            self._install(pl_module)
        if self.group is not None and self.check_batches:
            mine = _fingerprint(batch, getattr(pl_module, "device", None))
            shape = torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device)
            shapes = [torch.zeros_like(shape) for _ in range(self.cp_size)]
            dist.all_gather(shapes, shape, group=self.group)
            same = len({int(s) for s in shapes}) == 1
            if same:
                parts = [torch.zeros_like(mine) for _ in range(self.cp_size)]
                dist.all_gather(parts, mine, group=self.group)
                same = all(torch.equal(p, parts[0]) for p in parts)
            if not same:
                raise RuntimeError(
                    "the ranks of a context-parallel group got different batches; each CP group must train on one "
                    "batch. Keep Trainer(use_distributed_sampler=True) (ContextParallel makes Lightning's "
                    "DistributedSampler give CP peers the same batch), or shard your own sampler with "
                    "num_replicas=callback.dp_size, rank=callback.dp_rank")
        self._in_step = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._in_step = False
        if self.last_work:
            mean = sum(self.last_work) / len(self.last_work)
            if mean > 0:
                pl_module.log("cp/work_imbalance", max(self.last_work) / mean, on_step=True, on_epoch=False,
                              batch_size=1)
                pl_module.log("cp/work_rank", self.last_work[self.cp_rank] / mean, on_step=True, on_epoch=False,
                              batch_size=1)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._in_step = False

    # ------------------------------------------------------------------ the model call (BitfieldAdapter extension)
    def active(self, module) -> bool:
        return self._in_step and self.group is not None and module.training

    def top(self, module, kwargs: dict, call: dict) -> dict:
        labels, shifted = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        count = kwargs.pop("num_items_in_batch", None)
        if labels is None and shifted is None and not self.gather_logits:
            raise ValueError("ContextParallel computes outputs.loss from the model call's labels, and the call has "
                             "none: pass labels=... to the model (HF convention: aligned with input_ids, -100 = no "
                             "loss), or use ContextParallel(gather_logits=True) when the module computes its own "
                             "loss from outputs.logits")
        self.last_image_shards = None
        if self.shard_images and self.group is not None and kwargs.get("mm_encoder_outputs") is None:
            images = self._encode_image_shards(module, kwargs)
            if images is not None:  # the model takes the features instead of the pixels
                kwargs["mm_encoder_outputs"] = {"image": images}
                kwargs.pop("pixel_values")
        bam, segs = call["bam"], call["segment_ids"]
        seq_len = bam.shape[1]
        block = min(self.block_size, math.ceil(seq_len / self.cp_size))
        if seq_len < self.cp_size:
            raise ValueError(f"a sequence of {seq_len} tokens cannot be split over cp_size={self.cp_size} ranks; "
                             "use longer rows (pack_multimodal max_length) or a smaller cp_size")
        segs = None if segs is None else segs.cpu()
        plan = distribute(bam.cpu(), self.cp_size, self.distribution, block, segs, ulysses=self.degree,
                          window=self.windows)
        work = masks.block_workload(bam.cpu(), block, segs, self.windows).sum(0)
        k = self.degree  # a Ulysses group's ranks share its blocks' work
        groups = [float(sum(work[p].sum() for p in plan[g:g + k])) / k for g in range(0, self.cp_size, k)]
        self.last_work = [groups[r // k] for r in range(self.cp_size)]
        index = token_index(plan[self.cp_rank], block, seq_len).to(bam.device)
        call.update(plan=plan, block=block, index=index, seq_len=seq_len)
        if labels is not None or shifted is not None:
            targets = shift_labels(labels) if shifted is None else shifted
            call["targets"] = targets.index_select(1, index)
            call["count"] = (targets != IGNORE_INDEX).sum() if count is None else count
        return kwargs

    def _encode_image_shards(self, module, kwargs: dict):
        """This rank's share of the call's images encoded by the model's own ``get_image_features`` and every
        rank's features all-gathered in image order (backward returns each image's gradient, summed over the CP
        ranks, to the rank that encoded it), as the model's precomputed ``mm_encoder_outputs["image"]``; None
        when the inputs are not served or there are fewer images than CP ranks (then every rank encodes all)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        inner, pixels = getattr(module, "model", None), kwargs.get("pixel_values")
        if pixels is None or not hasattr(inner, "get_image_features"):
            return None
        grid = kwargs.get("image_grid_thw")
        vision = getattr(module.config, "vision_config", None)
        if grid is not None:  # Qwen2-VL: every image's patches in one [P, D] tensor
            patches = grid.prod(-1).tolist()
            merge = getattr(vision, "spatial_merge_size", 1) ** 2
            tokens = [p // merge for p in patches]
            starts = [0]
            for p in patches:
                starts.append(starts[-1] + p)

            def encode(items):
                rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=pixels.device) for i in items])
                return inner.get_image_features(pixels.index_select(0, rows), grid[items], return_dict=True)
        elif kwargs.get("image_sizes") is None and pixels.dim() == 4:  # LLaVA: one row per image, one size
            patches = tokens = [1] * pixels.shape[0]  # every image alike; its token count comes from encoding

            def encode(items):
                return inner.get_image_features(
                    pixel_values=pixels[items], vision_feature_layer=kwargs.get("vision_feature_layer"),
                    vision_feature_select_strategy=kwargs.get("vision_feature_select_strategy"), return_dict=True)
        else:
            return None
        if len(patches) < self.cp_size:
            return None
        shards = shard_items(item_work(patches, encoder_width(vision)), self.cp_size)
        local = list(encode(shards[self.cp_rank]).pooler_output)
        if grid is None:
            tokens = [local[0].shape[0]] * len(tokens)
        counts = [sum(tokens[i] for i in shard) for shard in shards]
        order = torch.tensor(gather_order(shards, tokens), dtype=torch.long, device=local[0].device)
        whole = gather_items(torch.cat(local), counts, order, self.group)
        self.last_image_shards = shards
        return BaseModelOutputWithPooling(pooler_output=tuple(torch.split(whole, tokens)))

    def decoder(self, module, kwargs: dict, call: dict) -> dict:
        index, seq_len = call["index"], call["seq_len"]
        for key in ("input_ids", "inputs_embeds"):
            t = kwargs.get(key)
            if t is not None:
                if t.shape[1] != seq_len:
                    raise ValueError(f"the text decoder got {key} of {t.shape[1]} tokens but the model call had "
                                     f"{seq_len}; ContextParallel needs the placeholders expanded in input_ids "
                                     "(one token per image feature, as HF processors do)")
                kwargs[key] = t.index_select(1, index)
        rows = call["bam"].shape[0]
        local = index.expand(rows, -1)
        pos = kwargs.get("position_ids")
        kwargs["position_ids"] = local if pos is None else pos.index_select(pos.dim() - 1, index)
        kwargs["attention_mask"] = None  # the words carry the padding
        kwargs["use_cache"] = False
        for key in ("past_key_values", "cache"):
            kwargs.pop(key, None)
        segs = call["segment_ids"]
        kwargs.update(bam=call["bam"].index_select(1, index), token_index=local, cp_group=self.attention_group,
                      attn_cache={}, segment_ids=None if segs is None else segs.index_select(1, index))
        return kwargs

    def output(self, module, kwargs: dict, output, call: dict):
        if not hasattr(output, "keys") or getattr(output, "logits", None) is None:
            raise ValueError(f"{type(module).__name__} returned {type(output).__name__} without logits; "
                             "ContextParallel needs the HF output object (return_dict=True, the default)")
        logits = output.logits
        if "targets" in call:
            local = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                      call["targets"].reshape(-1).to(logits.device),
                                                      ignore_index=IGNORE_INDEX, reduction="sum")
            total = local.detach().clone()
            dist.all_reduce(total, group=self.group)
            scaled = local * self.cp_size  # DDP / FSDP2 average over dp x cp ranks: cp shares make one replica
            count = torch.clamp(torch.as_tensor(call["count"], device=local.device, dtype=local.dtype), min=1)
            output["loss"] = (scaled + (total - scaled).detach()) / count
        if self.gather_logits:
            output["logits"] = _GatherLogits.apply(logits, call["plan"], call["block"], call["seq_len"], self.group,
                                                   call["index"], float(self.cp_size))
        return output


def _has_configure_model(pl_module) -> bool:
    return type(pl_module).configure_model is not pl.LightningModule.configure_model


__all__ = ["ContextParallel"]
