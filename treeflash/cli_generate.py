"""`treeflash generate`: stream one answer and print a one-line summary."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    from .cli import add_engine_args

    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt")
    add_engine_args(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the chat template (default on)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--compare", action="store_true",
                   help="then decode the same prompt plainly (vanilla, same target, dtype and backend) and "
                        "print both speeds and the speedup")
    p.set_defaults(func=run)


def check_prompt(prompt: str) -> None:
    from .errors import TreeflashError

    if not prompt.strip():
        raise TreeflashError("empty prompt")


def summary(cfg, stats) -> str:
    return (f"[{cfg.method}@{cfg.tree_size}] tau {stats.mean_acceptance_length:.2f} | {stats.new_tokens} tokens in "
            f"{stats.total_s:.2f} s | {stats.tokens_per_second:.1f} tok/s | {stats.steps} steps")


def compare(engine, prompt: list[int], cfg, stats, quiet: bool = False) -> dict:
    """Decode the same prompt (its token ids) plainly in this process and say how the two speeds
    compare (on stderr unless quiet)."""
    plain_cfg = cfg.replace(method="vanilla", tree_size=1)
    result = engine.generate(prompt, plain_cfg)
    plain = result.stats
    ratio = stats.tokens_per_second / max(plain.tokens_per_second, 1e-9)
    out = {"plain": plain.to_dict(), "plain_token_ids": result.token_ids, "speedup": round(ratio, 3)}
    if quiet:
        return out
    print(summary(plain_cfg, plain), file=sys.stderr)
    print(f"treeflash: {cfg.method} at tree size {cfg.tree_size} ran {ratio:.2f}x plain decoding "
          f"({str(engine.target.dtype).removeprefix('torch.')}, {engine.target.backend} backend, {torch_threads()} threads, same process)",
          file=sys.stderr)
    return out


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def run(args) -> int:
    from .api import generation_config
    from .cli import load_engine, print_json
    from .decoding.sequence import check_request
    from .decoding.stats import Stats

    check_prompt(args.prompt)
    engine = load_engine(args, quiet=args.method in ("vanilla", "lookup"))
    # encoded once; a prompt no window holds fails before --tree-size auto calibrates (a minute on a first run)
    prompt = engine.target.encode(args.prompt, chat=args.chat)
    check_request(prompt, args.max_new_tokens, engine.target.max_length)
    cfg = generation_config(engine, args, quiet=args.json)  # --json: stderr stays quiet
    if args.json:
        result = engine.generate(prompt, cfg)
        out = result.to_dict()
        if args.compare:
            out["compare"] = compare(engine, prompt, cfg, result.stats, quiet=True)
        print_json(out)
        return 0
    stats = Stats()
    for piece in engine.stream(prompt, cfg, stats=stats):
        sys.stdout.write(piece)
        sys.stdout.flush()
    print()
    print(summary(cfg, stats), file=sys.stderr)
    if args.compare:
        compare(engine, prompt, cfg, stats)
    return 0
