"""Echo stubs: docstring replacement, the checked copy equals the target's greedy answer, shards."""
from __future__ import annotations

import gzip
import json

import torch
from safetensors.torch import load_file

from treeflash.cli import main
from treeflash.training import echo
from treeflash.training.features import sequence_features

from test_data import tiny_target, tiny_target_dir, vanilla  # noqa: F401  (fixture)

STUB = 'def area(w: float, h: float) -> float:\n    """Area of a rectangle.\n\n    >>> area(2, 3)\n    6\n    """'
TEXT = "the quick brown fox jumps over the lazy dog and then runs far away into the quiet green woods"


def test_echo_stub_replaces_only_the_docstring_body():
    new = echo.echo_stub(STUB, TEXT)
    assert new == f'def area(w: float, h: float) -> float:\n    """The{TEXT[3:]}\n    """'
    wrapped = echo.echo_stub(STUB, TEXT, width=40)
    lines = wrapped.splitlines()
    assert lines[0] == STUB.splitlines()[0] and lines[-1] == '    """'
    assert all(len(ln) <= 40 for ln in lines[1:]) and all(ln.startswith("    ") for ln in lines[1:])
    assert " ".join(ln.strip().strip('"') for ln in lines[1:]).split() == ("The" + TEXT[3:]).split()
    single = "def f(x):\n    '''Old text.'''\n    return x"
    assert echo.echo_stub(single, "new words here") == "def f(x):\n    '''New words here\n    '''\n    return x"
    assert echo.echo_stub("def f(x):\n    return x", TEXT) is None


def test_paragraphs_keep_plain_prose_only():
    good = "This is a plain paragraph of prose. " * 5
    rows = [{"messages": [{"role": "user", "content": f"{good}\n\nshort\n\n```python\n{good}```\n\n"
                                                      f'{good} "quoted"\n\n{good}\u00e9\n\n{"$%^&*" * 30}'}]}]
    assert echo.paragraphs(rows) == [" ".join(good.split())]


def test_greedy_prefix_stops_at_the_first_token_that_is_not_the_argmax():
    ids = [5, 6, 7, 1, 2, 3, 4]  # prompt of 3, guess 1 2 3 4
    argmax = torch.tensor([0, 0, 1, 2, 9, 4, 0])  # argmax[i] predicts ids[i + 1]
    assert echo.greedy_prefix(argmax, ids, 3) == 5  # 1 and 2 match, 3 does not
    assert echo.greedy_prefix(torch.tensor([0, 0, 1, 2, 3, 4, 0]), ids, 3) == 7
    assert echo.greedy_prefix(torch.tensor([0, 0, 8, 2, 3, 4, 0]), ids, 3) == 3


def test_checked_copy_is_the_greedy_answer_with_its_own_features(tiny_target_dir):
    target = tiny_target(tiny_target_dir)
    target.set_taps([0, 1])
    msgs = [{"role": "user", "content": "Write a function that adds two numbers."}]
    prompt = target.apply_chat(msgs)
    greedy = vanilla(target, msgs, 10)
    wrong = (greedy[6] + 1) % target.vocab_rows
    for guess, keep in ((greedy[:6] + [wrong] + greedy[7:], 6), (greedy[:9], 9)):
        ids, f = echo.checked_copy(target, prompt, guess)
        assert ids == prompt + greedy[:keep]
        ref = sequence_features(target, ids, 8)  # the kept sequence alone, one forward
        assert torch.equal(f["top_idx"], ref["top_idx"])
        # fp16 storage of fp32 features: the two forwards may round one half-precision step apart
        assert torch.allclose(f["feats"].float(), ref["feats"].float(), rtol=2 ** -9, atol=2 ** -14)


def test_echo_shards_write_matching_tokens_and_features_and_resume(tiny_target_dir, tmp_path, monkeypatch):
    target = tiny_target(tiny_target_dir)
    target.set_taps([0, 1])
    monkeypatch.setattr(echo, "MIN_COPY", 0)  # a random target copies little: keep every row
    stubs = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"x\n\n```python\n{STUB.replace('area', f'area{i}')}\n```"}]}
             for i in range(3)]
    texts = [f"{TEXT} number {i}" for i in range(5)]
    stats = echo.echo_shards(target, stubs, texts, tmp_path / "tok", 3, shard_size=2, features=tmp_path / "f")
    assert stats["sequences"] == 3 and stats["dropped"] == 0
    recs = [json.loads(x) for s in sorted((tmp_path / "tok").glob("shard-*.jsonl.gz"))
            for x in gzip.open(s, "rt")]
    assert [r["id"] for r in recs] == ["echo/s0", "echo/s1", "echo/s2"]
    ids = []
    for s in ("00000", "00001"):
        t = load_file(tmp_path / "f" / f"feat-{s}.safetensors")
        assert t["feats"].shape[0] == t["ids"].numel() == int(t["offsets"][-1])
        ids += t["ids"].tolist()
    assert ids == [i for r in recs for i in r["input_ids"]]
    again = echo.echo_shards(target, stubs, texts, tmp_path / "tok", 3, shard_size=2, features=tmp_path / "f")
    assert again["sequences"] == 0  # both shards were there: nothing recomputed
    # deterministic gzip (mtime 0 in the header): a rerun elsewhere writes the same bytes
    echo.echo_shards(target, stubs, texts, tmp_path / "tok2", 3, shard_size=2)
    for s in sorted((tmp_path / "tok").glob("shard-*.jsonl.gz")):
        assert s.read_bytes()[4:8] == bytes(4) and s.read_bytes() == (tmp_path / "tok2" / s.name).read_bytes()


def test_cli_echo_missing_file_is_one_line(tmp_path, capsys):
    rc = main(["data", "echo", "--stubs", str(tmp_path / "nope.jsonl"), "--texts", str(tmp_path / "t.jsonl"),
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "no such file" in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_echo_writes_shards_features_and_meta(tiny_target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(echo, "MIN_COPY", 0)
    stubs, texts = tmp_path / "stubs.jsonl", tmp_path / "train.jsonl"
    stubs.write_text("".join(json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": f"```python\n{STUB}\n```"}]}) + "\n"
                             for i in range(3)))
    texts.write_text(json.dumps({"id": "t", "messages": [{"role": "user", "content": f"{TEXT} {TEXT} one.\n\n{TEXT} {TEXT} two."}]}) + "\n")
    rc = main(["data", "echo", "--target", str(tiny_target_dir), "--stubs", str(stubs), "--texts", str(texts),
               "--out", str(tmp_path / "o"), "--features", str(tmp_path / "f"), "--skip", "1", "--num-taps", "2"])
    assert rc == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["paragraphs"] == 2 and meta["this_run"]["sequences"] == 2  # 2 stubs after --skip 1, 2 texts
    assert [p.name for p in sorted((tmp_path / "f").iterdir())] == ["feat-00000.safetensors"]
