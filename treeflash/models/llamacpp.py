"""llama.cpp interop: our drafters as DFlash GGUFs, and llama.cpp's own binaries.

`make llama-cpp` builds the llama.cpp vendored in the `llama-cpp-python` sdist into `.llama.cpp/`
(or set LLAMA_CPP_DIR to another checkout with a `build/bin`). The GGUF is written by that
source's own converter (`convert_hf_to_gguf.py`, which registers `DFlashDraftModel`), from our
`--format dflash` export and the target's tokenizer (`--target-model-dir`): the metadata then is
exactly what this llama.cpp reads, with no second copy of its tensor and key naming here.

llama.cpp's DFlash graph has no TreeFlash AR-approximation (its optional Markov head is a bias from
the previous token alone, another function), so the GGUF carries the DFlash body: llama.cpp drafts
chains with it, as our `--method chain` does with the same weights.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import TreeflashError
from .registry import PACKAGE_ROOT

BUILD_HINT = "run `make llama-cpp` first (builds llama.cpp from the llama-cpp-python sdist, ~25 min)"


def llama_dir() -> Path:
    return Path(os.environ.get("LLAMA_CPP_DIR", PACKAGE_ROOT.parent / ".llama.cpp"))


def source_dir() -> Path | None:
    """The vendored llama.cpp source (holding convert_hf_to_gguf.py), or None."""
    root = llama_dir()
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1].parent if found else None


def binary(name: str) -> Path | None:
    p = llama_dir() / "build" / "bin" / name
    return p if p.exists() else None


def import_binding():
    """llama-cpp-python's module, loading the libllama that `make llama-cpp` built (LLAMA_CPP_LIB_PATH,
    unless set); a missing build or binding is one clear line."""
    lib = llama_dir() / "build" / "bin"
    if "LLAMA_CPP_LIB_PATH" not in os.environ and (lib / "libllama.so").exists():
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TreeflashError(f"llama_cpp is not importable ({why}); {BUILD_HINT}") from None
    return llama_cpp


def converter() -> Path:
    src = source_dir()
    if src is None:
        raise TreeflashError(f"llama.cpp's converter is not here ({llama_dir()}); {BUILD_HINT}")
    return src / "convert_hf_to_gguf.py"


def run_converter(model_dir: Path, out_file: Path, outtype: str, extra: list[str] = ()) -> None:
    cmd = [sys.executable, str(converter()), str(model_dir), "--outfile", str(out_file), "--outtype", outtype, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not out_file.exists():
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise TreeflashError(f"llama.cpp's converter failed on {model_dir}: {tail}")


def export_gguf(drafter, out_file: str | Path, target: str, outtype: str = "bf16") -> Path:
    """Write `drafter` (its DFlash body) as a DFlash GGUF for llama.cpp; `target`: the target whose
    tokenizer and vocabulary the GGUF carries (built-in name, repository id or HF directory)."""
    from . import registry
    import torch

    out_file = Path(out_file).expanduser()
    if out_file.suffix != ".gguf":
        raise TreeflashError(f"--format gguf writes one file: give OUT a .gguf name, got {out_file}")
    target_dir, gguf = registry.resolve_target(target)
    if gguf is not None:
        raise TreeflashError("--format gguf needs the target as a Hugging Face directory (its tokenizer files), "
                             "not a .gguf file")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save(tmp, dtype=torch.bfloat16, fmt="dflash")
        if drafter.draft_vocab is not None:
            _with_draft_vocab(Path(tmp), drafter.draft_vocab, target_dir)
        run_converter(Path(tmp), out_file, outtype, ["--target-model-dir", str(target_dir)])
    out_file.chmod(0o644)
    return out_file


def _with_draft_vocab(dflash_dir: Path, ids, target_dir: Path) -> None:
    """Give a `--format dflash` export its draft vocabulary the way llama.cpp's DFlash graph reads
    one: its own LM head (the target head's rows `ids` [Vd]) and `d2t` (each row's target id, as
    an offset from the row index, the EAGLE-3 convention the converter undoes). Only the converter's
    DSpark class writes `d2t`; without a Markov head that is a plain DFlash draft. Without this,
    llama.cpp drafts from the whole vocabulary, whose rows outside the draft vocabulary this drafter
    never learnt to rank low."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    ids = ids.long().cpu()
    head = _target_tensor(target_dir, ("lm_head.weight", "model.embed_tokens.weight"))  # [V, H]
    weights = dflash_dir / "model.safetensors"
    sd = load_file(str(weights))
    dtype = next(iter(sd.values())).dtype
    sd["lm_head.weight"] = head[ids].to(dtype).contiguous()        # [Vd, H]
    sd["d2t"] = (ids - torch.arange(len(ids))).contiguous()         # [Vd] int64
    save_file(sd, str(weights), metadata={"format": "pt"})
    cfg_file = dflash_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["architectures"] = ["DSparkDraftModel"]
    cfg["draft_vocab_size"] = len(ids)
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def _target_tensor(target_dir: Path, names: tuple[str, ...]):
    """The first of `names` found in the target's safetensors (its LM head, else the tied embedding)."""
    from safetensors import safe_open

    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in names:
                if name in st.keys():
                    return st.get_tensor(name)
    raise TreeflashError(f"target {target_dir}: none of {', '.join(names)} in its safetensors")


def target_gguf(target: str, out_file: str | Path, outtype: str = "bf16") -> Path:
    """The target as a GGUF of `outtype` (bf16, f32, q8_0, ...) from its safetensors, converted once."""
    from . import registry

    out_file = Path(out_file)
    if not out_file.exists():  # written aside, then renamed: a stopped conversion leaves no file to reuse
        target_dir, _ = registry.resolve_target(target)
        part = out_file.with_name(f"{out_file.stem}.{os.getpid()}.part.gguf")
        try:
            run_converter(target_dir, part, outtype)
            part.replace(out_file)
        finally:
            part.unlink(missing_ok=True)
    return out_file


@dataclass
class SpecRun:
    """What `llama-speculative-simple` printed about one run."""

    text: str
    n_predict: int      # tokens generated
    n_drafted: int      # draft tokens proposed
    n_accept: int       # draft tokens accepted
    tokens_per_s: float  # its own decode speed
    steps: int          # target verify passes (n_predict - n_accept: each step adds its accepted drafts + 1)

    @property
    def tau(self) -> float:
        return self.n_predict / max(1, self.steps)


def _num(pattern: str, text: str, cast=int):
    m = re.search(pattern, text)
    if m is None:
        raise TreeflashError(f"llama-speculative-simple output lacks {pattern!r}")
    return cast(m.group(1))


def speculative_simple(target_gguf: Path, draft_gguf: Path, prompt: str, n: int, draft_max: int,
                       threads: int = 2, spec_type: str = "draft-dflash") -> SpecRun:
    """Greedy speculative decoding with llama.cpp's DFlash (temperature 0), one prompt."""
    exe = binary("llama-speculative-simple")
    if exe is None:
        raise TreeflashError(f"llama-speculative-simple is not built; {BUILD_HINT}")
    cmd = [str(exe), "-m", str(target_gguf), "-md", str(draft_gguf), "--spec-type", spec_type, "-p", prompt,
           "-n", str(n), "--temp", "0", "--spec-draft-n-max", str(draft_max), "-t", str(threads), "-td", str(threads),
           "-c", "2048"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise TreeflashError(f"llama-speculative-simple failed ({r.returncode}): {out.strip().splitlines()[-1:]}")
    n_predict = _num(r"n_predict\s*=\s*(\d+)", out)
    n_accept = _num(r"n_accept\s*=\s*(\d+)", out)
    return SpecRun(r.stdout, n_predict, _num(r"n_drafted\s*=\s*(\d+)", out), n_accept,
                   _num(r"decoded\s+\d+\s+tokens in\s+[\d.]+\s*seconds,\s*speed:\s*([\d.]+)", out, float),
                   n_predict - n_accept)
