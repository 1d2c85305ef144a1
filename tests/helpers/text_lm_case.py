"""A language model inside MultimodalModel against the same HF model run by transformers (one process, fp32)."""

from __future__ import annotations

import copy

import torch

import lightning_mm as lmm


def compare_with_hf(lm, ids, labels, attention_mask=None, implementation="eager"):
    """Logits (at live positions), loss and every parameter's gradient of ``lm`` inside MultimodalModel equal a copy
    of it run by transformers with ``implementation``; a parameter without a gradient has none in both."""
    ref = copy.deepcopy(lm)
    ref.set_attn_implementation(implementation)
    model = lmm.MultimodalModel({}, lm)
    out = model(input_ids=ids, labels=labels, attention_mask=attention_mask)
    expected = ref(input_ids=ids, labels=labels, attention_mask=attention_mask)
    live = (attention_mask if attention_mask is not None else torch.ones_like(ids)).bool()
    torch.testing.assert_close(out.logits[live], expected.logits[live], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=0)
    out.loss.backward()
    expected.loss.backward()
    named = dict(ref.named_parameters())
    for name, p in lm.named_parameters():
        q = named[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    return out


def left_padded(ids: torch.Tensor, mask: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The right-padded rows ``ids`` (live where ``mask``) padded on the left instead, as HF's generate takes them."""
    left_ids, left_mask = torch.full_like(ids, pad), torch.zeros_like(mask)
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        left_ids[r, -n:], left_mask[r, -n:] = ids[r, :n], 1
    return left_ids, left_mask
