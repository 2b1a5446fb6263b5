"""How tokens leave the target's logits: one token (`choose`: temperature / top-k / top-p, shared
by plain and speculative decoding, so both sample alike), and a draft tree's accepted path (`accept`).

The sampling rules, tie-invariant and never empty (the most likely token is always kept):
- temperature T: logits / T (in float64, so that any finite T > 0 is exact enough: no overflow to
  inf, no inf / inf); T below `GREEDY_BELOW` is greedy;
- top-k: keep the tokens whose logit is at least the k-th largest (ties at the k-th all stay);
- top-p: keep token i when the mass of the tokens strictly more likely than i is below top_p
  ("the smallest set of the most likely tokens with mass >= top_p", ties at its edge all stay);
  a top_p so small that nothing qualifies keeps the most likely tokens alone.

Acceptance (definitions used everywhere in treeflash):
- accepted tokens: the draft nodes on the path from the root whose token equals the target's
  choice at their parent (argmax when greedy, a sample otherwise);
- bonus token: the target's choice at the last accepted node (or the root), always emitted;
- acceptance length tau = accepted + 1.
One target token is drawn per visited node from the target's own (processed) distribution and the
walk follows the child holding it. The tree does not depend on those draws, so every emitted token
is an exact sample of the target: lossless for any fixed tree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

# GREEDY_BELOW is re-exported (serve/schemas.py imports it from here)
from ..config import GREEDY_BELOW, SamplingParams  # noqa: F401
from ..errors import TreeflashError

if TYPE_CHECKING:
    from .trees import Tree


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


@dataclass
class Acceptance:
    path: list[int]         # node indices from the root (node 0) to the last accepted node
    accepted: list[int]     # accepted draft tokens (tokens of path[1:])
    bonus: int              # the target's token after the last accepted node


def accept(tree: Tree, logits: torch.Tensor, params: SamplingParams,
           gen: torch.Generator | None = None) -> Acceptance:
    """tree with N nodes; logits [N, V] of the target at each node (a tensor, or `LazyLogits`:
    only the rows of the visited nodes are read)."""
    children = tree.children()
    toks = tree.tokens.tolist()
    path, node = [0], 0
    while True:
        choice = choose(logits[node], params, gen)
        child = children.get((node, choice))
        if child is None:
            return Acceptance(path, [toks[i] for i in path[1:]], choice)
        path.append(child)
        node = child
