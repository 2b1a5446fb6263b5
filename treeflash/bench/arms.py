"""What a bench arm is, and the names of every benchmarked method (no torch: `treeflash bench --help`
lists them).

- `Method`: one benchmarked method behind `generate(prompt_ids, config) -> Generation`; its
  implementations are in bench/methods.py (ours, Hugging Face, llama-cpp-python) and
  bench/llama_server.py (llama.cpp's own server);
- the method names: ours (`options.METHODS`), the peers, and which of them take a tree size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..options import CORE_METHODS, METHODS as ENGINE_METHODS

if TYPE_CHECKING:
    from ..config import GenerationConfig
    from ..decoding.stats import Stats

TREE_METHODS = tuple(m for m in ENGINE_METHODS if m != "vanilla")  # use --tree-size
HF_METHODS = ("hf-generate", "hf-prompt-lookup", "hf-assisted")
LLAMA_SERVER_METHODS = ("llama-cpp-bf16", "llama-cpp-dflash", "llama-cpp-dflash-q4")  # bench/llama_server.py
ALL_METHODS = ENGINE_METHODS + HF_METHODS + ("llama-cpp",) + LLAMA_SERVER_METHODS
# what `treeflash bench` (and --quick) runs without --methods: ours, then the peers that need no extra model
DEFAULT_METHODS = (*CORE_METHODS, "hf-generate", "hf-prompt-lookup", "llama-cpp")


@dataclass
class Generation:
    token_ids: list[int]
    stats: Stats


class Method:
    name = "base"
    tree_size: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.tree_size is None else f"{self.name}@{self.tree_size}"

    def generate(self, prompt_ids: list[int], p: GenerationConfig) -> Generation:
        raise NotImplementedError
