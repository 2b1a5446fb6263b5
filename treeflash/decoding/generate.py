"""The decoding loop: prefill, then steps of draft -> build tree -> verify -> accept -> commit.

The same loop runs plain decoding (`vanilla`: a root-only tree), so every method shares one
sampler, one stop rule and one KV-cache path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..errors import TreeflashError
from ..models.drafter import DraftCache
from ..models.target import Target
from .proposers import Proposer
from .sampling import SamplingParams, choose
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
           stop_ids: set[int] | None = None) -> Iterator[int]:
    """Yield new token ids one by one; fills `stats`. Exactly the target's own output."""
    stats = stats if stats is not None else Stats()
    stop_ids = target.stop_ids() if stop_ids is None else stop_ids
    limit = target.max_length
    if len(prompt_ids) >= limit:
        raise TreeflashError(f"prompt has {len(prompt_ids)} tokens; the context window is {limit}")
    if max_new_tokens < 1:
        raise TreeflashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    # a budget of 1 is plain decoding: no drafter work at all (not even its context update)
    drafter = proposer.drafter if proposer.params.budget >= 2 else None
    dcache = DraftCache(len(drafter.model.layers)) if drafter is not None else None
    block = drafter.block_size if drafter is not None else 1
    # a step writes `budget` tree nodes past the accepted tokens before compaction
    cache = target.new_cache(min(limit, len(prompt_ids) + max_new_tokens) + max(block, proposer.params.budget))
    proposer.timings = {"draft": 0.0, "tree": 0.0}
    stats.prompt_tokens = len(prompt_ids)
    t_start = time.perf_counter()

    # prefill: the prompt's KV cache, its features for the drafter, and the first token
    dev = target.device
    ids = torch.tensor(prompt_ids, device=dev)
    pos = torch.arange(len(prompt_ids), device=dev)
    logits, feats = target.forward(ids, pos, cache)
    if drafter is not None:
        drafter.extend(dcache, feats, pos)
    root = choose(logits[-1], sampling, gen)
    stats.prefill_s = time.perf_counter() - t_start
    start = len(prompt_ids)  # position of `root`; cache holds positions < start

    produced = 0
    history = list(prompt_ids)  # committed tokens, ending with the root (lookup proposers read it)
    pending = [root]  # tokens to emit: the prefill's token, then each step's accepted drafts + bonus
    try:  # the stats are complete also when the consumer closes the generator early
        while True:
            for tok in pending:
                stats.new_tokens = produced = produced + 1
                history.append(tok)
                yield tok
                if tok in stop_ids:
                    stats.finish_reason = "stop"
                    return
            if produced >= max_new_tokens or start + 1 >= limit:
                stats.finish_reason = "length"
                return
            root = pending[-1]  # position `start`: the last emitted token, not yet in the cache
            # at most as deep as the tokens still wanted and the context window allow
            max_depth = min(max_new_tokens - produced - 1, limit - start - 2)
            tree = proposer.propose(dcache, root, start, max_depth, history)
            t0 = time.perf_counter()
            logits, feats = target.forward(tree.tokens.to(dev), (start + tree.depths).to(dev), cache,
                                           tree.ancestor_mask().to(dev))
            acc = accept(tree, logits, sampling, gen)
            keep = torch.tensor(acc.path, device=dev)
            cache.compact(start, keep)
            if drafter is not None:
                # deferred: the next block pass computes their keys/values in the same call
                drafter.extend(dcache, feats[keep], start + torch.arange(len(keep), device=dev), defer=True)
            stats.verify_s += time.perf_counter() - t0
            stats.record(len(acc.accepted), len(tree), acc.path)
            start += len(keep)
            pending = acc.accepted + [acc.bonus]
    finally:
        stats.draft_s += proposer.timings["draft"]
        stats.tree_s += proposer.timings["tree"]
        stats.total_s = time.perf_counter() - t_start
