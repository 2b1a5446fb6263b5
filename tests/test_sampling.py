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


@pytest.mark.parametrize("method", ["vanilla", "chain", "marginal", "treeflash", "lookup", "treeflash+lookup"])
def test_sampled_tokens_follow_the_target(small, method):
    target, drafter = small
    joint = exact_joint(target, PARAMS)
    ref = vanilla(target, PROMPT, 5)
    if method in ("vanilla", "lookup"):  # no drafter
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
