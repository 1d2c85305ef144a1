"""The bad-input catalogue: each case raises a message naming the problem, before any collective starts."""

from __future__ import annotations

import os
import pickle
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import lightning_mm as lmm
from lightning_mm import checkpoint as ckpt
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.plan.layout import ParallelSpec, build_layout
from tests.helpers.pipeline_case import build_model, global_batches

COLLECTIVES = ("all_reduce", "broadcast", "barrier", "send", "recv", "isend", "irecv", "all_gather",
               "batch_isend_irecv", "reduce_scatter_tensor", "all_gather_into_tensor")


@pytest.fixture(scope="module")
def pipeline():
    """A real one-rank PipelineEngine (replicated placement) behind the LightningModule's compute_loss."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = build_model(("vision",), "llm")
    reference = build_model(("vision",), "llm")
    module = lmm.MultimodalLightningModule(model)
    layout = build_layout({"vision": ParallelSpec()}, ParallelSpec(), 1, "replicated", ["vision"])
    engine = PipelineEngine(model, layout, 0, num_microbatches=2)
    run = lambda batch, **kw: engine.run(batch, **kw).loss  # noqa: E731  (the strategy's run_pipeline)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(run_pipeline=run, num_microbatches=2))
    yield module, reference, global_batches(model, 1, 4)[0]
    dist.destroy_process_group()


@pytest.fixture
def collectives(monkeypatch):
    calls = []
    for name in COLLECTIVES:
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    return calls


def test_good_batch_runs_collectives_and_matches_one_process(pipeline, collectives):
    module, reference, batch = pipeline
    loss = module.compute_loss(dict(batch), train=False)
    assert collectives, "the harness must see the engine's collectives"
    torch.testing.assert_close(loss, reference(**batch).loss, rtol=1e-5, atol=1e-6)


def _pad_to(batch: dict, length: int) -> dict:
    extra = length - batch["input_ids"].shape[1]
    pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], extra), v, dtype=t.dtype)], 1)  # noqa: E731
    out = {k: v for k, v in batch.items() if k != "position_ids"}
    for key, value in (("input_ids", 0), ("labels", -100), ("bam", 0), ("attention_mask", 0)):
        out[key] = pad(batch[key], value)
    return out


def _rows(batch: dict, rows: slice) -> dict:
    out = {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out["vision"], out["item_counts"] = batch["vision"], {}
    return out


def _case(name: str, batch: dict, model) -> dict:
    b = dict(batch)
    pid = model.placeholder_ids["vision"]
    if name == "missing_labels":
        del b["labels"]
    elif name == "misplaced_encoder_input":
        b["pixel_values"] = batch["vision"]["pixel_values"]
    elif name == "placeholder_feature_mismatch":
        ids = b["input_ids"].clone()
        ids[ids == pid] = 5
        b["input_ids"] = ids
    elif name == "longer_than_positions":
        b = _pad_to(batch, 600)
    elif name == "bit_63":
        bam = b["bam"].clone()
        bam[0, 0] |= torch.iinfo(torch.int64).min
        b["bam"] = bam
    elif name == "segment_ids_shape":
        b["segment_ids"] = torch.zeros(b["input_ids"].shape[0], b["input_ids"].shape[1] - 1, dtype=torch.long)
    elif name == "empty":
        b = _rows(batch, slice(0, 0))
    elif name == "microbatches_do_not_divide":
        b = {k: v[:3] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return b


CASES = {
    "missing_labels": r"the batch has no 'labels'",
    "misplaced_encoder_input": r"unknown keys \['pixel_values'\].*under their modality",
    "placeholder_feature_mismatch": r"modality 'vision': input_ids hold \d+ placeholder tokens .* emits \d+ features",
    "longer_than_positions": r"needs position 599 .* max_position_embeddings=512",
    "bit_63": r"bit 63",
    "segment_ids_shape": r"segment_ids has shape \(4, \d+\) but",
    "empty": r"the batch is empty",
    "microbatches_do_not_divide": r"3 rows cannot be cut into num_microbatches=2",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_batch_raises_before_any_collective(pipeline, collectives, case):
    module, _, batch = pipeline
    with pytest.raises((ValueError, TypeError), match=CASES[case]):
        module.compute_loss(_case(case, batch, module.model))
    assert collectives == [], f"{case}: a collective ran before the error ({collectives})"


# ------------------------------------------------------------------------------------------------ checkpoints
def _small_model(hidden=32):
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))},
                                tiny_language_model("llama", hidden_size=hidden))
    return model.freeze(encoders=True)


@pytest.fixture
def saved(tmp_path, pipeline):
    model = _small_model()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    tensors = {f"model/{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad}
    layout = {"parameters": ckpt.model_fingerprint(model), "trainable": names, "world_size": 1, "stages": []}
    path = str(tmp_path / "ckpt")
    ckpt.save_sharded(path, tensors, {"global_step": 3}, layout, rank=0)
    return path, model


def _data_file(path):
    return os.path.join(path, next(f for f in os.listdir(path) if f.endswith(".distcp")))


def test_checkpoint_round_trip_is_exact(saved):
    path, model = saved
    merged = ckpt.consolidate(path)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(merged[n], p), n


def test_corrupt_checkpoint_byte_flip_is_named(saved):
    path, _ = saved
    file = _data_file(path)
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(file, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0.distcp is corrupt \(CRC32 mismatch\)"):
        ckpt.consolidate(path)


def test_truncated_checkpoint_is_named(saved):
    path, _ = saved
    file = _data_file(path)
    os.truncate(file, os.path.getsize(file) // 2)
    with pytest.raises(ckpt.CheckpointError, match=r"missing or truncated"):
        ckpt.read_layout(path)


def test_corrupt_metadata_is_named(saved):
    path, _ = saved
    meta = os.path.join(path, ".metadata")
    size = os.path.getsize(meta)
    open(meta, "wb").write(b"\x00" * size)
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata is corrupt"):
        ckpt.consolidate(path)


def test_pickled_code_in_metadata_never_runs(saved, tmp_path):
    path, _ = saved
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    open(os.path.join(path, ".metadata"), "wb").write(pickle.dumps(Payload()))
    with pytest.raises(ckpt.CheckpointError, match=r"not a DCP metadata class"):
        ckpt.read_dcp_metadata(path)
    assert not marker.exists()


def test_meta_with_objects_is_refused(saved):
    path, _ = saved
    torch.save({"global_step": SimpleNamespace(x=1)}, os.path.join(path, ckpt.META_FILE))
    with pytest.raises(ckpt.CheckpointError, match=r"objects other than plain data"):
        ckpt.load_meta(path)


def test_missing_or_interrupted_checkpoint_is_named(saved, tmp_path):
    path, _ = saved
    os.rename(path, path + ".tmp")
    with pytest.raises(ckpt.CheckpointError, match=r"interrupted save"):
        ckpt.read_layout(path)
    with pytest.raises(ckpt.CheckpointError, match=r"does not exist"):
        ckpt.read_layout(str(tmp_path / "nowhere"))


def test_checkpoint_from_another_model_is_named(saved):
    path, _ = saved
    other = _small_model(hidden=48)
    with pytest.raises(ckpt.CheckpointError, match=r"written for another model: .*shapes differ .*hidden|"
                                                   r"written for another model: .*shapes differ"):
        ckpt.check_same_model(ckpt.read_layout(path)["parameters"], ckpt.model_fingerprint(other), path)
    with pytest.raises(ckpt.CheckpointError, match=r"written for another model"):
        ckpt.load_weights(path, other)


def test_backend_refuses_what_it_cannot_run_before_any_process_group():
    """NCCL with two local ranks on one GPU, and gloo between CUDA stages with TP/CP/FSDP, are named up front; what
    each backend can run passes. Pure: no process group, no GPU needed."""
    from lightning_mm.parallel.comm import carries_device_tensors, check_backend

    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"local ranks \[0, 2\] all run on cuda:0.*process_group_backend='gloo'"):
        check_backend("nccl", [cuda0, cuda1, cuda0], False, False, False)
    for flags, name in (((True, False, False), "tensor parallelism"), ((False, True, False), "context parallelism"),
                        ((False, False, True), "sharded data parallelism"),
                        ((False, False, False, True), "expert parallelism")):
        with pytest.raises(ValueError, match=f"{name} on CUDA devices needs NCCL"):
            check_backend("gloo", [cuda0, cuda0], *flags)
    with pytest.raises(ValueError, match="NCCL refuses"):
        check_backend("cpu:gloo,cuda:nccl", [cuda0, cuda0], False, False, False)
    with pytest.raises(ValueError, match="tensor parallelism on CUDA devices needs NCCL"):
        check_backend("cuda:gloo,cpu:gloo", [cuda0, cuda0], True, False, False)
    check_backend("nccl", [cuda0, cuda1], True, True, True)
    check_backend("cpu:gloo,cuda:nccl", [cuda0, cuda1], True, True, True)
    check_backend("gloo", [cuda0, cuda0, cuda0], False, False, False)  # pipeline + data parallelism, staged P2P
    check_backend("gloo", ["cpu", "cpu"], True, True, True, True)
    assert carries_device_tensors("nccl", "cuda") and carries_device_tensors("gloo", "cpu")
    assert carries_device_tensors("cpu:gloo,cuda:nccl", "cuda") and carries_device_tensors("gloo", "cpu")
    assert not carries_device_tensors("gloo", "cuda") and not carries_device_tensors("cuda:gloo", "cuda")
