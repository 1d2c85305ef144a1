"""Sharded data parallelism with FSDP2: the data-parallel replicas of a stage shard its state."""

from __future__ import annotations

SHARDING_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
