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


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Evenly spread taps from layer 1 to layer L-3 (the DFlash rule); one tap -> the middle layer."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
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
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    ar_approximation: str | None = "swiglu"  # None: plain DFlash drafter
    ar_intermediate_size: int | None = None  # defaults to intermediate_size
    candidate_tokens: int = 8  # TreeFlash stage-1 top-m used in training/eval by default
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

    # ---- HF-style config.json in the published layout ----
    def to_dict(self) -> dict:
        d = {
            "architectures": ["TreeFlashDraftModel" if self.ar_approximation else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "hidden_act": "silu",
            "tie_word_embeddings": False,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
        }
        if self.ar_approximation:
            d["treeflash_config"] = {"ar_approximation": self.ar_approximation,
                                     "candidate_tokens": self.candidate_tokens,
                                     "intermediate_size": self.ar_size}
        return {**self.extra, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        try:
            dfl = d.get("dflash_config") or {}
            tf = d.get("treeflash_config") or {}
            rope = d.get("rope_parameters") or {}
            L = int(d["num_target_layers"])
            n = int(d["num_hidden_layers"])
            known = set(cls.__dataclass_fields__) | {"dflash_config", "treeflash_config",
                                                      "rope_parameters"}
            return cls(
                hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=n, num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
                vocab_size=int(d["vocab_size"]), num_target_layers=L,
                target_layer_ids=[int(i) for i in dfl.get("target_layer_ids")
                                  or default_target_layer_ids(L, n)],
                mask_token_id=int(dfl["mask_token_id"]),
                block_size=int(d.get("block_size", 16)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                attention_bias=bool(d.get("attention_bias", False)),
                ar_approximation=tf.get("ar_approximation") if tf else None,
                ar_intermediate_size=tf.get("intermediate_size"),
                candidate_tokens=int(tf.get("candidate_tokens", 8)),
                extra={k: v for k, v in d.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TreeflashError(f"bad drafter config: missing or invalid field {e}") from None


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
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ug = nn.Linear(2 * c.hidden_size, 2 * c.ar_size, bias=True)
        self.d = nn.Linear(c.ar_size, c.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor, final_norm: RMSNorm) -> torch.Tensor:
        """h [..., H] pre-norm drafter states; prev_emb [..., H] -> corrected pre-norm states [..., H]."""
        u, g = self.ug(torch.cat([self.norm(prev_emb), final_norm(h)], -1)).chunk(2, -1)
        return h + self.d(F.silu(g) * u)


class DraftCache:
    """Per-layer context keys/values of the drafter: grows by the accepted positions each step."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers  # each [nkv, C, hd]
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], 1)
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], 1)


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.model = DFlashBody(config)
        self.ar_approximation = ARApproximation(config) if config.ar_approximation else None

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

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats [C, n_taps*H] target features at positions [C] -> per-layer (k, v) [nkv, C, hd]."""
        x = self.model.hidden_norm(self.model.fc(feats))
        cos, sin = self._rope(positions, x.dtype)
        return [layer.self_attn.kv(x, cos, sin) for layer in self.model.layers]

    def extend(self, cache: DraftCache, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Append context features (accepted positions) to the drafter's cache."""
        for i, (k, v) in enumerate(self.context_kv(feats, positions)):
            cache.append(i, k, v)
        cache.length += feats.shape[0]

    def forward_block(self, block_emb: torch.Tensor, positions: torch.Tensor,
                      kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_emb [Q, H] at positions [Q]; kv per layer [nkv, C, hd]; mask [Q, C+Q] -> h [Q, H] (pre-norm)."""
        cos, sin = self._rope(positions, block_emb.dtype)
        h = block_emb
        for layer, (k, v) in zip(self.model.layers, kv):
            h = layer(h, cos, sin, k, v, mask)
        return h

    def draft(self, cache: DraftCache, block_emb: torch.Tensor, start: int) -> torch.Tensor:
        """One inference pass: block [B, H] at positions start.. -> h [B, H] (pre-norm)."""
        pos = torch.arange(start, start + block_emb.shape[0], device=block_emb.device)
        return self.forward_block(block_emb, pos, list(zip(cache.k, cache.v)))

    def corrected(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """Final-normed states after the TreeFlash correction; without one, the marginal states."""
        if self.ar_approximation is not None:
            h = self.ar_approximation(h, prev_emb, self.model.norm)
        return self.model.norm(h)

    # ---- I/O ----
    def save(self, out_dir: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in self.state_dict().items()}
        if self.ar_approximation is None:  # DFlash layout keeps the body at the top level
            sd = {k.removeprefix("model."): v for k, v in sd.items()}
        tmp = out / (WEIGHTS_NAME + ".tmp")
        save_file(sd, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / WEIGHTS_NAME)
        (out / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")


def _normalise_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DFlash checkpoints keep the body at the top level; ours nest it under `model.`."""
    return {k if k.startswith(("model.", "ar_approximation.")) else "model." + k: v for k, v in sd.items()}


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32) -> Drafter:
    """Load a drafter directory (config.json + model.safetensors, DFlash or TreeFlash layout)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    cfg_file = p / CONFIG_NAME
    if not cfg_file.exists():
        raise TreeflashError(f"drafter {p}: missing {CONFIG_NAME}")
    try:
        cfg = DrafterConfig.from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise TreeflashError(f"drafter {cfg_file}: not valid JSON ({e.msg} at line {e.lineno})") from None
    files = sorted(p.glob("model*.safetensors"))
    if not files:
        raise TreeflashError(f"drafter {p}: missing {WEIGHTS_NAME}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise TreeflashError(f"drafter {f}: corrupt safetensors file ({str(e).splitlines()[0]})") from None
    model = Drafter(cfg)
    sd = _normalise_keys(sd)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise TreeflashError(f"drafter {p}: missing tensors {missing[:5]} unexpected tensors {unexpected[:5]}")
    for k, v in model.state_dict().items():
        if sd[k].shape != v.shape:
            raise TreeflashError(f"drafter {p}: tensor {k} has shape {tuple(sd[k].shape)}, "
                                 f"config implies {tuple(v.shape)}")
    model.load_state_dict(sd)
    return model.to(dtype).eval()


def check_fits(cfg: DrafterConfig, tcfg, vocab_rows: int) -> None:
    """Raise a clear error when a drafter cannot serve a target."""
    if cfg.hidden_size != tcfg.hidden_size:
        raise TreeflashError(f"drafter hidden size {cfg.hidden_size} does not match the target's {tcfg.hidden_size}")
    if cfg.vocab_size != vocab_rows:
        raise TreeflashError(f"drafter vocabulary {cfg.vocab_size} does not match the target's {vocab_rows}")
    if cfg.num_target_layers != tcfg.num_hidden_layers:
        raise TreeflashError(f"drafter was built for {cfg.num_target_layers} target layers; "
                             f"the target has {tcfg.num_hidden_layers}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < tcfg.num_hidden_layers]
    if bad:
        raise TreeflashError(f"drafter target_layer_ids {bad} out of range for a "
                             f"{tcfg.num_hidden_layers}-layer target")
    if not 0 <= cfg.mask_token_id < vocab_rows:
        raise TreeflashError(f"drafter mask_token_id {cfg.mask_token_id} outside the target vocabulary")
    if cfg.block_size < 2:
        raise TreeflashError(f"drafter block_size {cfg.block_size} must be at least 2")
