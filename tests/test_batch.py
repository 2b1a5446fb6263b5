"""Batched decoding (decoding/batch.py, models/kvcache.py): every sequence of a batch decodes
exactly what it decodes alone in the bs=1 loop, with staggered arrivals, a pool too small for all
requests at once (admission waits), stop ids, max_new_tokens of 1 and a cancel in the middle."""
from dataclasses import dataclass, replace

import pytest
import torch

from treeflash.config import GenerationConfig
from treeflash.decoding.batch import BatchDecoder
from treeflash.decoding.generate import decode
from treeflash.decoding.lookup import LookupParams
from treeflash.decoding.proposers import TreeParams, make_proposer
from treeflash.decoding.sampling import SamplingParams
from treeflash.decoding.stats import Stats
from treeflash.errors import TreeflashError
from treeflash.models.kvcache import PAGE_SIZE, BatchCache, StaticKV, round_up

from conftest import ORACLES, tiny_drafter, tiny_target, vanilla

METHODS = ["vanilla", "chain", "marginal", "treeflash", "lookup", "treeflash+lookup"]
DRAFTED = {"chain", "marginal", "treeflash", "treeflash+lookup"}
CAPACITY = 192  # slots: less than the requests' reservations together, so some wait


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    n: int                   # max_new_tokens
    budget: int
    arrive: int              # the step before which it is added
    stop_at: int | None = None   # a stop id: the greedy reference's token at this index
    cancel: int | None = None    # the step before which it is cancelled
    seed: int | None = None


REQS = [
    Req(list(range(3, 8)), 40, 8, 0),
    Req(list(range(5, 74, 3)), 17, 16, 0, stop_at=9),
    Req([7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10], 30, 5, 2),  # repeats: lookup branches match
    Req(list(range(90, 28, -2)), 25, 12, 3, cancel=6),
    Req([11, 12], 1, 8, 4),                                   # ends at its prefill
    Req(list(range(40, 49)), 12, 8, 4, stop_at=0),            # its first token is a stop id
    Req(list(range(60, 80)), 21, 6, 7),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    target = tiny_target(request.param, logit_scale=3.0).set_backend("static")
    drafter = tiny_drafter(target, block_size=8)
    greedy = [vanilla(target, r.prompt, r.n) for r in REQS]  # the oracles' references
    return target, drafter, greedy


class Decoy:
    """Over conftest's oracles: the reference token is boosted, and often a decoy is ranked just
    above it, so accepted paths also run through second children (tree nodes that come after
    non-ancestors: only the ancestor mask keeps those apart)."""

    decoy_rate = 0.4

    def _boost(self, row: torch.Tensor, depth: int) -> None:
        tok = self._ref(depth)
        if tok is None:
            return
        row[tok] += self.bonus * (1 + self._rng.random())
        if self._rng.random() < self.decoy_rate:
            row[self._rng.randrange(row.shape[0])] = row[tok] + 0.5


DECOYS = {name: type(f"Decoy{cls.__name__}", (Decoy, cls), {}) for name, cls in ORACLES.items()}


def proposer(method, target, drafter, reference, budget):
    """A decoy oracle for the drafter methods (NAME+lookup: with lookup branches), else the method's own."""
    base, _, plus = method.partition("+")
    if base not in DECOYS:
        return make_proposer(method, None, target.embed, target.lm_head, TreeParams(budget))
    p = DECOYS[base](drafter, target.embed, target.lm_head, TreeParams(budget, 4, 4, stage2_vocab=0),
                     LookupParams() if plus else None)
    p.reference = reference
    return p


def stop_ids(req, greedy):
    return set() if req.stop_at is None else {greedy[req.stop_at]}


def alone(target, drafter, greedy, methods, sampling=SamplingParams(), reqs=REQS):
    """Each request decoded by the bs=1 loop: (tokens, stats) per request."""
    out = []
    for r, g, m in zip(reqs, greedy, methods):
        stats = Stats()
        p = proposer(m, target, drafter, r.prompt + g, r.budget)
        toks = list(decode(target, p, r.prompt, r.n, sampling, seed=r.seed, stats=stats,
                           stop_ids=stop_ids(r, g)))
        out.append((toks, stats))
    return out


def batched(target, drafter, greedy, methods, sampling=SamplingParams(), reqs=REQS, capacity=CAPACITY,
            prefill_chunk=None):
    """The requests through one BatchDecoder, added and cancelled at their steps. Returns
    (tokens per request, the decoder, the batch size of each step's target forward); the
    decoder's `finished` is re-keyed by request index."""
    dec = BatchDecoder(target, drafter, capacity=capacity, prefill_chunk=prefill_chunk)
    sizes = []
    decode_step = dec._decode
    dec._decode = lambda seqs, out: sizes.append(len(seqs)) or decode_step(seqs, out)
    ids, toks, step = {}, {}, 0
    while step <= max(r.arrive for r in reqs) or dec.busy:
        for i, (r, g, m) in enumerate(zip(reqs, greedy, methods)):
            if r.arrive == step:
                cfg = GenerationConfig(max_new_tokens=r.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                       sampling_top_k=sampling.top_k, seed=r.seed)
                ids[i] = dec.add(r.prompt, cfg, proposer=proposer(m, target, drafter, r.prompt + g, r.budget),
                                 stop_ids=stop_ids(r, g))
                toks[ids[i]] = []
            if r.cancel == step:
                dec.cancel(ids[i])
        for sid, new in dec.step().items():
            toks[sid] += new
        step += 1
    dec.finished = {i: dec.finished[sid] for i, sid in ids.items()}
    return [toks[ids[i]] for i in range(len(reqs))], dec, sizes


def check_against_alone(got, dec, ref, drafted: bool, reqs=REQS):
    for i, (r, (want, stats)) in enumerate(zip(reqs, ref)):
        st = dec.finished[i].stats
        if r.cancel is not None:
            assert got[i] == want[:len(got[i])] and len(got[i]) < len(want), i
            assert st.finish_reason == "abort"
        else:
            assert got[i] == want, i
            assert st.finish_reason == stats.finish_reason, i
    assert dec.cache.free_slots == dec.cache.capacity and dec.cache.reserved_slots == 0
    assert not dec.running and not dec.waiting
    if drafted:  # the oracle's trees are accepted deep: the test covers long accepted paths
        steps = [dec.finished[i].stats for i, r in enumerate(reqs) if r.n > 20 and r.cancel is None]
        assert sum(sum(s.acceptance_lengths) for s in steps) / sum(s.steps for s in steps) > 1.5


@pytest.mark.parametrize("method", METHODS)
def test_batched_greedy_equals_alone(setup, method):
    target, drafter, greedy = setup
    methods = [method] * len(REQS)
    got, dec, sizes = batched(target, drafter, greedy, methods)
    check_against_alone(got, dec, alone(target, drafter, greedy, methods), method in DRAFTED)
    assert max(sizes) >= 3, "several sequences should share a forward"
    assert any(r.stop_at is not None and len(g) < r.n for r, g in zip(REQS, got)), "a stop id should end one"


@pytest.mark.parametrize("method", ["vanilla", "treeflash+lookup"])
def test_chunked_prefill_equals_alone(setup, method):
    """Prompts prefilled 7 tokens per step (several chunks for most, chunks of two prompts in one
    forward) decode what they decode alone."""
    target, drafter, greedy = setup
    methods = [method] * len(REQS)
    got, dec, _ = batched(target, drafter, greedy, methods, prefill_chunk=7)
    check_against_alone(got, dec, alone(target, drafter, greedy, methods), method in DRAFTED)


@pytest.mark.parametrize("method", ["vanilla", "treeflash+lookup"])
def test_compiled_batched_steps_equal_alone_and_compile_nothing_inside(method):
    """On the compiled backend a batch's tree forward runs the compiled step graphs (rows padded to
    a bucket; padding rows write the pool's spare slots): every request decodes what it decodes
    alone, fp32 greedy, and after `warm` no step compiles anything."""
    from torch._dynamo.utils import counters

    target = tiny_target("llama", logit_scale=3.0).set_backend("compiled")
    drafter = tiny_drafter(target, block_size=8)
    reqs = [replace(r, budget=4) for r in REQS[:4]]  # at most 16 rows: buckets 1..16 (compiling costs seconds)
    greedy = [vanilla(target, r.prompt, r.n) for r in reqs]
    methods = [method] * len(reqs)
    ref = alone(target, drafter, greedy, methods, reqs=reqs)
    runner, rows = target.runner, []
    compiled_step = runner._compiled_step

    def spy(taps):
        step = compiled_step(taps)

        def run(ids, pos, slots, mask, cache, tap_ids):
            pages = cache.capacity - runner.spare_slots
            rows.append((len(ids), int((slots >= pages).sum())))  # (bucket, padding rows: on spare slots)
            return step(ids, pos, slots, mask, cache, tap_ids)
        return run

    BatchDecoder(target, drafter, capacity=CAPACITY).warm(4 * len(reqs))
    graphs = counters["stats"]["unique_graphs"]
    runner._compiled_step = spy
    try:
        got, dec, sizes = batched(target, drafter, greedy, methods, reqs=reqs)
    finally:
        del runner._compiled_step
    check_against_alone(got, dec, ref, method in DRAFTED, reqs=reqs)
    assert counters["stats"]["unique_graphs"] == graphs, "a batched step compiled a graph"
    assert max(sizes) >= 3 and len(rows) == len(sizes), "every tree forward ran a compiled graph"
    if method in DRAFTED:  # trees of 1..4 nodes per sequence: most steps are padded to a bucket
        assert max(b for b, _ in rows) >= 8 and any(pad for _, pad in rows)


def test_a_long_prompt_does_not_stall_the_batch(setup):
    """While a 120-token prompt is prefilled 16 tokens per step, the running sequence emits tokens
    at every step, and the prompt takes ceil(120 / 16) steps to its first token."""
    target, drafter, _ = setup
    dec = BatchDecoder(target, drafter, capacity=512, prefill_chunk=16)
    cfg = GenerationConfig(method="vanilla", max_new_tokens=30, ignore_eos=True)
    first = dec.add(list(range(3, 9)), cfg)
    dec.step()
    long = dec.add([(7 * i) % 100 + 3 for i in range(120)], cfg)
    steps = 0
    while True:
        out = dec.step()
        steps += 1
        assert out.get(first), "the running sequence emits at every step"
        if long in out:
            break
    assert steps == 8
    assert dec.running[long].filled == 120


def test_prefill_chunk_must_be_positive_prompts_non_empty_and_one_drafter(setup):
    """One drafter pass per step: a proposer that drafts with another drafter than the decoder's is refused."""
    import copy

    target, drafter, _ = setup
    with pytest.raises(TreeflashError, match="prefill_chunk"):
        BatchDecoder(target, drafter, prefill_chunk=0)
    with pytest.raises(TreeflashError, match="empty prompt"):
        BatchDecoder(target, drafter).add([], GenerationConfig(method="treeflash", tree_size=4))
    other = make_proposer("chain", copy.deepcopy(drafter), target.embed, target.lm_head, TreeParams(4))
    with pytest.raises(TreeflashError, match="one drafter"):
        BatchDecoder(target, drafter).add([5, 6], proposer=other)


def test_chunked_prefill_gives_the_drafter_the_whole_context(setup):
    """A real drafter's context after a prompt prefilled in 7-token chunks holds every prompt row, at
    its position: its keys and values match those of a prompt prefilled whole (to float32 rounding
    of differently shaped matrix products: a row missed or misplaced differs by far more), and the
    first step's drafter states match too."""
    target, drafter, _ = setup
    prompt = list(range(3, 34))
    cfg = GenerationConfig(method="treeflash", tree_size=8, max_new_tokens=6, ignore_eos=True)
    states = []
    for chunk in (None, 7):
        dec = BatchDecoder(target, drafter, capacity=256, prefill_chunk=chunk)
        sid = dec.add(prompt, cfg)
        while dec.running.get(sid) is None or dec.running[sid].prefilling:
            dec.step()
        seq = dec.running[sid]
        states.append((seq.dcache, dec._draft([seq])[seq]))
    (whole, h_whole), (chunked, h_chunked) = states
    assert whole.length == chunked.length == len(prompt)
    for i in range(len(drafter.model.layers)):
        for a, b in ((whole.k[i], chunked.k[i]), (whole.v[i], chunked.v[i])):
            assert a.shape == b.shape and (a - b).abs().max() < 1e-4 * (1 + a.abs().max())
    assert (h_whole - h_chunked).abs().max() < 1e-4 * (1 + h_whole.abs().max())


def test_mixed_methods_in_one_batch(setup):
    target, drafter, greedy = setup
    methods = (METHODS * 2)[:len(REQS)]
    got, dec, _ = batched(target, drafter, greedy, methods)
    check_against_alone(got, dec, alone(target, drafter, greedy, methods), drafted=False)


def test_sampled_tokens_equal_alone_per_seed(setup):
    """Each request has its own RNG, drawn once per visited node as in the bs=1 loop: a seeded
    request samples the same tokens in a batch as alone."""
    target, drafter, greedy = setup
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    reqs = [replace(r, seed=100 + i) for i, r in enumerate(REQS)]
    methods = ["vanilla", "chain", "treeflash", "treeflash+lookup", "marginal", "lookup", "treeflash"]
    got, dec, _ = batched(target, drafter, greedy, methods, sampling, reqs)
    check_against_alone(got, dec, alone(target, drafter, greedy, methods, sampling, reqs), drafted=False)
    assert any(g != s[:len(g)] for g, s in zip(got, greedy)), "sampling should leave the greedy path"


@pytest.mark.parametrize("wrong", ["leak", "causal"])
def test_a_wrong_mask_breaks_exactness(setup, monkeypatch, wrong):
    """The exactness tests bite: rows that also see other sequences' slots (leak), or every
    earlier node of their tree instead of their ancestors (causal), change the outputs."""
    target, drafter, greedy = setup
    step_mask = BatchCache.step_mask

    def bad(self, parts, slots, width):
        if wrong == "causal":
            return step_mask(self, [(i, n, None) for i, n, _ in parts], slots, width)
        mask = step_mask(self, parts, slots, width)
        for i in self.seqs:
            mask[:, self.held(i)] = True
        return mask

    monkeypatch.setattr(BatchCache, "step_mask", bad)
    methods = ["treeflash"] * len(REQS)
    got, _, _ = batched(target, drafter, greedy, methods)
    ref = alone(target, drafter, greedy, methods)
    assert any(g != w[:len(g)] for g, (w, _) in zip(got, ref))


def test_pages_round_up_to_one_page_size():
    """One page size and one rounding rule for the pool, the decoder and the server's pool size."""
    from treeflash.serve.worker import pool_slots
    from treeflash.serve.jobs import ServeConfig

    assert [round_up(n, 16) for n in (1, 16, 17, 32)] == [16, 16, 32, 32]
    cache = BatchCache(StaticKV(1, 1, 1, 2 * PAGE_SIZE, torch.float32, "cpu"))
    assert cache.page_size == PAGE_SIZE and [cache.pages_for(n) for n in (0, 1, PAGE_SIZE, PAGE_SIZE + 1)] == [0, 1, 1, 2]
    cfg = ServeConfig(model_name="m", max_tokens_limit=100, max_prompt_tokens=10, max_batch=3)
    assert pool_slots(1000, cfg, rows=8) == 3 * round_up(118, PAGE_SIZE)


def test_pool_pages_compaction_and_free():
    """Pages are taken on demand, compaction moves kept rows (every layer, k and v) and gives the
    pages past them back; `free` returns the rest; admission refuses what does not fit."""
    kv = StaticKV(2, 1, 1, 32, torch.float32, "cpu")
    cache = BatchCache(kv, page_size=4)
    cache.add(0, 12)
    cache.add(1, 12)
    assert not cache.fits(12) and cache.fits(8)
    s1 = cache.write(1, 3)
    cache.compact({1: torch.arange(3)})
    slots = cache.write(0, 7)  # logical 0..6: two pages, the lowest free ones
    assert cache.seqs[0].pages == [1, 2] and s1.tolist() == [0, 1, 2] and slots.tolist() == [4, 5, 6, 7, 8, 9, 10]
    for t in kv.k + kv.v:
        t[0, 0, slots, 0] = torch.arange(7.0)
    cache.compact({0: torch.tensor([0, 2, 6])})
    assert cache.length(0) == 3 and cache.seqs[0].pages == [1]  # page 2 went back
    for t in kv.k + kv.v:
        assert t[0, 0, cache.held(0), 0].tolist() == [0.0, 2.0, 6.0]
    # a step: sequence 0 a 2-node chain tree (slots 7, 8: page 2 again), sequence 1 one root (slot 3)
    new = torch.cat([cache.write(0, 2), cache.write(1, 1)])
    assert new.tolist() == [7, 8, 3] and cache.width([0, 1]) == 12
    mask = cache.step_mask([(0, 2, torch.tensor([[True, False], [True, True]])), (1, 1, None)], new, 12)
    assert [m.nonzero().flatten().tolist() for m in mask] == [[4, 5, 6, 7], [4, 5, 6, 7, 8], [0, 1, 2, 3]]
    cache.free(0)
    cache.free(1)
    assert cache.free_slots == 32 and cache.reserved_slots == 0


def test_engine_generate_batch_equals_generate():
    from treeflash.api import Engine

    target = tiny_target("llama", logit_scale=3.0)
    engine = Engine(target, tiny_drafter(target), backend="static")
    prompts = [list(range(3, 12)), list(range(20, 50, 2)), [5, 6, 5, 6, 5, 6]]
    for kw in ({}, {"temperature": 1.0, "seed": 7}):
        cfg = engine.config(method="treeflash", tree_size=6, max_new_tokens=14, ignore_eos=True, **kw)
        got = engine.generate_batch(prompts, cfg)
        for p, res in zip(prompts, got):
            want = engine.generate(p, cfg)
            assert (res.token_ids, res.text) == (want.token_ids, want.text)
            assert res.stats.new_tokens == 14 and res.stats.finish_reason == "length"


def test_needs_a_fastpath_backend_and_a_pool_large_enough():
    target = tiny_target("llama")
    with pytest.raises(TreeflashError, match="static or a compiled backend"):
        BatchDecoder(target.set_backend("hf"))
    dec = BatchDecoder(target.set_backend("static"), capacity=32)
    with pytest.raises(TreeflashError, match="exceeds the pool"):
        dec.add(list(range(10)), GenerationConfig(method="vanilla", max_new_tokens=40))


def test_one_drafter_pass_drafts_what_each_block_drafts_alone():
    """`Drafter.draft_blocks` (all blocks in one pass, each seeing its own context) and
    `extend_contexts` (all contexts' keys / values in one pass) against the drafter run per sequence."""
    from treeflash.models.kvcache import DraftCache

    target = tiny_target("qwen2")
    drafter = tiny_drafter(target, block_size=8)
    n_layers, width = len(drafter.model.layers), drafter.model.fc.in_features
    gen = torch.Generator().manual_seed(0)
    lens, roots, depths = [5, 17, 9], [3, 40, 77], [7, 2, 4]
    batch = [DraftCache(n_layers) for _ in lens]
    alone = [DraftCache(n_layers) for _ in lens]
    with torch.no_grad():
        for n in (lens, [3, 1, 2]):  # a prompt, then a step's accepted rows
            feats = [torch.randn(k, width, generator=gen) for k in n]
            pos = [torch.arange(c.length, c.length + k) for c, k in zip(alone, n)]
            drafter.extend_contexts(list(zip(batch, feats, pos)))
            for c, f, p in zip(alone, feats, pos):
                drafter.extend(c, f, p)
        blocks = [target.embed(torch.tensor([r] + [drafter.config.mask_token_id] * d)) for r, d in zip(roots, depths)]
        got = drafter.draft_blocks([(c, b, c.length) for c, b in zip(batch, blocks)])
        for c, b, blk, h in zip(alone, batch, blocks, got):
            torch.testing.assert_close(h, drafter.draft(c, blk, c.length), atol=1e-5, rtol=1e-5)
            assert b.length == c.length and all(torch.equal(x, y) or torch.allclose(x, y, atol=1e-6)
                                                for x, y in zip(b.k + b.v, c.k + c.v))


class Boom(SamplingParams):
    """A sampler that raises once it has been asked `after` times (a fault of one sequence)."""

    calls = [0]
    after = 3

    @property
    def greedy(self):
        Boom.calls[0] += 1
        if Boom.calls[0] > Boom.after:
            raise RuntimeError("boom")
        return True


def test_a_faulty_sequence_ends_alone(setup):
    """One sequence's sampler raises mid-decode: it alone ends ("error", its exception kept), the
    others decode exactly what they decode alone, and the pool is whole again."""
    target, drafter, greedy = setup
    methods = ["treeflash+lookup"] * len(REQS)
    ref = alone(target, drafter, greedy, methods)
    dec = BatchDecoder(target, drafter, capacity=1024)
    ids = [dec.add(r.prompt, GenerationConfig(max_new_tokens=r.n),
                   proposer=proposer(m, target, drafter, r.prompt + g, r.budget), stop_ids=stop_ids(r, g))
           for r, g, m in zip(REQS[:3], greedy, methods)]
    Boom.calls[0] = 0
    dec.waiting[1].sampling = Boom()
    toks = {i: [] for i in ids}
    while dec.busy:
        for sid, new in dec.step().items():
            toks[sid] += new
    bad = dec.finished[ids[1]]
    assert bad.stats.finish_reason == "error" and isinstance(bad.error, RuntimeError)
    for i in (0, 2):
        assert toks[ids[i]] == ref[i][0] and dec.finished[ids[i]].error is None
    assert dec.cache.free_slots == dec.cache.capacity and dec.cache.reserved_slots == 0


@pytest.mark.parametrize("always", [False, True])
def test_a_failed_shared_forward_is_retried_per_sequence(setup, always):
    """The batch's target forward raises whenever it holds sequence B's rows beside others (or
    always, with B's rows): each sequence runs alone once more, so only B can fail, and the
    others stay exact."""
    target, drafter, greedy = setup
    methods = ["treeflash+lookup"] * 3
    ref = alone(target, drafter, greedy, methods, reqs=REQS[:3])
    dec = BatchDecoder(target, drafter, capacity=1024)
    ids = [dec.add(r.prompt, GenerationConfig(max_new_tokens=r.n),
                   proposer=proposer(m, target, drafter, r.prompt + g, r.budget), stop_ids=stop_ids(r, g))
           for r, g, m in zip(REQS[:3], greedy, methods)]
    forward, faults = dec._forward, [0]

    def flaky(parts, flat=False):
        mine = any(s.id == ids[1] for s, *_ in parts)
        if mine and (always or len(parts) > 1):
            faults[0] += 1
            raise RuntimeError("forward fault")
        return forward(parts, flat=flat)

    dec._forward = flaky
    toks = {i: [] for i in ids}
    while dec.busy:
        for sid, new in dec.step().items():
            toks[sid] += new
    assert faults[0] > 0
    for i in (0, 2):
        assert toks[ids[i]] == ref[i][0]
    b = dec.finished[ids[1]]
    if always:
        assert b.stats.finish_reason == "error" and isinstance(b.error, RuntimeError)
    else:
        assert toks[ids[1]] == ref[1][0] and b.error is None
    assert dec.cache.free_slots == dec.cache.capacity and dec.cache.reserved_slots == 0
