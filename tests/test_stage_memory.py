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
    assert [r["rank"] for r in ranks] == list(range(case.get("llm_pp", 4)))
    print(f"\n{'lazy' if case.get('lazy') else 'eager'} build, model {ranks[0]['model_bytes'] / MiB:.0f} MiB:")
    print(f"{'rank':>4} {'stage':<18} {'stage MiB':>9} {'peak growth MiB: build+fit':>26} {'fit only':>8}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['stage']:<18} {r['stage_bytes'] / MiB:>9.0f} {r['total_peak'] / MiB:>26.0f} "
              f"{r['fit_peak'] / MiB:>8.0f}")
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


# ---------------------------------------------------------------------------------------------- folders
def _save_folders(tmp_path) -> tuple[str, str]:
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(123)  # any values: they come from the folders in both runs
    llm, enc = str(tmp_path / "llm"), str(tmp_path / "siglip")
    lm = tiny_language_model("llama")
    with torch.no_grad():  # far from the initialisation by name, so a rank that ignored the folder would show
        lm.lm_head.weight.mul_(30)
    lm.save_pretrained(llm)
    tiny_encoder("siglip").save_pretrained(enc)
    return llm, enc


@pytest.mark.slow
@pytest.mark.ci
def test_folders_loaded_under_the_strategy_validate_like_one_process(tmp_path):
    llm, enc = _save_folders(tmp_path)
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
