"""`treeflash export`: write a drafter in the published DFlash / TreeFlash layout, or a GGUF for
llama.cpp (models/export.py does the work; see its docstring and docs/export.md)."""
from __future__ import annotations

import sys
from pathlib import Path

from .errors import TreeflashError
from .models.drafter_config import FORMATS  # stdlib only
from .options import DEFAULT_TARGET, DTYPES


def register(sub) -> None:
    from .cli import add_target_arg

    p = sub.add_parser("export", help="write a drafter in the published DFlash / TreeFlash checkpoint layout")
    p.add_argument("out", help="output directory (--format gguf: a .gguf file)")
    p.add_argument("--format", dest="fmt", default="dflash", choices=(*FORMATS, "gguf"),
                   help="dflash: for SGLang / vLLM (chain drafting; drops the AR-approximation); "
                        "treeflash: the full TreeFlash drafter; gguf: a DFlash GGUF for llama.cpp "
                        "(needs `make llama-cpp`) (default: dflash)")
    p.add_argument("--drafter", default=None,
                   help="drafter directory, a shipped drafter name, or 'random' (default: the drafter "
                        "shipped for --target)")
    add_target_arg(p, "target to check the drafter against", default=None,
                   default_help=f"{DEFAULT_TARGET} when no --drafter directory is given")
    p.add_argument("--dtype", default="bfloat16", choices=[d for d in DTYPES if d != "auto"],
                   help="tensor dtype on disk (default: bfloat16)")
    p.add_argument("--copy-code", default=None, metavar="DIR",
                   help="copy the *.py files of a downloaded published drafter (e.g. dflash.py) into OUT, "
                        "for AutoModel.from_pretrained(OUT, trust_remote_code=True)")
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint in OUT")
    p.set_defaults(func=run)


def run(args) -> int:
    from .models.drafter_io import state_dict_for
    from .models.export import copy_code, drafter_to_export, export, serve_hint
    from .models.target import parse_dtype

    out = Path(args.out).expanduser()
    if args.fmt == "gguf":
        return run_gguf(args, out)
    _check_out(out, args.force)
    drafter = drafter_to_export(args.drafter, args.target)
    path = export(drafter, out, args.fmt, parse_dtype(args.dtype))
    if args.copy_code:
        copy_code(Path(args.copy_code).expanduser(), out)
    n = len(state_dict_for(drafter, args.fmt))
    print(f"wrote {path} ({args.fmt} layout, {n} tensors, {args.dtype})")
    if args.fmt == "dflash" and drafter.ar_approximation is not None:
        print("note: the TreeFlash AR-approximation is not part of the DFlash format and was left out; "
              "engines serve chain drafting (use --format treeflash to keep it)", file=sys.stderr)
    print(serve_hint(path, drafter, args.fmt))
    return 0


def run_gguf(args, out: Path) -> int:
    from .models.export import drafter_to_export
    from .models.llamacpp import converter, export_gguf

    if out.exists() and not args.force:
        raise TreeflashError(f"{out} exists; pass --force to overwrite")
    converter()  # fail before loading anything when llama.cpp is not built
    target = args.target or DEFAULT_TARGET
    drafter = drafter_to_export(args.drafter, target)
    path = export_gguf(drafter, out, target, "bf16" if args.dtype == "bfloat16" else "f32")
    print(f"wrote {path} (DFlash GGUF for llama.cpp, {drafter.config.num_hidden_layers} layers, block "
          f"{drafter.config.block_size})")
    if drafter.ar_approximation is not None:
        print("note: llama.cpp has no TreeFlash AR-approximation; the GGUF carries the DFlash body, which "
              "llama.cpp drafts chains with", file=sys.stderr)
    print(f"run it with: .llama.cpp/build/bin/llama-speculative-simple -m TARGET.gguf -md {path} "
          f"--spec-type draft-dflash --spec-draft-n-max {drafter.config.block_size - 1} --temp 0 -p PROMPT")
    return 0


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise TreeflashError(f"{out} exists and is not a directory")
    from .models.drafter_io import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME

    existing = [n for n in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME) if (out / n).exists()]
    if existing and not force:
        raise TreeflashError(f"{out} already holds a checkpoint ({', '.join(existing)}); pass --force to overwrite")
