"""What the server runs: its configuration (`ServeConfig`), a request to generate (`Job`) and how
it ended (`Done`).

Shared by the HTTP app and the worker.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from ..config import GenerationConfig


@dataclass
class ServeConfig:
    model_name: str
    # how every request is generated; a request's own fields (max_tokens, temperature, top_p, seed,
    # stop) replace these (`schemas.GenerationRequest.generation_config`)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    max_tokens_limit: int = 4096    # larger max_tokens -> 400
    max_prompt_tokens: int | None = None  # None -> the context window
    api_key: str | None = None
    max_queue: int = 64             # more waiting requests -> 429
    max_batch: int = 1              # requests decoded together (`worker.Worker`; > 1: continuous batching)
    prefill_chunk: int = 256        # static and compiled backends: most prompt tokens prefilled per step
    # --tree-size auto with max_batch > 1: the `api.AutoChoice` the per-step budgets follow
    auto_budget: object | None = None


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    tau: float          # this request's mean acceptance length


@dataclass
class Job:
    prompt: str | list[dict] | list[int]
    chat: bool            # apply the chat template to a string prompt
    param: str            # request field the prompt came from (for error messages)
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    checked_at: float = field(default_factory=time.monotonic)  # last client-connection check

    def emit(self, kind: str, value) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()
