"""GSM8K-shaped word problems (`treeflash data problems`): well-formed, whole-number, not the test set."""
from __future__ import annotations

import json
import random
import re
from fractions import Fraction

from treeflash.datasets import STEP_BY_STEP, load_gsm8k
from treeflash.cli import main
from treeflash.training import problems


def test_every_template_asks_a_question_with_a_positive_whole_answer():
    rng = random.Random(0)
    for name, template in problems.TEMPLATES.items():
        for _ in range(500):
            question, answer = template(rng)
            assert Fraction(answer).denominator == 1 and answer > 0, (name, question, answer)
            assert question.endswith("?") and "{" not in question and "}" not in question, question
            assert not re.search(r"\b1 \w+s\b", question), question  # "1 apples"
            assert re.search(r"\d", question), question
            assert not re.search(r"\b[Aa] [aeiou]", question), question  # "a apple"


def test_plural_and_article():
    assert [problems.article(w) for w in ("apple", "mug")] == ["an apple", "a mug"]
    assert [problems.plural(g, n) for g, n in [("apple", 1), ("apple", 3), ("sandwich", 2), ("toy car", 2)]] == \
        ["apple", "apples", "sandwiches", "toy cars"]


def test_problem_prompts_are_distinct_seeded_and_end_with_the_gsm8k_instruction():
    rows = problems.problem_prompts(300, seed=1)
    contents = [r["messages"][0]["content"] for r in rows]
    assert len(rows) == 300 and len(set(contents)) == 300 and len({r["id"] for r in rows}) == 300
    assert all(c.endswith(STEP_BY_STEP) for c in contents)
    assert {r["id"].split("/")[1] for r in rows} == set(problems.TEMPLATES)  # every template is used
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in rows)
    assert rows == problems.problem_prompts(300, seed=1)
    assert rows != problems.problem_prompts(300, seed=2)


def test_no_problem_is_a_gsm8k_test_question():
    test = {s.turns[0].removesuffix(STEP_BY_STEP).strip() for s in load_gsm8k()}
    ours = {r["messages"][0]["content"].removesuffix(STEP_BY_STEP).strip() for r in problems.problem_prompts(2000)}
    assert len(test) > 1000 and not ours & test


def test_cli_writes_problems_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert main(["data", "problems", "--out", str(out), "--limit", "40", "--seed", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == problems.problem_prompts(40, seed=3)
    capsys.readouterr()
    assert main(["data", "problems", "--out", str(out), "--limit", "0"]) == 2
    assert main(["data", "problems", "--out", str(tmp_path)]) == 2  # a folder
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["data", "problems", "--out", str(blocker / "sub" / "p.jsonl")]) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 3 and all(e.startswith("error:") for e in errs)
