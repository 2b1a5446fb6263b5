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

from .config import BACKENDS
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


def add_model_args(p: argparse.ArgumentParser) -> None:
    """What to load and where: options of every command that builds an engine."""
    p.add_argument("--target", default="smollm2-135m",
                   help="built-in name, Hugging Face repository id (org/name[@revision]), HF model directory or .gguf file")
    p.add_argument("--drafter", default=None,
                   help="drafter directory or repository id, 'random', or 'none' (default: the drafter shipped for the target)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the models run (auto: CUDA when torch sees a GPU, else the CPU)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bf16 where the CPU/GPU computes it natively (fast), else fp32 (exact tests use fp32)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="target forward: static = lean path over a preallocated KV cache (Llama-family; "
                        "auto picks it where supported), compiled = the same under torch.compile "
                        "(first use compiles for ~30 s per tree size), compiled-cpp = compiled with every "
                        "matmul in inductor's C++ GEMM template (x86 CPUs; faster verify on CPUs without "
                        "AVX-512; first use compiles for minutes), hf = the model's own forward")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="int8 / int4: weight-only quantized target on CPU (faster, but a different target: "
                        "its greedy output differs from the unquantized model's on some tokens)")


def add_engine_args(p: argparse.ArgumentParser, **defaults) -> None:
    """Model options and every `GenerationConfig` field (generate, serve, chat)."""
    from .config import GenerationConfig

    add_model_args(p)
    GenerationConfig.add_args(p, **defaults)


def load_engine(args, **kw):
    """The engine the model options in `args` name."""
    from . import api

    return api.load(args.target, args.drafter, dtype=args.dtype, seed=getattr(args, "seed", None) or 0,
                    backend=args.backend, quantize=args.quantize, device=args.device, **kw)


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
