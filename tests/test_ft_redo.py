"""The early redo's fallback (``lightning_mm/fault_tolerance/redo.py``): a survivor computes the redo of a step
with the share the quorum without the lost group would give it, but the real quorum is another one, so that
computation is dropped and the step is computed again with the real quorum's share.

Deterministic by the lighthouse's own rule (torchft 0.2.0): it forms a quorum without a group of the last quorum
only once that group's heartbeat is older than its heartbeat timeout, and never from half or fewer of the replicas
it sees heartbeating. With a heartbeat timeout far longer than a restart, the survivor's quorum request waits until
the lost group has restarted and asks too; the quorum is then both groups, never the survivor alone, whatever
the machine's load. No sleep orders anything.
"""

from __future__ import annotations

import pytest

from tests.test_fault_tolerance import (STEPS, _assert_both_groups_equal_the_reference, _log, _run_two_groups,
                                        lighthouse_server)

torchft = pytest.importorskip("torchft")

PATIENT_HEARTBEAT_S = 1800.0  # far longer than a group's restart, even at a load of 10 on 2 cores (3-4 minutes)


@pytest.fixture
def patient_lighthouse():
    """A lighthouse that counts a silent group alive for ``PATIENT_HEARTBEAT_S``."""
    with lighthouse_server(PATIENT_HEARTBEAT_S) as address:
        yield address


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.combines("ft", "pipeline", "placement")  # group 0: LLM pp 2, the encoder replicated into its stages
def test_a_lost_group_back_before_the_quorum_makes_the_early_redo_fall_back_to_the_real_share(
        tmp_path, patient_lighthouse):
    """Group 0 (LLM pp 2, 2 ranks) and group 1 (pp 1, 1 rank) share ``global_batch=4`` (2 + 2). Group 0's rank 1
    is SIGKILLed inside step 3, before the cross-group reduction; torchrun restarts group 0. Group 1's reduction
    fails at once and it computes the redo with the whole batch (the quorum it expects: itself alone), then asks
    for the quorum: the lighthouse forms it only when the restarted group 0 asks too. The quorum is both groups,
    so group 1's record shows the expectation did not hold, and its committed step 3 took 2 samples, not 4 (the
    early computation counted as lost time); group 0 heals by name to step 3. Every step is committed once and
    both groups equal one process."""
    kill = {"group": 0, "rank": 1, "step": 3, "where": "backward"}
    patient = {"global_batch": 4, "quorum_timeout": PATIENT_HEARTBEAT_S}  # the survivor waits for the restart
    layouts = (patient, {**patient, "pp": 1, "devices": 1})
    out, codes, results = _run_two_groups(tmp_path, patient_lighthouse, kill, restarts_1=0, wait_rejoin=False,
                                          layouts=layouts, restarts_0=1, wait=1500)
    assert codes == [0, 0], _log(out, "launch_*.log")
    r0, r1 = results[0], results[1]
    assert r1["restart"] == 0 and [s for s, _ in r1["steps"]] == list(range(1, STEPS + 1))
    redos = [e for e in r1["events"] if e["event"] == "redo"]
    assert [e["step"] for e in redos] == [kill["step"]], r1["events"]  # one failed attempt, then one commit
    early = [e for e in r1["events"] if e["event"] == "early_redo"]
    assert [(e["step"], e["held"], e["groups"]) for e in early] == [(kill["step"], False, [0, 1])], r1["events"]
    # the dropped early computation is lost time, beside the failed attempt (and the wait for the quorum)
    assert early[0]["computed"] > 0 and r1["stats"]["lost_seconds"] >= redos[0]["seconds"] + early[0]["computed"]
    # the committed step took the real quorum's share (the expected quorum's would be the whole batch)
    assert r1["shares"][str(kill["step"])] == 2 and r1["shares"][str(kill["step"] - 1)] == 2
    assert r0["restart"] == 1 and r0["global_step"] == STEPS and r0["stats"]["healed_steps"] == 1
    healed = [e for e in r0["events"] if e["event"] == "healed"][0]
    assert healed["by"] == "name" and healed["step"] == kill["step"], r0["events"]
    assert [s for s, _ in r0["steps"]] == list(range(kill["step"] + 1, STEPS + 1))
    assert r0["shares"][str(kill["step"])] == 2
    _assert_both_groups_equal_the_reference(out)
