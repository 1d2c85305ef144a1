"""Run a helper script that starts a multi-process Lightning job, and fail with every process's stack if it hangs.

The script runs in its own session with ``PYTHONFAULTHANDLER=1`` (inherited by the ranks Lightning launches) and a
rendezvous port outside the ephemeral range (``distributed._free_port``). On timeout every process of the session
gets SIGABRT, so each prints all its threads' Python stacks to the captured stderr before it dies, and the test
fails with that output instead of leaving processes behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers.distributed import _free_port

# what Lightning's launcher (or torchrun) sets for the ranks it starts: inherited, they make Lightning skip launching
LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script: str, *args: str, cwd, timeout: float = 420, env: dict | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python script *args`` with one thread per process; raises with the stderr tail on failure."""
    return run_command([sys.executable, script, *args], cwd=cwd, timeout=timeout, env=env, check=check)


def run_cli(subcommand: str, config, *args: str, cwd, timeout: float = 420,
            check: bool = False) -> subprocess.CompletedProcess:
    """``lightning-mm <subcommand> --config <config> *args`` as a user runs it (the installed console script)."""
    import shutil

    exe = shutil.which("lightning-mm")
    assert exe, "the console script is not installed: pip install -e ."
    return run_command([exe, subcommand, "--config", str(config), *args], cwd=cwd, timeout=timeout, check=check)


def run_command(cmd: list[str], cwd, timeout: float = 420, env: dict | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` in its own session with one thread per process and this tree's ``lightning_mm`` first."""
    path = os.environ.get("PYTHONPATH")  # this tree's lightning_mm first (an editable install may point elsewhere)
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": ROOT + (os.pathsep + path if path else ""), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(os.path.basename(c) for c in cmd[:2])} did not finish in {timeout:g} s; the stacks "
                    "of its processes "
                    f"(SIGABRT on timeout):\n{err[-12000:]}", pytrace=False)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        assert proc.returncode == 0, err[-4000:]
    return result


def run_trainer_case(script: str, case: dict, tmp_path, name: str, timeout: float = 420) -> tuple[dict, dict]:
    """Run a JSON-driven Trainer case in ``tmp_path / name`` (failing after ``timeout`` s); returns rank 0's
    ``result.json`` and the trainable parameters every rank saved (``params_<rank>.pt``, merged by name; replicas
    must agree exactly)."""
    out = tmp_path / name
    out.mkdir()
    run_script(script, json.dumps(case), str(out), cwd=out, timeout=timeout)
    return json.loads((out / "result.json").read_text()), merged_params(out.glob("params_*.pt"))


def merged_params(files) -> dict:
    """The parameters each rank saved (one ``{name: whole tensor}`` file per rank), merged by name; ranks holding
    the same parameter (replicas, CP ranks, tied copies) must hold identical values."""
    import torch

    params = {}
    for f in sorted(map(str, files)):
        for n, p in torch.load(f, weights_only=True).items():
            if n in params:
                torch.testing.assert_close(p, params[n], rtol=0, atol=0, msg=f"{n} in {f}")
            params[n] = p
    return params
