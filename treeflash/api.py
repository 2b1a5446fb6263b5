"""The Python API: `engine = treeflash.load(); engine.generate("Hi")`."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Iterator

import torch

from .decoding.generate import Stats, decode
from .decoding.proposers import TreeParams, make_proposer
from .decoding.sampling import SamplingParams
from .errors import TreeflashError
from .models import registry
from .models.drafter import Drafter, DrafterConfig, check_fits, load_drafter
from .models.target import Target, parse_dtype


# TreeFlash stage 2 scores each position's top-N marginal tokens, not the whole vocabulary.
DEFAULT_STAGE2_VOCAB = 256  # measured: same tau as the full vocabulary, 2.8x less drafting time


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


def random_drafter(target: Target, seed: int = 0, **kw) -> Drafter:
    """A random-initialised drafter sized for `target` (for tests and checks)."""
    cfg = DrafterConfig.for_target(target.config, mask_token_id=target.default_mask_token(), **kw)
    cfg.vocab_size = target.vocab_rows
    return Drafter(cfg).init_weights(seed).to(device=target.device, dtype=target.dtype).eval()


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

    def summary(self) -> str:
        return (f"tree size auto -> {self.budget} for {self.method} (expected tau {self.expected_tau:.2f}, "
                f"{self.expected_tokens_per_s:.1f} tok/s; 1-node forward {self.verify_costs.get(1, 0) * 1e3:.1f} ms "
                f"+ LM head {self.verify_costs.get(0, 0) * 1e3:.1f} ms/row, draft {self.draft_s * 1e3:.1f} ms/step)")


class Engine:
    stage2_vocab = DEFAULT_STAGE2_VOCAB

    def __init__(self, target: Target, drafter: Drafter | None):
        self.target, self.drafter = target, drafter
        self.auto: dict[tuple, AutoChoice] = {}
        if drafter is not None:
            check_fits(drafter.config, target.config, target.vocab_rows)
            drafter.to(device=target.device, dtype=target.dtype)
            target.set_taps(drafter.config.target_layer_ids)

    def _prepare(self, prompt, method, max_new_tokens, temperature, top_p, sampling_top_k,
                 tree_size, top_m, top_k, stage2_vocab, chat, draft_vocab=True):
        sampling = SamplingParams(float(temperature), float(top_p), int(sampling_top_k)).check(self.target.vocab_rows)
        stage2 = self.stage2_vocab if stage2_vocab is None else int(stage2_vocab)
        stage2 = min(stage2, self.target.vocab_rows)
        if tree_size == "auto":
            tree_size = self.auto_tree_size(method, top_m, top_k, stage2).budget
        params = TreeParams(int(tree_size), int(top_m), int(top_k), stage2, bool(draft_vocab)).check(self.target.vocab_rows)
        proposer = make_proposer(method, self.drafter, self.target.embed, self.target.drafting_head, params)
        if self.drafter is not None:  # the compiled backend compiles the drafter's block pass too
            self.drafter.compile_drafting(self.target.backend == "compiled")
        ids = self.target.encode(prompt, chat=chat)
        if len(ids) >= self.target.max_length:
            raise TreeflashError(f"prompt has {len(ids)} tokens; the context window is {self.target.max_length}")
        if int(max_new_tokens) < 1:
            raise TreeflashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return ids, sampling, proposer

    def tokens(self, prompt, method: str = "treeflash", max_new_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, sampling_top_k: int = 0, tree_size: int | str = 8, top_m: int = 8,
               top_k: int = 8, seed: int | None = None, chat: bool = True, stats: Stats | None = None,
               stop_ids: set[int] | None = None, stage2_vocab: int | None = None,
               draft_vocab: bool = True) -> Iterator[int]:
        """Yield new token ids (prompt: text, chat messages, or token ids).

        stage2_vocab: TreeFlash stage-2 columns per position (0 = full vocabulary; None = the
        engine's default, `Engine.stage2_vocab`). draft_vocab: propose only from the drafter's
        draft vocabulary, when it ships one (False: the whole vocabulary)."""
        ids, sampling, proposer = self._prepare(prompt, method, max_new_tokens, temperature, top_p,
                                                sampling_top_k, tree_size, top_m, top_k, stage2_vocab, chat,
                                                draft_vocab)
        self._tap_target()
        # compile now what this generation will run: a tree of any size up to the budget (the root
        # alone at the end; lookup trees are as large as the text's repeats)
        self.target.warm(range(1, proposer.params.budget + 1))
        with torch.no_grad():
            yield from decode(self.target, proposer, ids, int(max_new_tokens), sampling, seed, stats, stop_ids)

    def _tap_target(self) -> None:
        """A shared target serves several engines: tap the layers this engine's drafter reads."""
        if self.drafter is not None and self.target.tap_ids != self.drafter.config.target_layer_ids:
            self.target.set_taps(self.drafter.config.target_layer_ids)

    def auto_tree_size(self, method: str = "treeflash", top_m: int = 8, top_k: int = 8,
                       stage2_vocab: int | None = None, max_budget: int = 64, tokens: int = 48) -> AutoChoice:
        """The budget maximising expected tokens/s on this machine (`costmodel.best_budget`): the
        target's verify cost per tree size (measured once, cached on disk), and this drafter's
        acceptance of each best-first node, measured by a short calibration run at `max_budget`, and
        its drafting cost, measured at `max_budget` and at 2. Memoised per engine and method."""
        from .decoding import costmodel

        key = (method, top_m, top_k, stage2_vocab, self.target.backend, torch.get_num_threads())
        if key in self.auto:
            return self.auto[key]
        if method == "vanilla" or (self.drafter is None and method != "lookup"):
            choice = AutoChoice(method, 1, 0.0, 1.0, 0.0, {})
        else:
            self._tap_target()  # the cost of a forward includes this drafter's taps
            costs = costmodel.measure(self.target)
            # untimed first: compiling (the compiled backend) must not count as drafting time; long
            # enough for full blocks and the shorter ones at the end (each a drafter shape)
            for _ in self.tokens(CALIBRATION_PROMPTS[0], method=method, max_new_tokens=24, tree_size=max_budget,
                                 top_m=top_m, top_k=top_k, stage2_vocab=stage2_vocab, stop_ids=set()):
                pass
            stats, small = Stats(), Stats()
            for prompt in CALIBRATION_PROMPTS:
                for budget, st in ((max_budget, stats), (2, small)):
                    for _ in self.tokens(prompt, method=method, max_new_tokens=tokens, tree_size=budget,
                                         top_m=top_m, top_k=top_k, stage2_vocab=stage2_vocab, stats=st,
                                         stop_ids=set()):
                        pass
            # drafting cost per step at budget 2 and at max_budget (the heads run as deep as the
            # budget reaches, so small budgets draft for less), linear in between by head depth
            draft = costmodel.draft_cost(
                (small.draft_s + small.tree_s) / max(1, small.steps), (stats.draft_s + stats.tree_s) / max(1, stats.steps),
                self.drafter.block_size - 1 if self.drafter is not None else 1)
            node_accept = stats.node_acceptance()
            # lookup trees are smaller than the budget where the text does not repeat
            sizes = stats.tree_sizes if "lookup" in method else None
            budget, rate = costmodel.best_budget(costs, node_accept, draft, range(2, max_budget + 1), sizes)
            choice = AutoChoice(method, budget, rate, costmodel.expected_tau(node_accept, budget),
                                draft(budget) if budget > 1 else 0.0, costs)
        self.auto[key] = choice
        return choice

    def stream(self, prompt, stats: Stats | None = None, **kw) -> Iterator[str]:
        """Yield text pieces as they are decoded (stop tokens are not shown)."""
        tok = self.target.tokenizer
        out, shown = [], ""
        stop = self.target.stop_ids()
        for t in self.tokens(prompt, stats=stats, **kw):
            if t in stop:
                continue
            out.append(t)
            text = tok.decode(out, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            yield text[len(shown):]
            shown = text

    def generate(self, prompt, **kw) -> Result:
        stats = Stats()
        ids = list(self.tokens(prompt, stats=stats, **kw))
        text = self.target.tokenizer.decode([t for t in ids if t not in self.target.stop_ids()],
                                            skip_special_tokens=True)
        return Result(text, ids, stats)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """"auto" / None -> the default device; "cuda" without a GPU is a clear error."""
    if device in (None, "auto"):
        return default_device()
    if device not in ("cpu", "cuda"):
        raise TreeflashError(f"unknown device {device!r}; choose auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise TreeflashError("--device cuda: torch sees no CUDA GPU here (use --device cpu or auto)")
    return device


@functools.lru_cache(maxsize=2)
def _load_target(name: str, dtype, device: str = "cpu", quantize: str = "none") -> Target:
    """Targets are cached per process (engines share them; each engine re-sets the taps it needs)."""
    return Target.load(name, dtype=dtype, device=device).quantize(quantize)


def load(target: str = registry.DEFAULT_TARGET, drafter: str | Drafter | None = None,
         dtype: str = "auto", seed: int = 0, quiet: bool = False, device: str | None = None,
         backend: str = "auto", quantize: str = "none") -> Engine:
    """Load a target (built-in name, HF directory or .gguf) and a drafter.

    drafter: None -> the shipped drafter of the target (a random one, with a warning, if none is
    shipped); "random" -> a random-initialised drafter; a path -> that drafter directory;
    "none" -> no drafter (vanilla decoding only). dtype "auto": bf16 where the hardware computes
    it natively, else fp32. device: "cpu", "cuda", or None / "auto": "cuda" when a GPU is present,
    else "cpu". backend: the
    target's forward path (`Target.set_backend`): auto | hf | static | compiled; it belongs to the
    (cached, shared) target, so the last engine loaded sets it. quantize: "none" | "int8" |
    "int4" (weight-only quantized target on CPU; this changes the target, see `models/quant.py`).
    """
    tgt = _load_target(target, parse_dtype(dtype), check_device(device), quantize)
    if backend != tgt.backend:
        tgt.set_backend(backend)
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
    return Engine(tgt, d)
