"""LoRA on the language model through ``peft``.

``peft`` injects its LoRA layers into the language model in place, so ``MultimodalModel.language_model`` stays the
HF ``*ForCausalLM`` (now holding ``lora_A``/``lora_B`` beside each adapted weight, which moves under
``base_layer``); the ``PeftModel`` wrapper is kept beside it, unregistered (``model.peft_model``), for saving and
merging. peft freezes every weight of the language model but the adapters; the rest of the model keeps its
``requires_grad``. The frozen base still runs backward for input gradients when something below it (a
projector, an encoder) is trainable.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

from torch import nn

from lightning_mm.model.loading import is_meta


def _peft():
    try:
        import peft
    except ImportError as e:  # a declared dependency; say how to get it if an environment lacks it
        raise ImportError("LoRA needs the peft package: pip install peft") from e
    return peft


def is_peft_model(module) -> bool:
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(module).__mro__)


def unwrap(language_model) -> tuple[nn.Module, object | None]:
    """``(HF causal LM, PeftModel or None)`` for a plain or PEFT-wrapped language model."""
    if not is_peft_model(language_model):
        return language_model, None
    other = {name: str(c.peft_type) for name, c in language_model.peft_config.items()
             if c.peft_type != _peft().PeftType.LORA}
    if other:
        raise ValueError(f"peft adapters other than LoRA are not supported (got {other}); wrap the language model "
                         "with a peft LoraConfig")
    return language_model.get_base_model(), language_model


@contextlib.contextmanager
def _quiet():
    """peft asks transformers a deprecated question; the warning is not the user's to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def add_lora(model, modules, r: int = 8, alpha: float = 16, dropout: float = 0.0, **config):
    """``MultimodalModel.add_lora``: see its docstring. Returns the ``PeftModel``."""
    peft = _peft()
    if model.peft_model is not None:
        raise ValueError("the language model already has LoRA adapters (model.peft_model); add more with "
                         "model.peft_model.add_adapter(name, peft.LoraConfig(...))")
    if is_meta(model.language_model):
        raise ValueError("add_lora needs the language model's weights: call it after "
                         "lightning_mm.model.materialise(model, device), or build the model eagerly")
    targets = [modules] if isinstance(modules, str) else list(modules)
    lora_config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                                  task_type="CAUSAL_LM", **config)
    with _quiet():
        peft_model = peft.get_peft_model(model.language_model, lora_config)
    model.__dict__["peft_model"] = peft_model  # unregistered: its parameters are the language model's
    return peft_model


def save_lora(model, path, merge: bool = False) -> None:
    """``merge=False``: the adapters as peft saves them (``adapter_config.json`` + ``adapter_model.safetensors``;
    ``peft.PeftModel.from_pretrained(base, path)`` loads them). ``merge=True``: a plain HF folder of the language
    model with the adapters merged into its weights (peft's ``merge_and_unload`` on a copy, so the model keeps
    training; the copy holds the language model once more while it is written)."""
    if model.peft_model is None:
        raise ValueError("the language model has no LoRA adapters: model.add_lora(...) first")
    if not merge:
        model.peft_model.save_pretrained(path)
        return
    with _quiet():
        merged = copy.deepcopy(model.peft_model).merge_and_unload()
    merged.save_pretrained(path)


def merge_lora(model) -> nn.Module:
    """Merge the adapters into the language model's weights in place (peft's ``merge_and_unload``); the model is a
    plain ``MultimodalModel`` again (``save_pretrained`` / ``export_hf`` write plain HF folders). Returns the
    language model."""
    if model.peft_model is None:
        raise ValueError("the language model has no LoRA adapters: model.add_lora(...) first")
    with _quiet():
        lm = model.peft_model.merge_and_unload()
    assert lm is model.language_model
    model.__dict__["peft_model"] = None
    return lm
