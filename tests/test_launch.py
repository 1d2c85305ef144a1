"""The strategy launched by torchrun and by SLURM (srun's environment) trains like the single-process run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.distributed import _free_port

CASE = os.path.join(os.path.dirname(__file__), "helpers", "lightning_case.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    proc = subprocess.run([sys.executable, CASE, "single", str(tmp / "out.json"), str(tmp / "ckpt")],
                          capture_output=True, text=True, timeout=400, env=ENV, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def assert_same_training(launched, single, environment):
    assert launched["environment"] == environment
    torch.testing.assert_close(torch.tensor(launched["train"]), torch.tensor(single["train"]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.ci
def test_torchrun_launch_equals_single_process(tmp_path, single):
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun (installed with torch) is missing"
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=5", CASE, "pipeline", str(tmp_path / "out.json"),
                           str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=400, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_training(json.loads((tmp_path / "out.json").read_text()), single, "TorchElasticEnvironment")


@pytest.mark.slow
def test_slurm_launch_equals_single_process(tmp_path, single):
    """Five tasks started the way srun starts them (one process per task, SLURM_* variables set)."""
    port, tasks = _free_port(), []
    for rank in range(5):
        env = {**ENV, "SLURM_NTASKS": "5", "SLURM_NTASKS_PER_NODE": "5", "SLURM_NNODES": "1", "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lmm-test",
               "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}
        env.pop("MASTER_ADDR", None)
        tasks.append(subprocess.Popen([sys.executable, CASE, "pipeline", str(tmp_path / "out.json"),
                                       str(tmp_path / "ckpt")], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    errors = [t.communicate(timeout=400)[1] for t in tasks]
    assert all(t.returncode == 0 for t in tasks), "\n".join(e[-2000:] for e in errors)
    assert_same_training(json.loads((tmp_path / "out.json").read_text()), single, "SLURMEnvironment")
