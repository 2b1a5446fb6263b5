"""Temperature / top-k / top-p, shared by plain and speculative decoding (so both sample alike)."""
from __future__ import annotations

import torch

# GREEDY_BELOW is re-exported (serve/schemas.py imports it from here)
from ..config import GREEDY_BELOW, SamplingParams  # noqa: F401


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the sampling distribution [..., V] (float32)."""
    x = logits.float() / p.temperature
    if p.top_k:
        kth = x.topk(p.top_k, -1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        srt, idx = x.sort(-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) >= p.top_p  # keep the smallest prefix with mass >= top_p
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return x.softmax(-1)


def choose(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from logits [V]: argmax when greedy, else a sample."""
    if p.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits.cpu(), p), 1, generator=gen))  # host RNG: seeds agree
