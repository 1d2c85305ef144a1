"""``lightning-mm export`` end to end, as a user runs it: fit the main example (4 processes) for a few steps with a
checkpoint, export that checkpoint from the same config, load every folder back with ``from_pretrained``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
import yaml

from lightning_mm import checkpoint as ckpt
from tests.helpers.checkpoint_runs import case_env

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny_valm_pp.yaml")


def _cli(*args, timeout=300):
    exe = shutil.which("lightning-mm")
    assert exe, "the console script is not installed: pip install -e ."
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                          env=case_env())


def _short_run(tmp_path) -> str:
    """The example's own model and layout (vision 1 stage, audio 1 stage, LLM 2 stages), 2 steps, a checkpoint
    that also holds the frozen encoders (so the test can see that the export's are the ones trained with)."""
    strategy = {"class_path": "lightning_mm.MultimodalParallelStrategy", "init_args": {"save_frozen_parameters": True}}
    override = {"trainer": {"strategy": strategy, "max_steps": 2, "enable_checkpointing": True, "logger": False,
                            "default_root_dir": str(tmp_path), "enable_progress_bar": False,
                            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                           "init_args": {"dirpath": str(tmp_path / "ckpts"), "filename": "{step}",
                                                         "every_n_train_steps": 2, "save_top_k": -1}}]},
                "data": {"class_path": "lightning_mm.data.SyntheticMultimodalDataModule",
                         "init_args": {"num_samples": 16}}}
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(override))
    fit = _cli("fit", "--config", CONFIG, "--config", str(tmp_path / "short.yaml"))
    assert fit.returncode == 0, fit.stderr[-4000:]
    path = tmp_path / "ckpts" / "step=2.ckpt"
    assert (path / "layout.json").is_file(), sorted(os.listdir(tmp_path / "ckpts"))
    return str(path)


@pytest.mark.slow
def test_export_cli_writes_folders_that_from_pretrained_loads(tmp_path):
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM, SiglipVisionModel
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    path = _short_run(tmp_path)
    layout = json.loads(open(os.path.join(path, "layout.json")).read())
    assert layout["stages"] == ["vision.0", "audio.0", "language_model.0", "language_model.1"], layout["stages"]
    out = tmp_path / "hf"
    export = _cli("export", "--config", CONFIG, "--ckpt_path", path, "--out_dir", str(out))
    assert export.returncode == 0, export.stderr[-4000:]
    assert "exported vision, audio" in export.stdout, export.stdout

    assert "differ from the ones the config builds" not in export.stderr, export.stderr[-3000:]

    merged = ckpt.consolidate(path, trainable_only=False)  # everything: projectors, the LLM, the frozen encoders
    trainable = ckpt.consolidate(path)
    assert set(trainable) < set(merged) and any(".module." in n for n in set(merged) - set(trainable))
    found = {}
    llm = Qwen2ForCausalLM.from_pretrained(out / "language_model")
    found.update({f"language_model.{n}": p for n, p in llm.named_parameters()})
    for name, cls in (("vision", SiglipVisionModel), ("audio", WhisperEncoder)):
        enc = cls.from_pretrained(out / "encoders" / name)
        found.update({f"encoders.{name}.module.{n}": p for n, p in enc.named_parameters()})
        proj = load_file(str(out / "projectors" / name / "model.safetensors"))
        found.update({f"encoders.{name}.projector.{n}": p for n, p in proj.items()})
    assert set(found) == set(merged) == set(layout["parameters"]), sorted(set(found) ^ set(merged))
    for name, value in merged.items():
        torch.testing.assert_close(found[name], value, rtol=0, atol=0, msg=name)
    model = ckpt.load_hf(str(out))  # the whole MultimodalModel back from the folders
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, merged[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_export_refuses_a_config_without_a_fixed_seed(tmp_path):
    """Frozen parameters come from the config; with a random seed they would silently differ from the run's."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_mm.data.synthetic import SyntheticMultimodalDataModule
    from lightning_mm.trainer.module import MultimodalLightningModule

    cli = LightningCLI(MultimodalLightningModule, SyntheticMultimodalDataModule, subclass_mode_data=True, run=False,
                       args=["--config", CONFIG, "--trainer.logger=false"], save_config_callback=None)
    model = cli.model.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(list(model.parameters()))  # the example freezes its encoders
    layout = {"parameters": ckpt.model_fingerprint(model), "trainable": trainable, "frozen_saved": False,
              "world_size": 1, "stages": []}
    path = str(tmp_path / "step=1.ckpt")  # what a default run writes: the trainable parameters only
    ckpt.save_sharded(path, {f"model/{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad},
                      {}, layout, rank=0)
    cfg = yaml.safe_load(open(CONFIG))
    cfg.pop("seed_everything")
    (tmp_path / "noseed.yaml").write_text(yaml.safe_dump(cfg))
    export = _cli("export", "--config", str(tmp_path / "noseed.yaml"), "--ckpt_path", path,
                  "--out_dir", str(tmp_path / "hf"))
    assert export.returncode != 0
    assert "seed_everything=None (a random seed)" in export.stderr, export.stderr[-3000:]
    assert not (tmp_path / "hf").exists()
