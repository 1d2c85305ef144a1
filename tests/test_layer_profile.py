"""`benchmarks/layer_profile.py` (tiny shapes on the CPU) and the measured cost source of
`benchmarks/frozen_aware.py`."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import frozen_aware
        import layer_profile
    finally:
        sys.path.remove(str(BENCHMARKS))
    return frozen_aware, layer_profile


@pytest.fixture(scope="module")
def tiny_profile(bench, tmp_path_factory):
    _, lp = bench
    out = tmp_path_factory.mktemp("layer_profile") / "tiny.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster than two fighting over a shared machine
    try:
        assert lp.main(["--tiny", "--device", "cpu", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out, json.loads(out.read_text())


def test_tiny_profile_has_every_family_size_and_projector(bench, tiny_profile):
    fa, lp = bench
    _, doc = tiny_profile
    assert doc["tiny"] is True and doc["shrink"] == lp.TINY_SHRINK and doc["dtype"] == "bfloat16"
    assert doc["device_type"] == "cpu" and doc["torch"] == torch.__version__
    expected_audio = "Phi4MultimodalAudioConformerEncoderLayer" if lp.phi4_audio_available() \
        else "torch.nn.TransformerEncoderLayer"
    assert doc["audio_layer"] == expected_audio
    tables = {"llama3": fa.LLAMA3, "qwen2_vision": fa.QWEN2_VISION, "phi4_audio": fa.PHI4_AUDIO}
    assert set(doc["layers"]) == set(tables)
    llm_tokens = {fa.TEXT_TOKENS + fa.VISION_PATCHES // fa.VISION_MERGE + fa.AUDIO_TOKENS,  # every Table 3.2 row
                  fa.TEXT_TOKENS + fa.VISION_PATCHES // fa.VISION_MERGE, fa.TEXT_TOKENS + fa.AUDIO_TOKENS}
    tokens_of = {"llama3": llm_tokens, "qwen2_vision": {fa.VISION_PATCHES}, "phi4_audio": {fa.AUDIO_TOKENS}}
    for family, table in tables.items():
        assert set(doc["layers"][family]) == set(table)
        for size, (layers, hidden, params) in table.items():
            info = doc["layers"][family][size]
            target = params / layers / lp.TINY_SHRINK**2
            assert info["target_params_per_layer"] == pytest.approx(target)
            assert abs(info["params_per_layer"] / target - 1) < 0.10, (family, size, info["params_per_layer"], target)
            assert info["hidden"] == round(hidden / lp.TINY_SHRINK)
            assert {int(t) for t in info["tokens"]} == tokens_of[family]
            for tokens, t in info["tokens"].items():
                assert t["measured_tokens"] == round(int(tokens) / lp.TINY_SHRINK)
                assert t["forward_s"] > 0 and t["input_grad_s"] > 0 and t["weight_grad_s"] > 0, (family, size, t)
                # a frozen layer keeps only what its input gradient needs: less than a trainable one
                assert 0 < t["activation_bytes_frozen"] < t["activation_bytes_trainable"], (family, size, t)
    for modality, family in (("vision", "qwen2_vision"), ("audio", "phi4_audio")):
        pairs = doc["projectors"][modality]
        assert set(pairs) == {f"{e}->{l}" for e in tables[family] for l in fa.LLAMA3}
        assert all(p["forward_s"] > 0 and p["weight_grad_s"] > 0 for p in pairs.values())


def test_without_cuda_it_says_so_and_exits_zero(bench, tmp_path, capsys):
    _, lp = bench
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert lp.main(["--out", str(tmp_path / "p.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_frozen_aware_runs_on_the_tiny_profile(bench, tiny_profile, tmp_path):
    fa, _ = bench
    path, _ = tiny_profile
    fa.main(["--skip-free", "--configs", "MMM", "--layer-profile", str(path), "--out", str(tmp_path)])
    assert not (tmp_path / "frozen_aware.json").exists()  # the FLOP-only results file is never overwritten
    doc = json.loads((tmp_path / "frozen_aware_measured.json").read_text())
    assert set(doc["meets_seed_speedup"]) == {"flops", "per_layer_loo", "seed_fitted", "measured"}
    (row,) = doc["seed_setting_rows"]
    assert row["config"] == "MLLM-MMM" and "measured" in row["meets_seed"]
    assert row["measured"]["aware_s"] > 0 and row["measured"]["forward-variance"]["ratio"] >= 1 - 1e-9
    assert doc["measured_layer_profile"]["tiny"] is True
    assert doc["measured_layer_profile"]["device"] == json.loads(path.read_text())["device"]
    assert (tmp_path / "frozen_aware_measured_MMM_aware.png").stat().st_size > 0


def flop_profile(fa, lp, llm_input_grad: float | None = None) -> dict:
    """A layer profile whose every time is the FLOP source's on one device; `llm_input_grad`: the LLM layers' input
    gradient set to this multiple of their forward instead."""
    layers = {}
    for family, table in (("llama3", fa.LLAMA3), ("qwen2_vision", fa.QWEN2_VISION), ("phi4_audio", fa.PHI4_AUDIO)):
        layers[family] = {}
        for size, (count, hidden, params) in table.items():
            samples = {}
            for tokens in lp.module_token_counts()[family]:
                f, d, w = fa.transformer_layer_times(tokens, hidden, params / count, causal=family == "llama3")
                if family == "llama3" and llm_input_grad is not None:
                    d = llm_input_grad * f
                samples[str(tokens)] = {"forward_s": f, "input_grad_s": d, "weight_grad_s": w,
                                        "activation_bytes_frozen": 1.0}
            layers[family][size] = {"tokens": samples}
    projectors = {}
    encoders = (("vision", fa.QWEN2_VISION, fa.VISION_MERGE, fa.VISION_PATCHES // fa.VISION_MERGE),
                ("audio", fa.PHI4_AUDIO, 1, fa.AUDIO_TOKENS))
    for modality, table, factor, tokens in encoders:
        projectors[modality] = {}
        for e, (_, hidden, _) in table.items():
            for l, (_, llm_hidden, _) in fa.LLAMA3.items():
                params = factor * hidden * llm_hidden + llm_hidden * llm_hidden
                t = fa.SAMPLES_PER_MICROBATCH * 2 * tokens * params / fa.EFFECTIVE_FLOPS
                projectors[modality][f"{e}->{l}"] = {"forward_s": t, "input_grad_s": t, "weight_grad_s": t}
    return {"format": lp.FORMAT, "version": lp.VERSION, "device": "FLOP model", "tiny": False,
            "layers": layers, "projectors": projectors}


def _load(fa, doc, path):
    path.write_text(json.dumps(doc))
    return fa.load_measured_profile(path)


def test_measured_source_uses_the_profile(bench, tmp_path):
    """A profile holding the FLOP source's own one-device times gives the FLOP column exactly (times / the stage's
    GPUs); making the frozen LLM's backward 10x its forward instead of 2x changes our layout, not the baseline's,
    and widens the gap between them."""
    fa, lp = bench
    same = _load(fa, flop_profile(fa, lp), tmp_path / "flops.json")
    flop_plans, _, _ = fa.seed_setting_plans("MMM", None, fa.SEED_STAGES)
    measured_plans, _, _ = fa.seed_setting_plans("MMM", None, fa.SEED_STAGES, measured=same)
    for mode in ("frozen-aware", *fa.BASELINES):
        assert measured_plans[mode].iteration_time == pytest.approx(flop_plans[mode].iteration_time, rel=1e-9)
        assert measured_plans[mode].layers == flop_plans[mode].layers

    def speedup(input_grad):  # backward of a frozen LLM layer under recomputation = input grad + forward
        profile = _load(fa, flop_profile(fa, lp, input_grad), tmp_path / f"llm_{input_grad}.json")
        assert profile.llm_backward_ratio("M", 3696) == pytest.approx(1 + input_grad)
        plans, _, _ = fa.seed_setting_plans("MMM", None, fa.SEED_STAGES, measured=profile)
        return plans["forward-variance"].iteration_time / plans["frozen-aware"].iteration_time, plans

    slow, slow_plans = speedup(9.0)
    fast, fast_plans = speedup(1.0)
    # the baseline believes backward = 2x forward, and the forwards are the same: it picks the same layout
    assert slow_plans["forward-variance"].layers == fast_plans["forward-variance"].layers
    # ours sees the slow frozen backward and gives the LLM more of the 6 stages (MMM: 4 -> 5), gaining more
    assert slow_plans["frozen-aware"].pp()[fa.LM] > fast_plans["frozen-aware"].pp()[fa.LM]
    assert slow > fast + 0.1, (slow, fast)


def test_profile_missing_a_size_is_refused(bench, tmp_path):
    fa, lp = bench
    doc = copy.deepcopy(flop_profile(fa, lp))
    del doc["layers"]["phi4_audio"]["L"]
    with pytest.raises(ValueError, match="phi4_audio L"):
        _load(fa, doc, tmp_path / "p.json")
    doc = flop_profile(fa, lp)
    doc["layers"]["qwen2_vision"]["S"]["tokens"] = {"100": doc["layers"]["qwen2_vision"]["S"]["tokens"]["4784"]}
    profile = _load(fa, doc, tmp_path / "q.json")
    with pytest.raises(KeyError, match="4784"):
        profile.layer_times("qwen2_vision", "S", fa.VISION_PATCHES)
