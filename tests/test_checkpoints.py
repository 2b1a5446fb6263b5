"""Published DFlash / TreeFlash checkpoints: load, forward parity with the published math, export.

Synthetic checkpoints are written here with the published tensor names and config fields
(z-lab `DFlashDraftModel`: top-level names; TreeFlash `TreeFlashDraftModel`: `model.` prefix plus
`ar_approximation.*`), with random weights. `ref_*` below re-implement the published forward
directly (one pass over [context; block], explicit softmax attention), independent of our modules.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

from treeflash.cli import main
from treeflash.errors import TreeflashError
from treeflash.models.drafter import Drafter, load_drafter
from treeflash.models.kvcache import DraftCache
from treeflash.models.drafter_config import QWEN3_DEFAULTS, DrafterConfig, check_fits, default_target_layer_ids
from treeflash.models.target import Target

H, NH, NKV, HD, INTER = 64, 4, 2, 32, 96  # head_dim 32 != H / NH on purpose
N_LAYERS, TARGET_LAYERS, VOCAB, MASK, BLOCK = 2, 6, 160, 150, 6
TAPS = [1, 3, 4]
EPS, THETA = 1e-5, 1_000_000.0  # eps != the AR norm's fixed 1e-6 on purpose

# ---------------------------------------------------------------- synthetic published checkpoints


def published_config(treeflash: bool) -> dict:
    """config.json fields as in z-lab/Qwen3-8B-DFlash-b16 (and the TreeFlash repos), tiny sizes."""
    cfg = {
        "architectures": ["TreeFlashDraftModel" if treeflash else "DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
        "block_size": BLOCK, "bos_token_id": 1, "eos_token_id": 2,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TAPS},
        "dtype": "float32", "head_dim": HD, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": 0.02, "intermediate_size": INTER,
        "layer_types": ["full_attention"] * N_LAYERS, "max_position_embeddings": 4096,
        "max_window_layers": N_LAYERS, "num_attention_heads": NH, "num_hidden_layers": N_LAYERS,
        "num_key_value_heads": NKV, "num_target_layers": TARGET_LAYERS, "rms_norm_eps": EPS,
        "rope_scaling": None, "rope_theta": THETA, "sliding_window": None, "tie_word_embeddings": False,
        "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    if treeflash:
        cfg["treeflash_config"] = {"ar_approximation": "swiglu", "candidate_tokens": 16}
    return cfg


def published_weights(treeflash: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the published names (norm weights random too, so they matter)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1 + 0.3 * torch.randn(n, generator=g)

    body = {"fc.weight": w(H, len(TAPS) * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        body |= {p + "self_attn.q_proj.weight": w(NH * HD, H), p + "self_attn.k_proj.weight": w(NKV * HD, H),
                 p + "self_attn.v_proj.weight": w(NKV * HD, H), p + "self_attn.o_proj.weight": w(H, NH * HD),
                 p + "self_attn.q_norm.weight": norm(HD), p + "self_attn.k_norm.weight": norm(HD),
                 p + "mlp.gate_proj.weight": w(INTER, H), p + "mlp.up_proj.weight": w(INTER, H),
                 p + "mlp.down_proj.weight": w(H, INTER),
                 p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)}
    if not treeflash:
        return body
    ar = {"ar_approximation.ug.weight": w(2 * INTER, 2 * H), "ar_approximation.ug.bias": w(2 * INTER),
          "ar_approximation.d.weight": w(H, INTER, std=0.3), "ar_approximation.norm.weight": norm(H)}
    return {"model." + k: v for k, v in body.items()} | ar


def write_checkpoint(path, treeflash: bool, config: dict | None = None, weights: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or published_config(treeflash)))
    save_file(weights if weights is not None else published_weights(treeflash), str(path / "model.safetensors"))
    return path


# ---------------------------------------------------------------- the published math, written out


def ref_rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_rotate(x, pos):
    """RoPE (rotate-half) of x [T, heads, HD] at positions pos [T]."""
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2).float() / HD)
    ang = torch.cat([pos.float()[:, None] * inv, pos.float()[:, None] * inv], -1)[:, None, :]  # [T, 1, HD]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def ref_draft(W, target_hidden, noise, ctx_pos, blk_pos):
    """Published DFlashDraftModel.forward (pre-norm output): block queries attend to all of
    [context; block]; keys/values of both come from the same k/v projections and k_norm."""
    W = {k.removeprefix("model."): v for k, v in W.items()}
    ctx = ref_rms(target_hidden @ W["fc.weight"].T, W["hidden_norm.weight"], EPS)  # [C, H]
    pos = torch.cat([ctx_pos, blk_pos])
    h, B = noise, noise.shape[0]
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        x = ref_rms(h, W[p + "input_layernorm.weight"], EPS)
        q = ref_rms((x @ W[p + "self_attn.q_proj.weight"].T).view(B, NH, HD), W[p + "self_attn.q_norm.weight"], EPS)
        both = torch.cat([ctx, x])  # [C+B, H]
        k = ref_rms((both @ W[p + "self_attn.k_proj.weight"].T).view(-1, NKV, HD),
                    W[p + "self_attn.k_norm.weight"], EPS)
        v = (both @ W[p + "self_attn.v_proj.weight"].T).view(-1, NKV, HD)
        q, k = ref_rotate(q, blk_pos), ref_rotate(k, pos)
        k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(B, NH * HD)
        h = h + o @ W[p + "self_attn.o_proj.weight"].T
        x = ref_rms(h, W[p + "post_attention_layernorm.weight"], EPS)
        h = h + (F.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)) \
            @ W[p + "mlp.down_proj.weight"].T
    return h


def ref_corrected(W, h, prev_emb):
    """Published TreeFlash: norm(h + d(silu(g) * u)), [u, g] = ug([norm_1e-6(prev), norm(h)])."""
    final = W["model.norm.weight"]
    inp = torch.cat([ref_rms(prev_emb, W["ar_approximation.norm.weight"], 1e-6), ref_rms(h, final, EPS)], -1)
    u, g = (inp @ W["ar_approximation.ug.weight"].T + W["ar_approximation.ug.bias"]).chunk(2, -1)
    return ref_rms(h + (F.silu(g) * u) @ W["ar_approximation.d.weight"].T, final, EPS)


def inputs(seed=5, C=7):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(C, len(TAPS) * H, generator=g)  # [C, taps*H]
    # token embeddings are small in real models (rms ~0.01-0.05), which makes norm eps matter
    noise = 0.02 * torch.randn(BLOCK, H, generator=g)  # [B, H]
    prev = 0.01 * torch.randn(BLOCK - 1, H, generator=g)  # [B-1, H] embeddings of chosen previous tokens
    return feats, noise, prev, torch.arange(C), torch.arange(C, C + BLOCK)


def ours(d: Drafter, feats, noise, ctx_pos, blk_pos):
    return d.forward_block(noise, blk_pos, d.context_kv(feats, ctx_pos))  # [B, H] pre-norm


# ---------------------------------------------------------------- parity with the published math


@pytest.mark.parametrize("treeflash", [False, True], ids=["dflash", "treeflash"])
def test_published_checkpoint_matches_published_math(tmp_path, treeflash):
    path = write_checkpoint(tmp_path / "ckpt", treeflash)
    d = load_drafter(path)
    W = published_weights(treeflash)
    feats, noise, prev, cpos, bpos = inputs()
    with torch.no_grad():
        h = ours(d, feats, noise, cpos, bpos)
        ref_h = ref_draft(W, feats, noise, cpos, bpos)
        torch.testing.assert_close(d.model.norm(h), ref_rms(ref_h, W["model.norm.weight" if treeflash
                                                                    else "norm.weight"], EPS),
                                   atol=1e-5, rtol=1e-5)
        if treeflash:
            got = d.corrected(h[1:], prev)
            want = ref_corrected(W, ref_h[1:], prev)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert (got - d.model.norm(h[1:])).abs().max() > 1e-2  # the correction is not a no-op
    assert (d.ar_approximation is not None) == treeflash


def test_cached_context_in_steps_matches_one_pass(tmp_path):
    """Context fed in two chunks through the draft cache (as decoding does) = the one-pass forward."""
    W = published_weights(True)
    d = load_drafter(write_checkpoint(tmp_path / "ckpt", True))
    feats, noise, _, cpos, bpos = inputs(C=9)
    cache = DraftCache(N_LAYERS)
    with torch.no_grad():
        d.extend(cache, feats[:4], cpos[:4])
        d.extend(cache, feats[4:], cpos[4:])
        h = d.draft(cache, noise, start=int(bpos[0]))
        torch.testing.assert_close(h, ref_draft(W, feats, noise, cpos, bpos), atol=1e-5, rtol=1e-5)


def test_target_taps_are_dflash_hidden_states_offset_by_one():
    """DFlash reads hidden_states[layer_id + 1] (the output of decoder layer layer_id); so do our taps."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER,
                                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16)).eval()
    target = Target(model, StubTokenizer(VOCAB))
    target.set_taps(TAPS)
    ids = torch.tensor([3, 9, 27, 81, 5])
    _, feats = target.forward(ids, torch.arange(5), target.new_cache())
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats, torch.cat([hs[i + 1][0] for i in TAPS], -1))


# ---------------------------------------------------------------- config fields and defaults


def test_published_config_fields():
    cfg = DrafterConfig.from_dict(published_config(True))
    assert (cfg.mask_token_id, cfg.block_size, cfg.target_layer_ids, cfg.num_target_layers) == \
        (MASK, BLOCK, TAPS, TARGET_LAYERS)
    assert (cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta, cfg.ar_approximation, cfg.candidate_tokens) == \
        (HD, EPS, THETA, "swiglu", 16)
    assert DrafterConfig.from_dict(published_config(False)).ar_approximation is None


def test_defaults_follow_the_published_loaders():
    # the Qwen3-8B DFlash drafter: 5 layers over a 36-layer target -> its published taps
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(24, 1) == [12]
    d = published_config(False)
    for key in ("head_dim", "rope_theta", "rms_norm_eps", "layer_types"):
        d.pop(key)
    d["dflash_config"] = {"mask_token_id": MASK}  # no target_layer_ids: the DFlash rule
    d["dflash_config"]["block_size"] = 8  # newer configs keep block_size here
    cfg = DrafterConfig.from_dict(d)
    qwen3 = Qwen3Config()  # what the published trust_remote_code loader builds
    assert (cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps) == \
        (qwen3.head_dim, qwen3.rope_parameters["rope_theta"], qwen3.rms_norm_eps)
    assert cfg.target_layer_ids == default_target_layer_ids(TARGET_LAYERS, N_LAYERS) and cfg.block_size == 8
    assert all(getattr(qwen3, k) == v for k, v in QWEN3_DEFAULTS.items() if k != "rope_theta")


# ---------------------------------------------------------------- export and round trips


def our_drafter(treeflash=True, seed=3) -> Drafter:
    cfg = DrafterConfig.from_dict(published_config(treeflash))
    d = Drafter(cfg).init_weights(seed, std=0.1)
    if treeflash:
        torch.nn.init.normal_(d.ar_approximation.d.weight, std=0.3, generator=torch.Generator().manual_seed(seed))
    return d.eval()


@pytest.mark.parametrize("fmt", ["dflash", "treeflash"])
def test_export_then_load_gives_identical_outputs(tmp_path, fmt):
    d = our_drafter(treeflash=True)
    d.save(tmp_path / fmt, dtype=torch.float32, fmt=fmt)
    e = load_drafter(tmp_path / fmt)
    feats, noise, prev, cpos, bpos = inputs()
    with torch.no_grad():
        h, h2 = ours(d, feats, noise, cpos, bpos), ours(e, feats, noise, cpos, bpos)
        assert torch.equal(h, h2)
        if fmt == "treeflash":
            assert torch.equal(d.corrected(h, torch.zeros_like(h)), e.corrected(h2, torch.zeros_like(h2)))
        else:
            assert e.ar_approximation is None  # the DFlash format carries no AR part
    assert e.config.to_dict(fmt) == {**d.config.to_dict(fmt), "dtype": "float32"}


def test_dflash_export_has_the_published_layout(tmp_path):
    from safetensors import safe_open

    our_drafter(treeflash=True).save(tmp_path / "out", fmt="dflash")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert names == set(published_weights(False))  # top-level names, no AR-approximation
    assert dtypes == {torch.bfloat16}
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and "treeflash_config" not in cfg
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": TAPS}
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["dtype"]) == (BLOCK, TARGET_LAYERS, "bfloat16")
    hf = AutoConfig.from_pretrained(str(tmp_path / "out"))  # what HF-style loaders build first
    assert isinstance(hf, Qwen3Config) and hf.dflash_config["mask_token_id"] == MASK
    assert (hf.head_dim, hf.num_hidden_layers, hf.block_size) == (HD, N_LAYERS, BLOCK)


def test_treeflash_export_names(tmp_path):
    our_drafter(treeflash=True).save(tmp_path / "out", fmt="treeflash")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(published_weights(True))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["TreeFlashDraftModel"]
    assert cfg["treeflash_config"] == {"ar_approximation": "swiglu", "candidate_tokens": 16}


def test_sharded_checkpoint_with_index_loads(tmp_path):
    W = {k: v.to(torch.bfloat16) for k, v in published_weights(True).items()}  # as published: BF16
    path = tmp_path / "sharded"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(published_config(True)))
    names = sorted(W)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: W[k] for k in keys}, str(path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    d = load_drafter(path)
    Wf = {k: v.float() for k, v in W.items()}
    feats, noise, prev, cpos, bpos = inputs()
    with torch.no_grad():
        h = ours(d, feats, noise, cpos, bpos)
        torch.testing.assert_close(h, ref_draft(Wf, feats, noise, cpos, bpos), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.corrected(h[1:], prev), ref_corrected(Wf, h[1:], prev), atol=1e-5, rtol=1e-5)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(TreeflashError, match="model-00002-of-00002.safetensors"):
        load_drafter(path)


# ---------------------------------------------------------------- clear errors


def target_config(**kw) -> Qwen3Config:
    base = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=TARGET_LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen3Config(**(base | kw))


def test_fitting_target_passes():
    check_fits(DrafterConfig.from_dict(published_config(True)), target_config(), VOCAB)


@pytest.mark.parametrize("target_kw, vocab, cfg_edit, message", [
    ({"hidden_size": 128}, VOCAB, None, "hidden size 64 does not match the target's 128"),
    ({}, VOCAB + 64, None, f"vocabulary {VOCAB} does not match the target's {VOCAB + 64}"),
    ({"num_hidden_layers": 8}, VOCAB, None, "built for 6 target layers; the target has 8"),
    ({"num_hidden_layers": 4}, VOCAB, lambda d: d.pop("num_target_layers"), r"target_layer_ids \[4\] out of range"),
    ({}, VOCAB, lambda d: d["dflash_config"].update(mask_token_id=VOCAB), "mask_token_id 160 outside"),
])
def test_target_mismatch_errors(target_kw, vocab, cfg_edit, message):
    d = published_config(True)
    if cfg_edit:
        cfg_edit(d)
    with pytest.raises(TreeflashError, match=message):
        check_fits(DrafterConfig.from_dict(d), target_config(**target_kw), vocab)


def _drop(name):
    return lambda w: w.pop(name)


@pytest.mark.parametrize("treeflash, edit_weights, edit_config, message", [
    (True, _drop("ar_approximation.d.weight"), None, r"missing tensors ar_approximation\.d\.weight"),
    (False, lambda w: w.update({"lm_head.weight": torch.zeros(VOCAB, H)}), None,
     r"unexpected tensors model\.lm_head\.weight"),
    (False, lambda w: w.update({"ar_approximation.d.weight": torch.zeros(H, INTER)}), None,
     "without treeflash_config"),
    (False, lambda w: w.update({"fc.weight": torch.zeros(H, 2 * H)}), None, r"fc\.weight has shape \(64, 128\)"),
    (False, None, lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id is missing"),
    (False, None, lambda c: c.update(architectures=["DFlash2DraftModel"]), "unsupported drafter architecture"),
    (False, None, lambda c: c.update(layer_types=["sliding_attention"] * N_LAYERS, sliding_window=64),
     "only non-causal full attention"),
    (False, None, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE type 'yarn'"),
    (False, None, lambda c: c["dflash_config"].update(final_logit_softcapping=20.0), "final_logit_softcapping"),
    (False, None, lambda c: c.update(num_hidden_layers="two"), "invalid field"),
])
def test_checkpoint_errors(tmp_path, treeflash, edit_weights, edit_config, message):
    w, c = published_weights(treeflash), published_config(treeflash)
    if edit_weights:
        edit_weights(w)
    if edit_config:
        edit_config(c)
    path = write_checkpoint(tmp_path / "bad", treeflash, config=c, weights=w)
    with pytest.raises(TreeflashError, match=message):
        load_drafter(path)


def test_corrupt_files(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", False)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(TreeflashError, match="corrupt safetensors file"):
        load_drafter(path)
    (path / "config.json").write_text("{\"hidden_size\": 64,")
    with pytest.raises(TreeflashError, match="not valid JSON"):
        load_drafter(path)
    (path / "config.json").unlink()
    with pytest.raises(TreeflashError, match="missing config.json"):
        load_drafter(path)


# ---------------------------------------------------------------- the CLI and the engine


def test_cli_export(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "published", True)
    out = tmp_path / "out"
    assert main(["export", str(out), "--drafter", str(src), "--dtype", "float32"]) == 0
    assert "speculative-algorithm DFLASH" in capsys.readouterr().out
    assert set(load_drafter(out).state_dict()) == {"model." + k for k in published_weights(False)}
    assert main(["export", str(out), "--drafter", str(src)]) == 2  # no silent overwrite
    assert "pass --force" in capsys.readouterr().err
    assert main(["export", str(out), "--drafter", str(src), "--format", "treeflash", "--force"]) == 0
    assert load_drafter(out).ar_approximation is not None
    dflash_only = write_checkpoint(tmp_path / "dflash", False)
    assert main(["export", str(tmp_path / "o2"), "--drafter", str(dflash_only), "--format", "treeflash"]) == 2
    assert "has no TreeFlash AR-approximation" in capsys.readouterr().err


def test_cli_export_checks_the_target(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "published", False)
    tdir = tmp_path / "target"
    Qwen3ForCausalLM(target_config(num_hidden_layers=8)).save_pretrained(str(tdir))
    assert main(["export", str(tmp_path / "out"), "--drafter", str(src), "--target", str(tdir)]) == 2
    assert "built for 6 target layers; the target has 8" in capsys.readouterr().err


class StubTokenizer:
    """Token-id prompts only; the attributes the engine reads."""

    chat_template = None
    eos_token_id = bos_token_id = pad_token_id = unk_token_id = None
    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}

    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return self.vocab


@pytest.mark.parametrize("method", ["chain", "treeflash"])
def test_published_checkpoint_drafts_losslessly_in_the_engine(tmp_path, method):
    from treeflash.api import Engine

    torch.manual_seed(1)
    model = Qwen3ForCausalLM(target_config(eos_token_id=None, bos_token_id=None, pad_token_id=None)).eval()
    engine = Engine(Target(model, StubTokenizer(VOCAB)), load_drafter(write_checkpoint(tmp_path / "c", True)))
    prompt = [5, 17, 33, 2, 99, 41]
    want = list(engine.tokens(prompt, method="vanilla", max_new_tokens=24, chat=False))
    got = list(engine.tokens(prompt, method=method, max_new_tokens=24, chat=False, tree_size=8, top_m=3, top_k=3))
    assert got == want and len(got) == 24


def test_draft_vocabulary_round_trips_restricts_proposals_and_rejects_bad_files(tmp_path):
    """A drafter's draft vocabulary (draft_vocab.safetensors) limits what it proposes, never what
    the target verifies; a damaged file is a clear error."""
    from safetensors.torch import save_file

    from treeflash.decoding.proposers import TreeParams, make_proposer
    from treeflash.errors import TreeflashError
    from treeflash.models.kvcache import DraftCache
    from treeflash.models.drafter import load_drafter
    from treeflash.models.drafter_io import DRAFT_VOCAB_NAME
    from conftest import block_states, run, tiny_drafter, tiny_target, vanilla

    target = tiny_target("llama", logit_scale=3.0)
    d = tiny_drafter(target)
    vocab = torch.arange(0, 128, 3)  # every third token
    d.draft_vocab = vocab
    d.save(tmp_path / "d", dtype=None)
    loaded = load_drafter(tmp_path / "d")
    assert torch.equal(loaded.draft_vocab, vocab)
    p = make_proposer("marginal", loaded, target.embed, target.lm_head, TreeParams(12))
    cache = DraftCache(1)
    loaded.extend(cache, torch.randn(6, 2 * 64), torch.arange(6))
    tree = p.propose(5, 6, 7, states=block_states(p, cache, 5, 6, p.block_depth(7)))
    assert len(tree) == 12 and all(int(t) % 3 == 0 for t in tree.tokens[1:])
    full = make_proposer("marginal", loaded, target.embed, target.lm_head, TreeParams(12, draft_vocab=False))
    assert any(int(t) % 3 for t in full.propose(5, 6, 7, states=block_states(full, cache, 5, 6, full.block_depth(7))).tokens[1:])
    prompt = list(range(3, 30, 2))
    assert run(target, p, prompt, 24) == vanilla(target, prompt, 24)  # still lossless

    save_file({"token_ids": torch.tensor([1, 500])}, str(tmp_path / "d" / DRAFT_VOCAB_NAME))
    with pytest.raises(TreeflashError, match="outside the vocabulary"):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / DRAFT_VOCAB_NAME).write_bytes(b"junk")
    with pytest.raises(TreeflashError, match="unreadable"):
        load_drafter(tmp_path / "d")


def test_default_tap_layers_are_in_range_for_every_depth():
    """DFlash's rule (layer 1 .. L-3) must not index outside shallow targets (it gave -1 for L=2)."""
    from treeflash.models.drafter_config import default_target_layer_ids

    assert default_target_layer_ids(30, 4) == [1, 10, 18, 27]  # the shipped drafter's taps
    for L in range(1, 41):
        for taps in range(1, 6):
            ids = default_target_layer_ids(L, taps)
            assert len(ids) == taps and all(0 <= i < L for i in ids) and ids == sorted(ids), (L, taps, ids)


def test_factored_correction_and_prev_table_match_the_plain_correction():
    """The inference split of the AR correction (state half per position, previous-token half from
    a per-token table) computes the same corrected states as `Drafter.corrected`, and the table
    follows weight updates."""
    from treeflash.decoding.heads import DraftHeads
    from treeflash.decoding.proposers import TreeParams, make_proposer
    from conftest import block_states, tiny_drafter, tiny_target

    torch.manual_seed(0)
    target = tiny_target("llama")
    d = tiny_drafter(target)
    with torch.no_grad():
        d.ar_approximation.d.weight.normal_(0, 0.2)  # a non-trivial correction
    d.draft_vocab = torch.arange(0, 128, 2)
    h = torch.randn(4, 64)                     # [P, H] pre-norm states
    row_pos = torch.tensor([0, 1, 1, 2, 3, 3])  # [R]
    prev = torch.tensor([5, 8, 10, 3, 7, 2])    # [R] previous tokens
    heads = DraftHeads(d, target.embed, target.lm_head)
    with torch.no_grad():
        want = d.corrected(h[row_pos], target.embed(prev))
        assert (want - d.model.norm(h[row_pos])).abs().max() > 1e-2
        got = heads.corrected_states(h, row_pos, d.ar_approximation.prev_part(target.embed(prev)))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        table = heads.prev_table()           # [Vd, 2A]
        cols = torch.tensor([4, 5, 1, 3])    # tokens 8, 10, 2, 6
        torch.testing.assert_close(table[cols], d.ar_approximation.prev_part(target.embed(d.draft_vocab[cols])))
        d.ar_approximation.ug.weight.mul_(2)  # an in-place update (as an optimizer step)
        torch.testing.assert_close(heads.prev_table()[cols],
                                   d.ar_approximation.prev_part(target.embed(d.draft_vocab[cols])))
        assert not torch.allclose(heads.prev_table()[cols], table[cols])
    # the proposer's table path and its lookup path build the same tree
    from treeflash.models.kvcache import DraftCache
    cache = DraftCache(1)
    d.extend(cache, torch.randn(6, 2 * 64), torch.arange(6))
    p = make_proposer("treeflash", d, target.embed, target.lm_head,
                      TreeParams(10, top_m=3, top_k=3, stage2_vocab=8))
    roots = (5, 6)  # 6 is in the draft vocabulary: the root's half comes from the table too
    trees = [p.propose(r, 6, 4, states=block_states(p, cache, r, 6, p.block_depth(4))) for r in roots]
    # over draft-vocabulary columns (the table's previous-token halves, the draft head's rows) stage 2
    # equals stage 2 over the same tokens' ids (halves computed per row, the LM head's rows)
    h, prev = torch.randn(5, 64), torch.arange(9).view(3, 3)  # [D+1, H], [D-1, m] columns (tokens 0, 2, ..)
    col_idx = torch.randint(0, 64, (4, 8))                     # [D, C] columns
    by_id = DraftHeads(d, target.embed, target.lm_head, draft_vocab=False)
    with torch.no_grad():
        torch.testing.assert_close(p.draft_heads.corrected(h, 6, prev, col_idx),
                                   by_id.corrected(h, 6, d.draft_vocab[prev], d.draft_vocab[col_idx]))
    p.draft_heads.PREV_TABLE_MAX_BYTES = 0  # no table: the previous-token half is computed per row
    assert p.draft_heads.prev_table() is None
    for r, tree in zip(roots, trees):
        again = p.propose(r, 6, 4, states=block_states(p, cache, r, 6, p.block_depth(4)))
        assert torch.equal(tree.tokens, again.tokens) and torch.equal(tree.parents, again.parents)


def test_engine_layout_exports_hold_only_the_model_and_are_world_readable(tmp_path):
    """--format dflash holds config.json + model.safetensors only (vLLM loads every *.safetensors of
    the folder and rejects unknown tensors such as the draft vocabulary's); the treeflash layout keeps
    the draft vocabulary for this engine; every file is 0644 whatever the umask."""
    import os
    import stat

    from treeflash.models.drafter import load_drafter
    from treeflash.models.drafter_io import DRAFT_VOCAB_NAME
    from conftest import tiny_drafter, tiny_target

    d = tiny_drafter(tiny_target("llama"))
    d.draft_vocab = torch.arange(0, 128, 2)
    old = os.umask(0o077)  # a strict umask must not make the weights unreadable to a server
    try:
        d.save(tmp_path / "tf", fmt="treeflash")
        d.save(tmp_path / "df", fmt="dflash")
    finally:
        os.umask(old)
    assert sorted(p.name for p in (tmp_path / "df").iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "tf" / DRAFT_VOCAB_NAME).exists()
    assert torch.equal(load_drafter(tmp_path / "tf").draft_vocab, d.draft_vocab)
    for p in [*(tmp_path / "df").iterdir(), *(tmp_path / "tf").iterdir()]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


def test_shipped_qwen_drafter_fits_qwen2_5_coder_0_5b():
    """The default drafter of `--target qwen2.5-coder-0.5b` is shipped, at most 50 MB, and fits the
    target's shape (Qwen2.5-Coder-0.5B-Instruct's config, no weights needed); it loads."""
    from transformers import Qwen2Config

    from treeflash.models import registry

    path = registry.resolve_drafter(None, "qwen2.5-coder-0.5b")
    assert path is not None and path == registry.resolve_drafter(None, "Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert (path / "model.safetensors").stat().st_size <= 50_000_000
    tcfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True)
    cfg = DrafterConfig.from_dict(json.loads((path / "config.json").read_text()))
    check_fits(cfg, tcfg, 151936)
    d = load_drafter(path)
    assert d.draft_vocab is not None and len(d.draft_vocab) <= 151936
