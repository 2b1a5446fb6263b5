"""`treeflash generate`: stream one answer and print a one-line summary."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    from .cli import add_engine_args, add_sampling_args

    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the chat template (default on)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=run)


def engine_kwargs(args) -> dict:
    """The generate()/stream() keywords common to CLI commands."""
    return dict(method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, sampling_top_k=args.sampling_top_k, tree_size=args.tree_size,
                top_m=args.top_m, top_k=args.top_k, seed=args.seed,
                stage2_vocab=getattr(args, "stage2_vocab", None), draft_vocab=getattr(args, "draft_vocab", True))


def resolve_tree_size(engine, args) -> None:
    """Replace --tree-size auto by the measured choice, and say what it was (stderr)."""
    if args.tree_size == "auto":
        choice = engine.auto_tree_size(args.method, args.top_m, args.top_k, getattr(args, "stage2_vocab", None))
        print(f"treeflash: {choice.summary()}", file=sys.stderr)
        args.tree_size = choice.budget


def check_prompt(prompt: str) -> None:
    from .errors import TreeflashError

    if not prompt.strip():
        raise TreeflashError("empty prompt")


def run(args) -> int:
    from . import api
    from .cli import print_json
    from .decoding.generate import Stats

    check_prompt(args.prompt)
    engine = api.load(args.target, args.drafter, dtype=args.dtype, seed=args.seed or 0, backend=args.backend, quantize=args.quantize,
                      device=args.device,
                      quiet=args.method in ("vanilla", "lookup"))
    resolve_tree_size(engine, args)
    kw = engine_kwargs(args)
    if args.json:
        r = engine.generate(args.prompt, chat=args.chat, **kw)
        d = r.to_dict()
        print_json(d)
        return 0
    stats = Stats()
    for piece in engine.stream(args.prompt, chat=args.chat, stats=stats, **kw):
        sys.stdout.write(piece)
        sys.stdout.flush()
    print()
    print(f"[{args.method}] tau {stats.mean_acceptance_length:.2f} | {stats.new_tokens} tokens in "
          f"{stats.total_s:.2f} s | {stats.tokens_per_second:.1f} tok/s | {stats.steps} steps",
          file=sys.stderr)
    return 0
