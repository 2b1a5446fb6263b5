"""Target features cached once to disk (fp16 safetensors), so every epoch costs only the drafter.

For each regenerated shard `shard-NNNNN.jsonl` (`{"id", "input_ids", "prompt_len"}` per line) one
`feat-NNNNN.safetensors` holds, for all its sequences concatenated:
  ids [N] int32, offsets [S+1] int64, prompt_len [S] int32,
  feats [N, taps*H] fp16 (outputs of the tapped target layers),
  top_idx [N, K] int32 / top_logp [N, K] fp16 (the target's next-token top-K log-probs, for KL).
The file's metadata records the target and the tapped layers; a mismatch is a clear error.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import TreeflashError
from ..fsutil import ensure_writable_dir
from ..models.target import Target
from .data import read_text, shard_files



def list_shards(data_dir: str | Path) -> list[Path]:
    d = Path(data_dir)
    if not d.is_dir():
        raise TreeflashError(f"data directory {d} does not exist")
    shards = shard_files(d)
    if not shards:
        raise TreeflashError(f"no shard-*.jsonl[.gz] shards in {d}")
    return shards


def read_shard(path: Path, vocab: int) -> list[tuple[list[int], int]]:
    """(input_ids, prompt_len) per line; a malformed line is a clear error."""
    out = []
    try:
        lines = read_text(path).splitlines()
    except (OSError, EOFError) as e:
        raise TreeflashError(f"cannot read shard {path}: {getattr(e, 'strerror', None) or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ids, plen = [int(t) for t in rec["input_ids"]], int(rec["prompt_len"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise TreeflashError(f"{path}:{n}: not a {{input_ids, prompt_len}} record") from None
        if not 0 < plen < len(ids):
            continue  # no response tokens: nothing to learn from
        if max(ids) >= vocab or min(ids) < 0:
            raise TreeflashError(f"{path}:{n}: token id outside the target vocabulary ({vocab})")
        out.append((ids, plen))
    return out


def feature_name(shard: Path) -> str:
    return "feat-" + shard.name.split("-", 1)[-1].split(".")[0] + ".safetensors"  # shard-N.jsonl[.gz]


@torch.no_grad()
def sequence_features(target: Target, ids: list[int], top_k: int) -> dict[str, torch.Tensor]:
    """One target forward over a whole sequence -> feats [T, taps*H] fp16, top-K next-token log-probs."""
    x = torch.tensor(ids, device=target.device)
    pos = torch.arange(len(ids), device=target.device)
    logits, feats = target.forward(x, pos, target.new_cache())
    vals, idx = logits[:].log_softmax(-1).topk(top_k, -1)  # [T, V] -> [T, K]; feats [T, taps*H]
    return {"feats": feats.to(torch.float16).cpu(), "top_idx": idx.to(torch.int32).cpu(),
            "top_logp": vals.to(torch.float16).cpu()}


@dataclass
class CacheSpec:
    target_name: str
    layer_ids: list[int]
    hidden_size: int
    vocab: int
    top_k: int
    max_len: int

    def metadata(self, source: str) -> dict[str, str]:
        return {"target": self.target_name, "layer_ids": json.dumps(self.layer_ids),
                "hidden_size": str(self.hidden_size), "vocab": str(self.vocab),
                "top_k": str(self.top_k), "max_len": str(self.max_len), "source": source}


def cache_shard(target: Target, shard: Path, out: Path, spec: CacheSpec, bar: tqdm | None = None) -> int:
    """Write the feature file of one shard atomically; returns its token count."""
    seqs = read_shard(shard, target.vocab_rows)
    seqs = [(ids[:spec.max_len], plen) for ids, plen in seqs if plen < min(len(ids), spec.max_len) - 1]
    rows = []
    for ids, plen in seqs:
        rows.append((ids, plen, sequence_features(target, ids, spec.top_k)))
        if bar is not None:
            bar.update(len(ids))
    return save_features(out, rows, spec, shard.name)


def save_features(out: Path, rows: list[tuple[list[int], int, dict]], spec: CacheSpec, source: str) -> int:
    """Write one feature file atomically from (token ids, prompt length, `sequence_features`
    output) per sequence; `source`: the token shard's name (metadata). Returns its token count
    (0: nothing written, no sequences)."""
    from safetensors.torch import save_file

    if not rows:
        return 0
    tensors = {k: torch.cat([f[k] for _, _, f in rows]) for k in ("feats", "top_idx", "top_logp")}
    offsets = [0]
    for ids, _, _ in rows:
        offsets.append(offsets[-1] + len(ids))
    tensors.update(ids=torch.tensor([t for ids, _, _ in rows for t in ids], dtype=torch.int32),
                   offsets=torch.tensor(offsets),
                   prompt_len=torch.tensor([plen for _, plen, _ in rows], dtype=torch.int32))
    tmp = out.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=spec.metadata(source))
    os.replace(tmp, out)
    return offsets[-1]


def build_cache(target: Target, data_dir: str | Path, out_dir: str | Path, layer_ids: list[int],
                top_k: int = 8, max_len: int = 1024, limit_shards: int | None = None) -> list[Path]:
    """Cache features of every shard not cached yet (resumable); returns all feature files."""
    shards = list_shards(data_dir)[:limit_shards]
    out = ensure_writable_dir(out_dir)
    bad = [i for i in layer_ids if not 0 <= i < target.config.num_hidden_layers]
    if bad:
        raise TreeflashError(f"tap layers {bad} out of range for a {target.config.num_hidden_layers}-layer target")
    spec = CacheSpec(target.name, list(layer_ids), target.config.hidden_size, target.vocab_rows, top_k, max_len)
    target.set_taps(layer_ids)
    todo = [s for s in shards if not (out / feature_name(s)).exists()]
    for s in shards:
        if s not in todo:
            check_feature_file(out / feature_name(s), layer_ids, target.config.hidden_size)
    t0, n = time.perf_counter(), 0
    with tqdm(desc="target features", unit="tok", disable=not todo) as bar:
        for s in todo:
            n += cache_shard(target, s, out / feature_name(s), spec, bar)
    if todo:
        dt = time.perf_counter() - t0
        print(f"cached {n} tokens from {len(todo)} shards in {dt:.0f} s ({n / max(dt, 1e-9):.0f} tok/s)")
    return [out / feature_name(s) for s in shards if (out / feature_name(s)).exists()]


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        raise TreeflashError(f"missing feature shard {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise TreeflashError(f"feature shard {path} is corrupt ({str(e).splitlines()[0]})") from None


def check_feature_file(path: Path, layer_ids: list[int], hidden_size: int) -> dict[str, str]:
    meta = read_metadata(path)
    if json.loads(meta.get("layer_ids", "null")) != list(layer_ids) or int(meta.get("hidden_size", -1)) != hidden_size:
        raise TreeflashError(f"feature shard {path} was cached for layers {meta.get('layer_ids')} / hidden "
                             f"{meta.get('hidden_size')}; the drafter needs layers {list(layer_ids)} / hidden {hidden_size}")
    return meta


class FeatureStore:
    """All cached sequences, indexed globally; tensors are read lazily (memory-mapped) per shard."""

    def __init__(self, files: list[Path], layer_ids: list[int], hidden_size: int, target_labels: bool = False):
        from safetensors import safe_open

        self.target_labels = target_labels
        if not files:
            raise TreeflashError("no feature shards to train on")
        self.files = [Path(f) for f in files]
        self.handles, self.index = [], []  # index: (file no, seq no)
        self.meta = []
        for fi, f in enumerate(self.files):
            self.meta.append(check_feature_file(f, layer_ids, hidden_size))
            h = safe_open(str(f), framework="pt")
            self.handles.append(h)
            n = h.get_slice("prompt_len").get_shape()[0]
            self.index.extend((fi, si) for si in range(n))
        self._small = {}  # per file: ids, offsets, prompt_len (kept in memory)

    def __len__(self) -> int:
        return len(self.index)

    def _small_of(self, fi: int):
        if fi not in self._small:
            h = self.handles[fi]
            self._small[fi] = (h.get_tensor("ids").long(), h.get_tensor("offsets"), h.get_tensor("prompt_len"))
        return self._small[fi]

    def get(self, i: int) -> dict[str, torch.Tensor]:
        fi, si = self.index[i]
        ids, offs, plens = self._small_of(fi)
        a, b = int(offs[si]), int(offs[si + 1])
        h = self.handles[fi]
        seq_ids, plen = ids[a:b], int(plens[si])
        top_idx = h.get_slice("top_idx")[a:b]  # [T, K]
        out_extra = {}
        if self.target_labels:  # labels := the target's greedy choice given the (data) prefix
            pred = seq_ids.clone()
            pred[1:] = top_idx[:-1, 0].long()
            out_extra = {"pred": pred}
        return {"ids": seq_ids, "prompt_len": plen, "feats": h.get_slice("feats")[a:b],
                "top_idx": top_idx, "top_logp": h.get_slice("top_logp")[a:b], **out_extra}

    def token_counts(self, vocab: int) -> torch.Tensor:
        """[vocab] counts of response tokens over all shards (for the draft vocabulary)."""
        counts = torch.zeros(vocab, dtype=torch.long)
        for fi in range(len(self.files)):
            ids, offs, plens = self._small_of(fi)
            for si in range(plens.numel()):
                a, b = int(offs[si]) + int(plens[si]), int(offs[si + 1])
                counts += torch.bincount(ids[a:b], minlength=vocab)
        return counts

    def num_tokens(self) -> int:
        return sum(int(self._small_of(fi)[1][-1]) for fi in range(len(self.files)))


def human_pair_shards(target: Target, out_dir: str | Path, n: int, train_prompts: str | Path,
                      max_len: int = 768, shard_size: int = 256) -> int:
    """ShareGPT (first user turn, first assistant turn) pairs as shards in the regen format.

    Only records whose id is in `train_prompts` (the training split) are used, so held-out and
    evaluation prompts stay out. Train with `--target-labels`: the response tokens are replaced by
    the target's own greedy choice given the prefix, from the cached top-1 (no generation needed).
    """
    from .data import iter_json_array, sharegpt_path

    keep = set()
    for line in Path(train_prompts).read_text().split("\n"):
        if line.strip():
            keep.add(json.loads(line)["id"].removeprefix("sharegpt/"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = sharegpt_path().read_text(encoding="utf-8", errors="replace")
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = eos if isinstance(eos, int) and eos >= 0 else target.tokenizer.eos_token_id
    rows, shard, count = [], 0, 0
    for rec in iter_json_array(text):
        if count >= n:
            break
        turns = rec.get("conversations") or []
        if str(rec.get("id")) not in keep or len(turns) < 2:
            continue
        user, bot = turns[0], turns[1]
        if user.get("from") not in ("human", "user") or bot.get("from") != "gpt" or not str(bot.get("value", "")).strip():
            continue
        prompt = target.apply_chat([{"role": "user", "content": user["value"]}])
        resp = target.tokenizer(bot["value"].strip(), add_special_tokens=False)["input_ids"] + [eos]
        if len(prompt) > max_len // 2:
            continue
        ids = (prompt + resp)[:max_len]
        rows.append(json.dumps({"id": f"pair/{rec['id']}", "input_ids": ids, "prompt_len": len(prompt)}))
        count += 1
        if len(rows) == shard_size:
            (out / f"shard-{shard:05d}.jsonl").write_text("\n".join(rows) + "\n")
            rows, shard = [], shard + 1
    if rows:
        (out / f"shard-{shard:05d}.jsonl").write_text("\n".join(rows) + "\n")
    return count
