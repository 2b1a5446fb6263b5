"""`GenerationConfig`: every generation parameter, its default and its check, defined once.

The API (`Engine.generate(prompt, config)`), the CLI (`add_args` / `from_args`), the bench and the
server (`serve/schemas.py: request_config`) all build this one object, so a new option is a new
field here and reaches every entry point (tests/test_config.py walks the fields to prove it).
Its shares for the sampler (`SamplingParams`) and the proposer (`TreeParams`) are checked here too;
`decoding/` reads them. This module imports no torch and nothing of `decoding/` or `models/`.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from .errors import TreeflashError
from .options import METHODS, check_method


def is_compiled(backend: str) -> bool:
    """Whether the backend runs the target step (and the drafter's block pass) under torch.compile."""
    return backend in ("compiled", "compiled-cpp")


def uses_cpp_gemm(backend: str) -> bool:
    """Whether the backend's compiled graphs put every matmul in inductor's C++ GEMM template."""
    return backend == "compiled-cpp"


def compiles_drafter(backend: str, packages_on_disk: bool) -> bool:
    """Whether the drafter's block passes and TreeFlash heads run compiled: on the compiled backends,
    and on llama-cpp (its target runs outside PyTorch) where compiled graphs are kept on disk (built
    once per machine; with TREEFLASH_AOT=0 it drafts eagerly rather than compile in every process)."""
    return is_compiled(backend) or (backend == "llama-cpp" and packages_on_disk)


def tree_size_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None


def tree_sizes_arg(value: str) -> list[int | str]:
    """A comma list of tree sizes, e.g. "4,8,auto": the --tree-size of the commands that sweep budgets
    (bench, train tau). Values below 1 are `check_tree_sizes`'s to refuse, with the command's message."""
    try:
        return [tree_size_arg(v.strip()) for v in value.split(",") if v.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number, 'auto' or a comma list of them, got {value!r}") from None


def check_tree_sizes(sizes: list, option: str = "--tree-size") -> list:
    """`sizes` (numbers >= 1 and/or "auto", at least one), else a one-line TreeflashError naming `option`."""
    numeric = [b for b in sizes if b != "auto"]
    if not sizes or any(not _is_int(b) for b in numeric) or (numeric and min(numeric) < 1):
        raise TreeflashError(f"{option} values must be >= 1, got {sizes}")
    return sizes


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_or_auto(value) -> bool:
    return value == "auto" or _is_int(value)


def valid_block_len(value) -> bool:
    """Rows of the drafter's block pass: 0 (as deep as the tree) or at least 2 (root + one MASK)."""
    return _is_int(value) and (value == 0 or value >= 2)


def auto_stage2_vocab(budget: int) -> int:
    """Stage-2 columns for `--stage2-vocab auto`: 64 up to budget 4 (a small tree reads only the top
    few tokens, and the heads' cost counts most there), 16 per node above, at most 256."""
    return min(256, max(64, 16 * budget))


def _opt(default, help: str, **cli):
    """A field with its command-line help (and argparse extras: type, action, flag, ...)."""
    meta = {"help": help, **cli}
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class GenerationConfig:
    method: str = _opt("treeflash+lookup", "decoding method (treeflash+lookup: the drafter's TreeFlash tree "
                                             "with branches copied from the text's own repeats)", choices=METHODS)
    tree_size: int | str = _opt(
        8, "nodes verified per step, root included; auto: the budget that maximises expected tokens/s "
           "here (1, plain decoding, where trees do not pay), from the target's measured verify cost and a "
           "short calibration of the drafter, both saved per machine (the first run takes a minute or so)",
        type=tree_size_arg)
    top_m: int = _opt(8, "TreeFlash stage-1 candidates per position")
    top_k: int = _opt(8, "TreeFlash stage-2 children per candidate")
    # docs/performance.md, "Stage-2 columns": 64 columns make the heads cheaper at small budgets for
    # almost no tau; at budget 16 they cost MT-Bench noticeably more tau, so wide trees get more
    stage2_vocab: int | str = _opt(
        "auto", "TreeFlash stage 2 scores each position's top-N marginal tokens (0 = all; auto: 64 up to "
                "budget 4, 16 per node above, at most 256)", type=tree_size_arg)
    draft_vocab: bool = _opt(True, "propose only from the drafter's draft vocabulary when it ships one",
                             action=argparse.BooleanOptionalAction)
    # docs/performance.md, "Drafter block length": at budget 3 on AVX2 bf16, about 1 ms less per step
    # for slightly lower tau
    block_len: int = _opt(0, "rows of the drafter's block pass, root included (0 = as deep as the tree "
                             "reaches: the tree size, at most the drafter's block; N: N rows, at most the block)")
    temperature: float = _opt(0.0, "0 = greedy")
    top_p: float = _opt(1.0, "nucleus sampling mass")
    sampling_top_k: int = _opt(0, "sampling top-k (0 = off)")
    max_new_tokens: int = _opt(256, "most new tokens per answer")
    seed: int | None = _opt(None, "sampling seed (default: fresh randomness)", type=int)
    stop: tuple[str, ...] = _opt((), "stop string (repeatable); the answer ends before it", action="append")
    ignore_eos: bool = _opt(False, "keep generating past end-of-sequence tokens, up to max_new_tokens "
                                   "(as vLLM's ignore_eos; for benchmarks)", action=argparse.BooleanOptionalAction)

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())  # one string: one stop, as OpenAI
        object.__setattr__(self, "stop", stop)

    def replace(self, **changes) -> "GenerationConfig":
        return dataclasses.replace(self, **changes)

    def check(self, vocab: int) -> "GenerationConfig":
        """Raise a one-line TreeflashError on any bad value (vocab: the target's vocabulary rows)."""
        check_method(self.method)
        if not _int_or_auto(self.tree_size):
            raise TreeflashError(f"tree size must be a number or 'auto', got {self.tree_size!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise TreeflashError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise TreeflashError(f"seed must be an integer, got {self.seed!r}")
        if not _int_or_auto(self.stage2_vocab):
            raise TreeflashError(f"stage-2 vocabulary must be a number or 'auto', got {self.stage2_vocab!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise TreeflashError("stop strings must be non-empty text")
        self.sampling(vocab)
        self.tree(vocab, TreeParams.budget if self.tree_size == "auto" else None)  # auto: before it calibrates
        return self

    def sampling(self, vocab: int) -> "SamplingParams":
        return SamplingParams(float(self.temperature), float(self.top_p), int(self.sampling_top_k)).check(vocab)

    def tree(self, vocab: int, budget: int | None = None) -> "TreeParams":
        """The proposer's parameters (budget: the resolved tree size when it is "auto")."""
        size = self.tree_size if budget is None else budget
        cols = self.stage2_vocab if self.stage2_vocab == "auto" else int(self.stage2_vocab)
        return TreeParams(int(size), int(self.top_m), int(self.top_k), cols,
                          bool(self.draft_vocab), int(self.block_len)).check(vocab)

    @classmethod
    def add_args(cls, p: argparse.ArgumentParser, exclude: tuple[str, ...] = (), suppress: bool = False,
                 **defaults) -> None:
        """One `--option` per field. suppress: absent options stay absent from the namespace (so
        `from_args` can tell them from defaults); defaults: other default values for this command."""
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            meta = dict(f.metadata)
            default = defaults.get(f.name, f.default)
            kw = {"help": meta.pop("help") + ("" if suppress else f" (default: {default})")}
            if "choices" in meta:
                kw["choices"] = meta.pop("choices")
            if "action" in meta:
                kw["action"] = meta.pop("action")
            elif "type" in meta:
                kw["type"] = meta.pop("type")
            else:
                kw["type"] = type(f.default)
            if kw.get("action") == "append":
                default = None  # argparse appends to a given default list; () means none
            kw["default"] = argparse.SUPPRESS if suppress else default
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)

    @classmethod
    def from_args(cls, args: argparse.Namespace, base: "GenerationConfig | None" = None) -> "GenerationConfig":
        """The config the parsed options say; fields absent from `args` keep `base`'s values."""
        base = base or cls()
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if given.get("stop", ()) is None:
            given["stop"] = ()
        return base.replace(**given)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "stop": list(self.stop)}


GREEDY_BELOW = 1e-5  # smaller temperatures overflow logits / T: greedy (as in vLLM)


@dataclass(frozen=True)
class SamplingParams:
    """The sampler's share of a `GenerationConfig` (its defaults are that config's; decoding/sampling.py)."""

    temperature: float = GenerationConfig.temperature  # 0 = greedy (argmax)
    top_p: float = GenerationConfig.top_p
    top_k: int = GenerationConfig.sampling_top_k        # 0 = off

    def check(self, vocab: int) -> "SamplingParams":
        if not self.temperature >= 0:
            raise TreeflashError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TreeflashError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.top_k > vocab:
            raise TreeflashError(f"sampling top-k must be in [0, {vocab}], got {self.top_k}")
        return self

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW are greedy (as in vLLM): dividing by them overflows."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class TreeParams:
    """The proposer's share of a `GenerationConfig` (its defaults are that config's)."""

    budget: int = GenerationConfig.tree_size  # nodes verified per step, root included
    top_m: int = GenerationConfig.top_m       # TreeFlash stage-1 candidates per position
    top_k: int = GenerationConfig.top_k       # TreeFlash stage-2 children per candidate
    # TreeFlash stage 2 scores only the position's top-`stage2_vocab` marginal tokens (0 = the whole
    # vocabulary): the LM head over (B-1) x m rows is otherwise the dearest part of a step.
    # "auto" becomes `auto_stage2_vocab(budget)` on construction.
    stage2_vocab: int = GenerationConfig.stage2_vocab
    # Propose only from the drafter's draft vocabulary when it has one (its LM head then runs over
    # those rows; docs/performance.md, "Draft vocabulary"). False: the whole vocabulary.
    draft_vocab: bool = GenerationConfig.draft_vocab
    # Rows of the drafter's block pass, root included (0: the budget; capped at the drafter's block).
    block_len: int = GenerationConfig.block_len

    def __post_init__(self):
        if self.stage2_vocab == "auto":  # never narrower than the children it picks from
            object.__setattr__(self, "stage2_vocab", max(self.top_k, auto_stage2_vocab(self.budget)))

    def check(self, vocab: int) -> "TreeParams":
        """Raise on a bad value; a stage-2 vocabulary wider than `vocab` becomes `vocab`."""
        if self.budget < 1:
            raise TreeflashError(f"tree size must be >= 1, got {self.budget}")
        for name, v in (("top-m", self.top_m), ("top-k", self.top_k)):
            if not 1 <= v <= vocab:
                raise TreeflashError(f"{name} must be in [1, {vocab}] (the vocabulary size), got {v}")
        if self.stage2_vocab and not self.top_k <= self.stage2_vocab:
            raise TreeflashError(f"stage-2 vocabulary must be 0 or in [top-k, {vocab}], got {self.stage2_vocab}")
        if not valid_block_len(self.block_len):
            raise TreeflashError(f"block length must be 0 (the tree size) or >= 2, got {self.block_len!r}")
        return dataclasses.replace(self, stage2_vocab=min(self.stage2_vocab, vocab))
