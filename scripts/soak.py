"""`make soak`: a `treeflash serve --max-batch 8` process under 16 streaming clients with random
disconnects, watching its memory.

The server (fp32, greedy, `--tree-size auto` by default) runs in its own process. After a
warm-up round (one request per prompt), its resident memory (VmRSS) is the idle level. Then
`--rounds` rounds of 16 clients x 3 requests each; about a third of the streams are closed after
a random number of chunks. During the rounds `/health` is polled every 0.2 s. After each round,
once the batch is empty, RSS is read again. Every completed answer must equal the same request
decoded alone (the bs=1 engine in this process, fp32 greedy); every disconnected one must be a
prefix of it. Writes `--out`/soak.json; exits non-zero when any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from treeflash.cli import add_target_arg
from treeflash.config import tree_size_arg

PROMPTS = ("Explain what a hash table is.", "Write a short poem about the sea.",
           "List five uses of a paperclip.", "How do vaccines work?",
           "What is the difference between a list and a tuple in Python?", "Give three tips for better sleep.")
LENGTHS = (16, 48, 96)


def rss_mb(pid: int) -> float:
    """Resident memory of a process (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def stream(url: str, prompt: str, n: int, leave_after: int | None) -> tuple[str, str]:
    """(finish: stop / length / left / an error, text) of one streaming chat request."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0, "stream": True}
    text, finish, chunks = "", None, 0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}", r.read().decode()[:200]
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return "left", text  # closing the stream disconnects
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}", text
    return finish or "none", text


def wait_idle(url: str, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        h = httpx.get(url + "/health", timeout=10).json()
        if h.get("running", 0) == 0 and h.get("waiting", 0) == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("the batch did not empty")


def one_round(url: str, rng: random.Random, clients: int, requests: int) -> tuple[list, list]:
    plan = [[(rng.choice(PROMPTS), rng.choice(LENGTHS), rng.randrange(1, 8) if rng.random() < 0.35 else None)
             for _ in range(requests)] for _ in range(clients)]
    got, healths, stop = [], [], threading.Event()

    def client(reqs):
        for prompt, n, leave in reqs:
            got.append((prompt, n, *stream(url, prompt, n, leave)))

    def poll():
        while not stop.is_set():
            try:
                healths.append(httpx.get(url + "/health", timeout=10).status_code)
            except httpx.HTTPError as e:
                healths.append(repr(e))
            time.sleep(0.2)

    poller = threading.Thread(target=poll)
    poller.start()
    threads = [threading.Thread(target=client, args=(reqs,)) for reqs in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    poller.join()
    return got, healths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arg(ap, "the server's target")
    ap.add_argument("--backend", default="static")
    ap.add_argument("--tree-size", type=tree_size_arg, default="auto", help="the server's tree size (default: auto)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--port", type=int, default=8013)
    ap.add_argument("--out", default="bench-out/soak")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "treeflash", "serve", "--target", args.target, "--dtype", "float32", "--port",
           str(args.port), "--max-batch", "8", "--max-queue", "32", "--prefill-chunk", "16", "--backend",
           args.backend, "--tree-size", str(args.tree_size), "--max-tokens-limit", "256"]
    log = open(out / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(1800):
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited; see {out / 'server.log'}")
            time.sleep(1)
        from treeflash.api import load

        engine = load(args.target, dtype="float32", quiet=True)
        solo = {(p, n): engine.generate([{"role": "user", "content": p}], method="vanilla", max_new_tokens=n).text
                for p in PROMPTS for n in LENGTHS}
        for p in PROMPTS:  # warm-up: every prompt once, then the idle level
            stream(url, p, 16, None)
        wait_idle(url)
        time.sleep(2)
        report = {"command": " ".join(cmd), "idle_rss_mb": rss_mb(server.pid), "rounds": []}
        print(f"idle RSS {report['idle_rss_mb']:.0f} MiB", flush=True)
        ok = True
        rng = random.Random(0)
        for i in range(args.rounds):
            t0 = time.time()
            got, healths = one_round(url, rng, args.clients, 3)
            wait_idle(url)
            time.sleep(2)
            done = [g for g in got if g[2] in ("stop", "length")]
            left = [g for g in got if g[2] == "left"]
            bad = [g[:3] for g in got if g not in done and g not in left]
            wrong = [g[:2] for g in done if g[3] != solo[g[:2]]] + [g[:2] for g in left if not solo[g[:2]].startswith(g[3])]
            r = {"requests": len(got), "completed": len(done), "disconnected": len(left), "failed": bad,
                 "not_as_solo": wrong, "health_non_200": sum(h != 200 for h in healths), "health_polls": len(healths),
                 "rss_mb": rss_mb(server.pid), "seconds": round(time.time() - t0, 1)}
            report["rounds"].append(r)
            ok &= not bad and not wrong and r["health_non_200"] == 0 and len(got) == 3 * args.clients
            print(f"round {i + 1}: {r['completed']} completed, {r['disconnected']} disconnected, {len(bad)} failed, "
                  f"{len(wrong)} differ from solo, /health non-200 {r['health_non_200']} of {r['health_polls']}, "
                  f"RSS {r['rss_mb']:.0f} MiB ({r['seconds']} s)", flush=True)
        report["ok"] = ok
        (out / "soak.json").write_text(json.dumps(report, indent=1))
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
