"""Sharded DCP checkpoints: exact resume, resharding between layouts, consolidation, HF export, atomic writes."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mm import checkpoint as ckpt
from lightning_mm.data.resumable import resumable
from tests.helpers.checkpoint_runs import rank_weights, reference, run_case


@pytest.mark.slow
def test_pipeline_run_matches_one_process_and_consolidates():
    ref = reference()
    assert len(ref["pp2"]) == 6 and ref["single"][0] != ref["single"][-1]
    torch.testing.assert_close(torch.tensor(ref["pp2"]), torch.tensor(ref["single"]), rtol=1e-5, atol=1e-6)
    expected = torch.load(ref["single_weights"], weights_only=True)
    merged = ckpt.consolidate(ref["ckpt6"])
    assert set(merged) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "pipeline")
def test_resume_is_bit_exact():
    ref = reference()
    out = os.path.join(ref["dir"], "resume.json")
    resumed = run_case({"layout": "pp2", "steps": 6, "out": out, "resume": ref["ckpt3"]})
    assert resumed == ref["pp2"][3:], "losses after resuming differ from the uninterrupted run"


def _pieces(path: str) -> dict[str, set[int]]:
    """How many pieces (DCP chunks: one per FSDP shard) each module's parameters were written in."""
    md = ckpt.read_dcp_metadata(path)
    out: dict[str, set[int]] = {}
    for key, entry in md.state_dict_metadata.items():
        if key.startswith("model/"):
            out.setdefault(key.split("/")[1].split(".")[0], set()).add(len(entry.chunks))
    return out


def _continue_elsewhere(ref: dict, there: str, then: str, cp: dict | None = None,
                        pieces: dict[str, set[int]] | None = None) -> None:
    """The pp2 step-3 checkpoint continued on layout ``there`` (saving at step 5), whose step-5 checkpoint is
    continued on layout ``then``: every step, and the parameters after the last, equal the uninterrupted pp2 run.
    ``pieces``: how the step-5 checkpoint holds each module's parameters (``_pieces``)."""
    d = ref["dir"]
    losses = run_case({"layout": there, "steps": 6, "out": f"{d}/{there}.json", "resume": ref["ckpt3"],
                       "ckpt_dir": f"{d}/{there}", "save_every": 5})
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["pp2"][3:]), rtol=1e-5, atol=1e-6)
    if cp is not None:
        written = ckpt.read_layout(f"{d}/{there}/step=5.ckpt")
        assert written["cp"] == cp, written["cp"]
    if pieces is not None:
        assert _pieces(f"{d}/{there}/step=5.ckpt") == pieces
    _continue_from(ref, f"{d}/{there}/step=5.ckpt", then, f"{there}_then_{then}")


def _continue_from(ref: dict, checkpoint: str, then: str, name: str) -> None:
    """A step-5 checkpoint continued on layout ``then``: step 6 and the parameters after it equal the
    uninterrupted pp2 run."""
    d = ref["dir"]
    weights = f"{d}/{name}.pt"
    losses = run_case({"layout": then, "steps": 6, "out": f"{d}/{name}.json", "resume": checkpoint,
                       "weights": weights})
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["pp2"][5:]), rtol=1e-5, atol=1e-6)
    final = rank_weights(weights)
    assert set(final) == set(ref["pp2_weights"])
    for name, value in ref["pp2_weights"].items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "pipeline")
def test_reshard_pp2dp1_to_pp1dp2_and_back():
    _continue_elsewhere(reference(), "dp2", "pp2")


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "tp")
def test_reshard_to_tensor_parallel_and_back():
    """pp2 -> vision + LLM tp2 (3 ranks, DTensor parameters and optimiser state) -> pp2."""
    _continue_elsewhere(reference(), "tp2", "pp2", {"vision.0": 1, "language_model.0": 1})


@pytest.mark.slow
def test_reshard_full_shard_dp2_to_pipeline_and_back():
    """pp2 (NO_SHARD) -> vision + LLM 1 stage each under FULL_SHARD over dp 2 (4 ranks: parameters and AdamW
    state are FSDP2 shards) -> pp2 (NO_SHARD)."""
    _continue_elsewhere(reference(), "dp2_fsdp", "pp2", pieces={"encoders": {2}, "language_model": {2}})


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "fsdp", "llm_cp")
def test_full_shard_with_context_parallel_saves_and_resumes():
    """pp2 -> vision + LLM cp 2 under FULL_SHARD (3 ranks: the LLM sharded over its 2 CP ranks) -> the same
    layout resumed from its own checkpoint."""
    _continue_elsewhere(reference(), "cp2_fsdp", "cp2_fsdp", {"vision.0": 1, "language_model.0": 2},
                        pieces={"encoders": {1}, "language_model": {2}})


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "fsdp", "per_module_dp")
def test_full_shard_with_per_module_data_parallel_saves_and_resumes():
    """pp2 -> vision dp 1 + LLM dp 2 under FULL_SHARD (per-module data parallelism, 3 ranks: the LLM sharded over
    its 2 replicas, the encoder whole) -> the same layout resumed from its own checkpoint."""
    _continue_elsewhere(reference(), "vdp1dp2_fsdp", "vdp1dp2_fsdp", pieces={"encoders": {1}, "language_model": {2}})


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "fsdp")
def test_shard_grad_op_saves_resumes_and_reshards():
    """pp2 -> vision + LLM 1 stage each under SHARD_GRAD_OP over dp 2 (4 ranks: parameters and AdamW state are
    FSDP2 shards, gathered parameters kept from forward to backward) -> the same layout resumed from its own
    checkpoint, and that checkpoint resharded to pp2 (NO_SHARD)."""
    ref = reference()
    _continue_elsewhere(ref, "dp2_sgo", "dp2_sgo", pieces={"encoders": {2}, "language_model": {2}})
    _continue_from(ref, f"{ref['dir']}/dp2_sgo/step=5.ckpt", "pp2", "dp2_sgo_then_pp2")


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "fsdp", "per_module_dp", "pipeline")
def test_sharded_encoder_replicas_under_per_module_dp_save_and_resume(tmp_path):
    """Vision dp 2 under FULL_SHARD (each of the 2 tower replicas holds half of the vision stage) + LLM dp 1 in 2
    stages (4 ranks), 0-1 images per sample (a replica's share of a step may hold none): the uninterrupted run
    equals one process; resumed from its step-2 checkpoint (the vision stage written in 2 pieces), steps 3-4 and
    the parameters after them equal the uninterrupted run."""
    d, base = str(tmp_path), {"steps": 4, "items": [0, 1]}
    single = run_case({**base, "layout": "single", "out": f"{d}/single.json", "weights": f"{d}/single.pt"})
    full = run_case({**base, "layout": "vdp2pp2_fsdp", "out": f"{d}/full.json", "ckpt_dir": f"{d}/full",
                     "save_every": 2, "weights": f"{d}/full.pt"})
    torch.testing.assert_close(torch.tensor(full), torch.tensor(single), rtol=1e-5, atol=1e-6)
    assert _pieces(f"{d}/full/step=2.ckpt") == {"encoders": {2}, "language_model": {1}}
    resumed = run_case({**base, "layout": "vdp2pp2_fsdp", "out": f"{d}/resumed.json",
                        "resume": f"{d}/full/step=2.ckpt", "weights": f"{d}/resumed.pt"})
    assert resumed == full[2:], "losses after resuming differ from the uninterrupted run"
    expected, got = rank_weights(f"{d}/full.pt"), rank_weights(f"{d}/resumed.pt")
    assert set(got) == set(expected) == set(torch.load(f"{d}/single.pt", weights_only=True))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "llm_cp")
def test_reshard_to_context_parallel_and_back():
    """pp2 -> vision + LLM cp2 (3 ranks) -> pp2."""
    _continue_elsewhere(reference(), "cp2", "pp2", {"vision.0": 1, "language_model.0": 2})


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "per_module_dp", "pipeline")
def test_reshard_per_module_data_parallel_and_back():
    """pp2 -> vision dp 2 + LLM dp 1 pp 2 (per-module data parallelism, 4 ranks) -> pp2 (one degree)."""
    _continue_elsewhere(reference(), "vdp2pp2", "pp2")


@pytest.mark.slow  # not in the CI subset (87 s there); test_reshard_to_tensor_parallel_and_back reshards in CI
@pytest.mark.combines("checkpoint", "llm_cp", "pipeline")
def test_reshard_context_parallel_with_pipeline_and_data_parallel():
    """pp2 -> LLM pp2 x cp2 (5 ranks, two CP-sharded LLM stages) -> LLM cp2 x dp2 (6 ranks)."""
    _continue_elsewhere(reference(), "pp2cp2", "cp2dp2", {"vision.0": 1, "language_model.0": 2, "language_model.1": 2})


@pytest.mark.slow
def test_export_hf_folders_load_with_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM, SiglipVisionModel

    from tests.helpers.checkpoint_case import build_module
    from tests.helpers.pipeline_case import global_batches

    ref = reference()
    model = build_module().model
    ckpt.export_hf(ref["ckpt6"], model, str(tmp_path / "hf"))
    merged = ckpt.consolidate(ref["ckpt6"])
    llm = LlamaForCausalLM.from_pretrained(tmp_path / "hf" / "language_model")
    vision = SiglipVisionModel.from_pretrained(tmp_path / "hf" / "encoders" / "vision")
    for name, p in llm.named_parameters():
        torch.testing.assert_close(p, merged.get(f"language_model.{name}", p), rtol=0, atol=0, msg=name)
    torch.testing.assert_close(next(vision.parameters()), next(model.encoders["vision"].module.parameters()))
    again = ckpt.load_hf(str(tmp_path / "hf"))
    batch = global_batches(model, 1, 2)[0]
    torch.testing.assert_close(again(**batch).loss, model(**batch).loss, rtol=0, atol=0)
    for name, value in merged.items():
        torch.testing.assert_close(dict(again.named_parameters())[name], value, rtol=0, atol=0, msg=name)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "last")
    first = {"model/w": torch.arange(6.0).reshape(2, 3)}
    layout = {"parameters": {"w": [2, 3]}, "trainable": ["w"], "world_size": 1, "stages": []}
    ckpt.save_sharded(path, first, {"global_step": 1}, layout, rank=0)

    def crash(self, *args, **kwargs):
        open(os.path.join(self.path, "__0_0.distcp"), "wb").write(b"partial")
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(FileSystemWriter, "write_data", crash)
    with pytest.raises(BaseException, match="killed mid-save|CheckpointException"):  # DCP's is a BaseException
        ckpt.save_sharded(path, {"model/w": torch.zeros(2, 3)}, {"global_step": 2}, layout, rank=0)
    assert os.path.isdir(path + ".tmp")
    assert torch.equal(ckpt.consolidate(path)["w"], first["model/w"])
    assert ckpt.load_meta(path)["global_step"] == 1


def test_optimizer_state_moves_by_parameter_name():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))
    opt = torch.optim.AdamW([a, b], lr=0.1)
    (a.sum() + (b ** 2).sum()).backward()
    opt.step()
    saved = ckpt.optimizer_tensors(0, ckpt.optimizer_state_by_name(opt, {id(a): "a", id(b): "b"}))
    # another layout: only b on this rank, at index 0 of a differently built optimiser
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = torch.optim.AdamW([b2], lr=0.5)
    ckpt.load_optimizer_by_name(opt2, 0, {id(b2): "b"}, saved, [{"lr": 0.1}])
    assert opt2.param_groups[0]["lr"] == 0.1
    for key, value in opt.state[b].items():
        assert torch.equal(opt2.state[b2][key], value), key


def test_resumable_loader_continues_mid_epoch():
    def loader():
        g = torch.Generator().manual_seed(3)
        return resumable(DataLoader(list(range(20)), batch_size=4, shuffle=True, generator=g))

    first = loader()
    it = iter(first)
    seen = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    assert state == {"batches": 2}
    again = loader()
    again.load_state_dict(state)
    rest = [b.tolist() for b in again]
    full = [b.tolist() for b in loader()]
    assert seen + rest == full
    assert len([b for b in again]) == len(full)  # the next epoch starts at its beginning


@pytest.mark.slow
@pytest.mark.combines("checkpoint", "ep")
def test_reshard_expert_parallel_to_no_ep_and_to_pipeline_stages(tmp_path):
    """A Qwen3-MoE LLM under dp 2 x ep 2 (each replica holds half the experts, as DTensor shards) checkpointed at
    step 3 continues under dp 2 without ep and under LLM pp 2 with the uninterrupted run's losses."""
    d = str(tmp_path)
    full = run_case({"layout": "ep2dp2", "llm": "qwen3_moe", "steps": 6, "out": f"{d}/ep2.json",
                     "ckpt_dir": f"{d}/ep2", "save_every": 3})
    assert len(full) == 6 and full[0] != full[-1]
    for there in ("dp2", "pp2"):
        losses = run_case({"layout": there, "llm": "qwen3_moe", "steps": 6, "out": f"{d}/{there}.json",
                           "resume": f"{d}/ep2/step=3.ckpt"})
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(full[3:]), rtol=1e-5, atol=1e-6, msg=there)
