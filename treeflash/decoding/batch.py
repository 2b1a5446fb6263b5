"""Batched speculative decoding: several sequences, each at its own position, advance together.

`BatchDecoder.step` is a pipeline of short functions over the running sequences:
1. admit: waiting requests whose worst case fits the slot pool (`models/batchcache.py`) join;
   their prompts are prefilled in chunks, at most `prefill_chunk` prompt tokens per step over all
   of them, in one forward after the trees' (each chunk causal over its sequence's slots), so a
   long prompt delays the running sequences' steps by one chunk's forward at a time; a prompt's
   last chunk emits its first token;
2. draft: one drafter pass over every sequence's block [root, MASK x d] (`drafting.draft_blocks`:
   each block sees its own context and itself), then each sequence's own proposer builds its tree
   from its block's states (per-sequence state: lookup index, method, budget);
3. verify: ONE target forward over all trees concatenated (ragged rows at positions start+depth,
   in pool slots; each row sees its sequence's context and its tree ancestors);
4. accept: per sequence, the bs=1 `verify.accept` over its rows of the logits, with its own
   sampler and RNG (so a seeded request samples what it samples alone);
5. commit: the pool keeps each accepted path (one gather/scatter per layer for the batch), the
   drafter's contexts get the accepted rows' features (one pass), tokens are emitted by each
   `sequence.Sequence` (the per-sequence rules the bs=1 loop runs too: stop ids and strings,
   length, stats), and finished or cancelled sequences give their slots back.
Faults stay with their sequence: an exception in a sequence's own work (its tree, its sampler,
its tokens) ends that sequence alone (finish reason "error", the exception in `Sequence.error`, its
slots back in the pool); a shared pass (the drafter's, the target's forward) that raises is run
again for each sequence alone, and only a sequence whose own pass raises again ends.
Plain decoding of B sequences is the case of root-only trees. Needs `FastPath` (the static and
compiled backends, Llama / Qwen family). On the compiled backends the tree forward runs the
compiled bs=1 step graphs, its rows padded to a bucket (`FastPath.forward_rows`; `warm` compiles
them before serving); prefill chunks and the drafter's batched passes run eagerly.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import torch

from ..config import GenerationConfig
from ..errors import TreeflashError
from ..models.batchcache import PAGE_SIZE, BatchCache, round_up
from ..models.drafter import Drafter
from ..models.fastpath import BUCKETS, FastPath
from ..models.target import Target
from .drafting import draft_blocks, extend_contexts  # noqa: F401 (draft_blocks: the batch's drafter pass)
from .proposers import Proposer, make_proposer
from .sampling import choose
from .sequence import Sequence
from .stats import Stats
from .trees import Tree
from .verify import accept

class Rows:
    """Rows off..off+n-1 of a step's logits, indexed by node (what `accept` reads)."""

    def __init__(self, logits, off: int, n: int):
        self.logits, self.off, self.n = logits, off, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.logits[self.off + i]


# ---------------------------------------------------------------- pure pieces of a step
def pack(trees: list[Tree], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Trees and their roots' positions -> ids [N], positions [N] (start + depth), rows per tree."""
    ids = torch.cat([t.tokens for t in trees])                             # [N]
    pos = torch.cat([s + t.depths for t, s in zip(trees, starts)])        # [N]
    return ids, pos, [len(t) for t in trees]


def offsets(parts: list[tuple[object, int]]) -> list[int]:
    """[(item, rows)] -> the first row of each item when their rows are concatenated."""
    out, o = [], 0
    for _, n in parts:
        out.append(o)
        o += n
    return out


# ---------------------------------------------------------------- the decoder
class BatchDecoder:
    """Continuous batching of decode requests over one target (static and compiled backends).

    `add` queues a request, `step` advances every decoding sequence by one verified tree (and
    admits waiting ones and prefills the next chunk of their prompts), `cancel` ends one; requests
    join and leave between steps. `capacity`: the slot pool (None: sized at the first step for
    every request added by then).
    `prefill_chunk`: most prompt tokens prefilled per step, all waiting prompts together (None:
    every admitted prompt whole in the step it joins)."""

    def __init__(self, target: Target, drafter: Drafter | None = None, capacity: int | None = None,
                 page_size: int = PAGE_SIZE, prefill_chunk: int | None = None):
        if not isinstance(target.runner, FastPath):
            raise TreeflashError(f"batched decoding needs the static or a compiled backend (Llama / Qwen family); "
                                 f"the target runs {target.backend}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise TreeflashError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target, self.drafter, self.page_size = target, drafter, page_size
        self.prefill_chunk = prefill_chunk
        self.runner: FastPath = target.runner
        self.cache = BatchCache.for_runner(self.runner, capacity, page_size) if capacity else None
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.finished: dict[int, Sequence] = {}
        self._next_id = 0

    def warm(self, rows: int) -> None:
        """Compile now (compiled backends) the steps of tree forwards of up to `rows` rows in all,
        so that no request waits for a compile."""
        self.target.warm(range(1, min(rows, BUCKETS[-1]) + 1))

    # ---- requests ----
    def add(self, prompt_ids: list[int], config: GenerationConfig | None = None, *,
            proposer: Proposer | None = None, stop_ids: set[int] | None = None, text=None) -> int:
        """Queue a request; returns its id. `config` gives the method (unless `proposer` is given),
        sampling, max_new_tokens, seed and ignore_eos; `stop_ids` overrides the target's; `text` (a
        `TextAssembler`, optional) is fed its tokens, and its stop strings end it."""
        cfg = config or GenerationConfig()
        if proposer is None:
            proposer = make_proposer(cfg.method, self.drafter, self.target.embed, self.target.drafting_head,
                                     cfg.tree(self.target.vocab_rows))
        seq = Sequence.request(self.target, prompt_ids, cfg, proposer, text, stop_ids, id=self._next_id)
        if self.cache is not None and self.cache.pages_for(seq.reserved) * self.page_size > self.cache.capacity:
            raise TreeflashError(f"a request of up to {seq.reserved} tokens exceeds the pool ({self.cache.capacity} slots)")
        self._next_id += 1
        self.waiting.append(seq)
        return seq.id

    def cancel(self, seq_id: int, reason: str = "abort") -> None:
        """End a waiting or running request now (its tokens so far stay in `finished`)."""
        for s in self.waiting:
            if s.id == seq_id:
                self.waiting.remove(s)
                s.finish(reason)
                self.finished[seq_id] = s
                return
        if seq_id in self.running:
            self._finish(self.running[seq_id], reason)

    def set_budget(self, seq_id: int, budget: int) -> int:
        """A waiting or running sequence's tree budget from its next step on (the proposer reads
        `params.budget` each step), within 1..the budget it was added with (its reservation and
        drafter context assume at most that); returns the budget set. Any budget is lossless."""
        seq = self.running.get(seq_id) or next((s for s in self.waiting if s.id == seq_id), None)
        if seq is None:
            raise TreeflashError(f"no waiting or running sequence {seq_id}")
        budget = max(1, min(int(budget), seq.max_budget))
        if seq.proposer.params.budget != budget:
            seq.proposer.params = replace(seq.proposer.params, budget=budget)
        return budget

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """Advance every decoding sequence by one tree; admit waiting requests that fit and prefill
        the next chunk of the prompts not yet prefilled. Returns the tokens each sequence emitted
        in this step."""
        out: dict[int, list[int]] = {}
        decoding = [s for s in self.running.values() if not s.prefilling]
        if decoding:
            self._decode(decoding, out)
        self._admit()
        chunks = self._chunks([s for s in self.running.values() if s.prefilling])
        if chunks:
            self._prefill(chunks, out)
        return out

    def _chunks(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """(sequence, prompt tokens to prefill now), first admitted first, within `prefill_chunk`."""
        left = self.prefill_chunk if self.prefill_chunk is not None else sum(len(s.prompt) for s in seqs)
        chunks = []
        for s in seqs:
            n = min(len(s.prompt) - s.filled, left)
            if n < 1:
                break
            chunks.append((s, n))
            left -= n
        return chunks

    def _admit(self) -> list[Sequence]:
        """Waiting requests join, first come first served, while their reservations fit the pool."""
        if self.cache is None:
            need = sum(round_up(s.reserved, self.page_size) for s in self.waiting)
            self.cache = BatchCache.for_runner(self.runner, max(need, self.page_size), self.page_size)
        new = []
        while self.waiting and self.cache.fits(self.waiting[0].reserved):
            s = self.waiting.popleft()
            self.cache.add(s.id, s.reserved)
            s.t_start = time.perf_counter()
            self.running[s.id] = s
            new.append(s)
        return new

    def _forward(self, ids, pos, slots, mask, flat: bool = False):
        """One target forward over rows ids, pos, slots [N] with mask [N, W] into the pool ->
        (logits indexable by row, features [N, taps*H]); compiled on the compiled backends, except
        flat prefill chunks (`FastPath.forward_rows`)."""
        return self.runner.forward_rows(self.cache.kv, ids, pos, slots, mask, self.target.tap_ids,
                                        self.cache.scratch, flat=flat)

    def _rows(self, parts: list[tuple[int, int, torch.Tensor | None]]):
        """parts [(seq, n, tree mask [n, n] or None)] -> slots [N] and mask [N, W] of a forward."""
        slots = torch.cat([self.cache.write(i, n) for i, n, _ in parts])  # [N]
        width = self.cache.width([i for i, _, _ in parts])
        return slots, self.cache.step_mask(parts, slots, width)

    # ---- fault isolation ----
    def _each(self, seqs: list[Sequence], fn) -> list[tuple[Sequence, object]]:
        """[(seq, fn(seq))] for the sequences whose fn returned; one that raises ends alone."""
        done = []
        for s in seqs:
            try:
                done.append((s, fn(s)))
            except Exception as e:  # noqa: BLE001  (its request's error: `Sequence.error`)
                self._fail(s, e)
        return done

    def _shared(self, seqs: list[Sequence], fn) -> dict[int, object]:
        """fn(seqs) -> {seq id: result}: one pass for all of them; if it raises, once more for
        each sequence alone (those that raise again end alone)."""
        try:
            return fn(seqs)
        except Exception:  # noqa: BLE001  (retried per sequence below)
            return {s.id: r for s, r in self._each(seqs, lambda s: fn([s])[s.id])}

    def fail(self, seq_id: int, error: BaseException) -> None:
        """End a running request for a fault of its own (finish reason "error", `Sequence.error`); a
        request that has just finished keeps its tokens but is marked failed too."""
        s = self.running.get(seq_id) or self.finished.get(seq_id)
        if s is not None:
            self._fail(s, error)

    def _fail(self, s: Sequence, error: BaseException) -> None:
        s.fail(error)
        self._release(s)

    # ---- prefill ----
    def _prefill(self, chunks: list[tuple[Sequence, int]], out: dict) -> None:
        """One forward over the next chunk of each prompt (positions filled..filled+n-1); a prompt
        prefilled to its end emits its first token."""
        t0 = time.perf_counter()
        sizes = {s.id: n for s, n in chunks}
        rows = self._shared([s for s, _ in chunks], lambda seqs: self._prefill_rows([(s, sizes[s.id]) for s in seqs]))
        self.cache.compact({sid: torch.arange(sizes[sid]) for sid in rows})
        self._each([s for s, _ in chunks if s.id in rows], lambda s: self._prefilled(s, *rows[s.id], t0, out))

    def _prefill_rows(self, chunks: list[tuple[Sequence, int]]) -> dict[int, tuple]:
        """The prompt chunks' forward -> {seq id: (its logits rows, its features [n, taps*H], positions [n])}."""
        dev = self.target.device
        ids = torch.tensor([t for s, n in chunks for t in s.prompt[s.filled:s.filled + n]], device=dev)  # [N]
        pos = torch.cat([torch.arange(s.filled, s.filled + n, device=dev) for s, n in chunks])          # [N]
        slots, mask = self._rows([(s.id, n, None) for s, n in chunks])
        logits, feats = self._forward(ids, pos, slots, mask, flat=True)
        return {s.id: (Rows(logits, o, n), feats[o:o + n], pos[o:o + n]) for (s, n), o in zip(chunks, offsets(chunks))}

    def _prefilled(self, s: Sequence, logits: "Rows", feats: torch.Tensor, pos: torch.Tensor, t0: float, out: dict) -> None:
        if s.dcache is not None:
            s.drafter.extend(s.dcache, feats, pos)
        s.filled += len(logits)
        s.stats.prefill_s += time.perf_counter() - t0
        if not s.prefilling:
            out[s.id] = list(s.first(choose(logits[len(logits) - 1], s.sampling, s.gen)))
            self._release(s)

    # ---- decode ----
    def _decode(self, seqs: list[Sequence], out: dict) -> None:
        """One step of the decoding sequences: draft -> propose -> verify -> accept -> commit."""
        t0 = time.perf_counter()
        ready = self._shared(seqs, self._draft)
        t_draft = time.perf_counter() - t0
        trees = dict(self._each([s for s in seqs if s.id in ready], lambda s: s.propose(ready[s.id])))
        t1 = time.perf_counter()
        seqs = [s for s in seqs if s in trees]
        rows = self._shared(seqs, lambda group: self._verify_rows([(s, trees[s]) for s in group]))
        accs = dict(self._each([s for s in seqs if s.id in rows],
                               lambda s: accept(trees[s], rows[s.id][0], s.sampling, s.gen)))
        keeps = {s.id: torch.tensor(a.path, device=self.target.device) for s, a in accs.items()}  # [K] each
        self.cache.compact(keeps)
        seqs = [s for s in seqs if s in accs]
        feats = {i: rows[i][1][keep] for i, keep in keeps.items()}  # the accepted rows' features [K, taps*H]
        grown = self._shared(seqs, lambda group: self._commit_contexts(group, feats))
        t_verify = time.perf_counter() - t1
        for s, toks in self._each([s for s in seqs if s.id in grown],
                                  lambda s: list(s.advance(trees[s], accs[s], t_draft, t_verify))):
            out[s.id] = toks
            self._release(s)

    def _verify_rows(self, parts: list[tuple[Sequence, Tree]]) -> dict[int, tuple]:
        """ONE target forward over the trees -> {seq id: (its logits rows, its features [n, taps*H])}."""
        dev = self.target.device
        ids, pos, _ = pack([t for _, t in parts], [s.start for s, _ in parts])
        slots, mask = self._rows([(s.id, len(t), t.ancestor_mask()) for s, t in parts])
        logits, feats = self._forward(ids.to(dev), pos.to(dev), slots, mask)
        sizes = [(s, len(t)) for s, t in parts]
        return {s.id: (Rows(logits, o, n), feats[o:o + n]) for (s, n), o in zip(sizes, offsets(sizes))}

    def _draft(self, seqs: list[Sequence]) -> dict[int, torch.Tensor | None]:
        """{seq id: its block's drafter states [d+1, H], or None (no drafter pass)}: one drafter
        pass per drafter (normally one)."""
        ready: dict[int, torch.Tensor | None] = {s.id: None for s in seqs}
        for group in self._by_drafter([(s, s.block_depth()) for s in seqs]):
            states = draft_blocks(group[0][0].drafter, group[0][0].proposer.embed, [s.draft_job(d) for s, d in group])
            ready.update({s.id: h for (s, _), h in zip(group, states)})
        return ready

    def _commit_contexts(self, seqs: list[Sequence], feats: dict[int, torch.Tensor]) -> dict[int, bool]:
        """The drafter contexts grow by the accepted rows' features, one pass per drafter."""
        for group in self._by_drafter([(s, len(feats[s.id])) for s in seqs]):
            extend_contexts(group[0][0].drafter, [s.context_rows(feats[s.id]) for s, _ in group])
        return {s.id: True for s in seqs}

    @staticmethod
    def _by_drafter(items: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
        """[(seq, n)] of drafting sequences with n >= 1, grouped by their drafter."""
        groups: dict[int, list] = {}
        for s, n in items:
            if s.dcache is not None and n >= 1:
                groups.setdefault(id(s.drafter), []).append((s, n))
        return list(groups.values())

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish(reason)
        self._release(s)

    def _release(self, s: Sequence) -> None:
        """A sequence that has ended gives its slots back and moves to `finished`."""
        if s.done and self.running.get(s.id) is s:
            self.cache.free(s.id)
            del self.running[s.id]
            self.finished[s.id] = s

    # ---- a whole batch ----
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
