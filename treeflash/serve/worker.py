"""The server's worker: one thread and one decoder run every request.

Requests wait in a FIFO queue (`--max-queue` bounds it: 429 beyond). Before each step the worker
moves waiting requests into the decoder while fewer than `--max-batch` run; a request leaves when
it ends (a stop token, max_tokens, a stop string in its text, a fault of its own: 500) or when its
client leaves (cancelled before the next step: its slots go back at once). Its new tokens become
text events of its `Job` (`jobs`), which the HTTP handler reads. Every engine, tokenizer and
decoder call happens on this thread.

The decoder is `BatchDecoder` on the static and compiled backends (`--max-batch 1`: a batch of
one), its KV pool sized for max_batch worst-case requests (`pool_slots`), so admission never waits
for slots; on the others (hf) it is `SerialDecoder`, the single-sequence loop behind the same
interface. With --tree-size auto and --max-batch > 1 each step's tree budget follows the load
(`costmodel.adaptive_budget`: the bs=1 best alone, down to plain decoding as the batch fills),
checked at each batch size against this server's own decode-only steps (`BudgetTuner`).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from jinja2 import TemplateError

from ..decoding import costmodel
from ..decoding.batch import BatchDecoder
from ..decoding.proposers import verify_rows
from ..decoding.serial import SerialDecoder
from ..decoding.stats import Stats
from ..decoding.text import TextAssembler
from ..errors import TreeflashError
from ..models.kvcache import PAGE_SIZE, round_up
from .budget_tuner import BudgetTuner
from .jobs import Done, Job, ServeConfig
from .metrics import Metrics
from .schemas import ApiError


def batchable(engine) -> bool:
    """Whether `BatchDecoder` runs the engine's target: the static and compiled backends."""
    from ..models.fastpath import FastPath

    engine.bind()  # the engine's backend on its target
    return isinstance(engine.target.runner, FastPath)


def check_batchable(engine, max_batch: int) -> None:
    """--max-batch > 1 needs the static or a compiled backend: a clear one-line error otherwise."""
    if max_batch > 1 and not batchable(engine):
        raise TreeflashError(f"--max-batch {max_batch} needs the static or a compiled backend (Llama / Qwen family); "
                             f"the target runs the {engine.target.backend} backend: use --backend static, compiled or "
                             f"compiled-cpp, or --max-batch 1")


def pool_slots(max_length: int, config: ServeConfig, rows: int, page_size: int = PAGE_SIZE) -> int:
    """KV pool slots for `max_batch` requests at their worst case: the longest prompt allowed plus
    max_tokens_limit (within the context window) plus one tree's `rows`, each rounded up to whole pages."""
    prompt = min(config.max_prompt_tokens or max_length, max_length - 1)
    need = min(max_length, prompt + config.max_tokens_limit) + rows
    return config.max_batch * round_up(need, page_size)


def internal(e: BaseException) -> ApiError:
    """A fault of the server's (its trace goes to the log): a 500."""
    traceback.print_exception(e, file=sys.stderr)
    return ApiError(500, f"internal error: {type(e).__name__}")


def refusal(e: Exception, param: str) -> ApiError:
    """What a request that cannot start is answered: 400 for bad input, 500 for a bug."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, TreeflashError):  # bad sampling values, a prompt over the window: nothing was sent yet
        return ApiError(400, str(e), param=param)
    if isinstance(e, TemplateError):
        return ApiError(400, f"the chat template rejects these messages: {e}", param=param)
    return internal(e)


@dataclass
class Active:
    """A request in the decoder: its job, its text so far, tokens received."""

    job: Job
    text: TextAssembler
    prompt_tokens: int
    n: int = 0


class Worker:
    """The queue (`submit`), the live load (`load`, `running`, `waiting`) and the thread (`start`,
    `stop`) that decodes every request."""

    def __init__(self, engine, config: ServeConfig, metrics: Metrics):
        check_batchable(engine, config.max_batch)
        self.engine, self.config, self.metrics = engine, config, metrics
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="treeflash-worker", daemon=True)
        gen = config.generation
        choice = engine.auto_tree_size(gen) if gen.tree_size == "auto" else None  # a lookup method's (memoised)
        self.budget = choice.budget if choice is not None else gen.tree_size
        planner = choice.step_budget() if choice is not None else None  # lookup-only steps up to its largest tree
        # a tree's rows (plain decoding: the root)
        self.rows = verify_rows(gen.method, max(self.budget, planner.max_budget if planner is not None else 1))
        self.decoder = self._new_decoder()
        self.decoder.warm(config.max_batch * self.rows)  # compiled backends: every batch's tree forward now
        self.active: dict[int, Active] = {}
        self.peak = 0            # most sequences decoded together so far (tests, logs)
        self._budgets: dict[int, int] = {}
        self.tuner = BudgetTuner()  # per batch size: the measured fastest of the model's choice, plain and one between
        self._stopping = threading.Event()
        metrics.load = self.load  # /metrics and /health read the same live count

    def _new_decoder(self) -> BatchDecoder | SerialDecoder:
        target = self.engine.target
        if not batchable(self.engine):
            return SerialDecoder(target)
        return BatchDecoder(target, self.engine.drafter, capacity=pool_slots(target.max_length, self.config, self.rows),
                            page_size=PAGE_SIZE, prefill_chunk=self.config.prefill_chunk)

    # ---- the interface of the HTTP app ----
    def load(self) -> tuple[int, int]:
        """(running, waiting) now: requests whose clients are still there, decoding / queued."""
        return self.running, self.waiting

    @property
    def running(self) -> int:
        """Requests in the decoder (prompts being prefilled included) whose clients have not left."""
        return sum(not a.job.cancelled.is_set() for a in list(self.active.values()))

    @property
    def waiting(self) -> int:
        """Requests queued, not yet in the decoder, whose clients have not left."""
        with self.queue.mutex:
            jobs = list(self.queue.queue)
        return sum(j is not None and not j.cancelled.is_set() for j in jobs)

    def submit(self, job: Job) -> None:
        if self.waiting >= self.config.max_queue:
            raise ApiError(429, f"server busy: {self.waiting} requests waiting; retry later",
                           code="server_busy", type_="rate_limit_error")
        self.queue.put(job)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel the running and queued jobs, then end the thread."""
        self._stopping.set()
        for a in list(self.active.values()):
            a.job.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        self.queue.put(None)
        self.thread.join(timeout=10)

    # ---- the loop ----
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._drop_cancelled()
            if not self._take(block=not self.active):
                return
            if not self.decoder.busy:
                continue
            plan = self._set_budgets()
            self.peak = max(self.peak, len(self.active))
            try:
                t0 = time.perf_counter()
                out = self.decoder.step()
                if plan is not None:
                    self.tuner.record(*plan, sum(map(len, out.values())), time.perf_counter() - t0)
            except Exception as e:  # a bug outside any one sequence: report it, answer 500 to the batch
                self._fail_all(internal(e))
                continue
            for sid in list(self.active):
                self._deliver(sid, out.get(sid, ()))

    def _take(self, block: bool) -> bool:
        """Move queued jobs into the decoder while fewer than max_batch are in it; waits for one
        when none is (block). False: the server is stopping."""
        while len(self.active) < self.config.max_batch:
            try:
                job = self.queue.get(block=block)
            except queue.Empty:
                return True
            if job is None or self._stopping.is_set():
                return False
            if job.cancelled.is_set():  # its client left while it waited
                self.metrics.record_generation(Stats(), 0, "abort", time.perf_counter() - job.arrived)
            elif self._admit(job):
                block = False
        return True

    def _admit(self, job: Job) -> bool:
        self.metrics.observe_queue_time(time.perf_counter() - job.arrived)
        try:
            ids = self._encode(job)
            _, _, proposer = self.engine.prepare(ids, job.config, chat=False)
            text = self.engine.assembler(job.config)
            sid = self.decoder.add(ids, job.config, proposer=proposer, text=text)
        except Exception as e:  # noqa: BLE001  (answered: `refusal`)
            job.emit("error", refusal(e, job.param))
            return False
        self.active[sid] = Active(job, text, len(ids))
        return True

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

    def _drop_cancelled(self) -> None:
        """Sequences whose clients left end now: their slots are free for the next step."""
        for sid, a in list(self.active.items()):
            if a.job.cancelled.is_set():
                self.decoder.cancel(sid)
                self._finish(sid, aborted=True)

    def _set_budgets(self) -> tuple[int, int] | None:
        """--tree-size auto: every running sequence's budget for this step's batch size (the cost
        model's choice, checked against measured steps by the tuner). Returns (batch size, budget)
        when the step will only decode, so that its speed can be recorded; else None."""
        choice = self.config.auto_budget
        if choice is None or self.rows < 2:  # a fixed tree size, or trees of the root alone
            return None
        # rows in the tree forward come from decoding sequences; prompts being prefilled run apart
        decoding = sum(not s.prefilling for s in self.decoder.running.values())
        n = max(1, decoding)
        if n not in self._budgets:
            self._budgets[n] = self.budget if n <= 1 else costmodel.adaptive_budget(
                choice.verify_costs, choice.node_accept, choice.draft_fn(), n, self.budget)
        budget = self.tuner.choose(n, self._budgets[n])
        for sid in self.decoder.running:
            self.decoder.set_budget(sid, budget)
        self.metrics.set_tree_budget(budget)
        only_decodes = not self.decoder.waiting and decoding == len(self.decoder.running)
        return (n, budget) if only_decodes else None

    def _deliver(self, sid: int, toks) -> None:
        """A sequence's new tokens become its text events (its text was fed by the decoder, which
        ended it at a stop string); it ends when the decoder ended it. A fault here ends this
        request alone."""
        try:
            self._emit_text(sid, toks)
        except Exception as e:  # noqa: BLE001  (this request's fault: the others go on)
            self.decoder.fail(sid, e)
        if sid in self.decoder.finished:
            self._finish(sid, aborted=self.active[sid].job.cancelled.is_set())

    def _emit_text(self, sid: int, toks) -> None:
        a = self.active[sid]
        if not toks or a.job.cancelled.is_set():
            return
        if a.n == 0:
            self.metrics.observe_ttft(time.perf_counter() - a.job.arrived)
        a.n += len(toks)
        piece = a.text.take()
        if piece:
            a.job.emit("text", piece)

    def _finish(self, sid: int, aborted: bool) -> None:
        a = self.active.pop(sid)
        seq = self.decoder.finished.pop(sid, None)
        stats = seq.stats if seq is not None else Stats()
        if seq is not None and seq.error is not None:  # its own fault: its request alone fails
            self.metrics.record_generation(stats, a.n, "error", time.perf_counter() - a.job.arrived)
            a.job.emit("error", internal(seq.error))
            return
        if not aborted:
            tail = a.text.flush()
            if tail:
                a.job.emit("text", tail)
        finish = "abort" if aborted else "stop" if a.text.stopped else stats.finish_reason
        self.metrics.record_generation(stats, a.n, finish, time.perf_counter() - a.job.arrived)
        a.job.emit("done", Done(finish, a.prompt_tokens, a.n, stats.mean_acceptance_length))

    def _fail_all(self, error: ApiError) -> None:
        for a in self.active.values():
            a.job.emit("error", error)
        self.active.clear()
        self.decoder = self._new_decoder()
