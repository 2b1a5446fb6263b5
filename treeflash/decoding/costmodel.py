"""What a verify forward costs, and which tree size that makes best (`--tree-size auto`).

`measure` times the target's forward for trees of 1..64 nodes after a fixed context (median of a
few runs, after a warm-up that also triggers compilation on the compiled backend) and caches the
result per machine, model, dtype, backend and thread count in ~/.cache/treeflash/costs.json.

`best_budget` picks the budget b that maximises expected tokens per second,
    E[tau(b)] / (t_draft + t_verify(b) + E[tau(b)] * t_head),
where t_verify(b) is the forward, t_head reading one row of its logits (the acceptance walk reads
the rows of the nodes it visits: tau of them; eagerly the LM head runs over each row read, the
compiled forward already ran it over every row), and E[tau(b)] = 1 +
(expected accepted drafts with b-1 best-first nodes), taken from the drafter's measured per-node
acceptance at the largest budget (see `expected_tau`). The cost table stores t_head under key 0.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CACHE_FILE = Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash")) / "costs.json"


COSTS_VERSION = "2"  # bump when the forward paths change, so old measurements are not reused


def _machine(name: str) -> list[str]:
    """The costs' version, this machine, its threads and a model's name: the head of every key."""
    return [COSTS_VERSION, platform.processor() or platform.machine(), str(os.cpu_count()),
            str(torch.get_num_threads()), name]


def machine_key(target, context: int | None = None) -> str:
    """This machine, threads, model, dtype, and (with a context) the backend and that context."""
    parts = [*_machine(target.name), str(target.dtype)]
    return "|".join(parts if context is None else [*parts, target.backend, str(context)])


@torch.no_grad()
def time_forward(target, n: int, context: int, repeats: int = 5) -> float:
    """Median seconds of one n-node tree forward plus the KV compaction (a chain: the mask shape is
    what matters) after `context` cached tokens, without reading its logits; n = 0: reading one
    row of a 1-node forward's logits: the LM head over that row where the forward leaves it to the
    reader, about nothing where the forward ran it over every row (compiled). The first run warms
    up (and compiles)."""
    dev = target.device
    cache = target.new_cache(context + 64)
    V = target.vocab_rows
    target.forward(torch.arange(context, device=dev) % V, torch.arange(context, device=dev), cache)
    size = max(n, 1)
    ids = (torch.arange(size, device=dev) + 7) % V
    pos = context + torch.arange(size, device=dev)
    mask = torch.ones(size, size, dtype=torch.bool, device=dev).tril_()
    none = torch.arange(0, device=dev)

    def forward():
        logits, _ = target.forward(ids, pos, cache, mask)
        cache.compact(context, none)
        return logits

    times = []
    for r in range(repeats + 1):
        logits = None if n else forward()  # untimed: n = 0 times the read only
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if n:
            forward()
        else:
            logits[0]  # the read is what is timed
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(target, sizes=SIZES, context: int = 256, repeats: int = 5, use_cache: bool = True) -> dict[int, float]:
    """{tree size: seconds per forward (without reading its logits), 0: seconds to read one row of
    them}; cached on disk per machine/model/dtype/backend/threads. A window too short for `context`
    cached tokens and the largest tree times them after as many as it holds."""
    sizes = tuple(sorted({0, *sizes}))
    context = max(1, min(context, target.max_length - max(sizes) - 1))
    key = machine_key(target, context)
    saved = _load()
    have = {int(k): v for k, v in saved.get(key, {}).items()}
    if use_cache and all(s in have for s in sizes):
        return {s: have[s] for s in sizes}
    costs = {s: time_forward(target, s, context, repeats) for s in sizes}
    saved[key] = {**{str(k): v for k, v in have.items()}, **{str(k): v for k, v in costs.items()}}
    _save(saved)
    return costs


AUTO_SIZES = (0, 1, 8)  # `auto_backend` scores a backend by a plain step, an 8-node tree and rows read
AUTO_ROWS_READ = 3       # logits rows a step reads (tau): the eager LM head runs over each of them


def step_times(target, backends) -> dict[str, float]:
    """{backend: seconds of a plain step + an 8-node tree + the rows a step reads of their logits},
    the faster of two interleaved rounds."""
    times = {}
    for backend in tuple(backends) * 2:
        target.set_backend(backend)
        costs = measure(target, AUTO_SIZES, use_cache=False)
        t = costs[1] + costs[8] + AUTO_ROWS_READ * costs[0]
        times[backend] = min(t, times.get(backend, t))
    return times


def _said(times: dict[str, float]) -> str:
    return ", ".join(f"{b} {t * 1e3:.1f} ms" for b, t in times.items())


def auto_backend(target) -> str:
    """`--backend auto` for a PyTorch target: static or compiled, whichever runs a plain step plus an
    8-node tree (and the rows a step reads of their logits) faster on this machine; timed once,
    interleaved twice (the compiled steps built first: minutes), and saved per machine, model, dtype
    and threads. hf where the static path does not support the model; static on a
    GPU, with a quantized target, and where compiled steps are not kept on disk (TREEFLASH_AOT=0):
    compiling in every process would cost more than it saves."""
    from ..models import aot
    from ..models.fastpath import supported

    if target.backend == "llama-cpp":  # loaded for it (`models/llama_backend.py`)
        return "llama-cpp"
    if not supported(target.config):
        return "hf"
    if target.device.type != "cpu" or not aot.enabled() or target.quantization != "none":
        return "static"
    key = machine_key(target)
    saved = _load().get("backend", {}).get(key)
    if saved is not None:
        return saved
    print("treeflash: --backend auto: timing the static and compiled backends once on this machine "
          "(the compiled steps are built first: minutes)", file=sys.stderr)
    times = step_times(target, ("static", "compiled"))
    choice = min(times, key=times.get)
    print(f"treeflash: --backend auto chose {choice} (plain step + 8-node tree + rows read: {_said(times)})",
          file=sys.stderr)
    _remember(backend=(key, choice))
    return choice


def auto_llama_cpp(name: str, load_torch, load_gguf) -> bool:
    """`--backend auto` for a target with a GGUF where llama.cpp is built (`api.load` says when):
    whether llama.cpp's kernels on that file run a plain step plus an 8-node tree (and the rows read)
    faster than the PyTorch backend `auto_backend` picks for the same weights; timed once per
    machine, target and threads, and saved. `load_torch()` and `load_gguf()` load either target
    (a `TreeflashError` from them goes to the caller, and nothing is saved)."""
    key = "|".join(_machine(name))
    saved = _load().get("engine", {}).get(key)
    if saved is not None:
        return saved == "llama-cpp"
    print(f"treeflash: --backend auto: timing llama.cpp's kernels on {name}'s GGUF against PyTorch once on this "
          "machine", file=sys.stderr)
    gguf = load_gguf()  # first: a file llama.cpp cannot run costs no PyTorch timing
    times = step_times(gguf, ("llama-cpp",))
    del gguf
    target = load_torch()
    backend = auto_backend(target)
    times.update(step_times(target, (backend,)))
    choice = min(times, key=times.get)
    print(f"treeflash: --backend auto chose {choice} (plain step + 8-node tree + rows read: {_said(times)})",
          file=sys.stderr)
    _remember(engine=(key, choice), engine_times=(key, times))
    return choice == "llama-cpp"


def fingerprint(module) -> str:
    """A short identity of a module's weights (shapes and a few sums), for cache keys."""
    import hashlib

    h = hashlib.sha1()
    for name, t in sorted(module.state_dict().items())[:64]:
        h.update(f"{name}{tuple(t.shape)}{float(t.float().sum()):.6e}".encode())
    return h.hexdigest()[:16]


def saved_choice(key: str) -> dict | None:
    """A `--tree-size auto` calibration saved under `key` (`save_choice`), or None."""
    return _load().get("auto", {}).get(key)


def save_choice(key: str, choice: dict) -> None:
    """Keep a calibration for later processes on this machine (the cost table's file)."""
    _remember(auto=(key, choice))


def _load() -> dict:
    try:
        return json.loads(CACHE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _remember(**entries: tuple[str, object]) -> None:
    """Save each section's (key, value) in the cache file beside what it holds."""
    data = _load()
    for section, (key, value) in entries.items():
        data.setdefault(section, {})[key] = value
    _save(data)


def _save(data: dict) -> None:
    try:
        CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = CACHE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(CACHE_FILE)
    except OSError:
        pass  # a cache, not a result: measuring again next time is fine


def interpolate(costs: dict[int, float], n: int) -> float:
    """Cost of an n-node forward, linear between measured sizes (flat beyond the largest)."""
    xs = sorted(k for k in costs if k > 0)
    if n <= xs[0]:
        return costs[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return costs[a] + (costs[b] - costs[a]) * (n - a) / (b - a)
    return costs[xs[-1]]


def expected_tau(node_accept: list[float], budget: int) -> float:
    """1 + the expected accepted drafts of a best-first tree with `budget` nodes (root included),
    given node_accept[i] = the measured rate at which the i-th best-first non-root node lay on
    the accepted path. Best-first order adds nodes in decreasing path probability, so a smaller
    budget keeps a prefix of that order."""
    return 1.0 + sum(node_accept[:max(0, budget - 1)])


def draft_cost(at_two: float, at_max: float, max_depth: int):
    """Drafting seconds per step as a function of the budget b: the block pass is fixed and the
    heads run over min(b - 1, max_depth) positions, so linear in that depth between the cost
    measured at budget 2 (depth 1) and at a budget reaching max_depth."""
    def cost(b: int) -> float:
        d = min(b - 1, max_depth)
        return at_two + (at_max - at_two) * (d - 1) / max(1, max_depth - 1)
    return cost


def best_budget(costs: dict[int, float], node_accept: list[float], draft_s,
                candidates=range(2, 65), tree_sizes: list[int] | None = None) -> tuple[int, float]:
    """(budget, expected tokens/s) maximising tau(b) / (draft(b) + forward(b) + tau(b) * head);
    draft_s: seconds per step, or a function of the budget (`draft_cost`). tree_sizes: the tree
    sizes measured at the largest candidate budget, where a method's trees can be smaller than the
    budget (lookup branches exist only where the text repeats): a step then verifies min(b, size)
    nodes. None: every step verifies b nodes."""
    head = costs.get(0, 0.0)
    draft = draft_s if callable(draft_s) else (lambda _b: draft_s)

    def forward(b: int) -> float:
        if not tree_sizes:
            return interpolate(costs, b)
        return sum(interpolate(costs, min(b, s)) for s in tree_sizes) / len(tree_sizes)

    best = (1, 1.0 / (interpolate(costs, 1) + head))  # plain decoding: no draft, one head row
    for b in candidates:
        tau = expected_tau(node_accept, b)
        rate = tau / (draft(b) + forward(b) + tau * head)
        if rate > best[1]:
            best = (b, rate)
    return best


def rows_cost(costs: dict[int, float], n: int) -> float:
    """Cost of a forward over n rows in total (a batch's trees together): `interpolate` within the
    measured sizes, and beyond the largest the last measured slope carried on (a batch of B trees
    of b nodes verifies B*b rows, far past the 64 measured; flat there would make them free)."""
    xs = sorted(k for k in costs if k > 0)
    if n <= xs[-1] or len(xs) < 2:
        return interpolate(costs, n)
    a, b = xs[-2], xs[-1]
    return costs[b] + (costs[b] - costs[a]) / (b - a) * (n - b)


def batch_rate(costs: dict[int, float], node_accept: list[float], draft_s, batch_size: int, budget: int) -> float:
    """Expected tokens/s of a batch of `batch_size` sequences, each verifying a tree of `budget`
    nodes per step: B * tau(b) / (B * draft(b) + forward(B * b rows) + B * tau(b) * head).
    draft_s: one sequence's drafting seconds per step (or a function of the budget): the heads and
    the tree search run per sequence. Budget 1 is plain decoding (no drafting)."""
    head, B = costs.get(0, 0.0), batch_size
    draft = 0.0 if budget < 2 else (draft_s(budget) if callable(draft_s) else draft_s)
    tau = expected_tau(node_accept, budget)
    return B * tau / (B * draft + rows_cost(costs, B * budget) + B * tau * head)


def adaptive_budget(costs: dict[int, float], node_accept: list[float], draft_s, batch_size: int,
                    max_budget: int) -> int:
    """The per-sequence tree budget in 1..max_budget that maximises the batch's expected tokens/s
    (`batch_rate`) at this batch size: `best_budget`'s choice at batch 1, shrinking towards 1
    (plain decoding) as the batch's rows make the verify forward dear (serve --max-batch with
    --tree-size auto)."""
    best, best_rate = 1, batch_rate(costs, node_accept, draft_s, max(1, batch_size), 1)
    for b in range(2, max_budget + 1):
        rate = batch_rate(costs, node_accept, draft_s, max(1, batch_size), b)
        if rate > best_rate:
            best, best_rate = b, rate
    return best
