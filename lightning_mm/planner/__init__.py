"""The frozen-aware planner: profiler, cost model, stage partitioner, auto-parallel search and simulator.

Pure planning code (no process groups): the strategy calls `partition_module` / `search`, the CLI prints
`plan_summary`, and the simulator times the schedule's own action lists (`lightning_mm.plan.schedule`).
`search_per_module_dp` gives each module its own (dp, tp, pp) (DistTrain's orchestration, `orchestration.py`).
"""

from lightning_mm.planner.costs import (
    CostModel,
    LayerCost,
    LayerProfile,
    ModuleTimes,
    fit_cost_model,
    forward_only_costs,
    layer_costs,
    load_profile,
    mllm_layer_costs,
    module_times,
    save_profile,
)
from lightning_mm.planner.heterogeneity import BatchSimulation, MethodReport, compare_methods, simulate_batch
from lightning_mm.planner.orchestration import (
    Orchestration,
    OrchestrationResult,
    Unit,
    eq12_time,
    flop_ratio_split,
    integer_min_max,
    search_per_module_dp,
    water_fill,
)
from lightning_mm.planner.partition import partition, partition_module, stage_sums, uniform_partition
from lightning_mm.planner.profiler import profile_layers
from lightning_mm.planner.search import (
    AttentionShape,
    ModuleSpec,
    Plan,
    SearchResult,
    check_module_dp,
    encoder_samples,
    evaluate_plan,
    plan_graph,
    plan_summary,
    search,
)
from lightning_mm.planner.simulator import SimulationResult, chrome_trace, simulate, simulate_1f1b, timeline_png

__all__ = [
    "CostModel", "LayerCost", "LayerProfile", "ModuleTimes", "fit_cost_model", "forward_only_costs", "layer_costs",
    "load_profile", "mllm_layer_costs", "module_times", "save_profile", "partition", "partition_module",
    "stage_sums", "uniform_partition", "profile_layers", "AttentionShape", "ModuleSpec", "Plan", "SearchResult",
    "evaluate_plan",
    "plan_graph", "plan_summary", "search", "SimulationResult", "chrome_trace", "simulate", "simulate_1f1b",
    "timeline_png", "BatchSimulation", "MethodReport", "compare_methods", "simulate_batch", "check_module_dp",
    "encoder_samples", "Orchestration", "OrchestrationResult", "Unit", "eq12_time", "flop_ratio_split",
    "integer_min_max", "search_per_module_dp", "water_fill",
]
