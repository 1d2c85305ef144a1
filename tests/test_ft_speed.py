"""How fast fault tolerance reacts: a group lost inside a step stalls the survivors for at most the lighthouse's
heartbeat timeout plus one step (not the cross-group ``timeout``), and the training math stays that of one process.

The run is the re-forming case of ``tests/test_fault_tolerance.py``: group 0 on two torchrun agents (``--nnodes
1:2``, the 2-node template: LLM pp 2) beside group 1 (one rank, the 1-node template), ``global_batch=4``; group 0's
second node (its agent and rank) is SIGKILLed inside step 4, after its backward and before the cross-group
reduction, while group 0's first rank is alive and still heartbeating. The cross-group ``timeout`` is 15 s, the
lighthouse's heartbeat timeout 2 s.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from lightning_mm.fault_tolerance import abandon

from tests.helpers.distributed import _free_port
from tests.test_fault_tolerance import HEARTBEAT_S, lighthouse  # noqa: F401  (the fixture: heartbeat 2 s)
from tests.test_fault_tolerance import (_assert_both_groups_equal_the_reference, _launch, _launch_elastic, _log,
                                        _templates, _wait)

torchft = pytest.importorskip("torchft")

TIMEOUT_S, STEPS, KILL_STEP = 15.0, 8, 3


PAGE = """Current quorum_id: 3 <br>
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat
    
  ">
    lmm_group_1:5c0b9a2e-8f0e-4a5e-9d51-0d8c2f1a6b7e: seen 58.588101ms ago
  </li>
  <li class="heartbeat
    old
  ">
    lmm_group_0:0f6e2a1b-3c4d-4e5f-8a9b-1c2d3e4f5a6b: seen 2.587206512s ago
  </li>
</ul>"""


class _Work:
    def __init__(self, done_after: float | None):
        self.done_at = None if done_after is None else time.monotonic() + done_after
        self.waited = False

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self) -> bool:
        self.waited = True
        return True


def test_the_lighthouse_page_names_the_groups_past_their_heartbeat_timeout():
    """torchft 0.2.0's lighthouse status page (as it serves it) read into heartbeats; a group marked old, or no
    longer listed, is lost; an unreadable page loses nobody (the collective's timeout still holds)."""
    beats = abandon.parse_heartbeats(PAGE)
    assert beats == {"lmm_group_1:5c0b9a2e-8f0e-4a5e-9d51-0d8c2f1a6b7e": (pytest.approx(0.058588101), False),
                     "lmm_group_0:0f6e2a1b-3c4d-4e5f-8a9b-1c2d3e4f5a6b": (pytest.approx(2.587206512), True)}
    assert abandon.lost_groups(beats, ["lmm_group_0", "lmm_group_1", "lmm_group_2"]) == ["lmm_group_0", "lmm_group_2"]
    assert abandon.lost_groups(None, ["lmm_group_0"]) == []


def test_a_wait_is_abandoned_at_the_first_check_after_a_peer_is_lost_and_kept_otherwise():
    """``wait_or_abandon`` returns once every work completed (each then waited for its error), and raises
    ``PeerGroupLost`` naming the lost group at the first check after ``lost()`` names it, long before the work."""
    works = [_Work(0.05), _Work(0.1)]
    abandon.wait_or_abandon(works, lambda: [], check_every=0.01)
    assert all(w.waited for w in works)
    calls, start = [], time.monotonic()

    def lost():
        calls.append(time.monotonic() - start)
        return ["lmm_group_0"] if len(calls) >= 3 else []

    with pytest.raises(abandon.PeerGroupLost, match="lmm_group_0 stopped heartbeating"):
        abandon.wait_or_abandon([_Work(None)], lost, check_every=0.05)
    assert len(calls) == 3 and calls[-1] < 1.0


def _steps_log(out: str, group: int) -> list[tuple[int, float, int]]:
    rows = [line.split() for line in open(os.path.join(out, f"steps_{group}.log")) if line.strip()]
    return [(int(s), float(t), int(r)) for s, t, r in rows]


class _LastHeartbeats(threading.Thread):
    """Reads the lighthouse's status page every 0.1 s and keeps each replica's newest heartbeat (wall clock): when
    a group's heartbeats stopped, seen from the lighthouse itself."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.last, self.stop = url, {}, threading.Event()

    def run(self):
        while not self.stop.wait(0.1):
            now, beats = time.time(), abandon.lighthouse_heartbeats(self.url, timeout=1.0)
            for rid, (age, old) in (beats or {}).items():
                if not old:
                    self.last[rid] = max(self.last.get(rid, 0.0), now - age)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.combines("ft", "pipeline", "placement")  # group 0: LLM pp 2, the encoder replicated into its stages
def test_a_group_lost_inside_a_step_stalls_the_survivor_a_heartbeat_and_a_step_not_the_timeout(tmp_path, lighthouse):
    """Every step is applied once and both groups equal one process. Group 1's stall (the kill to its redone step's
    commit) is at most the heartbeat timeout (its quorum without group 0) plus one of its steps alone (the redone
    step takes the whole global batch; it is computed while the lighthouse waits, ``redo.py``): far below the 15 s
    cross-group timeout it waited for before. The timeline (group 0's last heartbeat as the lighthouse saw it,
    group 1's failed vote, its quorum alone, the redone step's commit) is printed."""
    out, (host, port) = str(tmp_path), lighthouse
    store_port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    base = {"mode": "group", "lighthouse": f"{host}:{port}", "groups": 2, "steps": STEPS, "out": out,
            "timeout": TIMEOUT_S, "global_batch": 4, "templates": _templates(tmp_path / "templates.yaml"),
            "wait_rejoin": True, "kill": {"group": 0, "rank": 1, "step": KILL_STEP, "where": "backward",
                                          "agent": True}}
    beats = _LastHeartbeats(f"http://{host}:{port}")
    beats.start()
    group0 = [_launch_elastic({**base, "group": 0, "devices": 1, "elastic": True}, r, store_port) for r in (0, 1)]
    group1 = _launch({**base, "group": 1, "devices": 1}, restarts=0, nproc=1)
    codes = _wait([*group0, group1], 1200)
    beats.stop.set()
    del store
    assert codes[0] == 0 and codes[2] == 0, _log(out, "launch_*.log")
    with open(os.path.join(out, "killed_at")) as f:
        killed = float(f.read())
    with open(os.path.join(out, "result_1.json")) as f:
        r1 = json.load(f)
    rows = _steps_log(out, 1)
    assert [s for s, _, _ in rows] == list(range(1, STEPS + 1)) and r1["stats"]["redone_steps"] >= 1
    with open(os.path.join(out, "result_0.json")) as f:
        r0 = json.load(f)
    assert r0["world_size"] == 1 and r0["stats"]["healed_steps"] == 1
    _assert_both_groups_equal_the_reference(out)
    times = dict((s, t) for s, t, _ in rows)
    step_s = times[KILL_STEP + 2] - times[KILL_STEP + 1]  # one step of group 1 alone (the whole global batch)
    alone = [e["at"] for e in r1["events"] if e["event"] == "quorum" and e["participants"] == 1][0]
    redo = [e["at"] for e in r1["events"] if e["event"] == "redo"][0]
    last_beat = max(t for rid, t in beats.last.items() if rid.startswith("lmm_group_0:") and t < alone)
    stall = times[KILL_STEP + 1] - killed  # the kill to the redone step's commit
    timing = {"group 0's last heartbeat": last_beat - killed, "group 1's vote failed": redo - killed,
              "quorum without group 0": alone - killed, "redone step committed (stall)": stall,
              "a step alone": step_s, "stall - heartbeat timeout - step": stall - HEARTBEAT_S - step_s}
    print("seconds after the kill:", json.dumps({k: round(v, 3) for k, v in timing.items()}))
    early = [e for e in r1["events"] if e["event"] == "early_redo"]  # computed before its quorum formed
    assert [e["held"] for e in early] == [True] and early[0]["groups"] == [1], r1["events"]
    assert stall <= HEARTBEAT_S + step_s, (timing, r1["events"])  # the quorum without group 0, then the redone step
    assert stall < TIMEOUT_S  # before group links: the cross-group timeout at least


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_a_rank_that_ends_without_a_goodbye_is_seen_by_group_rank_0_at_once():
    """Rank 0 (this process) of a 3-rank gloo group with group links: rank 1 says goodbye and exits (a normal end,
    no loss), rank 2 is SIGKILLed; rank 0's link names rank 2 within seconds (not fault_timeout), once, and never
    rank 1."""
    import signal
    import subprocess
    import sys
    import threading

    import torch.distributed as dist

    from lightning_mm.fault_tolerance.links import GroupLinks
    from tests.helpers.checkpoint_runs import case_env

    case = os.path.join(os.path.dirname(__file__), "helpers", "links_case.py")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, case, str(r), "3", str(port), action], env=case_env(),
                              stdout=subprocess.PIPE, text=True) for r, action in ((1, "bye"), (2, "wait"))]
    try:  # the ranks' env:// rendezvous, as here: one store (this process's), the same key prefix
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=3)
        losses, seen = [], threading.Event()
        GroupLinks(0, 3, group=0, on_loss=lambda m: (losses.append((time.monotonic(), m)), seen.set())).start(
            "127.0.0.1")
        assert [p.stdout.readline().strip() for p in procs] == ["up", "up"]
        assert procs[0].wait(timeout=60) == 0 and not seen.wait(2.0)  # a goodbye is no loss
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        assert seen.wait(30.0)
        assert losses[0][0] - killed < 3.0, losses  # the watchdog would take fault_timeout
        assert len(losses) == 1 and "rank 2's process ended" in losses[0][1] and "rank 1" not in losses[0][1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        dist.destroy_process_group()
