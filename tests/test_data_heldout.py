"""The checked-in Qwen training data (data/regen/qwen2.5-coder-0.5b) answers prompts that the
commands of data/README.md make, and none of them holds a benchmark prompt."""
import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from treeflash.cli import main
from treeflash.datasets import DATASETS, load_dataset

QWEN_DATA = Path(__file__).resolve().parent.parent / "data" / "regen" / "qwen2.5-coder-0.5b"
N = 8  # words per shingle


def shingles(text: str) -> set[tuple[str, ...]]:
    """The text's runs of N words (lower-cased, punctuation kept with its word); a shorter text is one run."""
    words = text.lower().split()
    return {tuple(words[i:i + N]) for i in range(max(1, len(words) - N + 1))}


def bench_index():
    """Each benchmark item's shingles, less those of 3 or more items (an instruction every item has),
    as {shingle: items}, and each item's number of shingles left."""
    items = {f"{name}/{s.id}": set().union(*map(shingles, s.turns)) for name in DATASETS for s in load_dataset(name)}
    index: dict[tuple[str, ...], set[str]] = {}
    for item, sh in items.items():
        for x in sh:
            index.setdefault(x, set()).add(item)
    index = {x: found for x, found in index.items() if len(found) < 3}
    return index, Counter(item for found in index.values() for item in found)


def held(text: str, index, sizes) -> list[str]:
    """The benchmark items of which the text holds half the shingles or more."""
    hits = Counter(item for x in shingles(text) for item in index.get(x, ()))
    return sorted(item for item, n in hits.items() if 2 * n >= sizes[item])


def data_ids(folder: Path) -> set[str]:
    ids = set()
    for shard in sorted(folder.glob("shard-*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            ids.update(json.loads(line)["id"] for line in f)
    return ids


@pytest.fixture(scope="module")
def prompt_rows(tmp_path_factory):
    """The prompts of data/README.md's Qwen section, made by its commands, by id."""
    d = tmp_path_factory.mktemp("qwen-prompts")
    assert main(["data", "stubs", "--out", str(d / "stubs.jsonl")]) == 0
    assert main(["data", "problems", "--out", str(d / "problems.jsonl")]) == 0
    assert main(["data", "prompts", "--out", str(d / "sharegpt")]) == 0
    rows = {}
    for f in (d / "stubs.jsonl", d / "problems.jsonl", d / "sharegpt" / "train.jsonl"):
        for line in filter(None, f.read_text(encoding="utf-8").split("\n")):  # not splitlines: U+2028 sits in strings
            r = json.loads(line)
            rows[r["id"]] = r
    return rows


def test_every_answer_is_to_a_prompt_of_the_recipe_and_holds_no_benchmark_prompt(prompt_rows):
    ids = data_ids(QWEN_DATA)
    # stubs cut from the standard library depend on the Python that runs `data stubs`: another
    # version's source makes other stubs, so only the ones it still makes are checked there
    assert len(ids) >= 2240 and {i for i in ids if not i.startswith("stdlib/")} <= prompt_rows.keys()
    ids &= prompt_rows.keys()
    index, sizes = bench_index()
    assert len(sizes) == sum(len(load_dataset(name)) for name in DATASETS)  # every item keeps shingles to find
    for pid in sorted(ids):
        assert not held("\n".join(m["content"] for m in prompt_rows[pid]["messages"]), index, sizes), pid


def test_the_check_finds_a_benchmark_prompt_inside_a_prompt():
    humaneval = load_dataset("humaneval")[7].turns[0]
    mt_bench = load_dataset("mt-bench")[3].turns[0]
    index, sizes = bench_index()
    assert held(f"Please help.\n{humaneval}\nThanks", index, sizes) == ["humaneval/HumanEval/7"]
    assert held(f"My friend asked me this:   {mt_bench.upper()}", index, sizes) == ["mt-bench/84"]
    assert held("Write a function that adds two numbers.", index, sizes) == []
