"""One sequence's decoding state, with every per-sequence rule written once: the single-sequence
loop (`generate.decode`) and the batched step (`batch.BatchDecoder`) both run on it.

The rules: what a request may ask (`check_request`), the KV reservation (the tokens wanted, then
the proposer's rows of one tree), the prompt's rows and chunks (`prefill_chunks`: how a batch
shares a step's prefill), what a prefilled chunk does (the drafter's context grows; the last one
samples the first token), the drafter's context (kept where the proposer drafts) and its block, how
deep a step's tree may go and where its rows sit, each step's budget (`plan`: the set budget, or
`step_budget.StepBudget`'s choice where the proposer has one), emitting tokens (a stop id, a stop string,
max_new_tokens and the context window end it) and the stats, closed once when the sequence ends
(stop, length, a cancel, an error).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from ..config import GenerationConfig
from ..errors import TreeflashError
from ..models.drafter import Drafter
from ..models.kvcache import DraftCache
from ..models.target import Target
from .lookup import Branches
from .proposers import Proposer
from .sampling import Acceptance, SamplingParams, choose
from .stats import Stats
from .step_budget import StepRecord, lookup_probs
from .trees import Tree


def check_request(prompt_ids: list[int], max_new_tokens: int, limit: int) -> None:
    """A one-line TreeflashError for a request no sequence can decode (limit: the context window)."""
    if not prompt_ids:
        raise TreeflashError("empty prompt: a request needs at least one token")
    if len(prompt_ids) >= limit:
        raise TreeflashError(f"prompt has {len(prompt_ids)} tokens; the context window is {limit}")
    if max_new_tokens < 1:
        raise TreeflashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def prefill_chunks(seqs: list["Sequence"], budget: int | None) -> list[tuple["Sequence", int]]:
    """(sequence, prompt tokens to prefill now) for sequences still prefilling, in their order, at
    most `budget` tokens in all (None: every prompt whole); the first that gets none ends the list."""
    left = budget if budget is not None else sum(len(s.prompt) for s in seqs)
    chunks = []
    for s in seqs:
        n = min(len(s.prompt) - s.filled, left)
        if n < 1:
            break
        chunks.append((s, n))
        left -= n
    return chunks


@dataclass(eq=False)
class Sequence:
    """One request's decoding state (`Sequence.new` checks and sets it up)."""

    prompt: list[int]
    proposer: Proposer
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: set[int]
    limit: int                               # the target's context window
    gen: torch.Generator | None = None
    text: object | None = None               # a `TextAssembler` fed each token: its stop strings end it
    id: int = 0
    stats: Stats | None = None               # the caller's
    dcache: DraftCache | None = None         # the drafter's context (None: no drafting)
    history: list[int] = field(default_factory=list)  # prompt + emitted tokens (ends with the root)
    tokens: list[int] = field(default_factory=list)   # emitted tokens
    start: int = 0                           # position of the root = tokens in the target's cache
    filled: int = 0                          # prompt tokens prefilled so far
    budget: int = 1                          # the tree budget set (`set_budget`); a step may choose another (`plan`)
    max_budget: int = 1                      # the budget it was added with: `set_budget` stays within it
    skip_draft: bool = False                 # this step runs no drafter pass (`plan`: a lookup-only tree)
    branches: Branches | None = None         # this step's lookup branches where `plan` found them
    record: StepRecord = field(default_factory=StepRecord)  # its steps: lookup tokens expected, accepted; times
    expected: float | None = None            # this step's expected accepted lookup tokens (a lookup-only step)
    timed: bool = False                      # this step was planned alone: its time goes into `record`
    reserved: int = 0                        # worst-case target cache slots (its reservation)
    t_start: float = 0.0
    done: bool = False
    error: BaseException | None = None       # what ended it (finish reason "error")

    @classmethod
    def new(cls, prompt: list[int], proposer: Proposer, sampling: SamplingParams, max_new_tokens: int,
            stop_ids: set[int], limit: int, stats: Stats, seed: int | None = None, text=None,
            id: int = 0) -> "Sequence":
        """A checked sequence (`check_request`) whose `stats` (a fresh `Stats`) it fills."""
        check_request(prompt, max_new_tokens, limit)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        s = cls(list(prompt), proposer, sampling, max_new_tokens, set(stop_ids), limit, gen, text, id, stats)
        s.budget = s.max_budget = proposer.params.budget
        # every token wanted (within the window), then the rows of its largest tree (a lookup-only one
        # where its proposer has a planner) written past them before compaction
        s.reserved = min(limit, len(prompt) + max_new_tokens) + proposer.max_rows()
        if proposer.drafts:
            s.dcache = DraftCache(len(proposer.drafter.model.layers))
        proposer.timings = {"draft": 0.0, "tree": 0.0}
        s.stats.prompt_tokens = len(prompt)
        s.t_start = time.perf_counter()
        return s

    @classmethod
    def request(cls, target: Target, prompt: list[int], cfg: GenerationConfig, proposer: Proposer, text=None,
                stop_ids: set[int] | None = None, id: int = 0) -> "Sequence":
        """A sequence for a request to `target` as `cfg` says (sampling, max_new_tokens, seed); its stop
        ids: `stop_ids`, else the target's unless `cfg.ignore_eos`."""
        if stop_ids is None:
            stop_ids = set() if cfg.ignore_eos else target.stop_ids()
        return cls.new(prompt, proposer, cfg.sampling(target.vocab_rows), cfg.max_new_tokens, stop_ids,
                       target.max_length, Stats(), cfg.seed, text, id)

    def set_budget(self, budget: int) -> int:
        """The tree budget from the next step on (the proposer reads `params.budget` each step),
        within 1..the budget it was added with (its reservation and drafter context assume at most
        that); returns the budget set. Any budget is lossless."""
        self.budget = max(1, min(int(budget), self.max_budget))
        self._use(self.budget)
        return self.budget

    def _use(self, budget: int) -> None:
        if self.proposer.params.budget != budget:
            self.proposer.params = replace(self.proposer.params, budget=budget)

    def plan(self, alone: bool = True) -> None:
        """This step's budget and whether its drafter runs: the set budget, drafting where the
        sequence keeps a drafter context; where the proposer has a `StepBudget` (lookup methods under
        --tree-size auto) and the sequence decodes `alone` (its choice weighs one sequence's step
        costs; in a batch the set budget follows the load), its choice from this step's lookup
        branches (found here, once)."""
        planner = self.proposer.planner
        self.skip_draft, self.expected, self.timed = False, None, planner is not None and alone
        if not self.timed:
            self._use(self.budget)
            return
        t0 = time.perf_counter()
        self.branches = self.proposer.lookup_branches(self.history, self.max_depth())
        probs = lookup_probs(self.branches, self.proposer.scores)
        budget, drafting = planner.choose(self.budget, self.dcache is not None, probs, self.record)
        self.skip_draft = not drafting
        self.expected = sum(probs[:budget - 1]) if budget > 1 and not drafting else None
        self._use(budget)
        self.proposer.timings["tree"] += time.perf_counter() - t0

    @property
    def drafter(self) -> Drafter | None:
        return self.proposer.drafter if self.dcache is not None else None

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt)

    def prompt_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's next n tokens to prefill: ids [n], positions [n]."""
        return torch.tensor(self.prompt[self.filled:self.filled + n]), torch.arange(self.filled, self.filled + n)

    def prefilled(self, logits, feats: torch.Tensor | None, t0: float) -> Iterator[int]:
        """The target holds the prompt's next len(logits) tokens (its logits rows, features [n,
        taps*H]; prefill began at t0): the drafter's context grows by them; after the prompt's last
        chunk, the first token is sampled from its last row and emitted (`first`)."""
        n = len(logits)
        if self.dcache is not None:
            self.drafter.extend(self.dcache, feats, torch.arange(self.filled, self.filled + n, device=feats.device))
        self.filled += n
        self.stats.prefill_s += time.perf_counter() - t0
        return iter(()) if self.prefilling else self.first(choose(logits[n - 1], self.sampling, self.gen))

    def max_depth(self) -> int:
        """How deep this step's tree may go: the tokens still wanted and the context window."""
        return min(self.max_new_tokens - len(self.tokens) - 1, self.limit - self.start - 2)

    def block_depth(self) -> int:
        """Masks of this step's drafter block (0: no drafter pass)."""
        return self.proposer.block_depth(self.max_depth()) if self.dcache is not None and not self.skip_draft else 0

    def draft_block(self, depth: int) -> tuple[DraftCache, torch.Tensor, int]:
        """This step's drafter block [root, MASK x depth] for `Drafter.draft_blocks`: (context, the
        block embedded [depth+1, H], start)."""
        embed = self.proposer.embed
        return self.dcache, embed(self.drafter.block_ids(self.history[-1], depth, embed.weight.device)), self.start

    def propose(self, states: torch.Tensor | None) -> Tree:
        """This step's tree; states [d+1, H]: the drafter's pass over its block (None: none)."""
        branches, self.branches = self.branches, None
        return self.proposer.propose(self.history[-1], self.start, self.max_depth(), self.history, states, branches)

    def tree_rows(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tree's rows in the target's forward: ids [N], positions [N] (start + depth), ancestor mask [N, N]."""
        return tree.tokens, self.start + tree.depths, tree.ancestor_mask()

    def context_rows(self, feats: torch.Tensor) -> tuple[DraftCache, torch.Tensor, torch.Tensor]:
        """The accepted (or prefilled) rows' features [K, taps*H] -> (context, feats, positions [K])
        for `Drafter.extend_contexts`; positions run from `start` (before `advance`)."""
        return self.dcache, feats, self.start + torch.arange(len(feats), device=feats.device)

    def first(self, root: int) -> Iterator[int]:
        """The prompt is prefilled and `root` sampled from its last row: emit it."""
        self.start, self.history = len(self.prompt), list(self.prompt)
        return self.emit([root])

    def advance(self, tree: Tree, acc: Acceptance, draft_s: float = 0.0, verify_s: float = 0.0) -> Iterator[int]:
        """A step's tree is verified and its path committed: the stats and the position now, then
        its tokens as they are emitted (`emit`)."""
        self.stats.draft_s += draft_s
        self.stats.verify_s += verify_s
        self.stats.record(len(acc.accepted), len(tree), acc.path)
        if self.timed:  # what its later steps choose from
            self.record.add(len(tree), verify_s, len(acc.accepted) + 1, self.expected)
        self.start += len(acc.path)
        return self.emit(acc.accepted + [acc.bonus])

    def emit(self, toks: list[int]) -> Iterator[int]:
        """Emit tokens one by one, up to the first that ends the sequence: a stop id (emitted) or
        the last of a stop string (`text`); at the last, max_new_tokens or a full context window
        ends it. The sequence has ended before its last token is handed out; a token counts once
        it is taken, so a reader that stops early (a cancel) leaves the rest uncounted. The limits
        count this sequence's tokens (`stats.new_tokens` says them; a caller may reuse its stats)."""
        for i, tok in enumerate(toks):
            self.history.append(tok)
            self.tokens.append(tok)
            self.stats.new_tokens = len(self.tokens)
            if tok in self.stop_ids or (self.text is not None and self.text.feed(tok)):
                self.finish("stop")
            elif i == len(toks) - 1 and (len(self.tokens) >= self.max_new_tokens or self.start + 1 >= self.limit):
                self.finish("length")
            yield tok
            if self.done:
                return

    def finish(self, reason: str) -> None:
        """End it ("stop", "length", "abort", "error"): the stats are closed the first time; a
        later reason (a fault found after its end) replaces the first."""
        self._use(self.budget)  # its proposer as it was set (a step may have chosen another budget)
        if not self.done:
            self.done = True
            self.stats.draft_s += self.proposer.timings["draft"]
            self.stats.tree_s += self.proposer.timings["tree"]
            self.stats.total_s = time.perf_counter() - self.t_start
        self.stats.finish_reason = reason

    def fail(self, error: BaseException) -> None:
        """A fault of its own ends it (finish reason "error"; the first fault is kept)."""
        self.error = self.error or error
        self.finish("error")
