"""The target's compiled step (`FastPath._step`): what `FastPath` calls for a compiled forward.

- With packages on (`aot.enabled`, the CPU): one AOTInductor package per target and taps, built once
  per machine (`aot.Packaged`), for 2 to `MAX_ROWS` rows (the row count symbolic, so a tree is never
  padded to a bucket; a one-row step runs as two rows, the second a padding row: on the CPU it costs
  about what one row costs, and it saves a second package of the weights). The attended width and
  the cache's capacity are symbolic too.
- Otherwise: one `torch.compile` of `_step` (frozen weights), specialised per bucketed row count.
"""
from __future__ import annotations

import torch

from . import aot
from .kvcache import StaticKV

MAX_ROWS = 64          # the largest tree a package takes (FastPath's largest bucket)
MIN_WIDTH, MIN_SLOTS = 8, 64  # the exported graph's lower bounds of the mask width and the cache capacity


def flat_cache(kv) -> StaticKV:
    """A StaticKV over the per-layer tensors k_0..k_L-1, v_0..v_L-1 (a step's flat arguments)."""
    layers = len(kv) // 2
    cache = StaticKV.__new__(StaticKV)
    cache.k, cache.v, cache.length = list(kv[:layers]), list(kv[layers:]), 0
    return cache


class StepModule(torch.nn.Module):
    """`FastPath._step` with the cache as flat tensors: forward(ids, pos, slots, mask, *k, *v).
    Query heads are never stacked (`FastPath._attend`): with the row count symbolic, the choice
    would depend on it."""

    def __init__(self, fastpath, taps: tuple):
        super().__init__()
        self.fastpath, self.model, self.taps = fastpath, fastpath.model, taps

    def forward(self, ids, pos, slots, mask, *kv):
        return self.fastpath._step(ids, pos, slots, mask, flat_cache(kv), self.taps, stacked=False)


def example(fastpath, rows: int) -> tuple:
    """Export inputs (a chain of `rows` rows after 64 cached slots) and their dynamic shapes."""
    from torch.export import Dim

    p = next(fastpath.model.parameters())
    cap, start = 4 * MIN_SLOTS, MIN_SLOTS
    kv = [torch.zeros(1, fastpath.n_kv, cap, fastpath.head_dim, dtype=p.dtype, device=p.device)
          for _ in range(2 * len(fastpath.decoder.layers))]
    mask = torch.zeros(rows, 2 * MIN_SLOTS, dtype=torch.bool, device=p.device)  # [N, W]
    mask[:, :start + rows] = True
    pos = torch.arange(start, start + rows, device=p.device)  # [N]
    args = (torch.zeros(rows, dtype=torch.long, device=p.device), pos, pos.clone(), mask, *kv)
    width, slots = Dim("width", min=MIN_WIDTH, max=1 << 20), Dim("slots", min=MIN_SLOTS, max=1 << 20)
    n = {0: Dim("rows", min=2, max=MAX_ROWS)}
    return args, (n, n, n, {**n, 1: width}, tuple({2: slots} for _ in kv))


class PackagedSteps:
    """The target's step as one package (`aot.Packaged`) of 2..MAX_ROWS rows; called as
    (ids, pos, slots, mask, cache, taps) -> (float32 logits [N, V], features [N, taps*H])."""

    def __init__(self, fastpath, taps: tuple):
        folder = aot.key_dir("target", fastpath.model, fastpath.model.config.to_json_string(use_diff=False),
                             fastpath.cpp_gemm, taps=list(taps))
        self.step = aot.Packaged(StepModule(fastpath, taps), folder / f"step-2-{MAX_ROWS}.pt2",
                                 lambda: example(fastpath, 8), fastpath.cpp_gemm, "the target's step",
                                 dynamic=False, fullgraph=True)

    @staticmethod
    def rows_for(n: int) -> int | None:
        """The rows a step of n runs: n, at least 2; None: more than the package takes."""
        return max(n, 2) if n <= MAX_ROWS else None

    def __call__(self, ids, pos, slots, mask, cache: StaticKV, taps: tuple):
        return self.step(ids, pos, slots, mask, *cache.k, *cache.v)
