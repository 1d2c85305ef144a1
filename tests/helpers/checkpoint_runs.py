"""Runs of tests/helpers/checkpoint_case.py shared by the checkpoint and fault tests (each run once per session)."""

from __future__ import annotations

import functools
import json
import os
import tempfile

from tests.helpers.launch import LAUNCH_VARIABLES, ROOT, merged_params, run_script

CASE = os.path.join(os.path.dirname(__file__), "checkpoint_case.py")
STEPS = 6


def case_env() -> dict:
    """Environment of a test's subprocess: one thread, and THIS tree's lightning_mm first on the path (an editable
    install may point at another checkout; PYTHONPATH wins over its import finder)."""
    path = os.environ.get("PYTHONPATH")
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def run_case(cfg: dict, timeout: float = 300) -> list[float]:
    """Run one case to completion; returns rank 0's per-step losses."""
    run_script(CASE, json.dumps(cfg), cwd=os.path.dirname(cfg["out"]), timeout=timeout)
    with open(cfg["out"]) as f:
        return json.load(f)


def rank_weights(path: str) -> dict:
    """The trained parameters a distributed case wrote (``<path>.<rank>``: each rank's whole tensors), merged."""
    import glob

    merged = merged_params(glob.glob(f"{path}.*"))
    assert merged, f"no {path}.<rank> files"
    return merged


@functools.cache
def reference() -> dict:
    """An uninterrupted pipeline run (pp2, dp1, checkpoints at steps 3 and 6) and one-process Lightning run."""
    d = tempfile.mkdtemp(prefix="lmm-ckpt-")
    single = run_case({"layout": "single", "steps": STEPS, "out": f"{d}/single.json", "weights": f"{d}/single.pt"})
    pipe = run_case({"layout": "pp2", "steps": STEPS, "out": f"{d}/pp2.json", "ckpt_dir": f"{d}/pp2",
                     "save_every": 3, "weights": f"{d}/pp2.pt"})
    return {"dir": d, "single": single, "single_weights": f"{d}/single.pt", "pp2": pipe,
            "pp2_weights": rank_weights(f"{d}/pp2.pt"),
            "ckpt3": f"{d}/pp2/step=3.ckpt", "ckpt6": f"{d}/pp2/step=6.ckpt"}
