"""Every KV cache: the target's, for one sequence and for a batch, and the drafter's context.

THE TARGET'S, ONE SEQUENCE: one protocol, two implementations, one attention mask over its slots.

`KVCache` is what a target forward and the decoding loop need of a cache (gpt-fast style: the
cache owns how keys and values are written and how a step keeps its accepted path):
- `length`: the tokens held, positions 0..length-1; a forward writes its N tokens after them,
- `update(k, v, layer, slots)`: write one layer's new keys and values [1, Hkv, N, D] (Hugging
  Face's argument order, plus the cache slots of the new tokens) and return that layer's keys
  and values to attend over [1, Hkv, S, D],
- `compact(start, keep)`: keep slots [:start] and the tree nodes start+keep (one implementation
  for both caches, over `key_values` and `truncate`).

`StaticKV` (preallocated, the static and compiled backends, written by `fastpath`) and `HFCache`
(Hugging Face's DynamicCache, whose `update` the model's own attention calls: the hf backend).

THE TARGET'S, A BATCH OF SEQUENCES: one preallocated slot pool shared by all of them.

Layout: the pool is one `StaticKV` (per layer k, v [1, Hkv, C, D]) cut into pages of P slots. A
sequence owns a list of pages; its token at logical index j (= its position j) sits in slot
`pages[j // P] * P + j % P` (`SeqSlots.table`). Per sequence this keeps the bs=1 cache's contract:
- `length(seq)`: tokens held, positions 0..length-1;
- `write(seq, n)`: the slots of logical indices length..length+n-1, where a step writes its n
  new rows (pages taken on demand, lowest free first, so the attended width stays small);
  `write_rows` does it for every sequence of a forward and returns the forward's mask too;
- `compact({seq: keep})`: keep the written rows `keep` [K] (in order) at length..length+K-1, then
  hold length+K tokens; pages past them go back to the pool. One gather/scatter per layer for
  the whole batch.
The target forward (`FastPath._decode`) writes the pool through `update(k, v, layer, slots)`
(the `KVCache` contract) and attends over slots [:W] under a bool mask [N, W] (`step_mask`):
a row of sequence s sees s's held slots and, among the step's new rows, its own tree ancestors.
Admission (`admit`, first come first served, each by `add`) reserves a sequence's worst case in
pages, so no step runs out of slots; `check` refuses one that no pool of this size can hold.

For the compiled backends the pool has `spare` slots past its pages (`for_runner`): a compiled
step pads its rows to a bucket, and the padding rows write there (`scratch`), and its attended
width, rounded up, stays below the pool's size (`fastpath.FastPath.forward_rows`).

THE DRAFTER'S. `DraftCache`: the drafter's per-layer context keys and values of one sequence
(`models/drafter.py` writes and reads them).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..errors import TreeflashError


def path_in_place(keep: torch.Tensor) -> bool:
    """Whether the accepted tree nodes `keep` [K] already sit in the first K tree slots."""
    return keep.tolist() == list(range(len(keep)))


def causal(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()  # [N, N]


def attention_mask(start: int, tree_mask: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` [N, S] bool (S >= start+N; True = may attend) for N new tokens in slots
    start..start+N-1: each sees the held slots [:start] and, among the new ones, its ancestors
    (tree_mask [N, N]; None: causal, a flat sequence), no slot after those. Returns `out`."""
    n = out.shape[0]
    out.zero_()
    out[:, :start] = True
    out[:, start:start + n] = causal(n, out.device) if tree_mask is None else tree_mask
    return out


class KVCache:
    """The protocol (see the module's docstring); `compact` is shared."""

    length: int

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int, slots: torch.Tensor):
        raise NotImplementedError

    def key_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: keys, values [1, Hkv, S, D], S >= length (slots [:length] are live)."""
        raise NotImplementedError

    def truncate(self, length: int) -> None:
        """Hold only slots [:length]."""
        raise NotImplementedError

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep slots [:start] and the tree slots start+keep [K] (in order) at start..start+K-1."""
        n = len(keep)
        if not path_in_place(keep):  # plain decoding: always in place
            idx = start + keep
            for kv in self.key_values():
                for t in kv:
                    t[:, :, start:start + n] = t[:, :, idx]  # the gather copies first: no aliasing
        self.truncate(start + n)


class StaticKV(KVCache):
    """Preallocated cache. k[i], v[i]: [1, Hkv, capacity, D] per layer i (separate tensors, so a
    compiled step updates each in place; views of one tensor would make it copy the whole cache);
    slots < `length` hold the context."""

    def __init__(self, layers: int, n_kv: int, head_dim: int, capacity: int, dtype, device):
        self.k = [torch.zeros(1, n_kv, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.length = 0
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def update(self, k, v, layer, slots):
        """Write into `slots`; returns the whole buffers (the mask says which slots count)."""
        self.k[layer].index_copy_(2, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, slots, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def key_values(self):
        return list(zip(self.k, self.v))

    def truncate(self, length: int) -> None:
        self.length = length

    def inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        """Reused input buffers of the compiled step for one bucket size (`FastPath._padded`): mask
        [Nb, capacity] bool, ids, pos, slots [Nb] long."""
        if bucket not in self._inputs:
            dev = self.k[0].device
            z = torch.zeros(bucket, dtype=torch.long, device=dev)
            self._inputs[bucket] = {"mask": torch.zeros(bucket, self.capacity, dtype=torch.bool, device=dev),
                                    "ids": z.clone(), "pos": z.clone(), "slots": z.clone()}
        return self._inputs[bucket]


class HFCache(DynamicCache, KVCache):
    """Hugging Face's DynamicCache (any causal LM; its `update` appends, so the slots are always the
    next ones) with the protocol's length, key_values and truncate."""

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def key_values(self):
        return [(layer.keys, layer.values) for layer in self.layers if layer.is_initialized]

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.crop(length - self.length)  # transformers 5: a negative count of tokens to remove


# ---- a batch of sequences: one slot pool ----

PAGE_SIZE = 16  # slots per page of a batch pool: the serve worker's and the batch decoder's default


def round_up(n: int, step: int) -> int:
    """`n` rounded up to a whole number of `step`s (slots to whole pages, widths to whole steps)."""
    return -(-n // step) * step


class PoolFull(TreeflashError):
    """A sequence's reservation does not fit the pool now (wait for others to finish)."""


@dataclass
class SeqSlots:
    """One sequence's share of the pool."""

    reserved: int                                   # pages it may hold at most
    pages: list[int] = field(default_factory=list)  # pool pages, in logical order
    length: int = 0                                 # tokens held (logical 0..length-1)
    table: torch.Tensor | None = None               # [len(pages) * P] long: logical index -> slot


def slot_table(pages: list[int], page_size: int, device) -> torch.Tensor:
    """pages [G] -> slots [G * P] long: the slot of each logical index."""
    p = torch.tensor(pages, dtype=torch.long, device=device)  # [G]
    return (p[:, None] * page_size + torch.arange(page_size, device=device)).flatten()  # [G * P]


class BatchCache:
    """Pool bookkeeping for a batch (see the module's docstring). `kv` is what the forward writes."""

    def __init__(self, kv: StaticKV, page_size: int = PAGE_SIZE, spare: int = 0):
        pages = kv.capacity - spare
        if pages <= 0 or pages % page_size:
            raise TreeflashError(f"pool of {pages} slots is not a whole number of {page_size}-slot pages")
        self.kv, self.page_size = kv, page_size
        self.device = kv.k[0].device
        self.free_pages = list(range(pages // page_size))  # a heap: lowest page first
        self.scratch = torch.arange(pages, kv.capacity, device=self.device)  # [spare] long: on no page
        self.seqs: dict[int, SeqSlots] = {}

    @classmethod
    def for_runner(cls, runner, capacity: int, page_size: int = PAGE_SIZE) -> "BatchCache":
        """A pool of at least `capacity` slots for a `FastPath` runner's model (with the compiled
        backends' spare slots, and a symbolic slot dimension: their graphs serve any pool)."""
        p = next(runner.model.parameters())
        cap = round_up(capacity, page_size)
        spare = runner.spare_slots
        kv = StaticKV(len(runner.decoder.layers), runner.n_kv, runner.head_dim, cap + spare, p.dtype, p.device)
        runner.mark_dynamic(kv)
        return cls(kv, page_size, spare)

    # ---- admission ----
    @property
    def capacity(self) -> int:
        """Slots on pages (the spare ones excluded)."""
        return self.kv.capacity - len(self.scratch)

    @property
    def free_slots(self) -> int:
        """Slots on no sequence's page."""
        return len(self.free_pages) * self.page_size

    @property
    def reserved_slots(self) -> int:
        return sum(s.reserved for s in self.seqs.values()) * self.page_size

    def pages_for(self, slots: int) -> int:
        return round_up(slots, self.page_size) // self.page_size

    def fits(self, need: int) -> bool:
        """Whether a sequence of at most `need` slots can be added now."""
        return self.reserved_slots + self.pages_for(need) * self.page_size <= self.capacity

    def check(self, need: int) -> None:
        """Refuse a sequence of up to `need` slots that would not fit even an empty pool."""
        if self.pages_for(need) * self.page_size > self.capacity:
            raise TreeflashError(f"a request of up to {need} tokens exceeds the pool ({self.capacity} slots)")

    def add(self, seq_id: int, need: int) -> None:
        """Reserve `need` slots (the sequence's worst case) for a new sequence."""
        if seq_id in self.seqs:
            raise TreeflashError(f"sequence {seq_id} is already in the cache")
        self.check(need)
        if not self.fits(need):
            raise PoolFull(f"{need} slots do not fit: {self.reserved_slots} of {self.capacity} reserved")
        self.seqs[seq_id] = SeqSlots(self.pages_for(need))

    def admit(self, queue) -> list:
        """Items of a queue (a deque of objects with `id`, and `reserved`: their worst case in slots)
        leave it from its front, first come first served, while their reservations fit; returns
        them, reserved (`add`)."""
        joined = []
        while queue and self.fits(queue[0].reserved):
            joined.append(queue.popleft())
            self.add(joined[-1].id, joined[-1].reserved)
        return joined

    def free(self, seq_id: int) -> None:
        """Give a sequence's pages and reservation back."""
        s = self.seqs.pop(seq_id)
        for page in s.pages:
            heapq.heappush(self.free_pages, page)

    # ---- one sequence ----
    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    def held(self, seq_id: int) -> torch.Tensor:
        """[length] long: the slots of the tokens a sequence holds."""
        s = self.seqs[seq_id]
        return s.table[:s.length] if s.table is not None else torch.zeros(0, dtype=torch.long, device=self.device)

    def write(self, seq_id: int, n: int) -> torch.Tensor:
        """[n] long: the slots of logical indices length..length+n-1 (pages taken as needed)."""
        s = self.seqs[seq_id]
        want = self.pages_for(s.length + n)
        if want > s.reserved:
            raise TreeflashError(f"sequence {seq_id} writes past its reservation ({s.reserved} pages)")
        if want > len(s.pages):
            s.pages += [heapq.heappop(self.free_pages) for _ in range(want - len(s.pages))]
            s.table = slot_table(s.pages, self.page_size, self.device)
        return s.table[s.length:s.length + n]

    def _shrink(self, s: SeqSlots) -> None:
        """Pages past the held tokens go back to the pool."""
        keep = self.pages_for(s.length)
        if keep < len(s.pages):
            for page in s.pages[keep:]:
                heapq.heappush(self.free_pages, page)
            s.pages = s.pages[:keep]
            s.table = s.table[:keep * self.page_size] if keep else None

    # ---- the batch ----
    def compact(self, keeps: dict[int, torch.Tensor]) -> None:
        """keeps {seq: keep [K] long}: the written rows (0 = the first written after `length`) each
        sequence keeps, in order; they move to length..length+K-1 and the sequence holds them."""
        src, dst = [], []
        for seq_id, keep in keeps.items():
            s = self.seqs[seq_id]
            k = keep.to(self.device)
            if k.tolist() != list(range(len(k))):  # else already in place (plain decoding always)
                src.append(s.table[s.length + k])                # [K]
                dst.append(s.table[s.length:s.length + len(k)])  # [K]
            s.length += len(k)
        if src:
            src_t, dst_t = torch.cat(src), torch.cat(dst)  # [sum K]; disjoint across sequences
            for kv in self.kv.key_values():
                for t in kv:
                    t[:, :, dst_t] = t[:, :, src_t]  # the gather copies first: no aliasing
        for seq_id in keeps:
            self._shrink(self.seqs[seq_id])

    def write_rows(self, parts: list[tuple[int, int, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor]:
        """parts [(seq, n rows, tree mask [n, n] bool or None: causal)] in row order -> the slots [N]
        a forward writes its rows to (`write`) and its mask [N, W] (`step_mask`, W: `width`)."""
        slots = torch.cat([self.write(i, n) for i, n, _ in parts])  # [N]
        return slots, self.step_mask(parts, slots, self.width([i for i, _, _ in parts]))

    def width(self, seq_ids) -> int:
        """Slots a step over these sequences attends to: up to the last page any of them holds."""
        last = max((max(self.seqs[i].pages) for i in seq_ids if self.seqs[i].pages), default=-1)
        return (last + 1) * self.page_size

    def step_mask(self, parts: list[tuple[int, int, torch.Tensor | None]], slots: torch.Tensor,
                  width: int) -> torch.Tensor:
        """parts [(seq, n rows, tree mask [n, n] bool or None: causal)] in row order, the new rows'
        slots [N] (from `write`), width W -> mask [N, W] bool: each row sees its sequence's held
        slots and its ancestors among that sequence's new rows, nothing else."""
        mask = torch.zeros(len(slots), width, dtype=torch.bool, device=self.device)  # [N, W]
        r = 0
        for seq_id, n, tree in parts:
            rows = slice(r, r + n)
            mask[rows, self.held(seq_id)] = True  # [n, L]: the sequence's context
            among = causal(n, self.device) if tree is None else tree.to(self.device)  # [n, n]
            mask[rows, slots[rows]] = among
            r += n
        return mask


# ---- the drafter's context ----

class DraftCache:
    """Per-layer context keys/values of the drafter: grows by the accepted positions each step.

    `pending` holds context not yet turned into keys/values (features [n, taps*H], positions [n]):
    the decode loop defers its per-step append, and the next block pass computes it in the same
    (compiled) call."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers  # each [nkv, C, hd]
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0  # context positions, pending included
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # contiguous from the start: a compiled block pass then sees one layout every step
        self.k[i] = k.contiguous() if self.k[i] is None else torch.cat([self.k[i], k], 1)
        self.v[i] = v.contiguous() if self.v[i] is None else torch.cat([self.v[i], v], 1)

    def defer(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Context rows to append at the next block pass, after those already pending."""
        self.length += len(positions)
        if self.pending is not None:
            feats, positions = torch.cat([self.pending[0], feats]), torch.cat([self.pending[1], positions])
        self.pending = (feats, positions)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        p, self.pending = self.pending, None
        return p


def flat_kv(cache: DraftCache) -> list[torch.Tensor]:
    """k_0, v_0, k_1, v_1, ...: the cache as a compiled pass takes it (`drafter_steps`)."""
    return [t for k_v in zip(cache.k, cache.v) for t in k_v]
