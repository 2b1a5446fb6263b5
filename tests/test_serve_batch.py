"""`treeflash serve --max-batch N`: continuous batching in the server (serve/worker.py), the
load-adaptive tree budget (costmodel.adaptive_budget) and the decoder's per-step budget hook.

The app runs in this process (uvicorn on a thread, as test_serve.py's `held_server`) over the tiny
random Llama of test_serve.py on the static backend; `hold` pauses the worker before a decode step
(after newcomers' prefills) until it is cleared or every running request's client has left, so
queueing and disconnects are tested whatever the machine's speed. Greedy answers must equal what
the same model answers to each request alone (fp32).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from treeflash.decoding import costmodel

from conftest import tiny_target, vanilla

ACCEPT = [0.9, 0.7, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05] + [0.01] * 56


# ---------------------------------------------------------------- the adaptive budget (pure)
def convex(a: float = 1.0, c: float = 0.002):
    """A forward that costs about the same up to some rows, then more and more (convex)."""
    return {0: 0.0, **{n: a + c * n * n for n in costmodel.SIZES}}


@pytest.mark.parametrize("draft", [0.05, costmodel.draft_cost(0.05, 0.2, 7)])
def test_adaptive_budget_is_the_bs1_best_at_batch_1(draft):
    for costs in (convex(), convex(1.0, 0.0005), {0: 0.1, 1: 1.0, 4: 1.2, 8: 2.0, 64: 10.0}):
        best, _ = costmodel.best_budget(costs, ACCEPT, draft, range(2, 65))
        assert best > 1
        assert costmodel.adaptive_budget(costs, ACCEPT, draft, 1, 64) == best


def test_adaptive_budget_shrinks_as_the_batch_fills():
    costs = convex()
    budgets = [costmodel.adaptive_budget(costs, ACCEPT, 0.05, b, 64) for b in range(1, 33)]
    assert all(x >= y for x, y in zip(budgets, budgets[1:])), budgets
    assert budgets[0] > 4 and budgets[-1] == 1, budgets  # full batch: plain decoding
    assert costmodel.adaptive_budget(costs, ACCEPT, 0.05, 4, 3) <= 3  # never above the reservation


def _tune(tuner, n, predicted, rate_of, steps):
    """Drive a BudgetTuner for `steps` steps where budget b yields rate_of[b] tokens/s."""
    chosen = []
    for _ in range(steps):
        b = tuner.choose(n, predicted)
        tuner.record(n, b, int(rate_of[b]), 1.0)
        chosen.append(b)
    return chosen


def test_budget_tuner_keeps_plain_decoding_when_the_models_choice_measures_slower():
    from treeflash.serve.budget_tuner import MIN_STEPS, BudgetTuner, candidates

    assert candidates(6) == (1, 3, 6) and candidates(2) == (1, 2) and candidates(1) == (1,)
    tuner = BudgetTuner()
    chosen = _tune(tuner, 8, 6, {1: 70, 3: 60, 6: 45}, 40)
    assert sorted(set(chosen[:3 * MIN_STEPS])) == [1, 3, 6]      # every candidate measured first
    assert chosen[3 * MIN_STEPS:].count(1) == len(chosen) - 3 * MIN_STEPS and tuner.best(8) == 1
    # where the model was right, its choice wins
    tuner = BudgetTuner()
    assert _tune(tuner, 4, 6, {1: 40, 3: 50, 6: 65}, 40)[-1] == 6 and tuner.best(4) == 6


def test_budget_tuner_passes_batch_one_and_plain_through_and_explores_again():
    from treeflash.serve.budget_tuner import EXPLORE_EVERY, BudgetTuner

    tuner = BudgetTuner()
    assert tuner.choose(1, 8) == 8 and tuner.choose(5, 1) == 1 and tuner.best(1) is None
    chosen = _tune(tuner, 3, 4, {1: 30, 2: 50, 4: 40}, 3 * EXPLORE_EVERY)
    late = chosen[EXPLORE_EVERY:]
    assert late.count(2) < len(late) and {1, 4} & set(late)  # the others are measured again now and then
    # rates that change are followed: plain decoding becomes the fastest
    _tune(tuner, 3, 4, {1: 90, 2: 50, 4: 40}, 6 * EXPLORE_EVERY)
    assert tuner.best(3) == 1
    # a new prediction at this batch size starts its candidates afresh
    assert tuner.choose(3, 8) in (1, 4, 8) and tuner.levels[3].options == (1, 4, 8)


def test_adaptive_budget_is_plain_when_verify_cost_is_linear_in_rows():
    linear = {0: 0.0, **{n: 0.5 * n for n in costmodel.SIZES}}
    for b in (1, 2, 8, 16):
        assert costmodel.adaptive_budget(linear, ACCEPT, 0.0, b, 64) == 1


def test_rows_cost_extrapolates_past_the_largest_size():
    costs = {1: 1.0, 32: 2.0, 64: 3.0}
    assert costmodel.rows_cost(costs, 48) == pytest.approx(2.5)
    assert costmodel.rows_cost(costs, 128) == pytest.approx(5.0)


def test_batch_decoder_budget_hook_changes_trees_not_tokens():
    """set_budget each step (1, the max, in between) keeps every sequence's greedy tokens."""
    from treeflash.config import GenerationConfig
    from treeflash.decoding.batch import BatchDecoder

    from conftest import tiny_drafter

    target = tiny_target("llama", logit_scale=3.0).set_backend("static")
    drafter = tiny_drafter(target, block_size=8)
    prompts = [list(range(3, 12)), list(range(40, 49, 2)), [7, 8, 9, 7, 8, 9, 7]]
    dec = BatchDecoder(target, drafter)
    cfg = GenerationConfig(method="treeflash", tree_size=8, top_m=2, top_k=2, max_new_tokens=20)
    ids = [dec.add(p, cfg, stop_ids=set()) for p in prompts]
    got = {i: [] for i in ids}
    sizes, step = [], 0
    while dec.busy:
        for i in list(dec.running):
            assert dec.set_budget(i, [1, 8, 3, 99][step % 4]) == min(8, [1, 8, 3, 99][step % 4])
        sizes.append({i: s.proposer.params.budget for i, s in dec.running.items()})
        for i, toks in dec.step().items():
            got[i] += toks
        step += 1
    for i, p in zip(ids, prompts):
        assert got[i] == vanilla(target, p, 20)
    trees = [n for i in ids for n in dec.finished[i].stats.tree_sizes]
    assert 1 in trees and max(trees) > 1, trees  # budget 1 verified the root alone; larger ones more


# ---------------------------------------------------------------- the server
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import (API_KEY, build_tiny_model, child_env, free_port, fuzz_openapi, in_process, metric,  # noqa: E402
                        post, user, wait_until)

MAX_BATCH = 4
MAX_QUEUE = 2
LIMIT = 48
GEN = dict(method="treeflash", tree_size=8, top_m=2, top_k=2)
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.",
           "Explain recursion briefly.", "Say hello in Spanish.", "Name a colour."]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("serve-batch-model"))


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The same model in its own engine: what each request answers alone (bs=1 decode loop)."""
    from treeflash.api import Engine
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target

    target_dir, drafter_dir = model_dirs
    return Engine(Target.load(str(target_dir)), load_drafter(drafter_dir), backend="static")


def alone(reference, prompt, n, **kw):
    return reference.generate(user(prompt), max_new_tokens=n, **{"temperature": 0.0, **GEN, **kw})


@pytest.fixture(scope="module")
def batch_server(model_dirs):
    """The app with --max-batch 4 --max-queue 2 --prefill-chunk 5 in this process (every prompt is
    prefilled over several steps, between the running requests' steps); `.hold` pauses decode steps."""
    from treeflash.api import Engine
    from treeflash.config import GenerationConfig
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target
    from treeflash.serve.app import create_app
    from treeflash.serve.jobs import ServeConfig

    target_dir, drafter_dir = model_dirs
    engine = Engine(Target.load(str(target_dir)), load_drafter(drafter_dir), backend="static")
    gen = GenerationConfig(**GEN, max_new_tokens=12)
    app = create_app(engine, ServeConfig(model_name="tiny", generation=gen, max_tokens_limit=LIMIT, api_key=API_KEY,
                                         max_queue=MAX_QUEUE, max_batch=MAX_BATCH, prefill_chunk=5))
    worker, hold, holding = app.state.worker, threading.Event(), threading.Event()
    step = worker.decoder.step

    def held_step():
        """While held: wait before a decode step until released or every running client left."""
        dec = worker.decoder

        def decoding():  # prompts still being prefilled are not held
            return any(not s.prefilling for s in dec.running.values())

        while hold.is_set() and decoding() and not all(a.job.cancelled.is_set() for a in worker.active.values()):
            holding.set()  # the worker waits here: what is submitted now stays queued
            time.sleep(0.01)
        holding.clear()
        if hold.is_set() and decoding():
            return {}  # released by the clients leaving: the worker drops them before the next step
        return step()

    worker.decoder.step = held_step
    try:
        with in_process(app) as url:
            yield types.SimpleNamespace(url=url, hold=hold, holding=holding, worker=worker)
    finally:
        hold.clear()


def health(server) -> dict:
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(server, prompt: str, n: int, out: dict, key=None, **kw) -> None:
    """One streaming client: out[key or prompt] = (text, finish reason) or the error."""
    body = {"model": "tiny", "messages": user(prompt), "max_tokens": n, "temperature": 0, "stream": True, **kw}
    try:
        text, finish = "", None
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                out[key or prompt] = ("HTTP", r.status_code)
                return
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    choice = chunk["choices"][0]
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
        out[key or prompt] = (text, finish)
    except Exception as e:  # noqa: BLE001  (the test reports it)
        out[key or prompt] = ("ERROR", repr(e))


def test_concurrent_staggered_streams_get_their_alone_answers(batch_server, reference):
    """A is held after its prefill while three more arrive; they join A's batch together, a fifth
    and sixth arrive later; lengths differ. /health answers 200 all along."""
    server = batch_server
    lengths = [LIMIT, 9, 30, 17, 24, 5]
    want = {p: alone(reference, p, n) for p, n in zip(PROMPTS, lengths)}
    assert len({w.text for w in want.values()}) == len(PROMPTS), "prompts should give distinct answers"
    got, healths, stop = {}, [], threading.Event()

    def poll_health():
        while not stop.is_set():
            healths.append(httpx.get(server.url + "/health", timeout=10).status_code)
            time.sleep(0.05)

    threads = [threading.Thread(target=poll_health)]
    threads[0].start()
    server.worker.peak = 0
    server.hold.set()
    try:
        clients = [threading.Thread(target=stream_chat, args=(server, p, n, got)) for p, n in zip(PROMPTS, lengths)]
        clients[0].start()
        wait_until(lambda: health(server)["running"] == 1, "A to run")
        wait_until(server.holding.is_set, "A's prefill to end and the worker to hold")
        for t in clients[1:3]:
            t.start()
        wait_until(lambda: health(server)["waiting"] == 2, "B and C to queue")
        assert metric(server, "vllm:num_requests_running") == 1
        assert metric(server, "vllm:num_requests_waiting") == 2
    finally:
        server.hold.clear()
    # later arrivals, each once the queue is empty again, so at most two ever wait (--max-queue 2)
    # however slow a step is on this machine
    for t in clients[3:]:
        wait_until(lambda: health(server)["waiting"] == 0, "the queue to empty")
        t.start()
        time.sleep(0.2)
    for t in clients:
        t.join(timeout=300)
    stop.set()
    threads[0].join(timeout=30)
    assert server.worker.peak >= 3, "the requests should have been decoded together"
    for p, w in want.items():
        assert got[p] == (w.text, "stop" if w.stats.finish_reason == "stop" else "length"), p
    assert healths and set(healths) == {200}
    wait_until(lambda: health(server)["running"] == 0, "the batch to empty")
    assert server.worker.decoder.cache.reserved_slots == 0


def test_stop_string_and_seed_in_a_batch(batch_server, reference):
    server = batch_server
    full = alone(reference, PROMPTS[3], 20).text
    stop = full[6:9]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    sampled = alone(reference, PROMPTS[4], 16, temperature=1.0, top_p=0.9, seed=1234).text
    got = {}
    threads = [threading.Thread(target=stream_chat, args=(server, PROMPTS[3], 20, got), kwargs={"stop": [stop]}),
               threading.Thread(target=stream_chat, args=(server, PROMPTS[4], 16, got),
                                kwargs={"temperature": 1.0, "top_p": 0.9, "seed": 1234}),
               threading.Thread(target=stream_chat, args=(server, PROMPTS[0], LIMIT, got))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got[PROMPTS[3]] == (full[:full.index(stop)], "stop")
    assert got[PROMPTS[4]][0] == sampled
    assert got[PROMPTS[0]][0] == alone(reference, PROMPTS[0], LIMIT).text


def test_disconnect_frees_its_slot_and_a_full_queue_is_429(batch_server):
    """A streams, is held after its first text, B queues behind the held step, C finds the queue
    full (429); A's client leaves: its slot is freed (running 0, pool empty), B still completes."""
    server = batch_server
    worker = server.worker
    aborts = metric(server, "vllm:request_success_total", finished_reason="abort")
    got = {}
    body = {"model": "tiny", "messages": user(PROMPTS[0]), "max_tokens": LIMIT, "stream": True}
    server.hold.set()
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept open: closing it would close the connection
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"]
            wait_until(lambda: health(server)["running"] == 1, "A to run")
            wait_until(server.holding.is_set, "the worker to hold A")
            assert worker.decoder.cache.reserved_slots > 0
            b = [threading.Thread(target=stream_chat, args=(server, PROMPTS[1], 6, got, f"B{i}")) for i in range(2)]
            for t in b:
                t.start()
            wait_until(lambda: health(server)["waiting"] == MAX_QUEUE, "B to queue")
            c = post(server, "/v1/chat/completions", {"messages": user("C"), "max_tokens": 2})
            assert c.status_code == 429 and c.json()["error"]["code"] == "server_busy"
            assert metric(server, "treeflash:request_errors_total", status=429) >= 1
        # A's client has left; the held step lets the worker drop it
        wait_until(lambda: metric(server, "vllm:request_success_total", finished_reason="abort") > aborts,
                   "A's abort", timeout=30)
    finally:
        server.hold.clear()
    for t in b:
        t.join(timeout=300)
    assert got["B0"][1] in ("stop", "length") and got["B0"] == got["B1"], got
    wait_until(lambda: health(server)["running"] == 0 and health(server)["waiting"] == 0, "the batch to empty")
    assert worker.decoder.cache.reserved_slots == 0
    assert metric(server, "vllm:num_requests_running") == 0


def test_metrics_show_the_batch_gauges(batch_server):
    got = {}
    stream_chat(batch_server, PROMPTS[5], 3, got)  # at least one generation, whatever ran before
    assert got[PROMPTS[5]][1] in ("stop", "length"), got
    text = httpx.get(batch_server.url + "/metrics", timeout=10).text
    assert "# TYPE vllm:num_requests_running gauge" in text and "# TYPE vllm:num_requests_waiting gauge" in text
    assert metric(batch_server, "vllm:generation_tokens_total") > 0


def test_adaptive_budgets_follow_the_batch_size(model_dirs, reference):
    """--tree-size auto in batch mode: a cost table where big batches do not pay for trees makes
    the worker verify roots alone at batch 4, and keeps the bs=1 budget alone; answers are unchanged."""
    from treeflash.api import AutoChoice, Engine
    from treeflash.config import GenerationConfig
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target
    from treeflash.serve.worker import Worker
    from treeflash.serve.metrics import Metrics
    from treeflash.serve.jobs import Job, ServeConfig

    target_dir, drafter_dir = model_dirs
    engine = Engine(Target.load(str(target_dir)), load_drafter(drafter_dir), backend="static")
    costs = {0: 0.0, **{n: 1.0 + 0.5 * max(0, n - 8) for n in costmodel.SIZES}}  # flat to 8 rows, then steep
    b1 = costmodel.adaptive_budget(costs, ACCEPT, 0.3, 1, 8)
    assert b1 == 8 and costmodel.adaptive_budget(costs, ACCEPT, 0.3, 2, 8) == 4
    assert costmodel.adaptive_budget(costs, ACCEPT, 0.3, 4, 8) == 1
    choice = AutoChoice("treeflash", b1, 1.0, 2.0, 0.3, costs, ACCEPT, ())
    gen = GenerationConfig(**{**GEN, "tree_size": b1}, max_new_tokens=12)
    cfg = ServeConfig(model_name="tiny", generation=gen, max_tokens_limit=LIMIT, max_batch=4, auto_budget=choice)
    metrics = Metrics("tiny")
    worker = Worker(engine, cfg, metrics)
    seen = []
    step = worker.decoder.step

    def spy():
        seen.append({s.proposer.params.budget for s in worker.decoder.running.values()})
        return step()

    worker.decoder.step = spy

    async def run(prompts):
        import asyncio

        jobs = [Job(prompt=user(p), chat=True, param="messages", config=gen.replace(max_new_tokens=10),
                    loop=asyncio.get_running_loop()) for p in prompts]
        for j in jobs:
            worker.submit(j)
        texts = []
        for j in jobs:
            parts = []
            while True:
                kind, value = await asyncio.wait_for(j.events.get(), 120)
                if kind != "text":
                    break
                parts.append(value)
            assert kind == "done", value
            texts.append("".join(parts))
        return texts

    import asyncio

    worker.start()
    try:
        texts = asyncio.run(run(PROMPTS[:4]))
        alone_one = asyncio.run(run(PROMPTS[:1]))
    finally:
        worker.stop()
    assert texts == [alone(reference, p, 10).text for p in PROMPTS[:4]]
    assert alone_one == texts[:1]
    assert {1} in seen, seen                  # a full batch verified roots alone
    assert seen[-1] == {b1}, seen            # alone: the bs=1 budget
    assert "treeflash:tree_budget" in metrics.render()


def test_max_batch_1_is_a_batch_of_one(model_dirs, reference):
    """--max-batch 1 on the static backend decodes through `BatchDecoder` with a pool for one
    request: concurrent clients are served one at a time, and each greedy answer has the tokens of
    the engine's bs=1 loop and of plain decoding (fp32)."""
    from treeflash.api import Engine
    from treeflash.config import GenerationConfig
    from treeflash.decoding.batch import BatchDecoder
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target
    from treeflash.serve.app import create_app
    from treeflash.serve.jobs import ServeConfig
    from treeflash.serve.worker import pool_slots

    target_dir, drafter_dir = model_dirs
    engine = Engine(Target.load(str(target_dir)), load_drafter(drafter_dir), backend="static")
    cfg = ServeConfig(model_name="tiny", generation=GenerationConfig(**GEN, max_new_tokens=12), max_tokens_limit=LIMIT,
                      api_key=API_KEY)
    app = create_app(engine, cfg)
    worker = app.state.worker
    assert isinstance(worker.decoder, BatchDecoder)
    assert worker.decoder.cache.capacity == pool_slots(engine.target.max_length, cfg, worker.rows)
    lengths, got = [LIMIT, 9, 30], {}

    def ask(server, prompt: str, n: int) -> None:
        got[prompt] = post(server, "/v1/chat/completions", {"messages": user(prompt), "max_tokens": n,
                                                             "temperature": 0}).json()

    with in_process(app) as url:
        server = types.SimpleNamespace(url=url)
        threads = [threading.Thread(target=ask, args=(server, p, n)) for p, n in zip(PROMPTS, lengths)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert worker.peak == 1
    for p, n in zip(PROMPTS, lengths):
        want, plain = alone(reference, p, n), alone(reference, p, n, method="vanilla")
        assert plain.token_ids == want.token_ids, p
        assert got[p]["choices"][0]["message"]["content"] == want.text, p
        assert got[p]["usage"]["completion_tokens"] == len(want.token_ids), p


def test_max_batch_needs_the_static_backend(model_dirs):
    target_dir, drafter_dir = model_dirs
    out = subprocess.run([sys.executable, "-m", "treeflash.cli", "serve", "--target", str(target_dir), "--drafter",
                          str(drafter_dir), "--port", str(free_port()), "--dtype", "float32", "--backend", "hf",
                          "--max-batch", "4"], capture_output=True, text=True, env=child_env(), timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: --max-batch 4 needs the static or a compiled backend (Llama / Qwen family); the target runs the "
        "hf backend: use --backend static, compiled or compiled-cpp, or --max-batch 1"]


def test_prefill_chunk_must_be_positive(model_dirs):
    target_dir, drafter_dir = model_dirs
    out = subprocess.run([sys.executable, "-m", "treeflash.cli", "serve", "--target", str(target_dir), "--drafter",
                          str(drafter_dir), "--port", str(free_port()), "--max-batch", "4", "--prefill-chunk", "0"],
                         capture_output=True, text=True, env=child_env(), timeout=300)
    assert out.returncode == 2 and out.stderr.strip() == "error: --prefill-chunk must be >= 1", out.stderr


# ---------------------------------------------------------------- the load bench
def test_load_bench_statistics_from_fake_timings():
    from treeflash.bench.load import Timing, percentile, summarise

    assert percentile([3, 1, 2, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert percentile(list(range(101)), 99) == 99 and percentile([0, 10], 99) == pytest.approx(9.9)
    timings = [Timing(0.0, 0.5, 2.0, 20), Timing(0.0, 1.0, 4.0, 40), Timing(1.0, 1.5, 3.0, 10),
               Timing(0.5, error="HTTP 429: busy")]
    r = summarise(timings, wall_s=5.0, clients=3)
    assert (r["requests"], r["failed"], r["tokens"]) == (4, 1, 70)
    assert r["aggregate_tokens_per_s"] == pytest.approx(14.0)
    assert r["per_request_tokens_per_s"]["mean"] == pytest.approx(25 / 3)  # 20/2, 40/4, 10/2
    assert r["ttft_s"]["p50"] == pytest.approx(0.5) and r["ttft_s"]["mean"] == pytest.approx(2 / 3)
    assert r["latency_s"]["p50"] == pytest.approx(2.0) and r["latency_s"]["p99"] == pytest.approx(3.96)
    assert r["errors"] == ["HTTP 429: busy"]


def test_load_bench_against_the_batch_server(batch_server, tmp_path):
    """`treeflash bench-load` over the in-process server: every request answered, its tokens
    counted from the usage chunk, results.json and the plot written."""
    from treeflash.bench.load import load_test
    from treeflash.cli import main

    r = load_test(batch_server.url, ["Hi there", "Name a fruit."], clients=2, max_tokens=6, api_key=API_KEY,
                  requests_per_client=2)
    assert r["failed"] == 0 and r["requests"] == 4, r["errors"]
    assert all(t["tokens"] >= 1 and t["first"] <= t["end"] for t in r["timings"])
    assert r["aggregate_tokens_per_s"] > 0 and r["ttft_s"]["p99"] >= r["ttft_s"]["p50"]
    assert main(["bench-load", "--url", batch_server.url, "--clients", "1,2", "--max-tokens", "4",
                 "--requests-per-client", "1", "--api-key", API_KEY, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert [lv["clients"] for lv in report["levels"]] == [1, 2]
    assert (tmp_path / "load.png").stat().st_size > 0


def test_soak_sixteen_clients_with_random_disconnects(model_dirs, reference):
    """16 concurrent streaming clients, 3 requests each, about a third of the streams closed after
    a random number of chunks, on --max-batch 8 --max-queue 16 --prefill-chunk 16: no request is lost
    or corrupted (every completed answer equals its solo decode, fp32 greedy; every disconnected one
    is a prefix of it), /health answers 200 all along, and afterwards the pool, the batch and the
    decoder hold nothing (no sequence object survives)."""
    import gc
    import random

    from treeflash.api import Engine
    from treeflash.config import GenerationConfig
    from treeflash.decoding.sequence import Sequence as Seq
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target
    from treeflash.serve.app import create_app
    from treeflash.serve.jobs import ServeConfig

    target_dir, drafter_dir = model_dirs
    engine = Engine(Target.load(str(target_dir)), load_drafter(drafter_dir), backend="static")
    app = create_app(engine, ServeConfig(model_name="tiny", generation=GenerationConfig(**GEN, max_new_tokens=12),
                                         max_tokens_limit=LIMIT, api_key=API_KEY, max_queue=16, max_batch=8,
                                         prefill_chunk=16))
    before = {id(o) for o in gc.get_objects() if type(o) is Seq}  # any left by earlier tests
    rng = random.Random(0)
    plan = [[(PROMPTS[rng.randrange(len(PROMPTS))], rng.choice([6, 14, 24]),
              rng.randrange(1, 4) if rng.random() < 0.35 else None) for _ in range(3)] for _ in range(16)]
    want = {(p, n): alone(reference, p, n).text for reqs in plan for p, n, _ in reqs}
    got: list[tuple] = []
    healths, stop = [], threading.Event()

    def client(reqs, server_url):
        for prompt, n, leave_after in reqs:
            body = {"model": "tiny", "messages": user(prompt), "max_tokens": n, "temperature": 0, "stream": True}
            text, finish, chunks = "", None, 0
            try:
                with httpx.stream("POST", server_url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as r:
                    if r.status_code != 200:
                        got.append((prompt, n, "HTTP", r.status_code))
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["delta"].get("content") or ""
                        finish = choice.get("finish_reason") or finish
                        chunks += 1
                        if leave_after is not None and chunks >= leave_after:
                            break  # closing the stream disconnects
                got.append((prompt, n, "left" if leave_after is not None and finish is None else finish, text))
            except Exception as e:  # noqa: BLE001  (the test reports it)
                got.append((prompt, n, "ERROR", repr(e)))

    with in_process(app) as url:
        def poll_health():
            while not stop.is_set():
                try:
                    healths.append(httpx.get(url + "/health", timeout=10).status_code)
                except Exception as e:  # noqa: BLE001  (a failed poll fails the test below)
                    healths.append(repr(e))
                time.sleep(0.05)

        poller = threading.Thread(target=poll_health)
        poller.start()
        clients = [threading.Thread(target=client, args=(reqs, url)) for reqs in plan]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=600)
        wait_until(lambda: httpx.get(url + "/health", timeout=10).json()["running"] == 0, "the batch to empty")
        stop.set()
        poller.join(timeout=30)
        worker = app.state.worker
        assert worker.peak >= 4, "clients should have shared the batch"
        dec = worker.decoder
        assert not worker.active and not dec.running and not dec.waiting and not dec.finished
        assert dec.cache.reserved_slots == 0 and dec.cache.free_slots == dec.cache.capacity
        gc.collect()
        left_over = [o for o in gc.get_objects() if type(o) is Seq and id(o) not in before]
        assert not left_over, "a finished sequence is still referenced"
    assert len(got) == 48
    assert healths and set(healths) == {200}
    left = [g for g in got if g[2] == "left"]
    done = [g for g in got if g[2] in ("stop", "length")]
    assert len(left) + len(done) == 48, [g for g in got if g not in left and g not in done]
    assert left and done
    for prompt, n, _, text in done:
        assert text == want[(prompt, n)], (prompt, n)
    for prompt, n, _, text in left:
        assert want[(prompt, n)].startswith(text), (prompt, n)


def test_load_bench_reads_the_tree_budget_gauge():
    """bench-load reads the server's own /metrics text (labelled samples)."""
    from treeflash.bench.load import gauge
    from treeflash.serve.metrics import Metrics

    metrics = Metrics("tiny model")
    assert gauge(metrics.render(), "treeflash:tree_budget") is None
    metrics.set_tree_budget(3)
    metrics.load = lambda: (4, 1)
    text = metrics.render()
    assert gauge(text, "treeflash:tree_budget") == 3.0 and gauge(text, "vllm:num_requests_running") == 4.0
    assert gauge("treeflash:tree_budget_x 9\n", "treeflash:tree_budget") is None


def test_load_bench_compare_draws_earlier_runs(tmp_path, capsys):
    """`bench-load --compare NAME=DIR ...`: one table (and plot) of earlier runs; a bad spec or a
    folder without a report is a one-line error."""
    from treeflash.cli import main

    for name, rates in (("plain", [10.0, 30.0]), ("tree", [20.0, 25.0])):
        (tmp_path / name).mkdir()
        levels = [{"clients": c, "aggregate_tokens_per_s": r} for c, r in zip((1, 8), rates)]
        (tmp_path / name / "results.json").write_text(json.dumps({"levels": levels}))
    assert main(["bench-load", "--compare", f"plain={tmp_path / 'plain'}", f"tree={tmp_path / 'tree'}",
                 "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "table.md").read_text().splitlines()
    assert table[0] == "| clients | 1 | 8 |" and table[2] == "| plain | 10.0 | 30.0 |" and table[3] == "| tree | 20.0 | 25.0 |"
    for bad in (["plain"], [f"x={tmp_path / 'missing'}"]):
        assert main(["bench-load", "--compare", *bad, "--out", str(tmp_path / "cmp")]) != 0
    err = capsys.readouterr().err
    assert "--compare takes NAME=DIR" in err and "cannot read a bench-load report" in err


def test_a_failing_request_leaves_its_batch_mates_alone(batch_server, reference, monkeypatch):
    """B's sampler raises (a fault of B's alone) while A streams beside it: A's answer is its solo
    answer, B gets a JSON error, the pool is whole, and /health and /metrics agree on idle."""
    import treeflash.decoding.sampling as sampling_mod
    import treeflash.decoding.sequence as sequence_mod

    server = batch_server

    def faulty(choose):
        def wrapped(logits, p, gen):
            if p.top_p == 0.123:
                raise RuntimeError("sampler fault")
            return choose(logits, p, gen)
        return wrapped

    monkeypatch.setattr(sequence_mod, "choose", faulty(sequence_mod.choose))
    monkeypatch.setattr(sampling_mod, "choose", faulty(sampling_mod.choose))
    got = {}
    a = threading.Thread(target=stream_chat, args=(server, PROMPTS[0], LIMIT, got))
    a.start()
    wait_until(lambda: health(server)["running"] == 1, "A to run")
    b = post(server, "/v1/chat/completions", {"messages": user(PROMPTS[1]), "max_tokens": 8,
                                              "temperature": 1.0, "top_p": 0.123})
    assert b.status_code == 500 and "internal error" in b.json()["error"]["message"]
    a.join(timeout=300)
    assert got[PROMPTS[0]][0] == alone(reference, PROMPTS[0], LIMIT).text
    wait_until(lambda: health(server)["running"] == 0 and health(server)["waiting"] == 0, "idle")
    assert metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:num_requests_waiting") == 0
    assert server.worker.decoder.cache.reserved_slots == 0


def test_gauges_follow_queued_clients_that_give_up(batch_server):
    """Clients queued behind a held batch leave: waiting drops to 0 on /health and /metrics alike
    while the worker is still held (the gauges are read live, not pushed by the worker)."""
    server = batch_server
    server.hold.set()
    try:
        got = {}
        a = threading.Thread(target=stream_chat, args=(server, PROMPTS[0], LIMIT, got))
        a.start()
        wait_until(server.holding.is_set, "the worker to hold A")
        body = {"model": "tiny", "messages": user(PROMPTS[2]), "max_tokens": 4}

        def gives_up():  # no answer within 4 s: the client hangs up
            try:
                httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=4),
                           headers={"Authorization": f"Bearer {API_KEY}"})
            except httpx.TimeoutException:
                pass

        b = threading.Thread(target=gives_up)
        b.start()
        wait_until(lambda: health(server)["waiting"] == 1, "B to queue")
        assert metric(server, "vllm:num_requests_waiting") == 1
        b.join(timeout=60)
        wait_until(lambda: health(server)["waiting"] == 0, "B's give-up to show")
        assert metric(server, "vllm:num_requests_waiting") == 0 and server.holding.is_set()
    finally:
        server.hold.clear()
    a.join(timeout=300)
    wait_until(lambda: health(server)["running"] == 0, "idle")
    assert metric(server, "vllm:num_requests_running") == 0


def test_a_fault_in_one_requests_text_ends_it_alone(batch_server, reference, monkeypatch):
    """B's text assembler raises on its first token (a fault in its stop-string handling): B gets
    a JSON 500, A beside it keeps its solo answer, and the pool is whole again."""
    server = batch_server
    engine = server.worker.engine
    make = engine.assembler

    class Faulty:
        def feed(self, _tok):
            raise RuntimeError("text fault")

    monkeypatch.setattr(engine, "assembler", lambda cfg: Faulty() if cfg.stop == ("BOOM",) else make(cfg))
    got = {}
    a = threading.Thread(target=stream_chat, args=(server, PROMPTS[3], LIMIT, got))
    a.start()
    wait_until(lambda: health(server)["running"] == 1, "A to run")
    b = post(server, "/v1/chat/completions", {"messages": user(PROMPTS[1]), "max_tokens": 8, "stop": ["BOOM"]})
    assert b.status_code == 500 and "internal error" in b.json()["error"]["message"]
    a.join(timeout=300)
    assert got[PROMPTS[3]][0] == alone(reference, PROMPTS[3], LIMIT).text
    wait_until(lambda: health(server)["running"] == 0, "idle")
    assert server.worker.decoder.cache.reserved_slots == 0


def test_fuzzing_beside_streams_leaves_them_unharmed(batch_server, reference):
    """Schemathesis fuzzes every route while greedy streams run, one after another, for the whole
    fuzz run: no 5xx, and every stream's text is its solo answer."""
    server, done, streams = batch_server, threading.Event(), []
    solo = alone(reference, PROMPTS[3], LIMIT).text

    def keep_streaming():
        while not done.is_set():
            got = {}
            stream_chat(server, PROMPTS[3], LIMIT, got)
            streams.append(got[PROMPTS[3]])

    t = threading.Thread(target=keep_streaming)
    t.start()
    try:
        wait_until(lambda: health(server)["running"] >= 1 or streams, "a stream to run")
        fuzz_openapi(server.url, seconds=60)
    finally:
        done.set()
        t.join(timeout=300)
    assert streams and all(s == (solo, s[1]) and s[1] in ("stop", "length") for s in streams), streams[:3]
    wait_until(lambda: health(server)["running"] == 0 and health(server)["waiting"] == 0, "idle")
    assert server.worker.decoder.cache.reserved_slots == 0


def test_lookup_only_steps_in_a_served_batch(model_dirs, reference, monkeypatch):
    """--tree-size auto with a lookup method whose calibrated budget is 1 (the default server, one
    request at a time): the worker keeps "auto", reserves a lookup-only tree's rows per request, and
    its requests' steps verify such trees where the text repeats; each greedy answer is still what
    plain decoding answers alone."""
    import asyncio

    from treeflash.api import AutoChoice, Engine
    from treeflash.config import GenerationConfig
    from treeflash.decoding.sequence import Sequence
    from treeflash.decoding.step_budget import LOOKUP_MAX, StepRecord
    from treeflash.models.drafter import load_drafter
    from treeflash.models.target import Target
    from treeflash.serve.jobs import Job, ServeConfig
    from treeflash.serve.metrics import Metrics
    from treeflash.serve.worker import Worker

    target_dir, drafter_dir = model_dirs
    engine = Engine(Target.load(str(target_dir)), load_drafter(drafter_dir), backend="static")
    flat = {0: 0.0, 1: 1.0, 64: 1.0}  # verifying is free: every copy that may be accepted pays
    choice = AutoChoice("treeflash+lookup", 1, 1.0, 1.0, 0.0, flat, [0.1], (0.1, 0.1, 7))
    monkeypatch.setattr(Engine, "auto_tree_size", lambda self, cfg=None, **kw: choice)
    monkeypatch.setattr(StepRecord, "ratios", lambda self, estimate: {})  # the costs above decide, not this machine's
    gen = GenerationConfig(method="treeflash+lookup", tree_size="auto", top_m=2, top_k=2, max_new_tokens=16)
    worker = Worker(engine, ServeConfig(model_name="tiny", generation=gen, max_tokens_limit=LIMIT, max_batch=1),
                    Metrics("tiny"))
    assert worker.budget == 1 and worker.rows == LOOKUP_MAX
    budgets = []
    plan = Sequence.plan
    monkeypatch.setattr(Sequence, "plan", lambda self, alone=True: plan(self, alone) or budgets.append(self.proposer.params.budget))
    prompts = ["one two three one two three one two three one two", "red blue red blue red blue red"]

    async def run():
        jobs = [Job(prompt=user(p), chat=True, param="messages", config=gen, loop=asyncio.get_running_loop())
                for p in prompts]
        for j in jobs:
            worker.submit(j)
        out = []
        for j in jobs:
            parts = []
            while (event := await asyncio.wait_for(j.events.get(), 120))[0] == "text":
                parts.append(event[1])
            assert event[0] == "done", event
            out.append(("".join(parts), event[1]))
        return out

    worker.start()
    try:
        got = asyncio.run(run())
    finally:
        worker.stop()
    for p, (text, done) in zip(prompts, got):
        assert text == reference.generate(user(p), method="vanilla", max_new_tokens=16, temperature=0.0).text
    assert max(budgets) > 1 and 1 in budgets  # lookup-only trees where the text repeated, plain steps elsewhere
