"""--tree-size auto: the cost model, per-node acceptance statistics and the engine's choice."""
import pytest

from treeflash.api import Engine
from treeflash.decoding import costmodel
from treeflash.decoding.stats import Stats
from treeflash.errors import TreeflashError

from conftest import oracle, run, tiny_drafter, tiny_target, vanilla

PROMPT = list(range(3, 30, 2))


def test_interpolation_and_expected_tau():
    costs = {1: 1.0, 4: 1.3, 16: 2.5}
    assert costmodel.interpolate(costs, 1) == 1.0
    assert costmodel.interpolate(costs, 10) == pytest.approx(1.3 + 1.2 * 6 / 12)
    assert costmodel.interpolate(costs, 40) == 2.5
    accept = [0.9, 0.5, 0.2, 0.05]
    assert costmodel.expected_tau(accept, 1) == 1.0
    assert costmodel.expected_tau(accept, 3) == pytest.approx(2.4)
    assert costmodel.expected_tau(accept, 99) == pytest.approx(2.65)


def test_best_budget_trades_acceptance_against_cost():
    accept = [0.9, 0.6, 0.4, 0.1] + [0.01] * 60
    flat = {1: 1.0, 64: 1.0}            # verification is free: take everything that helps
    assert costmodel.best_budget(flat, accept, 0.0)[0] == 64
    steep = {1: 1.0, 2: 1.95, 64: 64.0}  # every node costs nearly a forward: plain decoding wins
    assert costmodel.best_budget(steep, accept, 0.1)[0] == 1
    mid = {1: 1.0, 4: 1.2, 8: 2.0, 64: 10.0}
    b, rate = costmodel.best_budget(mid, accept, 0.05)
    assert b == 4 and rate == pytest.approx(2.9 / 1.25)  # b=3: 2.5/1.183, b=5: 3.0/1.45
    # the LM head runs over tau rows: a dear head favours plain decoding less than a dear forward
    with_head = {0: 0.5, **mid}
    b, rate = costmodel.best_budget(with_head, accept, 0.05)
    assert b == 4 and rate == pytest.approx(2.9 / (1.25 + 2.9 * 0.5))
    assert costmodel.best_budget(with_head, [], 0.0) == (1, pytest.approx(1 / 1.5))


def test_drafting_cost_grows_with_the_depth_the_budget_reaches():
    cost = costmodel.draft_cost(0.01, 0.03, max_depth=7)  # heads over 1 .. 7 positions
    assert cost(2) == pytest.approx(0.01) and cost(8) == pytest.approx(0.03) and cost(64) == pytest.approx(0.03)
    assert cost(5) == pytest.approx(0.01 + 0.02 * 3 / 6)
    # a cheap small-budget draft makes a small tree pay where the flat (max-budget) cost did not
    accept = [0.6, 0.2, 0.1] + [0.01] * 61
    costs = {1: 1.0, 4: 1.25, 8: 1.6, 64: 10.0}
    assert costmodel.best_budget(costs, accept, cost(64) * 30)[0] == 1
    b, _ = costmodel.best_budget(costs, accept, lambda b: cost(b) * 30)
    assert b in (2, 3, 4)


def test_node_hits_follow_the_accepted_paths():
    target = tiny_target("llama", logit_scale=3.0)
    drafter = tiny_drafter(target)
    ref = vanilla(target, PROMPT, 30)
    stats = Stats()
    run(target, oracle("marginal", target, drafter, PROMPT + ref, 12), PROMPT, 30, stats=stats)
    # every accepted draft token is one hit of one node
    assert sum(stats.node_hits) == sum(stats.acceptance_lengths) - stats.steps > 0
    assert all(0 <= a <= 1 for a in stats.node_acceptance())


def test_engine_auto_tree_size_measures_caches_and_resolves(tmp_path, monkeypatch):
    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    target = tiny_target("qwen2").set_backend("static")
    target.tokenizer.chat_template = None
    engine = Engine(target, tiny_drafter(target))
    monkeypatch.setattr(type(target), "encode", lambda self, prompt, chat=True: PROMPT)
    choice = engine.auto_tree_size(method="treeflash", top_m=3, top_k=3, max_budget=12, tokens=8)
    assert 1 <= choice.budget <= 12 and choice.verify_costs[1] > 0 and choice.verify_costs[0] > 0
    assert (tmp_path / "costs.json").exists()
    assert engine.auto_tree_size(method="treeflash", top_m=3, top_k=3, max_budget=12, tokens=8) is choice  # memoised
    out = list(engine.tokens(PROMPT, method="treeflash", max_new_tokens=6, tree_size="auto", top_m=3, top_k=3,
                             ignore_eos=True))
    assert out == vanilla(target, PROMPT, 6)


def test_commands_calibrate_the_tree_size_by_default(tmp_path, monkeypatch, capsys):
    """`generate` without --tree-size resolves auto to a measured budget (said on stderr), and the
    generation at that budget is plain decoding's tokens; a lookup method (the default) keeps "auto"
    for its per-step budgets, with the same tokens; the library's default stays a fixed 8."""
    from treeflash.api import generation_config
    from treeflash.cli import build_parser
    from treeflash.config import GenerationConfig

    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    target = tiny_target("qwen2").set_backend("static")
    target.tokenizer.chat_template = None
    monkeypatch.setattr(type(target), "encode", lambda self, prompt, chat=True: PROMPT)
    engine = Engine(target, tiny_drafter(target))
    real = Engine.auto_tree_size  # a short calibration for the tiny model
    monkeypatch.setattr(Engine, "auto_tree_size", lambda self, cfg: real(self, cfg, max_budget=12, tokens=8))
    args = build_parser(["generate"]).parse_args(["generate", "hi", "--method", "treeflash", "--top-m", "3", "--top-k",
                                                  "3", "--max-new-tokens", "6", "--ignore-eos"])
    cfg = generation_config(engine, args)
    assert isinstance(cfg.tree_size, int) and 1 <= cfg.tree_size <= 12
    assert "tree size auto -> " in capsys.readouterr().err
    assert list(engine.tokens(PROMPT, cfg)) == vanilla(target, PROMPT, 6)
    assert generation_config(engine, args, quiet=True) == cfg and not capsys.readouterr().err  # --json
    default = build_parser(["generate"]).parse_args(["generate", "hi", "--top-m", "3", "--top-k", "3",
                                                     "--max-new-tokens", "6", "--ignore-eos"])
    cfg = generation_config(engine, default)
    assert cfg.method.endswith("+lookup") and cfg.tree_size == "auto" and "lookup-only" in capsys.readouterr().err
    assert list(engine.tokens(PROMPT, cfg)) == vanilla(target, PROMPT, 6)
    plain = build_parser(["generate"]).parse_args(["generate", "hi", "--method", "vanilla"])
    assert generation_config(engine, plain).tree_size == 1 and not capsys.readouterr().err  # nothing to choose
    assert GenerationConfig().tree_size == 8


def test_a_short_window_is_timed_after_the_context_it_holds(tmp_path, monkeypatch):
    """A target trained for fewer tokens than the usual 256 + 64 still gets a cost table."""
    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    target = tiny_target("qwen2", max_pos=96).set_backend("static")
    costs = costmodel.measure(target, sizes=(1, 8, 64), repeats=1)
    assert set(costs) == {0, 1, 8, 64} and all(t > 0 for t in costs.values())


def test_bad_tree_size_is_a_clear_cli_error(capsys):
    from treeflash.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--tree-size", "big"])
    assert e.value.code == 2 and "expected a number or 'auto'" in capsys.readouterr().err


def test_auto_tree_size_is_calibrated_once_per_machine(tmp_path, monkeypatch):
    """A later process (a new engine over the same model and drafter) reads the saved calibration
    instead of decoding the calibration prompts again; another drafter calibrates anew."""
    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    target = tiny_target("qwen2").set_backend("static")
    target.tokenizer.chat_template = None
    monkeypatch.setattr(type(target), "encode", lambda self, prompt, chat=True: PROMPT)
    drafter = tiny_drafter(target)
    first = Engine(target, drafter).auto_tree_size(method="treeflash", top_m=3, top_k=3, max_budget=12, tokens=8)

    calls = []
    real = Engine.tokens
    monkeypatch.setattr(Engine, "tokens", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    again = Engine(target, drafter).auto_tree_size(method="treeflash", top_m=3, top_k=3, max_budget=12, tokens=8)
    assert not calls and (again.budget, again.expected_tau) == (first.budget, first.expected_tau)
    Engine(target, tiny_drafter(target, seed=5)).auto_tree_size(method="treeflash", top_m=3, top_k=3,
                                                                max_budget=12, tokens=8)
    assert calls  # other weights: calibrated again


def test_auto_decodes_plainly_where_speculation_cannot_pay(tmp_path, monkeypatch):
    """When the cost model finds no tree that beats plain decoding, auto says so and the generation
    runs plain steps (no drafter pass, root-only trees), still token-identical (a method without
    lookup: a lookup method's steps may still verify lookup-only trees, test_step_budget.py)."""
    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    monkeypatch.setattr(costmodel, "best_budget", lambda *a, **kw: (1, 10.0))
    target = tiny_target("qwen2").set_backend("static")
    target.tokenizer.chat_template = None
    monkeypatch.setattr(type(target), "encode", lambda self, prompt, chat=True: PROMPT)
    engine = Engine(target, tiny_drafter(target))
    choice = engine.auto_tree_size(method="treeflash", top_m=3, top_k=3, max_budget=12, tokens=8)
    assert choice.budget == 1 and "decoding plainly" in choice.summary()
    drafted = []
    monkeypatch.setattr(type(engine.drafter), "draft", lambda *a, **kw: drafted.append(1))
    stats = Stats()
    out = list(engine.tokens(PROMPT, method="treeflash", max_new_tokens=6, tree_size="auto", top_m=3,
                             top_k=3, ignore_eos=True, stats=stats))
    assert out == vanilla(target, PROMPT, 6) and not drafted and set(stats.tree_sizes) == {1}


def test_auto_llama_cpp_times_once_per_machine_and_keeps_the_faster(tmp_path, monkeypatch):
    monkeypatch.setattr(costmodel, "CACHE_FILE", tmp_path / "costs.json")
    loaded = []

    class Fake:
        def __init__(self, kind):
            self.kind = kind
            loaded.append(kind)

    def step_times(target, backends):
        return {b: {"torch": 0.05, "gguf": 0.02}[target.kind] for b in backends}

    monkeypatch.setattr(costmodel, "step_times", step_times)
    monkeypatch.setattr(costmodel, "auto_backend", lambda target: "static")
    assert costmodel.auto_llama_cpp("m", lambda: Fake("torch"), lambda: Fake("gguf")) is True
    assert loaded == ["gguf", "torch"]
    assert costmodel.auto_llama_cpp("m", lambda: Fake("torch"), lambda: Fake("gguf")) is True
    assert loaded == ["gguf", "torch"]  # saved: no second timing
    monkeypatch.setattr(costmodel, "step_times", lambda t, b: {x: {"torch": 0.01, "gguf": 0.02}[t.kind] for x in b})
    assert costmodel.auto_llama_cpp("other", lambda: Fake("torch"), lambda: Fake("gguf")) is False

    def unreadable():
        raise TreeflashError("llama.cpp cannot load m.gguf")

    with pytest.raises(TreeflashError):  # the caller stays on PyTorch; nothing is saved
        costmodel.auto_llama_cpp("third", lambda: Fake("torch"), unreadable)
    assert "third" not in str(costmodel._load()["engine"])


@pytest.mark.parametrize("kw", [dict(), dict(dtype="float32"), dict(quantize="int8"), dict(torch_only=True),
                                dict(device="cuda"), dict(aot="0")])
def test_backend_auto_times_llama_cpp_only_where_the_caller_leaves_it_free(kw, monkeypatch):
    from pathlib import Path

    from treeflash import api
    from treeflash.models import gguf_file, llamacpp

    timed, free = [], not kw
    kw = dict(kw)
    monkeypatch.setenv("TREEFLASH_AOT", kw.pop("aot", "1"))
    monkeypatch.setattr(llamacpp, "binary", lambda name: Path(name))  # built, and the target has a GGUF
    monkeypatch.setattr(gguf_file, "has_gguf", lambda name: True)
    monkeypatch.setattr(costmodel, "auto_llama_cpp", lambda name, *loaders: timed.append(name) or True)
    args = dict(dtype="auto", device="cpu", quantize="none", torch_only=False) | kw
    got = api._auto_llama_cpp("smollm2-135m", args["dtype"], args["device"], args["quantize"], args["torch_only"])
    assert got is free and timed == (["smollm2-135m"] if free else [])
