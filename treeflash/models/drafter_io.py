"""Drafter checkpoints: config.json + safetensors in the published DFlash / TreeFlash layouts.

Tensor names follow the published drafters: `layers.N.*`, `fc`, `hidden_norm`, `norm` (under
`model.` in TreeFlash checkpoints) and `ar_approximation.*` (see models/drafter_config.py for the
two layouts, docs/checkpoints.md for what each engine reads). `treeflash export` (models/export.py)
writes through `save_drafter`; `drafter.load_drafter` reads through `read_config`, `read_state_dict`,
`check_tensors` and `read_draft_vocab`. This module never builds a `Drafter`: it takes one to save or
to check against, typed as `drafter_config.DrafterWeights`, so it does not import models/drafter.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import TreeflashError
from .drafter_config import DrafterConfig, DrafterWeights, check_format

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"  # optional: {"token_ids": [Vd] int64}, the drafter's LM-head rows
INDEX_NAME = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {tensor: file}}


def state_dict_for(drafter: DrafterWeights, fmt: str | None = None) -> dict[str, torch.Tensor]:
    """Tensors under the published names of `fmt` (dflash: top level, without the AR part)."""
    fmt = check_format(fmt or drafter.config.default_format)
    sd = drafter.state_dict()
    if fmt == "dflash":
        return {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}
    if drafter.ar_approximation is None:
        raise TreeflashError("this drafter has no TreeFlash AR-approximation; export it with --format dflash")
    return dict(sd)


def save_drafter(drafter: DrafterWeights, out_dir: str | Path, dtype: torch.dtype | None = torch.bfloat16,
                 fmt: str | None = None) -> Path:
    """Write config.json + model.safetensors in the published layout `fmt` (default: treeflash
    when there is an AR-approximation, else dflash). Returns the directory.

    The draft vocabulary (`draft_vocab.safetensors`, this engine's own) is written beside the
    treeflash layout only: engines that read the dflash layout load every *.safetensors in the
    folder and reject unknown tensors (vLLM). Files are written world-readable (0644), so a
    server running as another user can read them."""
    from safetensors.torch import save_file

    fmt = check_format(fmt or drafter.config.default_format)
    sd = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu()
          for k, v in state_dict_for(drafter, fmt).items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / INDEX_NAME).unlink(missing_ok=True)  # a stale index would shadow the new file
    cfg = drafter.config.to_dict(fmt)
    cfg["dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    written = [out / WEIGHTS_NAME, out / CONFIG_NAME]
    if drafter.draft_vocab is not None and fmt == "treeflash":
        save_file({"token_ids": drafter.draft_vocab.long().cpu().contiguous()}, str(out / DRAFT_VOCAB_NAME))
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


def check_tensors(p: Path, model: DrafterWeights, sd: dict[str, torch.Tensor]) -> None:
    """`sd` holds exactly `model`'s tensors, each of its shape (else a TreeflashError naming them)."""
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


def read_config(p: Path) -> DrafterConfig:
    """The config.json of a drafter directory."""
    if not p.is_dir():
        raise TreeflashError(f"drafter {p}: not a directory")
    cfg_file = p / CONFIG_NAME
    if not cfg_file.exists():
        raise TreeflashError(f"drafter {p}: missing {CONFIG_NAME}")
    return DrafterConfig.from_dict(_read_json(cfg_file, "drafter config"))


def read_state_dict(p: Path) -> dict[str, torch.Tensor]:
    """A drafter directory's tensors under our names (either published layout)."""
    return _normalise_keys(read_weights(p))


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
