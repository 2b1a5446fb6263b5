"""Temperature / top-k / top-p, shared by plain and speculative decoding (so both sample alike).

The rules, tie-invariant and never empty (the most likely token is always kept):
- temperature T: logits / T (in float64, so that any finite T > 0 is exact enough: no overflow to
  inf, no inf / inf); T below `GREEDY_BELOW` is greedy;
- top-k: keep the tokens whose logit is at least the k-th largest (ties at the k-th all stay);
- top-p: keep token i when the mass of the tokens strictly more likely than i is below top_p
  ("the smallest set of the most likely tokens with mass >= top_p", ties at its edge all stay);
  a top_p so small that nothing qualifies keeps the most likely tokens alone.
"""
from __future__ import annotations

import torch

# GREEDY_BELOW is re-exported (serve/schemas.py imports it from here)
from ..config import GREEDY_BELOW, SamplingParams  # noqa: F401
from ..errors import TreeflashError


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the sampling distribution [..., V] (float32)."""
    x = logits.double() / p.temperature                                   # [..., V]
    if p.top_k:
        kth = x.topk(p.top_k, -1).values[..., -1:]                        # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        srt = x.sort(-1, descending=True).values                          # [..., V]
        pr = srt.softmax(-1)
        before = pr.cumsum(-1) - pr                                       # mass strictly ahead, [..., V]
        n_keep = (before < p.top_p).sum(-1, keepdim=True).clamp(min=1)    # a prefix: `before` only grows
        edge = srt.gather(-1, n_keep - 1)                                 # the least likely kept logit
        x = x.masked_fill(x < edge, float("-inf"))
    out = x.softmax(-1)
    if not bool(torch.isfinite(out).all()):
        raise TreeflashError("the target's logits are not finite: nothing to sample from")
    return out.float()


def choose(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from logits [V]: argmax when greedy, else a sample."""
    if p.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits.cpu(), p), 1, generator=gen))  # host RNG: seeds agree
