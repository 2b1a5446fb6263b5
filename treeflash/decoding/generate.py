"""The decoding loop: prefill, then steps of draft -> build tree -> verify -> accept -> commit.

The same loop runs plain decoding (`vanilla`: a root-only tree), so every method shares one
sampler, one stop rule and one KV-cache path.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from ..errors import TreeflashError
from ..models.drafter import DraftCache
from ..models.target import Target
from .proposers import Proposer
from .sampling import SamplingParams, choose
from .stats import Stats
from .verify import accept


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
