"""Generation with a KV cache: the encoders run once, their features are merged into the prompt's embeddings,
then the language model's own transformers ``generate`` decodes (every logits processor, stopping criterion,
sampling and beam option of transformers applies).

The prompt attends under its bitfield words (modality tokens bidirectional among themselves by default, as in
training); every generated token is text and attends every earlier non-padding token. The words reach the
attention layers through :func:`lightning_mm.attention.hf.generation_words` for the duration of the call, so the
language model's config is never switched.

Positions: 1-D ones count each row's real tokens, as transformers does. A model with its own positions
(``position_ids_fn``: the M-RoPE of the Qwen2-VL family) gives the language model the prompt's ``[B, S, 3]``
positions (``prompt_positions``, taken by its ``prepare_inputs_for_generation``), and each generated token the
next ones (:func:`next_positions`), as HF's composites decode. Qwen3-VL's DeepStack features of the prompt go to
its text model at prefill (``prompt_deepstack``: :func:`deepstack_prompt`).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from lightning_mm.attention import mask as masks
from lightning_mm.attention.hf import check_honours_mask, generation_words
from lightning_mm.model.linear_attention import has_linear_attention

# batch keys that only matter for training (or cutting microbatches)
_DROPPED = ("labels", "item_counts", "num_label_tokens")


def left_align(*rows: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Move every row's padding to its left (stable: the real tokens keep their order), as batched decoding
    needs; ``rows`` are ``[B, S, ...]`` tensors indexed like ``attention_mask``. Returns them and the mask."""
    order = torch.argsort(attention_mask.ne(0).to(torch.int8), dim=1, stable=True)
    at = lambda r: order.view(*order.shape, *[1] * (r.dim() - 2)).expand_as(r)  # noqa: E731
    return (*(r.gather(1, at(r)) for r in rows), attention_mask.gather(1, order))


def prompt_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, modality_inputs: dict,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """An M-RoPE model's (``position_ids_fn``) positions of a prompt, moved with :func:`left_align`:
    ``[B, S, 3]``, padding 0. The given ``position_ids`` (``[B, S, 3]``, or ``[B, S]`` on every axis), else the
    model's own from the tokens and grids."""
    if position_ids is None:
        position_ids = model.position_ids_fn(input_ids, modality_inputs, attention_mask)
    if position_ids.dim() == 2:
        position_ids = position_ids.unsqueeze(-1).expand(-1, -1, 3)
    positions, aligned = left_align(position_ids, attention_mask=attention_mask)
    return positions * aligned.ne(0).unsqueeze(-1)


def next_positions(positions: torch.Tensor) -> torch.Tensor:
    """The position of each row's first generated token after a left-aligned prompt at ``positions`` (``[B, S]``
    -> ``[B]``, ``[B, S, 3]`` -> ``[B, 3]``); generated token ``t`` is at it + ``t``. It is the prompt's last
    position + 1 on every axis, as transformers' generate continues positions (HF's Qwen2-VL / Qwen2.5-VL
    composites included): after a prompt ending in text, ``max(prompt positions) + 1`` on all three axes (their
    ``rope_deltas``)."""
    return positions[:, -1] + 1


def positions_after(prompt: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Positions of tokens ``start .. start + length - 1`` of a sequence that begins with a left-aligned prompt at
    ``prompt`` (``[B, S, ...]``) and goes on with generated tokens (token ``S + t`` is generated token ``t``)."""
    extra = max(0, start + length - prompt.shape[1])
    steps = torch.arange(extra, device=prompt.device).view(1, -1, *[1] * (prompt.dim() - 2))
    return torch.cat([prompt, next_positions(prompt).unsqueeze(1) + steps], 1)[:, start:start + length]


def unpack_prompts(segment_ids: torch.Tensor, attention_mask: torch.Tensor, **rows: torch.Tensor | None) -> dict:
    """One prompt per packed sample: each row's runs of one segment id (over its non-padding tokens) become rows of
    their own, in order (row by row, then along the row), right-padded with 0; so media placeholders keep their order
    and the encoders' items still match them. ``rows`` are ``[R, L]`` (or ``[R, L, ...]``) tensors or None; returns
    them unpacked and ``attention_mask``."""
    real = attention_mask.ne(0)
    spans = []  # (row, start, end) of each sample
    for r in range(segment_ids.shape[0]):
        at = torch.nonzero(real[r]).flatten().tolist()
        seg = segment_ids[r].tolist()
        for i, j in enumerate(at):
            if i == 0 or seg[j] != seg[at[i - 1]] or j != at[i - 1] + 1:
                spans.append([r, j, j + 1])
            else:
                spans[-1][2] = j + 1
    width = max((e - s for _, s, e in spans), default=0)
    out = {}
    for name, t in {**rows, "attention_mask": attention_mask}.items():
        if t is None:
            out[name] = None
            continue
        new = t.new_zeros(len(spans), width, *t.shape[2:])
        for k, (r, s, e) in enumerate(spans):
            new[k, :e - s] = t[r, s:e] if name != "attention_mask" else 1
        out[name] = new
    return out


def is_packed(segment_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> bool:
    """Whether some row holds tokens of more than one segment (padding excluded)."""
    if segment_ids is None:
        return False
    seg = segment_ids if attention_mask is None else segment_ids.masked_fill(attention_mask.eq(0), -1)
    first = seg.gather(1, seg.ne(-1).long().argmax(1, keepdim=True))
    return bool((seg.ne(first) & seg.ne(-1)).any())


def deepstack_prompt(model, input_ids: torch.Tensor, stacks: dict[str, torch.Tensor]) -> tuple | None:
    """HF's ``(visual_pos_masks, deepstack_visual_embeds)`` of a prompt (Qwen3-VL's text model adds them after its
    first layers at prefill): every DeepStack modality's tokens, and per layer their features in row-major order."""
    if not stacks:
        return None
    where = {n: input_ids == model.placeholder_ids[n] for n in stacks}
    union = torch.stack(list(where.values())).any(0)
    slot = union.flatten().long().cumsum(0).view_as(union) - 1
    first = next(iter(stacks.values()))
    joint = first.new_zeros(int(union.sum()), *first.shape[1:])
    for n, feats in stacks.items():
        joint[slot[where[n]]] = feats
    return union, list(joint.unbind(1))


def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             bam: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
             segment_ids: torch.Tensor | None = None, **kwargs):
    """``MultimodalModel.generate``: see its docstring."""
    from transformers import DynamicCache

    modality_inputs = {k: kwargs.pop(k) for k in list(kwargs) if k in model.encoders}
    for k in _DROPPED:
        kwargs.pop(k, None)
    if is_packed(segment_ids, attention_mask):  # one prompt per packed sample; its positions restart at 0
        if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 3:
            position_ids = None  # the packer's per-sample M-RoPE positions: the model computes the same per row
        mask = attention_mask if attention_mask is not None else (bam.ne(0).long() if bam is not None
                                                                  else torch.ones_like(input_ids))
        rows = unpack_prompts(segment_ids, mask, input_ids=input_ids, bam=bam, position_ids=position_ids)
        input_ids, bam, position_ids, attention_mask = (rows[k] for k in ("input_ids", "bam", "position_ids",
                                                                          "attention_mask"))
    if "past_key_values" in kwargs:  # the name transformers 5 deprecates for generate's ``cache``
        kwargs["cache"] = kwargs.pop("past_key_values")
    cache = kwargs.get("cache")
    if kwargs.get("cache_implementation") is not None or (cache is not None and type(cache) is not DynamicCache):
        raise ValueError("MultimodalModel.generate keeps the KV cache itself (a full transformers DynamicCache, "
                         "which bitfield attention indexes by token position); drop cache_implementation / "
                         "cache")
    lm = model.language_model
    mrope = getattr(model, "position_ids_fn", None) is not None
    prepare = getattr(lm, "prepare_inputs_for_generation", None)
    if mrope and (prepare is None or "prompt_positions" not in inspect.signature(prepare).parameters):
        raise NotImplementedError(f"this model computes its own positions (position_ids_fn), which "
                                  f"{type(lm).__name__}.generate does not take (no prompt_positions)")
    check_honours_mask(lm)
    model.check_placeholders(input_ids, modality_inputs)
    if attention_mask is None:
        attention_mask = bam.ne(0).long() if bam is not None else torch.ones_like(input_ids)
    if bam is None:
        bam = model.build_bam(input_ids, attention_mask)
    masks.validate(bam)
    bam = bam * attention_mask.ne(0)  # padding has word 0, whatever the given words say
    if mrope:
        kwargs["prompt_positions"] = prompt_positions(model, input_ids, attention_mask, modality_inputs,
                                                      position_ids)
    input_ids, bam, aligned_mask = left_align(input_ids, bam, attention_mask=attention_mask)
    if position_ids is not None and not mrope:
        # transformers counts positions over each row's real tokens; a prompt given other positions would be
        # decoded under different ones, so say so rather than drop them
        given, _ = left_align(position_ids, attention_mask=attention_mask)
        expected = (aligned_mask.ne(0).long().cumsum(1) - 1).clamp(min=0)
        real = aligned_mask.ne(0)
        if not torch.equal(given[real], expected[real]):
            raise ValueError("generate counts positions 0, 1, ... over each row's non-padding tokens (as "
                             "transformers does); these position_ids differ: drop them")
    # a model with Gated DeltaNet layers keeps their convolution and recurrent states in the cache its config lays out
    kwargs.setdefault("cache", DynamicCache(config=lm.config) if has_linear_attention(lm) else DynamicCache())
    with torch.no_grad():
        features = {name: model.encoders[name](inputs) for name, inputs in modality_inputs.items()}
        embeds = model.embed(input_ids, features)
        if model.deepstack:
            kwargs["prompt_deepstack"] = deepstack_prompt(model, input_ids, model.split_features(features)[1])
    with generation_words(bam, masks.text_word(len(model.encoders))):
        return lm.generate(inputs_embeds=embeds, attention_mask=aligned_mask, **kwargs)


# ------------------------------------------------------------------ trainer.predict
def whole_model_on_rank(engine, model) -> bool:
    """Whether a pipeline engine's stage holds the whole model (every layer of every module, no context
    parallelism): ``devices=1``, or an LLM of one stage with ``encoder_placement="replicated"``."""
    from lightning_mm.plan.placement import LANGUAGE_MODEL

    def slices(plan):
        out = dict(plan.encoders)
        if plan.language_model is not None:
            out[LANGUAGE_MODEL] = plan.language_model
        return out

    full = {}  # layers per module, from every stage's plan (a pruned stage no longer holds the others' layers)
    for plan in engine.plans.values():
        for m, s in slices(plan).items():
            full[m] = max(full.get(m, 0), s.end)
    mine = slices(engine.plan)
    return (set(mine) == set(full) == {*model.encoders, LANGUAGE_MODEL} and engine.cp_size == 1
            and all(s.start == 0 and s.end == full[m] and s.embed and s.head for m, s in mine.items()))


def predict_generate(module, batch: dict, generation: dict) -> torch.Tensor:
    """``trainer.predict`` with ``MultimodalLightningModule(generation=...)``: the new token ids ``[B, N]``."""
    model, pipeline = module.model, module.pipeline
    context = contextlib.nullcontext()
    if pipeline is not None:
        if not whole_model_on_rank(pipeline.engine, model):
            raise RuntimeError(
                "trainer.predict with generation=... decodes token by token, which needs the whole model on every "
                "rank; this layout splits it into pipeline stages (or context-parallel ranks). Predict with "
                "devices=1, or with language_model=ParallelSpec(pp=1) and encoder_placement='replicated' "
                "(data parallel only), or drop generation= to get next-token logits from the pipeline")
        context = pipeline.precision_plugin.forward_context()
    with context:
        return model.generate(**{k: v for k, v in batch.items() if k not in _DROPPED}, **generation)
