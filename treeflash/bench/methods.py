"""Benchmarked methods behind one call: `method.generate(prompt_ids) -> Generation`.

- ours (`vanilla`, `chain`, `marginal`, `treeflash`): the treeflash engine, same drafter and budget;
- Hugging Face peers on the very same target model object: `hf-generate` (plain greedy/sampled
  `generate`), `hf-prompt-lookup` (`prompt_lookup_num_tokens`), `hf-assisted` (`assistant_model=`);
- `llama-cpp`: plain decoding of the target's GGUF through llama-cpp-python, when importable;
- `llama-cpp-bf16`, `llama-cpp-dflash[-q4]`: llama.cpp's own server, plain and with our drafter
  (bench/llama_server.py; `make llama-cpp`).

Every method fills a `Stats` (decoding/generate.py). For HF methods the acceptance lengths are read
off the target's forward calls (every forward is a step; see `ForwardLog.fill`); our engine's
prefill token is not a step, so there tokens = 1 + sum(acceptance lengths).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..decoding.stats import Stats
from ..errors import TreeflashError
from ..models import registry
from ..options import has_lookup
from .arms import HF_METHODS, LLAMA_SERVER_METHODS, TREE_METHODS, Generation, Method

PROMPT_LOOKUP_TOKENS = 10  # HF's documented default suggestion for prompt lookup


class EngineMethod(Method):
    """One of our decoding methods through `Engine.generate` (token ids in, no re-templating)."""

    def __init__(self, engine, name: str, tree_size: int | str | None):
        self.engine, self.name, self.tree_size = engine, name, tree_size

    def generate(self, prompt_ids, p):
        r = self.engine.generate(list(prompt_ids), p, method=self.name, tree_size=self.tree_size or 1)
        return Generation(r.token_ids, r.stats)


class ForwardLog:
    """Records the start position and length of every forward of an HF model (a pre-hook)."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []  # (first position, number of input tokens)
        self._handle = model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[1]) if ids is not None else int(kwargs["inputs_embeds"].shape[1])
        pos = kwargs.get("position_ids")
        if pos is not None:
            start = int(pos[0, 0])
        else:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            start = int(cache.get_seq_length()) if cache is not None else 0
        self.calls.append((start, n))

    def close(self):
        self._handle.remove()

    def fill(self, stats: Stats, prompt_len: int, total_len: int) -> None:
        """One step per forward: forward i commits n_{i+1} - n_i tokens (accepted drafts + 1).

        n_0 = prompt_len; a later forward re-reads the last committed token, so it starts at
        p_i = n_i - 1; n_{k+1} = total_len. The first forward is a step too: HF's speculative
        methods verify drafts in it (plain generate commits exactly one token there).
        """
        bounds = [prompt_len] + [s + 1 for s, _ in self.calls[1:]] + [total_len]
        for i, (_, n) in enumerate(self.calls):
            size = n - prompt_len + 1 if i == 0 else n  # nodes verified, the re-read token included
            stats.record(max(0, bounds[i + 1] - bounds[i] - 1), size)


class HFMethod(Method):
    """`model.generate` on the engine's own target model (same weights, same dtype, same prompt ids)."""

    def __init__(self, target, name: str, assistant=None):
        self.target, self.name, self.assistant = target, name, assistant
        stop = sorted(target.stop_ids())
        self.eos, self.pad = stop, (target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None
                                    else stop[0])

    def generation_config(self, p: GenerationConfig):
        import transformers

        kw = dict(max_new_tokens=p.max_new_tokens, eos_token_id=self.eos, pad_token_id=self.pad)
        if p.temperature > 0:
            kw.update(do_sample=True, temperature=p.temperature, top_k=p.sampling_top_k, top_p=p.top_p)
        else:
            kw.update(do_sample=False)
        if self.name == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        return transformers.GenerationConfig(**kw)

    def generate(self, prompt_ids, p):
        x = torch.tensor([list(prompt_ids)])  # [1, P]
        extra = {"assistant_model": self.assistant} if self.name == "hf-assisted" else {}
        torch.manual_seed(p.seed or 0)
        log = ForwardLog(self.target.model)
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = self.target.model.generate(x, attention_mask=torch.ones_like(x),
                                                 generation_config=self.generation_config(p), **extra)
            elapsed = time.perf_counter() - t0
        finally:
            log.close()
        new = out[0, x.shape[1]:].tolist()
        stats = Stats(prompt_tokens=x.shape[1], new_tokens=len(new), total_s=elapsed,
                      finish_reason="stop" if new and new[-1] in self.eos else "length")
        log.fill(stats, x.shape[1], out.shape[1])
        return Generation(new, stats)


class LlamaCppMethod(Method):
    """Plain decoding of the same GGUF through llama-cpp-python (token ids in, token ids out)."""

    name = "llama-cpp"

    def __init__(self, gguf: Path, stop_ids: set[int], n_ctx: int = 4096, threads: int | None = None):
        import llama_cpp

        self.stop_ids = stop_ids
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads or os.cpu_count() or 1,
                                   verbose=False, logits_all=False)

    def generate(self, prompt_ids, p):
        self.llm.reset()
        new: list[int] = []
        stats = Stats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        kw = ({"temp": p.temperature, "top_k": p.sampling_top_k, "top_p": p.top_p} if p.temperature > 0
              else {"temp": 0.0, "top_k": 1})
        for tok in self.llm.generate(list(prompt_ids), reset=True, **kw):
            new.append(int(tok))
            if tok in self.stop_ids or len(new) >= p.max_new_tokens:
                break
        stats.total_s = time.perf_counter() - t0
        stats.new_tokens = len(new)
        for _ in range(max(0, len(new) - 1)):
            stats.record(0, 1)
        stats.finish_reason = "stop" if new and new[-1] in self.stop_ids else "length"
        return Generation(new, stats)


def llama_cpp_gguf(target_name: str) -> tuple[Path | None, str]:
    """(GGUF path, '') when llama-cpp can run this target, else (None, why it is skipped)."""
    from ..models import llamacpp

    try:
        llamacpp.import_binding()
    except TreeflashError as e:
        return None, f"skipped: {e}"
    from ..models.gguf_file import gguf_of

    try:
        return gguf_of(str(target_name)), ""
    except TreeflashError:
        return None, f"skipped: target {target_name!r} has no GGUF file (give a built-in name or a .gguf path)"


def load_assistant(name_or_path: str, target):
    """The assistant model for hf-assisted; it must share the target's tokenizer."""
    from ..models.target import Target

    asst = Target.load(name_or_path, dtype=target.dtype)
    if asst.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise TreeflashError(f"assistant {name_or_path!r} does not share the target's tokenizer; "
                             "hf-assisted needs the same vocabulary")
    return asst.model


def resolve_sizes(engine, name: str, tree_sizes: list, p: GenerationConfig | None, notes: list[str]) -> list:
    """The budgets of one tree method; "auto" becomes the engine's measured choice (noted), and stays
    "auto" for a lookup method, whose steps choose their own budgets from it (`decoding/step_budget.py`)."""
    out: list = []
    for b in tree_sizes:
        if b == "auto":
            choice = engine.auto_tree_size(p, method=name)
            notes.append(choice.summary())
            b = "auto" if has_lookup(name) else choice.budget
        if b not in out:
            out.append(b)
    return out


def build_methods(engine, names: list[str], tree_sizes: list, target_name: str, assistant_model=None,
                  threads: int | None = None, params: GenerationConfig | None = None) -> tuple[list[Method], list[str]]:
    """One Method per arm (tree methods once per budget), in the requested order; plus skip notes."""
    arms: list[Method] = []
    notes: list[str] = []
    for name in names:
        if name == "vanilla":
            arms.append(EngineMethod(engine, name, None))
        elif name in TREE_METHODS:
            arms += [EngineMethod(engine, name, b) for b in resolve_sizes(engine, name, tree_sizes, params, notes)]
        elif name in HF_METHODS and engine.target.model is None:
            notes.append(f"{name} skipped: the target runs in llama.cpp (--backend llama-cpp), with no Hugging Face model")
        elif name in HF_METHODS:
            arms.append(HFMethod(engine.target, name, assistant_model if name == "hf-assisted" else None))
        elif name == "llama-cpp":
            gguf, why = llama_cpp_gguf(target_name)
            if gguf is None:
                notes.append(f"llama-cpp {why}")
            else:
                arms.append(LlamaCppMethod(gguf, engine.target.stop_ids(), threads=threads))
        elif name in LLAMA_SERVER_METHODS:
            from . import llama_server

            budgets = [b for b in tree_sizes if b != "auto"] or [8]
            got, why = llama_server.build(name, target_name, budgets, threads, registry.cache_dir() / "llama.cpp")
            arms += got
            if why:
                notes.append(why)
    return arms, notes
