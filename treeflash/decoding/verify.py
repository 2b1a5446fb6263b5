"""Acceptance of a draft tree against the target's logits.

Definitions (used everywhere in treeflash):
- accepted tokens: the draft nodes on the path from the root whose token equals the target's
  choice at their parent (argmax when greedy, a sample otherwise);
- bonus token: the target's choice at the last accepted node (or the root), always emitted;
- acceptance length tau = accepted + 1.

Sampling: one target token is drawn per visited node from the target's own (processed)
distribution and the walk follows the child holding it. The tree does not depend on those draws,
so every emitted token is an exact sample of the target: lossless for any fixed tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, choose
from .trees import Tree


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
