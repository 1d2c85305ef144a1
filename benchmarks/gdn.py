"""Gated DeltaNet (Qwen3.5's linear attention) against attention: layer time by length, and CP scaling of a hybrid.

Measured layers and the simulated Qwen3.5-9B-like plan: docs/context_parallel.md (the GDN section, `benchmarks/gdn.py`).
"""

from __future__ import annotations

import statistics

import torch

import harness

# Qwen3.5-9B-like: our assumption of its text shapes (not read from a published checkpoint)
SIM = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
           num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
           linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320)
KINDS = ("linear_attention", "full_attention")


def text_model(kind: str | list[str], **shape):
    """A ``Qwen3_5TextModel`` whose layers are ``kind`` (one layer, or the list), random weights (meta with
    ``device``), SDPA attention."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    kinds = [kind] if isinstance(kind, str) else kind
    device = shape.pop("device", "cpu")
    cfg = Qwen3_5TextConfig(**{**shape, "num_hidden_layers": len(kinds), "layer_types": kinds})
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        return Qwen3_5TextModel(cfg), cfg


def layer_flops(layer, cfg, kind: str, tokens: int) -> float:
    """The planner's forward + backward FLOPs of one trainable decoder layer (``planner.workload``'s terms)."""
    from lightning_mm.planner.workload import _attention_width, _layer_weights, linear_attention_token_flops

    per_token = 2.0 * _layer_weights(layer) + (linear_attention_token_flops(cfg) if kind == KINDS[0] else 0.0)
    quadratic = 0.0 if kind == KINDS[0] else 4.0 * _attention_width(cfg) * tokens
    return 3.0 * (per_token + quadratic) * tokens


def measure(args) -> list[dict]:
    """Median forward + backward seconds of one layer of each kind per length, and the planner's FLOPs."""
    torch.set_num_threads(args.threads)
    h = args.hidden
    shape = dict(hidden_size=h, intermediate_size=2 * h, num_attention_heads=h // 64, num_key_value_heads=h // 128,
                 head_dim=64, linear_num_key_heads=h // 128, linear_num_value_heads=h // 64, linear_key_head_dim=64,
                 linear_value_head_dim=64, vocab_size=64)
    rows = []
    for kind in KINDS:
        torch.manual_seed(0)
        model, cfg = text_model(kind, **shape)
        for n in map(int, args.lengths.split(",")):
            x = torch.randn(1, n, h, requires_grad=True)
            times, _, _ = harness.repeat(  # the first untimed
                lambda: model(inputs_embeds=x, use_cache=False).last_hidden_state.square().mean().backward(),
                args.repeats + 1)
            rows.append({"layer": kind, "tokens": n, "step_s": statistics.median(times[1:]),
                         "model_flops": layer_flops(model.layers[0], cfg, kind, n)})
            print(kind, n, f"{rows[-1]['step_s']:.3f} s", flush=True)
    for kind in KINDS:  # one seconds-per-FLOP constant per layer type (least squares through the origin)
        mine = [r for r in rows if r["layer"] == kind]
        c = sum(r["step_s"] * r["model_flops"] for r in mine) / sum(r["model_flops"] ** 2 for r in mine)
        for r in mine:
            r["fitted_s"], r["fitted_s_per_flop"] = c * r["model_flops"], c
    return rows


def simulate(tokens: int, flops: float, bandwidth: float) -> list[dict]:
    """``evaluate_plan`` of ``SIM`` (meta weights: no memory) on one microbatch of ``tokens`` at cp 1, 2, 4, 8."""
    from lightning_mm.plan.cp_comm import cp_communication_bytes, gdn_communication_bytes
    from lightning_mm.planner import AttentionShape, LayerCost, ModuleSpec, evaluate_plan

    kinds = [KINDS[1] if i % 4 == 3 else KINDS[0] for i in range(SIM["num_hidden_layers"])]
    model, cfg = text_model(kinds, **SIM, device="meta")
    costs = [LayerCost(f / 3 / flops, 2 * f / 3 / flops, True, True)
             for f in (layer_flops(layer, cfg, k, tokens) for layer, k in zip(model.layers, kinds))]
    s = SIM
    gdn = dict(linear_value_heads=s["linear_num_value_heads"], linear_key_heads=s["linear_num_key_heads"],
               linear_key_dim=s["linear_key_head_dim"], linear_value_dim=s["linear_value_head_dim"],
               linear_ids=[i for i, k in enumerate(kinds) if k == KINDS[0]])
    attention = (tokens, s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], 2)
    rows = []
    for cp in (1, 2, 4, 8):
        plan, before = (evaluate_plan({"language_model": ModuleSpec(costs, attention=AttentionShape(*attention, **kw))},
                                      {"language_model": [len(costs)]}, "parallel", 1, cp=cp, cp_bandwidth=bandwidth)
                        for kw in (gdn, {}))
        rows.append({"cp": cp, "step_s": plan.iteration_time, "cp_comm_s": plan.cp_comm["language_model.0"],
                     "gdn_layer_MB": gdn_communication_bytes(tokens, cp, s["linear_num_key_heads"],
                                                             s["linear_num_value_heads"], s["linear_key_head_dim"],
                                                             s["linear_value_head_dim"])["forward"] / 1e6,
                     "attention_layer_MB": cp_communication_bytes("allgather", tokens, cp,
                                                                  *attention[1:4])["forward"] / 1e6,
                     "step_s_attention_bytes_everywhere": before.iteration_time})
    for r in rows:
        r["speedup"] = rows[0]["step_s"] / r["step_s"]
    return rows


def main(argv=None) -> dict:
    args = harness.cli(__doc__, argv, lengths="256,512,1024,2048,4096,8192", repeats=3, hidden=256, threads=1,
                       sim_tokens=65536, sim_tflops=400.0, sim_bandwidth_gbps=50.0)
    start = harness.record()
    rows = measure(args)  # harness.write prints both tables (measured and simulated) as the docs quote them
    sim = simulate(args.sim_tokens, args.sim_tflops * 1e12, args.sim_bandwidth_gbps * 1e9)
    result = {"what": "one Qwen3.5 decoder layer (GDN or attention) forward + backward on CPU by length, measured, "
                      "beside the planner's FLOPs x one fitted constant per layer type; CP scaling of a "
                      "Qwen3.5-9B-like hybrid, simulated", "settings": vars(args), "rows": rows,
              "simulated": {"model": SIM, "pattern": "3 GDN : 1 attention", "tokens": args.sim_tokens,
                            "assumed_flops_per_device": args.sim_tflops * 1e12,
                            "cp_bandwidth_GBps": args.sim_bandwidth_gbps, "cp_mode": "allgather", "rows": sim}}
    harness.write(harness.RESULTS / "gdn_cpu.json", result, start, sources={"simulated": "simulated"})
    return result


if __name__ == "__main__":
    main()
