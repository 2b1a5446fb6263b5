"""Draft trees: pure builders over the drafter's per-position tables.

A tree is a flat list of nodes in topological order (parent before child). Node 0 is the root:
the last committed token, which the target has not processed yet. A node at depth d holds a
guess for the token d steps after the root (drafter block position d).

Budget = number of nodes verified in one target forward, root included; the same for every
method, so methods compare at equal verification cost.

Builders:
- chain     : argmax per position (DFlash), depth = budget - 1.
- marginal  : best-first over per-position marginals (DDTree); the tree holds the `budget - 1`
              highest-probability paths' nodes, score = sum of marginal log-probs.
- treeflash : best-first over transition tables: the children of a node are the top-k of the
              corrected distribution given that node's token. Only the top-m marginal candidates
              of a position have a table row, so a node whose token is not among its position's
              candidates is a leaf.
- +lookup   : any of them (or none) with the branches of a lookup trie (decoding/lookup.py) merged
              into the same best-first walk, under the same budget.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .lookup import Branches, LookupScores, TrieNode


@dataclass
class Tree:
    tokens: torch.Tensor   # [N] long, node 0 = root
    parents: torch.Tensor  # [N] long, parent node index, -1 for the root
    depths: torch.Tensor   # [N] long, root depth 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] = j is i or an ancestor of i."""
        n = len(self)
        rows: list[list[bool]] = []  # built as lists: a torch op per node cost more than the step's tree
        for i, p in enumerate(self.parents.tolist()):
            row = rows[p].copy() if p >= 0 else [False] * n  # a parent precedes its children
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool).view(n, n)

    def children(self) -> dict[tuple[int, int], int]:
        """(parent node, token) -> child node."""
        toks, pars = self.tokens.tolist(), self.parents.tolist()
        return {(pars[i], toks[i]): i for i in range(1, len(toks))}


# Transition lookup: (depth of a node, its token) -> (child tokens [K], child log-probs [K]) sorted
# by descending log-prob, or None when the node is a leaf.
Transitions = Callable[[int, int], "tuple[list[int], list[float]] | None"]


def combine(a: float, b: float) -> float:
    """log p of 'either source is right' for two independent guesses of one token (noisy-or)."""
    return math.log1p(-(-math.expm1(a)) * (-math.expm1(b))) if max(a, b) < 0 else 0.0


def with_lookup(row, trie: TrieNode | None, depth: int, lookup: Branches, scores: LookupScores):
    """A drafter row (tokens, log-probs) or None, merged with the lookup trie node's children.

    Returns (tokens, log-probs, child trie nodes or None) sorted by descending log-prob; a token
    both sources propose is one child (scores combined)."""
    if trie is None or not trie.children:
        return None if row is None else (row[0], row[1], None)
    merged: dict[int, list] = {}  # token -> [log-prob, trie child]
    for tok, child in trie.children.items():
        merged[tok] = [scores.edge(lookup.match_len, trie, child, depth + 1), child]
    if row is not None:
        for tok, lp in zip(*row):
            if tok in merged:
                merged[tok][0] = combine(merged[tok][0], lp)
            else:
                merged[tok] = [lp, None]
    order = sorted(merged.items(), key=lambda kv: -kv[1][0])
    return [t for t, _ in order], [v[0] for _, v in order], [v[1] for _, v in order]


def best_first(root_token: int, budget: int, transitions: Transitions | None,
               lookup: Branches | None = None, scores: LookupScores | None = None) -> Tree:
    """Grow the tree with the `budget` best nodes by path score (root included).

    Path scores only decrease along a child or a next-sibling, so popping a heap seeded with the
    root and pushing (first child, next sibling) of each popped node yields nodes in score order.
    `lookup` adds the branches of a lookup trie (scored by `scores`) to the drafter's children;
    a lookup branch may run deeper than the drafter's tables.
    """
    tokens, parents, depths = [root_token], [-1], [0]
    heap: list[tuple[float, int, int, int]] = []  # (-score, parent node, rank, depth)
    rows: dict[int, tuple] = {}  # node -> (child tokens, log-probs, child trie nodes or None)
    path_score = [0.0]
    tries: list[TrieNode | None] = [lookup.root if lookup is not None and lookup.match_len else None]

    def push_child(node: int, rank: int) -> None:
        row = rows.get(node)
        if row is not None and rank < len(row[0]):
            heapq.heappush(heap, (-(path_score[node] + row[1][rank]), node, rank, depths[node] + 1))

    def open_node(node: int) -> None:
        row = transitions(depths[node], tokens[node]) if transitions is not None else None
        if tries[node] is not None:
            row = with_lookup(row, tries[node], depths[node], lookup, scores)
        elif row is not None:
            row = (row[0], row[1], None)
        if row is not None and row[0]:
            rows[node] = row
            push_child(node, 0)

    open_node(0)
    while heap and len(tokens) < budget:
        neg, parent, rank, depth = heapq.heappop(heap)
        toks, _, kids = rows[parent]
        tokens.append(toks[rank])
        parents.append(parent)
        depths.append(depth)
        path_score.append(-neg)
        tries.append(kids[rank] if kids is not None else None)
        push_child(parent, rank + 1)  # next sibling
        open_node(len(tokens) - 1)    # first child
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def chain_tree(root_token: int, marginal_logp: torch.Tensor, budget: int) -> Tree:
    """marginal_logp [D, V] -> a chain of the argmax tokens, min(D, budget - 1) long."""
    n = min(marginal_logp.shape[0], budget - 1)
    toks = marginal_logp[:n].argmax(-1).tolist()
    return Tree(torch.tensor([root_token] + toks), torch.arange(-1, n), torch.arange(0, n + 1))


def chain_transitions(marginal_logp: torch.Tensor) -> Transitions:
    """marginal_logp [D, V]: one child per depth, the argmax (best-first over it is `chain_tree`)."""
    vals, idx = marginal_logp.float().max(-1)  # [D], [D]
    table = [([t], [v]) for t, v in zip(idx.tolist(), vals.tolist())]
    return lambda depth, _tok: table[depth] if depth < len(table) else None


def marginal_transitions(marginal_logp: torch.Tensor, budget: int) -> Transitions:
    """marginal_logp [D, V]: the children of any node at depth d are the top tokens of position d+1."""
    D = marginal_logp.shape[0]
    k = max(1, min(budget - 1, marginal_logp.shape[1]))
    vals, idx = marginal_logp.float().topk(k, -1)  # [D, k]
    table = [(idx[d].tolist(), vals[d].tolist()) for d in range(D)]
    return lambda depth, _tok: table[depth] if depth < D else None


def marginal_tree(root_token: int, marginal_logp: torch.Tensor, budget: int) -> Tree:
    """marginal_logp [D, V]: best-first over per-position marginals (DDTree)."""
    return best_first(root_token, budget, marginal_transitions(marginal_logp, budget))


@dataclass
class TransitionTables:
    """TreeFlash tables for one block (D = B - 1 draft positions).

    candidates [D, m]: top-m marginal tokens at depths 1..D (row d-1 for depth d).
    first      : (tokens [k], logp [k]) corrected distribution at depth 1 given the root token.
    next_tok   [D-1, m, k], next_logp [D-1, m, k]: top-k at depth d+1 given that the depth-d token
                 is candidates[d-1, j] (row [d-1, j]).
    """

    candidates: torch.Tensor
    first_tok: torch.Tensor
    first_logp: torch.Tensor
    next_tok: torch.Tensor
    next_logp: torch.Tensor


def treeflash_transitions(t: TransitionTables) -> Transitions:
    D = t.candidates.shape[0]
    cand = [dict((tok, j) for j, tok in reversed(list(enumerate(row)))) for row in t.candidates.tolist()]
    first = (t.first_tok.tolist(), t.first_logp.float().tolist())
    nt, nl = t.next_tok.tolist(), t.next_logp.float().tolist()

    def transitions(depth: int, token: int):
        if depth == 0:
            return first
        if depth >= D:
            return None
        j = cand[depth - 1].get(token)
        return None if j is None else (nt[depth - 1][j], nl[depth - 1][j])

    return transitions


def treeflash_tree(root_token: int, t: TransitionTables, budget: int) -> Tree:
    return best_first(root_token, budget, treeflash_transitions(t))
