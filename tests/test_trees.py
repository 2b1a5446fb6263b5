"""Tree builders against brute-force enumeration on small random tables."""
import itertools
import random

import pytest
import torch

from treeflash.decoding.trees import TransitionTables, chain_tree, marginal_tree, treeflash_tree


def paths_of(tree):
    """Node i -> its token path from the root (root excluded)."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = [()]
    for i in range(1, len(toks)):
        out.append(out[pars[i]] + (toks[i],))
    return out


def top_paths(scored: dict, n: int) -> set:
    return set(sorted(scored, key=lambda p: -scored[p])[:n])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 2, 4, 9, 20])
def test_marginal_tree_is_the_best_paths(seed, budget):
    g = torch.Generator().manual_seed(seed)
    D, V = 3, 5
    logp = torch.randn(D, V, generator=g).log_softmax(-1)
    tree = marginal_tree(7, logp, budget)
    scored = {}
    for d in range(1, D + 1):
        for path in itertools.product(range(V), repeat=d):
            scored[path] = sum(float(logp[i, t]) for i, t in enumerate(path))
    got = paths_of(tree)
    assert len(tree) == min(budget, 1 + len(scored))
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    assert set(got[1:]) == top_paths(scored, budget - 1)
    # best-first: nodes come in non-increasing score order; parents precede children
    scores = [scored[p] for p in got[1:]]
    assert all(a >= b - 1e-6 for a, b in zip(scores, scores[1:]))
    assert all(p < i for i, p in enumerate(tree.parents.tolist()) if i)
    assert tree.depths.tolist() == [len(p) for p in got]


def random_tables(seed, D=3, V=6, m=2, k=3):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.randperm(V, generator=g)[:m] for _ in range(D)])  # [D, m]
    first = torch.randn(V, generator=g).log_softmax(-1).topk(k)
    nxt = torch.randn(D - 1, m, V, generator=g).log_softmax(-1).topk(k, -1)
    return TransitionTables(cand, first.indices, first.values, nxt.indices, nxt.values)


def brute_force_treeflash(t: TransitionTables):
    """Every path the tables allow, with its score."""
    D = t.candidates.shape[0]
    scored = {}
    frontier = [((tok,), float(lp)) for tok, lp in zip(t.first_tok.tolist(), t.first_logp.tolist())]
    while frontier:
        path, score = frontier.pop()
        scored[path] = score
        d, tok = len(path), path[-1]
        row = t.candidates[d - 1].tolist() if d < D else []
        if tok in row:  # only candidates have a transition row; others are leaves
            j = row.index(tok)
            for c, lp in zip(t.next_tok[d - 1, j].tolist(), t.next_logp[d - 1, j].tolist()):
                frontier.append((path + (c,), score + lp))
    return scored


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [1, 3, 6, 12, 40])
def test_treeflash_tree_is_the_best_allowed_paths(seed, budget):
    t = random_tables(seed)
    tree = treeflash_tree(5, t, budget)
    scored = brute_force_treeflash(t)
    got = paths_of(tree)
    assert len(tree) == min(budget, 1 + len(scored))
    assert set(got[1:]) == top_paths(scored, budget - 1)
    scores = [scored[p] for p in got[1:]]
    assert all(a >= b - 1e-6 for a, b in zip(scores, scores[1:]))


def test_treeflash_leaf_rule():
    """A node whose token is not among its position's candidates gets no children."""
    for seed in range(20):
        t = random_tables(seed, D=4, V=8, m=2, k=4)
        tree = treeflash_tree(0, t, 64)
        got = paths_of(tree)
        parents = set(tree.parents.tolist()[1:])
        for i, path in enumerate(got[1:], 1):
            d = len(path)
            if path[-1] not in t.candidates[d - 1].tolist() or d == 4:
                assert i not in parents


def test_chain_tree():
    logp = torch.randn(6, 10).log_softmax(-1)
    tree = chain_tree(3, logp, 4)
    assert tree.tokens.tolist() == [3] + logp[:3].argmax(-1).tolist()
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert len(chain_tree(3, logp, 100)) == 7


def test_ancestor_mask_against_parent_walk():
    rng = random.Random(0)
    for _ in range(20):
        logp = torch.randn(4, 5).log_softmax(-1)
        tree = marginal_tree(1, logp, rng.randint(1, 30))
        mask = tree.ancestor_mask()
        pars = tree.parents.tolist()
        for i in range(len(tree)):
            anc, j = {i}, i
            while pars[j] >= 0:
                j = pars[j]
                anc.add(j)
            assert set(torch.nonzero(mask[i]).flatten().tolist()) == anc
