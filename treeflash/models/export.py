"""Write a drafter in the published DFlash or TreeFlash checkpoint layout (`treeflash export`,
whose command line is treeflash/cli_export.py).

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
from pathlib import Path

import torch

from ..errors import TreeflashError
from .drafter import Drafter, load_drafter, random_drafter
from .drafter_config import check_fits
from .drafter_io import save_drafter


def export(drafter: Drafter, out: str | Path, fmt: str = "dflash", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `drafter` to `out` in the published layout `fmt`; returns the directory."""
    return save_drafter(drafter, out, dtype, fmt)


def drafter_to_export(name: str | None, target: str | None) -> Drafter:
    """The drafter to export, checked against the target when one is named (or needed)."""
    from . import registry

    if name == "random":
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
