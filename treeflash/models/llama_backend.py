"""The `llama-cpp` backend: the target runs in libllama, on a GGUF as it is (no dequantized copy).

The same target contract as the PyTorch backends (`target.py`): `forward(ids, positions, cache,
mask)` appends a flat sequence or a draft tree and returns logits indexable by node and the tap
features; `cache.compact(start, keep)` keeps the accepted path. Over llama.cpp's own API:
- a tree is verified in one `llama_decode`: one sequence id per root-to-leaf path (`path_seqs`), a
  node carries the ids of the leaves below it, at position start + depth, in a unified KV cache. A
  node attends to the cells of its first id up to its own position: its ancestors and the context.
  The first leaf's path runs on the context's own id 0; the other ids share the context's cells
  (`seq_cp`, no copy of keys or values). No new kernel.
- compaction keeps exactly the accepted path (`LlamaCache.compact`: `seq_keep` the id that holds it,
  `seq_rm` past its depth, back to id 0): no rejected node stays in the cache.
- the tap features are the inputs of the next layers (`llama_get_embeddings_layer_inp`: our "output
  of layer i" is llama.cpp's input of layer i+1), from the same forward.
- the drafter reads the target's token embedding as llama.cpp holds it (`llama_model_get_tok_embd`,
  F32) and its LM head (the same matrix where tied, else `output.weight` dequantized by ggml:
  `gguf_file.output_weight`).

One context holds one sequence's cache at a time (`new_cache` starts it afresh): generate, chat,
bench and serve (one request at a time) decode one sequence.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import TreeflashError
from . import llamacpp, registry
from .gguf_file import gguf_of, hf_meta, output_weight
from .kvcache import KVCache
from .target import Target, parse_dtype

# architectures whose llama.cpp graph records its layer inputs (the drafter's taps); plain decoding
# (no drafter) runs on any architecture llama.cpp loads
TAP_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
CHUNK = 512        # tokens per llama_decode of a prefill (n_batch = n_ubatch)
MAX_SEQS = 128     # sequence ids of a context: leaves of one tree, at most


def path_seqs(tree_mask: torch.Tensor) -> list[list[int]]:
    """The sequence ids of each node of a tree: tree_mask [N, N] bool, True where column j is row
    i's ancestor or i itself. Leaf k (in node order) gets id k (the first leaf's path: the
    context's id 0); a node carries the ids of the leaves below it, smallest first."""
    m = tree_mask.cpu().numpy()                       # [N, N]
    leaves = np.flatnonzero(m.sum(0) == 1)            # [L] nodes no other node descends from
    below = m[leaves]                                 # [L, N] leaf k's ancestors (and itself)
    return [np.flatnonzero(below[:, j]).tolist() for j in range(len(m))]


class Lib:
    """libllama through llama-cpp-python's low-level binding, plus the llama-ext.h functions it
    does not bind (C++ symbols, looked up by their mangled names as llama_cpp_ext.py does)."""

    def __init__(self):
        self.ll = llamacpp.import_binding().llama_cpp  # the low-level module
        lib, ll = self.ll._lib, self.ll
        self.set_layer_inp = self._ext(lib, "llama_set_embeddings_layer_inp", "P13llama_contextjb",
                                       [ll.llama_context_p_ctypes, ctypes.c_uint32, ctypes.c_bool], None)
        self.get_layer_inp = self._ext(lib, "llama_get_embeddings_layer_inp", "P13llama_contextj",
                                       [ll.llama_context_p_ctypes, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))
        self.get_tok_embd = self._ext(lib, "llama_model_get_tok_embd", "PK11llama_modelPf",
                                      [ll.llama_model_p_ctypes, ctypes.POINTER(ctypes.c_float)], ctypes.c_uint32)
        self.errors: list[str] = []
        self._log = ll.llama_log_callback(self._on_log)  # kept: the library holds only its address
        ll.llama_log_set(self._log, ctypes.c_void_p(0))
        ll.llama_backend_init()

    @staticmethod
    def _ext(lib, name: str, mangled_args: str, argtypes, restype):
        for sym in (name, f"_Z{len(name)}{name}{mangled_args}"):
            f = getattr(lib, sym, None)
            if f is not None:
                f.argtypes, f.restype = argtypes, restype
                return f
        raise TreeflashError(f"this llama.cpp build has no {name} (rebuild it: `make llama-cpp`)")

    def _on_log(self, level: int, text: bytes, _user) -> None:
        """llama.cpp's log: quiet; its errors are kept for the one-line message of a failure."""
        msg = text.decode("utf-8", "replace").strip()
        if level == 5 and self.errors and msg:  # GGML_LOG_LEVEL_CONT: the last message goes on
            self.errors[-1] += " " + msg
        elif level == 4 and msg:  # GGML_LOG_LEVEL_ERROR
            self.errors = (self.errors + [msg])[-4:]

    def first_error(self) -> str:
        """The first line of the first error logged since `errors` was last cleared."""
        return self.errors[0].splitlines()[0] if self.errors else "no message"


_LIB: Lib | None = None


def lib() -> Lib:
    global _LIB
    if _LIB is None:
        _LIB = Lib()
    return _LIB


class GGUFModel:
    """One GGUF loaded in libllama with one context: KV cache cells for a sequence of `window`
    tokens (or the model's trained context, if shorter) and one tree, shared by up to MAX_SEQS
    sequence ids (unified); `threads` threads."""

    def __init__(self, path: Path, window: int, threads: int):
        L = lib()
        ll = L.ll
        self.L, self.ll, self.path = L, ll, path
        mp = ll.llama_model_default_params()
        L.errors.clear()
        self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise TreeflashError(f"llama.cpp cannot load {path.name}: {L.first_error()}")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.n_embd = ll.llama_model_n_embd(self.model)
        self.n_layer = ll.llama_model_n_layer(self.model)
        self.arch = self.meta("general.architecture")
        self.window = min(window, ll.llama_model_n_ctx_train(self.model))  # the sequence's, a tree's rows beyond
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = self.window + MAX_SEQS, CHUNK, CHUNK
        cp.n_seq_max, cp.kv_unified = MAX_SEQS, True
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED  # off, as llama-cpp-python's default (the bench's `llama-cpp` arm): the same kernels
        L.errors.clear()
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise TreeflashError(f"llama.cpp cannot make a context for {path.name}: {L.first_error()}")
        self.n_ctx = ll.llama_n_ctx(self.ctx)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(CHUNK, 0, MAX_SEQS)
        self.taps: list[int] = []
        self.owner = None  # the cache using the context now

    def meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else ""

    def set_taps(self, tap_ids: list[int]) -> None:
        """Record the inputs of layers i+1 (the outputs of layers i) from now on."""
        if tap_ids == self.taps:
            return
        if tap_ids and self.arch not in TAP_ARCHS:
            raise TreeflashError(f"llama.cpp's {self.arch} graph does not expose the layer states a drafter reads "
                                 f"(supported: {', '.join(TAP_ARCHS)}); use --method vanilla or another backend")
        if any(not 0 <= i < self.n_layer - 1 for i in tap_ids):
            raise TreeflashError(f"the drafter reads layers {tap_ids}; the llama-cpp backend gives layers "
                                 f"0..{self.n_layer - 2} of this {self.n_layer}-layer target")
        for i in self.taps:
            self.L.set_layer_inp(self.ctx, i + 1, False)
        for i in tap_ids:
            self.L.set_layer_inp(self.ctx, i + 1, True)
        self.taps = list(tap_ids)

    def token_embedding(self) -> torch.Tensor:
        """The token embedding [V, H] as llama.cpp holds it, in float32."""
        out = torch.empty(self.n_vocab, self.n_embd, dtype=torch.float32)
        n = self.L.get_tok_embd(self.model, ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_float)))
        if n != out.numel():
            raise TreeflashError(f"llama.cpp gave {n} embedding values for {self.path.name}, expected {out.numel()}")
        return out

    def decode(self, ids: np.ndarray, pos: np.ndarray, seqs: list[list[int]] | None, outputs: np.ndarray):
        """One llama_decode of n <= CHUNK tokens: ids, pos [n]; seqs: each token's ids (None: all 0);
        outputs [n] bool: the rows whose logits are kept."""
        b, n = self.batch, len(ids)
        for i in range(n):
            b.token[i], b.pos[i], b.logits[i] = int(ids[i]), int(pos[i]), bool(outputs[i])
            s = seqs[i] if seqs is not None else (0,)
            b.n_seq_id[i] = len(s)
            for k, sid in enumerate(s):
                b.seq_id[i][k] = sid
        b.n_tokens = n
        self.L.errors.clear()
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise TreeflashError(f"llama.cpp's decode failed (code {rc}): {self.L.first_error()}")

    def logits(self, n_out: int) -> torch.Tensor:
        """The last decode's output rows' logits [n_out, V], float32 (a copy)."""
        ptr = self.ll.llama_get_logits(self.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy())

    def features(self, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The last decode's tap features [n, taps*H] (None without taps)."""
        if not self.taps:
            return None
        rows = [np.ctypeslib.as_array(self.L.get_layer_inp(self.ctx, i + 1), shape=(n, self.n_embd)) for i in self.taps]
        return torch.from_numpy(np.concatenate(rows, 1)).to(dtype)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.ll.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class LlamaCache(KVCache):
    """The context's KV cache, held for one sequence: id 0 holds its tokens 0..length-1; a tree's
    other ids live only between its forward and its compaction."""

    def __init__(self, model: GGUFModel):
        self.model, self.length = model, 0
        self.seqs: list[list[int]] | None = None  # the last tree's ids per node
        model.owner = self
        model.ll.llama_memory_clear(model.mem, True)

    def check(self) -> None:
        if self.model.owner is not self:
            raise TreeflashError("this llama.cpp cache was replaced by a newer one (one sequence at a time)")

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep tokens [:start] and the tree nodes `keep` [K] (the accepted path, root first), at
        start..start+K-1, on id 0; every other cell of the tree is freed."""
        ll, mem, k = self.model.ll, self.model.mem, len(keep)
        s = self.seqs[int(keep[-1])][0] if (k and self.seqs is not None) else 0  # an id whose path it is
        ll.llama_memory_seq_keep(mem, s)              # cells off that path go; the rest keep id s alone
        ll.llama_memory_seq_rm(mem, s, start + k, -1)  # nodes below the accepted depth go
        if s != 0:
            ll.llama_memory_seq_cp(mem, s, 0, -1, -1)
            ll.llama_memory_seq_rm(mem, s, -1, -1)
        self.length, self.seqs = start + k, None

    def truncate(self, length: int) -> None:
        self.model.ll.llama_memory_seq_rm(self.model.mem, 0, length, -1)
        self.length = min(self.length, length)

    def cells(self, seq: int = 0) -> tuple[int, int]:
        """(lowest, highest) position id `seq` holds ((-1, -1) when none): what a test checks."""
        ll, mem = self.model.ll, self.model.mem
        return ll.llama_memory_seq_pos_min(mem, seq), ll.llama_memory_seq_pos_max(mem, seq)


class OutputRows:
    """A flat forward's logits: len() is its row count; only its last row was computed (a prefill
    and the cost model read that one)."""

    def __init__(self, n: int, last: torch.Tensor):
        self.n, self.last = n, last

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i) -> torch.Tensor:
        if i in (-1, self.n - 1):
            return self.last
        raise IndexError(f"row {i} of a flat llama.cpp forward was not computed (only its last, {self.n - 1})")


class LlamaCppPath:
    """The backend's forward path: what `Target.forward` calls (`new_cache`, `warm`, `forward`)."""

    def __init__(self, model: GGUFModel, dtype: torch.dtype):
        self.model, self.dtype = model, dtype

    def new_cache(self, need: int, max_length: int) -> LlamaCache:
        if need > self.model.n_ctx:
            raise TreeflashError(f"a sequence needs {need} cache cells; this llama.cpp context has {self.model.n_ctx}")
        return LlamaCache(self.model)

    def warm(self, sizes, tap_ids: list[int]) -> None:
        self.model.set_taps(tap_ids)

    def forward(self, ids, positions, cache: LlamaCache, tree_mask, tap_ids: list[int]):
        """As `FastPath.forward`: a tree (tree_mask [N, N]) in one llama_decode, logits [N, V] of
        every node; a flat sequence (None) in chunks, the logits of its last row (`OutputRows`)."""
        cache.check()
        self.model.set_taps(tap_ids)
        ids, pos = ids.cpu().numpy(), positions.cpu().numpy()  # [N] each
        n = len(ids)
        if tree_mask is not None:
            if n > CHUNK:
                raise TreeflashError(f"a tree of {n} nodes is larger than llama.cpp's batch ({CHUNK})")
            seqs = path_seqs(tree_mask)
            for s in range(1, max(max(x) for x in seqs) + 1):  # the other paths see the context
                if s >= MAX_SEQS:
                    raise TreeflashError(f"a tree of more than {MAX_SEQS} leaves")
                self.model.ll.llama_memory_seq_cp(self.model.mem, 0, s, -1, -1)
            self.model.decode(ids, pos, seqs, np.ones(n, dtype=bool))
            cache.seqs, cache.length = seqs, cache.length + n
            return self.model.logits(n), self.model.features(n, self.dtype)
        feats = []
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            out = np.zeros(b - a, dtype=bool)
            out[-1] = b == n
            self.model.decode(ids[a:b], pos[a:b], None, out)
            f = self.model.features(b - a, self.dtype)
            if f is not None:
                feats.append(f)
        cache.seqs, cache.length = None, cache.length + n
        return OutputRows(n, self.model.logits(1)[0]), (torch.cat(feats) if feats else None)


def threads() -> int:
    return torch.get_num_threads() or os.cpu_count() or 1


class LlamaTarget(Target):
    """A target on the llama-cpp backend: its forward in libllama on the GGUF; its tokenizer and
    config read from the GGUF by transformers (or the built-in target's converted directory, when
    present); in PyTorch only what the drafter reads, its token embedding and LM head."""

    WINDOW = 32768  # the context window, at most (the model's trained one where shorter; llama.cpp allocates its KV cache for it)

    def __init__(self, gguf: GGUFModel, config, tokenizer, dtype: torch.dtype, name: str):
        self.model = None  # no PyTorch copy of the target (Hugging Face's own methods skip it)
        self.tokenizer, self.config, self.name = tokenizer, config, name
        self.quantization, self.dtype, self.device = "none", dtype, torch.device("cpu")
        self.gguf, self.max_length = gguf, gguf.window
        V, H = self.gguf.n_vocab, self.gguf.n_embd
        self.embed = torch.nn.Embedding(V, H, _weight=self.gguf.token_embedding().to(dtype))
        out = output_weight(gguf.path, V, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.embed.weight if out is None else torch.nn.Parameter(out.to(dtype))
        self.drafting_head = self.lm_head
        self.vocab_rows = V
        self.tap_ids: list[int] = []
        self.runner, self.backend = LlamaCppPath(self.gguf, dtype), "llama-cpp"

    @classmethod
    def load(cls, name_or_path: str = registry.DEFAULT_TARGET, dtype="float32", device: str = "cpu") -> "LlamaTarget":
        if torch.device(device).type != "cpu":
            raise TreeflashError("--backend llama-cpp runs on the CPU here (--device cpu)")
        gguf = GGUFModel(gguf_of(name_or_path), cls.WINDOW, threads())  # first: llama.cpp says if it runs the file
        converted = registry.cache_dir() / "targets" / name_or_path if name_or_path in registry.TARGETS else None
        config, tok = hf_meta(gguf.path, converted)
        return cls(gguf, config, tok, parse_dtype(dtype), name_or_path)

    def quantize(self, mode: str) -> "LlamaTarget":
        if mode != "none":
            raise TreeflashError("--quantize applies to PyTorch targets; on --backend llama-cpp the GGUF's own "
                                 "quantization runs (pick a quantized GGUF)")
        return self

    def set_backend(self, name: str) -> "LlamaTarget":
        if name not in ("auto", "llama-cpp"):
            raise TreeflashError(f"this target was loaded for the llama-cpp backend; load it again for {name!r}")
        return self

    def set_taps(self, layer_ids: list[int]) -> None:
        self.gguf.set_taps(list(layer_ids))
        self.tap_ids = list(layer_ids)
