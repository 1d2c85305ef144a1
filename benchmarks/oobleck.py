"""Oobleck-style re-forming vs identical replica groups vs checkpoint-restart: simulated at the seed's scale, and
measured on CPU processes (``--measured``, ``oobleck_measured.json``), plus the time to plan one template.

Setting and methods: docs/fault_tolerance.md, "Simulated figures" and "Measured figures"; run ``python
benchmarks/oobleck.py [--measured]``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

import harness

sys.path.insert(0, str(harness.ROOT))  # tests.* (the measured runs' launcher)

from lightning_mm.plan.templates import instantiate, split_batch, step_time  # noqa: E402
from lightning_mm.planner.costs import LayerCost  # noqa: E402
from lightning_mm.planner.plan_cli import build_templates, plan_template  # noqa: E402
from lightning_mm.planner.search import ModuleSpec, search  # noqa: E402

OUT, MEASURED_OUT = harness.RESULTS / "oobleck.json", harness.RESULTS / "oobleck_measured.json"
MEASURED_BATCH = 4  # samples per step in all three measured runs
RUNS = ("reforming", "identical", "checkpoint_restart")
GIB = 2 ** 30
SEQ, VOCAB, STATE_BYTES = 1024, 50257, 16
NODES, FLOOR, MEMORY, LINK = 30, 15, 40 * GIB, 200e9 / 8
PLANNING_REPEATS = 5  # timed runs of each template (median): one run on a shared machine is one scheduler draw
# name: (layers, hidden, global batch, microbatch) -- Table 2.1
MODELS = {"BERT-Large": (24, 1024, 8192, 32), "GPT-2": (24, 1024, 8192, 32), "GPT-3 Medium": (24, 1024, 8192, 16),
          "GPT-3 2.7b": (32, 2560, 1024, 2), "GPT-3 6.7b": (32, 4096, 1024, 2)}
# Table 2.2 (samples/s): frequency -> model -> (Varuna, Oobleck)
SEED = {"6h": {"BERT-Large": (260.11, 287.10), "GPT-2": (86.51, 85.59), "GPT-3 Medium": (29.50, 29.30),
               "GPT-3 2.7b": (7.27, 7.29), "GPT-3 6.7b": (4.14, 4.33)},
        "1h": {"BERT-Large": (246.03, 286.28), "GPT-2": (85.17, 85.42), "GPT-3 Medium": (28.49, 29.21),
               "GPT-3 2.7b": (6.53, 7.23), "GPT-3 6.7b": (2.69, 4.22)},
        "10m": {"BERT-Large": (173.52, 282.11), "GPT-2": (76.39, 84.80), "GPT-3 Medium": (20.19, 28.70),
                "GPT-3 2.7b": (1.76, 6.89), "GPT-3 6.7b": (0.26, 3.55)}}
INTERVALS = {"6h": 6 * 3600.0, "1h": 3600.0, "10m": 600.0}
# Table 2.3 (seconds): (nodes, GPUs per node) -> seconds at 24, 32, 64 and 96 layers
SEED_PLANNING = {(8, 1): (0.28, 0.71, 9.65, 68.50), (8, 4): (0.41, 1.15, 11.58, 74.56),
                 (8, 8): (0.54, 1.50, 20.98, 109.76), (16, 1): (3.37, 7.45, 66.35, 540.36),
                 (16, 4): (4.56, 10.41, 108.10, 649.67), (16, 8): (4.90, 11.78, 176.04, 1213.63),
                 (24, 1): (11.35, 30.11, 262.47, 1477.54), (24, 4): (14.78, 45.80, 472.53, 2153.84),
                 (24, 8): (15.59, 49.25, 520.08, 3297.92)}


# ---------------------------------------------------------------------------------------------- simulated
def gpt_specs(layers: int, hidden: int, microbatch: int) -> dict[str, ModuleSpec]:
    """One microbatch's FLOPs per transformer layer, 16 bytes of state a parameter (the embedding on layer 0)."""
    f = 24 * microbatch * SEQ * hidden ** 2 + 4 * microbatch * SEQ ** 2 * hidden
    params = [12 * hidden ** 2 + (VOCAB * hidden if i == 0 else 0) for i in range(layers)]
    return {"language_model": ModuleSpec([LayerCost(float(f), 3.0 * f, True, True)] * layers,
                                         param_bytes=[STATE_BYTES * p for p in params],
                                         activation_bytes=4.0 * microbatch * SEQ * hidden,
                                         grad_bytes=[4.0 * p for p in params])}


def failure_times(interval: float) -> tuple[list[float], float]:
    return [interval * k for k in range(1, NODES - FLOOR + 1)], interval * (NODES - FLOOR + 1)


def oobleck_rates(templates, microbatches: int, samples: int) -> dict[int, tuple[float, list[int]]]:
    """Per live node count: (samples per FLOP-unit of time, group sizes)."""
    out = {}
    for n in range(FLOOR, NODES + 1):
        sizes = instantiate(templates, n, microbatches)
        groups = [templates.template_for(s * templates.devices_per_node) for s in sizes]
        out[n] = (samples / step_time(groups, split_batch(groups, microbatches)), sizes)
    return out


def run_oobleck(rates, flops, interval, restart_s, state, samples_per_step) -> tuple[float, list]:
    fails, end = failure_times(interval)
    done, t, nodes, timeline = 0.0, 0.0, NODES, []
    for when in [*fails, end]:
        rate = rates[nodes][0] * flops
        done += rate * (when - t)
        timeline.append((t, nodes, rate))
        t = when
        if when < end:
            group = min(rates[nodes][1])  # the lost node's group: its state share copied, half a step redone
            done -= rate * (restart_s + state / group / LINK + 0.5 * samples_per_step / rate)
            nodes -= 1
    return done / end, timeline


def run_identical(template, groups: int, microbatches: int, flops, interval, samples_per_mb, trials, seed=0):
    """Average samples/s of ``groups`` groups of ``template`` that stay down after losing a node."""
    per_group = microbatches // groups
    rate = per_group * samples_per_mb / template.step_time(per_group) * flops
    fails, end = failure_times(interval)
    rng, total = random.Random(seed), 0.0
    for _ in range(trials):
        owner = [g for g in range(groups) for _ in range(template.nodes)] + [None] * (NODES - groups * template.nodes)
        rng.shuffle(owner)
        alive, t, done = set(range(groups)), 0.0, 0.0
        for when, node in zip(fails, owner):  # the k-th failure takes the k-th node of a random order
            done += len(alive) * rate * (when - t)
            t = when
            alive.discard(node)
        total += (done + len(alive) * rate * (end - t)) / end
    return total / trials


def run_checkpoint(plans, flops, interval, restart_s, state, storage, samples) -> float:
    """Between failures: recover (restart + checkpoint load; none at the start), then steps with a checkpoint
    every 10; a failure loses the steps since the last checkpoint (the last interval keeps them all)."""
    fails, end = failure_times(interval)
    save, done, t, nodes = state / storage, 0.0, 0.0, NODES
    for k, when in enumerate([*fails, end]):
        step = plans[nodes] / flops + save / 10
        steps = max(0.0, when - t - (restart_s + state / storage if k else 0.0)) // step
        done += samples * (steps if when == end else steps // 10 * 10)
        t, nodes = when, nodes - 1
    return done / end


def throughput(args) -> dict:
    out = {}
    for name, (layers, hidden, batch, mb) in tqdm(MODELS.items(), desc="throughput (simulated)", disable=None):
        specs, microbatches = gpt_specs(layers, hidden, mb), batch // mb
        start = time.perf_counter()
        templates = build_templates(specs, NODES, 1, 1, microbatches, MEMORY)
        planning = time.perf_counter() - start
        rates = oobleck_rates(templates, microbatches, batch)
        plans = {n: search(specs, n, microbatches, MEMORY).best.iteration_time for n in range(FLOOR, NODES + 1)}
        best = max((t for t in templates.templates if NODES // t.nodes >= 2),
                   key=lambda t: (NODES // t.nodes) * (microbatches // (NODES // t.nodes))
                   / t.step_time(microbatches // (NODES // t.nodes)))
        groups = NODES // best.nodes
        state = STATE_BYTES * (layers * 12 * hidden ** 2 + VOCAB * hidden)
        flops = SEED["6h"][name][1] / rates[NODES][0]
        for _ in range(6):  # the GPU's FLOP/s: Oobleck's 6 h cell equals the seed's
            flops *= SEED["6h"][name][1] / run_oobleck(rates, flops, INTERVALS["6h"], args.restart_s, state, batch)[0]
        cells = {}
        for freq, interval in INTERVALS.items():
            oob, timeline = run_oobleck(rates, flops, interval, args.restart_s, state, batch)
            cells[freq] = {"oobleck": oob,
                           "identical": run_identical(best, groups, microbatches, flops, interval, mb, args.trials),
                           "checkpoint": run_checkpoint(plans, flops, interval, args.restart_s, state,
                                                        args.storage_gbps * 1e9, batch),
                           "seed_varuna": SEED[freq][name][0], "seed_oobleck": SEED[freq][name][1],
                           "oobleck_timeline": [{"t_s": t, "nodes": n, "samples_per_s": r} for t, n, r in timeline]}
        out[name] = {"n0": templates.node_counts[0], "templates": templates.node_counts,
                     "planning_s": planning, "calibrated_tflops": flops / 1e12,
                     "identical_groups": f"{groups} x {best.nodes} nodes",
                     "groups_at": {str(n): rates[n][1] for n in (NODES, 20, FLOOR)}, "cells": cells}
    return out


def planning() -> list[dict]:
    """Seconds of ``plan_template`` per Table 2.3 cell: median and minimum wall time of ``PLANNING_REPEATS`` runs,
    the median CPU time of this process (what load does not stretch) and the load average at the cell."""
    rows = []
    cells = [(*cell, layers, s) for cell, seed in SEED_PLANNING.items() for layers, s in zip((24, 32, 64, 96), seed)]
    for nodes, per_node, layers, seed_s in tqdm(cells, desc="planning (measured)", disable=None):
        specs, tp = gpt_specs(layers, 2560, 2), tuple(t for t in (1, 2, 4, 8) if t <= per_node)
        # gc first: a full collection owed by earlier allocations (imports, throughput) is not this cell's
        walls, cpus, t = harness.repeat(lambda: plan_template(specs, nodes, per_node, 4 * nodes, MEMORY,
                                                              tp_degrees=tp), PLANNING_REPEATS, gc.collect)
        seconds, cpu = statistics.median(walls), statistics.median(cpus)
        rows.append({"nodes": nodes, "gpus_per_node": per_node, "layers": layers, "seconds": seconds,
                     "seconds_min": min(walls), "cpu_seconds": cpu, "load_average": os.getloadavg()[0],
                     "repeats": PLANNING_REPEATS, "seed_seconds": seed_s, "speedup": seed_s / seconds,
                     "speedup_cpu": seed_s / cpu, "found": t is not None})
    return rows


# ---------------------------------------------------------------------------------------------- measured (--measured)
def phases(rows, killed: float, recovered: float | None, batch: int = MEASURED_BATCH) -> dict:
    """Committed steps/s and samples/s of ``rows`` ((step, time, ...) of a steps log) before ``killed`` (the first
    2 steps skipped: warm-up), during (killed -> ``recovered``, or to the last row when None: new steps past the
    last one committed before the kill, over the window) and after ``recovered`` (first to last row after it), plus
    the seconds from the kill to the first committed step after it. Pure."""
    before = [(s, t) for s, t, *_ in rows if t < killed]
    last = before[-1][0] if before else 0
    first_after = [t for _, t, *_ in rows if t > killed]
    end = recovered if recovered is not None else (rows[-1][1] if rows else None)

    def rate(sel):
        return None if len(sel) < 2 or sel[-1][1] <= sel[0][1] else (sel[-1][0] - sel[0][0]) / (sel[-1][1] - sel[0][1])

    during = None
    if end is not None and end > killed:
        during = (max([last, *[s for s, t, *_ in rows if killed < t <= end]]) - last) / (end - killed)
    out = {"steps_per_s_before": rate(before[2:]), "steps_per_s_during": during,
           "steps_per_s_after": rate([(s, t) for s, t, *_ in rows if t >= recovered]) if recovered else None,
           "kill_to_first_commit_s": first_after[0] - killed if first_after else None,
           "last_step_before_kill": last}
    for k in ("before", "during", "after"):
        v = out[f"steps_per_s_{k}"]
        out[f"samples_per_s_{k}"] = None if v is None else v * batch
    return out


def recovery_phases(result: dict, killed: float, first_commit: float | None) -> dict | None:
    """Where the lost group's time from the kill to its first commit goes, from the re-formed rank 0's result: the
    launcher (torchrun noticing, the rendezvous of the remaining nodes, the process start), the imports, the model
    and Trainer built, Lightning's setup (stage build, torchft manager, group links), and the quorum, heal and
    first step. Pure."""
    marks = [result.get(k) for k in ("created", "started", "fit_start", "train_start")]
    if None in marks or first_commit is None:
        return None
    points = [killed, *marks, first_commit]
    names = ("launcher", "imports", "model_and_trainer", "setup", "quorum_heal_first_step")
    return {n: b - a for n, a, b in zip(names, points, points[1:])}


@contextlib.contextmanager
def lighthouse():
    """A torchft lighthouse of this process for the replica groups (min 1, heartbeat 2 s, join 3 s): its address."""
    from torchft.coordination import LighthouseServer

    from lightning_mm.fault_tolerance import parse_address

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=2000)
    try:
        host, port = parse_address(server.address())
        yield f"{host}:{port}"
    finally:
        server.shutdown()


def _steps(out: str, group: int) -> list[tuple[int, float, int]]:
    """(step, end time, restart count) of each committed step of ``group``."""
    path = Path(out, f"steps_{group}.log")
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(s), float(t), int(r)) for s, t, r in (line.split() for line in lines if line.strip())]


def _run(name: str, base: str, args, launch, layout: str, kill: dict, steps_from: str,
         ft: bool = True) -> tuple[str, float, dict]:
    """``launch(out, lighthouse address)``'s processes into ``base/name`` (beside a lighthouse when ``ft``), waited
    for: the folder, the kill's time and the row's first entries."""
    from tests.test_fault_tolerance import _wait

    out = os.path.join(base, name)
    os.makedirs(out)
    t0 = time.time()
    with lighthouse() if ft else contextlib.nullcontext() as lh:
        codes = _wait(launch(out, lh), args.timeout)
    wall = time.time() - t0
    print(f"{name}: exit codes {codes}, {wall:.1f} s", flush=True)
    killed = float(Path(out, "killed_at").read_text())  # the time the victim wrote before dying
    return out, killed, {"layout": layout, "kill": kill, "codes": codes, "wall_s": wall, "steps_from": steps_from}


def _reforming(args, base: str, common: dict) -> dict:
    import torch

    from tests.helpers.distributed import _free_port
    from tests.test_fault_tolerance import _launch, _launch_elastic, _templates

    kill = {"group": 0, "rank": 1, "step": args.kill_step, "where": "backward", "agent": True}
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # outlives nodes

    def launch(out, lh):
        cfg = {**common, "lighthouse": lh, "groups": 2, "out": out, "global_batch": MEASURED_BATCH,
               "templates": _templates(Path(out) / "templates.yaml"), "kill": kill}
        return ([_launch_elastic({**cfg, "group": 0, "devices": 1, "elastic": True}, r, port) for r in (0, 1)]
                + [_launch({**cfg, "group": 1, "devices": 1}, restarts=0, nproc=1)])

    out, killed, row = _run("reforming", base, args, launch, (
        "group 0: 2 torchrun agents x 1 rank (--nnodes 1:2, 2-node template: LLM pp 2) -> 1 rank (1-node "
        "template); group 1: 1 rank (1-node template); global_batch 4 split by planned speed"), kill,
        "steps_1.log (group 1, never stops)")
    del store
    g0, g1, r0 = _steps(out, 0), _steps(out, 1), harness.read(Path(out, "result_0.json"))
    back = next((t for s, t, r in g0 if r >= 1), None)
    healed = [e for e in r0.get("events", []) if e.get("event") == "healed"]
    return {**row, **phases(g1, killed, back), "kill_to_recovered_s": back - killed if back else None,
            "kill_to_reformed_process_start_s": r0["started"] - killed if r0.get("started") else None,
            "recovery_phases_s": recovery_phases(r0, killed, back),
            "heal_s": healed[0].get("seconds") if healed else None,
            "healed_at_step": healed[0].get("step") if healed else None, "restart": r0.get("restart"),
            "reformed_world_size": r0.get("world_size"),
            "shares_before_after": [harness.read(Path(out, "result_1.json")).get("shares", {}).get(k)
                                    for k in ("0", str(args.steps - 1))],
            "completed": row["codes"][0] == 0 and row["codes"][2] == 0 and bool(g1) and g1[-1][0] == args.steps}


def _identical(args, base: str, common: dict) -> dict:
    from tests.test_fault_tolerance import _launch

    kill = {"group": 0, "rank": 1, "step": args.kill_step, "where": "backward"}

    def launch(out, lh):
        return [_launch({**common, "groups": 2, "group": g, "kill": kill, "lighthouse": lh, "out": out}, 0, nproc=2)
                for g in (0, 1)]

    out, killed, row = _run("identical", base, args, launch, "2 groups x 2 ranks (LLM pp 2), no global_batch "
                            "(per-group batch 2, the survivor takes all 4)", kill, "steps_1.log (group 1, never stops)")
    g1 = _steps(out, 1)
    return {**row, **phases(g1, killed, None), "kill_to_recovered_s": None,
            "note": "group 0 never returns: 'during' runs from the kill to the end of the run",
            "completed": row["codes"][1] == 0 and bool(g1) and g1[-1][0] == args.steps}


def _checkpoint_restart(args, base: str, common: dict) -> dict:
    from tests.test_fault_tolerance import _launch

    kill = {"group": 0, "rank": 1, "step": args.kill_step, "where": "backward"}
    cfg = {**common, "ft": False, "group": 0, "devices": 4, "kill": kill, "save_every": args.save_every,
           "ckpt_dir": os.path.join(base, "checkpoint_restart", "ckpt"), "resume": "last"}
    out, killed, row = _run("checkpoint_restart", base, args, lambda out, _: [_launch({**cfg, "out": out}, 1, nproc=4)],
                            "one job of 4 ranks (pp 2 x dp 2, no fault tolerance), batch 2 per dp rank", kill,
                            "steps_0.log (the job)", ft=False)
    # rank 0 may finish the killed step in its first launch (its pipeline peer died after the backward): that
    # step is in no checkpoint and on no other rank, so only the restarted job's steps count after the kill
    rows = [x for x in _steps(out, 0) if x[1] < killed or x[2] >= 1]
    second = [x for x in rows if x[2] >= 1]
    again = [t for s, t, _ in second if s == args.kill_step + 1]
    resumed = harness.read(Path(out, "result_0.json")).get("resumed_from")
    return {**row, **phases(rows, killed, second[0][1] if second else None),
            "kill_to_recovered_s": second[0][1] - killed if second else None,
            "resumed_from": os.path.basename(resumed or "") or None,
            "first_step_after_resume": second[0][0] if second else None,
            "kill_to_killed_step_committed_s": again[0] - killed if again else None,
            "completed": row["codes"][0] == 0 and bool(rows) and rows[-1][0] == args.steps}


def measured(args) -> None:
    start = harness.record()
    base = tempfile.mkdtemp(prefix="lmm-oobleck-measured-")
    res = {"what": "measured committed steps/s and samples/s (global batch 4) before, during and after one failure, "
                   "and the time to recover, of re-forming vs identical replica groups vs checkpoint-restart; CPU "
                   "processes with gloo",
           "settings": {"steps": args.steps, "kill_step": args.kill_step, "save_every": args.save_every,
                        "global_batch": MEASURED_BATCH, "heartbeat_s": 2.0, "join_s": 3.0},
           "model": "tests/helpers/ft_case.py: tiny siglip (frozen) + tiny llama, SGD momentum, StepLR",
           "runs": harness.read(MEASURED_OUT).get("runs", {}) if set(args.only) != set(RUNS) else {}}
    common = {"mode": "group", "steps": args.steps, "timeout": 10.0, "wait_rejoin": False}
    for name, run in zip(RUNS, (_reforming, _identical, _checkpoint_restart)):
        if name in args.only:
            res["runs"][name] = run(args, base, common)
    harness.write(MEASURED_OUT, res, start)
    print(f"run folders under {base}")


def main(argv=None) -> None:
    args = harness.cli(
        __doc__, argv, trials=(200, "failure orders averaged for identical groups"),
        restart_s=(11.0, "seconds to restart a group or a job"),
        storage_gbps=(2.5, "checkpoint storage GB/s (write and read)"),
        measured=(False, "the measured CPU-process comparison (see above)"),
        steps=(1200, "--measured: steps of every run (the survivor must outlast the re-forming)"),
        kill_step=(8, "--measured: the kill comes inside the next step"),
        save_every=(5, "--measured: checkpoint-restart's checkpoint interval"),
        only=dict(nargs="+", choices=RUNS, default=list(RUNS),
                  help="--measured: runs to make (the others are kept from the results file)"),
        timeout=(480.0, "--measured: seconds a run may take"))
    if args.measured:
        return measured(args)
    start = harness.record()
    harness.write(OUT, {"what": "simulated throughput (samples/s) beside the seed's Table 2.2; planning seconds per "
                                "template measured on this CPU beside Table 2.3",
                        "settings": {"nodes": NODES, "floor": FLOOR, "memory_gib": MEMORY / GIB, "link_gbps": 200,
                                     "restart_s": args.restart_s, "storage_gbps": args.storage_gbps,
                                     "trials": args.trials, "sequence": SEQ, "failures_tolerated": 1},
                        "throughput": throughput(args), "planning": planning()}, start,
                  sources={"throughput": "simulated"})


if __name__ == "__main__":
    main()
