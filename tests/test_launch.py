"""The strategy under torchrun (TorchElastic environment) trains like the single-process run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

CASE = os.path.join(os.path.dirname(__file__), "helpers", "lightning_case.py")


@pytest.mark.slow
def test_torchrun_launch_equals_single_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun (installed with torch) is missing"
    for cmd, name in [([sys.executable, CASE, "single"], "single"),
                      ([torchrun, "--standalone", "--nproc_per_node=5", CASE, "pipeline"], "torchrun")]:
        out = tmp_path / f"{name}.json"
        proc = subprocess.run(cmd + [str(out), str(tmp_path / f"{name}.ckpt")], capture_output=True, text=True,
                              timeout=400, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
    single = json.loads((tmp_path / "single.json").read_text())
    launched = json.loads((tmp_path / "torchrun.json").read_text())
    torch.testing.assert_close(torch.tensor(launched["train"]), torch.tensor(single["train"]), rtol=1e-5, atol=1e-6)
