"""Per-step budgets where the text repeats (`decoding/step_budget.py`): the choice, and that decoding
with it is plain decoding's output, one sequence or a batch."""
import math

import pytest

from treeflash.api import AutoChoice, Engine
from treeflash.decoding.lookup import (DEPTH_BUCKETS, MATCH_BUCKETS, SHARE_BUCKETS, Branches, LookupScores,
                                       TrieNode)
from treeflash.decoding.sequence import Sequence
from treeflash.decoding.stats import Stats
from treeflash.decoding.step_budget import SEEN, StepBudget, StepRecord, lookup_probs, ratio

from conftest import tiny_drafter, tiny_target, vanilla

PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]  # a text that repeats


def by_depth(rates: dict[int, float]) -> LookupScores:
    """A scores table whose edges score log(rates[depth bucket]) whatever their match and share."""
    return LookupScores([[[math.log(rates[d]) for d in range(len(DEPTH_BUCKETS) + 1)]
                          for _ in range(len(SHARE_BUCKETS) + 1)] for _ in range(len(MATCH_BUCKETS) + 1)])


def test_lookup_probs_multiply_the_edges_agreement_rates():
    a, b, c = TrieNode(2), TrieNode(1), TrieNode(1)
    a.children = {11: b, 12: c}
    scores = by_depth({0: 0.8, 1: 0.5, 2: 0.3, 3: 0.3, 4: 0.3})  # depth 1 -> bucket 0, depth 2 -> bucket 1
    probs = lookup_probs(Branches(TrieNode(2, {10: a}), match_len=3), scores)
    assert probs == pytest.approx([0.8, 0.4, 0.4])
    assert lookup_probs(Branches(TrieNode(), 0), scores) == []


def test_a_step_takes_the_faster_of_the_calibrated_tree_and_a_lookup_only_tree():
    flat = {1: 1.0, 64: 1.0}  # verifying is free: every node that may be accepted pays
    plain = StepBudget(flat, [], lambda b: 0.0)
    assert plain.choose(1, False, []) == (1, False)
    assert plain.choose(1, False, [0.9, 0.8]) == (3, False)
    steep = StepBudget({1: 1.0, 2: 1.95, 64: 64.0}, [], lambda b: 0.0)  # a node costs nearly a forward
    assert steep.choose(1, False, [0.9]) == (1, False)
    assert steep.choose(1, False, [0.99]) == (1, False)  # 1.99 tokens for 1.95: within the margin
    assert StepBudget({1: 1.0, 2: 1.5, 64: 64.0}, [], lambda b: 0.0).choose(1, False, [0.9]) == (2, False)  # 1.27x
    mid = {1: 1.0, 4: 1.2, 8: 2.0, 64: 10.0}
    drafter = StepBudget(mid, [0.9, 0.6, 0.4], lambda b: 0.05)
    assert drafter.choose(4, True, [0.1]) == (4, True)       # the calibrated step, drafter and all
    b, drafts = drafter.choose(4, True, [0.99] * 15)          # a long confident copy: no drafter pass
    assert not drafts and b > 4
    assert drafter.choose(4, False, [0.01]) == (2, False)     # no drafter: the calibrated lookup tree, as large as it is
    assert drafter.choose(1, False, [0.01]) == (1, False)     # ... calibrated plain: a poor copy stays plain
    assert StepBudget(flat, [], lambda b: 0.0, max_budget=4).choose(1, False, [0.9] * 10) == (4, False)


def test_a_sequences_record_corrects_the_scores_and_the_costs():
    """Copies that did not hold lower the trust in the scores; the step times seen scale the measured
    costs, per size where seen, linearly between, flat beyond."""
    costs = StepBudget({1: 1.0, 2: 1.2, 4: 1.6, 64: 12.0}, [], lambda b: 0.0)
    record = StepRecord()
    assert record.trust == 1.0 and ratio(record.ratios(costs.estimate), 4) == 1.0
    record.add(8, 1.0, tokens=1, expected=10.0)  # a long copy that missed
    assert record.trust == pytest.approx(4 / 14)
    assert costs.choose(1, False, [0.6], record) == (1, False)          # 1.17 tokens for 1.2 plain steps' cost
    assert costs.choose(1, False, [0.6], StepRecord()) == (2, False)    # 1.6, trusted
    slow = StepRecord()
    for _ in range(SEEN):
        slow.add(1, 0.5, tokens=1)
        slow.add(4, 4.0, tokens=2)   # a 4-node step ran at 8 plain steps here
    ratios = slow.ratios(costs.estimate)
    assert ratios == {1: pytest.approx(0.5), 4: pytest.approx(2.5)}
    assert ratio(ratios, 2) == pytest.approx(0.5 + 2 / 3) and ratio(ratios, 9) == pytest.approx(2.5)
    assert costs.seconds(2, 1.9, ratios) == pytest.approx(1.2 * (0.5 + 2 / 3))
    assert costs.choose(1, False, [0.9, 0.9, 0.9], StepRecord()) == (4, False)  # measured costs alone: 3.7 for 1.6
    assert costs.choose(1, False, [0.9, 0.9, 0.9], slow) == (1, False)          # as this sequence ran: plain pays


def engine_with(choice: AutoChoice, monkeypatch):
    """The tiny qwen2 target on static with a drafter; `tree_size="auto"` resolves to `choice`, whose
    costs alone decide (the sequences' own step times, machine-dependent, are not read)."""
    target = tiny_target("qwen2", logit_scale=3.0).set_backend("static")
    engine = Engine(target, tiny_drafter(target))
    monkeypatch.setattr(Engine, "auto_tree_size", lambda self, cfg=None, **kw: choice)
    monkeypatch.setattr(StepRecord, "ratios", lambda self, estimate: {})
    return engine


@pytest.mark.parametrize("budget", [1, 4])
def test_decoding_with_step_budgets_is_plain_decoding(budget, monkeypatch):
    """Calibrated plain decoding (1) or a drafter's tree of 4, verifying is free: steps that copy the
    text verify lookup-only trees without the drafter's pass; the tokens are plain decoding's, one
    sequence and in a batch."""
    flat = {0: 0.0, 1: 1.0, 64: 1.0}
    choice = AutoChoice("treeflash+lookup", budget, 1.0, 2.0, 0.01, flat, [0.5, 0.3, 0.2], (0.01, 0.01, 7))
    engine = engine_with(choice, monkeypatch)
    passes, contexts = [], []
    plan = Sequence.plan  # before each step the drafter's context holds every committed position, skipped passes or not
    monkeypatch.setattr(Sequence, "plan", lambda self, alone=True: contexts.append(
        self.dcache is None or self.dcache.length == self.start) or plan(self, alone))
    draft_blocks = engine.drafter.draft_blocks
    monkeypatch.setattr(engine.drafter, "draft_blocks", lambda jobs: passes.append(len(jobs)) or draft_blocks(jobs))
    cfg = engine.config(method="treeflash+lookup", tree_size="auto", top_m=3, top_k=3, max_new_tokens=40,
                        ignore_eos=True)
    stats = Stats()
    out = list(engine.tokens(PROMPT, cfg, stats=stats))
    assert out == vanilla(engine.target, PROMPT, 40)
    assert max(stats.tree_sizes) > budget                   # lookup-only trees, larger than the calibrated
    assert sum(stats.acceptance_lengths) > stats.steps      # ... and accepted
    assert len(passes) < stats.steps if budget > 1 else not passes  # steps without the drafter's pass
    assert contexts and all(contexts)
    batch = engine.generate_batch([PROMPT, PROMPT[3:]], cfg)
    assert batch[0].token_ids == out and batch[1].token_ids == vanilla(engine.target, PROMPT[3:], 40)


def test_a_fixed_tree_size_keeps_its_budget_every_step(monkeypatch):
    choice = AutoChoice("treeflash+lookup", 1, 1.0, 1.0, 0.0, {1: 1.0, 64: 1.0}, [], ())
    engine = engine_with(choice, monkeypatch)
    stats = Stats()
    out = list(engine.tokens(PROMPT, method="lookup", tree_size=1, max_new_tokens=20, ignore_eos=True, stats=stats))
    assert out == vanilla(engine.target, PROMPT, 20)
    assert set(stats.tree_sizes) == {1}
