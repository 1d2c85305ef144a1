"""One real transformers layer of each family and size of `benchmarks/frozen_aware.py`, timed on one device.

Layers, shapes, timing and commands: docs/planner.md, "Measured layer profile". Run: `python
benchmarks/layer_profile.py --device cuda`; without a GPU and without `--device cpu` it says so and exits 0.
"""

from __future__ import annotations

import itertools
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
AUDIO_CHUNK = 500  # Phi4MultimodalAudioModel unfolds longer clips into chunks of this many frames
MLP_MULTIPLE = 256  # MLP widths are rounded to a multiple of this (of 8 under --tiny)


def module_token_counts() -> dict[str, list[int]]:
    """The token counts of each family in `frozen_aware.py`'s configurations (LLM: text + merged patches + audio)."""
    llm = set()
    for _, vision, audio, _ in fa.configurations():
        llm.add(fa.TEXT_TOKENS + (fa.VISION_PATCHES // fa.VISION_MERGE if vision else 0)
                + (fa.AUDIO_TOKENS if audio else 0))
    return {"llama3": sorted(llm), "qwen2_vision": [fa.VISION_PATCHES], "phi4_audio": [fa.AUDIO_TOKENS]}


def shrunk(value: int, shrink: int) -> int:
    return max(1, round(value / shrink))


def phi4_audio_available() -> bool:
    try:
        from transformers.models.phi4_multimodal import modeling_phi4_multimodal as m
    except ImportError:
        return False
    return hasattr(m, "Phi4MultimodalAudioConformerEncoderLayer")


def head_dim(family: str, hidden: int, tiny: bool) -> int:
    """Llama 3: 64 at hidden <= 2048, else 128; Qwen2-VL vision: 80; Phi-4 audio: 64. Under --tiny: 16, 4, 16."""
    if tiny:
        return {"llama3": 16, "qwen2_vision": 4, "phi4_audio": 16}[family]
    return {"llama3": 64 if hidden <= 2048 else 128, "qwen2_vision": 80, "phi4_audio": 64}[family]


def solve_width(build, target: float, multiple: int) -> int:
    """The MLP width whose layer `build(width)` has `target` parameters (affine in the width), rounded."""
    def count(width):
        with torch.device("meta"):
            return sum(p.numel() for p in build(width).parameters())

    a, b = count(multiple), count(2 * multiple)
    per_unit = (b - a) / multiple
    return max(multiple, multiple * round((target - (a - per_unit * multiple)) / per_unit / multiple))


class Wrapped(nn.Module):
    """A layer taking [B, T, hidden] as its model runs it: `extra(x)` (computed once per shape, untimed, outside
    autograd) is what the model passes besides the hidden states, `call(layer, x, extra)` runs it."""

    def __init__(self, layer, extra, call):
        super().__init__()
        self.layer, self.extra, self.call, self._cache = layer, extra, call, {}

    def forward(self, x):
        if x.shape not in self._cache:
            with torch.no_grad():
                self._cache[x.shape] = self.extra(x)
        return self.call(self.layer, x, self._cache[x.shape])


def build_layer(family: str, hidden: int, target: float, tiny: bool):
    """(the layer wrapped to take [B, T, hidden], description), on the current default device: `hidden` is the size
    to build (already shrunk under --tiny), `target` its parameter count."""
    multiple, shrink = (8, TINY_SHRINK) if tiny else (MLP_MULTIPLE, 1)
    heads = hidden // head_dim(family, hidden * shrink, tiny)
    info = {"hidden": hidden, "heads": heads, "head_dim": hidden // heads, "causal": family == "llama3"}
    if family == "llama3":  # what LlamaModel gives a layer: rotary embeddings of positions 0..T-1, causal sdpa
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        info["kv_heads"] = math.gcd(heads, 8)

        def config(width):
            return LlamaConfig(hidden_size=hidden, intermediate_size=width, num_attention_heads=heads,
                               num_key_value_heads=info["kv_heads"], head_dim=hidden // heads, num_hidden_layers=1,
                               vocab_size=128, max_position_embeddings=8192, rope_theta=500000.0,
                               attn_implementation="sdpa")

        width = solve_width(lambda w: LlamaDecoderLayer(config(w), 0), target, multiple)
        rotary = LlamaRotaryEmbedding(config(width))

        def extra(x):
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
            return dict(attention_mask=None, position_ids=positions, position_embeddings=rotary(x, positions))

        layer = Wrapped(LlamaDecoderLayer(config(width), 0), extra, lambda layer, x, kw: layer(x, **kw))
    elif family == "qwen2_vision":  # the microbatch's images packed with cu_seqlens, axial 2-D rotary embeddings
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionBlock, Qwen2VLVisionRotaryEmbedding

        def config(width):  # the config takes an integer MLP ratio: widths are multiples of the hidden size
            c = Qwen2VLVisionConfig(embed_dim=hidden, num_heads=heads, depth=1, mlp_ratio=width // hidden,
                                    attn_implementation="sdpa")
            c.num_attention_heads = heads  # read by the rotary embedding
            return c

        width = solve_width(lambda w: Qwen2VLVisionBlock(config(w)), target, hidden)
        rotary = Qwen2VLVisionRotaryEmbedding(config(width))

        def extra(x):
            b, t, _ = x.shape
            side, index = max(1, round(math.sqrt(t))), torch.arange(t, device=x.device)
            positions = torch.stack([index // side, index % side], dim=-1).repeat(b, 1)  # [B*T, (h, w)]
            cos, sin = rotary(x, positions)
            return dict(cu_seqlens=torch.arange(b + 1, device=x.device, dtype=torch.int32) * t,
                        position_embeddings=(cos.to(x.dtype), sin.to(x.dtype)))

        def call(layer, x, kw):
            return layer(x.flatten(0, 1), **kw).reshape(x.shape)

        layer = Wrapped(Qwen2VLVisionBlock(config(width)), extra, call)
    elif phi4_audio_available():  # chunks of AUDIO_CHUNK frames, the relative-position bias as attention mask
        from transformers.models.phi4_multimodal.configuration_phi4_multimodal import Phi4MultimodalAudioConfig
        from transformers.models.phi4_multimodal.modeling_phi4_multimodal import (
            Phi4MultimodalAudioConformerEncoderLayer as Conformer, Phi4MultimodalAudioRelativeAttentionBias as Bias)

        def config(width):
            return Phi4MultimodalAudioConfig(hidden_size=hidden, intermediate_size=width, num_attention_heads=heads,
                                             ext_pw_out_channel=hidden, depthwise_separable_out_channel=hidden,
                                             num_blocks=1, attn_implementation="sdpa")

        width = solve_width(lambda w: Conformer(config(w)), target, multiple)
        bias = Bias(config(width))  # the model's one table, shared by every layer: not this layer's parameters
        info["attention_chunk"] = shrunk(AUDIO_CHUNK, shrink)

        def extra(x):
            chunk = min(info["attention_chunk"], x.shape[1])
            return chunk, bias(x.new_empty(1, chunk, 1)).to(x.dtype)

        def call(layer, x, extra):
            (b, t, h), (chunk, mask) = x.shape, extra
            y = nn.functional.pad(x, (0, 0, 0, (-t) % chunk)) if t % chunk else x
            return layer(y.reshape(-1, chunk, h), mask).reshape(b, -1, h)[:, :t]

        layer = Wrapped(Conformer(config(width)), extra, call)
    else:  # transformers without the Phi-4 multimodal model: a plain non-causal layer

        def plain(width):
            return nn.TransformerEncoderLayer(hidden, heads, width, dropout=0.0, activation="gelu",
                                              batch_first=True, norm_first=True)

        width = solve_width(plain, target, multiple)
        layer = plain(width)
    name = type(layer.layer).__name__ if isinstance(layer, Wrapped) else "torch.nn.TransformerEncoderLayer"
    return layer, {"class": name, **info, "intermediate": width}


def measure(layer: nn.Module, tokens: int, hidden: int, device: torch.device, dtype: torch.dtype,
            warmup: int, repeats: int) -> dict:
    """Times and activation bytes (weights frozen and trainable) of `layer` on [samples, tokens, hidden]."""
    shape = (fa.SAMPLES_PER_MICROBATCH, tokens, hidden)
    make_x = lambda: torch.randn(shape, device=device, dtype=dtype)  # noqa: E731
    out = dict(zip(("forward_s", "input_grad_s", "weight_grad_s"), profile_layer(layer, make_x, warmup, repeats)))
    params = list(layer.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    saved = [p.requires_grad for p in params]
    try:
        for name, flag in (("frozen", False), ("trainable", True)):
            for p in params:
                p.requires_grad_(flag)
            out[f"activation_bytes_{name}"] = part_activation_bytes(layer, make_x(), exclude, input_grad=True)
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)
    return {"measured_tokens": tokens, **out, "input_bytes": float(math.prod(shape) * torch.finfo(dtype).bits // 8)}


def main(argv=None) -> int:
    args = harness.cli(
        __doc__, argv, device=dict(choices=("cuda", "cpu"), default="cuda"),
        tiny=(False, f"every hidden size and token count / {TINY_SHRINK}: seconds on a CPU, for tests"),
        out=dict(type=Path, help="JSON path (default benchmarks/results/layer_profile_<device>[_tiny].json)"),
        warmup=3, repeats=10)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("layer_profile: no CUDA device here; nothing measured (use --device cpu to time on the CPU)")
        return 0
    import transformers

    device, dtype, started, start = torch.device(args.device), torch.bfloat16, time.perf_counter(), harness.record()
    cpu = platform.processor() or platform.machine()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cpu})"
    shrink = TINY_SHRINK if args.tiny else 1
    print(f"profiling one layer per family and size on {name}{' (tiny)' if args.tiny else ''}")
    torch.manual_seed(0)
    layers, hidden_of = {}, {}
    for family, table in fa.FAMILY_TABLES.items():
        for size, (count, hidden, params) in table.items():
            hidden_of[family, size] = hidden = shrunk(hidden, shrink)
            target, begun = params / count / shrink**2, time.perf_counter()
            with torch.device(device):
                layer, info = build_layer(family, hidden, target, args.tiny)
            layer = layer.to(dtype).eval()  # eval: no dropout; gradients still flow
            info.update(params_per_layer=sum(p.numel() for p in layer.parameters()), target_params_per_layer=target)
            info["tokens"] = {str(t): measure(layer, shrunk(t, shrink), hidden, device, dtype, args.warmup,
                                              args.repeats) for t in module_token_counts()[family]}
            info["seconds_to_profile"] = time.perf_counter() - begun
            layers.setdefault(family, {})[size] = info
            print(f"  {family} {size}: {info['class']}, {info['params_per_layer'] / 1e6:.2f}M parameters "
                  f"({info['seconds_to_profile']:.1f} s)")
            del layer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    projectors = {}
    for modality, family in fa.ENCODERS.items():
        _, tokens, merge = fa.ENCODER_TOKENS[modality]
        for enc_size, llm_size in itertools.product(fa.FAMILY_TABLES[family], fa.LLAMA3):
            in_features, llm_hidden = merge * hidden_of[family, enc_size], hidden_of["llama3", llm_size]
            with torch.device(device):  # the benchmark's trainable projector
                proj = nn.Sequential(nn.Linear(in_features, llm_hidden, bias=False), nn.GELU(),
                                     nn.Linear(llm_hidden, llm_hidden, bias=False)).to(dtype)
            entry = measure(proj, shrunk(tokens, shrink), in_features, device, dtype, args.warmup, args.repeats)
            entry.update(in_features=in_features, llm_hidden=llm_hidden, tokens=tokens,
                         params=sum(p.numel() for p in proj.parameters()))
            projectors.setdefault(modality, {})[f"{enc_size}->{llm_size}"] = entry
        print(f"  {modality} projectors: {len(projectors[modality])} pairs")
    doc = {
        "format": FORMAT, "version": VERSION, "device": name, "device_type": device.type,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None, "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": "sdpa", "tiny": args.tiny, "shrink": shrink,
        "samples_per_microbatch": fa.SAMPLES_PER_MICROBATCH, "warmup": args.warmup, "repeats": args.repeats,
        "audio_layer": layers["phi4_audio"]["S"]["class"],
        "note": ("one layer per family and size at the benchmark's shapes, random weights; times are medians of "
                 "`profile_layer` (forward, gradient w.r.t. the input only, w.r.t. the weights only) on one device, "
                 "per microbatch of samples_per_microbatch samples; token keys are the benchmark's token counts "
                 "(measured_tokens: what ran, smaller under tiny)"),
        "layers": layers, "projectors": projectors, "seconds": time.perf_counter() - started}
    tiny = "_tiny" if args.tiny else ""
    harness.write(args.out or harness.RESULTS / f"layer_profile_{harness.slug(name)}{tiny}.json", doc, start)
    harness.print_rows([dict(family=f, size=s, layer=i["class"], params=i["params_per_layer"] / 1e6, tokens=int(t),
                             fwd_ms=1e3 * x["forward_s"], in_grad_ms=1e3 * x["input_grad_s"],
                             w_grad_ms=1e3 * x["weight_grad_s"], act_mib_frozen=x["activation_bytes_frozen"] / 2**20)
                        for f, sizes in layers.items() for s, i in sizes.items() for t, x in i["tokens"].items()],
                       ["family", "size", "layer", "params", "tokens", "fwd_ms", "in_grad_ms", "w_grad_ms",
                        "act_mib_frozen"], f"layer profile on {name} (params in millions per layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
