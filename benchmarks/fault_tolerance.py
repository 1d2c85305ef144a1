"""Fault tolerance (torchft replica groups) vs checkpoint-restart: throughput, failure and recovery times.

Measured with CPU processes (gloo) through the launcher of the fault-tolerance tests (``tests/helpers/ft_case.py``,
each job a ``torchrun`` on localhost via ``tests/test_fault_tolerance._launch``); the model and data are the tests'
tiny ones (vision encoder frozen, LLM in 2 pipeline stages, per-replica batch 2). Four runs:

- ``ft``:   2 replica groups x 2 ranks (fault tolerance on), a lighthouse in this process, no failure.
- ``dp``:   the baseline: the same 4 ranks as ONE ordinary job (pp 2 x dp 2, no fault tolerance), the same global
            batch (4 samples) and model; Lightning's DDP-style reduction inside the job instead of torchft across
            groups. (Each group alone would be half the ranks and half the global batch: not the same job.)
- ``ft_fail``: as ``ft``, rank 1 of group 1 SIGKILLed after step ``--kill-step``; torchrun (``--max-restarts 1``)
            restarts group 1, which heals from group 0 and rejoins, while group 0 goes on alone.
- ``ckpt_fail``: as ``dp`` with ``ModelCheckpoint`` every ``--save-every`` steps, rank 1 SIGKILLed after
            ``--ckpt-kill-step``; torchrun ends the job's ranks and restarts it (``--max-restarts 1``), which resumes
            with ``trainer.fit(ckpt_path=<latest checkpoint>)``.

Times come from each job's rank 0 (``steps_<group>.log``: step, wall time, restart count) and the kill marker.
The machine is small and shared (2 cores for 4-6 processes): absolute figures are noisy, compare ratios.

    python benchmarks/fault_tolerance.py [--steps 100] [--fail-steps 900] [--kill-step 8] [--save-every 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LABEL = "measured, 2-core CPU, gloo (shared, noisy machine)"
GLOBAL_BATCH = 4  # per-replica batch 2 (tests/helpers/ft_case.py) x 2 replicas


def _lighthouse(min_replicas: int, heartbeat_ms: int, join_ms: int):
    from torchft._torchft import LighthouseServer

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
    if not os.path.exists(path):
        return []
    rows = [line.split() for line in open(path).read().splitlines() if line.strip()]
    return [(int(s), float(t), int(r)) for s, t, r in rows]


def _json(out: str, name: str):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None


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
    procs = [_launch({**cfg, "out": out}, restarts=restarts, nproc=nproc) for cfg, restarts, nproc in cfgs]
    codes = _wait(procs, timeout)
    print(f"{name}: exit codes {codes}, {time.time() - t0:.1f} s", flush=True)
    return out, codes, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="steps of the failure-free runs")
    ap.add_argument("--fail-steps", type=int, default=900, help="steps of the runs with a failure")
    ap.add_argument("--kill-step", type=int, default=8)
    ap.add_argument("--ckpt-kill-step", type=int, default=13, help="the checkpoint run's kill (after this step)")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--heartbeat-ms", type=int, default=2000, help="lighthouse heartbeat timeout")
    ap.add_argument("--join-ms", type=int, default=3000, help="lighthouse join timeout")
    ap.add_argument("--only", nargs="*", default=["ft", "dp", "ft_fail", "ckpt_fail"],
                    help="runs to make (the others' figures are kept from --out); none: print --out's table")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fault_tolerance_cpu.json"))
    ap.add_argument("--timeout", type=float, default=540)
    a = ap.parse_args()
    start = _machine.record()
    base = tempfile.mkdtemp(prefix="lmm-ft-bench-")
    common = {"mode": "group", "timeout": 10.0, "wait_rejoin": False}
    res: dict = {"label": LABEL, "device": f"CPU ({os.cpu_count()} cores, shared), gloo, {platform.machine()}",
                 "settings": vars(a), "model": "tests/helpers/ft_case.py: tiny siglip (frozen) + tiny llama, LLM pp 2",
                 "global_batch": GLOBAL_BATCH, "runs": {}}
    previous = {}
    if set(a.only) != {"ft", "dp", "ft_fail", "ckpt_fail"} and os.path.exists(a.out):  # keep the other runs' figures
        previous = json.load(open(a.out)).get("runs", {})
        res["runs"] = dict(previous)
    if not a.only:  # --only with nothing: print the table of the results file
        _table(json.load(open(a.out)))
        return

    if "ft" in a.only:  # min_replicas 2: both groups in every quorum from step 1
        server, lh = _lighthouse(2, a.heartbeat_ms, a.join_ms)
        try:
            out, codes, wall = run("ft", base, [({**common, "lighthouse": lh, "groups": 2, "group": g,
                                                  "steps": a.steps}, 0, 2) for g in (0, 1)], a.timeout)
        finally:
            server.shutdown()
        rows = _steps(out, 0)
        res["runs"]["ft"] = {"settings": vars(a).copy(), "codes": codes, "wall_s": wall,
                             "samples_per_s": _rate(rows[2:]),
                             "stats": (_json(out, "result_0.json") or {}).get("stats")}
    if "dp" in a.only:
        out, codes, wall = run("dp", base, [({**common, "ft": False, "group": 0, "devices": 4, "steps": a.steps},
                                             0, 4)], a.timeout)
        res["runs"]["dp"] = {"settings": vars(a).copy(), "codes": codes, "wall_s": wall,
                             "samples_per_s": _rate(_steps(out, 0)[2:])}
    if "ft_fail" in a.only:
        server, lh = _lighthouse(1, a.heartbeat_ms, a.join_ms)
        kill = {"group": 1, "rank": 1, "step": a.kill_step, "where": "batch_end"}
        try:
            out, codes, wall = run("ft_fail", base, [({**common, "lighthouse": lh, "groups": 2, "group": g,
                                                       "steps": a.fail_steps, "kill": kill}, 1 if g else 0, 2)
                                                     for g in (0, 1)], a.timeout)
        finally:
            server.shutdown()
        killed = float(open(os.path.join(out, "killed_at")).read())
        g0, g1 = _steps(out, 0), _steps(out, 1)
        r1 = _json(out, "result_1.json") or {}
        rejoin = [t for s, t, r in g1 if r == 1]
        t_rejoin = rejoin[0] if rejoin else None
        nxt = [(s, t) for s, t, _ in g0 if s > a.kill_step]  # the kill comes after step kill_step's commit
        healed = [e for e in r1.get("events", []) if e.get("event") == "healed"]
        step_s = 1 / (_rate([x for x in g0 if x[1] < killed][2:]) or float("nan")) * GLOBAL_BATCH
        res["runs"]["ft_fail"] = {
            "settings": vars(a).copy(), "codes": codes, "wall_s": wall, "kill": kill,
            "kill_to_next_commit_s": nxt[0][1] - killed if nxt else None,
            "next_commit_step": nxt[0][0] if nxt else None,
            "step_s_before": step_s,
            "kill_to_restarted_process_start_s": r1["started"] - killed if r1.get("started") else None,
            "rejoined_before_survivor_ended": bool(rejoin) and rejoin[0] < g0[-1][1],
            "restarted_start_to_first_commit_s": t_rejoin - r1["started"] if t_rejoin and r1.get("started") else None,
            "heal_s": healed[0].get("seconds") if healed else None,
            "healed_at_step": healed[0]["step"] if healed else None,
            "kill_to_rejoined_s": t_rejoin - killed if t_rejoin else None,
            "samples_per_s_before": _rate([x for x in g0 if x[1] < killed][2:]),
            "samples_per_s_during": _rate(g0, killed, t_rejoin),
            "samples_per_s_after": _rate(g0, t_rejoin) if t_rejoin else None,
            "survivor_stats": (_json(out, "result_0.json") or {}).get("stats"),
            "survivor_steps": [s for s, _, _ in g0] == list(range(1, a.fail_steps + 1))}
    if "ckpt_fail" in a.only:
        ck = os.path.join(base, "ckpt_fail", "ckpt")
        kill = {"group": 0, "rank": 1, "step": a.ckpt_kill_step, "where": "batch_end"}
        out, codes, wall = run("ckpt_fail", base, [({**common, "ft": False, "group": 0, "devices": 4,
                                                     "steps": a.fail_steps, "kill": kill, "save_every": a.save_every,
                                                     "ckpt_dir": ck, "resume": "last"}, 1, 4)], a.timeout)
        killed = float(open(os.path.join(out, "killed_at")).read())
        rows = _steps(out, 0)
        r = _json(out, "result_0.json") or {}
        first, second = [x for x in rows if x[2] == 0], [x for x in rows if x[2] == 1]
        last_ckpt = (a.ckpt_kill_step // a.save_every) * a.save_every
        step_s = GLOBAL_BATCH / (_rate(first[2:]) or float("nan"))
        again = [t for s, t, _ in second if s == a.ckpt_kill_step]
        res["runs"]["ckpt_fail"] = {
            "settings": vars(a).copy(), "codes": codes, "wall_s": wall, "kill": kill, "save_every": a.save_every,
            "last_checkpoint_step": last_ckpt,
            "resumed_from": r.get("resumed_from"), "lost_steps": a.ckpt_kill_step - last_ckpt, "step_s_before": step_s,
            "kill_to_restarted_process_start_s": r["started"] - killed if r.get("started") else None,
            "restarted_start_to_fit_s": r["fit_start"] - r["started"] if r.get("started") else None,
            "fit_to_train_start_s (setup + checkpoint load)": r["train_start"] - r["fit_start"]
            if r.get("train_start") else None,
            "kill_to_first_step_after_resume_s": second[0][1] - killed if second else None,
            "first_step_after_resume": second[0][0] if second else None,
            "kill_to_same_step_again_s": again[0] - killed if again else None,
            "samples_per_s_before": _rate(first[2:]), "samples_per_s_after": _rate(second[1:]),
            "steps_ok": [s for s, _, _ in second][-1:] == [a.fail_steps]}
    for name in ("ft", "dp"):  # a repeated failure-free run keeps the earlier ones' figures
        if name in a.only and name in previous:
            res["runs"][name]["earlier_samples_per_s"] = (previous[name].get("earlier_samples_per_s", [])
                                                          + [previous[name]["samples_per_s"]])
    if "ft" in res["runs"] and "dp" in res["runs"]:
        ft, dp = res["runs"]["ft"]["samples_per_s"], res["runs"]["dp"]["samples_per_s"]
        res["ratio_ft_over_dp_throughput"] = ft / dp if ft and dp else None
        ft_all = res["runs"]["ft"].get("earlier_samples_per_s", []) + [ft]
        dp_all = res["runs"]["dp"].get("earlier_samples_per_s", []) + [dp]
        if len(ft_all) == len(dp_all) > 1:  # the runs were made in pairs
            res["ratio_ft_over_dp_throughput_each_pair"] = [x / y for x, y in zip(ft_all, dp_all)]
    if "ft_fail" in res["runs"] and "ckpt_fail" in res["runs"]:
        f, c = res["runs"]["ft_fail"], res["runs"]["ckpt_fail"]
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
    res["machine"] = _machine.finish(start)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=2)
    _table(res)
    print(f"wrote {a.out} (run folders under {base})")
    tables.main(["--quiet"])


def _table(res: dict):
    def f(x, unit=""):
        return "-" if x is None else f"{x:.2f}{unit}"

    runs = res["runs"]
    print(f"\nFault tolerance benchmark ({res['label']})")
    lines = []
    if "ft" in runs and "dp" in runs:
        lines += [("samples/s, no failure: FT on, 2 groups x 2 ranks", f(runs["ft"]["samples_per_s"])),
                  ("samples/s, no failure: FT off, one 4-rank job (pp2 x dp2)", f(runs["dp"]["samples_per_s"])),
                  ("ratio FT on / off", f(res.get("ratio_ft_over_dp_throughput")))]
        if res.get("ratio_ft_over_dp_throughput_each_pair"):
            lines.append(("ratio FT on / off, each repeat", ", ".join(
                f(r) for r in res["ratio_ft_over_dp_throughput_each_pair"])))
    if "ft_fail" in runs:
        x = runs["ft_fail"]
        lines += [("FT: SIGKILL -> survivor's next committed step", f(x["kill_to_next_commit_s"], " s")),
                  ("FT: SIGKILL -> restarted group's ranks up (imports done)",
                   f(x["kill_to_restarted_process_start_s"], " s")),
                  ("FT: restarted group's heal (copy from peer)", f(x["heal_s"], " s")),
                  ("FT: SIGKILL -> restarted group commits again", f(x["kill_to_rejoined_s"], " s")),
                  ("FT: samples/s before / during / after", " / ".join(
                      f(x[k]) for k in ("samples_per_s_before", "samples_per_s_during", "samples_per_s_after"))),
                  ("FT: time lost to the failure", f(x.get("lost_s"), " s"))]
    if "ckpt_fail" in runs:
        x = runs["ckpt_fail"]
        lines += [(f"ckpt: steps since last checkpoint (every {x['save_every']})", str(x["lost_steps"])),
                  ("ckpt: SIGKILL -> restarted ranks up (imports done)",
                   f(x["kill_to_restarted_process_start_s"], " s")),
                  ("ckpt: fit() -> train start (setup + load)", f(x["fit_to_train_start_s (setup + checkpoint load)"],
                                                                  " s")),
                  ("ckpt: SIGKILL -> first step after resume", f(x["kill_to_first_step_after_resume_s"], " s")),
                  ("ckpt: SIGKILL -> back at the killed step", f(x["kill_to_same_step_again_s"], " s")),
                  ("ckpt: time lost to the failure", f(x.get("lost_s"), " s"))]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
