"""`treeflash bench`: our methods and their peers on the same prompts, in one run."""
from __future__ import annotations

import sys


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def register(sub) -> None:
    from ..cli import add_model_args
    from ..config import GenerationConfig, tree_sizes_arg
    from ..datasets import DATASETS
    from .arms import ALL_METHODS

    p = sub.add_parser("bench", help="benchmark acceptance length and speed against peers",
                       description=__doc__.splitlines()[0])
    p.add_argument("--datasets", type=_csv, default=None, help=f"comma list of {', '.join(DATASETS)} (default: all)")
    p.add_argument("--methods", type=_csv, default=None,
                   help=f"comma list of {', '.join(ALL_METHODS)} (default: all but hf-assisted, which needs "
                        "--assistant)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (default 20)")
    p.add_argument("--tree-size", type=tree_sizes_arg, default=None,
                   help="nodes verified per step; a comma list (e.g. 4,8,16,32,auto) sweeps the budget; auto picks "
                        "each method's best budget on this machine (see treeflash generate --help); default 16")
    # every generation option but the arm's own (method, tree size), the bench seed, and stop strings
    # and ignore_eos (the peers honour neither); absent options keep the preset's value (--quick: 32)
    GenerationConfig.add_args(p, exclude=("method", "tree_size", "seed", "stop", "ignore_eos"), suppress=True)
    add_model_args(p)  # the target (and backend, quantization) of our methods and the peers; dtype auto, as generate
    p.add_argument("--assistant", default=None, help="NAME|PATH of a smaller same-tokenizer model for hf-assisted")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling and sampling seed")
    p.add_argument("--repeats", type=int, default=1, help="runs per prompt and method; the median time is kept")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up generation")
    p.add_argument("--humaneval-timeout", type=float, default=3.0, help="seconds per HumanEval test program")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.add_argument("--quick", action="store_true",
                   help="preset: humaneval,gsm8k,mt-bench, 2 prompts, 32 tokens, budget 16 (< 5 min here); "
                        "explicit options still win")
    p.set_defaults(func=run)


def config_from_args(args):
    from ..config import GenerationConfig
    from .runner import QUICK, BenchConfig

    cfg = BenchConfig()
    if args.quick:
        for k, v in QUICK.items():
            setattr(cfg, k, list(v) if isinstance(v, list) else v)
    cfg.generation = GenerationConfig.from_args(args, cfg.generation)
    explicit = {"datasets": args.datasets, "methods": args.methods, "num_prompts": args.num_prompts,
                "tree_sizes": args.tree_size}
    for k, v in explicit.items():
        if v is not None:
            setattr(cfg, k, v)
    if args.assistant and args.methods is None and "hf-assisted" not in cfg.methods:
        cfg.methods = cfg.methods + ["hf-assisted"]
    for k in ("dtype", "backend", "quantize", "target", "drafter", "device", "assistant", "seed", "repeats",
              "warmup", "humaneval_timeout", "threads", "out"):
        setattr(cfg, k, getattr(args, k))
    return cfg.validate()


def run(args) -> int:
    from .runner import run_bench

    cfg = config_from_args(args)
    results = run_bench(cfg)
    print(f"wrote {cfg.out}/results.json, results.md, generations.jsonl and "
          f"{len(results.get('plots', []))} plots ({results['wall_s']:.0f} s)", file=sys.stderr)
    print(open(f"{cfg.out}/results.md").read())
    return 0
