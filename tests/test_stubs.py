"""Function-completion prompts (`treeflash data stubs`): what a stub keeps, what it drops."""
from __future__ import annotations

import ast
import json
import textwrap

from treeflash.datasets import humaneval_instruction
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

    def to_instance(a, b=1, cls=None):
        """Convert a with base b into an instance of cls (a plain function: cls is kept)."""

    class Box:
        def area(self, scale=1):
            """Return the area of the box, multiplied by scale (an integer or a float)."""
            return 0

        @classmethod
        def make(cls, width, height=2, /, depth=3):
            """Make a box of the given width, height and depth, in metres or in feet."""
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
    method = stubs.function_stub(fns["area"], method=True)
    assert method.splitlines()[0] == "def area(scale=1):"  # self dropped
    made = stubs.function_stub(fns["make"], method=True)
    assert made.splitlines()[0] == "def make(width, height=2, /, depth=3):"  # defaults stay aligned
    plain = stubs.function_stub(fns["to_instance"], method=False)
    assert plain.splitlines()[0] == "def to_instance(a, b=1, cls=None):"  # not a method: cls stays
    for name in ("_private", "short", "undocumented"):
        assert stubs.function_stub(fns[name]) is None


def test_source_stubs_skip_tests_and_unparsable_files(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "pkg" / "broken.py").write_text("def oops(:\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(SOURCE.replace("scale", "in_tests"))
    found = [stubs.stub_name(s) for s in stubs.source_stubs(tmp_path)]
    assert found == ["scale", "to_instance", "area", "make"]
    # the skipped folders count below the root only: a root inside a `tests` folder is read
    nested = tmp_path / "tests" / "proj"
    nested.mkdir()
    (nested / "mod.py").write_text(SOURCE)
    assert [stubs.stub_name(s) for s in stubs.source_stubs(nested)] == found
    area = [s for s in stubs.source_stubs(nested) if stubs.stub_name(s) == "area"][0]
    assert area.splitlines()[0] == "def area(scale=1):"


def test_cut_after_docstring():
    code = 'def f(a):\n    """Return a."""\n    flat = []\n    return'
    assert stubs.cut_after_docstring(code) == 'def f(a):\n    """Return a."""'
    multi = 'def g(a):\n    """Return a,\n    twice.\n    """\n    return'
    assert stubs.cut_after_docstring(multi) == 'def g(a):\n    """Return a,\n    twice.\n    """'
    assert stubs.cut_after_docstring("def h(a):\n    return a") is None
    assert stubs.cut_after_docstring('def h(a):\n    """never closed') is None
    raw = 'def r():\n    r"""Raw\n    doc."""\n    s = """a"""'
    assert stubs.cut_after_docstring(raw) == 'def r():\n    r"""Raw\n    doc."""'


def test_stub_prompts_dedupe_exclude_shuffle_and_limit():
    a = 'def a(x):\n    """Doc of a."""'
    b = 'def b(x):\n    """Doc of b."""'
    b2 = 'def b(x, y):\n    """Another b."""'
    pairs = [("s", a), ("s", b), ("t", b), ("s", b2), ("s", "not a function")]
    rows = stubs.stub_prompts(pairs, exclude=set())
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(humaneval_instruction(s) for s in (a, b, b2))
    kept = stubs.stub_prompts(pairs, exclude={"a"})
    assert sorted(r["messages"][0]["content"] for r in kept) == sorted(humaneval_instruction(s) for s in (b, b2))
    assert len({r["id"] for r in kept}) == 2 and all(r["id"].startswith("s/b/") for r in kept)
    assert kept == stubs.stub_prompts(pairs, exclude={"a"})  # seeded: the same order every time
    many = [("s", f'def f{i}(x):\n    """Doc {i}."""') for i in range(20)]
    orders = {tuple(r["id"] for r in stubs.stub_prompts(many, set(), seed=seed)) for seed in range(3)}
    assert len(orders) > 1  # the seed shuffles
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
    assert sorted(stubs.stub_name(r["messages"][0]["content"]) for r in rows) == ["area", "make", "scale", "to_instance"]
    capsys.readouterr()
    assert main(["data", "stubs", "--sources", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sources" in err and len(err.splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["data", "stubs", "--sources", str(empty), "--out", str(out)]) == 2
    assert main(["data", "stubs", "--sources", str(src), "--out", str(out), "--limit", "0"]) == 2
    assert main(["data", "stubs", "--sources", str(src), "--out", str(tmp_path)]) == 2  # a folder
    assert main(["data", "stubs", "--sources", "", "--out", str(out)]) == 2
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["data", "stubs", "--sources", str(src), "--out", str(blocker / "sub" / "p.jsonl")]) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 5 and all(e.startswith("error:") for e in errs)
