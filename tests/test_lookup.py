"""Lookup branches: the n-gram index against brute force, the merged best-first tree against
enumeration, the calibration counts by hand, and greedy losslessness of every +lookup method."""
import math
import random

import pytest
import torch

from treeflash.decoding import lookup as L
from treeflash.decoding.stats import Stats
from treeflash.decoding.proposers import TreeParams, make_proposer
from treeflash.options import METHODS
from treeflash.decoding.trees import best_first, combine, marginal_transitions

from conftest import oracle, run, tiny_drafter, tiny_target, vanilla

LOOKUP_METHODS = [m for m in METHODS if "lookup" in m]


# ---------------------------------------------------------------- the index
def brute_branches(toks: list[int], p: L.LookupParams) -> tuple[int, dict, int]:
    """(match length, {continuation prefix: count}, occurrences followed) by scanning every earlier
    position."""
    for n in range(min(p.max_ngram, len(toks) - 1), p.min_ngram - 1, -1):
        suffix = toks[len(toks) - n:]
        ends = [e for e in range(n - 1, len(toks) - 1) if toks[e - n + 1:e + 1] == suffix]
        if ends:
            prefixes: dict = {}
            for e in ends[::-1][:p.occurrences]:
                cont = toks[e + 1:e + 1 + p.max_len]
                for k in range(1, len(cont) + 1):
                    prefixes[tuple(cont[:k])] = prefixes.get(tuple(cont[:k]), 0) + 1
            return n, prefixes, min(len(ends), p.occurrences)
    return 0, {}, 0


def trie_prefixes(node: L.TrieNode, path=()) -> dict:
    out = {}
    for tok, child in node.children.items():
        out[path + (tok,)] = child.count
        out.update(trie_prefixes(child, path + (tok,)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_matches_brute_force(seed):
    rng = random.Random(seed)
    params = L.LookupParams(max_ngram=rng.choice([1, 3, 8]), max_len=rng.choice([1, 4, 16]),
                            occurrences=rng.choice([1, 3, 8]))
    alphabet = rng.choice([3, 6, 20])
    toks = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 8))]
    index = L.LookupIndex(params)
    seen_match = False
    while len(toks) < 120:
        index.sync(toks)  # history grows by a few tokens per step, as in decoding
        br = index.branches()
        n, want, occ = brute_branches(toks, params)
        assert br.match_len == n
        assert trie_prefixes(br.root) == want
        assert br.root.count == occ
        seen_match |= n >= min(2, params.max_ngram)
        toks = toks + [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]
    assert seen_match, "the sequences should repeat: the test must bite"


def brute_copy_steps(prompt, out, lengths, n=3):
    """Per step: scan the history backwards for the most recent earlier occurrence of its last n tokens."""
    flags, pos = [], 1
    for a in lengths:
        if pos >= len(out):
            flags.append(False)
            continue
        hist = prompt + out[:pos]
        follow = next((hist[i + n] for i in range(len(hist) - n - 1, -1, -1) if hist[i:i + n] == hist[-n:]), None)
        flags.append(len(hist) >= n and follow == out[pos])
        pos += a
    return flags


def test_copy_steps_by_hand_and_against_a_scan():
    # prompt 1 2 3 4; output 9 (prefill) 1 2 3 4 5: only the step whose history ends "1 2 3" copies (-> 4)
    assert L.copy_steps([1, 2, 3, 4], [9, 1, 2, 3, 4, 5], [1] * 5) == [False, False, False, True, False]
    # a step that commits several tokens moves the next step's root past them: roots 9, 1, 3
    assert L.copy_steps([1, 2, 3, 4], [9, 1, 2, 3, 4, 5], [1, 2, 2]) == [False, False, True]
    assert L.copy_steps([1, 2, 3, 4], [9, 1, 2, 3, 4, 5], [1, 3, 1]) == [False, False, False]
    rng = random.Random(0)
    hits = 0
    for _ in range(200):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        out = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        lengths = [rng.randrange(1, 4) for _ in range(len(out))]
        got = L.copy_steps(prompt, out, lengths)
        assert got == brute_copy_steps(prompt, out, lengths)
        hits += sum(got)
    assert hits > 50  # the random text repeats: the comparison covers copy steps


def test_branches_respect_max_len_and_restart_on_another_sequence():
    index = L.LookupIndex(L.LookupParams(max_len=16))
    index.sync([1, 2, 3, 4, 5, 6, 1, 2])
    assert trie_prefixes(index.branches(max_len=2).root) == {(3,): 1, (3, 4): 1}
    index.sync([9, 9])  # not an extension of the indexed history: a new index
    assert index.branches().match_len == 1 and trie_prefixes(index.branches().root) == {(9,): 1}


# ---------------------------------------------------------------- the merged tree
def random_scores(seed: int) -> L.LookupScores:
    g = random.Random(seed)
    shape = (len(L.MATCH_BUCKETS) + 1, len(L.SHARE_BUCKETS) + 1, len(L.DEPTH_BUCKETS) + 1)
    return L.LookupScores([[[math.log(g.uniform(0.05, 0.95)) for _ in range(shape[2])] for _ in range(shape[1])]
                           for _ in range(shape[0])])


def brute_force_merged(logp: torch.Tensor, br: L.Branches, scores: L.LookupScores) -> dict:
    """Every path that the marginal tables or the lookup trie allow, with its merged score."""
    D, V = logp.shape

    def edges(path, trie):
        out = {}
        if len(path) < D:
            out = {t: [float(logp[len(path), t]), None] for t in range(V)}
        if trie is not None and trie.children:
            for tok, child in trie.children.items():
                lp = scores.edge(br.match_len, trie, child, len(path) + 1)
                out[tok] = [combine(out[tok][0], lp) if tok in out else lp, child]
        return out

    scored, frontier = {}, [((), 0.0, br.root)]
    while frontier:
        path, score, trie = frontier.pop()
        for tok, (lp, child) in edges(path, trie).items():
            scored[path + (tok,)] = score + lp
            frontier.append((path + (tok,), score + lp, child))
    return scored


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [2, 5, 12, 30])
def test_merged_tree_is_the_best_paths(seed, budget):
    g = torch.Generator().manual_seed(seed)
    D, V = 2, 4
    logp = torch.randn(D, V, generator=g).log_softmax(-1)
    rng = random.Random(seed)
    toks = [rng.randrange(V) for _ in range(30)]
    index = L.LookupIndex(L.LookupParams(max_len=5, occurrences=4))
    index.sync(toks)
    br, scores = index.branches(), random_scores(seed)
    assert br.match_len > 0
    tree = best_first(toks[-1], budget, marginal_transitions(logp, budget), br, scores)
    scored = brute_force_merged(logp, br, scores)
    toks_, pars = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, len(toks_)):
        paths.append(paths[pars[i]] + (toks_[i],))
    assert len(set(paths)) == len(paths) == min(budget, 1 + len(scored))  # no token twice under one parent
    got = sorted((scored[p] for p in paths[1:]), reverse=True)
    want = sorted(scored.values(), reverse=True)[:budget - 1]
    assert got == pytest.approx(want, abs=1e-9)
    if budget == 30:  # more nodes than the drafter's D=2 tables hold: lookup paths run deeper
        assert any(len(p) > D for p in paths)
    assert tree.depths.tolist() == [len(p) for p in paths]


def test_lookup_alone_and_merged_sources():
    scores = random_scores(0)
    index = L.LookupIndex()
    index.sync([4, 5, 6, 7, 4, 5])
    br = index.branches()
    alone = best_first(5, 8, None, br, scores)
    assert alone.tokens.tolist() == [5, 6, 7, 4, 5] and alone.parents.tolist() == [-1, 0, 1, 2, 3]
    # the drafter proposes the lookup's first token too: one child, with the combined score
    logp = torch.full((1, 8), -10.0)
    logp[0, 6] = math.log(0.5)
    merged = best_first(5, 3, marginal_transitions(logp, 3), br, scores)
    assert merged.tokens.tolist()[:2] == [5, 6] and merged.tokens.tolist().count(6) == 1
    assert combine(math.log(0.5), math.log(0.5)) == pytest.approx(math.log(0.75))


# ---------------------------------------------------------------- calibration
def test_calibration_counts_by_hand():
    """seq 7 1 2 | 7 1 3 (prompt of 3): at root 7 the suffix [7] continues 1 2 7 (1 agrees, 2 does
    not); at root 1 the suffix [7 1] continues 2 7 1 (2 does not agree)."""
    counts = L.count_agreements([([7, 1, 2, 7, 1, 3], 3)])
    nonzero = {(m, s, d): tuple(c) for m, plane in enumerate(counts) for s, row in enumerate(plane)
               for d, c in enumerate(row) if c != [0, 0]}
    one, two, unanimous = L.bucket(1, L.MATCH_BUCKETS), L.bucket(2, L.MATCH_BUCKETS), L.bucket(1.0, L.SHARE_BUCKETS)
    assert nonzero == {(one, unanimous, 0): (1, 1), (one, unanimous, 1): (1, 0), (two, unanimous, 0): (1, 0)}
    log_p = L.scores_from_counts(counts)
    assert log_p[one][unanimous][0] > log_p[two][unanimous][0]  # agreed once vs not


def test_shipped_scores_load_and_are_log_probabilities():
    s = L.LookupScores.load()
    cells = [v for plane in s.table for row in plane for v in row]
    assert len(s.table) == len(L.MATCH_BUCKETS) + 1 and all(v < 0 for v in cells)


# ---------------------------------------------------------------- losslessness
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 11, 12, 5, 6, 7]
N = 48


@pytest.fixture(scope="module", params=["hf", "static"])
def setup(request):
    ref = vanilla(tiny_target("llama", logit_scale=3.0), PROMPT, N)
    target = tiny_target("llama", logit_scale=3.0).set_backend(request.param)
    return target, tiny_drafter(target, block_size=4), ref


@pytest.mark.parametrize("method", LOOKUP_METHODS)
@pytest.mark.parametrize("budget", [2, 5, 16, 33])
def test_lookup_methods_are_lossless(setup, method, budget):
    target, drafter, ref = setup
    stats = Stats()
    if method == "lookup":
        p = make_proposer("lookup", None, target.embed, target.lm_head, TreeParams(budget))
    else:
        p = oracle(method, target, drafter, PROMPT + ref, budget)
    assert run(target, p, PROMPT, N, stats=stats) == ref
    assert sum(stats.acceptance_lengths) + 1 == N


def test_lookup_branches_are_accepted_beyond_the_block(setup):
    """A repetitive continuation: lookup paths deeper than the drafter's block are accepted, and
    the drafter's context still receives every accepted token's features, in order."""
    target, drafter, ref = setup
    cycle = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    prompt = cycle * 4
    want = vanilla(target, prompt, N)
    positions = []
    extend = drafter.extend
    drafter.extend = lambda cache, feats, pos, **kw: (positions.extend(pos.tolist()), extend(cache, feats, pos, **kw))
    try:
        stats = Stats()
        p = make_proposer("treeflash+lookup", drafter, target.embed, target.lm_head, TreeParams(16, 4, 4))
        assert run(target, p, prompt, N, stats=stats) == want
    finally:
        del drafter.extend
    plain = Stats()
    run(target, make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(16, 4, 4)),
        prompt, N, stats=plain)
    assert max(stats.acceptance_lengths) > drafter.block_size, "no path deeper than the block was accepted"
    assert stats.mean_acceptance_length > plain.mean_acceptance_length
    # the prefill's prompt, then each step's root and accepted tokens: every position once, in order
    assert positions == list(range(len(prompt) + N - 1))


def test_lookup_needs_no_drafter_and_the_others_do():
    target = tiny_target("llama")
    assert make_proposer("lookup", None, target.embed, target.lm_head, TreeParams(8)).drafter is None
    from treeflash.errors import TreeflashError

    with pytest.raises(TreeflashError, match="needs a drafter"):
        make_proposer("marginal+lookup", None, target.embed, target.lm_head, TreeParams(8))


def test_selftest_exactness_rows_cover_every_method():
    """`treeflash selftest` (the GPU check) on the CPU, small: every fp32 run equals plain decoding."""
    from treeflash.bench.selftest import ARCHS, exactness

    rows = exactness("cpu", budgets=(5,), n=12)
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    assert {r["method"] for r in fp32} == set(METHODS) and {r["arch"] for r in fp32} == set(ARCHS)
    assert {r["backend"] for r in fp32} == {"hf", "static"}
    assert all(r["identical"] and r["tokens_before_first_difference"] == 12 for r in fp32)
    assert any(r["tau"] > 1 for r in fp32)  # drafts were accepted: the comparison saw tree steps


def test_selftest_catches_a_backend_that_loses_its_cache(monkeypatch):
    """The selftest's reference is a full recompute, not the backend's own plain decoding: a backend
    whose steps silently run without their KV cache (an unknown cache argument swallowed by **kwargs,
    as an older transformers did) fails every method, plain decoding included."""
    from treeflash.bench.selftest import exactness
    from treeflash.models import target as target_mod

    init = target_mod.HFPath.__init__

    def lossy(self, *a, **kw):
        init(self, *a, **kw)
        self.cache_arg = "kv_cache_under_a_name_the_model_ignores"

    monkeypatch.setattr(target_mod.HFPath, "__init__", lossy)
    rows = [r for r in exactness("cpu", budgets=(5,), n=8, backends=("hf",)) if r["dtype"] == "float32"]
    assert not any(r["identical"] for r in rows if r["method"] == "vanilla")


def test_selftest_batch_rows_cover_every_method():
    """The selftest's batched section on the CPU: one staggered request per method, each equal to its
    full-recompute reference."""
    from treeflash.bench.selftest import ARCHS, batch_exactness

    rows = batch_exactness("cpu", n=10)
    assert {r["method"] for r in rows} == set(METHODS) and {r["arch"] for r in rows} == set(ARCHS)
    assert all(r["identical"] for r in rows)


def test_selftest_batch_check_fails_on_a_wrong_batch(monkeypatch):
    """It can fail: a batch that emits one wrong token per step is caught."""
    from treeflash.bench.selftest import batch_exactness
    from treeflash.decoding.batch import BatchDecoder

    step = BatchDecoder.step

    def wrong(self):
        return {sid: [t + 1 for t in toks] for sid, toks in step(self).items()}

    monkeypatch.setattr(BatchDecoder, "step", wrong)
    assert not any(r["identical"] for r in batch_exactness("cpu", n=6))
