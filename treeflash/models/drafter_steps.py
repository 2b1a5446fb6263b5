"""The drafter's compiled passes (the compiled backends): its block pass, and the same pass after
appending the context that the last step accepted. Each is `aot.compiled_call`: a package on disk
on the CPU (built once per machine; the block's rows, the context's length and the appended rows
symbolic), else torch.compile in this process. Both take the cache as flat tensors
k_0, v_0, k_1, v_1, ... (each [nkv, C, hd])."""
from __future__ import annotations

import dataclasses
import functools
import json

import torch

from . import aot


def pairs(kv: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """k_0, v_0, k_1, v_1, ... -> [(k_0, v_0), (k_1, v_1), ...]."""
    return list(zip(kv[0::2], kv[1::2]))


class BlockPass(torch.nn.Module):
    """forward(block [Q, H], pos [Q], *kv) -> h [Q, H] (`Drafter.forward_block`)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, block, pos, *kv):
        return self.drafter.forward_block(block, pos, pairs(kv))


class ExtendBlockPass(BlockPass):
    """forward(feats [n, taps*H], fpos [n], block [Q, H], pos [Q], *kv) -> (h [Q, H], *kv grown by n)
    (`Drafter.extend_block`)."""

    def forward(self, feats, fpos, block, pos, *kv):
        new, h = self.drafter.extend_block(feats, fpos, block, pos, pairs(kv))
        return (h, *[t for k_v in new for t in k_v])


def example(drafter, extend: bool) -> tuple:
    """Export inputs (a block after 8 context positions; 3 appended) and their dynamic shapes."""
    from torch.export import Dim

    c, p = drafter.config, next(drafter.parameters())
    ctx, n = 8, 3
    kv = [torch.zeros(c.num_key_value_heads, ctx, c.head_dim, dtype=p.dtype, device=p.device)
          for _ in range(2 * len(drafter.model.layers))]
    block = torch.zeros(c.block_size, c.hidden_size, dtype=p.dtype, device=p.device)  # [Q, H]
    pos = torch.arange(ctx + n, ctx + n + c.block_size, device=p.device)              # [Q]
    q, length = {0: Dim.AUTO}, tuple({1: Dim("ctx", min=1, max=1 << 20)} for _ in kv)
    if not extend:
        return (block, pos, *kv), (q, q, length)
    feats = torch.zeros(n, drafter.model.fc.in_features, dtype=p.dtype, device=p.device)  # [n, taps*H]
    rows = {0: Dim("n", min=1, max=1 << 16)}
    return (feats, torch.arange(ctx, ctx + n, device=p.device), block, pos, *kv), (rows, rows, q, q, length)


def compiled_passes(drafter, cpp_gemm: bool) -> tuple:
    """(block pass, block pass after appending context), compiled."""
    @functools.cache  # one weights checksum for both
    def folder():
        return aot.key_dir("drafter", drafter, json.dumps(dataclasses.asdict(drafter.config), default=str), cpp_gemm)

    return tuple(aot.compiled_call(module, lambda name=name: folder() / name, lambda ext=ext: example(drafter, ext),
                                   cpp_gemm, what, dynamic=True)
                 for module, name, ext, what in (
                     (BlockPass(drafter), "block.pt2", False, "the drafter's block pass"),
                     (ExtendBlockPass(drafter), "extend-block.pt2", True, "the drafter's pass with new context")))
