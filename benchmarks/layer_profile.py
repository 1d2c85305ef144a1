"""One real transformers layer of each family and size of `benchmarks/frozen_aware.py`, timed on one device.

Layers, shapes, timing and commands: docs/planner.md, "Measured layer profile". Without a GPU and without
`--device cpu` it says so and exits 0.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

import frozen_aware as fa  # its model tables and token counts are what is profiled here
import harness
from lightning_mm.planner.model_costs import part_activation_bytes
from lightning_mm.planner.profiler import profile_layer

FORMAT = "lightning-mm layer profile"
VERSION = 1
TINY_SHRINK = 64  # --tiny: every hidden size and token count / this
TINY_HEAD_DIM = {"llama3": 16, "qwen2_vision": 4, "phi4_audio": 16}
FAMILIES = fa.FAMILY_TABLES
ENCODER_FAMILY = {modality: family for family, modality in fa.MODALITY.items()}
AUDIO_CHUNK = 500  # Phi4MultimodalAudioModel unfolds longer clips into chunks of this many frames
MLP_MULTIPLE = 256  # MLP widths are rounded to a multiple of this (of 8 under --tiny)


def llm_token_counts() -> list[int]:
    """Every LLM sequence length of `frozen_aware.py`'s configurations (text + merged patches + audio frames)."""
    counts = set()
    for _, vision, audio, _ in fa.configurations():
        counts.add(fa.TEXT_TOKENS + (fa.VISION_PATCHES // fa.VISION_MERGE if vision else 0)
                   + (fa.AUDIO_TOKENS if audio else 0))
    return sorted(counts)


def module_token_counts() -> dict[str, list[int]]:
    return {"llama3": llm_token_counts(), "qwen2_vision": [fa.VISION_PATCHES], "phi4_audio": [fa.AUDIO_TOKENS]}


def shrunk(value: int, shrink: int) -> int:
    return max(1, round(value / shrink))


# ------------------------------------------------------------------------------------------------ layer builders
def phi4_audio_available() -> bool:
    try:
        from transformers.models.phi4_multimodal import modeling_phi4_multimodal as m
    except ImportError:
        return False
    return hasattr(m, "Phi4MultimodalAudioConformerEncoderLayer")


def _heads(hidden: int, head_dim: int) -> int:
    if hidden % head_dim:
        raise ValueError(f"hidden {hidden} is not a multiple of head dim {head_dim}")
    return hidden // head_dim


def _count(build, width: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build(width).parameters())


def solve_width(build, target: float, multiple: int) -> int:
    """The MLP width whose layer has `target` parameters (the count is affine in the width), rounded."""
    a, b = _count(build, multiple), _count(build, 2 * multiple)
    per_unit = (b - a) / multiple
    width = (target - (a - per_unit * multiple)) / per_unit
    return max(multiple, multiple * round(width / multiple))


class LlamaLayer(nn.Module):
    """`LlamaDecoderLayer` with what `LlamaModel` gives it: rotary embeddings of positions 0..T-1, no mask (causal
    sdpa)."""

    def __init__(self, layer, rotary):
        super().__init__()
        self.layer, self.rotary, self._cache = layer, rotary, {}

    def forward(self, x):
        b, t, _ = x.shape
        if (b, t) not in self._cache:
            positions = torch.arange(t, device=x.device).unsqueeze(0).expand(b, -1)
            with torch.no_grad():
                self._cache[(b, t)] = positions, self.rotary(x, positions)
        positions, embeddings = self._cache[(b, t)]
        return self.layer(x, attention_mask=None, position_ids=positions, position_embeddings=embeddings)


class QwenVisionLayer(nn.Module):
    """`Qwen2VLVisionBlock` as `Qwen2VisionTransformerPretrainedModel` runs it: the microbatch's images packed into
    one [B*T, hidden] sequence with `cu_seqlens` (attention within each image), axial 2-D rotary embeddings."""

    def __init__(self, block, rotary):
        super().__init__()
        self.block, self.rotary, self._cache = block, rotary, {}

    def forward(self, x):
        b, t, h = x.shape
        if (b, t) not in self._cache:
            width = max(1, round(math.sqrt(t)))
            index = torch.arange(t, device=x.device)
            positions = torch.stack([index // width, index % width], dim=-1).repeat(b, 1)  # [B*T, (h, w)]
            cu_seqlens = torch.arange(b + 1, device=x.device, dtype=torch.int32) * t
            with torch.no_grad():
                cos, sin = self.rotary(x, positions)
            self._cache[(b, t)] = cu_seqlens, (cos.to(x.dtype), sin.to(x.dtype))
        cu_seqlens, embeddings = self._cache[(b, t)]
        out = self.block(x.reshape(b * t, h), cu_seqlens=cu_seqlens, position_embeddings=embeddings)
        return out.reshape(b, t, h)


class Phi4AudioLayer(nn.Module):
    """The Phi-4 conformer layer as `Phi4MultimodalAudioModel` runs it: clips longer than `chunk` frames padded
    and cut into chunks of `chunk`, the relative-position bias as the attention mask."""

    def __init__(self, layer, bias, chunk: int):
        super().__init__()
        self.layer, self.chunk, self._cache = layer, chunk, {}
        self._bias = (bias,)  # the model's one bias table, shared by every layer: not this layer's parameters

    def forward(self, x):
        b, t, h = x.shape
        chunk = min(self.chunk, t)
        pad = (-t) % chunk
        if chunk not in self._cache:
            with torch.no_grad():
                self._cache[chunk] = self._bias[0](x.new_empty(1, chunk, 1)).to(x.dtype)
        y = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        y = self.layer(y.reshape(-1, chunk, h), self._cache[chunk])
        return y.reshape(b, t + pad, h)[:, :t]


def head_dim(family: str, hidden: int, tiny: bool) -> int:
    """Llama 3: 64 at hidden <= 2048, else 128; Qwen2-VL vision: 80; Phi-4 audio: 64. Under --tiny: 16, 8, 16."""
    if tiny:
        return TINY_HEAD_DIM[family]
    return {"llama3": 64 if hidden <= 2048 else 128, "qwen2_vision": 80, "phi4_audio": 64}[family]


def build_layer(family: str, hidden: int, target: float, tiny: bool):
    """(the layer wrapped to take [B, T, hidden], description), on the current default device: `hidden` is the size
    to build (already shrunk under --tiny), `target` its parameter count."""
    multiple = 8 if tiny else MLP_MULTIPLE
    shrink = TINY_SHRINK if tiny else 1
    heads = _heads(hidden, head_dim(family, hidden * shrink, tiny))
    if family == "llama3":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        kv_heads = math.gcd(heads, 8)

        def config(width):
            c = LlamaConfig(hidden_size=hidden, intermediate_size=width, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, head_dim=hidden // heads, num_hidden_layers=1,
                            vocab_size=128, max_position_embeddings=8192, rope_theta=500000.0)
            c._attn_implementation = "sdpa"
            return c

        width = solve_width(lambda w: LlamaDecoderLayer(config(w), 0), target, multiple)
        c = config(width)
        layer = LlamaLayer(LlamaDecoderLayer(c, 0), LlamaRotaryEmbedding(c))
        return layer, {"class": "LlamaDecoderLayer", "hidden": hidden, "intermediate": width, "heads": heads,
                       "kv_heads": kv_heads, "head_dim": hidden // heads, "causal": True}
    if family == "qwen2_vision":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionBlock, Qwen2VLVisionRotaryEmbedding


        def config(width):  # the config takes an integer MLP ratio: widths are multiples of the hidden size
            c = Qwen2VLVisionConfig(embed_dim=hidden, num_heads=heads, depth=1, mlp_ratio=width // hidden)
            c._attn_implementation = "sdpa"
            return c

        width = solve_width(lambda w: Qwen2VLVisionBlock(config(w)), target, hidden)
        c = config(width)
        c.num_attention_heads = heads  # read by the rotary embedding
        layer = QwenVisionLayer(Qwen2VLVisionBlock(c), Qwen2VLVisionRotaryEmbedding(c))
        return layer, {"class": "Qwen2VLVisionBlock", "hidden": hidden, "intermediate": width, "heads": heads,
                       "head_dim": hidden // heads, "causal": False}
    if family == "phi4_audio":
        chunk = shrunk(AUDIO_CHUNK, shrink)
        if phi4_audio_available():
            from transformers.models.phi4_multimodal.configuration_phi4_multimodal import Phi4MultimodalAudioConfig
            from transformers.models.phi4_multimodal.modeling_phi4_multimodal import (
                Phi4MultimodalAudioConformerEncoderLayer, Phi4MultimodalAudioRelativeAttentionBias)

            def config(width):
                c = Phi4MultimodalAudioConfig(hidden_size=hidden, intermediate_size=width, num_attention_heads=heads,
                                              ext_pw_out_channel=hidden, depthwise_separable_out_channel=hidden,
                                              num_blocks=1)
                c._attn_implementation = "sdpa"
                return c

            width = solve_width(lambda w: Phi4MultimodalAudioConformerEncoderLayer(config(w)), target, multiple)
            c = config(width)
            layer = Phi4AudioLayer(Phi4MultimodalAudioConformerEncoderLayer(c),
                                   Phi4MultimodalAudioRelativeAttentionBias(c), chunk)
            return layer, {"class": "Phi4MultimodalAudioConformerEncoderLayer", "hidden": hidden,
                           "intermediate": width, "heads": heads, "head_dim": hidden // heads, "causal": False,
                           "attention_chunk": chunk}

        def plain(width):
            return nn.TransformerEncoderLayer(hidden, heads, width, dropout=0.0, activation="gelu",
                                              batch_first=True, norm_first=True)

        width = solve_width(plain, target, multiple)
        return plain(width), {"class": "torch.nn.TransformerEncoderLayer", "hidden": hidden, "intermediate": width,
                              "heads": heads, "head_dim": hidden // heads, "causal": False}
    raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")


def build_projector(in_features: int, llm_hidden: int) -> nn.Module:
    """The benchmark's trainable projector: Linear(in, llm hidden), GELU, Linear(llm hidden, llm hidden)."""
    return nn.Sequential(nn.Linear(in_features, llm_hidden, bias=False), nn.GELU(),
                         nn.Linear(llm_hidden, llm_hidden, bias=False))


# ---------------------------------------------------------------------------------------------------- measuring
def measure(layer: nn.Module, tokens: int, hidden: int, device: torch.device, dtype: torch.dtype,
            warmup: int, repeats: int) -> dict:
    """Times and activation bytes of `layer` on [SAMPLES_PER_MICROBATCH, tokens, hidden]."""
    shape = (fa.SAMPLES_PER_MICROBATCH, tokens, hidden)
    make_x = lambda: torch.randn(shape, device=device, dtype=dtype)  # noqa: E731
    forward, input_grad, weight_grad = profile_layer(layer, make_x, warmup, repeats)
    params = list(layer.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    saved = [p.requires_grad for p in params]
    acts = {}
    try:
        for name, flag in (("frozen", False), ("trainable", True)):
            for p in params:
                p.requires_grad_(flag)
            acts[name] = part_activation_bytes(layer, make_x(), exclude, input_grad=True)
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)
    return {"measured_tokens": tokens, "forward_s": forward, "input_grad_s": input_grad, "weight_grad_s": weight_grad,
            "activation_bytes_frozen": acts["frozen"], "activation_bytes_trainable": acts["trainable"],
            "input_bytes": float(math.prod(shape) * torch.finfo(dtype).bits // 8)}


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def profile_all(device: torch.device, dtype: torch.dtype, tiny: bool, warmup: int, repeats: int,
                log=print) -> dict:
    shrink = TINY_SHRINK if tiny else 1
    torch.manual_seed(0)
    layers, hidden_of = {}, {}
    for family, table in FAMILIES.items():
        layers[family] = {}
        for size, (count, hidden, params) in table.items():
            hidden = shrunk(hidden, shrink)
            hidden_of[(family, size)] = hidden
            target = params / count / shrink**2
            started = time.perf_counter()
            with torch.device(device):
                layer, info = build_layer(family, hidden, target, tiny)
            layer = layer.to(dtype).eval()  # eval: no dropout; gradients still flow
            info["params_per_layer"] = sum(p.numel() for p in layer.parameters())
            info["target_params_per_layer"] = target
            info["tokens"] = {}
            for tokens in module_token_counts()[family]:
                info["tokens"][str(tokens)] = measure(layer, shrunk(tokens, shrink), hidden, device, dtype,
                                                      warmup, repeats)
            info["seconds_to_profile"] = time.perf_counter() - started
            layers[family][size] = info
            log(f"  {family} {size}: {info['class']}, {info['params_per_layer'] / 1e6:.2f}M parameters "
                f"({info['seconds_to_profile']:.1f} s)")
            del layer
            _release(device)
    projectors = {}
    for modality, family in ENCODER_FAMILY.items():
        projectors[modality] = {}
        merge = fa.VISION_MERGE if modality == "vision" else 1
        tokens = fa.VISION_PATCHES // fa.VISION_MERGE if modality == "vision" else fa.AUDIO_TOKENS
        for enc_size in FAMILIES[family]:
            for llm_size in fa.LLAMA3:
                in_features = merge * hidden_of[(family, enc_size)]
                llm_hidden = hidden_of[("llama3", llm_size)]
                with torch.device(device):
                    proj = build_projector(in_features, llm_hidden).to(dtype)
                entry = measure(proj, shrunk(tokens, shrink), in_features, device, dtype, warmup, repeats)
                entry.update(in_features=in_features, llm_hidden=llm_hidden, tokens=tokens,
                             params=sum(p.numel() for p in proj.parameters()))
                projectors[modality][f"{enc_size}->{llm_size}"] = entry
                del proj
        log(f"  {modality} projectors: {len(projectors[modality])} pairs")
    _release(device)
    import transformers

    return {
        "format": FORMAT, "version": VERSION, "device": device_name(device), "device_type": device.type,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None, "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": "sdpa", "tiny": tiny, "shrink": shrink,
        "samples_per_microbatch": fa.SAMPLES_PER_MICROBATCH, "warmup": warmup, "repeats": repeats,
        "audio_layer": layers["phi4_audio"]["S"]["class"],
        "note": ("one layer per family and size at the benchmark's shapes, random weights; times are medians of "
                 "`profile_layer` (forward, gradient w.r.t. the input only, w.r.t. the weights only) on one device, "
                 "per microbatch of samples_per_microbatch samples; token keys are the benchmark's token counts "
                 "(measured_tokens: what ran, smaller under tiny)"),
        "layers": layers, "projectors": projectors,
    }


def main(argv=None) -> int:
    args = harness.cli(
        __doc__, argv, device=dict(choices=("cuda", "cpu"), default="cuda"),
        tiny=(False, f"every hidden size and token count / {TINY_SHRINK}: seconds on a CPU, for tests"),
        out=dict(type=Path, help="JSON path (default benchmarks/results/layer_profile_<device>[_tiny].json)"),
        warmup=3, repeats=10)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("layer_profile: no CUDA device here; nothing measured (use --device cpu to time on the CPU)")
        return 0
    device, started, start = torch.device(args.device), time.perf_counter(), harness.record()
    print(f"profiling one layer per family and size on {device_name(device)}{' (tiny)' if args.tiny else ''}")
    doc = profile_all(device, torch.bfloat16, args.tiny, args.warmup, args.repeats)  # bf16, as trained
    doc["seconds"] = time.perf_counter() - started
    out = args.out or harness.RESULTS / f"layer_profile_{harness.slug(doc['device'])}{'_tiny' if args.tiny else ''}.json"
    harness.write(out, doc, start)
    harness.print_rows([dict(family=f, size=s, layer=i["class"], params=i["params_per_layer"] / 1e6, tokens=int(t),
                             fwd_ms=1e3 * x["forward_s"], in_grad_ms=1e3 * x["input_grad_s"],
                             w_grad_ms=1e3 * x["weight_grad_s"], act_mib_frozen=x["activation_bytes_frozen"] / 2**20)
                        for f, sizes in doc["layers"].items() for s, i in sizes.items()
                        for t, x in i["tokens"].items()],
                       ["family", "size", "layer", "params", "tokens", "fwd_ms", "in_grad_ms", "w_grad_ms",
                        "act_mib_frozen"], f"layer profile on {doc['device']} (params in millions per layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
