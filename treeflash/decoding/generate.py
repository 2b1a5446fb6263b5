"""The single-sequence decoding loop: prefill, then steps of draft -> build tree -> verify ->
accept -> commit (`decode`; `serial.SerialDecoder` runs the same `prefill` and `decode_step`).

The same loop runs plain decoding (`vanilla`: a root-only tree), so every method shares one
sampler and one KV-cache path; the per-sequence rules (checks, reservation, depth, emitting and
stop rules, stats) are `sequence.Sequence`'s, which the batched step (`batch.py`) runs on too.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from ..models.target import Target
from .proposers import Proposer
from .sampling import SamplingParams, accept
from .sequence import Sequence
from .stats import Stats


@torch.no_grad()  # also for callers that forget it: autograd bookkeeping slows every step
def decode(target: Target, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int,
           sampling: SamplingParams, seed: int | None = None, stats: Stats | None = None,
           stop_ids: set[int] | None = None, text=None) -> Iterator[int]:
    """Yield new token ids one by one; fills `stats`. Exactly the target's own output. `text` (a
    `TextAssembler`, optional) is fed every token: a stop string ends decoding there."""
    stop_ids = target.stop_ids() if stop_ids is None else stop_ids
    seq = Sequence.new(prompt_ids, proposer, sampling, max_new_tokens, stop_ids, target.max_length,
                       stats if stats is not None else Stats(), seed, text)
    cache = target.new_cache(seq.reserved)
    try:  # the stats are complete also when the consumer closes the generator early (a cancel)
        toks = prefill(target, seq, cache)
        while True:
            yield from toks
            if seq.done:
                return
            toks = decode_step(target, seq, cache)
    finally:
        if not seq.done:
            seq.finish("abort")


def decode_step(target: Target, seq: Sequence, cache) -> Iterator[int]:
    """One step of a prefilled sequence: draft -> build tree -> verify -> accept -> commit; returns
    its tokens, emitted as they are taken (`Sequence.advance`)."""
    dev = target.device
    seq.plan()  # this step's budget, and whether the drafter runs
    t0 = time.perf_counter()
    depth = seq.block_depth()  # the drafter's pass over this step's block, if any
    states = seq.drafter.draft_blocks([seq.draft_block(depth)])[0] if depth else None
    t_draft = time.perf_counter() - t0
    tree = seq.propose(states)
    t1 = time.perf_counter()
    ids, pos, mask = (x.to(dev) for x in seq.tree_rows(tree))
    logits, feats = target.forward(ids, pos, cache, mask)
    acc = accept(tree, logits, seq.sampling, seq.gen)
    keep = torch.tensor(acc.path, device=dev)  # [K] the accepted path's rows
    cache.compact(seq.start, keep)
    if seq.dcache is not None:  # deferred: the next block pass computes their keys/values
        seq.drafter.extend_contexts([seq.context_rows(feats[keep])], defer=True)
    return seq.advance(tree, acc, t_draft, time.perf_counter() - t1)


def prefill(target: Target, seq: Sequence, cache) -> Iterator[int]:
    """The whole prompt in one forward (`Sequence.prefilled`): returns the first token, to emit."""
    t0 = time.perf_counter()
    ids, pos = (x.to(target.device) for x in seq.prompt_rows(len(seq.prompt)))  # [P] each
    logits, feats = target.forward(ids, pos, cache)
    return seq.prefilled(logits, feats, t0)
