"""The phases of ``benchmarks/oobleck.py --measured`` (committed steps/s before, during and after a failure) from a
steps log. Pure: no process is launched."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _oobleck():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("oobleck_benchmark", ROOT / "benchmarks" / "oobleck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_of_a_steps_log():
    phases = _oobleck().phases
    rows = [(1, 0.0, 0), (2, 1.0, 0), (3, 2.0, 0), (4, 3.0, 0), (5, 10.0, 1), (6, 11.0, 1), (7, 12.0, 1)]
    p = phases(rows, killed=3.5, recovered=10.0, batch=4)
    assert p["steps_per_s_before"] == 1.0 and p["samples_per_s_before"] == 4.0  # steps 3 -> 4 (2 warm-up skipped)
    assert p["steps_per_s_during"] == 1 / 6.5  # one new step (5) in 6.5 s
    assert p["steps_per_s_after"] == 1.0 and p["kill_to_first_commit_s"] == 6.5
    never = phases(rows, killed=3.5, recovered=None)  # no recovery: "during" lasts to the last row
    assert never["steps_per_s_during"] == 3 / 8.5 and never["steps_per_s_after"] is None
    redo = [(1, 0.0, 0), (2, 1.0, 0), (3, 2.0, 0), (4, 3.0, 0), (2, 9.0, 1), (3, 10.0, 1), (4, 11.0, 1)]
    r = phases(redo, killed=3.5, recovered=9.0)  # a resume from an older checkpoint redoes steps: no new progress
    assert r["steps_per_s_during"] == 0.0 and r["kill_to_first_commit_s"] == 5.5


def test_recovery_phases_split_the_kill_to_the_first_commit():
    """The re-formed group's recovery split at its process's creation, the end of its imports, the fit's start and
    the training's start; None when a mark is missing (a run from before the marks)."""
    phases = _oobleck().recovery_phases
    got = phases({"created": 9.0, "started": 12.0, "fit_start": 12.5, "train_start": 15.0}, killed=1.0,
                 first_commit=16.0)
    assert got == {"launcher": 8.0, "imports": 3.0, "model_and_trainer": 0.5, "setup": 2.5,
                   "quorum_heal_first_step": 1.0}
    assert sum(got.values()) == 16.0 - 1.0
    assert phases({"started": 12.0}, killed=1.0, first_commit=16.0) is None
