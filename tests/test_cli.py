"""The README's examples run through the installed console script."""

import shutil
import subprocess

import pytest


@pytest.mark.parametrize("config", ["examples/tiny_vlm.yaml", "examples/tiny_valm.yaml", "examples/tiny_valm_pp.yaml"])
def test_cli_example_trains(config, tmp_path):
    exe = shutil.which("lightning-mm")
    assert exe, "the console script is not installed: pip install -e ."
    proc = subprocess.run([exe, "fit", "--config", config, "--trainer.max_steps=6",
                           f"--trainer.default_root_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_steps=6" in proc.stderr + proc.stdout
    assert [p.parent.name for p in tmp_path.rglob("loss.png")] == ["version_0"]  # beside metrics.csv
    assert (next(tmp_path.rglob("loss.png")).parent / "metrics.csv").exists()
