"""The per-node agents (``lightning_mm.fault_tolerance.agent``) on a real TCPStore, each running a real process
for its group: the leader's assignment, borrowing and merging as the table decides, a leader that dies replaced by
another agent, and an agent's death taking its torchrun (and the training process under it) with it.

The agents here tick in this test's thread (one round each in turn) and their commands are small processes that
record the group they were started in (``LMM_REPLICA_GROUP``) and sleep; tests/test_oobleck_agents.py runs them
around real torchrun groups that train."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import lightning_mm as lmm
from lightning_mm.fault_tolerance.agent import Agent, AgentStore, Liveness
from lightning_mm.plan.templates import PipelineTemplate, Templates
from tests.helpers.distributed import _free_port

RECORD = ("import os, sys, time; open(os.path.join(sys.argv[1], os.environ['LMM_AGENT_NODE'] + '_' + "
          "os.environ['LMM_REPLICA_GROUP'] + '_' + str(os.getpid())), 'w').close(); time.sleep(600)")


def _store(port, master=False):
    return dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False, timeout=timedelta(seconds=30))


def _agents(tmp_path, port, groups):
    return {name: Agent(_store(port), name, g, [2, 3], lambda g: [sys.executable, "-c", RECORD, str(tmp_path)],
                        node_timeout=1.5, lease=1.0, env=dict(os.environ))
            for g, names in groups.items() for name in names}


def _tick_until(agents, done, what, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for a in agents:
            a.tick()
        if done():
            return
        time.sleep(0.1)
    pytest.fail(f"agents: {what} did not happen in {timeout:g} s: {[a.log for a in agents]}")


def _running(agents, out):
    """Each agent's group whose process is up and has recorded that group (its environment) in ``out``."""
    return {a.name: a.running for a in agents if a.proc is not None and a.proc.poll() is None
            and os.path.exists(os.path.join(out, f"{a.name}_{a.running}_{a.proc.pid}"))}


def _die(agent):
    """What an agent's death does: its beat stops (no more ticks) and its child gets the parent-death signal."""
    agent.proc.terminate()
    agent.proc.wait()


def test_agents_borrow_and_merge_as_the_table_says_and_survive_their_leaders_death(tmp_path):
    port = _free_port()
    master = _store(port, master=True)
    groups = {0: ["a0", "a1"], 1: ["b0", "b1", "b2"], 2: ["c0", "c1"]}
    agents = _agents(tmp_path, port, groups)
    alive = list(agents.values())
    try:
        everyone = {n: g for g, v in groups.items() for n in v}
        _tick_until(alive, lambda: _running(alive, tmp_path) == everyone, "the start")
        s = AgentStore(master)
        assert s.get("leader")["name"] == "a0" and s.get("assignment")["groups"] == {str(g): v for g, v in
                                                                                      groups.items()}
        # the leader's node is lost: another agent takes the lead, a1 borrows B's last node (B can spare one, C
        # lost no node and stays untouched); b2's process is stopped and started again in group 0
        old_b2 = agents["b2"].proc.pid
        _die(agents["a0"])
        alive.remove(agents["a0"])
        _tick_until(alive, lambda: _running(alive, tmp_path).get("b2") == 0, "the borrow")
        leader = s.get("leader")
        assert leader["name"] != "a0" and leader["term"] == 2
        a = s.get("assignment")
        assert a["groups"] == {"0": ["a1", "b2"], "1": ["b0", "b1"], "2": ["c0", "c1"]} and a["by"] == leader["name"]
        assert agents["b2"].proc.pid != old_b2 and os.path.exists(tmp_path / f"b2_1_{old_b2}")
        c_pids = {n: agents[n].proc.pid for n in ("c0", "c1")}
        # A and B lose a node each: their survivors merge into group 0; C never restarts
        for name in ("a1", "b0"):
            _die(agents[name])
            alive.remove(agents[name])
        _tick_until(alive, lambda: _running(alive, tmp_path) == {"b2": 0, "b1": 0, "c0": 2, "c1": 2}, "the merge")
        a = s.get("assignment")  # the lost nodes stay out, whoever leads
        assert a["groups"] == {"0": ["b2", "b1"], "2": ["c0", "c1"]} and set(a["lost"]) == {"a0", "a1", "b0"}
        assert {n: agents[n].proc.pid for n in ("c0", "c1")} == c_pids
    finally:
        for a in agents.values():
            if a.proc is not None and a.proc.poll() is None:
                a.proc.kill()


def test_two_groups_borrow_through_the_donors_snapshot(tmp_path):
    """Two groups only (A on 2 nodes, B on 3) and a snapshot folder: A's leading node is lost, another agent leads,
    asks B for a snapshot and assigns B's last node to A. B's processes keep running and no process of the new
    assignment starts until the snapshot is recorded (this test records it, as B's group rank 0 would); then b2
    moves. Then a1 is lost too: b2 would merge into B through B's snapshot, which never comes: after the timeout
    the agents record it as failed (the training processes then raise naming it) and b2 starts in B."""
    port = _free_port()
    master = _store(port, master=True)
    groups = {0: ["a0", "a1"], 1: ["b0", "b1", "b2"]}
    agents = {name: Agent(_store(port), name, g, [2, 3], lambda g: [sys.executable, "-c", RECORD, str(tmp_path)],
                          node_timeout=1.5, lease=1.0, env=dict(os.environ), snapshot_dir=str(tmp_path / "snap"),
                          snapshot_timeout=8.0)
              for g, names in groups.items() for name in names}
    alive = list(agents.values())
    try:
        everyone = {n: g for g, v in groups.items() for n in v}
        _tick_until(alive, lambda: _running(alive, tmp_path) == everyone, "the start")
        s = AgentStore(master)
        pids = {n: agents[n].proc.pid for n in everyone}
        _die(agents["a0"])
        alive.remove(agents["a0"])
        _tick_until(alive, lambda: (s.get("assignment") or {}).get("snapshot") is not None, "the request")
        a = s.get("assignment")
        assert a["groups"] == {"0": ["a1", "b2"], "1": ["b0", "b1"]} and s.get("leader")["term"] == 2
        assert a["snapshot"] == {"epoch": a["epoch"], "group": 1, "path": str(tmp_path / "snap" / f"epoch{a['epoch']}")}
        assert s.get("snapshot/request/1") == a["snapshot"]  # what B's training processes read
        deadline = time.time() + 3.0  # not recorded: B's processes go on, b2 does not move
        while time.time() < deadline:
            for agent in alive:
                agent.tick()
            time.sleep(0.1)
        rest = ("a1", "b0", "b1", "b2")
        assert {n: agents[n].proc.pid for n in rest} == {n: pids[n] for n in rest} and agents["b2"].running == 1
        recorded = time.time()
        s.set(f"snapshot/done/{a['epoch']}", {"step": 7, "path": a["snapshot"]["path"], "group": 1})
        _tick_until(alive, lambda: _running(alive, tmp_path).get("b2") == 0, "the move after the snapshot")
        moved = agents["b2"].proc.pid
        assert moved != pids["b2"] and os.path.getmtime(tmp_path / f"b2_0_{moved}") >= recorded - 0.05
        assert {n: agents[n].proc.pid for n in rest[:3]} == {n: pids[n] for n in rest[:3]}
        _die(agents["a1"])
        alive.remove(agents["a1"])
        _tick_until(alive, lambda: _running(alive, tmp_path).get("b2") == 1, "the merge after the timeout")
        merged = s.get("assignment")
        assert merged["groups"] == {"1": ["b0", "b1", "b2"]} and merged["snapshot"]["group"] == 1
        assert merged["snapshot"]["epoch"] > a["epoch"]
        assert "within 8 s" in s.get(f"snapshot/done/{merged['snapshot']['epoch']}")["failed"]
    finally:
        for a in agents.values():
            if a.proc is not None and a.proc.poll() is None:
                a.proc.kill()


def test_liveness_uses_the_judges_clock_and_a_new_leader_gives_every_node_the_timeout():
    now = [0.0]
    live = Liveness(2.0, clock=lambda: now[0])
    assert live.alive("n", 5)
    now[0] = 1.9
    assert live.alive("n", 5)
    now[0] = 2.1
    assert not live.alive("n", 5) and live.alive("n", 6)  # the counter moved: alive again from now


def _templates(path):
    def template(n):
        return PipelineTemplate(nodes=n, devices_per_node=1, specs={"language_model": lmm.ParallelSpec(pp=1)},
                                partition={"language_model": (4,)})
    Templates((template(1), template(2)), failures=1).save(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_agents_death_ends_its_torchrun_and_the_training_process_under_it(tmp_path):
    """``lightning-mm agent`` around a real torchrun (one node, 1-node template): SIGKILL the agent and torchrun
    (parent-death signal) stops the worker."""
    port = _free_port()
    master = _store(port, master=True)
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\nopen(sys.argv[1] + '/worker_' + os.environ['LMM_REPLICA_GROUP'] + '_' "
                      "+ str(os.getpid()), 'w').close()\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", "lightning_mm.trainer.cli", "agent", "--store", f"127.0.0.1:{port}", "--node",
           "n0", "--group", "3", "--templates", _templates(tmp_path / "t.yaml"), "--", "--nproc-per-node", "1",
           "--monitor-interval", "0.5", str(script), str(tmp_path)]
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600  # imports and torchrun's start on a loaded machine
        while not [f for f in os.listdir(tmp_path) if f.startswith("worker_3_")]:
            assert agent.poll() is None and time.time() < deadline, (tmp_path / "agent.log").read_text()
            time.sleep(0.2)
        worker = int([f for f in os.listdir(tmp_path) if f.startswith("worker_3_")][0].rsplit("_", 1)[1])
        assert AgentStore(master).get("assignment")["groups"] == {"3": ["n0"]}
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.time() + 60
        while _alive(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(worker)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_snapshot_folder_that_cannot_be_created_is_named_before_anything_starts(tmp_path, capsys):
    from lightning_mm.fault_tolerance.agent import agent_main

    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as e:
        agent_main(["--store", "127.0.0.1:1", "--node", "n0", "--group", "0", "--templates", "t.yaml",
                    "--snapshot-dir", str(tmp_path / "a_file" / "snapshots"), "--", "train.py"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--snapshot-dir" in err and "cannot be created" in err and "every node can write" in err
