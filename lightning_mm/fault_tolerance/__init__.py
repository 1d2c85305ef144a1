"""Fault-tolerant replica groups (torchft): a quorum per step, gradients summed across the groups of the quorum,
a commit or a redo, healing from a peer, and the global sampler that keeps every step's global batch.

A replica group is one whole launch of the strategy (its own torchrun / Lightning launch, with its pipeline, tp,
cp and FSDP inside, exactly as without fault tolerance). Groups of one rank layout pair rank r with rank r:
torchft's process group joins rank r of every group in the quorum, and a restarted group's rank r heals from rank
r of a healthy group. Groups of different layouts (``FaultTolerance(global_batch=...)``) reduce and heal layer by
layer, by parameter name (``layerwise.py``), and with ``templates`` re-form at the layout of their size.

One concern per file: ``config.py`` (the settings and their checks), ``sampler.py`` (the global sampler),
``training.py`` (the per-step glue, imported by the strategy: the package itself stays importable from
``parallel/``), ``shares.py`` (this rank's share of a step: placement over replicas, accumulation's
micro-batches), ``layerwise.py`` (groups of different layouts), ``lighthouse.py``, ``watchdog.py`` (a dead or
stuck rank ends the job naming it; imported by the runtime's collectives), ``links.py`` (a rank that ends ends its
group at once), ``abandon.py`` (a cross-group wait given up when the lighthouse drops a group of the quorum),
``redo.py`` (a step that lost a group redone while the lighthouse waits out its heartbeat timeout), ``agent.py``
(the per-node agent that moves nodes between groups), ``snapshot.py`` (the donor's snapshot when such a move
restarts every group).

Per optimiser step (``MultimodalParallelStrategy`` calls these; nothing here is spread through the engine):

1. ``begin_step`` (in ``training_step``): the quorum (synchronous: a group behind the others loads a peer's
   state here, before it computes anything); the step number is torchft's committed step, so the global batch
   is ``global_batch_indices(step)``, cut over the groups of the quorum in proportion to their size
   (``group_shares``) and over the group's own data-parallel replicas; the share is loaded and collated here,
   after the quorum, and cut into as many microbatches as it needs (a group that takes a lost group's share runs
   more microbatches of the usual size).
2. The pipeline runs forward and backward; the strategy's ``backward`` sums gradients inside the group as always.
3. ``reduce_and_commit`` (in the closure the strategy serves to Lightning's ``optimizer_step``): one all-reduce
   across groups of ``C_g * grad`` (``C_g``: the group's label tokens; each group's loss is normalised by its own
   count), divided by the sum of the counts, so the gradient is that of the whole global batch's loss; then
   ``should_commit``. A step that lost a member is discarded (gradients dropped, no optimiser update) and redone
   with a new quorum; Lightning's optimiser step then runs once, on the committed gradients.

The training math is therefore that of an uninterrupted run over the same global batches, whatever groups come
and go (``tests/test_fault_tolerance.py``).
"""

from lightning_mm.fault_tolerance.config import (LIGHTHOUSE_ENV, REPLICA_GROUP_ENV, TOKEN_KEY, FaultTolerance,
                                                 FaultToleranceError, as_fault_tolerance, check_reachable,
                                                 import_torchft, parse_address, quiet_torchft)
from lightning_mm.fault_tolerance.lighthouse import lighthouse_banner, lighthouse_main
from lightning_mm.fault_tolerance.sampler import (StepTokens, global_batch_indices, global_batches_per_epoch,
                                                  group_shares, microbatch_plan)

__all__ = ["FaultTolerance", "FaultToleranceError", "LIGHTHOUSE_ENV", "REPLICA_GROUP_ENV",
           "StepTokens", "TOKEN_KEY", "as_fault_tolerance", "check_reachable", "global_batch_indices",
           "global_batches_per_epoch", "group_shares", "import_torchft", "lighthouse_banner", "lighthouse_main",
           "microbatch_plan", "parse_address", "quiet_torchft"]
