"""Launch failures end cleanly: a layout the devices cannot hold fails in the launching process before any rank is
spawned (one traceback, no child left), ranks never outlive the process that launched them, and a rank that
finished its job leaves its process groups destroyed and exits without aborting."""

import os
import subprocess
import sys
import time

import pytest
import yaml

from tests.helpers.distributed import _free_port

HERE = os.path.dirname(__file__)
EXAMPLE = os.path.join(HERE, "..", "examples", "tiny_valm_pp.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1",  # this tree's lightning_mm first (an editable install may point elsewhere)
       "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(HERE, ".."), os.environ.get("PYTHONPATH")]))}


def processes_mentioning(text: str) -> list[int]:
    """Pids of the running processes whose command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_layout_error_raised_before_any_rank_is_spawned(tmp_path):
    config = yaml.safe_load(open(EXAMPLE))
    config["trainer"]["devices"] = 5  # the layout needs a multiple of 4 ranks
    path = tmp_path / "five_devices.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "lightning_mm.trainer.cli", "fit", "--config", str(path)], cwd=tmp_path,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "5 devices cannot hold whole replicas of 4 ranks" in err, err[-3000:]
    assert "Traceback" not in err and "lightning-mm fit: error:" in err, err[-3000:]  # one message, the fix in it
    assert not (tmp_path / "lightning_logs").exists()  # no rank got as far as logging
    assert processes_mentioning(str(path)) == []


def run_case(mode: str, folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(HERE, "helpers", "launcher_case.py"), mode, str(folder)],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=folder)


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_children_ended_when_the_launching_process_raises(tmp_path):
    proc = run_case("raise", tmp_path)
    assert proc.returncode != 0 and "the launching rank failed" in proc.stderr, proc.stderr[-3000:]
    assert wait_gone(int((tmp_path / "child.pid").read_text()), 5)


@pytest.mark.slow
def test_children_die_with_their_launcher(tmp_path):
    proc = run_case("orphan", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert wait_gone(int((tmp_path / "child.pid").read_text()), 5)


@pytest.mark.slow
def test_a_rank_started_after_its_launcher_died_stops():
    code = "from lightning_mm.trainer.launch import end_with_launcher; end_with_launcher(); print('waited')"
    env = {**ENV, "LMM_LAUNCHER_PID": "1", "LOCAL_RANK": "1"}  # pid 1 is never this process's parent here
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1 and "waited" not in proc.stdout
    assert "the launching process (pid 1) has exited" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("failed", [False, True])
def test_process_groups_destroyed_at_a_normal_exit_only(failed):
    """The strategy registers one exit handler that destroys the process groups, except after the rank's job
    raised."""
    code = f"""
import atexit
import torch.distributed as dist
from lightning_mm.trainer import launch
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port: nothing to collide with
launch.release_process_groups_at_exit()
launch.release_process_groups_at_exit()  # once
if {failed}:
    launch.mark_failed()
atexit._run_exitfuncs()
print("alive" if dist.is_initialized() else "destroyed")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["alive" if failed else "destroyed"]


EXIT_RACE = """
import os, sys, time
import torch, torch.distributed as dist
rank, port, handler = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = dist.group.WORLD  # referenced to the end, as a trainer references its groups
if rank == 1:
    time.sleep(0.3)
    dist.all_reduce(torch.ones(4))
    os._exit(0)
if handler:
    from lightning_mm.trainer import launch
    launch.release_process_groups_at_exit()
sys.setswitchinterval(100.0)  # the main thread keeps the GIL from here to the interpreter's end
dist.all_reduce(torch.ones(4), async_op=True)  # done when rank 1 joins; gloo's worker then releases the tensor
end = time.monotonic() + 1.0
while time.monotonic() < end:
    pass
"""


@pytest.mark.slow
@pytest.mark.parametrize("handler", [False, True])
def test_a_collective_finished_just_before_exit_does_not_abort_the_rank(handler):
    """A gloo worker that releases a finished collective's tensor needs the GIL; if the interpreter is finalising
    by then, the rank aborts ("terminate called without an active exception") after its job succeeded. Made
    certain here: the main thread keeps the GIL until exit. The exit handler lets the worker finish first."""
    port = str(_free_port())
    peer = subprocess.Popen([sys.executable, "-c", EXIT_RACE, "1", port, "0"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = subprocess.run([sys.executable, "-c", EXIT_RACE, "0", port, str(int(handler))], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert peer.wait(timeout=60) == 0
    if handler:
        assert out.returncode == 0, out.stderr[-2000:]
    else:  # the race the handler exists for (a torch that freed these tensors without the GIL would end it)
        assert out.returncode == -6 and "terminate called without an active exception" in out.stderr
