"""The capabilities a user combines, named once, and the checks of the markers that record how pairs of them compose.

A test that trains (or generates) with two or more capabilities together and compares with one process (or HF)
carries ``@pytest.mark.combines("fsdp", "llm_cp")``; a test that asserts a refusal carries
``@pytest.mark.refuses("ft", "per_module_dp", message="...")`` with a part of the refusal's text that the test
itself asserts. Either may sit on a ``pytest.param`` instead. Documented limits and pairs that mean nothing are in
``compatibility_limits.toml`` beside this file. ``tests/compatibility.py`` writes docs/compatibility.md from all of
it; tests/conftest.py fails collection on a marker this module rejects.
"""

from __future__ import annotations

import tomllib
from itertools import combinations
from pathlib import Path

CAPABILITIES = {
    "pipeline": "pp > 1 on an encoder or the LLM",
    "placement": "encoder_placement 'colocated' or 'replicated'",
    "tp": "tensor parallelism (tp > 1)",
    "llm_cp": "context parallelism of the LLM (allgather, ulysses or hybrid)",
    "encoder_cp": "context parallelism of an encoder (its items shared over cp ranks)",
    "fsdp": "sharding_strategy FULL_SHARD or SHARD_GRAD_OP (FSDP2)",
    "per_module_dp": "a data-parallel degree per module (ParallelSpec(dp=...))",
    "ep": "expert parallelism of a mixture-of-experts LLM (ep > 1)",
    "ft": "fault-tolerant replica groups (fault_tolerance=, torchft)",
    "balancing": "batch balancing ('entrain' or 'disttrain')",
    "packing": "packed rows (several samples a row, segment ids)",
    "activation_checkpointing": "activation_checkpointing=True",
    "accumulation": "accumulate_grad_batches > 1",
    "mixed_precision": "precision 'bf16-mixed' or '16-mixed'",
    "lora": "LoRA adapters (peft)",
    "generation": "trainer.predict with generation= (greedy decoding, across stages where pp > 1)",
    "checkpoint": "resuming or resharding a sharded checkpoint",
}
PAIRS = [frozenset(p) for p in combinations(CAPABILITIES, 2)]
LIMITS_FILE = Path(__file__).with_name("compatibility_limits.toml")


def marker_problem(name: str, args: tuple, kwargs: dict) -> str | None:
    """What is wrong with one ``combines`` / ``refuses`` marker (None when it is right)."""
    unknown = [a for a in args if a not in CAPABILITIES]
    if unknown:
        return f"unknown capabilities {unknown}; use names from tests/capabilities.py: {list(CAPABILITIES)}"
    if len(set(args)) != len(args):
        return f"a capability is named twice in {args}"
    if name == "combines":
        if len(args) < 2 or set(kwargs) - {"note"}:
            return "combines(...) takes two or more capabilities and an optional note="
    elif name == "refuses":
        if len(args) != 2 or set(kwargs) != {"message"} or not str(kwargs["message"]).strip():
            return "refuses(a, b, message=...) takes two capabilities and the part of the refusal the test asserts"
    return None


def load_limits(path: Path = LIMITS_FILE) -> dict[str, dict[frozenset, str]]:
    """``{"limit": {pair: reason}, "not_applicable": {pair: reason}}`` from the TOML file, checked."""
    data = tomllib.loads(path.read_text())
    out: dict[str, dict[frozenset, str]] = {"limit": {}, "not_applicable": {}}
    for kind in out:
        for entry in data.get(kind, []):
            pair = tuple(entry["pair"])
            problem = marker_problem(kind, pair, {})
            if problem or len(pair) != 2 or not entry.get("reason", "").strip():
                raise ValueError(f"{path.name}: {kind} {pair}: {problem or 'give two capabilities and a reason'}")
            out[kind][frozenset(pair)] = entry["reason"].strip()
    return out
