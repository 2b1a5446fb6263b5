"""A lean target forward for Llama-family models over a preallocated KV cache (gpt-fast style).

The Hugging Face modules keep their weights; this file replaces only the glue around them: no
mask factory, no per-step cache concatenation, taps read inline instead of by hooks. Tree nodes
are written to consecutive slots `start .. start+N-1` of a `kvcache.StaticKV` (positions
`start + depth`), and its `compact` moves the accepted path to the front of those slots in place.

One decoder function (`_decode`) over rows at any slots (`forward_rows`; `forward`: one sequence's
rows at the slots after its cache), two modes; both return (logits, features), logits indexable by node:
- eager (`compile=False`): attention reads only the live slots `[:start+N]`; any N; the logits are
  a `LazyLogits` (the LM head runs over the rows read).
- compiled (`compile=True`): `torch.compile` (inductor, freezing) of `_step` = `_decode` plus the LM
  head over every row (a tensor), for a few bucketed tree sizes; attention reads the live slots
  and the step's own, rounded up to `WIDTH_STEP`, under a bool mask. The cache's slot dimension
  and the mask's width are symbolic (`mark_dynamic`), so each bucket compiles once for every
  capacity and width, and is cached on disk by inductor. Rows are padded to their bucket by one
  function (`_padded`) for one sequence and for a batch alike: a padding row writes a free slot
  and attends to slot 0 alone. Prefill (and any flat sequence of more than one token) runs eagerly.
- compiled with `cpp_gemm=True` (backend `compiled-cpp`): the same graph, but every matmul is
  inductor's C++ GEMM template (max-autotune with the CPP backend as the only choice, so nothing is
  benchmarked). Where the default kernels cost more with each row (MKL's packed fp32 and ATen's bf16
  GEMM on AVX2 CPUs without AVX-512), its cost stays near flat from 1 to 4 rows (docs/performance.md,
  "Backends (`--backend`)"; `treeflash profile --verify-costs compiled,compiled-cpp` measures it).
  It needs an x86 CPU with AVX2 or AVX-512; compiling takes minutes per tree size.
- compiled on the CPU (packages on, the default): the step is one AOTInductor package on disk for
  2..64 rows, trees unpadded and a plain step run as two rows (`steps.PackagedSteps`), built once
  per machine and loaded in about a second by later processes.

Long flat sequences of a bfloat16 model compute in float32 where that pays (`cpu.upcast_pays`).
Beside this file: `kvcache` (the caches), `attention` (stacked attention, `linear`), `inductor`
(`compile_frozen`, the compiled-cpp options), `cpu` (feature flags, the upcast rule),
`lazy_logits` (the eager path's logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TreeflashError
from .aot import enabled as aot_enabled
from .attention import apply_rope, linear, stacked_attention
from .cpu import UPCAST_MIN_ROWS, upcast_pays
from .inductor import compile_frozen, cpp_gemm_supported
from .kvcache import StaticKV, attention_mask, causal, round_up
from .lazy_logits import LazyLogits
from .steps import PackagedSteps

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64)  # compiled tree sizes; a tree is padded to the next one
CAPACITY_STEP = 512
WIDTH_STEP = 64  # a compiled step attends over the slots of its mask's width rounded up to this
GROUPED_MAX_ROWS = 4  # steps of 2..this many rows attend with the query heads of a KV head stacked (`_attend`)


def bucket_for(n: int) -> int | None:
    """The compiled tree size that holds n nodes (None: larger than every bucket)."""
    return next((b for b in BUCKETS if b >= n), None)


def supported(config) -> bool:
    """Llama-family decoder with full attention in every layer (no sliding window)."""
    layer_types = getattr(config, "layer_types", None) or []
    return config.model_type in SUPPORTED and all(t == "full_attention" for t in layer_types)


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear | None:
    """One nn.Linear computing cat([p(x) for p in parts], -1); the parts' weights (and biases)
    become views into the fused ones, so the HF modules keep working and no memory is duplicated.
    None when a part is not a plain nn.Linear (e.g. quantized) or the parts disagree on bias."""
    if any(type(p) is not nn.Linear for p in parts) or len({p.bias is None for p in parts}) != 1:
        return None
    w = torch.cat([p.weight.detach() for p in parts])  # [sum O, I]
    b = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        fused.bias = nn.Parameter(b, requires_grad=False)
    o = 0
    for p in parts:
        n = p.out_features
        p.weight = nn.Parameter(w[o:o + n], requires_grad=False)
        if b is not None:
            p.bias = nn.Parameter(b[o:o + n], requires_grad=False)
        o += n
    return fused


class FusedLayer(nn.Module):
    """q|k|v and gate|up of one decoder layer as two matmuls (None where they cannot be fused)."""

    def __init__(self, layer):
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self.qkv = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
        self.gate_up = fuse_linears([m.gate_proj, m.up_proj])
        self.sizes = (a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features)


class FastPath:
    """One decoder forward over the HF modules of `model` (a *ForCausalLM), writing a StaticKV."""

    def __init__(self, model, compile: bool = False, cpp_gemm: bool = False):
        if not supported(model.config):
            raise TreeflashError(f"the static-cache path supports {', '.join(SUPPORTED)} (full attention); "
                                 f"got {model.config.model_type}: use --backend hf")
        self.model = model
        self.decoder = model.get_decoder()
        attn = self.decoder.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_kv = model.config.num_key_value_heads
        self.scaling = attn.scaling
        self.qk_norm = hasattr(attn, "q_norm")
        self.compile = compile
        self.cpp_gemm = cpp_gemm
        self.aot = compile and aot_enabled() and next(model.parameters()).device.type == "cpu"
        if cpp_gemm and (next(model.parameters()).device.type != "cpu" or not cpp_gemm_supported()):
            raise TreeflashError("backend compiled-cpp needs an x86 CPU with AVX2 or AVX-512; use --backend compiled")
        self._compiled = {}  # tap ids -> compiled step
        self._warmed: dict[tuple, set[int]] = {}  # tap ids -> buckets compiled by `warm`
        self.fused = nn.ModuleList(FusedLayer(layer) for layer in self.decoder.layers)
        p = next(model.parameters())
        # upcast long prefills (not with quantized or unfused layers: those keep their own kernels)
        self.upcast = upcast_pays(p.dtype, p.device) and all(f.qkv is not None and f.gate_up is not None
                                                             for f in self.fused)
        # attention in float32 there too: ATen's bf16 CPU attention for a 1-token query costs several
        # times its float32 (docs/performance.md, "Attention in float32")
        self.attn_dtype = torch.float32 if upcast_pays(p.dtype, p.device) else None

    # ---- cache ----
    def new_cache(self, need: int, max_length: int) -> StaticKV:
        if self.compile:  # spare slots: a compiled step's width stays below the capacity (`forward`)
            need += WIDTH_STEP
        cap = min(max_length + BUCKETS[-1], round_up(need, CAPACITY_STEP))
        p = next(self.model.parameters())
        return self.mark_dynamic(StaticKV(len(self.decoder.layers), self.n_kv, self.head_dim, cap, p.dtype, p.device))

    def mark_dynamic(self, cache: StaticKV) -> StaticKV:
        """Compiled: the slot dimension is symbolic, so one compiled step serves every capacity."""
        if self.compile:
            for t in cache.k + cache.v:
                torch._dynamo.mark_dynamic(t, 2)
        return cache

    @property
    def spare_slots(self) -> int:
        """Slots a batch pool keeps past its pages (`forward_rows`): scratch for a bucket's padding
        rows (fewer than the largest bucket) and room for the attended width's rounding."""
        return max(WIDTH_STEP, BUCKETS[-1]) if self.compile else 0

    # ---- the forward ----
    def _decode(self, x, pos, slots, mask, cache: StaticKV, tap_ids: tuple, stacked: bool = True):
        """x [N, H]; pos, slots [N]; mask [N, S] bool over the cache slots [:S] to attend to;
        `stacked`: steps of 2-4 rows may stack query heads (`_attend`).

        Returns h [N, H] (final-normed) and the features [N, taps*H]: the outputs of the layers
        `tap_ids`, in order (no columns without taps)."""
        x = x[None]  # [1, N, H]
        cos, sin = self.decoder.rotary_emb(x, pos[None])  # [1, N, D]
        cos, sin = cos[:, None], sin[:, None]             # [1, 1, N, D]
        width = mask.shape[-1]
        taps = {}
        for i, layer in enumerate(self.decoder.layers):
            a = layer.self_attn
            fl = self.fused[i]
            h = layer.input_layernorm(x)
            if fl.qkv is not None:
                q, k, v = linear(fl.qkv, h).split(fl.sizes, -1)
            else:
                q, k, v = linear(a.q_proj, h), linear(a.k_proj, h), linear(a.v_proj, h)
            q = q.view(1, -1, a.config.num_attention_heads, self.head_dim)  # [1, N, Hq, D]
            k = k.view(1, -1, self.n_kv, self.head_dim)
            v = v.view(1, -1, self.n_kv, self.head_dim).transpose(1, 2)  # [1, Hkv, N, D]
            if self.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
            keys, values = cache.update(k, v, i, slots)  # [1, Hkv, S', D], S' >= S
            dt = self.attn_dtype or q.dtype
            q, keys, values = q.to(dt), keys[:, :, :width].to(dt), values[:, :, :width].to(dt)
            o = self._attend(q, keys, values, mask, x.dtype, stacked)  # [1, Hq, N, D]
            x = x + linear(a.o_proj, o.transpose(1, 2).reshape(1, o.shape[2], -1))
            h = layer.post_attention_layernorm(x)
            if fl.gate_up is not None:
                g, u = linear(fl.gate_up, h).chunk(2, -1)
                x = x + linear(layer.mlp.down_proj, layer.mlp.act_fn(g) * u)
            else:
                x = x + layer.mlp(h)
            if i in tap_ids:
                taps[i] = x[0]
        h = self.decoder.norm(x[0])
        return h, (torch.cat([taps[i] for i in tap_ids], -1) if tap_ids else h[:, :0])

    def _attend(self, q, keys, values, mask, dtype, stacked: bool = True):
        """q [1, Hq, N, D], keys/values [1, Hkv, S, D], mask [N, S] bool -> [1, Hq, N, D] in `dtype`.

        A step of 2-4 rows (a small tree) stacks the g = Hq/Hkv query heads that share a KV head
        as g*N rows of one head (row gi*N + n: head h*g + gi, node n; the mask repeated per head):
        ATen's CPU flash attention then runs Hkv heads of g*N rows instead of Hq heads of N rows
        with the KV heads broadcast, which is slower for 2-4 rows on an AVX2 CPU (docs/performance.md,
        "Stacked query heads"). One row keeps the broadcast form: it is faster there."""
        n = q.shape[2]
        if stacked and 1 < n <= GROUPED_MAX_ROWS and q.shape[1] > self.n_kv:
            return stacked_attention(q, keys, values, mask, self.scaling).to(dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None], scale=self.scaling,
                                              enable_gqa=True).to(dtype)

    def _step(self, ids, pos, slots, mask, cache: StaticKV, tap_ids: tuple, stacked: bool = True):
        """The compiled unit: `_decode` and the LM head over every row: float32 logits [N, V], features."""
        h, feats = self._decode(self.decoder.embed_tokens(ids), pos, slots, mask, cache, tap_ids, stacked)
        return self.model.get_output_embeddings()(h).float(), feats

    def bucket(self, n: int) -> int | None:
        """The rows a compiled step of n rows runs (packages: n, at least 2; else the bucket holding it)."""
        return PackagedSteps.rows_for(n) if self.aot else bucket_for(n)

    def _compiled_step(self, tap_ids: tuple):
        if tap_ids not in self._compiled:  # weights as constants: what makes compiling pay on CPU
            self._compiled[tap_ids] = (PackagedSteps(self, tap_ids) if self.aot else
                                       compile_frozen(self._step, self.cpp_gemm, dynamic=False, fullgraph=True))
        return self._compiled[tap_ids]

    @torch.no_grad()
    def forward(self, ids, positions, cache: StaticKV, tree_mask, tap_ids: list[int]):
        """ids, positions [N] into slots cache.length.. ; tree_mask [N, N] bool among the new tokens
        (None: causal). Returns (logits, features [N, taps*H] or None). Eager: a `LazyLogits`.
        Compiled: float32 logits [N, V] of every row: inside the compiled graph the LM head uses a
        prepacked weight, so one pass over the tree costs about what one row costs eagerly. The
        rows of `forward_rows`: slots start..start+N-1, each seeing the held slots and its
        ancestors (`kvcache.attention_mask`); a compiled bucket's padding rows write the slots after."""
        n, start = len(ids), cache.length
        end = start + n
        if end > cache.capacity:
            raise TreeflashError(f"KV cache of {cache.capacity} slots is full (needed {end})")
        mask = attention_mask(start, tree_mask, torch.empty(n, end, dtype=torch.bool, device=ids.device))  # [N, end]
        slots = torch.arange(start, min(end + BUCKETS[-1], cache.capacity), device=ids.device)  # its own, then free
        logits, feats = self.forward_rows(cache, ids, positions, slots[:n], mask, tap_ids, slots[n:],
                                          flat=tree_mask is None and n > 1)
        cache.length = end
        return logits, (feats if tap_ids else None)

    @torch.no_grad()
    def forward_rows(self, cache: StaticKV, ids, pos, slots, mask, tap_ids, scratch: torch.Tensor,
                     flat: bool = False):
        """Rows ids, pos, slots [N] at any slots of the cache (a batch pool's, `decoding/batch.py`, or
        one sequence's, `forward`), mask [N, W] bool over its slots [:W]; `scratch` [S] long: slots
        that no row holds or sees, where a compiled bucket's padding rows write. Returns (logits
        indexable by row, features [N, taps*H]).

        Compiled where a bucket holds the N rows, the scratch slots its padding rows (`_padded`), and
        the width rounded up to WIDTH_STEP stays below the cache's size (a slice of the whole cache
        would be contiguous, a case the graph is not compiled for). Flat (a prefill or a prefill
        chunk), more rows than any bucket, or eager backends: eagerly."""
        n, taps = len(ids), tuple(tap_ids)
        bucket = self.bucket(n) if self.compile and not flat else None
        width = round_up(mask.shape[1], WIDTH_STEP)
        if bucket is None or width >= cache.capacity or len(scratch) < bucket - n:
            return self._eager_rows(cache, ids, pos, slots, mask, taps, flat)
        step_inputs = self._padded(cache, ids, pos, slots, mask, bucket, width, scratch)
        logits, feats = self._compiled_step(taps)(*step_inputs, cache, taps)
        return logits[:n], feats[:n]

    def _padded(self, cache: StaticKV, ids, pos, slots, mask, bucket: int, width: int, scratch: torch.Tensor):
        """The compiled step's inputs: the rows padded to `bucket` rows, the mask to `width` columns,
        in the cache's reused buffers (`StaticKV.inputs`) -> ids, pos, slots [Nb], mask [Nb, width]
        (contiguous, its width symbolic). A padding row is token 0 at the last row's position; it
        writes a scratch slot and attends to slot 0 alone: no row sees it, its outputs are dropped."""
        n, b = len(ids), cache.inputs(bucket)
        m = b["mask"].view(-1)[:bucket * width].view(bucket, width)  # [Nb, W'], contiguous
        torch._dynamo.mark_dynamic(m, 1)  # W' is symbolic: no compile per width
        m.zero_()
        m[:n, :mask.shape[1]] = mask
        m[n:, 0] = True
        b["ids"][:n], b["ids"][n:] = ids, 0
        b["pos"][:n], b["pos"][n:] = pos, pos[-1]
        b["slots"][:n], b["slots"][n:] = slots, scratch[:bucket - n]
        return b["ids"], b["pos"], b["slots"], m

    def _eager_rows(self, cache, ids, pos, slots, mask, taps, flat: bool):
        """Eager `_decode` of rows ids, pos, slots [N] under mask [N, W] -> (LazyLogits, features
        [N, taps*H]); a long flat sequence (a prefill) computes in float32 where that pays."""
        x = self.decoder.embed_tokens(ids)  # [N, H]
        dtype = x.dtype
        if self.upcast and flat and len(ids) >= UPCAST_MIN_ROWS:
            x = x.float()
        h, feats = self._decode(x, pos, slots, mask, cache, taps)
        return LazyLogits(h.to(dtype), self.model.get_output_embeddings()), feats.to(dtype)

    @torch.no_grad()  # as `forward` runs: grad mode is part of what a compiled graph checks
    def warm(self, sizes, tap_ids: list[int]) -> None:
        """Compile (or load from inductor's disk cache) the steps for trees of these sizes now,
        on a scratch cache of the usual capacity, rather than inside a timed generation."""
        if not self.compile:
            return
        taps = tuple(tap_ids)
        todo = {b for b in map(self.bucket, sizes) if b is not None}
        todo -= self._warmed.get(taps, set())
        if not todo:
            return
        cache = self.new_cache(CAPACITY_STEP, CAPACITY_STEP)
        dev = cache.k[0].device
        for b in sorted(todo):  # a chain of b rows from slot 0: a whole bucket, no padding
            rows = torch.arange(b, device=dev)
            self.forward_rows(cache, torch.zeros(b, dtype=torch.long, device=dev), rows, rows, causal(b, dev), taps,
                              rows[:0])
        self._warmed.setdefault(taps, set()).update(todo)
