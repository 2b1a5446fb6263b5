"""`SerialDecoder`: the single-sequence loop (`generate.py`) behind `BatchDecoder`'s interface, one
request at a time, for the backends `BatchDecoder` cannot run (hf).

`add` queues a request, `step` prefills the next one's prompt (its first token) or advances the
running one by one verified tree, `cancel` and `fail` end one; an ended request waits in
`finished` with its stats. A fault in a step ends its request alone (`Sequence.error`).
"""
from __future__ import annotations

from collections import deque

import torch

from ..config import GenerationConfig
from ..models.target import Target
from .generate import decode_step, prefill
from .proposers import Proposer
from .sequence import Sequence


class SerialDecoder:
    def __init__(self, target: Target):
        self.target = target
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # at most one
        self.finished: dict[int, Sequence] = {}
        self.cache = None                       # the running request's KV cache
        self._next_id = 0

    def warm(self, rows: int) -> None:
        """Nothing ahead: `Engine.prepare` compiles each request's steps."""

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, prompt_ids: list[int], config: GenerationConfig, *, proposer: Proposer, text=None) -> int:
        """Queue a request (`Sequence.request`); returns its id."""
        seq = Sequence.request(self.target, prompt_ids, config, proposer, text, id=self._next_id)
        self._next_id += 1
        self.waiting.append(seq)
        return seq.id

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """One step of the running request (the next waiting one starts with its prefill); returns
        the tokens it emitted."""
        if not self.running and self.waiting:
            s = self.waiting.popleft()
            self.running[s.id], self.cache = s, self.target.new_cache(s.reserved)
        if not self.running:
            return {}
        s, target, cache = next(iter(self.running.values())), self.target, self.cache
        try:
            toks = prefill(target, s, cache) if s.prefilling else decode_step(target, s, cache)
            out = {s.id: list(toks)}
        except Exception as e:  # noqa: BLE001  (its request's error: `Sequence.error`)
            self.fail(s.id, e)
            return {}
        self._release(s)
        return out

    def cancel(self, seq_id: int, reason: str = "abort") -> None:
        """End a waiting or running request now (its tokens so far stay in `finished`)."""
        s = self.running.get(seq_id) or next((w for w in self.waiting if w.id == seq_id), None)
        if s is not None:
            s.finish(reason)
            self._release(s)

    def fail(self, seq_id: int, error: BaseException) -> None:
        """End a request for a fault of its own (finish reason "error", `Sequence.error`)."""
        s = self.running.get(seq_id) or self.finished.get(seq_id)
        if s is not None:
            s.fail(error)
            self._release(s)

    def _release(self, s: Sequence) -> None:
        """A sequence that has ended moves to `finished`; the cache goes with the running one."""
        if not s.done:
            return
        if s in self.waiting:
            self.waiting.remove(s)
        if self.running.pop(s.id, None) is not None:
            self.cache = None
        self.finished[s.id] = s
