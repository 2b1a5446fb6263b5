"""Drafter configuration: `DrafterConfig`, its config.json in the published layouts, and the
checks that a config describes math this drafter implements and fits a target.

Config fields follow the published DFlash/TreeFlash drafters. Two on-disk layouts (see
docs/checkpoints.md; the files are read and written by models/drafter_io.py):
- "dflash": z-lab DFlash (`DFlashDraftModel`): no AR-approximation; what the SGLang / vLLM DFlash
  loaders read.
- "treeflash": TreeFlash (`TreeFlashDraftModel`): plus `treeflash_config` (the AR-approximation).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import TreeflashError

FORMATS = ("dflash", "treeflash")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "treeflash": "TreeFlashDraftModel"}
# trust_remote_code entry points of the published repos (the .py files are not shipped by us)
AUTO_MAPS = {"dflash": {"AutoModel": "dflash.DFlashDraftModel"},
             "treeflash": {"AutoModel": "tree_flash.TreeFlashDraftModel"}}
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
        fmt = check_format(fmt or self.default_format)
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


class DrafterWeights(Protocol):
    """What a checkpoint reads and writes of a drafter (`drafter.Drafter` is one): a type of its own,
    so that models/drafter_io.py and models/drafter.py need not import each other."""

    config: DrafterConfig
    ar_approximation: Any  # the TreeFlash AR-approximation module, or None
    draft_vocab: Any  # [Vd] int64 token ids, or None

    def state_dict(self) -> dict: ...


def check_format(fmt: str) -> str:
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
