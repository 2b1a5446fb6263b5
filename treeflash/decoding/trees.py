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
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import torch


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
        mask = torch.eye(n, dtype=torch.bool)
        parents = self.parents.tolist()
        for i in range(1, n):
            mask[i] |= mask[parents[i]]
        return mask

    def children(self) -> dict[tuple[int, int], int]:
        """(parent node, token) -> child node."""
        toks, pars = self.tokens.tolist(), self.parents.tolist()
        return {(pars[i], toks[i]): i for i in range(1, len(toks))}


# Transition lookup: (depth of a node, its token) -> (child tokens [K], child log-probs [K]) sorted
# by descending log-prob, or None when the node is a leaf.
Transitions = Callable[[int, int], "tuple[list[int], list[float]] | None"]


def best_first(root_token: int, budget: int, transitions: Transitions) -> Tree:
    """Grow the tree with the `budget` best nodes by path score (root included).

    Path scores only decrease along a child or a next-sibling, so popping a heap seeded with the
    root and pushing (first child, next sibling) of each popped node yields nodes in score order.
    """
    tokens, parents, depths = [root_token], [-1], [0]
    heap: list[tuple[float, int, int, int]] = []  # (-score, parent node, rank, depth)
    rows: dict[int, tuple[list[int], list[float]]] = {}
    scores = [0.0]

    def push_child(node: int, rank: int) -> None:
        row = rows.get(node)
        if row is not None and rank < len(row[0]):
            heapq.heappush(heap, (-(scores[node] + row[1][rank]), node, rank, depths[node] + 1))

    def open_node(node: int) -> None:
        row = transitions(depths[node], tokens[node])
        if row is not None:
            rows[node] = row
            push_child(node, 0)

    open_node(0)
    while heap and len(tokens) < budget:
        neg, parent, rank, depth = heapq.heappop(heap)
        tokens.append(rows[parent][0][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        push_child(parent, rank + 1)  # next sibling
        open_node(len(tokens) - 1)    # first child
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def chain_tree(root_token: int, marginal_logp: torch.Tensor, budget: int) -> Tree:
    """marginal_logp [D, V] -> a chain of the argmax tokens, min(D, budget - 1) long."""
    n = min(marginal_logp.shape[0], budget - 1)
    toks = marginal_logp[:n].argmax(-1).tolist()
    return Tree(torch.tensor([root_token] + toks), torch.arange(-1, n), torch.arange(0, n + 1))


def marginal_tree(root_token: int, marginal_logp: torch.Tensor, budget: int) -> Tree:
    """marginal_logp [D, V]: best-first over per-position marginals (DDTree)."""
    D = marginal_logp.shape[0]
    k = min(budget - 1, marginal_logp.shape[1])
    vals, idx = marginal_logp.float().topk(k, -1)  # [D, k]
    table = [(idx[d].tolist(), vals[d].tolist()) for d in range(D)]
    return best_first(root_token, budget, lambda depth, _tok: table[depth] if depth < D else None)


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


def treeflash_tree(root_token: int, t: TransitionTables, budget: int) -> Tree:
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

    return best_first(root_token, budget, transitions)
