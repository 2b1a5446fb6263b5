"""`treeflash profile`: where the time of a speculative step goes.

Wall-clock timers wrap the parts of a step (no sampling profiler needed, no change to the decode
loop): target forward (verify, without its LM head), KV compaction, drafter layers, drafter heads
(LM head over the marginals, TreeFlash stage 2), lookup (the n-gram index update and the
continuation trie of +lookup methods), tree building (with lookup branches merged in), the target's LM head over the
visited nodes + acceptance (the walk computes those rows lazily), drafter context update (the decode
loop defers it: its keys/values are computed inside the next "drafter layers" call). "other" is the
step time not inside any of them (Python glue in the loop, mask construction, stats). Prefill is
excluded. Methods run interleaved, prompt by prompt.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from collections import defaultdict

from ..options import CORE_METHODS

PARTS = ("target forward", "KV compaction", "drafter layers", "drafter heads", "lookup", "tree build",
         "LM head + acceptance", "drafter context")


class Timers:
    def __init__(self):
        self.s = defaultdict(float)

    def wrap(self, obj, attr: str, part: str, patches: list):
        fn = getattr(obj, attr, None)
        if fn is None:
            return

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[part] += time.perf_counter() - t0
        patches.append((obj, attr, obj.__dict__.get(attr, None)))
        setattr(obj, attr, timed)


@contextlib.contextmanager
def instrumented(engine, proposer, timers: Timers):
    """Patch the step's parts on these objects (instances, and the decode loop's `accept`)."""
    from ..decoding import generate
    from ..models.kvcache import KVCache

    patches: list = []
    t, d = engine.target, engine.drafter
    timers.wrap(t, "forward", "target forward", patches)
    timers.wrap(KVCache, "compact", "KV compaction", patches)  # every cache type's (shared) compaction
    if d is not None:
        timers.wrap(d, "draft", "drafter layers", patches)
        timers.wrap(d, "extend", "drafter context", patches)
    timers.wrap(proposer, "heads", "drafter heads", patches)
    timers.wrap(proposer, "lookup_branches", "lookup", patches)  # +lookup methods: index update + trie
    timers.wrap(proposer, "build", "tree build", patches)
    timers.wrap(generate, "accept", "LM head + acceptance", patches)
    try:
        yield
    finally:
        for obj, attr, old in reversed(patches):
            if old is None:
                delattr(obj, attr)  # instance attribute over the class's method
            else:
                setattr(obj, attr, old)


def profile(engine, prompts: list[str], methods: list[str], config) -> dict:
    """{method: {"steps", "tokens", "step_ms", "tau", "parts_ms": {part: ms per step}}}.

    A method "NAME:full" runs NAME without the drafter's draft vocabulary (whole-vocabulary head).
    config: the GenerationConfig of every run (greedy; its method and draft vocabulary are set here)."""
    from ..decoding.generate import decode
    from ..decoding.stats import Stats

    out = {m: {"steps": 0, "tokens": 0, "time_s": 0.0, "parts": defaultdict(float)} for m in methods}
    for prompt in prompts:
        for method in methods:
            name, _, opt = method.partition(":")
            cfg = engine.config(config, method=name, draft_vocab=config.draft_vocab and opt != "full", temperature=0.0)
            ids, sampling, proposer = engine.prepare(prompt, cfg)
            timers, stats = Timers(), Stats()
            with instrumented(engine, proposer, timers):
                for i, _ in enumerate(decode(engine.target, proposer, ids, cfg.max_new_tokens, sampling, None, stats)):
                    if i == 0:  # the first token comes from the prefill: no step has run yet
                        timers.s.clear()
            r = out[method]
            r["steps"] += stats.steps
            r["tokens"] += stats.new_tokens - 1  # the prefill's token
            r["time_s"] += stats.total_s - stats.prefill_s
            for k, v in timers.s.items():
                r["parts"][k] += v
    report = {}
    for m, r in out.items():
        n = max(1, r["steps"])
        parts = {p: 1e3 * r["parts"].get(p, 0.0) / n for p in PARTS}
        step_ms = 1e3 * r["time_s"] / n
        parts["other"] = step_ms - sum(parts.values())
        report[m] = {"steps": r["steps"], "tokens": r["tokens"], "tau": r["tokens"] / n, "step_ms": step_ms,
                     "tokens_per_s": r["tokens"] / max(r["time_s"], 1e-9), "parts_ms": parts}
    return report


def markdown(report: dict) -> str:
    methods = list(report)
    lines = ["| part (ms per step) | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for p in (*PARTS, "other"):
        cells = [f"{report[m]['parts_ms'][p]:.2f} ({100 * report[m]['parts_ms'][p] / report[m]['step_ms']:.0f}%)"
                 for m in methods]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    for key, fmt in (("step_ms", "{:.2f}"), ("tau", "{:.2f}"), ("tokens_per_s", "{:.1f}")):
        lines.append(f"| **{key.replace('_', ' ')}** | " + " | ".join(fmt.format(report[m][key]) for m in methods) + " |")
    return "\n".join(lines)


def verify_costs(engine, backends: list[str], sizes=(1, 2, 4, 8, 16, 32), rounds: int = 2) -> list[dict]:
    """Rows {backend, round, costs_ms {N: ms}} of N-node forwards without the LM head (N = 0: the
    LM head over one row), backends interleaved per round."""
    from ..decoding import costmodel

    rows = []
    for r in range(rounds):
        for b in backends:
            engine.target.set_backend(b)
            c = costmodel.measure(engine.target, sizes=sizes, context=300, repeats=7, use_cache=False)
            rows.append({"backend": b, "round": r, "costs_ms": {n: round(v * 1e3, 2) for n, v in c.items()}})
    return rows


def print_verify_costs(engine, backends: list[str], as_json: bool) -> int:
    import torch

    rows = verify_costs(engine, backends)
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    sizes = list(rows[0]["costs_ms"])
    print(f"{engine.target.name}, {engine.target.dtype}, {torch.get_num_threads()} threads, ms per forward "
          "after 300 context tokens (N=0: the LM head over one row; N>0: the forward without it)", file=sys.stderr)
    print("| backend (round) | " + " | ".join(f"N={n}" for n in sizes) + " | (16+head)/(1+head) |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for r in rows:
        c = r["costs_ms"]
        ratio = f"{(c[16] + c[0]) / (c[1] + c[0]):.2f}" if 16 in c else "–"
        print(f"| {r['backend']} ({r['round']}) | " + " | ".join(f"{c[n]:.1f}" for n in sizes) + f" | {ratio} |")
    return 0


def register(sub) -> None:
    from ..cli import add_model_args
    from ..config import GenerationConfig

    p = sub.add_parser("profile", help="time the parts of a speculative step (target, drafter, tree, cache)",
                       description=__doc__.splitlines()[0])
    add_model_args(p)
    GenerationConfig.add_args(p, exclude=("method", "temperature", "top_p", "sampling_top_k", "seed", "stop",
                                          "ignore_eos"), max_new_tokens=64)
    p.add_argument("--methods", default=",".join(CORE_METHODS),
                   help="comma list; NAME:full = NAME with the whole-vocabulary drafter head")
    p.add_argument("--dataset", default="humaneval", help="prompts from this bench dataset")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--verify-costs", metavar="BACKENDS", default=None,
                   help="instead: time N-node target forwards (N = 1..32, 300-token context) on each of these "
                        "backends (comma list of hf,static,compiled,compiled-cpp), twice, interleaved")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..cli import load_engine
    from ..errors import TreeflashError
    from ..datasets import sample_prompts

    if args.threads is not None:
        if args.threads < 1:
            raise TreeflashError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise TreeflashError("--num-prompts and --max-new-tokens must be >= 1")
    methods = [m for m in args.methods.split(",") if m]
    engine = load_engine(args, torch_only=bool(args.verify_costs))  # --verify-costs sets PyTorch backends
    if args.verify_costs:
        return print_verify_costs(engine, args.verify_costs.split(","), args.json)
    from ..api import generation_config

    cfg = generation_config(engine, args, per_step=False)  # --tree-size auto: the measured choice, every step
    prompts = [s.turns[0] for s in sample_prompts(args.dataset, args.num_prompts, seed=0)]
    profile(engine, prompts[:1], methods, cfg.replace(max_new_tokens=8))  # warm-up (and compile)
    report = profile(engine, prompts, methods, cfg)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{engine.target.name}, {engine.target.dtype}, backend {engine.target.backend}, tree size "
              f"{cfg.tree_size}, {len(prompts)} {args.dataset} prompts x {args.max_new_tokens} tokens, "
              f"{torch.get_num_threads()} threads", file=sys.stderr)
        print(markdown(report))
    return 0
