"""Greedy losslessness: every method and tree size gives exactly plain greedy decoding (fp32)."""
import itertools
import pytest
import torch

from treeflash.decoding.stats import Stats
from treeflash.decoding.proposers import TreeParams, make_proposer

from conftest import block_states, oracle, run, tiny_drafter, tiny_target, vanilla

METHODS = ["chain", "marginal", "treeflash"]
BUDGETS = [1, 2, 5, 16, 33]
PROMPT = list(range(3, 40, 2))
N = 48


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module", params=["hf", "static"])
def setup(request, arch):
    """The reference is plain greedy decoding on the HF backend (the model's own forward)."""
    ref = vanilla(tiny_target(arch, logit_scale=3.0), PROMPT, N)
    target = tiny_target(arch, logit_scale=3.0).set_backend(request.param)
    drafter = tiny_drafter(target, block_size=8)
    assert vanilla(target, PROMPT, N) == ref
    return target, drafter, ref


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_oracle_drafts_are_lossless(setup, method, budget):
    """Drafts biased towards the true continuation: long accepted paths, still identical output."""
    target, drafter, ref = setup
    stats = Stats()
    out = run(target, oracle(method, target, drafter, PROMPT + ref, budget), PROMPT, N, stats=stats)
    assert out == ref
    assert sum(stats.acceptance_lengths) + 1 == N  # every step's tokens, plus the prefill token
    if budget >= 5:
        assert stats.mean_acceptance_length > 1.5, "the oracle should be accepted: the test must bite"


@pytest.mark.parametrize("method", METHODS)
def test_random_drafter_is_lossless(setup, method):
    target, drafter, ref = setup
    proposer = make_proposer(method, drafter, target.embed, target.lm_head, TreeParams(12, 3, 3))
    assert run(target, proposer, PROMPT, N) == ref


def test_stage2_vocabulary_is_lossless_and_matches_full_when_wide(setup):
    """The stage-2 column subset changes only the tree; with all columns it is the full table."""
    target, drafter, ref = setup
    V = target.vocab_rows
    for cols in (8, 32):
        p = make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(12, 3, 3, cols))
        assert run(target, p, PROMPT, N) == ref
    full = make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(12, 3, 3, 0))
    wide = make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(12, 3, 3, V))
    from treeflash.models.kvcache import DraftCache
    cache = DraftCache(1)
    feats = torch.randn(len(PROMPT), 2 * target.config.hidden_size)
    drafter.extend(cache, feats, torch.arange(len(PROMPT)))
    h = block_states(full, cache, PROMPT[-1], len(PROMPT), 7)
    a, b = full.heads(h, PROMPT[-1]), wide.heads(h, PROMPT[-1])
    assert torch.equal(a.next_tok, b.next_tok) and torch.equal(a.first_tok, b.first_tok)
    torch.testing.assert_close(a.next_logp, b.next_logp)


@pytest.mark.parametrize("block_len, rows", [(0, 5), (3, 3), (2, 2), (8, 8), (64, 8)])
def test_block_pass_is_as_long_as_asked_and_lossless(setup, monkeypatch, block_len, rows):
    """block_len 0: the block pass is as deep as a budget-5 tree reaches (5 rows, root included);
    N: N rows, at most the drafter's block (8); shorter only where the generation ends. Each is
    lossless, and the heads read every row of a short block (a tree as deep as the block)."""
    target, drafter, ref = setup
    seen, depths = [], []
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda cache, emb, start: seen.append(emb.shape[0]) or draft(cache, emb, start))
    p = make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(5, 3, 3, block_len=block_len))
    heads = p.heads
    monkeypatch.setattr(p, "heads", lambda h, root: depths.append(h.shape[0]) or heads(h, root))
    assert run(target, p, PROMPT, N) == ref
    assert seen[0] == rows and max(seen) == rows and len(set(seen[:-rows])) == 1
    assert depths[0] == min(rows, 5)  # the heads go no deeper than the tree (budget 5: depth 4)


def test_vanilla_matches_hf_generate(setup):
    """Our plain loop equals transformers' own greedy generate."""
    target, _, ref = setup
    out = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False,
                                min_new_tokens=N, pad_token_id=0)
    assert out[0, len(PROMPT):].tolist() == ref


def test_max_new_tokens_is_exact(setup):
    target, drafter, ref = setup
    for n in (1, 2, 7):
        assert run(target, oracle("treeflash", target, drafter, PROMPT + ref, 16), PROMPT, n) == ref[:n]


def test_context_window_is_honoured():
    target = tiny_target("llama", max_pos=40, logit_scale=3.0)
    drafter = tiny_drafter(target)
    ref = vanilla(target, PROMPT, 100)
    assert len(PROMPT) + len(ref) == 40 - 1 + 1  # stops when the window is full
    out = run(target, oracle("marginal", target, drafter, PROMPT + ref, 16), PROMPT, 100)
    assert out == ref


def test_stop_token_ends_generation(setup):
    target, drafter, ref = setup
    stop = ref[10]
    first = ref.index(stop)
    p = oracle("treeflash", target, drafter, PROMPT + ref, 16)
    from treeflash.decoding.generate import decode
    from treeflash.decoding.sampling import SamplingParams
    stats = Stats()
    out = list(decode(target, p, PROMPT, N, SamplingParams(), stats=stats, stop_ids={stop}))
    assert out == ref[:first + 1]
    assert stats.finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_default_model_is_lossless(default_engine, method):
    """The real SmolLM2-135M target, random drafter, two tree sizes."""
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    ref = default_engine.generate(prompt, method="vanilla", max_new_tokens=40)
    ids = torch.tensor([default_engine.target.encode(prompt)])
    hf = default_engine.target.model.generate(ids, max_new_tokens=40, do_sample=False)
    assert hf[0, ids.shape[1]:].tolist() == ref.token_ids
    for budget in (4, 24):
        out = default_engine.generate(prompt, method=method, tree_size=budget, max_new_tokens=40)
        assert out.token_ids == ref.token_ids
        assert out.text == ref.text


def test_compiled_backend_is_lossless():
    """The compiled path (bucketed tree sizes, whole-cache mask) against HF plain greedy decoding."""
    ref = vanilla(tiny_target("llama", logit_scale=3.0), PROMPT, N)
    target = tiny_target("llama", logit_scale=3.0).set_backend("compiled")
    drafter = tiny_drafter(target, block_size=8)
    drafter.compile_drafting()  # as the engine does on this backend
    stats = Stats()
    out = run(target, oracle("treeflash", target, drafter, PROMPT + ref, 16), PROMPT, N, stats=stats)
    assert out == ref and stats.mean_acceptance_length > 1.5
    # the compiled block pass drafts what the eager one does, at any context length, also when it
    # appends the deferred context of the last step in the same call
    from treeflash.models.kvcache import DraftCache
    cache, ref_cache = DraftCache(len(drafter.model.layers)), DraftCache(len(drafter.model.layers))
    emb = target.embed(torch.arange(8))
    for i, n in enumerate((5, 3, 1, 2)):
        feats, pos = torch.randn(n, drafter.model.fc.in_features), torch.arange(cache.length, cache.length + n)
        drafter.extend(cache, feats, pos, defer=i % 2 == 1)
        drafter.extend(ref_cache, feats, pos)
        with torch.no_grad():
            got = drafter.draft(cache, emb, cache.length)
            want = drafter.forward_block(emb, torch.arange(cache.length, cache.length + 8),
                                         list(zip(ref_cache.k, ref_cache.v)))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert cache.pending is None and cache.length == ref_cache.length == ref_cache.k[0].shape[1]
        for a, b in zip(cache.k + cache.v, ref_cache.k + ref_cache.v):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compiled_cpp_backend_is_lossless_and_uses_the_cpp_gemm():
    """compiled-cpp: every matmul in inductor's C++ GEMM template (checked in the generated code),
    tree sizes 1 and 3 (bucket 4 with a padded row), against HF plain greedy decoding."""
    from torch._inductor.utils import run_and_get_code

    from treeflash.models.inductor import cpp_gemm_supported

    if not cpp_gemm_supported():
        pytest.skip("the C++ GEMM template needs an x86 CPU with AVX2 or AVX-512")
    ref = vanilla(tiny_target("llama", logit_scale=3.0), PROMPT, N)
    target = tiny_target("llama", logit_scale=3.0).set_backend("compiled-cpp")
    drafter = tiny_drafter(target, block_size=8)
    with torch._inductor.config.patch(fx_graph_cache=False):  # generate the code, not load it
        _, code = run_and_get_code(target.runner.warm, [4], drafter.config.target_layer_ids)
    assert code and all("micro_gemm" in c and "extern_kernels.mm" not in c and "mkl" not in c for c in code)
    with torch._inductor.config.patch(fx_graph_cache=False):  # the drafter's block pass, as the engine compiles it
        _, code = run_and_get_code(drafter.compile_drafting, True, cpp_gemm=True)
    assert drafter._compiled_cpp and len(code) >= 2  # the block pass, and with appended context
    assert all("micro_gemm" in c and "extern_kernels.mm" not in c and "mkl" not in c for c in code)
    for budget in (1, 3):
        stats = Stats()
        out = run(target, oracle("treeflash", target, drafter, PROMPT + ref, budget), PROMPT, N, stats=stats)
        assert out == ref and (budget == 1 or stats.mean_acceptance_length > 1.5)


def test_compiled_cpp_backend_refuses_a_cpu_without_it(monkeypatch):
    from treeflash.errors import TreeflashError
    from treeflash.models import fastpath

    monkeypatch.setattr(fastpath, "cpp_gemm_supported", lambda: False)  # where FastPath looks it up
    with pytest.raises(TreeflashError, match="compiled-cpp needs an x86 CPU"):
        tiny_target("llama").set_backend("compiled-cpp")


def test_budget_one_is_plain_decoding_without_drafter_work():
    """A 1-node tree proposes nothing, so the drafter is not run at all (not even its context update)."""
    target = tiny_target("llama", logit_scale=3.0)
    drafter = tiny_drafter(target)
    calls = []
    drafter.extend = lambda *a, **k: calls.append(1)
    p = make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(1))
    stats = Stats()
    assert run(target, p, PROMPT, 12, stats=stats) == vanilla(target, PROMPT, 12)
    assert not calls and stats.steps == 11 and stats.mean_acceptance_length == 1.0


def test_stats_are_recorded_when_the_generation_is_closed_early():
    """A consumer that stops iterating (a stop string, a disconnect) still gets the timings."""
    from treeflash.decoding.generate import decode
    from treeflash.decoding.sampling import SamplingParams

    target = tiny_target("llama", logit_scale=3.0)
    drafter = tiny_drafter(target)
    stats = Stats()
    p = make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(8, 3, 3))
    gen = decode(target, p, PROMPT, N, SamplingParams(), stats=stats, stop_ids=set())
    got = [next(gen) for _ in range(3)]
    gen.close()
    assert len(got) == stats.new_tokens == 3 and stats.steps >= 1
    assert stats.total_s > 0 and stats.draft_s > 0  # were 0: the loop's last lines never ran


def test_compiled_treeflash_heads_build_the_eager_tables():
    """The compiled heads (`heads.TablesGraph`, on the compiled backends) build the tables the eager
    heads build, at the budget's depth and at the shorter depths of a generation's end (padded),
    also for a root outside the draft vocabulary (its previous-token half is not in the table),
    and stay lossless."""
    from treeflash.decoding.proposers import TreeParams, make_proposer
    from treeflash.models.kvcache import DraftCache

    target = tiny_target("llama", logit_scale=3.0)
    ref = vanilla(target, PROMPT, N)
    drafter = tiny_drafter(target, block_size=8)
    drafter.draft_vocab = torch.arange(1, target.vocab_rows, 2)  # odd ids: PROMPT[-1] is one
    p = make_proposer("treeflash", drafter, target.embed, target.lm_head, TreeParams(4, 3, 3, 16))
    p.compile_heads(True)
    assert p.compiled == (3, False)
    cache = DraftCache(len(drafter.model.layers))
    drafter.extend(cache, torch.randn(len(PROMPT), drafter.model.fc.in_features), torch.arange(len(PROMPT)))
    h = block_states(p, cache, PROMPT[-1], len(PROMPT), 7)  # [8, H]
    assert PROMPT[-1] % 2 == 1
    roots = (PROMPT[-1], 2)  # odd: in the draft vocabulary; even: outside it
    for root, depth in itertools.product(roots, (3, 2, 1)):
        got = p.heads(h[:depth + 1], root)
        p.compiled = None
        want = p.heads(h[:depth + 1], root)
        p.compiled = (3, False)
        for name in ("candidates", "first_tok", "next_tok"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (root, depth, name)
        torch.testing.assert_close(got.next_logp, want.next_logp)
        torch.testing.assert_close(got.first_logp, want.first_logp)
    for root in roots:  # the graph ran for both
        assert p.draft_heads.compiled_tables(h[:4], root, 3, 3, 16, 3, False) is not None
    # the root's own row of the corrected table differs between an odd and an even root
    a, b = (p.heads(h[:4], root) for root in roots)
    assert not torch.equal(a.first_logp, b.first_logp)
    assert run(target, p, PROMPT, N) == ref
