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
GDN, ATTENTION = "linear_attention", "full_attention"


def text_model(kinds: list[str], device="cpu", **shape):
    """A ``Qwen3_5TextModel`` of layers ``kinds``, random weights (none on the meta ``device``), SDPA attention."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    cfg = Qwen3_5TextConfig(**{**shape, "num_hidden_layers": len(kinds), "layer_types": kinds})
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        return Qwen3_5TextModel(cfg), cfg


def layer_flops(layer, cfg, kind: str, tokens: int) -> float:
    """The planner's forward + backward FLOPs of one trainable decoder layer (``planner.workload``'s terms)."""
    from lightning_mm.planner.workload import _attention_width, _layer_weights, linear_attention_token_flops

    per_token = 2.0 * _layer_weights(layer) + (linear_attention_token_flops(cfg) if kind == GDN else 0.0)
    quadratic = 0.0 if kind == GDN else 4.0 * _attention_width(cfg) * tokens
    return 3.0 * (per_token + quadratic) * tokens


def measure(args) -> list[dict]:
    """Median forward + backward seconds of one layer of each kind per length, the planner's FLOPs, and the fit of
    one seconds-per-FLOP constant per layer type (least squares through the origin)."""
    torch.set_num_threads(args.threads)
    h = args.hidden
    shape = dict(hidden_size=h, intermediate_size=2 * h, num_attention_heads=h // 64, num_key_value_heads=h // 128,
                 head_dim=64, linear_num_key_heads=h // 128, linear_num_value_heads=h // 64, linear_key_head_dim=64,
                 linear_value_head_dim=64, vocab_size=64)
    rows = []
    for kind in (GDN, ATTENTION):
        torch.manual_seed(0)
        model, cfg = text_model([kind], **shape)
        mine = []
        for n in map(int, args.lengths.split(",")):
            x = torch.randn(1, n, h, requires_grad=True)
            times, _, _ = harness.repeat(  # the first untimed
                lambda: model(inputs_embeds=x, use_cache=False).last_hidden_state.square().mean().backward(),
                args.repeats + 1)
            mine.append({"layer": kind, "tokens": n, "step_s": statistics.median(times[1:]),
                         "model_flops": layer_flops(model.layers[0], cfg, kind, n)})
            print(kind, n, f"{mine[-1]['step_s']:.3f} s", flush=True)
        c = sum(r["step_s"] * r["model_flops"] for r in mine) / sum(r["model_flops"] ** 2 for r in mine)
        rows += [{**r, "fitted_s": c * r["model_flops"], "fitted_s_per_flop": c} for r in mine]
    return rows


def simulate(tokens: int, flops: float, bandwidth: float) -> list[dict]:
    """``evaluate_plan`` of ``SIM`` (3 GDN : 1 attention) on one microbatch of ``tokens`` at cp 1, 2, 4, 8, with
    GDN's CP bytes at its layers and, for comparison, attention's bytes at every layer."""
    from lightning_mm.plan.cp_comm import cp_communication_bytes, gdn_communication_bytes
    from lightning_mm.planner import AttentionShape, LayerCost, ModuleSpec, evaluate_plan

    s = SIM
    kinds = [ATTENTION if i % 4 == 3 else GDN for i in range(s["num_hidden_layers"])]
    model, cfg = text_model(kinds, device="meta", **s)
    costs = [LayerCost(f / 3 / flops, 2 * f / 3 / flops, True, True)
             for f in (layer_flops(layer, cfg, k, tokens) for layer, k in zip(model.layers, kinds))]
    gdn = dict(linear_value_heads=s["linear_num_value_heads"], linear_key_heads=s["linear_num_key_heads"],
               linear_key_dim=s["linear_key_head_dim"], linear_value_dim=s["linear_value_head_dim"],
               linear_ids=[i for i, k in enumerate(kinds) if k == GDN])
    attention = (tokens, s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], 2)
    gdn_bytes = (s["linear_num_key_heads"], s["linear_num_value_heads"], s["linear_key_head_dim"],
                 s["linear_value_head_dim"])
    rows = []
    for cp in (1, 2, 4, 8):
        plan, before = (evaluate_plan({"language_model": ModuleSpec(costs, attention=AttentionShape(*attention, **kw))},
                                      {"language_model": [len(costs)]}, "parallel", 1, cp=cp, cp_bandwidth=bandwidth)
                        for kw in (gdn, {}))
        rows.append({"cp": cp, "step_s": plan.iteration_time, "cp_comm_s": plan.cp_comm["language_model.0"],
                     "gdn_layer_MB": gdn_communication_bytes(tokens, cp, *gdn_bytes)["forward"] / 1e6,
                     "attention_layer_MB": cp_communication_bytes("allgather", tokens, cp,
                                                                  *attention[1:4])["forward"] / 1e6,
                     "step_s_attention_bytes_everywhere": before.iteration_time})
    return [{**r, "speedup": rows[0]["step_s"] / r["step_s"]} for r in rows]


def main(argv=None) -> dict:
    args = harness.cli(__doc__, argv, lengths="256,512,1024,2048,4096,8192", repeats=3, hidden=256, threads=1,
                       sim_tokens=65536, sim_tflops=400.0, sim_bandwidth_gbps=50.0)
    start = harness.record()
    rows = measure(args)
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
