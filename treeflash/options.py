"""The choices every command and entry point shares, declared once.

This module imports nothing heavy (no torch, no transformers): the command line builds its parsers
and answers `--help` from it without loading the models' code. Each table is the one source of its
names; code that acts on a name (`models.target.parse_dtype`, `Target.set_backend`,
`decoding.proposers.make_proposer`, ...) reads it from here.
"""
from __future__ import annotations

from .errors import TreeflashError

# the built-in target that every command uses when none is named (`models.registry` resolves it)
DEFAULT_TARGET = "smollm2-135m"

# where the models run: auto = CUDA when torch sees a GPU, else the CPU
DEVICES = ("auto", "cpu", "cuda")

# auto = bf16 where the CPU/GPU computes it natively, else fp32 (`models.target.parse_dtype`)
DTYPES = ("auto", "float32", "bfloat16", "float16")

# target forward paths (`models.target.Target.set_backend`; llama-cpp: `models.llama_backend`, a GGUF in libllama)
BACKENDS = ("auto", "hf", "static", "compiled", "compiled-cpp", "llama-cpp")

# weight-only quantization of the target (`models.quant`)
QUANTIZE = ("none", "int8", "int4")

# proposers (`decoding.proposers.make_proposer`): plain decoding, the drafter's trees, n-gram lookup,
# and each drafter tree with lookup branches added
DRAFTER_METHODS = ("chain", "marginal", "treeflash")
METHODS = ("vanilla", *DRAFTER_METHODS, "lookup", *(f"{m}+lookup" for m in DRAFTER_METHODS))


def has_lookup(method: str) -> bool:
    """Whether `method` drafts lookup branches (`lookup`, `NAME+lookup`)."""
    return method == "lookup" or method.endswith("+lookup")
# plain decoding and each drafter tree: what bench, profile and selftest compare unless told otherwise
CORE_METHODS = ("vanilla", *DRAFTER_METHODS)


def check_method(name: str, known: tuple[str, ...] = METHODS) -> str:
    """`name` if it is one of `known` (default: ours), else a one-line TreeflashError listing them."""
    if name not in known:
        raise TreeflashError(f"unknown method {name!r}; choose from {', '.join(known)}")
    return name
