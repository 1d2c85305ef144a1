"""Fault-tolerant replica groups (torchft): the global sampler, bad input, and real failures.

The slow tests start a torchft lighthouse in this process and each replica group as its own torchrun launch
(``python -m torch.distributed.run``, 2 ranks: the LLM in 2 pipeline stages) on loopback addresses, gloo on CPU,
running ``tests/helpers/ft_case.py``; a group's rank is SIGKILLed and the final parameters are compared with one
process trained on the same global batches (SGD with momentum and a step schedule: the healed state includes the
optimiser's buffers and the scheduler).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DistributedSampler

import lightning_mm as lmm
from lightning_mm.fault_tolerance import (FaultTolerance, FaultToleranceError, check_reachable, global_batch_indices,
                                          group_shares, microbatch_plan, parse_address)
from tests.helpers.checkpoint_runs import case_env
from tests.helpers.distributed import _free_port

torchft = pytest.importorskip("torchft")

CASE = os.path.join(os.path.dirname(__file__), "helpers", "ft_case.py")
HEARTBEAT_S = 2.0
STEPS = 8


# ---------------------------------------------------------------------------------------------- pure parts
def test_global_sampler_is_one_distributed_sampler_and_shares_keep_the_global_batch():
    n, g = 23, 4
    ds = DistributedSampler(list(range(n)), num_replicas=1, rank=0, shuffle=True, seed=7, drop_last=False)
    for epoch in range(2):
        ds.set_epoch(epoch)
        order = list(ds)
        for i in range(n // g):
            assert global_batch_indices(epoch * (n // g) + i, n, g, True, 7) == order[i * g:(i + 1) * g]
    assert global_batch_indices(1, n, g, False) == [4, 5, 6, 7]
    for total in (0, 1, 4, 7, 12):
        for members in (1, 2, 3):
            shares = group_shares(total, [1.0] * members)
            assert shares[0][0] == 0 and shares[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
            assert max(b - a for a, b in shares) - min(b - a for a, b in shares) <= 1
    assert group_shares(10, [1.0, 4.0]) == [(0, 2), (2, 10)]
    assert microbatch_plan(4, 1) == [0, 1, 2, 3] and microbatch_plan(4, 2) == [0, 0, 1, 1]
    assert microbatch_plan(5, 2) == [0, 0, 1, 1, 2]  # more rows than usual: more microbatches of about the usual size
    assert microbatch_plan(1, 4) == [0]


def test_settings_are_checked_when_made(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("LMM_REPLICA_GROUP", raising=False)
    assert parse_address("http://localhost:29510") == ("localhost", 29510)
    assert parse_address("[::1]:5") == ("::1", 5)
    for bad in ("localhost", "host:port", ":12", "h:0", "h:70000"):
        with pytest.raises(ValueError, match="host:port"):
            FaultTolerance(lighthouse=bad, replica_group=0)
    with pytest.raises(ValueError, match="lighthouse is not set"):
        FaultTolerance(replica_group=0)
    with pytest.raises(ValueError, match="replica_group is not set"):
        FaultTolerance(lighthouse="localhost:1")
    with pytest.raises(ValueError, match=r"not in 0\.\.1"):
        FaultTolerance(lighthouse="localhost:1", replica_group=2, num_replica_groups=2)
    with pytest.raises(ValueError, match="min_replicas"):
        FaultTolerance(lighthouse="localhost:1", replica_group=0, num_replica_groups=2, min_replicas=3)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "127.0.0.1:9")
    monkeypatch.setenv("LMM_REPLICA_GROUP", "1")
    ft = FaultTolerance(num_replica_groups=2)
    assert (ft.lighthouse, ft.replica_group, ft.url) == ("127.0.0.1:9", 1, "http://127.0.0.1:9")
    strategy = lmm.MultimodalParallelStrategy(fault_tolerance={"lighthouse": "localhost:7", "replica_group": 0})
    assert strategy.fault_tolerance.lighthouse == "localhost:7" and strategy.ft is not None
    with pytest.raises(TypeError, match="unknown fields"):
        lmm.MultimodalParallelStrategy(fault_tolerance={"lighthouse": "localhost:7", "replica_group": 0, "x": 1})
    # re-forming at templates under torchrun needs a rendezvous that republishes the master address every round
    elastic = FaultTolerance(num_replica_groups=2, templates="templates.yaml", global_batch=4)
    assert elastic.elastic_launch_problem({}) is None  # not under torchrun
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in elastic.elastic_launch_problem({"TORCHELASTIC_RUN_ID": "g0"})
    assert elastic.elastic_launch_problem({"TORCHELASTIC_RUN_ID": "g0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) \
        is None
    assert ft.elastic_launch_problem({"TORCHELASTIC_RUN_ID": "g0"}) is None  # no templates: nodes never change


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_unreachable_lighthouse_is_named_after_connect_timeout_and_a_late_one_is_waited_for():
    """Groups started beside their lighthouse try to reach it for ``connect_timeout`` seconds, then name it."""
    import threading

    ft = FaultTolerance(lighthouse=f"127.0.0.1:{_closed_port()}", replica_group=0, connect_timeout=1.0)
    t0 = time.perf_counter()
    with pytest.raises(FaultToleranceError, match="lighthouse at 127.0.0.1:.* is unreachable.*lightning-mm lighthouse"):
        check_reachable(ft)
    assert 1.0 <= time.perf_counter() - t0 < 5
    port = _closed_port()
    server = socket.socket()
    threading.Timer(0.5, lambda: (server.bind(("127.0.0.1", port)), server.listen())).start()
    try:
        check_reachable(FaultTolerance(lighthouse=f"127.0.0.1:{port}", replica_group=0, connect_timeout=10.0))
    finally:
        server.close()


@pytest.mark.parametrize("setting", [
    "unreachable",
    pytest.param("accumulate", marks=pytest.mark.refuses("ft", "accumulation",
                                                         message="accumulate_grad_batches=2 with global_batch"))])
def test_bad_settings_fail_before_training(setting, tmp_path):
    """In one process (devices=1): the error comes from the strategy's setup, before the model is built."""
    import lightning as L

    from tests.helpers.ft_case import build_module

    lighthouse = None
    if setting != "unreachable":
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        address = lighthouse.address() if lighthouse else f"127.0.0.1:{_closed_port()}"
        strategy = lmm.MultimodalParallelStrategy(
            fault_tolerance=FaultTolerance(lighthouse=address, replica_group=0, connect_timeout=1.0,
                                           global_batch=4 if setting == "accumulate" else None))
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            accumulate_grad_batches=2 if setting == "accumulate" else 1, default_root_dir=tmp_path)
        data = lmm.data.SyntheticMultimodalDataModule(num_samples=8, batch_size=2)
        match = {"unreachable": "unreachable", "accumulate": "accumulate_grad_batches=2 with global_batch"}[setting]
        with pytest.raises(FaultToleranceError, match=match):
            trainer.fit(build_module(), data)
        assert strategy.engine is None  # nothing was built
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()


# ---------------------------------------------------------------------------------------------- real failures
@contextlib.contextmanager
def lighthouse_server(heartbeat_s: float):
    """A torchft lighthouse on a free port that counts a silent group alive for ``heartbeat_s``; its address."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=3000, quorum_tick_ms=20,
                              heartbeat_timeout_ms=int(heartbeat_s * 1000))
    try:
        yield parse_address(server.address())
    finally:
        server.shutdown()


@pytest.fixture
def lighthouse():
    with lighthouse_server(HEARTBEAT_S) as address:
        yield address


def _launch(cfg: dict, restarts: int, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
            nproc: int = 2) -> subprocess.Popen:
    env = {**case_env(), "PYTHONFAULTHANDLER": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rdzv = (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port or _free_port()}"] if nnodes == 1 else
            ["--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", str(node_rank)])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "--monitor-interval", "0.5", *rdzv, CASE, json.dumps(cfg)]
    log = open(os.path.join(cfg["out"], f"launch_{cfg.get('group', 0)}_{node_rank}.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cfg["out"],
                            start_new_session=True)


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"the replica groups did not finish in {timeout:g} s")
    return [p.returncode for p in procs]


def _log(out, name) -> str:
    return "".join(open(f).read()[-3000:] for f in sorted(glob.glob(os.path.join(out, name))))


def _params(out, group) -> dict:
    got = {}
    for f in glob.glob(os.path.join(out, f"params_{group}_*.pt")):
        got.update(torch.load(f))
    return got


def _reference(out, steps=STEPS) -> dict:
    env = {**case_env()}
    subprocess.run([sys.executable, CASE, json.dumps({"mode": "reference", "steps": steps, "out": str(out)})],
                   check=True, env=env, cwd=out, capture_output=True, timeout=300)
    return torch.load(os.path.join(out, "reference.pt"))


def _assert_equal_to_reference(got: dict, ref: dict):
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}: {m}")


def _assert_both_groups_equal_the_reference(out, steps=STEPS):
    ref = _reference(out, steps)
    _assert_equal_to_reference(_params(out, 0), ref)
    _assert_equal_to_reference(_params(out, 1), ref)


def _run_two_groups(tmp_path, address, kill, restarts_1, wait_rejoin, layouts=({}, {}), restarts_0=1, wait=420):
    out = str(tmp_path)
    host, port = address
    base = {"mode": "group", "lighthouse": f"{host}:{port}", "groups": 2, "steps": STEPS, "out": out, "kill": kill,
            "wait_rejoin": wait_rejoin, "timeout": 10.0}
    procs = [_launch({**base, "group": g, **layouts[g]}, restarts=restarts_0 if g == 0 else restarts_1,
                     nproc=layouts[g].get("devices", 2)) for g in (0, 1)]
    codes = _wait(procs, wait)
    results = {}
    for g in (0, 1):
        path = os.path.join(out, f"result_{g}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[g] = json.load(f)
    return out, codes, results


def _check_group_0(out, codes, results, kill):
    assert codes[0] == 0, _log(out, "launch_0_*.log")
    r0 = results[0]
    assert r0["restart"] == 0 and r0["global_step"] == STEPS
    steps = [s for s, _ in r0["steps"]]
    assert steps == list(range(1, STEPS + 1))  # one optimiser step per batch: none skipped, none applied twice
    with open(os.path.join(out, "killed_at")) as f:
        killed_at = float(f.read())
    after = [t for s, t in r0["steps"] if s == kill["step"] + 1][0]
    # group 0 waits for the lost group no longer than the lighthouse's heartbeat timeout (+ a step and slack)
    assert after - killed_at < HEARTBEAT_S + 6.0, (after - killed_at, r0)
    return r0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.combines("ft", "pipeline", "placement")  # each group: LLM pp 2, the encoder replicated into its stages
def test_a_killed_group_restarts_heals_from_its_peer_and_the_math_is_the_uninterrupted_run(tmp_path, lighthouse):
    kill = {"group": 1, "rank": 1, "step": 3, "where": "batch_end"}
    out, codes, results = _run_two_groups(tmp_path, lighthouse, kill, restarts_1=1, wait_rejoin=True)
    r0 = _check_group_0(out, codes, results, kill)
    assert codes[1] == 0, _log(out, "launch_1_*.log")
    r1 = results[1]
    assert r1["restart"] == 1 and r1["stats"]["healed_steps"] == 1 and r1["global_step"] == STEPS
    healed = [e for e in r1["events"] if e["event"] == "healed"][0]["step"]
    assert kill["step"] < healed < STEPS and [s for s, _ in r1["steps"]] == list(range(healed + 1, STEPS + 1))
    assert [e["participants"] for e in r0["events"] if e["event"] == "quorum"] == [2, 1, 2]
    metrics = open(glob.glob(os.path.join(out, "logs_0", "**", "metrics.csv"), recursive=True)[0]).read()
    assert "ft/participants" in metrics and "ft/quorum_changes" in metrics
    _assert_both_groups_equal_the_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_lost_inside_a_step_makes_its_peer_redo_that_step(tmp_path, lighthouse):
    kill = {"group": 1, "rank": 1, "step": 3, "where": "backward"}  # before the cross-group gradient sum
    out, codes, results = _run_two_groups(tmp_path, lighthouse, kill, restarts_1=1, wait_rejoin=True)
    r0 = _check_group_0(out, codes, results, kill)
    assert r0["stats"]["redone_steps"] >= 1
    assert all(e["step"] == kill["step"] for e in r0["events"] if e["event"] == "redo")
    assert codes[1] == 0, _log(out, "launch_1_*.log")
    assert results[1]["stats"]["healed_steps"] == 1
    _assert_both_groups_equal_the_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_that_never_returns_leaves_its_share_to_the_survivor(tmp_path, lighthouse):
    kill = {"group": 1, "rank": 1, "step": 3, "where": "batch_end"}
    out, codes, results = _run_two_groups(tmp_path, lighthouse, kill, restarts_1=0, wait_rejoin=False)
    r0 = _check_group_0(out, codes, results, kill)
    assert codes[1] != 0 and 1 not in results
    assert [e["participants"] for e in r0["events"] if e["event"] == "quorum"] == [2, 1]
    _assert_equal_to_reference(_params(out, 0), _reference(out))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replica_groups_with_different_layouts_stop_before_training(tmp_path, lighthouse):
    out, codes, results = _run_two_groups(tmp_path, lighthouse, None, restarts_1=0, wait_rejoin=False,
                                          layouts=({}, {"pp": 1}), restarts_0=0)  # group 1: LLM 1 stage, dp 2
    assert codes[0] != 0 and codes[1] != 0 and not results
    logs = _log(out, "launch_*.log")
    assert "differ in their rank layout" in logs
    assert not glob.glob(os.path.join(out, "params_*"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.combines("ft", "pipeline", "placement")
def test_groups_of_different_pipeline_stages_train_like_one_process(tmp_path, lighthouse):
    """Group 0: the LLM in 2 stages on 2 ranks; group 1: the whole model on 1 rank. With ``global_batch`` each
    layer's gradient is reduced with the other group's holder of that layer: both equal one process."""
    layouts = ({"global_batch": 4}, {"global_batch": 4, "pp": 1, "devices": 1})
    out, codes, results = _run_two_groups(tmp_path, lighthouse, None, restarts_1=0, wait_rejoin=False,
                                          layouts=layouts, restarts_0=0)
    assert codes == [0, 0], _log(out, "launch_*.log")
    assert results[0]["global_step"] == results[1]["global_step"] == STEPS
    assert [e["participants"] for e in results[0]["events"] if e["event"] == "quorum"] == [2]
    _assert_both_groups_equal_the_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_of_another_layout_heals_by_name_after_losing_a_rank_inside_a_step(tmp_path, lighthouse):
    """Group 0 (LLM pp 2) loses rank 1 inside step 3; group 1 (pp 1, one rank) redoes that step alone. Group 0
    restarts at step 0 and heals from group 1 layer by layer by name (their stage boundaries differ: group 1's one
    rank holds both of group 0's stages), optimiser buffers and scheduler included, and rejoins: both equal one
    process."""
    kill = {"group": 0, "rank": 1, "step": 3, "where": "backward"}
    layouts = ({"global_batch": 4}, {"global_batch": 4, "pp": 1, "devices": 1})
    out, codes, results = _run_two_groups(tmp_path, lighthouse, kill, restarts_1=0, wait_rejoin=True,
                                          layouts=layouts, restarts_0=1)
    assert codes == [0, 0], _log(out, "launch_*.log")
    r0, r1 = results[0], results[1]
    assert r1["restart"] == 0 and r1["global_step"] == STEPS and r1["stats"]["redone_steps"] >= 1
    assert r0["restart"] == 1 and r0["global_step"] == STEPS and r0["stats"]["healed_steps"] == 1
    healed = [e for e in r0["events"] if e["event"] == "healed"][0]
    assert healed["by"] == "name" and kill["step"] <= healed["step"] < STEPS
    _assert_both_groups_equal_the_reference(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_data_parallel_group_beside_a_pipeline_group_heals_its_copies_by_name(tmp_path, lighthouse):
    """Group 0: the LLM in 2 stages; group 1: the whole model on 2 data-parallel ranks (a holder and its copy).
    Group 1's copy is killed inside step 3 and the group restarts: its holder heals by name from group 0, its copy
    from its holder, and both groups equal one process (the synced gradients reach the copy every step)."""
    kill = {"group": 1, "rank": 1, "step": 3, "where": "backward"}
    layouts = ({"global_batch": 4}, {"global_batch": 4, "pp": 1})
    out, codes, results = _run_two_groups(tmp_path, lighthouse, kill, restarts_1=1, wait_rejoin=True,
                                          layouts=layouts, restarts_0=0)
    assert codes == [0, 0], _log(out, "launch_*.log")
    assert results[1]["restart"] == 1 and results[1]["stats"]["healed_steps"] == 1
    assert results[0]["global_step"] == results[1]["global_step"] == STEPS
    ref = _reference(out)
    _assert_equal_to_reference(_params(out, 0), ref)
    copies = sorted(glob.glob(os.path.join(out, "params_1_*.pt")))
    assert len(copies) == 2
    for f in copies:  # the holder and its copy each
        _assert_equal_to_reference(torch.load(f), ref)


def _templates(path) -> str:
    """Two templates of 1-device nodes: 1 node runs the whole model (planned twice as slow per microbatch), 2 nodes
    run the LLM in 2 stages."""
    from lightning_mm.plan.templates import PipelineTemplate, Templates

    def template(nodes, pp, time):
        return PipelineTemplate(nodes=nodes, devices_per_node=1, specs={"vision": lmm.ParallelSpec(),
                                "language_model": lmm.ParallelSpec(pp=pp)},
                                partition={"language_model": (4,) if pp == 1 else (2, 2)}, placement="replicated",
                                microbatch_time=time)

    Templates((template(1, 1, 2.0), template(2, 2, 1.0)), failures=1).save(path)
    return str(path)


def _launch_elastic(cfg: dict, node_rank: int, endpoint: int, last_call: int = 5) -> subprocess.Popen:
    """One node (torchrun agent, 1 rank) of a group launched with ``--nnodes 1:2``; the rendezvous store is the
    test's, so that it outlives any node. A lost node's agent is dropped from the rendezvous after 3 missed
    keep-alives of 1 s (torchrun's default: 3 of 5 s), and a round waits ``last_call`` seconds for more nodes."""
    # torchrun's shared rendezvous store does not republish the master address when the rank-0 agent stays rank 0
    # across a membership change (a node joining); the documented opt-out publishes it every round
    env = {**case_env(), "PYTHONFAULTHANDLER": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--max-restarts", "2", "--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-id", "group0",
           "--rdzv-endpoint", f"127.0.0.1:{endpoint}", "--rdzv-conf",
           f"is_host=false,last_call_timeout={last_call},keep_alive_interval=1,keep_alive_max_attempt=3",
           CASE, json.dumps(cfg)]
    log = open(os.path.join(cfg["out"], f"launch_{cfg['group']}_{node_rank}.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cfg["out"],
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_group_that_loses_a_node_re_forms_at_its_smaller_template(tmp_path, lighthouse):
    """Group 0 runs on two torchrun agents (``--nnodes 1:2``, the 2-node template: LLM pp 2) beside group 1 (one
    rank, the 1-node template); the shares of the global batch follow the templates' speeds (3 + 1 samples). Group
    0's second node is lost for good inside step 3: group 1 redoes that step alone and never stops; group 0's
    surviving agent re-forms at the 1-node template, heals by name from group 1 and trains on. Each step is applied
    once, and both groups equal one process."""
    out, (host, port) = str(tmp_path), lighthouse
    store_port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    templates = _templates(tmp_path / "templates.yaml")
    base = {"mode": "group", "lighthouse": f"{host}:{port}", "groups": 2, "steps": STEPS, "out": out,
            "timeout": 10.0, "global_batch": 4, "templates": templates, "wait_rejoin": True,
            "kill": {"group": 0, "rank": 1, "step": 3, "where": "backward", "agent": True}}
    group0 = [_launch_elastic({**base, "group": 0, "devices": 1, "elastic": True}, r, store_port) for r in (0, 1)]
    group1 = _launch({**base, "group": 1, "devices": 1}, restarts=0, nproc=1)
    codes = _wait([*group0, group1], 600)
    del store
    assert codes[0] == 0 and codes[2] == 0, _log(out, "launch_*.log")
    assert codes[1] != 0  # the lost node
    with open(os.path.join(out, "result_0.json")) as f:
        r0 = json.load(f)
    with open(os.path.join(out, "result_1.json")) as f:
        r1 = json.load(f)
    assert r1["restart"] == 0 and [s for s, _ in r1["steps"]] == list(range(1, STEPS + 1))
    assert r1["stats"]["redone_steps"] >= 1
    assert r0["restart"] >= 1 and r0["world_size"] == 1 and r0["stats"]["healed_steps"] == 1
    assert r1["shares"]["0"] == 1 and r1["shares"][str(STEPS - 1)] == 2  # by speed: 2 nodes 3 samples, 1 node 1
    healed = [e for e in r0["events"] if e["event"] == "healed"][0]["step"]
    assert [s for s, _ in r0["steps"]] == list(range(healed + 1, STEPS + 1))
    _assert_both_groups_equal_the_reference(out)


def _wait_for_step(out: str, group: int, step: int, timeout: float, procs) -> None:
    """Until ``group``'s rank 0 logged ``step`` (fails early if a launch ended)."""
    path, deadline = os.path.join(out, f"steps_{group}.log"), time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and any(int(line.split()[0]) >= step for line in open(path) if line.strip()):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    pytest.fail(f"group {group} did not reach step {step}: " + _log(out, "launch_*.log"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_group_that_gains_a_node_re_forms_at_its_larger_template(tmp_path, lighthouse):
    """Group 0 starts on one torchrun agent (``--nnodes 1:2``, the 1-node template) beside group 1 (one rank): equal
    speeds, equal shares (2 + 2 samples). After group 0's step 2 a second agent joins: torchrun stops group 0's
    worker and starts two at world size 2, which take the 2-node template (LLM pp 2), heal by name from group 1 and
    rejoin; the shares follow the new speeds (3 + 1). Group 1 never stops (it only slows its steps until group 0's
    two ranks started, never waiting on a peer); each step is applied once; both groups equal one process."""
    out, (host, port) = str(tmp_path), lighthouse
    store_port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    templates = _templates(tmp_path / "templates.yaml")
    steps = 12  # group 0 re-forms in about 10 s while group 1 paces its steps 3 s apart; 10 of them leave 30 s
    base = {"mode": "group", "lighthouse": f"{host}:{port}", "groups": 2, "steps": steps, "out": out,
            "timeout": 10.0, "global_batch": 4, "templates": templates}
    elastic = {**base, "group": 0, "devices": 1, "elastic": True}
    first = _launch_elastic(elastic, 0, store_port)
    group1 = _launch({**base, "group": 1, "devices": 1,
                      "pace": {"until": "world_0_2", "after": 2, "seconds": 3.0, "max": 180}}, restarts=0, nproc=1)
    _wait_for_step(out, 0, 2, 300, [first, group1])
    second = _launch_elastic(elastic, 1, store_port)
    codes = _wait([first, second, group1], 600)
    del store
    assert codes == [0, 0, 0], _log(out, "launch_*.log")
    with open(os.path.join(out, "result_0.json")) as f:
        r0 = json.load(f)
    with open(os.path.join(out, "result_1.json")) as f:
        r1 = json.load(f)
    assert r1["restart"] == 0 and [s for s, _ in r1["steps"]] == list(range(1, steps + 1))
    assert r0["world_size"] == 2 and r0["stats"]["healed_steps"] == 1
    assert r1["shares"]["0"] == 2 and r1["shares"][str(steps - 1)] == 1  # 1 + 1 nodes: 2 + 2; 2 + 1 nodes: 3 + 1
    healed = [e for e in r0["events"] if e["event"] == "healed"][0]["step"]
    assert [s for s, _ in r0["steps"]] == list(range(healed + 1, steps + 1))
    _assert_both_groups_equal_the_reference(out, steps)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_on_localhost_train_like_one_process(tmp_path):
    """One group over two torchrun launches (``--nnodes 2``, a node rank each, 1 rank per node, LLM pp 2)."""
    out, port = str(tmp_path), _free_port()
    cfg = {"mode": "group", "ft": False, "group": 0, "steps": 4, "out": out, "devices": 1, "num_nodes": 2}
    procs = [_launch(cfg, restarts=0, nnodes=2, node_rank=r, port=port, nproc=1) for r in (0, 1)]
    codes = _wait(procs, 300)
    assert codes == [0, 0], _log(out, "launch_*.log")
    _assert_equal_to_reference(_params(out, 0), _reference(out, steps=4))
