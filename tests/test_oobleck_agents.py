"""Nodes that move between replica groups (Oobleck's borrowing and merging) under ``lightning-mm agent``: real
torchrun groups of the tests' tiny model (``tests/helpers/ft_case.py``), gloo on CPU, a torchft lighthouse and one
TCPStore in this process (the agents' keys and every group's rendezvous; it outlives the nodes). A node is one
agent around one torchrun of one rank; templates for 2 nodes (LLM pp 2) and 3 nodes (pp 3).

In both tests the node lost for good is the one whose agent leads (started first, so it takes the lead), so they
also show that the leader's death does not stop training: another agent takes the lead and plans the move. Each
group is compared with one process trained on the same global batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.fault_tolerance.agent import AgentStore
from tests.helpers.checkpoint_runs import case_env
from tests.helpers.distributed import _free_port
from tests.test_fault_tolerance import CASE, _assert_equal_to_reference, _log, _params, _reference, _wait
from tests.test_fault_tolerance import lighthouse  # noqa: F401  (the fixture)

pytest.importorskip("torchft")
STEPS = 10


def _templates(path) -> str:
    from lightning_mm.plan.templates import PipelineTemplate, Templates

    def template(nodes, cuts, time):
        return PipelineTemplate(nodes=nodes, devices_per_node=1, specs={"vision": lmm.ParallelSpec(),
                                "language_model": lmm.ParallelSpec(pp=nodes)}, partition={"language_model": cuts},
                                placement="replicated", microbatch_time=time)

    Templates((template(2, (2, 2), 1.0), template(3, (2, 1, 1), 0.5)), failures=1).save(path)
    return str(path)


def _agent(cfg: dict, node: str, group: int, store_port: int, templates: str) -> subprocess.Popen:
    env = {**case_env(), "PYTHONFAULTHANDLER": "1"}
    snapshots = ["--snapshot-dir", os.path.join(cfg["out"], "snapshots")] if cfg.get("snapshots") else []
    cmd = [sys.executable, "-m", "lightning_mm.trainer.cli", "agent", "--store", f"127.0.0.1:{store_port}",
           "--node", node, "--group", str(group), "--templates", templates, "--node-timeout", "6", "--lease", "3",
           "--last-call", "5", *snapshots,
           "--", "--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.5", CASE, json.dumps(cfg)]
    log = open(os.path.join(cfg["out"], f"launch_{node}.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cfg["out"],
                            start_new_session=True)


def _start(out, groups, cfgs, store_port, templates, store):
    """The agents, the first one alone until it leads."""
    procs, first = {}, groups[0][0]
    procs[first] = _agent(cfgs(0), first, 0, store_port, templates)
    s, deadline = AgentStore(store), time.time() + 900  # its imports alone took 5 min at load average 20
    while (s.get("leader") or {}).get("name") != first:
        assert procs[first].poll() is None and time.time() < deadline, _log(out, f"launch_{first}.log")
        time.sleep(0.5)
    for g, nodes in groups.items():
        for node in nodes:
            if node != first:
                procs[node] = _agent(cfgs(g), node, g, store_port, templates)
    return procs


def _result(out, group) -> dict:
    with open(os.path.join(out, f"result_{group}.json")) as f:
        return json.load(f)


def _run(tmp_path, lighthouse, groups, kills, global_batch, keeper, rejoin, extra=None):  # noqa: F811
    out, (host, port) = str(tmp_path), lighthouse
    store_port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    templates = _templates(tmp_path / "templates.yaml")
    base = {"mode": "group", "group": None, "lighthouse": f"{host}:{port}", "groups": len(groups), "steps": STEPS,
            "out": out, "timeout": 10.0, "quorum_timeout": 300.0, "global_batch": global_batch,
            "templates": templates, "devices": 1, "elastic": True, "kill": kills}
    restarted, healed = [f"restarted_{g}" for g in rejoin], [f"healed_{g}" for g in rejoin]

    def cfgs(g):  # the group kept untouched waits until the others restarted, and paces its steps until healed
        if extra is not None:  # or each group's own settings
            return {**base, **extra.get(g, {})}
        if g != keeper:
            return base
        return {**base, "wait_for": {"step": 5, "marker": restarted, "max": 400},
                "pace": {"until": healed, "after": 5, "seconds": 2.0, "max": 300}}

    procs = _start(out, groups, cfgs, store_port, templates, store)
    codes = dict(zip(procs, _wait(list(procs.values()), 1500)))
    assignment = AgentStore(store).get("assignment")
    leader = AgentStore(store).get("leader")
    snapshot = assignment.get("snapshot")
    done = AgentStore(store).get(f"snapshot/done/{snapshot['epoch']}") if snapshot else None
    del store
    return out, codes, {**assignment, "done": done}, leader


def _check(out, codes, leader, lost, keeper, groups_after):
    assert all(codes[n] == 0 for n in codes if n not in lost), (codes, _log(out, "launch_*.log"))
    assert leader["name"] not in lost and leader["term"] >= 2  # the first leader died with its node
    rk = None
    if keeper is not None:  # the untouched group never stopped: every step once, no restart
        rk = _result(out, keeper)
        assert rk["restart"] == 0 and [s for s, _ in rk["steps"]] == list(range(1, STEPS + 1))
    ref = _reference(out, STEPS)
    for g in groups_after:
        r = _result(out, g)
        assert r["global_step"] == STEPS
        _assert_equal_to_reference(_params(out, g), ref)
    return rk


@pytest.mark.slow
@pytest.mark.timeout(2700)
@pytest.mark.combines("ft", "pipeline", "placement")  # groups of LLM pp 2 and pp 3, the encoder in every stage
def test_a_group_below_its_smallest_template_borrows_a_node_and_both_re_form(tmp_path, lighthouse):  # noqa: F811
    """A on 2 nodes, B on 3, C on 2. A's leading node is lost for good inside step 3: another agent takes the lead,
    A (1 node, below the 2-node template) borrows B's last node (B can spare one: its 2-node template is valid), B
    re-forms at 2 nodes and A at 2, both heal by name from C (which lost no node and is left untouched: it
    redoes step 3 and trains on), the global batch of 6 microbatches is re-split (A 2, B 3, C 1 by the templates'
    times; then 2 + 2 + 2), and every group equals one process."""
    groups = {0: ["a0", "a1"], 1: ["b0", "b1", "b2"], 2: ["c0", "c1"]}
    kills = [{"node": "a0", "step": 3, "where": "backward", "agent": True}]
    out, codes, assignment, leader = _run(tmp_path, lighthouse, groups, kills, 6, keeper=2, rejoin=[0, 1])
    a = assignment["groups"]  # B's last node to register is the one it gives
    assert a["0"][0] == "a1" and len(a["0"]) == 2 and sorted(a["1"] + a["0"][1:]) == ["b0", "b1", "b2"], a
    assert sorted(a["2"]) == ["c0", "c1"]  # C's nodes in the order they registered
    rc = _check(out, codes, leader, {"a0"}, 2, [0, 1, 2])
    assert 1 in rc["shares"].values() and rc["shares"][str(STEPS - 1)] == 2  # 2 + 3 + 1 while B had 3 nodes
    for g in (0, 1):
        r = _result(out, g)
        assert r["world_size"] == 2 and r["stats"]["healed_steps"] == 1
        healed = [e for e in r["events"] if e["event"] == "healed"][0]
        assert healed["by"] == "name" and 3 <= healed["step"] < STEPS


@pytest.mark.slow
@pytest.mark.timeout(2700)
@pytest.mark.combines("ft", "pipeline", "placement")  # groups of LLM pp 2, the encoder in every stage
def test_two_groups_below_their_smallest_template_merge_and_the_third_never_stops(tmp_path, lighthouse):  # noqa: F811
    """A, B and C on 2 nodes each. A's leading node and one of B's are lost for good inside step 3: another agent
    takes the lead, the two survivors merge into group 0 (the lower id) at the 2-node template, heal by name from C
    and train on; C never stops; the global batch of 4 microbatches goes 2 + 1 + 1, then 2 + 2; every group that
    trains to the end equals one process."""
    groups = {0: ["a0", "a1"], 1: ["b0", "b1"], 2: ["c0", "c1"]}
    kills = [{"node": "a0", "step": 3, "where": "backward", "agent": True},
             {"node": "b1", "step": 3, "where": "backward", "agent": True}]
    out, codes, assignment, leader = _run(tmp_path, lighthouse, groups, kills, 4, keeper=2, rejoin=[0])
    a = assignment["groups"]
    assert a["0"] == ["a1", "b0"] and sorted(a["2"]) == ["c0", "c1"] and set(a) == {"0", "2"}, assignment
    rc = _check(out, codes, leader, {"a0", "b1"}, 2, [0, 2])
    assert 1 in rc["shares"].values() and rc["shares"][str(STEPS - 1)] == 2
    r0 = _result(out, 0)
    assert r0["world_size"] == 2 and r0["stats"]["healed_steps"] == 1
    assert [e for e in r0["events"] if e["event"] == "healed"][0]["by"] == "name"


@pytest.mark.slow
@pytest.mark.timeout(2700)
@pytest.mark.combines("ft", "pipeline", "placement", "checkpoint")  # pp 3 -> pp 2 through B's snapshot
def test_two_groups_borrow_through_the_donors_snapshot(tmp_path, lighthouse):  # noqa: F811
    """Two groups only, A on 2 nodes and B on 3, agents with a snapshot folder. A's leading node is lost for good
    inside step 3: no group is left to heal from once both re-form, so the new leader asks B (healthy, training on
    alone) for a snapshot; B writes it at a step boundary (pp 3, by parameter name) and only then stops; B's last
    node moves to A; both groups re-form at the 2-node template (pp 2), load the snapshot before their first
    quorum, the global batch of 6 microbatches is re-split 3 + 3, and both groups equal one process."""
    groups = {0: ["a0", "a1"], 1: ["b0", "b1", "b2"]}
    kills = [{"node": "a0", "step": 3, "where": "backward", "agent": True}]
    # B paces its lone steps until it has written the snapshot; the re-formed groups start their first step once
    # both are up (restarted by torchrun), so that they train together (one that came first would take every
    # step alone until the other healed from it: still one process's math, but no re-split to check)
    hold = {"if": "snapshots/epoch*", "until": ["restarted_0", "restarted_1"], "max": 900}
    extra = {g: {"snapshots": True, "hold": hold} for g in groups}
    extra[1]["pace"] = {"until": "snapshots/epoch*", "after": 3, "seconds": 10.0, "max": 600}
    out, codes, assignment, leader = _run(tmp_path, lighthouse, groups, kills, 6, None, [], extra=extra)
    a, done = assignment["groups"], assignment["done"]
    assert a["0"][0] == "a1" and len(a["0"]) == 2 and sorted(a["1"] + a["0"][1:]) == ["b0", "b1", "b2"], a
    assert assignment["snapshot"]["group"] == 1 and 3 <= done["step"] < STEPS, assignment
    with open(os.path.join(done["path"], "layout.json")) as f:
        assert json.load(f)["world_size"] == 3  # written by B's 3 stages, loaded by 2
    _check(out, codes, leader, {"a0"}, None, [0, 1])
    for g in (0, 1):
        r = _result(out, g)
        assert r["world_size"] == 2 and r["shares"][str(STEPS - 1)] == 3, r["shares"]
        loaded = [e for e in r["events"] if e["event"] == "snapshot_loaded"]
        assert [e["step"] for e in loaded] == [done["step"]] and loaded[0]["path"] == done["path"]
        assert min(s for s, _ in r["steps"]) > done["step"]  # went on from the snapshot's step
        with open(os.path.join(out, "killed_at")) as f:
            print(f"group {g}: snapshot of step {done['step']} loaded {loaded[0]['at'] - float(f.read()):.1f} s "
                  f"after the kill; shares {r['shares']}")
