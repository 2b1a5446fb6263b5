"""What treeflash reads of a GGUF itself, beside llama.cpp (`llama_backend.py`): which file a
target name means, its LM head as ggml dequantizes it (the drafter's head), and its tokenizer and
config (read by transformers once, then kept)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..errors import TreeflashError
from . import llamacpp, registry


def gguf_of(name_or_path: str) -> Path:
    """The GGUF file of a built-in target (its shipped file) or a .gguf path."""
    if name_or_path in registry.TARGETS:
        return registry.gguf_path(name_or_path)
    p = Path(name_or_path).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return p
    raise TreeflashError(f"--backend llama-cpp runs a GGUF: give a built-in target ({', '.join(registry.TARGETS)}) "
                         f"or a .gguf file, not {name_or_path!r}")


def has_gguf(name_or_path: str) -> bool:
    """Whether `gguf_of` finds a file for this name (a built-in whose assets are installed, or a .gguf path)."""
    try:
        gguf_of(name_or_path)
    except TreeflashError:
        return False
    return True


class _TypeTraits(ctypes.Structure):  # ggml.h's struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool),
                ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)),
                ("from_float_ref", ctypes.c_void_p)]


class _GGUFParams(ctypes.Structure):  # gguf.h's struct gguf_init_params
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _ggml():
    g = ctypes.CDLL(str(llamacpp.llama_dir() / "build" / "bin" / "libggml-base.so"))
    sig = {"ggml_get_type_traits": ([ctypes.c_int], ctypes.POINTER(_TypeTraits)),
           "gguf_init_from_file": ([ctypes.c_char_p, _GGUFParams], ctypes.c_void_p),
           "gguf_find_tensor": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int64),
           "gguf_get_data_offset": ([ctypes.c_void_p], ctypes.c_size_t),
           "gguf_get_tensor_offset": ([ctypes.c_void_p, ctypes.c_int64], ctypes.c_size_t),
           "gguf_get_tensor_size": ([ctypes.c_void_p, ctypes.c_int64], ctypes.c_size_t),
           "gguf_get_tensor_type": ([ctypes.c_void_p, ctypes.c_int64], ctypes.c_int),
           "gguf_free": ([ctypes.c_void_p], None)}
    for name, (args, res) in sig.items():
        getattr(g, name).argtypes, getattr(g, name).restype = args, res
    return g


def output_weight(path: Path, rows: int, cols: int) -> torch.Tensor | None:
    """`output.weight` [rows=V, cols=H] of a GGUF in float32, dequantized by ggml's own row
    function (the values llama.cpp's LM head multiplies by); None where the LM head is tied to the
    token embedding (no such tensor). ggml's gguf reader finds it; the file is mapped, not read."""
    g = _ggml()
    ctx = g.gguf_init_from_file(str(path).encode(), _GGUFParams(True, None))
    if not ctx:
        raise TreeflashError(f"ggml cannot read {path.name}'s tensor table")
    try:
        i = g.gguf_find_tensor(ctx, b"output.weight")
        if i < 0:
            return None
        off = g.gguf_get_data_offset(ctx) + g.gguf_get_tensor_offset(ctx, i)
        size, kind = g.gguf_get_tensor_size(ctx, i), g.gguf_get_tensor_type(ctx, i)
    finally:
        g.gguf_free(ctx)
    traits = g.ggml_get_type_traits(kind).contents
    if size * traits.blck_size != rows * cols * traits.type_size:
        raise TreeflashError(f"{path.name}'s output.weight is not [{rows}, {cols}]")
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=off, shape=(size,))  # copy-on-write: never written
    out = torch.empty(rows, cols, dtype=torch.float32)
    if traits.to_float:
        traits.to_float(raw.ctypes.data, ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_float)), rows * cols)
    else:  # F32: stored as is
        out.copy_(torch.from_numpy(raw.view(np.float32).reshape(rows, cols)))
    return out


def hf_meta(gguf: Path, converted: Path | None):
    """The config and tokenizer of a GGUF: from a built-in target's converted directory when
    present, else read from the GGUF by transformers once and kept under the cache (reading a
    GGUF's vocabulary takes transformers half a minute)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    st = gguf.stat()
    kept = registry.cache_dir() / "gguf-meta" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"
    done = lambda d: (d / "config.json").exists() and (d / "tokenizer_config.json").exists()  # noqa: E731
    for d in (converted, kept):
        if d is not None and done(d):
            return AutoConfig.from_pretrained(str(d)), AutoTokenizer.from_pretrained(str(d))
    print(f"treeflash: reading {gguf.name}'s tokenizer and config (once)", flush=True)
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError) as e:
        raise TreeflashError(f"cannot read {gguf.name}'s tokenizer and config: {str(e).splitlines()[0]}") from None

    def write(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    registry.write_dir(kept, write, complete=done)
    return config, tok
