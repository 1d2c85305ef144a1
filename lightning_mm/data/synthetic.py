"""Synthetic multimodal data: the embedded default, so every example and test runs with no download.

Text is learnable (each sample is an arithmetic progression of token ids modulo the vocabulary with a per-sample
step), so the loss visibly goes down. Each sample carries a random number of items per modality with the
family's own input shapes (variable resolution for Qwen2-VL), placed prepended (EP) or embedded at random
positions (EE); multimodal packing (MP) is the collator's ``pack`` option. Seeded: sample i is a pure function
of (seed, i).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_mm.data.collator import MultimodalCollator
from lightning_mm.data.metadata import SampleMeta, metadata_of

LAYOUTS = ("ep", "ee", "mp")


class SyntheticMultimodalDataset(Dataset):
    """``num_samples`` unexpanded samples (see ``MultimodalCollator``) for ``model``'s encoders."""

    def __init__(self, model, num_samples: int = 64, text_tokens: tuple[int, int] = (8, 24),
                 items_per_sample: tuple[int, int] = (1, 2), layout: str = "ee", seed: int = 0,
                 variable_size: bool = True):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
        self.model, self.num_samples, self.text_tokens = model, num_samples, text_tokens
        self.items_per_sample, self.layout, self.seed, self.variable_size = (
            items_per_sample, layout, seed, variable_size)
        self.vocab = model.vocab_size
        self._metadata: dict[int, SampleMeta] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _text_token(self, t: int) -> int:
        """Token ``t`` of the vocabulary, stepping past placeholder ids inside it (a composite's image and video
        tokens), so that text never reads as an item."""
        reserved = set(self.model.placeholder_ids.values())
        t %= self.vocab
        while t in reserved:
            t = (t + 1) % self.vocab
        return t

    def _items(self, enc, n: int, g: torch.Generator) -> dict:
        fam, cfg = enc.family, enc.config
        if fam.input_key == "image_grid_thw" and self.variable_size:
            m = cfg.spatial_merge_size
            grids = [(1, m * int(torch.randint(1, 3, (1,), generator=g)), m * int(torch.randint(1, 3, (1,), generator=g)))
                     for _ in range(n)]
            return fam.random_inputs(cfg, n, generator=g, grids=grids)
        return fam.random_inputs(cfg, n, generator=g)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        lo, hi = self.text_tokens
        n_text = int(torch.randint(lo, hi + 1, (1,), generator=g))
        start, step = int(torch.randint(0, self.vocab, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        text = [self._text_token(start + step * t) for t in range(n_text)]
        sample, placeholders = {}, []
        for name, enc in self.model.encoders.items():
            n = int(torch.randint(self.items_per_sample[0], self.items_per_sample[1] + 1, (1,), generator=g))
            if n:
                sample[name] = self._items(enc, n, g)
                placeholders += [self.model.placeholder_ids[name]] * n
        if self.layout == "ep":
            ids = placeholders + text
        else:  # embedded at random cut points, keeping item order
            cuts = sorted(torch.randint(0, n_text + 1, (len(placeholders),), generator=g).tolist())
            ids, prev = [], 0
            for p, c in zip(placeholders, cuts):
                ids += text[prev:c] + [p]
                prev = c
            ids += text[prev:]
        sample["input_ids"] = torch.tensor(ids)
        return sample

    def sample_metadata(self, i: int) -> SampleMeta:
        """Sample ``i``'s token counts. Synthetic samples are generated, not stored, so this generates the sample
        (once: cached) and counts; file-backed data sets read headers instead."""
        if i not in self._metadata:
            self._metadata[i] = metadata_of(self[i], self.model)
        return self._metadata[i]


class SyntheticMultimodalDataModule(pl.LightningDataModule):
    """Synthetic data for the model of the running ``MultimodalLightningModule`` (or ``model=`` when used alone).

    ``layout``: "ep" (prepended), "ee" (embedded) or "mp" (embedded and packed into rows of ``seq_len``).
    ``pad_to_multiple_of`` rounds sequence lengths up (context parallelism needs whole blocks).
    """

    def __init__(self, num_samples: int = 64, batch_size: int = 4, text_tokens: tuple[int, int] = (8, 24),
                 items_per_sample: tuple[int, int] = (1, 2), layout: str = "ee", seq_len: int | None = None,
                 pad_to_multiple_of: int = 1, val_samples: int = 0, seed: int = 0, num_workers: int = 0,
                 causal_modalities: bool = False, model=None):
        super().__init__()
        if layout == "mp" and not seq_len:
            raise ValueError("layout 'mp' packs samples into rows of seq_len tokens: set seq_len")
        self.save_hyperparameters(ignore=["model"])
        self._model = model

    @property
    def model(self):
        if self._model is not None:
            return self._model
        if self.trainer is None or self.trainer.lightning_module is None:
            raise RuntimeError("SyntheticMultimodalDataModule needs the model: pass model=... or use it with a "
                               "Trainer and a MultimodalLightningModule")
        return self.trainer.lightning_module.model

    def collator(self) -> MultimodalCollator:
        h = self.hparams
        return MultimodalCollator(self.model, seq_len=h.seq_len, pack=h.layout == "mp",
                                  pad_to_multiple_of=h.pad_to_multiple_of, causal_modalities=h.causal_modalities)

    def _dataset(self, n, seed):
        h = self.hparams
        return SyntheticMultimodalDataset(self.model, n, tuple(h.text_tokens), tuple(h.items_per_sample),
                                          "ee" if h.layout == "mp" else h.layout, seed)

    def _loader(self, n, seed, shuffle):
        h = self.hparams
        samples_per_batch = h.batch_size
        return DataLoader(self._dataset(n, seed), batch_size=samples_per_batch, shuffle=shuffle,
                          collate_fn=self.collator(), num_workers=h.num_workers, drop_last=True,
                          generator=torch.Generator().manual_seed(h.seed) if shuffle else None)

    def train_dataloader(self):
        return self._loader(self.hparams.num_samples, self.hparams.seed, shuffle=True)

    @property
    def val_dataloader(self):
        """The validation loader's hook, or, without ``val_samples``, LightningDataModule's own (not overridden), so
        Lightning runs no validation loop instead of one over an empty list."""
        return self._val_dataloader if self.hparams.val_samples else super().val_dataloader

    def _val_dataloader(self):
        return self._loader(self.hparams.val_samples, self.hparams.seed + 1, shuffle=False)
