"""Per-step tree budgets where the text repeats (`--tree-size auto` with a lookup method).

`--tree-size auto` calibrates one budget per machine on short prompts that repeat little text, so
lookup branches weigh little in it: where a step of the drafter does not pay, it chooses plain
decoding, and lookup's gain on code that repeats is lost. A step knows more. Before the drafter
runs, this step's lookup trie is there (it costs no model call), and its calibrated edge scores
(`LookupScores`: log p of the target agreeing with the edge given its parent) give the expected
accepted tokens of a lookup-only tree of every size. `StepBudget.choose` takes, per step, whichever
is faster by expected tokens per second on the measured verify costs (`costmodel`), a lookup-only
tree only where it is expected `MARGIN` times faster:
  - the calibrated step: the drafter's tree (with this step's lookup branches) at the calibrated
    budget; without a drafter, the lookup tree at that budget (plain decoding where it is 1);
  - a lookup-only tree of the size that pays best, without the drafter's pass.
A sequence decoding in a batch with others keeps its set budget (`Sequence.plan(alone=False)`):
this choice weighs one sequence's step costs, and a batch's budgets follow the load.
Both inputs are estimates, so each sequence keeps its own record (`StepRecord`) and corrects them:
- the scores were measured on one target's data, and how far a copy holds depends on the text (code
  repeats exactly, chat paraphrases): the lookup tokens its lookup-only steps expected and those the
  target accepted scale the scores by their ratio (shrunk towards 1 while the record is short);
- the verify costs were measured once, after 256 cached tokens: its own steps' times, against what
  the measured costs said of them, scale the costs, per tree size where it has seen that size and
  linearly between (steps it decoded alone only).
Any tree is lossless; this chooses only its size and whether the drafter runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .costmodel import expected_tau, interpolate
from .lookup import Branches, LookupScores

LOOKUP_MAX = 16  # the largest lookup-only tree a step may verify (or the calibrated budget, if larger)
PRIOR_TOKENS = 4.0  # a new sequence trusts the scores as if they had been right about this many tokens
SEEN = 2  # steps of one tree size a sequence needs before their times correct the measured cost
MARGIN = 1.2  # a lookup-only tree must be expected this much faster than the calibrated step: both
              # estimates err, and a tree that only breaks even on paper loses where they do


@dataclass
class StepRecord:
    """One sequence's steps so far: the accepted tokens its lookup-only steps' scores expected and
    those the target accepted; per tree size, its steps' seconds past drafting (verify, accept,
    commit), how many, and the tokens they committed."""

    expected: float = 0.0
    accepted: int = 0
    times: dict[int, list[float]] = field(default_factory=dict)  # tree size -> [seconds, steps, tokens]

    @property
    def trust(self) -> float:
        """The factor on this sequence's lookup scores: accepted / expected, shrunk towards 1."""
        return (self.accepted + PRIOR_TOKENS) / (self.expected + PRIOR_TOKENS)

    def add(self, nodes: int, seconds: float, tokens: int, expected: float | None = None) -> None:
        """A step that verified `nodes` in `seconds` and committed `tokens`; a lookup-only step's
        scores expected `expected` of its accepted drafts (tokens - 1)."""
        t = self.times.setdefault(nodes, [0.0, 0, 0])
        t[0] += seconds
        t[1] += 1
        t[2] += tokens
        if expected is not None:
            self.expected += expected
            self.accepted += tokens - 1

    def ratios(self, estimate) -> dict[int, float]:
        """{tree size: how much slower (> 1) or faster than `estimate(nodes, tokens)` this sequence's
        steps of that size ran}, for the sizes seen `SEEN` times or more."""
        return {n: t / (k * estimate(n, c / k)) for n, (t, k, c) in self.times.items() if k >= SEEN}


def ratio(ratios: dict[int, float], nodes: int) -> float:
    """The factor on the estimate of a `nodes`-node step (`StepRecord.ratios`): linear between the
    sizes seen, flat beyond them; 1 before any."""
    return interpolate(ratios, nodes) if ratios else 1.0


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

    def estimate(self, nodes: int, tau: float) -> float:
        """The measured seconds of a step that verifies `nodes` and commits `tau` tokens: the forward
        and tau rows of the LM head (`costmodel`)."""
        return interpolate(self.costs, nodes) + tau * self.costs.get(0, 0.0)

    def seconds(self, nodes: int, tau: float, ratios: dict[int, float]) -> float:
        """That estimate as this sequence's own steps ran against it (`StepRecord.ratios`)."""
        return self.estimate(nodes, tau) * ratio(ratios, nodes)

    def choose(self, budget: int, drafts: bool, probs: list[float],
               record: StepRecord | None = None) -> tuple[int, bool]:
        """(this step's tree budget, whether the drafter runs) from the calibrated `budget`, whether
        the sequence drafts at it, this step's lookup node probabilities (`lookup_probs`) and the
        sequence's record (its trust in the scores, its step times)."""
        drafting = drafts and budget >= 2
        if not probs:  # nothing to copy: the calibrated step
            return (budget, True) if drafting else (1, False)
        record = record if record is not None else StepRecord()
        ratios = record.ratios(self.estimate)
        lookup_tau = [1.0, 1.0]  # [b]: 1 + the expected accepted lookup nodes of a b-node tree
        for p in probs[: self.max_budget - 1]:
            lookup_tau.append(lookup_tau[-1] + min(1.0, record.trust * p))
        if drafting:  # the calibrated step; its tree holds this step's lookup branches too
            tau = max(expected_tau(self.node_accept, budget), lookup_tau[min(budget, len(lookup_tau) - 1)])
            best = (budget, True, tau / (self.draft(budget) + self.seconds(budget, tau, ratios)))
        else:  # the calibrated step without a drafter: the lookup tree at the calibrated budget (1: plain)
            b = min(budget, len(lookup_tau) - 1)
            best = (b, False, lookup_tau[b] / self.seconds(b, lookup_tau[b], ratios))
        base = best[2]
        for b in range(2, len(lookup_tau)):
            rate = lookup_tau[b] / self.seconds(b, lookup_tau[b], ratios)
            if rate > best[2] and rate >= MARGIN * base:
                best = (b, False, rate)
        return best[0], best[1]
