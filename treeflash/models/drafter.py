"""DFlash block drafter with the optional TreeFlash AR-approximation.

One drafter pass reads a block `[last token, MASK x (B-1)]` and the fused hidden states of a few
target layers (the *context*), and returns the block's hidden states. Block position i (1..B-1)
predicts the token i steps after the last token, through the target's own (shared) LM head.

Context features enter every layer only as extra keys/values: `hidden_norm(fc(concat(taps)))`
goes through each layer's k_proj/v_proj (+k_norm, RoPE at the context positions). The block
attends to all context and bidirectionally to itself. Context keys/values are cached across
steps (`DraftCache`); the block's own keys/values are never stored.

TreeFlash: `ar_approximation` (SwiGLU over [RMSNorm(emb(prev token)), norm(h)]) is added to the
residual h before the final norm, turning the marginal at a position into a distribution
conditioned on a chosen previous token.

Parameter names and config fields follow the published DFlash/TreeFlash drafters: `layers.N.*`,
`fc`, `hidden_norm`, `norm` (under `model.` in TreeFlash checkpoints) and `ar_approximation.*`.
Two on-disk layouts (see docs/checkpoints.md):
- "dflash": z-lab DFlash (`DFlashDraftModel`): body at the top level, no AR-approximation; what the
  SGLang / vLLM DFlash loaders read.
- "treeflash": TreeFlash (`TreeFlashDraftModel`): body under `model.`, plus `ar_approximation.*`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import TreeflashError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"  # optional: {"token_ids": [Vd] int64}, the drafter's LM-head rows
INDEX_NAME = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {tensor: file}}
FORMATS = ("dflash", "treeflash")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "treeflash": "TreeFlashDraftModel"}
# trust_remote_code entry points of the published repos (the .py files are not shipped by us)
AUTO_MAPS = {"dflash": {"AutoModel": "dflash.DFlashDraftModel"},
             "treeflash": {"AutoModel": "tree_flash.TreeFlashDraftModel"}}
AR_NORM_EPS = 1e-6  # the published SwiGLU AR-approximation hard-codes its norm's eps
# Published loaders build a transformers Qwen3Config, so its defaults apply to absent fields.
QWEN3_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 32768, "attention_bias": False,
    "hidden_act": "silu",
}
# dflash_config keys of later DFlash variants whose math this drafter does not implement,
# with the value that means "off".
UNSUPPORTED_DFLASH_KEYS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                           "final_logit_softcapping": None, "attention_sink_bias": False,
                           "use_swa": False, "causal": False, "conv_kernel_size": None,
                           "selector_rank": None, "projector_type": "dflash"}


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Evenly spread taps from layer 1 to layer L-3 (the DFlash rule); one tap -> the middle layer."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)  # shallow targets (< 4 layers): every tap stays in range
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int | None  # None: the checkpoint did not say (target_layer_ids given)
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    ar_approximation: str | None = "swiglu"  # None: plain DFlash drafter
    ar_intermediate_size: int | None = None  # defaults to intermediate_size
    candidate_tokens: int = 16  # published TreeFlash: default tree size (nodes verified, root included)
    extra: dict = field(default_factory=dict)  # unknown config.json fields, kept on round trips

    @property
    def ar_size(self) -> int:
        return self.ar_intermediate_size or self.intermediate_size

    @classmethod
    def for_target(cls, tcfg, *, num_layers: int = 1, num_taps: int = 4, block_size: int = 16,
                   mask_token_id: int, treeflash: bool = True, **kw) -> "DrafterConfig":
        """A drafter shaped like the target's own layers (so it can be initialised from them)."""
        L = tcfg.num_hidden_layers
        rope = getattr(tcfg, "rope_parameters", None) or {}
        return cls(
            hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=tcfg.num_attention_heads,
            num_key_value_heads=tcfg.num_key_value_heads,
            head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads,
            vocab_size=tcfg.vocab_size, num_target_layers=L,
            target_layer_ids=default_target_layer_ids(L, min(num_taps, L)),
            mask_token_id=mask_token_id, block_size=block_size,
            rms_norm_eps=tcfg.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))),
            max_position_embeddings=tcfg.max_position_embeddings,
            ar_approximation="swiglu" if treeflash else None, **kw)

    @property
    def default_format(self) -> str:
        return "treeflash" if self.ar_approximation else "dflash"

    # ---- HF-style config.json in the published layout ----
    def to_dict(self, fmt: str | None = None) -> dict:
        """config.json for `fmt` ("dflash" | "treeflash"; default: treeflash iff there is an AR part)."""
        fmt = _check_format(fmt or self.default_format)
        n = self.num_hidden_layers
        d = {
            "architectures": [ARCHITECTURES[fmt]], "auto_map": dict(AUTO_MAPS[fmt]),
            "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": n, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0, "hidden_act": "silu",
            "layer_types": ["full_attention"] * n, "sliding_window": None, "use_sliding_window": False,
            "max_window_layers": n, "tie_word_embeddings": False, "use_cache": True,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
        }
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if fmt == "treeflash":
            tf = {"ar_approximation": self.ar_approximation, "candidate_tokens": self.candidate_tokens}
            if self.ar_size != self.intermediate_size:  # our extension; published code assumes equal
                tf["intermediate_size"] = self.ar_size
            d["treeflash_config"] = tf
        return {**self.extra, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        """Parse a published DFlash / TreeFlash config.json (or ours)."""
        if not isinstance(d, dict):
            raise TreeflashError("bad drafter config: config.json is not a JSON object")
        try:
            return cls._from_dict(d)
        except TreeflashError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise TreeflashError(f"bad drafter config: missing or invalid field {e}") from None

    @classmethod
    def _from_dict(cls, d: dict) -> "DrafterConfig":
        dfl, tf = _sub_dict(d, "dflash_config"), _sub_dict(d, "treeflash_config")
        _check_supported(d, dfl, tf)

        def get(key):  # absent -> the Qwen3Config default, as in the published loaders
            return d.get(key, QWEN3_DEFAULTS[key])

        n = int(get("num_hidden_layers"))
        L = dfl.get("num_target_layers", d.get("num_target_layers"))
        L = None if L is None else int(L)
        ids = dfl.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            if L is None:
                raise TreeflashError("bad drafter config: neither dflash_config.target_layer_ids nor "
                                     "num_target_layers is set")
            ids = default_target_layer_ids(L, n)  # the DFlash rule, one tap per drafter layer
        if not isinstance(ids, list) or not ids:
            raise TreeflashError(f"bad drafter config: dflash_config.target_layer_ids must be a "
                                 f"non-empty list of layer ids, got {ids!r}")
        mask = dfl.get("mask_token_id", d.get("mask_token_id"))
        if mask is None or isinstance(mask, bool):
            raise TreeflashError("bad drafter config: dflash_config.mask_token_id is missing (a token id "
                                 "of the target vocabulary, e.g. 151669 for Qwen3)")
        known = set(cls.__dataclass_fields__) | {"dflash_config", "treeflash_config", "rope_parameters",
                                                 "rope_scaling", "hidden_act"}
        return cls(
            hidden_size=int(get("hidden_size")), intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=n, num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads")), head_dim=int(get("head_dim")),
            vocab_size=int(get("vocab_size")), num_target_layers=L,
            target_layer_ids=[int(i) for i in ids], mask_token_id=int(mask),
            block_size=int(dfl.get("block_size", d.get("block_size", 16))),
            rms_norm_eps=float(get("rms_norm_eps")), rope_theta=_rope_theta(d),
            max_position_embeddings=int(get("max_position_embeddings")),
            attention_bias=bool(get("attention_bias")),
            ar_approximation=tf.get("ar_approximation"),
            ar_intermediate_size=tf.get("intermediate_size"),
            candidate_tokens=int(tf.get("candidate_tokens", 16)),
            extra={k: v for k, v in d.items() if k not in known},
        )


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise TreeflashError(f"unknown drafter format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def _sub_dict(d: dict, key: str) -> dict:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TreeflashError(f"bad drafter config: {key} must be a JSON object, got {type(v).__name__}")
    return v


def _rope_theta(d: dict) -> float:
    rope = _sub_dict(d, "rope_parameters")
    return float(rope.get("rope_theta", d.get("rope_theta", QWEN3_DEFAULTS["rope_theta"])))


def _check_supported(d: dict, dfl: dict, tf: dict) -> None:
    """Refuse configs whose math this drafter does not implement (instead of drafting garbage)."""
    arch = (d.get("architectures") or [None])[0]
    if arch is not None and arch not in ARCHITECTURES.values():
        raise TreeflashError(f"unsupported drafter architecture {arch!r}; supported: "
                             f"{', '.join(ARCHITECTURES.values())}")
    for key in ("rope_parameters", "rope_scaling"):
        rope = _sub_dict(d, key)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise TreeflashError(f"unsupported drafter RoPE type {kind!r} ({key}); only 'default' is supported")
        if float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
            raise TreeflashError("unsupported drafter config: partial_rotary_factor != 1")
    if d.get("hidden_act", "silu") != "silu":
        raise TreeflashError(f"unsupported drafter activation {d['hidden_act']!r}; only 'silu' is supported")
    kinds = set(d.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"} or d.get("is_causal"):
        raise TreeflashError(f"unsupported drafter attention (layer_types {sorted(kinds)}, is_causal "
                             f"{d.get('is_causal')}); only non-causal full attention is supported")
    for key, off in UNSUPPORTED_DFLASH_KEYS.items():
        if dfl.get(key, off) != off:
            raise TreeflashError(f"unsupported drafter config: dflash_config.{key}={dfl[key]!r} "
                                 "(a DFlash variant this engine does not implement)")
    ar = tf.get("ar_approximation")
    if ar not in (None, "swiglu"):
        raise TreeflashError(f"unsupported treeflash_config.ar_approximation {ar!r}; expected 'swiglu' or null")


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D]; cos/sin [T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


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
        k = self.k_norm(self.k_proj(x).view(T, self.nkv, self.hd)).transpose(0, 1)
        v = self.v_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask=None) -> torch.Tensor:
        """x [Q, H] block states; k_ctx/v_ctx [nkv, C, hd]; mask [Q, C+Q] bool or None (all visible)."""
        Q = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(Q, self.nh, self.hd)).transpose(0, 1), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([k_ctx, k_blk], 1)  # [nkv, C+Q, hd]
        v = torch.cat([v_ctx, v_blk], 1)
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


class DraftCache:
    """Per-layer context keys/values of the drafter: grows by the accepted positions each step.

    `pending` holds context not yet turned into keys/values (features [n, taps*H], positions [n]):
    the decode loop defers its per-step append, and the next block pass computes it in the same
    (compiled) call."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers  # each [nkv, C, hd]
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0  # context positions, pending included
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # contiguous from the start: a compiled block pass then sees one layout every step
        self.k[i] = k.contiguous() if self.k[i] is None else torch.cat([self.k[i], k], 1)
        self.v[i] = v.contiguous() if self.v[i] is None else torch.cat([self.v[i], v], 1)

    def defer(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        if self.pending is not None:
            feats, positions = torch.cat([self.pending[0], feats]), torch.cat([self.pending[1], positions])
        self.pending = (feats, positions)
        self.length += len(positions)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        p, self.pending = self.pending, None
        return p


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.model = DFlashBody(config)
        self.ar_approximation = ARApproximation(config) if config.ar_approximation else None
        # Draft vocabulary (EAGLE-3 style): the token ids [Vd] the drafter proposes from; its LM head
        # runs over those rows only. None = the whole vocabulary. Verification never uses it.
        self.draft_vocab: torch.Tensor | None = None
        self._head_rows: tuple | None = None
        self._columns: tuple | None = None  # (draft_vocab ptr, {token: column})
        self._prev_table: tuple | None = None
        self._compiled_block = self._compiled_extend_block = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def draft_head(self, lm_head: nn.Module) -> torch.Tensor | None:
        """lm_head.weight[draft_vocab] [Vd, H] (cached), or None without a draft vocabulary."""
        if self.draft_vocab is None:
            return None
        w = lm_head.weight
        key = (w.data_ptr(), w.dtype, w.device, self.draft_vocab.data_ptr())
        if self._head_rows is None or self._head_rows[0] != key:
            self._head_rows = (key, w[self.draft_vocab.to(w.device)].contiguous())
        return self._head_rows[1]

    def draft_column(self, token: int) -> int | None:
        """The column of `token` in the draft vocabulary (None: not in it, or no draft vocabulary)."""
        if self.draft_vocab is None:
            return None
        if self._columns is None or self._columns[0] != self.draft_vocab.data_ptr():
            cols = dict((t, i) for i, t in enumerate(self.draft_vocab.tolist()))
            self._columns = (self.draft_vocab.data_ptr(), cols)
        return self._columns[1].get(int(token))

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

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats [C, n_taps*H] target features at positions [C] -> per-layer (k, v) [nkv, C, hd]."""
        x = self.model.hidden_norm(self.model.fc(feats))
        cos, sin = self._rope(positions, x.dtype)
        return [layer.self_attn.kv(x, cos, sin) for layer in self.model.layers]

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
        for i, (k, v) in enumerate(self.context_kv(feats, positions)):
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

    def draft(self, cache: DraftCache, block_emb: torch.Tensor, start: int) -> torch.Tensor:
        """One inference pass: block [B, H] at positions start.. -> h [B, H] (pre-norm); appends
        the cache's pending context first."""
        pos = torch.arange(start, start + block_emb.shape[0], device=block_emb.device)
        if self._compiled_block is None or cache.pending is None or cache.k[0] is None:
            self._flush(cache)
            block = self._compiled_block or self.forward_block
            return block(block_emb, pos, list(zip(cache.k, cache.v)))
        kv, h = self._compiled_extend_block(*cache.take_pending(), block_emb, pos, list(zip(cache.k, cache.v)))
        for i, (k, v) in enumerate(kv):
            cache.k[i], cache.v[i] = k, v
        return h

    def extend_block(self, feats: torch.Tensor, fpos: torch.Tensor, block_emb: torch.Tensor, positions: torch.Tensor,
                     kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """Context features feats [n, taps*H] at fpos [n] appended to kv (per layer [nkv, C, hd]),
        then the block pass: -> (the extended kv per layer [nkv, C+n, hd], h [Q, H])."""
        new = self.context_kv(feats, fpos)
        kv = [(torch.cat([k, nk], 1), torch.cat([v, nv], 1)) for (k, v), (nk, nv) in zip(kv, new)]
        return kv, self.forward_block(block_emb, positions, kv)

    def compile_drafting(self, on: bool = True) -> None:
        """torch.compile the inference block pass (`draft`), with the context length dynamic so
        it compiles once (the compiled target backend turns this on). Weights are frozen into
        the compiled graph: recompile (off, then on) after changing them."""
        if not on:
            self._compiled_block = self._compiled_extend_block = None
        elif self._compiled_block is None:
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True
            self._compiled_block = torch.compile(self.forward_block, dynamic=True)
            # the decode loop's step: last step's accepted context + this block, one call
            self._compiled_extend_block = torch.compile(self.extend_block, dynamic=True)
            self._warm_compiled()

    @torch.no_grad()
    def _warm_compiled(self, context: int = 4) -> None:
        """Compile every graph the decode loop uses now, not inside a timed generation: the block
        pass alone, and with 1 and with >= 2 appended positions (sizes 0/1 specialise)."""
        p = next(self.parameters())
        c = self.config
        kv = [tuple(torch.zeros(c.num_key_value_heads, context, c.head_dim, dtype=p.dtype, device=p.device)
                    for _ in range(2)) for _ in self.model.layers]  # distinct k, v: guards check aliasing
        block = torch.zeros(c.block_size, c.hidden_size, dtype=p.dtype, device=p.device)
        pos = torch.arange(context, context + c.block_size, device=p.device)
        self._compiled_block(block, pos, kv)
        for n in (1, 2):
            feats = torch.zeros(n, self.model.fc.in_features, dtype=p.dtype, device=p.device)
            self._compiled_extend_block(feats, torch.arange(n, device=p.device), block, pos, kv)

    PREV_TABLE_MAX_BYTES = 128 << 20

    def prev_table(self, embed: nn.Module) -> torch.Tensor | None:
        """ar_approximation.prev_part of every draft-vocabulary token [Vd, 2A] (cached), or None
        without a draft vocabulary or when the table would exceed PREV_TABLE_MAX_BYTES."""
        ar = self.ar_approximation
        if ar is None or self.draft_vocab is None:
            return None
        w = ar.ug.weight
        if len(self.draft_vocab) * w.shape[0] * w.element_size() > self.PREV_TABLE_MAX_BYTES:
            return None
        key = (w.data_ptr(), w._version, embed.weight.data_ptr(), self.draft_vocab.data_ptr())
        if self._prev_table is None or self._prev_table[0] != key:
            with torch.no_grad():
                table = ar.prev_part(embed(self.draft_vocab.to(w.device)))
            self._prev_table = (key, table)
        return self._prev_table[1]

    def corrected_rows(self, h: torch.Tensor, row_pos: torch.Tensor, prev_part: torch.Tensor) -> torch.Tensor:
        """TreeFlash-corrected, final-normed states for rows that share positions.

        h [P, H] pre-norm states of P positions; row_pos [R] the position of each row; prev_part
        [R, 2A] each row's previous-token half (`ARApproximation.prev_part` or `prev_table` rows)
        -> [R, H]. Equals `corrected(h[row_pos], embed(prev))` up to rounding, for a fraction of
        the matmuls when R >> P."""
        ar = self.ar_approximation
        ug = ar.state_part(h, self.model.norm)[row_pos] + prev_part  # [R, 2A]
        return self.model.norm(ar.combine(h[row_pos], ug))

    def corrected(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """Final-normed states after the TreeFlash correction; without one, the marginal states."""
        if self.ar_approximation is not None:
            h = self.ar_approximation(h, prev_emb, self.model.norm)
        return self.model.norm(h)

    # ---- I/O ----
    def state_dict_for(self, fmt: str | None = None) -> dict[str, torch.Tensor]:
        """Tensors under the published names of `fmt` (dflash: top level, without the AR part)."""
        fmt = _check_format(fmt or self.config.default_format)
        sd = self.state_dict()
        if fmt == "dflash":
            return {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}
        if self.ar_approximation is None:
            raise TreeflashError("this drafter has no TreeFlash AR-approximation; export it with --format dflash")
        return dict(sd)

    def save(self, out_dir: str | Path, dtype: torch.dtype | None = torch.bfloat16,
             fmt: str | None = None) -> Path:
        """Write config.json + model.safetensors in the published layout `fmt` (default: treeflash
        when there is an AR-approximation, else dflash). Returns the directory.

        The draft vocabulary (`draft_vocab.safetensors`, this engine's own) is written beside the
        treeflash layout only: engines that read the dflash layout load every *.safetensors in the
        folder and reject unknown tensors (vLLM). Files are written world-readable (0644), so a
        server running as another user can read them."""
        from safetensors.torch import save_file

        fmt = _check_format(fmt or self.config.default_format)
        sd = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu()
              for k, v in self.state_dict_for(fmt).items()}
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (WEIGHTS_NAME + ".tmp")
        save_file(sd, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / WEIGHTS_NAME)
        (out / INDEX_NAME).unlink(missing_ok=True)  # a stale index would shadow the new file
        cfg = self.config.to_dict(fmt)
        cfg["dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        written = [out / WEIGHTS_NAME, out / CONFIG_NAME]
        if self.draft_vocab is not None and fmt == "treeflash":
            save_file({"token_ids": self.draft_vocab.long().cpu().contiguous()}, str(out / DRAFT_VOCAB_NAME))
            written.append(out / DRAFT_VOCAB_NAME)
        else:
            (out / DRAFT_VOCAB_NAME).unlink(missing_ok=True)
        for f in written:
            f.chmod(0o644)
        return out


def _normalise_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published names -> ours: DFlash keeps the body at the top level, TreeFlash (and we) under
    `model.`; `ar_approximation.*` stays. Rotary caches that some exporters save are dropped."""
    out = {}
    for k, v in sd.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        out[k if k.startswith(("model.", "ar_approximation.")) else "model." + k] = v
    return out


def _read_json(f: Path, what: str):
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise TreeflashError(f"{what} {f}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TreeflashError(f"{what} {f}: cannot read ({e})") from None


def weight_files(p: Path) -> list[Path]:
    """The safetensors files of a drafter directory: the shards named by the index, or the single file."""
    index = p / INDEX_NAME
    if index.exists():
        data = _read_json(index, "drafter index")
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise TreeflashError(f"drafter index {index}: no weight_map")
        files = [p / f for f in sorted(set(wm.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise TreeflashError(f"drafter {p}: shards named in {INDEX_NAME} are missing: {', '.join(missing)}")
        return files
    if (p / WEIGHTS_NAME).exists():
        return [p / WEIGHTS_NAME]
    raise TreeflashError(f"drafter {p}: missing {WEIGHTS_NAME} (or {INDEX_NAME} for a sharded checkpoint)")


def read_weights(p: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(p):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise TreeflashError(f"drafter {f}: corrupt safetensors file ({str(e).splitlines()[0]})") from None
        dup = sorted(set(part) & set(sd))
        if dup:
            raise TreeflashError(f"drafter {p}: tensors stored twice across shards: {_names(dup)}")
        sd.update(part)
    return sd


def _names(names: list[str], limit: int = 6) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_tensors(p: Path, model: Drafter, sd: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing:
        raise TreeflashError(f"drafter {p}: missing tensors {_names(missing)}"
                             + (f"; unexpected tensors {_names(unexpected)}" if unexpected else ""))
    if unexpected:
        hint = (" (an AR-approximation without treeflash_config.ar_approximation in config.json)"
                if any(k.startswith("ar_approximation.") for k in unexpected) else "")
        raise TreeflashError(f"drafter {p}: unexpected tensors {_names(unexpected)}{hint}")
    for k, v in expected.items():
        if sd[k].shape != v.shape:
            raise TreeflashError(f"drafter {p}: tensor {k} has shape {tuple(sd[k].shape)}, "
                                 f"config.json implies {tuple(v.shape)}")


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32) -> Drafter:
    """Load a drafter directory: config.json + model.safetensors (or shards with an index), in the
    published DFlash or TreeFlash layout, or ours."""
    p = Path(path)
    if not p.is_dir():
        raise TreeflashError(f"drafter {p}: not a directory")
    cfg_file = p / CONFIG_NAME
    if not cfg_file.exists():
        raise TreeflashError(f"drafter {p}: missing {CONFIG_NAME}")
    cfg = DrafterConfig.from_dict(_read_json(cfg_file, "drafter config"))
    sd = _normalise_keys(read_weights(p))
    with torch.device("meta"):  # no random init: every tensor comes from the file
        model = Drafter(cfg)
    _check_tensors(p, model, sd)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    model.draft_vocab = read_draft_vocab(p, cfg.vocab_size)
    return model.eval()


def read_draft_vocab(path: Path, vocab: int) -> torch.Tensor | None:
    """The drafter directory's draft vocabulary [Vd] (sorted unique ids), or None if it has none."""
    f = path / DRAFT_VOCAB_NAME
    if not f.exists():
        return None
    from safetensors.torch import load_file

    try:
        ids = load_file(str(f)).get("token_ids")
    except Exception as e:  # safetensors raises several types for a damaged file
        raise TreeflashError(f"drafter {path}: unreadable {DRAFT_VOCAB_NAME} ({str(e).splitlines()[0]})") from None
    if ids is None or ids.dim() != 1 or not len(ids) or ids.dtype != torch.int64:
        raise TreeflashError(f"drafter {path}: {DRAFT_VOCAB_NAME} must hold 'token_ids', a non-empty int64 vector")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise TreeflashError(f"drafter {path}: {DRAFT_VOCAB_NAME} has ids outside the vocabulary (0..{vocab - 1})")
    return ids.unique()


def check_fits(cfg: DrafterConfig, tcfg, vocab_rows: int) -> None:
    """Raise a clear error when a drafter cannot serve a target (HF config `tcfg`)."""
    tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    n_layers = tcfg.num_hidden_layers
    if cfg.hidden_size != tcfg.hidden_size:
        raise TreeflashError(f"drafter hidden size {cfg.hidden_size} does not match the target's {tcfg.hidden_size}")
    if cfg.vocab_size != vocab_rows:
        raise TreeflashError(f"drafter vocabulary {cfg.vocab_size} does not match the target's {vocab_rows}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != n_layers:
        raise TreeflashError(f"drafter was built for {cfg.num_target_layers} target layers; "
                             f"the target has {n_layers}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise TreeflashError(f"drafter target_layer_ids {bad} out of range for a {n_layers}-layer target")
    if not 0 <= cfg.mask_token_id < vocab_rows:
        raise TreeflashError(f"drafter mask_token_id {cfg.mask_token_id} outside the target vocabulary "
                             f"(0..{vocab_rows - 1})")
    if cfg.block_size < 2:
        raise TreeflashError(f"drafter block_size {cfg.block_size} must be at least 2")
