"""Fault tolerance (torchft replica groups) vs checkpoint-restart: throughput, failure and recovery times.

The four runs (ft, dp, ft_fail, ckpt_fail) and how each time is read: docs/fault_tolerance.md, "Benchmark".
"""

from __future__ import annotations

import os
import platform
import signal
import sys
import tempfile
import time

import harness

sys.path.insert(0, str(harness.ROOT))  # tests.* (the launcher and the tiny case)

LABEL = "measured, 2-core CPU, gloo (shared, noisy machine)"
GLOBAL_BATCH = 4  # per-replica batch 2 (tests/helpers/ft_case.py) x 2 replicas
RUNS = ["ft", "dp", "ft_fail", "ckpt_fail"]


def _lighthouse(min_replicas: int, heartbeat_ms: int, join_ms: int):
    from torchft.coordination import LighthouseServer

    from lightning_mm.fault_tolerance import parse_address

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_ms,
                              heartbeat_timeout_ms=heartbeat_ms)
    host, port = parse_address(server.address())
    return server, f"{host}:{port}"


def _wait(procs, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except Exception:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            raise RuntimeError(f"the run did not finish in {timeout:g} s")
    return [p.returncode for p in procs]


def _steps(out: str, group: int) -> list[tuple[int, float, int]]:
    path = os.path.join(out, f"steps_{group}.log")
    rows = [line.split() for line in open(path).read().splitlines() if line.strip()] if os.path.exists(path) else []
    return [(int(s), float(t), int(r)) for s, t, r in rows]


def _json(out: str, name: str) -> dict:
    return harness.read(os.path.join(out, name))


def _killed_at(out: str) -> float:
    """When the run's kill came (the time its victim wrote before dying)."""
    return float(open(os.path.join(out, "killed_at")).read())


def _rate(rows, t0=None, t1=None) -> float | None:
    """Committed samples/s between the first and last step end in [t0, t1] (steps counted between them)."""
    rows = [(s, t) for s, t, *_ in rows if (t0 is None or t >= t0) and (t1 is None or t <= t1)]
    if len(rows) < 2:
        return None
    (s0, a), (s1, b) = rows[0], rows[-1]
    return GLOBAL_BATCH * (s1 - s0) / (b - a)


def run(name: str, base: str, cfgs: list[tuple[dict, int, int]], timeout: float) -> tuple[str, list[int], float]:
    """Launch the torchrun jobs ``cfgs`` ((cfg, max_restarts, nproc)) into ``base/name``; returns the folder, the
    exit codes and the wall time."""
    from tests.test_fault_tolerance import _launch

    out = os.path.join(base, name)
    os.makedirs(out)
    t0 = time.time()
    codes = _wait([_launch({**cfg, "out": out}, restarts=restarts, nproc=nproc) for cfg, restarts, nproc in cfgs],
                  timeout)
    print(f"{name}: exit codes {codes}, {time.time() - t0:.1f} s", flush=True)
    return out, codes, time.time() - t0


def with_lighthouse(min_replicas: int, name: str, base: str, cfgs, timeout: float, heartbeat_ms: int = 2000,
                    join_ms: int = 3000) -> tuple[str, list[int], float]:
    """``run`` beside a lighthouse of this process (each cfg gets its address), shut down after."""
    server, lh = _lighthouse(min_replicas, heartbeat_ms, join_ms)
    try:
        return run(name, base, [({**cfg, "lighthouse": lh}, r, n) for cfg, r, n in cfgs], timeout)
    finally:
        server.shutdown()


def ft_fail(a, base: str, common: dict) -> dict:
    kill = {"group": 1, "rank": 1, "step": a.kill_step, "where": "batch_end"}
    out, codes, wall = with_lighthouse(1, "ft_fail", base, [
        ({**common, "groups": 2, "group": g, "steps": a.fail_steps, "kill": kill}, 1 if g else 0, 2) for g in (0, 1)],
        a.timeout, a.heartbeat_ms, a.join_ms)
    killed = _killed_at(out)
    g0, g1, r1 = _steps(out, 0), _steps(out, 1), _json(out, "result_1.json")
    rejoin = [t for s, t, r in g1 if r == 1]
    t_rejoin = rejoin[0] if rejoin else None
    nxt = [(s, t) for s, t, _ in g0 if s > a.kill_step]  # the kill comes after step kill_step's commit
    healed = [e for e in r1.get("events", []) if e.get("event") == "healed"]
    before = _rate([x for x in g0 if x[1] < killed][2:])
    return {
        "settings": vars(a).copy(), "codes": codes, "wall_s": wall, "kill": kill,
        "kill_to_next_commit_s": nxt[0][1] - killed if nxt else None, "next_commit_step": nxt[0][0] if nxt else None,
        "step_s_before": 1 / (before or float("nan")) * GLOBAL_BATCH,
        "kill_to_restarted_process_start_s": r1["started"] - killed if r1.get("started") else None,
        "rejoined_before_survivor_ended": bool(rejoin) and rejoin[0] < g0[-1][1],
        "restarted_start_to_first_commit_s": t_rejoin - r1["started"] if t_rejoin and r1.get("started") else None,
        "heal_s": healed[0].get("seconds") if healed else None, "healed_at_step": healed[0]["step"] if healed else None,
        "kill_to_rejoined_s": t_rejoin - killed if t_rejoin else None, "samples_per_s_before": before,
        "samples_per_s_during": _rate(g0, killed, t_rejoin),
        "samples_per_s_after": _rate(g0, t_rejoin) if t_rejoin else None,
        "survivor_stats": _json(out, "result_0.json").get("stats"),
        "survivor_steps": [s for s, _, _ in g0] == list(range(1, a.fail_steps + 1))}


def ckpt_fail(a, base: str, common: dict) -> dict:
    kill = {"group": 0, "rank": 1, "step": a.ckpt_kill_step, "where": "batch_end"}
    out, codes, wall = run("ckpt_fail", base, [({**common, "ft": False, "group": 0, "devices": 4,
                                                 "steps": a.fail_steps, "kill": kill, "save_every": a.save_every,
                                                 "ckpt_dir": os.path.join(base, "ckpt_fail", "ckpt"),
                                                 "resume": "last"}, 1, 4)], a.timeout)
    killed = _killed_at(out)
    rows, r = _steps(out, 0), _json(out, "result_0.json")
    first, second = [x for x in rows if x[2] == 0], [x for x in rows if x[2] == 1]
    last_ckpt = (a.ckpt_kill_step // a.save_every) * a.save_every
    again = [t for s, t, _ in second if s == a.ckpt_kill_step]
    return {
        "settings": vars(a).copy(), "codes": codes, "wall_s": wall, "kill": kill, "save_every": a.save_every,
        "last_checkpoint_step": last_ckpt, "resumed_from": r.get("resumed_from"),
        "lost_steps": a.ckpt_kill_step - last_ckpt, "step_s_before": GLOBAL_BATCH / (_rate(first[2:]) or float("nan")),
        "kill_to_restarted_process_start_s": r["started"] - killed if r.get("started") else None,
        "restarted_start_to_fit_s": r["fit_start"] - r["started"] if r.get("started") else None,
        "fit_to_train_start_s (setup + checkpoint load)": r["train_start"] - r["fit_start"]
        if r.get("train_start") else None,
        "kill_to_first_step_after_resume_s": second[0][1] - killed if second else None,
        "first_step_after_resume": second[0][0] if second else None,
        "kill_to_same_step_again_s": again[0] - killed if again else None,
        "samples_per_s_before": _rate(first[2:]), "samples_per_s_after": _rate(second[1:]),
        "steps_ok": [s for s, _, _ in second][-1:] == [a.fail_steps]}


def main(argv=None) -> None:
    a = harness.cli(__doc__, argv, steps=(100, "steps of the failure-free runs"),
                    fail_steps=(900, "steps of the runs with a failure"), kill_step=8,
                    ckpt_kill_step=(13, "the checkpoint run's kill (after this step)"), save_every=5,
                    heartbeat_ms=(2000, "lighthouse heartbeat timeout"), join_ms=(3000, "lighthouse join timeout"),
                    only=dict(nargs="*", default=RUNS, help="runs to make (the others' figures are kept from --out); "
                                                            "none: print --out's table"),
                    out=str(harness.RESULTS / "fault_tolerance_cpu.json"), timeout=540.0)
    if not a.only:  # --only with nothing: print the table of the results file
        print(harness.tables.show(os.path.basename(a.out), harness.read(a.out)))
        return
    start = harness.record()
    base = tempfile.mkdtemp(prefix="lmm-ft-bench-")
    common = {"mode": "group", "timeout": 10.0, "wait_rejoin": False}
    previous = harness.read(a.out).get("runs", {}) if set(a.only) != set(RUNS) else {}  # keep the others' figures
    res: dict = {"label": LABEL, "device": f"CPU ({os.cpu_count()} cores, shared), gloo, {platform.machine()}",
                 "settings": vars(a), "model": "tests/helpers/ft_case.py: tiny siglip (frozen) + tiny llama, LLM pp 2",
                 "global_batch": GLOBAL_BATCH, "runs": dict(previous)}
    if "ft" in a.only:  # min_replicas 2: both groups in every quorum from step 1
        out, codes, wall = with_lighthouse(2, "ft", base, [
            ({**common, "groups": 2, "group": g, "steps": a.steps}, 0, 2) for g in (0, 1)], a.timeout, a.heartbeat_ms,
            a.join_ms)
        res["runs"]["ft"] = {"settings": vars(a).copy(), "codes": codes, "wall_s": wall,
                             "samples_per_s": _rate(_steps(out, 0)[2:]),
                             "stats": _json(out, "result_0.json").get("stats")}
    if "dp" in a.only:
        out, codes, wall = run("dp", base, [({**common, "ft": False, "group": 0, "devices": 4, "steps": a.steps}, 0,
                                             4)], a.timeout)
        res["runs"]["dp"] = {"settings": vars(a).copy(), "codes": codes, "wall_s": wall,
                             "samples_per_s": _rate(_steps(out, 0)[2:])}
    if "ft_fail" in a.only:
        res["runs"]["ft_fail"] = ft_fail(a, base, common)
    if "ckpt_fail" in a.only:
        res["runs"]["ckpt_fail"] = ckpt_fail(a, base, common)
    runs = res["runs"]
    for name in ("ft", "dp"):  # a repeated failure-free run keeps the earlier ones' figures
        if name in a.only and name in previous:
            runs[name]["earlier_samples_per_s"] = (previous[name].get("earlier_samples_per_s", [])
                                                   + [previous[name]["samples_per_s"]])
    if "ft" in runs and "dp" in runs:
        ft, dp = runs["ft"]["samples_per_s"], runs["dp"]["samples_per_s"]
        res["ratio_ft_over_dp_throughput"] = ft / dp if ft and dp else None
        ft_all = runs["ft"].get("earlier_samples_per_s", []) + [ft]
        dp_all = runs["dp"].get("earlier_samples_per_s", []) + [dp]
        if len(ft_all) == len(dp_all) > 1:  # the runs were made in pairs
            res["ratio_ft_over_dp_throughput_each_pair"] = [x / y for x, y in zip(ft_all, dp_all)]
    if "ft_fail" in runs and "ckpt_fail" in runs:
        f, c = runs["ft_fail"], runs["ckpt_fail"]
        # time the job loses to the failure: FT: the stall to the next commit, then the degraded phase's missing
        # throughput; checkpoint-restart: from the kill until the job is back at the killed step, minus one step
        if f["kill_to_next_commit_s"] is not None and f["kill_to_rejoined_s"] and f["samples_per_s_during"]:
            degraded = f["kill_to_rejoined_s"] - f["kill_to_next_commit_s"]
            f["lost_s"] = (f["kill_to_next_commit_s"] - f["step_s_before"]
                           + degraded * (1 - f["samples_per_s_during"] / f["samples_per_s_before"]))
        if c["kill_to_same_step_again_s"] is not None:
            c["lost_s"] = c["kill_to_same_step_again_s"] - c["step_s_before"]
            c["formula"] = ("lost = detect + restart (process start to fit) + setup/load (fit to first step) + "
                            "lost_steps x step time; expected lost_steps = save_every / 2")
            c["expected_lost_s_formula"] = (c["kill_to_first_step_after_resume_s"] - c["step_s_before"]
                                            + (a.save_every / 2) * c["step_s_before"])
    harness.write(a.out, res, start)
    print(f"run folders under {base}")


if __name__ == "__main__":
    main()
