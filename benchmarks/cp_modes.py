"""LLM context-parallel modes on CPU processes: one training step per mode, up to the longest sequence that fits.

Modes (``ParallelSpec`` of the language model): cp 1 (one process, the baseline), allgather cp 2, ulysses cp 2,
allgather cp 4, ulysses cp 4, hybrid 2x2 (cp 4, Ulysses in groups of 2, all-gather across the 2 groups). Every mode
runs on its own gloo processes (one per CP rank, ``--threads`` torch threads each), through ``PipelineEngine`` (what
``MultimodalParallelStrategy`` drives each training step; the Lightning Trainer around it adds a constant and is
left out so that the lengths of one mode share one launch), with the strategy's layout check
(``check_context_parallel``) and the default LPT distribution over blocks of 128 tokens.

Model: a frozen tiny SigLIP (64 tokens per image) + trainable MLP projector + a trainable Qwen2 decoder
(``--hidden`` 256, ``--layers`` 2, 8 query heads of 32, 2 KV heads: GQA, so Ulysses over 4 ranks repeats each KV
head; vocabulary 1024), replicated encoder placement (the encoder runs inside the LLM stage on every CP rank, so a
mode uses exactly cp processes), fp32. Data: the synthetic data set, multimodal packing (MP): samples of 64-768
text tokens with 1-4 images embedded at random places (EE), packed first-fit into one row of the length (the rest
is padding): 4 samples and 7 images at 2k tokens, 13 and 30 at 8k, bidirectional image runs inside causal text. A step is the real
training step: ``engine.run`` (embedding, every decoder layer with the mode's CP attention -- K/V all-gather and
reduce-scatter, or the Ulysses all-to-alls, or both -- loss, backward), the gradient all-reduce over the CP ranks,
and an SGD update. Attention on CPU is the chunked reference backend (queries in chunks of 1024 against all keys):
its work is dense, the mask does not skip blocks, so a rank's attention time follows its query count x keys.

Per mode the lengths (``--lengths``) run in ascending order on the same processes: ``--warmup`` untimed steps
before the first length (before every length with ``--warmup-each``), then ``--steps`` timed steps per length (one
where a step is predicted to take over ``--long-step`` seconds; median reported; a step = barrier to barrier, rank
0's clock), each rank's CPU seconds in the step (process time: its own work, robust to other jobs on the machine),
the peak resident set of every rank (VmHWM, reset before each length) and the rank's resident set before it. The next length is skipped when its step time
(``a S + b S^2`` through the last two lengths) would pass ``--cap`` seconds, when the memory of all ranks scaled
linearly (the growth above the resident set before the length) would pass ``--mem-fraction`` of what the machine
has available, or when the mode's share of ``--budget`` (what is left over the modes left, launches included)
would run out; the reason is recorded. A rank that dies (e.g. killed for memory) or a mode that overruns ends that
mode with the error kept; the other modes still run.

On this machine cp 4 puts 4 processes on 2 cores: its times show the communication and the split work, not a
speed-up. Times are ratios on a shared, noisy machine, not claims about GPUs; the load average is recorded before
and after. Writes benchmarks/results/cp_modes_cpu.json and prints a table.

    python benchmarks/cp_modes.py [--lengths 2048,4096,...,65536] [--modes cp1,allgather2,ulysses2,...]
                                  [--steps 2] [--warmup 1] [--warmup-each] [--long-step 20] [--cap 60]
                                  [--budget 780] [--mem-fraction 0.8] [--threads 1] [--hidden 256] [--layers 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _machine  # benchmarks/_machine.py: the machine record
import tables  # benchmarks/tables.py: the figures the docs quote

from pipeline import _rss_reset, _status_kb  # benchmarks/pipeline.py: peak-RSS helpers

RESULTS = pathlib.Path(__file__).parent / "results"
# name -> (cp, cp_mode, ulysses)
MODES = {"cp1": (1, "allgather", None), "allgather2": (2, "allgather", None), "ulysses2": (2, "ulysses", None),
         "allgather4": (4, "allgather", None), "ulysses4": (4, "ulysses", None), "hybrid2x2": (4, "hybrid", 2)}
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)
BLOCK = 128


# ---------------------------------------------------------------------------------------------------- helpers
def _meminfo_mib(key: str) -> float:
    """A /proc/meminfo field (MemTotal, MemAvailable) in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("inf")


def build_model(hidden: int, layers: int, max_len: int):
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    vision = lmm.ModalityEncoder(tiny_encoder("siglip", image_size=64, patch_size=8), projector="mlp")
    llm = tiny_language_model("qwen2", vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 4,
                              num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=max_len)
    return lmm.MultimodalModel({"vision": vision}, llm).freeze(encoders=True, projectors=False, language_model=False)


def packed_row(model, length: int, seed: int = 0) -> dict:
    """One MP row of ``length`` tokens: synthetic EE samples packed first-fit, the rest padding."""
    import lightning_mm as lmm

    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=10 ** 6, text_tokens=(64, 768),
                                               items_per_sample=(1, 4), layout="ee", seed=seed)
    picked, used, misses = [], 0, 0
    for i in range(10 ** 6):
        n = data.sample_metadata(i).llm_tokens
        if used + n <= length:
            picked.append(data[i])
            used += n
        else:
            misses += 1
        if length - used < 64 + 64 or misses > 50:
            break
    batch = lmm.data.MultimodalCollator(model, seq_len=length, pack=True)(picked)
    assert batch["input_ids"].shape == (1, length), batch["input_ids"].shape
    return batch


# ---------------------------------------------------------------------------------------------------- one rank
def _worker(rank: int, world: int, name: str, args, rendezvous: str, out_path: str, deadline: float) -> None:
    torch.set_num_threads(args.threads)
    try:
        _run(rank, world, name, args, rendezvous, out_path, deadline)
    except BaseException:  # noqa: BLE001  (kept in the results, the parent ends the others)
        with open(f"{out_path}.err{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def timed_steps(args, predicted_s: float) -> int:
    """``--steps``, or one where a step is predicted to take over ``--long-step`` seconds (its noise is small
    against its length; the whole run has to fit in ``--budget``)."""
    return 1 if predicted_s > args.long_step else args.steps


def predict_step(done: list[tuple[int, float]], length: int) -> float:
    """A step's seconds at ``length`` from the lengths already run: ``t = a S + b S^2`` through the last two (the
    linear layers and the dense attention), or quadratic from one; never below the last time."""
    (s2, t2) = done[-1]
    quad = t2 * (length / s2) ** 2
    if len(done) < 2:
        return quad
    (s1, t1) = done[-2]
    b = (t2 / s2 - t1 / s1) / (s2 - s1)
    a = t2 / s2 - b * s2
    if a < 0 or b < 0:
        return quad
    return max(a * length + b * length ** 2, t2)


def _run(rank: int, world: int, name: str, args, rendezvous: str, out_path: str, deadline: float) -> None:
    from lightning_mm.parallel.context import (check_context_parallel, distribute, pad_for_context_parallel,
                                               token_index)
    from lightning_mm.parallel.engine import PipelineEngine
    from lightning_mm.plan.layout import ParallelSpec, build_layout

    cp, mode, ulysses = MODES[name]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.cap * 10))
    lengths = sorted(args.lengths)
    model = build_model(args.hidden, args.layers, max(lengths))
    spec = ParallelSpec(cp=cp, cp_mode=mode, ulysses=ulysses)
    check_context_parallel(model, spec)  # what the strategy checks before any process group
    layout = build_layout({"vision": ParallelSpec()}, spec, world, "replicated", ["vision"])
    engine = PipelineEngine(model, layout, rank, 1, cp_distribution="lpt", cp_block_size=BLOCK)
    opt = torch.optim.SGD(engine.trainable_parameters(), lr=1e-4)
    prev, done = None, []
    for length in lengths:
        if prev is not None:  # decide on rank 0, the same answer everywhere
            reason = [None]
            if rank == 0:
                grow = length / prev["tokens"]
                step_next = predict_step(done, length)
                mem_next = sum(b + (p - b) * grow for b, p in zip(prev["rss_before_mib"], prev["peak_rss_mib"]))
                mem_now = sum(prev["rss_before_mib"])
                room = args.mem_fraction * (_meminfo_mib("MemAvailable") + mem_now)
                left = deadline - time.time()
                steps_next = timed_steps(args, step_next) + (args.warmup if args.warmup_each else 0)
                if step_next > args.cap:
                    reason[0] = f"time cap: a step would take ~{step_next:.0f} s > {args.cap:.0f} s"
                elif mem_next > room:
                    reason[0] = (f"memory: ~{mem_next / 1024:.1f} GiB over all ranks > {args.mem_fraction:.0%} of "
                                 f"{room / args.mem_fraction / 1024:.1f} GiB available")
                elif step_next * steps_next + 5 > left:
                    reason[0] = (f"budget: ~{step_next * steps_next:.0f} s for this length > {max(left, 0):.0f} s "
                                 "left of the mode's share of --budget")
            if world > 1:
                dist.broadcast_object_list(reason, src=0)
            if reason[0] is not None:
                if rank == 0:
                    _append(out_path, {"tokens": length, "skipped": reason[0]})
                break
        batch = packed_row(model, length)
        padded = pad_for_context_parallel(batch, cp, BLOCK)  # as the step pads a sequence of fewer than cp blocks
        plan = distribute(padded["bam"], cp, "lpt", BLOCK, padded.get("segment_ids"), ulysses=layout.ulysses)
        local_tokens = [len(token_index(p, BLOCK, padded["bam"].shape[1])) for p in plan]
        times, cpu = [], []
        before = _status_kb("VmRSS") / 1024
        reset = _rss_reset()
        warmup = args.warmup if (args.warmup_each or prev is None) else 0
        steps = [args.steps if not done else timed_steps(args, predict_step(done, length))]  # rank 0 predicts
        if world > 1:
            dist.broadcast_object_list(steps, src=0)
        for _ in range(warmup + steps[0]):
            if world > 1:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.run(batch)
            engine.sync_gradients()
            opt.step()
            opt.zero_grad(set_to_none=True)
            cpu.append(time.process_time() - c0)  # this rank's own work (gloo waits block, they do not spin)
            if world > 1:
                dist.barrier()
            times.append(time.perf_counter() - t0)
        peak = _status_kb("VmHWM") / 1024
        mine = (before, peak, statistics.median(cpu[warmup:]))
        mem = [mine]
        if world > 1:
            mem = [None] * world
            dist.all_gather_object(mem, mine)
        if rank == 0:
            timed = times[warmup:]
            prev = {"tokens": length, "step_s": statistics.median(timed), "steps_s": timed,
                    "warmup_s": times[:warmup], "rss_before_mib": [round(b, 1) for b, _, _ in mem],
                    "peak_rss_mib": [round(p, 1) for _, p, _ in mem], "peak_reset": reset,
                    "cpu_s": [round(c, 3) for _, _, c in mem], "local_tokens": local_tokens,
                    "over_cap": statistics.median(timed) > args.cap, "load_1min": os.getloadavg()[0],
                    "segments": int(batch["segment_ids"].max()), "images": int(batch["item_counts"]["vision"].sum()),
                    "image_tokens": int((batch["input_ids"] == model.placeholder_ids["vision"]).sum()),
                    "padding": int((batch["attention_mask"] == 0).sum())}
            _append(out_path, prev)
            done.append((length, prev["step_s"]))
            print(f"  {name:>10} {length:>6} tokens: {prev['step_s']:7.2f} s/step, CPU s per rank {prev['cpu_s']}, "
                  f"peak RSS {max(prev['peak_rss_mib']):.0f} MiB/rank (load {os.getloadavg()[0]:.2f})", flush=True)
        else:
            prev = {}
        if world > 1:
            box = [prev]
            dist.broadcast_object_list(box, src=0)
            prev = box[0]
    dist.destroy_process_group()


def _append(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------------- one mode
def run_mode(name: str, args, tmp: pathlib.Path, share: float) -> dict:
    """Run one mode on its processes; ``share``: the seconds it may take (launch included)."""
    cp = MODES[name][0]
    out_path = tmp / f"{name}.jsonl"
    out_path.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    rendezvous = tmp / f"{name}.rendezvous"  # a file rendezvous: no port to pick
    rendezvous.unlink(missing_ok=True)
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(r, cp, name, args, str(rendezvous), str(out_path), time.time() + share))
             for r in range(cp)]
    for p in procs:
        p.start()
    deadline = t0 + share + 2 * args.cap * (args.steps + args.warmup) + 60  # the last length's overrun
    error = None
    while any(p.is_alive() for p in procs):
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive() and p.exitcode]
        if dead or time.perf_counter() > deadline:
            error = (f"rank {dead[0][0]} exited with code {dead[0][1]}" if dead else
                     f"overran {deadline - t0:.0f} s")
            break
        time.sleep(0.5)
    for p in procs:  # only the processes this run started
        if p.is_alive():
            p.kill()
        p.join()
    if error is None:
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
        error = f"rank {bad[0][0]} exited with code {bad[0][1]}" if bad else None
    rows = [json.loads(line) for line in out_path.read_text().splitlines()] if out_path.exists() else []
    errs = sorted(tmp.glob(f"{name}.jsonl.err*"))
    if errs:
        error = (error or "") + "\n" + errs[0].read_text().strip().splitlines()[-1]
        for e in errs:
            e.unlink()
    if error and "code -9" in error:  # not ours: this run kills only after an overrun, and says so
        error += " (SIGKILL from outside, e.g. the kernel's out-of-memory killer)"
    cp_, mode, ulysses = MODES[name]
    return {"cp": cp_, "cp_mode": mode, "ulysses": ulysses, "processes": cp_, "wall_s": time.perf_counter() - t0,
            "lengths": [r for r in rows if "step_s" in r], "stopped": next((r for r in rows if "skipped" in r), None),
            "error": error}


# ---------------------------------------------------------------------------------------------------- main
def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _grid(result: dict, title, cell, ratio_of) -> list[str]:
    """Mode x length table: ``cell(row)`` per measured length and the speed-up over cp 1 of ``ratio_of(row)``."""
    lengths = sorted({r["tokens"] for m in result["modes"].values() for r in m["lengths"]})
    base = {r["tokens"]: ratio_of(r) for r in result["modes"].get("cp1", {"lengths": []})["lengths"]}
    lines = [f"{'mode':>11} {'procs':>5} " + " ".join(f"{f'{_k(n)} {title}':>24}" for n in lengths)]
    for name, m in result["modes"].items():
        cells = {r["tokens"]: r for r in m["lengths"]}
        row = []
        for n in lengths:
            r = cells.get(n)
            ratio = f"{base[n] / ratio_of(r):.2f}" if r is not None and n in base and name != "cp1" else "-"
            row.append(f"{'-':>24}" if r is None else f"{cell(r)} | {ratio:>5}")
        lines.append(f"{name:>11} {m['processes']:>5} " + " ".join(row))
    return lines


def _table(result: dict) -> list[str]:
    lines = _grid(result, "s | MiB | x cp1", lambda r: f"{r['step_s']:>9.2f} | {max(r['peak_rss_mib']):>5.0f}",
                  lambda r: r["step_s"])
    lines[0] += "  longest  memory-bound (projected)"
    for i, (name, m) in enumerate(result["modes"].items(), 1):
        proj = m.get("projected_memory_limit_tokens")
        lines[i] += f"  {_k(max((r['tokens'] for r in m['lengths']), default=0)):>7}  " + \
            (f"~{proj / 1024:.0f}k" if proj else "-")
    return lines


def command(args) -> str:
    parts = []
    for k, v in vars(args).items():
        if k == "out" or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {','.join(map(str, v)) if isinstance(v, list) else v}")
    return "python benchmarks/cp_modes.py " + " ".join(parts)


def memory_projection(mode: dict, limit_mib: float) -> int | None:
    """Projected (not measured): the length at which the summed peak resident set of the mode's ranks, a straight
    line through its last two lengths, reaches ``limit_mib``."""
    rows = mode["lengths"][-2:]
    if len(rows) < 2:
        return None
    (s1, m1), (s2, m2) = [(r["tokens"], sum(r["peak_rss_mib"])) for r in rows]
    slope = (m2 - m1) / (s2 - s1)
    return None if slope <= 0 else int(s2 + (limit_mib - m2) / slope)


def _cpu_table(result: dict) -> list[str]:
    """CPU seconds of a step: the busiest rank (a step's time with a free core per rank and free communication)
    and the sum over ranks (the work the mode costs in all, communication copies included)."""
    return _grid(result, "max | sum | x cp1", lambda r: f"{max(r['cpu_s']):>8.2f} | {sum(r['cpu_s']):>7.2f}",
                 lambda r: max(r["cpu_s"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="comma-separated sequence lengths, tried in ascending order per mode")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per length (median reported)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps before the first length (before every length with --warmup-each)")
    parser.add_argument("--warmup-each", action="store_true")
    parser.add_argument("--long-step", type=float, default=20.0,
                        help="seconds: a length whose step is predicted to take longer gets one timed step")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds one step may take")
    parser.add_argument("--budget", type=float, default=780.0,
                        help="seconds for all modes, launches included: each mode gets what is left / modes left")
    parser.add_argument("--mem-fraction", type=float, default=0.8,
                        help="share of the available memory all ranks of a mode may be predicted to use")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "cp_modes_cpu.json"))
    args = parser.parse_args()
    start = _machine.record()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")

    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; "
          f"{os.cpu_count()} cores, {_meminfo_mib('MemAvailable') / 1024:.1f} GiB available", flush=True)
    tmp = RESULTS / ".cp_modes_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    modes = {}
    for i, name in enumerate(args.modes):
        share = (args.budget - (time.perf_counter() - t0)) / (len(args.modes) - i)  # what earlier modes left over
        print(f"{name}: {MODES[name][0]} process(es), up to {share:.0f} s", flush=True)
        modes[name] = run_mode(name, args, tmp, share)
        if modes[name]["stopped"]:
            print(f"  {name:>10} stopped before {modes[name]['stopped']['tokens']}: {modes[name]['stopped']['skipped']}")
        if modes[name]["error"]:
            print(f"  {name:>10} ERROR: {modes[name]['error']}")
    for f in tmp.glob("*"):
        f.unlink()
    tmp.rmdir()
    load_after = os.getloadavg()
    limit = args.mem_fraction * _meminfo_mib("MemTotal")
    for m in modes.values():
        m["projected_memory_limit_tokens"] = memory_projection(m, limit)
    result = {
        "device": f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), gloo",
        "how": "measured", "torch": torch.__version__, "command": command(args),
        "load_average_before": load_before, "load_average_after": load_after,
        "threads_per_rank": args.threads,
        "note": "cp 4 runs 4 processes on this machine's cores; times are ratios on a shared CPU, not GPU claims",
        "model": {"llm": "Qwen2", "hidden": args.hidden, "layers": args.layers, "heads": 8, "kv_heads": 2,
                  "head_dim": args.hidden // 8, "vocab": 1024, "encoder": "SigLIP tiny (frozen, 64 tokens/image), "
                  "MLP projector", "placement": "replicated", "data": "synthetic, MP (EE samples packed)",
                  "cp_distribution": "lpt", "cp_block_size": BLOCK, "precision": "fp32", "optimizer": "SGD"},
        "memory_total_mib": round(_meminfo_mib("MemTotal")),
        "projected_memory_limit": f"summed peak RSS of a mode's ranks, linear in the length through its last two "
                                  f"lengths, reaching {args.mem_fraction:.0%} of the machine's memory (projected, "
                                  "not run)",
        "steps": args.steps, "warmup": args.warmup, "cap_s": args.cap, "budget_s": args.budget,
        "wall_s": time.perf_counter() - t0, "modes": modes, "machine": _machine.finish(start)}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    tables.main(["--quiet"])
    print(f"\none training step per mode (measured, {result['device']}, {args.threads} thread(s) per rank; "
          f"median of {args.steps} after {args.warmup} warm-up, 1 step where one takes over {args.long_step:.0f} s):")
    print("cell: step seconds | peak RSS MiB (largest rank) | speed-up over cp 1 at that length")
    for line in _table(result):
        print(line)
    print("CPU seconds per step (process time, median): busiest rank | sum over ranks | cp 1 over the busiest rank")
    for line in _cpu_table(result):
        print(line)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); "
          f"{os.cpu_count()} cores: cp 4 = 4 processes share them")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
