"""Lookup branches: draft tokens copied from the text itself (prompt + output), no model needed.

`LookupIndex` keeps an n-gram index over the committed tokens, updated incrementally (O(new
tokens x max_ngram) per step). `branches()` finds the longest recent suffix (up to `max_ngram`
tokens) that occurred before and turns the continuations that followed its most recent
occurrences into a trie of distinct continuations with counts, up to `max_len` tokens deep (not
bound by the drafter's block).

Each trie edge gets a log-probability-like score from a calibration table (`LookupScores`): the
measured rate at which the target's greedy continuation agrees with a lookup token, given that
its parent agreed, by (suffix match length, the edge's share of its parent's count, depth in the
continuation). `treeflash train lookup-calibrate` measures it on target-generated training data
(never on evaluation sets); a table ships in `treeflash/assets/lookup_scores.json`.
"""
from __future__ import annotations

import functools
import json
from bisect import bisect_left
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TreeflashError

SCORES_FILE = Path(__file__).resolve().parent.parent / "assets" / "lookup_scores.json"
# feature buckets: upper bounds (inclusive) of each bucket; the last bucket takes the rest
MATCH_BUCKETS = (1, 2, 3, 5, 8)      # suffix match length in tokens
SHARE_BUCKETS = (0.34, 0.67, 0.999)  # the edge's count / its parent's count (last bucket: 1, unanimous)
DEPTH_BUCKETS = (1, 2, 4, 8)         # 1-based depth of the edge's token in the continuation


def bucket(value: float, bounds: tuple) -> int:
    """The index of the first bound >= value (len(bounds) beyond the last)."""
    return bisect_left(bounds, value)


@dataclass(frozen=True)
class LookupParams:
    max_ngram: int = 8       # longest suffix matched
    min_ngram: int = 1       # shortest suffix matched
    max_len: int = 16        # continuation tokens per branch
    occurrences: int = 8     # most recent occurrences of the suffix followed

    def check(self) -> "LookupParams":
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise TreeflashError(f"lookup n-gram lengths must satisfy 1 <= min <= max, got {self.min_ngram}, {self.max_ngram}")
        if self.max_len < 1 or self.occurrences < 1:
            raise TreeflashError("lookup length and occurrences must be >= 1")
        return self


@dataclass
class TrieNode:
    count: int = 0
    children: dict[int, "TrieNode"] = field(default_factory=dict)  # token -> node


@dataclass
class Branches:
    """The continuations of the matched suffix: a trie (root = the current last token)."""

    root: TrieNode
    match_len: int  # tokens of the matched suffix (0: no match, empty trie)


class LookupScores:
    """Calibrated log-probabilities of lookup edges: table[match][share][depth] = log p(agree)."""

    def __init__(self, table: list):
        self.table = table

    @classmethod
    def load(cls, path: Path | str = SCORES_FILE) -> "LookupScores":
        return cls(_read_table(str(path)))

    def edge(self, match_len: int, parent: "TrieNode", child: "TrieNode", depth: int) -> float:
        """log p of the edge parent -> child (child at `depth` of the continuation)."""
        m, s, d = cell(match_len, parent, child, depth)
        return self.table[m][s][d]


@functools.lru_cache(maxsize=4)
def _read_table(path: str) -> list:
    """The log_p table of a scores file (read once per process; tables are never mutated)."""
    try:
        return json.loads(Path(path).read_text())["log_p"]
    except (OSError, ValueError, KeyError) as e:
        raise TreeflashError(f"cannot read lookup scores {path}: {e}") from None


class LookupIndex:
    """n-gram index over one sequence of committed tokens (prompt + output so far)."""

    def __init__(self, params: LookupParams = LookupParams()):
        self.params = params.check()
        self.tokens: list[int] = []
        # n -> {n-gram: end positions, oldest first}; a position is indexed once a token follows it
        self.grams: list[dict[tuple, list[int]]] = [{} for _ in range(params.max_ngram + 1)]
        self.indexed = 0  # positions < indexed are in `grams`

    def sync(self, history: list[int]) -> None:
        """Index the tokens of `history` beyond those seen (history extends what was synced)."""
        if len(history) < len(self.tokens) or history[:1] != self.tokens[:1]:
            self.__init__(self.params)  # another sequence: start over
        self.tokens.extend(history[len(self.tokens):])
        toks = self.tokens
        for end in range(self.indexed, len(toks) - 1):  # `end` has a successor now
            for n in range(1, min(self.params.max_ngram, end + 1) + 1):
                self.grams[n].setdefault(tuple(toks[end - n + 1:end + 1]), []).append(end)
        self.indexed = max(self.indexed, len(toks) - 1)

    def branches(self, max_len: int | None = None) -> Branches:
        """Continuations (at most `max_len` tokens) of the longest suffix that occurred before."""
        p, toks = self.params, self.tokens
        max_len = p.max_len if max_len is None else min(max_len, p.max_len)
        root = TrieNode()
        if max_len < 1:
            return Branches(root, 0)
        for n in range(min(p.max_ngram, len(toks)), p.min_ngram - 1, -1):
            ends = self.grams[n].get(tuple(toks[len(toks) - n:]))
            if not ends:
                continue
            for end in reversed(ends[-p.occurrences:]):  # most recent first
                node = root
                node.count += 1
                for tok in toks[end + 1:end + 1 + max_len]:
                    node = node.children.setdefault(tok, TrieNode())
                    node.count += 1
            return Branches(root, n)
        return Branches(root, 0)


def cell(match_len: int, parent: TrieNode, child: TrieNode, depth: int) -> tuple[int, int, int]:
    """An edge's calibration bucket: (suffix match length, the child's share of its parent's count,
    the child's depth in the continuation), each bucketed."""
    return (bucket(match_len, MATCH_BUCKETS), bucket(child.count / parent.count, SHARE_BUCKETS),
            bucket(depth, DEPTH_BUCKETS))


# ---------------------------------------------------------------- calibration
def count_agreements(records, params: LookupParams = LookupParams()) -> list:
    """counts[match][share][depth] = [edges whose parent agreed, of which the edge agreed too].

    records: (token ids, prompt length) pairs, the ids as the target generated them greedily
    (prompt + response). A lookup is made at every response position, with the history up to it,
    and its trie is scored against the tokens that actually follow."""
    shape = (len(MATCH_BUCKETS) + 1, len(SHARE_BUCKETS) + 1, len(DEPTH_BUCKETS) + 1)
    counts = [[[[0, 0] for _ in range(shape[2])] for _ in range(shape[1])] for _ in range(shape[0])]
    for seq, prompt_len in records:
        first = max(int(prompt_len), 1)
        index, history = LookupIndex(params), list(seq[:first])
        for i in range(first, len(seq) - 1):  # history seq[:i+1] (its last token: the root); truth seq[i+1:]
            history.append(seq[i])
            index.sync(history)
            br = index.branches()
            if br.match_len == 0:
                continue
            truth = seq[i + 1:i + 1 + params.max_len]
            node, depth = br.root, 1
            while node.children and depth <= len(truth):
                for tok, child in node.children.items():
                    m, s, d = cell(br.match_len, node, child, depth)
                    counts[m][s][d][0] += 1
                    counts[m][s][d][1] += int(tok == truth[depth - 1])
                node = node.children.get(truth[depth - 1])
                if node is None:
                    break
                depth += 1
    return counts


def scores_from_counts(counts: list, prior: float = 0.2, strength: float = 4.0) -> list:
    """Smoothed log-rates: (agreed + prior * strength) / (seen + strength)."""
    return [[[round(math.log((a + prior * strength) / (n + strength)), 4) for n, a in row] for row in plane]
            for plane in counts]


# ---------------------------------------------------------------- copy steps (a diagnostic)
COPY_NGRAM = 3


def copy_steps(prompt_ids: list[int], token_ids: list[int], acceptance_lengths: list[int],
               n: int = COPY_NGRAM) -> list[bool]:
    """Which steps of a generation were *copy steps*: the last `n` committed tokens (prompt and
    output so far, ending with the step's root) occurred earlier, and the token that followed
    their most recent earlier occurrence is the token the target produced next. An `n`-gram
    lookup would have drafted that token; the bench reports tau on these steps apart.

    token_ids: the output, whose first token came from the prefill (no step); acceptance_lengths:
    tokens committed per step (accepted drafts + 1), in order -> one flag per step."""
    seq = list(prompt_ids) + list(token_ids)
    follow: dict[tuple, int] = {}  # n-gram -> the token after its most recent occurrence
    done = n                       # seq[:done] is indexed: every n-gram whose next token is there
    flags, pos = [], len(prompt_ids) + 1  # history seq[:pos] ends with the first step's root
    for a in acceptance_lengths:
        if pos >= len(seq):  # a step past the output's end (cut at the token limit): no next token
            flags.append(False)
            continue
        for f in range(done, pos):  # index the n-grams followed by seq[f], f < pos
            follow[tuple(seq[f - n:f])] = seq[f]
        done = max(done, pos)
        key = tuple(seq[pos - n:pos])
        flags.append(pos >= n and follow.get(key) == seq[pos])
        pos += a
    return flags


def copy_split(acceptance_lengths: list[int], flags: list[bool]) -> dict:
    """The share of steps that were copy steps and tau on them and on the rest (None: no such
    steps), from per-step acceptance lengths and `copy_steps` flags."""
    on = [a for a, c in zip(acceptance_lengths, flags) if c]
    off = [a for a, c in zip(acceptance_lengths, flags) if not c]
    n = len(on) + len(off)
    return {"copy_step_share": len(on) / n if n else None,
            "tau_copy_steps": sum(on) / len(on) if on else None,
            "tau_other_steps": sum(off) / len(off) if off else None}
