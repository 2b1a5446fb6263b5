"""Batched speculative decoding: several sequences, each at its own position, advance together.

`BatchDecoder.step`, over the running sequences, in the order the code reads:
1. decode: one drafter pass over every block (`Drafter.draft_blocks`), each proposer builds its
   tree, ONE target forward verifies all trees (ragged rows in pool slots, each seeing its
   sequence's context and its tree ancestors; `FastPath.forward_rows`, compiled graphs on the
   compiled backends), each sequence accepts with its own sampler and RNG (`sampling.accept`), the
   pool keeps the accepted paths, the drafter contexts grow (one pass), and each
   `sequence.Sequence` emits its tokens by the rules the bs=1 loop runs too;
2. admit: waiting requests whose worst case fits the slot pool (`models/kvcache.py`) join;
3. prefill: the next chunk of each prompt (`sequence.prefill_chunks`), in one forward; a prompt's
   last chunk emits its first token, so a long prompt delays the others by a chunk per step.
Faults stay with their sequence: an exception in its own work (tree, sampler, tokens) ends it
alone (finish reason "error", `Sequence.error`, its slots back); a shared pass (the drafter's,
the target's forward) that raises runs again per sequence, and only one that raises again ends.
Plain decoding is the case of root-only trees. Needs `FastPath` (static and compiled backends).
"""
from __future__ import annotations

import time
from collections import deque
from itertools import accumulate

import torch

from ..config import GenerationConfig
from ..errors import TreeflashError
from ..models.kvcache import PAGE_SIZE, BatchCache, round_up
from ..models.drafter import Drafter
from ..models.fastpath import BUCKETS, FastPath
from ..models.target import Target
from .proposers import Proposer, make_proposer
from .sampling import accept
from .sequence import Sequence, prefill_chunks
from .stats import Stats


class Rows:
    """Rows off..off+n-1 of a forward's logits, indexed by node (what `accept` reads)."""

    def __init__(self, logits, off: int, n: int):
        self.logits, self.off, self.n = logits, off, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.logits[self.off + i]


class BatchDecoder:
    """Continuous batching of decode requests over one target (static and compiled backends).

    `add` queues a request, `step` advances them all, `cancel` ends one; requests join and leave
    between steps. `capacity`: the slot pool (None: sized at the first step for the requests added
    by then). `prefill_chunk`: most prompt tokens prefilled per step, all prompts together (None:
    every admitted prompt whole in the step it joins)."""

    def __init__(self, target: Target, drafter: Drafter | None = None, capacity: int | None = None,
                 page_size: int = PAGE_SIZE, prefill_chunk: int | None = None):
        if not isinstance(target.runner, FastPath):
            raise TreeflashError(f"batched decoding needs the static or a compiled backend (Llama / Qwen family); "
                                 f"the target runs {target.backend}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise TreeflashError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target, self.drafter, self.page_size, self.prefill_chunk = target, drafter, page_size, prefill_chunk
        self.runner: FastPath = target.runner
        self.cache = BatchCache.for_runner(self.runner, capacity, page_size) if capacity else None
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.finished: dict[int, Sequence] = {}
        self._next_id = 0

    # ---- one step ----
    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """Advance every decoding sequence by one tree, admit waiting requests that fit, prefill the
        next chunk of the prompts; returns {seq id: the tokens it emitted in this step}."""
        out: dict[int, list[int]] = {}
        decoding = [s for s in self.running.values() if not s.prefilling]
        if decoding:
            self._decode(decoding, out)
        if self.waiting:
            self._admit()
        chunks = dict(prefill_chunks([s for s in self.running.values() if s.prefilling], self.prefill_chunk))
        if chunks:
            self._prefill(chunks, out)
        return out

    def _decode(self, seqs: list[Sequence], out: dict) -> None:
        """One step of the decoding sequences: draft -> propose -> verify -> accept -> commit."""
        alone = len(seqs) == 1  # per-step lookup budgets weigh one sequence's costs; a batch's follow the load
        seqs = list(self._each(seqs, lambda s: s.plan(alone)))  # each one's budget, and whether its drafter runs
        t0 = time.perf_counter()
        states = self._shared(seqs, self._draft)
        t_draft = time.perf_counter() - t0
        trees = self._each(states, lambda s: s.propose(states[s]))
        t1 = time.perf_counter()
        rows = self._shared(trees, lambda group: self._forward([(s, *s.tree_rows(trees[s])) for s in group]))
        accs = self._each(rows, lambda s: accept(trees[s], rows[s][0], s.sampling, s.gen))
        keeps = {s: torch.tensor(a.path, device=self.target.device) for s, a in accs.items()}  # [K] each
        self.cache.compact({s.id: keep for s, keep in keeps.items()})
        grown = self._shared(keeps, lambda group: self._grow_contexts({s: rows[s][1][keeps[s]] for s in group}))
        t_verify = time.perf_counter() - t1
        for s, toks in self._each(grown, lambda s: list(s.advance(trees[s], accs[s], t_draft, t_verify))).items():
            out[s.id] = toks
            self._release(s)

    def _draft(self, seqs: list[Sequence]) -> dict[Sequence, torch.Tensor | None]:
        """{seq: its block's drafter states [d+1, H], or None (no drafter pass)}: one drafter pass."""
        depths = {s: d for s in seqs if (d := s.block_depth())}  # 0: no drafter context, or no pass
        states = self.drafter.draft_blocks([s.draft_block(d) for s, d in depths.items()]) if depths else []
        return dict.fromkeys(seqs) | dict(zip(depths, states))

    def _grow_contexts(self, feats: dict[Sequence, torch.Tensor]) -> dict[Sequence, bool]:
        """feats {seq: its accepted rows' features [K, taps*H]}: the drafter contexts grow by them (one pass)."""
        items = [s.context_rows(f) for s, f in feats.items() if s.dcache is not None]
        if items:
            self.drafter.extend_contexts(items)
        return dict.fromkeys(feats, True)

    def _forward(self, parts: list[tuple], flat: bool = False) -> dict[Sequence, tuple]:
        """ONE target forward over parts [(seq, ids [n], positions [n], tree mask [n, n] or None:
        causal)] in their pool slots -> {seq: (its logits rows, its features [n, taps*H])}."""
        dev, sizes = self.target.device, [len(ids) for _, ids, _, _ in parts]
        slots, mask = self.cache.write_rows([(s.id, n, m) for (s, _, _, m), n in zip(parts, sizes)])
        ids, pos = (torch.cat([p[i] for p in parts]).to(dev) for i in (1, 2))  # [N] each
        logits, feats = self.runner.forward_rows(self.cache.kv, ids, pos, slots, mask, self.target.tap_ids,
                                                 self.cache.scratch, flat=flat)
        offsets = accumulate(sizes, initial=0)
        return {s: (Rows(logits, o, n), feats[o:o + n]) for (s, *_), o, n in zip(parts, offsets, sizes)}

    def _prefill(self, chunks: dict[Sequence, int], out: dict) -> None:
        """One forward over the next chunk of each prompt (chunks {seq: tokens}); a last chunk emits a token."""
        t0 = time.perf_counter()
        rows = self._shared(chunks, lambda group: self._forward([(s, *s.prompt_rows(chunks[s]), None) for s in group],
                                                                flat=True))
        self.cache.compact({s.id: torch.arange(chunks[s]) for s in rows})  # every row stays
        for s, toks in self._each(rows, lambda s: list(s.prefilled(*rows[s], t0))).items():
            if toks:
                out[s.id] = toks
            self._release(s)

    def _admit(self) -> None:
        """Waiting requests join while their reservations fit the pool (`BatchCache.admit`)."""
        if self.cache is None:  # sized for the requests added by now
            need = sum(round_up(s.reserved, self.page_size) for s in self.waiting)
            self.cache = BatchCache.for_runner(self.runner, need, self.page_size)
        for s in self.cache.admit(self.waiting):
            s.t_start = time.perf_counter()
            self.running[s.id] = s

    # ---- faults and ends ----
    def _each(self, seqs, fn) -> dict[Sequence, object]:
        """{seq: fn(seq)} for the sequences whose fn returned; one that raises ends alone."""
        done = {}
        for s in seqs:
            try:
                done[s] = fn(s)
            except Exception as e:  # noqa: BLE001  (its request's error: `Sequence.error`)
                s.fail(e)
                self._release(s)
        return done

    def _shared(self, seqs, fn) -> dict[Sequence, object]:
        """fn(seqs) -> {seq: result}: one pass for all of them; if it raises, once more for each
        sequence alone (those that raise again end alone)."""
        try:
            return fn(list(seqs))
        except Exception:  # noqa: BLE001  (retried per sequence below)
            return self._each(seqs, lambda s: fn([s])[s])

    def _release(self, s: Sequence) -> None:
        """A sequence that has ended leaves the queue or the batch (its slots back to the pool)
        for `finished`."""
        if not s.done:
            return
        if self.running.get(s.id) is s:
            self.cache.free(s.id)
            del self.running[s.id]
        elif s in self.waiting:
            self.waiting.remove(s)
        self.finished[s.id] = s

    # ---- requests ----
    def add(self, prompt_ids: list[int], config: GenerationConfig | None = None, *,
            proposer: Proposer | None = None, stop_ids: set[int] | None = None, text=None) -> int:
        """Queue a request; returns its id. `config` gives the method (unless `proposer` is given),
        sampling, max_new_tokens, seed and ignore_eos; `stop_ids` overrides the target's; `text` (a
        `TextAssembler`, optional) is fed its tokens, and its stop strings end it."""
        cfg = config or GenerationConfig()
        if proposer is None and cfg.tree_size == "auto":
            raise TreeflashError('tree_size "auto": give the proposer `Engine.prepare` makes for it')
        if proposer is None:
            proposer = make_proposer(cfg.method, self.drafter, self.target.embed, self.target.drafting_head,
                                     cfg.tree(self.target.vocab_rows))
        if proposer.drafts and proposer.drafter is not self.drafter:
            raise TreeflashError("a batch drafts with one drafter (its decoder's); this proposer has another")
        seq = Sequence.request(self.target, prompt_ids, cfg, proposer, text, stop_ids, id=self._next_id)
        if self.cache is not None:
            self.cache.check(seq.reserved)
        self._next_id += 1
        self.waiting.append(seq)
        return seq.id

    def _find(self, seq_id: int) -> Sequence | None:
        return self.running.get(seq_id) or next((s for s in self.waiting if s.id == seq_id), None)

    def cancel(self, seq_id: int, reason: str = "abort") -> None:
        """End a waiting or running request now (its tokens so far stay in `finished`)."""
        s = self._find(seq_id)
        if s is not None:
            s.finish(reason)
            self._release(s)

    def fail(self, seq_id: int, error: BaseException) -> None:
        """End a running request for a fault of its own (finish reason "error", `Sequence.error`); a
        request that has just finished keeps its tokens but is marked failed too."""
        s = self.running.get(seq_id) or self.finished.get(seq_id)
        if s is not None:
            s.fail(error)
            self._release(s)

    def set_budget(self, seq_id: int, budget: int) -> int:
        """A waiting or running sequence's tree budget from its next step on (`Sequence.set_budget`)."""
        seq = self._find(seq_id)
        if seq is None:
            raise TreeflashError(f"no waiting or running sequence {seq_id}")
        return seq.set_budget(budget)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def warm(self, rows: int) -> None:
        """Compile now (compiled backends) the steps of tree forwards of up to `rows` rows in all,
        so that no request waits for a compile."""
        self.target.warm(range(1, min(rows, BUCKETS[-1]) + 1))

    def run(self, seq_ids: list[int]) -> list[tuple[list[int], Stats]]:
        """Step until these sequences end. Returns per sequence (token ids, up to the one that
        ended it, and stats)."""
        ids: dict[int, list[int]] = {i: [] for i in seq_ids}
        while any(i not in self.finished for i in seq_ids):
            for i, toks in self.step().items():
                ids.get(i, []).extend(toks)
        for i in seq_ids:  # the others ran to their end; a library caller sees the fault
            if self.finished[i].error is not None:
                raise self.finished[i].error
        return [(ids[i], self.finished[i].stats) for i in seq_ids]
