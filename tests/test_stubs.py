"""Function-completion prompts (`treeflash data stubs`): what a stub keeps, what it drops."""
from __future__ import annotations

import ast
import json
import textwrap

from treeflash.bench.datasets import humaneval_instruction
from treeflash.cli import main
from treeflash.training import stubs

SOURCE = textwrap.dedent('''
    def scale(values: list[float], factor=2.0, *, clip=None) -> list[float]:
        """Multiply every value by factor, clipping the results at clip when it is given."""
        return [v * factor for v in values]

    def _private(x):
        """A private helper with a long enough docstring to pass the length filter."""

    def short(x):
        """Too short."""

    def undocumented(x):
        return x

    class Box:
        def area(self, scale=1):
            """Return the area of the box, multiplied by scale (an integer or a float)."""
            return 0
''')


def parse_functions(code):
    return {n.name: n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)}


def test_function_stub_keeps_signature_and_docstring_only():
    fns = parse_functions(SOURCE)
    stub = stubs.function_stub(fns["scale"])
    tree = ast.parse(stub)  # a stub is valid Python: a def whose body is its docstring
    (node,) = tree.body
    assert ast.unparse(node.args) == "values: list[float], factor=2.0, *, clip=None"
    assert ast.unparse(node.returns) == "list[float]"
    assert ast.get_docstring(node).strip() == ast.get_docstring(fns["scale"])
    assert len(node.body) == 1  # the body is gone
    method = stubs.function_stub(fns["area"])
    assert method.splitlines()[0] == "def area(scale=1):"  # self dropped, its default kept aligned
    for name in ("_private", "short", "undocumented"):
        assert stubs.function_stub(fns[name]) is None


def test_source_stubs_skip_tests_and_unparsable_files(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "pkg" / "broken.py").write_text("def oops(:\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(SOURCE.replace("scale", "in_tests"))
    found = [stubs.stub_name(s) for s in stubs.source_stubs(tmp_path)]
    assert found == ["scale", "area"]


def test_cut_after_docstring():
    code = 'def f(a):\n    """Return a."""\n    flat = []\n    return'
    assert stubs.cut_after_docstring(code) == 'def f(a):\n    """Return a."""'
    multi = 'def g(a):\n    """Return a,\n    twice.\n    """\n    return'
    assert stubs.cut_after_docstring(multi) == 'def g(a):\n    """Return a,\n    twice.\n    """'
    assert stubs.cut_after_docstring("def h(a):\n    return a") is None
    assert stubs.cut_after_docstring('def h(a):\n    """never closed') is None


def test_stub_prompts_dedupe_exclude_shuffle_and_limit():
    a = 'def a(x):\n    """Doc of a."""'
    b = 'def b(x):\n    """Doc of b."""'
    b2 = 'def b(x, y):\n    """Another b."""'
    pairs = [("s", a), ("s", b), ("t", a), ("s", b2), ("s", "not a function")]
    rows = stubs.stub_prompts(pairs, exclude={"a"})
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(humaneval_instruction(s) for s in (b, b2))
    assert len({r["id"] for r in rows}) == 2 and all(r["id"].startswith("s/b/") for r in rows)
    assert rows == stubs.stub_prompts(pairs, exclude={"a"})  # seeded: the same order every time
    assert len(stubs.stub_prompts(pairs, exclude=set(), limit=1)) == 1


def test_benchmark_names_cover_humaneval_and_mbpp():
    names = stubs.benchmark_names()
    assert {"has_close_elements", "remove_Occ"} <= names  # HumanEval/0, MBPP's first test item


def test_olmo_stubs_are_docstring_cut_functions():
    found = stubs.olmo_stubs()
    assert len(found) > 500
    for stub in found:
        (node,) = ast.parse(stub).body
        assert isinstance(node, ast.FunctionDef) and ast.get_docstring(node)
        assert len(node.body) == 1


def test_cli_writes_prompts_and_rejects_bad_sources(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "mod.py").write_text(SOURCE)
    out = tmp_path / "p.jsonl"
    assert main(["data", "stubs", "--sources", str(src), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(stubs.stub_name(r["messages"][0]["content"]) for r in rows) == ["area", "scale"]
    capsys.readouterr()
    assert main(["data", "stubs", "--sources", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sources" in err and len(err.splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["data", "stubs", "--sources", str(empty), "--out", str(out)]) == 2
    assert main(["data", "stubs", "--sources", str(src), "--out", str(out), "--limit", "0"]) == 2
