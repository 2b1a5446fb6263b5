"""Batched speculative decoding: several sequences, each at its own position, advance together.

`BatchDecoder.step` is a pipeline of short functions over the running sequences:
1. admit: waiting requests whose worst case fits the slot pool (`models/batchcache.py`) join;
   their prompts are prefilled in chunks, at most `prefill_chunk` prompt tokens per step over all
   of them, in one forward after the trees' (each chunk causal over its sequence's slots), so a
   long prompt delays the running sequences' steps by one chunk's forward at a time; a prompt's
   last chunk emits its first token;
2. draft: one drafter pass over every sequence's block [root, MASK x d] (`draft_blocks`: each
   block sees its own context and itself), then each sequence's own proposer builds its tree
   (per-sequence state: lookup index, method, budget);
3. verify: ONE target forward over all trees concatenated (ragged rows at positions start+depth,
   in pool slots; each row sees its sequence's context and its tree ancestors);
4. accept: per sequence, the bs=1 `verify.accept` over its rows of the logits, with its own
   sampler and RNG (so a seeded request samples what it samples alone);
5. commit: the pool keeps each accepted path (one gather/scatter per layer for the batch), the
   drafter's contexts get the accepted rows' features (one pass), tokens are emitted with the
   bs=1 stop / length rules, and finished or cancelled sequences give their slots back.
Faults stay with their sequence: an exception in a sequence's own work (its tree, its sampler,
its tokens) ends that sequence alone (finish reason "error", the exception in `Seq.error`, its
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
from dataclasses import dataclass, field, replace

import torch

from ..config import GenerationConfig
from ..errors import TreeflashError
from ..models.batchcache import PAGE_SIZE, BatchCache, round_up
from ..models.drafter import DraftCache, Drafter
from ..models.fastpath import BUCKETS, FastPath
from ..models.target import Target
from .proposers import Proposer, make_proposer
from .sampling import SamplingParams, choose
from .stats import Stats
from .trees import Tree
from .verify import accept


@dataclass
class Seq:
    """One request's decoding state."""

    id: int
    prompt: list[int]
    proposer: Proposer
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: set[int]
    gen: torch.Generator | None
    need: int                                # worst-case cache slots (its reservation)
    max_budget: int = 1                      # the budget its reservation allows (`set_budget`)
    stats: Stats = field(default_factory=Stats)
    dcache: DraftCache | None = None         # the drafter's context (None: no drafting)
    history: list[int] = field(default_factory=list)  # prompt + emitted tokens (ends with the root)
    tokens: list[int] = field(default_factory=list)   # emitted tokens
    start: int = 0                           # position of the root = tokens in the target's cache
    ready: torch.Tensor | None = None        # this step's drafter states [d+1, H] (`draft_blocks`)
    t_start: float = 0.0
    filled: int = 0                          # prompt tokens prefilled so far
    error: BaseException | None = None       # what ended it (finish reason "error")

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt)

    @property
    def drafter(self) -> Drafter | None:
        return self.proposer.drafter if self.dcache is not None else None


class Rows:
    """Rows off..off+n-1 of a step's logits, indexed by node (what `accept` reads)."""

    def __init__(self, logits, off: int, n: int):
        self.logits, self.off, self.n = logits, off, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.logits[self.off + i]


# ---------------------------------------------------------------- pure pieces of a step
def block_ids(drafter: Drafter, root: int, depth: int, device) -> torch.Tensor:
    """[depth+1] long: the block [root, MASK x depth]."""
    ids = torch.full((depth + 1,), drafter.config.mask_token_id, dtype=torch.long, device=device)
    ids[0] = root
    return ids


def owner_mask(rows: list[int], cols: list[int], device) -> torch.Tensor:
    """Row i of job a may see column j of job b iff a == b. rows [J], cols [J]: rows / columns per
    job (job order) -> [sum rows, sum cols] bool (block diagonal)."""
    jobs = torch.arange(len(rows), device=device)
    r = jobs.repeat_interleave(torch.tensor(rows, device=device))  # [R]
    c = jobs.repeat_interleave(torch.tensor(cols, device=device))  # [C]
    return r[:, None] == c[None, :]


def block_mask(ctx: list[int], blk: list[int], device) -> torch.Tensor:
    """Context lengths [J], block lengths [J] -> [Q, C+Q] bool (keys: every job's context, then
    every job's block): a block row of job j sees job j's context and job j's block only."""
    return torch.cat([owner_mask(blk, ctx, device), owner_mask(blk, blk, device)], 1)


@torch.no_grad()
def draft_blocks(drafter: Drafter, embed, jobs: list[tuple[DraftCache, int, int, int]]) -> list[torch.Tensor]:
    """jobs [(draft cache, root, start, depth)] -> per job the pre-norm states h [depth+1, H] of its
    block [root, MASK x depth] at positions start.., from ONE drafter pass over all blocks."""
    dev = embed.weight.device
    if len(jobs) == 1:  # the bs=1 pass (compiled where the drafter is)
        cache, root, start, d = jobs[0]
        return [drafter.draft(cache, embed(block_ids(drafter, root, d, dev)), start)]
    assert all(c.pending is None for c, *_ in jobs), "batched contexts are extended eagerly"
    ids = torch.cat([block_ids(drafter, root, d, dev) for _, root, _, d in jobs])     # [Q]
    pos = torch.cat([torch.arange(s, s + d + 1, device=dev) for _, _, s, d in jobs])  # [Q]
    kv = [(torch.cat([c.k[i] for c, *_ in jobs], 1), torch.cat([c.v[i] for c, *_ in jobs], 1))
          for i in range(len(drafter.model.layers))]                                  # per layer [nkv, C, hd]
    ctx, blk = [c.k[0].shape[1] for c, *_ in jobs], [d + 1 for *_, d in jobs]
    h = drafter.forward_block(embed(ids), pos, kv, block_mask(ctx, blk, dev))        # [Q, H]
    return list(h.split(blk))


@torch.no_grad()
def extend_contexts(drafter: Drafter, items: list[tuple[DraftCache, torch.Tensor, torch.Tensor]]) -> None:
    """items [(draft cache, feats [K, taps*H], positions [K])]: each cache's context grows by its
    rows; the keys / values of all of them come from one pass."""
    if len(items) == 1:
        drafter.extend(*items[0])
        return
    sizes = [len(p) for _, _, p in items]
    kv = drafter.context_kv(torch.cat([f for _, f, _ in items]), torch.cat([p for _, _, p in items]))
    for i, (k, v) in enumerate(kv):  # [nkv, sum K, hd]
        for (cache, _, _), kj, vj in zip(items, k.split(sizes, 1), v.split(sizes, 1)):
            cache.append(i, kj, vj)
    for (cache, _, _), n in zip(items, sizes):
        cache.length += n


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


def max_depth(seq: Seq, limit: int) -> int:
    """How deep a sequence's tree may go: the tokens still wanted and the context window (bs=1's rule)."""
    return min(seq.max_new_tokens - seq.stats.new_tokens - 1, limit - seq.start - 2)


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
        self.limit = target.max_length
        self.cache = BatchCache.for_runner(self.runner, capacity, page_size) if capacity else None
        self.waiting: deque[Seq] = deque()
        self.running: dict[int, Seq] = {}
        self.finished: dict[int, Seq] = {}
        self._next_id = 0

    def warm(self, rows: int) -> None:
        """Compile now (compiled backends) the steps of tree forwards of up to `rows` rows in all,
        so that no request waits for a compile."""
        self.target.warm(range(1, min(rows, BUCKETS[-1]) + 1))

    # ---- requests ----
    def add(self, prompt_ids: list[int], config: GenerationConfig | None = None, *,
            proposer: Proposer | None = None, stop_ids: set[int] | None = None) -> int:
        """Queue a request; returns its id. `config` gives the method (unless `proposer` is given),
        sampling, max_new_tokens, seed and ignore_eos; `stop_ids` overrides the target's."""
        cfg = config or GenerationConfig()
        vocab = self.target.vocab_rows
        if not prompt_ids:
            raise TreeflashError("empty prompt: a request needs at least one token")
        if len(prompt_ids) >= self.limit:
            raise TreeflashError(f"prompt has {len(prompt_ids)} tokens; the context window is {self.limit}")
        if cfg.max_new_tokens < 1:
            raise TreeflashError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
        if proposer is None:
            proposer = make_proposer(cfg.method, self.drafter, self.target.embed, self.target.drafting_head,
                                     cfg.tree(vocab))
        if stop_ids is None:
            stop_ids = set() if cfg.ignore_eos else self.target.stop_ids()
        budget = proposer.params.budget
        need = min(self.limit, len(prompt_ids) + cfg.max_new_tokens) + budget
        if self.cache is not None and self.cache.pages_for(need) * self.page_size > self.cache.capacity:
            raise TreeflashError(f"a request of up to {need} tokens exceeds the pool ({self.cache.capacity} slots)")
        seq = Seq(self._next_id, list(prompt_ids), proposer, cfg.sampling(vocab), cfg.max_new_tokens, set(stop_ids),
                  torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None, need, budget)
        if proposer.drafter is not None and budget >= 2:  # bs=1: budget 1 does no drafter work at all
            seq.dcache = DraftCache(len(proposer.drafter.model.layers))
            proposer.draft_states = _from_batch(seq)  # the batch drafts every block in one pass
        proposer.timings = {"draft": 0.0, "tree": 0.0}
        seq.stats.prompt_tokens = len(prompt_ids)
        self._next_id += 1
        self.waiting.append(seq)
        return seq.id

    def cancel(self, seq_id: int, reason: str = "abort") -> None:
        """End a waiting or running request now (its tokens so far stay in `finished`)."""
        for s in self.waiting:
            if s.id == seq_id:
                self.waiting.remove(s)
                s.stats.finish_reason = reason
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

    def _chunks(self, seqs: list[Seq]) -> list[tuple[Seq, int]]:
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

    def _admit(self) -> list[Seq]:
        """Waiting requests join, first come first served, while their reservations fit the pool."""
        if self.cache is None:
            need = sum(round_up(s.need, self.page_size) for s in self.waiting)
            self.cache = BatchCache.for_runner(self.runner, max(need, self.page_size), self.page_size)
        new = []
        while self.waiting and self.cache.fits(self.waiting[0].need):
            s = self.waiting.popleft()
            self.cache.add(s.id, s.need)
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
    def _each(self, seqs: list[Seq], fn) -> list[tuple[Seq, object]]:
        """[(seq, fn(seq))] for the sequences whose fn returned; one that raises ends alone."""
        done = []
        for s in seqs:
            try:
                done.append((s, fn(s)))
            except Exception as e:  # noqa: BLE001  (its request's error: `Seq.error`)
                self._fail(s, e)
        return done

    def _shared(self, seqs: list[Seq], fn) -> dict[int, object]:
        """fn(seqs) -> {seq id: result}: one pass for all of them; if it raises, once more for
        each sequence alone (those that raise again end alone)."""
        try:
            return fn(seqs)
        except Exception:  # noqa: BLE001  (retried per sequence below)
            return {s.id: r for s, r in self._each(seqs, lambda s: fn([s])[s.id])}

    def fail(self, seq_id: int, error: BaseException) -> None:
        """End a running request for a fault of its own (finish reason "error", `Seq.error`); a
        request that has just finished keeps its tokens but is marked failed too."""
        s = self.running.get(seq_id) or self.finished.get(seq_id)
        if s is not None:
            self._fail(s, error)

    def _fail(self, s: Seq, error: BaseException) -> None:
        s.error = s.error or error
        if s.id in self.running:
            self._finish(s, "error")
        else:
            s.stats.finish_reason = "error"

    # ---- prefill ----
    def _prefill(self, chunks: list[tuple[Seq, int]], out: dict) -> None:
        """One forward over the next chunk of each prompt (positions filled..filled+n-1); a prompt
        prefilled to its end emits its first token."""
        t0 = time.perf_counter()
        sizes = {s.id: n for s, n in chunks}
        rows = self._shared([s for s, _ in chunks], lambda seqs: self._prefill_rows([(s, sizes[s.id]) for s in seqs]))
        self.cache.compact({sid: torch.arange(sizes[sid]) for sid in rows})
        self._each([s for s, _ in chunks if s.id in rows], lambda s: self._prefilled(s, *rows[s.id], t0, out))

    def _prefill_rows(self, chunks: list[tuple[Seq, int]]) -> dict[int, tuple]:
        """The prompt chunks' forward -> {seq id: (its logits rows, its features [n, taps*H], positions [n])}."""
        dev = self.target.device
        ids = torch.tensor([t for s, n in chunks for t in s.prompt[s.filled:s.filled + n]], device=dev)  # [N]
        pos = torch.cat([torch.arange(s.filled, s.filled + n, device=dev) for s, n in chunks])          # [N]
        slots, mask = self._rows([(s.id, n, None) for s, n in chunks])
        logits, feats = self._forward(ids, pos, slots, mask, flat=True)
        return {s.id: (Rows(logits, o, n), feats[o:o + n], pos[o:o + n]) for (s, n), o in zip(chunks, offsets(chunks))}

    def _prefilled(self, s: Seq, logits: "Rows", feats: torch.Tensor, pos: torch.Tensor, t0: float, out: dict) -> None:
        if s.dcache is not None:
            s.drafter.extend(s.dcache, feats, pos)
        s.filled += len(logits)
        s.stats.prefill_s += time.perf_counter() - t0
        if not s.prefilling:
            root = choose(logits[len(logits) - 1], s.sampling, s.gen)
            s.start, s.history = s.filled, list(s.prompt)
            out[s.id] = self._emit(s, [root])

    # ---- decode ----
    def _decode(self, seqs: list[Seq], out: dict) -> None:
        t0 = time.perf_counter()
        depths = {s.id: max_depth(s, self.limit) for s in seqs}
        ready = self._shared(seqs, lambda group: self._draft(group, depths))
        t_draft = time.perf_counter() - t0
        trees = {s.id: t for s, t in self._each([s for s in seqs if s.id in ready],
                                                 lambda s: self._propose(s, ready[s.id], depths[s.id]))}
        t1 = time.perf_counter()
        seqs = [s for s in seqs if s.id in trees]
        rows = self._shared(seqs, lambda group: self._verify_rows([(s, trees[s.id]) for s in group]))
        accs = {s.id: a for s, a in self._each([s for s in seqs if s.id in rows],
                                                lambda s: accept(trees[s.id], rows[s.id][0], s.sampling, s.gen))}
        keeps = {i: torch.tensor(a.path, device=self.target.device) for i, a in accs.items()}
        self.cache.compact(keeps)
        seqs = [s for s in seqs if s.id in accs]
        feats = {i: rows[i][1][keep] for i, keep in keeps.items()}  # the accepted rows' features
        grown = self._shared(seqs, lambda group: self._commit_contexts(group, feats))
        t_verify = time.perf_counter() - t1
        self._each([s for s in seqs if s.id in grown],
                   lambda s: self._advance(s, len(trees[s.id]), accs[s.id], t_draft, t_verify, out))

    def _advance(self, s: Seq, size: int, a, t_draft: float, t_verify: float, out: dict) -> None:
        """A sequence's step is verified and committed: its stats, its position, its tokens."""
        s.stats.draft_s += t_draft
        s.stats.verify_s += t_verify
        s.stats.record(len(a.accepted), size, a.path)
        s.start += len(a.path)
        out[s.id] = self._emit(s, a.accepted + [a.bonus])

    def _propose(self, s: Seq, ready: torch.Tensor | None, depth: int) -> Tree:
        s.ready = ready
        return s.proposer.propose(s.dcache, s.history[-1], s.start, depth, s.history)

    def _verify_rows(self, parts: list[tuple[Seq, Tree]]) -> dict[int, tuple]:
        """ONE target forward over the trees -> {seq id: (its logits rows, its features [n, taps*H])}."""
        dev = self.target.device
        ids, pos, _ = pack([t for _, t in parts], [s.start for s, _ in parts])
        slots, mask = self._rows([(s.id, len(t), t.ancestor_mask()) for s, t in parts])
        logits, feats = self._forward(ids.to(dev), pos.to(dev), slots, mask)
        sizes = [(s, len(t)) for s, t in parts]
        return {s.id: (Rows(logits, o, n), feats[o:o + n]) for (s, n), o in zip(sizes, offsets(sizes))}

    def _draft(self, seqs: list[Seq], depths: dict[int, int]) -> dict[int, torch.Tensor | None]:
        """{seq id: its block's drafter states [d+1, H], or None (not drafting)}: one drafter pass
        per drafter (normally one)."""
        ready: dict[int, torch.Tensor | None] = {s.id: None for s in seqs}
        groups: dict[int, list[tuple[Seq, int]]] = {}
        for s in seqs:
            d = s.proposer.block_depth(depths[s.id]) if s.dcache is not None else 0
            if d >= 1:
                groups.setdefault(id(s.drafter), []).append((s, d))
        for group in groups.values():
            drafter, embed = group[0][0].drafter, group[0][0].proposer.embed
            states = draft_blocks(drafter, embed, [(s.dcache, s.history[-1], s.start, d) for s, d in group])
            ready.update({s.id: h for (s, _), h in zip(group, states)})
        return ready

    def _commit_contexts(self, seqs: list[Seq], feats: dict[int, torch.Tensor]) -> dict[int, bool]:
        """The drafter contexts grow by the accepted rows' features, one pass per drafter."""
        groups: dict[int, list] = {}
        for s in seqs:
            if s.dcache is not None:
                f = feats[s.id]  # [K, taps*H]
                item = (s.dcache, f, s.start + torch.arange(len(f), device=f.device))
                groups.setdefault(id(s.drafter), [s.drafter]).append(item)
        for drafter, *items in groups.values():
            extend_contexts(drafter, items)
        return {s.id: True for s in seqs}

    def _emit(self, s: Seq, toks: list[int]) -> list[int]:
        """Emit tokens with the bs=1 rules: a stop token ends the sequence (emitted); after them,
        max_new_tokens or a full context window ends it."""
        new = []
        for tok in toks:
            s.stats.new_tokens += 1
            s.history.append(tok)
            s.tokens.append(tok)
            new.append(tok)
            if tok in s.stop_ids:
                self._finish(s, "stop")
                return new
        if s.stats.new_tokens >= s.max_new_tokens or s.start + 1 >= self.limit:
            self._finish(s, "length")
        return new

    def _finish(self, s: Seq, reason: str) -> None:
        s.stats.finish_reason = reason
        s.stats.draft_s += s.proposer.timings["draft"]
        s.stats.tree_s += s.proposer.timings["tree"]
        s.stats.total_s = time.perf_counter() - s.t_start
        self.cache.free(s.id)
        del self.running[s.id]
        self.finished[s.id] = s

    # ---- a whole batch ----
    def run(self, seq_ids: list[int], texts: list | None = None) -> list[tuple[list[int], Stats]]:
        """Step until these sequences end; texts[i] (a `TextAssembler`, optional) reads sequence
        seq_ids[i]'s tokens and ends it at a stop string. Returns per sequence (token ids, up to
        the one completing a stop string, and stats)."""
        readers = dict(zip(seq_ids, texts or [None] * len(seq_ids)))
        ids: dict[int, list[int]] = {i: [] for i in seq_ids}
        while any(i not in self.finished for i in seq_ids):
            for i, toks in self.step().items():
                for t in toks if i in ids else ():
                    ids[i].append(t)
                    if readers[i] is not None:
                        readers[i].add(t)
                        if readers[i].stopped:
                            self.cancel(i, "stop")
                            break
        for i in seq_ids:  # the others ran to their end; a library caller sees the fault
            if self.finished[i].error is not None:
                raise self.finished[i].error
        return [(ids[i], self.finished[i].stats) for i in seq_ids]


def _from_batch(seq: Seq):
    """A proposer's `draft_states` that returns its sequence's rows of the batch's drafter pass."""
    def draft_states(cache, root_token: int, start: int, depth: int) -> torch.Tensor:
        h, seq.ready = seq.ready, None
        assert h is not None and h.shape[0] == depth + 1 and start == seq.start, "the batch drafts every block first"
        return h
    return draft_states
