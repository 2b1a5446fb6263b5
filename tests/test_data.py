"""Training data: ShareGPT recovery, dedup/split, regeneration == greedy decoding, resume, errors."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from treeflash.api import Engine
from treeflash.cli import main
from treeflash.errors import TreeflashError
from treeflash.models import registry
from treeflash.models.target import Target
from treeflash.training import data

MAX_NEW = 7


# ---------------------------------------------------------------- step 1: prompts
def write_truncated_sharegpt(path, records, tail='  {\n    "id": "cut", "conversations": [{"from": "hum'):
    text = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + ",\n" + tail
    path.write_text(text)


def conv(rid, *turns):
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


SHAREGPT = [
    conv("a_0", ("human", "How do I sort a list in Python?"), ("gpt", "Use sorted().")),
    conv("b_0", ("gpt", "Hello!"), ("human", "What is 2+2?")),   # first *user* turn is kept
    conv("c_0", ("human", "   "), ("gpt", "...")),                  # empty: dropped
    conv("d_0", ("human", ["not", "text"])),                        # non-text: dropped
    conv("e_0", ("human", "how do I  sort a list in python?")),     # duplicate of a_0 after normalising
    {"id": "f_0"},                                                  # no conversations: dropped
    conv("g_0", ("human", "Write a haiku about rain."), ("gpt", "...")),
]


def test_truncated_sharegpt_records_are_recovered(tmp_path):
    src = tmp_path / "sg.json"
    write_truncated_sharegpt(src, SHAREGPT)
    with pytest.raises(json.JSONDecodeError):
        json.loads(src.read_text())  # really truncated
    prompts, n_records = data.sharegpt_prompts(src)
    assert n_records == len(SHAREGPT)
    assert [p["id"] for p in prompts] == ["sharegpt/a_0", "sharegpt/b_0", "sharegpt/e_0", "sharegpt/g_0"]
    assert prompts[1]["messages"] == [{"role": "user", "content": "What is 2+2?"}]


def test_build_prompts_dedups_and_splits_disjointly(tmp_path):
    src = tmp_path / "sg.json"
    extra = [conv(f"x{i}_0", ("human", f"Question number {i}?")) for i in range(20)]
    write_truncated_sharegpt(src, SHAREGPT + extra)
    stats = data.build_prompts(tmp_path / "out", heldout=5, seed=3, source=src)
    train = data.read_jsonl(tmp_path / "out" / "train.jsonl")
    held = data.read_jsonl(tmp_path / "out" / "heldout.jsonl")
    assert stats["duplicates_dropped"] == 1 and (stats["train"], stats["heldout"]) == (len(train), 5)
    ids_train, ids_held = {p["id"] for p in train}, {p["id"] for p in held}
    assert not ids_train & ids_held and len(ids_train) == len(train)
    texts = [data.normalise(p["messages"][0]["content"]) for p in train + held]
    assert len(set(texts)) == len(texts) == 3 + 20
    again, _ = data.split(data.dedupe(data.sharegpt_prompts(src)[0]), 5, seed=3)
    assert [p["id"] for p in again] == [p["id"] for p in train]  # the seed fixes the order
    other, _ = data.split(data.dedupe(data.sharegpt_prompts(src)[0]), 5, seed=4)
    assert [p["id"] for p in other] != [p["id"] for p in train]
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["train"] == len(train)


def test_later_turns_keep_alternation_and_stay_in_the_training_split(tmp_path):
    long = conv("h_0", ("gpt", "Hi, how can I help?"), ("human", "Q1"), ("gpt", "A1"), ("human", "Q2"),
                ("gpt", "A2"), ("human", "Q3"), ("human", "Q4 breaks alternation"), ("gpt", "A4"), ("human", "Q5"))
    assert data.later_turns(long) == [
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}],
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
         {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}]]
    assert data.later_turns(long, max_chars=7) == [[{"role": "user", "content": "Q1"},
                                                   {"role": "assistant", "content": "A1"},
                                                   {"role": "user", "content": "Q2"}]]
    assert data.later_turns(conv("z", ("human", "Q"), ("gpt", "  "), ("human", "Q2"))) == []  # empty answer
    src = tmp_path / "sg.json"
    extra = [conv(f"x{i}_0", ("human", f"Question {i}?"), ("gpt", "A"), ("human", f"More {i}?")) for i in range(20)]
    write_truncated_sharegpt(src, SHAREGPT + extra)
    stats = data.build_prompts(tmp_path / "out", heldout=5, seed=3, source=src)
    train = {p["id"] for p in data.read_jsonl(tmp_path / "out" / "train.jsonl")}
    held = {p["id"] for p in data.read_jsonl(tmp_path / "out" / "heldout.jsonl")}
    later = data.read_jsonl(tmp_path / "out" / "train-later.jsonl")
    assert stats["train_later_turns"] == len(later) > 0
    assert all(p["id"].split("#")[0] in train and p["id"].split("#")[0] not in held for p in later)
    assert len(later) == sum(1 for i in range(20) if f"sharegpt/x{i}_0" in train)
    assert all(p["messages"][-1]["role"] == "user" and len(p["messages"]) == 3 for p in later)


def test_length_sorted_batches_cover_everything_once():
    items = [(str(i), [0] * ((i * 7) % 11 + 1)) for i in range(23)]
    batches = list(data.length_sorted_batches(items, batch_size=4, window=2))
    flat = [pid for b in batches for pid, _ in b]
    assert sorted(flat) == sorted(pid for pid, _ in items) and all(len(b) <= 4 for b in batches)
    first_window = [len(ids) for b in batches[:2] for _, ids in b]
    assert first_window == sorted(first_window)


# ---------------------------------------------------------------- step 2: regeneration
@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A 2-layer random Llama with the real SmolLM2 tokenizer (chat template), saved to disk."""
    tok = AutoTokenizer.from_pretrained(str(registry.resolve_target(registry.DEFAULT_TARGET)[0]))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def tiny_target(path) -> Target:
    return Target.load(str(path), dtype="float32")


PROMPTS = ["Hi", "Write a function that adds two numbers.", "What is the capital of France?",
           "Tell me a long story about a dragon, a knight and a very old castle by the sea.", "2+2=?"]


def write_prompts(path, texts=PROMPTS):
    data.write_jsonl(path, [{"id": f"p{i}", "messages": [{"role": "user", "content": t}]}
                            for i, t in enumerate(texts)])
    return path


def vanilla(target: Target, messages, max_new: int) -> list[int]:
    return list(Engine(target, None).tokens(messages, method="vanilla", max_new_tokens=max_new))


def add_early_stop(target: Target, messages) -> int:
    """Make a token that greedy decoding emits mid-answer a stop token, so rows end at different steps."""
    tok = vanilla(target, messages, MAX_NEW)[2]
    target.model.config.eos_token_id = [target.tokenizer.eos_token_id, tok]
    return tok


def read_shards(out_dir) -> list[dict]:
    return [r for s in sorted(out_dir.glob("shard-*.jsonl")) for r in data.read_jsonl(s)]


def test_regen_shards_equal_plain_greedy_decoding(tiny_target_dir, tmp_path):
    target = tiny_target(tiny_target_dir)
    prompts = data.load_prompts(write_prompts(tmp_path / "p.jsonl"))
    stop_tok = add_early_stop(target, prompts[1]["messages"])
    cfg = data.RegenConfig(batch_size=3, max_new_tokens=MAX_NEW, shard_size=2)
    meta = data.regenerate(target, tmp_path / "p.jsonl", tmp_path / "out", cfg, dtype="float32",
                           progress=False)
    recs = {r["id"]: r for r in read_shards(tmp_path / "out")}
    assert sorted(recs) == [p["id"] for p in prompts] and meta["sequences"] == len(prompts)
    assert sorted(p.name for p in (tmp_path / "out").glob("shard-*")) == [
        "shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    ended_early = 0
    for p in prompts:
        r = recs[p["id"]]
        prompt_ids = target.apply_chat(p["messages"])
        assert r["prompt_len"] == len(prompt_ids) and r["input_ids"][:r["prompt_len"]] == prompt_ids
        assert r["input_ids"][r["prompt_len"]:] == vanilla(target, p["messages"], MAX_NEW)
        ended_early += r["input_ids"][-1] == stop_tok
    assert ended_early >= 1  # at least one row left its batch early
    assert meta["response_tokens"] == sum(len(r["input_ids"]) - r["prompt_len"] for r in recs.values())
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["finished"] is True


def test_killed_run_resumes_without_duplicates(tiny_target_dir, tmp_path, monkeypatch):
    target = tiny_target(tiny_target_dir)
    write_prompts(tmp_path / "p.jsonl")
    cfg = data.RegenConfig(batch_size=1, max_new_tokens=MAX_NEW, shard_size=2)
    real, calls = data.generate_batch, []

    def dies_on_fourth_batch(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # interrupted mid-shard: the 3 finished records are saved
        return real(*a, **kw)

    monkeypatch.setattr(data, "generate_batch", dies_on_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        data.regenerate(target, tmp_path / "p.jsonl", tmp_path / "out", cfg, progress=False)
    (tmp_path / "out" / "shard-00001.jsonl.tmp").write_text('{"id": "half')  # a torn write
    first = read_shards(tmp_path / "out")
    assert len(first) == 3 and len({r["id"] for r in first}) == 3
    monkeypatch.setattr(data, "generate_batch", real)
    meta = data.regenerate(target, tmp_path / "p.jsonl", tmp_path / "out", cfg, progress=False)
    ids = [r["id"] for r in read_shards(tmp_path / "out")]
    assert len(ids) == len(set(ids)) == len(PROMPTS) and meta["finished"] is True
    assert meta["run_response_tokens"] < meta["response_tokens"]  # the resumed run did only the rest


def test_max_tokens_stops_early(tiny_target_dir, tmp_path):
    target = tiny_target(tiny_target_dir)
    write_prompts(tmp_path / "p.jsonl")
    cfg = data.RegenConfig(batch_size=2, max_new_tokens=MAX_NEW, max_tokens=MAX_NEW + 1)
    meta = data.regenerate(target, tmp_path / "p.jsonl", tmp_path / "out", cfg, progress=False)
    assert meta["sequences"] < len(PROMPTS) and meta["response_tokens"] >= MAX_NEW + 1
    assert meta["finished"] is False


# ---------------------------------------------------------------- bad input
def test_cli_missing_prompts_file(tmp_path, capsys):
    rc = main(["data", "regen", "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "prompts file not found" in err and "Traceback" not in err


def test_cli_unwritable_out_dir(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    write_prompts(tmp_path / "p.jsonl")
    rc = main(["data", "regen", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(blocker / "sub")])
    assert rc == 2 and "cannot write to output directory" in capsys.readouterr().err
    rc = main(["data", "prompts", "--out", str(blocker / "sub")])
    assert rc == 2 and "cannot write to output directory" in capsys.readouterr().err


def test_bad_prompt_files_and_values(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n{oops\n')
    with pytest.raises(TreeflashError, match="bad.jsonl:2"):
        data.load_prompts(bad)
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(TreeflashError, match="messages"):
        data.load_prompts(bad)
    rc = main(["data", "regen", "--prompts", str(bad), "--out", str(tmp_path / "o"), "--batch-size", "0"])
    assert rc == 2 and "--batch-size must be >= 1" in capsys.readouterr().err
    with pytest.raises(TreeflashError, match="heldout"):
        data.split([{"id": "a"}], heldout=5, seed=0)


def test_jsonl_and_gzipped_shards_read_alike(tmp_path):
    """A record whose text holds U+2028 (a line separator to str.splitlines) is one record; a
    gzipped shard (as checked in under data/) reads like the plain one, and packing keeps it whole."""
    import gzip

    from treeflash.cli import main

    rows = [{"id": "a", "input_ids": [1, 2, 3], "prompt_len": 1, "note": "x\u2028y\x85z"}, {"id": "b", "input_ids": [4, 5], "prompt_len": 1}]
    src = tmp_path / "src"
    src.mkdir()
    data.write_jsonl(src / "shard-00000.jsonl", rows)
    assert data.read_jsonl(src / "shard-00000.jsonl") == rows
    assert main(["data", "pack", str(src), str(tmp_path / "dst")]) == 0
    packed = tmp_path / "dst" / "shard-00000.jsonl.gz"
    assert gzip.decompress(packed.read_bytes()) == (src / "shard-00000.jsonl").read_bytes()
    assert packed.read_bytes()[4:8] == bytes(4)  # no mtime: repacking gives the same bytes
    assert data.read_jsonl(packed) == rows and data.shard_files(tmp_path / "dst") == [packed]
    assert data.scan_shards(tmp_path / "dst", stop_ids={5}).next_shard == 1


def test_a_shard_beside_its_gzipped_copy_counts_once(tmp_path):
    """Resuming a regeneration from packed shards leaves a shard and its .gz side by side: scanning
    (resume counts, meta.json) and reading (training) must take it once."""
    from treeflash.cli import main

    rows = [{"id": "a", "input_ids": [1, 2, 3], "prompt_len": 1}]
    data.write_jsonl(tmp_path / "shard-00000.jsonl", rows)
    data.write_jsonl(tmp_path / "shard-00001.jsonl", [{"id": "b", "input_ids": [4, 5], "prompt_len": 1}])
    assert main(["data", "pack", str(tmp_path), str(tmp_path)]) == 0  # .gz beside each plain shard
    assert len(list(tmp_path.glob("shard-*"))) == 4
    assert [p.name.split(".")[0] for p in data.shard_files(tmp_path)] == ["shard-00000", "shard-00001"]
    prog = data.scan_shards(tmp_path, stop_ids=set())
    assert (prog.response_tokens, prog.total_tokens, prog.next_shard) == (3, 5, 2)


def test_select_keeps_topic_prompts_in_order_minus_done_ids(tmp_path, capsys):
    """`data select`: code and maths prompts (by the last user turn), in file order, without the
    ids a regen directory already holds and without repeats across files; bad topics are one line."""
    def row(rid, *texts):
        roles = ["user", "assistant"]
        return {"id": rid, "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]}

    first = [row("a", "Write a Python function that sorts a list."), row("b", "Write a haiku about rain."),
             row("c", "How many apples are left if I eat 3 of 7?"), row("d", "```js\nlet x = 1\n```")]
    later = [row("b#t2", "Write a haiku about rain.", "...", "Now as a bash script"),
             row("e#t2", "What is SQL?", "A query language.", "Thanks, tell me a story."),
             row("a", "duplicate id of a code prompt")]
    (tmp_path / "p1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    (tmp_path / "p2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in later))
    done = tmp_path / "done"
    done.mkdir()
    data.write_jsonl(done / "shard-00000.jsonl", [{"id": "d", "input_ids": [1, 2], "prompt_len": 1}])
    out = tmp_path / "sel.jsonl"
    args = ["data", "select", str(tmp_path / "p1.jsonl"), str(tmp_path / "p2.jsonl"), "--out", str(out), "--exclude", str(done)]
    assert main(args) == 0
    assert [r["id"] for r in data.read_jsonl(out)] == ["a", "c", "b#t2"]
    assert main(args + ["--topics", "math"]) == 0
    assert [r["id"] for r in data.read_jsonl(out)] == ["c"]
    capsys.readouterr()
    assert main(args + ["--topics", "poetry"]) == 2
    err = capsys.readouterr().err
    assert "unknown topic 'poetry'" in err and "Traceback" not in err
    assert main(["data", "select", str(tmp_path / "nope.jsonl"), "--out", str(out)]) == 2


def test_output_dir_probe_leaves_other_writers_files(tmp_path):
    """Two `train features` processes share one --out: the write probe of one must not delete a
    file of the other (a shared probe name made the second process fail with 'not writable')."""
    from treeflash.fsutil import ensure_writable_dir

    other = tmp_path / "out" / ".write-test"
    other.parent.mkdir()
    other.write_text("")
    assert ensure_writable_dir(tmp_path / "out") == tmp_path / "out"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".write-test"]


def test_drop_history_keeps_the_longest_tail_that_fits():
    """--long-prompts drop-history: the oldest turns go first, the system message stays, the tail
    starts at a user turn; a last turn too long on its own is still skipped, and "skip" keeps the
    old behaviour."""
    def msg(role, n):
        return {"role": role, "content": " ".join(["w"] * n)}

    class WordTarget:  # one token per word, plus one per message
        @staticmethod
        def apply_chat(messages):
            return [0] * sum(1 + len(m["content"].split()) for m in messages)

    sys_, u1, a1, u2, a2, u3 = msg("system", 2), msg("user", 5), msg("assistant", 9), msg("user", 4), msg("assistant", 3), msg("user", 6)
    conv_ = [sys_, u1, a1, u2, a2, u3]                     # 3 + 6 + 10 + 5 + 4 + 7 = 35 tokens
    chat = WordTarget.apply_chat
    assert len(data.fit_history(chat, conv_, 35)) == 35    # fits: nothing dropped
    assert len(data.fit_history(chat, conv_, 34)) == 3 + 5 + 4 + 7   # from u2 on, system kept
    assert len(data.fit_history(chat, conv_, 10)) == 3 + 7           # only the last user turn
    assert data.fit_history(chat, conv_, 9) is None
    assert len(data.fit_history(chat, [u1, a1, u2], 16)) == 5       # no system message
    calls = []                                              # 65 user turns: bisection, not a scan
    long_conv = [sys_] + [msg("user" if i % 2 == 0 else "assistant", 3) for i in range(129)]
    ids = data.fit_history(lambda m: calls.append(m) or chat(m), long_conv, 3 + 4 * 5)
    assert len(ids) == 3 + 4 * 5 and len(calls) <= 7         # the last 5 messages (u, a, u, a, u)
    rows = [{"id": "long", "messages": conv_}, {"id": "short", "messages": [u3]},
            {"id": "hopeless", "messages": [msg("user", 40)]}, {"id": "done", "messages": [u1]}]
    todo, too_long, shortened = data.encode_prompts(WordTarget, rows, {"done"}, 20, "drop-history")
    assert [(i, len(p)) for i, p in todo] == [("long", 19), ("short", 7)] and (too_long, shortened) == (1, 1)
    todo, too_long, shortened = data.encode_prompts(WordTarget, rows, {"done"}, 20, "skip")
    assert [i for i, _ in todo] == ["short"] and (too_long, shortened) == (2, 0)
    with pytest.raises(TreeflashError, match="--long-prompts"):
        data.RegenConfig(long_prompts="truncate").check()


def test_select_exclude_must_be_a_directory(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "def f(): pass"}]}) + "\n")
    rc = main(["data", "select", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "s.jsonl"),
               "--exclude", str(tmp_path / "no-such-regen-dir")])
    err = capsys.readouterr().err
    assert rc == 2 and "--exclude: not a directory" in err and "Traceback" not in err
    assert not (tmp_path / "s.jsonl").exists()


# ---------------------------------------------------------------- --engine llama-server
class FakeServer:
    """A `LlamaServer` stand-in: answers after a short wait, counting the requests in flight."""

    def __init__(self):
        import threading

        self.lock, self.in_flight, self.most, self.closed = threading.Lock(), 0, 0, False

    def complete(self, prompt, n_predict):
        import time

        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        time.sleep(0.01 * (len(prompt) % 3))  # answers finish out of order
        with self.lock:
            self.in_flight -= 1
        return {"tokens": [len(prompt)] * n_predict}

    def close(self):
        self.closed = True


def test_server_answers_keep_the_slots_full_and_every_answer_lands_once(tmp_path):
    todo = [(f"p{i}", list(range(i + 1))) for i in range(20)]
    cfg = data.RegenConfig(batch_size=4, max_new_tokens=3)
    server = FakeServer()
    got = [a for group in data.server_answers(server, todo, cfg) for a in group]
    assert sorted(got) == sorted((pid, p, [len(p)] * 3) for pid, p in todo)
    assert server.most == 4 and server.closed


def test_regen_with_answers_from_a_server_resumes_and_stops_at_max_tokens(tiny_target_dir, tmp_path):
    target = tiny_target(tiny_target_dir)
    prompts = data.load_prompts(write_prompts(tmp_path / "p.jsonl"))
    cfg = data.RegenConfig(batch_size=2, max_new_tokens=MAX_NEW, shard_size=2, max_tokens=2 * MAX_NEW)
    server = FakeServer()
    meta = data.regenerate(target, tmp_path / "p.jsonl", tmp_path / "out", cfg, progress=False,
                           answers=lambda todo: data.server_answers(server, todo, cfg))
    assert meta["sequences"] == 2 and not meta["finished"] and server.closed
    cfg.max_tokens = None
    meta = data.regenerate(target, tmp_path / "p.jsonl", tmp_path / "out", cfg, progress=False,
                           answers=lambda todo: data.server_answers(FakeServer(), todo, cfg))
    recs = {r["id"]: r for r in read_shards(tmp_path / "out")}
    assert len(recs) == len(read_shards(tmp_path / "out")) == len(prompts)  # each answer once
    assert meta["finished"] and meta["run_response_tokens"] == (len(prompts) - 2) * MAX_NEW
    for p in prompts:
        n = len(target.apply_chat(p["messages"]))
        assert recs[p["id"]]["input_ids"][n:] == [n] * MAX_NEW and recs[p["id"]]["prompt_len"] == n


llama_built = pytest.mark.skipif(__import__("treeflash.models.llamacpp", fromlist=["x"]).binary("llama-server") is None,
                                 reason="llama.cpp is not built here: run `make llama-cpp`")


@llama_built
def test_regen_through_llama_server_writes_whole_answers_and_resumes(tiny_target_dir, tmp_path):
    from treeflash.models import llamacpp

    gguf = tmp_path / "tiny-f32.gguf"
    llamacpp.run_converter(tiny_target_dir, gguf, "f32")
    write_prompts(tmp_path / "p.jsonl")
    args = ["data", "regen", "--target", str(tiny_target_dir), "--engine", "llama-server", "--gguf", str(gguf),
            "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out"), "--batch-size", "3",
            "--max-new-tokens", str(MAX_NEW), "--shard-size", "2", "--no-progress", "--threads", "2"]
    assert main(args) == 0
    target = tiny_target(tiny_target_dir)
    stop = target.stop_ids()
    recs = read_shards(tmp_path / "out")
    assert sorted(r["id"] for r in recs) == [f"p{i}" for i in range(len(PROMPTS))]
    for r in recs:
        answer = r["input_ids"][r["prompt_len"]:]
        assert r["input_ids"][:r["prompt_len"]] == target.apply_chat(
            [{"role": "user", "content": PROMPTS[int(r["id"][1:])]}])
        assert len(answer) == MAX_NEW or (answer and answer[-1] in stop and len(answer) < MAX_NEW)
        assert all(0 <= t < len(target.tokenizer) for t in answer)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["finished"] and meta["dtype"] == "gguf:tiny-f32.gguf"
    assert main(args) == 0  # resumed: nothing left to answer
    assert len(read_shards(tmp_path / "out")) == len(recs)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["run_response_tokens"] == 0


def test_regen_gguf_bad_input_is_one_line(tiny_target_dir, tmp_path, capsys):
    write_prompts(tmp_path / "p.jsonl")
    base = ["data", "regen", "--target", str(tiny_target_dir), "--engine", "llama-server",
            "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out")]
    (tmp_path / "x.txt").write_text("x")
    for gguf, says in ((str(tmp_path / "x.txt"), "--gguf takes a .gguf file"), ("q8_0", "needs a built-in target")):
        assert main(base + ["--gguf", gguf]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
