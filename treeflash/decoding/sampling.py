"""Temperature / top-k / top-p, shared by plain and speculative decoding (so both sample alike)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import GenerationConfig
from ..errors import TreeflashError


GREEDY_BELOW = 1e-5  # smaller temperatures overflow logits / T: greedy (as in vLLM)


@dataclass(frozen=True)
class SamplingParams:
    """The sampler's share of a `GenerationConfig` (its defaults are that config's)."""

    temperature: float = GenerationConfig.temperature  # 0 = greedy (argmax)
    top_p: float = GenerationConfig.top_p
    top_k: int = GenerationConfig.sampling_top_k        # 0 = off

    def check(self, vocab: int) -> "SamplingParams":
        if not self.temperature >= 0:
            raise TreeflashError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TreeflashError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.top_k > vocab:
            raise TreeflashError(f"sampling top-k must be in [0, {vocab}], got {self.top_k}")
        return self

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW are greedy (as in vLLM): dividing by them overflows."""
        return self.temperature < GREEDY_BELOW


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
