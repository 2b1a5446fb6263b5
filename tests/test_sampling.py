"""Sampling losslessness: a chi-square test of the joint distribution of the first three tokens."""
import itertools

import pytest
import torch
from scipy.stats import chisquare

from treeflash.decoding.sampling import SamplingParams, probs

from conftest import oracle, run, tiny_drafter, tiny_target, vanilla

V = 5
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def small():
    target = tiny_target("llama", vocab=V, layers=2, seed=3, logit_scale=6.0)
    drafter = tiny_drafter(target, block_size=4, ar_std=0.5)
    return target, drafter


def exact_joint(target, params: SamplingParams, n=3) -> dict:
    """p(t1, t2, t3) from direct forwards of the HF model, processed by the shared sampler."""
    model = target.model

    def next_probs(seq):
        with torch.no_grad():
            return probs(model(torch.tensor([seq])).logits[0, -1], params)

    joint = {}
    for seq in itertools.product(range(V), repeat=n):
        p, ctx = 1.0, list(PROMPT)
        for t in seq:
            p *= float(next_probs(ctx)[t])
            ctx.append(t)
        joint[seq] = p
    return joint


def sample_counts(target, make_proposer, params, n_samples) -> dict:
    counts = {}
    for s in range(n_samples):
        out = tuple(run(target, make_proposer(), PROMPT, 5, params, seed=s)[:3])
        counts[out] = counts.get(out, 0) + 1
    return counts


def chi2_pvalue(counts: dict, joint: dict) -> float:
    n = sum(counts.values())
    cells = sorted(joint, key=lambda c: -joint[c])
    obs, exp, o_rest, e_rest = [], [], 0, 0.0
    for c in cells:
        if joint[c] * n >= 5:
            obs.append(counts.get(c, 0))
            exp.append(joint[c] * n)
        else:
            o_rest += counts.get(c, 0)
            e_rest += joint[c] * n
    obs.append(o_rest)
    exp.append(e_rest)
    # the expected counts sum to n only up to float rounding, and scipy's chisquare checks that sum
    # against its own tolerance: scale them to the observed total exactly
    exp = [e * n / sum(exp) for e in exp]
    return float(chisquare(obs, exp).pvalue)


PARAMS = SamplingParams(temperature=1.0, top_p=0.95, top_k=4)
N_SAMPLES = 1500


@pytest.mark.parametrize("method", ["vanilla", "chain", "marginal", "treeflash", "lookup", "treeflash+lookup",
                                    "lookup@auto"])
def test_sampled_tokens_follow_the_target(small, method):
    target, drafter = small
    joint = exact_joint(target, PARAMS)
    ref = vanilla(target, PROMPT, 5)
    if method == "lookup@auto":  # per-step budgets: a lookup-only tree wherever the text repeats (verifying is free)
        def make():
            from treeflash.decoding.proposers import TreeParams, make_proposer
            from treeflash.decoding.step_budget import StepBudget
            p = make_proposer("lookup", None, target.embed, target.lm_head, TreeParams(1))
            p.planner = StepBudget({0: 0.0, 1: 1.0, 64: 1.0}, [], lambda b: 0.0)
            return p
    elif method in ("vanilla", "lookup"):  # no drafter
        def make():
            from treeflash.decoding.proposers import TreeParams, make_proposer
            return make_proposer(method, None, target.embed, target.lm_head, TreeParams(6))
    else:
        def make():  # drafts lean towards the greedy path, so acceptances happen at every depth
            return oracle(method, target, drafter, PROMPT + ref, budget=6, top_m=2, top_k=2)
    p = chi2_pvalue(sample_counts(target, make, PARAMS, N_SAMPLES), joint)
    assert p > 1e-3, f"{method}: sampled joint distribution differs from the target's (p={p:.2e})"


def test_the_chi_square_check_can_fail(small):
    """Control: samples at another temperature are rejected by the same check."""
    target, drafter = small
    ref = vanilla(target, PROMPT, 5)
    joint = exact_joint(target, PARAMS)
    hot = SamplingParams(temperature=1.6, top_p=0.95, top_k=4)
    counts = sample_counts(target, lambda: oracle("treeflash", target, drafter, PROMPT + ref, 6, 2, 2),
                           hot, N_SAMPLES)
    assert chi2_pvalue(counts, joint) < 1e-3


def test_top_p_and_top_k_processing():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = probs(logits, SamplingParams(1.0, 1.0, 2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    p = probs(logits, SamplingParams(1.0, float(full[0] + full[1] / 2), 0))
    assert (p[:2] > 0).all() and (p[2:] == 0).all()  # the smallest prefix reaching top_p
    assert torch.allclose(probs(logits, SamplingParams(0.5)), (logits / 0.5).softmax(-1))


def test_sampling_is_exact_on_the_static_backend():
    """The same check through the static-cache forward (lazy LM head, in-place compaction)."""
    target = tiny_target("llama", vocab=V, layers=2, seed=3, logit_scale=6.0).set_backend("static")
    drafter = tiny_drafter(target, block_size=4, ar_std=0.5)
    ref = vanilla(target, PROMPT, 5)
    counts = sample_counts(target, lambda: oracle("treeflash", target, drafter, PROMPT + ref, 6, 2, 2),
                           PARAMS, N_SAMPLES)
    p = chi2_pvalue(counts, exact_joint(target, PARAMS))
    assert p > 1e-3, f"static backend: sampled joint distribution differs from the target's (p={p:.2e})"


# ---------------------------------------------------------------- the sampler's rules (property test)
def reference_probs(logits, temperature, top_p, top_k):
    """The documented rules, written plainly in numpy float64 (decoding/sampling.py's docstring)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64) / temperature
    if top_k:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        ahead = np.array([p[x > xi].sum() for xi in x])  # mass strictly more likely than each token
        keep = (ahead < top_p) | (x == x.max())
        x = np.where(keep, x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
    return p


def test_probs_follow_the_rules_and_never_go_empty():
    import numpy as np
    from hypothesis import HealthCheck, assume, given, settings, strategies as st

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.floats(-30, 30), min_size=1, max_size=12),
           st.one_of(st.floats(1e-5, 1e6), st.sampled_from([1e-5, 1.0, 1e300])),
           st.one_of(st.floats(1e-300, 1.0), st.sampled_from([1e-300, 5e-324, 1.0])),
           st.integers(0, 12))
    def check(logits, temperature, top_p, top_k):
        top_k = min(top_k, len(logits))
        ref = reference_probs(logits, temperature, top_p, top_k)
        # the edge of top-p is decided by a sum: skip masses within rounding of top_p
        x = np.asarray(logits) / temperature
        pr = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        assume(all(abs(pr[x > v].sum() - top_p) > 1e-9 for v in x))
        got = probs(torch.tensor(logits, dtype=torch.float32), SamplingParams(temperature, top_p, top_k)).double().numpy()
        assert np.isfinite(got).all() and got.sum() > 0.999
        assert got[int(np.argmax(logits))] > 0  # the most likely token is always kept
        x32 = torch.tensor(logits, dtype=torch.float32).double().numpy()  # the same float32 inputs
        ref = reference_probs(x32, temperature, top_p, top_k)
        assert ((got > 0) == (ref > 0)).all(), (got, ref)
        assert np.abs(got - ref).max() < 1e-6

    check()


def test_a_vanishing_top_p_samples_the_most_likely_token():
    logits = torch.tensor([0.5, 3.0, 1.0, 2.9])
    p = probs(logits, SamplingParams(1.0, 1e-300, 0))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]
