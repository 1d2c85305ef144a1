"""Expert parallelism measured on CPU processes, beside the planner's predicted ep trade-off (docs/moe.md)."""

from __future__ import annotations

import statistics

import torch

import harness

QWEN3_30B_A3B = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                     expert_width=768, vocab=151936)
SIMULATED = dict(dp=8, pp=4, microbatches=16, tokens_per_microbatch=4096, assumed_flops_per_device=400e12)


def build_model(args: dict):
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    vision = tiny_encoder("siglip", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    llm = tiny_language_model("qwen3_moe", vocab_size=512, hidden_size=args["hidden"], num_hidden_layers=args["layers"],
                              num_attention_heads=4, num_key_value_heads=2, head_dim=args["hidden"] // 4,
                              moe_intermediate_size=args["expert_width"], num_experts=args["experts"],
                              num_experts_per_tok=args["top_k"])
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(vision, projector="mlp")}, llm)


def local_bytes(params) -> int:
    from torch.distributed.tensor import DTensor

    return sum(t.numel() * t.element_size() for t in (p.to_local() if isinstance(p, DTensor) else p for p in params))


class AllToAllCounter:
    """The rows each expert dispatch of this rank sends to and receives from other ranks (the split sizes of
    transformers' ``AllToAllEP``), and the (token, expert) pairs the byte model predicts from."""

    def __init__(self):
        from transformers.distributed.expert_parallel import AllToAllEP

        self.pairs = self.sent = self.received = self.hidden = self.bytes = 0
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

    def step_bytes(self, ep: int) -> tuple[float, float]:
        """(measured, modelled) bytes this rank sent to other ranks since the last call: each off-rank row crosses
        twice (dispatch and its gradient back, combine and its gradient); the model: ``all_to_all_bytes``."""
        from lightning_mm.planner.moe_costs import all_to_all_bytes

        model = all_to_all_bytes(self.pairs, 1, self.hidden, self.bytes, ep)
        measured = 2 * (self.sent + self.received) * self.hidden * self.bytes
        self.pairs = self.sent = self.received = 0
        return measured, model["forward"] + model["backward"]


def worker(rank: int, world: int, ep: int, args: dict) -> dict:
    from lightning_mm.model.moe import load_imbalance
    from lightning_mm.plan.layout import ParallelSpec, build_layout
    from lightning_mm.planner.moe_costs import expert_parameter_names

    model = build_model(args)
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(ep=ep), world, "replicated", ["vision"])
    engine, batches, train = harness.engine_steps(model, layout, rank, args, text_tokens=(args["text_tokens"],) * 2,
                                                  items_per_sample=(1, 2))
    experts = [model.llm_layers[i].get_parameter(n) for i, ns in expert_parameter_names(model).items() for n in ns]
    counter = AllToAllCounter() if ep > 1 else None

    def step(i):
        train(i)
        return int(batches[i]["attention_mask"].sum()), counter.step_bytes(ep) if counter is not None else None

    walls, cpus, outs = harness.timed(step, args["steps"], args["warmup"])
    metrics = engine.router_metrics.metrics if engine.router_metrics is not None else None
    return {"wall": walls, "cpu": cpus, "tokens": [t for t, _ in outs],
            "all_to_all": [b for _, b in outs if b is not None], "expert_bytes": local_bytes(experts),
            "param_bytes": local_bytes(model.parameters()),
            "imbalance": [round(float(v), 3) for v in load_imbalance(metrics["expert_load"])] if metrics else None}


def run_layout(ep: int, args: dict) -> dict:
    ranks = harness.spawn(worker, args["world"], ep, args)
    a2a = [b for r in ranks for b in r["all_to_all"]]  # per rank and step: the mean over ranks and timed steps
    return {"layout": f"dp {args['world']}" + (f" x ep {ep}" if ep > 1 else ""), "ep": ep,
            "step_s": statistics.median(ranks[0]["wall"]),
            "tokens_per_s": statistics.median(t / w for t, w in zip(ranks[0]["tokens"], ranks[0]["wall"])),
            "busiest_cpu_s": harness.busiest_cpu_s(ranks),
            "expert_bytes_per_rank": max(r["expert_bytes"] for r in ranks),
            "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
            "expert_imbalance_per_layer": ranks[0]["imbalance"],
            "all_to_all_bytes_measured": statistics.fmean(b[0] for b in a2a) if a2a else 0.0,
            "all_to_all_bytes_model": statistics.fmean(b[1] for b in a2a) if a2a else 0.0}


def simulated(bandwidths=(50e9, 400e9), eps=(1, 2, 4, 8)) -> list[dict]:
    """The planner's prediction at Qwen3-30B-A3B shapes (no model is built): per layer the active parameters'
    work (6 x tokens x active weights, plus the attention's 12 x tokens^2 x width / 2 causal), the experts' state
    (16 bytes per trainable parameter) and the all-to-all of ``all_to_all_bytes``; ``evaluate_plan`` at each ep."""
    from lightning_mm.planner.costs import LayerCost
    from lightning_mm.planner.moe_costs import ExpertShape, all_to_all_bytes
    from lightning_mm.planner.search import ModuleSpec, evaluate_plan

    s, sim = QWEN3_30B_A3B, SIMULATED
    tokens, dp, pp = sim["tokens_per_microbatch"], sim["dp"], sim["pp"]
    attention = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"])
    router, one_expert = s["experts"] * s["hidden"], 3 * s["hidden"] * s["expert_width"]
    active = attention + router + s["top_k"] * one_expert
    total = attention + router + s["experts"] * one_expert
    forward = (2 * tokens * active + 2 * tokens * tokens * s["heads"] * s["head_dim"]) / sim["assumed_flops_per_device"]
    spec = ModuleSpec([LayerCost(forward, 2 * forward, True, True)] * s["layers"], 16.0 * total, 0.0, 4.0 * total,
                      expert_bytes=16.0 * s["experts"] * one_expert, expert_grad_bytes=4.0 * s["experts"] * one_expert,
                      experts=ExpertShape(s["experts"], s["top_k"], s["hidden"], tokens, 2))
    rows = []
    for bw in bandwidths:
        for ep in eps:
            plan = evaluate_plan({"language_model": spec}, {"language_model": [s["layers"] // pp] * pp}, "parallel",
                                 sim["microbatches"] * dp, dp, ep=ep, ep_bandwidth=bw)
            a2a = all_to_all_bytes(tokens, s["top_k"], s["hidden"], 2, ep)
            rows.append({"ep": ep, "ep_bandwidth_GBps": bw / 1e9,
                         "all_to_all_MB_per_layer_microbatch": (a2a["forward"] + a2a["backward"]) / 1e6,
                         "memory_GiB_per_rank": max(plan.memory.values()) / 2 ** 30, "iteration_s": plan.iteration_time,
                         "all_to_all_s_per_microbatch_stage": max(plan.ep_comm.values(), default=0.0),
                         "forward_backward_s_per_microbatch_stage": max(plan.forward[k] + plan.backward[k]
                                                                        for k in plan.forward)})
    return rows


def main(argv=None) -> dict:
    args = harness.cli(__doc__, argv, world=2, batch=8, microbatches=2, steps=6, warmup=2, text_tokens=64, hidden=128,
                       layers=4, experts=8, expert_width=256, top_k=2)
    start = harness.record()
    rows = [run_layout(ep, vars(args)) for ep in (1, args.world)]
    for row in rows:
        row["step_vs_ep1"] = row["step_s"] / rows[0]["step_s"]
        row["expert_bytes_vs_ep1"] = row["expert_bytes_per_rank"] / rows[0]["expert_bytes_per_rank"]
    result = {"what": "dp vs dp x ep on CPU processes (gloo), measured; the planner's ep trade-off at Qwen3-30B-A3B "
                      "shapes, simulated", "settings": vars(args), "rows": rows,
              "simulated": {"model": QWEN3_30B_A3B, **SIMULATED, "rows": simulated()}}
    harness.write(harness.RESULTS / "moe_cpu.json", result, start)
    return result


if __name__ == "__main__":
    main()
