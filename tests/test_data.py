"""Collator and synthetic data: expansion, labels, words, determinism, loss going down."""

import lightning as L
import pytest
import torch

import lightning_mm as lmm
from lightning_mm.attention import mask as masks
from lightning_mm.model import tiny_encoder, tiny_language_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip")),
                                "audio": lmm.ModalityEncoder(tiny_encoder("qwen2_audio"), projector="linear")},
                               tiny_language_model())


def test_collator_expands_placeholders_and_builds_labels_and_words(model):
    vis, aud = model.placeholder_ids["vision"], model.placeholder_ids["audio"]
    enc = model.encoders
    sample = {"input_ids": torch.tensor([aud, 5, 6, vis, 7]),
              "vision": enc["vision"].family.random_inputs(enc["vision"].module.config, 1),
              "audio": enc["audio"].family.random_inputs(enc["audio"].module.config, 1)}
    batch = lmm.data.MultimodalCollator(model, pad_to_multiple_of=8)([sample, {"input_ids": torch.tensor([9, 9])}])
    n_vis, n_aud = 16, 4
    length = n_aud + 2 + n_vis + 1
    assert batch["input_ids"].shape == (2, 24)  # rounded up to a multiple of 8
    row = batch["input_ids"][0, :length].tolist()
    assert row == [aud] * n_aud + [5, 6] + [vis] * n_vis + [7]
    assert batch["labels"][0, :length].tolist() == [-100] * n_aud + [5, 6] + [-100] * n_vis + [7]
    assert (batch["labels"][0, length:] == -100).all() and (batch["attention_mask"][0, length:] == 0).all()
    words = batch["bam"][0].tolist()
    assert words[:n_aud] == [masks.modality_word(2, 2)] * n_aud
    assert words[n_aud] == masks.text_word(2) and words[length:] == [0] * (24 - length)
    assert batch["item_counts"]["vision"].tolist() == [1, 0]
    with pytest.raises(ValueError, match="modality 'vision': the sample has 2 placeholder tokens .* 1 items"):
        lmm.data.MultimodalCollator(model)([{**sample, "input_ids": torch.tensor([aud, vis, vis])}])
    with pytest.raises(ValueError, match="empty batch"):
        lmm.data.MultimodalCollator(model)([])


def test_synthetic_data_is_seeded_and_every_layout_runs(model):
    a = lmm.data.SyntheticMultimodalDataset(model, 3, seed=1)[2]
    b = lmm.data.SyntheticMultimodalDataset(model, 3, seed=1)[2]
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["vision"]["pixel_values"],
                                                                        b["vision"]["pixel_values"])
    ep = lmm.data.SyntheticMultimodalDataset(model, 3, layout="ep")[0]["input_ids"]
    n_items = int((ep >= 128).sum())
    assert (ep[:n_items] >= 128).all()  # prepended
    for layout in ("ep", "ee", "mp"):
        dm = lmm.data.SyntheticMultimodalDataModule(model=model, layout=layout, seq_len=96, batch_size=4)
        batch = next(iter(dm.train_dataloader()))
        out = model(**batch)
        assert torch.isfinite(out.loss)
        assert ("segment_ids" in batch) == (layout == "mp")


def test_single_process_training_reduces_loss(model):
    torch.manual_seed(0)
    module = lmm.MultimodalLightningModule(model, lr=5e-3, freeze={"encoders": True})
    dm = lmm.data.SyntheticMultimodalDataModule(num_samples=96, batch_size=4)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(max_steps=30, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()])
    trainer.fit(module, dm)
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.15
    assert "train/tokens_per_s" in trainer.callback_metrics


def test_without_validation_data_there_is_no_validation_loader(model):
    """No ``val_samples`` / ``val_data_path``: the data modules offer no ``val_dataloader`` (Lightning then runs no
    validation loop; an empty list made it warn "Total length of `list` across ranks is zero")."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    none, some = (lmm.data.SyntheticMultimodalDataModule(batch_size=2, val_samples=n, model=model) for n in (0, 4))
    assert not is_overridden("val_dataloader", none) and is_overridden("val_dataloader", some)
    assert len(some.val_dataloader()) == 2
    proc = lmm.data.MultimodalProcessor.__new__(lmm.data.MultimodalProcessor)  # never used: nothing is read
    conv = [lmm.data.ConversationDataModule("train.json", processor=proc, val_data_path=v) for v in (None, "val.json")]
    assert not is_overridden("val_dataloader", conv[0]) and is_overridden("val_dataloader", conv[1])
