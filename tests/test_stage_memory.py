"""Per-rank memory of a large LLM under MultimodalParallelStrategy, and folders loaded under the strategy.

Memory: a Llama of about 180M parameters (hidden 1024, 12 layers, vocab 32000, intermediate 2048, untied; 686 MiB in
fp32) with a tiny SigLIP encoder trains one step on 4 gloo CPU processes (the LLM in 4 stages, the encoder inside
stage 0: ``encoder_placement="replicated"``). The encoder and the LLM are frozen and only the projector trains
(AdamW), so neither gradients nor optimiser state of the LLM count; batch 1, at most 12 text tokens plus the image's
16, so activations are a few MiB. Each rank measures its peak resident set (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) above its resident set before the model is built, and above it right before
``trainer.fit`` (tests/helpers/memory_case.py).

Built under ``trainer.init_module(empty_init=True)``, no rank grows by half the model's parameter bytes: each
materialises only its stage (the largest, embeddings or head plus 3 layers, is 237 MiB). Built eagerly, every rank
first holds the whole model (the contrast, measured by the same code).

Loading from folders: a Qwen2 of about 134M parameters (hidden 384, 8 layers, Qwen2's vocabulary of 151936, untied:
the embedding and the head are 222 MiB each, so the first and the last LLM stage are about 233 MiB) and a tiny CLIP
saved with ``save_pretrained``, built on meta under the strategy (5 processes: CLIP on its own rank, the LLM in 4
stages), each rank reading its stage's tensors from the safetensors while it materialises. Every rank, the one
holding the head included, peaks at no more than 1.25x its stage's bytes plus 64 MiB above its resident set before
the build (each tensor is read straight into the buffer it keeps: no second copy, no mapped file pages).

Folders: a tiny Llama and a tiny SigLIP saved with ``save_pretrained``, built from their folders on meta under the
strategy (LLM pp 2, 3 processes; each rank reads its stage's tensors) validate to the loss plain single-device
Lightning gets from the same folders loaded eagerly (tests/helpers/folder_case.py).
"""

import json
import os
import subprocess

import pytest
import torch
from tests.helpers.launch import run_script

HELPERS = os.path.join(os.path.dirname(__file__), "helpers")
MiB = 2 ** 20


def _run(script: str, case: dict, out, timeout: float = 420):
    out.mkdir()
    return run_script(os.path.join(HELPERS, script), json.dumps(case), str(out), cwd=out, timeout=timeout)


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_memory(case: dict, out) -> list[dict]:
    _run("memory_case.py", case, out)
    ranks = sorted((json.loads(f.read_text()) for f in out.glob("memory_*.json")), key=lambda d: d["rank"])
    world = case.get("llm_pp", 4) + (case.get("placement", "replicated") != "replicated")
    assert [r["rank"] for r in ranks] == list(range(world))
    print(f"\n{'lazy' if case.get('lazy') else 'eager'} build, model {ranks[0]['model_bytes'] / MiB:.0f} MiB:")
    print(f"{'rank':>4} {'stage':<18} {'stage MiB':>9} {'peak growth MiB: build+fit':>26} {'fit only':>8} "
          f"{'setup':>6} {'steps':>6}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['stage']:<18} {r['stage_bytes'] / MiB:>9.0f} {r['total_peak'] / MiB:>26.0f} "
              f"{r['fit_peak'] / MiB:>8.0f} {r['setup_peak'] / MiB:>6.0f} {r['train_peak'] / MiB:>6.0f}")
    return ranks


needs_peak_reset = pytest.mark.skipif(not _can_reset_peak(), reason="/proc/self/clear_refs is not writable here")


@pytest.mark.slow
@needs_peak_reset
def test_lazy_build_keeps_every_rank_under_half_the_model(tmp_path):
    ranks = run_memory({"lazy": True}, tmp_path / "lazy")
    model = ranks[0]["model_bytes"]
    assert model > 600 * MiB  # the size this test is about (~180M fp32 parameters)
    for r in ranks:
        # the build on meta costs nothing; setup (materialising the stage) and one training step stay under half
        assert r["build_peak"] < 20 * MiB, r
        assert r["fit_peak"] < model / 2, r
        assert r["total_peak"] < model / 2, r
        # and it is the stage, not the model, that the rank holds (plus a bounded working overhead)
        assert r["total_peak"] < r["stage_bytes"] + 100 * MiB, r
    assert sum(r["stage_bytes"] for r in ranks) >= ranks[0]["llm_bytes"]  # the stages cover the LLM
    assert ranks[0]["trainable"] and all(not r["trainable"] for r in ranks[1:])  # the projector, on stage 0


@pytest.mark.slow
@needs_peak_reset
def test_eager_build_holds_the_whole_model_on_every_rank(tmp_path):
    """The contrast, by the same measure: built eagerly, every rank's peak includes the whole model."""
    ranks = run_memory({}, tmp_path / "eager")
    model = ranks[0]["model_bytes"]
    for r in ranks:
        assert r["total_peak"] > 0.9 * model, r
        # pruning to the stage frees the rest: after fit a rank holds about its stage again
        assert r["rss_after_fit"] - r["rss_before_build"] < r["stage_bytes"] + 100 * MiB, r


# Qwen2's vocabulary with a small body: the embedding and the head dominate the first and the last stage
QWEN2_134M = dict(vocab_size=151936, hidden_size=384, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


@pytest.mark.slow
@needs_peak_reset
def test_loading_from_folders_keeps_every_rank_near_its_stage(tmp_path):
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    llm, enc = str(tmp_path / "qwen2"), str(tmp_path / "clip")
    tiny_language_model("qwen2", **QWEN2_134M).save_pretrained(llm)
    tiny_encoder("clip").save_pretrained(enc)
    # short rows: the step's logits over Qwen2's vocabulary (and their gradient) stay a small part of the measure
    ranks = run_memory({"lazy": True, "llm_folder": llm, "encoder_folder": enc, "placement": "parallel",
                        "text_tokens": [4, 6]}, tmp_path / "run")
    assert ranks[0]["llm_bytes"] > 500 * MiB  # the size this test is about (~134M fp32 parameters)
    stages = {r["stage"]: r for r in ranks}
    for name in ("language_model.0", "language_model.3"):  # the embedding's stage and the head's
        assert stages[name]["stage_bytes"] > 200 * MiB, stages[name]
    for r in ranks:
        bound = 1.25 * r["stage_bytes"] + 64 * MiB
        assert r["build_peak"] < 20 * MiB, r  # built on meta: only where the tensors live is recorded
        assert r["setup_peak"] <= bound, r  # cutting the model to the stage and reading the stage's tensors
        assert r["total_peak"] <= bound, r  # the build, setup and one training step together


# ---------------------------------------------------------------------------------------------- folders
def _save_folders(tmp_path, kind: str = "llama") -> tuple[str, str]:
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(123)  # any values: they come from the folders in both runs
    llm, enc = str(tmp_path / "llm"), str(tmp_path / "siglip")
    lm = tiny_language_model(kind)
    with torch.no_grad():  # far from the initialisation by name, so a rank that ignored the folder would show
        lm.lm_head.weight.mul_(30)
    lm.save_pretrained(llm)
    tiny_encoder("siglip").save_pretrained(enc)
    return llm, enc


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_folders_loaded_under_the_strategy_validate_like_one_process(tmp_path, kind):
    """Built lazily under the strategy (each LLM stage reads its layers; Qwen3-MoE: its experts' stored pieces,
    fused on materialise) the folders validate like one process loading them eagerly (transformers' own fusing)."""
    llm, enc = _save_folders(tmp_path, kind)
    base = {"llm": llm, "encoder": enc}
    _run("folder_case.py", {**base, "llm_pp": 2, "lazy": True}, tmp_path / "pp2")
    _run("folder_case.py", base, tmp_path / "single")
    got = json.loads((tmp_path / "pp2" / "result.json").read_text())
    ref = json.loads((tmp_path / "single" / "result.json").read_text())
    assert got["world_size"] == 3 and ref["world_size"] == 1
    assert got["built_on_meta"] and not ref["built_on_meta"]
    assert got["val"] == pytest.approx(ref["val"], rel=1e-5, abs=1e-5)
    # the same folder tensors in both, not the random initialisation by name the strategy would give otherwise
    assert abs(got["val"] - ref["val_random_init"]) > 0.1
