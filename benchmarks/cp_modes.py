"""LLM context-parallel modes on CPU processes: one training step per mode, up to the longest sequence that fits.

Model, data, modes and the rules that skip a length: docs/context_parallel.md, "Measured on CPU processes".
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import harness
import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.context import check_context_parallel, distribute, pad_for_context_parallel, token_index
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.plan.layout import ParallelSpec, build_layout

# name -> (cp, cp_mode, ulysses)
MODES = {"cp1": (1, "allgather", None), "allgather2": (2, "allgather", None), "ulysses2": (2, "ulysses", None),
         "allgather4": (4, "allgather", None), "ulysses4": (4, "ulysses", None), "hybrid2x2": (4, "hybrid", 2)}
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)
BLOCK = 128


def _mib(key: str) -> float:
    return harness.proc_kb(key, "/proc/meminfo" if key.startswith("Mem") else "/proc/self/status") / 1024


def build_model(hidden: int, layers: int, max_len: int):
    torch.manual_seed(0)
    vision = lmm.ModalityEncoder(tiny_encoder("siglip", image_size=64, patch_size=8), projector="mlp")
    llm = tiny_language_model("qwen2", vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 4,
                              num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=max_len)
    return lmm.MultimodalModel({"vision": vision}, llm).freeze(encoders=True, projectors=False, language_model=False)


def packed_row(model, length: int, seed: int = 0) -> dict:
    """One MP row of ``length`` tokens: synthetic EE samples packed first-fit, the rest padding."""
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
    return quad if a < 0 or b < 0 else max(a * length + b * length ** 2, t2)


def _skip(args, prev: dict, done: list, length: int, deadline: float) -> str | None:
    """Why rank 0 skips ``length`` (time cap, memory, budget), or None."""
    step_next = predict_step(done, length)
    mem_next = sum(b + (p - b) * length / prev["tokens"] for b, p in zip(prev["rss_before_mib"], prev["peak_rss_mib"]))
    room = args.mem_fraction * (_mib("MemAvailable") + sum(prev["rss_before_mib"]))
    left = deadline - time.time()
    steps_next = 1 if step_next > args.long_step else args.steps
    if step_next > args.cap:
        return f"time cap: a step would take ~{step_next:.0f} s > {args.cap:.0f} s"
    if mem_next > room:
        return (f"memory: ~{mem_next / 1024:.1f} GiB over all ranks > {args.mem_fraction:.0%} of "
                f"{room / args.mem_fraction / 1024:.1f} GiB available")
    if step_next * steps_next + 5 > left:
        return (f"budget: ~{step_next * steps_next:.0f} s for this length > {max(left, 0):.0f} s left of the mode's "
                "share of --budget")
    return None


def _share(world: int, value):
    """Rank 0's ``value`` on every rank."""
    box = [value]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def run_lengths(rank: int, world: int, name: str, args, deadline: float, result: str) -> None:
    """One mode's ranks: the lengths in ascending order until one is skipped; rank 0 rewrites ``result`` after each."""
    cp, mode, ulysses = MODES[name]
    torch.set_num_threads(args.threads)
    model = build_model(args.hidden, args.layers, max(args.lengths))
    spec = ParallelSpec(cp=cp, cp_mode=mode, ulysses=ulysses)
    check_context_parallel(model, spec)  # what the strategy checks before any process group
    layout = build_layout({"vision": ParallelSpec()}, spec, world, "replicated", ["vision"])
    engine = PipelineEngine(model, layout, rank, 1, cp_distribution="lpt", cp_block_size=BLOCK)
    opt = torch.optim.SGD(engine.trainable_parameters(), lr=1e-4)
    prev, done, rows = None, [], []
    for length in sorted(args.lengths):
        if prev is not None:  # decided on rank 0, the same answer everywhere
            reason = _share(world, _skip(args, prev, done, length, deadline) if rank == 0 else None)
            if reason is not None:
                if rank == 0:
                    harness.save(result, {"lengths": rows, "stopped": {"tokens": length, "skipped": reason}})
                return
        batch = packed_row(model, length)
        padded = pad_for_context_parallel(batch, cp, BLOCK)  # as the step pads a sequence of fewer than cp blocks
        plan = distribute(padded["bam"], cp, "lpt", BLOCK, padded.get("segment_ids"), ulysses=layout.ulysses)
        local_tokens = [len(token_index(p, BLOCK, padded["bam"].shape[1])) for p in plan]
        before, reset = _mib("VmRSS"), harness.rss_reset()
        steps = _share(world, 1 if done and predict_step(done, length) > args.long_step else args.steps)

        def step(_):
            engine.run(batch)
            engine.sync_gradients()
            opt.step()
            opt.zero_grad(set_to_none=True)

        warm, _, _ = harness.timed(step, args.warmup if prev is None else 0, 0)
        timed, cpu, _ = harness.timed(step, steps, 0)  # CPU: this rank's own work (gloo waits block, not spin)
        mem = [None] * world
        dist.all_gather_object(mem, (before, _mib("VmHWM"), statistics.median(cpu)))
        prev = {}
        if rank == 0:
            prev = {"tokens": length, "step_s": statistics.median(timed), "steps_s": timed,
                    "warmup_s": warm, "rss_before_mib": [round(b, 1) for b, _, _ in mem],
                    "peak_rss_mib": [round(p, 1) for _, p, _ in mem], "peak_reset": reset,
                    "cpu_s": [round(c, 3) for _, _, c in mem], "local_tokens": local_tokens,
                    "over_cap": statistics.median(timed) > args.cap, "load_1min": os.getloadavg()[0],
                    "segments": int(batch["segment_ids"].max()), "images": int(batch["item_counts"]["vision"].sum()),
                    "image_tokens": int((batch["input_ids"] == model.placeholder_ids["vision"]).sum()),
                    "padding": int((batch["attention_mask"] == 0).sum())}
            rows.append(prev)
            done.append((length, prev["step_s"]))
            harness.save(result, {"lengths": rows, "stopped": None})
        prev = _share(world, prev)


def run_mode(name: str, args, argv, share: float) -> dict:
    """One mode in a process of its own that spawns its ranks; ``share``: the seconds it may take (launch included),
    ended after that plus the last length's overrun."""
    cp, mode, ulysses = MODES[name]
    t0 = time.perf_counter()
    out = harness.run_worker(__file__, {"mode": name, "deadline": time.time() + share},
                             share + 2 * args.cap * (args.steps + args.warmup) + 60, argv)
    why = out.get("error") or out.get("exit")
    error = why and f"{why.splitlines()[0][:100]} {harness.error_line(why)}"
    if why and "SIGKILL" in why and "killed after" not in why:  # not ours: this run kills only after an overrun
        error += " (SIGKILL from outside, e.g. the kernel's out-of-memory killer)"
    for r in out.get("lengths", []):
        print(f"  {name:>10} {r['tokens']:>6} tokens: {r['step_s']:7.2f} s/step, CPU s per rank {r['cpu_s']}, "
              f"peak RSS {max(r['peak_rss_mib']):.0f} MiB/rank (load {r['load_1min']:.2f})", flush=True)
    return {"cp": cp, "cp_mode": mode, "ulysses": ulysses, "processes": cp, "wall_s": time.perf_counter() - t0,
            "lengths": out.get("lengths", []), "stopped": out.get("stopped"), "error": error}


def memory_projection(mode: dict, limit_mib: float) -> int | None:
    """Projected (not measured): the length at which the summed peak resident set of the mode's ranks, a straight
    line through its last two lengths, reaches ``limit_mib``."""
    rows = mode["lengths"][-2:]
    if len(rows) < 2:
        return None
    (s1, m1), (s2, m2) = [(r["tokens"], sum(r["peak_rss_mib"])) for r in rows]
    slope = (m2 - m1) / (s2 - s1)
    return None if slope <= 0 else int(s2 + (limit_mib - m2) / slope)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = harness.cli(
        __doc__, argv,
        lengths=(",".join(map(str, LENGTHS)), "comma-separated sequence lengths, tried in ascending order per mode"),
        modes=(",".join(MODES), f"comma-separated, of {','.join(MODES)}"),
        steps=(2, "timed steps per length (median reported)"),
        warmup=(1, "untimed steps before the first length"),
        long_step=(20.0, "seconds: a length whose step is predicted to take longer gets one timed step"),
        cap=(60.0, "seconds one step may take"),
        budget=(780.0, "seconds for all modes, launches included: each mode gets what is left / modes left"),
        mem_fraction=(0.8, "share of the available memory all ranks of a mode may be predicted to use"),
        threads=(1, "torch threads per rank"), hidden=256, layers=2, out=str(harness.RESULTS / "cp_modes_cpu.json"),
        worker=True)
    args.lengths, args.modes = [int(x) for x in args.lengths.split(",")], args.modes.split(",")
    if [m for m in args.modes if m not in MODES]:
        raise SystemExit(f"unknown modes {[m for m in args.modes if m not in MODES]}; choose from {list(MODES)}")
    if args.worker:
        name = args.worker["mode"]
        return harness.spawn(run_lengths, MODES[name][0], name, args, args.worker["deadline"], args.result)
    start = harness.record()
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f}; {os.cpu_count()} cores, "
          f"{_mib('MemAvailable') / 1024:.1f} GiB available", flush=True)
    t0 = time.perf_counter()
    modes = {}
    for i, name in enumerate(args.modes):
        share = (args.budget - (time.perf_counter() - t0)) / (len(args.modes) - i)  # what earlier modes left over
        print(f"{name}: {MODES[name][0]} process(es), up to {share:.0f} s", flush=True)
        modes[name] = m = run_mode(name, args, argv, share)
        if m["stopped"] or m["error"]:
            print(f"  {name:>10} stopped: {m['stopped'] and m['stopped']['skipped']}; error: {m['error']}")
    for m in modes.values():
        m["projected_memory_limit_tokens"] = memory_projection(m, args.mem_fraction * _mib("MemTotal"))
    harness.write(args.out, {
        "device": f"CPU, {os.cpu_count()} cores ({start['cpu']}), gloo",
        "how": "measured", "torch": torch.__version__, "command": start["command"],
        "load_average_before": load_before, "load_average_after": os.getloadavg(), "threads_per_rank": args.threads,
        "note": "cp 4 runs 4 processes on this machine's cores; times are ratios on a shared CPU, not GPU claims",
        "model": {"llm": "Qwen2", "hidden": args.hidden, "layers": args.layers, "heads": 8, "kv_heads": 2,
                  "head_dim": args.hidden // 8, "vocab": 1024, "encoder": "SigLIP tiny (frozen, 64 tokens/image), "
                  "MLP projector", "placement": "replicated", "data": "synthetic, MP (EE samples packed)",
                  "cp_distribution": "lpt", "cp_block_size": BLOCK, "precision": "fp32", "optimizer": "SGD"},
        "memory_total_mib": round(_mib("MemTotal")),
        "projected_memory_limit": f"summed peak RSS of a mode's ranks, linear in the length through its last two "
                                  f"lengths, reaching {args.mem_fraction:.0%} of the machine's memory (projected, "
                                  "not run)",
        "steps": args.steps, "warmup": args.warmup, "cap_s": args.cap, "budget_s": args.budget,
        "wall_s": time.perf_counter() - t0, "modes": modes}, start)


if __name__ == "__main__":
    main()
