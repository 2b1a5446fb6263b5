"""DFlash block drafter with the optional TreeFlash AR-approximation: the modules and their passes.

One drafter pass reads a block `[last token, MASK x (B-1)]` and the fused hidden states of a few
target layers (the *context*), and returns the block's hidden states. Block position i (1..B-1)
predicts the token i steps after the last token, through the target's own (shared) LM head
(decoding/heads.py at inference).

Context features enter every layer only as extra keys/values: `hidden_norm(fc(concat(taps)))`
goes through each layer's k_proj/v_proj (+k_norm, RoPE at the context positions). The block
attends to all context and bidirectionally to itself. Context keys/values are cached across
steps (`kvcache.DraftCache`); the block's own keys/values are never stored. One sequence's pass is `draft`
(its context grows by `extend`); several sequences' blocks go through one pass (`draft_blocks`),
their contexts' new rows too (`extend_contexts`): the single-sequence loop and the batched step
call these two.

TreeFlash: `ar_approximation` (SwiGLU over [RMSNorm(emb(prev token)), norm(h)]) is added to the
residual h before the final norm, turning the marginal at a position into a distribution
conditioned on a chosen previous token.

Parameter names follow the published DFlash/TreeFlash drafters: `layers.N.*`, `fc`, `hidden_norm`,
`norm` (under `model.`) and `ar_approximation.*`. The config is models/drafter_config.py; the
checkpoint files are read and written by models/drafter_io.py (`load_drafter`, `Drafter.save` here).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import drafter_io
from .attention import apply_rope, linear, stacked_attention
from .cpu import UPCAST_MIN_ROWS, upcast_pays
from .drafter_config import DrafterConfig
from .kvcache import DraftCache, flat_kv

AR_NORM_EPS = 1e-6  # the published SwiGLU AR-approximation hard-codes its norm's eps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, head_dim] (rotate-half convention, as Llama/Qwen)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    freqs = positions.float()[:, None] * inv[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> k, v [nkv, T, hd] (k normed and rotated)."""
        T = x.shape[0]
        k = self.k_norm(linear(self.k_proj, x).view(T, self.nkv, self.hd)).transpose(0, 1)
        v = linear(self.v_proj, x).view(T, self.nkv, self.hd).transpose(0, 1)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask=None) -> torch.Tensor:
        """x [Q, H] block states; k_ctx/v_ctx [nkv, C, hd]; mask [Q, C+Q] bool or None (all visible)."""
        Q = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(Q, self.nh, self.hd)).transpose(0, 1), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([k_ctx, k_blk], 1)  # [nkv, C+Q, hd]
        v = torch.cat([v_ctx, v_blk], 1)
        if mask is None:  # inference: every row sees the context and the whole block
            o = stacked_attention(q[None], k[None], v[None])  # [1, nh, Q, hd]
        else:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                               enable_gqa=self.nh != self.nkv)  # [1, nh, Q, hd]
        return self.o_proj(o[0].transpose(0, 1).reshape(Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, k_ctx, v_ctx, mask=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_ctx, v_ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashBody(nn.Module):
    """The published DFlash parameter tree: layers, fc, hidden_norm, norm."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class ARApproximation(nn.Module):
    """TreeFlash correction: h + d(silu(g) * u), [u, g] = ug([norm(emb(prev)), final_norm(h)])."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, AR_NORM_EPS)  # fixed eps, as published
        self.ug = nn.Linear(2 * c.hidden_size, 2 * c.ar_size, bias=True)
        self.d = nn.Linear(c.ar_size, c.hidden_size, bias=False)
        self._split: tuple | None = None

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor, final_norm: RMSNorm) -> torch.Tensor:
        """h [..., H] pre-norm drafter states; prev_emb [..., H] -> corrected pre-norm states [..., H]."""
        return self.combine(h, self.ug(torch.cat([self.norm(prev_emb), final_norm(h)], -1)))

    # ug is linear in its two halves, so inference can compute them apart: the state half once per
    # position (not once per candidate), the previous-token half from a per-token table.
    def _halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_prev [2A, H], W_state [2A, H]) contiguous, cached until the weight changes."""
        w = self.ug.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if self._split is None or self._split[0] != key:
            H = w.shape[1] // 2
            self._split = (key, (w[:, :H].contiguous(), w[:, H:].contiguous()))
        return self._split[1]

    def prev_part(self, prev_emb: torch.Tensor) -> torch.Tensor:
        """prev_emb [R, H] -> the previous-token half of ug, bias included [R, 2A]."""
        return F.linear(self.norm(prev_emb), self._halves()[0], self.ug.bias)

    def state_part(self, h: torch.Tensor, final_norm: RMSNorm) -> torch.Tensor:
        """h [P, H] pre-norm -> the state half of ug [P, 2A]."""
        return F.linear(final_norm(h), self._halves()[1])

    def combine(self, h: torch.Tensor, ug: torch.Tensor) -> torch.Tensor:
        """h [R, H], ug [R, 2A] (both halves summed) -> corrected pre-norm states [R, H]."""
        u, g = ug.chunk(2, -1)
        return h + self.d(F.silu(g) * u)


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.model = DFlashBody(config)
        self.ar_approximation = ARApproximation(config) if config.ar_approximation else None
        # Draft vocabulary (EAGLE-3 style): the token ids [Vd] the drafter proposes from; its LM head
        # runs over those rows only. None = the whole vocabulary. Verification never uses it.
        self.draft_vocab: torch.Tensor | None = None
        self._compiled_block = self._compiled_extend_block = None
        self._compiled_cpp = False  # whether the compiled block pass uses the C++ GEMM template

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Drafter":
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        if self.ar_approximation is not None:
            nn.init.zeros_(self.ar_approximation.d.weight)  # starts as the identity correction
        return self

    def _rope(self, positions: torch.Tensor, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor,
                   upcast: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats [C, n_taps*H] target features at positions [C] -> per-layer (k, v) [nkv, C, hd].
        upcast: compute in float32 (bf16 weights are upcast per call), return feats' dtype."""
        x = self.model.hidden_norm(linear(self.model.fc, feats.float() if upcast else feats))
        cos, sin = self._rope(positions, x.dtype)
        kv = [layer.self_attn.kv(x, cos, sin) for layer in self.model.layers]
        return [(k.to(feats.dtype), v.to(feats.dtype)) for k, v in kv] if upcast else kv

    def extend(self, cache: DraftCache, feats: torch.Tensor, positions: torch.Tensor, defer: bool = False) -> None:
        """Append context features (accepted positions) to the drafter's cache; with `defer`, the
        next `draft` computes their keys/values (one call on the compiled path)."""
        if defer:
            cache.defer(feats, positions)
            return
        self._flush(cache)
        self._append(cache, feats, positions)
        cache.length += feats.shape[0]

    def _append(self, cache: DraftCache, feats: torch.Tensor, positions: torch.Tensor) -> None:
        # a prompt's features on a CPU that emulates bf16: 6x faster in float32 (180 rows, AVX2: 31 -> 5 ms)
        upcast = feats.shape[0] >= UPCAST_MIN_ROWS and upcast_pays(feats.dtype, feats.device)
        for i, (k, v) in enumerate(self.context_kv(feats, positions, upcast)):
            cache.append(i, k, v)

    def _flush(self, cache: DraftCache) -> None:
        pending = cache.take_pending()
        if pending is not None:
            self._append(cache, *pending)

    def forward_block(self, block_emb: torch.Tensor, positions: torch.Tensor,
                      kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_emb [Q, H] at positions [Q]; kv per layer [nkv, C, hd]; mask [Q, C+Q] -> h [Q, H] (pre-norm)."""
        cos, sin = self._rope(positions, block_emb.dtype)
        h = block_emb
        for layer, (k, v) in zip(self.model.layers, kv):
            h = layer(h, cos, sin, k, v, mask)
        return h

    def block_ids(self, root: int, depth: int, device) -> torch.Tensor:
        """[depth+1] long: a step's block [root, MASK x depth]."""
        ids = torch.full((depth + 1,), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0] = root
        return ids

    @torch.no_grad()
    def draft_blocks(self, jobs: list[tuple[DraftCache, torch.Tensor, int]]) -> list[torch.Tensor]:
        """jobs [(context, embedded block [Q_j, H], start)] -> per job the pre-norm states h [Q_j, H]
        of its block at positions start.., from ONE pass over every block (a block sees its own
        context and itself). One job alone is `draft` (compiled where the drafter is)."""
        if len(jobs) == 1:
            return [self.draft(*jobs[0])]
        assert all(c.pending is None for c, _, _ in jobs), "batched contexts are extended eagerly"
        dev = jobs[0][1].device
        pos = torch.cat([torch.arange(s, s + len(b), device=dev) for _, b, s in jobs])  # [Q]
        kv = [(torch.cat([c.k[i] for c, _, _ in jobs], 1), torch.cat([c.v[i] for c, _, _ in jobs], 1))
              for i in range(len(self.model.layers))]                                 # per layer [nkv, C, hd]
        ctx, blk = [c.k[0].shape[1] for c, _, _ in jobs], [len(b) for _, b, _ in jobs]
        own = [torch.block_diag(*[torch.ones(r, c, dtype=torch.bool, device=dev) for r, c in zip(blk, cols)])
               for cols in (ctx, blk)]                                                # [Q, C], [Q, Q]
        h = self.forward_block(torch.cat([b for _, b, _ in jobs]), pos, kv, torch.cat(own, 1))  # [Q, H]
        return list(h.split(blk))

    @torch.no_grad()
    def extend_contexts(self, items: list[tuple[DraftCache, torch.Tensor, torch.Tensor]], defer: bool = False) -> None:
        """items [(context, feats [K, taps*H], positions [K])]: each context grows by its rows, the
        keys / values of all of them from one pass. One item alone is `extend` (it may be `defer`red)."""
        if len(items) == 1:
            self.extend(*items[0], defer=defer)
            return
        sizes = [len(p) for _, _, p in items]
        kv = self.context_kv(torch.cat([f for _, f, _ in items]), torch.cat([p for _, _, p in items]))
        for i, (k, v) in enumerate(kv):  # [nkv, sum K, hd]
            for (cache, _, _), kj, vj in zip(items, k.split(sizes, 1), v.split(sizes, 1)):
                cache.append(i, kj, vj)
        for (cache, _, _), n in zip(items, sizes):
            cache.length += n

    def draft(self, cache: DraftCache, block_emb: torch.Tensor, start: int) -> torch.Tensor:
        """One inference pass: block [B, H] at positions start.. -> h [B, H] (pre-norm); appends
        the cache's pending context first."""
        pos = torch.arange(start, start + block_emb.shape[0], device=block_emb.device)
        if self._compiled_block is None:
            self._flush(cache)
            return self.forward_block(block_emb, pos, list(zip(cache.k, cache.v)))
        if cache.pending is None or cache.k[0] is None:
            self._flush(cache)
            return self._compiled_block(block_emb, pos, *flat_kv(cache))
        h, *kv = self._compiled_extend_block(*cache.take_pending(), block_emb, pos, *flat_kv(cache))
        cache.k[:], cache.v[:] = kv[0::2], kv[1::2]
        return h

    def extend_block(self, feats: torch.Tensor, fpos: torch.Tensor, block_emb: torch.Tensor, positions: torch.Tensor,
                     kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """Context features feats [n, taps*H] at fpos [n] appended to kv (per layer [nkv, C, hd]),
        then the block pass: -> (the extended kv per layer [nkv, C+n, hd], h [Q, H])."""
        new = self.context_kv(feats, fpos)
        kv = [(torch.cat([k, nk], 1), torch.cat([v, nv], 1)) for (k, v), (nk, nv) in zip(kv, new)]
        return kv, self.forward_block(block_emb, positions, kv)

    def compile_drafting(self, on: bool = True, cpp_gemm: bool = False) -> None:
        """Compile the inference block pass (`draft`) and the same pass after appending the last
        step's accepted context, their sizes symbolic (`drafter_steps.compiled_passes`: packages
        on disk on the CPU); the compiled target backends turn this on; `cpp_gemm`: matmuls in
        inductor's C++ GEMM template, as backend compiled-cpp. Weights are frozen into the
        compiled graph: recompile (off, then on) after changing them."""
        if not on or cpp_gemm != self._compiled_cpp:
            self._compiled_block = self._compiled_extend_block = None
        if on and self._compiled_block is None:
            from .drafter_steps import compiled_passes

            self._compiled_block, self._compiled_extend_block = compiled_passes(self, cpp_gemm)
            self._compiled_cpp = cpp_gemm
            self._warm_compiled()

    @torch.no_grad()
    def _warm_compiled(self, context: int = 4) -> None:
        """Compile every graph the decode loop uses now, not inside a timed generation: the block
        pass alone, and with 1 and with >= 2 appended positions (sizes 0/1 specialise)."""
        p = next(self.parameters())
        c = self.config
        kv = [torch.zeros(c.num_key_value_heads, context, c.head_dim, dtype=p.dtype, device=p.device)
              for _ in range(2 * len(self.model.layers))]  # distinct k, v: guards check aliasing
        block = torch.zeros(c.block_size, c.hidden_size, dtype=p.dtype, device=p.device)
        pos = torch.arange(context, context + c.block_size, device=p.device)
        self._compiled_block(block, pos, *kv)
        for n in (1, 2):
            feats = torch.zeros(n, self.model.fc.in_features, dtype=p.dtype, device=p.device)
            self._compiled_extend_block(feats, torch.arange(n, device=p.device), block, pos, *kv)

    def corrected(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """Final-normed states after the TreeFlash correction; without one, the marginal states."""
        if self.ar_approximation is not None:
            h = self.ar_approximation(h, prev_emb, self.model.norm)
        return self.model.norm(h)

    def save(self, out_dir: str | Path, dtype: torch.dtype | None = torch.bfloat16,
             fmt: str | None = None) -> Path:
        """Write a checkpoint directory in the published layout `fmt`: see `drafter_io.save_drafter`."""
        return drafter_io.save_drafter(self, out_dir, dtype, fmt)


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32) -> Drafter:
    """Load a drafter directory: config.json + model.safetensors (or shards with an index), in the
    published DFlash or TreeFlash layout, or ours (`drafter_io` reads and checks the files)."""
    p = Path(path)
    cfg = drafter_io.read_config(p)
    sd = drafter_io.read_state_dict(p)
    with torch.device("meta"):  # no random init: every tensor comes from the file
        model = Drafter(cfg)
    drafter_io.check_tensors(p, model, sd)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    model.draft_vocab = drafter_io.read_draft_vocab(p, cfg.vocab_size)
    return model.eval()


def random_drafter(target, seed: int = 0, **kw) -> Drafter:
    """A random-initialised drafter sized for `target` (a `models.target.Target`; for tests and
    checks); `kw`: `DrafterConfig.for_target` options (num_layers, block_size, ...)."""
    cfg = DrafterConfig.for_target(target.config, mask_token_id=target.default_mask_token(), **kw)
    cfg.vocab_size = target.vocab_rows
    return Drafter(cfg).init_weights(seed).to(device=target.device, dtype=target.dtype).eval()
