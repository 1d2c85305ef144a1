"""Pure planning data shared by the runtime and the planner: rank layout, placement table, stage slices, schedule.

Nothing here imports torch.distributed or Lightning, so every fact is unit-tested directly and every check runs
before a process group exists. Imports run one way: ``plan`` <- ``planner``; ``plan`` <- ``parallel`` <- strategy.
"""

from lightning_mm.plan.layout import Coordinate, ParallelSpec, RankLayout, build_layout
from lightning_mm.plan.placement import placement_table
from lightning_mm.plan.schedule import LANGUAGE_MODEL, build_stage_graph, check_schedule, one_f_one_b
from lightning_mm.plan.stages import Slice, StagePlan, stage_plans, uniform_partition

__all__ = ["Coordinate", "ParallelSpec", "RankLayout", "build_layout", "placement_table", "LANGUAGE_MODEL",
           "build_stage_graph", "check_schedule", "one_f_one_b", "Slice", "StagePlan", "stage_plans",
           "uniform_partition"]
