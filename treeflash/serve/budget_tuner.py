"""Load-adaptive tree budgets that check the cost model against the server's own steps.

`costmodel.adaptive_budget` predicts the best per-sequence budget at each batch size from the
cost of one sequence's forward over N rows and the acceptance of a short calibration. A real
batch differs from both: its rows attend over several sequences' caches, each sequence adds
per-step work, and live prompts accept drafts at their own rate. So at each batch size n >= 2
the tuner tries a few candidates, the model's choice, plain decoding (budget 1) and one between,
and keeps whichever delivered the most tokens per second in steps that only decoded. At batch 1
the calibrated bs=1 choice stands. Every candidate is lossless: only speed depends on the choice.

Pure bookkeeping (no torch): `choose(n, predicted)` before a step, `record(n, budget, tokens,
seconds)` after it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_STEPS = 6        # steps of each candidate before the tuner trusts its rate
WINDOW = 12          # the most recent steps of a candidate that make its rate
EXPLORE_EVERY = 50   # after the first round, every this many steps at a batch size another candidate
BURST = 3            # runs this many steps


def candidates(predicted: int) -> tuple[int, ...]:
    """The budgets tried for a model choice: itself, plain decoding, and halfway between."""
    return tuple(sorted({1, max(1, predicted // 2), predicted}))


@dataclass
class _Level:
    """One batch size's candidates and their recent (tokens, seconds) steps."""

    options: tuple[int, ...]
    samples: dict[int, deque] = field(default_factory=dict)
    steps: int = 0
    last_tried: dict[int, int] = field(default_factory=dict)
    exploring: int = 1

    def rate(self, b: int) -> float:
        s = self.samples.get(b)
        seconds = sum(t for _, t in s) if s else 0.0
        return sum(k for k, _ in s) / seconds if seconds > 0 else 0.0


class BudgetTuner:
    """Per batch size: try each candidate budget MIN_STEPS times, then use the fastest measured,
    trying the least recently tried other one for BURST steps every EXPLORE_EVERY steps."""

    def __init__(self):
        self.levels: dict[int, _Level] = {}

    def choose(self, n: int, predicted: int) -> int:
        """The budget for the next step of a batch of n decoding sequences, given the cost model's."""
        if n <= 1 or predicted <= 1:
            return max(1, predicted)
        level = self.levels.get(n)
        if level is None or level.options != candidates(predicted):
            level = self.levels[n] = _Level(candidates(predicted))
        level.steps += 1
        young = [b for b in level.options if len(level.samples.get(b, ())) < MIN_STEPS]
        if young:
            return young[0]
        best = max(level.options, key=level.rate)
        phase = level.steps % EXPLORE_EVERY
        if phase == 0:
            others = [b for b in level.options if b != best]
            level.exploring = min(others, key=lambda b: level.last_tried.get(b, 0))
        return level.exploring if phase < BURST else best

    def record(self, n: int, budget: int, tokens: int, seconds: float) -> None:
        """One step that only decoded: n sequences at `budget` emitted `tokens` in `seconds`."""
        level = self.levels.get(n)
        if level is None or budget not in level.options or seconds <= 0:
            return
        level.samples.setdefault(budget, deque(maxlen=WINDOW)).append((tokens, seconds))
        level.last_tried[budget] = level.steps

    def best(self, n: int) -> int | None:
        """The fastest measured budget at batch size n so far (None: not measured)."""
        level = self.levels.get(n)
        if level is None or not level.samples:
            return None
        return max(level.samples, key=level.rate)
