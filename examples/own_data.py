import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model

L.seed_everything(0)
model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")},
                            tiny_language_model("llama"))
IMAGE = model.placeholder_ids["vision"]          # the id of one image's placeholder token
SIZE = model.encoders["vision"].config.image_size   # the tower's input resolution


class MyData(Dataset):
    """Samples in the collator's format: input_ids with ONE placeholder per image, the images' encoder inputs."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        images = i % 3                           # 0, 1 or 2 images
        text = torch.randint(3, model.vocab_size, (8 + i % 5,), generator=g).tolist()
        sample = {"input_ids": [1] + [IMAGE] * images + text}    # labels default to the text, -100 on images
        if images:
            sample["vision"] = {"pixel_values": torch.randn(images, 3, SIZE, SIZE, generator=g)}
        return sample


strategy = lmm.MultimodalParallelStrategy(language_model=lmm.ParallelSpec(pp=2), num_microbatches=2,
                                          batch_balancing="entrain")
trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=3, max_steps=5, log_every_n_steps=1,
                    enable_checkpointing=False, callbacks=[lmm.callbacks.StepProgressBar()])
loader = DataLoader(MyData(), batch_size=4, collate_fn=lmm.data.MultimodalCollator(model))
trainer.fit(lmm.MultimodalLightningModule(model, lr=3e-3), train_dataloaders=loader)
