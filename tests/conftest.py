"""Shared fixtures: tiny random-weight targets of several architectures, and oracle proposers.

Oracle proposers (forced-argmax fixtures) bias the drafter's tables towards a known reference
continuation, so that trees get accepted deep and at varying ranks: losslessness is then tested
on long accepted paths, not only on rejections.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from treeflash.api import random_drafter
from treeflash.bench.selftest import tiny_target  # shared with the selftest; tests import it from here
from treeflash.decoding.generate import decode
from treeflash.decoding.lookup import LookupParams
from treeflash.decoding.proposers import Chain, Marginal, TreeFlash, TreeParams, Vanilla
from treeflash.decoding.sampling import SamplingParams
from treeflash.decoding.stats import Stats
from treeflash.models.target import Target

# The compiled backends' graphs as packages on disk (the default, `models/aot.py`) are tested in
# test_aot.py; elsewhere the suite compiles in process, and `--backend auto` stays static.
os.environ.setdefault("TREEFLASH_AOT", "0")


def tiny_drafter(target: Target, seed: int = 1, block_size: int = 8, ar_std: float = 0.3):
    d = random_drafter(target, seed=seed, num_layers=1, num_taps=2, block_size=block_size)
    if d.ar_approximation is not None:  # a non-zero correction, so stage 2 differs from stage 1
        torch.nn.init.normal_(d.ar_approximation.d.weight, std=ar_std,
                              generator=torch.Generator().manual_seed(seed))
    target.set_taps(d.config.target_layer_ids)
    return d


class _Oracle:
    """Mixin: bias the drafter's log-probs towards `reference` (the full token sequence)."""

    reference: list[int]
    hit_rate = 0.8
    bonus = 4.0

    def propose(self, root_token, start, max_depth, history=None, states=None, branches=None):
        self._start = start
        self._rng = random.Random(start * 7919 + len(self.reference))
        return super().propose(root_token, start, max_depth, history, states, branches)

    def _ref(self, depth: int) -> int | None:
        i = self._start + depth
        return self.reference[i] if i < len(self.reference) else None

    def _boost(self, row: torch.Tensor, depth: int) -> None:
        tok = self._ref(depth)
        if tok is None:
            return
        if self._rng.random() > self.hit_rate:  # a wrong guess, so rejections happen too
            tok = self._rng.randrange(row.shape[0])
        row[tok] += self.bonus * (1 + self._rng.random())

    def marginal_logp(self, h):
        logp = super().marginal_logp(h).clone()
        for d in range(logp.shape[0]):
            self._boost(logp[d], d + 1)
        return logp.log_softmax(-1)


class OracleChain(_Oracle, Chain):
    pass


class OracleMarginal(_Oracle, Marginal):
    pass


class OracleTreeFlash(_Oracle, TreeFlash):
    def corrected_logp(self, h, root_token, prev, cols=None):
        assert cols is None, "the oracle boosts token ids: use stage2_vocab=0"
        logp = super().corrected_logp(h, root_token, prev).clone()
        cand = self.draft_heads.tokens(prev)  # [D-1, m] token ids
        m = cand.shape[1]
        self._boost(logp[0], 1)
        for r in range(1, logp.shape[0]):
            d, j = 1 + (r - 1) // m, (r - 1) % m
            if int(cand[d - 1, j]) == self._ref(d):  # on the reference path: know the next token
                self._boost(logp[r], d + 1)
        return logp.log_softmax(-1)


ORACLES = {"chain": OracleChain, "marginal": OracleMarginal, "treeflash": OracleTreeFlash}


def run(target, proposer, prompt, n, sampling=SamplingParams(), seed=None, stats=None):
    return list(decode(target, proposer, prompt, n, sampling, seed=seed, stats=stats, stop_ids=set()))


def vanilla(target, prompt, n, sampling=SamplingParams(), seed=None):
    return run(target, Vanilla(None, target.embed, target.lm_head, TreeParams()), prompt, n, sampling, seed)


def block_states(proposer, cache, root: int, start: int, depth: int) -> torch.Tensor:
    """The drafter's states [depth+1, H] of one block [root, MASK x depth] at `start`, as the decoding
    loops draft it (`Sequence.draft_block`, `Drafter.draft_blocks`)."""
    d, embed = proposer.drafter, proposer.embed
    return d.draft_blocks([(cache, embed(d.block_ids(root, depth, embed.weight.device)), start)])[0]


def oracle(method, target, drafter, reference, budget, top_m=4, top_k=4):
    """A drafter method biased towards `reference`; `NAME+lookup` adds (unbiased) lookup branches."""
    base, _, plus = method.partition("+")
    p = ORACLES[base](drafter, target.embed, target.lm_head, TreeParams(budget, top_m, top_k, stage2_vocab=0),
                      LookupParams() if plus else None)
    p.reference = reference
    return p


@pytest.fixture(scope="session")
def default_engine():
    """The real default target (fp32) with a random drafter; loaded once."""
    import treeflash

    return treeflash.load(drafter="random", dtype="float32", quiet=True)


__all__ = ["tiny_target", "tiny_drafter", "oracle", "run", "vanilla", "Stats"]
