"""The llama-cpp backend (`models/llama_backend.py`): the target's GGUF in libllama, our trees verified
with llama.cpp's sequence ids.

- `path_seqs` (pure; runs everywhere): every node's ids are exactly the leaves below it, so each
  node's first id sees exactly its ancestors.
- Where llama.cpp is built: a tiny random Llama written as an F32 GGUF by llama.cpp's own converter
  (SmolLM2's tokenizer). Greedy output of every method and budget equals plain decoding on the same
  backend; after every step the cache holds exactly the accepted path; sampled output follows the
  verify forward's own distribution; bad input is one clear line.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from treeflash.errors import TreeflashError
from treeflash.models import llamacpp
from treeflash.models.llama_backend import path_seqs


def random_tree(n: int, rng: random.Random) -> torch.Tensor:
    """The ancestor mask [n, n] of a random tree in node order (parents before children)."""
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("seed", range(40))
def test_each_nodes_first_id_sees_exactly_its_ancestors(seed):
    rng = random.Random(seed)
    m = random_tree(rng.randrange(1, 40), rng)
    seqs = path_seqs(m)
    n = len(m)
    leaves = [i for i in range(n) if m[:, i].sum() == 1]
    assert sorted({s for x in seqs for s in x}) == list(range(len(leaves)))  # one id per leaf, 0 first
    for i in range(n):
        assert seqs[i] == sorted(seqs[i]) and seqs[i]
        # the ids of node i are the leaves below it
        assert seqs[i] == [k for k, leaf in enumerate(leaves) if m[leaf, i]]
        # llama.cpp lets a token see the cells of its first id at positions up to its own
        first, depth = seqs[i][0], int(m[i].sum())
        seen = {j for j in range(n) if first in seqs[j] and int(m[j].sum()) <= depth}
        assert seen == set(np.flatnonzero(m[i].numpy()).tolist())
    # llama.cpp's batch checks: along each id, positions (depths) rise by one in node order
    for s in range(len(leaves)):
        depths = [int(m[j].sum()) for j in range(n) if s in seqs[j]]
        assert depths == list(range(1, len(depths) + 1))


built = pytest.mark.skipif(llamacpp.binary("llama-bench") is None or llamacpp.source_dir() is None,
                           reason="llama.cpp is not built here: run `make llama-cpp`")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random 4-layer Llama (hidden 64, SmolLM2's vocabulary and tokenizer, a peaky LM head) as an
    F32 GGUF, and its PyTorch twin."""
    from treeflash.bench.selftest import random_model
    from treeflash.models import registry
    from transformers import AutoTokenizer

    try:
        tok_dir, _ = registry.resolve_target("smollm2-135m")
    except TreeflashError:
        pytest.skip("smollm2-135m is not installed here")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    model = random_model("llama", 0, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out / "hf")
    tok.save_pretrained(out / "hf")
    llamacpp.run_converter(out / "hf", out / "tiny-f32.gguf", "f32")
    return out / "tiny-f32.gguf"


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    import treeflash
    from treeflash.api import random_drafter

    eng = treeflash.load(target=str(tiny_gguf), drafter="none", dtype="float32", backend="llama-cpp")
    d = random_drafter(eng.target, seed=1, num_layers=1, num_taps=2, block_size=8)
    return treeflash.api.Engine(eng.target, d, "llama-cpp")


PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown fox"]


@built
@pytest.mark.parametrize("method", ["chain", "marginal", "treeflash", "lookup", "treeflash+lookup"])
@pytest.mark.parametrize("budget", [2, 8, 16])
def test_greedy_output_equals_plain_decoding_on_the_same_backend(engine, method, budget):
    for p in PROMPTS:
        plain = engine.generate(p, method="vanilla", max_new_tokens=40, chat=False, ignore_eos=True)
        r = engine.generate(p, method=method, tree_size=budget, max_new_tokens=40, chat=False, ignore_eos=True)
        assert r.token_ids == plain.token_ids, (method, budget, p)
        assert len(r.token_ids) == 40


@built
def test_the_cache_holds_exactly_the_accepted_path_after_every_step(engine):
    from treeflash.api import GenerationConfig
    from treeflash.decoding.generate import decode_step, prefill
    from treeflash.decoding.sequence import Sequence

    tgt = engine.target
    cfg = engine.config(GenerationConfig(method="treeflash+lookup", tree_size=16, max_new_tokens=48, ignore_eos=True))
    ids, _, proposer = engine.prepare(PROMPTS[1], cfg, chat=False)
    seq = Sequence.request(tgt, ids, cfg, proposer)
    cache = tgt.new_cache(seq.reserved)
    list(prefill(tgt, seq, cache))
    trees = 0
    while not seq.done:
        list(decode_step(tgt, seq, cache))
        trees += 1
        lo, hi = cache.cells(0)
        assert (lo, hi) == (0, cache.length - 1) == (0, seq.start - 1)
        assert all(cache.cells(s) == (-1, -1) for s in range(1, 64))  # no other id holds a cell
    assert trees > 1
    ll, ctx = tgt.gguf.ll, tgt.gguf.ctx
    held = ll.llama_state_seq_get_size(ctx, 0)
    assert ll.llama_state_seq_get_size(ctx, -1) == held  # every used cell is the sequence's
    # as many cells as a cache that prefilled the same tokens: no rejected node stayed
    fresh = tgt.new_cache(seq.reserved)
    tgt.forward(torch.tensor(seq.history[:-1]), torch.arange(len(seq.history) - 1), fresh)
    assert ll.llama_state_seq_get_size(ctx, 0) == held


@built
def test_sampled_tokens_follow_the_verify_forwards_distribution(engine):
    """A chi-square test of a tree step's first token (prompt and first token fixed, then treeflash
    trees at temperature 0.3: the random target is flat over its 49k tokens) against the target's distribution at that position."""
    from scipy.stats import chisquare

    from treeflash.api import GenerationConfig
    from treeflash.decoding.generate import decode_step, prefill
    from treeflash.decoding.sampling import SamplingParams, probs
    from treeflash.decoding.sequence import Sequence

    tgt, hot = engine.target, SamplingParams(temperature=0.3)
    cfg = engine.config(GenerationConfig(method="treeflash", tree_size=8, max_new_tokens=8, ignore_eos=True))
    ids, _, proposer = engine.prepare("The quick brown fox", cfg, chat=False)
    n, counts = 300, {}
    for seed in range(n):
        seq = Sequence.request(tgt, ids, cfg, proposer)
        cache = tgt.new_cache(seq.reserved)
        first = list(prefill(tgt, seq, cache))  # greedy: the same first token every time
        seq.sampling, seq.gen = hot, torch.Generator().manual_seed(seed)
        tok = next(iter(decode_step(tgt, seq, cache)))
        counts[tok] = counts.get(tok, 0) + 1
    cache = tgt.new_cache(64)
    ctx = ids + first
    logits, _ = tgt.forward(torch.tensor(ctx), torch.arange(len(ctx)), cache)
    p = probs(logits[len(ctx) - 1], hot).double().numpy()
    cats = np.flatnonzero(p * n >= 5)
    assert len(cats) >= 3, "the distribution must spread over several tokens for the test to bite"
    obs = np.array([counts.get(int(i), 0) for i in cats] + [n - sum(counts.get(int(i), 0) for i in cats)])
    exp = np.concatenate([p[cats], [1 - p[cats].sum()]]) * n
    if exp[-1] < 5:  # the rest is too rare to test alone: fold it away
        obs, exp = obs[:-1], exp[:-1]
        exp = exp * obs.sum() / exp.sum()
    assert chisquare(obs, exp).pvalue > 1e-3


@built
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_the_drafters_lm_head_is_the_ggufs_output_weight(tiny_gguf, outtype):
    """`output_weight` (ggml's tensor table and row dequantizer) gives the F32 file's weights as
    they are, and a Q8_0 file's as gguf-py's own dequantizer reads them."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from treeflash.models.gguf_file import output_weight

    hf = load_file(str(tiny_gguf.parent / "hf" / "model.safetensors"))["lm_head.weight"]  # [V, H]
    path = tiny_gguf
    if outtype != "f32":
        path = tiny_gguf.parent / f"tiny-{outtype}.gguf"
        if not path.exists():
            llamacpp.run_converter(tiny_gguf.parent / "hf", path, outtype)
    got = output_weight(path, *hf.shape)
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == "output.weight")
    want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(hf.shape))
    assert torch.equal(got, want)
    if outtype == "f32":
        assert torch.equal(got, hf)
    else:
        assert not torch.equal(got, hf)  # quantized: the test reads the file, not the twin


@built
def test_the_bench_measures_agreement_with_llama_cpps_plain_decoding(tiny_gguf, tmp_path):
    """`bench --backend llama-cpp` with the `llama-cpp` arm: our plain decoding of the F32 file
    equals llama.cpp's own on every prompt; a difference is reported at its token, with the plain
    run's top-two logit gap there."""
    from treeflash.bench import agreement
    from treeflash.bench.runner import BenchConfig, load_engine, run_bench
    from treeflash.config import GenerationConfig

    cfg = BenchConfig(datasets=["humaneval"], methods=["vanilla", "llama-cpp"], num_prompts=2, dtype="float32",
                      generation=GenerationConfig(max_new_tokens=12), backend="llama-cpp",
                      target=str(tiny_gguf), drafter="none", warmup=False, out=str(tmp_path / "bench"))
    engine = load_engine(cfg)
    results = run_bench(cfg, engine)
    assert any("vanilla equals llama.cpp's plain greedy decoding of the same GGUF on 2/2" in n for n in results["notes"])

    import json

    records = [json.loads(line) for line in (tmp_path / "bench" / "generations.jsonl").read_text().splitlines()]
    from treeflash.bench.runner import Record

    recs = [Record(r["dataset"], r["id"], r["method"], r["tree_size"], r["turns"]) for r in records]
    ours = next(r for r in recs if r.method == "vanilla")
    ours.turns[0]["token_ids"][5] += 1  # a difference at token 5
    note, = agreement.llama_cpp(engine.target, cfg, recs)
    assert "on 1/2 first turns" in note and f"{ours.sample_id} token 5 (gap " in note and ", shift " in note


@built
def test_bad_input_is_one_clear_line(tiny_gguf, tmp_path):
    import subprocess
    import sys

    import treeflash
    from treeflash.models.target import Target

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(TreeflashError, match="llama.cpp cannot load bad.gguf"):
        treeflash.load(target=str(bad), drafter="none", backend="llama-cpp")
    with pytest.raises(TreeflashError, match="runs a GGUF"):
        treeflash.load(target=str(tmp_path), drafter="none", backend="llama-cpp")
    with pytest.raises(TreeflashError, match="load the target with --backend llama-cpp"):
        Target.load(str(tiny_gguf)).set_backend("llama-cpp")
    r = subprocess.run([sys.executable, "-m", "treeflash", "generate", "hi", "--target", str(bad), "--backend",
                        "llama-cpp", "--drafter", "none"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@built
@pytest.mark.parametrize("faster", ["llama-cpp", "static"])
def test_backend_auto_loads_the_gguf_where_llama_cpp_times_faster(tiny_gguf, tmp_path, monkeypatch, faster):
    import treeflash
    from treeflash import api
    from treeflash.decoding import costmodel

    monkeypatch.setenv("TREEFLASH_AOT", "1")
    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    real = costmodel.auto_backend  # the torch target's choice without compiling in a test
    monkeypatch.setattr(costmodel, "auto_backend", lambda t: real(t) if t.backend == "llama-cpp" else "static")
    monkeypatch.setattr(costmodel, "step_times", lambda target, backends: {
        b: 0.01 if b == faster else 0.02 for b in backends})
    api._load_target.cache_clear()
    eng = treeflash.load(target=str(tiny_gguf), drafter="none")
    assert (eng.target.backend == "llama-cpp") is (faster == "llama-cpp")
    plain = eng.generate("def f(x):", method="vanilla", max_new_tokens=8, chat=False, ignore_eos=True)
    assert len(plain.token_ids) == 8
    api._load_target.cache_clear()


@built
def test_generate_batch_runs_the_prompts_one_after_another(engine):
    got = engine.generate_batch(PROMPTS, method="treeflash", tree_size=8, max_new_tokens=12, chat=False,
                                ignore_eos=True)
    want = [engine.generate(p, method="vanilla", max_new_tokens=12, chat=False, ignore_eos=True) for p in PROMPTS]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
