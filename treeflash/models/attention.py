"""Attention, rotary and projection helpers shared by the target's fast path (`fastpath.FastPath`) and the drafter."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def stacked_attention(q, keys, values, mask=None, scale=None) -> torch.Tensor:
    """Grouped-query attention with the g = Hq/Hkv query heads of each KV head stacked as g*N rows
    of one head (row i*N + n: head h*g + i, row n; the mask repeated per head), which ATen's CPU flash
    attention runs faster than broadcast KV heads for a few rows (docs/performance.md, "Stacked query heads").
    q [1, Hq, N, D], keys/values [1, Hkv, S, D], mask [N, S] bool or None -> [1, Hq, N, D]."""
    hq, n, d = q.shape[1:]
    g = hq // keys.shape[1]
    if mask is not None:
        mask = mask.expand(g, n, mask.shape[-1]).reshape(1, 1, g * n, -1)
    o = F.scaled_dot_product_attention(q.reshape(1, keys.shape[1], g * n, d), keys, values,
                                       attn_mask=mask, scale=scale)  # [1, Hkv, g*N, D]
    return o.reshape(1, hq, n, d)  # CUDA kernels may return a transposed layout


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D]; cos/sin broadcastable to it (rotate-half convention, as Llama/Qwen)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mod(x); a plain nn.Linear with weights of another dtype computes in x's dtype."""
    if type(mod) is nn.Linear and mod.weight.dtype != x.dtype:
        b = None if mod.bias is None else mod.bias.to(x.dtype)
        return F.linear(x, mod.weight.to(x.dtype), b)
    return mod(x)
