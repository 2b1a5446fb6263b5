"""The single-sequence decoding loop: prefill, then steps of draft -> build tree -> verify ->
accept -> commit.

The same loop runs plain decoding (`vanilla`: a root-only tree), so every method shares one
sampler and one KV-cache path; the per-sequence rules (checks, reservation, depth, emitting and
stop rules, stats) are `sequence.Sequence`'s, which the batched step (`batch.py`) runs on too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..models.target import Target
from .drafting import draft_blocks, extend_contexts
from .proposers import Proposer
from .sampling import SamplingParams, choose
from .sequence import Sequence
from .verify import accept


@dataclass
class Stats:
    """Per generation. acceptance_lengths[i] = accepted draft tokens + 1 bonus in step i."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps accepting >= j+1 drafts
    tree_sizes: list[int] = field(default_factory=list)
    node_hits: list[int] = field(default_factory=list)  # [i]: steps whose accepted path holds node i+1
    prefill_s: float = 0.0
    draft_s: float = 0.0
    tree_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"

    def record(self, n_accepted: int, tree_size: int, path: list[int] = ()) -> None:
        self.steps += 1
        for node in path[1:]:  # node indices follow the builder's (best-first) order
            while len(self.node_hits) < node:
                self.node_hits.append(0)
            self.node_hits[node - 1] += 1
        self.acceptance_lengths.append(n_accepted + 1)
        self.tree_sizes.append(tree_size)
        while len(self.accepted_per_position) < n_accepted:
            self.accepted_per_position.append(0)
        for j in range(n_accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(1, self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        """vLLM-style: fraction of steps whose draft was accepted at least up to position j+1."""
        return [a / max(1, self.steps) for a in self.accepted_per_position]

    def node_acceptance(self) -> list[float]:
        """[i]: fraction of steps whose accepted path held the (i+1)-th best-first draft node."""
        return [h / max(1, self.steps) for h in self.node_hits]

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_lengths": self.acceptance_lengths,
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance()],
            "mean_tree_size": round(sum(self.tree_sizes) / max(1, self.steps), 2),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "time_s": {"total": round(self.total_s, 6), "prefill": round(self.prefill_s, 6),
                       "draft": round(self.draft_s, 6), "tree": round(self.tree_s, 6),
                       "verify": round(self.verify_s, 6)},
            "finish_reason": self.finish_reason,
        }


@torch.no_grad()  # also for callers that forget it: autograd bookkeeping slows every step
def decode(target: Target, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int,
           sampling: SamplingParams, seed: int | None = None, stats: Stats | None = None,
           stop_ids: set[int] | None = None, text=None) -> Iterator[int]:
    """Yield new token ids one by one; fills `stats`. Exactly the target's own output. `text` (a
    `TextAssembler`, optional) is fed every token: a stop string ends decoding there."""
    stop_ids = target.stop_ids() if stop_ids is None else stop_ids
    seq = Sequence.new(prompt_ids, proposer, sampling, max_new_tokens, stop_ids, target.max_length,
                       stats if stats is not None else Stats(), seed, text)
    cache, dev = target.new_cache(seq.reserved), target.device
    try:  # the stats are complete also when the consumer closes the generator early (a cancel)
        toks = seq.first(prefill(target, seq, cache))
        while True:
            yield from toks
            if seq.done:
                return
            t0 = time.perf_counter()
            depth = seq.block_depth()  # the drafter's pass over this step's block, if any
            states = draft_blocks(seq.drafter, proposer.embed, [seq.draft_job(depth)])[0] if depth else None
            t_draft = time.perf_counter() - t0
            tree = seq.propose(states)
            t1 = time.perf_counter()
            logits, feats = target.forward(tree.tokens.to(dev), (seq.start + tree.depths).to(dev), cache,
                                           tree.ancestor_mask().to(dev))
            acc = accept(tree, logits, sampling, seq.gen)
            keep = torch.tensor(acc.path, device=dev)  # [K] the accepted path's rows
            cache.compact(seq.start, keep)
            if seq.dcache is not None:  # deferred: the next block pass computes their keys/values
                extend_contexts(seq.drafter, [seq.context_rows(feats[keep])], defer=True)
            toks = seq.advance(tree, acc, t_draft, time.perf_counter() - t1)
    finally:
        if not seq.done:
            seq.finish("abort")


def prefill(target: Target, seq: Sequence, cache) -> int:
    """The prompt's KV cache and its features for the drafter; returns the first token."""
    t0 = time.perf_counter()
    ids = torch.tensor(seq.prompt, device=target.device)        # [P]
    pos = torch.arange(len(seq.prompt), device=target.device)   # [P]
    logits, feats = target.forward(ids, pos, cache)
    if seq.dcache is not None:
        seq.drafter.extend(seq.dcache, feats, pos)
    seq.filled = len(seq.prompt)
    root = choose(logits[-1], seq.sampling, seq.gen)
    seq.stats.prefill_s = time.perf_counter() - t0
    return root
