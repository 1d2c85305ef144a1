"""A ``MultimodalModel`` as one HF folder per part, and back.

``save_parts(model, out_dir)`` writes ``out_dir/encoders/<name>`` and ``out_dir/language_model`` as
``save_pretrained`` folders (safetensors + config.json), ``out_dir/projectors/<name>`` as ``model.safetensors`` and a
``config.json`` (kind, widths), and ``out_dir/lightning_mm.json`` listing the parts. Each part loads alone with its
HF class's ``from_pretrained``; ``load_parts`` (what ``MultimodalModel.from_pretrained`` calls for such a folder)
rebuilds the whole model. A LoRA language model is written with its adapters merged (a plain HF folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_mm.model.encoder import ModalityEncoder
from lightning_mm.model.loading import ModelFolderError

MANIFEST = "lightning_mm.json"


def is_parts_folder(path) -> bool:
    """Whether ``path`` is a folder ``save_parts`` wrote."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, MANIFEST))


def save_parts(model, out_dir) -> dict:
    """Write ``model`` (a whole ``MultimodalModel``) as HF folders, one per part; returns the manifest."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    manifest = {"encoders": {}, "language_model": {"class": type(model.language_model).__name__,
                                                   "dir": "language_model"},
                "placeholder_ids": model.placeholder_ids}
    for name, enc in model.encoders.items():
        enc.module.save_pretrained(out / "encoders" / name)
        pdir = out / "projectors" / name
        pdir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in enc.projector.state_dict().items()}, str(pdir / "model.safetensors"))
        pconf = {"kind": enc.projector_kind, "in_dim": enc.output_dim, "out_dim": model.hidden_size}
        (pdir / "config.json").write_text(json.dumps(pconf, indent=1))
        manifest["encoders"][name] = {"class": type(enc.module).__name__, "module": type(enc.module).__module__,
                                      "dir": f"encoders/{name}", "projector": f"projectors/{name}",
                                      "projector_kind": enc.projector_kind}
    if getattr(model, "peft_model", None) is not None:  # LoRA adapters: a plain folder with them merged
        from lightning_mm.model.lora import save_lora

        save_lora(model, out / "language_model", merge=True)
    else:
        model.language_model.save_pretrained(out / "language_model")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def load_parts(model_class, out_dir):
    """The ``model_class`` (``MultimodalModel``) of a ``save_parts`` folder, each part through its HF class's
    ``from_pretrained``."""
    import importlib

    import transformers
    from safetensors.torch import load_file

    out = Path(out_dir)
    manifest = json.loads((out / MANIFEST).read_text())
    encoders = {}
    for name, part in manifest["encoders"].items():
        cls = getattr(importlib.import_module(part["module"]), part["class"])
        kind = part["projector_kind"]
        if kind is None:
            raise ModelFolderError(f"encoder {name!r} of {out} has a custom projector module; build the model in "
                                   "code and load the weights into it (lightning_mm.checkpoint.load_weights)")
        encoders[name] = ModalityEncoder(cls.from_pretrained(out / part["dir"]), projector=kind)
    lm = getattr(transformers, manifest["language_model"]["class"]).from_pretrained(out / "language_model")
    model = model_class(encoders, lm, placeholder_ids=manifest["placeholder_ids"])
    for name, part in manifest["encoders"].items():
        model.encoders[name].projector.load_state_dict(load_file(str(out / part["projector"] / "model.safetensors")))
    return model


__all__ = ["MANIFEST", "is_parts_folder", "save_parts", "load_parts"]
