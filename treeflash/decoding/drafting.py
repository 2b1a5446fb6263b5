"""The drafter's passes over several sequences at once: their blocks in one forward
(`draft_blocks`), their contexts' new rows in one pass (`extend_contexts`). One sequence runs the
drafter's own bs=1 pass (compiled where the drafter is), so the single-sequence loop and the
batched step call the same functions."""
from __future__ import annotations

import torch

from ..models.drafter import DraftCache, Drafter
from .proposers import block_ids


def owner_mask(rows: list[int], cols: list[int], device) -> torch.Tensor:
    """Row i of job a may see column j of job b iff a == b. rows [J], cols [J]: rows / columns per
    job (job order) -> [sum rows, sum cols] bool (block diagonal)."""
    jobs = torch.arange(len(rows), device=device)
    r = jobs.repeat_interleave(torch.tensor(rows, device=device))  # [R]
    c = jobs.repeat_interleave(torch.tensor(cols, device=device))  # [C]
    return r[:, None] == c[None, :]


def block_mask(ctx: list[int], blk: list[int], device) -> torch.Tensor:
    """Context lengths [J], block lengths [J] -> [Q, C+Q] bool (keys: every job's context, then
    every job's block): a block row of job j sees job j's context and job j's block only."""
    return torch.cat([owner_mask(blk, ctx, device), owner_mask(blk, blk, device)], 1)


@torch.no_grad()
def draft_blocks(drafter: Drafter, embed, jobs: list[tuple[DraftCache, int, int, int]]) -> list[torch.Tensor]:
    """jobs [(draft cache, root, start, depth)] -> per job the pre-norm states h [depth+1, H] of its
    block [root, MASK x depth] at positions start.., from ONE drafter pass over all blocks."""
    dev = embed.weight.device
    if len(jobs) == 1:  # the bs=1 pass (compiled where the drafter is)
        cache, root, start, d = jobs[0]
        return [drafter.draft(cache, embed(block_ids(drafter, root, d, dev)), start)]
    assert all(c.pending is None for c, *_ in jobs), "batched contexts are extended eagerly"
    ids = torch.cat([block_ids(drafter, root, d, dev) for _, root, _, d in jobs])     # [Q]
    pos = torch.cat([torch.arange(s, s + d + 1, device=dev) for _, _, s, d in jobs])  # [Q]
    kv = [(torch.cat([c.k[i] for c, *_ in jobs], 1), torch.cat([c.v[i] for c, *_ in jobs], 1))
          for i in range(len(drafter.model.layers))]                                  # per layer [nkv, C, hd]
    ctx, blk = [c.k[0].shape[1] for c, *_ in jobs], [d + 1 for *_, d in jobs]
    h = drafter.forward_block(embed(ids), pos, kv, block_mask(ctx, blk, dev))        # [Q, H]
    return list(h.split(blk))


@torch.no_grad()
def extend_contexts(drafter: Drafter, items: list[tuple[DraftCache, torch.Tensor, torch.Tensor]],
                    defer: bool = False) -> None:
    """items [(draft cache, feats [K, taps*H], positions [K])]: each cache's context grows by its
    rows; the keys / values of all of them come from one pass. One item alone may be `defer`red:
    its keys / values are computed in its next block pass's call."""
    if len(items) == 1:
        drafter.extend(*items[0], defer=defer)
        return
    sizes = [len(p) for _, _, p in items]
    kv = drafter.context_kv(torch.cat([f for _, f, _ in items]), torch.cat([p for _, _, p in items]))
    for i, (k, v) in enumerate(kv):  # [nkv, sum K, hd]
        for (cache, _, _), kj, vj in zip(items, k.split(sizes, 1), v.split(sizes, 1)):
            cache.append(i, kj, vj)
    for (cache, _, _), n in zip(items, sizes):
        cache.length += n
