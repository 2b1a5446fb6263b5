"""Does a greedy answer depend on its batch mates here? For each dtype: (1) the GEMM check: how many
elements of one row of x @ W.T change when the product holds M rows instead of 1 (the target's own
MLP weight); (2) N greedy prompts (4 HumanEval + 4 MT-Bench, treeflash at a fixed budget 8, 64 new
tokens) decoded together by the batched engine vs each alone: how many answers are identical, and the
aggregate tokens/s of each way (alone = what a per-sequence forward would cost).
Usage: python scripts/batch-invariance.py [target] [backend]   (defaults: smollm2-135m static)"""
import sys
import time

import torch
import torch.nn.functional as F

from treeflash.api import load
from treeflash.datasets import sample_prompts

torch.set_num_threads(2)
target = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
backend = sys.argv[2] if len(sys.argv) > 2 else "static"
samples = sample_prompts("humaneval", 4) + sample_prompts("mt-bench", 4)
prompts = [[{"role": "user", "content": s.turns[0]}] for s in samples]
print(f"target {target}, backend {backend}, {torch.get_num_threads()} threads")
print("| dtype | row elements changed by M=2/4/8/16/32 (of one row) | identical answers, batch vs alone "
      "| tok/s together | tok/s alone |")
print("|---|---|---|---|---|")
for dtype in ("bfloat16", "float32"):
    engine = load(target, dtype=dtype, backend=backend, quiet=True)
    w = next(m.weight for n, m in engine.target.model.named_modules() if n.endswith("mlp.up_proj"))
    x = torch.randn(32, w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(0))
    one = F.linear(x[:1], w)
    changed = [int((F.linear(x[:m], w)[:1] != one).sum()) for m in (2, 4, 8, 16, 32)]
    cfg = engine.config(method="treeflash", tree_size=8, max_new_tokens=64, temperature=0.0)
    engine.generate_batch(prompts[:2], cfg, max_new_tokens=4)  # warm
    t0 = time.perf_counter()
    alone = [engine.generate_batch([p], cfg)[0] for p in prompts]
    t_alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    together = engine.generate_batch(prompts, cfg)
    t_together = time.perf_counter() - t0
    same = sum(a.token_ids == b.token_ids for a, b in zip(alone, together))
    toks = sum(r.stats.new_tokens for r in together)
    print(f"| {dtype} | {'/'.join(map(str, changed))} of {w.shape[0]} | {same} of {len(prompts)} "
          f"| {toks / t_together:.1f} | {sum(r.stats.new_tokens for r in alone) / t_alone:.1f} |", flush=True)
