import lightning as L
import lightning_mm as lmm
from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

L.seed_everything(0)
vision = lmm.ModalityEncoder(SiglipVisionModel(SiglipVisionConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)),
    projector="mlp")
llm = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
model = lmm.MultimodalModel(encoders={"vision": vision}, language_model=llm)
model.freeze(encoders=True, projectors=False, language_model=False)     # train the projector and the LLM

strategy = lmm.MultimodalParallelStrategy(
    encoders={"vision": lmm.ParallelSpec(pp=1)},    # the vision tower: 1 stage on its own rank
    language_model=lmm.ParallelSpec(pp=2),          # the LLM: 2 pipeline stages
    num_microbatches=2,
)
trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=3, max_steps=10, log_every_n_steps=2,
                    callbacks=[lmm.callbacks.StepProgressBar(), lmm.callbacks.LossCurve()])
trainer.fit(lmm.MultimodalLightningModule(model, lr=3e-3),
            datamodule=lmm.data.SyntheticMultimodalDataModule(batch_size=4, val_samples=0))
