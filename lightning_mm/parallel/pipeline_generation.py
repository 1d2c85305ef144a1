"""Greedy generation across pipeline stages: ``trainer.predict`` with ``MultimodalLightningModule(generation=...)``
when the model is split into stages (the LLM in ``pp`` stages, encoders on their own ranks).

Per batch (one replica; every rank of it sees the same batch, so each derives the prompt's words and positions
itself and only features, hidden states and tokens travel):

1. The encoder stages run once over the whole batch (one microbatch, the training forward of each stage under
   ``no_grad``) and send their features down the stage graph to the LLM's first stage.
2. Prefill: the LLM's first stage embeds the prompt (moved to left padding, as ``MultimodalModel.generate`` does)
   and scatters the features; each LLM stage runs its own layers over the prompt and fills its own KV cache, a
   transformers ``DynamicCache`` over its layers only (filled by the HF attention modules of those layers, keyed by
   their global layer index); the hidden states go stage to stage. The last stage picks the greedy next token.
3. Decoding: the last stage sends the tokens of the rows still running (and their row indices) back to the first
   stage, which embeds them; the ``[rows, 1, H]`` hidden states travel down the stages, each appending to its
   cache. A row that emits an end-of-sequence token leaves the batch: every stage drops it from its cache at the
   next step (``DynamicCache.batch_select_indices``), so finished rows cost no more compute; when no row is left
   an empty message stops every stage.

Attention keeps the bitfield semantics of one-process generation (``attention.hf.generation_words``): the prompt
attends under its words, every generated token is text. Positions are those of one-process generation too: 1-D
positions count each row's real tokens; M-RoPE models (Qwen2-VL family, ``position_ids_fn``) give the prompt its
own and generated token ``t`` ``next_positions`` + ``t`` (``lightning_mm.model.generation``). Messages use the
engine's ``StageComm`` (one exchange per send or receive, headers first), one at a time along the chain, so no
cycle can wait on itself. The last LLM stage broadcasts the ids to every rank of the replica.

Under per-module data parallelism every rank of a group sees the group's batch; it is routed as a training step
of one microbatch routes it (``RoutedExchange.whole_batch``): each language-model replica decodes its own rows,
every encoder replica encodes its share of the rows with items and sends each language-model replica the features
of that replica's rows, which its first stage assembles in its row order. Each replica's last stage fills its own
prompts of the group's ids (summed over the group).

Under tensor parallelism every tp rank of an LLM stage runs the stage's split layers (its KV cache holds its own
heads), hidden states and tokens go between the ranks of the same tp index, and the last stage gathers the
vocabulary-parallel logits of the last position only (``rows x vocab``) to pick the token on every tp rank.

Under context parallelism every cp rank of an LLM stage holds the stage's whole weights and decodes the whole prompt
itself (messages between ranks of the same cp index, no cp collective). Under FSDP each rank gathers its stage's
parameters once for the whole generation (:func:`unsharded`): replicas decode different numbers of steps, so no
collective may run per step. Under expert parallelism each rank likewise gathers its stage's routed experts from
its ep group once (``expert_parallel.gathered_experts``) and runs them locally, without the token all-to-all.
Packed rows decode as one prompt per sample (``unpack_prompts``).

Served: greedy decoding (``do_sample=False``, one beam, one sequence per prompt), ``max_new_tokens``,
``eos_token_id``, ``pad_token_id``; the LLM's stages with tensor, context and expert parallelism, FSDP, packed
prompts, per-module data parallelism. Refused with the fix: everything else.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_mm.attention import mask as masks
from lightning_mm.attention.hf import check_honours_mask, generation_words
from lightning_mm.data.microbatch import feature_tokens, split_microbatches
from lightning_mm.model.generation import is_packed, left_align, next_positions, prompt_positions, unpack_prompts
from lightning_mm.parallel.encoder_cp import item_shards
from lightning_mm.parallel.engine import check_same_batch, deepstack_message, received_deepstack
from lightning_mm.parallel.expert_parallel import gathered_experts
from lightning_mm.plan.schedule import LANGUAGE_MODEL

SERVED = ("max_new_tokens", "do_sample", "num_beams", "num_return_sequences", "eos_token_id", "pad_token_id",
          "use_cache")
# generation_config entries that change greedy picks (transformers' logits processors); refused when set
_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0,
               "min_new_tokens": None, "suppress_tokens": None, "begin_suppress_tokens": None,
               "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
               "encoder_repetition_penalty": 1.0}
HIDDEN_KEYS = ["hidden", "rows"]
TOKEN_KEYS = ["tokens", "rows"]


@dataclass(frozen=True)
class GreedySettings:
    max_new_tokens: int
    eos: tuple[int, ...]
    pad: int


def unserved_options(generation: dict) -> str | None:
    """Why ``generation`` (``MultimodalLightningModule(generation=...)``) cannot decode across pipeline stages, or
    None (pure: the same answer on every rank)."""
    unknown = sorted(set(generation) - set(SERVED))
    if generation.get("do_sample") or generation.get("num_beams", 1) != 1 or \
            generation.get("num_return_sequences", 1) != 1 or generation.get("use_cache", True) is False:
        return ("generation across pipeline stages decodes greedily with a KV cache (do_sample=False, num_beams=1, "
                "num_return_sequences=1); for sampling or beam search predict with the whole model on every rank "
                "(devices=1, or language_model=ParallelSpec(pp=1) with encoder_placement='replicated')")
    if unknown:
        return (f"generation across pipeline stages takes {list(SERVED)}, not {unknown}; drop them, or predict with "
                "the whole model on every rank (devices=1, or language_model=ParallelSpec(pp=1) with "
                "encoder_placement='replicated'), where transformers' generate takes every option")
    if not isinstance(generation.get("max_new_tokens"), int) or generation["max_new_tokens"] < 1:
        return "generation across pipeline stages needs max_new_tokens=<int >= 1> in generation=..."
    return None


@contextlib.contextmanager
def unsharded(engine):
    """Every FSDP unit of this rank's stage all-gathered once for the whole generation (and kept so by each forward),
    and the stage's routed experts gathered from their ep group (``expert_parallel.gathered_experts``), then sharded
    again: replicas decode different numbers of steps, so no collective may run per step. Every rank of a shard or
    ep group enters together (one generation per predict batch on every rank)."""
    root = engine.run_stage if isinstance(engine.run_stage, FSDPModule) else None
    if root is not None:
        _initialise_from_root(root)
    units = [m for m in engine.model.modules() if isinstance(m, FSDPModule)] + ([root] if root is not None else [])
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        with gathered_experts(engine.model, engine.plan):
            yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(engine.sharding_strategy == "FULL_SHARD" and m is not root, recurse=False)


def _initialise_from_root(root) -> None:
    """Run the root unit's forward once, doing nothing, so that FSDP sets its units up from the root as a training
    step's first forward does. Generation runs the stage's units directly: without this the first unit to run
    would make itself a root, which a tied embedding and head (one unit of two modules, Gemma 3) cannot be."""
    run = root.run
    root.run = lambda: None
    try:
        root()
    finally:
        root.run = run


def greedy_settings(lm, generation: dict) -> tuple[GreedySettings | None, str | None]:
    """The stop tokens and padding of ``lm``'s generation config overridden by ``generation`` (an LLM stage)."""
    config = getattr(lm, "generation_config", None)
    for key, neutral in _PROCESSORS.items():
        value = getattr(config, key, neutral) if config is not None else neutral
        if value not in (neutral, None, [], ()) and key not in generation:
            return None, (f"the language model's generation_config sets {key}={value!r}, which changes greedy picks "
                          "and is not applied across pipeline stages; reset it (model.language_model."
                          f"generation_config.{key} = {neutral!r}) or predict with the whole model on every rank")
    eos = generation.get("eos_token_id", getattr(config, "eos_token_id", None))
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
    pad = generation.get("pad_token_id", getattr(config, "pad_token_id", None))
    pad = pad if pad is not None else (eos[0] if eos else 0)  # as transformers: pad with the first eos
    return GreedySettings(int(generation["max_new_tokens"]), eos, int(pad)), None


def _agree(problem: str | None, group, device) -> None:
    """Raise on every rank of ``group`` when any of them has a ``problem`` (its own message where it has one)."""
    flag = torch.tensor([0 if problem is None else 1], device=device)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag):
        raise RuntimeError(problem or "another rank of this replica refused generation across pipeline stages "
                           "(an LLM stage): see its error")


# ------------------------------------------------------------------ the prompt, as every LLM stage derives it
@dataclass
class Prompt:
    input_ids: torch.Tensor  # [B, S] left-aligned
    bam: torch.Tensor  # [B, S] (padding word 0)
    positions: torch.Tensor  # [B, S] or [B, S, 3] (M-RoPE)
    next_position: torch.Tensor  # [B] or [B, 3]: the position of the first generated token


def prompt_of(model, batch: dict) -> Prompt:
    """The batch's prompt as ``MultimodalModel.generate`` decodes it: padding moved left, words with padding 0,
    transformers' positions (or the model's own M-RoPE positions, left-aligned the same way)."""
    input_ids, bam = batch["input_ids"], batch.get("bam")
    mask, position_ids = batch.get("attention_mask"), batch.get("position_ids")
    if mask is None:
        mask = bam.ne(0).long() if bam is not None else torch.ones_like(input_ids)
    if is_packed(batch.get("segment_ids"), mask):  # one prompt per packed sample, as MultimodalModel.generate
        if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 3:
            position_ids = None  # the packer's per-sample M-RoPE positions: the model computes the same per row
        rows = unpack_prompts(batch["segment_ids"], mask, input_ids=input_ids, bam=bam, position_ids=position_ids)
        input_ids, bam, position_ids, mask = (rows[k] for k in ("input_ids", "bam", "position_ids",
                                                                "attention_mask"))
    if bam is None:
        bam = model.build_bam(input_ids, mask)
    masks.validate(bam)
    bam = bam * mask.ne(0)
    ids, bam, aligned = left_align(input_ids, bam, attention_mask=mask)
    real = aligned.ne(0)
    if getattr(model, "position_ids_fn", None) is not None:  # M-RoPE: [B, S, 3] from the tokens and grids
        inputs = {n: batch[n] for n in model.encoders if isinstance(batch.get(n), dict)}
        positions = prompt_positions(model, input_ids, mask, inputs, position_ids)
    else:
        positions = (aligned.long().ne(0).cumsum(1) - 1).clamp(min=0)
        if position_ids is not None:
            given, _ = left_align(position_ids, attention_mask=mask)
            if not torch.equal(given[real], positions[real]):
                raise ValueError("generate counts positions 0, 1, ... over each row's non-padding tokens (as "
                                 "transformers does); these position_ids differ: drop them")
    return Prompt(ids, bam, positions, next_positions(positions))


# ------------------------------------------------------------------ one LLM stage
class StageDecoder:
    """One LLM stage's part of the decoding: its layers, its own KV cache and the rows it holds."""

    def __init__(self, model, prompt: Prompt, start: int, end: int):
        from transformers import DynamicCache

        self.model, self.prompt, self.start, self.end = model, prompt, start, end
        self.cache = DynamicCache()  # over this stage's layers (HF layers update it at their global index)
        self.rows = torch.arange(prompt.input_ids.shape[0], device=prompt.input_ids.device)
        self.text_word = masks.text_word(len(model.encoders))

    def keep(self, rows: torch.Tensor) -> None:
        """Drop from the cache every row not in ``rows`` (rows only ever leave, and stay in order)."""
        if rows.numel() != self.rows.numel():
            self.cache.batch_select_indices(torch.searchsorted(self.rows, rows))
            self.rows = rows

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, deepstack: dict | None = None) -> torch.Tensor:
        """This stage's layers over ``hidden [rows, q, H]`` at ``positions``, appending to the cache (the prompt's
        DeepStack features added after their layers)."""
        fam, lm = self.model.lm_family, self.model.language_model
        pos_emb = fam.position_embeddings(lm, hidden, positions)
        with generation_words(self.prompt.bam.index_select(0, self.rows), self.text_word):
            for i, layer in enumerate(list(self.model.llm_layers)[self.start:self.end], self.start):
                hidden = fam.run_layer(layer, hidden, pos_emb, positions, {"cache": self.cache})
                for stack in (deepstack or {}).values():
                    hidden = stack.add(hidden, i)
        return hidden

    def step_positions(self, t: int) -> torch.Tensor:
        """Positions of generated token ``t`` (0: the first) for the rows held: ``[rows, 1]`` or ``[rows, 1, 3]``."""
        return (self.prompt.next_position.index_select(0, self.rows) + t).unsqueeze(1)


# ------------------------------------------------------------------ the whole exchange
def pipeline_generate(engine, batch: dict, generation: dict) -> torch.Tensor:
    """The new token ids ``[B, N]`` (``N <= max_new_tokens``: decoding stops when every row has finished; finished
    rows are padded with ``pad_token_id``) on every rank of this rank's replica."""
    model, plan = engine.model, engine.plan
    sl = plan.language_model
    problem = unserved_options(generation)
    settings = None
    if problem is None and sl is not None:
        check_honours_mask(model.language_model)
        settings, problem = greedy_settings(model.language_model, generation)
    _agree(problem, engine.groups.replica, engine.device)
    check_same_batch(batch, engine.groups.replica)
    rows, steps = prompt_count(batch), int(generation["max_new_tokens"])
    mine, part = None, batch
    if engine.exchange is not None:  # per-module data parallelism: this stage's rows of the group's batch
        mine = engine.exchange.whole_batch(batch, feature_tokens(batch, model), sl is not None)
        part = split_microbatches(batch, [mine], model)[0]
    out, produced = None, 0
    with torch.no_grad(), unsharded(engine):
        features = _run_encoders(engine, part)
        if sl is not None:
            out, produced = _decode(engine, part, features, settings)
    engine.comm.wait_all()
    if mine is not None:
        return _share_group(engine, out, produced, prompt_index(batch, mine), rows, steps)
    return _share(engine, out, produced, rows, steps)


def prompt_count(batch: dict) -> int:
    """How many prompts the batch holds: its rows, or its samples when rows are packed."""
    mask = batch.get("attention_mask")
    if mask is None:
        mask = batch["bam"].ne(0) if batch.get("bam") is not None else torch.ones_like(batch["input_ids"])
    if not is_packed(batch.get("segment_ids"), mask):
        return batch["input_ids"].shape[0]
    return unpack_prompts(batch["segment_ids"], mask)["attention_mask"].shape[0]


def prompt_index(batch: dict, rows: list[int]) -> torch.Tensor:
    """Where the prompts of ``rows`` (ascending) sit among the batch's prompts (``prompt_count``: one per row, or
    one per packed sample, row by row)."""
    keys = ("input_ids", "attention_mask", "bam", "segment_ids")
    counts = [prompt_count({k: batch[k][r:r + 1] for k in keys if batch.get(k) is not None})
              for r in range(batch["input_ids"].shape[0])]
    starts = [sum(counts[:r]) for r in range(len(counts))]
    return torch.tensor([starts[r] + i for r in rows for i in range(counts[r])], dtype=torch.long,
                        device=batch["input_ids"].device)


def _llm_rank(engine, k: int) -> int:
    """The rank of LLM stage ``k`` in this replica with this rank's cp and tp index (every LLM stage has the same
    cp and tp): under context parallelism each cp rank decodes the whole prompt itself, the same tokens."""
    return engine.layout.rank(f"{LANGUAGE_MODEL}.{k}", engine.coord.dp, engine.coord.cp, engine.coord.tp)


def _run_encoders(engine, batch: dict) -> dict[str, torch.Tensor]:
    """Run this rank's encoder stage once over its rows of the batch (receiving from and sending to its neighbours
    in the stage graph; under per-module data parallelism an encoder's last stage sends each language-model replica
    of its group the features of that replica's rows, as a training step's routed exchange does); at the LLM's
    first stage, the features of every modality (received and colocated), in its rows' order."""
    graph, layout, me, d = engine.frozen_graph, engine.layout, engine.rank, engine.coord.dp
    stage, plan, exchange = engine.stage, engine.plan, engine.exchange
    if plan.language_model is not None and not plan.language_model.embed:
        return {}
    sources = [(p, i) for p in graph.predecessors(stage) for i in layout.peer_replicas(stage, p, d)]
    got = engine.comm.exchange([], [(engine.forward_keys(p), layout.activation_sources(p, stage, d, sender_dp=i)[me])
                                    for p, i in sources])
    received = {}
    for (p, i), msg in zip(sources, got):
        if engine.routed(p):
            exchange.receive(0, p, i, msg)
        else:
            received[p] = msg
    received.update({p: exchange.assemble(0, p) for p in dict.fromkeys(p for p, _ in sources) if engine.routed(p)})
    mb = dict(batch)
    item_shards(engine.item_planners, [mb])  # encoder context parallelism: which rank encodes which item
    if plan.language_model is not None:  # the LLM's first stage: received features and colocated encoders
        features = {k: v for msg in received.values() for k, v in msg.items()}
        with engine.forward_context():
            features.update({e: engine.encoder_part(e, s, mb, {}) for e, s in plan.encoders.items()})
        return {k: v for k, v in features.items() if v.numel()}
    message = engine.run_stage(mb, received, None)
    sends = []
    for succ in graph.successors(stage):
        for j in layout.peer_replicas(stage, succ, d):
            part = message
            if engine.routed(succ):  # the features of the rows replica j decodes
                part = {k: t.index_select(0, exchange.feature_index(0, j, k)) for k, t in message.items()}
            sends += [(part, engine.forward_keys(stage), dst)
                      for dst, src in layout.activation_sources(stage, succ, j, sender_dp=d).items() if src == me]
    engine.comm.exchange(sends, [])
    return {}


def _decode(engine, batch: dict, features: dict, settings: GreedySettings) -> tuple[torch.Tensor | None, int]:
    """This LLM stage's part of prefill and decoding; at the last stage the ids ``[B, max_new_tokens]`` and how many
    columns were produced."""
    model, sl, comm = engine.model, engine.plan.language_model, engine.comm
    k = int(engine.stage.rsplit(".", 1)[1])
    last = engine.layout.module_stages[LANGUAGE_MODEL] - 1
    prev, nxt = (_llm_rank(engine, k - 1) if k else None), (_llm_rank(engine, k + 1) if k < last else None)
    first_rank, last_rank = _llm_rank(engine, 0), _llm_rank(engine, last)
    prompt = prompt_of(model, batch)
    stage = StageDecoder(model, prompt, sl.start, sl.end)
    device = prompt.input_ids.device
    out = torch.full((prompt.input_ids.shape[0], settings.max_new_tokens), settings.pad, dtype=torch.long,
                     device=device) if sl.head else None
    eos = torch.tensor(settings.eos, dtype=torch.long, device=device)
    embed_tokens = model.lm_family.embed_tokens(model.language_model)
    handoff = None  # P == 1: the tokens go from the head to the embedding on this rank

    def forward(hidden, positions, deepstack=None):
        with engine.forward_context():
            return stage.run(hidden, positions, deepstack)

    def pick(hidden, t):  # the last stage: greedy tokens of the rows held; returns the rows still running
        with engine.forward_context():
            logits = model.logits(hidden[:, -1:])
            if isinstance(logits, DTensor):  # vocabulary-parallel head: every tp rank picks from all of it
                logits = logits.full_tensor()
            tokens = logits.argmax(-1).view(-1)
        out[stage.rows, t] = tokens
        running = ~torch.isin(tokens, eos) if eos.numel() else torch.ones_like(tokens, dtype=torch.bool)
        return {"tokens": tokens[running], "rows": stage.rows[running]}

    # prefill (the prompt's DeepStack features, Qwen3-VL, ride along to the stages holding their layers)
    if sl.embed:
        hidden = model.embed(prompt.input_ids, features)
        stacks = model.split_features(features)[1] if model.deepstack else {}
    else:
        message = _receive_dict(comm, HIDDEN_KEYS + engine.deepstack_keys(f"{LANGUAGE_MODEL}.{k - 1}"), prev)
        hidden, stacks = message["hidden"], received_deepstack(engine.model, message)
    deepstack = model.deepstack_context(prompt.input_ids, stacks, sl.start) if model.deepstack else {}
    hidden = forward(hidden, prompt.positions, deepstack)
    prefill_extra = deepstack_message(engine.model, deepstack, sl, engine.device)
    produced = 0
    for t in range(settings.max_new_tokens):
        # hidden: this stage's output for the input of step t (the prompt at t = 0)
        if sl.head:
            message = pick(hidden, t)
            produced = t + 1
            if t + 1 == settings.max_new_tokens:
                break
            if sl.embed:
                handoff = message
            else:
                comm.exchange([(message, TOKEN_KEYS, first_rank)], [])
        elif nxt is not None:
            extra = prefill_extra if t == 0 else {}
            comm.exchange([({"hidden": hidden, "rows": stage.rows, **extra}, HIDDEN_KEYS + list(extra), nxt)], [])
        if t + 1 == settings.max_new_tokens:
            break
        # the input of step t + 1
        if sl.embed:
            message = handoff if handoff is not None else _receive_dict(comm, TOKEN_KEYS, last_rank)
            rows = message["rows"]
            if not rows.numel():  # every row finished: stop every stage down the chain
                if nxt is not None:
                    comm.exchange([({"hidden": hidden[:0, -1:], "rows": rows}, HIDDEN_KEYS, nxt)], [])
                break
            stage.keep(rows)
            hidden = embed_tokens(message["tokens"].view(-1, 1))  # as transformers' generate embeds its tokens
        else:
            hidden, rows = _receive(comm, HIDDEN_KEYS, prev)
            if not rows.numel():
                if nxt is not None:
                    comm.exchange([({"hidden": hidden, "rows": rows}, HIDDEN_KEYS, nxt)], [])
                break
            stage.keep(rows)
        hidden = forward(hidden, stage.step_positions(t))
    return out, produced


def _receive_dict(comm, keys: list[str], src: int) -> dict[str, torch.Tensor]:
    (message,) = comm.exchange([], [(keys, src)])
    return message


def _receive(comm, keys: list[str], src: int) -> tuple[torch.Tensor, ...]:
    message = _receive_dict(comm, keys, src)
    return tuple(message[k] for k in keys)


def _share(engine, out: torch.Tensor | None, produced: int, rows: int, steps: int) -> torch.Tensor:
    """Broadcast the last LLM stage's ids (and how many columns it produced) over the replica."""
    buffer = torch.zeros(1 + rows * steps, dtype=torch.long, device=engine.device)
    if out is not None:
        buffer[0] = produced
        buffer[1:] = out.reshape(-1).to(engine.device)
    if engine.groups.replica is not None:
        last = f"{LANGUAGE_MODEL}.{engine.layout.module_stages[LANGUAGE_MODEL] - 1}"
        dist.broadcast(buffer, engine.layout.rank(last, engine.coord.dp), group=engine.groups.replica)
    return buffer[1:].view(rows, steps)[:, :int(buffer[0])]


def _share_group(engine, out: torch.Tensor | None, produced: int, index: torch.Tensor, rows: int,
                 steps: int) -> torch.Tensor:
    """Per-module data parallelism: every language-model replica's last stage fills its own prompts (``index``)
    of the group's ids, summed over the group, with the most columns any replica produced (a replica that
    stopped sooner has only finished rows, padded)."""
    ids = torch.zeros(rows, steps, dtype=torch.long, device=engine.device)
    count = torch.zeros(1, dtype=torch.long, device=engine.device)
    if out is not None and engine.coord.cp == 0 and engine.coord.tp == 0:
        ids[index.to(engine.device)] = out.to(engine.device)
        count[0] = produced
    if engine.groups.replica is not None:
        dist.all_reduce(ids, group=engine.groups.replica)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=engine.groups.replica)
    return ids[:, :int(count)]
