"""`treeflash bench-load`: a running server under N concurrent streaming clients.

Each of N clients sends OpenAI streaming chat requests one after another (`requests_per_client`
each, prompts taken in turn) to a server started separately (`treeflash serve --max-batch N`, or
any OpenAI-compatible server); per request it times the first text (time to first token) and the
end, and reads the completion tokens from the final usage chunk (`stream_options.include_usage`;
counted as text chunks where a server sends no usage). `summarise` turns the timings into
aggregate tokens/s (all tokens over the level's wall time), per-request tokens/s (tokens over
that request's latency), and time to first token / latency: mean, p50 and p99.
`treeflash bench-load --url URL --clients 1,2,4,8,16` runs one level per client count and writes
results.json and load.png (aggregate tokens/s against clients) into --out.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPTS = ("Explain what a hash table is.", "Write a short poem about the sea.",
           "List five uses of a paperclip.", "Summarise the plot of Romeo and Juliet.",
           "How do vaccines work?", "Describe a sunset in three sentences.",
           "What is the difference between a list and a tuple in Python?", "Give three tips for better sleep.")


@dataclass
class Timing:
    """One request: seconds since the level started."""

    start: float
    first: float | None = None   # first text received
    end: float | None = None
    tokens: int = 0
    error: str | None = None


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of xs, linear between the closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs) if xs else math.nan, "p50": percentile(xs, 50), "p99": percentile(xs, 99)}


def summarise(timings: list[Timing], wall_s: float, clients: int) -> dict:
    """The level's report from its requests' timings (failed requests counted, not timed)."""
    ok = [t for t in timings if t.error is None and t.end is not None]
    tokens = sum(t.tokens for t in ok)
    latency = [t.end - t.start for t in ok]
    return {
        "clients": clients, "requests": len(timings), "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "wall_s": wall_s, "tokens": tokens,
        "aggregate_tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
        "per_request_tokens_per_s": _stats([t.tokens / (t.end - t.start) for t in ok if t.end > t.start]),
        "ttft_s": _stats([t.first - t.start for t in ok if t.first is not None]),
        "latency_s": _stats(latency),
    }


async def _request(client, url: str, body: dict, t0: float) -> Timing:
    timing = Timing(time.perf_counter() - t0)
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                timing.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return timing
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return timing
                if chunk.get("usage"):
                    timing.tokens = int(chunk["usage"].get("completion_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if timing.first is None:
                            timing.first = time.perf_counter() - t0
        timing.end = time.perf_counter() - t0
        timing.tokens = timing.tokens or chunks
    except Exception as e:  # noqa: BLE001  (a failed request is reported, the level goes on)
        timing.error = f"{type(e).__name__}: {e}"[:200]
    return timing


def gauge(text: str, name: str) -> float | None:
    """A gauge's first sample in Prometheus text, labels or not (None if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or line.split("{", 1)[0].split(" ", 1)[0] != name:
            continue
        try:
            return float(line.rsplit(None, 1)[1])
        except (IndexError, ValueError):
            return None
    return None


async def _watch_budget(client, base_url: str, seen: dict, done: asyncio.Event) -> None:
    """While a level runs: how often each tree budget (treeflash:tree_budget, --max-batch with
    --tree-size auto) was seen on /metrics, polled every 0.25 s."""
    while not done.is_set():
        try:
            r = await client.get(base_url.rstrip("/") + "/metrics")
            b = gauge(r.text, "treeflash:tree_budget")
            if b is not None:
                seen[int(b)] = seen.get(int(b), 0) + 1
        except Exception:  # noqa: BLE001  (a gauge missed is no failure of the bench)
            pass
        try:
            await asyncio.wait_for(done.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def _level(base_url: str, prompts, clients: int, max_tokens: int, requests_per_client: int,
                 api_key: str | None, model: str | None, temperature: float, timeout: float) -> dict:
    import httpx

    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    timings: list[Timing] = []
    budgets: dict[int, int] = {}
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        done = asyncio.Event()
        watch = asyncio.create_task(_watch_budget(client, base_url, budgets, done))
        t0 = time.perf_counter()

        async def one_client(c: int) -> None:
            for k in range(requests_per_client):
                prompt = prompts[(c + k * clients) % len(prompts)]
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                        "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
                if model:
                    body["model"] = model
                timings.append(await _request(client, url, body, t0))

        await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
        done.set()
        await watch
    seen = {"tree_budgets_seen": dict(sorted(budgets.items()))} if budgets else {}
    return summarise(timings, wall, clients) | seen | {"timings": [asdict(t) for t in timings]}


def load_test(base_url: str, prompts=PROMPTS, clients: int = 1, max_tokens: int = 64, *, requests_per_client: int = 2,
              api_key: str | None = None, model: str | None = None, temperature: float = 0.0,
              timeout: float = 600.0) -> dict:
    """`clients` concurrent streaming clients against the server at base_url -> `summarise`'s report
    (plus every request's timing)."""
    if clients < 1 or requests_per_client < 1 or not prompts:
        raise ValueError("need at least one client, one request per client and one prompt")
    return asyncio.run(_level(base_url, list(prompts), clients, max_tokens, requests_per_client, api_key, model,
                              temperature, timeout))


def plot(levels: list[dict], path: Path) -> bool:
    """One run: aggregate and mean per-request tokens/s against clients."""
    per_request = [{**lv, "aggregate_tokens_per_s": lv["per_request_tokens_per_s"]["mean"]} for lv in levels]
    return plot_arms({"aggregate": levels, "per request (mean)": per_request}, path, "tokens / s")


def plot_arms(arms: dict[str, list[dict]], path: Path, ylabel: str = "aggregate tokens / s") -> bool:
    """One line per arm: aggregate tokens/s against clients (False where matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs: set[int] = set()
    for (name, levels), style in zip(arms.items(), ["o-", "s--", "^-", "v-", "d-", "x-"] * 4):
        x = [lv["clients"] for lv in levels]
        xs.update(x)
        ax.plot(x, [lv["aggregate_tokens_per_s"] for lv in levels], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(xs), [str(x) for x in sorted(xs)])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def arms_table(arms: dict[str, list[dict]]) -> str:
    """A markdown table: one row per arm, aggregate tokens/s per client count."""
    counts = sorted({lv["clients"] for levels in arms.values() for lv in levels})
    lines = ["| clients | " + " | ".join(map(str, counts)) + " |", "|---" * (len(counts) + 1) + "|"]
    for name, levels in arms.items():
        by = {lv["clients"]: lv["aggregate_tokens_per_s"] for lv in levels}
        lines.append(f"| {name} | " + " | ".join(f"{by[c]:.1f}" if c in by else "" for c in counts) + " |")
    return "\n".join(lines)


def compare(specs: list[str], out: Path) -> int:
    """--compare NAME=DIR ...: each DIR's results.json into one plot (load.png) and one table."""
    from ..errors import TreeflashError

    arms = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise TreeflashError(f"--compare takes NAME=DIR, got {spec!r}")
        path = Path(folder) / "results.json"
        try:
            arms[name] = json.loads(path.read_text())["levels"]
            for lv in arms[name]:
                float(lv["clients"]), float(lv["aggregate_tokens_per_s"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TreeflashError(f"cannot read a bench-load report from {path}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    table = arms_table(arms)
    (out / "table.md").write_text(table + "\n")
    print(table)
    plotted = plot_arms(arms, out / "load.png")
    print(f"treeflash: wrote {out / 'table.md'}" + (f" and {out / 'load.png'}" if plotted else ""), file=sys.stderr)
    return 0


def _client_counts(value: str) -> list[int]:
    import argparse

    try:
        counts = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes numbers separated by commas, got {value!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--clients needs counts >= 1, got {value!r}")
    return counts


def register(sub) -> None:
    p = sub.add_parser("bench-load", help="load-test a running server with N concurrent streaming clients",
                       description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=_client_counts, default=[1, 2, 4, 8, 16],
                   help="client counts, one level each (default: 1,2,4,8,16)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends in turn")
    p.add_argument("--prompts", default=None, help="a text file, one prompt a line (default: built-in prompts)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's own)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default="load-bench", help="directory for results.json and load.png")
    p.add_argument("--compare", nargs="+", metavar="NAME=DIR", default=None,
                   help="no load: draw the results.json of earlier runs (one line each) into OUT/load.png "
                        "and print their table (OUT/table.md)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import TreeflashError

    if args.compare:
        return compare(args.compare, Path(args.out))
    if not args.url:
        raise TreeflashError("bench-load needs --url (a running server) or --compare NAME=DIR ...")
    prompts = PROMPTS
    if args.prompts:
        try:
            prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        except OSError as e:
            raise TreeflashError(f"cannot read --prompts {args.prompts}: {e.strerror or e}") from None
        if not prompts:
            raise TreeflashError(f"--prompts {args.prompts} holds no prompt")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = []
    for n in args.clients:
        lv = load_test(args.url, prompts, n, args.max_tokens, requests_per_client=args.requests_per_client,
                       api_key=args.api_key, model=args.model, temperature=args.temperature)
        levels.append(lv)
        print(f"clients {n:3d}: {lv['aggregate_tokens_per_s']:8.1f} tok/s aggregate, "
              f"{lv['per_request_tokens_per_s']['mean']:7.1f} tok/s per request, "
              f"TTFT p50 {lv['ttft_s']['p50']:.3f} s, latency p50 {lv['latency_s']['p50']:.2f} s "
              f"p99 {lv['latency_s']['p99']:.2f} s, {lv['failed']} failed"
              + (f", tree budgets seen {lv['tree_budgets_seen']}" if lv.get("tree_budgets_seen") else ""),
              file=sys.stderr, flush=True)
    report = {"url": args.url, "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
              "levels": levels}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    plotted = plot(levels, out / "load.png")
    print(f"treeflash: wrote {out / 'results.json'}" + (f" and {out / 'load.png'}" if plotted else ""),
          file=sys.stderr)
    return 1 if any(lv["failed"] for lv in levels) else 0
