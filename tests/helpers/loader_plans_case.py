"""trainer_case.py with context-parallel planning forbidden inside the step.

``python loader_plans_case.py '<json>' <out_dir>``: the same run as trainer_case.py (same JSON keys), except that
the planning functions (``distribute`` as ``parallel/context.py``'s ``BlockOwners`` calls it, ``shard_items`` as
``data/cp_plans.py``'s ``EncoderItems`` calls it, for the loader and the step alike) raise when called inside
``PipelineEngine.run``, and each rank writes ``loader_plans_<rank>.json``: how many steps it ran, how many of their
batches carried the loader's CP plans, and whether its stage runs CP.
"""

import json
import os
import sys

import lightning_mm.data.cp_plans as cp_plans
import lightning_mm.parallel.context as context
import lightning_mm.parallel.engine as engine
from tests.helpers import trainer_case  # run_script puts the repository on PYTHONPATH

IN_STEP = [False]
STATS = {"rank": None, "steps": 0, "with_plans": 0, "runs_cp": False}


def forbidden_in_step(fn):
    def planning(*args, **kwargs):
        if IN_STEP[0]:
            raise AssertionError(f"{fn.__name__} ran inside the step: the batch should have carried its CP plan")
        return fn(*args, **kwargs)
    return planning


context.distribute = forbidden_in_step(context.distribute)
cp_plans.shard_items = forbidden_in_step(cp_plans.shard_items)
_run = engine.PipelineEngine.run


def run(self, batch, *args, **kwargs):
    STATS.update(rank=self.rank, runs_cp=bool(self.item_planners or self.block_owners))
    STATS["steps"] += 1
    STATS["with_plans"] += cp_plans.batch_plans(batch) is not None
    IN_STEP[0] = True
    try:
        return _run(self, batch, *args, **kwargs)
    finally:
        IN_STEP[0] = False


engine.PipelineEngine.run = run

if __name__ == "__main__":
    trainer_case.main(*sys.argv[1:])
    with open(os.path.join(sys.argv[2], f"loader_plans_{STATS['rank']}.json"), "w") as f:
        json.dump(STATS, f)
