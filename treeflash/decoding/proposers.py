"""Drafting methods behind one interface: `propose(root_token, start, max_depth, history, states) -> Tree`.

A proposer says what it needs: `rows(budget)`, the most tree rows it verifies at a budget (the
KV reservation past the tokens and the warm-up follow from it), `drafts` (whether it keeps a
drafter context), and `block_depth`, the masks of a step's drafter pass; the decoding loop runs
that pass (at most one per step) and hands its states to `propose`. `vanilla` proposes the root
alone. A method
`NAME+lookup` adds lookup branches (decoding/lookup.py: continuations copied from the prompt and
the output) to NAME's tree under the same budget; `lookup` alone needs no drafter.
"""
from __future__ import annotations

import time

import torch

from ..config import TreeParams  # the proposer's parameters (checked with the rest of a GenerationConfig)
from ..errors import TreeflashError
from ..models.drafter import Drafter
from ..options import DRAFTER_METHODS, check_method
from .heads import DraftHeads
from .lookup import Branches, LookupIndex, LookupParams, LookupScores
from .trees import (Tree, TransitionTables, best_first, chain_transitions, marginal_transitions,
                    treeflash_transitions)


def root_only(root_token: int) -> Tree:
    return Tree(torch.tensor([root_token]), torch.tensor([-1]), torch.tensor([0]))


class Proposer:
    """Turns one drafter block pass (and, with lookup, the lookup trie) into a tree: `draft`
    (drafter forward + heads -> tables), `lookup_branches`, then `build` (pure tree construction).
    The heads (`draft_heads`, decoding/heads.py) turn the drafter's states into log-probs.
    Timings are kept per phase: "draft" (drafter pass and heads), "tree" (lookup and building)."""

    name = "base"
    planner = None  # a `step_budget.StepBudget` choosing each step's budget (--tree-size auto, lookup methods)

    def __init__(self, drafter: Drafter | None, embed, lm_head, params: TreeParams,
                 lookup: LookupParams | None = None, scores: LookupScores | None = None):
        self.drafter, self.embed, self.lm_head, self.params = drafter, embed, lm_head, params
        self.draft_heads = (DraftHeads(drafter, embed, lm_head, params.draft_vocab)
                            if drafter is not None else None)
        self.index = LookupIndex(lookup) if lookup is not None else None
        self.scores = scores if scores is not None or lookup is None else LookupScores.load()
        self.timings = {"draft": 0.0, "tree": 0.0}

    @classmethod
    def rows(cls, budget: int) -> int:
        """The most tree rows one step verifies at `budget`: what a sequence reserves in the KV
        cache past its tokens, and what the warm-up compiles."""
        return max(1, budget)

    def max_rows(self) -> int:
        """The most tree rows one step verifies: at its budget, or at the largest its planner may choose."""
        return self.rows(max(self.params.budget, self.planner.max_budget if self.planner is not None else 1))

    @property
    def drafts(self) -> bool:
        """Whether a sequence keeps a drafter context: a drafter, and a budget of 2 or more (a
        budget of 1 is plain decoding: no drafter work at all, not even its context update)."""
        return self.drafter is not None and self.params.budget >= 2

    def propose(self, root_token: int, start: int, max_depth: int, history: list[int] | None = None,
                states: torch.Tensor | None = None, branches: Branches | None = None) -> Tree:
        """Tree rooted at `root_token` (position `start`), at most `max_depth` deep; `history`: the
        committed tokens, prompt first, ending with the root (read by lookup methods); `states`: the
        drafter's pre-norm states [d+1, H] of this step's block [root, MASK x d], d =
        `block_depth(max_depth)` (None: no drafter pass this step); `branches`: this step's lookup
        branches where the caller found them already (else found here for lookup methods)."""
        if self.params.budget < 2:
            return root_only(root_token)
        t0 = time.perf_counter()
        tables = None
        if states is not None and len(states) >= 2:
            # a tree of `budget` nodes is at most budget-1 deep: the heads need no deeper positions
            tables = self.heads(states[: min(len(states) - 1, self.params.budget - 1) + 1], root_token)
        t1 = time.perf_counter()
        if branches is None and self.index is not None:
            branches = self.lookup_branches(history, max_depth)
        tree = self.build(root_token, tables, branches)
        self.timings["draft"] += t1 - t0
        self.timings["tree"] += time.perf_counter() - t1
        return tree

    def block_depth(self, max_depth: int) -> int:
        """Mask rows of this step's block pass (0: no pass): as deep as the tree reaches (a tree of
        `budget` nodes is at most budget-1 deep) or `block_len`-1, within the drafter's block and
        `max_depth`. The masks beyond the tree's reach only change what the others attend to (the
        drafter attends bidirectionally inside its block), so dropping them is cheaper and still
        lossless; the drafter was trained on full blocks, so tau can move a little."""
        if not self.drafts:
            return 0
        rows = self.params.block_len or self.params.budget
        return max(0, min(max_depth, self.drafter.block_size - 1, rows - 1))

    def compile_heads(self, on: bool, cpp_gemm: bool = False) -> None:
        """Run the heads as a compiled graph where the method has one (the compiled backends)."""

    def lookup_branches(self, history: list[int], max_depth: int) -> Branches:
        self.index.sync(history)
        return self.index.branches(max_depth)

    def marginal_logp(self, h: torch.Tensor) -> torch.Tensor:
        """h [D+1, H] -> log-probs [D, V] for depths 1..D (-inf outside the draft vocabulary)."""
        return self.draft_heads.to_full(self.draft_heads.marginal(h))

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
    """Plain decoding: the proposer that verifies the root alone, whatever the budget."""

    name = "vanilla"

    @classmethod
    def rows(cls, budget: int) -> int:
        return 1

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
    compiled: tuple[int, bool] | None = None  # (depth, cpp_gemm) of the compiled heads; None: eager

    def compile_heads(self, on: bool, cpp_gemm: bool = False) -> None:
        """On: stages 1 and 2 as one compiled graph (`heads.TablesGraph`) as deep as this budget's
        trees reach, compiled now; where it does not apply (no draft vocabulary, stage 2 over the
        whole vocabulary) the eager heads run."""
        self.compiled = None
        vocab = self.draft_heads.vocab if self.drafter is not None else None
        if not on or vocab is None:
            return
        depth = min(self.block_depth(self.drafter.block_size), self.params.budget - 1)
        n_cols = self._n_cols(len(vocab))
        if depth >= 1 and n_cols and self.draft_heads.prev_table() is not None:
            p = self.params
            self.draft_heads.tables_graph(p.top_m, p.top_k, n_cols, depth, cpp_gemm).warm()
            self.compiled = (depth, cpp_gemm)

    def _n_cols(self, width: int) -> int:
        """Stage 2's columns per position (0: every token id) out of `width` (the marginal's);
        raises where top-m exceeds them."""
        m = self.params.top_m
        if width < m:
            raise TreeflashError(f"top-m {m} exceeds the drafter's draft vocabulary ({width} tokens)")
        return min(max(self.params.stage2_vocab, m), width) if self.params.stage2_vocab else 0

    def heads(self, h: torch.Tensor, root_token: int) -> TransitionTables:
        """Stage 1: top-m marginal candidates; stage 2: corrected top-k per candidate previous token."""
        D = h.shape[0] - 1
        m, k = self.params.top_m, self.params.top_k
        if self.compiled is not None:  # set only with a draft vocabulary
            n_cols = self._n_cols(len(self.draft_heads.vocab))
            out = self.draft_heads.compiled_tables(h, root_token, m, k, n_cols, *self.compiled)
            if out is not None:
                cand, idx, vals = (t.cpu() for t in (self.draft_heads.tokens(out[0]),
                                                     self.draft_heads.tokens(out[1]), out[2]))
                return TransitionTables(cand, idx[0], vals[0], idx[1:].view(D - 1, m, k), vals[1:].view(D - 1, m, k))
        marginal = self.draft_heads.marginal(h)  # [D, Vd] over the draft-vocabulary columns
        n_cols = self._n_cols(marginal.shape[1])
        top = marginal.topk(max(m, n_cols), -1).indices  # [D, max(m, C)] columns, best first
        cols = top[:, :n_cols] if n_cols else None  # [D, C]
        logp = self.corrected_logp(h, root_token, top[:-1, :m], cols)  # [1 + (D-1)*m, C]
        vals, idx = logp.topk(k, -1)  # [1 + (D-1)*m, k]
        if cols is not None:  # index among a depth's columns -> column -> token id
            idx = self.draft_heads.tokens(torch.cat([cols[0][idx[0]][None],
                                                     cols[1:].repeat_interleave(m, 0).gather(1, idx[1:])]))
        cand = self.draft_heads.tokens(top[:, :m])  # [D, m] token ids
        idx, vals, cand = idx.cpu(), vals.cpu(), cand.cpu()  # tree building runs on the host
        return TransitionTables(cand, idx[0], vals[0], idx[1:].view(D - 1, m, k), vals[1:].view(D - 1, m, k))

    def corrected_logp(self, h: torch.Tensor, root_token: int, prev: torch.Tensor,
                       cols: torch.Tensor | None = None) -> torch.Tensor:
        """h [D+1, H], prev [D-1, m], cols [D, C] columns -> log-probs [1 + (D-1)*m, C]: see
        `DraftHeads.corrected`."""
        return self.draft_heads.corrected(h, root_token, prev, cols)

    def transitions(self, tables):
        return treeflash_transitions(tables)


PROPOSERS = {p.name: p for p in (Vanilla, Lookup, Chain, Marginal, TreeFlash)}


def verify_rows(method: str, budget: int) -> int:
    """The most tree rows a step of `method` verifies at `budget` (`Proposer.rows`), before any
    proposer is built (a server sizing its pool and warm-up)."""
    return PROPOSERS[method.partition("+")[0]].rows(budget)


def plain_only(method: str) -> bool:
    """Whether `method`'s trees are the root alone at every budget (`vanilla`): it has no tree size to choose."""
    return verify_rows(method, 2) < 2


def check_drafter(method: str, drafter) -> None:
    """A one-line TreeflashError where `method` cannot run with `drafter` (None: no drafter)."""
    check_method(method)
    base = method.partition("+")[0]
    if base in DRAFTER_METHODS and drafter is None:
        raise TreeflashError(f"method {method!r} needs a drafter (--drafter PATH or --drafter random)")
    if base == "treeflash" and drafter.ar_approximation is None:
        raise TreeflashError(f"method {method!r} needs a drafter with a TreeFlash AR-approximation")


def make_proposer(method: str, drafter, embed, lm_head, params: TreeParams,
                  lookup: LookupParams | None = None, scores: LookupScores | None = None) -> Proposer:
    """`NAME+lookup`: NAME's proposer with lookup branches (`lookup`: their parameters)."""
    check_drafter(method, drafter)
    base, _, plus = method.partition("+")
    if plus:
        return PROPOSERS[base](drafter, embed, lm_head, params, lookup or LookupParams(), scores)
    return PROPOSERS[base](drafter, embed, lm_head, params, lookup if base == "lookup" else None, scores)
