"""Expert parallelism measured on CPU processes, beside the planner's predicted ep trade-off.

Measured: a tiny-but-not-trivial Qwen3-MoE VLM (SigLIP 2 layers of width 64 + MLP projector + Qwen3-MoE, 4 layers of
width 128, 8 experts of width 256, top-2, vocab 512) trained on ``--world`` gloo processes (one torch thread each),
encoders replicated inside the LLM stage (one rank per replica), under two layouts on the same processes:

- ``dp 2``: every rank holds every expert (``ParallelSpec(ep=1)``);
- ``dp 2 x ep 2``: each rank holds half of every layer's experts and exchanges tokens with all-to-all
  (``ParallelSpec(ep=2)``, transformers' ``AllToAllEP``).

Each layout runs ``--warmup`` untimed and ``--steps`` timed training steps through ``PipelineEngine`` (the schedule,
the expert all-to-alls, gradient sums over the ranks holding the same experts, an SGD update) on the same global
batches. Reported per layout: rank 0's median step (barrier to barrier) and tokens/s (the global batch's tokens,
padding excluded, over that step), the busiest rank's CPU seconds per step,
the expert weights each rank holds (bytes of its local shards, measured on the parameters) and the experts' share of
its parameters, the expert load imbalance (busiest expert / mean, per layer, of the last step's routing), and the
all-to-all bytes each rank sends to other ranks per step, measured from the split sizes of every dispatch (forward
dispatch and combine, and their mirrored backward exchanges), beside the planner's byte model
(``planner.moe_costs.all_to_all_bytes``: uniform routing) at the same token count.

Simulated (labelled so): the planner's ``evaluate_plan`` for Qwen3-30B-A3B shapes (48 layers, hidden 2048, 128
experts of width 768, top-8, 4096 tokens per microbatch, bf16 all-to-all, 16 bytes of state per trainable
parameter) on dp 8 x pp 4: per-rank memory and iteration time at ep 1, 2, 4, 8, with assumed 400 TFLOP/s per device
and assumed all-to-all bandwidths of 50 GB/s (inter-node) and 400 GB/s (NVLink).

    python benchmarks/moe.py [--world 2] [--batch 8] [--microbatches 2] [--steps 6] [--warmup 2]

Writes benchmarks/results/moe_cpu.json, prints both tables and rewrites the tables docs/moe.md quotes from it
(benchmarks/tables.py). The machine is shared: the load average is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _machine  # benchmarks/_machine.py: the machine record
import tables  # benchmarks/tables.py: the figures docs quote

RESULTS = pathlib.Path(__file__).parent / "results"
LM = "language_model"


def build_model(args):
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    vision = tiny_encoder("siglip", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    llm = tiny_language_model("qwen3_moe", vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                              moe_intermediate_size=args.expert_width, num_experts=args.experts,
                              num_experts_per_tok=args.top_k)
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(vision, projector="mlp")}, llm)


def _local_bytes(p) -> int:
    from torch.distributed.tensor import DTensor

    t = p.to_local() if isinstance(p, DTensor) else p
    return t.numel() * t.element_size()


class _AllToAllCounter:
    """Counts the rows each expert dispatch of this rank sends to and receives from other ranks (the split sizes
    of transformers' ``AllToAllEP``), and the (token, expert) pairs the model predicts from."""

    def __init__(self):
        from transformers.distributed.expert_parallel import AllToAllEP

        self.reset()
        self.hidden = self.bytes = 0
        original = AllToAllEP._dispatch_tokens

        def counted(ep_self, hidden_states, top_k_index, top_k_weights):
            tokens, ids, weights, state = original(ep_self, hidden_states, top_k_index, top_k_weights)
            me = ep_self.ep_mesh.get_local_rank()
            self.pairs += sum(state.send_sizes)
            self.sent += sum(state.send_sizes) - state.send_sizes[me]
            self.received += sum(state.recv_sizes) - state.recv_sizes[me]
            self.hidden, self.bytes = hidden_states.shape[-1], hidden_states.element_size()
            return tokens, ids, weights, state

        AllToAllEP._dispatch_tokens = counted

    def reset(self) -> None:
        self.pairs = self.sent = self.received = 0

    def step_bytes(self, ep: int) -> tuple[float, float]:
        """(measured, modelled) bytes this rank sent to other ranks: a dispatch sends its off-rank pairs forward and
        receives their gradients back; the combine returns the received rows and takes their gradients, so each
        off-rank row crosses twice; the model: ``all_to_all_bytes`` of the same (token, expert) pairs."""
        from lightning_mm.planner.moe_costs import all_to_all_bytes

        model = all_to_all_bytes(self.pairs, 1, self.hidden, self.bytes, ep)
        return 2 * (self.sent + self.received) * self.hidden * self.bytes, model["forward"] + model["backward"]


def _worker(rank, world, ep, args, rendezvous, out):
    import lightning_mm as lmm
    from lightning_mm.data.microbatch import split_microbatches
    from lightning_mm.model.moe import load_imbalance
    from lightning_mm.parallel.engine import PipelineEngine
    from lightning_mm.plan.layout import ParallelSpec, build_layout
    from lightning_mm.planner.moe_costs import expert_parameter_names

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model = build_model(args)
        names = expert_parameter_names(model)
        layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(ep=ep), world, "replicated", ["vision"])
        engine = PipelineEngine(model, layout, rank, args.microbatches)
        experts = [model.llm_layers[i].get_parameter(n) for i, ns in names.items() for n in ns]
        expert_bytes = sum(_local_bytes(p) for p in experts)
        all_bytes = sum(_local_bytes(p) for p in model.parameters())
        data = lmm.data.SyntheticMultimodalDataset(model, num_samples=args.batch * (args.steps + args.warmup),
                                                   text_tokens=(args.text_tokens, args.text_tokens),
                                                   items_per_sample=(1, 2), seed=1)
        collate = lmm.data.MultimodalCollator(model)
        params = engine.trainable_parameters()
        opt = torch.optim.SGD(params, lr=1e-3)
        walls, cpus, imbalance, a2a, tokens = [], [], None, [], []
        counter = _AllToAllCounter() if ep > 1 else None
        for step in range(args.warmup + args.steps):
            if counter is not None:
                counter.reset()
            batch = collate([data[step * args.batch + i] for i in range(args.batch)])
            mine = split_microbatches(batch, layout.num_groups, model)[layout.group_of(rank)]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.run(mine)
            engine.sync_gradients()
            opt.step()
            opt.zero_grad()
            c1 = time.process_time()
            dist.barrier()
            if step >= args.warmup:
                tokens.append(int(batch["attention_mask"].sum()))  # the global batch's real tokens
                walls.append(time.perf_counter() - t0)
                cpus.append(c1 - c0)
                if counter is not None:
                    a2a.append(counter.step_bytes(ep))
        router = engine.router_metrics
        metrics = router.metrics if router is not None else None
        if metrics:
            imbalance = [round(float(v), 3) for v in load_imbalance(metrics["expert_load"])]
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"rank": rank, "wall": walls, "cpu": cpus, "expert_bytes": expert_bytes,
                       "param_bytes": all_bytes, "imbalance": imbalance, "all_to_all": a2a, "tokens": tokens}, f)
    finally:
        dist.destroy_process_group()


def run_layout(ep: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_worker, args=(args.world, ep, args, os.path.join(tmp, "rendezvous"), out), nprocs=args.world)
        ranks = [json.load(open(f"{out}.{r}")) for r in range(args.world)]
    steps = len(ranks[0]["wall"])
    return {"layout": f"dp {args.world}" + (f" x ep {ep}" if ep > 1 else ""), "ep": ep,
            "step_s": statistics.median(ranks[0]["wall"]),
            "tokens_per_s": statistics.median(t / w for t, w in zip(ranks[0]["tokens"], ranks[0]["wall"])),
            "busiest_cpu_s": statistics.median(max(r["cpu"][s] for r in ranks) for s in range(steps)),
            "expert_bytes_per_rank": max(r["expert_bytes"] for r in ranks),
            "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
            "expert_imbalance_per_layer": ranks[0]["imbalance"],
            # per rank and step, the mean over ranks and timed steps
            "all_to_all_bytes_measured": _mean([b[0] for r in ranks for b in r["all_to_all"]]),
            "all_to_all_bytes_model": _mean([b[1] for r in ranks for b in r["all_to_all"]])}


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


# ------------------------------------------------------------------------------------------------- simulated
QWEN3_30B_A3B = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                     expert_width=768, vocab=151936)


def simulated(dp: int = 8, pp: int = 4, microbatches: int = 16, tokens: int = 4096, flops: float = 400e12,
              bandwidths=(50e9, 400e9), eps=(1, 2, 4, 8)) -> list[dict]:
    """The planner's prediction at Qwen3-30B-A3B shapes (no model is built): per layer the active parameters'
    work (6 x tokens x active weights, plus the attention's 12 x tokens^2 x width / 2 causal), the experts' state
    (16 bytes per trainable parameter: weights, gradient, two Adam moments) and the all-to-all of
    ``planner.moe_costs.all_to_all_bytes``; ``evaluate_plan`` at each ep."""
    from lightning_mm.planner.costs import LayerCost
    from lightning_mm.planner.moe_costs import ExpertShape, all_to_all_bytes
    from lightning_mm.planner.search import ModuleSpec, evaluate_plan

    s = QWEN3_30B_A3B
    attention = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"])
    router = s["experts"] * s["hidden"]
    one_expert = 3 * s["hidden"] * s["expert_width"]
    active = attention + router + s["top_k"] * one_expert
    total = attention + router + s["experts"] * one_expert
    forward = (2 * tokens * active + 2 * tokens * tokens * s["heads"] * s["head_dim"]) / flops
    costs = [LayerCost(forward, 2 * forward, True, True)] * s["layers"]
    expert_state = 16.0 * s["experts"] * one_expert
    spec = ModuleSpec(costs, 16.0 * total, 0.0, 4.0 * total, expert_bytes=expert_state,
                      expert_grad_bytes=4.0 * s["experts"] * one_expert,
                      experts=ExpertShape(s["experts"], s["top_k"], s["hidden"], tokens, 2))
    layers = [s["layers"] // pp] * pp
    rows = []
    for bw in bandwidths:
        for ep in eps:
            plan = evaluate_plan({LM: spec}, {LM: layers}, "parallel", microbatches * dp, dp, ep=ep, ep_bandwidth=bw)
            a2a = all_to_all_bytes(tokens, s["top_k"], s["hidden"], 2, ep)
            rows.append({"ep": ep, "ep_bandwidth_GBps": bw / 1e9,
                         "all_to_all_MB_per_layer_microbatch": (a2a["forward"] + a2a["backward"]) / 1e6,
                         "memory_GiB_per_rank": max(plan.memory.values()) / 2 ** 30,
                         "iteration_s": plan.iteration_time,
                         "all_to_all_s_per_microbatch_stage": max(plan.ep_comm.values(), default=0.0),
                         "forward_backward_s_per_microbatch_stage": max(plan.forward[k] + plan.backward[k]
                                                                        for k in plan.forward)})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args(argv)
    start = _machine.record()
    rows = [run_layout(ep, args) for ep in (1, args.world)]
    base = rows[0]
    for row in rows:
        row["step_vs_ep1"] = row["step_s"] / base["step_s"]
        row["expert_bytes_vs_ep1"] = row["expert_bytes_per_rank"] / base["expert_bytes_per_rank"]
    sim = simulated()
    result = {"what": "dp vs dp x ep on CPU processes (gloo), measured; the planner's ep trade-off at Qwen3-30B-A3B "
                      "shapes, simulated", "settings": vars(args), "rows": rows,
              "simulated": {"model": QWEN3_30B_A3B, "dp": 8, "pp": 4, "microbatches": 16, "tokens_per_microbatch": 4096,
                            "assumed_flops_per_device": 400e12, "rows": sim},
              "machine": _machine.finish(start)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"measured on {args.world} CPU processes ({_machine.describe(result['machine'])})")
    print(f"{'layout':<12} {'step (s)':>9} {'tokens/s':>9} {'busiest CPU (s)':>16} {'expert MiB/rank':>16} {'params MiB/rank':>16} "
          f"{'step x':>7}  imbalance/layer")
    for r in rows:
        print(f"{r['layout']:<12} {r['step_s']:>9.3f} {r['tokens_per_s']:>9.0f} {r['busiest_cpu_s']:>16.3f} "
              f"{r['expert_bytes_per_rank'] / 2**20:>16.2f} {r['param_bytes_per_rank'] / 2**20:>16.2f} "
              f"{r['step_vs_ep1']:>7.2f}  {r['expert_imbalance_per_layer']}")
    for r in rows[1:]:
        print(f"{r['layout']}: all-to-all sent per rank and step {r['all_to_all_bytes_measured'] / 2**20:.3f} MiB "
              f"measured, {r['all_to_all_bytes_model'] / 2**20:.3f} MiB by the planner's model (uniform routing)")
    print("\nsimulated (planner, Qwen3-30B-A3B shapes, dp 8 x pp 4, assumed 400 TFLOP/s per device)")
    print(f"{'ep':>3} {'a2a GB/s':>9} {'GiB/rank':>9} {'iteration (s)':>14} {'a2a s/mb/stage':>15}")
    for r in sim:
        print(f"{r['ep']:>3} {r['ep_bandwidth_GBps']:>9.0f} {r['memory_GiB_per_rank']:>9.1f} {r['iteration_s']:>14.3f} "
              f"{r['all_to_all_s_per_microbatch_stage']:>15.4f}")
    tables.main(["--quiet"])
    return result


if __name__ == "__main__":
    main()
