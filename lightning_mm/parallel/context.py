"""Context parallelism (CP) planning and sharding: which token blocks each CP rank holds, and moving tensors.

A *plan* is a list with one ascending ``LongTensor`` of block indices per CP rank, together a partition of
the ``ceil(S / block_size)`` blocks of the sequence. Every sequence tensor of a microbatch (embeddings,
globally shifted labels, global positions, mask words, segment ids) is sharded by the same plan, so a rank
holds the tokens of its blocks in ascending order; ``token_index`` gives their global indices, which the
attention uses as positions so that the causal rule stays exact.

Distributions: ``"lpt"`` balances the block workload of ``masks.block_workload`` (the seeds' Algorithm 1),
``"zigzag"`` is the causal-LLM scheme (2*cp chunks, rank i gets chunks i and 2cp-1-i), ``"contiguous"``
cuts cp chunks, ``"random"`` deals a seeded permutation round-robin.
"""

from __future__ import annotations

import numpy as np
import torch

from lightning_mm.attention import mask as masks
from lightning_mm.loss import IGNORE_INDEX, shift_labels  # the one shift, done globally before sharding
from lightning_mm.attention.context_parallel import context_parallel_attention
from lightning_mm.data.microbatch import PLAN_KEY
from lightning_mm.plan.cp_comm import cp_communication_bytes  # pure: the planner times it too

METHODS = ("lpt", "random", "zigzag", "contiguous")

__all__ = ["METHODS", "IGNORE_INDEX", "distribute", "lpt_assign", "zigzag_plan", "contiguous_plan", "random_plan",
           "plan_workload", "validate_plan", "token_index", "shard", "unshard", "shift_labels", "shard_batch",
           "gather_sequence", "context_parallel_attention", "pad_for_context_parallel", "check_context_parallel",
           "cp_communication_bytes"]


# ----------------------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------------------

def _check_cp(num_blocks: int, cp_size: int, block_size: int | None = None) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if num_blocks < cp_size:
        size = "" if block_size is None else f" of {block_size} tokens"
        raise ValueError(f"sequence shorter than cp_size blocks: {num_blocks} block(s){size} cannot give each of "
                         f"the {cp_size} CP ranks one; use a longer sequence (pad it), a smaller block_size or a "
                         "smaller cp")


def _lpt_plan(work: np.ndarray, cp_size: int) -> list[torch.Tensor]:
    """``lpt_assign``'s plan for the column sums of int64 ``[B, n]`` block work (compiled:
    ``planning_loops.lpt_blocks``)."""
    from lightning_mm.plan.cp_loops import lpt_blocks

    n = work.shape[1]
    if (float(work.sum(dtype=np.float64)) * (n + 1) + n + 1) * cp_size >= 2.0 ** 62:  # with room for rounding
        raise ValueError(f"block work sums too large for LPT's int64 rank keys ({n} blocks, cp {cp_size}); "
                         "use a larger block_size")
    blocks, start = lpt_blocks(work, cp_size)
    return list(torch.from_numpy(blocks).split(np.diff(start).tolist()))


def lpt_assign(work: torch.Tensor, cp_size: int) -> list[torch.Tensor]:
    """Longest-processing-time-first: blocks by work descending (ties: lower block first), each to the least
    loaded rank (ties: the rank with fewer blocks, then the lower rank). Makespan <= sum/cp + max (Graham).

    The tie rule on block counts spreads zero-work blocks (padding) evenly, so every rank gets a block when
    there are at least ``cp_size`` of them. Compiled (``planning_loops.py``).
    """
    work = torch.as_tensor(work).reshape(-1).to(torch.int64).cpu().numpy()
    _check_cp(work.size, cp_size)
    if work.size and work.min() < 0:
        raise ValueError("block work must be non-negative")
    return _lpt_plan(work[None], cp_size)


def zigzag_plan(num_blocks: int, cp_size: int) -> list[torch.Tensor]:
    """2*cp chunks of consecutive blocks (sizes differ by at most one), rank i gets chunks i and 2cp-1-i."""
    _check_cp(num_blocks, cp_size)
    chunks = torch.tensor_split(torch.arange(num_blocks), 2 * cp_size)
    return [torch.cat([chunks[i], chunks[2 * cp_size - 1 - i]]) for i in range(cp_size)]


def contiguous_plan(num_blocks: int, cp_size: int) -> list[torch.Tensor]:
    """cp chunks of consecutive blocks (sizes differ by at most one), rank i gets chunk i."""
    _check_cp(num_blocks, cp_size)
    return list(torch.tensor_split(torch.arange(num_blocks), cp_size))


def random_plan(num_blocks: int, cp_size: int, seed: int = 0) -> list[torch.Tensor]:
    """A seeded random permutation of the blocks dealt round-robin (block counts differ by at most one)."""
    _check_cp(num_blocks, cp_size)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return [torch.sort(perm[r::cp_size]).values for r in range(cp_size)]


def distribute(bam: torch.Tensor, cp_size: int, method: str = "lpt", block_size: int = 128,
               segment_ids: torch.Tensor | None = None, seed: int = 0, ulysses: int = 1,
               window=None) -> list[torch.Tensor]:
    """Each CP rank's block indices (ascending; together a partition of all blocks) for one microbatch.

    ``bam`` is ``[B,S]`` (one plan for the microbatch: block work summed over its rows) or ``[S]``. Only
    ``"lpt"`` looks at the mask; ``seed`` drives ``"random"``. ``ulysses=K > 1`` (hybrid or Ulysses CP: ranks
    ``g*K .. g*K+K-1`` form Ulysses group ``g``): the blocks are distributed over the ``cp_size / K`` groups by
    ``method`` (a group's attention work is the work of all its blocks, whichever of its ranks holds them), then
    dealt round-robin to the group's ``K`` ranks, which balances their token counts. ``window``: the LLM's sliding
    window, or one entry per layer (``families.layer_windows``), for the work ``"lpt"`` balances
    (``masks.block_workload``); None counts every allowed pair.
    """
    if not isinstance(ulysses, int) or ulysses < 1 or (isinstance(cp_size, int) and cp_size % ulysses):
        raise ValueError(f"ulysses={ulysses!r} must be a positive divisor of cp_size={cp_size!r}")
    if ulysses > 1:
        return _grouped_plan(bam, cp_size, method, block_size, segment_ids, seed, ulysses, window)
    if method not in METHODS:
        raise ValueError(f"unknown CP distribution method {method!r}; choose one of {METHODS}")
    num_blocks = _num_blocks(bam, cp_size, block_size)
    if method == "lpt":
        bam2, seg2, _ = masks._as_batch(bam, segment_ids)
        if window is not None:
            return _lpt_plan(masks.block_workload(bam2, block_size, seg2, window).cpu().numpy(), cp_size)
        return _lpt_plan(masks._block_workload(bam2, seg2, block_size), cp_size)
    if method == "zigzag":
        return zigzag_plan(num_blocks, cp_size)
    if method == "contiguous":
        return contiguous_plan(num_blocks, cp_size)
    return random_plan(num_blocks, cp_size, seed)


def _num_blocks(bam, cp_size, block_size) -> int:
    """The sequence's block count, after checking the inputs every distribution takes."""
    if not isinstance(bam, torch.Tensor) or bam.dim() not in (1, 2):
        raise ValueError(f"bam must be a [S] or [B,S] int64 tensor, got {getattr(bam, 'shape', type(bam))}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    num_blocks = -(-bam.shape[-1] // block_size)
    _check_cp(num_blocks, cp_size, block_size)
    return num_blocks


def _grouped_plan(bam, cp_size, method, block_size, segment_ids, seed, k, window=None) -> list[torch.Tensor]:
    """``distribute`` with Ulysses groups of ``k`` ranks (see there)."""
    num_blocks = _num_blocks(bam, cp_size, block_size)
    groups = cp_size // k
    plan = distribute(bam, groups, method, block_size, segment_ids, seed, window=window) if groups > 1 \
        else [torch.arange(num_blocks)]
    counts = [len(p) for p in plan]
    if min(counts) < k:  # a short sequence: give each group k blocks, taking the lightest of the fullest group
        work = (masks.block_workload(bam, block_size, segment_ids, window).reshape(-1, num_blocks).sum(0)
                if method == "lpt" else torch.zeros(num_blocks, dtype=torch.int64))
        plan = [p.tolist() for p in plan]
        for g in range(groups):
            while len(plan[g]) < k:
                donor = max(range(groups), key=lambda h: (len(plan[h]), -h))
                block = min(plan[donor], key=lambda b: (int(work[b]), b))
                plan[donor].remove(block)
                plan[g].append(block)
        plan = [torch.tensor(sorted(p), dtype=torch.int64) for p in plan]
    return [p[j::k] for p in plan for j in range(k)]


def check_context_parallel(model, spec) -> None:
    """Raise, with the fix, when the language model cannot be split for ``spec``: Gated DeltaNet layers (Qwen3.5)
    whose value heads ``cp`` does not divide (they are split by heads), or heads that do not divide by the Ulysses
    degree (``cp_mode`` "ulysses" or
    "hybrid"): query heads per tensor-parallel rank must divide by it, and key/value
    heads per tensor-parallel rank must divide by it or divide it. Pure: runs before any process group."""
    from lightning_mm.attention.ulysses import check_ulysses_heads
    from lightning_mm.model.qwen3_5 import check_context_parallel_heads

    check_context_parallel_heads(model.language_model, spec.cp)
    degree = spec.ulysses_degree
    if degree == 1:
        return
    cfg = model.language_model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    check_ulysses_heads(heads // spec.tp, kv_heads // spec.tp, degree,
                        f"language_model with cp_mode={spec.cp_mode!r}, cp={spec.cp}, ulysses={degree}, tp={spec.tp}")


def plan_workload(plan: list[torch.Tensor], work: torch.Tensor) -> torch.Tensor:
    """Total block work of each rank ``[cp]`` (``work`` is ``[nb]`` or ``[B,nb]``, summed over rows)."""
    work = torch.as_tensor(work).reshape(-1, work.shape[-1]).sum(0)
    return torch.stack([work[p].sum() for p in plan])


def validate_plan(plan, num_blocks: int, cp_size: int) -> None:
    """Raise unless ``plan`` has one ascending integer tensor per rank that together partition the blocks."""
    if not isinstance(plan, (list, tuple)) or len(plan) != cp_size:
        got = len(plan) if isinstance(plan, (list, tuple)) else type(plan).__name__
        raise ValueError(f"a CP plan needs one block list per rank: expected {cp_size}, got {got}; "
                         "build it with lightning_mm.parallel.context.distribute")
    for r, p in enumerate(plan):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype.is_floating_point or p.dtype == torch.bool:
            raise ValueError(f"plan[{r}] must be a 1-D integer tensor of block indices, got "
                             f"{getattr(p, 'dtype', type(p))} {tuple(getattr(p, 'shape', ()))}")
        if p.numel() > 1 and not bool((p[1:] > p[:-1]).all()):
            raise ValueError(f"plan[{r}] must be strictly ascending (sort it; no repeated blocks)")
    flat = torch.cat([p.reshape(-1).to(torch.int64).cpu() for p in plan])
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_blocks):
        raise ValueError(f"the plan names blocks outside 0..{num_blocks - 1}; it was made for another sequence "
                         "length or block size")
    counts = torch.bincount(flat, minlength=num_blocks)
    if bool((counts != 1).any()):
        missing = torch.nonzero(counts == 0).flatten()[:5].tolist()
        twice = torch.nonzero(counts > 1).flatten()[:5].tolist()
        raise ValueError(f"the plan is not a partition of the {num_blocks} blocks: missing {missing}, held by "
                         f"several ranks {twice} (first five shown); every block must belong to exactly one rank")


def pad_for_context_parallel(mb: dict, cp_size: int, block_size: int) -> dict:
    """A microbatch whose LLM sequence is too short to give each of ``cp_size`` ranks a block of ``block_size``
    tokens (fewer than ``cp_size`` blocks), padded at the end to ``cp_size * block_size`` tokens; longer ones are
    returned as they are (the last block may be short). The padding is what the collator pads with: mask word 0
    (attends to nothing, seen by nothing), label ``IGNORE_INDEX``, ``attention_mask`` 0, token id 0; positions go on
    counting and segment ids repeat the last, which no allowed pair reads. The loss, its label count and every
    real token's output are unchanged. Every LLM rank of a replica pads the same microbatch alike.

    Raises only for what padding cannot fix: a ``cp_size`` or ``block_size`` below 1, or no ``[B,S]`` sequence."""
    if not isinstance(cp_size, int) or cp_size < 1 or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"context parallelism needs cp >= 1 and cp_block_size >= 1 tokens, got cp={cp_size!r}, "
                         f"cp_block_size={block_size!r}")
    ids = mb.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise ValueError("a context-parallel microbatch needs input_ids [B,S] (the LLM sequence to shard)")
    seq_len = ids.shape[1]
    if -(-seq_len // block_size) >= cp_size:
        return mb
    extra = cp_size * block_size - seq_len
    out = dict(mb)
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "bam": 0, "attention_mask": 0}
    for key in ("input_ids", "labels", "bam", "attention_mask", "segment_ids", "position_ids"):
        t = mb.get(key)
        if t is None:
            continue
        if key in fill:
            tail = torch.full((t.shape[0], extra), fill[key], dtype=t.dtype, device=t.device)
        elif key == "position_ids":  # [B, S] or [B, S, 3] (M-RoPE)
            step = torch.arange(1, extra + 1, dtype=t.dtype, device=t.device).view(1, -1, *[1] * (t.dim() - 2))
            tail = t[:, -1:] + step
        else:
            tail = t[:, -1:].expand(-1, extra)
        out[key] = torch.cat([t, tail], dim=1)
    return out


# ----------------------------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------------------------

def token_index(plan_rank: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """Global indices ``[S_local]`` of the tokens of one rank's blocks, ascending (the last block may be short)."""
    blocks = torch.as_tensor(plan_rank, dtype=torch.int64)
    if blocks.numel() and int(blocks.max()) * block_size >= seq_len:
        raise ValueError(f"block {int(blocks.max())} starts past the sequence end ({seq_len} tokens at block_size "
                         f"{block_size}); the plan was made for another sequence")
    idx = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).reshape(-1)
    return idx[idx < seq_len]


def shard(tensor: torch.Tensor, plan_rank: torch.Tensor, block_size: int, dim: int = 1) -> torch.Tensor:
    """The tokens of one rank's blocks along ``dim`` (ascending), for any sequence tensor."""
    idx = token_index(plan_rank, block_size, tensor.shape[dim]).to(tensor.device)
    return tensor.index_select(dim, idx)


def unshard(shards: list[torch.Tensor], plan: list[torch.Tensor], block_size: int, seq_len: int,
            dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard`` over all ranks: put every rank's tokens back at their global indices."""
    if len(shards) != len(plan):
        raise ValueError(f"{len(shards)} shards for a plan of {len(plan)} ranks")
    idx = torch.cat([token_index(p, block_size, seq_len) for p in plan]).to(shards[0].device)
    if idx.numel() != seq_len:
        raise ValueError(f"the plan covers {idx.numel()} tokens, not seq_len={seq_len}; it is not a partition")
    cat = torch.cat(list(shards), dim)
    if cat.shape[dim] != seq_len:
        raise ValueError(f"the shards hold {cat.shape[dim]} tokens along dim {dim}, the plan {seq_len}")
    out = torch.empty_like(cat)
    return out.index_copy_(dim, idx, cat)


def shard_batch(batch: dict, plan: list[torch.Tensor], rank: int, block_size: int = 128,
                seq_keys: tuple[str, ...] = ("input_ids", "inputs_embeds", "bam", "segment_ids", "position_ids",
                                             "attention_mask")) -> dict:
    """One CP rank's view of an LLM batch (a dict of ``[B,S,...]`` tensors).

    The listed sequence keys are sharded; ``labels`` become globally shifted ``shift_labels`` (then sharded,
    ``labels`` is dropped so nothing shifts twice); ``token_index`` ``[B,S_local]`` holds the global token
    indices; ``position_ids`` default to them (RoPE needs global positions). Other keys pass through.
    """
    seq_len = batch["bam"].shape[1]
    validate_plan(plan, -(-seq_len // block_size), len(plan))
    out = {k: v for k, v in batch.items() if k not in seq_keys and k != "labels"}
    for key in seq_keys:
        if batch.get(key) is not None:
            out[key] = shard(batch[key], plan[rank], block_size, 1)
    if batch.get("labels") is not None:
        out["shift_labels"] = shard(shift_labels(batch["labels"]), plan[rank], block_size, 1)
    idx = token_index(plan[rank], block_size, seq_len).to(batch["bam"].device)
    out["token_index"] = idx.expand(batch["bam"].shape[0], -1)
    if out.get("position_ids") is None:
        out["position_ids"] = out["token_index"]
    return out


def gather_sequence(local: torch.Tensor, plan: list[torch.Tensor], block_size: int, seq_len: int, group=None,
                    dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard of a sequence tensor and unshard it (no autograd), on every rank."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world != len(plan):
        raise ValueError(f"the CP group has {world} ranks but the plan {len(plan)}")
    sizes = [token_index(p, block_size, seq_len).numel() for p in plan]
    padded = torch.nn.functional.pad(local.movedim(dim, -1), (0, max(sizes) - local.shape[dim])).movedim(-1, dim)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return unshard([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], plan, block_size, seq_len, dim)


class BlockOwners:
    """What LLM CP plans with, in the data loader (``data/cp_plans.py``) and in the step alike: ``owner(mb)`` is the
    CP rank of every block of the microbatch, padded to whole blocks first exactly as the step pads it, by
    ``distribute`` with this method, block size and Ulysses degree. Picklable (loader workers). ``windows``: the
    LLM's sliding window per layer (``families.layer_windows``; None when no layer has one), so LPT balances the
    work each layer really does; every stage passes all layers' windows, so every stage plans alike."""

    def __init__(self, cp: int, method: str = "lpt", block_size: int = 128, ulysses: int = 1,
                 windows: tuple | None = None):
        self.cp, self.method, self.block_size, self.ulysses = cp, method, block_size, ulysses
        self.windows = windows

    def num_blocks(self, seq_len: int) -> int:
        """Blocks of a sequence of ``seq_len`` tokens after ``pad_for_context_parallel``."""
        return max(-(-seq_len // self.block_size), self.cp)

    def owner(self, mb: dict) -> torch.Tensor:
        """``[num_blocks]`` int64 on the host (reads ``bam`` and ``segment_ids``: a host read where they are on a
        device)."""
        mb = pad_for_context_parallel(mb, self.cp, self.block_size)  # a no-op on the step's padded microbatches
        plan = distribute(mb["bam"], self.cp, self.method, self.block_size, mb.get("segment_ids"),
                          ulysses=self.ulysses, window=self.windows)
        owner = torch.empty(sum(len(p) for p in plan), dtype=torch.long)
        for r, blocks in enumerate(plan):
            owner[blocks] = r
        return owner


def llm_windows(model) -> tuple | None:
    """The sliding window of every LLM layer (from the config: the same on every stage), None without any."""
    from lightning_mm.model.families import layer_windows

    windows = tuple(layer_windows(model.language_model))
    return windows if any(w is not None for w in windows) else None


def block_owner_plans(block_owners: BlockOwners | None, mbs: list[dict], plans=None,
                      embeds: bool = True) -> list[torch.Tensor] | None:
    """Each LLM microbatch's CP distribution as the owning rank of every block, on the host: the data loader's
    (``plans``, a ``CPPlans``), else made here at the LLM's first stage (``embeds``) (a host read of ``bam`` and ``segment_ids`` per
    microbatch). The first stage sends it down the LLM pipeline with the hidden states (``"cp_owner"``); a later
    stage without the loader's plan uses that one (None here)."""
    if block_owners is None:
        return None
    if plans is not None and plans.owners is not None:
        got = [int(o.numel()) for o in plans.owners]
        want = [block_owners.num_blocks(mb["input_ids"].shape[1]) for mb in mbs]
        if got != want:
            raise ValueError(f"the batch's CP plan (batch['{PLAN_KEY}']['cp']) gives block owners for {got} "
                             f"blocks per microbatch but this step runs {want}: it was made for another batch or "
                             "layout; let MultimodalParallelStrategy wrap the loader (it plans for its own "
                             "layout) or drop the plan from the batch")
        return plans.owners
    if not embeds:
        return None
    return [block_owners.owner(mb) for mb in mbs]
