"""Cut a batch into microbatches: by rows (equal slices, or the row lists of a balanced batch plan), each with
its rows' items of every modality.

A balanced batch (``MultimodalParallelStrategy(batch_balancing=...)``) carries ``batch["microbatches"]``, host
lists made in the data loader: ``"encoder"`` (each row's encoder microbatch; rows come ordered by it) and
``"llm"`` (each row's LLM microbatch: the same, except rows whose LLM work is deferred to the next microbatch).
Under per-module data parallelism a batch holds the samples of several language-model replicas: ``"replica"``
gives each row's replica (rows ordered by it) and ``"route"`` the routing of its rows between modules
(``plan/routing.py``).
Under context parallelism it also carries ``"cp"``, the CP plans of these microbatches (``data/cp_plans.py``); a
plan without ``"encoder"`` means equal slices.
"""

from __future__ import annotations

import torch

ROW_KEYS = ("input_ids", "labels", "bam", "segment_ids", "position_ids", "attention_mask")
PLAN_KEY = "microbatches"
CP_PLAN_KEY = "cp"  # inside batch[PLAN_KEY]: the loader's context-parallel plans
ROUTE_KEY = "route"  # inside batch[PLAN_KEY]: per-module data parallelism's routing (plan/routing.py)


def item_counts(batch: dict, encoders) -> dict[str, torch.Tensor]:
    """Items of each modality per row: the collator's ``item_counts``, else one item per row. ``encoders``: name ->
    anything with the encoder's ``family`` (``model.encoders``)."""
    counts = dict(batch.get("item_counts") or {})
    rows = batch["input_ids"].shape[0]
    for name, enc in encoders.items():
        if name in batch and name not in counts:
            n = enc.family.num_items(batch[name])
            if n != rows:
                raise ValueError(f"batch[{name!r}] has {n} items for {rows} rows and no item_counts; give "
                                 "batch['item_counts'][name] (items per row), as MultimodalCollator does")
            counts[name] = torch.ones(rows, dtype=torch.long, device=batch["input_ids"].device)
    return counts


def equal_rows(rows: int, num_microbatches: int) -> list[list[int]]:
    """Today's split: ``num_microbatches`` contiguous slices of equal row counts."""
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(f"a batch of {rows} rows cannot be cut into num_microbatches={num_microbatches} equal "
                         f"microbatches; make the per-rank batch size a multiple of num_microbatches")
    size = rows // num_microbatches
    return [list(range(m * size, (m + 1) * size)) for m in range(num_microbatches)]


def microbatch_rows(batch: dict, num_microbatches: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rows of each encoder microbatch and of each LLM microbatch (equal slices when the batch has no plan).

    An LLM microbatch lists its own rows first, then the rows deferred into it from the previous microbatch."""
    plan = batch.get(PLAN_KEY)
    plan = plan if plan is not None and "encoder" in plan else None
    return plan_rows(batch["input_ids"].shape[0], plan and plan["encoder"], plan and plan["llm"], num_microbatches)


def as_one_microbatch(batch: dict) -> dict:
    """``batch`` with only the parts of its loader's plan that hold for any microbatch count (each row's
    language-model replica, its feature tokens): generation runs a batch as one piece, while the loader planned
    rows, routing and CP shards for training's ``num_microbatches``."""
    plan = batch.get(PLAN_KEY)
    if not isinstance(plan, dict):
        return batch
    return {**batch, PLAN_KEY: {k: plan[k] for k in ("replica", "tokens") if k in plan}}


def replica_microbatch_rows(batch: dict, num_microbatches: int, replicas: int | None = None
                            ) -> list[tuple[list[list[int]], list[list[int]]]]:
    """``microbatch_rows`` of each language-model replica of a group's batch (per-module data parallelism), as row
    indices of the whole batch. The plan's ``"replica"`` gives each row's replica; without it the batch is
    ``replicas`` equal slices (default: the plan's replicas, else one)."""
    rows = batch["input_ids"].shape[0]
    plan = batch.get(PLAN_KEY) or {}
    owner = plan.get("replica")
    if replicas is None:
        replicas = 1 if owner is None else max(owner) + 1
    if owner is None:
        if rows % replicas:
            raise ValueError(f"a batch of {rows} rows cannot be split over {replicas} language-model replicas; give "
                             f"batch['{PLAN_KEY}']['replica'] or a multiple of {replicas} rows")
        owner = [r * replicas // rows for r in range(rows)]
    out = []
    for j in range(replicas):
        mine = [r for r in range(rows) if owner[r] == j]
        if not mine:
            raise ValueError(f"language-model replica {j} of {replicas} has no row in this batch")
        enc, llm = (None, None) if "encoder" not in plan else ([plan["encoder"][r] for r in mine],
                                                                [plan["llm"][r] for r in mine])
        enc_rows, llm_rows = plan_rows(len(mine), enc, llm, num_microbatches)
        out.append(([[mine[i] for i in g] for g in enc_rows], [[mine[i] for i in g] for g in llm_rows]))
    return out


def plan_rows(rows: int, enc: list[int] | None, llm: list[int] | None, num_microbatches: int
              ) -> tuple[list[list[int]], list[list[int]]]:
    """Encoder and LLM microbatch rows of ``rows`` rows from each row's microbatches (``enc``, ``llm``), or equal
    slices when ``enc`` is None."""
    if enc is None:
        same = equal_rows(rows, num_microbatches)
        return same, same
    enc, llm = list(enc), list(llm)
    if len(enc) != rows or len(llm) != rows:
        raise ValueError(f"batch['{PLAN_KEY}'] gives {len(enc)}/{len(llm)} rows for a batch of {rows}")
    if sorted(enc) != enc or set(enc) != set(range(num_microbatches)):
        raise ValueError(f"batch['{PLAN_KEY}']['encoder'] must list microbatches 0..{num_microbatches - 1} in "
                         f"row order, each at least once (num_microbatches={num_microbatches}); got {enc}")
    for r, (e, m) in enumerate(zip(enc, llm)):
        if m not in (e, e + 1):
            raise ValueError(f"row {r}: LLM microbatch {m} of encoder microbatch {e}; a row's LLM work runs in "
                             "its own microbatch or is deferred to the next one")
    encoder = [[r for r in range(rows) if enc[r] == m] for m in range(num_microbatches)]
    language = [[r for r in encoder[m] if llm[r] == m] + ([r for r in encoder[m - 1] if llm[r] == m] if m else [])
                for m in range(num_microbatches)]
    if any(not rs for rs in language):
        raise ValueError(f"batch['{PLAN_KEY}'] leaves an LLM microbatch without rows: {language}")
    return encoder, language


def deferrals(encoder_rows: list[list[int]], llm_rows: list[list[int]]) -> tuple[int, ...]:
    """Microbatches whose LLM work is partly run by the next microbatch."""
    return tuple(m for m in range(len(encoder_rows) - 1)
                 if any(r in encoder_rows[m] for r in llm_rows[m + 1]))


def row_index(batch: dict, group: list[int]):
    """What selects the rows ``group`` of the batch's tensors: a slice when they are contiguous, else an index."""
    contiguous = group == list(range(group[0], group[0] + len(group)))
    return slice(group[0], group[-1] + 1) if contiguous else torch.tensor(group, device=batch["input_ids"].device)


def group_items(per_row: list[int], group: list[int]) -> list[int]:
    """Indices (in the batch's item order) of the items of rows ``group``, row by row; ``per_row``: items per row."""
    first = [0]
    for n in per_row[:-1]:
        first.append(first[-1] + n)
    return [first[r] + i for r in group for i in range(per_row[r])]


def split_microbatches(batch: dict, num_microbatches: int | list[list[int]], model) -> list[dict]:
    """One batch per microbatch, each with its own rows' encoder inputs. ``num_microbatches`` is a count (equal
    slices) or the row indices of each microbatch."""
    groups = (equal_rows(batch["input_ids"].shape[0], num_microbatches) if isinstance(num_microbatches, int)
              else num_microbatches)
    counts = item_counts(batch, model.encoders)
    per_row = {name: c.tolist() for name, c in counts.items()}  # one small host read per modality
    out = []
    for group in groups:
        if not group:  # an encoder replica with no row in this microbatch (per-module data parallelism)
            out.append({"item_counts": {}})
            continue
        rows = row_index(batch, group)
        mb = {k: batch[k][rows] for k in ROW_KEYS if k in batch}
        mb["item_counts"] = {}
        for name, c in counts.items():
            mb["item_counts"][name] = c[rows]
            items = group_items(per_row[name], group)
            if items:
                index = torch.tensor(items, device=c.device)
                mb[name] = model.encoders[name].family.select_items(batch[name], index)
        out.append(mb)
    return out


def feature_tokens(batch: dict, model) -> dict[str, list[int]]:
    """Feature tokens of each modality per row (the data loader counts them; else read here once)."""
    plan = batch.get(PLAN_KEY) or {}
    if "tokens" in plan:
        return plan["tokens"]
    ids = batch["input_ids"]
    return {e: (ids == pid).sum(1).tolist() for e, pid in model.placeholder_ids.items()}
