"""Per-step tree budgets where the text repeats (`--tree-size auto` with a lookup method).

`--tree-size auto` calibrates one budget per machine on short prompts that repeat little text, so
lookup branches weigh little in it: where a step of the drafter does not pay, it chooses plain
decoding, and lookup's gain on code that repeats is lost. A step knows more. Before the drafter
runs, this step's lookup trie is there (it costs no model call), and its calibrated edge scores
(`LookupScores`: log p of the target agreeing with the edge given its parent) give the expected
accepted tokens of a lookup-only tree of every size. `StepBudget.choose` takes, per step, whichever
is faster by expected tokens per second on the measured verify costs (`costmodel`):
  - the calibrated step: the drafter's tree (with this step's lookup branches) at the calibrated
    budget, or plain decoding where that budget is 1;
  - a lookup-only tree of the size that pays best, without the drafter's pass.
The scores were measured on one target's data, and how far a copy holds depends on the text (code
repeats exactly, chat paraphrases). So each sequence keeps its own record (`LookupRecord`): the lookup
tokens its lookup-only steps expected and those the target accepted, and scales the scores by their
ratio (shrunk towards 1 while the record is short). Any tree is lossless; this chooses only its size
and whether the drafter runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .costmodel import expected_tau, interpolate
from .lookup import Branches, LookupScores

LOOKUP_MAX = 16  # the largest lookup-only tree a step may verify: a branch of max_len = 16 tokens
PRIOR_TOKENS = 4.0  # a new sequence trusts the scores as if they had been right about this many tokens


@dataclass
class LookupRecord:
    """One sequence's lookup-only steps so far: the accepted tokens their scores expected, and those
    the target accepted."""

    expected: float = 0.0
    accepted: int = 0

    @property
    def trust(self) -> float:
        """The factor on this sequence's lookup scores: accepted / expected, shrunk towards 1."""
        return (self.accepted + PRIOR_TOKENS) / (self.expected + PRIOR_TOKENS)

    def add(self, expected: float, accepted: int) -> None:
        self.expected += expected
        self.accepted += accepted


def lookup_probs(branches: Branches, scores: LookupScores) -> list[float]:
    """For each node of the lookup trie (its root, the current token, excluded): the probability that
    it lies on the accepted path, the product of its edges' calibrated agreement rates; best first."""
    out: list[float] = []
    stack = [(branches.root, 0.0, 1)]  # (node, log p of reaching it, depth of its children)
    while stack:
        node, logp, depth = stack.pop()
        for child in node.children.values():
            lp = logp + scores.edge(branches.match_len, node, child, depth)
            out.append(math.exp(lp))
            stack.append((child, lp, depth + 1))
    return sorted(out, reverse=True)


@dataclass(frozen=True)
class StepBudget:
    """What a step's choice is made from: the target's verify costs, and the calibrated drafter's
    acceptance and drafting cost (an `api.AutoChoice`'s)."""

    costs: dict[int, float]           # seconds per verify forward by tree size; 0: one row's LM head
    node_accept: list[float]          # per best-first node: the rate it lay on the accepted path
    draft: Callable[[int], float]     # drafting seconds per step at a budget
    max_budget: int = LOOKUP_MAX      # the largest tree a step verifies (what a sequence reserves)

    def rate(self, tau: float, draft_s: float, nodes: int) -> float:
        """Expected tokens/s of a step that verifies `nodes` and commits `tau` tokens on average."""
        return tau / (draft_s + interpolate(self.costs, nodes) + tau * self.costs.get(0, 0.0))

    def choose(self, budget: int, drafts: bool, probs: list[float], trust: float = 1.0) -> tuple[int, bool]:
        """(this step's tree budget, whether the drafter runs) from the calibrated `budget`, whether
        the sequence drafts at it, this step's lookup node probabilities (`lookup_probs`) and the
        sequence's `trust` in them (`LookupRecord.trust`)."""
        lookup_tau = [1.0, 1.0]  # [b]: 1 + the expected accepted lookup nodes of a b-node tree
        for p in probs[: self.max_budget - 1]:
            lookup_tau.append(lookup_tau[-1] + trust * p)
        if drafts and budget >= 2:  # the calibrated step; its tree holds this step's lookup branches too
            tau = max(expected_tau(self.node_accept, budget), lookup_tau[min(budget, len(lookup_tau) - 1)])
            best = (budget, True, self.rate(tau, self.draft(budget), budget))
        else:
            best = (1, False, self.rate(1.0, 0.0, 1))  # plain decoding
        for b in range(2, len(lookup_tau)):
            r = self.rate(lookup_tau[b], 0.0, b)
            if r > best[2]:
                best = (b, False, r)
        return best[0], best[1]
