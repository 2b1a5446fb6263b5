"""Drafter training on a tiny random target: features, objective mask, loss, resume, DDP, bad input."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treeflash.errors import TreeflashError
from treeflash.models.drafter_config import default_target_layer_ids
from treeflash.models.target import Target
from treeflash.training import features as F
from treeflash.training.objective import IGNORE, block_inputs, block_mask, dense_reference_mask, sample_anchors
from treeflash.training.trainer import TrainConfig, Trainer, export

VOCAB = 64


def make_tiny_target_dir(path: Path, seed: int = 0) -> Path:
    """A 4-layer Llama with a word-level tokenizer, saved as an HF directory (loads via Target.load)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB - 4)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=1, tie_word_embeddings=True, initializer_range=0.3)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def make_shards(data: Path, n_shards: int = 2, per_shard: int = 12, seed: int = 0) -> Path:
    """Learnable sequences: a prompt of random tokens then an arithmetic progression mod 50."""
    g = torch.Generator().manual_seed(seed)
    data.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        rows = []
        for i in range(per_shard):
            plen = int(torch.randint(3, 8, (1,), generator=g))
            prompt = torch.randint(2, 52, (plen,), generator=g).tolist()
            start, step = prompt[-1], 1 + (prompt[0] % 3)
            resp = [2 + (start + step * j) % 50 for j in range(1, 28)]
            rows.append(json.dumps({"id": f"{s}-{i}", "input_ids": prompt + resp, "prompt_len": plen}))
        (data / f"shard-{s:05d}.jsonl").write_text("\n".join(rows) + "\n")
    return data


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tdir = make_tiny_target_dir(root / "target")
    data = make_shards(root / "data")
    target = Target.load(str(tdir))
    layers = default_target_layer_ids(4, 2)
    files = F.build_cache(target, data, root / "feats", layers, top_k=4)
    return {"root": root, "tdir": tdir, "data": data, "target": target, "files": files}


def config(env, name: str, **kw) -> TrainConfig:
    base = dict(features=[str(f) for f in env["files"]], out=str(env["root"] / name), num_layers=1,
                num_taps=2, block_size=4, batch_seqs=4, max_anchors=6, steps=12, lr=1e-2, warmup=0.1, kl_weight=0.0,
                val_seqs=4, eval_every=6, ckpt_every=5, log_every=1, draft_vocab=0, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def read_log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"loss"' in x]


# ---------------------------------------------------------------- objective
def test_mask_matches_dense_reference():
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(prompt_len=5, seq_len=40, max_anchors=7, gen=g)
    assert anchors.min() >= 5 and anchors.max() <= 38 and anchors.numel() == 7
    m = block_mask(anchors, ctx_len=40, block_size=4)
    ref = dense_reference_mask(anchors.tolist(), 40, 4)
    assert torch.equal(m, ref)
    for qi in range(m.shape[0]):  # no query sees its anchor's feature or any later position
        a = int(anchors[qi // 4])
        assert not m[qi, a:40].any() and m[qi, :a].all()


def test_block_inputs_labels_and_prev():
    ids = torch.arange(100, 120)
    tokens, pos, labels, prev = block_inputs(ids, torch.tensor([3, 17]), 4, mask_token_id=7)
    assert tokens.tolist() == [103, 7, 7, 7, 117, 7, 7, 7]
    assert pos.tolist() == [3, 4, 5, 6, 17, 18, 19, 20]
    assert labels.tolist() == [IGNORE, 104, 105, 106, IGNORE, 118, 119, IGNORE]  # 20 is past the end
    assert prev.tolist()[1:4] == [103, 104, 105]


def test_objective_ignores_other_blocks(env):
    """Changing one block's anchor token must not change another block's states (no cross-block leak)."""
    target = env["target"]
    cfg = config(env, "leak")
    tr = Trainer(cfg, target)
    s = tr.store.get(0)
    a = torch.tensor([s["prompt_len"], s["prompt_len"] + 6])
    d = tr.drafter
    T = s["ids"].numel()

    def states(ids):
        kv = d.context_kv(s["feats"].float(), torch.arange(T))
        tok, pos, _, _ = block_inputs(ids, a, 4, d.config.mask_token_id)
        emb = torch.nn.functional.embedding(tok, tr.obj.embed_weight)
        return d.forward_block(emb, pos, kv, block_mask(a, T, 4))

    ids2 = s["ids"].clone()
    ids2[a[1]] = (ids2[a[1]] + 1) % 50 + 2  # the second block's anchor token
    h1, h2 = states(s["ids"]), states(ids2)
    assert torch.allclose(h1[:4], h2[:4], atol=1e-6)
    assert not torch.allclose(h1[4:], h2[4:])


# ---------------------------------------------------------------- training
def test_features_then_training_loss_decreases(env):
    cfg = config(env, "run-a", steps=30, ckpt_every=100, eval_every=100)
    last = Trainer(cfg, env["target"]).fit()
    log = read_log(Path(cfg.out))
    first = sum(r["loss"] for r in log[:3]) / 3
    final = sum(r["loss"] for r in log[-3:]) / 3
    assert final < 0.8 * first, (first, final)
    assert last["step"] == 30 and len(last["acc"]) == 3
    meta = F.read_metadata(env["files"][0])
    assert json.loads(meta["layer_ids"]) == default_target_layer_ids(4, 2) == [1, 1]  # a 4-layer target


def test_gamma_weighs_training_and_validation_keeps_the_default(env):
    """--gamma sets the training loss's position decay; validation weighs with the default one."""
    from treeflash.training.objective import default_gamma, position_weights

    tr = Trainer(config(env, "gamma", gamma=2.0), env["target"])
    assert torch.equal(tr.obj.pos_w, position_weights(4, 2.0))
    assert torch.equal(tr.val_obj.pos_w, position_weights(4, default_gamma(4)))


def test_kill_and_resume_reproduces_next_loss(env):
    full = config(env, "full")
    Trainer(full, env["target"]).fit()
    ref = {r["step"]: r["loss"] for r in read_log(Path(full.out))}
    part = config(env, "part", max_minutes=1e-9)  # stops (with a checkpoint) after the first step
    Trainer(part, env["target"]).fit()
    st = json.loads((Path(part.out) / "last" / "state.json").read_text())
    assert st["step"] == 1
    vals = [json.loads(x) for x in (Path(part.out) / "log.jsonl").read_text().splitlines() if "val_loss" in x]
    assert [v["step"] for v in vals] == [1]  # the stop validated, so its step can be the best
    assert (Path(part.out) / "best" / "config.json").exists()
    Trainer(config(env, "part"), env["target"], resume=True).fit()
    got = {r["step"]: r["loss"] for r in read_log(Path(part.out))}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), k


def test_resume_checks_options_of_earlier_versions(env, capsys):
    """A checkpoint whose state.json records a removed option at its off value resumes; one that used
    it is a clear error, not a silent change of training; unknown keys are dropped with a warning."""
    from treeflash.training.trainer import REMOVED_OPTIONS

    old = config(env, "old-opts", max_minutes=1e-9)  # one step, then a checkpoint
    Trainer(old, env["target"]).fit()
    path = Path(old.out) / "last" / "state.json"
    st = json.loads(path.read_text())
    path.write_text(json.dumps({**st, "config": {**st["config"], **REMOVED_OPTIONS}}))
    assert Trainer(config(env, "old-opts", steps=2), env["target"], resume=True).fit()["step"] == 2
    for key, used in (("grow_layers", 2), ("short_blocks", 0.5)):
        st = json.loads(path.read_text())
        path.write_text(json.dumps({**st, "config": {**st["config"], **REMOVED_OPTIONS, key: used}}))
        with pytest.raises(TreeflashError, match=f"--{key.replace('_', '-')} {used}, which this version no longer has"):
            Trainer(config(env, "old-opts", steps=3), env["target"], resume=True)
    cfg = TrainConfig.from_dict({**st["config"], "grow_layers": 1})
    assert cfg.block_size == 4 and not hasattr(cfg, "grow_layers")
    assert "ignoring unknown training options grow_layers, short_blocks" in capsys.readouterr().err


def test_treeflash_freeze_body_trains_only_ar(env):
    base = config(env, "dflash", treeflash=False, steps=6)
    Trainer(base, env["target"]).fit()
    cfg = config(env, "mlp", init=str(Path(base.out) / "last" / "drafter"), freeze_body=True, steps=6)
    tr = Trainer(cfg, env["target"])
    before = {k: v.clone() for k, v in tr.drafter.model.state_dict().items()}
    tr.fit()
    after = tr.drafter.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert tr.drafter.ar_approximation.d.weight.abs().sum() > 0


def test_export_loads_in_engine(env, tmp_path):
    cfg = config(env, "exp", steps=2)
    Trainer(cfg, env["target"]).fit()
    out = export(Path(cfg.out) / "last", tmp_path / "drafter", env["target"])
    from treeflash import api
    from treeflash.models.drafter import load_drafter

    d = load_drafter(out)
    assert next(iter(d.state_dict().values())).dtype == torch.float32  # loaded as requested
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    eng = api.Engine(env["target"], d)
    r = eng.generate([5, 6, 7], method="treeflash", max_new_tokens=8, chat=False)
    plain = api.Engine(env["target"], None).generate([5, 6, 7], method="vanilla", max_new_tokens=8, chat=False)
    assert r.token_ids == plain.token_ids


# ---------------------------------------------------------------- DDP
def test_dist_timeout_reads_seconds_and_rejects_bad_values(monkeypatch):
    from datetime import timedelta

    from treeflash.training.trainer import dist_timeout

    monkeypatch.delenv("TREEFLASH_DIST_TIMEOUT_S", raising=False)
    assert dist_timeout() is None
    monkeypatch.setenv("TREEFLASH_DIST_TIMEOUT_S", "90")
    assert dist_timeout() == timedelta(seconds=90)
    for bad in ("0", "-5", "soon", "nan", "inf"):
        monkeypatch.setenv("TREEFLASH_DIST_TIMEOUT_S", bad)
        with pytest.raises(TreeflashError, match="TREEFLASH_DIST_TIMEOUT_S"):
            dist_timeout()


def run_bounded(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run a launcher (torchrun) to completion or for `timeout` s: (exit code or None, stderr). On
    timeout it gets SIGTERM (torchrun then stops its workers), then SIGKILL."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=timeout)
        return p.returncode, err
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        return None, f"timed out after {timeout:.0f} s\n{err}"


def test_torchrun_two_ranks_matches_one_process(env):
    args = ["train", "fit", "--target", str(env["tdir"]), "--features", *map(str, env["files"]),
            "--num-layers", "1", "--num-taps", "2", "--block-size", "4", "--batch-seqs", "4",
            "--max-anchors", "6", "--steps", "3", "--lr", "1e-2", "--kl-weight", "0.3", "--draft-vocab", "0", "--val-seqs", "0",
            "--log-every", "1", "--seed", "3"]
    envv = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    one = env["root"] / "ddp-1"
    two = env["root"] / "ddp-2"
    subprocess.run([sys.executable, "-m", "treeflash.cli", *args, "--out", str(one)], check=True, env=envv,
                   capture_output=True, timeout=300)
    # A rank of this 2-process gloo run can die by a signal (SIGABRT), and a launch can hang past
    # 300 s; it takes ~20 s. Every address is loopback (no hostname lookups), a stuck collective
    # fails after 60 s, a stuck launch is stopped after 150 s, and a second launch tells such a
    # launch failure from a real one, whose every attempt fails (each attempt's launcher and rank
    # stderr are shown).
    envv = {**envv, "GLOO_SOCKET_IFNAME": "lo", "TREEFLASH_DIST_TIMEOUT_S": "60"}
    reports, ok = [], False
    for attempt in range(3):
        logs = env["root"] / f"ddp-logs-{attempt}"
        shutil.rmtree(two, ignore_errors=True)
        # `python -m torch.distributed.run` is torchrun, from this interpreter (no PATH lookup)
        rc, err = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "--local-addr", "127.0.0.1", "--log-dir", str(logs), "--redirects", "3",
                               "-m", "treeflash.cli", *args, "--out", str(two)], envv, timeout=150)
        if rc == 0:
            ok = True
            break
        ranks = "\n".join(f"--- {p.relative_to(logs)}\n{p.read_text()[-1500:]}" for p in sorted(logs.rglob("stderr.log")))
        reports.append(f"attempt {attempt}: rc={rc}\n{err[-800:]}\n{ranks}")
    assert ok, "\n".join(reports)
    a, b = read_log(one), read_log(two)
    assert [x["step"] for x in a] == [x["step"] for x in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y["tokens"] == x["tokens"]


# ---------------------------------------------------------------- bad input
def run_cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treeflash.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_bad_config_values(env):
    for kw in ({"block_size": 1}, {"lr": -1.0}, {"warmup": 1.5}, {"kl_weight": 2.0}, {"freeze_body": True},
               {"gamma": -1.0}, {"gamma": float("nan")}):
        with pytest.raises(TreeflashError, match="bad config value"):
            config(env, "bad", **kw).check()
    r = run_cli("train", "fit", "--target", str(env["tdir"]), "--features", str(env["files"][0]),
                "--out", str(env["root"] / "bad-cli"), "--block-size", "0")
    assert r.returncode == 2 and r.stderr.startswith("error: bad config value") and "Traceback" not in r.stderr


def test_missing_shard_and_unwritable_out(env, tmp_path):
    r = run_cli("train", "fit", "--features", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "missing feature shard" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("train", "features", "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "f"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(TreeflashError, match="not writable"):
            Trainer(config(env, "x", out=str(ro / "run")), env["target"])
    finally:
        ro.chmod(0o700)


def test_unwritable_out_dir_is_a_file(env, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(TreeflashError, match="not writable"):
        Trainer(config(env, "x", out=str(f / "run")), env["target"])


def test_existing_checkpoint_not_overwritten(env):
    cfg = config(env, "keep", steps=2)
    Trainer(cfg, env["target"]).fit()
    ckpt = Path(cfg.out) / "last" / "drafter" / "model.safetensors"
    before = ckpt.read_bytes()
    with pytest.raises(TreeflashError, match="already holds a checkpoint"):
        Trainer(config(env, "keep", steps=4), env["target"])
    assert ckpt.read_bytes() == before


def test_target_drafter_mismatch(env, tmp_path):
    other = make_tiny_target_dir(tmp_path / "other", seed=1)
    from transformers import LlamaConfig

    c = LlamaConfig.from_pretrained(str(other))
    c.hidden_size, c.intermediate_size = 48, 96
    from transformers import LlamaForCausalLM
    LlamaForCausalLM(c).save_pretrained(str(other))
    big = Target.load(str(other))
    cfg = config(env, "mm", steps=2)
    Trainer(cfg, env["target"]).fit()
    with pytest.raises(TreeflashError, match="hidden size"):
        Trainer(config(env, "mm2", init=str(Path(cfg.out) / "last" / "drafter")), big)
    with pytest.raises(TreeflashError, match="cached for layers"):  # features of another tap set
        Trainer(config(env, "mm3", num_taps=3), env["target"])


def test_corrupt_feature_shard(env, tmp_path):
    bad = tmp_path / "feat-00000.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(TreeflashError, match="corrupt"):
        Trainer(config(env, "corrupt", features=[str(bad)]), env["target"])


def test_target_labels_are_target_greedy_choices(env):
    from treeflash.models.drafter_config import default_target_layer_ids

    store = F.FeatureStore(env["files"], default_target_layer_ids(4, 2), 32, target_labels=True)
    raw = F.FeatureStore(env["files"], default_target_layer_ids(4, 2), 32)
    s, r = store.get(3), raw.get(3)
    assert torch.equal(s["ids"], r["ids"])  # the data tokens are kept (the blocks' anchors)
    assert torch.equal(s["pred"][1:], r["top_idx"][:-1, 0].long())  # labels: the target's top-1


def test_target_labels_stop_where_data_leaves_the_greedy_path():
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    pred = torch.tensor([0, 6, 7, 40, 9, 10, 11, 12])  # the data disagrees with the target at position 3
    _, _, labels, prev = block_inputs(ids, torch.tensor([1, 4]), 4, 99, pred)
    # block at 1: k=1 -> pred[2]=7, k=2 -> pred[3]=40 (positions 2 agrees), k=3 -> IGNORE (3 disagrees)
    assert labels.tolist() == [IGNORE, 7, 40, IGNORE, IGNORE, 10, 11, 12]
    assert prev.tolist() == [5, 6, 7, 8, 8, 9, 10, 11]  # data tokens (teacher forcing)


def test_draft_vocab_negatives_are_outside_and_deterministic(env):
    cfg = config(env, "neg", draft_vocab=16, negatives=8)
    tr = Trainer(cfg, env["target"])
    obj = tr.obj
    assert obj.vocab.numel() >= 16 and obj.head_weight.shape[0] == obj.vocab.numel()
    obj.set_negatives(5)
    rows_a = obj.head_weight.clone()
    obj.set_negatives(5)
    assert torch.equal(rows_a, obj.head_weight) and rows_a.shape[0] == obj.vocab.numel() + 8
    vocab_rows = obj.full_head[obj.vocab]
    assert torch.equal(rows_a[:obj.vocab.numel()], vocab_rows)
    neg = rows_a[obj.vocab.numel():]  # none of the negatives is a draft-vocabulary row
    assert not (neg[:, None, :] == vocab_rows[None, :, :]).all(-1).any()
    last = tr.fit()  # and training with a draft vocabulary runs; validation uses the full vocabulary
    assert "val_acc" in last


def test_fine_tune_keeps_the_init_drafters_draft_vocab(env):
    """`--init DRAFTER` with a draft vocabulary of the same size keeps the drafter's own columns (a
    recount on a narrow mix would drop tokens it already predicts); another size recounts."""
    from safetensors.torch import save_file
    from treeflash.models.drafter_io import DRAFT_VOCAB_NAME, save_drafter

    src = Trainer(config(env, "vsrc", draft_vocab=16), env["target"])
    init = env["root"] / "vinit"
    save_drafter(src.drafter, init)
    V = env["target"].vocab_rows
    own = torch.arange(V - 16, V, dtype=torch.long)  # not the frequency-counted columns
    assert not torch.equal(own, src.draft_vocab)
    save_file({"token_ids": own}, str(init / DRAFT_VOCAB_NAME))
    kept = Trainer(config(env, "vkeep", draft_vocab=16, init=str(init)), env["target"])
    assert torch.equal(kept.draft_vocab, own) and torch.equal(kept.obj.vocab, own)
    recount = Trainer(config(env, "vnew", draft_vocab=12, init=str(init)), env["target"])
    fresh = Trainer(config(env, "vfresh", draft_vocab=12), env["target"])
    assert torch.equal(recount.draft_vocab, fresh.draft_vocab)


def test_tau_compares_drafters_in_one_run(tmp_path, capsys):
    """`train tau --drafter A,B`: both drafters on one target, interleaved, one labelled row each."""
    from treeflash.cli import main
    from treeflash.models import registry

    shipped = registry.resolve_drafter(None, "smollm2-135m")
    out = tmp_path / "tau.json"
    assert main(["train", "tau", "--drafter", f"{shipped},random", "--sets", "gsm8k", "-n", "1",
                 "--max-new-tokens", "24", "--methods", "vanilla,treeflash", "--tree-size", "4",
                 "--dtype", "float32", "--block-len", "0,8", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["gsm8k"]
    name = Path(shipped).name
    assert set(rows) == {"vanilla", f"{name}/treeflash@4", "random/treeflash@4", f"{name}/treeflash@4/8",
                         "random/treeflash@4/8"}
    assert rows["vanilla"]["tau"] == 1.0
    assert rows[f"{Path(shipped).name}/treeflash@4"]["tau"] > rows["random/treeflash@4"]["tau"]
    for r in rows.values():  # the copy-step split recombines into tau
        parts = [(r["copy_step_share"], r["tau_copy_steps"]), (1 - r["copy_step_share"], r["tau_other_steps"])]
        assert sum(w * t for w, t in parts if t is not None) == pytest.approx(r["tau"], abs=2e-3)
    assert main(["train", "tau", "--drafter", "random,random", "--sets", "gsm8k"]) == 2
    assert "listed twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: a usage line and exit code 2
        main(["train", "tau", "--block-len", "3,1"])
    assert e.value.code == 2 and "block lengths must be 0" in capsys.readouterr().err


def test_with_ar_keeps_the_draft_vocab():
    """The drafter that `--init` turns into (a TreeFlash head added) proposes from the same columns
    as the one loaded, so a fine-tune can keep its draft vocabulary."""
    from conftest import tiny_drafter, tiny_target
    from treeflash.models.drafter import Drafter
    from treeflash.models.drafter_config import DrafterConfig
    from treeflash.training.trainer import with_ar

    target = tiny_target("llama")
    cfg = DrafterConfig.from_dict(tiny_drafter(target).config.to_dict())
    cfg.ar_approximation = None
    plain = Drafter(cfg).init_weights(0)
    plain.draft_vocab = torch.tensor([3, 5, 8, 13])
    new = with_ar(plain, 0)
    assert new is not plain and torch.equal(new.draft_vocab, plain.draft_vocab)


def test_tau_prompts_are_the_bench_prompts(capsys):
    """`train tau --sets NAME` measures on exactly the prompts `treeflash bench --datasets NAME`
    samples, worded as it words them, under the bench's dataset names (`bench:NAME` still accepted)."""
    from treeflash.datasets import humaneval_instruction, sample_prompts
    from treeflash.cli import main
    from treeflash.training.cli import load_prompts

    for name in ("humaneval", "mt-bench"):
        bench = [s.turns for s in sample_prompts(name, 3)]
        assert load_prompts(name, 3) == load_prompts(f"bench:{name}", 3) == bench
    first = sample_prompts("humaneval", 1)[0]
    assert load_prompts("humaneval", 1)[0][0] == humaneval_instruction(first.meta["problem"]["prompt"])
    for bad in ("nope", "mtbench"):
        assert main(["train", "tau", "--sets", bad]) == 2
        err = capsys.readouterr().err
        assert f"unknown dataset '{bad}'" in err and "mt-bench" in err and err.count("\n") == 1


def test_ranks_talk_over_gloo_where_a_gpu_is_seen_too(monkeypatch):
    """Training keeps its tensors on the CPU: the process group must be gloo even when torch sees a
    GPU (nccl cannot reduce CPU tensors)."""
    import torch.distributed as dist

    from treeflash.training import trainer

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert trainer.dist_env() == (1, 2) and seen["backend"] == "gloo"


def test_ar_size_sets_the_treeflash_heads_width(env, tmp_path):
    """--ar-size: the TreeFlash head's hidden size (default: the target's MLP size), kept by export
    and load; a negative size is refused."""
    from treeflash.models.drafter import load_drafter
    from treeflash.training.trainer import build_drafter

    small = build_drafter(config(env, "ar", ar_size=24), env["target"])
    assert small.ar_approximation.d.weight.shape[1] == 24
    default = build_drafter(config(env, "ar0"), env["target"])
    assert default.ar_approximation.d.weight.shape[1] == env["target"].config.intermediate_size
    small.save(tmp_path / "d")
    assert load_drafter(tmp_path / "d").config.ar_size == 24
    with pytest.raises(TreeflashError, match="ar_size"):
        config(env, "bad", ar_size=-1).check()
