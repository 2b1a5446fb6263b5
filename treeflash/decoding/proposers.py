"""Drafting methods behind one interface: `propose(state, root_token, start, max_depth, history) -> Tree`.

Every method runs at most one drafter forward per step; `vanilla` proposes the root alone. A method
`NAME+lookup` adds lookup branches (decoding/lookup.py: continuations copied from the prompt and
the output) to NAME's tree under the same budget; `lookup` alone needs no drafter.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import TreeflashError
from ..models.drafter import DraftCache, Drafter
from .lookup import Branches, LookupIndex, LookupParams, LookupScores
from .trees import (Tree, TransitionTables, best_first, chain_transitions, marginal_transitions,
                    treeflash_transitions)

DRAFTER_METHODS = ("chain", "marginal", "treeflash")
METHODS = ("vanilla", *DRAFTER_METHODS, "lookup", *(f"{m}+lookup" for m in DRAFTER_METHODS))


@dataclass(frozen=True)
class TreeParams:
    budget: int = 16  # nodes verified per step, root included
    top_m: int = 8    # TreeFlash stage-1 candidates per position
    top_k: int = 8    # TreeFlash stage-2 children per candidate
    # TreeFlash stage 2 scores only the position's top-`stage2_vocab` marginal tokens (0 = the whole
    # vocabulary): the LM head over (B-1) x m rows is otherwise the dearest part of a step.
    stage2_vocab: int = 0
    # Propose only from the drafter's draft vocabulary when it has one (its LM head then runs over
    # those rows; measured: see docs/performance.md). False: the whole vocabulary.
    draft_vocab: bool = True

    def check(self, vocab: int) -> "TreeParams":
        if self.budget < 1:
            raise TreeflashError(f"tree size must be >= 1, got {self.budget}")
        for name, v in (("top-m", self.top_m), ("top-k", self.top_k)):
            if not 1 <= v <= vocab:
                raise TreeflashError(f"{name} must be in [1, {vocab}] (the vocabulary size), got {v}")
        if self.stage2_vocab and not self.top_k <= self.stage2_vocab <= vocab:
            raise TreeflashError(f"stage-2 vocabulary must be 0 or in [top-k, {vocab}], got {self.stage2_vocab}")
        return self


def root_only(root_token: int) -> Tree:
    return Tree(torch.tensor([root_token]), torch.tensor([-1]), torch.tensor([0]))


class Proposer:
    """Turns one drafter block pass (and, with lookup, the lookup trie) into a tree: `draft`
    (drafter forward + heads -> tables), `lookup_branches`, then `build` (pure tree construction).
    Timings are kept per phase: "draft" (drafter pass and heads), "tree" (lookup and building)."""

    name = "base"

    def __init__(self, drafter: Drafter | None, embed, lm_head, params: TreeParams,
                 lookup: LookupParams | None = None, scores: LookupScores | None = None):
        self.drafter, self.embed, self.lm_head, self.params = drafter, embed, lm_head, params
        self.index = LookupIndex(lookup) if lookup is not None else None
        self.scores = scores if scores is not None or lookup is None else LookupScores.load()
        self.timings = {"draft": 0.0, "tree": 0.0}

    def propose(self, cache: DraftCache | None, root_token: int, start: int, max_depth: int,
                history: list[int] | None = None) -> Tree:
        """Tree rooted at `root_token` (position `start`), at most `max_depth` deep; `history`: the
        committed tokens, prompt first, ending with the root (read by lookup methods)."""
        if self.params.budget < 2:
            return root_only(root_token)
        t0 = time.perf_counter()
        depth = min(max_depth, self.drafter.block_size - 1) if self.drafter is not None else 0
        tables = None
        if depth >= 1:
            h = self.draft_states(cache, root_token, start, depth)  # [depth+1, H]
            # a tree of `budget` nodes is at most budget-1 deep: the heads need no deeper positions
            # (the block pass keeps its full length, the length the drafter was trained on)
            tables = self.heads(h[: min(depth, self.params.budget - 1) + 1], root_token)
        t1 = time.perf_counter()
        branches = self.lookup_branches(history, max_depth) if self.index is not None else None
        tree = self.build(root_token, tables, branches)
        self.timings["draft"] += t1 - t0
        self.timings["tree"] += time.perf_counter() - t1
        return tree

    def lookup_branches(self, history: list[int], max_depth: int) -> Branches:
        self.index.sync(history)
        return self.index.branches(max_depth)

    def draft_states(self, cache: DraftCache, root_token: int, start: int, depth: int) -> torch.Tensor:
        """One drafter pass over [root, MASK x depth] -> pre-norm states h [depth+1, H]."""
        ids = torch.full((depth + 1,), self.drafter.config.mask_token_id, dtype=torch.long,
                         device=self.embed.weight.device)
        ids[0] = root_token
        return self.drafter.draft(cache, self.embed(ids), start)

    def marginal_sub(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [D+1, H] -> (log-probs [D, Vd] over the draft vocabulary, its ids [Vd]) for depths
        1..D; without a draft vocabulary: ([D, V], None)."""
        x = self.drafter.model.norm(h[1:])  # [D, H]
        rows = self.drafter.draft_head(self.lm_head) if self.params.draft_vocab else None  # [Vd, H]
        if rows is None:
            return self.lm_head(x).float().log_softmax(-1), None
        return (x @ rows.T).float().log_softmax(-1), self.drafter.draft_vocab.to(x.device)

    def marginal_logp(self, h: torch.Tensor) -> torch.Tensor:
        """h [D+1, H] -> log-probs [D, V] for depths 1..D (-inf outside the draft vocabulary)."""
        sub, ids = self.marginal_sub(h)
        if ids is None:
            return sub
        full = sub.new_full((sub.shape[0], self.lm_head.weight.shape[0]), float("-inf"))  # [D, V]
        full[:, ids] = sub
        return full

    def heads(self, h: torch.Tensor, root_token: int):
        return self.marginal_logp(h).cpu()

    def transitions(self, tables):
        return None

    def build(self, root_token: int, tables, branches: Branches | None = None) -> Tree:
        trans = self.transitions(tables) if tables is not None else None
        if trans is None and (branches is None or not branches.match_len):
            return root_only(root_token)
        return best_first(root_token, self.params.budget, trans, branches, self.scores)


class Vanilla(Proposer):
    name = "vanilla"

    def __init__(self, drafter, embed, lm_head, params, lookup=None, scores=None):
        super().__init__(None, embed, lm_head, params)


class Lookup(Proposer):
    """Lookup branches alone: no drafter."""

    name = "lookup"

    def __init__(self, drafter, embed, lm_head, params, lookup=None, scores=None):
        super().__init__(None, embed, lm_head, params, lookup or LookupParams(), scores)


class Chain(Proposer):
    name = "chain"

    def transitions(self, logp):
        return chain_transitions(logp)


class Marginal(Proposer):
    name = "marginal"

    def transitions(self, logp):
        return marginal_transitions(logp, self.params.budget)


class TreeFlash(Proposer):
    name = "treeflash"

    def heads(self, h: torch.Tensor, root_token: int) -> TransitionTables:
        """Stage 1: top-m marginal candidates; stage 2: corrected top-k per candidate previous token."""
        D = h.shape[0] - 1
        m, k = self.params.top_m, self.params.top_k
        marginal, ids = self.marginal_sub(h)  # [D, Vd], [Vd] (or [D, V], None)
        if marginal.shape[1] < m:
            raise TreeflashError(f"top-m {m} exceeds the drafter's draft vocabulary ({marginal.shape[1]} tokens)")
        n_cols = min(max(self.params.stage2_vocab, m), marginal.shape[1]) if self.params.stage2_vocab else 0
        top_col = marginal.topk(max(m, n_cols), -1).indices  # [D, max(m, C)], best first
        top = ids[top_col] if ids is not None else top_col  # draft-vocabulary column -> token id
        cand = top[:, :m]  # [D, m]
        cols = top[:, :n_cols] if n_cols else None  # [D, C]
        prev_col = top_col[:-1, :m].reshape(-1) if ids is not None else None  # [(D-1)*m]
        col_idx = top_col[:, :n_cols] if n_cols and ids is not None else None  # [D, C]
        logp = self.corrected_logp(h, root_token, cand, cols, prev_col, col_idx)  # [1 + (D-1)*m, C]
        vals, idx = logp.topk(k, -1)  # [1 + (D-1)*m, k]
        if cols is not None:  # column -> token id
            idx = torch.cat([cols[0][idx[0]][None], cols[1:].repeat_interleave(m, 0).gather(1, idx[1:])])
        idx, vals, cand = idx.cpu(), vals.cpu(), cand.cpu()  # tree building runs on the host
        return TransitionTables(cand, idx[0], vals[0], idx[1:].view(D - 1, m, k), vals[1:].view(D - 1, m, k))

    def corrected_logp(self, h: torch.Tensor, root_token: int, cand: torch.Tensor,
                       cols: torch.Tensor | None = None, prev_col: torch.Tensor | None = None,
                       col_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Row 0: depth 1 given the root; row 1 + (d-1)*m + j: depth d+1 given cand[d-1, j].

        h [D+1, H], cand [D, m], cols [D, C] token ids per depth (None: all V), prev_col
        [(D-1)*m] the draft-vocabulary columns of cand[:-1] (None: look the tokens up), col_idx
        [D, C] the draft-vocabulary columns of cols (None: read the LM head's rows of cols)
        -> log-probs [1 + (D-1)*m, C] over those columns.
        """
        D, m = cand.shape
        ar = self.drafter.ar_approximation
        dev = h.device
        # the AR correction's state half runs once per position, its previous-token half comes
        # from the drafter's per-token table where there is one
        row_pos = torch.cat([torch.zeros(1, dtype=torch.long, device=dev),
                             torch.arange(1, D, device=dev).repeat_interleave(m)])  # [1 + (D-1)*m]
        table = self.drafter.prev_table(self.embed) if prev_col is not None else None
        root_col = self.drafter.draft_column(root_token) if table is not None else None
        root_part = (table[root_col][None] if root_col is not None
                     else ar.prev_part(self.embed(cand.new_tensor([root_token]))))  # [1, 2A]
        cand_part = table[prev_col] if table is not None else ar.prev_part(self.embed(cand[:-1].reshape(-1)))
        x = self.drafter.corrected_rows(h[1:], row_pos, torch.cat([root_part, cand_part]))  # [1 + (D-1)*m, H]
        if cols is None:
            return self.lm_head(x).float().log_softmax(-1)
        rows = self.drafter.draft_head(self.lm_head) if col_idx is not None else None
        w = rows[col_idx] if rows is not None else self.lm_head.weight[cols]  # [D, C, H]: same rows
        first = x[:1] @ w[0].T  # [1, C]
        rest = torch.bmm(x[1:].view(D - 1, m, x.shape[-1]), w[1:].transpose(1, 2)).view((D - 1) * m, w.shape[1])
        return torch.cat([first, rest]).float().log_softmax(-1)  # normalised over the columns

    def transitions(self, tables):
        return treeflash_transitions(tables)


PROPOSERS = {p.name: p for p in (Vanilla, Lookup, Chain, Marginal, TreeFlash)}


def make_proposer(method: str, drafter, embed, lm_head, params: TreeParams,
                  lookup: LookupParams | None = None, scores: LookupScores | None = None) -> Proposer:
    """`NAME+lookup`: NAME's proposer with lookup branches (`lookup`: their parameters)."""
    if method not in METHODS:
        raise TreeflashError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    base, _, plus = method.partition("+")
    if base in DRAFTER_METHODS and drafter is None:
        raise TreeflashError(f"method {method!r} needs a drafter (--drafter PATH or --drafter random)")
    if base == "treeflash" and drafter.ar_approximation is None:
        raise TreeflashError(f"method {method!r} needs a drafter with a TreeFlash AR-approximation")
    if plus:
        return PROPOSERS[base](drafter, embed, lm_head, params, lookup or LookupParams(), scores)
    return PROPOSERS[base](drafter, embed, lm_head, params, lookup if base == "lookup" else None, scores)
