"""The target LLM: any Hugging Face causal LM with embed_tokens / lm_head.

- `forward(ids, positions, cache, mask)` appends a flat sequence or a draft tree to the KV cache
  (ancestor-only mask among the new tokens, positions start+depth) and returns its logits
  (indexable by node, on every backend) and the features of the tap layers,
- the cache (`kvcache.KVCache`, from `new_cache`) owns its update and its compaction to the
  accepted path (`cache.compact`).

Backends (`set_backend`) are forward paths with one interface (`new_cache`, `forward`, `warm`):
`hf` (`HFPath`) runs the model's own forward over Hugging Face's DynamicCache (any causal LM;
tap features by forward hooks); `static` and `compiled` run `fastpath.FastPath` (Llama-family)
over a preallocated cache.
"""
from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..config import is_compiled, uses_cpp_gemm
from ..errors import TreeflashError
from ..options import BACKENDS, DTYPES
from . import registry
from .cpu import cpu_flags
from .fastpath import FastPath, supported
from .kvcache import HFCache, KVCache, attention_mask
from .lazy_logits import LazyLogits

# the torch dtype of each `options.DTYPES` name but "auto" (`parse_dtype` resolves that one)
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


def bf16_is_fast() -> bool:
    """A GPU, or a CPU with native bf16 arithmetic (AVX512-BF16 / AMX)."""
    if torch.cuda.is_available():
        return True
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A name of `options.DTYPES`: float32 | bfloat16 | float16 | auto (bf16 where the hardware
    computes it natively, else fp32)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast() else torch.float32
    if name not in TORCH_DTYPES:
        raise TreeflashError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return TORCH_DTYPES[name]


class HFPath:
    """The model's own decoder forward over an `HFCache` (any causal LM); the tap features come from
    the forward hooks of `Target.set_taps` (into `captured`)."""

    def __init__(self, model, captured: dict[int, torch.Tensor]):
        self.model, self.decoder, self.captured = model, model.get_decoder(), captured
        self.dtype = next(model.parameters()).dtype
        # transformers 5.24 names the cache argument `cache`, earlier releases `past_key_values`; an
        # unknown name would be swallowed by **kwargs and every step would run without its context
        params = inspect.signature(self.decoder.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def new_cache(self, need: int, max_length: int) -> HFCache:
        return HFCache(config=self.model.config)

    def warm(self, sizes, tap_ids: list[int]) -> None:
        """Nothing to compile."""

    def forward(self, ids, positions, cache: HFCache, tree_mask, tap_ids: list[int]):
        """As `FastPath.forward`; a flat sequence (tree_mask None) gets the model's own causal mask."""
        attn = None
        if tree_mask is not None:  # as an additive float mask [1, 1, N, start+N]
            n, start, dev = len(ids), cache.length, ids.device
            allowed = attention_mask(start, tree_mask, torch.empty(n, start + n, dtype=torch.bool, device=dev))
            attn = torch.zeros(allowed.shape, dtype=self.dtype, device=dev)
            attn = attn.masked_fill_(~allowed, torch.finfo(self.dtype).min)[None, None]
        self.captured.clear()
        out = self.decoder(input_ids=ids[None], position_ids=positions[None], attention_mask=attn,
                           use_cache=True, **{self.cache_arg: cache})
        feats = torch.cat([self.captured[i][0] for i in tap_ids], -1) if tap_ids else None
        return LazyLogits(out.last_hidden_state[0], self.model.get_output_embeddings()), feats


class Target:
    def __init__(self, model, tokenizer, name: str = "target"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.decoder = model.get_decoder()
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.drafting_head = self.lm_head  # the drafter's LM head: stays unquantized (see `quantize`)
        self.quantization = "none"
        if self.embed is None or self.lm_head is None or not hasattr(self.decoder, "layers"):
            raise TreeflashError(f"target {name} has no embed_tokens/lm_head/layers; not a supported causal LM")
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.max_length = int(getattr(self.config, "max_position_embeddings", 2048))
        self.vocab_rows = self.embed.weight.shape[0]
        self._taps: dict[int, torch.Tensor] = {}
        self._hooks = []
        self.tap_ids: list[int] = []
        self._runners: dict[str, HFPath | FastPath] = {}  # kept: engines sharing this target switch cheaply
        self.set_backend("hf")

    def quantize(self, mode: str) -> "Target":
        """Weight-only int8 / int4 for the decoder's linear layers and the verify LM head (`quant.py`).
        The drafter keeps reading the unquantized LM head (`drafting_head`)."""
        from .quant import quantize_linears

        if mode != self.quantization:
            if self.quantization != "none":
                raise TreeflashError("this target is already quantized; load it again")
            quantize_linears(self.model, mode)
            self.lm_head = self.model.get_output_embeddings()
            self.quantization = mode
            self._runners.clear()  # the static path's fused matmuls hold the unquantized weights
            self.set_backend(self.backend)
        return self

    def set_backend(self, name: str) -> "Target":
        """auto (static where supported, else hf) | hf | static | compiled | compiled-cpp (compiled, every
        matmul through inductor's C++ GEMM template: `fastpath.FastPath`)."""
        if name not in BACKENDS:
            raise TreeflashError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
        if name == "llama-cpp":
            raise TreeflashError("the llama-cpp backend runs the target's GGUF in libllama: load the target with "
                                 "--backend llama-cpp (api.load(..., backend='llama-cpp'))")
        if name == "auto":
            name = "static" if supported(self.config) else "hf"
        if name not in self._runners or (name != "hf" and not supported(self.config)):  # support rechecked
            self._runners[name] = (HFPath(self.model, self._taps) if name == "hf"
                                   else FastPath(self.model, compile=is_compiled(name),
                                                 cpp_gemm=uses_cpp_gemm(name)))
        self.runner, self.backend = self._runners[name], name
        return self

    # ---- loading ----
    @classmethod
    def load(cls, name_or_path: str = registry.DEFAULT_TARGET, dtype="float32", device: str = "cpu") -> "Target":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path, gguf = registry.resolve_target(name_or_path)
        kw = {"gguf_file": gguf} if gguf else {}
        try:
            tok = AutoTokenizer.from_pretrained(str(path), **kw)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=parse_dtype(dtype), **kw)
        except (OSError, ValueError) as e:
            raise TreeflashError(f"cannot load target {name_or_path!r}: {str(e).splitlines()[0]}") from None
        return cls(model.to(device), tok, name=name_or_path)

    # ---- hidden-state taps ----
    def set_taps(self, layer_ids: list[int]) -> None:
        """Capture the outputs of these decoder layers on every forward."""
        for h in self._hooks:
            h.remove()
        self._hooks, self.tap_ids = [], list(layer_ids)
        for i in self.tap_ids:
            self._hooks.append(self.decoder.layers[i].register_forward_hook(self._hook(i)))

    def warm(self, tree_sizes) -> None:
        """Compile the compiled backend's steps for these tree sizes now (no-op on other backends)."""
        self.runner.warm(tree_sizes, self.tap_ids)

    def _hook(self, i: int):
        def fn(_module, _inp, out):
            self._taps[i] = out[0] if isinstance(out, tuple) else out
        return fn

    # ---- forward ----
    def new_cache(self, need: int | None = None) -> KVCache:
        """An empty KV cache for at most `need` tokens (the static backends preallocate it)."""
        return self.runner.new_cache(need or self.max_length, self.max_length)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None):
        """Append ids, positions [N] to the cache. mask [N, N] bool (True = may attend) among the
        new tokens, or None for causal; every new token sees the whole cache before it.

        Returns logits and features [N, taps*H] (None without taps), on self.device. The logits
        are indexable by node: logits[i] [V], logits[rows] [k, V], float32; eagerly a `LazyLogits`
        (the LM head runs over the rows read), compiled a tensor (the compiled step ran the head
        over every row)."""
        return self.runner.forward(ids, positions, cache, mask, self.tap_ids)

    # ---- text ----
    def encode(self, prompt: str | list[dict] | list[int], chat: bool = True) -> list[int]:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            ids = list(prompt)
        elif isinstance(prompt, list):
            ids = self.apply_chat(prompt)
        elif chat and self.tokenizer.chat_template:
            ids = self.apply_chat([{"role": "user", "content": prompt}])
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids or (isinstance(prompt, str) and not prompt.strip()):
            raise TreeflashError("empty prompt")
        return ids

    def apply_chat(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise TreeflashError("empty messages list")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return list(out)

    def stop_ids(self) -> set[int]:
        ids = set()
        eos = self.config.eos_token_id if self.config.eos_token_id is not None else self.tokenizer.eos_token_id
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                ids.add(int(e))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def default_mask_token(self) -> int:
        """A token id the drafter can use as MASK: an unused embedding row, else a rare special token."""
        n_tok = len(self.tokenizer)
        if self.vocab_rows > n_tok:
            return n_tok
        specials = set(self.tokenizer.all_special_ids) | set(getattr(self.tokenizer, "added_tokens_decoder", {}))
        used = self.stop_ids() | {self.tokenizer.bos_token_id, self.tokenizer.pad_token_id,
                                  self.tokenizer.unk_token_id}
        for i in sorted((i for i in specials if i is not None), reverse=True):
            if i not in used and i < self.vocab_rows:
                return int(i)
        return self.vocab_rows - 1

