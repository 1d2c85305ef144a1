"""Per-module data parallelism measured on CPU processes: one dp degree for every module (uniform) vs a degree per
module (per-module: vision dp world - 1, LLM dp 1).

Model and layouts: docs/per_module_dp.md, "Measured on CPU processes"; run ``python benchmarks/per_module_dp_cpu.py``.
"""

from __future__ import annotations

import statistics

import torch

import harness

LAYOUTS = {"uniform": lambda world: ({}, {}), "per-module": lambda world: ({"dp": world - 1}, {"dp": 1})}


def worker(rank: int, world: int, name: str, args: dict) -> dict:
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model
    from lightning_mm.plan.layout import ParallelSpec, build_layout

    torch.manual_seed(0)
    width = args["encoder_hidden"]
    vision = tiny_encoder("siglip", hidden_size=width, intermediate_size=4 * width,
                          num_hidden_layers=args["encoder_layers"], num_attention_heads=4,
                          image_size=args["image_size"], patch_size=16)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(vision, projector="mlp")},
                                tiny_language_model("llama", num_hidden_layers=2))
    vision_spec, llm_spec = LAYOUTS[name](world)
    layout = build_layout({"vision": ParallelSpec(**vision_spec)}, ParallelSpec(**llm_spec), world, "parallel",
                          ["vision"])
    engine, _, step = harness.engine_steps(model, layout, rank, args, items_per_sample=(2, 4))
    walls, cpus, _ = harness.timed(step, args["steps"], args["warmup"])
    return {"stage": engine.stage, "dp": engine.coord.dp, "wall": walls, "cpu": cpus}


def main(argv=None) -> dict:
    args = harness.cli(__doc__, argv, world=4, batch=12, microbatches=2, steps=4, warmup=1, encoder_layers=6,
                       encoder_hidden=384, image_size=112)
    if args.world % 2:
        raise SystemExit(f"--world {args.world}: the uniform layout needs an even number of ranks")
    start = harness.record()
    rows = []
    for name in LAYOUTS:
        ranks = harness.spawn(worker, args.world, name, vars(args))
        rows.append({"layout": name, "step_s": statistics.median(ranks[0]["wall"]),
                     "busiest_cpu_s": harness.busiest_cpu_s(ranks),
                     "cpu_s_per_rank": {f"{r['stage']}/dp{r['dp']}": statistics.median(r["cpu"]) for r in ranks}})
    for row in rows:
        row["step_speedup"] = rows[0]["step_s"] / row["step_s"]
        row["busiest_cpu_speedup"] = rows[0]["busiest_cpu_s"] / row["busiest_cpu_s"]
    result = {"what": "uniform vs per-module data parallelism, measured on CPU processes (gloo)",
              "settings": vars(args), "rows": rows}
    harness.write(harness.RESULTS / "per_module_dp_cpu.json", result, start)
    return result


if __name__ == "__main__":
    main()
