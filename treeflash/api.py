"""The Python API: `engine = treeflash.load(); engine.generate("Hi")`."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .decoding.generate import decode
from .decoding.stats import Stats
from .config import GenerationConfig, compiles_drafter, uses_cpp_gemm
from .decoding.proposers import check_drafter, make_proposer, plain_only
from .decoding.text import TextAssembler, pieces
from .errors import TreeflashError
from .models import aot, registry
from .options import DEVICES, has_lookup
from .models.drafter import Drafter, load_drafter, random_drafter  # noqa: F401 (random_drafter: part of the API)
from .models.drafter_config import check_fits
from .models.target import Target, parse_dtype


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


# Calibration prompts for `tree_size="auto"` (not from any evaluation set).
CALIBRATION_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "A shop sells pens at 3 dollars each. How much do 7 pens and a 5 dollar notebook cost? Explain.",
    "Give three tips for writing clear emails at work.",
)


@dataclass
class AutoChoice:
    """What `tree_size="auto"` picked, and from what."""

    method: str
    budget: int
    expected_tokens_per_s: float
    expected_tau: float
    draft_s: float            # per step
    verify_costs: dict        # {tree size: seconds per forward}
    # what the choice came from, for the batch size-adaptive budget (`costmodel.adaptive_budget`):
    # per best-first node acceptance, and the drafting cost (at budget 2, at the largest, max depth)
    node_accept: list = field(default_factory=list)
    draft_costs: tuple = ()

    def draft_fn(self):
        """Drafting seconds per step as a function of the budget (`costmodel.draft_cost`)."""
        from .decoding import costmodel

        return costmodel.draft_cost(*self.draft_costs) if self.draft_costs else (lambda _b: self.draft_s)

    def step_budget(self):
        """Per-step budgets from the text's repeats (`decoding.step_budget`) for a lookup method; None
        for the others (every step runs at `budget`)."""
        from .decoding.step_budget import LOOKUP_MAX, StepBudget

        if not has_lookup(self.method):
            return None
        return StepBudget(self.verify_costs, list(self.node_accept), self.draft_fn(), max(LOOKUP_MAX, self.budget))

    def summary(self) -> str:
        lookup = "; lookup-only trees where the text repeats" if has_lookup(self.method) else ""
        if self.budget == 1 and not plain_only(self.method):  # a proposer that could have drafted
            return (f"tree size auto -> 1: speculation does not pay on this machine for {self.method} (1-node "
                    f"forward {self.verify_costs.get(1, 0) * 1e3:.1f} ms, draft {self.draft_s * 1e3:.1f} ms/step); "
                    f"decoding plainly{lookup}")
        return (f"tree size auto -> {self.budget} for {self.method} (expected tau {self.expected_tau:.2f}, "
                f"{self.expected_tokens_per_s:.1f} tok/s; 1-node forward {self.verify_costs.get(1, 0) * 1e3:.1f} ms "
                f"+ LM head {self.verify_costs.get(0, 0) * 1e3:.1f} ms/row, draft {self.draft_s * 1e3:.1f} ms/step{lookup})")


class Engine:
    """A target and its drafter, with this engine's own backend and taps (explicit state): a target
    cached for the process may serve several engines, and each sets what it needs before running."""

    def __init__(self, target: Target, drafter: Drafter | None, backend: str | None = None):
        self.target, self.drafter = target, drafter
        self.backend = backend or target.backend
        self.auto: dict[tuple, AutoChoice] = {}
        if drafter is not None:
            check_fits(drafter.config, target.config, target.vocab_rows)
            drafter.to(device=target.device, dtype=target.dtype)
        self.bind()

    def config(self, config: GenerationConfig | None = None, **overrides) -> GenerationConfig:
        """`config` (default: `GenerationConfig()`) with `overrides`, checked against the target."""
        cfg = config or GenerationConfig()
        return (cfg.replace(**overrides) if overrides else cfg).check(self.target.vocab_rows)

    def bind(self) -> None:
        """Put the shared target in this engine's state: its backend, the layers its drafter reads
        (before any target call made outside the engine's own loops, as the batched server's)."""
        if self.drafter is not None and self.target.tap_ids != self.drafter.config.target_layer_ids:
            self.target.set_taps(self.drafter.config.target_layer_ids)  # first: compiled steps are per taps
        if self.backend == "auto":  # the faster backend here, timed once per machine
            from .decoding import costmodel

            self.backend = costmodel.auto_backend(self.target)
        if self.target.backend != self.backend:
            self.target.set_backend(self.backend)
            self.backend = self.target.backend

    def prepare(self, prompt, cfg: GenerationConfig, chat: bool = True):
        """(prompt ids, sampling, proposer) for one generation, its steps compiled: what the engine's
        loops start from, and the loops that run outside it (the batched server, `bench profile`)."""
        self.bind()
        vocab = self.target.vocab_rows
        choice = self.auto_tree_size(cfg) if cfg.tree_size == "auto" else None
        proposer = make_proposer(cfg.method, self.drafter, self.target.embed, self.target.drafting_head,
                                 cfg.tree(vocab, choice.budget if choice is not None else cfg.tree_size))
        proposer.planner = choice.step_budget() if choice is not None else None
        if proposer.drafts:  # the drafter's block passes and heads, compiled where the backend says (not for plain decoding)
            backend = self.target.backend
            on = compiles_drafter(backend, aot.enabled() and self.target.device.type == "cpu")
            self.drafter.compile_drafting(on, cpp_gemm=uses_cpp_gemm(backend))
            proposer.compile_heads(on, cpp_gemm=uses_cpp_gemm(backend))
        # compile now what this generation will run: a tree of any size up to its rows at the budget (the root
        # alone at the end; lookup trees are as large as the text's repeats)
        self.target.warm(range(1, proposer.max_rows() + 1))
        return self.target.encode(prompt, chat=chat), cfg.sampling(vocab), proposer

    def tokens(self, prompt, config: GenerationConfig | None = None, *, chat: bool = True,
               stats: Stats | None = None, text: TextAssembler | None = None, **overrides) -> Iterator[int]:
        """Yield new token ids (prompt: text, chat messages, or token ids). `config` and keyword
        overrides of its fields (`method=`, `tree_size=`, ...) say how; see `GenerationConfig`.
        Stop strings apply only with `text` (`assembler(cfg)`, fed every token; `stream` and
        `generate` pass one): decoding ends at the token completing one."""
        cfg = self.config(config, **overrides)
        ids, sampling, proposer = self.prepare(prompt, cfg, chat)
        with torch.no_grad():
            yield from decode(self.target, proposer, ids, cfg.max_new_tokens, sampling, cfg.seed, stats,
                              set() if cfg.ignore_eos else None, text)

    def auto_tree_size(self, config: GenerationConfig | None = None, max_budget: int = 64, tokens: int = 48,
                       **overrides) -> AutoChoice:
        """The budget maximising expected tokens/s on this machine (`costmodel.best_budget`): the
        target's verify cost per tree size (measured once, cached on disk), and this drafter's
        acceptance of each best-first node, measured by a short calibration run at `max_budget`, and
        its drafting cost, measured at `max_budget` and at 2. Memoised per engine and tree options, and
        saved on disk per machine, model, dtype, backend, threads and drafter (`costmodel.save_choice`)."""
        from .decoding import costmodel

        cfg = self.config(config, **overrides)
        self.bind()
        key = (cfg.method, cfg.top_m, cfg.top_k, cfg.stage2_vocab, cfg.draft_vocab, cfg.block_len, self.target.backend,
               torch.get_num_threads())
        if key in self.auto:
            return self.auto[key]
        method = cfg.method
        disk_key = "|".join([costmodel.machine_key(self.target, 256), self._drafter_id(), repr(key[:-2]), str(max_budget)])
        plain = plain_only(method)
        if not plain:
            check_drafter(method, self.drafter)  # before a calibration or a saved choice says anything
        saved = costmodel.saved_choice(disk_key) if not plain else None
        if saved is not None and "node_accept" not in saved:
            saved = None  # saved before the choice kept what the batch-adaptive budget reads: calibrate again
        if plain:
            choice = AutoChoice(method, 1, 0.0, 1.0, 0.0, {})
        elif saved is not None:  # calibrated by an earlier process on this machine
            choice = AutoChoice(method, saved["budget"], saved["expected_tokens_per_s"], saved["expected_tau"],
                                saved["draft_s"], costmodel.measure(self.target), saved["node_accept"],
                                tuple(saved.get("draft_costs", ())))
        else:
            costs = costmodel.measure(self.target)  # with this drafter's taps: they are part of a forward
            calib = cfg.replace(temperature=0.0, stop=(), seed=None, ignore_eos=True)
            # untimed first: compiling (the compiled backend) must not count as drafting time; long
            # enough for full blocks and the shorter ones at the end (each a drafter shape)
            for _ in self.tokens(CALIBRATION_PROMPTS[0], calib, max_new_tokens=24, tree_size=max_budget):
                pass
            stats, small = Stats(), Stats()
            for prompt in CALIBRATION_PROMPTS:
                for budget, st in ((max_budget, stats), (2, small)):
                    for _ in self.tokens(prompt, calib, max_new_tokens=tokens, tree_size=budget, stats=st):
                        pass
            # drafting cost per step at budget 2 and at max_budget (the heads run as deep as the
            # budget reaches, so small budgets draft for less), linear in between by head depth
            draft_costs = ((small.draft_s + small.tree_s) / max(1, small.steps),
                           (stats.draft_s + stats.tree_s) / max(1, stats.steps),
                           self.drafter.block_size - 1 if self.drafter is not None else 1)
            draft = costmodel.draft_cost(*draft_costs)
            node_accept = stats.node_acceptance()
            # lookup trees are smaller than the budget where the text does not repeat
            sizes = stats.tree_sizes if has_lookup(method) else None
            budget, rate = costmodel.best_budget(costs, node_accept, draft, range(2, max_budget + 1), sizes)
            choice = AutoChoice(method, budget, rate, costmodel.expected_tau(node_accept, budget),
                                draft(budget) if budget > 1 else 0.0, costs, list(node_accept), draft_costs)
            costmodel.save_choice(disk_key, {"budget": budget, "expected_tokens_per_s": rate,
                                             "expected_tau": choice.expected_tau, "draft_s": choice.draft_s,
                                             "node_accept": list(node_accept), "draft_costs": list(draft_costs)})
        self.auto[key] = choice
        return choice

    def _drafter_id(self) -> str:
        """The drafter's weights' fingerprint (a cache key of the auto tree size), computed once."""
        if not hasattr(self, "_drafter_fp"):
            from .decoding import costmodel

            self._drafter_fp = "none" if self.drafter is None else costmodel.fingerprint(self.drafter)
        return self._drafter_fp

    def _pieces(self, prompt, cfg: GenerationConfig, chat: bool, stats: Stats | None,
                text: TextAssembler, ids: list[int] | None = None) -> Iterator[str]:
        """Text pieces of one generation (`decoding.text.pieces`); `ids` (if given) receives every
        token id, stop tokens too."""
        yield from pieces(self.tokens(prompt, cfg, chat=chat, stats=stats, text=text), text, ids)

    def assembler(self, cfg: GenerationConfig) -> TextAssembler:
        """Token ids -> text for `cfg` (its stop strings; the target's stop tokens hidden)."""
        return TextAssembler(self.target.tokenizer, self.target.stop_ids(), list(cfg.stop))

    def stream(self, prompt, config: GenerationConfig | None = None, *, chat: bool = True,
               stats: Stats | None = None, **overrides) -> Iterator[str]:
        """Yield text pieces as they are decoded (stop tokens are not shown; a stop string ends the
        answer and is not shown either)."""
        cfg = self.config(config, **overrides)
        yield from self._pieces(prompt, cfg, chat, stats, self.assembler(cfg))

    def generate(self, prompt, config: GenerationConfig | None = None, *, chat: bool = True,
                 **overrides) -> Result:
        cfg = self.config(config, **overrides)
        stats, text = Stats(), self.assembler(cfg)
        ids: list[int] = []
        for _ in self._pieces(prompt, cfg, chat, stats, text, ids):
            pass
        return Result(text.final_text(), ids, stats)

    def generate_batch(self, prompts: list, config: GenerationConfig | None = None, *, chat: bool = True,
                       **overrides) -> list[Result]:
        """`generate` for several prompts decoded together, one target forward per step for all
        (`decoding/batch.py`; the static and compiled backends; on the others one after another)."""
        from .decoding.batch import BatchDecoder
        from .models.fastpath import FastPath

        cfg = self.config(config, **overrides)
        if not isinstance(self.target.runner, FastPath):  # hf, llama-cpp: the same results, one after another
            return [self.generate(x, cfg, chat=chat) for x in prompts]
        dec = BatchDecoder(self.target, self.drafter)
        prepared = [self.prepare(x, cfg, chat) for x in prompts]
        dec.warm(sum(p.max_rows() for _, _, p in prepared))
        texts = [self.assembler(cfg) for _ in prepared]
        seqs = [dec.add(ids, cfg, proposer=p, text=t) for (ids, _, p), t in zip(prepared, texts)]
        return [Result(t.final_text(), ids, st) for t, (ids, st) in zip(texts, dec.run(seqs))]


def generation_config(engine: Engine, args, quiet: bool = False, per_step: bool = True) -> GenerationConfig:
    """The parsed options' GenerationConfig, checked, with --tree-size auto measured (the choice said
    on stderr unless quiet, or the method never drafts) and replaced by its budget; with `per_step`,
    a lookup method keeps "auto": its steps choose their budgets from that choice and the text's
    repeats (`decoding/step_budget.py`). Every command that decodes (generate, serve, chat, profile)
    builds it here."""
    cfg = engine.config(GenerationConfig.from_args(args))
    if cfg.tree_size == "auto":
        choice = engine.auto_tree_size(cfg)
        if not quiet and not plain_only(cfg.method):
            print(f"treeflash: {choice.summary()}", file=sys.stderr)
        if not (per_step and has_lookup(cfg.method)):
            cfg = cfg.replace(tree_size=choice.budget)
    return cfg


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """"auto" / None -> the default device; "cuda" without a GPU is a clear error."""
    if device in (None, "auto"):
        return default_device()
    if device not in DEVICES:
        raise TreeflashError(f"unknown device {device!r}; choose {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise TreeflashError("--device cuda: torch sees no CUDA GPU here (use --device cpu or auto)")
    return device


def _auto_llama_cpp(name: str, dtype: str, device: str, quantize: str, torch_only: bool) -> bool:
    """Whether `--backend auto` runs the target's GGUF on llama.cpp: where llama.cpp is built, the
    target has a GGUF (a built-in's shipped file, which its PyTorch weights are converted from, or a
    .gguf path), the dtype is auto, there is no --quantize, the device is the CPU, the caller does
    not need PyTorch (`torch_only`) and backends are timed at all (TREEFLASH_AOT not 0); then if its
    step is the faster here, timed once per machine (`costmodel.auto_llama_cpp`)."""
    from .models import gguf_file, llamacpp

    if dtype != "auto" or quantize != "none" or device != "cpu" or torch_only or not aot.enabled():
        return False
    if llamacpp.binary("libllama.so") is None or not gguf_file.has_gguf(name):
        return False
    from .decoding import costmodel
    from .models.llama_backend import TAP_ARCHS, LlamaTarget

    def gguf_target():  # not kept: the engine loads the winner through `_load_target`
        t = LlamaTarget.load(name, dtype=parse_dtype(dtype))
        if t.gguf.arch not in TAP_ARCHS:
            raise TreeflashError(f"llama.cpp does not expose the layer states of {t.gguf.arch} models to a drafter")
        return t

    try:
        return costmodel.auto_llama_cpp(name, lambda: Target.load(name, dtype=parse_dtype(dtype), device=device),
                                        gguf_target)
    except TreeflashError as e:
        print(f"treeflash: --backend auto stays on PyTorch: {e}", file=sys.stderr)
        return False


@functools.lru_cache(maxsize=2)
def _load_target(name: str, dtype, device: str = "cpu", quantize: str = "none", gguf: bool = False) -> Target:
    """Targets are cached per process (engines share them; each engine re-sets the taps it needs);
    gguf: for the llama-cpp backend (the GGUF in libllama, `models/llama_backend.py`)."""
    if gguf:
        from .models.llama_backend import LlamaTarget

        return LlamaTarget.load(name, dtype=dtype, device=device).quantize(quantize)
    return Target.load(name, dtype=dtype, device=device).quantize(quantize)


def load(target: str = registry.DEFAULT_TARGET, drafter: str | Drafter | None = None,
         dtype: str = "auto", seed: int = 0, quiet: bool = False, device: str | None = None,
         backend: str = "auto", quantize: str = "none", torch_only: bool = False) -> Engine:
    """Load a target (built-in name, HF directory or .gguf) and a drafter.

    drafter: None -> the shipped drafter of the target (a random one, with a warning, if none is
    shipped); "random" -> a random-initialised drafter; a path -> that drafter directory;
    "none" -> no drafter (vanilla decoding only). dtype "auto": bf16 where the hardware computes
    it natively, else fp32. device: "cpu", "cuda", or None / "auto": "cuda" when a GPU is present,
    else "cpu". backend: the target's forward path (`Target.set_backend`): auto | hf | static | compiled |
    compiled-cpp | llama-cpp (the target's GGUF in libllama: a built-in name or a .gguf); it is the engine's own (the target, cached and shared, is put in each engine's state
    before it runs). quantize: "none" | "int8" | "int4" (weight-only quantized target on CPU; this
    changes the target, see `models/quant.py`). torch_only: backend auto stays on PyTorch (for batched
    decoding, `BatchDecoder`, and the bench's Hugging Face arms).
    """
    gguf = backend == "llama-cpp" or (backend == "auto" and _auto_llama_cpp(target, dtype, check_device(device),
                                                                             quantize, torch_only))
    tgt = _load_target(target, parse_dtype(dtype), check_device(device), quantize, gguf)
    if isinstance(drafter, Drafter):
        d = drafter
    elif drafter == "none":
        d = None
    elif drafter == "random":
        d = random_drafter(tgt, seed=seed)
    else:
        path = registry.resolve_drafter(drafter, target)
        if path is None:
            if not quiet:
                print(f"treeflash: warning: no trained drafter ships for {target!r}; using a random drafter "
                      "(lossless but slow). Pass --drafter PATH.", file=sys.stderr)
            d = random_drafter(tgt, seed=seed)
        else:
            d = load_drafter(path, dtype=tgt.dtype)
    return Engine(tgt, d, backend)
