"""The target's compiled step (`FastPath._step`): what `FastPath` calls for a compiled forward.

- With packages on (`aot.enabled`, the CPU): two AOTInductor packages per target, built once per
  machine (`aot.Packaged`): one row (plain decoding), and every tree of 2 to `MAX_ROWS` rows (the
  row count symbolic, so a tree is never padded). In both, the attended width and the cache's
  capacity are symbolic.
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
    `stacked`: whether steps of 2-4 rows stack their query heads (not in a package whose row count
    is symbolic: the choice would depend on it)."""

    def __init__(self, fastpath, taps: tuple, stacked: bool):
        super().__init__()
        self.fastpath, self.model, self.taps, self.stacked = fastpath, fastpath.model, taps, stacked

    def forward(self, ids, pos, slots, mask, *kv):
        return self.fastpath._step(ids, pos, slots, mask, flat_cache(kv), self.taps, self.stacked)


def example(fastpath, rows: int, dynamic_rows: bool) -> tuple:
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
    n = {0: Dim("rows", min=2, max=MAX_ROWS)} if dynamic_rows else {}
    shapes = (n or None, n or None, n or None, {**n, 1: width}, tuple({2: slots} for _ in kv))
    return args, shapes


class PackagedSteps:
    """The target's step as two packages (`aot.Packaged`): one row, and 2..MAX_ROWS rows; called as
    (ids, pos, slots, mask, cache, taps) -> (float32 logits [N, V], features [N, taps*H])."""

    def __init__(self, fastpath, taps: tuple):
        folder = aot.key_dir("target", fastpath.model, fastpath.model.config.to_json_string(use_diff=False),
                             fastpath.cpp_gemm, taps=list(taps))
        self.one, self.tree = (
            aot.Packaged(StepModule(fastpath, taps, stacked=rows == 1), folder / name,
                         lambda rows=rows: example(fastpath, rows, rows > 1), fastpath.cpp_gemm, what,
                         dynamic=False, fullgraph=True)
            for rows, name, what in ((1, "step-1.pt2", "the target's one-row step"),
                                     (8, f"step-2-{MAX_ROWS}.pt2", "the target's tree step")))

    @staticmethod
    def rows_for(n: int) -> int | None:
        """The rows a step of n runs (no padding); None: more than any package takes."""
        return n if n <= MAX_ROWS else None

    def __call__(self, ids, pos, slots, mask, cache: StaticKV, taps: tuple):
        return (self.one if len(ids) == 1 else self.tree)(ids, pos, slots, mask, *cache.k, *cache.v)
