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

from . import options
from .errors import TreeflashError

# subcommand -> (the module whose `register(subparsers)` adds it, its line in `treeflash --help`).
# Only the module of the command being run is imported (training, bench and serve code stay out of
# `treeflash generate`); a bare `treeflash`, `--help` or an unknown command lists them from this
# table without importing any. A module's `register` imports nothing heavy (no torch, no
# transformers: tests/test_cli.py checks), so `treeflash CMD --help` answers at once.
COMMANDS = {
    "generate": ("treeflash.cli_generate", "generate text with speculative decoding"),
    "chat": ("treeflash.serve.cli", "chat in the terminal (streaming, multi-turn; /reset, /exit)"),
    "serve": ("treeflash.serve.cli", "serve the OpenAI API (chat/completions, completions, models, metrics)"),
    "bench": ("treeflash.bench.cli", "benchmark acceptance length and speed against peers"),
    "bench-load": ("treeflash.bench.load", "load-test a running server with N concurrent streaming clients"),
    "profile": ("treeflash.bench.profile", "time the parts of a speculative step (target, drafter, tree, cache)"),
    "selftest": ("treeflash.bench.selftest", "exactness on this device and a greedy bench, as one JSON report"),
    "export": ("treeflash.cli_export", "write a drafter in the published DFlash / TreeFlash checkpoint layout"),
    "data": ("treeflash.training.cli_data", "build drafter training data (prompts, regenerated responses)"),
    "train": ("treeflash.training.cli", "train a DFlash/TreeFlash drafter (features, fit, export, tau)"),
}


def add_target_arg(p: argparse.ArgumentParser, role: str = "", default: str | None = options.DEFAULT_TARGET,
                   default_help: str | None = None) -> None:
    """--target, as every command declares it. role: what this command does with it (starts the help);
    default_help: what the default means when it is not a name (export: None)."""
    what = "built-in name, Hugging Face repository id (org/name[@revision]), HF model directory or .gguf file"
    p.add_argument("--target", default=default,
                   help=(f"{role}: " if role else "") + what + f" (default: {default_help or default})")


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=options.DEVICES,
                   help="where the models run (auto: CUDA when torch sees a GPU, else the CPU)")


def add_dtype_arg(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """--dtype with this command's default (exact checks and training use float32, speed runs bf16)."""
    p.add_argument("--dtype", default=default, choices=options.DTYPES,
                   help="auto: bf16 where the CPU/GPU computes it natively (fast), else fp32 (exact tests use "
                        f"fp32) (default: {default})")


def add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", choices=options.BACKENDS,
                   help="target forward: static = lean path over a preallocated KV cache (Llama-family), "
                        "compiled = the same compiled (CPU: built once per machine, minutes, then loaded "
                        "from ~/.cache/treeflash/aot in seconds), compiled-cpp = compiled with every matmul in "
                        "inductor's C++ GEMM template (x86 CPUs; faster verify on CPUs without AVX-512), "
                        "hf = the model's own forward, llama-cpp = the target's GGUF in llama.cpp (4-bit "
                        "included; `make llama-cpp`); auto = the fastest of static, compiled and (where llama.cpp is "
                        "built and the target has a GGUF) llama-cpp here, timed once per machine (hf where "
                        "static does not support the model)")


def add_model_args(p: argparse.ArgumentParser, dtype: str = "auto") -> None:
    """What to load and where: options of every command that builds an engine (dtype: this
    command's default)."""
    add_target_arg(p)
    p.add_argument("--drafter", default=None,
                   help="drafter directory or repository id, 'random', or 'none' (default: the drafter shipped for the target)")
    add_device_arg(p)
    add_dtype_arg(p, dtype)
    add_backend_arg(p)
    p.add_argument("--quantize", default="none", choices=options.QUANTIZE,
                   help="int8 / int4: weight-only quantized target on CPU (faster, but a different target: "
                        "its greedy output differs from the unquantized model's on some tokens)")


# The commands that decode (generate, chat, serve) measure the tree size by default: the budget that
# pays on this machine, from plain decoding on a CPU where trees cost more than they save to 8 or more
# where a tree's verify costs little more than one row; calibrated once per machine and saved. The
# library's `GenerationConfig` keeps a fixed 8 (a call has no calibration unless it asks for "auto").
CLI_TREE_SIZE = "auto"


def add_engine_args(p: argparse.ArgumentParser, **defaults) -> None:
    """Model options and every `GenerationConfig` field (generate, serve, chat)."""
    from .config import GenerationConfig

    add_model_args(p)
    GenerationConfig.add_args(p, **{"tree_size": CLI_TREE_SIZE, **defaults})


def load_engine(args, **kw):
    """The engine the model options in `args` name."""
    from . import api

    return api.load(args.target, args.drafter, dtype=args.dtype, seed=getattr(args, "seed", None) or 0,
                    backend=args.backend, quantize=args.quantize, device=args.device, **kw)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (default: every command): only the module of argv's command is loaded;
    the other commands are listed from `COMMANDS`."""
    parser = argparse.ArgumentParser(prog="treeflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    command = next((a for a in argv or () if not a.startswith("-")), None)
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command][0]).register(sub)  # may add its siblings (serve: chat)
    for name, (_, help) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help)  # listed only: its module loads when it is the command
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
