"""KV-cache compaction and tree attention against fresh causal forwards, on every backend.

References are the Hugging Face model's own full-sequence forward (independent of our paths)."""
import pytest
import torch

from treeflash.decoding.trees import marginal_tree
from treeflash.models.lazy_logits import LazyLogits

from conftest import tiny_drafter, tiny_target

def kv(cache):
    """[layers] of (keys, values) [1, Hkv, length, D]: the live part of any cache."""
    n = cache.length
    return [(k[:, :, :n], v[:, :, :n]) for k, v in cache.key_values()]


def hf_reference(target, seq):
    """Logits [T, V] and tap features [T, taps*H] of the HF model's own causal forward."""
    out = target.model(seq[None], output_hidden_states=True)
    hs = out.hidden_states  # embeddings, then the output of each layer
    feats = torch.cat([hs[i + 1][0] for i in target.tap_ids], -1) if target.tap_ids else None
    return out.logits[0].float(), feats


def deepest_path(tree) -> torch.Tensor:
    path, node = [], int(tree.depths.argmax())
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return torch.tensor(path[::-1])


@pytest.mark.parametrize("arch,backend", [("llama", "hf"), ("qwen3", "hf"), ("llama", "static"),
                                          ("qwen3", "static"), ("qwen3", "compiled")])  # compiling costs ~20 s
def test_compacted_cache_equals_fresh_forward(arch, backend):
    target = tiny_target(arch).set_backend(backend)
    target.set_taps([1, 2])
    prefix = torch.arange(5, 25)
    cache = target.new_cache(64)
    target.forward(prefix, torch.arange(len(prefix)), cache)
    start = len(prefix)
    tree = marginal_tree(int(prefix[-1]) + 1, torch.randn(4, 128).log_softmax(-1), 14)
    logits, feats = target.forward(tree.tokens, start + tree.depths, cache, tree.ancestor_mask())
    keep = deepest_path(tree)
    cache.compact(start, keep)

    seq = torch.cat([prefix, tree.tokens[keep]])
    fresh_cache = target.new_cache(64)
    target.forward(seq, torch.arange(len(seq)), fresh_cache)
    assert cache.length == fresh_cache.length == len(seq)
    for (ka, va), (kb, vb) in zip(kv(cache), kv(fresh_cache)):
        assert ka.shape == kb.shape
        torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-5)
    # the tree forward saw exactly the causal context of each path node
    ref_logits, ref_feats = hf_reference(target, seq)
    cache.compact(start, torch.arange(0))
    again, _ = target.forward(tree.tokens, start + tree.depths, cache, tree.ancestor_mask())
    assert len(again) == len(tree)
    # eagerly the LM head runs over the rows read only; compiled, it ran over every row in the step
    lazy = backend != "compiled"
    assert isinstance(again, LazyLogits) == lazy
    if lazy:
        assert not again.rows
    for i in keep.tolist():
        torch.testing.assert_close(again[i], logits[i], atol=1e-5, rtol=1e-5)
    if lazy:
        assert sorted(again.rows) == sorted(keep.tolist())
    torch.testing.assert_close(logits[keep], ref_logits[start:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[-1], logits[len(tree) - 1])
    torch.testing.assert_close(feats[keep], ref_feats[start:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_tree_logits_of_every_node_match_its_own_path(backend):
    """Sibling branches must not see each other (ancestor-only mask)."""
    target = tiny_target("qwen2").set_backend(backend)
    prefix = torch.arange(3, 13)
    cache = target.new_cache(32)
    target.forward(prefix, torch.arange(len(prefix)), cache)
    tree = marginal_tree(50, torch.randn(3, 128).log_softmax(-1), 10)
    logits, _ = target.forward(tree.tokens, len(prefix) + tree.depths, cache, tree.ancestor_mask())
    pars = tree.parents.tolist()
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.append(int(tree.tokens[node]))
            node = pars[node]
        seq = torch.cat([prefix, torch.tensor(path[::-1])])
        ref, _ = hf_reference(target, seq)
        torch.testing.assert_close(logits[i], ref[-1], atol=1e-4, rtol=1e-4)


def test_static_backend_rejects_unsupported_models_and_full_caches():
    from treeflash.errors import TreeflashError

    target = tiny_target("llama").set_backend("static")
    cache = target.new_cache(8)
    with pytest.raises(TreeflashError, match="full"):
        target.forward(torch.arange(cache.capacity + 1), torch.arange(cache.capacity + 1), cache)
    target.config.model_type = "gpt2"
    assert target.set_backend("auto").backend == "hf"
    with pytest.raises(TreeflashError, match="supports"):
        target.set_backend("static")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_long_bf16_prefill_computes_in_float32(arch, monkeypatch):
    """The upcast prefill of a bf16 target (CPUs without AMX) is closer to the float32 model than
    the bf16-computed one, stores bf16 keys, and returns bf16 states and features."""
    from treeflash.models import attention, cpu

    ref_target = tiny_target(arch)
    ref_target.model.to(torch.bfloat16).float()  # the float32 model of the same (bf16) weights
    ref_target.set_taps([1, 2])
    seq = torch.randint(0, 128, (cpu.UPCAST_MIN_ROWS + 6,), generator=torch.Generator().manual_seed(3))
    _, ref = ref_target.forward(seq, torch.arange(len(seq)), ref_target.new_cache(128))
    target = tiny_target(arch)
    target.model.to(torch.bfloat16)
    target.set_backend("static")
    target.set_taps([1, 2])
    errs = {}
    for upcast in (False, True):
        target.runner.upcast = upcast
        cache = target.new_cache(128)
        logits, feats = target.forward(seq, torch.arange(len(seq)), cache)
        assert feats.dtype == cache.k[0].dtype == torch.bfloat16
        errs[upcast] = (feats.float() - ref).abs().max().item()
    assert errs[True] < errs[False] / 2, errs
    # short sequences (decode steps) keep computing in bf16
    calls = []
    monkeypatch.setattr(attention.F, "linear", lambda x, w, b=None: calls.append(x.dtype) or torch.matmul(x, w.T))
    target.forward(seq[:3], torch.arange(len(seq), len(seq) + 3), cache)
    assert calls and set(calls) == {torch.bfloat16}  # no upcast
    assert cpu.upcast_pays(torch.float32, torch.device("cpu")) is False


def test_bf16_attention_computes_in_float32_where_bf16_is_emulated(monkeypatch):
    """On CPUs without AMX (`upcast_pays`) a bf16 target's attention gets float32 inputs (ATen's bf16
    CPU attention of one query row is several times slower there); elsewhere it stays bf16. The
    states it returns stay bf16 either way."""
    from treeflash.models import fastpath

    seen = []
    real = fastpath.F.scaled_dot_product_attention
    monkeypatch.setattr(fastpath.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or real(q, k, v, **kw))
    for pays in (True, False):
        monkeypatch.setattr(fastpath, "upcast_pays", lambda dtype, device, pays=pays: pays)
        target = tiny_target("llama", dtype=torch.bfloat16).set_backend("static")
        assert target.runner.attn_dtype == (torch.float32 if pays else None)
        seen.clear()
        cache = target.new_cache(32)
        logits, _ = target.forward(torch.tensor([3, 4, 5]), torch.arange(3), cache)
        logits, _ = target.forward(torch.tensor([6]), torch.tensor([3]), cache)
        want = torch.float32 if pays else torch.bfloat16
        assert seen and set(seen) == {(want,) * 3}
        assert cache.k[0].dtype == torch.bfloat16 and logits[0].dtype == torch.float32


def test_compiled_graphs_stay_with_their_own_instance():
    """Compiled steps guard only their arguments, not what they reach through `self`
    (`inductor.skip_guards_through_self`), so each compiled function keeps its own graphs
    (`compile_frozen`): two targets, then two drafters, of one architecture and dtype (the same code
    and argument shapes) each compute with their own frozen weights. Without the isolation the
    second instance silently runs the first one's graph."""
    from types import SimpleNamespace

    from treeflash.models import inductor

    names = ["self", "self.scaling", "self._modules['model']._parameters['weight']", "type(self).__mro__",
             "dict(type(self).__mro__[1].__dict__)", "cache", "cache.k[0]", "tap_ids", "G['self']", "self_x"]
    kept = inductor.skip_guards_through_self([SimpleNamespace(name=n) for n in names])
    assert kept == [False] * 5 + [True] * 5
    ids = torch.arange(5, 9)
    for seed in (0, 1):
        out = {}
        for backend in ("compiled", "static"):
            t = tiny_target("llama", seed=seed).set_backend(backend)
            cache = t.new_cache(64)
            t.forward(ids[:3], torch.arange(3), cache)
            out[backend] = t.forward(ids[3:], torch.arange(3, 4), cache)[0][0]
        torch.testing.assert_close(out["compiled"], out["static"], atol=1e-5, rtol=1e-5)
    target = tiny_target("llama")
    gen = torch.Generator().manual_seed(0)
    for seed in (1, 2):
        d = tiny_drafter(target, seed=seed)
        c = d.config
        kv = [tuple(torch.randn(c.num_key_value_heads, 6, c.head_dim, generator=gen) for _ in range(2))
              for _ in d.model.layers]
        block, pos = torch.randn(4, c.hidden_size, generator=gen), torch.arange(6, 10)
        with torch.no_grad():
            want = d.forward_block(block, pos, kv)
            d.compile_drafting(True)
            flat = [t for k_v in kv for t in k_v]  # k_0, v_0, k_1, ...: as `Drafter.draft` passes them
            torch.testing.assert_close(d._compiled_block(block, pos, *flat), want, atol=1e-5, rtol=1e-5)


def test_one_compiled_step_serves_every_capacity_and_attends_over_the_live_slots():
    """The compiled step's slot dimension is symbolic: a cache of another capacity runs the graphs
    already compiled (no compile inside a generation), and a step attends over the live slots and
    its own, rounded up to `WIDTH_STEP`, not over the whole cache. Logits equal the eager path's."""
    from torch._dynamo.utils import counters

    from treeflash.models.fastpath import WIDTH_STEP

    target, eager = tiny_target("llama").set_backend("compiled"), tiny_target("llama").set_backend("static")
    compiled_step, seen = target.runner._compiled_step, []

    def spy(taps):
        step = compiled_step(taps)

        def run(ids, pos, slots, mask, cache, tap_ids):
            seen.append((len(ids), mask.shape[1], cache.capacity))
            return step(ids, pos, slots, mask, cache, tap_ids)
        return run

    target.runner._compiled_step = spy
    prompt, tree_mask = torch.arange(5, 75), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    graphs = []
    for need in (64, 1000):
        caches = [t.new_cache(need) for t in (target, eager)]
        out = []
        for t, cache in zip((target, eager), caches):
            t.forward(prompt, torch.arange(70), cache)  # eager prefill
            one, _ = t.forward(torch.tensor([80]), torch.tensor([70]), cache)
            tree, _ = t.forward(torch.tensor([81, 82, 83]), torch.tensor([71, 72, 72]), cache, tree_mask)
            out.append(torch.stack([one[0]] + [tree[i] for i in range(3)]))
        torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    caps = [c for _, _, c in seen]
    assert caps[0] == caps[1] and caps[2] == caps[3] and caps[0] != caps[2]  # two capacities
    assert graphs[1] == graphs[0]  # the second capacity compiled nothing
    assert [(n, w) for n, w, _ in seen] == [(1, 2 * WIDTH_STEP), (3, 2 * WIDTH_STEP)] * 2  # 71 and 74 slots
    # the last slots of a cache: the width would be the whole cache, so the step runs eagerly
    cache, ref = target.new_cache(64), eager.new_cache(64)
    last = cache.capacity - 3
    for t, c in ((target, cache), (eager, ref)):
        t.forward(torch.arange(last) % 100, torch.arange(last), c)
    got, want = (t.forward(torch.tensor([81, 82, 83]), last + torch.tensor([0, 1, 1]), c, tree_mask)[0]
                 for t, c in ((target, cache), (eager, ref)))
    torch.testing.assert_close(torch.stack([got[i] for i in range(3)]), torch.stack([want[i] for i in range(3)]),
                               atol=1e-5, rtol=1e-5)
    assert len(seen) == 4 and counters["stats"]["unique_graphs"] == graphs[0]


def test_micro_gemm_table_keeps_the_4x24_block_off_multiples_of_4_rows():
    """The compiled-cpp backend edits inductor's AVX2 bf16 micro-kernel table: the 4 x 24 register
    block (it spills with 4 rows) stays the choice for 1-3 rows and is skipped for 4, 8, ... rows.
    The table is the same on every CPU, so this runs everywhere."""
    from treeflash.models import inductor

    assert inductor.compile_options(True)["max_autotune_gemm_backends"] == "CPP"  # applies the edit
    assert inductor.avoid_spilling_micro_gemm()
    from torch._inductor.codegen import cpp_micro_gemm  # after inductor's own import order (models/inductor.py)
    from torch._inductor.cpu_vec_isa import VecAVX2

    blocks = [c for configs in cpp_micro_gemm.micro_gemm_configs.values() for c in configs
              if c.vec_isa_cls is VecAVX2 and c.input_dtype == c.input2_dtype == torch.bfloat16
              and tuple(c.register_blocking) == (4, 24, 1)]
    assert blocks
    for c in blocks:
        assert [c.extra_check(c, m, 576, 576, 1, 2) for m in (1, 2, 3, 4, 5, 8, 64)] == \
            [True, True, True, False, True, False, False]
    others = [c for configs in cpp_micro_gemm.micro_gemm_configs.values() for c in configs
              if c.vec_isa_cls is VecAVX2 and c.input_dtype == c.input2_dtype == torch.bfloat16
              and tuple(c.register_blocking) == (4, 16, 1)]
    assert others and all(c.extra_check is None for c in others)  # the 4 x 16 block takes over


def test_small_tree_attention_stacks_the_query_heads_of_each_kv_head(monkeypatch):
    """Trees of 2-4 rows attend as Hkv heads of g*N rows (`FastPath._attend`); the result is each
    query head's own softmax attention over its KV head under the tree mask, computed here by hand in
    float64. The calls are recorded: 2-4 rows take the stacked form, 1 and 5+ rows the broadcast one."""
    from treeflash.models import fastpath

    runner = tiny_target("llama").set_backend("static").runner
    hq, hkv, d, width = 4, runner.n_kv, runner.head_dim, 11
    calls = []
    real = fastpath.F.scaled_dot_product_attention
    monkeypatch.setattr(fastpath.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append(tuple(q.shape)) or real(q, k, v, **kw))
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 4, 5):
        q = torch.randn(1, hq, n, d, dtype=torch.float64, generator=gen)
        k, v = (torch.randn(1, hkv, width, d, dtype=torch.float64, generator=gen) for _ in range(2))
        mask = torch.rand(n, width, generator=gen) > 0.4
        mask[:, 0] = True  # every row sees at least one slot
        calls.clear()
        out = runner._attend(q, k, v, mask, torch.float64)
        stacked = 1 < n <= fastpath.GROUPED_MAX_ROWS
        assert calls == [(1, hkv, hq // hkv * n, d) if stacked else (1, hq, n, d)]
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = (q[0, h] @ k[0, kv].T * runner.scaling).masked_fill(~mask, float("-inf"))
            want = scores.softmax(-1) @ v[0, kv]  # [N, D]
            assert (out[0, h] - want).abs().max().item() < 1e-12, (n, h)


def test_the_drafter_block_attends_with_the_query_heads_of_each_kv_head_stacked(monkeypatch):
    """Inference (no mask: every row sees the context and the block) runs Hkv heads of g*Q rows; in
    float64 it gives the training path's result (an all-visible mask, KV heads broadcast) to 1e-12."""
    from treeflash.models import drafter as drafter_mod

    d = tiny_drafter(tiny_target("llama")).double()
    attn = d.model.layers[0].self_attn
    assert attn.nh > attn.nkv, "the test needs grouped query heads"
    calls = []
    real = drafter_mod.F.scaled_dot_product_attention
    monkeypatch.setattr(drafter_mod.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append(tuple(q.shape)) or real(q, k, v, **kw))
    gen = torch.Generator().manual_seed(0)
    for Q in (1, 3, 8):
        x = torch.randn(Q, d.config.hidden_size, dtype=torch.float64, generator=gen)
        k, v = (torch.randn(attn.nkv, 13, attn.hd, dtype=torch.float64, generator=gen) for _ in range(2))
        cos, sin = d._rope(torch.arange(13, 13 + Q), torch.float64)
        calls.clear()
        out = attn(x, cos, sin, k, v)
        want = attn(x, cos, sin, k, v, torch.ones(Q, 13 + Q, dtype=torch.bool))
        assert calls == [(1, attn.nkv, attn.nh // attn.nkv * Q, attn.hd), (1, attn.nh, Q, attn.hd)]
        assert (out - want).abs().max().item() < 1e-12, Q


def test_a_long_context_extends_the_bf16_drafter_in_float32_where_bf16_is_emulated(monkeypatch):
    """A prompt's features (>= UPCAST_MIN_ROWS rows) enter a bf16 drafter's cache computed in float32
    where `upcast_pays` (bf16 stored: exactly the float32 drafter's keys/values, rounded); shorter
    extensions, and CPUs with native bf16, keep the bf16 computation."""
    import copy

    from treeflash.models import drafter as drafter_mod
    from treeflash.models.kvcache import DraftCache
    from treeflash.models.cpu import UPCAST_MIN_ROWS

    d = tiny_drafter(tiny_target("llama")).to(torch.bfloat16)
    d32 = copy.deepcopy(d).float()
    gen = torch.Generator().manual_seed(0)
    for rows in (UPCAST_MIN_ROWS, UPCAST_MIN_ROWS - 1):
        feats = torch.randn(rows, d.model.fc.in_features, generator=gen).to(torch.bfloat16)
        pos = torch.arange(rows)
        as_fp32 = [(k.bfloat16(), v.bfloat16()) for k, v in d32.context_kv(feats.float(), pos)]
        as_bf16 = d.context_kv(feats, pos)
        assert any(not torch.equal(a[0], b[0]) for a, b in zip(as_fp32, as_bf16))  # the paths differ
        for pays in (True, False):
            monkeypatch.setattr(drafter_mod, "upcast_pays", lambda dtype, device, pays=pays: pays)
            cache = DraftCache(len(d.model.layers))
            d.extend(cache, feats, pos)
            want = as_fp32 if pays and rows >= UPCAST_MIN_ROWS else as_bf16
            for i, (k, v) in enumerate(want):
                assert cache.k[i].dtype == torch.bfloat16
                assert torch.equal(cache.k[i], k) and torch.equal(cache.v[i], v), (rows, pays, i)


def test_hf_backend_passes_the_cache_under_the_name_the_decoder_takes(monkeypatch):
    """transformers before 5.24 calls the decoder's cache argument `past_key_values`; passed as `cache`
    it would vanish into **kwargs and every step after the prefill would run without its context."""
    target = tiny_target("llama").set_backend("hf")
    decoder = target.model.get_decoder()
    new_style = decoder.forward

    def old_style(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  inputs_embeds=None, use_cache=None, **kwargs):
        return new_style(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)

    monkeypatch.setattr(decoder, "forward", old_style)
    target._runners.clear()
    target.set_backend("hf")
    seq = torch.arange(5, 25)
    cache = target.new_cache(64)
    target.forward(seq[:-1], torch.arange(len(seq) - 1), cache)
    logits, _ = target.forward(seq[-1:], torch.tensor([len(seq) - 1]), cache)
    assert cache.length == len(seq)
    ref, _ = hf_reference(target, seq)
    torch.testing.assert_close(logits[0].float(), ref[-1], atol=1e-4, rtol=1e-4)


def test_lazy_logits_of_a_large_head_read_it_once_for_all_rows(monkeypatch):
    """A head over ALL_ROWS_BYTES: the first row asked for is computed alone (a prefill reads one),
    the second brings every row in one product; the values are the row-by-row ones. A small head
    stays row by row."""
    from treeflash.models import lazy_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(6, 8)
    calls = []
    orig = head.forward
    head.forward = lambda x: calls.append(len(x)) or orig(x)
    small = LazyLogits(h, head)
    for i in (0, 3, 1):
        torch.testing.assert_close(small[i], orig(h[i:i + 1])[0], atol=0, rtol=0)
    assert calls == [1, 1, 1] and sorted(small.rows) == [0, 1, 3]
    monkeypatch.setattr(lazy_logits, "ALL_ROWS_BYTES", 100)  # this head (1.6 KB) counts as large
    calls.clear()
    big = LazyLogits(h, head)
    first = big[0]
    assert calls == [1]
    rows = [big[i] for i in (3, 1, 5, 0)]
    assert calls == [1, 6] and sorted(big.rows) == list(range(6))
    assert big[0] is first
    for i, r in zip((3, 1, 5), rows):
        assert torch.equal(r.argmax(), orig(h[i:i + 1])[0].argmax())
        torch.testing.assert_close(r, orig(h[i:i + 1])[0], atol=1e-5, rtol=1e-5)
