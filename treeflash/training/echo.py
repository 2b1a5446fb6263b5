"""Echo stubs: function stubs whose docstring is new prose, answered by checking a copy.

Asked to "reply with the complete function", the target first copies the stub: signature,
docstring, then writes a body. The drafter copies package docstrings well and HumanEval's badly: its
top-1 at block position 1 is 0.82 on the copied part of unseen package-stub answers but 0.57 on
that of HumanEval answers (docs/training.md, session 22). Echo stubs give it copies of text that is
in no package's documentation. Each takes a stub and replaces its
docstring with a paragraph of ShareGPT user text (`paragraphs`, `echo_stub`). The target's answer
is not generated token by token. The copy is a guess, checked in one forward pass: the longest
prefix of `` ```python\\n<stub>`` on which every token is the target's greedy choice
(`greedy_prefix`). That prefix is exactly how the target's greedy answer begins, so the shards hold
target-generated data, like `data regen`'s, at the cost of one forward per sequence. The same
forward gives the training features (`echo_shards(..., features=DIR)`).
"""
from __future__ import annotations

import json
import random
import re
import textwrap
from pathlib import Path

import torch

from ..errors import TreeflashError
from ..fsutil import ensure_writable_dir
from .data import write_gzip_atomic

DOCSTRING = re.compile(r'(?P<q>"""|\'\'\')(?P<body>.*?)(?P=q)', re.S)
CODE_BLOCK = re.compile(r"```python\n(?P<code>.*?)\n```", re.S)
MIN_TEXT, MAX_TEXT = 120, 500  # characters of a paragraph
MIN_COPY = 8  # fewest checked response tokens worth a sequence


def paragraphs(rows: list[dict], lo: int = MIN_TEXT, hi: int = MAX_TEXT) -> list[str]:
    """Prose paragraphs (whitespace collapsed) of the first user turns of prompt rows: ASCII, no
    code fences, quotes or backslashes, at least 85 % letters and spaces, `lo`..`hi` characters."""
    out = []
    for r in rows:
        for para in re.split(r"\n\s*\n", r["messages"][0]["content"]):
            text = " ".join(para.split())
            if not lo <= len(text) <= hi or not text.isascii() or any(s in text for s in ('"', "'''", "`", "\\")):
                continue
            if sum(c.isalpha() or c == " " for c in text) >= 0.85 * len(text):
                out.append(text)
    return out


def stub_of(row: dict) -> str | None:
    """The stub inside a `data stubs` prompt row (its ```python block)."""
    m = CODE_BLOCK.search(row["messages"][0]["content"])
    return m.group("code") if m else None


def echo_stub(stub: str, text: str, width: int = 0) -> str | None:
    """`stub` with its first docstring's body replaced by `text` (first letter capitalised), on one
    line, or with `width`, wrapped at `width` columns under the docstring's indentation; None if
    the stub has no docstring."""
    m = DOCSTRING.search(stub)
    if m is None:
        return None
    line_start = stub.rfind("\n", 0, m.start()) + 1
    indent = stub[line_start:m.start()]
    if indent.strip():
        return None  # the docstring does not open its line
    q, text = m.group("q"), text[:1].upper() + text[1:]
    body = "\n".join(textwrap.wrap(text, width, initial_indent=indent + q, subsequent_indent=indent)
                     )[len(indent + q):] if width else text
    return stub[:m.start()] + q + body + f"\n{indent}" + q + stub[m.end():]


def greedy_prefix(logits_argmax: torch.Tensor, ids: list[int], prompt_len: int) -> int:
    """Length of the longest prefix of `ids` whose response tokens (from `prompt_len` on) are each
    the argmax of the position before: logits_argmax [T] -> end index (prompt_len..len(ids))."""
    guess = torch.tensor(ids[prompt_len:])
    ok = (logits_argmax[prompt_len - 1:len(ids) - 1] == guess).long()
    bad = (ok == 0).nonzero()
    return prompt_len + (int(bad[0]) if bad.numel() else len(guess))


def checked_copy(target, prompt_ids: list[int], guess_ids: list[int], top_k: int = 8):
    """One forward over prompt + guess -> (prompt + the longest prefix of the guess that is the
    target's greedy answer, that sequence's features as `sequence_features` gives them: rows of a
    causal forward do not depend on later tokens, so the guess's are cut off). The dict also holds
    "guess": the guessed ids."""
    from .features import sequence_features

    ids = prompt_ids + guess_ids
    f = sequence_features(target, ids, top_k)
    end = greedy_prefix(f["top_idx"][:, 0].long(), ids, len(prompt_ids))
    return ids[:end], {**{k: v[:end] for k, v in f.items()}, "guess": guess_ids}


def echo_rows(stub_rows: list[dict], texts: list[str], n: int, seed: int = 0):
    """Up to `n` (id, prompt text, guessed response) for stubs with a docstring, each given a
    paragraph drawn without replacement (seeded)."""
    from ..bench.datasets import humaneval_instruction

    rng = random.Random(seed)
    pool = list(texts)
    rng.shuffle(pool)
    for row in stub_rows:
        if n <= 0 or not pool:
            return
        stub = stub_of(row)
        new = echo_stub(stub, pool[-1]) if stub else None
        if new is None:
            continue
        pool.pop()
        n -= 1
        yield f"echo/{row['id']}", humaneval_instruction(new), f"```python\n{new}\n```"


def echo_shards(target, stub_rows: list[dict], texts: list[str], out_dir: str | Path, n: int,
                shard_size: int = 64, seed: int = 0, features: str | Path | None = None,
                top_k: int = 8, bar=None) -> dict:
    """Write `shard-NNNNN.jsonl.gz` token shards (`data regen`'s format) of checked echo answers;
    with `features`, also each shard's feature file (`train features`' format) from the same
    forward. Resumable: shards already written are skipped, with their prompts."""
    from .features import CacheSpec, feature_name, save_features

    out = ensure_writable_dir(out_dir)
    fdir = ensure_writable_dir(features) if features else None
    spec = CacheSpec(target.name, list(target.tap_ids), target.config.hidden_size, target.vocab_rows, top_k, 1024)
    rows = list(echo_rows(stub_rows, texts, n, seed))
    if not rows:
        raise TreeflashError("no echo prompts: the stubs have no docstrings or there is no prose text")
    stats = {"sequences": 0, "response_tokens": 0, "dropped": 0, "guess_tokens": 0}
    for s, b in enumerate(range(0, len(rows), shard_size)):
        path = out / f"shard-{s:05d}.jsonl.gz"
        if path.exists() and (fdir is None or (fdir / feature_name(path)).exists()):
            continue
        kept = []  # (row id, token ids, prompt length, features) of the answers kept
        for rid, prompt, guess in rows[b:b + shard_size]:
            p = target.encode(prompt, chat=True)
            ids, f = checked_copy(target, p, target.tokenizer.encode(guess, add_special_tokens=False), top_k)
            stats["guess_tokens"] += len(f["guess"])
            if bar is not None:
                bar.update(len(p) + len(f["guess"]))
            if len(ids) - len(p) < MIN_COPY:
                stats["dropped"] += 1
                continue
            kept.append((rid, ids, len(p), f))
            stats["sequences"] += 1
            stats["response_tokens"] += len(ids) - len(p)
        if fdir is not None:
            save_features(fdir / feature_name(path), [k[1:] for k in kept], spec, path.name)
        write_gzip_atomic(path, "".join(json.dumps({"id": rid, "input_ids": ids, "prompt_len": plen}) + "\n"
                                        for rid, ids, plen, _ in kept).encode("utf-8"))
    return stats
