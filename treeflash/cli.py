"""`treeflash` command line: thin argument parsing over the API.

Subcommands live beside the code they drive; each module exposes `register(subparsers)` which
adds its parser and sets `func` (a callable taking the parsed args and returning an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .errors import TreeflashError

# subcommand -> the module whose `register(subparsers)` adds it. Only the module of the command
# being run is imported (training, bench and serve code stay out of `treeflash generate`); a bare
# `treeflash`, `--help` or an unknown command loads them all, to list every command.
COMMANDS = {
    "generate": "treeflash.cli_generate",
    "train": "treeflash.training.cli",
    "data": "treeflash.training.cli_data",
    "bench": "treeflash.bench.cli",
    "serve": "treeflash.serve.cli",
    "chat": "treeflash.serve.cli",
    "export": "treeflash.models.export",
    "profile": "treeflash.bench.profile",
    "selftest": "treeflash.bench.selftest",
}
SUBCOMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))


def tree_size_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None


def add_engine_args(p: argparse.ArgumentParser, method_default: str = "treeflash") -> None:
    """Options shared by every command that builds an engine (generate, bench, serve, chat)."""
    from .decoding.proposers import METHODS

    p.add_argument("--target", default="smollm2-135m",
                   help="built-in name, Hugging Face repository id (org/name[@revision]), HF model directory or .gguf file")
    p.add_argument("--drafter", default=None,
                   help="drafter directory or repository id, 'random', or 'none' (default: the drafter shipped for the target)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the models run (auto: CUDA when torch sees a GPU, else the CPU)")
    p.add_argument("--method", default=method_default, choices=METHODS)
    p.add_argument("--tree-size", type=tree_size_arg, default=8,
                   help="nodes verified per step, root included (default 8: measured fastest with --tree-size 4 "
                        "on this project's 2-core CPU, see docs/performance.md); auto: the budget that maximises expected "
                        "tokens/s here, from the target's measured verify cost (cached per machine) and a "
                        "short calibration of the drafter's acceptance")
    p.add_argument("--top-m", type=int, default=8, help="TreeFlash stage-1 candidates per position")
    p.add_argument("--top-k", type=int, default=8, help="TreeFlash stage-2 children per candidate")
    p.add_argument("--stage2-vocab", type=int, default=None,
                   help="TreeFlash stage 2 scores each position's top-N marginal tokens (0 = all)")
    p.add_argument("--draft-vocab", action=argparse.BooleanOptionalAction, default=True,
                   help="propose only from the drafter's draft vocabulary when it ships one (default on)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bf16 where the CPU/GPU computes it natively (fast), else fp32 (exact tests use fp32)")
    p.add_argument("--backend", default="auto", choices=["auto", "hf", "static", "compiled"],
                   help="target forward: static = lean path over a preallocated KV cache (Llama-family; "
                        "auto picks it where supported), compiled = the same under torch.compile "
                        "(first use compiles for ~30 s per tree size), hf = the model's own forward")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="int8 / int4: weight-only quantized target on CPU (faster, but a different target: "
                        "its greedy output differs from the unquantized model's on some tokens)")
    p.add_argument("--seed", type=int, default=None)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-top-k", type=int, default=0, help="sampling top-k (0 = off)")
    p.add_argument("--max-new-tokens", type=int, default=256)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (default: every command): only the module of argv's command is loaded."""
    parser = argparse.ArgumentParser(prog="treeflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    command = next((a for a in argv or () if not a.startswith("-")), None)
    for mod in [COMMANDS[command]] if command in COMMANDS else SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue  # that subcommand group is not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TreeflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False))


if __name__ == "__main__":
    sys.exit(main())
