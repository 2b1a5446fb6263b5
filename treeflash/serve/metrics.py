"""Prometheus text-format metrics, named like vLLM's so existing dashboards carry over.

Written by hand (no prometheus_client dependency): a handful of counters, a few gauges and
latency histograms, all updated under one lock by the worker thread and the HTTP handlers.
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict

from ..decoding.stats import Stats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _labels(**kw) -> str:
    if not kw:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in kw.items())
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        for i, b in enumerate(self.buckets):
            if x <= b:
                self.counts[i] += 1  # cumulative: every bucket >= x
        self.sum += x
        self.count += 1

    def lines(self, name: str, labels: dict) -> list[str]:
        out = [f"{name}_bucket{_labels(**labels, le=_num(b))} {c}" for b, c in zip(self.buckets, self.counts)]
        out += [f"{name}_sum{_labels(**labels)} {_num(self.sum)}", f"{name}_count{_labels(**labels)} {self.count}"]
        return out


class Metrics:
    """Counters for one served model; `render()` gives the /metrics body."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.lock = threading.Lock()
        self.drafts = 0            # speculative steps (one draft tree each)
        self.draft_tokens = 0      # draft nodes verified (tree size - root), summed over steps
        self.accepted_tokens = 0   # accepted draft tokens (bonus tokens not counted)
        self.accepted_per_pos: list[int] = []  # [j]: steps that accepted >= j+1 drafts
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = defaultdict(int)  # finished_reason -> count
        self.errors = defaultdict(int)   # http status -> count
        # (running, waiting) now: the worker's own count, read at each render (`Worker.load`)
        self.load = lambda: (0, 0)
        self.tree_budget = None  # --max-batch with --tree-size auto: this step's per-request budget
        self.e2e = Histogram()
        self.ttft = Histogram()
        self.queue_time = Histogram()

    # ---- updates ----
    def record_generation(self, stats: Stats, completion_tokens: int, finish: str, e2e_s: float) -> None:
        with self.lock:
            self.drafts += stats.steps
            self.draft_tokens += sum(stats.tree_sizes) - stats.steps
            self.accepted_tokens += sum(stats.acceptance_lengths) - stats.steps
            for j, n in enumerate(stats.accepted_per_position):
                if j >= len(self.accepted_per_pos):
                    self.accepted_per_pos.append(0)
                self.accepted_per_pos[j] += n
            self.prompt_tokens += stats.prompt_tokens
            self.generation_tokens += completion_tokens
            self.success[finish] += 1
            self.e2e.observe(e2e_s)

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        with self.lock:
            self.queue_time.observe(seconds)

    def record_error(self, status: int) -> None:
        with self.lock:
            self.errors[int(status)] += 1

    def set_tree_budget(self, budget: int) -> None:
        with self.lock:
            self.tree_budget = budget

    # ---- exposition ----
    def render(self) -> str:
        m = {"model_name": self.model}
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        running, waiting = self.load()
        with self.lock:
            metric("vllm:num_requests_running", "gauge", "Requests being generated now.",
                   [f"vllm:num_requests_running{_labels(**m)} {running}"])
            metric("vllm:num_requests_waiting", "gauge", "Requests queued for the worker.",
                   [f"vllm:num_requests_waiting{_labels(**m)} {waiting}"])
            if self.tree_budget is not None:
                metric("treeflash:tree_budget", "gauge", "Tree budget per request this step (load-adaptive).",
                       [f"treeflash:tree_budget{_labels(**m)} {self.tree_budget}"])
            for name, value, help_ in [
                ("vllm:spec_decode_num_drafts_total", self.drafts, "Speculative steps (draft trees verified)."),
                ("vllm:spec_decode_num_draft_tokens_total", self.draft_tokens, "Draft tokens verified."),
                ("vllm:spec_decode_num_accepted_tokens_total", self.accepted_tokens, "Draft tokens accepted."),
                ("vllm:prompt_tokens_total", self.prompt_tokens, "Prompt tokens processed."),
                ("vllm:generation_tokens_total", self.generation_tokens, "Tokens generated."),
            ]:
                metric(name, "counter", help_, [f"{name}{_labels(**m)} {value}"])
            name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            metric(name, "counter", "Steps whose draft was accepted at least up to this position (0-based).",
                   [f"{name}{_labels(**m, position=j)} {n}" for j, n in enumerate(self.accepted_per_pos)])
            name = "vllm:request_success_total"
            metric(name, "counter", "Finished requests by finish reason.",
                   [f"{name}{_labels(**m, finished_reason=r)} {n}" for r, n in sorted(self.success.items())])
            name = "treeflash:request_errors_total"
            metric(name, "counter", "Requests answered with an HTTP error, by status.",
                   [f"{name}{_labels(**m, status=s)} {n}" for s, n in sorted(self.errors.items())])
            for name, hist, help_ in [
                ("vllm:e2e_request_latency_seconds", self.e2e, "Time from arrival to last token."),
                ("vllm:time_to_first_token_seconds", self.ttft, "Time from arrival to first token."),
                ("vllm:request_queue_time_seconds", self.queue_time, "Time spent waiting for the worker."),
            ]:
                metric(name, "histogram", help_, hist.lines(name, m))
        return "\n".join(lines) + "\n"
