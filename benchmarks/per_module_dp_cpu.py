"""Per-module data parallelism measured on CPU processes: one dp degree for every module vs a degree per module.

Model and layouts: docs/per_module_dp.md, "Measured on CPU processes".
"""

from __future__ import annotations

import statistics

import torch

import harness


def build_model(args: dict):
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    width = args["encoder_hidden"]
    vision = tiny_encoder("siglip", hidden_size=width, intermediate_size=4 * width,
                          num_hidden_layers=args["encoder_layers"], num_attention_heads=4,
                          image_size=args["image_size"], patch_size=16)
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(vision, projector="mlp")},
                               tiny_language_model("llama", num_hidden_layers=2))


def layouts(world: int) -> dict[str, tuple[dict, dict]]:
    """name -> (vision spec kwargs, LLM spec kwargs)."""
    if world % 2:
        raise ValueError(f"--world {world}: the uniform layout needs an even number of ranks")
    return {"uniform": ({}, {}), "per-module": ({"dp": world - 1}, {"dp": 1})}


def worker(rank: int, world: int, name: str, args: dict) -> dict:
    from lightning_mm.plan.layout import ParallelSpec, build_layout

    model, (vision, llm) = build_model(args), layouts(world)[name]
    layout = build_layout({"vision": ParallelSpec(**vision)}, ParallelSpec(**llm), world, "parallel", ["vision"])
    engine, _, step = harness.engine_steps(model, layout, rank, args, items_per_sample=(2, 4))
    walls, cpus, _ = harness.timed(step, args["steps"], args["warmup"])
    return {"stage": engine.stage, "dp": engine.coord.dp, "wall": walls, "cpu": cpus}


def run_layout(name: str, args: dict) -> dict:
    ranks = harness.spawn(worker, args["world"], name, args)
    return {"layout": name, "step_s": statistics.median(ranks[0]["wall"]),
            "busiest_cpu_s": harness.busiest_cpu_s(ranks),
            "cpu_s_per_rank": {f"{r['stage']}/dp{r['dp']}": statistics.median(r["cpu"]) for r in ranks}}


def main(argv=None) -> dict:
    args = harness.cli(__doc__, argv, world=4, batch=12, microbatches=2, steps=4, warmup=1, encoder_layers=6,
                       encoder_hidden=384, image_size=112)
    start = harness.record()
    rows = [run_layout(name, vars(args)) for name in layouts(args.world)]
    for row in rows:
        row["step_speedup"] = rows[0]["step_s"] / row["step_s"]
        row["busiest_cpu_speedup"] = rows[0]["busiest_cpu_s"] / row["busiest_cpu_s"]
    result = {"what": "uniform vs per-module data parallelism, measured on CPU processes (gloo)",
              "settings": vars(args), "rows": rows}
    harness.write(harness.RESULTS / "per_module_dp_cpu.json", result, start)
    return result


if __name__ == "__main__":
    main()
