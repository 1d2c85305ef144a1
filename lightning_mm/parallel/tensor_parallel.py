"""Tensor parallelism: each module's layers split over its stage's "tp" mesh dim with DTensor.

The LLM follows the plan transformers ships in its config (``base_model_tp_plan``: q/k/v and gate/up column-wise,
o/down row-wise), plus a vocab-parallel embedding and a vocab-parallel head whose loss runs under DTensor's
``loss_parallel`` (the full logits are never gathered). Encoders follow the declarative per-layer plan of their
family adapter (``EncoderFamily.tensor_parallel_plan``). Hidden states between layers (and between pipeline
stages) stay whole on every tp rank, so the pipeline, CP attention (local heads) and the runtime see plain tensors.
A map of the plan wrapped by a peft LoRA layer is split with its adapter (``_styles``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_mm.plan.stages import StagePlan

# HF plan names -> DTensor styles; "replicated_with_grad_allreduce" keeps the module whole and sums its
# gradients over tp (its inputs are per-head, so each tp rank sees a part of them).
STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
# a fused q/k/v projection (Qwen-VL towers' ``attn.qkv``, rows [q | k | v], each head-major) kept whole on every tp
# rank, its output cut to this rank's heads of q, k and v; its input gradient and parameter gradients summed over tp
FUSED_QKV_HEADS = "fused_qkv_heads"
LAYERS = "layers.*."
EXPERTS = LAYERS + "mlp.experts"


def language_model_layer_plan(lm: nn.Module) -> dict[str, str]:
    """The per-layer part of the LLM's HF plan (``layers.*.X`` -> ``X``), or a clear error without one."""
    plan = dict(getattr(lm.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(lm).__name__} ships no tensor-parallel plan (config.base_model_tp_plan is empty); "
                         "use language_model=ParallelSpec(tp=1)")
    # routed experts stay whole on every tp rank (a mixture-of-experts LLM: lightning_mm.model.moe)
    layer = {k[len(LAYERS):]: v for k, v in plan.items() if k.startswith(LAYERS) and not k.startswith(EXPERTS)}
    unknown = sorted({v for v in layer.values() if v not in STYLES and v != GRAD_ALLREDUCE})
    if unknown:
        raise ValueError(f"{type(lm).__name__}'s tensor-parallel plan uses {unknown}, which lightning-mm does not "
                         f"apply (supported: {sorted(STYLES) + [GRAD_ALLREDUCE]}); use language_model="
                         "ParallelSpec(tp=1)")
    return layer


def _divides(tp: int, what: dict[str, int], module: str) -> None:
    for name, value in what.items():
        if value is not None and value % tp:
            raise ValueError(f"{module}: tp={tp} does not divide {name}={value}; choose a tp that divides it")


def check_tensor_parallel(model, encoder_tp: dict[str, int], language_model_tp: int) -> None:
    """Every tp > 1 has a plan and divides what it splits (heads, kv heads, vocabulary, MLP width). Pure: runs
    before any process group exists."""
    if language_model_tp > 1:
        lm, cfg = model.language_model, model.language_model.config
        language_model_layer_plan(lm)
        _divides(language_model_tp, {"num_attention_heads": cfg.num_attention_heads,
                                     "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
                                     "vocab_size": model.lm_family.vocab_size(lm),
                                     "intermediate_size": getattr(cfg, "intermediate_size", None)}, "language_model")
    for name, tp in encoder_tp.items():
        if tp == 1:
            continue
        enc = model.encoders[name]
        if not enc.family.tensor_parallel_plan(enc.module):
            raise ValueError(f"encoder {name!r} ({type(enc.module).__name__}) has no tensor-parallel plan; use "
                             f"encoders={{{name!r}: ParallelSpec(tp=1)}} (families with one: CLIP, SigLIP, Dinov2 "
                             "without SwiGLU, InternViT without qk norms, Whisper, Qwen2-Audio, the Qwen-VL towers)")
        cfg = enc.module.config
        _divides(tp, {"num_attention_heads": getattr(cfg, "num_attention_heads", None)
                      or getattr(cfg, "encoder_attention_heads", None) or getattr(cfg, "num_heads", None),
                      "intermediate_size": getattr(cfg, "intermediate_size", None)
                      or getattr(cfg, "encoder_ffn_dim", None)}, f"encoder {name!r}")


def _styles(layer: nn.Module, path: str, style: str) -> dict[str, object]:
    """The DTensor styles of a linear map of the plan, or of the peft LoRA layer wrapping it: the base layer takes
    the plan's style; under a column-wise map lora_B splits its output the same way and lora_A stays whole (lora_B,
    like the base layer, sums its input gradient over tp, so lora_A's gradients are whole); under a row-wise map
    lora_A splits its input the same way and lora_B stays whole (its input and output are whole on every rank)."""
    module = layer.get_submodule(path)
    if not hasattr(module, "base_layer") or style not in STYLES:
        return {path: STYLES[style]()} if style in STYLES else {}
    if any(not isinstance(d, nn.Identity) for d in module.lora_dropout.values()):
        raise ValueError(f"LoRA dropout on {path!r} under tensor parallelism would drop different inputs on each tp "
                         "rank; add_lora(dropout=0.0), or use tp=1")
    styles = {f"{path}.base_layer": STYLES[style]()}
    split = "lora_B" if style.startswith("colwise") else "lora_A"
    for adapter in getattr(module, split):
        styles[f"{path}.{split}.{adapter}"] = STYLES[style]()
    return styles


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tp group (the input of a map whose output each tp rank
    keeps a part of)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _keep_heads_of_fused_qkv(module: nn.Module, mesh) -> None:
    """``FUSED_QKV_HEADS``: ``module`` (a linear map to ``[.., 3 * heads * head_dim]``) stays whole; its output keeps
    heads ``r * heads / tp ..`` of each of q, k and v on tp rank ``r``, laid out as the attention reshapes it with
    ``heads / tp`` heads. Whole weights keep checkpoints and exports as they are (DCP cannot save the interleaved
    shard a column split of the fused rows would be); the q/k/v matmul is repeated on every tp rank."""
    tp, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    module.register_forward_pre_hook(lambda m, args: (_SumGradOverTP.apply(args[0], group), *args[1:]))

    def keep(m, args, out):
        parts = out.unflatten(-1, (3, tp, out.shape[-1] // (3 * tp)))
        return parts[..., rank, :].flatten(-2)
    module.register_forward_hook(keep)


def _parallelize_layer(layer: nn.Module, mesh, plan: dict[str, str], head_attrs: tuple[str, ...],
                       allreduce: list[nn.Parameter]) -> None:
    styles = {k: v for path, style in plan.items() for k, v in _styles(layer, path, style).items()}
    parallelize_module(layer, mesh, styles)
    for k, v in plan.items():
        if v in (GRAD_ALLREDUCE, FUSED_QKV_HEADS):
            allreduce += list(layer.get_submodule(k).parameters())
        if v == FUSED_QKV_HEADS:
            _keep_heads_of_fused_qkv(layer.get_submodule(k), mesh)
    for path in head_attrs:  # attention modules that reshape by a stored head count hold tp-th of the heads
        owner, attr = path.rsplit(".", 1)
        module = layer.get_submodule(owner)
        setattr(module, attr, getattr(module, attr) // mesh.size())


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def apply_tp(model, plan: StagePlan, meshes: dict[str, object]) -> list[nn.Parameter]:
    """Split this stage's layers over tp: ``meshes[module]`` is the tp mesh of each module run with tp > 1 here
    ("language_model" or an encoder name). Returns the parameters whose gradients must be summed over tp."""
    allreduce: list[nn.Parameter] = []
    lm_mesh = meshes.get("language_model")
    if plan.language_model is not None and lm_mesh is not None:
        sl, lm, fam = plan.language_model, model.language_model, model.lm_family
        layer_plan = language_model_layer_plan(lm)
        for i in range(sl.start, sl.end):
            layer = fam.layers(lm)[i]  # a mixture-of-experts layer has no dense-MLP modules of the plan
            _parallelize_layer(layer, lm_mesh, {k: v for k, v in layer_plan.items() if _has(layer, k)}, (),
                               allreduce)
        embed = fam.embed_tokens(lm)
        tied = isinstance(lm.lm_head, nn.Linear) and lm.lm_head.weight is getattr(embed, "weight", None)
        if sl.embed or (tied and sl.head):  # vocab-parallel: each rank looks up its rows, partial sums reduced
            parallelize_module(embed, lm_mesh, RowwiseParallel(input_layouts=Replicate()))
        if sl.head:  # vocab-parallel logits, consumed by loss_parallel
            parallelize_module(lm.lm_head, lm_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
            if tied:
                lm.lm_head.weight = embed.weight  # both Shard(0) over the same mesh: keep them one parameter
    for name, sl in plan.encoders.items():
        mesh = meshes.get(name)
        if mesh is None:
            continue
        enc = model.encoders[name]
        for i in range(sl.start, sl.end):
            _parallelize_layer(enc.layers[i], mesh, enc.family.tensor_parallel_plan(enc.module),
                               enc.family.tp_head_attrs, allreduce)
    return allreduce


def keep_grads_like_parameters(params) -> None:
    """Hook every trainable DTensor parameter so its gradient takes its layout."""
    for p in params:
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(_grad_like_parameter)


@contextmanager
def dtensor_parameters_pinned(module: nn.Module, fsdp_params: set[int] = frozenset()):
    """Inside, ``module.to()`` / ``.cpu()`` leave DTensor parameters outside FSDP where they are (materialise and
    DTensor placed them on the stage's device): moving one swaps its contents with a new tensor's, after which
    its gradient hooks never fire again. FSDP's own ``_apply`` re-registers the parameters it manages. Tensors
    still on the meta device (a setup that failed before materialising) stay too: they cannot be moved."""
    hidden = []
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None and (t.is_meta or isinstance(t, DTensor) and id(t) not in fsdp_params):
                    hidden.append((table, name, t))
                    del table[name]
    try:
        yield
    finally:
        for table, name, t in hidden:
            table[name] = t


def _grad_like_parameter(p) -> None:
    """Keep a gradient laid out as its parameter: DTensor's vocab-parallel embedding backward yields a replicated
    (whole-vocabulary) gradient; taking this rank's shard right away frees the rest (no communication)."""
    if p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local(t):
    """The local tensor of a DTensor (its own, as ``to_local`` gives it without grad mode: in-place changes reach
    the DTensor, no autograd node is recorded), else ``t``."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def shards(t) -> int:
    """How many distinct pieces a tensor is split into across its mesh (1 for plain and replicated tensors)."""
    if not isinstance(t, DTensor):
        return 1
    n = 1
    for dim, placement in enumerate(t.placements):
        if placement.is_shard():
            n *= t.device_mesh.size(dim)
    return n
