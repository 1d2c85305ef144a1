"""Faults: a lost rank ends every other rank with an error naming it in bounded time; checkpoints survive."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from lightning_mm.fault_tolerance.watchdog import (FAULT_EXIT_CODE, FaultWatchdog, WaitRecord, check_finite_loss,
                                                   collective_tails, unentered_collectives, unentered_message)
from tests.helpers.checkpoint_runs import CASE, case_env, reference, run_case

FAULT_TIMEOUT = 3.0
SLACK = 30.0  # startup of the error path, interpreter exit, a loaded 2-core machine (without the watchdog a frozen
#               rank holds the others for the process-group timeout, 600 s: the bound still tells the two apart)
UNIT_TIMEOUT = 1.5  # the in-process watchdog tests: long beside a thread's scheduling delays on a loaded machine


# ------------------------------------------------------------------------------------------------ the watchdog
def _pair(store, timeout=UNIT_TIMEOUT):
    faults = {0: [], 1: []}
    dogs = [FaultWatchdog(r, 2, timeout, interval=0.05, store=store, on_fault=faults[r].append) for r in (0, 1)]
    return dogs, faults


def _wait(cond, seconds=UNIT_TIMEOUT + 15):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_watchdog_names_a_rank_that_stops_beating():
    dogs, faults = _pair(dist.HashStore())
    for d in dogs:
        d.start()
    time.sleep(0.3)
    assert faults == {0: [], 1: []}
    dogs[1].stop()  # rank 1 goes silent (killed or frozen)
    t0 = time.monotonic()
    assert _wait(lambda: faults[0]), "rank 0 never noticed"
    # not before its timeout (less the last beat's age, which scheduling on a loaded machine can stretch), and
    # bounded after it
    assert UNIT_TIMEOUT / 2 < time.monotonic() - t0 < UNIT_TIMEOUT + 10
    assert "rank 1 stopped sending heartbeats" in faults[0][0]
    dogs[0].stop()


def test_watchdog_names_a_rank_that_raised_and_normal_end_is_quiet():
    dogs, faults = _pair(dist.HashStore())
    for d in dogs:
        d.start()
    dogs[1].report_failure(RuntimeError("boom"))
    assert _wait(lambda: faults[0])
    assert "rank 1 raised RuntimeError: boom" in faults[0][0] and faults[1] == []
    dogs, faults = _pair(dist.HashStore())
    for d in dogs:
        d.start()
    threads = [threading.Thread(target=d.finish) for d in dogs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    time.sleep(UNIT_TIMEOUT + 0.5)  # longer than the timeout: a finished peer is never reported
    assert faults == {0: [], 1: []}


def test_nan_guard():
    assert check_finite_loss(torch.tensor(1.0), 3, "stop")
    assert not check_finite_loss(torch.tensor(float("nan")), 3, "skip")
    with pytest.raises(FloatingPointError, match="the loss is inf at step 7"):
        check_finite_loss(torch.tensor(float("inf")), 7, "stop")
    with pytest.raises(ValueError, match="nan_guard must be None, 'skip' or 'stop'"):
        check_finite_loss(torch.tensor(1.0), 0, "ignore")


# ------------------------------------------------------------------------------------------------ real runs
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _run_with_fault(d: str, kind: str, rank: int):
    """A 4-process dp2 run that checkpoints at step 2 and loses ``rank`` after step 3; returns (seconds from the
    fault to every other process gone, combined output, main exit code)."""
    os.makedirs(f"{d}/pids", exist_ok=True)
    cfg = {"layout": "dp2", "steps": 6, "out": f"{d}/out.json", "ckpt_dir": f"{d}/ckpts", "save_every": 2,
           kind: {"rank": rank, "step": 3}, "fault_timeout": FAULT_TIMEOUT, "pids": f"{d}/pids"}
    proc = subprocess.Popen([sys.executable, CASE, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=case_env())
    output = []
    reader = threading.Thread(target=lambda: output.append(proc.communicate()[0]))
    reader.start()
    marker = f"{d}/pids/killed_at"
    deadline = time.time() + 300
    while not os.path.exists(marker) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert os.path.exists(marker), "the fault was never injected"
    time.sleep(0.2)
    faulted_at = float(open(marker).read())
    pids = {r: int(open(f"{d}/pids/{r}.pid").read()) for r in range(4)}
    deadline = time.time() + FAULT_TIMEOUT + 60
    while any(_alive(pids[r]) for r in pids if r != rank) and time.time() < deadline:
        time.sleep(0.05)
    gone_after = time.time() - faulted_at
    print(f"{kind} rank {rank}: every other process gone {gone_after:.2f} s after the fault")
    for r, pid in pids.items():  # never leave a process behind, even when the test fails
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    reader.join(30)
    return gone_after, output[0] if output else "", proc.returncode


@pytest.mark.slow
def test_frozen_rank_ends_every_other_rank_and_last_checkpoint_resumes(tmp_path):
    """SIGSTOP keeps the rank's sockets open (like a lost node or a hung GPU): only the watchdog can notice."""
    gone_after, output, code = _run_with_fault(str(tmp_path), "hang", 1)
    assert gone_after < FAULT_TIMEOUT + SLACK, f"survivors took {gone_after:.1f} s\n{output[-3000:]}"
    assert "lightning-mm fault: rank 1 stopped sending heartbeats" in output, output[-3000:]
    assert code != 0
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step=2.ckpt"]
    ref = reference()
    resumed = run_case({"layout": "pp2", "steps": 6, "out": str(tmp_path / "resumed.json"),
                        "resume": str(tmp_path / "ckpts" / "step=2.ckpt")})
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ref["pp2"][2:]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.ci
def test_killed_rank_ends_every_process_with_an_error(tmp_path):
    gone_after, output, code = _run_with_fault(str(tmp_path), "kill", 0)
    assert gone_after < FAULT_TIMEOUT + SLACK, f"survivors took {gone_after:.1f} s\n{output[-3000:]}"
    assert code == -signal.SIGKILL
    assert "lightning-mm fault: cannot reach the rendezvous store hosted by rank 0" in output, output[-3000:]


# ------------------------------------------------------------------------------------------------ stuck ranks
def _three(store, timeout=UNIT_TIMEOUT):
    faults = {r: [] for r in range(3)}
    waits = {r: WaitRecord() for r in range(3)}
    labels = {0: "stage vision.0", 1: "stage language_model.0", 2: "stage language_model.1"}
    dogs = [FaultWatchdog(r, 3, timeout, interval=0.05, store=store, on_fault=faults[r].append, labels=labels,
                          waits=waits[r]) for r in range(3)]
    return dogs, faults, waits


def test_watchdog_names_a_rank_that_is_alive_but_stuck():
    """Rank 0 waits on rank 1 (P2P), rank 1 waits in a collective with everyone, rank 2 beats but waits on
    nothing: rank 2 is named, with its stage and the operation the others wait in; rank 2 prints its stack."""
    dogs, faults, waits = _three(dist.HashStore())
    for d in dogs:
        d.start()
    with waits[0].waiting("recv hidden", peer=1), waits[1].waiting("all_reduce loss", group=None):
        t0 = time.monotonic()
        assert _wait(lambda: all(faults.values()))
        took = time.monotonic() - t0
    assert UNIT_TIMEOUT <= took < UNIT_TIMEOUT + 10
    for r in range(3):
        assert faults[r][0].startswith("rank 2 (stage language_model.1) is stuck: alive"), faults[r][0]
        assert "waits" in faults[r][0] or "waited" in faults[r][0]
    text = faults[0][0]
    assert "recv hidden from rank 1 (stage language_model.0)" in text or "all_reduce loss with every rank" in text
    assert "main thread is at" in faults[2][0] and "main thread is at" not in faults[0][0]


def test_a_rank_that_names_a_stuck_one_ends_only_after_the_stuck_rank_wrote_its_stack():
    """Once one rank ends, the launcher kills the others (Lightning's child-process observer, torchrun's agent):
    the rank that names a stuck one must not end before the stuck rank has written its stack, even when the stuck
    rank's watchdog beats ten times more slowly (its stack would come one slow beat after the namer ended)."""
    store, faults, waits = dist.HashStore(), {0: [], 1: []}, WaitRecord()
    stuck = FaultWatchdog(0, 2, UNIT_TIMEOUT, interval=0.5, store=store, on_fault=faults[0].append,
                          waits=WaitRecord())
    namer = FaultWatchdog(1, 2, UNIT_TIMEOUT, interval=0.05, store=store, on_fault=faults[1].append, waits=waits)
    stuck.start()
    namer.start()
    with waits.waiting("recv hidden", peer=0):
        assert _wait(lambda: faults[1])
        namer._thread.join(30)  # where the default on_fault ends the process
        assert faults[0] and "main thread is at" in faults[0][0], faults
    assert faults[1][0].startswith("rank 0 is stuck") and "main thread is at" not in faults[1][0], faults[1]


def test_watchdog_names_waits_that_wait_on_each_other_and_lets_silence_be_a_heartbeat_fault():
    dogs, faults, waits = _three(dist.HashStore())
    for d in dogs:
        d.start()
    with waits[0].waiting("recv hidden", peer=1), waits[1].waiting("broadcast", group=[0, 1]):
        assert _wait(lambda: faults[0] and faults[1])
    assert "ranks wait on each other" in faults[0][0] and "broadcast with ranks [0, 1]" in faults[0][0], faults[0]
    for d in dogs:
        d.stop()
    # a rank that waits on a silent one (killed or frozen): the heartbeat check names it, not "stuck"
    dogs, faults, waits = _three(dist.HashStore())
    for d in dogs:
        d.start()
    dogs[2].stop()
    with waits[0].waiting("recv hidden", peer=2):
        assert _wait(lambda: faults[0])
    assert "rank 2 stopped sending heartbeats" in faults[0][0], faults[0]
    for d in dogs:
        d.stop()


def _group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


STUCK_TIMEOUT = 5.0


def _run_stuck_case(cfg: dict) -> tuple[float, str, int]:
    """Run ``tests/helpers/stuck_case.py`` with ``cfg`` in its own session; returns (seconds from the fault, as the
    case's marker file records it, to every process gone; the combined output; the main process's exit code)."""
    marker = cfg["marker"]
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(CASE), "stuck_case.py"), json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=case_env(),
                            start_new_session=True)
    output = []
    reader = threading.Thread(target=lambda: output.append(proc.communicate()[0]))
    reader.start()
    try:
        deadline = time.time() + 240
        while not os.path.exists(marker) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert os.path.exists(marker), f"the fault was never injected\n{''.join(output)[-3000:]}"
        time.sleep(0.2)
        since = float(open(marker).read())
        deadline = since + cfg["fault_timeout"] + SLACK + 30
        while _group_alive(proc.pid) and time.time() < deadline:
            time.sleep(0.1)
        gone_after = time.time() - since
    finally:
        for pid in _group_alive(proc.pid):  # never leave a process behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
        reader.join(30)
    return gone_after, output[0] if output else "", proc.returncode


@pytest.mark.slow
@pytest.mark.ci
def test_a_rank_stuck_inside_a_step_ends_every_process_naming_it(tmp_path):
    """Rank 0 (it also hosts the rendezvous store) sleeps inside step 2: rank 1 waits on it beyond fault_timeout,
    every process ends within fault_timeout + 30 s, and the message names rank 0, its stage and the wait."""
    cfg = {"rank": 0, "step": 2, "fault_timeout": STUCK_TIMEOUT, "marker": str(tmp_path / "sleeping_since")}
    gone_after, text, code = _run_stuck_case(cfg)
    print(f"every process gone {gone_after:.1f} s after rank 0 started sleeping (fault_timeout={STUCK_TIMEOUT:g} s)")
    assert gone_after < STUCK_TIMEOUT + SLACK, f"took {gone_after:.1f} s\n{text[-3000:]}"
    assert "lightning-mm fault: rank 0 (stage language_model.0) is stuck" in text, text[-3000:]
    assert "while rank 1 (stage language_model.1) has waited" in text, text[-3000:]
    assert "main thread is at" in text and "time.sleep(3600)" in text, text[-3000:]
    assert code != 0


# the stage each rank of a 2-process run holds, per placement (tests/helpers/stuck_case.py)
SKIP_STAGES = {"replicated": ("language_model.0", "language_model.1"), "parallel": ("vision.0", "language_model.0"),
               "colocated": ("encoders.0", "language_model.0")}


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["replicated", "parallel", "colocated"])
def test_a_collective_one_rank_skips_ends_every_process_naming_it(tmp_path, placement):
    """Every rank but rank 1 enters an all-reduce at step 2 and waits for it through its work handle (as FSDP
    waits for its all-gathers: nothing lightning-mm marks); rank 1 skips it and waits in the next step's
    collectives. Every rank beats, none progresses: every process ends within fault_timeout + slack with exit
    code 75 and a message naming the skipped collective, its group and the rank (and stage) that did not arrive."""
    cfg = {"rank": 1, "step": 2, "fault_timeout": STUCK_TIMEOUT, "marker": str(tmp_path / "entered_at"),
           "skip": True, "placement": placement}
    gone_after, text, code = _run_stuck_case(cfg)
    print(f"{placement}: every process gone {gone_after:.1f} s after rank 0 entered the all-reduce rank 1 skipped "
          f"(fault_timeout={STUCK_TIMEOUT:g} s)")
    first, second = SKIP_STAGES[placement]
    assert gone_after < STUCK_TIMEOUT + SLACK, f"took {gone_after:.1f} s\n{text[-3000:]}"
    skipped = re.compile(r"all_reduce #1 of the process group 'skipped-by-one' of every rank \(input sizes \[\[3\]\]\) "
                         r"was entered (\d+\.\d) s ago by " + re.escape(f"rank 0 (stage {first}) but not by rank 1 "
                                                                    f"(stage {second}) (its last there: none)"))
    assert "lightning-mm fault: a collective that not every rank entered: " in text, text[-3000:]
    faults = text.split("lightning-mm fault: ")[1:]  # one per rank; a rank that did not arrive adds its stack
    for rank in (0, 1):  # every rank prints it as it ends, the collective entered longer than fault_timeout ago
        assert any((m := skipped.search(f)) and float(m.group(1)) > STUCK_TIMEOUT
                   and f"stopping rank {rank} instead of" in f for f in faults), (rank, text[-4000:])
    assert "main thread is at" in text, text[-3000:]  # rank 1 (it did not arrive) prints where it is
    assert code == FAULT_EXIT_CODE, (code, text[-3000:])


def test_the_flight_recorder_view_names_the_collective_and_who_did_not_arrive():
    """From flight-recorder entries (torch's format): each rank's last collective per group, and the groups whose
    members stand at different sequence numbers, against the answer worked out by hand."""
    def entry(group, desc, seq, op, sizes, created, p2p=False):
        return {"process_group": [group, desc], "collective_seq_id": seq, "profiling_name": f"gloo:{op}",
                "input_sizes": sizes, "time_created_ns": created, "is_p2p": p2p}
    groups = {"0": [0, 1, 2], "1": [0, 1], "2": [1, 2]}
    entries = {0: [entry("0", "default_pg", 1, "all_reduce", [[1]], 10), entry("1", "dp", 1, "all_gather", [[8]], 20),
                   entry("1", "dp", 2, "all_gather", [[4]], 30)],
               1: [entry("0", "default_pg", 1, "all_reduce", [[1]], 11), entry("1", "dp", 1, "all_gather", [[8]], 21),
                   entry("2", "", 0, "send", [[2]], 22, p2p=True)],
               2: [entry("0", "default_pg", 1, "all_reduce", [[1]], 12)]}
    tails = {r: collective_tails(entries[r], {g: m for g, m in groups.items() if r in m}, capacity=100)
             for r in range(3)}
    assert tails[1]["1"]["seq"] == 1 and tails[1]["2"]["seq"] == 0 and tails[0]["1"]["op"] == "all_gather"
    found = unentered_collectives(tails, {0: 30 + 6_500_000_000, 1: 40, 2: 50})
    assert [(f["group"], f["seq"], f["op"], f["entered"], f["behind"], f["age"]) for f in found] == [
        ("1", 2, "all_gather", [0], {1: (1, "all_gather")}, 6.5)]
    # a full ring buffer may have dropped a group's entries: that group is not judged
    full = collective_tails(entries[2], {"0": [0, 1, 2], "2": [1, 2]}, capacity=1)
    assert full["2"]["seq"] is None
    answers = {r: {"wait": "all_reduce with every rank" if r == 1 else None, "waited": 6.0, "idle": 7.5 - r}
               for r in range(3)}
    message, behind = unentered_message(found, answers, lambda r: f"rank {r}", 3, 5.0)
    assert behind == [1] and message == (
        "a collective that not every rank entered: all_gather #2 of the process group 'dp' of ranks [0, 1] (input "
        "sizes [[4]]) was entered 6.5 s ago by rank 0 but not by rank 1 (its last there: all_gather #1), while rank 1 "
        "has waited 6.0 s in all_reduce with every rank; no rank has begun or ended a step for 5.5 s "
        "(fault_timeout=5 s)")
    answers[1]["wait"] = None  # the rank behind waits on nothing lightning-mm marks: the stuck-rank message
    message, behind = unentered_message(found, answers, lambda r: f"rank {r}", 3, 5.0)
    assert behind == [1] and message.startswith(
        "rank 1 is stuck: alive (heartbeats) but not in any collective or P2P wait that lightning-mm tracks, and never "
        "entered all_gather #2 of the process group 'dp' of ranks [0, 1] (input sizes [[4]]) (entered by rank 0); "), message


def test_a_launched_rank_that_exits_before_the_rendezvous_ends_rank_0_naming_it():
    """Lightning's rank 0 launches the other local ranks, then waits for them in the rendezvous, where no signal
    reaches it: one that already exited must end it with its rank and exit code."""
    from lightning_mm.fault_tolerance.watchdog import launched_ranks_watched

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    faults = []
    try:
        with launched_ranks_watched([alive, dead], interval=0.05, on_fault=faults.append):
            deadline = time.monotonic() + 20
            while not faults and time.monotonic() < deadline:
                time.sleep(0.05)
        assert faults and faults[0].startswith(f"local rank 2 (pid {dead.pid}) exited with code 3 before every rank")
        faults.clear()
        with launched_ranks_watched([alive], interval=0.05, on_fault=faults.append):
            time.sleep(0.3)  # the rendezvous completes while every launched rank lives
        assert faults == []
    finally:
        alive.kill()
