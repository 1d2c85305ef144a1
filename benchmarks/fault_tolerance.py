"""Fault tolerance (torchft replica groups) vs checkpoint-restart: throughput, failure and recovery times.

The four runs (ft, dp, ft_fail, ckpt_fail) and how each time is read: docs/fault_tolerance.md, "Benchmark".
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time

import harness

sys.path.insert(0, str(harness.ROOT))  # tests.* (the launcher and the tiny case)

GLOBAL_BATCH = 4  # per-replica batch 2 (tests/helpers/ft_case.py) x 2 replicas
RUNS = ["ft", "dp", "ft_fail", "ckpt_fail"]


def jobs(a, base: str) -> dict:
    """Each run's lighthouse (its min replicas; 0: none) and torchrun jobs ((cfg, max restarts, processes))."""
    common = {"mode": "group", "timeout": 10.0, "wait_rejoin": False}
    groups = [{**common, "groups": 2, "group": g} for g in (0, 1)]
    one_job = {**common, "ft": False, "group": 0, "devices": 4}
    kill = {"group": 1, "rank": 1, "step": a.kill_step, "where": "batch_end"}
    ckpt_kill = {"group": 0, "rank": 1, "step": a.ckpt_kill_step, "where": "batch_end"}
    return {"ft": (2, [({**g, "steps": a.steps}, 0, 2) for g in groups]),  # both groups in every quorum
            "dp": (0, [({**one_job, "steps": a.steps}, 0, 4)]),
            "ft_fail": (1, [({**g, "steps": a.fail_steps, "kill": kill}, g["group"], 2) for g in groups]),
            "ckpt_fail": (0, [({**one_job, "steps": a.fail_steps, "kill": ckpt_kill, "save_every": a.save_every,
                                "ckpt_dir": os.path.join(base, "ckpt_fail", "ckpt"), "resume": "last"}, 1, 4)])}


def run(name: str, base: str, a) -> tuple[str, dict]:
    """Run ``name``'s jobs into ``base/name`` (beside a lighthouse of this process, shut down after): the folder
    and the run's settings, exit codes, wall time and kill."""
    from tests.test_fault_tolerance import _launch, _wait

    min_replicas, cfgs = jobs(a, base)[name]
    server = None
    if min_replicas:
        from torchft.coordination import LighthouseServer

        from lightning_mm.fault_tolerance import parse_address

        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=a.join_ms,
                                  heartbeat_timeout_ms=a.heartbeat_ms)
        host, port = parse_address(server.address())
        cfgs = [({**cfg, "lighthouse": f"{host}:{port}"}, r, n) for cfg, r, n in cfgs]
    out = os.path.join(base, name)
    os.makedirs(out)
    t0 = time.time()
    try:
        codes = _wait([_launch({**cfg, "out": out}, restarts=r, nproc=n) for cfg, r, n in cfgs], a.timeout)
    finally:
        if server is not None:
            server.shutdown()
    row = {"settings": vars(a).copy(), "codes": codes, "wall_s": time.time() - t0}
    print(f"{name}: exit codes {codes}, {row['wall_s']:.1f} s", flush=True)
    if "kill" in cfgs[-1][0]:
        row["kill"] = cfgs[-1][0]["kill"]
    return out, row


def _steps(out: str, group: int) -> list[tuple[int, float, int]]:
    """(step, end time, restart count) of each committed step of ``group``."""
    path = os.path.join(out, f"steps_{group}.log")
    rows = [line.split() for line in open(path).read().splitlines() if line.strip()] if os.path.exists(path) else []
    return [(int(s), float(t), int(r)) for s, t, r in rows]


def _rate(rows, t0=None, t1=None) -> float | None:
    """Committed samples/s between the first and last step end in [t0, t1] (steps counted between them)."""
    rows = [(s, t) for s, t, *_ in rows if (t0 is None or t >= t0) and (t1 is None or t <= t1)]
    if len(rows) < 2:
        return None
    (s0, a), (s1, b) = rows[0], rows[-1]
    return GLOBAL_BATCH * (s1 - s0) / (b - a)


def read(name: str, a, out: str) -> dict:
    """The figures of run ``name`` from its folder (docs/fault_tolerance.md says how each is read)."""
    g0, r0 = _steps(out, 0), harness.read(os.path.join(out, "result_0.json"))
    if name in ("ft", "dp"):
        return {"samples_per_s": _rate(g0[2:]), **({"stats": r0.get("stats")} if name == "ft" else {})}
    killed = float(open(os.path.join(out, "killed_at")).read())  # the time its victim wrote before dying
    if name == "ft_fail":
        g1, r1 = _steps(out, 1), harness.read(os.path.join(out, "result_1.json"))
        rejoin = [t for s, t, r in g1 if r == 1]
        t_rejoin, started = rejoin[0] if rejoin else None, r1.get("started")
        next_step, next_t = next(((s, t) for s, t, _ in g0 if s > a.kill_step), (None, None))  # kill: after a commit
        healed = [e for e in r1.get("events", []) if e.get("event") == "healed"]
        before = _rate([x for x in g0 if x[1] < killed][2:])
        return {
            "kill_to_next_commit_s": next_t - killed if next_t else None, "next_commit_step": next_step,
            "step_s_before": 1 / (before or float("nan")) * GLOBAL_BATCH,
            "kill_to_restarted_process_start_s": started - killed if started else None,
            "rejoined_before_survivor_ended": bool(rejoin) and rejoin[0] < g0[-1][1],
            "restarted_start_to_first_commit_s": t_rejoin - started if t_rejoin and started else None,
            "heal_s": healed[0].get("seconds") if healed else None,
            "healed_at_step": healed[0]["step"] if healed else None,
            "kill_to_rejoined_s": t_rejoin - killed if t_rejoin else None, "samples_per_s_before": before,
            "samples_per_s_during": _rate(g0, killed, t_rejoin),
            "samples_per_s_after": _rate(g0, t_rejoin) if t_rejoin else None, "survivor_stats": r0.get("stats"),
            "survivor_steps": [s for s, _, _ in g0] == list(range(1, a.fail_steps + 1))}
    first, second = [x for x in g0 if x[2] == 0], [x for x in g0 if x[2] == 1]  # ckpt_fail: before, after restart
    last_ckpt = (a.ckpt_kill_step // a.save_every) * a.save_every
    again = [t for s, t, _ in second if s == a.ckpt_kill_step]
    started = r0.get("started")
    return {
        "save_every": a.save_every, "last_checkpoint_step": last_ckpt, "resumed_from": r0.get("resumed_from"),
        "lost_steps": a.ckpt_kill_step - last_ckpt, "step_s_before": GLOBAL_BATCH / (_rate(first[2:]) or float("nan")),
        "kill_to_restarted_process_start_s": started - killed if started else None,
        "restarted_start_to_fit_s": r0["fit_start"] - started if started else None,
        "fit_to_train_start_s (setup + checkpoint load)": r0["train_start"] - r0["fit_start"]
        if r0.get("train_start") else None,
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
    if not a.only:
        print(harness.tables.show(os.path.basename(a.out), harness.read(a.out)))
        return
    start, base = harness.record(), tempfile.mkdtemp(prefix="lmm-ft-bench-")
    previous = harness.read(a.out).get("runs", {}) if set(a.only) != set(RUNS) else {}  # keep the others' figures
    runs = dict(previous)
    res = {"label": "measured, 2-core CPU, gloo (shared, noisy machine)",
           "device": f"CPU ({os.cpu_count()} cores, shared), gloo, {platform.machine()}", "settings": vars(a),
           "model": "tests/helpers/ft_case.py: tiny siglip (frozen) + tiny llama, LLM pp 2",
           "global_batch": GLOBAL_BATCH, "runs": runs}
    for name in (n for n in RUNS if n in a.only):
        out, row = run(name, base, a)
        runs[name] = {**row, **read(name, a, out)}
        if name in ("ft", "dp") and name in previous:  # a repeated failure-free run keeps the earlier figures
            runs[name]["earlier_samples_per_s"] = (previous[name].get("earlier_samples_per_s", [])
                                                   + [previous[name]["samples_per_s"]])
    if "ft" in runs and "dp" in runs:
        ft, dp = (runs[k].get("earlier_samples_per_s", []) + [runs[k]["samples_per_s"]] for k in ("ft", "dp"))
        res["ratio_ft_over_dp_throughput"] = ft[-1] / dp[-1] if ft[-1] and dp[-1] else None
        if len(ft) == len(dp) > 1:  # the runs were made in pairs
            res["ratio_ft_over_dp_throughput_each_pair"] = [x / y for x, y in zip(ft, dp)]
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
