"""Batched decoding speed per backend: `Engine.generate_batch` of N HumanEval prompts (64 new tokens,
bf16) for plain decoding and treeflash+lookup at budgets 4 and 2, at 1, 4 and N sequences.
Usage: python scripts/batch-backends.py static,compiled 8"""
import sys, time, torch
from treeflash.api import load
from treeflash.datasets import sample_prompts
torch.set_num_threads(2)
backends = sys.argv[1].split(",")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
engine = load(quiet=True)
try:
    prompts = [[{"role": "user", "content": s.turns[0]}] for s in sample_prompts("humaneval", n)]
except Exception as e:
    print("prompts", e); raise
for be in backends:
    engine = type(engine)(engine.target, engine.drafter, backend=be)
    t0 = time.perf_counter()
    engine.generate("hi", engine.config(method="treeflash+lookup", tree_size=4, max_new_tokens=2))
    from treeflash.decoding.batch import BatchDecoder
    BatchDecoder(engine.target, engine.drafter).warm(4 * n)
    print(be, "warm", time.perf_counter() - t0, flush=True)
    for method, ts in (("vanilla", 1), ("treeflash+lookup", 4), ("treeflash+lookup", 2)):
        cfg = engine.config(method=method, tree_size=ts, max_new_tokens=64, ignore_eos=True)
        t0 = time.perf_counter(); engine.generate_batch(prompts[:2], cfg, max_new_tokens=4); tw = time.perf_counter() - t0
        for bs in (1, 4, n):
            t0 = time.perf_counter()
            res = engine.generate_batch(prompts[:bs], cfg)
            dt = time.perf_counter() - t0
            toks = sum(r.stats.new_tokens for r in res)
            print(f"{be:12s} {method}@{ts} bs={bs}: {toks/dt:6.1f} tok/s aggregate (warm {tw:.0f}s)", flush=True)
