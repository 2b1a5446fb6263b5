"""One worker thread runs generations, one at a time, from a FIFO queue.

The engine is batch-size 1 and not thread-safe, so every engine and tokenizer call happens on
this thread. Each request is a `Job`: the worker streams its events (`text`, then `done` or
`error`) into the job's asyncio queue on the server's event loop; the HTTP handler reads them.
A job whose client went away is marked cancelled and the worker stops it before the next token.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback

from jinja2 import TemplateError

from ..decoding.stats import Stats
from ..decoding.text import pieces
from ..errors import TreeflashError
from .jobs import Done, Job, ServeConfig
from .metrics import Metrics
from .schemas import ApiError


class Worker:
    def __init__(self, engine, config: ServeConfig, metrics: Metrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.current: Job | None = None  # the job being generated
        self.thread = threading.Thread(target=self._loop, name="treeflash-worker", daemon=True)
        metrics.load = self.load  # /metrics and /health read the same live count

    def load(self) -> tuple[int, int]:
        """(running, waiting) now: requests whose clients are still there, generating / queued."""
        return self.running, self.waiting

    @property
    def running(self) -> int:
        """Requests being generated whose clients have not left."""
        job = self.current
        return int(job is not None and not job.cancelled.is_set())

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel the running and queued jobs, then end the thread."""
        if self.current is not None:
            self.current.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        self.queue.put(None)
        self.thread.join(timeout=10)

    @property
    def waiting(self) -> int:
        """Requests queued, not yet generating, whose clients have not left."""
        with self.queue.mutex:
            jobs = list(self.queue.queue)
        return sum(j is not None and not j.cancelled.is_set() for j in jobs)

    def submit(self, job: Job) -> None:
        if self.waiting >= self.config.max_queue:
            raise ApiError(429, f"server busy: {self.waiting} requests waiting; retry later",
                           code="server_busy", type_="rate_limit_error")
        self.queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancelled.is_set():  # its client left while it waited
                self.metrics.record_generation(Stats(), 0, "abort", time.perf_counter() - job.arrived)
                continue
            self.current = job
            try:
                self._run(job)
            except Exception as e:  # a bug: report it, answer 500, keep serving
                traceback.print_exc(file=sys.stderr)
                job.emit("error", ApiError(500, f"internal error: {type(e).__name__}"))
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        self.metrics.observe_queue_time(time.perf_counter() - job.arrived)
        try:
            ids = self._encode(job)
        except ApiError as e:
            return job.emit("error", e)
        except TreeflashError as e:
            return job.emit("error", ApiError(400, str(e), param=job.param))
        except TemplateError as e:  # the chat template refused these messages
            return job.emit("error", ApiError(400, f"the chat template rejects these messages: {e}",
                                              param=job.param))
        try:  # bad sampling or tree values: a 400 before anything runs
            self.engine.config(job.config).sampling(self.engine.target.vocab_rows)
        except TreeflashError as e:
            return job.emit("error", ApiError(400, str(e)))
        stats = Stats()  # from here on, a fault is the server's: `_loop` answers 500
        finish, n_tokens = self._generate(job, ids, stats)
        stats.prompt_tokens = len(ids)
        self.metrics.record_generation(stats, n_tokens, finish, time.perf_counter() - job.arrived)
        job.emit("done", Done(finish, len(ids), n_tokens, stats.mean_acceptance_length))

    def _encode(self, job: Job) -> list[int]:
        target = self.engine.target
        ids = target.encode(job.prompt, chat=job.chat)
        limit = target.max_length - 1
        if self.config.max_prompt_tokens is not None:
            limit = min(limit, self.config.max_prompt_tokens)
        if len(ids) > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; at most {limit} are allowed "
                           f"(context window {target.max_length})", param=job.param,
                           code="context_length_exceeded")
        return ids

    def _generate(self, job: Job, ids: list[int], stats: Stats) -> tuple[str, int]:
        """Stream one generation into the job through the engine's own token loop (`pieces`, as
        `Engine.stream`); returns (finish_reason, tokens generated)."""
        text = self.engine.assembler(job.config)
        n, aborted = 0, False

        def on_token(_tok: int) -> bool:  # before each token: has the client left? time to first token
            nonlocal n, aborted
            if job.cancelled.is_set():
                aborted = True
                return False
            n += 1
            if n == 1:
                self.metrics.observe_ttft(time.perf_counter() - job.arrived)
            return True

        for piece in pieces(self.engine.tokens(ids, job.config, chat=False, stats=stats, text=text), text,
                            on_token=on_token):
            job.emit("text", piece)
        return ("abort" if aborted else "stop" if text.stopped else stats.finish_reason), n
