"""`treeflash export`: write a drafter in the published DFlash or TreeFlash checkpoint layout.

- `--format dflash` (z-lab `DFlashDraftModel`): top-level tensor names, no AR-approximation. This is
  what the SGLang (`--speculative-algorithm DFLASH`) and vLLM (`"method": "dflash"`) loaders read;
  they serve chain drafting.
- `--format treeflash` (`TreeFlashDraftModel`): body under `model.` plus `ar_approximation.*`.
- `--format gguf` (llama.cpp's `--spec-type draft-dflash`): the DFlash body as one GGUF file, written
  by the vendored llama.cpp's own converter (`models/llamacpp.py`; needs `make llama-cpp`).

See docs/checkpoints.md for what each engine needs.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from ..errors import TreeflashError
from .drafter import Drafter
from .drafter_config import FORMATS, check_fits
from .drafter_io import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, load_drafter, save_drafter, state_dict_for

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def register(sub) -> None:
    p = sub.add_parser("export", help="write a drafter in the published DFlash / TreeFlash checkpoint layout")
    p.add_argument("out", help="output directory (--format gguf: a .gguf file)")
    p.add_argument("--format", dest="fmt", default="dflash", choices=(*FORMATS, "gguf"),
                   help="dflash: for SGLang / vLLM (chain drafting; drops the AR-approximation); "
                        "treeflash: the full TreeFlash drafter; gguf: a DFlash GGUF for llama.cpp "
                        "(needs `make llama-cpp`) (default: dflash)")
    p.add_argument("--drafter", default=None,
                   help="drafter directory, a shipped drafter name, or 'random' (default: the drafter "
                        "shipped for --target)")
    p.add_argument("--target", default=None,
                   help="target to check the drafter against (built-in name, HF directory or .gguf); "
                        "default: smollm2-135m when no --drafter directory is given")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="tensor dtype on disk")
    p.add_argument("--copy-code", default=None, metavar="DIR",
                   help="copy the *.py files of a downloaded published drafter (e.g. dflash.py) into OUT, "
                        "for AutoModel.from_pretrained(OUT, trust_remote_code=True)")
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint in OUT")
    p.set_defaults(func=run)


def run(args) -> int:
    out = Path(args.out).expanduser()
    if args.fmt == "gguf":
        return run_gguf(args, out)
    _check_out(out, args.force)
    drafter = drafter_to_export(args.drafter, args.target)
    path = export(drafter, out, args.fmt, DTYPES[args.dtype])
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
    from . import registry
    from .llamacpp import converter, export_gguf

    if out.exists() and not args.force:
        raise TreeflashError(f"{out} exists; pass --force to overwrite")
    converter()  # fail before loading anything when llama.cpp is not built
    target = args.target or registry.DEFAULT_TARGET
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


def export(drafter: Drafter, out: str | Path, fmt: str = "dflash", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `drafter` to `out` in the published layout `fmt`; returns the directory."""
    return save_drafter(drafter, out, dtype, fmt)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise TreeflashError(f"{out} exists and is not a directory")
    existing = [n for n in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME) if (out / n).exists()]
    if existing and not force:
        raise TreeflashError(f"{out} already holds a checkpoint ({', '.join(existing)}); pass --force to overwrite")


def drafter_to_export(name: str | None, target: str | None) -> Drafter:
    """The drafter to export, checked against the target when one is named (or needed)."""
    from . import registry

    if name == "random":
        from ..api import random_drafter
        from .target import Target

        return random_drafter(Target.load(target or registry.DEFAULT_TARGET))
    target_name = target or (registry.DEFAULT_TARGET if name is None else None)
    path = registry.resolve_drafter(name, target_name or registry.DEFAULT_TARGET)
    if path is None:
        raise TreeflashError(f"no trained drafter ships for target {target_name!r}; pass --drafter PATH "
                             "(or --drafter random)")
    drafter = load_drafter(path)
    if target_name is not None:
        tcfg = target_config(target_name)
        check_fits(drafter.config, tcfg, tcfg.vocab_size)
    return drafter


def target_config(name: str):
    """The HF config of a target (no weights loaded)."""
    from transformers import AutoConfig

    from . import registry

    path, gguf = registry.resolve_target(name)
    try:
        cfg = AutoConfig.from_pretrained(str(path), **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError) as e:
        raise TreeflashError(f"cannot read the config of target {name!r}: {str(e).splitlines()[0]}") from None
    return cfg.get_text_config()


def copy_code(src: Path, out: Path) -> list[str]:
    """Copy the remote-code modules (*.py) of a published drafter directory next to the export."""
    files = sorted(src.glob("*.py")) if src.is_dir() else []
    if not files:
        raise TreeflashError(f"--copy-code {src}: no *.py files there (expected e.g. dflash.py of a "
                             "downloaded z-lab DFlash drafter)")
    for f in files:
        shutil.copy2(f, out / f.name)
    return [f.name for f in files]


def serve_hint(path: Path, drafter: Drafter, fmt: str) -> str:
    c = drafter.config
    if fmt == "treeflash":
        return f"use it here with: treeflash generate PROMPT --drafter {path} --method treeflash"
    return ("serve it with\n"
            f"  SGLang: python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {path} --speculative-num-draft-tokens {c.block_size}\n"
            f"  vLLM:   vllm serve TARGET --speculative-config '{{\"method\": \"dflash\", \"model\": \"{path}\", "
            f"\"num_speculative_tokens\": {c.block_size - 1}}}'")
