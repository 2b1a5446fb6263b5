"""How far greedy outputs agree where exact equality is not the contract (bench notes).

- `quantized`: a `--quantize` target against the unquantized one.
- `llama_cpp`: our methods on the llama-cpp backend against llama.cpp's own plain greedy decoding
  of the same GGUF (the `llama-cpp` arm). llama.cpp computes one row and n rows with different
  kernels, which round differently, so a tree's verify can pick the other of two near-equal
  tokens. At each prompt's first difference the note gives the gap between the top two logits of
  the plain run there, and how far computing that position among 8 rows shifts those two logits
  (`near_tie`): a gap below the shift is a near-tie that rounding alone can flip.
"""
from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from ..config import is_compiled
from ..datasets import sample_prompts
from .arms import TREE_METHODS


def _first_turn_prompts(cfg) -> dict:
    return {(s.dataset, s.id): s.turns[0] for d in cfg.datasets for s in sample_prompts(d, cfg.num_prompts, cfg.seed)}


def _ours(r) -> bool:
    """Whether a record is one of our engine's arms (not a peer's)."""
    return r.method in TREE_METHODS or r.method == "vanilla"


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def quantized(cfg, records) -> str:
    """How far the quantized target's greedy output (each prompt's first turn, as decoded by the
    first arm of our engine) follows the unquantized target's, decoded here on the same prompts."""
    from .. import api
    from ..models.target import Target

    ours = [r for r in records if _ours(r)]
    if not ours:
        return f"{cfg.quantize}: no engine method ran, so no agreement with the unquantized target was measured"
    first = ours[0].method, ours[0].tree_size
    ours = [r for r in ours if (r.method, r.tree_size) == first]
    ref_backend = "static" if is_compiled(cfg.backend) else cfg.backend
    ref = Target.load(cfg.target, dtype=cfg.dtype).set_backend(ref_backend)
    engine = api.Engine(ref, None)
    prompts = _first_turn_prompts(cfg)
    same = agree = total = 0
    for r in tqdm(ours, desc="unquantized reference", leave=False, file=sys.stderr):
        q = r.turns[0]["token_ids"]
        want = engine.generate([{"role": "user", "content": prompts[(r.dataset, r.sample_id)]}],
                               method="vanilla", max_new_tokens=cfg.max_new_tokens).token_ids
        n = _first_difference(q, want)
        same += q == want
        agree += n
        total += len(want)
    return (f"{cfg.quantize}: the quantized target's greedy output equals the unquantized {cfg.dtype} target's on "
            f"{same}/{len(ours)} first turns; {100 * agree / max(total, 1):.0f}% of the unquantized tokens come "
            f"before the first difference")


def near_tie(target, context: list[int], rows: int = 8) -> tuple[float, float]:
    """(gap, shift) after `context`: gap, between the two largest logits of the plain run there (its
    last token decoded alone, as plain decoding does); shift, the largest change of either of those
    two logits when the same position is computed as the last of `rows` tokens decoded together, as
    a verify forward computes it. A gap below the shift is a near-tie that rounding alone can flip."""
    n = len(context)
    k = max(1, min(rows, n - 1))
    ids, pos = torch.tensor(context), torch.arange(n)
    cache = target.new_cache(n + 8)
    target.forward(ids[:n - k], pos[:n - k], cache)
    many, _ = target.forward(ids[n - k:], pos[n - k:], cache, torch.ones(k, k, dtype=torch.bool).tril_())
    together = many[k - 1].float()  # [V]
    cache.compact(n - k, torch.zeros(0, dtype=torch.long))
    if k > 1:
        target.forward(ids[n - k:n - 1], pos[n - k:n - 1], cache)
    one, _ = target.forward(ids[n - 1:], pos[n - 1:], cache)
    alone = one[-1].float()  # [V]
    top = alone.topk(2)
    return float(top.values[0] - top.values[1]), float((together[top.indices] - top.values).abs().max())


def llama_cpp(target, cfg, records) -> list[str]:
    """One note per arm of ours on the llama-cpp backend: on how many first turns its greedy output
    equals llama.cpp's plain decoding of the same GGUF, and the top-two logit gap at each first
    difference; none without both."""
    plain = {(r.dataset, r.sample_id): r.turns[0]["token_ids"] for r in records if r.method == "llama-cpp"}
    if target.backend != "llama-cpp" or not plain:
        return []
    prompts = _first_turn_prompts(cfg)
    arms: dict[tuple, list] = {}
    for r in records:
        if _ours(r) and (r.dataset, r.sample_id) in plain:
            arms.setdefault((r.method, r.tree_size), []).append(r)
    ties: dict[tuple, tuple] = {}  # (dataset, id, position) -> (gap, shift), shared by arms that differ there
    notes = []
    for (method, size), recs in tqdm(arms.items(), desc="llama.cpp agreement", leave=False, file=sys.stderr):
        same, at = 0, []
        for r in recs:
            ours, want = r.turns[0]["token_ids"], plain[(r.dataset, r.sample_id)]
            if ours == want:
                same += 1
                continue
            n = _first_difference(ours, want)
            key = (r.dataset, r.sample_id, n)
            if key not in ties and n < len(want):
                ids = target.encode([{"role": "user", "content": prompts[(r.dataset, r.sample_id)]}])
                ties[key] = near_tie(target, ids + want[:n])
            at.append(f"{r.dataset} {r.sample_id} token {n}"
                      + (" (gap {:.3f}, shift {:.3f})".format(*ties[key]) if key in ties else ""))
        arm = method + (f"@{size}" if size else "")
        notes.append(f"llama.cpp agreement: {arm} equals llama.cpp's plain greedy decoding of the same GGUF on "
                     f"{same}/{len(recs)} first turns" + ("; first differences (the plain run's top-two logit gap "
                                                         "there, and how far rounding among 8 rows shifts those "
                                                         "logits): " + ", ".join(at) if at else ""))
    return notes
