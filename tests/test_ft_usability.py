"""Fault tolerance as a user meets it: the example job (a lighthouse and two replica groups on this host) runs as
shipped, quietly, with a log folder per group; a planned group that never joins is named in a warning; the
lighthouse says where it listens; ``lightning-mm --help`` lists every command."""

import contextlib
import io
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torchft")

from helpers.distributed import _free_port  # noqa: E402

from lightning_mm.trainer.cli import main  # noqa: E402
from lightning_mm.fault_tolerance import lighthouse_banner  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXAMPLE = os.path.join(ROOT, "examples", "fault_tolerance")
ENV = {**os.environ, "OMP_NUM_THREADS": "1",  # this tree's lightning_mm first (an editable install may point elsewhere)
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
ENV.pop("RUST_LOG", None)


def test_help_lists_every_command():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    for command in ("fit", "validate", "test", "predict", "plan", "export", "lighthouse"):
        assert f"    {command} " in out.getvalue(), out.getvalue()


def test_lighthouse_banner_names_the_bound_address():
    assert "fault_tolerance.lighthouse=127.0.0.1:29510" in lighthouse_banner("127.0.0.1:29510", "http://vm:29510", 1)
    wide = lighthouse_banner("[::]:29510", "http://vm:29510", 2)
    assert "every interface" in wide and "fault_tolerance.lighthouse=vm:29510" in wide


@pytest.mark.slow
def test_example_job_runs_quietly_with_a_folder_per_group(tmp_path):
    env = {**ENV, "LIGHTHOUSE_PORT": str(_free_port())}
    proc = subprocess.run(["bash", os.path.join(EXAMPLE, "launch.sh"), "--trainer.max_steps", "3"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"lighthouse bound to 127.0.0.1:{env['LIGHTHOUSE_PORT']}" in proc.stdout
    for group in (0, 1):
        assert (tmp_path / "lightning_logs" / f"group_{group}" / "version_0" / "metrics.csv").exists()
    assert "[INFO] [torchft" not in proc.stderr and "NCCL" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count('"event": "quorum"') == 2  # the project's own event lines stay


@pytest.mark.slow
def test_a_group_that_never_joins_is_named(tmp_path):
    port = _free_port()
    env = {**ENV, "TORCHFT_LIGHTHOUSE": f"localhost:{port}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "LMM_REPLICA_GROUP": "0"}
    lighthouse = subprocess.Popen([sys.executable, "-m", "lightning_mm.trainer.cli", "lighthouse", "--bind",
                                   f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL)
    try:
        proc = subprocess.run(
            [shutil.which("torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "lightning_mm.trainer.cli", "fit",
             "--config", os.path.join(EXAMPLE, "job.yaml"), "--trainer.max_steps", "2",
             "--trainer.strategy.init_args.fault_tolerance.quorum_timeout", "5"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "replica group(s) 1 of 2 did not join within quorum_timeout=5 s" in proc.stderr, proc.stderr[-4000:]
