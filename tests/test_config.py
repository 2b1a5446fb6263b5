"""GenerationConfig is the one definition of the generation options: every field, set on each
entry point (API, `treeflash generate`, `chat`, `serve` + an OpenAI request, `bench`), arrives
unchanged in the config the engine runs. The fields are walked, so a new field is covered (or this
test asks how to set it) without editing the test."""
from __future__ import annotations

import dataclasses
import io
import sys

import pytest

from treeflash import api
from treeflash.api import Engine
from treeflash.bench import cli as bench_cli
from treeflash.cli import build_parser
from treeflash.config import GenerationConfig
from treeflash.errors import TreeflashError

from conftest import tiny_drafter, tiny_target

FIELDS = [f.name for f in dataclasses.fields(GenerationConfig)]
PROMPT = list(range(3, 20))


def changed(f: dataclasses.Field):
    """A valid value other than the field's default."""
    d = f.default
    if f.name == "method":
        return "chain"
    if f.name == "tree_size":
        return 5
    if f.name == "block_len":
        return 3
    if f.name == "stage2_vocab":
        return 32
    if isinstance(d, bool):
        return not d
    if isinstance(d, int):
        return d + 1
    if isinstance(d, float):
        return 0.5 if d == 0 else d / 2
    if d is None:
        return 7
    if isinstance(d, tuple):
        return ("zzz",)
    raise AssertionError(f"teach this test a non-default value for the new field {f.name!r}")


VALUES = {f.name: changed(f) for f in dataclasses.fields(GenerationConfig)}


def fixed(name: str) -> list[str]:
    """A fixed tree size for the commands (their default, auto, would calibrate first), unless it is the field tested."""
    return [] if name == "tree_size" else ["--tree-size", "8"]


def flags(name: str) -> list[str]:
    v, opt = VALUES[name], "--" + name.replace("_", "-")
    if isinstance(v, bool):
        return [opt if v else "--no-" + name.replace("_", "-")]
    if isinstance(v, tuple):
        return [x for s in v for x in (opt, s)]
    return [opt, str(v)]


@pytest.fixture(scope="module")
def engine():
    target = tiny_target("llama").set_backend("static")
    return Engine(target, tiny_drafter(target))


@pytest.fixture
def seen(engine, monkeypatch):
    """The configs the engine prepared generations with (the real run goes on)."""
    got: list[GenerationConfig] = []
    prepare = Engine.prepare

    def spy(self, prompt, cfg, chat=True):
        got.append(cfg)
        return prepare(self, prompt, cfg, chat)
    monkeypatch.setattr(Engine, "prepare", spy)
    monkeypatch.setattr(api, "load", lambda *a, **kw: engine)
    # the tiny target has no tokenizer: any text or chat becomes these token ids
    monkeypatch.setattr(engine.target, "encode", lambda prompt, chat=True: PROMPT)
    return got


def parse(argv: list[str]):
    return build_parser(argv).parse_args(argv)


def test_defaults_are_defined_once():
    """The CLI's defaults are the dataclass's, except the tree size, which the commands that decode
    measure (`cli.CLI_TREE_SIZE`, "auto"): `generate` with no options gives GenerationConfig() with it."""
    from treeflash.cli import CLI_TREE_SIZE

    assert CLI_TREE_SIZE == "auto" and GenerationConfig().tree_size == 8
    for argv in (["generate", "hi"], ["serve"], ["chat"]):
        assert GenerationConfig.from_args(parse(argv)) == GenerationConfig(tree_size=CLI_TREE_SIZE)
    assert GenerationConfig.from_args(parse(["generate", "hi", "--tree-size", "5"])).tree_size == 5


@pytest.mark.parametrize("name", FIELDS)
def test_api_option_reaches_the_engine(engine, seen, name):
    engine.generate(PROMPT, **{"max_new_tokens": 4, name: VALUES[name]})
    assert getattr(seen[-1], name) == VALUES[name]


@pytest.mark.parametrize("name", FIELDS)
def test_generate_cli_option_reaches_the_engine(seen, capsys, name):
    argv = ["generate", "x", "--no-chat"] + fixed(name) + flags(name) + ([] if name == "max_new_tokens" else ["--max-new-tokens", "4"])
    args = parse(argv)
    assert args.func(args) == 0
    assert getattr(seen[-1], name) == VALUES[name]


@pytest.mark.parametrize("name", FIELDS)
def test_chat_option_reaches_the_engine(seen, capsys, monkeypatch, name):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    args = parse(["chat"] + fixed(name) + flags(name) + ([] if name == "max_new_tokens" else ["--max-new-tokens", "4"]))
    assert args.func(args) == 0
    assert getattr(seen[-1], name) == VALUES[name]


@pytest.mark.parametrize("name", FIELDS)
def test_serve_option_reaches_the_engine_through_a_request(engine, seen, name):
    """`serve --OPTION` is the default of every request that does not set the field itself."""
    from fastapi.testclient import TestClient

    from treeflash.serve.app import create_app
    from treeflash.serve.cli import _config

    args = parse(["serve"] + fixed(name) + flags(name) + ([] if name == "max_new_tokens" else ["--max-new-tokens", "4"]))
    config = _config(args, "tiny")
    with TestClient(create_app(engine, config)) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 200, r.text
    assert getattr(seen[-1], name) == VALUES[name]


def test_a_request_field_overrides_the_server_default():
    from treeflash.serve.schemas import CompletionRequest

    base = GenerationConfig(temperature=0.7, top_p=0.9, max_new_tokens=9, seed=3, stop=("a",))
    req = CompletionRequest(prompt="x", temperature=0.2, max_tokens=4, seed=5, stop=["b", "c"])
    assert req.generation_config(base) == base.replace(temperature=0.2, max_new_tokens=4, seed=5, stop=("b", "c"))
    assert CompletionRequest(prompt="x").generation_config(base) == base
    assert CompletionRequest(prompt="x", temperature=1e-9).generation_config(base).temperature == 0.0  # greedy


@pytest.mark.parametrize("name", FIELDS)
def test_bench_option_reaches_the_engine(engine, seen, name):
    """Every field is a bench option except the arm's own (method, tree size), the bench's seed
    (prompt sampling and sampling), and the two its peers cannot honour (stop, ignore_eos)."""
    from treeflash.bench.methods import build_methods

    own = {"method": "arm", "tree_size": "arm", "seed": "bench", "stop": "peers", "ignore_eos": "peers"}
    argv = ["bench", "--methods", "treeflash", "--tree-size", "5"]
    if name == "seed":
        argv += ["--seed", str(VALUES[name])]
    elif name not in own:
        argv += flags(name)
    cfg = bench_cli.config_from_args(parse(argv))
    arms, _ = build_methods(engine, cfg.methods, cfg.tree_sizes, "tiny", params=cfg.decode_config())
    arms[0].generate(PROMPT, cfg.decode_config().replace(max_new_tokens=min(4, cfg.max_new_tokens))
                     if name != "max_new_tokens" else cfg.decode_config())
    want = {"method": "treeflash", "tree_size": 5}.get(name, VALUES[name])
    if own.get(name) == "peers":
        want = getattr(GenerationConfig(), name)
    assert getattr(seen[-1], name) == want


@pytest.mark.parametrize("changes, message", [
    (dict(method="nope"), "unknown method 'nope'"),
    (dict(tree_size=0), "tree size must be >= 1"),
    (dict(tree_size="big"), "tree size must be a number or 'auto'"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(top_p=0.0), "top-p must be in (0, 1]"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=4, stage2_vocab=3), "stage-2 vocabulary must be 0 or in [top-k, 128]"),
    (dict(stage2_vocab="wide"), "stage-2 vocabulary must be a number or 'auto'"),
    (dict(stop=("",)), "stop strings must be non-empty text"),
    (dict(block_len=1), "block length must be 0 (the tree size) or >= 2"),
    (dict(block_len=-2), "block length must be 0 (the tree size) or >= 2"),
])
def test_check_names_the_bad_value(changes, message):
    with pytest.raises(TreeflashError) as e:
        GenerationConfig().replace(**changes).check(128)
    assert str(e.value).startswith(message)


def test_auto_stage2_columns_grow_with_the_budget_and_an_explicit_value_is_kept():
    from treeflash.decoding.proposers import TreeParams

    assert GenerationConfig().stage2_vocab == "auto"
    auto = {b: GenerationConfig(tree_size=b).tree(50_000).stage2_vocab for b in (2, 4, 5, 8, 16, 64)}
    assert auto == {2: 64, 4: 64, 5: 80, 8: 128, 16: 256, 64: 256}
    assert GenerationConfig(tree_size="auto").tree(50_000, budget=16).stage2_vocab == 256  # the resolved budget
    assert GenerationConfig(tree_size=16).tree(128).stage2_vocab == 128  # at most the vocabulary
    assert GenerationConfig(tree_size=16, stage2_vocab=64).tree(50_000).stage2_vocab == 64
    assert GenerationConfig(tree_size=16, stage2_vocab=0).tree(50_000).stage2_vocab == 0
    assert TreeParams(16).stage2_vocab == 256 and TreeParams(3).stage2_vocab == 64


def test_prepare_compiles_every_tree_size_up_to_the_budget(engine, monkeypatch):
    """Every caller of `prepare` (generation, `profile`, `bench`) gets the compiled steps of trees of
    1..budget nodes (the proposer's rows at the budget) before it times anything: a tree at the end
    of a generation is smaller."""
    sizes: list[list[int]] = []
    monkeypatch.setattr(engine.target, "warm", lambda tree_sizes: sizes.append(list(tree_sizes)))
    engine.prepare([5, 6, 7], engine.config(method="treeflash", tree_size=4))
    engine.prepare([5, 6, 7], engine.config(method="vanilla", tree_size=4))  # plain decoding: the root alone
    assert sizes == [[1, 2, 3, 4], [1]]


def test_stop_string_ends_generate_and_stream(engine):
    """A stop string cuts the answer in the API as in the server (the shared TextAssembler)."""
    full = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    words = full.text.split()
    stop = " " + words[5]
    cut = full.text[:full.text.index(stop)]
    assert engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True, stop=[stop]).text == cut
    assert "".join(engine.stream(PROMPT, max_new_tokens=12, ignore_eos=True, stop=[stop])) == cut


def test_one_parser_for_every_tree_size_list_and_one_method_check(capsys):
    """bench, train tau and selftest read budget lists ("4,8,auto") through one parser; every unknown
    method is refused by one check, in one line."""
    import argparse

    from treeflash.config import check_tree_sizes, tree_sizes_arg
    from treeflash.options import check_method

    assert tree_sizes_arg("4, 8,auto") == [4, 8, "auto"]
    with pytest.raises(argparse.ArgumentTypeError, match="comma list of them"):
        tree_sizes_arg("4,x")
    with pytest.raises(TreeflashError, match="--budgets values must be >= 1"):
        check_tree_sizes([4, 0], "--budgets")
    with pytest.raises(TreeflashError, match="unknown method 'warp'; choose from vanilla"):
        check_method("warp")
    assert build_parser(["train", "tau"]).parse_args(["train", "tau", "--tree-size", "4,auto"]).tree_size == [4, "auto"]
    assert build_parser(["selftest"]).parse_args(["selftest"]).budgets == [16, 64]
