"""What every benchmark shares: the machine record, the command line, worker processes, the results JSON.

    start = harness.record()                 # at the start (machine, command, load average before the run)
    args = harness.cli(__doc__, argv, steps=5, warmup=(2, "untimed steps"))
    harness.write(RESULTS / "x.json", doc, start)   # JSON + machine record, its doc quotes printed and rewritten
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
L3_FALLBACK = 32 << 20  # bytes assumed when the machine does not say
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
SOURCES = ("measured", "simulated", "computed", "published", "setting")


# ---------------------------------------------------------------------------------------------- the machine record
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform where that is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _size(text: str) -> int:
    text = text.strip().upper().replace("IB", "").replace(" ", "")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1:] in scale else int(text)


def l3_bytes() -> int | None:
    """Size of the L3 (last-level) cache cpu0 sees, from sysfs, else lscpu; None when neither says (sizes the
    cold-cache eviction of cp_balance.py)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                return _size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        line = next(x for x in out.splitlines() if x.startswith("L3 cache:"))
        return _size(" ".join(line.split(":", 1)[1].split()[:2]))
    except (OSError, StopIteration, ValueError, subprocess.SubprocessError):
        return None


def command() -> str:
    """The command that ran, as typed from the repository root."""
    argv = list(sys.argv)
    try:
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    except ValueError:
        pass
    return "python " + shlex.join(argv)


def commit() -> str:
    """The checked-out commit, with "+changes" when the code (the package or the benchmarks) differs from it."""
    git = {"cwd": ROOT, "capture_output": True, "text": True}
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=True, **git).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "lightning_mm",
                                "benchmarks", ":!benchmarks/results"], **git).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _load() -> tuple[list[float], dict[str, int]]:
    """The load average, and the processes running or ready to run now by priority against this one: work at a
    lower priority (a larger nice value) counts in the load average but yields the CPU to the benchmark."""
    mine, runnable = os.nice(0), {"same_or_higher_priority": 0, "lower_priority": 0}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "R":
            runnable["lower_priority" if int(fields[16]) > mine else "same_or_higher_priority"] += 1
    return [round(x, 2) for x in os.getloadavg()], runnable


def record() -> dict:
    """Machine, software and command at the start of a run."""
    import torch

    l3, (load, runnable) = l3_bytes(), _load()
    return dict(cpu=cpu_model(), cores=os.cpu_count(), l3_bytes=l3, l3=f"{l3 >> 20} MB" if l3 else "unknown",
                torch=torch.__version__, python=platform.python_version(), load_average_start=load,
                runnable_start=runnable,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command(), commit=commit(), _t0=time.time())


def finish(start: dict) -> dict:
    """``start`` with the load average at the end and the run's duration added."""
    out = {k: v for k, v in start.items() if k != "_t0"}
    out["load_average_end"], out["runnable_end"] = _load()
    out["duration_s"] = round(time.time() - start.get("_t0", time.time()), 1)
    return out


def slug(name: str) -> str:
    """A device name as a file-name part: "NVIDIA H200" -> "nvidia_h200"."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def describe(machine: dict | str | None) -> str:
    """One phrase naming the machine of a results JSON, for the text beside its figures."""
    if not isinstance(machine, dict):
        return "an unrecorded machine"
    m, load = machine, machine.get("load_average_start")
    lower = (m.get("runnable_start") or {}).get("lower_priority")
    yielded = f" ({lower} runnable processes at a lower priority)" if lower else ""
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('l3', '?')} L3"
            + (f", {m['date'][:10]}" if m.get("date") else "") + (f", commit {m['commit']}" if m.get("commit") else "")
            + (f", load average {load[0]:.1f} at start{yielded}" if load else ""))


# ---------------------------------------------------------------------------------------------- command line, JSON
def cli(doc: str, argv=None, worker: bool = False, **options) -> argparse.Namespace:
    """Parse ``argv``, one ``--option`` per keyword: ``name=default``, ``name=(default, help)`` or a dict of
    ``add_argument`` keywords. The type follows the default; a False default makes a flag. ``worker``: the hidden
    ``--worker CFG`` (JSON, parsed) and ``--result FILE`` that ``run_worker`` passes."""
    parser = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0])
    if worker:
        parser.add_argument("--worker", type=json.loads, help=argparse.SUPPRESS)
        parser.add_argument("--result", help=argparse.SUPPRESS)
    for name, spec in options.items():
        kw = dict(spec) if isinstance(spec, dict) else dict(zip(("default", "help"), spec if isinstance(spec, tuple)
                                                                 else (spec,)))
        default = kw.get("default")
        if default is False:
            kw["action"] = "store_true"
        elif default is not None and not {"type", "nargs", "action", "choices"} & set(kw):
            kw["type"] = type(default)
        parser.add_argument("--" + name.replace("_", "-"), **kw)
    return parser.parse_args(argv)


def obtained(doc: dict, given: dict | None = None) -> dict[str, str]:
    """How each top-level entry of a results JSON was obtained (one of ``SOURCES``; a setting is an input of the
    run): ``given`` where a benchmark says, else by its name (``simulated*`` simulated; ``published*``/``paper*``/
    ``seed*`` published; ``expected*``/``*formula*`` computed; ``setting*``/``config*``/``goals``/``what``/``how``
    a setting) or, for the rest, measured when the JSON has a machine record and computed otherwise. The doc test
    checks that every quote says the source of each entry it reads."""
    given = dict(given or {})
    unknown = {k: v for k, v in given.items() if v not in SOURCES}
    if unknown:
        raise ValueError(f"obtained: {unknown} are not among {SOURCES}")
    recorded = isinstance(doc.get("machine"), dict) or isinstance(doc.get("measured_machine"), dict)
    out = {}
    for key in [k for k in doc if k not in ("machine", "measured_machine", "obtained")]:
        low = key.lower()
        out[key] = given.get(key) or (
            "simulated" if low.startswith("simulat") else
            "published" if low.startswith(("published", "paper", "seed")) else
            "computed" if low.startswith("expected") or "formula" in low else
            "setting" if low.startswith(("setting", "config")) or low in ("goals", "what", "how") else
            "measured" if recorded else "computed")
    return out


def write(path: Path | str, doc: dict, start: dict | None = None, sources: dict | None = None) -> Path:
    """Write a results JSON (with the machine record when ``start`` is given, and ``obtained``: how each entry was
    obtained, ``sources`` overriding the names' defaults) and print the figures the docs quote from it; written under
    benchmarks/results/, the quotes in README.md and docs/ are rewritten too."""
    path = Path(path)
    if start is not None:
        doc["machine"] = finish(start)
    doc["obtained"] = obtained(doc, sources)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    shown = tables.show(path.name, doc)
    if shown:
        print(shown)
    if path.resolve().parent == RESULTS:
        tables.main(["--quiet"])
    print(f"wrote {path}")
    return path


def print_rows(rows: list[dict], columns: list[str], title: str = "") -> None:
    """``rows`` as aligned text columns, one per key of ``columns`` (numbers to 3 decimals, missing: -)."""
    cells = [[c, *["-" if r.get(c) is None else f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])
                   for r in rows]] for c in columns]
    widths = [max(map(len, col)) for col in cells]
    print("\n".join(([title] if title else []) + ["  ".join(col[i].rjust(w) for col, w in zip(cells, widths))
                                                  for i in range(len(rows) + 1)]))


def read(path: Path | str) -> dict:
    """A results JSON, or {} where there is none yet."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


# ---------------------------------------------------------------------------------------------- processes
def error_line(error: str) -> str:
    """The first exception's message (a teardown error raised while handling it comes after)."""
    lines = [x.strip() for x in error.split("During handling of the above exception")[0].splitlines() if x.strip()]
    return lines[-1] if lines else error


def run_worker(script: str, cfg: dict, timeout: float, argv=()) -> dict:
    """``script [argv] --worker CFG --result FILE`` in fresh processes of a session of their own (all of it ended
    after: ranks left waiting in a collective when another failed): the JSON it wrote, else its error."""
    with tempfile.TemporaryDirectory() as tmp:
        result, log = Path(tmp, "result.json"), Path(tmp, "stderr.txt")
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(Path(script).resolve()), *argv, "--worker", json.dumps(cfg), "--result",
               str(result)]
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = f"killed after {timeout:.0f} s"
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        stderr = log.read_text(errors="replace")
        if not result.exists():
            return {**cfg, "error": f"no result (exit {code}):\n{stderr[-3000:]}"}
        doc = json.loads(result.read_text())
        if code != 0 and "error" not in doc:  # measured and written, then failed in teardown: keep it, say so
            doc["exit"] = f"exit code {code} after writing results: {stderr.strip()[-300:]}"
        return doc


def launch(script: str, cfg: dict, timeout: float, name: str, argv=(), fail: bool = True) -> dict:
    """``run_worker`` and one line on how it went: the worker's JSON; its error raised when ``fail``, else kept."""
    start = time.time()
    row = run_worker(script, cfg, timeout, argv)
    if "error" in row and fail:
        raise RuntimeError(f"{name} failed:\n{row['error']}")
    what = f"error: {error_line(row['error'])[:200]}" if "error" in row else (
        f"{row['samples_per_s']:.3f} samples/s" if "samples_per_s" in row else "done")
    print(f"{name}: {what} ({time.time() - start:.0f} s with launch)" + (
        f"; warning: {row['exit']}" if "exit" in row else ""), flush=True)
    return row


def save(result: str, doc: dict, trainer=None) -> None:
    """A worker's JSON written to ``result`` (under a Lightning ``trainer``: by its rank 0 only)."""
    if trainer is None or trainer.global_rank == 0:
        Path(result).write_text(json.dumps(doc))


def rank_rows(trainer, mine: dict) -> list[dict] | None:
    """Every rank's ``mine`` (with its rank and stage) on rank 0 of a Lightning run; None on the others."""
    import torch.distributed as dist

    engine = getattr(trainer.strategy, "engine", None)
    mine = {"rank": trainer.global_rank, "stage": engine.stage if engine is not None else "whole model", **mine}
    ranks = [mine]
    if trainer.world_size > 1:
        ranks = [None] * trainer.world_size
        dist.all_gather_object(ranks, mine)
    return ranks if trainer.global_rank == 0 else None


def engine_steps(model, layout, rank: int, args: dict, **data):
    """This rank's ``PipelineEngine`` of ``model`` under ``layout``, the global batches (``args["batch"]`` synthetic
    samples each, seed 1, ``data``: more ``SyntheticMultimodalDataset`` keywords) and ``step(i)``: run batch i's
    share of this rank's group, sync the gradients, step SGD. For ``timed``."""
    import torch

    import lightning_mm as lmm
    from lightning_mm.data.microbatch import split_microbatches
    from lightning_mm.parallel.engine import PipelineEngine

    batch, count = args["batch"], args["warmup"] + args["steps"]
    engine = PipelineEngine(model, layout, rank, args["microbatches"])
    samples = lmm.data.SyntheticMultimodalDataset(model, num_samples=batch * count, seed=1, **data)
    collate, params = lmm.data.MultimodalCollator(model), engine.trainable_parameters()
    opt = torch.optim.SGD(params, lr=1e-3) if params else None
    batches = [collate([samples[i * batch + j] for j in range(batch)]) for i in range(count)]
    mine = [split_microbatches(b, layout.num_groups, model)[layout.group_of(rank)] for b in batches]

    def step(i):
        engine.run(mine[i])
        engine.sync_gradients()
        if opt:
            opt.step()
            opt.zero_grad()

    return engine, batches, step


def busiest_cpu_s(ranks: list[dict]) -> float:
    """The median over timed steps of the busiest rank's CPU seconds (``cpu``: each rank's per step)."""
    import statistics

    return statistics.median(max(c) for c in zip(*(r["cpu"] for r in ranks)))


def spawn(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo processes of one torch thread (file rendezvous); what each
    rank returns (JSON), in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world, tmp, fn, args), nprocs=world)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def _spawned(rank: int, world: int, tmp: str, fn, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(fn(rank, world, *args)))
    finally:
        dist.destroy_process_group()


def repeat(fn, repeats: int, before=None, cpu_clock=time.process_time) -> tuple[list[float], list[float], object]:
    """Wall and CPU (``cpu_clock``) seconds of ``repeats`` calls of ``fn``, ``before`` untimed ahead of each, and the
    last call's result."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        if before is not None:
            before()
        c, t = cpu_clock(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(cpu_clock() - c)
    return walls, cpus, out


def timed(step, steps: int, warmup: int) -> tuple[list[float], list[float], list]:
    """Wall and CPU (process) seconds of ``steps`` calls of ``step(i)`` after ``warmup`` untimed ones, barrier to
    barrier, and what each timed call returned."""
    import torch.distributed as dist

    walls, cpus, outs = [], [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = step(i)
        c1 = time.process_time()
        dist.barrier()
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
            cpus.append(c1 - c0)
            outs.append(out)
    return walls, cpus, outs


# ---------------------------------------------------------------------------------------------- memory, plots
def rss_reset() -> bool:
    """Reset this process's peak-RSS mark (Linux clear_refs 5); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def proc_kb(key: str, path: str = "/proc/self/status") -> float:
    """A field of /proc/self/status (VmRSS, VmHWM) or /proc/meminfo (MemTotal, MemAvailable), in KiB."""
    with open(path) as f:
        return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), 0)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


import tables  # noqa: E402  (benchmarks/tables.py, which imports this module's names above)
